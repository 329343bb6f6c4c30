"""``gpuhealth drill`` in dry-run: stages, SLOs, the drill marker, opt-out, budget, schedule."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from click.testing import CliRunner

from core.protocols import NodeInspector, SchedulerAdapter
from core.records import (
    ActionPhase,
    ActionRequest,
    AuditRecord,
    NodeName,
    NodeState,
    RemediationStep,
)
from gpuhealth.cli import main
from gpuhealth.config import load_settings
from gpuhealth.drill_cli import DrillOutcome, run_drill, schedule_drills
from remediation.actions import INCIDENT_OPEN, ActionStore, StoredIncident
from remediation.drill import (
    FAULTS,
    DrillTimeline,
    drill_adapter,
    judge,
    parse_slos,
    passed,
)
from remediation.dry_run import DryRunScheduler
from storage.history import IncidentHistory


def _config(tmp: Path, extra: str = "", remediation: str = "") -> Path:
    path = tmp / "gpuhealth.toml"
    path.write_text(f"""
[node]
name = "n1"
data_dir = "{tmp / 'data'}"

[analytics]
detectors = false
predictor = false

[inventory]
nvlink = "expected"

[remediation]
probation_seconds = 0.5
cluster_size = 10
max_disrupted_fraction = 0.1
{remediation}
{extra}
""")
    return path


def _drill(config: Path, *args: str) -> tuple[int, str, dict]:
    out = CliRunner().invoke(main, ["drill", "--config", str(config), "--json", *args])
    body = out.stdout[out.stdout.index("{"):] if "{" in out.stdout else "{}"
    return out.exit_code, out.output, json.loads(body)


def _stages(result: dict) -> dict[str, dict]:
    return {s["stage"]: s for s in result["stages"]}


def test_dry_run_xid79_times_every_stage_and_passes(tmp_path):
    config = _config(tmp_path)
    out = CliRunner().invoke(main, ["drill", "--config", str(config), "--node", "n1",
                                    "--kind", "xid79", "--slo", "detect=5s",
                                    "--slo", "total=30s", "--id", "t1"])
    assert out.exit_code == 0, out.output
    table = out.stdout
    for stage in ("detect", "alert", "cordon", "drain", "reboot", "validate", "resume",
                  "total"):
        assert any(line.startswith(stage) for line in table.splitlines()), table
    assert "drill t1 PASSED" in table
    assert "dry-run" in table
    result = json.loads((tmp_path / "data/drills/t1/result.json").read_text())
    stages = _stages(result)
    for stage in ("detect", "alert", "cordon", "drain", "reboot", "resume"):
        assert stages[stage]["status"] == "ok", stages
        assert stages[stage]["seconds"] is not None
    assert stages["reset_gpu"]["status"] == "skipped"
    assert stages["validate"]["status"] == "skipped"  # no [remediation.validation]
    assert stages["detect"]["seconds"] <= stages["cordon"]["seconds"] <= stages["resume"][
        "seconds"]
    assert stages["resume"]["seconds"] >= 0.5  # after probation


def test_an_impossible_slo_fails_with_a_non_zero_exit(tmp_path):
    code, output, result = _drill(_config(tmp_path), "--slo", "detect=0", "--id", "t2")
    assert code == 1, output
    assert result["passed"] is False
    assert _stages(result)["detect"]["status"] == "missed"
    assert "FAILED" in output
    # the drill still ran every stage to the end
    assert _stages(result)["resume"]["status"] == "ok"


def test_slos_from_the_file_and_the_command_line(tmp_path):
    config = _config(tmp_path, '[drill.slo]\ncordon = "1ms"\nresume = "1m"\n')
    code, output, result = _drill(config, "--slo", "cordon=10s", "--id", "t3")
    assert code == 0, output
    stages = _stages(result)
    assert stages["cordon"]["slo_seconds"] == 10.0  # the command line wins
    assert stages["resume"]["slo_seconds"] == 60.0


@pytest.mark.parametrize(("kind", "fix"), [("xid48", "reset_gpu"), ("nvlink", "reset_gpu")])
def test_gpu_faults_drain_the_gpu_and_reset_it(tmp_path, kind, fix):
    code, output, result = _drill(_config(tmp_path), "--kind", kind, "--id", f"t-{kind}")
    assert code == 0, output
    stages = _stages(result)
    assert stages["detect"]["status"] == stages[fix]["status"] == "ok", stages
    assert stages["reboot"]["status"] == "skipped"
    assert stages["resume"]["status"] == "skipped"  # the node itself never went out


def test_every_stage_carries_the_drill_marker(tmp_path):
    config = _config(tmp_path)
    code, output, _ = _drill(config, "--id", "mark1")
    assert code == 0, output
    folder = tmp_path / "data/drills/mark1"
    assert "gpuhealth-drill=mark1" in (folder / "kern.log").read_text()
    records = [json.loads(x) for x in (folder / "audit.jsonl").read_text().splitlines()]
    assert records
    assert all(r["details"]["drill"] == "mark1" for r in records)
    store = ActionStore(str(folder / "actions.db"))
    try:
        actions = store.actions()
        assert actions
        assert all(a.epoch.startswith("drill:mark1@") for a in actions if a.ref)
        assert {a.fingerprint for a in actions} == {r["details"]["fingerprint"]
                                                   for r in records if r["step"]}
    finally:
        store.close()
    # nothing of the drill went into the service's own trail or store
    assert not (tmp_path / "data/audit.jsonl").exists()
    assert not (tmp_path / "data/actions.db").exists()
    history = IncidentHistory(tmp_path / "data/history.sqlite")
    try:
        (row,) = history.incidents().to_dict("records")
    finally:
        history.close()
    assert row["attrs"]["drill"] == "mark1"
    assert row["attrs"]["drill_result"] == "passed"
    assert row["attrs"]["drill_mode"] == "dry-run"


def test_alerts_are_labelled_drill(tmp_path, monkeypatch):
    from alerting.testing import RecordingNotifier  # the stage's own fake

    settings = load_settings(_config(tmp_path))
    recorder = RecordingNotifier()
    monkeypatch.setattr("gpuhealth.compose.build_notifiers", lambda s: ([recorder], []))
    outcome = run_drill(settings, node="n1", kind="xid79", live=False, slos={},
                        drill_id="lab1")
    assert outcome.passed, outcome
    seen = [dict(a.labels) for a in recorder.sent]
    assert seen
    assert all(labels["drill"] == "lab1" for labels in seen), seen


def test_an_opted_out_node_is_refused(tmp_path):
    config = _config(tmp_path, remediation='opt_out_nodes = ["n1"]')
    code, output, result = _drill(config, "--id", "t4")
    assert code == 3, output
    assert "opted out" in result["refused"]
    assert not (tmp_path / "data/drills/t4/actions.db").exists()  # nothing was injected


def test_a_full_disruption_budget_refuses_the_drill(tmp_path):
    config = _config(tmp_path)  # 10 nodes x 0.1: one node may be out
    store = ActionStore(str(tmp_path / "data/actions.db"))
    try:
        store.open_incident(StoredIncident(
            incident="abc", fingerprint="abc", node=NodeName("n7"), entity="node", kind="xid",
            code="79", severity="critical", state=INCIDENT_OPEN, opened_at=1.0))
        store.update_incident("abc", out_of_service_at=2.0)
    finally:
        store.close()
    code, output, result = _drill(config, "--node", "n1", "--id", "t5")
    assert code == 3, output
    assert "disruption budget" in result["refused"]
    assert "n7" in result["refused"]
    # the node gpuhealth holds itself is not drilled either
    code, output, result = _drill(config, "--node", "n7", "--id", "t6")
    assert code == 3, output
    assert "already out of service" in result["refused"]


def test_a_hand_off_is_recorded_as_a_drill_and_never_made():
    inner = DryRunScheduler()
    adapter = drill_adapter(inner, "h1")
    request = ActionRequest(step=RemediationStep.HAND_OFF, node=NodeName("n1"),
                            entity="node", reason="gpuhealth: validation failed",  # type: ignore[arg-type]
                            idempotency_key="fp/hand_off", dry_run=False)
    loop = asyncio.new_event_loop()
    try:
        ref = loop.run_until_complete(adapter.submit(request))
        status = loop.run_until_complete(adapter.status(ref))
        cordon = loop.run_until_complete(adapter.submit(
            ActionRequest(step=RemediationStep.CORDON, node=NodeName("n1"), entity="node",  # type: ignore[arg-type]
                          reason="gpuhealth: GpuXid79", idempotency_key="fp/cordon")))
    finally:
        loop.close()
    assert status.phase == ActionPhase.SUCCEEDED
    assert "drill" in status.message
    assert [r.step for r in inner.requests] == [RemediationStep.CORDON]  # no hand-off made
    assert inner.requests[0].attrs["drill"] == "h1"
    assert inner.requests[0].reason == "gpuhealth: drill h1: GpuXid79"
    assert cordon.startswith("dry-run")
    assert len(adapter.handed_off) == 1
    assert adapter.handed_off[0].attrs["drill"] == "h1"
    # and the timeline fails the drill for it
    timeline = DrillTimeline(drill_id="h1", node="n1", fault=FAULTS["xid79"], injected_at=0.0)
    timeline.saw_audit([AuditRecord(
        at=1.0, actor="gpuhealth", decision="requested", step=RemediationStep.HAND_OFF,
        node=NodeName("n1"), entity="node", reason="validation failed",  # type: ignore[arg-type]
        idempotency_key="fp/hand_off", dry_run=False)])
    assert timeline.finished()
    assert not passed(judge(timeline, {}), timeline)


class _Inspecting(DryRunScheduler):
    async def node_state(self, node: NodeName, *, workload: bool = True) -> NodeState:
        return NodeState(node=node)


def test_the_wrapper_offers_what_the_adapter_offers():
    assert isinstance(drill_adapter(DryRunScheduler(), "x"), SchedulerAdapter)
    assert not isinstance(drill_adapter(DryRunScheduler(), "x"), NodeInspector)
    wrapped = drill_adapter(_Inspecting(), "x")
    assert isinstance(wrapped, NodeInspector)
    state = asyncio.run(wrapped.node_state(NodeName("n1")))  # type: ignore[attr-defined]
    assert state.node == "n1"


def test_a_stage_that_never_happens_fails_the_drill():
    timeline = DrillTimeline(drill_id="n", node="n1", fault=FAULTS["xid79"], injected_at=0.0)
    timeline.at.update({"detect": 1.0, "alert": 1.0})
    timeline.expected.update({"cordon", "drain", "reboot", "resume"})
    results = judge(timeline, {})
    by = {r.stage: r for r in results}
    assert by["cordon"].status == "never"
    assert by["total"].status == "never"
    assert not passed(results, timeline)


def test_bad_slos_and_kinds_are_usage_errors(tmp_path):
    config = _config(tmp_path)
    out = CliRunner().invoke(main, ["drill", "--config", str(config), "--slo", "bogus=1s"])
    assert out.exit_code == 64
    assert "unknown drill stage" in out.output
    out = CliRunner().invoke(main, ["drill", "--config", str(config), "--slo", "detect=soon"])
    assert out.exit_code == 64
    assert "not a duration" in out.output
    assert parse_slos(["reset=2s"]) == {"reset_gpu": 2.0}


def test_the_drill_section_is_checked_by_config_check(tmp_path):
    bad = _config(tmp_path, '[drill]\nschedule = "every monday"\n')
    out = CliRunner().invoke(main, ["config", "check", str(bad)])
    assert out.exit_code == 1, out.output
    assert "crontab" in out.output
    bad.write_text(bad.read_text().replace('schedule = "every monday"', "[drill.slo]\nx = 1"))
    out = CliRunner().invoke(main, ["config", "check", str(bad)])
    assert out.exit_code == 1, out.output
    assert "unknown drill stage" in out.output


def test_the_schedule_drills_the_nodes_in_turn(tmp_path):
    config = _config(tmp_path, '[drill]\nschedule = "0 3 * * mon"\nnodes = ["a", "b"]\n')
    settings = load_settings(config)
    ran: list[str] = []

    def run(node: str) -> DrillOutcome:
        ran.append(node)
        return DrillOutcome(drill_id="s", node=node, kind="xid79", live=False, passed=True)

    scheduler = BackgroundScheduler()
    job = schedule_drills(settings, scheduler, run=run)
    assert str(job.trigger).startswith("cron[")
    assert "day_of_week='mon'" in str(job.trigger)
    assert "hour='3'" in str(job.trigger)
    for _ in range(3):
        job.func()
    assert ran == ["a", "b", "a"]
    (tmp_path / "off").mkdir()
    off = load_settings(_config(tmp_path / "off"))
    with pytest.raises(Exception, match="not scheduled by default"):
        schedule_drills(off, scheduler, run=run)


def test_the_report_counts_drills_as_drills_never_as_failures(tmp_path):
    from dashboards.report import ReportOptions, build_report, render_html, render_markdown

    config = _config(tmp_path)
    assert _drill(config, "--id", "rep-ok")[0] == 0
    assert _drill(config, "--id", "rep-bad", "--slo", "detect=0")[0] == 1
    history = IncidentHistory(tmp_path / "data/history.sqlite")
    try:
        figures = build_report(history, ReportOptions(since=0.0))
    finally:
        history.close()
    s = figures["sections"]
    assert s["mtbf"]["fleet"]["failures"] == 0  # no failure counted
    assert figures["inputs"]["incidents_total"] == 0
    assert figures["inputs"]["drills_total"] == 2
    drills = s["drills"]
    assert (drills["drills"], drills["passed"], drills["failed"]) == (2, 1, 1)
    by_id = {r["drill"]: r for r in drills["rows"]}
    assert by_id["rep-bad"]["missed"] == ["detect"]
    assert by_id["rep-ok"]["mode"] == "dry-run"
    assert by_id["rep-ok"]["stages_seconds"]["resume"] > 0
    text = render_markdown(figures)
    assert "## Drills (synthetic faults, never counted as failures)" in text
    assert "| rep-bad | n1 | xid79 | dry-run |" in text
    page = render_html(figures, plots=False)
    assert "Drills (synthetic faults, never counted as failures)" in page
    assert "rep-ok" in page


def test_a_step_waiting_for_approval_fails_the_drill_at_once():
    timeline = DrillTimeline(drill_id="ap", node="n1", fault=FAULTS["xid79"], injected_at=0.0)
    timeline.at.update({"detect": 1.0, "alert": 1.0})
    timeline.expected.add("reboot")
    assert not timeline.finished()
    timeline.saw_audit([AuditRecord(
        at=1.0, actor="drill:ap", decision="awaiting_approval", step=RemediationStep.REBOOT,
        node=NodeName("n1"), entity="node",  # type: ignore[arg-type]
        reason="waits for a human's approval", idempotency_key="fp/reboot", dry_run=False)])
    assert timeline.finished()
    assert "approval" in timeline.problems[0]
    assert not passed(judge(timeline, {}), timeline)


def test_dry_run_flag_wins_over_a_live_file(tmp_path):
    # [drill] live = true with the dry-run adapter would be refused as a bad configuration
    config = _config(tmp_path, "[drill]\nlive = true\n")
    code, output, _ = _drill(config, "--id", "lv1")
    assert code == 78, output
    assert "a live drill needs a [remediation] scheduler" in output
    code, output, result = _drill(config, "--id", "lv2", "--dry-run")
    assert code == 0, output
    assert result["mode"] == "dry-run"


def test_notify_false_keeps_the_drills_alerts_in_the_log(tmp_path, monkeypatch):
    from alerting.testing import RecordingNotifier

    settings = load_settings(_config(tmp_path, "[drill]\nnotify = false\n"))
    recorder = RecordingNotifier()
    monkeypatch.setattr("gpuhealth.compose.build_notifiers",
                        lambda s: ([recorder] if s is settings else [], []))
    outcome = run_drill(settings, node="n1", kind="xid79", live=False, slos={},
                        drill_id="quiet")
    assert outcome.passed, outcome
    assert recorder.sent == []


def test_an_unreadable_service_store_refuses_the_drill(tmp_path):
    config = _config(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/actions.db").write_text("not a database")
    code, output, result = _drill(config, "--id", "ur1")
    assert code == 3, output
    assert "disruption budget is unknown" in result["refused"]
