"""Alert lifecycle: pending and for-duration, debounce per fault class, keep-firing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from alerting.alerts import AlertPolicy, AlertTracker, alert_name, policy_for
from core.clock import FakeClock
from core.records import AlertState, Severity
from tests.unit.test_alerts import make_finding

XID13 = make_finding(code="13", severity=Severity.WARNING, occurrences=1)


def test_for_duration_keeps_alert_pending_then_fires_once():
    clock = FakeClock(now=0)
    tracker = AlertTracker(clock=clock, policies={"xid": AlertPolicy(for_seconds=60)})
    finding = make_finding()
    assert tracker.update([finding]) == []
    assert [a.state for a in tracker.pending()] == [AlertState.PENDING]
    clock.advance(59)
    assert tracker.update([finding]) == []
    clock.advance(1)
    (alert,) = tracker.update([finding])
    assert alert.state is AlertState.FIRING
    assert alert.starts_at == 60
    assert tracker.pending() == []
    assert tracker.update([finding]) == []


def test_pending_alert_that_goes_away_is_dropped_silently():
    clock = FakeClock(now=0)
    tracker = AlertTracker(clock=clock, policies={"*": AlertPolicy(for_seconds=60)})
    tracker.update([make_finding()])
    clock.advance(30)
    assert tracker.update([]) == []
    assert tracker.pending() == []


def test_debounce_count_in_window_per_xid():
    clock = FakeClock(now=0)
    policy = AlertPolicy(debounce_count=3, debounce_window_seconds=600)
    tracker = AlertTracker(clock=clock, policies={"xid:13": policy})
    assert tracker.update([XID13]) == []
    clock.advance(700)  # the first one is now outside the window
    assert tracker.update([replace(XID13, occurrences=3)]) == []  # 2 in the window
    clock.advance(10)
    (alert,) = tracker.update([replace(XID13, occurrences=4)])  # 3 in the window
    assert alert.labels["alertname"] == "GpuXid13"
    # other Xids are not debounced
    (other,) = tracker.update([replace(XID13, occurrences=4), make_finding(code="79")])
    assert other.labels["code"] == "79"


def test_burst_within_one_evaluation_fires_at_once():
    tracker = AlertTracker(clock=FakeClock(), policies={
        "xid:13": AlertPolicy(debounce_count=3, debounce_window_seconds=600)})
    assert len(tracker.update([replace(XID13, occurrences=5)])) == 1


def test_keep_firing_for_absorbs_a_flap():
    clock = FakeClock(now=0)
    tracker = AlertTracker(clock=clock, policies={
        "ib_port": AlertPolicy(keep_firing_for_seconds=120)})
    port = make_finding(kind="ib_port", code="state_down", severity=Severity.MAJOR,
                        entity="mlx5_0:1")
    assert len(tracker.update([port])) == 1
    clock.advance(60)
    assert tracker.update([]) == []  # gone for 60 s: still firing
    assert len(tracker.active()) == 1
    assert tracker.update([port]) == []  # back: same alert, nothing sent
    clock.advance(10)
    tracker.update([])
    clock.advance(130)
    (resolved,) = tracker.update([])
    assert resolved.state is AlertState.RESOLVED
    assert resolved.ends_at == 200


def test_extra_labels_change_nothing_but_the_labels():
    tracker = AlertTracker(clock=FakeClock(), extra_labels={"cluster": "c1"})
    (alert,) = tracker.update([make_finding()])
    assert alert.labels["cluster"] == "c1"
    assert tracker.finding_of(alert.fingerprint) is not None


def test_policy_lookup_and_validation():
    policies = {"xid": AlertPolicy(for_seconds=5), "*": AlertPolicy(for_seconds=1)}
    assert policy_for(policies, "xid", "79").for_seconds == 5
    assert policy_for(policies, "ecc", "x").for_seconds == 1
    with pytest.raises(ValueError, match=">= 0"):
        AlertPolicy(for_seconds=-1)
    with pytest.raises(ValueError, match=">= 1"):
        AlertPolicy(debounce_count=0)
    with pytest.raises(ValueError, match="window"):
        AlertPolicy(debounce_count=2)


def test_alert_names_stay_one_per_class():
    assert alert_name("pcie", "uncorrected_nonfatal:0000:5e:00.0") == "GpuPcieUncorrectedNonfatal"
    assert alert_name("roce_qos", "no_lossless_priority") == "NetRoceQosNoLosslessPriority"
