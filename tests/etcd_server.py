"""A real etcd for election tests, started from the Debian binary on free loopback ports.

One member (``--initial-cluster t1=...``) with its data in a temporary folder, polled
until ``GET /health`` answers ``{"health":"true"}``, stopped by its PID
(``/work/shared/docs/infra.md`` §5). A missing binary skips, unless
``GPUHEALTH_TEST_SERVERS=required`` (CI), where it fails. Debian package:
``etcd-server`` (``/usr/bin/etcd``, 3.4).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import free_port, servers_required

READY_TIMEOUT_SECONDS = 30.0




def etcd_binary() -> str:
    """Return the etcd binary; skip, or fail under ``GPUHEALTH_TEST_SERVERS=required``."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK)
                                     else None)
    if found:
        return found
    message = "etcd not on PATH (apt-get install etcd-server)"
    if servers_required():
        pytest.fail(f"GPUHEALTH_TEST_SERVERS=required but {message}")
    pytest.skip(message)
    raise AssertionError("unreachable")




@dataclass
class Etcd:
    """One etcd member; :meth:`stop` then :meth:`start` keeps its data and ports."""

    binary: str
    folder: Path
    client_port: int
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        client = self.url
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [self.binary, "--name", "t1", "--data-dir", str(self.folder / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"t1={peer}", "--log-level", "warn"]

    def start(self) -> None:
        with (self.folder / "etcd.log").open("ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}:\n{self.log()}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise RuntimeError(f"etcd not healthy after {READY_TIMEOUT_SECONDS} s:\n{self.log()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return False

    def stop(self) -> None:
        """SIGTERM by PID, SIGKILL after 10 s."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def log(self) -> str:
        path = self.folder / "etcd.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@contextlib.contextmanager
def start_etcd() -> Iterator[Etcd]:
    binary = etcd_binary()
    with tempfile.TemporaryDirectory(prefix="gpuhealth-etcd-") as tmp:
        server = Etcd(binary=binary, folder=Path(tmp), client_port=free_port(),
                      peer_port=free_port())
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def etcd() -> Iterator[Etcd]:
    """A shared etcd; tests use distinct election names."""
    with start_etcd() as server:
        yield server
