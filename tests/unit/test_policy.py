from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.clock import FakeClock
from core.errors import PermanentError
from core.protocols import SchedulerAdapter
from core.records import (
    NODE_ENTITY,
    Action,
    ActionPhase,
    ActionRequest,
    ActionStatus,
    EntityId,
    Finding,
    NodeName,
    RemediationStep,
    Severity,
)
from remediation.dry_run import DryRunScheduler
from remediation.policy import RemediationPolicy, describe_request, ladder

GPU = EntityId("0000:b1:00.0")


def make_finding(**kw: Any) -> Finding:
    base: dict[str, Any] = {
        "node": NodeName("gpu-001"),
        "entity": GPU,
        "kind": "xid",
        "code": "79",
        "severity": Severity.CRITICAL,
        "action": Action.REBOOT_NODE,
        "summary": "GPU has fallen off the bus",
        "evidence": (),
        "source": "test",
    }
    base.update(kw)
    return Finding(**base)


XID79 = make_finding()
XID94 = make_finding(
    code="94", severity=Severity.WARNING, action=Action.RESET_GPU, summary="contained ECC error"
)
XID109 = make_finding(code="109", action=Action.RESET_GPU, summary="ctxsw timeout")
RESET_REQUIRED_NODE = make_finding(
    kind="recovery_action", code="reset_required", entity=NODE_ENTITY, action=Action.RESET_GPU
)
IB_DOWN = make_finding(
    kind="ib_port",
    code="Down",
    entity=EntityId("mlx5_0:1"),
    severity=Severity.MAJOR,
    action=Action.CHECK_NETWORK,
)
HW = make_finding(kind="diagnostic", code="memory", action=Action.SERVICE_HARDWARE)
EDAC = make_finding(
    kind="host_memory", code="edac_ue", entity=NODE_ENTITY, action=Action.SERVICE_HARDWARE
)
INFO = make_finding(code="13", severity=Severity.INFO, action=Action.RESTART_APP)
COLLECTIVE = make_finding(
    kind="collective",
    code="timeout",
    entity=NODE_ENTITY,
    severity=Severity.WARNING,
    action=Action.NONE,
)


def steps(finding: Finding, **kw: Any) -> list[tuple[RemediationStep, str, str, str]]:
    return [(p.step, p.entity, p.when, p.scope) for p in ladder(finding, **kw)]


S = RemediationStep


def test_critical_reboot_node_cordons_drains_reboots_the_node():
    assert steps(XID79) == [
        (S.CORDON, NODE_ENTITY, "now", "node"),
        (S.DRAIN, NODE_ENTITY, "now", "node"),
        (S.REBOOT, NODE_ENTITY, "now", "node"),
    ]


def test_critical_reset_gpu_drains_and_resets_that_gpu_without_cordon():
    assert steps(XID109) == [(S.DRAIN, GPU, "now", "gpu"), (S.RESET_GPU, GPU, "now", "gpu")]


def test_critical_reset_gpu_without_gpu_level_drain_cordons_the_node():
    assert [s for s, *_ in steps(XID109, gpu_level_drain=False)] == [S.CORDON, S.DRAIN, S.RESET_GPU]


def test_critical_reset_gpu_node_at_fault_cordons():
    assert [s for s, *_ in steps(RESET_REQUIRED_NODE)] == [S.CORDON, S.DRAIN, S.RESET_GPU]


def test_warning_reset_gpu_is_deferred_and_never_cordons():
    plan = ladder(XID94)
    assert [p.step for p in plan] == [S.DRAIN, S.RESET_GPU]
    assert all(p.entity == GPU and p.scope == "gpu" for p in plan)
    assert plan[-1].when == "idle"
    assert plan[0].mode == "allow_completion"
    assert not any(p.disrupts_node for p in plan)


def test_major_check_network_notifies_and_drains_multi_node_jobs_at_safe_point():
    assert steps(IB_DOWN) == [
        (S.NOTIFY, EntityId("mlx5_0:1"), "now", "node"),
        (S.DRAIN, NODE_ENTITY, "next_safe_point", "multi_node_jobs"),
    ]


def test_critical_service_hardware_cordons_drains_hands_off():
    assert steps(HW) == [
        (S.CORDON, NODE_ENTITY, "now", "node"),
        (S.DRAIN, NODE_ENTITY, "now", "node"),
        (S.HAND_OFF, GPU, "now", "node"),
    ]
    assert [s for s, *_ in steps(EDAC)] == [S.CORDON, S.DRAIN, S.HAND_OFF]


def test_info_nothing_and_warning_none_notify_only():
    assert ladder(INFO) == []
    assert [s for s, *_ in steps(COLLECTIVE)] == [S.NOTIFY]


