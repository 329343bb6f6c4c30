"""The remediation engine: carries out the policy's requests, step after step, safely.

The policy (:mod:`remediation.policy`) decides *what* to do for a finding under the
disruption budget, opt-outs and idempotency; this engine decides *when* and *whether
still*, and does it through the scheduler adapters:

* **Order.** The steps of one incident run one after another (cordon, then drain, then
  reboot): a step is submitted when every earlier step of its incident succeeded;
  if one fails or is cancelled, the later ones are cancelled. Each step is fired
  (``submit``) and then polled (``status``) until it succeeds, fails or times out.
* **Circuit breaker.** When more than ``breaker_max_nodes`` distinct nodes need a
  disruptive step within ``breaker_window_seconds`` (a bad driver roll-out, a network
  partition, a monitoring fault: a shared cause, not that many broken nodes), the
  breaker opens and no new step is submitted until a human resets it
  (``gpuhealth actions breaker reset``). Notifications still go out.
* **Rate limit.** At most ``max_actions_per_minute`` steps are submitted per minute
  fleet-wide (token bucket).
* **Approval.** Steps of findings at or above ``approval_min_severity``, and steps in
  ``approval_steps``, wait in ``awaiting_approval`` for ``gpuhealth actions approve``.
* **Ownership; a human always wins.** Before a step that changes a node the engine
  reads the node through the adapter (:class:`~core.protocols.NodeInspector`): a node
  that opted out is left alone; a node a human already took out of service is left to
  the human; a node gpuhealth took out that a human put back into service is not taken
  out again, and the incident's remaining steps are cancelled.
* **Probation.** After the fix (reboot, GPU reset) succeeded, the incident is on
  probation for ``probation_seconds``; if the fault recurs meanwhile it escalates
  (cordon, drain, hand off to hardware service, see
  :meth:`~remediation.policy.RemediationPolicy.escalate`), else the node is resumed.
* **Validation.** With a ``validator`` (:mod:`remediation.validation`), an incident on
  probation is validated first (NVML clean, ``dcgmi diag``, a load test, an NCCL
  loopback, on the node): the node is resumed only after the validation passed (and
  probation passed); a failed validation hands the node to hardware service (cordon,
  drain, hand-off in the same incident) with the validation's evidence.
* **Diagnostic bundle.** With a ``bundler`` (:mod:`remediation.bundle`), a reboot or a
  hand-off waits (at most the bundler's ``timeout_seconds``) for a diagnostic bundle
  collected on the node while its evidence is still there; the bundle's path goes with
  the step (``attrs["bundle"]``) and into the audit log (``bundle``).
* **Priorities** (:mod:`remediation.priority`). With an adapter that shows them
  (:class:`~remediation.priority.PriorityScheduler`: Slurm, Kubernetes), the work on the
  node (jobs or pods, their priority, QOS or PriorityClass, GPUs, start time) is read
  when an incident opens and kept with it. Within a tick, incidents whose work has the
  higher priority take their steps first (they get the rate limit's tokens first); the
  adapters requeue or evict the highest-priority work of a node first; the work on the
  nodes of findings the disruption budget holds back is read too, so a freed slot goes
  to the node of the highest-priority work (within one severity). With a
  ``preemption`` policy (off by default), a critical job whose recovery still waits for
  capacity after its node was drained may have a low-priority job elsewhere preempted
  for it: within the preemption budget and the disruption budget, never while the
  breaker is open, audited (``preempting``) before it is done and only recorded in a
  dry run.
* **Fail-over.** Actions and incidents live in the :class:`~remediation.actions.ActionStore`
  (SQLite). A controller that becomes leader re-submits the actions another controller
  left running, with the same idempotency key: adapters are idempotent in effect, so
  an interrupted drain completes exactly once.

Every transition is returned as :class:`~core.records.AuditRecord` for the audit log.
The engine is driven by :meth:`RemediationEngine.tick` (the service calls it every
``tick_seconds`` and right after each evaluation, so the first step of a fresh
incident goes out within milliseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from core.clock import Clock, system_clock
from core.drill import DRILL
from core.errors import GpuHealthError, PermanentError, ReturnedToService, TemporaryError
from core.protocols import NodeInspector, ReliabilityPublisher, ReliabilityReader, SchedulerAdapter
from core.records import (
    NODE_ENTITY,
    ActionPhase,
    ActionRequest,
    AuditRecord,
    EntityId,
    NodeName,
    NodeState,
    RemediationStep,
    Severity,
)
from remediation.actions import (
    INCIDENT_CLOSED,
    INCIDENT_HUMAN,
    INCIDENT_OPEN,
    INCIDENT_PROBATION,
    LIVE_PHASES,
    TERMINAL,
    ActionStore,
    NewAction,
    StoredAction,
    StoredIncident,
)
from remediation.bundle import Bundler, BundleRequest
from remediation.gpu_reset import fallback_of
from remediation.placement import reliability_scores
from remediation.policy import (
    DECISION_HELD,
    DECISION_REQUESTED,
    DECISION_RESOLVED,
    MODE_EVICT,
    SCOPE_GPU,
    PlannedStep,
    PolicyResult,
    RemediationPolicy,
)
from remediation.priority import (
    PreemptionPolicy,
    PriorityScheduler,
    WorkItem,
    by_priority,
    priority_class_of,
    top_priority,
    work_from_json,
    work_to_json,
)
from remediation.validation import NodeValidator, ValidationRequest, ValidationStatus

logger = logging.getLogger(__name__)

BREAKER = "breaker"
"""Name of the circuit breaker's control flag in the store."""

FIX_STEPS = frozenset({RemediationStep.REBOOT, RemediationStep.RESET_GPU})
"""Steps after which the incident goes on probation."""

_NODE_CHANGING = frozenset(
    {
        RemediationStep.CORDON,
        RemediationStep.DRAIN,
        RemediationStep.REBOOT,
        RemediationStep.HAND_OFF,
        RemediationStep.RESET_GPU,
        RemediationStep.RESTART,
    }
)

_BUNDLE_BEFORE = frozenset({RemediationStep.REBOOT, RemediationStep.HAND_OFF})
"""Steps a diagnostic bundle is collected before (a GPU reset's bundle is the node's own,
collected by the reset procedure itself)."""

_TAKING_OUT = frozenset(
    {
        RemediationStep.CORDON,
        RemediationStep.DRAIN,
        RemediationStep.MIGRATE,
        RemediationStep.REBOOT,
        RemediationStep.HAND_OFF,
    }
)
"""Node-level steps that take the node out of service (again, if a human returned it)."""

# Audit decisions written by the engine (the policy writes requested/held/duplicate/resolved).
SUBMITTED = "submitted"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
WAITING = "waiting"
AWAITING_APPROVAL = "awaiting_approval"
BREAKER_OPENED = "breaker_opened"
PROBATION = "probation"
ESCALATED = "escalated"
PREEMPTING = "preempting"
"""Audited before a preemption is carried out (or, in a dry run, instead of it)."""
PREEMPTED = "preempted"
PREEMPT_PREFIX = "preempt:"
"""``control`` rows ``preempt:<kind>:<critical work id>``: a preemption made (or recorded in
a dry run) for that work, with the victim and its node (once per critical job; the
preemption budget is rebuilt from them after a fail-over)."""
PREEMPTION_HELD = "preemption_held"
"""A preemption that would place a critical job's recovery was not made (budget, breaker)."""

BUNDLING = "bundling"
BUNDLE = "bundle"
VALIDATING = "validating"
VALIDATED = "validated"
VALIDATION_FAILED = "validation_failed"
_VALIDATION_PASSED_NOTE = "validation passed"

FOLLOWS = "follows"
"""Attribute of a follow-up step naming the id of the failed step it replaces (a failed
GPU reset is followed by cordon, drain, reboot): the failed step does not cancel it."""

_SEVERITY_ORDER = {s: i for i, s in enumerate(Severity)}

HELD_WORK_SECONDS = 60.0
"""How often the work on the node of a held finding is read again, seconds."""

WORK_PRUNE_SECONDS = 300.0
"""How often the work cached for incidents no longer open is forgotten, seconds (the store
keeps it; :meth:`RemediationEngine.work_of` reads it again if asked)."""

WORK_PER_TICK = 128
"""New incidents whose node's work is read per tick (one ``squeue --json`` serves all on
Slurm; Kubernetes lists each node's pods): a burst is read before its drains start."""

PUBLISH_PER_TICK = 256
"""Reliability scores published per tick at most (``concurrency`` at a time); the rest wait
for the next tick. A new leader knows nothing of what the old one published, so its first
placement changes every scored node (10^4 label updates at 10,000 nodes): one at a time in
one tick, that held its first ticks for 20-26 s and its first cordon with them."""

PUBLISHED_DECIMALS = 2
"""A score is published again only when it changes at this precision (the Kubernetes
label's): the half-life decay moves every scored node's fourth decimal at each placement,
and each of those was a node update."""


def incident_of(key: str) -> str:
    """Return the incident prefix of an idempotency key (``<incident>/<step>``)."""
    return key.rsplit("/", 1)[0]


def fingerprint_of(incident: str) -> str:
    """Return the alert fingerprint of an incident prefix (``<fingerprint>[.<n>]``)."""
    return incident.split(".", 1)[0].split("~", 1)[0]


@dataclass(slots=True)
class EngineStats:
    """Counters for the Prometheus metrics (read by the service)."""

    transitions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    """``(step, decision, dry_run)`` -> count of engine transitions since start (``dry_run``
    ``"true"``: recorded only, nothing was done)."""
    held: dict[str, int] = field(default_factory=dict)
    """Reason class -> steps held back (breaker, rate limit, approval, human, opt-out)."""
    remediate_seconds: list[float] = field(default_factory=list)
    """Seconds from an incident's first request to its node being out of service."""
    reliability: dict[str, float] = field(default_factory=dict)
    """Last reliability score per node (:mod:`remediation.placement`)."""
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    """``(step, classification)`` -> failed attempts: ``transient`` (retried),
    ``exhausted`` (transient until the attempt budget ran out), ``permanent``."""


