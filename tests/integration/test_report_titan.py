"""The report over the real Titan and LANL records reproduces the figures their SOURCE.md state.

Needs ``GPUHEALTH_TEST_DATA`` (CI: ``/work/shared/data``) holding
``titan-gpu-lifetimes/`` and ``lanl-failure-1996-2005/``; skipped when it is unset. The
data are read in place, never copied into the project.

Each assertion quotes the SOURCE.md line it checks; tolerances are the rounding of the
quoted figure (``~106,600`` h is checked to the nearest hundred, ``7.8 h`` to a tenth).
Titan's ``years`` are days / 365 (``gc_summary_loc.csv``: 843.938 days = 2.3122 years), so
GPU-years here are GPU-hours / 8,760.
"""

from __future__ import annotations

import csv
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dashboards.report import ReportOptions, build_report, render_markdown
from storage.history import IncidentHistory
from storage.importers import import_lanl, import_titan

DATA = os.environ.get("GPUHEALTH_TEST_DATA")
pytestmark = pytest.mark.skipif(not DATA, reason="GPUHEALTH_TEST_DATA is not set")

HOURS_PER_YEAR = 8760.0


def _data(name: str) -> Path:
    path = Path(str(DATA)) / name
    if not path.is_dir():
        pytest.fail(f"GPUHEALTH_TEST_DATA={DATA} has no {name}/")
    return path


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("history") / "history.sqlite"
    store = IncidentHistory(path)
    started = time.perf_counter()
    titan = import_titan(_data("titan-gpu-lifetimes"))
    lanl = import_lanl(_data("lanl-failure-1996-2005"))
    for result in (titan, lanl):
        store.upsert_inventory(result.inventory)
        store.upsert_incidents(result.incidents)
    store.import_seconds = time.perf_counter() - started  # type: ignore[attr-defined]
    store.titan_result = titan  # type: ignore[attr-defined]
    store.lanl_result = lanl  # type: ignore[attr-defined]
    yield store
    store.close()


@pytest.fixture(scope="module")
def titan(history: IncidentHistory) -> dict[str, Any]:
    return build_report(history, ReportOptions(source="titan", timezone="America/New_York"))