def policy(**kw: Any) -> RemediationPolicy:
    kw.setdefault("clock", FakeClock(now=1000.0))
    return RemediationPolicy(**kw)


def test_decide_produces_requests_with_keys_and_audit():
    p = policy()
    result = p.decide(XID79, fingerprint="fp79")
    assert [r.step for r in result.requests] == [S.CORDON, S.DRAIN, S.REBOOT]
    assert [r.idempotency_key for r in result.requests] == [
        "fp79/cordon",
        "fp79/drain",
        "fp79/reboot",
    ]
    assert all(r.dry_run and r.node == "gpu-001" for r in result.requests)
    assert result.requests[0].reason.startswith("gpuhealth: GpuXid79 critical reboot_node")
    assert [a.decision for a in result.audit] == ["requested"] * 3
    assert result.audit[0].at == 1000.0
    assert result.audit[0].details["fingerprint"] == "fp79"
    assert p.out_of_service == {"gpu-001"}
    assert [describe_request(r) for r in result.requests] == [
        "cordon node",
        "drain node",
        "reboot node",
    ]


def test_open_incidents_follow_decide_and_resolve():
    p = policy()
    p.decide(XID79, fingerprint="fp79")
    assert p.open_incidents == {"fp79": "gpu-001"}
    p.resolve(fingerprint="fp79", node="gpu-001")
    assert p.open_incidents == {}


def test_same_incident_twice_yields_duplicates_only():
    p = policy()
    p.decide(XID79, fingerprint="fp79")
    again = p.decide(XID79, fingerprint="fp79")
    assert again.requests == []
    assert [a.decision for a in again.audit] == ["duplicate"] * 3


def test_opt_out_holds_everything_but_notify():
    p = policy(opt_out_nodes=frozenset({"gpu-001"}))
    result = p.decide(IB_DOWN, fingerprint="ib")
    assert [r.step for r in result.requests] == [S.NOTIFY]
    held = [a for a in result.audit if a.decision == "held"]
    assert [(a.step, a.reason) for a in held] == [
        (S.DRAIN, "node opted out of automatic remediation")
    ]
    assert p.out_of_service == frozenset()


def test_low_confidence_only_notifies():
    result = policy().decide(make_finding(confidence=0.2), fingerprint="x")
    assert result.requests == []
    assert all(a.decision == "held" for a in result.audit)
    assert "confidence 0.20" in result.audit[0].reason


def test_budget_holds_second_node_and_later_steps_follow():
    p = policy(cluster_size=10, max_disrupted_fraction=0.10)
    assert p.disruption_limit == 1
    p.decide(XID79, fingerprint="a")
    other = make_finding(node=NodeName("gpu-002"), action=Action.RESET_GPU, entity=NODE_ENTITY)
    result = p.decide(other, fingerprint="b")
    assert result.requests == []
    reasons = [a.reason for a in result.audit]
    assert reasons[0].startswith("disruption budget exhausted: 1 of 1 node(s)")
    assert reasons[2].startswith("an earlier step was held back")  # the reset waits for its drain
    assert p.held == {"b"}
    # the same node may take more steps: it is already out of service
    more = p.decide(make_finding(code="48", action=Action.SERVICE_HARDWARE), fingerprint="c")
    assert [r.step for r in more.requests] == [S.HAND_OFF]
    assert [a.decision for a in more.audit] == ["duplicate", "duplicate", "requested"]
    assert more.audit[0].reason == "already requested by another incident (a/cordon)"


def test_the_budget_goes_to_the_worst_fault_first():
    # budget 1; a major fault arrives first in the burst, a lost GPU after it
    p = policy(cluster_size=10, max_disrupted_fraction=0.10)
    major = make_finding(node=NodeName("gpu-001"), severity=Severity.MAJOR, code="119",
                         summary="GSP timeout")
    lost = make_finding(node=NodeName("gpu-002"))
    result = p.decide_worst_first([(major, "m"), (lost, "c")])
    assert {(r.node, r.step) for r in result.requests if r.step == S.CORDON} == {
        ("gpu-002", S.CORDON)}
    assert p.held == {"m"}
    # held: a major (older) and then a critical (newer); when the slot frees, the critical
    # takes it although it came later
    p.decide_worst_first([(make_finding(node=NodeName("gpu-003")), "c2")])
    assert p.held == {"m", "c2"}
    p.resolve(fingerprint="c", node="gpu-002")
    retried = p.retry_held()
    assert [(r.node, r.step) for r in retried.requests][:1] == [("gpu-003", S.CORDON)]
    assert p.held == {"m"}
    # within one severity, arrival order
    q = policy(cluster_size=10, max_disrupted_fraction=0.10)
    first, second = (make_finding(node=NodeName(n)) for n in ("gpu-005", "gpu-004"))
    q.decide_worst_first([(first, "a"), (second, "b")])
    assert q.held == {"b"}


