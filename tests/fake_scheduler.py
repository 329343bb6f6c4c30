"""A scheduler that keeps nodes in memory, for engine tests and benchmarks.

It behaves like a real one where the engine depends on it: a cordon marks the node
unschedulable with the request's reason; a drain takes ``drain_polls`` status polls;
a reboot ``reboot_polls`` polls and then returns the node to service (Slurm's
``nextstate=RESUME``); a resume returns the node only if gpuhealth owns its state.
It is idempotent in effect: ``effects`` counts what was done per idempotency key, so
tests can assert that a step was carried out exactly once across adapter instances
(``shared`` holds the nodes and effects, as a real cluster would). Like the real adapters,
a step that takes out again a node this incident took out (``taken_out``) refuses when the
node is back in service (:class:`~core.errors.ReturnedToService`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from core.errors import NodeNotFound, PermanentError, ReturnedToService, SchedulerUnavailable
from core.records import (
    OWNER_PREFIX,
    ActionPhase,
    ActionRequest,
    ActionStatus,
    EntityId,
    NodeName,
    NodeState,
    RemediationStep,
)
from remediation.priority import WorkItem, by_priority


@dataclass(slots=True)
class FakeNode:
    """One node: in service or not, why, and whether a human opted it out."""

    schedulable: bool = True
    reason: str = ""
    opted_out: bool = False
    boot: int = 0


@dataclass(slots=True)
class FakeCluster:
    """The state a real scheduler keeps, shared by adapter instances."""

    nodes: dict[str, FakeNode] = field(default_factory=dict)
    effects: dict[str, int] = field(default_factory=dict)
    history: list[tuple[str, str]] = field(default_factory=list)
    """``(step, node)`` for every effect carried out, in order."""
    down: bool = False

    def out_of_service_by_gpuhealth(self) -> set[str]:
        """Nodes unschedulable with a ``gpuhealth:`` reason now."""
        return {n for n, s in self.nodes.items()
                if not s.schedulable and s.reason.startswith(OWNER_PREFIX)}

    def human_resume(self, node: str) -> None:
        """What ``scontrol update State=RESUME`` by a human does."""
        self.nodes[node].schedulable = True
        self.nodes[node].reason = ""

    def human_drain(self, node: str, reason: str = "maintenance by ops") -> None:
        """What a human's drain does."""
        self.nodes[node].schedulable = False
        self.nodes[node].reason = reason


class FakeScheduler:
    """The adapter over a :class:`FakeCluster` (``SchedulerAdapter`` and ``NodeInspector``)."""

    name = "fake"
    gpu_level_drain = True

    def __init__(self, cluster: FakeCluster, *, drain_polls: int = 1,
                 reboot_polls: int = 2,
                 before_submit: Callable[[ActionRequest], None] | None = None,
                 after_submit: Callable[[ActionRequest], None] | None = None) -> None:
        self.cluster = cluster
        self.before_submit = before_submit
        """Called with each request just before it is carried out (a human acting then)."""
        self.after_submit = after_submit
        """Called with each request just after it was carried out."""
        self.drain_polls = drain_polls
        self.reboot_polls = reboot_polls
        self._refs: dict[str, ActionRequest] = {}
        self.weights: dict[str, float] = {}
        self._polls: dict[str, int] = {}

    def _node(self, name: str) -> FakeNode:
        if self.cluster.down:
            raise SchedulerUnavailable("fake scheduler down")
        node = self.cluster.nodes.get(name)
        if node is None:
            raise NodeNotFound(f"no node {name}")
        return node

    async def submit(self, request: ActionRequest) -> str:
        node = self._node(request.node)
        if self.before_submit is not None:
            self.before_submit(request)
        if request.attrs.get("taken_out") == "yes" and node.schedulable:
            raise ReturnedToService(f"node {request.node} is back in service")
        key = request.idempotency_key
        if key not in self.cluster.effects:
            self.cluster.effects[key] = 0
        if self.cluster.effects[key] == 0:
            self.cluster.effects[key] = 1
            self.cluster.history.append((request.step.value, request.node))
            step = request.step
            if step in (RemediationStep.CORDON, RemediationStep.HAND_OFF) or (
                step == RemediationStep.DRAIN and request.attrs.get("scope") != "gpu"
            ):
                node.schedulable = False
                node.reason = request.reason
            elif step == RemediationStep.RESUME:
                if not node.schedulable and not node.reason.startswith(OWNER_PREFIX):
                    raise PermanentError(f"node {request.node} drained by someone else")
                node.schedulable, node.reason = True, ""
        else:
            self.cluster.effects[key] += 0  # already done: nothing twice
        ref = f"fake:{key}"
        self._refs[ref] = request
        if self.after_submit is not None:
            self.after_submit(request)
        return ref

    async def status(self, ref: str) -> ActionStatus:
        request = self._refs.get(ref)
        if request is None:
            raise PermanentError(f"unknown ref {ref}")
        node = self._node(request.node)
        polls = self._polls[ref] = self._polls.get(ref, 0) + 1
        need = {RemediationStep.DRAIN: self.drain_polls,
                RemediationStep.REBOOT: self.reboot_polls}.get(request.step, 0)
        takes_out = request.step in (RemediationStep.CORDON, RemediationStep.HAND_OFF) or (
            request.step == RemediationStep.DRAIN and request.attrs.get("scope") != "gpu")
        if takes_out and node.schedulable:  # as Slurm's adapter: the DRAIN flag is gone
            return ActionStatus(ref=ref, phase=ActionPhase.CANCELLED,
                                message="no longer drained: someone returned it to service")
        if polls <= need:
            return ActionStatus(ref=ref, phase=ActionPhase.RUNNING, message=f"poll {polls}")
        if request.step == RemediationStep.REBOOT and node.boot < polls:
            node.boot = polls
            node.schedulable, node.reason = True, ""  # nextstate=RESUME
        return ActionStatus(ref=ref, phase=ActionPhase.SUCCEEDED, message="done")

    async def node_state(self, node: NodeName, *, workload: bool = True) -> NodeState:
        state = self._node(node)
        return NodeState(
            node=node,
            schedulable=state.schedulable,
            reason=state.reason,
            owned=not state.schedulable and state.reason.startswith(OWNER_PREFIX),
            opted_out=state.opted_out,
            boot_id=str(state.boot),
            state="IDLE" if state.schedulable else "DRAIN",
        )

    async def set_reliability(self, node: NodeName, score: float) -> None:
        self._node(node)
        self.weights[node] = score

    async def published_reliability(self) -> dict[NodeName, float]:
        """What the nodes show (as the Kubernetes adapter reads its labels back)."""
        if self.cluster.down:
            raise SchedulerUnavailable("fake scheduler is down")
        return {NodeName(n): w for n, w in self.weights.items()}


