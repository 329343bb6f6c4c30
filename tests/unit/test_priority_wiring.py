"""The wiring of priority-aware recovery (#16 items 8 and 10): ``[remediation.preemption]``
reaches the engine, and the work each incident hit reaches the incident history and the
weekly report."""

from __future__ import annotations

from pathlib import Path

from dashboards.report import ReportOptions, build_report
from gpuhealth.compose import guards
from gpuhealth.config import load_settings
from gpuhealth.history_sync import HistoryRecorder
from remediation.actions import INCIDENT_CLOSED, ActionStore, StoredIncident
from remediation.priority import WorkItem, work_to_json
from storage.history import IncidentHistory


def test_the_preemption_table_reaches_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "gpuhealth.toml"
    path.write_text('[remediation.preemption]\nenabled = true\ncritical_classes = ["hi"]\n')
    options = guards(load_settings(path, env={})).engine_options("ctl")
    assert options["preemption"].enabled
    assert options["preemption"].critical_classes == ("hi",)
    assert not guards(load_settings(None, env={})).engine_options("ctl")["preemption"].enabled


def test_the_work_hit_reaches_the_history_and_the_report(tmp_path: Path) -> None:
    store = ActionStore(None)
    store.open_incident(StoredIncident(
        incident="fp1", fingerprint="fp1", node="gpu-01", entity="GPU-1",  # type: ignore[arg-type]
        kind="xid", code="79", severity="critical", state=INCIDENT_CLOSED, opened_at=10_000.0,
        out_of_service_at=10_000.0, closed_at=17_200.0))
    store.set_work("fp1", work_to_json([
        WorkItem(kind="slurm_job", id="42", node="gpu-01", gpus=4, started_at=2_800.0,
                 priority=900, priority_class="high")]), at=10_000.0, who="t")
    history = IncidentHistory(tmp_path / "history.sqlite")
    HistoryRecorder(history).sync(store, 20_000.0)
    figures = build_report(history, ReportOptions(since=0.0, until=30_000.0),
                           now=lambda: 30_000.0)
    history.close()
    store.close()
    work = figures["sections"]["work"]
    assert (work["interrupted_jobs"], work["gpu_hours"]) == (1, 8.0)  # 4 GPUs x 2 h
    assert figures["sections"]["mttr"]["by_priority_class"]["high"]["median_hours"] == 2.0