def test_the_last_budget_slots_are_kept_for_critical_faults():
    # budget 4 (40 nodes x 10 %), a quarter (1 slot) kept for critical faults
    p = policy(cluster_size=40, max_disrupted_fraction=0.10)
    assert (p.disruption_limit, p.critical_reserve) == (4, 1)
    majors = [make_finding(node=NodeName(f"gpu-00{i}"), severity=Severity.MAJOR, code="119",
                           summary="GSP timeout") for i in range(4)]
    taken = [bool(p.decide(f, fingerprint=f"m{i}").requests[1:]) for i, f in
             enumerate(majors)]
    assert taken == [True, True, True, False]  # the fourth major waits for the reserve
    held = p.decide(majors[3], fingerprint="m3")
    lost = p.decide(make_finding(node=NodeName("gpu-009")), fingerprint="c")
    assert [r.step for r in lost.requests][:1] == [S.CORDON]  # a lost GPU takes the last
    assert p.held == {"m3"}
    assert held.requests == []
    reasons = [a.reason for a in p.decide(majors[3], fingerprint="m3").audit]
    assert any("exhausted: 4 of 4" in r for r in reasons)
    # one node's budget keeps its slot for any fault; the reserve can be turned off
    assert policy(cluster_size=5, max_disrupted_fraction=0.2).critical_reserve == 0
    assert policy(cluster_size=40, critical_reserve_fraction=0.0).critical_reserve == 0
    assert policy(cluster_size=100, max_disrupted_fraction=0.1).critical_reserve == 3
    with pytest.raises(ValueError, match="critical_reserve_fraction"):
        policy(critical_reserve_fraction=1.0)


def test_a_predicted_failure_only_notifies_unless_the_site_opts_in():
    from alerting.alerts import finding_from_prediction
    from core.records import Prediction

    predicted = finding_from_prediction(Prediction(
        node=NodeName("gpu-007"), entity=GPU, probability=0.95, horizon_seconds=6 * 3600,
        top_features={"sbe_rate": 0.7}, predicted_at=1000.0))
    assert predicted is not None
    assert predicted.severity == Severity.MAJOR
    by_default = policy(cluster_size=10).decide(predicted, fingerprint="p")
    assert [r.step for r in by_default.requests] == [S.NOTIFY]
    held = [a.reason for a in by_default.audit if a.decision == "held"]
    assert held
    assert held[0].startswith("predicted failure: notify only")
    opted_in = policy(cluster_size=10, act_on_predictions=True).decide(predicted,
                                                                        fingerprint="p")
    assert S.DRAIN in [r.step for r in opted_in.requests]


def test_node_resumes_only_when_every_incident_holding_it_resolved():
    p = policy(cluster_size=10)
    p.decide(XID79, fingerprint="a")
    p.decide(make_finding(code="48", action=Action.SERVICE_HARDWARE), fingerprint="c")
    assert p.resolve(fingerprint="a", node="gpu-001").requests == []
    assert p.out_of_service == {"gpu-001"}
    (resume,) = p.resolve(fingerprint="c", node="gpu-001").requests
    assert resume.step == S.RESUME
    assert p.out_of_service == frozenset()
    # a new incident on the node cordons again
    again = p.decide(make_finding(code="119", action=Action.REBOOT_NODE), fingerprint="d")
    assert [r.step for r in again.requests] == [S.CORDON, S.DRAIN, S.REBOOT]


def test_two_faults_on_one_gpu_share_one_drain_and_reset():
    p = policy()
    first = p.decide(XID109, fingerprint="x109")
    second = p.decide(make_finding(code="154", action=Action.RESET_GPU), fingerprint="x154")
    assert [r.step for r in first.requests] == [S.DRAIN, S.RESET_GPU]
    assert second.requests == []
    assert [a.decision for a in second.audit] == ["duplicate", "duplicate"]
    # once both resolved, a new fault on that GPU is reset again
    p.resolve(fingerprint="x109", node="gpu-001")
    assert p.decide(XID109, fingerprint="x120").requests == []  # x154 still holds the reset
    p.resolve(fingerprint="x154", node="gpu-001")
    p.resolve(fingerprint="x120", node="gpu-001")
    assert [r.step for r in p.decide(XID109, fingerprint="x48").requests] == [S.DRAIN, S.RESET_GPU]


def test_restore_keeps_shared_steps():
    p = policy()
    records = p.decide(XID109, fingerprint="x109").audit
    records += p.decide(make_finding(code="154", action=Action.RESET_GPU), fingerprint="x154").audit
    q = policy()
    q.restore(records)
    assert (
        q.decide(make_finding(code="62", action=Action.RESET_GPU), fingerprint="x62").requests == []
    )