def _failure_events(path: Path) -> tuple[dict[tuple[str, str, str], int], int]:
    """Failure events counted straight from gc_full.csv by the rule of docs/report.md: the
    end of a residency (a row with an insert time and an event); an event row without an
    insert is a further report of the failure of the residency it falls in."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    spans: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for r in rows:
        if r["insert"] and r["event"]:
            spans[r["SN"], r["location"]].append((r["insert"], r["remove"]))
    events: dict[tuple[str, str, str], int] = defaultdict(int)
    folded = 0
    for r in rows:
        if not r["event"]:
            continue
        if not r["insert"] and any(a <= r["remove"] <= b
                                   for a, b in spans[r["SN"], r["location"]]):
            folded += 1  # ISO-like stamps compare as text
            continue
        events[r["SN"], r["location"], r["event"]] += 1
    return events, folded


def test_titan_import_counts(history: IncidentHistory) -> None:
    result = history.titan_result  # type: ignore[attr-defined]
    # "gc_full.csv — 37,343 rows"; no row is malformed.
    assert result.rows == 37_343
    events, folded = _failure_events(_data("titan-gpu-lifetimes") / "gc_full.csv")
    assert dict(result.skipped) == {"repeat_report": folded}
    assert folded == 1_048
    assert len(history.inventory(source="titan")) == 37_343 - folded  # residencies only
    incidents = history.incidents(source="titan")
    # One failure event per residency: 5,209 residencies ended by a DBE or OTB, and 110
    # event rows that fall in no residency (SOURCE.md's "6,367 failure events" are rows).
    assert len(incidents) == sum(events.values()) == 5_319
    # "`DBE` double-bit ECC error = 4,826 rows, `OTB` off-the-bus = 1,541 rows": every row
    # is in exactly one incident (its first report, or counted in its reports; a DBE row
    # before an off-the-bus end counts in that OTB failure).
    reports = incidents["attrs"].map(lambda a: int(dict(a).get("reports", "1")))
    assert int(reports.sum()) == 4_826 + 1_541
    by_code = incidents["code"].value_counts().to_dict()
    assert by_code == {
        "48": sum(n for (_, _, e), n in events.items() if e == "DBE"),
        "79": sum(n for (_, _, e), n in events.items() if e == "OTB")}
    # The GPU with 106 DBE rows within 69 minutes is one failure, with its 106 reports.
    worst = incidents[incidents["entity"] == "0323712022158"]
    assert len(worst) == 1
    assert int(dict(worst["attrs"].iloc[0])["reports"]) == 106
    # "30,207 distinct GPU serial numbers"; "batch old = original boards (18,837), new =
    # 2017 replacement boards (11,370)"
    inventory = history.inventory(source="titan")
    assert inventory["entity"].nunique() == 30_207
    batches = inventory.drop_duplicates("entity")["batch"].value_counts().to_dict()
    assert batches == {"old": 18_837, "new": 11_370}
    assert history.import_seconds < 30  # type: ignore[attr-defined]


def test_titan_report_reproduces_source_figures(titan: dict[str, Any]) -> None:
    s = titan["sections"]
    fleet = s["mtbf"]["fleet"]
    # "2013-11-19 .. 2019-08-01", "~100,889 GPU-years"
    assert titan["inputs"]["window_start"].startswith("2013-11-19")
    assert titan["inputs"]["window_end"].startswith("2019-08-02T00:07")  # 20:07 EDT + 1 s
    assert fleet["exposure_hours"] / HOURS_PER_YEAR == pytest.approx(100_889, rel=1e-3)
    assert fleet["units"] == 30_207
    # SOURCE.md's "7.8 h" between failures counts every failure row; counted as failure
    # events (one per residency, docs/report.md) the span has 5,319 of them: 9.4 h.
    assert round(fleet["system_mtbf_hours"], 1) == 9.4
    batches = {r["group"]: r for r in s["mtbf"]["by_batch"]}
    old, new = batches["old"], batches["new"]
    # "Old batch: 75,746 GPU-years, 6,226 DBE+OTB events" (rows) -> 5,183 failure events,
    # ~128,000 GPU-hours per failure; "new batch: 25,144 GPU-years, 141 events" -> 136,
    # ~1.62 M GPU-hours per failure.
    assert old["failures"] == 5_183
    assert old["exposure_hours"] / HOURS_PER_YEAR == pytest.approx(75_746, rel=1e-3)
    assert round(old["mtbf_hours"], -3) == 128_000
    assert new["failures"] == 136
    assert new["exposure_hours"] / HOURS_PER_YEAR == pytest.approx(25_144, rel=1e-3)
    assert round(new["mtbf_hours"] / 1e6, 2) == 1.62
    # The cohort comparison says the 2017 boards fail far less, with an interval.
    comparison = next(c for c in s["cohorts"]["comparisons"] if c["by"] == "batch")
    assert (comparison["candidate"], comparison["baseline"]) == ("new", "old")
    assert comparison["ratio_upper"] < 0.1
    assert comparison["rate_ratio"] == pytest.approx(128_021 / 1_619_566, rel=0.01)
    # "6,367 failure events, 5,089 GPUs retired"
    assert s["availability"]["retired_after_failure"] == 5_089
    # SOURCE.md's "Events per year (DBE/OTB): 2014 46/16, 2015 303/63, 2016 1912/699,
    # 2017 912/509, 2018 873/190, 2019 780/64" count rows; as failure events (years cut in
    # Oak Ridge time):
    per_year = {year: (row.get("memory", 0), row.get("gpu_lost", 0))
                for year, row in s["causes"]["by_period"].items()}
    assert per_year == {"2014": (31, 12), "2015": (150, 52), "2016": (1325, 651),
                        "2017": (830, 490), "2018": (811, 181), "2019": (728, 58)}


def test_titan_2017_2019_system_mtbf(history: IncidentHistory) -> None:
    # SOURCE.md's "2017-2019: 6.8 h" counts rows; as failure events, 7.3 h (from 1 January
    # 2017, Oak Ridge time, to the end of the data)
    since = pd.Timestamp("2017-01-01", tz="America/New_York").timestamp()
    until = pd.Timestamp("2019-08-01 20:07:34", tz="America/New_York").timestamp()
    figures = build_report(history, ReportOptions(since=since, until=until, source="titan"))
    assert round(figures["sections"]["mtbf"]["fleet"]["system_mtbf_hours"], 1) == 7.3


def test_titan_lemon_slots_match_an_independent_count(titan: dict[str, Any]) -> None:
    """"lemon slot" detection: slots where two or more different GPUs failed, counted here
    straight from gc_full.csv."""
    failed: dict[str, set[str]] = defaultdict(set)
    events: dict[str, int] = defaultdict(int)
    per_gpu, _ = _failure_events(_data("titan-gpu-lifetimes") / "gc_full.csv")
    for (sn, location, _event), count in per_gpu.items():
        failed[location].add(sn)
        events[location] += count
    expected = {slot for slot, serials in failed.items() if len(serials) >= 2}
    section = titan["sections"]["repeat_offenders"]
    assert section["lemon_slots_count"] == len(expected)
    assert {x["slot"] for x in section["lemon_slots"]} == expected
    top = section["lemon_slots"][0]
    assert top["entities"] == max(len(s) for s in failed.values())
    assert top["failures"] == events[top["slot"]]
    # The worst single GPU: 8 failure events at one location (its 106 DBE rows of
    # 2016-07-19 are one failure, see test_titan_import_counts).
    worst_gpu = max(per_gpu.items(), key=lambda item: item[1])
    assert section["entities"][0]["failures"] == 8
    assert worst_gpu[1] == 8


def test_lanl_reproduces_source_figures(history: IncidentHistory) -> None:
    result = history.lanl_result  # type: ignore[attr-defined]
    # "23,739 records"
    assert result.rows == 23_739
    assert len(history.incidents(source="lanl")) == 23_739
    figures = build_report(history, ReportOptions(source="lanl", timezone="America/Denver"))
    s = figures["sections"]
    # "Root-cause counts: Hardware 14,341 (CPU 5,931, Memory DIMM 2,880, Node Board 915, …),
    # Software 5,361, Undetermined 2,652, Network 421, Facilities 362, Human Error 149."
    kinds = s["causes"]["by_kind"]
    assert {k: kinds[k] for k in ("hardware", "software", "undetermined", "network",
                                  "facilities", "human_error")} == {
        "hardware": 14_341, "software": 5_361, "undetermined": 2_652, "network": 421,
        "facilities": 362, "human_error": 149}
    codes = {(c["kind"], c["code"]): c["failures"] for c in s["causes"]["top_codes"]}
    assert codes["hardware", "CPU"] == 5_931
    assert codes["hardware", "Memory Dimm"] == 2_880
    assert codes["hardware", "Node Board"] == 915
    assert s["causes"]["by_cause"]["memory"] == 2_880
    # "Median downtime 59 min."
    assert s["mttr"]["median_hours"] * 60 == pytest.approx(59.0)
    # "Biggest systems: 2 (7,104 records), 18 (3,997, 1,024 nodes), 19 (3,284, 1,024 nodes)"
    # "Rough system-level MTBF (span/records): sys 18 7.3 h, sys 19 7.7 h, sys 20 13.2 h."
    systems = {r["group"]: r for r in s["mtbf"]["by_model"]}
    assert systems["system-2"]["failures"] == 7_104
    assert (systems["system-18"]["failures"], systems["system-18"]["units"]) == (3_997, 1_024)
    assert (systems["system-19"]["failures"], systems["system-19"]["units"]) == (3_284, 1_024)
    assert round(systems["system-18"]["system_mtbf_hours"], 1) == 7.3
    assert round(systems["system-19"]["system_mtbf_hours"], 1) == 7.7
    assert round(systems["system-20"]["system_mtbf_hours"], 1) == 13.2


def test_whole_titan_report_renders(titan: dict[str, Any]) -> None:
    started = time.perf_counter()
    text = render_markdown(titan)
    assert time.perf_counter() - started < 10
    assert "| old | 18,837 |" in text
    assert "Titan: back in service is the time the next GPU was inserted" in text
