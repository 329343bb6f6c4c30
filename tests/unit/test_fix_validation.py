"""After a fix: a failed GPU reset falls back to a reboot; validation before resume.

The engine runs through the pipeline on the in-memory scheduler (tests/fake_scheduler.py);
the node agent is a fake adapter answering as :class:`remediation.gpu_reset.NodeAgentResetter`
does for a node whose reset failed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from core.clock import FakeClock
from core.records import (
    Action,
    ActionPhase,
    ActionRequest,
    ActionStatus,
    EntityId,
    Evidence,
    Finding,
    NodeName,
    Severity,
)
from gpuhealth.pipeline import Pipeline
from remediation.audit import read_audit_log
from remediation.gpu_reset import FALLBACK_MARK
from tests.fake_scheduler import FakeCluster, FakeNode, FakeScheduler

GPU = "0000:b1:00.0"


def finding(node: str, *, code: str = "48", action: Action = Action.RESET_GPU,
            at: float = 0.0, occurrences: int = 1) -> Finding:
    return Finding(
        node=NodeName(node), entity=EntityId(GPU), kind="xid", code=code,
        severity=Severity.CRITICAL, action=action, summary=f"Xid {code}",
        evidence=(Evidence(file="kern.log", line=1, text=f"NVRM: Xid (PCI:0000:b1:00): {code}"),),
        source="test", occurrences=occurrences, last_seen_at=at,
    )


class FailingAgent:
    """A node agent whose resets fail with the node's fallback (``reboot``)."""

    name = "node_agent"

    def __init__(self, fallback: str = "reboot") -> None:
        self.fallback = fallback
        self.requests: list[ActionRequest] = []

    async def submit(self, request: ActionRequest) -> str:
        self.requests.append(request)
        return f"node-agent-{request.idempotency_key}"

    async def status(self, ref: str) -> ActionStatus:
        tail = f"{FALLBACK_MARK}{self.fallback}" if self.fallback else ""
        return ActionStatus(ref=ref, phase=ActionPhase.FAILED,
                            message=f"GPU {GPU} reset failed: the GPU did not come back clean "
                                    f"after the reset; steps: reset ok, verify FAILED{tail}")


def make(tmp_path: Path, cluster: FakeCluster, clock: FakeClock, **kw) -> Pipeline:
    options = kw.pop("engine_options", {})
    return Pipeline(
        facts={}, notifiers=[], audit_log_path=str(tmp_path / "audit.jsonl"), dry_run=False,
        scheduler=FakeScheduler(cluster), clock=clock, rules=[],
        cluster_size=len(cluster.nodes), max_disrupted_fraction=1.0,
        action_store_path=str(tmp_path / "actions.db"),
        engine_options={"probation_seconds": 600.0, **options}, **kw,
    )


def run(pipeline: Pipeline, ticks: int, clock: FakeClock) -> None:
    for _ in range(ticks):
        asyncio.run(pipeline.atick())
        clock.advance(1.0)


def test_a_failed_gpu_reset_falls_back_to_a_node_reboot(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    agent = FailingAgent()
    p = make(tmp_path, cluster, clock, node_agent=agent)
    p.observe_findings([finding("n1")], hold_seconds=1e6)
    p.evaluate()
    run(p, 12, clock)
    assert len(agent.requests) == 1
    steps = [h[0] for h in cluster.history]
    assert steps[-3:] == ["cordon", "drain", "reboot"], steps
    records = read_audit_log(str(tmp_path / "audit.jsonl"))
    failed = [r for r in records if r.decision == "failed" and r.step and
              r.step.value == "reset_gpu"]
    assert failed[0].details["fallback"] == "reboot"
    requested = [r.step.value for r in records if r.decision == "requested"
                 and r.details.get("follows")]
    assert requested == ["cordon", "drain", "reboot"]
    assert not any(r.decision == "escalated" and r.step and r.step.value == "reset_gpu"
                   for r in records)
    [inc] = p.actions.incidents()
    assert inc.state == "probation"  # the reboot fixed it; probation as for any fix


def test_a_failed_reset_without_fallback_escalates_to_a_person(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    p = make(tmp_path, cluster, clock, node_agent=FailingAgent(fallback=""))
    p.observe_findings([finding("n1")], hold_seconds=1e6)
    p.evaluate()
    run(p, 8, clock)
    assert "reboot" not in [h[0] for h in cluster.history]
    records = read_audit_log(str(tmp_path / "audit.jsonl"))
    assert any(r.decision == "escalated" for r in records)