def test_gpu_level_steps_do_not_use_the_budget():
    p = policy(cluster_size=1)
    p.decide(XID79, fingerprint="a")
    other = make_finding(
        node=NodeName("gpu-002"), code="94", severity=Severity.WARNING, action=Action.RESET_GPU
    )
    assert [r.step for r in p.decide(other, fingerprint="b").requests] == [S.DRAIN, S.RESET_GPU]


def test_resolve_frees_budget_resumes_and_held_steps_are_retried():
    p = policy(cluster_size=5)
    p.decide(XID79, fingerprint="a")
    p.decide(make_finding(node=NodeName("gpu-002")), fingerprint="b")
    assert p.held == {"b"}
    assert p.retry_held().audit == []  # still held: not audited again
    resolved = p.resolve(fingerprint="a", node="gpu-001")
    assert [a.decision for a in resolved.audit] == ["resolved", "requested"]
    assert [(r.step, r.idempotency_key) for r in resolved.requests] == [(S.RESUME, "a/resume")]
    assert p.out_of_service == frozenset()
    retried = p.retry_held()
    assert [r.step for r in retried.requests] == [S.CORDON, S.DRAIN, S.REBOOT]
    assert p.out_of_service == {"gpu-002"}
    assert p.held == frozenset()


def test_recurrence_after_resolve_is_a_new_incident_with_new_keys():
    p = policy()
    p.decide(XID79, fingerprint="a")
    p.resolve(fingerprint="a", node="gpu-001")
    again = p.decide(XID79, fingerprint="a")
    assert [r.idempotency_key for r in again.requests] == ["a.2/cordon", "a.2/drain", "a.2/reboot"]


def test_resolve_of_unknown_alert_records_nothing():
    assert policy().resolve(fingerprint="zz", node="n").audit == []


def test_restore_from_audit_makes_replay_idempotent():
    first = policy(cluster_size=1)
    records = first.decide(XID79, fingerprint="a").audit
    second = policy(cluster_size=1)
    second.restore(records)
    assert second.out_of_service == {"gpu-001"}
    again = second.decide(XID79, fingerprint="a")
    assert again.requests == []
    assert {a.decision for a in again.audit} == {"duplicate"}
    # after a resolve in the log, the next occurrence is a new incident
    third = policy()
    third.restore([*records, *first.resolve(fingerprint="a", node="gpu-001").audit])
    assert third.out_of_service == frozenset()
    assert third.decide(XID79, fingerprint="a").requests[0].idempotency_key == "a.2/cordon"


@pytest.mark.parametrize(
    "kw",
    [
        {"max_disrupted_fraction": 0.0},
        {"max_disrupted_fraction": 1.5},
        {"cluster_size": 0},
        {"min_confidence": 2.0},
    ],
)
def test_bad_arguments(kw):
    with pytest.raises(ValueError, match="must be"):
        RemediationPolicy(**kw)


@pytest.mark.parametrize(
    ("fraction", "size", "limit"),
    [(0.10, 1, 1), (0.10, 33, 3), (0.10, 100, 10), (0.25, 8, 2), (1.0, 4, 4)],
)
def test_disruption_limit(fraction, size, limit):
    assert (
        RemediationPolicy(max_disrupted_fraction=fraction, cluster_size=size).disruption_limit
        == limit
    )


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(st.tuples(st.integers(0, 19), st.booleans()), max_size=80),
    fraction=st.floats(0.01, 1.0),
)
def test_budget_is_never_exceeded(events, fraction):
    p = RemediationPolicy(max_disrupted_fraction=fraction, cluster_size=20, clock=FakeClock())
    for node_index, resolve in events:
        node = NodeName(f"n{node_index}")
        fp = f"fp{node_index}"
        if resolve:
            p.resolve(fingerprint=fp, node=node)
            p.retry_held()
        else:
            p.decide(make_finding(node=node), fingerprint=fp)
        assert len(p.out_of_service) <= p.disruption_limit


def test_dry_run_scheduler_is_idempotent_and_reports_success():
    scheduler = DryRunScheduler()
    assert isinstance(scheduler, SchedulerAdapter)
    assert scheduler.name == "dry_run"
    request = ActionRequest(
        step=S.CORDON, node=NodeName("n"), entity=NODE_ENTITY, reason="r", idempotency_key="k"
    )

    async def run() -> tuple[str, str, ActionStatus]:
        first = await scheduler.submit(request)
        second = await scheduler.submit(request)
        return first, second, await scheduler.status(first)

    first, second, status = asyncio.run(run())
    assert first == second
    assert scheduler.requests == [request]
    assert status.phase == ActionPhase.SUCCEEDED
    assert status.message == "dry run"
    with pytest.raises(PermanentError):
        asyncio.run(scheduler.status("nope"))
