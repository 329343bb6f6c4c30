"""The incident history store and the Titan/LANL importers, on hand-made slices."""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from core.errors import ArtifactError, TemporaryError
from storage.history import (
    CAUSES,
    INCIDENT_COLUMNS,
    INVENTORY_COLUMNS,
    IncidentHistory,
    IncidentRecord,
    InventoryRecord,
    PredictionRecord,
    cause_of,
)
from storage.importers import import_lanl, import_titan

FIXTURES = Path(__file__).parents[1] / "fixtures" / "history"


def utc(year: int, month: int, day: int, hour: int = 0) -> float:
    return datetime(year, month, day, hour, tzinfo=UTC).timestamp()


def incident(incident_id: str = "i1", *, detected_at: float = 1000.0, source: str = "gpuhealth",
             **kw: object) -> IncidentRecord:
    base: dict[str, object] = {
        "node": "n1", "entity": "GPU-1", "kind": "xid", "code": "79", "severity": "critical",
        "cause": "gpu_lost", "out_of_service_at": detected_at,
        "back_in_service_at": detected_at + 60, "resolved_at": detected_at + 60}
    base.update(kw)
    return IncidentRecord(incident_id=incident_id, detected_at=detected_at, source=source,
                          **base)  # type: ignore[arg-type]


def residency(entity: str, first: float | None, last: float, **kw: object) -> InventoryRecord:
    base: dict[str, object] = {"node": "n1", "model": "H100", "driver_version": "550.54",
                               "vbios_version": "96.00", "slot": "0000:1b:00.0",
                               "removed_at": None}
    base.update(kw)
    return InventoryRecord(entity=entity, first_seen_at=first, last_seen_at=last,
                           **base)  # type: ignore[arg-type]


@pytest.fixture
def history(tmp_path: Path):
    store = IncidentHistory(tmp_path / "h" / "history.sqlite")
    yield store
    store.close()


def test_cause_of_maps_xids_kinds_and_lanl_subcauses() -> None:
    assert cause_of("xid", "48") == "memory"
    assert cause_of("xid", "94") == "memory"
    assert cause_of("xid", "74") == "nvlink"
    assert cause_of("xid", "79") == "gpu_lost"
    assert cause_of("xid", "13") == "xid"
    assert cause_of("xid", "not-a-number") == "xid"
    assert cause_of("ecc", "dbe") == "memory"
    assert cause_of("ib_port", "down") == "network"
    assert cause_of("throttle", "hw_slowdown") == "thermal"
    assert cause_of("hardware", "Memory Dimm") == "memory"
    assert cause_of("hardware", "Power Supply") == "power"
    assert cause_of("hardware", "CPU") == "host"
    assert cause_of("facilities", "Chillers") == "thermal"
    assert cause_of("facilities", "UPS") == "power"
    assert cause_of("network", "Network") == "network"
    assert cause_of("something_new", "") == "other"
    assert set(CAUSES) >= {cause_of(k, c) for k, c in [("xid", "1"), ("pcie", "aer")]}


def test_records_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="cause 'disk'"):
        incident(cause="disk")
    with pytest.raises(ValueError, match="probability"):
        PredictionRecord(entity="g", node="n", at=1.0, probability=1.5, horizon_seconds=60)
    with pytest.raises(ValueError, match="horizon_seconds"):
        PredictionRecord(entity="g", node="n", at=1.0, probability=0.5, horizon_seconds=0)


def test_round_trip_and_upsert_replaces(history: IncidentHistory) -> None:
    first = incident("i1", detected_at=100.0, actions=("drain", "reset"),
                     attrs={"approval": "approved"}, predicted_at=40.0, model="H100")
    assert history.upsert_incidents([first, incident("i2", detected_at=200.0)]) == 2
    history.upsert_incidents([incident("i2", detected_at=250.0, cause="memory", code="48")])
    frame = history.incidents()
    assert list(frame.columns) == list(INCIDENT_COLUMNS)
    assert list(frame["incident_id"]) == ["i1", "i2"]
    row = frame.iloc[0]
    assert row["actions"] == ("drain", "reset")
    assert row["attrs"] == {"approval": "approved"}
    assert row["predicted_at"] == 40.0
    assert row["model"] == "H100"
    assert frame.iloc[1]["detected_at"] == 250.0
    assert frame.iloc[1]["cause"] == "memory"


def test_time_range_and_source_filters(history: IncidentHistory) -> None:
    history.upsert_incidents([incident("a", detected_at=100.0),
                              incident("b", detected_at=200.0, source="titan"),
                              incident("c", detected_at=300.0)])
    assert list(history.incidents(since=100.0, until=300.0)["incident_id"]) == ["a", "b"]
    assert list(history.incidents(since=150.0)["incident_id"]) == ["b", "c"]
    assert list(history.incidents(source="titan")["incident_id"]) == ["b"]
    assert history.incidents(since=1e9).empty
    assert list(history.incidents(since=1e9).columns) == list(INCIDENT_COLUMNS)
    assert history.sources() == ["gpuhealth", "titan"]


