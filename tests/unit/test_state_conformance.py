"""The action store and the audit trail: one suite over SQLite and a real PostgreSQL.

A controller pair on two machines shares both through PostgreSQL; ``run`` keeps them in
SQLite and a JSONL file. Two store objects on one target stand for two processes (a
leader and its standby, or the controller and ``gpuhealth actions``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.records import ActionPhase, ActionRequest, AuditRecord, RemediationStep
from remediation.actions import ActionStore, StoredIncident
from remediation.audit import AuditLog, AuditStore, open_audit
from tests.pg_server import Postgres, postgres  # noqa: F401 (fixture)

_numbers = itertools.count()


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "actions.db")
        return
    server: Postgres = request.getfixturevalue("postgres")
    import psycopg

    name = f"state_{next(_numbers)}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield f"host=127.0.0.1 port={server.port} user=postgres dbname={name}"


def _request(key: str = "fp1/drain") -> ActionRequest:
    return ActionRequest(step=RemediationStep.DRAIN, node="gpu-01", entity="node",  # type: ignore[arg-type]
                         reason="Xid 79", idempotency_key=key, dry_run=False,
                         attrs={"why": "test"})


def test_an_action_is_stored_once_by_its_key(target: str) -> None:
    a, b = ActionStore(target), ActionStore(target)
    try:
        first = a.add(_request(), incident="fp1", fingerprint="fp1", severity="critical",
                      phase=ActionPhase.PENDING, now=10.0)
        again = b.add(_request(), incident="fp1", fingerprint="fp1", severity="critical",
                      phase=ActionPhase.PENDING, now=11.0)
        assert first is not None
        assert again is None  # the standby's second decision adds nothing
        (stored,) = b.actions()
        assert (stored.id, stored.key, stored.attrs) == (first.id, "fp1/drain", {"why": "test"})
        assert b.by_key("fp1/drain") == stored
    finally:
        a.close()
        b.close()


def test_compare_and_set_lets_one_of_two_writers_win(target: str) -> None:
    a, b = ActionStore(target), ActionStore(target)
    try:
        action = a.add(_request(), incident="fp1", fingerprint="fp1", severity="critical",
                       phase=ActionPhase.PENDING, now=1.0)
        assert action is not None
        results: list[bool] = []

        def move(store: ActionStore, phase: ActionPhase) -> None:
            results.append(store.update(action.id, now=2.0, phase=phase,
                                        expect=(ActionPhase.PENDING,)))

        threads = [threading.Thread(target=move, args=(a, ActionPhase.RUNNING)),
                   threading.Thread(target=move, args=(b, ActionPhase.CANCELLED))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, True]  # a human's cancel and a submit: one wins
        assert a.get(action.id).phase in (ActionPhase.RUNNING, ActionPhase.CANCELLED)  # type: ignore[union-attr]
    finally:
        a.close()
        b.close()


def test_incidents_and_control_flags(target: str) -> None:
    store = ActionStore(target)
    try:
        incident = StoredIncident(incident="fp1", fingerprint="fp1", node="gpu-01",  # type: ignore[arg-type]
                                  entity="node", kind="xid", code="79", severity="critical",
                                  state="open", opened_at=5.0)
        assert store.open_incident(incident) is True
        assert store.open_incident(incident) is False
        store.update_incident("fp1", state="probation", probation_until=99.0, claimed=0)
        got = store.incident("fp1")
        assert got is not None
        assert (got.state, got.probation_until, got.claimed) == ("probation", 99.0, False)
        assert [i.incident for i in store.incidents(states=("probation",))] == ["fp1"]
        store.set_control("breaker", "open", at=7.0, who="ctl-a", why="5 nodes in 10 min")
        store.set_control("breaker", "closed", at=8.0, who="alice", why="reset")
        assert store.control("breaker") == ("closed", 8.0, "alice", "reset")
    finally:
        store.close()


def test_the_audit_trail_keeps_order_across_two_writers(target: str, tmp_path: Path) -> None:
    path = target if not target.endswith(".db") else str(tmp_path / "audit.jsonl")
    a, b = open_audit(path), open_audit(path)
    assert isinstance(a, AuditStore if "dbname=" in path else AuditLog)
    a.create()
    records = [AuditRecord(at=float(i), actor=f"ctl-{'ab'[i % 2]}", decision="requested",
                           step=RemediationStep.CORDON, node="gpu-01", entity="node",  # type: ignore[arg-type]
                           reason=f"r{i}", idempotency_key=f"k{i}", dry_run=False,
                           details={"fingerprint": "fp1"}) for i in range(6)]
    for i, record in enumerate(records):
        (a if i % 2 == 0 else b).extend([record])
    assert [r.reason for r in a.read()] == [f"r{i}" for i in range(6)]
    assert b.read() == a.read()
    for sink in (a, b):
        if isinstance(sink, AuditStore):
            sink.close()


def test_silences_are_shared_by_two_stores(target: str, tmp_path: Path) -> None:
    from alerting.silences import SilenceState, SilenceStore, parse_matchers

    path = target if "dbname=" in target else str(tmp_path / "silences.json")
    a, b = SilenceStore(path=path), SilenceStore(path=path)
    made = a.add(parse_matchers(["node=gpu-01"]), duration_seconds=3600, created_by="alice",
                 comment="maintenance")
    got = b.get(made.id)
    assert got is not None
    assert got.matchers == made.matchers
    assert b.muting({"node": "gpu-01", "alertname": "GpuXid79"}) == [made.id]
    b.expire(made.id)
    again = a.get(made.id)
    assert again is not None
    assert again.state(a.clock()) is SilenceState.EXPIRED
    assert a.muting({"node": "gpu-01"}) == []
