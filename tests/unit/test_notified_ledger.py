"""A restart or a new leader tells the notifiers nothing they were told before.

The fresh-user trial found every firing alert sent again, with a new start time, at each
controller fail-over and at each restart of ``gpuhealth run``: the outbox now records
what was sent as firing (shared by a controller pair on PostgreSQL), and a firing alert
starts when its fault was first seen.
"""

from __future__ import annotations

from pathlib import Path

from alerting.testing import RecordingNotifier
from core.clock import FakeClock
from core.records import Action, EntityId, Finding, NodeName, Severity
from gpuhealth.pipeline import Pipeline


def fault(node: str = "n1", first: float = 900.0) -> Finding:
    return Finding(node=NodeName(node), entity=EntityId("GPU-1"), kind="xid", code="79",
                   severity=Severity.CRITICAL, action=Action.REBOOT_NODE, summary="lost",
                   evidence=(), source="t", first_seen_at=first, last_seen_at=first)


def make(tmp_path: Path, clock: FakeClock, rec: RecordingNotifier, **kw) -> Pipeline:  # type: ignore[no-untyped-def]
    return Pipeline(facts={}, notifiers=[rec], audit_log_path=None, clock=clock,
                    outbox_path=str(tmp_path / "outbox.sqlite"), **kw)


def test_a_restart_sends_nothing_again_and_what_resolved_meanwhile_resolves(tmp_path) -> None:
    clock = FakeClock(now=1000.0)
    first = RecordingNotifier()
    p = make(tmp_path, clock, first)
    p.observe_findings([fault("n1"), fault("n2")], hold_seconds=3600)
    p.evaluate()
    assert sorted(a.labels["node"] for a in first.sent) == ["n1", "n2"]
    assert {a.starts_at for a in first.sent} == {900.0}  # when the fault was first seen
    p.close()
    clock.advance(60)
    again = RecordingNotifier()
    q = make(tmp_path, clock, again)  # restarted: n1 still failing, n2 recovered meanwhile
    q.observe_findings([fault("n1")], hold_seconds=3600)
    q.evaluate()
    assert [(a.labels["node"], a.state.value) for a in again.sent] == [("n2", "resolved")]
    clock.advance(60)
    q.evaluate()
    assert len(again.sent) == 1
    q.close()


def test_a_new_leader_does_not_send_what_the_old_leader_sent(tmp_path) -> None:
    clock = FakeClock(now=1000.0)
    old, new = RecordingNotifier(), RecordingNotifier()
    leading = {"old": True}
    a = make(tmp_path, clock, old, is_leader=lambda: leading["old"], notify_as_standby=False)
    b = make(tmp_path, clock, new, is_leader=lambda: not leading["old"],
             notify_as_standby=False)
    for p in (a, b):
        p.observe_findings([fault("n1")], hold_seconds=3600)
        p.evaluate()
    assert len(old.sent) == 1
    assert new.sent == []  # the standby tracks, sends nothing
    leading["old"] = False  # fail-over
    a.close()
    clock.advance(30)
    b.observe_findings([fault("n3")], hold_seconds=3600)
    b.evaluate()
    assert [a.labels["node"] for a in new.sent] == ["n3"]  # only what is new
    b.close()
