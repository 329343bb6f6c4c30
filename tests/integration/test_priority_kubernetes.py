"""Kubernetes priorities in gpuhealth (#16 item 10), against the local API stand-in.

A drain evicts the highest ``spec.priority`` first; the work on a node carries its
PriorityClass, priority, GPUs, start time and controller; the recovery of an evicted
pod waits while its controller's replacement pod is ``Pending``; a preemption is an
Eviction (its PodDisruptionBudget holds); and the engine, with the preemption policy
on, evicts a low-priority pod elsewhere to place a critical pod's recovery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.clock import FakeClock
from core.errors import SchedulerUnavailable
from core.records import (
    Action,
    ActionPhase,
    ActionRequest,
    EntityId,
    Evidence,
    Finding,
    NodeName,
    RemediationStep,
    Severity,
)
from gpuhealth.pipeline import Pipeline
from remediation.audit import read_audit_log
from remediation.kubernetes import KubernetesScheduler
from remediation.priority import PreemptionPolicy, PriorityScheduler
from tests.k8s_api import K8sApi, running_k8s_api

REASON = "gpuhealth: GpuXid79 critical reboot_node on 0000:b1:00.0: Xid 79"
CRITICAL_UID = "rs-critical-uid"


@pytest.fixture
def api() -> Iterator[K8sApi]:
    with running_k8s_api() as server:
        yield server


def fast(api: K8sApi, **overrides: Any) -> KubernetesScheduler:
    settings: dict[str, Any] = {"eviction_retry_seconds": 0.05, "poll_seconds": 0.02,
                                "drain_timeout_seconds": 5.0, "evictions_per_second": 20.0}
    settings.update(overrides)
    return KubernetesScheduler(host=api.url, **settings)


def drain(node: str = "n1") -> ActionRequest:
    return ActionRequest(step=RemediationStep.DRAIN, node=NodeName(node),
                         entity=EntityId("node"), reason=REASON,
                         idempotency_key=f"fp/drain/{node}", dry_run=False,
                         attrs={"scope": "node", "mode": "evict"})


def test_a_drain_evicts_the_highest_priority_first(api: K8sApi) -> None:
    api.add_node("n1")
    api.add_pod("batch", "n1", owner_kind="ReplicaSet", gpus=2, priority=10,
                priority_class="scavenger")
    api.add_pod("train", "n1", owner_kind="ReplicaSet", gpus=4, priority=100000,
                priority_class="critical")
    api.add_pod("serve", "n1", owner_kind="ReplicaSet", gpus=1, priority=1000,
                priority_class="normal")
    api.add_pod("plain", "n1", owner_kind="ReplicaSet")  # no priority: 0, last
    sched = fast(api)

    async def go() -> Any:
        ref = await sched.submit(drain())
        (status,) = await sched.wait([ref], timeout=10.0)
        return status

    status = asyncio.run(go())
    assert status.phase == ActionPhase.SUCCEEDED, status.message
    assert api.eviction_order == ["default/train", "default/serve", "default/batch",
                                  "default/plain"]
    sched.close()


def test_work_detail_pending_replacement_and_preempt(api: K8sApi) -> None:
    api.add_node("n1")
    api.add_node("n2")
    api.add_pod("train-a", "n1", owner_kind="ReplicaSet", gpus=4, priority=100000,
                priority_class="critical", started_at=1796000000.0, owner_uid=CRITICAL_UID)
    api.add_pod("batch", "n2", owner_kind="ReplicaSet", gpus=4, priority=10,
                priority_class="scavenger")
    sched = fast(api)
    assert isinstance(sched, PriorityScheduler)
    (item,) = asyncio.run(sched.work_detail(NodeName("n1")))
    assert (item.id, item.priority, item.priority_class, item.gpus, item.started_at,
            item.controller, item.node) == ("default/train-a", 100000, "critical", 4,
                                            1796000000.0, CRITICAL_UID, "n1")
    assert asyncio.run(sched.pending_of([item])) == []  # still running, nothing waits
    # evicted; its ReplicaSet's new pod cannot be scheduled: Pending, no node
    api.add_pod("train-b", "", owner_kind="ReplicaSet", gpus=4, priority=100000,
                priority_class="critical", phase="Pending", owner_uid=CRITICAL_UID)
    assert asyncio.run(sched.pending_of([item])) == [item]
    running = asyncio.run(sched.running_work())
    assert {w.id for w in running} == {"default/train-a", "default/batch"}
    (victim,) = [w for w in running if w.id == "default/batch"]
    api.block_evictions("default", "batch", times=1)
    with pytest.raises(SchedulerUnavailable, match="PodDisruptionBudget"):
        asyncio.run(sched.preempt(victim, reason="for default/train-a"))
    done = asyncio.run(sched.preempt(victim, reason="for default/train-a"))
    assert done.startswith("evicted pod default/batch")
    assert api.evictions["default/batch"] == 1
    sched.close()


def test_the_engine_preempts_for_a_critical_pod_that_waits(api: K8sApi, tmp_path: Path) -> None:
    api.add_node("n1")
    api.add_node("n2")
    api.add_pod("train-a", "n1", owner_kind="ReplicaSet", gpus=4, priority=100000,
                priority_class="critical", owner_uid=CRITICAL_UID)
    api.add_pod("batch", "n2", owner_kind="ReplicaSet", gpus=8, priority=10,
                priority_class="scavenger")
    sched = fast(api)
    clock = FakeClock(now=1000.0)
    p = Pipeline(facts={}, notifiers=[], audit_log_path=str(tmp_path / "audit.jsonl"),
                 dry_run=False, scheduler=sched, clock=clock, rules=[], cluster_size=4,
                 max_disrupted_fraction=1.0, action_store_path=str(tmp_path / "actions.db"),
                 engine_options={"probation_seconds": 600.0, "preemption": PreemptionPolicy(
                     enabled=True, critical_classes=("critical",), wait_seconds=10.0)})
    finding = Finding(node=NodeName("n1"), entity=EntityId("GPU-1"), kind="xid", code="79",
                      severity=Severity.CRITICAL, action=Action.REBOOT_NODE,
                      summary="GPU has fallen off the bus",
                      evidence=(Evidence(file="kern.log", line=1, text="NVRM: Xid 79"),),
                      source="test")
    p.observe_findings([finding], hold_seconds=1e6)

    async def scenario() -> None:  # one event loop: the adapter's drain runs on it
        await p.aevaluate()
        for _ in range(200):
            await p.atick()
            if api.evictions.get("default/train-a") and p.actions.incidents()[0] \
                    .out_of_service_at is not None:
                break
            await asyncio.sleep(0.02)
        assert api.evictions["default/train-a"] == 1
        # its ReplicaSet's new pod finds no free GPU: Pending
        api.add_pod("train-b", "", owner_kind="ReplicaSet", gpus=4, priority=100000,
                    priority_class="critical", phase="Pending", owner_uid=CRITICAL_UID)
        for _ in range(15):
            clock.advance(1.0)
            await p.atick()
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert api.evictions["default/batch"] == 1
    decisions = [r.decision for r in read_audit_log(str(tmp_path / "audit.jsonl"))]
    assert decisions.index("preempting") < decisions.index("preempted")
    p.close()
    sched.close()
