"""One long-lived ``httpx.AsyncClient`` per notifier, bound to the event loop that uses it.

A notifier's connections (TLS sessions, keep-alive) are reused from one send to the next
instead of a new client per alert. An ``AsyncClient`` belongs to the loop it first ran
on; the service sends everything from one long-lived loop, so one client serves the
whole run. Code that runs each evaluation on a loop of its own (a replay) gets a client
per loop: the previous one is dropped with its loop, never used across loops.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class LoopClient:
    """An ``httpx.AsyncClient`` made on first use in a loop and kept for that loop.

    Args:
        kwargs: Arguments of ``httpx.AsyncClient`` (``timeout``, ``verify``, ``transport``).
    """

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> httpx.AsyncClient:
        """The client of the running loop (made now if this loop has none)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop or self._client.is_closed:
            self._client = httpx.AsyncClient(**self._kwargs)
            self._loop = loop
        return self._client

    async def aclose(self) -> None:
        """Close the client if it belongs to the running loop; idempotent."""
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.aclose()
