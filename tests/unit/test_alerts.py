from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alerting.alerts import (
    AlertTracker,
    alert_for,
    alert_labels,
    alert_name,
    alert_to_json,
    fingerprint,
)
from alerting.log import LogNotifier
from core.clock import FakeClock
from core.protocols import Notifier
from core.records import (
    Action,
    AlertState,
    EntityId,
    Evidence,
    Finding,
    NodeName,
    Severity,
)


def make_finding(**kw: Any) -> Finding:
    base: dict[str, Any] = {
        "node": NodeName("gpu-001"),
        "entity": EntityId("0000:b1:00.0"),
        "kind": "xid",
        "code": "79",
        "severity": Severity.CRITICAL,
        "action": Action.REBOOT_NODE,
        "summary": "GPU has fallen off the bus",
        "evidence": tuple(
            Evidence(file="dmesg.log", line=i, text=f"NVRM: Xid line {i}") for i in range(1, 9)
        ),
        "source": "xid.lost: XIDCAT 79",
        "first_seen_at": 1000.0,
        "last_seen_at": 1010.0,
    }
    base.update(kw)
    return Finding(**base)


@pytest.mark.parametrize(
    ("kind", "code", "expected"),
    [
        ("xid", "79", "GpuXid79"),
        ("row_remap", "pending", "GpuRowRemapPending"),
        ("recovery_action", "GPU Reset Required", "GpuRecoveryActionGpuResetRequired"),
        ("ib_port", "Polling", "NetIbPortPolling"),
        ("rdma_transport", "12", "NetRdmaTransport12"),
        ("host_memory", "edac_ue", "HostMemoryEdacUe"),
    ],
)
def test_alert_name(kind, code, expected):
    assert alert_name(kind, code) == expected


def test_labels_annotations_and_fingerprint():
    finding = make_finding()
    alert = alert_for(finding, starts_at=5.0)
    assert dict(alert.labels) == {
        "alertname": "GpuXid79",
        "severity": "critical",
        "node": "gpu-001",
        "entity": "0000:b1:00.0",
        "kind": "xid",
        "code": "79",
    }
    assert alert.fingerprint == fingerprint(alert.labels)
    assert len(alert.fingerprint) == 16
    assert int(alert.fingerprint, 16) >= 0
    ann = alert.annotations
    assert ann["summary"] == "GPU has fallen off the bus"
    assert ann["action"] == "reboot_node"
    assert ann["runbook_url"] == "docs/runbooks/xid.md"
    assert ann["evidence"].splitlines()[0] == "dmesg.log:1: NVRM: Xid line 1"
    assert len(ann["evidence"].splitlines()) == 5
    assert "reboot_node" in ann["description"]
    assert alert.state == AlertState.FIRING
    assert alert.starts_at == 5.0
    assert alert_to_json(alert)["labels"]["alertname"] == "GpuXid79"


def test_fingerprint_is_order_independent_and_changes_with_labels():
    labels = alert_labels(make_finding())
    assert fingerprint(dict(reversed(list(labels.items())))) == fingerprint(labels)
    assert fingerprint({**labels, "severity": "warning"}) != fingerprint(labels)


def test_new_finding_fires_once_and_is_not_resent_unchanged():
    clock = FakeClock(now=100.0)
    tracker = AlertTracker(clock=clock, resend_interval_seconds=3600)
    f = make_finding()
    first = tracker.update([f])
    assert [a.state for a in first] == [AlertState.FIRING]
    clock.advance(60)
    assert tracker.update([f]) == []
    assert [a.fingerprint for a in tracker.active()] == [first[0].fingerprint]
    assert tracker.finding_of(first[0].fingerprint) == f


def test_resend_after_interval_and_on_occurrences_change():
    clock = FakeClock(now=0.0)
    tracker = AlertTracker(clock=clock, resend_interval_seconds=600)
    f = make_finding()
    (fired,) = tracker.update([f])
    clock.advance(100)
    (again,) = tracker.update([make_finding(occurrences=3)])
    assert again.fingerprint == fired.fingerprint
    assert again.annotations["occurrences"] == "3"
    assert again.starts_at == fired.starts_at
    clock.advance(599)
    assert tracker.update([make_finding(occurrences=3)]) == []
    clock.advance(1)
    (resent,) = tracker.update([make_finding(occurrences=3)])
    assert resent.fingerprint == fired.fingerprint


