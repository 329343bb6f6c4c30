from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from core.clock import FakeClock
from core.errors import TemporaryError
from core.protocols import Store
from core.records import EntityId, EntityRef, Event, Evidence, NodeName, Sample
from storage.sqlite import SqliteStore


def _s(metric: str, value: float, at: float | None, entity: str = "GPU-a", node: str = "n1",
       **labels: str) -> Sample:
    return Sample(metric=metric, value=value, observed_at=at, node=NodeName(node),
                  entity=EntityId(entity), labels=labels)


@pytest.fixture
def store(tmp_path: Path):
    s = SqliteStore(path=tmp_path / "sub" / "db.sqlite", clock=FakeClock(now=500.0))
    yield s
    s.close()


def test_is_a_store_in_wal_mode(store: SqliteStore, tmp_path: Path) -> None:
    assert isinstance(store, Store)
    conn = sqlite3.connect(tmp_path / "sub" / "db.sqlite")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"series", "samples", "events"} <= tables
    conn.close()


def test_write_read_roundtrip_with_labels(store: SqliteStore) -> None:
    store.write([
        _s("gpu_temperature_celsius", 40.0, 100.0),
        _s("gpu_temperature_celsius", 41.5, 101.0),
        _s("gpu_temperature_celsius", 50.0, 100.0, entity="GPU-b"),
        _s("gpu_clock_event_active", 1.0, 100.0, reason="hw_slowdown"),
        _s("gpu_clock_event_active", 0.0, 100.0, reason="gpu_idle"),
    ], [])
    df = store.read("gpu_temperature_celsius", None, 0.0, 1000.0)
    assert list(df.columns) == ["observed_at", "node", "entity", "value"]
    assert df.to_dict("records") == [
        {"observed_at": 100.0, "node": "n1", "entity": "GPU-a", "value": 40.0},
        {"observed_at": 101.0, "node": "n1", "entity": "GPU-a", "value": 41.5},
        {"observed_at": 100.0, "node": "n1", "entity": "GPU-b", "value": 50.0},
    ]
    only_b = store.read("gpu_temperature_celsius",
                        [EntityRef(node=NodeName("n1"), entity=EntityId("GPU-b"))], 0.0, 1000.0)
    assert list(only_b["value"]) == [50.0]
    window = store.read("gpu_temperature_celsius", None, 100.5, 1000.0)
    assert list(window["value"]) == [41.5]
    clocks = store.read("gpu_clock_event_active", None, 0.0, 1000.0)
    assert "reason" in clocks.columns
    assert set(zip(clocks["reason"], clocks["value"], strict=True)) == {
        ("gpu_idle", 0.0), ("hw_slowdown", 1.0)}
    assert store.entities() == [EntityRef(node=NodeName("n1"), entity=EntityId("GPU-a")),
                                EntityRef(node=NodeName("n1"), entity=EntityId("GPU-b"))]


def test_step_averages_per_bucket(store: SqliteStore) -> None:
    store.write([_s("gpu_power_watts", float(v), 60.0 + v) for v in range(20)], [])
    df = store.read("gpu_power_watts", None, 0.0, 1000.0, step_seconds=10.0)
    assert list(df["observed_at"]) == [60.0, 70.0]
    assert list(df["value"]) == [4.5, 14.5]


def test_unstamped_samples_get_the_store_clock(store: SqliteStore) -> None:
    store.write([_s("gpu_power_watts", 3.0, None)], [])
    df = store.read("gpu_power_watts", None, 0.0, 1000.0)
    assert list(df["observed_at"]) == [500.0]


def test_events_roundtrip(store: SqliteStore) -> None:
    event = Event(kind="xid", code="79", node=NodeName("n1"), entity=EntityId("0000:b1:00.0"),
                  observed_at=123.0, message="fallen off the bus", attrs={"pid": "42"},
                  evidence=(Evidence(file="kern.log", line=3, text="NVRM: Xid ..."),),
                  source="kernel_log")
    store.write([], [event])
    assert store.read_events(0.0, 1000.0) == [event]


def test_empty_read_and_empty_write(store: SqliteStore) -> None:
    store.write([], [])
    df = store.read("gpu_power_watts", None, 0.0, 1.0)
    assert df.empty
    assert list(df.columns) == ["observed_at", "node", "entity", "value"]
    assert store.read("gpu_power_watts", [], 0.0, 1.0).empty


def test_series_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    first = SqliteStore(path=path)
    first.write([_s("gpu_power_watts", 1.0, 10.0)], [])
    first.close()
    second = SqliteStore(path=path)
    second.write([_s("gpu_power_watts", 2.0, 11.0)], [])
    assert list(second.read("gpu_power_watts", None, 0.0, 100.0)["value"]) == [1.0, 2.0]
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM series").fetchone()[0] == 1
    second.close()


