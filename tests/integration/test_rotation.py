"""Rotating secrets while agents keep sending, on a real PostgreSQL and real processes.

A real PostgreSQL (``tests/pg_server.py``) whose ``pg_hba.conf`` asks every role but the
superuser for a SCRAM password over TCP; the real controller
(:class:`gpuhealth.controller.Controller`) keeps its fleet state there, logging in as a
role of its own with ``[controller] state_password_file`` (a Kubernetes-style Secret
volume, :class:`tests.rotation_helpers.SecretVolume`); a real agent outbox and sender
(:class:`tests.rotation_helpers.KeepSending`) posts a record every 50 ms throughout.

The rotation as a DBA and Kubernetes do it: ``ALTER ROLE ... PASSWORD`` first (sessions
already open go on), then every session of the role ends (a database fail-over) before
the Secret is updated, so the controller cannot log in for a while (503: the agent keeps
its records), then kubelet swaps the Secret and the controller logs in with the new
password without a restart. Every record the agent queued is in the state store once.

The last test rotates all three in one run of real ``gpuhealth controller`` and
``gpuhealth agent`` processes (TLS on loopback, the agent verifying it with its
``ca_file``) while faults keep arriving in the agent's kernel log: every fault reaches
the state store, and the controller is the same process throughout.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pg_server import Postgres, start_postgres
from tests.rotation_helpers import KeepSending, SecretVolume, running_controller
from tests.servers import eventually, free_port

TOKEN = "tok-two-0123456789abcdef"
OLD_PASSWORD = "old:pass\\word"  # a colon and a backslash: pgpass escaping
NEW_PASSWORD = "new pass'word"

HBA = """\
local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
"""


@pytest.fixture(scope="module")
def scram_postgres() -> Iterator[Postgres]:
    """A PostgreSQL of its own asking every role but ``postgres`` for a password."""
    with start_postgres() as server:
        (server.data / "pg_hba.conf").write_text(HBA)
        import psycopg

        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
        yield server


def _sessions(admin: Any, role: str) -> set[int]:
    rows = admin.execute("SELECT pid FROM pg_stat_activity WHERE usename = %s",
                         (role,)).fetchall()
    return {int(r[0]) for r in rows}


def test_the_state_password_rotates_while_an_agent_keeps_sending(
        tmp_path: Path, scram_postgres: Postgres, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import psycopg
    from psycopg import sql

    caplog.set_level(logging.INFO, logger="storage.sql")
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-such-pgpass"))  # not ~/.pgpass
    pg = scram_postgres
    role, db = f"gh_rot_{os.getpid()}", f"fleet_rot_{os.getpid()}"
    admin = psycopg.connect(pg.dsn, autocommit=True)
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
        sql.Identifier(role), sql.Literal(OLD_PASSWORD)))
    admin.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
        sql.Identifier(db), sql.Identifier(role)))
    dsn = f"host=127.0.0.1 port={pg.port} dbname={db} user={role} connect_timeout=2"
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(dsn).close()  # no password, no session: the file is what logs in

    secret = SecretVolume(tmp_path / "pg-secret", {"password": f"{OLD_PASSWORD}\n".encode()})
    tokens = tmp_path / "tokens"
    tokens.write_text(f"gpu-02 {TOKEN}\n")
    extra = (f'state = "{dsn}"\nstate_password_file = "{secret.root / "password"}"\n'
             "pool_size = 2\n")
    try:
        with running_controller(tmp_path, tokens, extra) as ctl:
            agent = KeepSending(f"http://127.0.0.1:{ctl.port}", "gpu-02", TOKEN).start()
            eventually(lambda: agent.taken_since(0) >= 5, timeout=20)
            before = _sessions(admin, role)
            assert before

            # 1. the DBA sets a new password: the sessions already open go on
            admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(NEW_PASSWORD)))
            with pytest.raises(psycopg.OperationalError, match="password"):
                psycopg.connect(dsn, password=OLD_PASSWORD).close()
            altered_at = time.monotonic()
            eventually(lambda: agent.taken_since(altered_at) >= 5, timeout=20)

            # 2. every session ends before the Secret is updated: no new one logs in
            ended_at = time.monotonic()
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE usename = %s", (role,))
            eventually(lambda: agent.statuses[503] >= 1, timeout=60)
            assert not _sessions(admin, role) - before  # none with the old password
            assert "password authentication failed" in pg.log()

            # 3. kubelet swaps the Secret: new sessions log in with the new password
            secret.write({"password": f"{NEW_PASSWORD}\n".encode()})
            updated_at = time.monotonic()
            eventually(lambda: agent.taken_since(updated_at) >= 10, timeout=90)
            after = _sessions(admin, role)
            assert after
            assert not after & before
            agent.finish()

            stored = [r.key for r in ctl.store.read_after(0, limit=1_000_000)
                      if r.node == "gpu-02" and r.kind == "inventory"]
            assert len(stored) == len(set(stored))
            assert set(stored) == set(agent.keys)
            assert len(agent.keys) >= 20
            assert agent.taken_since(ended_at) >= 10
            assert ctl.pg_password is not None
            assert ctl.pg_password.problem == ""
    finally:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(db)))
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
        admin.close()
    assert any("state_password_file" in r.getMessage() and "re-read" in r.getMessage()
               for r in caplog.records)


XID48 = ("[Fri Apr  5 21:30:{s:02d} 2024] NVRM: Xid (PCI:0000:{bus:02x}:00): 48, pid=99, "
         "An uncorrectable double bit error (DBE) has been detected on GPU in the "
         "framebuffer at partition 1, subpartition 0.\n")


def _openssl_pair(folder: Path, name: str) -> dict[str, bytes]:
    crt, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(key), "-out", str(crt), "-subj", f"/CN=ctl-{name}",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    return {"tls.crt": crt.read_bytes(), "tls.key": key.read_bytes()}


def _served(port: int, bundle: Path) -> bytes | None:
    import socket
    import ssl

    context = ssl.create_default_context(cafile=str(bundle))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return tls.getpeercert(binary_form=True)


def _der(pem: bytes) -> bytes:
    import ssl

    return ssl.PEM_cert_to_DER_cert(pem.decode())


def test_tls_token_and_password_rotate_under_real_processes(
        tmp_path: Path, scram_postgres: Postgres, monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg
    from psycopg import sql

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    pg = scram_postgres
    role, db = f"gh_proc_{os.getpid()}", f"fleet_proc_{os.getpid()}"
    admin = psycopg.connect(pg.dsn, autocommit=True)
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
        sql.Identifier(role), sql.Literal(OLD_PASSWORD)))
    admin.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
        sql.Identifier(db), sql.Identifier(role)))
    dsn = f"host=127.0.0.1 port={pg.port} dbname={db} user={role} connect_timeout=2"

    a, b = _openssl_pair(tmp_path, "a"), _openssl_pair(tmp_path, "b")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(a["tls.crt"] + b["tls.crt"])
    tls = SecretVolume(tmp_path / "tls", a)
    pg_secret = SecretVolume(tmp_path / "pg", {"password": f"{OLD_PASSWORD}\n".encode()})
    old_token, new_token = "tok-proc-old-" + "x" * 20, "tok-proc-new-" + "y" * 20
    tokens = SecretVolume(tmp_path / "tokens", {"agent-tokens": f"gpu-02 {old_token}\n".encode()})
    agent_secret = SecretVolume(tmp_path / "agent", {"gpu-02": f"{old_token}\n".encode()})
    port = free_port()
    (tmp_path / "ctl.toml").write_text(f"""
