"""Rotating the PostgreSQL password while an agent keeps sending, on a real server.

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
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pg_server import Postgres, start_postgres
from tests.rotation_helpers import KeepSending, SecretVolume, running_controller
from tests.servers import eventually

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
