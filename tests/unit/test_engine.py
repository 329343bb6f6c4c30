"""The remediation engine through the pipeline, on an in-memory scheduler (tests/fake_scheduler.py).

What the real adapters do on real Slurm and the Kubernetes API stand-in is tested in
tests/integration; here the engine's own rules: order, ownership, probation,
escalation, breaker, rate limit, approvals, budget, fail-over.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.clock import FakeClock
from core.records import (
    Action,
    ActionPhase,
    EntityId,
    Evidence,
    Finding,
    NodeName,
    RemediationStep,
    Severity,
)
from gpuhealth.pipeline import Pipeline
from remediation import stage as stage_module
from remediation.actions import INCIDENT_CLOSED, INCIDENT_HUMAN, INCIDENT_PROBATION, ActionStore
from remediation.audit import AuditStore, read_audit_log
from remediation.engine import approve, cancel, undo
from tests.fake_scheduler import FakeCluster, FakeNode, FakeScheduler

S = RemediationStep


def xid79(node: str, *, occurrences: int = 1, at: float = 0.0) -> Finding:
    return Finding(
        node=NodeName(node),
        entity=EntityId("GPU-1"),
        kind="xid",
        code="79",
        severity=Severity.CRITICAL,
        action=Action.REBOOT_NODE,
        summary="GPU has fallen off the bus",
        evidence=(Evidence(file="kern.log", line=1, text="NVRM: Xid (PCI:0000:b1:00): 79"),),
        source="test",
        occurrences=occurrences,
        last_seen_at=at,
    )


def cluster_of(n: int) -> FakeCluster:
    return FakeCluster(nodes={f"n{i:03d}": FakeNode() for i in range(n)})


def make(tmp_path: Path | None, cluster: FakeCluster, clock: FakeClock, **kw):
    options = kw.pop("engine_options", {})
    return Pipeline(
        facts={},
        notifiers=kw.pop("notifiers", []),
        audit_log_path=kw.pop("audit_log_path",
                              str(tmp_path / "audit.jsonl") if tmp_path else None),
        dry_run=False,
        scheduler=FakeScheduler(cluster, **kw.pop("fake", {})),
        clock=clock,
        rules=[],
        cluster_size=kw.pop("cluster_size", len(cluster.nodes)),
        max_disrupted_fraction=kw.pop("fraction", 1.0),
        action_store_path=str(tmp_path / "actions.db") if tmp_path else None,
        engine_options={"probation_seconds": 600.0, **options},
        **kw,
    )


def run(pipeline: Pipeline, ticks: int = 10, clock: FakeClock | None = None) -> None:
    for _ in range(ticks):
        asyncio.run(pipeline.atick())
        if clock is not None:
            clock.advance(1.0)


def steps_of(pipeline: Pipeline, node: str | None = None) -> list[tuple[str, str]]:
    return [(a.step.value, a.phase.value) for a in pipeline.actions.actions(node=node)]


def test_xid79_cordon_drain_reboot_probation_resume(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(4)
    p = make(tmp_path, cluster, clock, fake={"drain_polls": 2, "reboot_polls": 2})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    assert not cluster.nodes["n001"].schedulable
    assert cluster.nodes["n001"].reason.startswith("gpuhealth: GpuXid79")
    run(p, 8, clock)
    assert [h[0] for h in cluster.history] == ["cordon", "drain", "reboot"]
    [inc] = p.actions.incidents()
    assert inc.state == INCIDENT_PROBATION
    clock.advance(601)
    run(p, 3, clock)
    assert [h[0] for h in cluster.history] == ["cordon", "drain", "reboot", "resume"]
    assert p.actions.incidents()[0].state == INCIDENT_CLOSED
    assert p.policy.out_of_service == frozenset()
    decisions = [(r.decision, r.step.value if r.step else "") for r in
                 read_audit_log(str(tmp_path / "audit.jsonl"))]
    assert ("submitted", "cordon") in decisions
    assert ("succeeded", "reboot") in decisions
    assert ("probation", "reboot") in decisions
    # replaying the same incident does nothing twice
    p.evaluate()
    run(p, 3, clock)
    assert len(cluster.history) == 4


def test_human_resume_in_between_is_respected(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(4)
    p = make(tmp_path, cluster, clock, fake={"drain_polls": 3})
    p.observe_findings([xid79("n002")], hold_seconds=1e6)
    p.evaluate()  # cordon done, drain running
    assert [h[0] for h in cluster.history] == ["cordon", "drain"]
    cluster.human_resume("n002")
    run(p, 10, clock)
    assert [h[0] for h in cluster.history] == ["cordon", "drain"]  # no reboot
    assert cluster.nodes["n002"].schedulable
    [inc] = p.actions.incidents()
    assert inc.state == INCIDENT_HUMAN
    assert "human returned" in inc.note
    assert p.policy.out_of_service == frozenset()  # its budget slot is free again
    cancelled = [a for a in p.actions.actions() if a.phase == ActionPhase.CANCELLED]
    assert [a.step for a in cancelled] == [S.DRAIN, S.REBOOT]  # the running drain stops too


@pytest.mark.parametrize(("hook", "step", "first"), [
    # resumed between gpuhealth's cordon and the drain's submission (no read in between):
    # the drain must not cordon it again
    ("before_submit", S.DRAIN, ActionPhase.SUCCEEDED),
    # resumed before the cordon's first status read: the cordon ends cancelled
    ("after_submit", S.CORDON, ActionPhase.CANCELLED),
], ids=["before-the-drain", "before-the-cordons-status"])
def test_a_human_resume_right_after_the_cordon_is_not_undone(tmp_path, hook, step, first):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(4)

    def human(request):
        if request.step == step:
            cluster.human_resume(request.node)

    p = make(tmp_path, cluster, clock, fake={hook: human})
    p.observe_findings([xid79("n002")], hold_seconds=1e6)
    p.evaluate()
    run(p, 5, clock)
    assert [h[0] for h in cluster.history] == ["cordon"]
    assert cluster.nodes["n002"].schedulable
    [inc] = p.actions.incidents()
    assert inc.state == INCIDENT_HUMAN
    assert "human returned" in inc.note
    assert p.policy.out_of_service == frozenset()
    assert [(a.step, a.phase) for a in p.actions.actions()] == [
        (S.CORDON, first), (S.DRAIN, ActionPhase.CANCELLED), (S.REBOOT, ActionPhase.CANCELLED)]


def test_the_first_take_out_is_not_marked_taken_out(tmp_path):
    seen: list[tuple[str, str]] = []
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    p = make(tmp_path, cluster, clock, fake={
        "before_submit": lambda r: seen.append((r.step.value, r.attrs.get("taken_out", "")))})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    run(p, 8, clock)
    assert seen[:3] == [("cordon", ""), ("drain", "yes"), ("reboot", "yes")]


def test_a_humans_drain_is_left_to_the_human(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    cluster.human_drain("n000", "disk replacement INC-42")
    p = make(tmp_path, cluster, clock)
    p.observe_findings([xid79("n000")], hold_seconds=1e6)
    p.evaluate()
    run(p, 5, clock)
    assert cluster.history == []
    assert cluster.nodes["n000"].reason == "disk replacement INC-42"
    assert p.actions.incidents()[0].state == INCIDENT_HUMAN


def test_opted_out_node_is_not_touched(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    cluster.nodes["n001"].opted_out = True
    p = make(tmp_path, cluster, clock)
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    run(p, 3, clock)
    assert cluster.history == []
    assert "opted out" in p.actions.incidents()[0].note


def test_recurrence_on_probation_escalates_to_hand_off(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(3)
    p = make(tmp_path, cluster, clock)
    p.observe_findings([xid79("n001", occurrences=1)], hold_seconds=1e6)
    p.evaluate()
    run(p, 6, clock)
    assert p.actions.incidents()[0].state == INCIDENT_PROBATION
    p.observe_findings([xid79("n001", occurrences=2, at=clock())], hold_seconds=1e6)
    p.evaluate()
    run(p, 6, clock)
    steps = [h[0] for h in cluster.history]
    assert steps == ["cordon", "drain", "reboot", "cordon", "drain", "hand_off"]
    assert not cluster.nodes["n001"].schedulable
    assert "hand-off" in cluster.nodes["n001"].reason or "GpuXid79" in cluster.nodes["n001"].reason
    clock.advance(10_000)
    run(p, 3, clock)
    assert "resume" not in [h[0] for h in cluster.history]  # handed off: a human resumes


def test_breaker_opens_on_a_burst_and_holds_until_reset(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(50)
    p = make(tmp_path, cluster, clock, engine_options={"breaker_max_nodes": 5})
    p.observe_findings([xid79(f"n{i:03d}") for i in range(50)], hold_seconds=1e6)
    p.evaluate()
    run(p, 5, clock)
    assert p.engine.breaker_open
    assert cluster.history == []  # the breaker opened before anything was submitted
    held = [r for r in read_audit_log(str(tmp_path / "audit.jsonl")) if r.decision == "waiting"]
    assert held
    assert all("circuit breaker" in r.reason for r in held)
    p.engine.reset_breaker(who="alice")
    run(p, 20, clock)
    assert len({node for step, node in cluster.history if step == "cordon"}) == 50


def test_rate_limit(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(10)
    p = make(tmp_path, cluster, clock, engine_options={"max_actions_per_minute": 3})
    p.observe_findings([xid79(f"n{i:03d}") for i in range(6)], hold_seconds=1e6)
    p.evaluate()
    assert len(cluster.history) == 3  # three tokens at once, then one every 20 s
    clock.advance(20)
    run(p, 1)
    assert len(cluster.history) == 4


def test_approval_then_cancel(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(4)
    p = make(tmp_path, cluster, clock,
             engine_options={"approval_min_severity": Severity.CRITICAL})
    p.observe_findings([xid79("n001"), xid79("n002")], hold_seconds=1e6)
    p.evaluate()
    run(p, 3, clock)
    assert cluster.history == []
    waiting = p.actions.actions(phases=[ActionPhase.AWAITING_APPROVAL])
    assert {a.step for a in waiting} == {S.CORDON, S.DRAIN, S.REBOOT}
    first = next(a for a in waiting if a.node == "n001" and a.step == S.CORDON)
    approve(p.actions, first.id, who="alice", now=clock())
    run(p, 3, clock)
    assert cluster.history == [("cordon", "n001")]
    other = next(a for a in waiting if a.node == "n002" and a.step == S.CORDON)
    cancel(p.actions, other.id, who="bob", now=clock())
    run(p, 3, clock)
    assert all(h[1] == "n001" for h in cluster.history)
    n2 = p.actions.actions(node="n002")
    assert all(a.phase == ActionPhase.CANCELLED for a in n2)  # later steps follow the cancel


def test_undo_resumes_only_what_gpuhealth_did(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    p = make(tmp_path, cluster, clock, fake={"drain_polls": 50})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    cordon = next(a for a in p.actions.actions() if a.step == S.CORDON)
    undo(p.actions, cordon.id, who="carol", now=clock())
    run(p, 3, clock)
    assert cluster.nodes["n001"].schedulable
    assert ("resume", "n001") in cluster.history


def test_failover_resubmits_and_completes_exactly_once(tmp_path):
    """Leader A dies in the middle of a drain; B takes over from the shared store and log."""
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(3)
    leader = {"who": "a"}
    a = make(tmp_path, cluster, clock, fake={"drain_polls": 5},
             is_leader=lambda: leader["who"] == "a")
    b = make(tmp_path, cluster, clock, fake={"drain_polls": 5},
             is_leader=lambda: leader["who"] == "b")
    f = xid79("n001")
    for p in (a, b):
        p.observe_findings([f], hold_seconds=1e6)
    a.evaluate()
    b.evaluate()  # the standby only tracks the alert
    run(a, 2, clock)
    drain = next(x for x in a.actions.actions() if x.step == S.DRAIN)
    assert drain.phase == ActionPhase.RUNNING
    leader["who"] = "b"  # A is gone (its lease expired)
    b.evaluate()
    run(b, 12, clock)
    assert cluster.effects == dict.fromkeys(cluster.effects, 1)
    assert [h[0] for h in cluster.history] == ["cordon", "drain", "reboot"]
    store = ActionStore(tmp_path / "actions.db")
    phases = {x.step: x.phase for x in store.actions()}
    assert phases[S.DRAIN] == ActionPhase.SUCCEEDED
    assert phases[S.REBOOT] == ActionPhase.SUCCEEDED
    requested = [r for r in read_audit_log(str(tmp_path / "audit.jsonl"))
                 if r.decision == "requested"]
    assert len(requested) == len({r.idempotency_key for r in requested})


def test_the_first_evaluation_as_leader_decides_with_the_policy_it_took_over(tmp_path):
    # The budget is one node of ten. The old leader has n001 out (draining); the standby
    # leads, and its first evaluation as leader brings a new fault on n002. It decided that
    # with its own stale policy (restored at its start, knowing nothing of n001), before the
    # tick's take-over rebuilt the policy: both nodes went out. It takes over first now.
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(10)
    leader = {"who": "a"}
    a, b = (make(tmp_path, cluster, clock, fraction=0.1, fake={"drain_polls": 100},
                 is_leader=lambda who=who: leader["who"] == who) for who in ("a", "b"))
    for p in (a, b):
        p.observe_findings([xid79("n001")], hold_seconds=1e6)
    a.evaluate()
    run(a, 2, clock)
    b.evaluate()  # the standby tracks the alert, decides nothing
    assert cluster.out_of_service_by_gpuhealth() == {"n001"}
    leader["who"] = "b"  # A is gone
    b.observe_findings([xid79("n002")], hold_seconds=1e6)
    out = b.evaluate()
    run(b, 5, clock)
    assert cluster.out_of_service_by_gpuhealth() == {"n001"}  # n002 waits for the budget
    assert {r.node for r in out.audit} == {"n002"}  # decided once, in the take-over
    requested = [r for r in read_audit_log(str(tmp_path / "audit.jsonl"))
                 if r.decision == "requested"]
    assert len(requested) == len({r.idempotency_key for r in requested})


def test_a_standby_keeps_its_policy_warm_and_reads_only_the_tail_on_taking_over(
        tmp_path, monkeypatch):
    # A shared audit store (a controller pair's): the standby applies the trail as it
    # grows, so taking over reads only what the old leader appended since; the outcome
    # is the whole-trail take-over's (every effect once, no step requested twice).
    reads: list[tuple[int, int]] = []
    real = AuditStore.read_after

    def spy(self, after):  # type: ignore[no-untyped-def]
        records, last = real(self, after)
        reads.append((after, len(records)))
        return records, last

    monkeypatch.setattr(AuditStore, "read_after", spy)
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(3)
    leader = {"who": "a"}
    trail = str(tmp_path / "audit.sqlite")
    a = make(tmp_path, cluster, clock, fake={"drain_polls": 5}, audit_log_path=trail,
             is_leader=lambda: leader["who"] == "a")
    b = make(tmp_path, cluster, clock, fake={"drain_polls": 5}, audit_log_path=trail,
             is_leader=lambda: leader["who"] == "b")
    f = xid79("n001")
    for p in (a, b):
        p.observe_findings([f], hold_seconds=1e6)
    a.evaluate()
    b.evaluate()  # the standby tracks the alert and warms its policy on the trail so far
    assert reads
    assert reads[-1][0] == 0  # the first warm-up reads the trail so far
    assert reads[-1][1] > 0
    warmed = sum(n for _, n in reads)
    run(a, 2, clock)  # the old leader goes on: cordon done, drain running
    total = len(AuditStore(trail).read())
    leader["who"] = "b"
    reads.clear()
    b.evaluate()
    assert reads[0][0] > 0  # the tail only
    assert reads[0][1] == total - warmed
    run(b, 12, clock)
    assert cluster.effects == dict.fromkeys(cluster.effects, 1)
    assert [h[0] for h in cluster.history] == ["cordon", "drain", "reboot"]
    requested = [r for r in AuditStore(trail).read() if r.decision == "requested"]
    assert len(requested) == len({r.idempotency_key for r in requested})

@settings(max_examples=25, deadline=None)
@given(
    size=st.integers(min_value=1, max_value=60),
    fraction=st.sampled_from([0.05, 0.1, 0.2, 0.5]),
    failing=st.integers(min_value=1, max_value=50),
    resolve_every=st.integers(min_value=0, max_value=5),
)
def test_budget_holds_under_a_burst(size, fraction, failing, resolve_every):
    """Property: never more than max(1, floor(fraction x size)) nodes out by gpuhealth."""
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(size)
    p = make(None, cluster, clock, fraction=fraction, cluster_size=size)
    limit = max(1, int(fraction * size + 1e-9))
    nodes = sorted(cluster.nodes)[: min(failing, size)]
    for i, node in enumerate(nodes):
        p.observe_findings([xid79(node)], hold_seconds=1e6)
        p.evaluate()
        run(p, 2, clock)
        assert len(cluster.out_of_service_by_gpuhealth()) <= limit
        if resolve_every and i % resolve_every == 0:
            p.clear_findings([(nodes[0], "GPU-1", "xid", "79")])
            p.evaluate()
            run(p, 2, clock)
            assert len(cluster.out_of_service_by_gpuhealth()) <= limit
    assert p.policy.disruption_limit == limit


def test_reliability_scores_are_published_for_placement(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(3)
    p = make(tmp_path, cluster, clock, engine_options={"placement_interval_seconds": 60.0})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    clock.advance(61)
    run(p, 1)
    scheduler = p.engine.scheduler
    assert scheduler.weights == {"n001": 0.5}
    assert p.engine.stats.reliability["n001"] == 0.5



def scored_fleet(tmp_path, nodes, clock):
    """A pipeline whose every node holds an Xid 79 (so each is scored 0.5 at placement)."""
    cluster = cluster_of(nodes)
    p = make(tmp_path, cluster, clock, engine_options={"placement_interval_seconds": 60.0})
    p.observe_findings([xid79(n) for n in sorted(cluster.nodes)], hold_seconds=1e6)
    p.evaluate()
    return p, cluster


def count_publishes(monkeypatch, scheduler) -> list[str]:
    """The nodes ``scheduler.set_reliability`` is called for, in order (still publishing)."""
    calls: list[str] = []
    real = scheduler.set_reliability

    async def counted(node, score):  # type: ignore[no-untyped-def]
        calls.append(node)
        await real(node, score)

    monkeypatch.setattr(scheduler, "set_reliability", counted)
    return calls


def test_a_fleet_of_scores_is_published_a_bounded_number_per_tick_and_only_when_it_shows(
        tmp_path, monkeypatch):
    # A new leader scores every node at once; one tick must not publish them all (at
    # 10,000 nodes that held its first ticks for 20-26 s), yet all are published within
    # a few ticks; the decay's fourth-decimal change is not published again.
    from remediation import engine as engine_module

    monkeypatch.setattr(engine_module, "PUBLISH_PER_TICK", 4)
    clock = FakeClock(now=1000.0)
    p, cluster = scored_fleet(tmp_path, 10, clock)
    scheduler = p.engine.scheduler
    calls = count_publishes(monkeypatch, scheduler)
    clock.advance(61)
    run(p, 1)
    assert len(calls) == 4
    run(p, 2)
    assert sorted(calls) == sorted(cluster.nodes)  # each once, within three ticks
    assert set(scheduler.weights.values()) == {0.5}
    clock.advance(3600)  # the decay moves the score's fourth decimal, not its second
    run(p, 3)
    assert p.engine.stats.reliability["n001"] != 0.5
    assert len(calls) == 10


def test_a_new_leader_publishes_only_the_scores_the_nodes_do_not_show_yet(tmp_path, monkeypatch):
    # After a fail-over the new leader knew nothing of what the old one had published and
    # updated every scored node again (10,000 node updates at 10,000 nodes, competing with
    # its first decisions); it reads the scores back once and publishes only what differs.
    clock = FakeClock(now=1000.0)
    p, cluster = scored_fleet(tmp_path, 10, clock)
    scheduler = p.engine.scheduler
    scheduler.weights = dict.fromkeys(cluster.nodes, 0.5)  # what the old leader published
    scheduler.weights["n003"] = 0.9  # a stale one
    calls = count_publishes(monkeypatch, scheduler)
    clock.advance(61)
    run(p, 2)
    assert calls == ["n003"]
    assert set(scheduler.weights.values()) == {0.5}
    # Taking over again forgets what was published: another leader may have changed it.
    scheduler.weights["n004"] = 0.7
    p.engine.forget_published()
    clock.advance(61)
    run(p, 2)
    assert calls == ["n003", "n004"]


def test_scores_are_published_when_they_cannot_be_read_back(tmp_path, monkeypatch, caplog):
    from core.errors import SchedulerUnavailable

    clock = FakeClock(now=1000.0)
    p, cluster = scored_fleet(tmp_path, 3, clock)
    scheduler = p.engine.scheduler

    async def unreadable():  # type: ignore[no-untyped-def]
        raise SchedulerUnavailable("list nodes: 503")

    monkeypatch.setattr(scheduler, "published_reliability", unreadable)
    clock.advance(61)
    with caplog.at_level("WARNING", logger="remediation.engine"):
        run(p, 1)
    assert "cannot read the published reliability scores back" in caplog.text
    assert set(scheduler.weights) == set(cluster.nodes)


def test_a_score_that_cannot_be_published_is_said_once_and_published_at_the_next_placement(
        tmp_path, monkeypatch, caplog):
    from core.errors import SchedulerUnavailable

    clock = FakeClock(now=1000.0)
    p, cluster = scored_fleet(tmp_path, 3, clock)
    scheduler = p.engine.scheduler
    real = scheduler.set_reliability
    away = {"on": True}

    async def flaky(node, score):  # type: ignore[no-untyped-def]
        if away["on"]:
            raise SchedulerUnavailable("the API server is away")
        await real(node, score)

    monkeypatch.setattr(scheduler, "set_reliability", flaky)
    clock.advance(61)
    with caplog.at_level("WARNING", logger="remediation.engine"):
        run(p, 1)
    said = [r for r in caplog.records if "cannot publish the reliability" in r.getMessage()]
    assert len(said) == 1
    assert "3 node(s)" in said[0].getMessage()
    assert scheduler.weights == {}
    away["on"] = False
    run(p, 1)
    assert scheduler.weights == {}  # not before the next placement
    clock.advance(61)
    run(p, 1)
    assert set(scheduler.weights) == set(cluster.nodes)

def test_an_old_copy_of_the_event_is_not_a_recurrence(tmp_path):
    """Two backlog lines of one old Xid (kernel log read at start) must not escalate."""
    clock = FakeClock(now=10_000.0)
    cluster = cluster_of(3)
    p = make(tmp_path, cluster, clock)
    p.observe_findings([xid79("n001", occurrences=1, at=5_000.0)], hold_seconds=1e6)
    p.evaluate()
    run(p, 6, clock)
    assert p.actions.incidents()[0].state == INCIDENT_PROBATION
    p.observe_findings([xid79("n001", occurrences=2, at=5_018.0)], hold_seconds=1e6)
    p.evaluate()
    run(p, 6, clock)
    assert "hand_off" not in [h[0] for h in cluster.history]
    assert p.actions.incidents()[0].state == INCIDENT_PROBATION


def test_every_incident_takes_its_first_step_before_any_takes_its_second(tmp_path):
    # A burst: each node's cordon comes before any node's drain within one tick, even
    # one incident at a time, so a long drain never delays another node's cordon.
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(6)
    p = make(tmp_path, cluster, clock, fake={"drain_polls": 0, "reboot_polls": 5},
             engine_options={"concurrency": 1})
    p.observe_findings([xid79(f"n{i:03d}") for i in range(6)], hold_seconds=1e6)
    p.evaluate()
    steps = [step for step, _ in cluster.history]
    assert steps == ["cordon"] * 6 + ["drain"] * 6 + ["reboot"] * 6
    assert [node for _, node in cluster.history[:6]] == [f"n{i:03d}" for i in range(6)]



def test_the_step_after_a_notify_runs_in_the_same_tick(tmp_path):
    # A critical network fault is notify, cordon, drain: the notify succeeds without an
    # adapter, and the cordon must not wait for the next tick (fleet_sim's time to cordon).
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(4)
    p = make(tmp_path, cluster, clock)
    fault = replace(xid79("n001"), kind="ib_port", code="down", entity=EntityId("mlx5_0/1"),
                    action=Action.CHECK_NETWORK)
    p.observe_findings([fault], hold_seconds=1e6)
    p.evaluate()  # one evaluation, one (inline) tick
    assert [step for step, _ in cluster.history][:1] == ["cordon"]
    assert steps_of(p, "n001")[:2] == [("notify", "succeeded"), ("cordon", "succeeded")]

def test_placement_waits_while_steps_are_being_submitted(tmp_path):
    # Publishing weights is a hint; a burst's steps come first, for at most one interval.
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(3)
    p = make(tmp_path, cluster, clock, fake={"drain_polls": 0, "reboot_polls": 100},
             engine_options={"placement_interval_seconds": 60.0})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()  # submits cordon, drain, reboot: placement deferred
    assert p.engine.scheduler.weights == {}
    clock.advance(1)
    run(p, 1)  # only polls now: placement runs
    assert p.engine.scheduler.weights == {"n001": 0.5}


def test_a_dry_run_disrupts_nothing_and_repairs_nothing(tmp_path):
    # The policy still counts the nodes it would take out (to show what the budget would
    # hold back), but the metrics must not call that a disruption or a repair (MTTR).
    from gpuhealth.service import disrupted

    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    p = Pipeline(facts={}, notifiers=[], audit_log_path=None, dry_run=True,
                 scheduler=FakeScheduler(cluster), clock=clock, rules=[], cluster_size=2,
                 max_disrupted_fraction=1.0, engine_options={"probation_seconds": 600.0})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    run(p, 5, clock)
    assert p.policy.out_of_service == frozenset({"n001"})
    assert disrupted(p.policy) == frozenset()
    assert p.engine.stats.remediate_seconds == []
    assert cluster.nodes["n001"].schedulable


# --- outcomes of attempts: transient (retried with backoff, within a budget) or permanent --


def _flaky(fail: dict[str, int], exc_of):  # type: ignore[no-untyped-def]
    def before(request):  # type: ignore[no-untyped-def]
        left = fail.get(request.step.value, 0)
        if left:
            fail[request.step.value] = left - 1
            raise exc_of(request)
    return before


def test_a_transient_failure_is_retried_with_backoff_then_succeeds(tmp_path):
    from core.errors import SchedulerUnavailable
    from remediation.metrics import RemediationCollector

    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    fail = {"cordon": 2}
    p = make(tmp_path, cluster, clock, fake={"before_submit": _flaky(
        fail, lambda r: SchedulerUnavailable("provider: HTTP 409 Conflict"))},
        engine_options={"step_attempts": 4})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()  # first try fails: waits 5 s
    assert cluster.history == []
    run(p, 3, clock)  # t+3: still backing off (no try before t+5)
    assert fail["cordon"] == 1
    run(p, 15, clock)  # second try at t+5 fails (waits 10 s), third at t+15 succeeds
    assert [h[0] for h in cluster.history][:1] == ["cordon"]
    audit = read_audit_log(str(tmp_path / "audit.jsonl"))
    transient = [r for r in audit if r.details.get("classification") == "transient"]
    assert [r.details["attempt"] for r in transient] == ["1", "2"]
    assert "tried again in 5 s" in transient[0].reason
    assert "tried again in 10 s" in transient[1].reason
    samples = {(m.name, tuple(sorted(s.labels.items()))): s.value
               for m in RemediationCollector(p.remediation, is_leader=lambda: True).collect()
               for s in m.samples}
    assert samples[("gpuhealth_remediation_failures",
                    (("classification", "transient"), ("step", "cordon")))] == 2


def test_the_attempt_budget_runs_out_and_the_incident_is_escalated(tmp_path):
    from core.errors import SchedulerUnavailable

    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    p = make(tmp_path, cluster, clock, fake={"before_submit": _flaky(
        {"cordon": 99}, lambda r: SchedulerUnavailable("slurmctld: Unable to contact slurm "
                                                       "controller"))},
        engine_options={"step_attempts": 3})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    run(p, 40, clock)
    assert cluster.history == []
    assert steps_of(p, "n001")[0] == ("cordon", "failed")
    assert all(phase in ("failed", "cancelled") for _, phase in steps_of(p, "n001"))
    audit = read_audit_log(str(tmp_path / "audit.jsonl"))
    escalated = [r for r in audit if r.decision == "escalated"]
    assert len(escalated) == 1
    assert escalated[0].details["classification"] == "exhausted"
    assert "3 transient failures in a row" in escalated[0].reason


def test_a_permanent_refusal_is_not_retried(tmp_path):
    from core.errors import PermanentError

    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    fail = {"cordon": 99}
    p = make(tmp_path, cluster, clock, fake={"before_submit": _flaky(
        fail, lambda r: PermanentError("HTTP 403 Forbidden: nodes is forbidden"))})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    run(p, 10, clock)
    assert fail["cordon"] == 98  # tried once
    audit = read_audit_log(str(tmp_path / "audit.jsonl"))
    (escalated,) = [r for r in audit if r.decision == "escalated"]
    assert escalated.details["classification"] == "permanent"
    assert "403" in escalated.reason


def sbe_warning(node: str) -> Finding:
    return Finding(
        node=NodeName(node), entity=EntityId("GPU-2"), kind="ecc", code="sbe",
        severity=Severity.WARNING, action=Action.NONE,
        summary="corrected ECC errors rising on this GPU",
        evidence=(Evidence(file="nvml", line=None, text="volatile SBE count 12"),),
        source="test")


def test_a_warnings_incident_closes_when_its_finding_is_gone(tmp_path):
    # Found by benchmarks/fleet_sim.py: every warning of a fleet (one notify step each)
    # stayed an open incident for ever, and each tick read them all.
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    p = make(tmp_path, cluster, clock)
    p.observe_findings([sbe_warning("n000")], hold_seconds=1e6)
    p.evaluate()
    run(p, 2, clock)
    [inc] = p.actions.incidents()
    assert inc.state == "open"  # it fires: the incident lasts as long as the finding
    assert steps_of(p) == [("notify", "succeeded")]
    p.clear_findings([sbe_warning("n000").key])
    p.evaluate()
    run(p, 1, clock)
    [inc] = p.actions.incidents()
    assert (inc.state, inc.note) == (INCIDENT_CLOSED, "the finding is gone")
    assert cluster.history == []  # nothing of the node was touched


def test_a_warning_gone_before_its_notify_ran_closes_after_it(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    p = make(tmp_path, cluster, clock, tick_inline=False)
    p.observe_findings([sbe_warning("n000")], hold_seconds=1e6)
    p.evaluate()  # decided, not run yet
    assert steps_of(p) == [("notify", "pending")]
    p.clear_findings([sbe_warning("n000").key])
    p.evaluate()
    assert p.actions.incidents()[0].state == "open"
    run(p, 1, clock)
    [inc] = p.actions.incidents()
    assert inc.state == INCIDENT_CLOSED


def test_an_incident_that_changed_the_node_does_not_close_on_resolve(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(4)
    p = make(tmp_path, cluster, clock, fake={"drain_polls": 50})
    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    p.evaluate()
    run(p, 2, clock)
    p.clear_findings([xid79("n001").key])
    p.evaluate()
    run(p, 1, clock)
    assert p.actions.incidents()[0].state == "open"  # the drain runs; resume follows it


def test_with_delivery_apart_a_decision_never_waits_behind_a_slow_notifier(tmp_path):
    # A controller delivers the outbox in a task of its own (gpuhealth/controller.py):
    # the evaluation decides and returns while a notifier hangs.
    from alerting.testing import RecordingNotifier

    class Hanging(RecordingNotifier):
        async def send(self, alert):  # type: ignore[no-untyped-def]
            await asyncio.sleep(30)

    clock = FakeClock(now=1000.0)
    cluster = cluster_of(2)
    p = make(tmp_path, cluster, clock, notifiers=[Hanging(name="slow")])
    p.deliver_inline = False

    async def evaluate_within_a_second():
        return await asyncio.wait_for(p.aevaluate(), 1.0)

    p.observe_findings([xid79("n001")], hold_seconds=1e6)
    out = asyncio.run(evaluate_within_a_second())
    assert not cluster.nodes["n001"].schedulable  # cordoned in the evaluation
    assert [a.labels["alertname"] for a in out.notified] == ["GpuXid79"]
    assert p.notify_due.is_set()
    assert p.outbox_depths() == {"slow": 1}
    p.deliver_inline = True  # run's way: the evaluation delivers (and here, times out)
    p.notify_due.clear()
    p.observe_findings([sbe_warning("n000")], hold_seconds=1e6)
    with pytest.raises(TimeoutError):
        asyncio.run(evaluate_within_a_second())


def test_a_cordon_is_stored_before_a_backlog_of_notify_steps(tmp_path, monkeypatch):
    # Found by benchmarks/fleet_sim.py: a take-over decides every firing alert at once
    # (3,500 notify steps at 2,000 nodes) and storing them all in one tick held the next
    # round, and the first cordon after the fail-over, for over a second. The disruptive
    # step goes first; the notify steps follow a few incidents per call, each once.
    monkeypatch.setattr(stage_module, "NOTIFY_INCIDENTS_PER_TICK", 2)
    clock = FakeClock(now=1000.0)
    cluster = cluster_of(8)
    p = make(tmp_path, cluster, clock, tick_inline=False)
    p.observe_findings([sbe_warning(f"n{i:03d}") for i in range(1, 7)], hold_seconds=1e6)
    p.observe_findings([xid79("n000")], hold_seconds=1e6)
    p.evaluate()  # one evaluation decides the seven incidents
    stored = {(a.node, a.step) for a in p.actions.actions()}
    assert ("n000", S.CORDON) in stored
    assert sorted(n for n, s in stored if s == S.NOTIFY) == ["n001", "n002"]
    run(p, 2, clock)  # two more incidents' notify steps a call
    notified = sorted(a.node for a in p.actions.actions()
                      if a.step == S.NOTIFY)
    assert notified == [f"n{i:03d}" for i in range(1, 7)]
    keys = [a.key for a in p.actions.actions()]
    assert len(keys) == len(set(keys))


def test_a_replay_stores_every_notify_step_it_decided(tmp_path, monkeypatch):
    monkeypatch.setattr(stage_module, "NOTIFY_INCIDENTS_PER_TICK", 1)
    clock = FakeClock(now=1000.0)
    p = make(tmp_path, cluster_of(4), clock, tick_inline=False)
    p.observe_findings([sbe_warning(f"n{i:03d}") for i in range(3)], hold_seconds=1e6)
    p.evaluate()
    assert len(p.actions.actions()) == 1
    p.store_pending()
    assert sorted(a.node for a in p.actions.actions()) == ["n000", "n001", "n002"]


def test_urgent_first_keeps_each_incident_whole_and_in_order():
    from remediation.policy import Decision, PlannedStep, PolicyResult

    def decision(incident: str, step: RemediationStep | None) -> Decision:
        planned = None if step is None else PlannedStep(step=step, entity=EntityId("node"))
        return Decision(at=0.0, actor="test", decision="requested", node=NodeName("n1"),
                        planned=planned, reason="test", idempotency_key=incident,
                        dry_run=False, fingerprint=incident, incident=1)

    result = PolicyResult([decision("a", S.NOTIFY), decision("b", S.NOTIFY),
                           decision("c", S.CORDON), decision("a", None),
                           decision("d", S.NOTIFY), decision("b", S.NOTIFY)])
    now, later = stage_module.urgent_first(result, 1)
    assert [d.incident_key for d in now.decisions] == ["a", "c", "a"]
    assert [d.incident_key for d in later.decisions] == ["b", "d", "b"]
    now, later = stage_module.urgent_first(result, 0)
    assert [d.incident_key for d in now.decisions] == ["c"]
