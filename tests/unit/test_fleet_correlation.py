"""Fleet incidents: many nodes under one switch failing together trip the breaker, not N drains."""

from __future__ import annotations

from analytics.fleet import FLEET_NODE, FleetCorrelator
from core.records import Action, Evidence, Finding, Severity


def _f(node: str, severity: Severity = Severity.CRITICAL, kind: str = "ib_port") -> Finding:
    return Finding(node=node, entity="mlx5_0/1", kind=kind, code="down",  # type: ignore[arg-type]
                   severity=severity, action=Action.CHECK_NETWORK, summary=f"{node} port down",
                   evidence=(Evidence(file="ibstat", line=3, text="State: Down"),), source="t")


FACTS = {"n1": {"switch": "leaf-1"}, "n2": {"switch": "leaf-1"}, "n3": {"switch": "leaf-1"},
         "n4": {"switch": "leaf-2"}, "n5": {}}


def test_three_nodes_under_one_switch_are_one_fleet_event_reported_once() -> None:
    c = FleetCorrelator(attributes=("switch",), min_nodes=3, window_seconds=600)
    assert c.update([_f("n1"), _f("n2"), _f("n4")], FACTS, now=0.0) == []
    (event,) = c.update([_f("n1"), _f("n2"), _f("n3"), _f("n4")], FACTS, now=10.0)
    assert (event.attribute, event.value, event.nodes) == ("switch", "leaf-1", ("n1", "n2", "n3"))
    f = event.finding
    assert (f.node, f.entity, f.severity, f.action) == (FLEET_NODE, "switch:leaf-1",
                                                       Severity.MAJOR, Action.NONE)
    assert [e.file for e in f.evidence] == ["n1", "n2", "n3"]
    assert c.update([_f("n1"), _f("n2"), _f("n3")], FACTS, now=20.0) == []  # once
    assert c.update([_f("n1")], FACTS, now=30.0) == []  # over; may begin again later
    assert len(c.update([_f("n1"), _f("n2"), _f("n3")], FACTS, now=40.0)) == 1


def test_old_minor_or_unattributed_findings_do_not_count() -> None:
    c = FleetCorrelator(attributes=("switch",), min_nodes=3, window_seconds=60)
    c.update([_f("n1"), _f("n2")], FACTS, now=0.0)
    assert c.update([_f("n1"), _f("n2"), _f("n3")], FACTS, now=100.0) == []  # not together
    c2 = FleetCorrelator(attributes=("switch",), min_nodes=3)
    assert c2.update([_f("n1"), _f("n2"), _f("n3", Severity.WARNING)], FACTS, now=0.0) == []
    assert c2.update([_f("n1"), _f("n2"), _f("n5")], FACTS, now=0.0) == []
    assert c2.update([_f("n1"), _f("n2"), _f("n3", kind="agent")], FACTS, now=0.0) == []


def test_a_controller_standby_notifies_nothing_until_it_leads() -> None:
    from gpuhealth.pipeline import Pipeline

    leading = {"now": False}
    p = Pipeline(facts={}, notifiers=[], audit_log_path=None,
                 is_leader=lambda: leading["now"], notify_as_standby=False)
    p.observe_findings([_f("n1")], hold_seconds=600)
    standby = p.evaluate()
    assert [a.labels["node"] for a in standby.alerts] == ["n1"]  # tracked
    assert standby.notified == []  # but not sent
    leading["now"] = True
    led = p.evaluate()
    assert [a.labels["node"] for a in led.notified] == ["n1"]  # sent once on taking over
    assert p.evaluate().notified == []
    p.close()