def test_inventory_overlap_and_unknown_start(history: IncidentHistory) -> None:
    history.upsert_inventory([
        residency("g1", 0.0, 100.0),
        residency("g2", 50.0, 500.0),
        residency("g3", None, 80.0, slot="s3"),
        residency("g4", 600.0, 700.0),
    ])
    frame = history.inventory(since=90.0, until=550.0)
    assert list(frame.columns) == list(INVENTORY_COLUMNS)
    assert sorted(frame["entity"]) == ["g1", "g2"]
    # A residency without a start is returned when its end is in range.
    assert sorted(history.inventory(since=10.0, until=90.0)["entity"]) == ["g1", "g2", "g3"]
    # Same key (source, entity, node, slot, start): replaced, not duplicated.
    history.upsert_inventory([residency("g1", 0.0, 150.0)])
    assert len(history.inventory()) == 4
    assert history.inventory()["last_seen_at"].max() == 700.0


def test_predictions_round_trip(history: IncidentHistory) -> None:
    history.record_predictions([
        PredictionRecord(entity="GPU-1", node="n1", at=10.0, probability=0.8,
                         horizon_seconds=3600, top_features={"ecc_sbe_rate": 0.6}),
        PredictionRecord(entity="GPU-2", node="n1", at=20.0, probability=0.1,
                         horizon_seconds=3600),
    ])
    frame = history.predictions(since=0.0, until=15.0)
    assert list(frame["entity"]) == ["GPU-1"]
    assert frame.iloc[0]["top_features"] == {"ecc_sbe_rate": 0.6}


