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


# --- the two ends of one link ---------------------------------------------------------

LINKS = {"n1": {"link:mlx5_0/1": "n2:mlx5_0/1"}, "n3": {"link:mlx5_0/1": "leaf-3:17"}}


def test_both_ends_of_one_link_are_one_finding_with_both_evidences() -> None:
    from analytics.fleet import join_link_ends

    worse, other = _f("n2"), _f("n1", Severity.MAJOR)
    unrelated = _f("n4")
    joined = join_link_ends([other, worse, unrelated], LINKS)  # n2's fact is derived
    assert [f.node for f in joined] == ["n2", "n4"]  # the worse end stands for the link
    link = joined[0]
    assert "n1:mlx5_0/1" in link.summary
    assert "one link fault" in link.summary
    assert [e.text for e in link.evidence][:2] == ["State: Down", "n1: State: Down"]
    assert link.occurrences == 2
    assert join_link_ends([unrelated], LINKS) == [unrelated]
    assert join_link_ends([other, worse], {}) == [other, worse]  # no topology: unchanged


def test_one_end_alone_keeps_its_finding_and_names_the_peer() -> None:
    from analytics.fleet import join_link_ends

    (alone,) = join_link_ends([_f("n3")], LINKS)
    assert alone.node == "n3"
    assert alone.summary.endswith("(link to leaf-3:17)")
    gpu = Finding(node="n1", entity="mlx5_0/1", kind="xid", code="79",  # type: ignore[arg-type]
                  severity=Severity.CRITICAL, action=Action.REBOOT_NODE, summary="s",
                  evidence=(), source="t")
    assert join_link_ends([gpu, _f("n2")], LINKS)[0] is gpu  # only port kinds join


def test_a_link_seen_from_both_ends_alerts_once_and_remediates_one_node() -> None:
    from analytics.fleet import join_link_ends
    from gpuhealth.pipeline import Pipeline

    p = Pipeline(facts={}, notifiers=[], audit_log_path=None, cluster_size=10,
                 join=lambda found: join_link_ends(found, LINKS))
    p.observe_findings([_f("n1"), _f("n2")], hold_seconds=600)
    out = p.evaluate()
    assert [a.labels["node"] for a in out.alerts] == ["n1"]  # equal severity: first seen, name
    assert {r.node for r in out.actions} == {"n1"}
    alone = Pipeline(facts={}, notifiers=[], audit_log_path=None, cluster_size=10)
    alone.observe_findings([_f("n1"), _f("n2")], hold_seconds=600)
    assert len(alone.evaluate().alerts) == 2  # without the topology: two incidents
    p.close()
    alone.close()


def test_link_facts_are_checked() -> None:
    from analytics.fault_model.engine import check_facts

    assert check_facts({"link:mlx5_0/1": "gpu-02:mlx5_0/1", "switch": "leaf-1"}) == []
    (problem,) = check_facts({"link:mlx5_0/1": "gpu-02"})
    assert "link:mlx5_0/1" in problem
    assert "<peer node>:<peer port>" in problem


# --- silent agents -----------------------------------------------------------------


def test_a_silent_agent_gets_one_warning_and_is_cleared_by_a_heartbeat() -> None:
    from analytics.fleet import AgentSilence

    s = AgentSilence(after_seconds=60)
    assert s.update({"n1": 100.0, "n2": 100.0}, now=150.0).gone == []
    change = s.update({"n1": 100.0, "n2": 150.0}, now=200.0)
    (finding,) = change.gone
    assert (finding.node, finding.kind, finding.code) == ("n1", "agent", "silent")
    assert (finding.severity, finding.action) == (Severity.WARNING, Action.NONE)  # no drain
    assert s.update({"n1": 100.0, "n2": 200.0}, now=230.0).gone == []  # once
    back = s.update({"n1": 229.0, "n2": 229.0}, now=230.0)
    assert back.back == [("n1", "node", "agent", "silent")]
    assert back.silent == frozenset()


def test_no_agent_is_called_silent_while_the_store_was_just_away() -> None:
    from analytics.fleet import AgentSilence

    s = AgentSilence(after_seconds=60)
    assert s.update({"n1": 0.0}, now=100.0, store_back_since=10.0).gone == []
    assert [f.node for f in s.update({"n1": 0.0}, now=200.0, store_back_since=70.0).gone] == [
        "n1"]


def test_the_latest_record_of_a_finding_decides() -> None:
    from core.codec import finding_to_json
    from storage.fleet import StoredFleetRecord, finding_updates

    f = _f("n1")
    body = finding_to_json(f)
    cleared = {"node": "n1", "entity": "mlx5_0/1", "kind": "ib_port", "code": "down"}

    def rec(seq: int, kind: str, b: dict, at: float = 100.0) -> StoredFleetRecord:
        return StoredFleetRecord(seq=seq, key=f"n1:{seq}", node="n1", kind=kind, at=at,
                                 body=b, accepted_at=at)

    seen_then_cleared = finding_updates([rec(1, "finding", body), rec(2, "finding_cleared",
                                                                      cleared)],
                                        now=110.0, window_seconds=60.0)
    assert seen_then_cleared.held == []
    assert seen_then_cleared.cleared == [f.key]
    cleared_then_seen = finding_updates([rec(1, "finding_cleared", cleared),
                                         rec(2, "finding", body)], now=110.0,
                                        window_seconds=60.0)
    assert [(x.key, hold) for x, hold in cleared_then_seen.held] == [(f.key, 50.0)]
    assert cleared_then_seen.cleared == []
    old = finding_updates([rec(1, "finding", body, at=0.0)], now=110.0, window_seconds=60.0)
    assert old.held == []
    assert old.changed == 0
    bad = finding_updates([rec(1, "finding", {"node": "n1"})], now=110.0, window_seconds=60.0)
    assert bad.held == []  # unreadable: skipped with a warning, never a finding


def test_an_agent_never_sends_its_token_in_clear_text_beyond_loopback() -> None:
    import pytest
    from pydantic import ValidationError

    from gpuhealth.config import AgentSettings

    with pytest.raises(ValidationError, match="clear text beyond loopback"):
        AgentSettings(controllers=("http://10.0.0.5:9837",))
    assert AgentSettings(controllers=("https://10.0.0.5:9837", "http://127.0.0.1:9837",
                                      "http://localhost:9837")).controllers