class RemediationEngine:
    """Carries out remediation requests in order, under the safety rules above.

    Args:
        store: The durable action store.
        scheduler: The adapter for node steps (``dry_run``, ``slurm``, ``kubernetes``,
            ``webhook``).
        policy: The policy whose budget slots the engine frees or escalates.
        node_agent: The adapter for ``reset_gpu`` (the node's own gpuhealth); ``None``:
            the scheduler gets them too.
        clock: Returns now, epoch seconds.
        identity: This controller's name; written on each action it submits.
        is_leader: Returns whether this controller may act now (leader election).
        lock: Held while the policy is touched (the pipeline's lock).
        breaker_max_nodes: Distinct nodes needing disruptive steps within the window
            above which the breaker opens; ``None`` disables the breaker.
        breaker_window_seconds: The breaker's window, > 0.
        max_actions_per_minute: Submits per minute fleet-wide, > 0.
        approval_min_severity: Findings at or above it wait for approval; ``None``: none.
        approval_steps: Steps that always wait for approval.
        probation_seconds: How long a fixed node is watched before it is resumed, >= 0.
        step_timeout_seconds: A step still running after this long fails, > 0.
        placement_interval_seconds: How often node reliability scores are recomputed and
            published to the scheduler (``ReliabilityPublisher``), > 0; a tick that
            submitted steps defers it, by at most one more interval.
        concurrency: Incidents advanced at the same time within one tick, >= 1.
        inspect_seconds: While a node drain runs, how often the node is read to notice a
            human returning it to service, seconds.
        step_attempts: Tries of one step whose adapter fails transiently (HTTP 409 after
            its own retries, 429, 5xx, slurmctld unreachable, a connection error) before
            it fails for good, >= 1; between tries the step waits ``retry_base_seconds``
            doubling to ``retry_max_seconds`` (or the adapter's ``Retry-After``).
        retry_base_seconds: The first wait after a transient failure, seconds.
        retry_max_seconds: The longest wait between two tries, seconds.
        validator: Validates a node after its fix, before the resume
            (:class:`~remediation.validation.LocalValidator` or
            :class:`~remediation.validation.NodeAgentValidator`); ``None``: no validation.
        bundler: Collects a diagnostic bundle before a reboot or hand-off
            (:class:`~remediation.bundle.LocalBundler` or
            :class:`~remediation.bundle.NodeAgentBundler`); ``None``: none.
        preemption: When low-priority work may be preempted to place a critical job's
            recovery (:class:`~remediation.priority.PreemptionPolicy`); ``None`` or not
            ``enabled`` (the default): never.
        work_timeout_seconds: Longest wait for the scheduler's answer about the work on
            a new incident's node, per tick, seconds (> 0).

    Raises:
        ValueError: A window, rate, timeout or probation out of range.
    """

    def __init__(
        self,
        *,
        store: ActionStore,
        scheduler: SchedulerAdapter,
        policy: RemediationPolicy,
        node_agent: SchedulerAdapter | None = None,
        clock: Clock = system_clock,
        identity: str = "gpuhealth",
        is_leader: Callable[[], bool] = lambda: True,
        lock: threading.RLock | None = None,
        breaker_max_nodes: int | None = None,
        breaker_window_seconds: float = 600.0,
        max_actions_per_minute: float = 600.0,
        approval_min_severity: Severity | None = None,
        approval_steps: frozenset[RemediationStep] = frozenset(),
        probation_seconds: float = 3600.0,
        step_timeout_seconds: float = 3600.0,
        placement_interval_seconds: float = 300.0,
        concurrency: int = 64,
        inspect_seconds: float = 1.0,
        step_attempts: int = 8,
        retry_base_seconds: float = 5.0,
        retry_max_seconds: float = 300.0,
        validator: NodeValidator | None = None,
        bundler: Bundler | None = None,
        preemption: PreemptionPolicy | None = None,
        work_timeout_seconds: float = 2.0,
    ) -> None:
        if not work_timeout_seconds > 0:
            raise ValueError(f"work_timeout_seconds must be > 0, got {work_timeout_seconds}")
        self.preemption = preemption or PreemptionPolicy()
        self.work_timeout_seconds = work_timeout_seconds
        self._work: dict[str, list[WorkItem]] = {}
        """The work each incident's node held, cached (the store has it): live incidents,
        and open or in-probation ones where preemption reads them."""
        self._work_pruned_at = float("-inf")
        """Incident -> the work its node held when it opened (read from the store once)."""
        self._work_said = False
        self._held_read: dict[str, float] = {}
        """Node of a held finding -> when its work was last read."""
        self._preemptions: deque[tuple[float, str]] | None = None
        """``(at, victim node)`` of the preemptions within the preemption window (read from
        the store at the first use, so a new leader keeps the budget)."""
        self._preempt_said: dict[str, str] = {}
        """Critical work id -> the last reason its preemption was held (audited once)."""
        if step_attempts < 1:
            raise ValueError(f"step_attempts must be >= 1, got {step_attempts}")
        if not 0 < retry_base_seconds <= retry_max_seconds:
            raise ValueError("need 0 < retry_base_seconds <= retry_max_seconds, got "
                             f"{retry_base_seconds} and {retry_max_seconds}")
        self.step_attempts = step_attempts
        self.validator = validator
        self.bundler = bundler
        self._bundling: dict[int, float] = {}
        """Per action id: when its diagnostic bundle was started."""
        self._bundles: dict[int, str] = {}
        """Per action id: the bundle's path (``""``: none) once collected or given up."""
        self._bundle_records: dict[int, AuditRecord] = {}
        """Per action id: the audit record of its finished bundle, written before the step's."""
        self._validations: dict[str, str] = {}
        """Incident -> the validator's ref of its validation in flight."""
        self.retry_base_seconds = retry_base_seconds
        self.retry_max_seconds = retry_max_seconds
        self._tries: dict[int, tuple[int, float]] = {}
        """Per action id: transient failures so far and when the next try is due."""
        if breaker_window_seconds <= 0:
            raise ValueError(f"breaker_window_seconds must be > 0, got {breaker_window_seconds}")
        if breaker_max_nodes is not None and breaker_max_nodes < 1:
            raise ValueError(f"breaker_max_nodes must be >= 1, got {breaker_max_nodes}")
        if max_actions_per_minute <= 0:
            raise ValueError(f"max_actions_per_minute must be > 0, got {max_actions_per_minute}")
        if probation_seconds < 0:
            raise ValueError(f"probation_seconds must be >= 0, got {probation_seconds}")
        if step_timeout_seconds <= 0:
            raise ValueError(f"step_timeout_seconds must be > 0, got {step_timeout_seconds}")
        self.store = store
        self.scheduler = scheduler
        self.policy = policy
        self.node_agent = node_agent
        self.clock = clock
        self.identity = identity
        self.is_leader = is_leader
        self.breaker_max_nodes = breaker_max_nodes
        self.breaker_window_seconds = breaker_window_seconds
        self.max_actions_per_minute = max_actions_per_minute
        self.approval_min_severity = approval_min_severity
        self.approval_steps = approval_steps
        self.probation_seconds = probation_seconds
        self.step_timeout_seconds = step_timeout_seconds
        self.placement_interval_seconds = placement_interval_seconds
        self.concurrency = max(1, concurrency)
        self.inspect_seconds = inspect_seconds
        self._inspected: dict[int, float] = {}
        self.predictions: dict[str, float] = {}
        """Highest current failure probability per node (set by the pipeline)."""
        self._placed_at = float("-inf")
        self._place_deferred_at: float | None = None
        self._published: dict[str, float] = {}  # node -> score published (PUBLISHED_DECIMALS)
        self._unpublished: dict[str, float] = {}  # node -> score to publish, oldest first
        self._read_published = False  # whether _published was read back from the scheduler
        self.stats = EngineStats()
        self._lock = lock or threading.RLock()
        self._tick_lock = threading.Lock()
        self._epoch = f"{identity}@{clock():.3f}#{uuid.uuid4().hex[:8]}"
        self._failing: deque[tuple[float, str]] = deque()
        self._tokens = max_actions_per_minute
        self._tokens_at = clock()
        self._said: dict[int, str] = {}

    # -- input ---------------------------------------------------------------------

    def enqueue(self, result: PolicyResult) -> list[AuditRecord]:
        """Store the policy's new requests as actions and count failing nodes for the breaker.

        Args:
            result: What the policy decided (its audit records carry the incident,
                severity, kind and code of each request).

        Returns:
            Audit records of what this did (the breaker opening, approvals awaited).
        """
        now = self.clock()
        out: list[AuditRecord] = []
        for d in result.decisions:
            if d.disrupts_node and d.decision in (DECISION_REQUESTED, DECISION_HELD):
                self._failing.append((d.at, d.node))
        out.extend(self._check_breaker(now))
        with self.store.transaction():  # one commit for the whole result
            out.extend(self._store_requests(result, now))
        return out

    def _store_requests(self, result: PolicyResult, now: float) -> list[AuditRecord]:
        # A burst decides thousands of steps: the incidents, and the steps between two
        # that await approval, go in one round trip each (a step awaiting approval is
        # audited with its row, so it is stored on its own); steps keep their order.
        out: list[AuditRecord] = []
        incidents: list[StoredIncident] = []
        plain: list[NewAction] = []

        def flush() -> None:
            self.store.open_incidents(incidents)
            self.store.add_many(plain, now=now)
            incidents.clear()
            plain.clear()

        self._close_if_only_notified([d.incident_key for d in result.decisions
                                      if d.request is None and d.decision == DECISION_RESOLVED],
                                     now)
        for d in result.decisions:
            request = d.request
            if request is None:
                continue
            incidents.append(StoredIncident(
                incident=d.incident_key, fingerprint=d.fingerprint, node=request.node,
                entity=d.finding_entity or request.entity, kind=d.kind, code=d.code,
                severity=d.severity, state=INCIDENT_OPEN, opened_at=now))
            if not self._needs_approval(request, d.severity):
                plain.append(NewAction(request, d.incident_key, d.fingerprint, d.severity,
                                       ActionPhase.PENDING))
                continue
            flush()
            message = "waits for a human's approval (gpuhealth actions approve)"
            stored = self.store.add(request, incident=d.incident_key,
                                    fingerprint=d.fingerprint, severity=d.severity,
                                    phase=ActionPhase.AWAITING_APPROVAL, now=now,
                                    message=message)
            if stored is not None:
                out.append(self._audit(stored, AWAITING_APPROVAL, message, now))
                self._count_held("approval")
        flush()
        return out

    def _needs_approval(self, request: ActionRequest, severity: str) -> bool:
        if request.step in (RemediationStep.NOTIFY, RemediationStep.RESUME) or request.dry_run:
            return False
        if request.step in self.approval_steps:
            return True
        if self.approval_min_severity is None or severity not in Severity.__members__.values():
            return False
        return _SEVERITY_ORDER[Severity(severity)] >= _SEVERITY_ORDER[self.approval_min_severity]

    def recurred(self, fingerprint: str, finding_node: str) -> bool:
        """Whether ``fingerprint``'s latest incident is on probation (a recurrence escalates).

        The caller then asks the policy to escalate and enqueues the result.
        """
        for inc in self.store.incidents(states=(INCIDENT_PROBATION,)):
            if inc.fingerprint == fingerprint and inc.node == finding_node:
                return True
        return False

    def on_probation_by_fingerprint(self) -> dict[str, StoredIncident]:
        """Every incident on probation now, by fingerprint (one read for many alerts)."""
        return {inc.fingerprint: inc
                for inc in self.store.incidents(states=(INCIDENT_PROBATION,))}

    def end_probation(self, fingerprint: str, *, why: str) -> None:
        """Close ``fingerprint``'s incident on probation (it escalated into a new one)."""
        now = self.clock()
        for inc in self.store.incidents(states=(INCIDENT_PROBATION,)):
            if inc.fingerprint == fingerprint:
                self.store.update_incident(inc.incident, state=INCIDENT_CLOSED, closed_at=now,
                                           note=why)

    # -- the breaker -----------------------------------------------------------------

    @property
    def breaker_open(self) -> bool:
        """Whether the circuit breaker is open (no new step is submitted)."""
        state = self.store.control(BREAKER)
        return state is not None and state[0] == "open"

    def _check_breaker(self, now: float) -> list[AuditRecord]:
        if self.breaker_max_nodes is None:
            return []
        state = self.store.control(BREAKER)
        reset_at = state[1] if state is not None and state[0] == "closed" else float("-inf")
        while self._failing and (
            self._failing[0][0] < now - self.breaker_window_seconds
            or self._failing[0][0] < reset_at
        ):
            self._failing.popleft()
        nodes = {node for _, node in self._failing}
        if len(nodes) <= self.breaker_max_nodes or self.breaker_open:
            return []
        why = (
            f"{len(nodes)} nodes needed disruptive steps within "
            f"{self.breaker_window_seconds:.0f} s (more than {self.breaker_max_nodes}): "
            "a shared cause is likely; no automatic action until a human resets the breaker"
        )
        return self.trip_breaker(why, now=now, nodes=len(nodes))

    def trip_breaker(self, why: str, *, now: float, nodes: int) -> list[AuditRecord]:
        """Open the circuit breaker for a fleet event (many nodes, one shared cause).

        No new step is submitted until a human resets it (``gpuhealth actions breaker
        reset``); steps already running go on. Does nothing when it is open already.

        Args:
            why: The reason, stored with the breaker and in the audit record.
            now: Epoch seconds.
            nodes: How many nodes the event spans.

        Returns:
            The ``breaker_opened`` audit record, or nothing when it was open.
        """
        if self.breaker_open:
            return []
        self.store.set_control(BREAKER, "open", at=now, who=self.identity, why=why)
        logger.error("circuit breaker opened: %s", why)
        return [
            AuditRecord(
                at=now,
                actor=self.identity,
                decision=BREAKER_OPENED,
                step=None,
                node=NodeName("*"),
                entity="node",  # type: ignore[arg-type]
                reason=why,
                idempotency_key=f"breaker/{now:.3f}",
                dry_run=self.policy.dry_run,
                details={"nodes": str(nodes)},
            )
        ]

    def reset_breaker(self, *, who: str, why: str = "reset by a human") -> None:
        """Close the breaker (what ``gpuhealth actions breaker reset`` does)."""
        self.store.set_control(BREAKER, "closed", at=self.clock(), who=who, why=why)
        self._failing.clear()

    # -- the loop ------------------------------------------------------------------

    async def tick(self) -> list[AuditRecord]:
        """Advance every action and incident once; return the audit records produced.

        Does nothing unless this controller is leader. Never raises for an adapter's
        failure: a temporary one is retried on the next tick, a permanent one fails
        the step (and cancels the incident's later steps).
        """
        if not self.is_leader():
            return []
        if not self._tick_lock.acquire(blocking=False):
            return []  # another tick is running (the loop and an evaluation raced)
        try:
            return await self._tick()
        finally:
            self._tick_lock.release()

    async def _tick(self) -> list[AuditRecord]:
        out: list[AuditRecord] = []
        now = self.clock()
        live = self.store.actions(phases=LIVE_PHASES)
        by_incident: dict[str, list[StoredAction]] = {}
        for action in live:
            by_incident.setdefault(action.incident, []).append(action)
        breaker = self.breaker_open
        gate = asyncio.Semaphore(self.concurrency)
        checked: dict[str, set[str]] = {}  # nodes read in this tick, per incident (_start)

        await self._record_work(now, by_incident)

        async def work_on(incident: str, action: StoredAction) -> list[AuditRecord]:
            async with gate:
                return await self._work_on(action, now, breaker,
                                           checked.setdefault(incident, set()))

        async def round_of(waiting: dict[str, list[StoredAction]]
                           ) -> tuple[list[list[AuditRecord]], set[str]]:
            picked, done, notified = self._pick(waiting, now)
            # the incidents of higher-priority work go first (a tier at a time), so they
            # take the rate limit's tokens first; one tier when no priority is known
            for tier in self._tiers({i: waiting[i] for i in picked}):
                results = await asyncio.gather(*(work_on(i, picked[i]) for i in tier))
                for incident, records in zip(tier, results, strict=True):
                    done[incident].extend(records)
            return [done[i] for i in waiting], notified

        # Breadth first: every incident takes its next step in one concurrent round (a
        # burst of 100 nodes is one round trip, not 100), and steps that finished at once
        # are followed in the next round of the same tick, so one incident's drain never
        # delays another's cordon (nor a notify step the cordon after it).
        waiting = by_incident
        for _ in range(16):
            rounds, succeeded = await round_of(waiting)
            for incident, records in zip(waiting, rounds, strict=True):
                out.extend(records)
                if any(r.decision == SUCCEEDED for r in records):
                    succeeded.add(incident)
            if not succeeded:
                break
            still: dict[str, list[StoredAction]] = {}
            for action in self.store.actions(phases=LIVE_PHASES):  # one read a round
                if action.incident in succeeded:
                    still.setdefault(action.incident, []).append(action)
            following = {i: still[i] for i in waiting if i in still}
            if not following:
                break
            waiting = following
        out.extend(await self._validate(now))
        out.extend(self._probation(now))
        out.extend(self._settle(now))
        out.extend(await self._preempt(now, breaker))
        self._forget_work(by_incident, now)
        await self._read_held_work(now)
        if now - self._placed_at >= self.placement_interval_seconds:
            # Scores are hints for the scheduler; the steps come first: a tick that
            # submitted steps (a burst) defers placement, by at most one more interval,
            # so publishing 100 node weights never holds up the next tick's steps.
            busy = any(r.decision == SUBMITTED for r in out)
            if busy and self._place_deferred_at is None:
                self._place_deferred_at = now
            if not busy or now - (self._place_deferred_at or now) >= \
                    self.placement_interval_seconds:
                self._placed_at = now
                self._place_deferred_at = None
                self._place(now)
        await self._publish(gate)
        return out

    # -- priorities ----------------------------------------------------------------

    def work_of(self, incident: str) -> list[WorkItem]:
        """The work ``incident``'s node held when it opened (empty: none or not known)."""
        if incident not in self._work:
            stored = self.store.work(incident)
            if stored is None:
                return []
            self._work[incident] = work_from_json(stored)
        return self._work[incident]

    def _forget_work(self, live: Mapping[str, list[StoredAction]], now: float) -> None:
        """Drop the cached work of incidents neither live nor (for preemption) open.

        Every :data:`WORK_PRUNE_SECONDS`: a controller that runs for months would otherwise
        keep the work of every incident it ever saw.
        """
        if not self._work or now - self._work_pruned_at < WORK_PRUNE_SECONDS:
            return
        self._work_pruned_at = now
        keep = set(live)
        if self.preemption.enabled:
            keep.update(inc.incident for inc in self.store.incidents(
                states=(INCIDENT_OPEN, INCIDENT_PROBATION)))
        for incident in [i for i in self._work if i not in keep]:
            del self._work[incident]

    async def _record_work(self, now: float, live: Mapping[str, list[StoredAction]]) -> None:
        """Ask the scheduler what ran on the node of each incident not asked yet.

        At most :data:`WORK_PER_TICK` incidents per tick, all within
        ``work_timeout_seconds``; a scheduler that does not answer is asked again at the
        next tick (the incident's steps do not wait for it).
        """
        if not isinstance(self.scheduler, PriorityScheduler):
            return
        # a notify-only incident (a warning) changes nothing on the node: nothing to ask
        new = [i for i, actions in live.items() if i not in self._work
               and any(a.step != RemediationStep.NOTIFY for a in actions)]
        if not new:
            return
        asked = self.store.works()  # one read a tick, and only for an incident not known
        unknown: list[str] = []
        for incident in new:
            if incident in asked:
                self._work[incident] = work_from_json(asked[incident])
            else:
                unknown.append(incident)
        order = {incident: n for n, incident in enumerate(unknown[:WORK_PER_TICK])}
        todo = sorted((inc for inc in self.store.incidents_named(list(order))
                       if inc.state == INCIDENT_OPEN), key=lambda i: order[i.incident])
        if not todo:
            return
        scheduler = self.scheduler
        try:
            answers = await asyncio.wait_for(asyncio.gather(*(
                scheduler.work_detail(inc.node, EntityId(inc.entity)
                                      if inc.entity != NODE_ENTITY else None)
                for inc in todo)), self.work_timeout_seconds)
        except (TimeoutError, GpuHealthError, OSError) as exc:
            if not self._work_said:
                logger.warning("cannot read the work on the nodes of new incidents: %s", exc)
                self._work_said = True
            return
        self._work_said = False
        with self.store.transaction():  # one commit for all
            for inc, items in zip(todo, answers, strict=True):
                ordered = by_priority(items)
                self.store.set_work(inc.incident, work_to_json(ordered), at=now,
                                    who=self.identity)
                self._work[inc.incident] = ordered

    async def _read_held_work(self, now: float) -> None:
        """Read the top priority of the work on the nodes of held findings, for the policy.

        The disruption budget then goes to the node of the highest-priority work first
        (:attr:`~remediation.policy.RemediationPolicy.work_priority`). Each node is read
        again after :data:`HELD_WORK_SECONDS`; nodes no longer held are forgotten.
        """
        if not isinstance(self.scheduler, PriorityScheduler):
            return
        with self._lock:
            nodes = self.policy.held_nodes
        for node in set(self._held_read) - nodes:
            del self._held_read[node]
        due = sorted(n for n in nodes
                     if now - self._held_read.get(n, float("-inf")) >= HELD_WORK_SECONDS)
        due = due[:WORK_PER_TICK]
        answers: list[list[WorkItem]] = []
        if due:
            scheduler = self.scheduler
            try:
                answers = await asyncio.wait_for(asyncio.gather(*(
                    scheduler.work_detail(NodeName(n)) for n in due)), self.work_timeout_seconds)
            except (TimeoutError, GpuHealthError, OSError) as exc:
                logger.info("cannot read the work on held nodes: %s", exc)
                return
        with self._lock:
            known = self.policy.work_priority
            for node in set(known) - nodes:
                del known[node]
            for node, items in zip(due, answers, strict=True):
                self._held_read[node] = now
                top = top_priority(items)
                if top is None:
                    known.pop(node, None)
                else:
                    known[node] = float(top)

    def _tiers(self, waiting: Mapping[str, list[StoredAction]]) -> list[list[str]]:
        """Incidents grouped by the top priority of their work, highest first."""
        if not isinstance(self.scheduler, PriorityScheduler):
            return [list(waiting)]
        groups: dict[float, list[str]] = {}
        for incident in waiting:
            top = top_priority(self.work_of(incident))
            groups.setdefault(float("-inf") if top is None else float(top), []).append(incident)
        return [groups[k] for k in sorted(groups, reverse=True)]

    async def _preempt(self, now: float, breaker: bool) -> list[AuditRecord]:
        """Preempt low-priority work for critical work whose recovery waits (see above).

        For each incident whose node is out of service since ``wait_seconds`` or more,
        the critical work it displaced is looked up; what still waits for capacity gets
        the best victim (:meth:`~remediation.priority.PreemptionPolicy.victims`) within
        the budgets. Each critical job is preempted for once. Audited ``preempting``
        before, ``preempted`` or ``failed`` after; ``preemption_held`` (once per reason)
        when a budget or the breaker holds it back.
        """
        policy = self.preemption
        scheduler = self.scheduler
        if not policy.enabled or not isinstance(scheduler, PriorityScheduler):
            return []
        if self._preemptions is None:
            self._preemptions = deque()
            for _, value, at, _, _ in self.store.controls(PREEMPT_PREFIX):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self._preemptions.append((at, str(json.loads(value)["node"])))
        preemptions = self._preemptions
        while preemptions and preemptions[0][0] <= now - policy.window_seconds:
            preemptions.popleft()
        waiting: list[tuple[StoredIncident, WorkItem]] = []
        for inc in self.store.incidents(states=(INCIDENT_OPEN, INCIDENT_PROBATION)):
            if inc.out_of_service_at is None or now - inc.out_of_service_at < policy.wait_seconds:
                continue
            for item in self.work_of(inc.incident):
                if policy.is_critical(item) and \
                        self.store.control(f"{PREEMPT_PREFIX}{item.kind}:{item.id}") is None:
                    waiting.append((inc, item))
        if not waiting:
            return []
        out: list[AuditRecord] = []
        try:
            pending = await scheduler.pending_of([item for _, item in waiting])
            running = await scheduler.running_work() if pending else []
        except GpuHealthError as exc:
            logger.warning("preemption: cannot read the scheduler: %s", exc)
            return []
        waits = {(w.kind, w.id) for w in pending}
        taken: set[str] = set()
        for inc, item in sorted(waiting, key=lambda x: -x[1].priority):
            if (item.kind, item.id) not in waits:
                continue
            with self._lock:
                out_of_service = set(self.policy.out_of_service)
                limit = self.policy.disruption_limit
                opted_out = set(self.policy.opt_out_nodes)
            avoid = frozenset(out_of_service | opted_out | {inc.node}
                              | {node for _, node in preemptions} | taken)
            victims = [v for v in policy.victims(item, running, avoid_nodes=avoid)
                       if v.id not in taken]
            key = f"{inc.incident}/preempt/{item.id}"
            why = ""
            if not victims:
                why = "no running lower-priority work that may be preempted holds enough GPUs"
            elif breaker:
                why = "circuit breaker open"
            elif len(preemptions) >= policy.max_preemptions:
                why = (f"preemption budget spent: {len(preemptions)} of "
                       f"{policy.max_preemptions} within {policy.window_seconds:.0f} s")
            elif len(out_of_service | {n for _, n in preemptions}) + 1 > limit:
                why = (f"disruption budget: {len(out_of_service)} node(s) out of service and "
                       f"{len(preemptions)} preemption(s) of {limit} allowed")
            if why:
                if self._preempt_said.get(item.id) != why:
                    self._preempt_said[item.id] = why
                    self._count_held("preemption")
                    out.append(self._preempt_audit(PREEMPTION_HELD, inc, item, None, key,
                                                   f"{item.describe()} waits for capacity; "
                                                   f"not preempting: {why}", now))
                continue
            victim = victims[0]
            taken.add(victim.id)
            taken.add(victim.node)
            dry = self.policy.dry_run
            reason = (f"gpuhealth: preempted to place the recovery of {item.describe()} "
                      f"(incident {inc.incident} on {inc.node})")[:200]
            out.append(self._preempt_audit(PREEMPTING, inc, item, victim, key, (
                f"{'dry run: would preempt' if dry else 'preempting'} {victim.describe()} to "
                f"place the recovery of {item.describe()}, which waits for capacity"), now))
            preemptions.append((now, victim.node))
            self.store.set_control(f"{PREEMPT_PREFIX}{item.kind}:{item.id}",
                                   json.dumps({"victim": victim.id, "node": victim.node,
                                               "dry_run": dry}, sort_keys=True),
                                   at=now, who=self.identity, why=reason)
            if dry:
                continue
            try:
                done = await scheduler.preempt(victim, reason=reason)
            except GpuHealthError as exc:
                out.append(self._preempt_audit(FAILED, inc, item, victim, key,
                                               f"preemption of {victim.describe()} failed: "
                                               f"{exc}", now))
                continue
            self._count_held("preempted")
            out.append(self._preempt_audit(PREEMPTED, inc, item, victim, key, done, now))
        return out

    def _preempt_audit(self, decision: str, inc: StoredIncident, item: WorkItem,
                       victim: WorkItem | None, key: str, reason: str,
                       now: float) -> AuditRecord:
        details = {"incident": inc.incident, "fingerprint": inc.fingerprint,
                   "for": f"{item.kind}:{item.id}", "for_priority": str(item.priority),
                   "for_class": item.priority_class, "for_node": inc.node}
        if victim is not None:
            details.update({"victim": f"{victim.kind}:{victim.id}",
                            "victim_priority": str(victim.priority),
                            "victim_class": victim.priority_class})
        return AuditRecord(
            at=now, actor=self.identity, decision=decision, step=None,
            node=NodeName(victim.node if victim is not None else inc.node),
            entity="node",  # type: ignore[arg-type]
            reason=reason, idempotency_key=key, dry_run=self.policy.dry_run, details=details)

    def _place(self, now: float) -> None:
        """Recompute reliability scores (the metric); queue the changed ones to publish."""
        scores = reliability_scores(
            self.store.incident_marks(), predictions=self.predictions,
            nodes=self.stats.reliability, now=now,
        )
        self.stats.reliability.update(scores)
        if self.policy.dry_run or not isinstance(self.scheduler, ReliabilityPublisher):
            return
        for node, score in sorted(scores.items()):
            shown = round(score, PUBLISHED_DECIMALS)
            if self._published.get(node) == shown:
                self._unpublished.pop(node, None)
            else:
                self._unpublished[node] = shown

    def forget_published(self) -> None:
        """Forget which scores were published (on taking over: another leader published since).

        The next publishing reads them back first where the scheduler can
        (:class:`~core.protocols.ReliabilityReader`), so a new leader does not update
        every scored node again.
        """
        self._published.clear()
        self._read_published = False

    async def _read_back(self, reader: ReliabilityReader) -> None:
        """Learn the scores the nodes show now; drop the queued ones they already show."""
        try:
            shown = await reader.published_reliability()
        except GpuHealthError as exc:  # publish them all, as without a reader
            logger.warning("cannot read the published reliability scores back (%s): "
                           "publishing every scored node", exc)
        else:
            published = {str(node): score for node, score in shown.items()}
            self._published.update(published)
            for node in [n for n, score in self._unpublished.items()
                         if published.get(n) == score]:
                del self._unpublished[node]
            logger.info("%d node(s) show a reliability score; %d to publish",
                        len(shown), len(self._unpublished))
        self._read_published = True

    async def _publish(self, gate: asyncio.Semaphore) -> None:
        """Publish at most :data:`PUBLISH_PER_TICK` queued scores, ``concurrency`` at a time.

        Before the first (and after :meth:`forget_published`) the scores the scheduler
        shows are read back where it can, and those already shown are not published again.
        A score that cannot be published is queued again for the next placement.
        """
        publisher = self.scheduler
        if not self._unpublished or not isinstance(publisher, ReliabilityPublisher):
            return
        if not self._read_published and isinstance(publisher, ReliabilityReader):
            await self._read_back(publisher)
            if not self._unpublished:
                return
        batch = list(itertools.islice(self._unpublished.items(), PUBLISH_PER_TICK))
        for node, _ in batch:
            del self._unpublished[node]

        failed: list[tuple[str, GpuHealthError]] = []

        async def one(node: str, score: float) -> None:
            async with gate:
                try:
                    await publisher.set_reliability(NodeName(node), score)
                except GpuHealthError as exc:
                    self._published.pop(node, None)  # published again at the next placement
                    failed.append((node, exc))
                else:
                    self._published[node] = score

        await asyncio.gather(*(one(node, score) for node, score in batch))
        if failed:  # one line a tick, not one per node, when the API server is away
            logger.warning("cannot publish the reliability of %d node(s), retried at the next "
                           "placement (%s: %s)", len(failed), failed[0][0], failed[0][1])

    async def _work_on(self, action: StoredAction, now: float, breaker: bool,
                       checked: set[str] | None = None) -> list[AuditRecord]:
        """Poll ``action`` (running) or start it (pending), as :meth:`_pick` chose it."""
        if action.phase == ActionPhase.RUNNING:
            return await self._poll(action, now)
        if action.phase != ActionPhase.PENDING:
            return []
        started = await self._start(action, now, breaker, checked)
        bundled = self._bundle_records.pop(action.id, None)
        return [bundled, *started] if bundled is not None else started

    def _pick(self, waiting: Mapping[str, list[StoredAction]], now: float
              ) -> tuple[dict[str, StoredAction], dict[str, list[AuditRecord]], set[str]]:
        """The action each incident of ``waiting`` works on now, and what was done already.

        Returns the action by incident, the audit records by incident, and the incidents
        whose ``notify`` step succeeded here (their next step follows in this tick).

        One read of the incidents' histories, and one commit for what needs no adapter:
        the later steps of a failed one cancelled, the due ``notify`` steps succeeded (a
        burst of warnings is thousands of them; one round trip each held the leader's
        consumer for seconds: ``benchmarks/fleet_sim.py`` at 1,000 nodes).
        """
        histories: dict[str, list[StoredAction]] = {}
        for stored in self.store.actions(incident_phases=LIVE_PHASES):
            histories.setdefault(stored.incident, []).append(stored)
        picked: dict[str, StoredAction] = {}
        done: dict[str, list[AuditRecord]] = {}
        notified: list[StoredAction] = []
        with self.store.transaction():
            for incident, live in waiting.items():
                done[incident], action = self._next_action(
                    live, histories.get(incident, []), now)
                if action is None:
                    continue
                if (action.phase == ActionPhase.PENDING
                        and action.step == RemediationStep.NOTIFY
                        and (action.not_before is None or now >= action.not_before)):
                    notified.append(action)
                else:
                    picked[incident] = action
            self._notified(notified, now)
        return picked, done, {a.incident for a in notified}

    def _next_action(self, live: list[StoredAction], history: list[StoredAction],
                     now: float) -> tuple[list[AuditRecord], StoredAction | None]:
        """An incident's first unfinished action to work on now, or ``None``.

        ``live`` are its pending, running and waiting actions, ``history`` all of them.

        After a failed or cancelled step (without a follow-up) the later live steps are
        cancelled instead (the audit records of that are returned); an action backing off
        after a transient failure is not worked on until its time.
        """
        out: list[AuditRecord] = []
        for action in history:
            if action.phase in (ActionPhase.FAILED, ActionPhase.CANCELLED) and any(
                    a.attrs.get(FOLLOWS) == str(action.id) for a in history):
                continue  # its follow-up runs instead (a failed reset's reboot)
            if action.phase in (ActionPhase.FAILED, ActionPhase.CANCELLED):
                # an earlier step failed: nothing after it runs
                for later in live:
                    if later.id > action.id and self.store.update(
                        later.id,
                        now=now,
                        phase=ActionPhase.CANCELLED,
                        expect=(ActionPhase.PENDING, ActionPhase.AWAITING_APPROVAL),
                        message=f"an earlier step ({action.step.value}) {action.phase.value}",
                        finished_at=now,
                    ):
                        out.append(self._audit(later, CANCELLED, "an earlier step did not "
                                               "succeed", now))
                return out, None
            if action.phase in TERMINAL:
                continue
            # the first non-terminal action of the incident
            tries = self._tries.get(action.id)
            if tries is not None and now < tries[1]:
                return out, None  # backing off after a transient failure
            return out, action
        return out, None

    async def _start(self, action: StoredAction, now: float, breaker: bool,
                     checked: set[str] | None = None) -> list[AuditRecord]:
        """Submit ``action`` unless a guard holds it.

        ``checked`` holds the nodes read earlier in the same follow-up of this incident:
        the step before finished moments ago on a node read just before it, so the node
        is not read again (a human's change between two steps of one tick cannot be told
        from our own; it is seen at the next tick).
        """
        if action.not_before is not None and now < action.not_before:
            return self._wait(action, f"deferred until {action.not_before:.0f}", now)
        if action.step == RemediationStep.NOTIFY:
            self._notified([action], now)
            return []
        if breaker:
            return self._wait(action, "circuit breaker open: waits for a human reset", now,
                              held="breaker")
        adapter = self._adapter_for(action)
        if (not action.dry_run and isinstance(self.scheduler, NodeInspector)
                and (checked is None or action.node not in checked
                     or action.step == RemediationStep.RESUME)):
            verdict = await self._check_node(action, now)
            if verdict is not None:
                return verdict
            if checked is not None:
                checked.add(action.node)
        if (self.bundler is not None and not action.dry_run
                and action.step in _BUNDLE_BEFORE and action.id not in self._bundles):
            held = self._bundle(action, now)
            if held is not None:
                return held
        if not self._take_token(now):
            return self._wait(action, "rate limit: waits for the next slot", now,
                              held="rate_limit")
        try:
            ref = await adapter.submit(self._request(action))
        except TemporaryError as exc:
            return self._transient(action, f"{adapter.name} unavailable: {exc}", exc, now,
                                   expect=ActionPhase.PENDING)
        except ReturnedToService as exc:
            return self._returned(action, now, exc, expect=ActionPhase.PENDING)
        except GpuHealthError as exc:
            return self._permanent(action, f"{adapter.name} refused: {exc}", now,
                                   expect=ActionPhase.PENDING)
        self._tries.pop(action.id, None)
        if not self.store.update(
            action.id, now=now, phase=ActionPhase.RUNNING, expect=(ActionPhase.PENDING,),
            ref=ref, adapter=adapter.name, started_at=now, epoch=self._epoch,
            message="submitted",
        ):
            return []  # a human cancelled it meanwhile
        self._said.pop(action.id, None)
        self._inspected[action.id] = now  # the node was read just before: next read later
        self._count(action.step, SUBMITTED, action.dry_run)
        out = [self._audit(action, SUBMITTED, f"{adapter.name} ref {ref}", now)]

        running = self.store.get(action.id)
        if running is not None:
            out.extend(await self._poll(running, now))  # quick steps finish in the same tick
        return out

    def _bundle(self, action: StoredAction, now: float) -> list[AuditRecord] | None:
        """Start or await ``action``'s diagnostic bundle; ``None`` once the step may go.

        The step waits at most the bundler's ``timeout_seconds``; then it goes without.
        """
        bundler = self.bundler
        assert bundler is not None
        started = self._bundling.get(action.id)
        if started is None:
            self._bundling[action.id] = now
            evidence = tuple(e for e in (action.reason, action.attrs.get("evidence", ""),
                                         action.message) if e)
            gpus = (action.entity,) if action.entity != NODE_ENTITY else ()
            record = self._audit(action, BUNDLING, f"collecting a diagnostic bundle "
                                 f"({bundler.name}) before {action.step.value}, at most "
                                 f"{bundler.timeout_seconds:g} s", now)
            bundler.start(BundleRequest(node=action.node, key=action.key,
                                        reason=action.reason, gpus=gpus, evidence=evidence))
            self.store.update(action.id, now=now, message="collecting a diagnostic bundle")
            return [record]
        result = bundler.result(action.key)
        if result is None and now - started < bundler.timeout_seconds:
            return []
        self._bundling.pop(action.id, None)
        path = result.path if result is not None else ""
        self._bundles[action.id] = path
        why = (result.message if result is not None else
               f"not collected within {bundler.timeout_seconds:g} s: the step goes without")
        record = self._audit(action, BUNDLE, why, now)
        self._bundle_records[action.id] = replace(record, details={**record.details,
                                                                   "bundle": path})
        return None

    def _request(self, action: StoredAction) -> ActionRequest:
        """Return the adapter's request for ``action``.

        With ``taken_out`` when this incident took the node out already: the adapter then
        leaves alone a node someone has returned to service since. With ``bundle`` when a
        diagnostic bundle was collected for it (the hand-off carries it).
        """
        request = action.request()
        bundle = self._bundles.get(action.id)
        if bundle:
            request = replace(request, attrs={**request.attrs, "bundle": bundle})
        if action.step not in _TAKING_OUT or action.attrs.get("scope") == SCOPE_GPU:
            return request
        incident = self.store.incident(action.incident)
        if incident is None or incident.out_of_service_at is None or not incident.claimed:
            return request
        return replace(request, attrs={**request.attrs, "taken_out": "yes"})

    def _returned(self, action: StoredAction, now: float, exc: ReturnedToService, *,
                  expect: ActionPhase) -> list[AuditRecord]:
        """The adapter found the node returned to service by someone: stop the incident."""
        return self._stop_for_human(action, now, (
            f"a human returned node {action.node} to service after gpuhealth took it out: "
            f"{action.step.value} not carried out ({exc})"), expect=expect)

    async def _poll(self, action: StoredAction, now: float) -> list[AuditRecord]:
        adapter = self._adapter_for(action)
        if action.epoch != self._epoch:
            # left running by another controller (fail-over) or an earlier run of this one:
            # re-submit with the same idempotency key; adapters do nothing twice.
            try:
                ref = await adapter.submit(self._request(action))
            except TemporaryError as exc:
                return self._transient(action, f"{adapter.name} unavailable: {exc}", exc, now)
            except ReturnedToService as exc:
                return self._returned(action, now, exc, expect=ActionPhase.RUNNING)
            except GpuHealthError as exc:
                return self._permanent(action, f"{adapter.name} refused on take-over: {exc}",
                                       now)
            self.store.update(action.id, now=now, ref=ref, epoch=self._epoch,
                              message="taken over from another controller")
            action = self.store.get(action.id) or action
        overridden = await self._human_took_over(action, now)
        if overridden is not None:
            return overridden
        try:
            status = await adapter.status(action.ref)
        except TemporaryError as exc:
            return self._transient(action, f"{adapter.name} unavailable: {exc}", exc, now)
        except GpuHealthError as exc:
            return self._permanent(action, str(exc), now)
        self._tries.pop(action.id, None)
        if status.phase == ActionPhase.SUCCEEDED:
            if not self.store.update(
                action.id, now=now, phase=ActionPhase.SUCCEEDED, expect=(ActionPhase.RUNNING,),
                message=status.message, finished_at=now,
            ):
                return []
            self._count(action.step, SUCCEEDED, action.dry_run)
            return [self._audit(action, SUCCEEDED, status.message, now),
                    *self._after_success(action, now)]
        if status.phase == ActionPhase.CANCELLED:
            returned = await self._returned_meanwhile(action, status.message, now)
            if returned is not None:
                return returned
        if status.phase == ActionPhase.FAILED:
            return self._permanent(action, status.message, now)
        if status.phase == ActionPhase.CANCELLED:
            self.store.update(action.id, now=now, phase=status.phase, finished_at=now,
                              message=status.message)
            self._count(action.step, FAILED, action.dry_run)
            return [self._audit(action, FAILED, status.message, now)]
        started = action.started_at if action.started_at is not None else now
        if now - started > self.step_timeout_seconds:
            return self._permanent(action, f"timed out after {now - started:.0f} s "
                                   f"({status.message})", now, classification="timeout")
        if status.message and status.message != action.message:
            self.store.update(action.id, now=now, message=status.message)
        return []

    def _after_success(self, action: StoredAction, now: float) -> list[AuditRecord]:
        incident = self.store.incident(action.incident)
        if incident is None:
            return []
        out: list[AuditRecord] = []
        out_of_service = action.step in (
            RemediationStep.CORDON, RemediationStep.REBOOT, RemediationStep.HAND_OFF
        ) or (action.step == RemediationStep.DRAIN and action.attrs.get("scope") != SCOPE_GPU)
        if out_of_service and incident.out_of_service_at is None:
            self.store.update_incident(action.incident, out_of_service_at=now)
            if not action.dry_run:  # a dry run repairs nothing: kept out of MTTR
                self.stats.remediate_seconds.append(max(0.0, now - incident.opened_at))
        if action.step == RemediationStep.RESUME:
            self.store.update_incident(action.incident, state=INCIDENT_CLOSED, closed_at=now)
            return out
        if action.step in FIX_STEPS:
            rest = [a for a in self.store.actions(incident=action.incident)
                    if a.id > action.id and a.phase not in TERMINAL]
            if not rest:
                until = now + self.probation_seconds
                self.store.update_incident(
                    action.incident, state=INCIDENT_PROBATION, fixed_at=now,
                    probation_until=until,
                )
                out.append(self._audit(action, PROBATION,
                                       f"fixed; on probation until {until:.0f}", now))
        return out

    async def _check_node(self, action: StoredAction, now: float) -> list[AuditRecord] | None:
        """Read the node before a node-changing step; return audit records if it must not run."""
        if action.step not in _NODE_CHANGING and action.step != RemediationStep.RESUME:
            return None
        inspector = self.scheduler
        assert isinstance(inspector, NodeInspector)
        try:
            state: NodeState = await inspector.node_state(action.node, workload=False)
        except TemporaryError as exc:
            return self._wait(action, f"cannot read node {action.node}: {exc}", now)
        except PermanentError as exc:
            self.store.update(action.id, now=now, phase=ActionPhase.FAILED, finished_at=now,
                              message=f"cannot read node {action.node}: {exc}")
            return [self._audit(action, FAILED, str(exc), now)]
        incident = self.store.incident(action.incident)
        if action.step == RemediationStep.RESUME:
            if not state.schedulable and not state.owned:
                return self._human(action, now, f"node {action.node} is out of service by "
                                   f"someone else ({state.reason!r}); not resumed by gpuhealth")
            return None
        if state.opted_out:
            self._count_held("opt_out")
            return self._human(action, now, f"node {action.node} opted out of automatic "
                               "remediation")
        taken_out = incident is not None and incident.out_of_service_at is not None
        if not state.schedulable and not state.owned and not taken_out:
            return self._human(action, now, f"node {action.node} is already out of service "
                               f"by someone else ({state.reason!r}): left to them")
        if state.schedulable and taken_out and incident is not None and incident.claimed:
            return self._human(action, now, f"a human returned node {action.node} to service "
                               "after gpuhealth took it out: not taken out again")
        return None

    async def _human_took_over(self, action: StoredAction, now: float) -> list[AuditRecord] | None:
        """While a node-level drain runs, notice a human returning the node to service.

        Read at most every ``inspect_seconds`` per action. The running step is cancelled
        (it is no longer polled, so an adapter that requeues jobs on a later poll, as
        Slurm's after its grace period, does not) and the incident stops.
        """
        if (action.dry_run or action.step not in (RemediationStep.DRAIN, RemediationStep.CORDON)
                or action.attrs.get("scope") == SCOPE_GPU
                or not isinstance(self.scheduler, NodeInspector)):
            return None
        if now - self._inspected.get(action.id, float("-inf")) < self.inspect_seconds:
            return None
        self._inspected[action.id] = now
        incident = self.store.incident(action.incident)
        if incident is None or incident.out_of_service_at is None or not incident.claimed:
            return None
        if not await self._back_in_service(action.node):
            return None
        return self._stop_for_human(action, now, (
            f"a human returned node {action.node} to service while gpuhealth's "
            f"{action.step.value} ran: stopped, not taken out again"))

    async def _returned_meanwhile(self, action: StoredAction, message: str,
                                  now: float) -> list[AuditRecord] | None:
        """Stop the incident if a cancelled take-out step found the node back in service.

        Slurm's adapter answers cancelled when the DRAIN flag is gone; if the node is
        schedulable now, a human returned it.

        Without this, a resume between a cordon and its first status read would leave the
        incident open, and its drain would take the node out again.
        """
        if (action.dry_run or action.step not in _TAKING_OUT
                or action.attrs.get("scope") == SCOPE_GPU
                or not await self._back_in_service(action.node)):
            return None
        return self._stop_for_human(action, now, (
            f"a human returned node {action.node} to service while gpuhealth's "
            f"{action.step.value} ran: stopped, not taken out again ({message})"))

    async def _back_in_service(self, node: NodeName) -> bool:
        """Whether the scheduler shows ``node`` in service now (False if unreadable)."""
        if not isinstance(self.scheduler, NodeInspector):
            return False
        try:
            state = await self.scheduler.node_state(node, workload=False)
        except GpuHealthError:
            return False
        return state.exists and state.schedulable

    def _stop_for_human(self, action: StoredAction, now: float, why: str, *,
                        expect: ActionPhase = ActionPhase.RUNNING) -> list[AuditRecord]:
        """Cancel ``action`` (in phase ``expect``) and stop its incident: a human acted."""
        self.store.update(action.id, now=now, phase=ActionPhase.CANCELLED, finished_at=now,
                          message=why, expect=(expect,))
        return [self._audit(action, CANCELLED, why, now), *self._human(action, now, why)]

    def _human(self, action: StoredAction, now: float, why: str) -> list[AuditRecord]:
        """Stop the incident of ``action``: a human's state wins; free its budget slot."""
        self._count_held("human")
        out: list[AuditRecord] = []
        for later in self.store.actions(incident=action.incident):
            if later.phase in TERMINAL:
                continue
            if self.store.update(
                later.id, now=now, phase=ActionPhase.CANCELLED, finished_at=now, message=why,
                expect=(ActionPhase.PENDING, ActionPhase.AWAITING_APPROVAL),
            ):
                out.append(self._audit(later, CANCELLED, why, now))
        self.store.update_incident(action.incident, state=INCIDENT_HUMAN, closed_at=now,
                                   note=why)
        with self._lock:
            released = self.policy.release(
                fingerprint=action.fingerprint, node=action.node, why=why
            )
        out.extend(released.audit)
        logger.warning("%s", why)
        return out

    def _probation(self, now: float) -> list[AuditRecord]:
        out: list[AuditRecord] = []
        for inc in self.store.incidents(states=(INCIDENT_PROBATION,)):
            if inc.probation_until is None or now < inc.probation_until:
                continue
            if self.validator is not None and not inc.note.startswith(_VALIDATION_PASSED_NOTE):
                continue  # not resumed before its validation passed
            with self._lock:
                result = self.policy.resolve(fingerprint=inc.fingerprint, node=inc.node)
            drill = next((a.attrs[DRILL] for a in self.store.actions(incident=inc.incident)
                          if a.attrs.get(DRILL)), "")
            if drill:  # a drill's return to service is the drill's too
                from remediation.drill import mark_drill_decisions

                result = mark_drill_decisions(result, {inc.fingerprint: drill})
            self.store.update_incident(inc.incident, state=INCIDENT_CLOSED if not
                                       result.requests else INCIDENT_OPEN, closed_at=None
                                       if result.requests else now,
                                       note="probation passed without recurrence")
            out.extend(result.audit)
            out.extend(self._reparent(result, inc.incident))
        return out

    async def _validate(self, now: float) -> list[AuditRecord]:
        """Start or poll the validation of each incident on probation (with a validator).

        Passed: noted on the incident (``validation passed: ...``), audited ``validated``;
        the probation's resume may follow. Failed: audited ``validation_failed`` and
        ``escalated`` with the evidence, and the node is handed to hardware service.
        """
        validator = self.validator
        if validator is None:
            return []
        out: list[AuditRecord] = []
        for inc in self.store.incidents(states=(INCIDENT_PROBATION,)):
            if inc.note.startswith(_VALIDATION_PASSED_NOTE):
                continue
            fix = next((a for a in reversed(self.store.actions(incident=inc.incident))
                        if a.step in FIX_STEPS and a.phase == ActionPhase.SUCCEEDED), None)
            if fix is None:
                continue
            ref = self._validations.get(inc.incident)
            status: ValidationStatus | None = None
            if ref is None:
                request = ValidationRequest(
                    node=inc.node, idempotency_key=f"{inc.incident}/validate",
                    reason=fix.reason, since_at=fix.finished_at, dry_run=fix.dry_run)
                out.append(self._audit(fix, VALIDATING, f"validating {inc.node} before it "
                                       f"returns to service ({validator.name})", now))
                try:
                    ref = await validator.submit(request)
                except TemporaryError as exc:
                    logger.warning("validator %s unavailable: %s", validator.name, exc)
                    continue
                except GpuHealthError as exc:
                    status = ValidationStatus(ref="", phase=ActionPhase.FAILED,
                                              message=f"{validator.name} refused: {exc}")
                else:
                    self._validations[inc.incident] = ref
            if status is None and ref is not None:
                try:
                    status = await validator.status(ref)
                except TemporaryError as exc:
                    logger.warning("validator %s unavailable: %s", validator.name, exc)
                    continue
                except GpuHealthError as exc:
                    status = ValidationStatus(ref=ref, phase=ActionPhase.FAILED,
                                              message=str(exc))
            if status is None or status.phase not in (ActionPhase.SUCCEEDED,
                                                      ActionPhase.FAILED):
                continue
            self._validations.pop(inc.incident, None)
            report = json.dumps(status.report.to_json(), sort_keys=True) \
                if status.report is not None else ""
            if status.phase == ActionPhase.SUCCEEDED:
                self.store.update_incident(inc.incident, note=f"{_VALIDATION_PASSED_NOTE}: "
                                           f"{status.message}"[:1000])
                record = self._audit(fix, VALIDATED, status.message, now)
                out.append(replace(record, details={**record.details, "validation": "passed",
                                                    "report": report}))
                continue
            back = {"out_of_service_at": None} if fix.step == RemediationStep.REBOOT else {}
            # (a reboot may have returned the node to service itself, Slurm's
            # nextstate=RESUME: taking it out again is not undoing a human's resume)
            self.store.update_incident(inc.incident, state=INCIDENT_OPEN, probation_until=None,
                                       note=f"validation failed: {status.message}"[:1000],
                                       **back)
            failed = self._audit(fix, VALIDATION_FAILED, status.message, now)
            escalated = self._audit(fix, ESCALATED, "the node failed its validation after "
                                    f"{fix.step.value}: hand-off to hardware service; "
                                    f"{status.message}", now)
            extra = {"validation": "failed", "report": report}
            self._count(fix.step, VALIDATION_FAILED, fix.dry_run)
            out.extend([replace(failed, details={**failed.details, **extra}),
                        replace(escalated, details={**escalated.details, **extra})])
            target = EntityId(fix.entity) if fix.entity != NODE_ENTITY else EntityId(inc.entity)
            out.extend(self._follow_up(fix, now, why="failed validation: hand-off to hardware "
                                       "service", evidence=status.message, plan=[
                                           PlannedStep(step=RemediationStep.CORDON,
                                                       entity=NODE_ENTITY),
                                           PlannedStep(step=RemediationStep.DRAIN,
                                                       entity=NODE_ENTITY, mode=MODE_EVICT),
                                           PlannedStep(step=RemediationStep.HAND_OFF,
                                                       entity=target)]))
        return out

    def _reparent(self, result: PolicyResult, incident: str) -> list[AuditRecord]:
        """Enqueue the resume that ends ``incident`` in that incident (it runs after its fix)."""
        now = self.clock()
        for request in result.requests:
            self.store.add(
                request, incident=incident, fingerprint=fingerprint_of(incident),
                severity="", phase=ActionPhase.PENDING, now=now,
            )
        return []

    def _settle(self, now: float) -> list[AuditRecord]:
        """Close incidents whose actions a human cancelled (``gpuhealth actions cancel``)."""
        out: list[AuditRecord] = []
        # only incidents with a step a human cancelled (one small read a tick, not every
        # open incident's actions: a fleet has thousands of open warnings)
        cancelled = [a.incident for a in self.store.actions(
            phases=(ActionPhase.CANCELLED,), incident_states=(INCIDENT_OPEN,)) if a.decided_by]
        if not cancelled:
            return out
        of = self.store.actions_of(cancelled)
        for inc in sorted(self.store.incidents_named(cancelled),
                          key=lambda i: (i.opened_at, i.incident)):
            if inc.state != INCIDENT_OPEN:
                continue
            actions = of.get(inc.incident, [])
            if not actions or any(a.phase not in TERMINAL for a in actions):
                continue
            if any(a.phase == ActionPhase.CANCELLED and a.decided_by for a in actions):
                why = "cancelled by a human"
                self.store.update_incident(inc.incident, state=INCIDENT_HUMAN, closed_at=now,
                                           note=why)
                with self._lock:
                    out.extend(self.policy.release(
                        fingerprint=inc.fingerprint, node=inc.node, why=why).audit)
        return out

    # -- helpers -------------------------------------------------------------------

    def _notified(self, actions: Sequence[StoredAction], now: float) -> None:
        """``notify`` steps succeed at once: the alert carries the notification."""
        if not actions:
            return
        self.store.update_many(
            [a.id for a in actions], now=now, phase=ActionPhase.SUCCEEDED,
            expect=(ActionPhase.PENDING,), message="the alert carries the notification",
            started_at=now, finished_at=now)
        still = self.policy.open_incidents
        self._close_if_only_notified(  # those whose finding resolved meanwhile
            [a.incident for a in actions if a.fingerprint not in still], now)

    def _close_if_only_notified(self, incidents: Sequence[str], now: float) -> None:
        """Close the open ones of ``incidents`` whose finding resolved and that only notified.

        A warning's incident is one ``notify`` step: nothing of the node changed, so
        nothing waits for a resume or a probation, and it closes when its finding is gone
        (else every warning of a fleet would stay an open incident for ever). One with
        any other step, or a step not finished yet, stays as it is. Two reads and one
        write for all of them (a burst resolves thousands).
        """
        if not incidents:
            return
        still = [i.incident for i in self.store.incidents_named(incidents)
                 if i.state == INCIDENT_OPEN]
        if not still:
            return
        of = self.store.actions_of(still)
        done = [i for i in still if of.get(i) and all(
            a.step == RemediationStep.NOTIFY and a.phase in TERMINAL for a in of[i])]
        self.store.update_incidents(done, state=INCIDENT_CLOSED, closed_at=now,
                                    note="the finding is gone")

    def _adapter_for(self, action: StoredAction) -> SchedulerAdapter:
        if action.step == RemediationStep.RESET_GPU and self.node_agent is not None:
            return self.node_agent
        return self.scheduler

    def _take_token(self, now: float) -> bool:
        rate = self.max_actions_per_minute / 60.0
        self._tokens = min(self.max_actions_per_minute,
                           self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def _wait(self, action: StoredAction, why: str, now: float,
              held: str | None = None) -> list[AuditRecord]:
        """Keep ``action`` waiting; audit (and count, as ``held``) once per change of reason."""
        if self._said.get(action.id) == why:
            return []
        self._said[action.id] = why
        if held is not None:
            self._count_held(held)
        self.store.update(action.id, now=now, message=why)
        return [self._audit(action, WAITING, why, now)]

    def _transient(self, action: StoredAction, why: str, exc: TemporaryError, now: float,
                   *, expect: ActionPhase | None = None) -> list[AuditRecord]:
        """A transient failure: try again after a backoff, within the attempt budget.

        The n-th failure waits ``retry_base_seconds x 2^(n-1)`` (at most
        ``retry_max_seconds``; at least the adapter's ``Retry-After``); the
        ``step_attempts``-th fails the step as ``exhausted``. Each is audited with its
        classification and counted in ``gpuhealth_remediation_failures_total``.
        """
        tries = self._tries.get(action.id, (0, now))[0] + 1
        if tries >= self.step_attempts:
            self._tries.pop(action.id, None)
            return self._permanent(action, f"{why} ({tries} transient failures in a row: the "
                                   "attempt budget is spent)", now, expect=expect,
                                   classification="exhausted")
        wait = min(self.retry_max_seconds, self.retry_base_seconds * 2 ** (tries - 1))
        if exc.retry_after_seconds is not None:
            wait = max(wait, exc.retry_after_seconds)
        self._tries[action.id] = (tries, now + wait)
        self._fail_count(action.step, "transient")
        message = (f"transient failure {tries} of {self.step_attempts}: {why}; "
                   f"tried again in {wait:.0f} s")
        self._said[action.id] = message
        self.store.update(action.id, now=now, message=message)
        record = self._audit(action, WAITING, message, now)
        return [replace(record, details={**record.details, "classification": "transient",
                                         "attempt": str(tries)})]

    def _permanent(self, action: StoredAction, why: str, now: float, *,
                   expect: ActionPhase | None = None,
                   classification: str = "permanent") -> list[AuditRecord]:
        """The step failed for good: no retry; its incident's later steps do not run.

        The incident is escalated to a person (``escalated`` audit record naming the
        classification); its alert keeps firing.
        """
        self._tries.pop(action.id, None)
        if not self.store.update(action.id, now=now, phase=ActionPhase.FAILED,
                                 expect=(expect,) if expect is not None else None,
                                 message=why, finished_at=now):
            return []
        self._count(action.step, FAILED, action.dry_run)
        self._fail_count(action.step, classification)
        failed = self._audit(action, FAILED, why, now)
        escalated = self._audit(action, ESCALATED, f"{action.step.value} failed "
                                f"({classification}): needs a person; {why}", now)
        extra = {"classification": classification}
        if action.step == RemediationStep.RESET_GPU and fallback_of(why) == "reboot":
            return [replace(failed, details={**failed.details, **extra, "fallback": "reboot"}),
                    *self._follow_up(action, now, why="the GPU reset failed; falls back to "
                                     "a node reboot", plan=[
                                         PlannedStep(step=RemediationStep.CORDON,
                                                     entity=NODE_ENTITY),
                                         PlannedStep(step=RemediationStep.DRAIN,
                                                     entity=NODE_ENTITY, mode=MODE_EVICT),
                                         PlannedStep(step=RemediationStep.REBOOT,
                                                     entity=NODE_ENTITY)])]
        return [replace(failed, details={**failed.details, **extra}),
                replace(escalated, details={**escalated.details, **extra})]

    def _follow_up(self, action: StoredAction, now: float, *, why: str,
                   plan: list[PlannedStep], evidence: str = "") -> list[AuditRecord]:
        """Queue ``plan`` in ``action``'s incident, after it, in place of its later steps.

        Used when a step fails in a way that has a known next rung: a failed GPU reset
        falls back to a node reboot (cordon, drain, reboot), a failed validation hands
        the node to hardware service. Each queued step is audited (``requested``) before
        it can run; keys are ``<failed step's key>/<step>`` (idempotent across ticks).
        """
        for later in self.store.actions(incident=action.incident):
            if later.id > action.id and later.phase in (ActionPhase.PENDING,
                                                         ActionPhase.AWAITING_APPROVAL):
                self.store.update(later.id, now=now, phase=ActionPhase.CANCELLED,
                                  expect=(ActionPhase.PENDING, ActionPhase.AWAITING_APPROVAL),
                                  message=f"replaced: {why}", finished_at=now)
        out: list[AuditRecord] = []
        for planned in plan:
            attrs = {**planned.attrs(), FOLLOWS: str(action.id), "why": why}
            if action.attrs.get(DRILL):  # a drill's follow-up is the drill's (no hand-off)
                attrs[DRILL] = action.attrs[DRILL]
            if evidence:
                attrs["evidence"] = evidence[:1000]
            request = ActionRequest(
                step=planned.step, node=action.node, entity=planned.entity,
                reason=f"{action.reason} ({why})"[:200],
                idempotency_key=f"{action.key}/{planned.step.value}",
                dry_run=action.dry_run, attrs=attrs,
            )
            stored = self.store.add(request, incident=action.incident,
                                    fingerprint=action.fingerprint, severity=action.severity,
                                    phase=ActionPhase.PENDING, now=now, message=why)
            if stored is not None:
                out.append(self._audit(stored, DECISION_REQUESTED, why, now))
        return out

    def _fail_count(self, step: RemediationStep, classification: str) -> None:
        key = (step.value, classification)
        self.stats.failures[key] = self.stats.failures.get(key, 0) + 1

    def _count(self, step: RemediationStep, decision: str, dry_run: bool) -> None:
        key = (step.value, decision, "true" if dry_run else "false")
        self.stats.transitions[key] = self.stats.transitions.get(key, 0) + 1

    def _count_held(self, why: str) -> None:
        self.stats.held[why] = self.stats.held.get(why, 0) + 1

    def _audit(self, action: StoredAction, decision: str, reason: str, now: float) -> AuditRecord:
        return AuditRecord(
            at=now,
            actor=self.identity,
            decision=decision,
            step=action.step,
            node=action.node,
            entity=action.entity,  # type: ignore[arg-type]
            reason=reason,
            idempotency_key=action.key,
            dry_run=action.dry_run,
            details={"action_id": str(action.id), "incident": action.incident,
                     "fingerprint": action.fingerprint, **action.attrs,
                     **self._priority_details(action.incident)},
        )

    def _priority_details(self, incident: str) -> dict[str, str]:
        work = self._work.get(incident)
        if not work:
            return {}
        return {"priority": str(top_priority(work)), "priority_class": priority_class_of(work)}


def approve(store: ActionStore, action_id: int, *, who: str, now: float) -> StoredAction:
    """Approve an action waiting for approval (``gpuhealth actions approve``).

    Raises:
        KeyError: No such action.
        ValueError: The action is not waiting for approval.
    """
    action = store.get(action_id)
    if action is None:
        raise KeyError(f"no action {action_id}")
    if not store.update(action_id, now=now, phase=ActionPhase.PENDING,
                        expect=(ActionPhase.AWAITING_APPROVAL,), decided_by=who,
                        message=f"approved by {who}"):
        raise ValueError(f"action {action_id} is {action.phase.value}, not awaiting approval")
    return store.get(action_id) or action


def cancel(store: ActionStore, action_id: int, *, who: str, now: float) -> StoredAction:
    """Cancel an action that has not started (``gpuhealth actions cancel``).

    Raises:
        KeyError: No such action.
        ValueError: The action is running or finished (undo it instead).
    """
    action = store.get(action_id)
    if action is None:
        raise KeyError(f"no action {action_id}")
    if not store.update(action_id, now=now, phase=ActionPhase.CANCELLED,
                        expect=(ActionPhase.PENDING, ActionPhase.AWAITING_APPROVAL),
                        decided_by=who, message=f"cancelled by {who}", finished_at=now):
        raise ValueError(f"action {action_id} is {action.phase.value}; only pending or "
                         "awaiting-approval actions can be cancelled")
    return store.get(action_id) or action


UNDOABLE = frozenset({RemediationStep.CORDON, RemediationStep.DRAIN, RemediationStep.HAND_OFF})


def undo(store: ActionStore, action_id: int, *, who: str, now: float) -> StoredAction:
    """Queue the undo of a succeeded cordon, drain or hand-off: resume the node.

    The resume runs as a new action (the engine reads the node first: only what
    gpuhealth did is undone). The incident's steps not yet started are cancelled.

    Raises:
        KeyError: No such action.
        ValueError: The action cannot be undone (not succeeded, or not a cordon/drain/hand-off).
    """
    action = store.get(action_id)
    if action is None:
        raise KeyError(f"no action {action_id}")
    if action.step not in UNDOABLE or action.phase != ActionPhase.SUCCEEDED:
        raise ValueError(f"action {action_id} ({action.step.value}, {action.phase.value}) "
                         "cannot be undone: only succeeded cordon, drain and hand_off can")
    for later in store.actions(incident=action.incident):
        store.update(later.id, now=now, phase=ActionPhase.CANCELLED, decided_by=who,
                     message=f"cancelled by {who} (undo of action {action_id})",
                     finished_at=now,
                     expect=(ActionPhase.PENDING, ActionPhase.AWAITING_APPROVAL))
    request = ActionRequest(
        step=RemediationStep.RESUME,
        node=action.node,
        entity=action.request().entity,
        reason=f"gpuhealth: undo of action {action_id} by {who}",
        idempotency_key=f"{action.incident}~undo{action_id}/resume",
        dry_run=action.dry_run,
        attrs={"when": "now", "scope": "node"},
    )
    added = store.add(request, incident=f"{action.incident}~undo{action_id}",
                      fingerprint=action.fingerprint, severity=action.severity,
                      phase=ActionPhase.PENDING, now=now, message=f"undo requested by {who}")
    if added is None:
        existing = store.by_key(request.idempotency_key)
        assert existing is not None
        return existing
    store.update(added.id, now=now, decided_by=who)
    return store.get(added.id) or added


def summarize(actions: Iterable[StoredAction]) -> Mapping[str, int]:
    """Count actions by phase (``gpuhealth actions list`` footer, metrics)."""
    out: dict[str, int] = {}
    for action in actions:
        out[action.phase.value] = out.get(action.phase.value, 0) + 1
    return out
