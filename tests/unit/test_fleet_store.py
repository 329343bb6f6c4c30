"""The fleet state store: one conformance suite over SQLite and a real PostgreSQL.

PostgreSQL is a throw-away server on loopback (``tests/pg_server.py``); each test gets
its own database, so the migrations run for each.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.fleet import (
    FleetRecord,
    PostgresFleetStore,
    SqliteFleetStore,
    is_postgres,
    open_fleet_store,
)
from tests.pg_server import Postgres, postgres  # noqa: F401 (fixture)

_db_numbers = itertools.count()


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "fleet.sqlite")
        return
    server: Postgres = request.getfixturevalue("postgres")
    import psycopg

    name = f"fleet_{next(_db_numbers)}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield f"host=127.0.0.1 port={server.port} user=postgres dbname={name}"


def _rec(node: str, n: int, kind: str = "finding", at: float = 1000.0) -> FleetRecord:
    return FleetRecord(key=f"{node}:{n:04d}", node=node, kind=kind, at=at + n,
                       body={"node": node, "n": n})


def test_accept_counts_duplicates_and_keeps_order(target: str) -> None:
    store = open_fleet_store(target)
    try:
        first = store.accept("gpu-01", [_rec("gpu-01", i) for i in range(5)])
        again = store.accept("gpu-01", [_rec("gpu-01", i) for i in range(3, 8)])
        assert (first.accepted, first.duplicates) == (5, 0)
        assert (again.accepted, again.duplicates) == (3, 2)  # an answer lost, a resend
        got = store.read_after(0)
        assert [r.key for r in got] == [f"gpu-01:{i:04d}" for i in range(8)]
        assert [r.seq for r in got] == sorted(r.seq for r in got)
        assert got[0].body == {"node": "gpu-01", "n": 0}
        assert [r.key for r in store.read_after(got[4].seq, limit=2)] == [
            "gpu-01:0005", "gpu-01:0006"]
    finally:
        store.close()


def test_two_replicas_share_the_records_and_the_registry(target: str) -> None:
    a, b = open_fleet_store(target), open_fleet_store(target)
    try:
        a.accept("gpu-01", [_rec("gpu-01", 1)])
        b.accept("gpu-02", [_rec("gpu-02", 1)])
        assert {r.node for r in a.read_after(0)} == {"gpu-01", "gpu-02"}
        a.heartbeat("gpu-01", version="0.1.0", gpus=[{"entity": "GPU-1"}], at=10.0)
        b.heartbeat("gpu-01", version="0.1.1", gpus=[], at=20.0)
        (row,) = a.agents()
        assert (row.node, row.version, row.first_seen_at, row.last_heartbeat_at) == (
            "gpu-01", "0.1.1", 10.0, 20.0)
    finally:
        a.close()
        b.close()


def test_concurrent_accepts_never_commit_out_of_order(target: str) -> None:
    """A reader that follows seq never skips a record that committed late."""
    stores = [open_fleet_store(target) for _ in range(3)]
    seen: list[int] = []
    done = threading.Event()

    def write(i: int) -> None:
        for n in range(40):
            stores[i].accept(f"gpu-{i}", [_rec(f"gpu-{i}", n)])

    def read() -> None:
        cursor = 0
        while True:
            finished = done.is_set()  # read before the last look: nothing commits after it
            batch = stores[0].read_after(cursor)
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
    try:
        assert len(seen) == 120 == len(set(seen))
    finally:
        for s in stores:
            s.close()


def test_prune_deletes_only_old_records(target: str) -> None:
    store = open_fleet_store(target)
    try:
        store.accept("gpu-01", [_rec("gpu-01", i, at=0.0) for i in range(4)])
        assert store.prune(older_than=2.0) == 2
        assert [r.key for r in store.read_after(0)] == ["gpu-01:0002", "gpu-01:0003"]
    finally:
        store.close()


def test_the_backend_is_chosen_by_the_target(tmp_path: Path) -> None:
    assert is_postgres("postgresql://u@db/fleet")
    assert is_postgres("host=db dbname=x")
    assert not is_postgres(str(tmp_path / "fleet.sqlite"))
    store = open_fleet_store(str(tmp_path / "f.sqlite"))
    assert isinstance(store, SqliteFleetStore)
    store.close()


def test_a_restarted_postgres_is_a_temporary_error_then_works(postgres: Postgres) -> None:  # noqa: F811
    from core.errors import TemporaryError

    store = PostgresFleetStore(postgres.dsn, pool_size=2, timeout_seconds=3.0)
    try:
        store.accept("gpu-01", [_rec("gpu-01", 1)])
        postgres.stop()
        with pytest.raises(TemporaryError, match=r"PostgreSQL 127\.0\.0\.1"):
            store.accept("gpu-01", [_rec("gpu-01", 2)])
        postgres.start()
        for _ in range(20):  # the pool replaces its broken connections
            try:
                store.accept("gpu-01", [_rec("gpu-01", 2)])
                break
            except TemporaryError:
                continue
        assert [r.key for r in store.read_after(0)][-1] == "gpu-01:0002"
    finally:
        store.close()
