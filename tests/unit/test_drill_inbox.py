"""The agent's drill inbox and the controller's drill marking (``gpuhealth drill --fleet``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

import pytest

from alerting.alerts import alert_labels
from collectors.drill_inbox import DrillInbox, DrillRefused, read_drill_line
from core.drill import drill_of_evidence, drill_of_text
from core.records import (
    Action,
    ActionPhase,
    ActionRequest,
    ActionStatus,
    EntityId,
    Event,
    Evidence,
    Finding,
    NodeName,
    RemediationStep,
    Severity,
)
from remediation.drill import (
    FAULTS,
    drill_line,
    fleet_drill_adapter,
    held_from_actions,
    mark_drill_decisions,
    write_inbox,
)
from remediation.policy import Decision, PlannedStep, PolicyResult

MARKED = drill_line(FAULTS["xid79"], drill_id="d1", bus="0000:b1:00")
UNMARKED = "NVRM: Xid (PCI:0000:b1:00): 79, pid=1, GPU has fallen off the bus."


def test_a_marked_line_is_read_by_the_kernel_log_parser() -> None:
    events = read_drill_line(MARKED.encode(), node="n1", name="d1.line", clock=lambda: 5.0)
    assert [(e.kind, e.code, e.node, e.entity) for e in events] == [
        ("xid", "79", "n1", "0000:b1:00.0")]
    assert events[0].observed_at == 5.0
    assert events[0].source == "kernel_log"
    assert drill_of_evidence(events[0].evidence) == "d1"
    assert events[0].evidence[0].file == "drill-inbox/d1.line"


@pytest.mark.parametrize(("data", "why"), [
    (UNMARKED.encode(), "gpuhealth-drill=<id>"),
    (UNMARKED.encode() + b" gpuhealth-drill=", "gpuhealth-drill=<id>"),
    (b"gpuhealth-drill=d1 " + UNMARKED.encode(), "gpuhealth-drill=<id>"),  # not at the end
    (b"\xff\xfe binary", "not UTF-8"),
    (b"", "0 lines"),
    ((MARKED + "\n" + MARKED).encode(), "2 lines"),
    (b"x" * 5000, "at most 4096"),
    (b"hello world gpuhealth-drill=d1", "finds no fault"),
])
def test_a_bad_injected_line_is_refused_with_a_clear_reason(data: bytes, why: str) -> None:
    with pytest.raises(DrillRefused, match=why.replace("(", r"\(")):
        read_drill_line(data, node="n1", name="x.line")


def test_a_syslog_line_naming_a_host_stays_this_agents() -> None:
    line = "Apr  5 21:29:39 other-host kernel: " + MARKED
    events = read_drill_line(line.encode(), node="n1", name="x.line")
    assert {e.node for e in events} == {"n1"}  # never a finding about another node


def test_the_inbox_takes_good_files_refuses_bad_ones_and_never_raises(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    inbox = DrillInbox(node="n1", folder=tmp_path / "drill-inbox", clock=lambda: 7.0)
    assert inbox.collect() == []
    write_inbox(tmp_path, line=MARKED, drill_id="d1")
    (tmp_path / "drill-inbox" / "fake.line").write_text(UNMARKED + "\n")
    (tmp_path / "drill-inbox" / "junk.line").write_bytes(b"\x00\xff" * 10)
    (tmp_path / "drill-inbox" / "dir.line").mkdir()  # not a file: left alone
    with caplog.at_level(logging.ERROR):
        records = inbox.collect()
    assert [(r.kind, r.code) for r in records if isinstance(r, Event)] == [("xid", "79")]
    assert (inbox.taken, inbox.refused) == (1, 2)
    folder = tmp_path / "drill-inbox"
    assert (folder / "d1.taken").exists()
    assert not (folder / "d1.line").exists()
    assert (folder / "fake.refused").exists()
    assert (folder / "junk.refused").exists()
    assert "only a line marked as a drill" in (folder / "fake.why").read_text()
    assert "not UTF-8" in (folder / "junk.why").read_text()
    assert "fake.line refused" in caplog.text
    assert inbox.collect() == []  # each file once


def test_an_inbox_file_that_cannot_be_moved_is_skipped_not_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inbox = DrillInbox(node="n1", folder=tmp_path / "drill-inbox")
    write_inbox(tmp_path, line=MARKED, drill_id="d2")

    def refuse(self: Path, target: Path) -> Path:
        raise PermissionError("read-only")

    monkeypatch.setattr(Path, "replace", refuse)
    assert inbox.collect() == []  # not taken (it could not be marked taken): no event
    assert inbox.collect() == []


def test_an_unwritable_inbox_folder_does_not_stop_the_agent(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    inbox = DrillInbox(node="n1", folder=tmp_path / "file" / "drill-inbox")
    assert inbox.collect() == []


def test_the_marker_is_read_only_at_the_end_of_a_line() -> None:
    assert drill_of_text(MARKED) == "d1"
    assert drill_of_text(MARKED + "  ") == "d1"
    assert drill_of_text("x gpuhealth-drill=d1 then more") == ""
    assert drill_of_text("xgpuhealth-drill=d1") == ""
    assert drill_of_text("x gpuhealth-drill=-bad") == ""


def test_an_nvml_fault_cannot_go_through_the_inbox() -> None:
    with pytest.raises(ValueError, match="kernel-log faults only"):
        drill_line(FAULTS["nvlink"], drill_id="d1", bus="0000:b1:00")


def _finding(text: str) -> Finding:
    return Finding(node=NodeName("n1"), entity=EntityId("0000:b1:00.0"), kind="xid",
                   code="79", severity=Severity.CRITICAL, action=Action.REBOOT_NODE,
                   summary="fell off the bus", evidence=(Evidence(file="k", line=1,
                                                                  text=text),),
                   source="test")


def test_a_drill_finding_gets_the_drill_label_and_its_own_fingerprint() -> None:
    real, drill = alert_labels(_finding(UNMARKED)), alert_labels(_finding(MARKED))
    assert "drill" not in real
    assert drill == {**real, "drill": "d1"}


def test_decisions_of_drill_alerts_are_marked_and_others_left_alone() -> None:
    def decision(fp: str) -> Decision:
        request = ActionRequest(step=RemediationStep.CORDON, node=NodeName("n1"),
                                entity=EntityId("node"), reason="gpuhealth: GpuXid79",
                                idempotency_key=f"{fp}/cordon", attrs={"scope": "node"})
        return Decision(at=1.0, actor="t", decision="requested", node=NodeName("n1"),
                        planned=PlannedStep(step=RemediationStep.CORDON,
                                            entity=EntityId("node")),
                        reason="r", idempotency_key=f"{fp}/cordon", fingerprint=fp,
                        dry_run=False, incident=1,
                        request=request)

    result = PolicyResult(decisions=[decision("fp-drill"), decision("fp-real")])
    marked = mark_drill_decisions(result, {"fp-drill": "d1"})
    drill, real = marked.decisions
    assert drill.request is not None
    assert real.request is not None
    assert drill.request.attrs["drill"] == "d1"
    assert drill.request.reason == "gpuhealth: drill d1: GpuXid79"
    assert drill.audit_record().details["drill"] == "d1"
    assert Decision.from_audit(drill.audit_record()).request.attrs["drill"] == "d1"  # type: ignore[union-attr]
    assert real == result.decisions[1]
    assert "drill" not in real.audit_record().details


class _Adapter:
    name = "fake"

    def __init__(self) -> None:
        self.submitted: list[ActionRequest] = []

    async def submit(self, request: ActionRequest) -> str:
        self.submitted.append(request)
        return f"ref-{len(self.submitted)}"

    async def status(self, ref: str) -> ActionStatus:
        return ActionStatus(ref=ref, phase=ActionPhase.RUNNING)

    def extra(self) -> str:
        return "delegated"


def test_the_controller_adapter_never_hands_off_a_drill_and_passes_real_steps() -> None:
    inner = _Adapter()
    adapter = fleet_drill_adapter(inner)

    def request(step: RemediationStep, attrs: dict[str, str]) -> ActionRequest:
        return ActionRequest(step=step, node=NodeName("n1"), entity=EntityId("node"),
                             reason="gpuhealth: x", idempotency_key=f"k/{step.value}",
                             attrs=attrs)

    async def scenario() -> None:
        real = request(RemediationStep.HAND_OFF, {})
        assert await adapter.submit(real) == "ref-1"
        assert inner.submitted == [real]  # untouched
        ref = await adapter.submit(request(RemediationStep.HAND_OFF, {"drill": "d1"}))
        assert ref.startswith("drill-hand-off:")
        assert len(inner.submitted) == 1
        assert (await adapter.status(ref)).phase == ActionPhase.SUCCEEDED
        await adapter.submit(request(RemediationStep.CORDON, {"drill": "d1"}))
        assert inner.submitted[-1].reason == "gpuhealth: drill d1: x"
        assert inner.submitted[-1].attrs["drill"] == "d1"
        assert (await adapter.status("ref-2")).phase == ActionPhase.RUNNING

    asyncio.run(scenario())
    assert adapter.extra() == "delegated"  # type: ignore[attr-defined]


def test_held_nodes_are_read_from_the_controllers_actions() -> None:
    rows = [
        {"incident": "a", "node": "n1", "step": "cordon", "phase": "succeeded", "attrs": {}},
        {"incident": "b", "node": "n2", "step": "drain", "phase": "succeeded",
         "attrs": {"scope": "node"}},
        {"incident": "b", "node": "n2", "step": "resume", "phase": "succeeded", "attrs": {}},
        {"incident": "c", "node": "n3", "step": "drain", "phase": "succeeded",
         "attrs": {"scope": "gpu"}},
        {"incident": "d", "node": "n4", "step": "cordon", "phase": "pending", "attrs": {}},
    ]
    assert held_from_actions(rows) == {"n1": "a"}


def test_a_new_drill_or_a_real_occurrence_after_a_drill_is_a_new_alert() -> None:
    from dataclasses import replace

    from alerting.alerts import AlertTracker
    from core.records import AlertState

    clock = itertools.count(1.0)
    tracker = AlertTracker(clock=lambda: next(clock))
    first = _finding(MARKED)
    fired = tracker.update([first])
    assert [a.labels.get("drill") for a in fired if a.state == AlertState.FIRING] == ["d1"]
    second_line = drill_line(FAULTS["xid79"], drill_id="d2", bus="0000:b1:00")
    second = replace(first, occurrences=2, evidence=(*first.evidence, Evidence(
        file="k", line=2, text=second_line)))
    changed = tracker.update([second])
    assert {(a.state, a.labels.get("drill")) for a in changed} == {
        (AlertState.RESOLVED, "d1"), (AlertState.FIRING, "d2")}
    real = replace(second, occurrences=3, evidence=(*second.evidence, Evidence(
        file="k", line=3, text=UNMARKED)))
    changed = tracker.update([real])
    assert {(a.state, a.labels.get("drill")) for a in changed} == {
        (AlertState.RESOLVED, "d2"), (AlertState.FIRING, None)}
