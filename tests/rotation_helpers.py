"""Rotating secrets under load: an agent that keeps sending, a Secret volume, a controller.

Used by ``tests/unit/test_tls_reload.py`` and ``tests/integration/test_rotation.py``.

:class:`KeepSending` queues one ``inventory`` record into a real
:class:`~storage.agent_outbox.AgentOutbox` every ``every`` seconds and sends the outbox
with the real :class:`~storage.agent_outbox.OutboxSender` after each, in a thread; what
a controller did not take stays queued and goes with the next batch, as the agent does.
:meth:`KeepSending.finish` stops it and sends what is left.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gpuhealth.config import load_settings
from gpuhealth.controller import Controller
from storage.agent_outbox import AgentOutbox, OutboxSender
from tests.servers import free_port


class KeepSending:
    """One agent sending a record every ``every`` seconds, in a thread (module docstring)."""

    def __init__(self, url: str, node: str, token: str | Callable[[], str], *,
                 verify: bool | str = True, every: float = 0.05,
                 timeout_seconds: float = 30.0) -> None:
        self.outbox = AgentOutbox(None, node=node, max_records=1_000_000)
        self.sender = OutboxSender(self.outbox, controllers=[url], token=token,
                                   version="test", verify=verify,
                                   timeout_seconds=timeout_seconds)
        self.every = every
        self.keys: list[str] = []
        """Every record queued, in order."""
        self.statuses: collections.Counter[int] = collections.Counter()
        """Answers of the controller, by HTTP status."""
        self.errors: list[str] = []
        """Tries no controller answered (the transport's error)."""
        self.accepted_at: list[float] = []
        """When each batch was taken (monotonic seconds)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keep-sending", daemon=True)

    def start(self) -> KeepSending:
        self._thread.start()
        return self

    def _send(self) -> None:
        result = self.sender.send_once()
        self.statuses.update(result.statuses.values())
        if result.controller is not None:
            self.accepted_at.append(time.monotonic())
        elif not result.statuses:
            self.errors.append(result.error)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.keys.append(self.outbox.put("inventory", {"n": n}, at=time.time()))
            self._send()
            self._stop.wait(self.every)

    def taken_since(self, since: float) -> int:
        """Batches taken after ``since`` (monotonic seconds)."""
        return sum(1 for t in list(self.accepted_at) if t > since)

    def finish(self, timeout: float = 60.0) -> None:
        """Stop queueing and send until the outbox is empty.

        Raises:
            AssertionError: Records are still queued after ``timeout`` seconds.
        """
        self._stop.set()
        self._thread.join(30)
        deadline = time.monotonic() + timeout
        while len(self.outbox) and time.monotonic() < deadline:
            self._send()
            if len(self.outbox):
                time.sleep(0.1)
        assert not len(self.outbox), f"{len(self.outbox)} records never taken: {self.errors[-3:]}"
        self.sender.close()
        self.outbox.close()


class SecretVolume:
    """A folder laid out as kubelet lays out a mounted Secret, updated as kubelet does.

    ``<root>/<name>`` is a symlink to ``..data/<name>``; ``..data`` is a symlink to a
    ``..<timestamp>`` folder holding the files. :meth:`write` makes a new such folder,
    points ``..data_tmp`` at it and renames that over ``..data`` (atomic: a reader sees
    every file old or every file new), then removes the old folder.
    """

    def __init__(self, root: Path, files: dict[str, bytes]) -> None:
        self.root = root
        root.mkdir(parents=True)
        self._n = 0
        self.write(files)
        for name in files:
            (root / name).symlink_to(Path("..data") / name)

    def write(self, files: dict[str, bytes]) -> None:
        self._n += 1
        folder = self.root / f"..2026_12_02_06_00_00.{self._n:09d}"
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
        data_link = self.root / "..data"
        old = os.readlink(data_link) if data_link.is_symlink() else None
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(folder.name)
        os.rename(tmp, data_link)
        if old is not None:
            shutil.rmtree(self.root / old)


@contextlib.contextmanager
def running_controller(tmp_path: Path, tokens_file: Path, extra: str = ""
                       ) -> Iterator[Controller]:
    """A real controller on a free loopback port in a thread (SQLite state unless ``extra``
    sets ``state``), checking its secret files every 0.1 s."""
    config = tmp_path / "ctl.toml"
    config.write_text(f"""
[node]
name = "ctl-a"
data_dir = "{tmp_path / 'ctl'}"
[report]
enabled = false
[analytics]
evaluate_interval_seconds = 0.2
[controller]
port = {free_port()}
agent_tokens_file = "{tokens_file}"
{extra}""")
    settings = load_settings(config, env={})
    settings.node.data_dir.mkdir(parents=True)
    ctl = Controller(settings)
    ctl.secrets_check_seconds = 0.1
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(ctl.serve(stop),))
    thread.start()
    try:
        assert ctl.ready.wait(10)
        yield ctl
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(15)
        loop.close()
