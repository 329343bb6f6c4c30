"""A real PostgreSQL for election tests: a throw-away cluster on a free loopback port.

``initdb`` (trust authentication, ``--no-sync``) into a temporary folder, ``pg_ctl -w
start`` with ``listen_addresses=127.0.0.1``, the socket in that folder and
``fsync=off``; stopped by the postmaster's PID (SIGINT: fast shutdown) from
``postmaster.pid`` (``/work/shared/docs/infra.md`` §5). Run as root, the server
runs as the ``postgres`` user (``runuser``). A missing server skips, unless
``GPUHEALTH_TEST_SERVERS=required`` (CI), where it fails. Debian package:
``postgresql-15`` (``/usr/lib/postgresql/15/bin``); the client is ``psycopg[binary]``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import free_port, servers_required

STOP_TIMEOUT_SECONDS = 15.0




def _missing(message: str) -> None:
    if servers_required():
        pytest.fail(f"GPUHEALTH_TEST_SERVERS=required but {message}")
    pytest.skip(message)


def need_psycopg() -> None:
    """Skip (fail when required) unless the ``psycopg`` client is installed."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _missing("psycopg not installed (pip install 'psycopg[binary]>=3.1')")


def pg_bindir() -> Path:
    """Return the folder of ``initdb``/``pg_ctl`` (newest Debian version, else PATH)."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                        key=lambda p: int(Path(p).parent.parent.name)
                        if Path(p).parent.parent.name.isdigit() else 0, reverse=True)
    found = candidates[0] if candidates else shutil.which("pg_ctl")
    if not found:
        _missing("PostgreSQL not found (apt-get install postgresql-15)")
    return Path(str(found)).parent




@dataclass
class Postgres:
    """One PostgreSQL cluster; :meth:`stop` then :meth:`start` keeps its data and port."""

    bindir: Path
    folder: Path
    port: int
    run_as: str | None

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    @property
    def data(self) -> Path:
        return self.folder / "data"

    def _run(self, *argv: str) -> None:
        command = list(argv)
        if self.run_as:
            command = ["runuser", "-u", self.run_as, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                check=False, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n"
                               f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}\n"
                               f"{self.log()}")

    def initdb(self) -> None:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "-A", "trust", "--no-sync")

    def start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} "
                   f"-c unix_socket_directories={self.folder} -c fsync=off")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", options,
                  "-l", str(self.folder / "pg.log"), "-w", "-t", "30", "start")

    def pid(self) -> int | None:
        path = self.data / "postmaster.pid"
        try:
            return int(path.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        """Fast shutdown by the postmaster's PID (SIGINT), SIGKILL if it lingers."""
        pid = self.pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def log(self) -> str:
        path = self.folder / "pg.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours would still answer; the postmaster is pg_ctl's child, not ours
    return True


@contextlib.contextmanager
def start_postgres() -> Iterator[Postgres]:
    need_psycopg()
    bindir = pg_bindir()
    run_as: str | None = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            _missing("running as root and no 'postgres' user to run the server as")
        run_as = "postgres"
    with tempfile.TemporaryDirectory(prefix="gpuhealth-pg-") as tmp:
        folder = Path(tmp)
        if run_as:
            entry = pwd.getpwnam(run_as)
            os.chown(folder, entry.pw_uid, entry.pw_gid)
        server = Postgres(bindir=bindir, folder=folder, port=free_port(), run_as=run_as)
        server.initdb()
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """A shared PostgreSQL; tests use distinct election names."""
    with start_postgres() as server:
        yield server