[node]
name = "ctl-a"
data_dir = "{tmp_path / 'ctl'}"
[metrics]
enabled = false
[alerting]
api_enabled = false
[report]
enabled = false
[controller]
port = {port}
state = "{dsn}"
state_password_file = "{pg_secret.root / 'password'}"
pool_size = 2
agent_tokens_file = "{tokens.root / 'agent-tokens'}"
tls_cert_file = "{tls.root / 'tls.crt'}"
tls_key_file = "{tls.root / 'tls.key'}"
""")
    kern = tmp_path / "gpu-02.kern.log"
    kern.touch()
    (tmp_path / "agent.toml").write_text(f"""
[node]
name = "gpu-02"
data_dir = "{tmp_path / 'gpu-02'}"
[metrics]
port = {free_port()}
[alerting]
api_port = {free_port()}
[collectors.nvml]
enabled = false
[collectors.network]
enabled = false
[collectors.probe]
enabled = false
[collectors.kernel_log]
source = "file"
path = "{kern}"
[analytics]
evaluate_interval_seconds = 0.3
detectors = false
predictor = false
[agent]
controllers = ["https://127.0.0.1:{port}"]
token_file = "{agent_secret.root / 'gpu-02'}"
ca_file = "{bundle}"
send_interval_seconds = 0.2
heartbeat_interval_seconds = 0.5
""")
    exe = str(Path(sys.executable).parent / "gpuhealth")
    env = {k: v for k, v in os.environ.items() if k != "PGPASSWORD"}
    env.update(PYTHONUNBUFFERED="1", PGPASSFILE=str(tmp_path / "no-such-pgpass"))
    logs = {name: (tmp_path / f"{name}.log").open("ab") for name in ("ctl", "agent")}
    procs = {
        name: subprocess.Popen([exe, name if name == "agent" else "controller", "--config",
                                str(tmp_path / f"{name}.toml")], stdout=logs[name],
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        for name in ("ctl", "agent")}
    faults: list[int] = []
    stop = threading.Event()

    def keep_failing() -> None:  # a GPU fault every 0.3 s, each on its own bus
        while not stop.is_set() and len(faults) < 200:
            bus = 0x10 + len(faults)
            with kern.open("a") as handle:
                handle.write(XID48.format(s=len(faults) % 60, bus=bus))
            faults.append(bus)
            stop.wait(0.3)

    def stored() -> set[str]:
        with psycopg.connect(pg.dsn.replace("dbname=postgres", f"dbname={db}")) as conn:
            return {str(r[0]) for r in conn.execute(
                "SELECT DISTINCT body->>'entity' FROM fleet_records "
                "WHERE kind = 'finding' AND node = 'gpu-02'")}

    def logs_text() -> str:
        return "\n".join(f"--- {n}\n" + (tmp_path / f"{n}.log").read_text(errors="replace")[-4000:]
                         for n in ("ctl", "agent"))

    failing = threading.Thread(target=keep_failing, daemon=True)
    try:
        eventually(lambda: _served(port, bundle) if _up(port) else None, timeout=60)
        failing.start()
        eventually(lambda: len(stored()) >= 3, timeout=60)

        # the TLS Secret renewed (cert-manager): new handshakes get the new certificate
        n = len(stored())
        tls.write(b)
        eventually(lambda: _served(port, bundle) == _der(b["tls.crt"]), timeout=15)
        eventually(lambda: len(stored()) >= n + 3, timeout=30)

        # the agent's token rolled over in three steps
        for volume, files in (
                (tokens, {"agent-tokens": f"gpu-02 {old_token} {new_token}\n".encode()}),
                (agent_secret, {"gpu-02": f"{new_token}\n".encode()}),
                (tokens, {"agent-tokens": f"gpu-02 {new_token}\n".encode()})):
            time.sleep(1.5)  # past both processes' next look at the file
            volume.write(files)
            n = len(stored())
            eventually(lambda n=n: len(stored()) >= n + 2, timeout=30)

        # the database password: ALTER ROLE, the Secret, then every session ends
        admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(NEW_PASSWORD)))
        pg_secret.write({"password": f"{NEW_PASSWORD}\n".encode()})
        time.sleep(1.5)
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE usename = %s", (role,))
        n = len(stored())
        eventually(lambda: len(stored()) >= n + 3, timeout=60)
        eventually(lambda: _sessions(admin, role), timeout=30)

        stop.set()
        failing.join(10)
        want = {f"0000:{bus:02x}:00.0" for bus in faults}
        eventually(lambda: want <= stored(), timeout=60)
        assert procs["ctl"].poll() is None, logs_text()  # never restarted
        assert procs["agent"].poll() is None, logs_text()
        text = (tmp_path / "ctl.log").read_text(errors="replace")
        assert "Traceback" not in text, logs_text()
        assert "TLS certificate re-read" in text
        assert "state_password_file" in text
        assert "re-read" in text
        assert old_token not in text
        assert new_token not in text
        assert NEW_PASSWORD not in text
        assert OLD_PASSWORD not in text
        agent_log = (tmp_path / "agent.log").read_text(errors="replace")
        assert "HTTP 401" not in agent_log, logs_text()  # the rollover refused no batch
        assert len(faults) >= 20
    finally:
        sys.stdout.write(f"{len(faults)} faults\n{logs_text()}\n")  # shown on a failure
        stop.set()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for handle in logs.values():
            handle.close()
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(db)))
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
        admin.close()


def _up(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