def test_gone_finding_resolves_with_ends_at():
    clock = FakeClock(now=10.0)
    tracker = AlertTracker(clock=clock)
    (fired,) = tracker.update([make_finding()])
    clock.advance(30)
    (resolved,) = tracker.update([])
    assert resolved.state == AlertState.RESOLVED
    assert resolved.fingerprint == fired.fingerprint
    assert resolved.ends_at == 40.0
    assert tracker.active() == []
    assert tracker.update([]) == []


def test_info_never_alerts_and_min_severity_filters():
    tracker = AlertTracker(clock=FakeClock(), min_severity=Severity.INFO)
    assert tracker.update([make_finding(severity=Severity.INFO, action=Action.NONE)]) == []
    strict = AlertTracker(clock=FakeClock(), min_severity=Severity.MAJOR)
    warning = make_finding(kind="row_remap", code="pending", severity=Severity.WARNING)
    assert strict.update([warning]) == []
    assert len(strict.update([warning, make_finding()])) == 1


def test_severity_change_resolves_old_fingerprint_and_fires_new():
    clock = FakeClock()
    tracker = AlertTracker(clock=clock)
    (warn,) = tracker.update([make_finding(severity=Severity.WARNING, action=Action.RESET_GPU)])
    clock.advance(5)
    out = tracker.update([make_finding()])
    assert [(a.state, a.fingerprint) for a in out] == [
        (AlertState.RESOLVED, warn.fingerprint),
        (AlertState.FIRING, out[1].fingerprint),
    ]
    assert out[1].fingerprint != warn.fingerprint
    assert out[1].labels["severity"] == "critical"


def test_finding_falling_below_threshold_resolves():
    tracker = AlertTracker(clock=FakeClock())
    tracker.update([make_finding(severity=Severity.WARNING)])
    (resolved,) = tracker.update([make_finding(severity=Severity.INFO)])
    assert resolved.state == AlertState.RESOLVED


def test_tracker_rejects_bad_interval():
    with pytest.raises(ValueError, match="resend_interval_seconds"):
        AlertTracker(resend_interval_seconds=0)


def test_log_notifier_levels(caplog):
    notifier = LogNotifier()
    assert isinstance(notifier, Notifier)
    assert notifier.name == "log"
    clock = FakeClock()
    tracker = AlertTracker(clock=clock)
    (fired,) = tracker.update([make_finding()])
    (resolved,) = tracker.update([])
    with caplog.at_level(logging.DEBUG, logger="alerting.log"):
        asyncio.run(notifier.send(fired))
        asyncio.run(notifier.send(resolved))
    levels = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "alerting.log"]
    assert levels[0][0] == logging.WARNING
    assert "firing GpuXid79 critical node=gpu-001" in levels[0][1]
    assert levels[1][0] == logging.INFO
    assert "resolved GpuXid79" in levels[1][1]


@settings(max_examples=200, deadline=None)
@given(
    rounds=st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(["79", "94", "13"]),
                st.sampled_from(list(Severity)),
                st.integers(1, 3),
            ),
            max_size=4,
        ),
        max_size=12,
    )
)
def test_tracker_sends_only_changes_and_resolves_everything(rounds):
    clock = FakeClock()
    tracker = AlertTracker(clock=clock, resend_interval_seconds=1e9)
    for round_ in rounds:
        clock.advance(1)
        findings = {
            code: make_finding(code=code, severity=sev, occurrences=n) for code, sev, n in round_
        }
        before = {a.fingerprint: a for a in tracker.active()}
        sent = tracker.update(findings.values())
        alerting = {k: f for k, f in findings.items() if f.severity.rank >= 1}
        assert {a.labels["code"] for a in tracker.active()} == set(alerting)
        firing = [a for a in sent if a.state == AlertState.FIRING]
        assert len({a.fingerprint for a in firing}) == len(firing)
        for alert in firing:
            old = before.get(alert.fingerprint)
            if old is not None:  # re-sent: only because occurrences changed
                assert old.annotations["occurrences"] != alert.annotations["occurrences"]
        assert all(a.ends_at == clock() for a in sent if a.state == AlertState.RESOLVED)
    clock.advance(1)
    final = tracker.update([])
    assert all(a.state == AlertState.RESOLVED for a in final)
    assert tracker.active() == []
