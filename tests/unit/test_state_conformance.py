"""The state stores: one conformance suite over SQLite and a real PostgreSQL.

The action store, the audit trail, the fleet store, the silences, the notification
outbox and the incident history are written once against
``storage.sql``; a controller pair on two machines shares them in PostgreSQL, ``run``
keeps them in SQLite. Two store objects on one target stand for two processes (a leader
and its standby, or the controller and ``gpuhealth actions``).

PostgreSQL is a throw-away server on loopback (``tests/pg_server.py``), one for this
module; every test gets a database of its own (``CREATE DATABASE t_<n>``), so the
migrations run for each. Without PostgreSQL the ``postgres`` cases skip (fail under
``GPUHEALTH_TEST_SERVERS=required``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from alerting.outbox import Outbox
from alerting.testing import RecordingNotifier
from core.clock import FakeClock
from core.errors import NotifierUnavailable, PermanentError, TemporaryError
from core.records import (
    ActionPhase,
    ActionRequest,
    Alert,
    AlertState,
    AuditRecord,
    RemediationStep,
)
from remediation.actions import ActionStore, StoredAction, StoredIncident
from remediation.audit import AuditLog, AuditStore, open_audit
from storage.fleet import (
    AcceptResult,
    AgentBatch,
    FleetRecord,
    FleetStore,
    SqliteFleetStore,
    open_fleet_store,
)
from storage.history import IncidentHistory, IncidentRecord, InventoryRecord, PredictionRecord
from storage.sql import SHARED_SCHEMA, is_postgres, migrations, open_database, server_of
from tests.pg_server import Postgres, start_postgres

_numbers = itertools.count()

SHARED = ["sqlite", "postgres"]
"""Backends two store objects can share (two processes)."""
SINGLE = ["memory", *SHARED]
"""Backends for one store object; ``memory`` is SQLite in memory."""


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    with start_postgres() as server:
        yield server


def _new_database(server: Postgres, *, extra: str = "") -> str:
    import psycopg

    name = f"t_{next(_numbers)}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"host=127.0.0.1 port={server.port} user=postgres dbname={name}{extra}"


def _target(kind: str, request: pytest.FixtureRequest, tmp_path: Path, suffix: str
            ) -> str | None:
    if kind == "memory":
        return None
    if kind == "sqlite":
        return str(tmp_path / f"state{suffix}")
    return _new_database(request.getfixturevalue("pg"))


@pytest.fixture(params=SHARED)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh target that two store objects open (a SQLite file or a database)."""
    found = _target(request.param, request, tmp_path, ".db")
    assert found is not None
    return found


