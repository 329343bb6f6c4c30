"""After a fix: a failed GPU reset falls back to a reboot; validation before resume.

The engine runs through the pipeline on the in-memory scheduler (tests/fake_scheduler.py);
the node agent is a fake adapter answering as :class:`remediation.gpu_reset.NodeAgentResetter`
does for a node whose reset failed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
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
from remediation.bundle import BundleCollector, LocalBundler
from remediation.gpu_reset import FALLBACK_MARK
from remediation.validation import (
    CommandResult,
    GpuState,
    LocalValidator,
    ValidationRunner,
)
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
    scheduler = kw.pop("scheduler", None) or FakeScheduler(cluster)
    return Pipeline(
        facts={}, notifiers=[], audit_log_path=str(tmp_path / "audit.jsonl"), dry_run=False,
        scheduler=scheduler, clock=clock, rules=[],
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


# --------------------------------------------------------------------------- validation


class FakeTools:
    """``dcgmi``, the load test and ``all_reduce_perf`` as an injected runner.

    ``fail`` names the tools that fail now; ``calls`` records every command line.
    """

    def __init__(self) -> None:
        self.fail: set[str] = set()
        self.calls: list[str] = []

    def __call__(self, argv, timeout_seconds):
        self.calls.append(" ".join(argv))
        tool = argv[0]
        if tool == "dcgmi":
            if "dcgmi" in self.fail:
                return CommandResult(returncode=226, stdout=(
                    "+---------------------------+------------------------------------+\n"
                    "| Memory                    | Fail - GPU: 0                      |\n"
                    "| Warning: GPU 0 Memory: DBE error detected                      |\n"))
            return CommandResult(returncode=0, stdout="| Memory | Pass - All |\n")
        if tool == "gpu-burn":
            return CommandResult(returncode=1 if "load" in self.fail else 0,
                                 stdout="GPU 0: OK\n" if "load" not in self.fail else
                                 "GPU 0: FAULTY\n")
        if tool == "all_reduce_perf":
            return CommandResult(returncode=0, stdout=(
                "#  Out of bounds values : 0 OK\n# Avg bus bandwidth    : "
                + ("12.5" if "nccl" in self.fail else "380.2") + " \n"))
        return CommandResult(returncode=127, stderr=f"{tool}: not found")


def validator(tools: FakeTools, **kw) -> LocalValidator:
    installed = {"dcgmi", "gpu-burn", "all_reduce_perf"}
    return LocalValidator(runner=ValidationRunner(
        node="n1", state_check=CleanGpus(), runner=tools,
        which=lambda name: f"/usr/bin/{name}" if name in installed else None,
        load_command=("gpu-burn", "-d", "30"), nccl_min_bus_gbps=100.0, **kw))


class CleanGpus:
    def __init__(self) -> None:
        self.problems: tuple[str, ...] = ()

    def __call__(self, gpus, since_at):
        return [GpuState(gpu="0000:b1:00.0", problems=self.problems)]


def run_until(p: Pipeline, clock: FakeClock, done, ticks: int = 40) -> None:
    """Tick (1 s apart) until ``done()``; validations run in threads, so let them end."""
    for _ in range(ticks):
        asyncio.run(p.atick())
        clock.advance(1.0)
        if done():
            return
        time.sleep(0.01)
    raise AssertionError("not done in time")


def test_validation_runner_checks_in_order_and_stops_at_the_first_failure():
    tools = FakeTools()
    runner = validator(tools).runner
    report = runner.run()
    assert report.passed
    assert [(c.name, c.outcome) for c in report.checks] == [
        ("nvml", "passed"), ("dcgm_diag", "passed"), ("load", "passed"), ("nccl", "passed")]
    assert tools.calls == ["dcgmi diag -r 2", "gpu-burn -d 30",
                           "all_reduce_perf -b 8 -e 256M -f 2 -g 1"]
    tools.fail = {"dcgmi"}
    failed = runner.run()
    assert [(c.name, c.outcome) for c in failed.checks] == [
        ("nvml", "passed"), ("dcgm_diag", "failed"), ("load", "not_run"), ("nccl", "not_run")]
    assert "DBE error detected" in failed.summary()
    tools.fail = {"nccl"}
    slow = runner.run()
    assert slow.checks[-1].outcome == "failed"
    assert "12.5 GB/s < 100" in slow.checks[-1].output


def test_missing_tools_are_skipped_not_failed():
    runner = ValidationRunner(state_check=CleanGpus(), runner=FakeTools(),
                              which=lambda name: None)
    report = runner.run()
    assert report.passed
    assert [c.outcome for c in report.checks] == ["passed", "skipped", "skipped", "skipped"]


def test_nvml_problems_fail_the_validation():
    state = CleanGpus()
    state.problems = ("row remap pending",)
    report = ValidationRunner(state_check=state, runner=FakeTools(),
                              which=lambda name: None).run()
    assert not report.passed
    assert "0000:b1:00.0: row remap pending" in report.summary()


def test_drill_xid79_validation_fails_then_passes(tmp_path):
    """Xid 79: drained, bundle, reboot, validated (the in-memory scheduler stands in for Slurm).

    First run: dcgmi diag fails after the reboot, so the node is handed to hardware
    service with the evidence and never resumed. Second run (the node came back from
    service, the same fault again): the validation passes and the node is resumed.
    """
    clock = FakeClock(now=1000.0)
    cluster = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    tools = FakeTools()
    tools.fail = {"dcgmi"}
    bundler = LocalBundler(collector=BundleCollector(
        directory=str(tmp_path / "bundles"), node="n1", runner=tools,
        which=lambda name: None))  # no vendor tools here: evidence and manifest only
    p = make(tmp_path, cluster, clock, engine_options={"validator": validator(tools),
                                                       "bundler": bundler})
    p.observe_findings([finding("n1", code="79", action=Action.REBOOT_NODE)],
                       hold_seconds=1e6)
    p.evaluate()
    run_until(p, clock, lambda: "hand_off" in [h[0] for h in cluster.history])
    assert [h[0] for h in cluster.history] == ["cordon", "drain", "reboot", "cordon", "drain",
                                               "hand_off"]
    [inc] = p.actions.incidents()
    assert inc.state == "open"
    assert inc.note.startswith("validation failed: validation failed: nvml passed, "
                               "dcgm_diag failed")
    records = read_audit_log(str(tmp_path / "audit.jsonl"))
    decisions = [r.decision for r in records]
    assert decisions.index("validating") < decisions.index("validation_failed")
    failed = next(r for r in records if r.decision == "validation_failed")
    assert "DBE error detected" in failed.reason
    assert json.loads(failed.details["report"])["checks"][1]["outcome"] == "failed"
    assert any(r.decision == "escalated" and "hand-off to hardware service" in r.reason
               for r in records)
    hand_off = next(a for a in p.actions.actions() if a.step.value == "hand_off")
    assert "DBE error detected" in hand_off.attrs["evidence"]
    # the bundle was collected before the reboot and before the hand-off
    order = [(r.decision, r.step.value if r.step else "") for r in records]
    for step in ("reboot", "hand_off"):
        assert order.index(("bundle", step)) < order.index(("submitted", step))
    bundles = [r.details["bundle"] for r in records if r.decision == "bundle"]
    assert len(bundles) == 2
    assert all(b.endswith(".tar.gz") for b in bundles)
    clock.advance(10_000)
    run_until(p, clock, lambda: True, ticks=3)
    assert "resume" not in [h[0] for h in cluster.history]  # handed off: a human resumes

    # the second run: after service the node is back; the same fault, a clean node
    clock2 = FakeClock(now=50_000.0)
    cluster2 = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    tools.fail = set()
    p2 = make(tmp_path / "second", cluster2, clock2, engine_options={"validator":
                                                                   validator(tools)})
    p2.observe_findings([finding("n1", code="79", action=Action.REBOOT_NODE, at=50_000.0)],
                        hold_seconds=1e6)
    p2.evaluate()
    run_until(p2, clock2, lambda: p2.actions.incidents()[0].note.startswith(
        "validation passed"))
    assert [h[0] for h in cluster2.history] == ["cordon", "drain", "reboot"]
    clock2.advance(601)
    run_until(p2, clock2, lambda: "resume" in [h[0] for h in cluster2.history])
    assert p2.actions.incidents()[0].state == "closed"
    records2 = read_audit_log(str(tmp_path / "second" / "audit.jsonl"))
    decisions2 = [r.decision for r in records2]
    assert decisions2.index("validated") < max(
        i for i, r in enumerate(records2) if r.step and r.step.value == "resume")


def test_no_resume_before_the_validation_ended(tmp_path):
    """Probation over, validation still running: the node stays out."""
    clock = FakeClock(now=1000.0)
    cluster = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    gate = threading.Event()

    class Slow(CleanGpus):
        def __call__(self, gpus, since_at):
            gate.wait(10)
            return super().__call__(gpus, since_at)

    slow = LocalValidator(runner=ValidationRunner(state_check=Slow(), runner=FakeTools(),
                                                  which=lambda name: None))
    p = make(tmp_path, cluster, clock, engine_options={"validator": slow,
                                                       "probation_seconds": 1.0})
    p.observe_findings([finding("n1", code="79", action=Action.REBOOT_NODE)],
                       hold_seconds=1e6)
    p.evaluate()
    run(p, 20, clock)
    assert "resume" not in [h[0] for h in cluster.history]
    gate.set()
    run_until(p, clock, lambda: "resume" in [h[0] for h in cluster.history])
