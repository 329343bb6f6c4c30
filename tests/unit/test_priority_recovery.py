"""Priority-aware recovery (#16 item 10) on the in-memory scheduler (tests/fake_scheduler.py).

The work on a node is read when its incident opens and kept with it; incidents of the
higher-priority work take their steps first when the rate limit is short; a drain
requeues the highest-priority job first; and, only where the site turned it on, a
low-priority job is preempted to place a critical job's recovery: audited before,
within the preemption and disruption budgets, and only recorded in a dry run.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from core.clock import FakeClock
from core.records import Action, EntityId, Evidence, Finding, NodeName, Severity
from gpuhealth.pipeline import Pipeline
from remediation.audit import read_audit_log
from remediation.priority import (
    PreemptionPolicy,
    WorkItem,
    history_attrs,
    priority_class_of,
    work_from_json,
)
from tests.fake_scheduler import FakeCluster, FakeNode, FakePriorityScheduler


def xid79(node: str) -> Finding:
    return Finding(node=NodeName(node), entity=EntityId("GPU-1"), kind="xid", code="79",
                   severity=Severity.CRITICAL, action=Action.REBOOT_NODE,
                   summary="GPU has fallen off the bus",
                   evidence=(Evidence(file="kern.log", line=1, text="NVRM: Xid 79"),),
                   source="test")


def make(tmp_path: Path, nodes: int, clock: FakeClock, *, dry_run: bool = False,
         fraction: float = 1.0, **engine: Any) -> tuple[Pipeline, FakePriorityScheduler,
                                                         FakeCluster]:
    cluster = FakeCluster(nodes={f"n{i}": FakeNode() for i in range(nodes)})
    sched = FakePriorityScheduler(cluster, drain_polls=0, reboot_polls=1)
    p = Pipeline(facts={}, notifiers=[], audit_log_path=str(tmp_path / "audit.jsonl"),
                 dry_run=dry_run, scheduler=sched, clock=clock, rules=[],
                 cluster_size=nodes, max_disrupted_fraction=fraction,
                 action_store_path=str(tmp_path / "actions.db"),
                 engine_options={"probation_seconds": 600.0, **engine})
    return p, sched, cluster


def run(p: Pipeline, clock: FakeClock, ticks: int) -> None:
    for _ in range(ticks):
        asyncio.run(p.atick())
        clock.advance(1.0)


def audit(tmp_path: Path) -> list[Any]:
    return read_audit_log(str(tmp_path / "audit.jsonl"))


def test_the_work_on_the_node_is_kept_with_the_incident_and_named_in_its_audit(tmp_path):
    clock = FakeClock(now=1000.0)
    p, sched, _ = make(tmp_path, 4, clock)
    sched.add_job("11", "n1", priority=100, qos="normal", gpus=2, started_at=1000.0 - 3600)
    sched.add_job("12", "n1", priority=900, qos="high", gpus=4, started_at=1000.0 - 7200)
    p.observe_findings([xid79("n1")], hold_seconds=1e6)
    p.evaluate()
    run(p, clock, 3)
    (inc,) = p.actions.incidents()
    stored = work_from_json(p.actions.work(inc.incident) or "")
    assert [w.id for w in stored] == ["12", "11"]  # highest priority first
    assert (stored[0].gpus, stored[0].priority_class) == (4, "high")
    attrs = history_attrs(p.actions.work(inc.incident))
    assert attrs["priority_class"] == "high"
    assert [w["id"] for w in json.loads(attrs["work"])] == ["12", "11"]
    submitted = [r for r in audit(tmp_path) if r.decision == "submitted"]
    assert submitted
    assert all(r.details["priority_class"] == "high" for r in submitted)
    assert all(r.details["priority"] == "900" for r in submitted)
    # the drain requeued the jobs of the node, the highest priority first
    assert sched.requeued == ["12", "11"]
    assert sched.asked == 1  # asked once, when the incident opened


def test_incidents_of_higher_priority_work_take_the_rate_limit_first(tmp_path):
    clock = FakeClock(now=1000.0)
    # one step per minute: the first tick has tokens for one cordon only
    p, sched, cluster = make(tmp_path, 4, clock, max_actions_per_minute=1.0)
    sched.add_job("1", "n1", priority=10, qos="scavenger")
    sched.add_job("2", "n2", priority=5000, qos="critical")
    sched.add_job("3", "n3", priority=500, qos="normal")
    p.observe_findings([xid79("n1"), xid79("n2"), xid79("n3")], hold_seconds=1e6)
    p.evaluate()
    run(p, clock, 1)
    first = [node for _, node in cluster.history]
    assert first == ["n2"]  # the critical job's node goes first
    for _ in range(12):
        clock.advance(61.0)
        run(p, clock, 1)
    cordons = [node for step, node in cluster.history if step == "cordon"]
    assert cordons == ["n2", "n3", "n1"]  # priority order, not arrival order
    # the critical job's node takes each token first: its drain before the others' cordon
    assert cluster.history.index(("drain", "n2")) < cluster.history.index(("cordon", "n3"))


def preemption(**kw: Any) -> PreemptionPolicy:
    return PreemptionPolicy(enabled=True, critical_classes=("critical",), wait_seconds=30.0,
                            **kw)


def test_a_low_priority_job_is_preempted_to_place_a_critical_recovery(tmp_path):
    clock = FakeClock(now=1000.0)
    p, sched, _ = make(tmp_path, 4, clock, preemption=preemption())
    sched.add_job("crit", "n1", priority=5000, qos="critical", gpus=4)
    sched.add_job("low-big", "n2", priority=10, qos="scavenger", gpus=8, started_at=500.0)
    sched.add_job("low", "n3", priority=10, qos="scavenger", gpus=4, started_at=900.0)
    sched.add_job("mid", "n0", priority=800, qos="normal", gpus=8)
    sched.add_job("small", "n0", priority=1, qos="scavenger", gpus=1)
    p.observe_findings([xid79("n1")], hold_seconds=1e6)
    p.evaluate()
    run(p, clock, 5)
    assert sched.requeued == ["crit"]
    assert sched.preempted == []
    run(p, clock, 30)
    # the lowest priority that started last and holds enough GPUs: not 'small' (1 GPU)
    assert sched.preempted == ["low"]
    records = audit(tmp_path)
    decisions = [r.decision for r in records]
    assert decisions.index("preempting") < decisions.index("preempted")
    (before,) = [r for r in records if r.decision == "preempting"]
    assert before.details["victim"] == "slurm_job:low"
    assert before.details["for"] == "slurm_job:crit"
    assert before.node == "n3"
    assert not before.dry_run
    assert "low" in before.reason
    assert "crit" in before.reason
    # once per critical job: more ticks preempt nothing more
    run(p, clock, 10)
    assert sched.preempted == ["low"]


def test_preemption_is_off_by_default_and_not_needed_when_the_job_is_placed(tmp_path):
    clock = FakeClock(now=1000.0)
    p, sched, _ = make(tmp_path, 4, clock)  # no preemption policy
    sched.add_job("crit", "n1", priority=5000, qos="critical", gpus=4)
    sched.add_job("low", "n3", priority=10, qos="scavenger", gpus=4)
    p.observe_findings([xid79("n1")], hold_seconds=1e6)
    p.evaluate()
    run(p, clock, 60)
    assert sched.preempted == []
    assert not any(r.decision.startswith("preempt") for r in audit(tmp_path))

    clock2 = FakeClock(now=1000.0)
    p2, sched2, _ = make(tmp_path / "b", 4, clock2, preemption=preemption())
    sched2.add_job("crit", "n1", priority=5000, qos="critical", gpus=4)
    sched2.add_job("low", "n3", priority=10, qos="scavenger", gpus=4)
    p2.observe_findings([xid79("n1")], hold_seconds=1e6)
    p2.evaluate()
    run(p2, clock2, 3)
    sched2.place("crit", "n2")  # capacity was there: the scheduler placed it
    run(p2, clock2, 60)
    assert sched2.preempted == []


def test_a_dry_run_only_records_the_preemption(tmp_path):
    clock = FakeClock(now=1000.0)
    p, sched, _ = make(tmp_path, 4, clock, dry_run=True, preemption=preemption())
    sched.add_job("crit", "n1", priority=5000, qos="critical", gpus=4)
    sched.add_job("low", "n3", priority=10, qos="scavenger", gpus=4)
    p.observe_findings([xid79("n1")], hold_seconds=1e6)
    p.evaluate()
    # a dry run drains nothing: the job never waits, so nothing is even considered
    run(p, clock, 60)
    assert sched.preempted == []
    # the job waits anyway (requeued by someone): the dry run records, does nothing
    sched.cluster_jobs["crit"] = WorkItem(kind="slurm_job", id="crit", priority=5000,
                                          priority_class="critical", gpus=4, state="pending")
    (inc,) = p.actions.incidents()
    p.actions.update_incident(inc.incident, out_of_service_at=clock())
    run(p, clock, 40)
    assert sched.preempted == []
    (record,) = [r for r in audit(tmp_path) if r.decision == "preempting"]
    assert record.dry_run
    assert record.reason.startswith("dry run: would preempt")
    assert record.details["victim"] == "slurm_job:low"


def test_preemption_respects_its_budget_and_the_disruption_budget(tmp_path):
    clock = FakeClock(now=1000.0)
    # two critical jobs displaced, one preemption per hour allowed
    p, sched, _ = make(tmp_path, 6, clock, preemption=preemption(max_preemptions=1))
    sched.add_job("crit-a", "n1", priority=5000, qos="critical", gpus=4)
    sched.add_job("crit-b", "n2", priority=6000, qos="critical", gpus=4)
    sched.add_job("low-1", "n3", priority=10, qos="scavenger", gpus=4)
    sched.add_job("low-2", "n4", priority=20, qos="scavenger", gpus=4)
    p.observe_findings([xid79("n1"), xid79("n2")], hold_seconds=1e6)
    p.evaluate()
    run(p, clock, 40)
    assert sched.preempted == ["low-1"]  # for crit-b, the higher priority, first
    held = [r for r in audit(tmp_path) if r.decision == "preemption_held"]
    assert len(held) == 1
    assert "preemption budget spent" in held[0].reason
    assert held[0].details["for"] == "slurm_job:crit-a"

    # a disruption budget of one node: the drained node uses it, no preemption
    clock2 = FakeClock(now=1000.0)
    p2, sched2, _ = make(tmp_path / "b", 4, clock2, fraction=0.25, preemption=preemption())
    sched2.add_job("crit", "n1", priority=5000, qos="critical", gpus=4)
    sched2.add_job("low", "n3", priority=10, qos="scavenger", gpus=4)
    p2.observe_findings([xid79("n1")], hold_seconds=1e6)
    p2.evaluate()
    run(p2, clock2, 40)
    assert sched2.preempted == []
    (held2,) = [r for r in audit(tmp_path / "b") if r.decision == "preemption_held"]
    assert "disruption budget" in held2.reason


def test_protected_and_higher_priority_work_is_never_a_victim():
    policy = PreemptionPolicy(enabled=True, critical_priority=1000, max_victim_priority=50)
    crit = WorkItem(kind="pod", id="ml/train", priority=2000, gpus=2)
    running = [
        WorkItem(kind="pod", id="kube-system/dcgm", node="a", priority=0, gpus=2,
                 priority_class="system-node-critical"),
        WorkItem(kind="pod", id="ml/other-critical", node="b", priority=1500, gpus=2),
        WorkItem(kind="pod", id="ml/mid", node="c", priority=100, gpus=2),
        WorkItem(kind="pod", id="ml/low", node="d", priority=5, gpus=2),
        WorkItem(kind="pod", id="ml/low-small", node="e", priority=1, gpus=1),
    ]
    assert [v.id for v in policy.victims(crit, running)] == ["ml/low"]
    assert policy.victims(crit, running, avoid_nodes=frozenset({"d"})) == []


def test_policy_checks_and_classes():
    with pytest.raises(ValueError, match="critical"):
        PreemptionPolicy(enabled=True)
    with pytest.raises(ValueError, match="unknown keys"):
        PreemptionPolicy.from_options({"enabled": True, "critical_classes": ["x"],
                                       "victims": 3})
    with pytest.raises(ValueError, match="max_preemptions"):
        PreemptionPolicy(max_preemptions=0)
    assert not PreemptionPolicy().enabled
    assert priority_class_of([WorkItem(kind="pod", id="a", priority=3)]) == "default"


def test_the_preemption_budget_survives_a_new_leader(tmp_path):
    clock = FakeClock(now=1000.0)
    p, sched, _ = make(tmp_path, 6, clock, preemption=preemption(max_preemptions=1))
    sched.add_job("crit-a", "n1", priority=5000, qos="critical", gpus=4)
    sched.add_job("low-1", "n3", priority=10, qos="scavenger", gpus=4)
    sched.add_job("low-2", "n4", priority=10, qos="scavenger", gpus=4)
    p.observe_findings([xid79("n1")], hold_seconds=1e6)
    p.evaluate()
    run(p, clock, 40)
    assert sched.preempted == ["low-1"]
    p.close()
    # a new controller on the same store: a second critical job waits; the budget is spent
    p2 = Pipeline(facts={}, notifiers=[], audit_log_path=str(tmp_path / "audit2.jsonl"),
                  dry_run=False, scheduler=sched, clock=clock, rules=[], cluster_size=6,
                  max_disrupted_fraction=1.0, action_store_path=str(tmp_path / "actions.db"),
                  engine_options={"probation_seconds": 600.0,
                                  "preemption": preemption(max_preemptions=1)})
    sched.add_job("crit-b", "n2", priority=6000, qos="critical", gpus=4)
    p2.observe_findings([xid79("n2")], hold_seconds=1e6)
    p2.evaluate()
    run(p2, clock, 40)
    assert sched.preempted == ["low-1"]  # crit-a is not preempted for again, crit-b waits
    held = [r for r in read_audit_log(str(tmp_path / "audit2.jsonl"))
            if r.decision == "preemption_held"]
    assert [r.details["for"] for r in held] == ["slurm_job:crit-b"]
    assert "preemption budget spent: 1 of 1" in held[0].reason


def test_the_disruption_budget_goes_to_the_node_of_the_critical_job_first(tmp_path):
    clock = FakeClock(now=1000.0)
    # a budget of one node out of ten
    p, sched, cluster = make(tmp_path, 10, clock, fraction=0.1)
    sched.add_job("scav", "n1", priority=10, qos="scavenger")
    sched.add_job("norm", "n3", priority=500, qos="normal")
    sched.add_job("crit", "n2", priority=5000, qos="critical")
    p.observe_findings([xid79("n1"), xid79("n3"), xid79("n2")], hold_seconds=1e6)
    p.evaluate()  # n1 came first and takes the budget; n3 and n2 wait
    run(p, clock, 5)
    assert {node for _, node in cluster.history} == {"n1"}
    assert p.policy.work_priority == {"n2": 5000.0, "n3": 500.0}  # read while they wait
    clock.advance(700.0)  # n1's probation passes: resumed, its slot is free
    run(p, clock, 3)
    p.evaluate()
    run(p, clock, 5)
    cordons = [node for step, node in cluster.history if step == "cordon"]
    assert cordons == ["n1", "n2"]  # the critical job's node, though n3 waited longer


def test_the_work_of_closed_incidents_is_not_kept_in_memory(tmp_path):
    """#18 (the leader's memory): the engine cached the work of every incident it ever saw;
    once an incident is closed only the store keeps it, and it is still read from there."""
    clock = FakeClock(now=1000.0)
    p, sched, _ = make(tmp_path, 4, clock)
    sched.add_job("12", "n1", priority=900, qos="high", gpus=4)
    p.observe_findings([xid79("n1")], hold_seconds=120.0)  # gone after the reboot
    p.evaluate()
    run(p, clock, 3)
    (inc,) = p.actions.incidents()
    assert p.engine._work  # cached while the incident is live
    for _ in range(40):  # validated, probation (600 s), closed; pruned every 300 s
        clock.advance(60.0)
        p.evaluate()
        run(p, clock, 1)
    assert p.actions.incidents()[0].state == "closed"
    assert not p.engine._work
    assert [w.id for w in p.engine.work_of(inc.incident)] == ["12"]  # from the store
    assert sched.asked == 1