@pytest.fixture(params=SINGLE)
def single(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """A fresh target for one store object (also SQLite in memory: ``None``)."""
    return _target(request.param, request, tmp_path, ".db")


def _closing(request: pytest.FixtureRequest, close: Callable[[], None]) -> None:
    request.addfinalizer(close)


# -- the action store -------------------------------------------------------------------


def _request(key: str = "fp1/drain") -> ActionRequest:
    return ActionRequest(step=RemediationStep.DRAIN, node="gpu-01", entity="node",  # type: ignore[arg-type]
                         reason="Xid 79", idempotency_key=key, dry_run=False,
                         attrs={"why": "test"})


def _add(store: ActionStore, key: str = "fp1/drain", now: float = 10.0) -> StoredAction | None:
    return store.add(_request(key), incident="fp1", fingerprint="fp1", severity="critical",
                     phase=ActionPhase.PENDING, now=now)


def test_an_action_is_stored_once_by_its_key(target: str,
                                             request: pytest.FixtureRequest) -> None:
    a, b = ActionStore(target), ActionStore(target)
    _closing(request, a.close)
    _closing(request, b.close)
    first = _add(a, now=10.0)
    again = _add(b, now=11.0)
    assert first is not None
    assert again is None  # the standby's second decision adds nothing
    (stored,) = b.actions()
    assert (stored.id, stored.key, stored.attrs, stored.created_at) == (
        first.id, "fp1/drain", {"why": "test"}, 10.0)
    assert b.by_key("fp1/drain") == stored == a.get(first.id)
    second = _add(b, key="fp1/reboot", now=12.0)
    assert second is not None
    assert second.id > first.id
    assert [x.key for x in a.actions(phases=(ActionPhase.PENDING,), node="gpu-01")] == [
        "fp1/drain", "fp1/reboot"]
    assert [x.key for x in a.actions(limit=1)] == ["fp1/reboot"]


def test_compare_and_set_lets_one_of_two_writers_win(target: str,
                                                    request: pytest.FixtureRequest) -> None:
    a, b = ActionStore(target), ActionStore(target)
    _closing(request, a.close)
    _closing(request, b.close)
    results: list[bool] = []

    def move(store: ActionStore, phase: ActionPhase, action_id: int,
             barrier: threading.Barrier, outcome: list[tuple[bool, ActionPhase]]) -> None:
        barrier.wait()
        won = store.update(action_id, now=2.0, phase=phase, expect=(ActionPhase.PENDING,),
                           message=phase.value)
        outcome.append((won, phase))

    for round_ in range(5):
        action = _add(a, key=f"fp1/step{round_}", now=1.0)
        assert action is not None
        barrier = threading.Barrier(2)
        outcome: list[tuple[bool, ActionPhase]] = []
        threads = [threading.Thread(target=move, args=(store, phase, action.id, barrier, outcome))
                   for store, phase in ((a, ActionPhase.RUNNING), (b, ActionPhase.CANCELLED))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        (winner,) = [phase for won, phase in outcome if won]  # a cancel and a submit: one wins
        got = b.get(action.id)
        assert got is not None
        assert (got.phase, got.message, got.updated_at) == (winner, winner.value, 2.0)
        results.extend(won for won, _ in outcome)
    assert results.count(True) == 5
    assert a.update(1, now=3.0, phase=ActionPhase.FAILED, expect=(ActionPhase.PENDING,)) is False
    with pytest.raises(ValueError, match="cannot update action columns"):
        a.update(1, now=3.0, phase=ActionPhase.FAILED, node="gpu-02")


def test_incidents_and_control_flags(single: str | None, request: pytest.FixtureRequest) -> None:
    store = ActionStore(single)
    _closing(request, store.close)
    incident = StoredIncident(incident="fp1", fingerprint="fp1", node="gpu-01",  # type: ignore[arg-type]
                              entity="node", kind="xid", code="79", severity="critical",
                              state="open", opened_at=5.0)
    assert store.open_incident(incident) is True
    assert store.open_incident(incident) is False
    store.update_incident("fp1", state="probation", probation_until=99.0, claimed=0)
    got = store.incident("fp1")
    assert got is not None
    assert (got.state, got.probation_until, got.claimed, got.opened_at) == (
        "probation", 99.0, False, 5.0)
    assert [i.incident for i in store.incidents(states=("probation",))] == ["fp1"]
    assert store.incidents(states=("open",)) == []
    assert store.control("breaker") is None
    store.set_control("breaker", "open", at=7.0, who="ctl-a", why="5 nodes in 10 min")
    store.set_control("breaker", "closed", at=8.0, who="alice", why="reset")
    assert store.control("breaker") == ("closed", 8.0, "alice", "reset")


def test_an_action_store_of_an_older_release_opens(tmp_path: Path) -> None:
    """A file made before the schema was versioned (tables, no migration records)."""
    path = tmp_path / "actions.db"
    old = sqlite3.connect(path)
    for migration in migrations("sqlite", "actions"):
        old.executescript(migration.sql)
    old.execute("INSERT INTO control (name, value, at) VALUES ('breaker', 'open', 1.0)")
    old.commit()
    old.close()
    store = ActionStore(path)
    try:
        assert store.control("breaker") == ("open", 1.0, "", "")
        assert store.path == path
    finally:
        store.close()


# -- the audit trail --------------------------------------------------------------------


def _audit(i: int) -> AuditRecord:
    return AuditRecord(at=float(i), actor=f"ctl-{'ab'[i % 2]}", decision="requested",
                       step=RemediationStep.CORDON, node="gpu-01", entity="node",  # type: ignore[arg-type]
                       reason=f"r{i}", idempotency_key=f"k{i}", dry_run=False,
                       details={"fingerprint": "fp1"})


@pytest.mark.parametrize("kind", ["jsonl", *SHARED])
def test_the_audit_trail_keeps_order_across_two_writers(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    path = (str(tmp_path / "audit.jsonl") if kind == "jsonl"
            else _target(kind, request, tmp_path, ".db"))
    assert path is not None
    a, b = open_audit(path), open_audit(path)
    for sink in (a, b):
        assert isinstance(sink, AuditLog if kind == "jsonl" else AuditStore)
        if isinstance(sink, AuditStore):
            _closing(request, sink.close)
    a.create()
    b.create()  # never truncates
    for i in range(6):
        (a if i % 2 == 0 else b).append(_audit(i))
    b.extend([_audit(6), _audit(7)])
    b.extend([])
    assert [r.reason for r in a.read()] == [f"r{i}" for i in range(8)]
    assert b.read() == a.read()
    assert a.read()[0] == _audit(0)


@pytest.mark.parametrize("kind", SINGLE)
def test_the_audit_store_shares_a_database_it_does_not_close(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    db = open_database(_target(kind, request, tmp_path, ".db"))
    _closing(request, db.close)
    audit = AuditStore(db)
    audit.extend([_audit(1)])
    audit.close()
    assert [r[0] for r in db.execute("SELECT record FROM audit_records")] != []
    assert AuditStore(db).read() == [_audit(1)]


# -- the fleet store --------------------------------------------------------------------


def _rec(node: str, n: int, kind: str = "finding", at: float = 1000.0) -> FleetRecord:
    return FleetRecord(key=f"{node}:{n:04d}", node=node, kind=kind, at=at + n,
                       body={"node": node, "n": n, "nested": {"xs": [1, 2.5, None]}})


def test_duplicates_are_counted_not_stored(target: str, request: pytest.FixtureRequest) -> None:
    a, b = open_fleet_store(target), open_fleet_store(target)
    _closing(request, a.close)
    _closing(request, b.close)
    first = a.accept("gpu-01", [_rec("gpu-01", i) for i in range(5)])
    again = b.accept("gpu-01", [_rec("gpu-01", i) for i in range(3, 8)])  # an answer lost
    assert (first.accepted, first.duplicates) == (5, 0)
    assert (again.accepted, again.duplicates) == (3, 2)
    assert b.accept("gpu-01", []) == AcceptResult(0, 0)
    got = a.read_after(0)
    assert [r.key for r in got] == [f"gpu-01:{i:04d}" for i in range(8)]
    assert [r.seq for r in got] == sorted({r.seq for r in got})
    assert got[0].body == {"node": "gpu-01", "n": 0, "nested": {"xs": [1, 2.5, None]}}
    assert (got[0].node, got[0].kind, got[0].at) == ("gpu-01", "finding", 1000.0)
    assert [r.key for r in b.read_after(got[4].seq, limit=2)] == ["gpu-01:0005", "gpu-01:0006"]
    assert b.read_after(got[-1].seq) == []



def test_a_group_of_batches_is_each_batch_accepted_and_its_heartbeat(
        target: str, request: pytest.FixtureRequest) -> None:
    store = open_fleet_store(target)
    _closing(request, store.close)
    store.accept("gpu-01", [_rec("gpu-01", 0)])  # stored before: a duplicate below
    results = store.accept_batches([
        AgentBatch(node="gpu-01", records=[_rec("gpu-01", 0), _rec("gpu-01", 1)],
                   heartbeat_at=50.0, version="1.2", gpus=[{"entity": "GPU-a"}],
                   facts={"rack": "r1"}),
        AgentBatch(node="gpu-02", records=[], heartbeat_at=51.0),
        AgentBatch(node="gpu-03", records=[_rec("gpu-03", 0)])])  # no heartbeat
    assert results == [AcceptResult(1, 1), AcceptResult(0, 0), AcceptResult(1, 0)]
    assert [r.key for r in store.read_after(0)] == ["gpu-01:0000", "gpu-01:0001",
                                                    "gpu-03:0000"]
    agents = {a.node: a for a in store.agents()}
    assert sorted(agents) == ["gpu-01", "gpu-02"]
    assert (agents["gpu-01"].version, agents["gpu-01"].last_heartbeat_at) == ("1.2", 50.0)
    assert dict(agents["gpu-01"].facts) == {"rack": "r1"}
    assert [dict(g) for g in agents["gpu-01"].gpus] == [{"entity": "GPU-a"}]
    assert store.accept_batches([]) == []

def test_accepted_records_keep_their_order(single: str | None,
                                           request: pytest.FixtureRequest) -> None:
    clock = itertools.count(100)
    db = open_database(single)
    store = FleetStore(db, clock=lambda: float(next(clock)))
    _closing(request, store.close)
    store.accept("gpu-02", [_rec("gpu-02", 9, kind="inventory"), _rec("gpu-02", 1)])
    store.accept("gpu-01", [_rec("gpu-01", 5, kind="anomaly"), _rec("gpu-01", 2,
                                                                    kind="prediction")])
    got = store.read_after(0)
    assert [(r.key, r.kind) for r in got] == [
        ("gpu-02:0009", "inventory"), ("gpu-02:0001", "finding"),
        ("gpu-01:0005", "anomaly"), ("gpu-01:0002", "prediction")]
    assert [r.accepted_at for r in got] == [100.0, 100.0, 101.0, 101.0]
    with pytest.raises(ValueError, match="kind must be one of"):
        FleetRecord(key="gpu-01:x", node="gpu-01", kind="gossip", at=1.0, body={})


def test_concurrent_accepts_never_commit_out_of_order(target: str,
                                                      request: pytest.FixtureRequest) -> None:
    """A reader that follows seq never skips a record that committed late."""
    stores = [open_fleet_store(target, pool_size=2) for _ in range(3)]
    for s in stores:
        _closing(request, s.close)
    seen: list[int] = []
    done = threading.Event()

    def write(i: int) -> None:
        for n in range(25):
            stores[i].accept(f"gpu-{i}", [_rec(f"gpu-{i}", n), _rec(f"gpu-{i}", n + 100)])

    def read() -> None:
        cursor = 0
        while True:
            finished = done.is_set()  # read before the last look: nothing commits after it
            batch = stores[0].read_after(cursor, limit=7)
            seen.extend(r.seq for r in batch)
            if batch:
                cursor = batch[-1].seq
            elif finished:
                return

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(3)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert len(seen) == 150 == len(set(seen))


def test_heartbeats_upsert_the_registry(target: str, request: pytest.FixtureRequest) -> None:
    a, b = open_fleet_store(target), open_fleet_store(target)
    _closing(request, a.close)
    _closing(request, b.close)
    assert a.agents() == []
    a.heartbeat("gpu-02", version="0.1.0", gpus=[], at=5.0)
    a.heartbeat("gpu-01", version="0.1.0", gpus=[{"entity": "GPU-1"}], at=10.0,
                facts={"rack": "r1"})
    b.heartbeat("gpu-01", version="0.1.1", gpus=[{"entity": "GPU-1"}, {"entity": "GPU-2"}],
                at=20.0)
    rows = a.agents()
    assert [r.node for r in rows] == ["gpu-01", "gpu-02"]
    row = rows[0]
    assert (row.version, row.first_seen_at, row.last_heartbeat_at) == ("0.1.1", 10.0, 20.0)
    assert [dict(g) for g in row.gpus] == [{"entity": "GPU-1"}, {"entity": "GPU-2"}]
    assert dict(row.facts) == {}


def test_prune_deletes_only_old_records(single: str | None,
                                        request: pytest.FixtureRequest) -> None:
    store = FleetStore(open_database(single))
    _closing(request, store.close)
    store.accept("gpu-01", [_rec("gpu-01", i, at=0.0) for i in range(4)])
    assert store.prune(older_than=2.0) == 2
    assert store.prune(older_than=2.0) == 0
    assert [r.key for r in store.read_after(0)] == ["gpu-01:0002", "gpu-01:0003"]
    assert store.accept("gpu-01", [_rec("gpu-01", 3, at=0.0)]).duplicates == 1


def test_the_backend_is_chosen_by_the_target(tmp_path: Path) -> None:
    assert is_postgres("postgresql://u@db/fleet")
    assert is_postgres("postgres://db/fleet")
    assert is_postgres("host=db dbname=x")
    assert not is_postgres(str(tmp_path / "fleet.sqlite"))
    assert not is_postgres(tmp_path / "host=db")
    assert open_database(None).dialect == "sqlite"
    store = open_fleet_store(str(tmp_path / "sub" / "f.sqlite"))
    assert isinstance(store, SqliteFleetStore)
    assert store.db.dialect == "sqlite"
    store.close()
    assert server_of("postgresql://u:pw@db:5433/fleet") == "db:5433/fleet"


# -- migrations and failures ------------------------------------------------------------


def test_migrations_are_applied_once_by_two_databases_at_once(
        target: str, request: pytest.FixtureRequest) -> None:
    dbs = [open_database(target, pool_size=1) for _ in range(3)]
    for db in dbs:
        _closing(request, db.close)
    dialect = dbs[0].dialect
    component = "actions" if dialect == "sqlite" else SHARED_SCHEMA
    barrier = threading.Barrier(len(dbs))
    applied: list[list[int]] = []
    errors: list[BaseException] = []

    def migrate(i: int) -> None:
        barrier.wait()
        try:
            applied.append(dbs[i].migrate("actions"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=migrate, args=(i,)) for i in range(len(dbs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    expected = [m.version for m in migrations(dialect, component)]
    assert sorted(v for versions in applied for v in versions) == expected
    assert sorted(applied, key=len)[:-1] == [[]] * (len(dbs) - 1)  # one did all the work
    rows = dbs[0].execute("SELECT component, version FROM gpuhealth_schema_migrations "
                          "ORDER BY version")
    assert [tuple(r) for r in rows] == [(component, v) for v in expected]
    assert dbs[1].migrate("actions") == []


def test_sqlite_components_get_their_own_migrations() -> None:
    assert [m.version for m in migrations("sqlite", "fleet")] == [1, 2]
    assert [m.name for m in migrations("sqlite", "actions")] == ["actions"]
    assert [m.name for m in migrations("sqlite", "audit")] == ["audit"]
    everything = [m.version for m in migrations("postgres")]
    assert everything == sorted(set(everything))


def test_a_postgres_restart_is_a_temporary_error_then_works(pg: Postgres) -> None:
    # trust authentication ignores the password; it is here to be kept out of messages
    dsn = _new_database(pg, extra=" password=s3cret-pw")
    fleet = FleetStore(open_database(dsn, pool_size=1, timeout_seconds=1.0))
    actions = ActionStore(dsn)
    try:
        fleet.accept("gpu-01", [_rec("gpu-01", 1)])
        assert _add(actions, key="fp1/cordon") is not None
        pg.stop()
        with pytest.raises(TemporaryError) as failed:
            fleet.accept("gpu-01", [_rec("gpu-01", 2)])
        assert str(failed.value).startswith(f"PostgreSQL 127.0.0.1:{pg.port}/t_")
        assert "s3cret" not in str(failed.value)
        pg.start()
        deadline = time.monotonic() + 15.0
        while True:  # the pool replaces its broken connections in the background
            try:
                fleet.accept("gpu-01", [_rec("gpu-01", 2)])
                break
            except TemporaryError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert [r.key for r in fleet.read_after(0)] == ["gpu-01:0001", "gpu-01:0002"]
        # a store that was idle meanwhile replaces its broken connections on its next call
        stored = actions.by_key("fp1/cordon")
        assert stored is not None
        assert stored.phase is ActionPhase.PENDING
    finally:
        if pg.pid() is None:  # failed while stopped: the module's later tests need it
            pg.start()
        fleet.close()
        actions.close()


# -- shared silences (alerting.silences on the same database) ---------------------------


def test_silences_are_shared_by_two_stores(target: str, tmp_path: Path) -> None:
    from alerting.silences import SilenceState, SilenceStore, parse_matchers

    path = target if is_postgres(target) else str(tmp_path / "silences.json")
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


# -- the notification outbox (alerting.outbox on the same database) ---------------------


def _alerts(n: int, start: int = 0) -> list[Alert]:
    from alerting.alerts import alert_for
    from tests.unit.test_alerts import make_finding

    return [alert_for(make_finding(entity=f"GPU-{i}"), starts_at=1.0)
            for i in range(start, start + n)]


def _entities(alerts: Sequence[Alert]) -> list[str]:
    return [a.labels["entity"] for a in alerts]


def _outbox(target: str | None, request: pytest.FixtureRequest, **kw: Any) -> Outbox:
    box = Outbox(path=target, **kw)
    _closing(request, box.close)
    return box


def test_the_outbox_keeps_order_and_replaces_in_place(single: str | None,
                                                      request: pytest.FixtureRequest) -> None:
    box = _outbox(single, request, clock=FakeClock())
    first = _alerts(3)
    box.enqueue("n", first)
    box.enqueue("other", _alerts(1, start=7))
    newer = replace(first[1], annotations={**first[1].annotations, "occurrences": "2"})
    box.enqueue("n", [newer])  # same alert, same state: in place
    assert box.depths() == {"n": 3, "other": 1}
    assert _entities(box.queued("n")) == ["GPU-0", "GPU-1", "GPU-2"]
    assert box.queued("n")[1].annotations["occurrences"] == "2"
    box.enqueue("n", [replace(first[0], state=AlertState.RESOLVED, ends_at=5.0)])
    assert [a.state for a in box.queued("n")] == [AlertState.FIRING] * 3 + [
        AlertState.RESOLVED]
    rec = RecordingNotifier(name="n")
    stats = asyncio.run(box.deliver({"n": rec}))
    assert stats.sent == {"n": 4}
    assert _entities(rec.sent) == ["GPU-0", "GPU-1", "GPU-2", "GPU-0"]
    assert box.depths() == {"other": 1}


def test_the_outbox_bound_drops_the_oldest(single: str | None,
                                           request: pytest.FixtureRequest) -> None:
    box = _outbox(single, request, clock=FakeClock(), max_per_notifier=3)
    assert box.enqueue("n", _alerts(5)) == 2
    assert _entities(box.queued("n")) == ["GPU-2", "GPU-3", "GPU-4"]
    assert box.dropped == {"n": 2}


def test_the_outbox_backs_off_and_drops_a_refused_alert(single: str | None,
                                                        request: pytest.FixtureRequest) -> None:
    clock = FakeClock(now=0)
    box = _outbox(single, request, clock=clock, jitter=lambda: 1.0)
    rec = RecordingNotifier(name="n")
    box.enqueue("n", _alerts(2))
    rec.inject_error(NotifierUnavailable("503"), times=2)
    assert asyncio.run(box.deliver({"n": rec})).failed == {"n": 1}
    assert box.next_attempt_at("n") == 1.0
    clock.now = 1.0
    asyncio.run(box.deliver({"n": rec}))
    assert box.next_attempt_at("n") == 3.0
    clock.now = 3.0
    rec.inject_error(PermanentError("400"))
    stats = asyncio.run(box.deliver({"n": rec}))
    assert (stats.dropped, _entities(rec.sent)) == ({"n": 1}, ["GPU-1"])


def test_the_outbox_survives_a_restart(target: str, request: pytest.FixtureRequest) -> None:
    box = Outbox(path=target, clock=FakeClock())
    box.enqueue("n", _alerts(2))
    box.close()
    again = _outbox(target, request, clock=FakeClock())
    rec = RecordingNotifier(name="n")
    asyncio.run(again.deliver({"n": rec}))
    assert _entities(rec.sent) == ["GPU-0", "GPU-1"]
    assert again.depths() == {}


def test_an_outbox_file_of_an_older_release_opens(tmp_path: Path) -> None:
    path = tmp_path / "outbox.sqlite"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, notifier TEXT NOT NULL,
            fingerprint TEXT NOT NULL, state TEXT NOT NULL, body TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL DEFAULT 0,
            enqueued_at REAL NOT NULL);
        CREATE INDEX outbox_by_notifier ON outbox (notifier, seq);
        CREATE INDEX outbox_by_alert ON outbox (notifier, fingerprint, seq);
    """)
    (alert,) = _alerts(1)
    from alerting.alerts import alert_to_json

    old.execute("INSERT INTO outbox (notifier, fingerprint, state, body, enqueued_at) "
                "VALUES ('n', ?, 'firing', ?, 1.0)",
                (alert.fingerprint, json.dumps(alert_to_json(alert))))
    old.commit()
    old.close()
    box = Outbox(path=str(path), clock=FakeClock())
    try:
        assert _entities(box.queued("n")) == ["GPU-0"]
        rec = RecordingNotifier(name="n")
        asyncio.run(box.deliver({"n": rec}))
        assert _entities(rec.sent) == ["GPU-0"]
    finally:
        box.close()


class _SlowNotifier:
    """Records what it is sent, in the order received by every replica together."""

    def __init__(self, name: str, log: list[tuple[str, str]], lock: threading.Lock,
                 *, many: bool = False) -> None:
        self.name = name
        self.log = log
        self.lock = lock
        if many:
            self.send_many = self._send_many

    async def send(self, alert: Alert) -> None:
        await asyncio.sleep(0.002)
        with self.lock:
            self.log.append((self.name, alert.labels["entity"]))

    async def _send_many(self, alerts: Sequence[Alert]) -> None:
        await asyncio.sleep(0.002)
        with self.lock:
            self.log.extend((self.name, a.labels["entity"]) for a in alerts)


def test_two_replicas_delivering_at_once_send_each_entry_once_in_order(
        target: str, request: pytest.FixtureRequest) -> None:
    replicas = [_outbox(target, request, batch_size=7) for _ in range(2)]
    log: list[tuple[str, str]] = []
    lock = threading.Lock()
    total = 60
    done = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        for start in range(0, total, 5):  # both replicas write (a leader change meanwhile)
            replicas[start // 5 % 2].enqueue("one", _alerts(5, start))
            replicas[start // 5 % 2].enqueue("many", _alerts(5, start))
            time.sleep(0.003)
        done.set()

    def deliver(box: Outbox) -> None:
        notifiers = {"one": _SlowNotifier("one", log, lock),
                     "many": _SlowNotifier("many", log, lock, many=True)}
        try:
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                finished = done.is_set()
                asyncio.run(box.deliver(notifiers))
                if finished and not box.depths():
                    return
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=produce),
               *(threading.Thread(target=deliver, args=(box,)) for box in replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    expected = [f"GPU-{i}" for i in range(total)]
    for name in ("one", "many"):
        assert [e for n, e in log if n == name] == expected  # each once, in order
    assert replicas[0].depths() == {}


def test_a_dead_deliverers_claim_expires_then_the_standby_sends_what_is_pending_once(
        target: str, request: pytest.FixtureRequest) -> None:
    clock = FakeClock(now=100.0)
    leader = Outbox(path=target, clock=clock)
    leader.enqueue("n", _alerts(3))
    assert leader.claim("n", seconds=60.0)  # then dies in the middle of a send
    standby = _outbox(target, request, clock=clock)
    rec = RecordingNotifier(name="n")
    assert asyncio.run(standby.deliver({"n": rec})).sent == {}
    assert not standby.claim("n", seconds=60.0)
    clock.now = 161.0  # the dead leader's claim has expired
    assert asyncio.run(standby.deliver({"n": rec})).sent == {"n": 3}
    assert asyncio.run(standby.deliver({"n": rec})).sent == {}
    assert _entities(rec.sent) == ["GPU-0", "GPU-1", "GPU-2"]
    leader.db.close()  # never released: it died
    standby.enqueue("n", _alerts(1, start=3))  # no claim left behind after a round
    assert asyncio.run(standby.deliver({"n": rec})).sent == {"n": 1}


def test_an_entry_replaced_while_it_is_sent_keeps_its_newer_content(
        single: str | None, request: pytest.FixtureRequest) -> None:
    box = _outbox(single, request, clock=FakeClock())
    (alert,) = _alerts(1)
    box.enqueue("n", [alert])
    newer = replace(alert, annotations={**alert.annotations, "occurrences": "9"})

    class Replacing(RecordingNotifier):
        async def send(self, sent: Alert) -> None:
            if not self.sent:
                box.enqueue("n", [newer])  # the pipeline re-sends it meanwhile
            await super().send(sent)

    rec = Replacing(name="n")
    asyncio.run(box.deliver({"n": rec}))
    # the entry sent first was replaced meanwhile: it stayed, and went again, newer
    assert rec.sent == [alert, newer]
    assert box.depths() == {}


# -- the incident history (storage.history on the same database) ------------------------


def _history_records(n: int, *, severity: str = "critical"
                     ) -> tuple[list[IncidentRecord], list[InventoryRecord],
                                list[PredictionRecord]]:
    incidents = [IncidentRecord(
        incident_id=f"gpu-{i:02d}/fp{i}", node=f"gpu-{i:02d}", entity=f"GPU-{i}", kind="xid",
        code="79", severity=severity, cause="gpu_lost", detected_at=1000.0 + i,
        out_of_service_at=1010.0 + i, back_in_service_at=None, resolved_at=None,
        actions=("cordon", "drain"), attrs={"state": "open"}) for i in range(n)]
    inventory = [InventoryRecord(
        entity=f"GPU-{i}", node=f"gpu-{i:02d}", model="H100", driver_version="550.54.15",
        vbios_version="96.00", slot="0000:1b:00.0", first_seen_at=10.0, last_seen_at=2000.0,
        removed_at=None) for i in range(n)]
    predictions = [PredictionRecord(entity=f"GPU-{i}", node=f"gpu-{i:02d}", at=900.0 + i,
                                    probability=0.75, horizon_seconds=86400.0,
                                    top_features={"ecc": 0.5}) for i in range(n)]
    return incidents, inventory, predictions


def test_history_upserts_are_idempotent_across_two_writers(
        target: str, request: pytest.FixtureRequest) -> None:
    a, b = IncidentHistory(target), IncidentHistory(target)
    _closing(request, a.close)
    _closing(request, b.close)
    incidents, inventory, predictions = _history_records(4)
    for writer in (a, b, a):  # a leader, the standby taking over, the leader again
        assert writer.upsert_incidents(incidents) == 4
        assert writer.upsert_inventory(inventory) == 4
        assert writer.record_predictions(predictions) == 4
    frame = b.incidents()
    assert list(frame["incident_id"]) == [r.incident_id for r in incidents]
    assert frame.iloc[0]["actions"] == ("cordon", "drain")
    assert frame.iloc[0]["attrs"] == {"state": "open"}
    assert frame.iloc[0]["back_in_service_at"] is None or frame["back_in_service_at"].isna()[0]
    assert len(a.inventory()) == 4
    assert len(a.predictions(since=900.0, until=902.0)) == 2
    closed = replace(incidents[0], resolved_at=1500.0, back_in_service_at=1500.0,
                     attrs={"state": "closed"})
    b.upsert_incidents([closed])  # the last write of a key wins
    row = a.incidents().iloc[0]
    assert (row["resolved_at"], row["attrs"]) == (1500.0, {"state": "closed"})
    assert len(a.incidents(since=1001.0)) == 3
    assert a.sources() == ["gpuhealth"]


def test_the_history_reads_the_same_on_both_engines(
        target: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    shared = IncidentHistory(target)
    local = IncidentHistory(":memory:")
    for h in (shared, local):
        _closing(request, h.close)
        incidents, inventory, predictions = _history_records(3)
        h.upsert_incidents(incidents)
        h.upsert_inventory(inventory)
        h.record_predictions(predictions)
    for read in ("incidents", "inventory", "predictions"):
        got, want = getattr(shared, read)(), getattr(local, read)()
        assert list(got.columns) == list(want.columns)
        assert got.astype(str).to_dict("records") == want.astype(str).to_dict("records")


def test_the_report_reads_the_history_of_either_engine(target: str,
                                                       request: pytest.FixtureRequest) -> None:
    from click.testing import CliRunner

    from gpuhealth.report_cli import report

    history = IncidentHistory(target)
    _closing(request, history.close)
    incidents, inventory, _ = _history_records(2)
    history.upsert_inventory(inventory)
    history.upsert_incidents(incidents)
    result = CliRunner().invoke(report, ["--history", target, "--since", "0", "--until",
                                         "5000", "--format", "json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["inputs"]["history"] == history.where  # never a password
    assert body["inputs"]["incidents_in_window"] == 2
    assert body["inputs"]["inventory_residencies"] == 2


def test_the_outbox_keeps_notifications_through_a_postgres_restart(pg: Postgres) -> None:
    box = Outbox(path=_new_database(pg), clock=FakeClock(), db_timeout_seconds=1.0)
    rec = RecordingNotifier(name="n")
    try:
        box.enqueue("n", _alerts(1))
        pg.stop()
        assert box.enqueue("n", _alerts(2, start=1)) == 0  # waits in memory
        assert asyncio.run(box.deliver({"n": rec})).sent == {}
        assert box.unsaved() == 2
        pg.start()
        deadline = time.monotonic() + 15.0
        while len(rec.sent) < 3 and time.monotonic() < deadline:
            asyncio.run(box.deliver({"n": rec}))  # the pool reconnects in the background
            time.sleep(0.05)
        assert _entities(rec.sent) == ["GPU-0", "GPU-1", "GPU-2"]
        assert (box.unsaved(), box.depths()) == (0, {})
    finally:
        if pg.pid() is None:
            pg.start()
        box.close()