def test_reader_in_another_connection_sees_committed_rows(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    writer = IncidentHistory(path)
    reader = IncidentHistory(path)
    try:
        writer.upsert_incidents([incident("x")])
        assert list(reader.incidents()["incident_id"]) == ["x"]
    finally:
        writer.close()
        reader.close()


def test_locked_database_is_a_temporary_error(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    store = IncidentHistory(path, timeout_seconds=0.05)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(TemporaryError, match="locked"):
            store.upsert_incidents([incident("y")])
        other.execute("ROLLBACK")
        assert store.upsert_incidents([incident("y")]) == 1
    finally:
        other.close()
        store.close()


_OLD_SCHEMA = """
CREATE TABLE incidents (
    incident_id TEXT PRIMARY KEY, source TEXT NOT NULL, node TEXT NOT NULL,
    entity TEXT NOT NULL, kind TEXT NOT NULL, code TEXT NOT NULL, severity TEXT NOT NULL,
    cause TEXT NOT NULL, detected_at REAL NOT NULL, out_of_service_at REAL,
    back_in_service_at REAL, resolved_at REAL, model TEXT NOT NULL,
    driver_version TEXT NOT NULL, vbios_version TEXT NOT NULL, slot TEXT NOT NULL,
    batch TEXT NOT NULL, predicted_at REAL, actions TEXT NOT NULL, attrs TEXT NOT NULL
);
CREATE INDEX incidents_detected ON incidents (detected_at);
CREATE TABLE inventory (
    key TEXT PRIMARY KEY, source TEXT NOT NULL, entity TEXT NOT NULL, node TEXT NOT NULL,
    model TEXT NOT NULL, driver_version TEXT NOT NULL, vbios_version TEXT NOT NULL,
    slot TEXT NOT NULL, batch TEXT NOT NULL, first_seen_at REAL, last_seen_at REAL NOT NULL,
    removed_at REAL, attrs TEXT NOT NULL
);
CREATE TABLE predictions (
    entity TEXT NOT NULL, node TEXT NOT NULL, at REAL NOT NULL, probability REAL NOT NULL,
    horizon_seconds REAL NOT NULL, top_features TEXT NOT NULL,
    PRIMARY KEY (entity, node, at)
);
INSERT INTO incidents VALUES ('old', 'gpuhealth', 'n1', 'GPU-1', 'xid', '79', 'critical',
    'gpu_lost', 1000.0, 1000.0, 1060.0, 1060.0, '', '', '', '', '', NULL, '["drain"]', '{}');
INSERT INTO predictions VALUES ('GPU-1', 'n1', 900.0, 0.8, 3600.0, '{"ecc": 0.5}');
"""


def test_a_history_file_of_an_older_release_is_adopted(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    old = sqlite3.connect(path)
    old.executescript(_OLD_SCHEMA)
    old.close()
    with IncidentHistory(path) as store:
        frame = store.incidents()
        assert list(frame["incident_id"]) == ["old"]
        assert frame.iloc[0]["actions"] == ("drain",)
        assert list(store.predictions()["probability"]) == [0.8]
        store.upsert_incidents([incident("old", resolved_at=2000.0), incident("new")])
        both = store.incidents()
        assert list(zip(both["incident_id"], both["resolved_at"], strict=True)) == [
            ("new", 1060.0), ("old", 2000.0)]
    with IncidentHistory(path) as again:  # migrated once
        assert len(again.incidents()) == 2
    conn = sqlite3.connect(path)
    try:
        tables = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()
    assert {"history_incidents", "history_inventory", "history_predictions"} <= tables
    assert not tables & {"incidents", "inventory", "predictions"}


def test_bulk_insert_is_fast(history: IncidentHistory) -> None:
    """40k residencies and 7k incidents (Titan's size) in one call each."""
    residencies = [residency(f"g{i}", float(i), float(i) + 1e6, node=f"n{i // 2}")
                   for i in range(40_000)]
    incidents = [incident(f"i{i}", detected_at=float(i)) for i in range(7_000)]
    started = time.perf_counter()
    history.upsert_inventory(residencies)
    history.upsert_incidents(incidents)
    elapsed = time.perf_counter() - started
    assert len(history.inventory()) == 40_000
    assert elapsed < 10.0, f"bulk insert took {elapsed:.1f} s"


# ------------------------------------------------------------------------------ Titan


def test_titan_slice() -> None:
    result = import_titan(FIXTURES / "titan")
    assert result.rows == 7
    assert result.skipped == {"service_slot": 1}
    assert len(result.inventory) == 6
    assert len(result.incidents) == 3
    by_id = {i.entity + "@" + i.slot: i for i in result.incidents}
    dbe = by_id["0320000000001@c0-0c0s1n0"]
    assert (dbe.kind, dbe.code, dbe.cause, dbe.batch) == ("xid", "48", "memory", "old")
    # EST (UTC-5): 2014-01-11 00:00 local is 05:00 UTC; the slot's next GPU came a day later.
    assert dbe.detected_at == utc(2014, 1, 11, 5)
    assert dbe.back_in_service_at == utc(2014, 1, 12, 5)
    otb = by_id["0320000000002@c0-0c0s1n0"]
    assert (otb.code, otb.cause, otb.attrs["removed_from_system"]) == ("79", "gpu_lost", "true")
    assert otb.back_in_service_at == utc(2014, 2, 2, 5)
    lost_start = by_id["0320000000005@c0-0c0s2n1"]
    assert lost_start.back_in_service_at is None
    residencies = {(r.entity, r.slot): r for r in result.inventory}
    assert residencies["0320000000005", "c0-0c0s2n1"].first_seen_at is None
    moved = residencies["0320000000001", "c0-0c0s3n1"]
    assert moved.first_seen_at == utc(2014, 1, 15, 5)
    assert moved.removed_at is None
    assert residencies["0320000000002", "c0-0c0s1n0"].removed_at == utc(2014, 2, 1, 5)
    assert residencies["0320000000003", "c0-0c0s1n0"].batch == "new"
    assert all(r.model == "Tesla K20X" and r.source == "titan" for r in result.inventory)


def test_titan_durations_match_the_duration_column() -> None:
    result = import_titan(FIXTURES / "titan" / "gc_full.csv")
    by_key = {(r.entity, r.slot): r for r in result.inventory}
    a1 = by_key["0320000000001", "c0-0c0s1n0"]
    assert a1.first_seen_at is not None
    assert a1.last_seen_at - a1.first_seen_at == 864000


def _titan_copy(tmp_path: Path, extra: str) -> Path:
    folder = tmp_path / "titan"
    folder.mkdir()
    text = (FIXTURES / "titan" / "gc_full.csv").read_text()
    (folder / "gc_full.csv").write_text(text + extra)
    return folder


@pytest.mark.parametrize(("extra", "reason", "message"), [
    ("0320000000009,c1-0c0s1n0,2014-01-01 00:00:00,yesterday,1,FALSE,\n", "bad_time",
     "bad insert/remove time"),
    ("0320000000009,c1-0c0s1n0,2014-01-01 00:00:00,2014-01-02 00:00:00,1,FALSE,XID\n",
     "bad_event", "unknown event 'XID'"),
    ("0320000000009,c1-0c0s1n0,2014-01-01 00:00:00\n", "bad_columns", "3 fields where"),
    ("0320000000009,c1-0c0s1n0,2014-01-03 00:00:00,2014-01-02 00:00:00,1,FALSE,\n",
     "bad_time", "insert is after remove"),
])
def test_titan_malformed_rows(tmp_path: Path, extra: str, reason: str, message: str) -> None:
    folder = _titan_copy(tmp_path, extra)
    with pytest.raises(ArtifactError, match=message) as info:
        import_titan(folder)
    assert info.value.line == 9
    assert str(info.value).startswith(f"{folder / 'gc_full.csv'}:9: ")
    lenient = import_titan(folder, strict=False)
    assert lenient.skipped[reason] == 1
    assert len(lenient.incidents) == 3
    assert lenient.problems[0].startswith(f"{folder / 'gc_full.csv'}:9: ")


def test_titan_missing_column_and_file(tmp_path: Path) -> None:
    (tmp_path / "gc_full.csv").write_text("SN,location,insert\n1,c0,2014-01-01 00:00:00\n")
    with pytest.raises(ArtifactError, match=r"gc_full.csv:1: missing column\(s\) remove"):
        import_titan(tmp_path)
    with pytest.raises(ArtifactError, match="no such file"):
        import_titan(tmp_path / "absent")


def test_titan_import_into_history_keeps_every_row(history: IncidentHistory) -> None:
    result = import_titan(FIXTURES / "titan")
    history.upsert_inventory(result.inventory)
    history.upsert_incidents(result.incidents)
    history.upsert_inventory(result.inventory)  # a second import changes nothing
    assert len(history.inventory(source="titan")) == 6
    assert len(history.incidents(source="titan")) == 3


# ------------------------------------------------------------------------------- LANL


def test_lanl_slice() -> None:
    result = import_lanl(FIXTURES / "lanl")
    assert result.rows == 5
    assert len(result.incidents) == 5
    assert result.skipped == {"node_unknown_kept_as_system": 1}
    kinds = [(i.node, i.kind, i.code, i.cause) for i in result.incidents]
    assert kinds == [
        ("lanl-s18-n0", "hardware", "Memory Dimm", "memory"),
        ("lanl-s18-n1", "software", "OS", "host"),
        ("lanl-s18-n1", "facilities", "Power Outage", "power"),
        ("lanl-s18-n2", "unrecorded", "", "other"),
        ("lanl-s17", "undetermined", "Unresolvable", "other"),
    ]
    first = result.incidents[0]
    # MST (UTC-7): 1/10/2003 10:00 local is 17:00 UTC.
    assert first.detected_at == utc(2003, 1, 10, 17)
    assert first.back_in_service_at == utc(2003, 1, 10, 18)
    assert first.entity == "node"
    assert first.model == "system-18"
    power = result.incidents[2]
    assert power.back_in_service_at == power.detected_at + 120 * 60  # from Down Time
    nodes = sorted(r.node for r in result.inventory)
    assert nodes == ["lanl-s17", "lanl-s18-n0", "lanl-s18-n1", "lanl-s18-n2", "lanl-s18-n3"]
    s18 = [r for r in result.inventory if r.model == "system-18"]
    assert {r.first_seen_at for r in s18} == {utc(2003, 1, 10, 17)}
    assert {r.last_seen_at for r in s18} == {utc(2003, 2, 3, 20)}


def test_lanl_malformed_row(tmp_path: Path) -> None:
    text = (FIXTURES / "lanl" / "LA-UR-05-7318-sample.csv").read_text()
    bad = text + "18,cluster,4,16,4,3,3,2-Mar,2-May,current,part,16,1,1,2,compute,13/45/2003 " \
                 "8:00,,30,,CPU,,,,,No\n"
    path = tmp_path / "LA-UR-05-7318-bad.csv"
    path.write_text(bad)
    with pytest.raises(ArtifactError, match="bad nodenumz, time or Down Time") as info:
        import_lanl(path)
    assert info.value.line == 7
    lenient = import_lanl(tmp_path, strict=False)
    assert lenient.skipped["bad_value"] == 1
    assert len(lenient.incidents) == 5


@pytest.mark.parametrize(("change", "why"), [
    ({0: "banana"}, "System must be a number"),
    ({18: "-6"}, "negative or non-finite Down Time"),
    ({16: "2/3/2030 8:00"}, "after the data set's end"),
])
def test_lanl_garbage_values_are_refused(tmp_path: Path, change: dict[int, str],
                                         why: str) -> None:
    text = (FIXTURES / "lanl" / "LA-UR-05-7318-sample.csv").read_text()
    good = ("18,cluster,4,16,4,3,3,2-Mar,2-May,current,part,16,1,1,2,compute,3/4/2003 "
            "8:00,,30,,CPU,,,,,No")
    fields = good.split(",")
    for index, value in change.items():
        fields[index] = value
    path = tmp_path / "LA-UR-05-7318-bad.csv"
    path.write_text(text + ",".join(fields) + "\n")
    with pytest.raises(ArtifactError, match=why):
        import_lanl(path)
