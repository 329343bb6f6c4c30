"""The remediation stage: typed decisions, nothing taken that is not recorded, a full disk.

The full-disk test mounts a real 1 MiB tmpfs (CI runs as root; elsewhere it is skipped)
and fills it, as the issue's report did with the data folder on a full filesystem.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from analytics.fault_model import Context, Observations
from core.clock import FakeClock
from core.records import Action, EntityId, Event, Finding, NodeName, RemediationStep, Severity
from gpuhealth.pipeline import Pipeline
from remediation.actions import ActionStore
from remediation.audit import AuditLog, read_audit_log
from remediation.metrics import RemediationCollector
from remediation.policy import (
    DECISION_DUPLICATE,
    DECISION_HELD,
    DECISION_REQUESTED,
    DECISION_RESOLVED,
    Decision,
    RemediationPolicy,
)

TABLE = {"79": (Severity.CRITICAL, Action.REBOOT_NODE), "94": (Severity.WARNING, Action.RESET_GPU)}


def rule(obs: Observations, ctx: Context):
    for g in obs.events("xid"):
        severity, action = TABLE[g.code]
        yield Finding(node=g.node, entity=g.entity, kind="xid", code=g.code, severity=severity,
                      action=action, summary=f"Xid {g.code}", evidence=(), source="t",
                      occurrences=g.count)


def xid(code: str, node: str = "n1", entity: str = "GPU-1") -> Event:
    return Event(kind="xid", code=code, node=NodeName(node), entity=EntityId(entity),
                 observed_at=None)


def finding(node: str = "n1", code: str = "79") -> Finding:
    severity, action = TABLE[code]
    return Finding(node=NodeName(node), entity=EntityId("GPU-1"), kind="xid", code=code,
                   severity=severity, action=action, summary="s", evidence=(), source="t")


def make(clock: FakeClock, folder: Path, **kw: object) -> Pipeline:
    return Pipeline(facts={"node": "ctl"}, notifiers=[], audit_log_path=str(folder / "audit.jsonl"),
                    action_store_path=str(folder / "actions.db"), rules=[rule], clock=clock,
                    cluster_size=10, **kw)  # type: ignore[arg-type]


# --- typed decisions -------------------------------------------------------------------


def test_every_decision_reads_back_from_its_audit_line() -> None:
    clock = FakeClock(now=100.0)
    policy = RemediationPolicy(cluster_size=1, clock=clock)
    first = policy.decide(finding("n1"), fingerprint="fa")
    again = policy.decide(finding("n1"), fingerprint="fa")
    held = policy.decide(finding("n2"), fingerprint="fb")
    escalated = policy.escalate(finding("n1"), fingerprint="fa", why="recurred")
    resolved = policy.resolve(fingerprint="fa", node="n1")
    released = policy.release(fingerprint="fb", node="n2", why="a human took it")
    kinds = set()
    for result in (first, again, held, escalated, resolved, released):
        for d in result.decisions:
            kinds.add(d.decision)
            assert Decision.from_audit(d.audit_record()) == d
    assert kinds == {DECISION_REQUESTED, DECISION_DUPLICATE, DECISION_HELD, DECISION_RESOLVED}
    assert all(d.escalated_from == "fa" for d in escalated.decisions)
    # The engine reads typed fields: severity, incident key, the finding's entity.
    cordon = next(d for d in first.decisions if d.planned
                  and d.planned.step == RemediationStep.CORDON)
    assert (cordon.severity, cordon.incident_key, cordon.finding_entity) == (
        "critical", "fa", "GPU-1")
    assert cordon.disrupts_node
    assert cordon.request is not None


def test_a_line_of_another_writer_is_not_a_decision() -> None:
    record = Decision(at=1.0, actor="a", decision=DECISION_RESOLVED, node=NodeName("n"),
                      planned=None, reason="r", idempotency_key="k", dry_run=True,
                      fingerprint="f", incident=1).audit_record()
    engine_line = type(record)(at=1.0, actor="a", decision="submitted", step=None,
                               node=NodeName("n"), entity=EntityId("node"), reason="r",
                               idempotency_key="k/cordon", dry_run=True,
                               details={"action_id": "3"})
    assert Decision.from_audit(engine_line) is None
    assert Decision.from_audit(record) is not None


# --- nothing taken that cannot be recorded -----------------------------------------------


class FailingAudit(AuditLog):
    """A JSONL audit log whose writes fail with ENOSPC while ``full`` is set."""

    full = False

    def extend(self, records):  # type: ignore[no-untyped-def]
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        super().extend(records)


def test_audit_failure_holds_no_budget_slot_and_decides_again(tmp_path: Path) -> None:
    clock = FakeClock(now=0.0)
    p = make(clock, tmp_path)
    audit = FailingAudit(path=str(tmp_path / "audit.jsonl"))
    p.remediation.audit = audit
    audit.full = True
    p.observe([xid("79", node="n1")])
    out = p.evaluate()
    assert out.actions == []
    assert p.policy.out_of_service == frozenset()  # the old code kept n1 counted here
    assert p.actions.actions() == []
    assert "audit" in p.remediation.failing_store()
    clock.advance(5)
    out = p.evaluate()  # still full: still waiting, still nothing counted; no page yet
    assert not any(f.kind == "gpuhealth" for f in out.findings)
    clock.advance(30)
    out = p.evaluate()  # failing for over 30 s: a critical self-alert
    assert out.actions == []
    assert p.policy.out_of_service == frozenset()
    assert any(f.kind == "gpuhealth" and f.code == "state_write_failed"
               and f.severity == Severity.CRITICAL for f in out.findings)
    assert any(a.labels.get("code") == "state_write_failed" for a in p.active_alerts())
    collector = RemediationCollector(p.remediation, is_leader=lambda: True)
    samples = {(m.name, tuple(s.labels.items())): s.value
               for m in collector.collect() for s in m.samples}
    assert samples[("gpuhealth_state_write_failures", (("store", "audit"),))] >= 1
    assert samples[("gpuhealth_state_store_writable", (("store", "audit"),))] == 0
    audit.full = False
    clock.advance(5)
    out = p.evaluate()  # space is back: decided once, recorded, then queued
    steps = [r.step for r in out.actions]
    assert RemediationStep.CORDON in steps
    assert p.policy.out_of_service == frozenset({"n1"})
    assert {a.request().node for a in p.actions.actions()} == {"n1"}
    assert p.remediation.failing_store() == {}
    requested = [r for r in read_audit_log(audit.path) if r.decision == DECISION_REQUESTED]
    assert sorted(r.idempotency_key for r in requested) == sorted(
        r.idempotency_key for r in out.actions)
    clock.advance(5)
    assert not [f for f in p.evaluate().findings if f.kind == "gpuhealth"]


def test_a_fault_that_resolved_while_the_audit_failed_is_not_acted_on(tmp_path: Path) -> None:
    clock = FakeClock(now=0.0)
    p = make(clock, tmp_path)
    audit = FailingAudit(path=str(tmp_path / "audit.jsonl"))
    p.remediation.audit = audit
    audit.full = True
    fault = finding("n1")
    p.observe_findings([fault])
    assert p.evaluate().alerts
    p.clear_findings([fault.key])  # the alert resolves while the disk is still full
    clock.advance(5)
    changes = {a.labels["code"]: a.state.value for a in p.evaluate().alerts}
    assert changes["79"] == "resolved"
    audit.full = False
    out = p.evaluate()
    assert out.actions == []
    assert p.actions.actions() == []
    assert p.policy.out_of_service == frozenset()


def test_action_store_failure_keeps_the_requests_and_stores_them_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(now=0.0)
    p = make(clock, tmp_path)
    real_open = ActionStore.open_incidents  # a decision's first write
    calls = {"n": 0}

    def full_add(self, *a, **kw):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ActionStore, "open_incidents", full_add)
    p.observe([xid("79", node="n1")])
    out = p.evaluate()
    assert out.actions  # decided and audited
    assert calls["n"] >= 1
    assert p.actions.actions() == []
    assert "actions" in p.remediation.failing_store()
    monkeypatch.setattr(ActionStore, "open_incidents", real_open)
    clock.advance(5)
    p.evaluate()
    assert {a.request().idempotency_key for a in p.actions.actions()} == {
        r.idempotency_key for r in out.actions}
    assert p.remediation.failing_store() == {}


def test_restart_stores_what_was_audited_but_never_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(now=0.0)
    p = make(clock, tmp_path)
    monkeypatch.setattr(ActionStore, "open_incidents", lambda *a, **kw: (_ for _ in ()).throw(
        sqlite3.OperationalError("disk I/O error")))
    p.observe([xid("79", node="n1")])
    out = p.evaluate()
    p.close()  # crash-like: the requests were audited, the store never took them
    monkeypatch.undo()
    again = make(clock, tmp_path)
    keys = {a.request().idempotency_key for a in again.actions.actions()}
    assert keys == {r.idempotency_key for r in out.actions}
    assert again.policy.out_of_service == frozenset({"n1"})
    again.close()
    third = make(clock, tmp_path)  # and only once
    assert len(third.actions.actions()) == len(keys)
    third.close()


# --- a real full filesystem ----------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "1m") -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path) -> Path:
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as handle, contextlib.suppress(OSError):
        while True:
            handle.write(b"\0" * 4096)
    return filler


def test_full_disk_costs_no_audit_line_and_no_budget_slot(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "data") as data:
        clock = FakeClock(now=0.0)
        p = make(clock, data)
        filler = fill(data)
        p.observe([xid("79", node="n1")])
        out = p.evaluate()  # never raises
        assert out.actions == []
        assert p.policy.out_of_service == frozenset()
        assert p.remediation.failing_store()
        clock.advance(31)
        p.evaluate()
        assert any(f.code == "state_write_failed" for f in p.evaluate().findings)
        filler.unlink()
        clock.advance(5)
        out = p.evaluate()
        assert RemediationStep.CORDON in [r.step for r in out.actions]
        assert p.policy.out_of_service == frozenset({"n1"})
        stored = {a.request().idempotency_key for a in p.actions.actions()}
        assert stored == {r.idempotency_key for r in out.actions}
        lines = (data / "audit.jsonl").read_text().splitlines()
        assert len(lines) == len(read_audit_log(str(data / "audit.jsonl")))  # none cut
        p.close()
        again = make(clock, data)  # and after a restart the budget equals the store
        assert again.policy.out_of_service == frozenset({"n1"})
        assert {a.request().idempotency_key for a in again.actions.actions()} == stored
        again.close()


def test_any_state_store_that_cannot_be_written_is_a_self_alert(tmp_path: Path) -> None:
    from storage.journal import InputJournal

    class FullJournal(InputJournal):
        def hold(self, findings, *, at, source=""):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "j.sqlite"))

    clock = FakeClock(now=0.0)
    p = make(clock, tmp_path)
    p.journal = FullJournal(tmp_path / "j.sqlite")
    p.observe_findings([finding("n1", "94")], hold_seconds=3600)
    p.evaluate()
    assert p.remediation.failing_store()["journal"].startswith("no space left on the device")
    clock.advance(31)
    p.observe_findings([finding("n1", "94")], hold_seconds=3600)
    out = p.evaluate()
    (self_alert,) = [f for f in out.findings if f.kind == "gpuhealth"]
    assert (self_alert.entity, self_alert.severity) == ("journal", Severity.CRITICAL)
    assert p.remediation.write_failures["journal"] == 2
    p.close()
