"""The state stores: one conformance suite over SQLite and a real PostgreSQL.

The action store, the audit trail and the fleet store are written once against
``storage.sql``; a controller pair on two machines shares them in PostgreSQL, ``run``
keeps them in SQLite. Two store objects on one target stand for two processes (a leader
and its standby, or the controller and ``gpuhealth actions``).

PostgreSQL is a throw-away server on loopback (``tests/pg_server.py``), one for this
module; every test gets a database of its own (``CREATE DATABASE t_<n>``), so the
migrations run for each. Without PostgreSQL the ``postgres`` cases skip (fail under
``GPUHEALTH_TEST_SERVERS=required``).
"""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.errors import TemporaryError
from core.records import ActionPhase, ActionRequest, AuditRecord, RemediationStep
from remediation.actions import ActionStore, StoredAction, StoredIncident
from remediation.audit import AuditLog, AuditStore, open_audit
from storage.fleet import (
    AcceptResult,
    FleetRecord,
    FleetStore,
    SqliteFleetStore,
    open_fleet_store,
)
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