class FakePriorityScheduler(FakeScheduler):
    """A :class:`FakeScheduler` with jobs that have priorities (``PriorityScheduler``).

    ``cluster_jobs`` maps a job id to its :class:`~remediation.priority.WorkItem`. A node
    drain that evicts requeues the node's running jobs, the highest priority first (the
    order is kept in ``requeued``): they become ``pending`` with no node, as Slurm's
    requeued jobs do. :meth:`place` is the scheduler's placement: the pending job starts
    on a node. :meth:`preempt` requeues a running job (kept in ``preempted``).
    """

    def __init__(self, cluster: FakeCluster, **kwargs: Any) -> None:
        super().__init__(cluster, **kwargs)
        self.cluster_jobs: dict[str, WorkItem] = {}
        self.requeued: list[str] = []
        self.preempted: list[str] = []
        self.asked: int = 0

    def add_job(self, job_id: str, node: str, *, priority: int, qos: str = "",
                gpus: int = 1, started_at: float | None = 0.0) -> WorkItem:
        item = WorkItem(kind="slurm_job", id=job_id, node=node, gpus=gpus,
                        started_at=started_at, priority=priority, priority_class=qos,
                        owner="alice")
        self.cluster_jobs[job_id] = item
        return item

    def place(self, job_id: str, node: str) -> None:
        """The scheduler starts a pending job on ``node``."""
        self.cluster_jobs[job_id] = replace(self.cluster_jobs[job_id], node=node,
                                            state="running")

    async def submit(self, request: ActionRequest) -> str:
        first = request.idempotency_key not in self.cluster.effects
        ref = await super().submit(request)
        if (first and not request.dry_run and request.step == RemediationStep.DRAIN
                and request.attrs.get("scope") != "gpu"
                and request.attrs.get("mode", "evict") == "evict"):
            on_node = [j for j in self.cluster_jobs.values()
                       if j.node == request.node and j.state == "running"]
            for job in by_priority(on_node):
                self.requeued.append(job.id)
                self.cluster_jobs[job.id] = replace(job, node="", state="pending")
        return ref

    async def work_detail(self, node: NodeName,
                          entity: EntityId | None = None) -> list[WorkItem]:
        self._node(node)
        self.asked += 1
        return [j for j in self.cluster_jobs.values() if j.node == node and j.state == "running"]

    async def running_work(self) -> list[WorkItem]:
        if self.cluster.down:
            raise SchedulerUnavailable("fake scheduler down")
        return [j for j in self.cluster_jobs.values() if j.state == "running"]

    async def pending_of(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        return [self.cluster_jobs[i.id] for i in items
                if i.id in self.cluster_jobs and self.cluster_jobs[i.id].state == "pending"]

    async def preempt(self, item: WorkItem, *, reason: str) -> str:
        job = self.cluster_jobs.get(item.id)
        if job is None or job.state != "running":
            raise PermanentError(f"job {item.id} is not running")
        self.preempted.append(item.id)
        self.cluster_jobs[item.id] = replace(job, node="", state="pending")
        return f"requeued job {item.id} ({reason})"