def test_retention_prunes_old_rows(tmp_path: Path) -> None:
    clock = FakeClock(now=10_000.0)
    store = SqliteStore(path=tmp_path / "db.sqlite", retention_seconds=100.0, clock=clock)
    store.write([_s("gpu_power_watts", 1.0, 9_800.0), _s("gpu_power_watts", 2.0, 9_950.0)], [])
    assert list(store.read("gpu_power_watts", None, 0.0, 20_000.0)["value"]) == [2.0]
    store.close()


def test_locked_database_is_a_temporary_error(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    store = SqliteStore(path=path, busy_timeout_seconds=0.05)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(TemporaryError, match="locked"):
            store.write([_s("gpu_power_watts", 1.0, 10.0)], [])
    finally:
        other.execute("ROLLBACK")
        other.close()
    store.write([_s("gpu_power_watts", 1.0, 10.0)], [])
    assert len(store.read("gpu_power_watts", None, 0.0, 100.0)) == 1
    store.close()


def test_second_connection_reads_while_a_write_is_open(tmp_path: Path) -> None:
    # WAL: a reader (another process in production, another connection here) is not
    # blocked by the writer's open transaction and sees only committed rows.
    path = tmp_path / "db.sqlite"
    store = SqliteStore(path=path)
    store.write([_s("gpu_power_watts", 7.0, 10.0)], [])
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO samples (series_id, ts, value) VALUES (1, 20000, 8.0)")
    reader = SqliteStore(path=path, busy_timeout_seconds=0.05)
    try:
        assert reader.read("gpu_power_watts", None, 0, 100)["value"].tolist() == [7.0]
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        reader.close()
        store.close()


def test_chunks_tiers_late_data_and_raw_retention(tmp_path: Path) -> None:
    t0 = 1_699_999_200.0  # an hour boundary
    clock = FakeClock(now=t0 + 3 * 3600 + 10)
    store = SqliteStore(path=tmp_path / "db.sqlite", retention_seconds=2 * 3600.0,
                        downsample=((60.0, 86400.0),), clock=clock)
    store.write([_s("gpu_power_watts", float(i % 60), t0 + i) for i in range(3 * 3600)], [])
    conn = sqlite3.connect(tmp_path / "db.sqlite")
    # the first hour ended more than compact_delay_seconds (2 h) ago: compacted on write
    assert conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 2 * 3600
    store.compact()
    assert conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM chunks WHERE step = 60000").fetchone()[0] == 3
    # the first hour's raw chunk was pruned at once (raw retention 2 h); its minutes stay
    assert conn.execute("SELECT COUNT(*) FROM chunks WHERE step = 0").fetchone()[0] == 2
    # a late sample replaces the value of an already compacted window (last write wins)
    store.write([_s("gpu_power_watts", 99.0, t0 + 5000)], [])
    store.compact()
    raw = store.read("gpu_power_watts", None, t0, t0 + 4 * 3600)
    assert raw["observed_at"].min() >= clock() - 2 * 3600  # raw retention applies on read
    assert raw.loc[raw["observed_at"] == t0 + 5000, "value"].tolist() == [99.0]
    # older than raw retention: the 1-minute tier answers stepped reads
    hourly = store.read("gpu_power_watts", None, t0, t0 + 3 * 3600 - 1, step_seconds=3600)
    assert len(hourly) == 3
    assert hourly["value"].round(6).tolist()[0] == 29.5
    store.close()
    conn.close()


def test_a_reader_in_another_process_sees_head_and_chunks(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "db.sqlite"
    clock = FakeClock(now=1_700_000_000.0)
    store = SqliteStore(path=path, clock=clock)
    store.write([_s("gpu_power_watts", float(i), 1_699_990_000.0 + i) for i in range(100)], [])
    clock.advance(7200)
    store.compact()
    store.write([_s("gpu_power_watts", 5.0, 1_700_007_000.0)], [])
    code = ("from storage.sqlite import SqliteStore;"
            f"print(len(SqliteStore(path={str(path)!r}).read('gpu_power_watts', None, 0, 2e9)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "101"
    store.close()


def test_writing_the_same_event_twice_stores_it_once(tmp_path) -> None:
    """Imports and replays may write an event again; it is one event."""
    from core.records import Event
    from storage.sqlite import SqliteStore

    store = SqliteStore(path=str(tmp_path / "x.sqlite"))
    event = Event(kind="xid", code="79", node="n", entity="g",  # type: ignore[arg-type]
                  observed_at=1_796_000_000.0, message="GPU has fallen off the bus.")
    store.write([], [event])
    store.write([], [event])
    assert len(store.read_events(1_795_999_000.0, 1_796_001_000.0)) == 1
    store.close()
