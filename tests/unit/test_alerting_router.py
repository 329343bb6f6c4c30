"""Inhibition (Alertmanager semantics) and grouping into pages per node."""

from __future__ import annotations

from alerting.alerts import alert_for
from alerting.router import DEFAULT_INHIBIT_RULES, PAGE_ALERTNAME, PageGrouper, inhibited
from core.clock import FakeClock
from core.records import AlertState, Severity
from tests.unit.test_alerts import make_finding


def alert(**kw):
    return alert_for(make_finding(**kw), starts_at=0.0, extra_labels={"cluster": "c1"})


def test_node_down_inhibits_gpu_and_link_alerts_of_that_node_only():
    down = alert(kind="node_down", code="unreachable", entity="node")
    gpu = alert()
    port = alert(kind="ib_port", code="state_down", entity="mlx5_0:1", severity=Severity.MAJOR)
    elsewhere = alert(node="gpu-002")
    muted = inhibited([down, gpu, port, elsewhere], DEFAULT_INHIBIT_RULES)
    assert muted == {gpu.fingerprint: down.fingerprint, port.fingerprint: down.fingerprint}


def test_root_xid_inhibits_sympathetic_xids_on_the_same_gpu():
    root = alert(code="62")
    sympathetic = alert(code="45", severity=Severity.WARNING)
    other_gpu = alert(code="45", severity=Severity.WARNING, entity="0000:3b:00.0")
    muted = inhibited([root, sympathetic, other_gpu], DEFAULT_INHIBIT_RULES)
    assert muted == {sympathetic.fingerprint: root.fingerprint}


def test_lost_gpu_inhibits_its_other_alerts():
    root = alert(code="62")
    lost = alert(kind="gpu_lost", code="fallen_off_bus")
    smi = alert(kind="nvidia_smi_err", code="row", severity=Severity.WARNING)
    muted = inhibited([root, lost, smi], DEFAULT_INHIBIT_RULES)
    assert muted[smi.fingerprint] == lost.fingerprint
    assert muted[root.fingerprint] == lost.fingerprint  # a lost GPU mutes its other alerts
    assert lost.fingerprint not in muted


def test_one_page_per_node_escalation_ack_and_resolve():
    grouper = PageGrouper(clock=FakeClock(now=10))
    a1 = alert(code="62")  # critical
    warn = alert(code="94", severity=Severity.WARNING)
    (page,) = grouper.update([a1, warn])
    assert page.labels == {"alertname": PAGE_ALERTNAME, "cluster": "c1", "node": "gpu-001",
                           "severity": "critical"}
    assert page.annotations["alerts"] == "1"  # warnings do not page
    # a second critical on the same node joins the page without paging again
    a2 = alert(code="79", entity="0000:3b:00.0")
    assert grouper.update([a1, a2, warn]) == []
    # a major alert on another node is its own page
    other = alert(node="gpu-002", kind="ib_port", code="state_down", entity="mlx5_0:1",
                  severity=Severity.MAJOR)
    (page2,) = grouper.update([a1, a2, other])
    assert page2.labels["node"] == "gpu-002"
    assert page2.labels["severity"] == "major"
    assert page2.fingerprint != page.fingerprint
    # silencing every alert of gpu-001 acknowledges its page
    (ack,) = grouper.update([a1, a2, other], silenced={a1.fingerprint, a2.fingerprint})
    assert ack.annotations["acknowledged"] == "true"
    assert ack.fingerprint == page.fingerprint
    # resolving
    (resolved,) = grouper.update([other])
    assert resolved.state is AlertState.RESOLVED
    assert resolved.fingerprint == page.fingerprint
    assert [p.labels["node"] for p in grouper.open_pages()] == ["gpu-002"]


def test_silenced_or_inhibited_before_paging_never_pages():
    grouper = PageGrouper(clock=FakeClock())
    a = alert(code="62")
    assert grouper.update([a], silenced={a.fingerprint}) == []
    assert grouper.update([a], inhibited={a.fingerprint}) == []
    assert grouper.update([]) == []


def test_escalation_repages_with_the_same_fingerprint():
    grouper = PageGrouper(clock=FakeClock())
    major = alert(kind="nvlink", code="link_down", severity=Severity.MAJOR)
    (first,) = grouper.update([major])
    (second,) = grouper.update([major, alert(code="79")])
    assert (first.labels["severity"], second.labels["severity"]) == ("major", "critical")
    assert first.fingerprint == second.fingerprint


def test_cached_inhibitor_agrees_with_inhibited():
    from alerting.router import Inhibitor

    alerts = [alert(code="62"), alert(code="45", severity=Severity.WARNING),
              alert(kind="gpu_lost", code="fallen_off_bus", entity="0000:3b:00.0"),
              alert(kind="nvidia_smi_err", code="row", entity="0000:3b:00.0",
                    severity=Severity.WARNING),
              alert(kind="node_down", code="unreachable", entity="node", node="gpu-009"),
              alert(node="gpu-009")]
    inhibitor = Inhibitor(DEFAULT_INHIBIT_RULES)
    for subset in (alerts, alerts[:2], alerts[2:], alerts):
        assert inhibitor.muted(subset) == inhibited(subset, DEFAULT_INHIBIT_RULES)
