"""A scheduler adapter that records requests and changes nothing (entry point ``dry_run``)."""

from __future__ import annotations

import logging

from core.errors import PermanentError
from core.records import ActionPhase, ActionRequest, ActionStatus

logger = logging.getLogger(__name__)


class DryRunScheduler:
    """Records every request it is given and reports it done, without touching any node.

    ``submit`` is idempotent on ``idempotency_key``: a second submission returns
    the first one's ref and records nothing new.
    """

    name = "dry_run"

    def __init__(self) -> None:
        self.requests: list[ActionRequest] = []
        self._refs: dict[str, str] = {}

    async def submit(self, request: ActionRequest) -> str:
        """Record ``request`` once; return its ref (``dry-run-<n>``)."""
        ref = self._refs.get(request.idempotency_key)
        if ref is not None:
            return ref
        ref = self._refs[request.idempotency_key] = f"dry-run-{len(self._refs) + 1}"
        self.requests.append(request)
        logger.info(
            "dry run: would %s %s/%s (%s) [%s]",
            request.step.value,
            request.node,
            request.entity,
            request.reason,
            ref,
        )
        return ref

    async def status(self, ref: str) -> ActionStatus:
        """Return ``succeeded`` with message ``"dry run"`` for a ref this adapter gave out.

        Raises:
            PermanentError: ``ref`` was never returned by :meth:`submit`.
        """
        if ref not in self._refs.values():
            raise PermanentError(f"unknown dry-run ref {ref!r}")
        return ActionStatus(ref=ref, phase=ActionPhase.SUCCEEDED, message="dry run")
