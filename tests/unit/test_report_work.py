"""The report's jobs and pods hit by failures, their GPU-hours, and MTTR by priority class.

Issue #16 items 8 and 10. The history below is small enough to check every figure by hand
(window: the week before 2026-11-30 06:00 UTC, cut per day):

========  ==========  =======  ========  =====================================  ========
incident  detected    back     kind      work on the node (GPUs, started)       class
========  ==========  =======  ========  =====================================  ========
i1        +10 h       +14 h    xid       job 101 (4, +4 h), job 102 (2, +9 h)   high
i2        +50 h       +52 h    xid       job 101 again, job 103 (1, +48 h)      high
i3        +90 h       (out)    gpu_lost  pod ml/train-0 (8, +80 h), ml/eval (1)  critical
i4        +100 h      +101 h   nvlink    nothing (idle node)                    none
i5        +120 h      +126 h   xid       not recorded                           -
prev      -20 h       -19 h    xid       job 999                                (before)
========  ==========  =======  ========  =====================================  ========

Interrupted: 101, 102, 103, ml/train-0, ml/eval = 5 (101 counted once, at i1).
GPU-hours: 101: 4 x (10 - 4) = 24; 102: 2 x 1 = 2; 103: 1 x 2 = 2; train-0: 8 x 10 = 80;
ml/eval has no start time: none. Total 108.
MTTR by class: high 4 h and 2 h (median 3); none 1 h; critical not repaired.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from dashboards.report import ReportOptions, build_report, render_markdown, summary
from remediation.priority import WorkItem, history_attrs, work_to_json
from storage.history import IncidentHistory, IncidentRecord

H = 3600.0
NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC).timestamp()
START = NOW - 7 * 24 * H


def job(job_id: str, gpus: int, started: float | None, qos: str, priority: int,
        kind: str = "slurm_job") -> WorkItem:
    return WorkItem(kind=kind, id=job_id, node="n", gpus=gpus,
                    started_at=None if started is None else START + started * H,
                    priority=priority, priority_class=qos)


def incident(name: str, detected: float, back: float | None, kind: str, cause: str,
             work: list[WorkItem] | None) -> IncidentRecord:
    attrs = history_attrs(None if work is None else work_to_json(work))
    return IncidentRecord(
        incident_id=name, node="node1", entity="GPU-1", kind=kind, code="79",
        severity="critical", cause=cause, detected_at=START + detected * H,
        out_of_service_at=START + detected * H,
        back_in_service_at=None if back is None else START + back * H,
        resolved_at=None if back is None else START + back * H, attrs=attrs)


@pytest.fixture
def figures(tmp_path: Path) -> dict[str, Any]:
    j101 = job("101", 4, 4, "high", 900)
    store = IncidentHistory(tmp_path / "history.sqlite")
    store.upsert_incidents([
        incident("i1", 10, 14, "xid", "xid", [j101, job("102", 2, 9, "low", 10)]),
        incident("i2", 50, 52, "xid", "xid", [j101, job("103", 1, 48, "low", 10)]),
        incident("i3", 90, None, "gpu_lost", "gpu_lost",
                 [job("ml/train-0", 8, 80, "critical", 100000, kind="pod"),
                  job("ml/eval", 1, None, "", 0, kind="pod")]),
        incident("i4", 100, 101, "nvlink", "nvlink", []),
        incident("i5", 120, 126, "xid", "xid", None),
        incident("prev", -20, -19, "xid", "xid", [job("999", 8, -30, "high", 900)]),
    ])
    try:
        return build_report(store, ReportOptions(since=START, until=NOW),
                            now=lambda: NOW)
    finally:
        store.close()


def test_interrupted_jobs_and_their_gpu_hours(figures: dict[str, Any]) -> None:
    w = figures["sections"]["work"]
    assert w["interrupted_jobs"] == 5
    assert w["gpu_hours"] == pytest.approx(108.0)
    assert w["jobs_without_gpu_hours"] == 1
    assert (w["incidents_with_work_data"], w["incidents_without_work_data"],
            w["incidents_on_idle_nodes"]) == (4, 1, 1)
    assert w["period"] == "day"
    assert w["by_period"] == {
        "2026-11-23": {"jobs": 2, "gpu_hours": pytest.approx(26.0)},
        "2026-11-25": {"jobs": 1, "gpu_hours": pytest.approx(2.0)},
        "2026-11-27": {"jobs": 2, "gpu_hours": pytest.approx(80.0)},
    }
    assert w["by_cause"] == {"gpu_lost": {"jobs": 2, "gpu_hours": pytest.approx(80.0)},
                             "xid": {"jobs": 3, "gpu_hours": pytest.approx(28.0)}}
    assert w["by_kind"] == {"gpu_lost": {"jobs": 2, "gpu_hours": pytest.approx(80.0)},
                            "xid": {"jobs": 3, "gpu_hours": pytest.approx(28.0)}}
    assert w["by_priority_class"] == {
        "critical": {"jobs": 1, "gpu_hours": pytest.approx(80.0)},
        "default": {"jobs": 1, "gpu_hours": 0.0},
        "high": {"jobs": 1, "gpu_hours": pytest.approx(24.0)},
        "low": {"jobs": 2, "gpu_hours": pytest.approx(4.0)},
    }
    assert any("no record of the work" in c for c in figures["caveats"])
    assert any("no known start time" in c for c in figures["caveats"])
    head = summary(figures)
    assert (head["interrupted_jobs"], head["gpu_hours_of_jobs_hit"]) == (5, 108.0)


def test_mttr_by_priority_class(figures: dict[str, Any]) -> None:
    by_class = figures["sections"]["mttr"]["by_priority_class"]
    assert set(by_class) == {"high", "critical", "none"}  # i5 recorded no work: not here
    assert by_class["high"]["repaired"] == 2
    assert by_class["high"]["median_hours"] == pytest.approx(3.0)
    assert by_class["high"]["mean_hours"] == pytest.approx(3.0)
    assert by_class["none"]["median_hours"] == pytest.approx(1.0)
    assert (by_class["critical"]["repaired"], by_class["critical"]["unrepaired"]) == (0, 1)
    assert by_class["critical"]["median_hours"] is None


def test_markdown_and_json_show_them(figures: dict[str, Any]) -> None:
    text = render_markdown(figures)
    assert "## Jobs and pods hit by failures" in text
    assert "| Interrupted jobs and pods (distinct) | 5 |" in text
    assert "| GPU-hours of the jobs hit (start to fault) | 108.0 |" in text
    assert "| high | 2 | 0 | 3.00 | 3.00 |" in text  # MTTR by priority class
    assert "| critical | 0 | 1 | n/a |" in text
    json.dumps(figures, allow_nan=False)


def test_no_work_recorded_says_so(tmp_path: Path) -> None:
    store = IncidentHistory(tmp_path / "h.sqlite")
    store.upsert_incidents([incident("x", 10, 12, "xid", "xid", None)])
    try:
        figures = build_report(store, ReportOptions(since=START, until=NOW), now=lambda: NOW)
    finally:
        store.close()
    w = figures["sections"]["work"]
    assert (w["interrupted_jobs"], w["gpu_hours"]) == (0, 0.0)
    assert "no incident of this window recorded the work" in w["note"]
    assert figures["sections"]["mttr"]["by_priority_class"] == {}
