"""The remediation policy: from a finding to ordered, guarded, idempotent action requests.

:func:`ladder` maps a finding's severity, recommended action and entity to the
ordered remediation steps of ``docs/remediation.md`` (from ``docs/fault-model.md``:
critical takes the GPU or node out of service now, major drains at the next safe
point, warning defers to the next opportunity, info does nothing).
:class:`RemediationPolicy` turns those steps into
:class:`~core.records.ActionRequest` records under the guards: dry-run by default, a
fleet-wide disruption budget, per-node opt-out, a minimum confidence and
idempotency on ``<alert fingerprint>/<step>``. Every decision, taken or held
back, comes with an :class:`~core.records.AuditRecord` saying why.

The policy decides; it neither submits requests nor writes the audit log (the
pipeline does both), so it can be tested with literal findings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from alerting.alerts import NETWORK_KINDS, PREDICTION_KIND, alert_name
from analytics.fault_model.site_rules import rule_notes
from core.clock import Clock, system_clock
from core.records import (
    NODE_ENTITY,
    Action,
    ActionRequest,
    AuditRecord,
    EntityId,
    Finding,
    NodeName,
    RemediationStep,
    Severity,
)

logger = logging.getLogger(__name__)

NOW = "now"
"""``when``: carry the step out at once."""
NEXT_SAFE_POINT = "next_safe_point"
"""``when``: at the next point where no running job is killed (jobs finish first)."""
IDLE = "idle"
"""``when``: once the target is idle (deferred to the next opportunity)."""

SCOPE_NODE = "node"
SCOPE_GPU = "gpu"
SCOPE_MULTI_NODE_JOBS = "multi_node_jobs"
"""``scope`` of a drain that only keeps the node out of multi-node jobs."""

MODE_EVICT = "evict"
"""``mode`` of a drain that evicts running work (respecting disruption budgets of the scheduler)."""
MODE_ALLOW_COMPLETION = "allow_completion"
"""``mode`` of a drain that stops new work and lets running work finish."""

DECISION_REQUESTED = "requested"
DECISION_HELD = "held"
DECISION_DUPLICATE = "duplicate"
DECISION_RESOLVED = "resolved"

REASON_MAX_CHARS = 200
"""Reasons written onto nodes are cut to this length (Slurm ``Reason=`` stays readable)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedStep:
    """One step of the ladder for a finding, before the guards.

    Attributes:
        step: The remediation step.
        entity: The GPU for GPU-level steps, else ``"node"``.
        when: :data:`NOW`, :data:`NEXT_SAFE_POINT` or :data:`IDLE`.
        scope: :data:`SCOPE_NODE`, :data:`SCOPE_GPU` or :data:`SCOPE_MULTI_NODE_JOBS`.
        mode: For drains, :data:`MODE_EVICT` or :data:`MODE_ALLOW_COMPLETION`; else ``""``.
    """

    step: RemediationStep
    entity: EntityId
    when: str = NOW
    scope: str = SCOPE_NODE
    mode: str = ""

    @property
    def disrupts_node(self) -> bool:
        """Whether the step takes (part of) the node out of service: counted by the budget."""
        if self.step in (RemediationStep.CORDON, RemediationStep.REBOOT, RemediationStep.HAND_OFF):
            return True
        return self.step == RemediationStep.DRAIN and self.scope != SCOPE_GPU

    def attrs(self) -> dict[str, str]:
        """Return the ``ActionRequest.attrs`` of the step."""
        attrs = {"when": self.when, "scope": self.scope}
        if self.mode:
            attrs["mode"] = self.mode
        return attrs


def gpu_of(finding: Finding) -> EntityId | None:
    """Return the GPU a finding is about, or ``None`` for node, host and network findings."""
    if finding.entity == NODE_ENTITY:
        return None
    if finding.kind in NETWORK_KINDS or finding.kind.startswith("host_"):
        return None
    return finding.entity


def _drain_and_reset_gpu(gpu: EntityId, *, urgent: bool) -> list[PlannedStep]:
    """Drain one GPU's work and reset it: now (evicting), or gently and when idle."""
    return [
        PlannedStep(
            step=RemediationStep.DRAIN,
            entity=gpu,
            when=NOW if urgent else NEXT_SAFE_POINT,
            scope=SCOPE_GPU,
            mode=MODE_EVICT if urgent else MODE_ALLOW_COMPLETION,
        ),
        PlannedStep(
            step=RemediationStep.RESET_GPU,
            entity=gpu,
            when=NOW if urgent else IDLE,
            scope=SCOPE_GPU,
        ),
    ]


def _then_act(
    finding: Finding, gpu: EntityId | None, before: list[PlannedStep], when: str
) -> list[PlannedStep] | None:
    """``before``, then the step of the finding's action at ``when``; ``None`` if it has none."""
    if finding.action == Action.REBOOT_NODE:
        last = PlannedStep(step=RemediationStep.REBOOT, entity=NODE_ENTITY, when=when)
    elif finding.action == Action.RESET_GPU:
        target, scope = (gpu, SCOPE_GPU) if gpu is not None else (NODE_ENTITY, SCOPE_NODE)
        last = PlannedStep(step=RemediationStep.RESET_GPU, entity=target, when=when, scope=scope)
    elif finding.action == Action.SERVICE_HARDWARE:
        last = PlannedStep(step=RemediationStep.HAND_OFF, entity=finding.entity, when=when)
    else:
        return None
    return [*before, last]


def ladder(finding: Finding, *, gpu_level_drain: bool = True) -> list[PlannedStep]:
    """Return the ordered remediation steps for ``finding`` (``docs/remediation.md``).

    Args:
        finding: The diagnosis; its severity, action, entity and kind decide.
        gpu_level_drain: Whether the scheduler can drain one GPU's work (Kubernetes
            device plugins, Slurm GRES); if not, a GPU fault drains the node.

    Returns:
        Steps in the order they must run; empty for ``info``.
    """
    node = NODE_ENTITY
    gpu = gpu_of(finding)
    sev, action = finding.severity, finding.action
    notify = PlannedStep(step=RemediationStep.NOTIFY, entity=finding.entity)
    cordon = PlannedStep(step=RemediationStep.CORDON, entity=node)
    drain_now = PlannedStep(step=RemediationStep.DRAIN, entity=node, mode=MODE_EVICT)
    drain_later = PlannedStep(
        step=RemediationStep.DRAIN, entity=node, when=NEXT_SAFE_POINT, mode=MODE_ALLOW_COMPLETION
    )
    if sev == Severity.INFO or finding.kind == "gpuhealth":
        return []  # gpuhealth's own faults (a store it cannot write) are not the node's
    if sev == Severity.WARNING:
        if action == Action.RESET_GPU and gpu is not None:
            # Pending row remap, Xid 94/63: reset at the next opportunity, no cordon (MEMERR).
            return _drain_and_reset_gpu(gpu, urgent=False)
        return [notify]
    if sev == Severity.MAJOR:
        if action == Action.CHECK_NETWORK:
            return [
                notify,
                PlannedStep(
                    step=RemediationStep.DRAIN,
                    entity=node,
                    when=NEXT_SAFE_POINT,
                    scope=SCOPE_MULTI_NODE_JOBS,
                    mode=MODE_ALLOW_COMPLETION,
                ),
            ]
        if action == Action.RESET_GPU and gpu is not None and gpu_level_drain:
            return [notify, *_drain_and_reset_gpu(gpu, urgent=False)]
        steps = _then_act(finding, gpu, [notify, drain_later], IDLE)
        return steps if steps is not None else [notify]
    # Critical: out of service now, then the recommended action.
    if action == Action.RESET_GPU and gpu is not None and gpu_level_drain:
        return _drain_and_reset_gpu(gpu, urgent=True)
    steps = _then_act(finding, gpu, [cordon, drain_now], NOW)
    if steps is not None:
        return steps
    if action in (Action.CHECK_NETWORK, Action.FIX_CONFIG):
        return [notify, cordon, drain_now]
    if action == Action.RESTART_APP:
        return [notify, PlannedStep(step=RemediationStep.RESTART, entity=finding.entity)]
    return [notify]


def describe(step: RemediationStep, entity: str, attrs: dict[str, str] | None = None) -> str:
    """Return a short phrase for a step: ``cordon node``, ``reset GPU 0000:b1:00.0 when idle``.

    Examples:
        >>> describe(RemediationStep.REBOOT, "node")
        'reboot node'
        >>> describe(RemediationStep.RESET_GPU, "gpu:1", {"when": "idle", "scope": "gpu"})
        'reset GPU gpu:1 when idle'
    """
    attrs = attrs or {}
    target = "node" if entity == NODE_ENTITY else f"GPU {entity}"
    if step == RemediationStep.NOTIFY:
        text = "notify"
    elif step == RemediationStep.HAND_OFF:
        text = f"hand off {'node' if entity == NODE_ENTITY else entity} to hardware service"
    elif step == RemediationStep.RESET_GPU:
        text = "reset all GPUs of node" if entity == NODE_ENTITY else f"reset GPU {entity}"
    elif step == RemediationStep.RESTART:
        text = f"restart the workload on {target}"
    elif step == RemediationStep.DRAIN and attrs.get("scope") == SCOPE_MULTI_NODE_JOBS:
        text = "drain node from multi-node jobs"
    else:
        text = f"{step.value} {target}"
    when = attrs.get("when", NOW)
    if when == NEXT_SAFE_POINT:
        text += " at the next safe point"
    elif when == IDLE:
        text += " when idle"
    return text


def describe_request(request: ActionRequest) -> str:
    """Return a short phrase for ``request`` (see :func:`describe`)."""
    return describe(request.step, request.entity, dict(request.attrs))


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One decision of the policy about one step of one incident: the typed record it hands on.

    The engine reads a decision's fields to open the incident and store the action; the
    audit trail is written from it (:meth:`audit_record`) and read back into it
    (:meth:`from_audit`) when the policy is rebuilt after a restart or a fail-over, so
    the audit line, the action and the budget come from one record.

    Attributes:
        at: When it was decided, epoch seconds.
        actor: Who decided (the ``actor`` of the audit record).
        decision: :data:`DECISION_REQUESTED`, :data:`DECISION_HELD`,
            :data:`DECISION_DUPLICATE` or :data:`DECISION_RESOLVED`.
        node: The node.
        planned: The step decided on; ``None`` for a resolution.
        reason: Why (the hold's reason, the request's ``Reason=``).
        idempotency_key: ``<incident>/<step>``, or the incident for a resolution.
        dry_run: Whether requests are dry-run.
        fingerprint: The alert's fingerprint.
        incident: The incident's number for this fingerprint, from 1.
        alertname, severity, action, kind, code, finding_entity: The finding decided on
            (empty for a resolution).
        escalated_from: The incident this one escalates (a recurrence on probation), or ``""``.
        why: Why it escalated or was released, or ``""``.
        released: A resolution because a human took over, not because the fault went away.
        rules: The site rules (``[[policy.rule]]``) that changed the finding, as their notes
            (``policy rule 'xid43-repeat': severity major -> critical``), or ``""``.
        request: The request to submit (``requested`` decisions only).
    """

    at: float
    actor: str
    decision: str
    node: NodeName
    planned: PlannedStep | None
    reason: str
    idempotency_key: str
    dry_run: bool
    fingerprint: str
    incident: int
    alertname: str = ""
    severity: str = ""
    action: str = ""
    kind: str = ""
    code: str = ""
    finding_entity: str = ""
    escalated_from: str = ""
    why: str = ""
    released: bool = False
    rules: str = ""
    request: ActionRequest | None = None
    drill: str = ""
    """The drill this decision is for (``details["drill"]``), else ``""``."""

    @property
    def disrupts_node(self) -> bool:
        """Whether the step takes (part of) the node out of service (counted by the budget)."""
        return self.planned is not None and self.planned.disrupts_node

    @property
    def incident_key(self) -> str:
        """The incident's key: the fingerprint, ``<fingerprint>.<n>`` from the second on."""
        return self.fingerprint if self.incident == 1 else f"{self.fingerprint}.{self.incident}"

    def audit_record(self) -> AuditRecord:
        """Return the audit line of this decision (its fields as ``details``)."""
        details: dict[str, str] = {"fingerprint": self.fingerprint, "incident": str(self.incident)}
        if self.alertname:
            details.update(alertname=self.alertname, severity=self.severity,
                           action=self.action, kind=self.kind, code=self.code,
                           finding_entity=self.finding_entity)
        if self.escalated_from:
            details.update(escalated="true", escalated_from=self.escalated_from)
        if self.why:
            details["why"] = self.why
        if self.released:
            details["released"] = "true"
        if self.rules:
            details["policy_rules"] = self.rules
        if self.drill:
            details["drill"] = self.drill
        if self.planned is not None:
            details.update(self.planned.attrs())
            details["disrupts_node"] = "true" if self.disrupts_node else "false"
        return AuditRecord(
            at=self.at, actor=self.actor, decision=self.decision,
            step=self.planned.step if self.planned is not None else None, node=self.node,
            entity=self.planned.entity if self.planned is not None else NODE_ENTITY,
            reason=self.reason, idempotency_key=self.idempotency_key, dry_run=self.dry_run,
            details=details)

    @classmethod
    def from_audit(cls, record: AuditRecord) -> Decision | None:
        """Read a policy decision back from its audit line; ``None`` for other lines.

        A ``requested`` line gets back its :attr:`request` (step, entity, reason, key,
        dry-run and the step's attributes), as it was handed to the engine.

        Lines without a ``fingerprint`` (the engine's step results, the breaker) are not
        policy decisions. Lines of older versions lack ``disrupts_node``; it is then
        derived from the step as :attr:`PlannedStep.disrupts_node` does.
        """
        d = record.details
        fingerprint = d.get("fingerprint")
        if fingerprint is None or record.decision not in _DECISIONS:
            return None
        planned: PlannedStep | None = None
        if record.step is not None:
            planned = PlannedStep(step=record.step, entity=record.entity,
                                  when=d.get("when", NOW), scope=d.get("scope", SCOPE_NODE),
                                  mode=d.get("mode", ""))
        try:
            incident = int(d.get("incident", "1"))
        except ValueError:
            incident = 1
        request = None
        if record.decision == DECISION_REQUESTED and planned is not None:
            request = ActionRequest(step=planned.step, node=record.node, entity=planned.entity,
                                    reason=record.reason, idempotency_key=record.idempotency_key,
                                    dry_run=record.dry_run, attrs=planned.attrs())
            if d.get("drill"):
                request = replace(request, attrs={**request.attrs, "drill": d["drill"]})
            if d.get("policy_rules"):
                request = replace(request, attrs={**request.attrs,
                                                  "policy_rules": d["policy_rules"]})
        return cls(
            at=record.at, actor=record.actor, decision=record.decision, node=record.node,
            planned=planned, reason=record.reason, idempotency_key=record.idempotency_key,
            dry_run=record.dry_run, fingerprint=fingerprint, incident=incident,
            alertname=d.get("alertname", ""), severity=d.get("severity", ""),
            action=d.get("action", ""), kind=d.get("kind", ""), code=d.get("code", ""),
            finding_entity=d.get("finding_entity", ""),
            escalated_from=d.get("escalated_from", ""), why=d.get("why", ""),
            released=d.get("released") == "true", rules=d.get("policy_rules", ""),
            request=request, drill=d.get("drill", ""))


_DECISIONS = frozenset({DECISION_REQUESTED, DECISION_HELD, DECISION_DUPLICATE,
                        DECISION_RESOLVED})


@dataclass(slots=True)
class PolicyResult:
    """What one decision produced: typed :class:`Decision` records, in ladder order.

    :attr:`requests` are the ones to submit, :attr:`audit` the lines to write before
    anything is submitted; both are read from :attr:`decisions`.
    """

    decisions: list[Decision] = field(default_factory=list)

    @property
    def requests(self) -> list[ActionRequest]:
        """The requests to submit, in order."""
        return [d.request for d in self.decisions if d.request is not None]

    @property
    def audit(self) -> list[AuditRecord]:
        """One audit line per decision, in order."""
        return [d.audit_record() for d in self.decisions]

    def extend(self, other: PolicyResult) -> None:
        """Append ``other``'s decisions."""
        self.decisions.extend(other.decisions)


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyCheckpoint:
    """The policy's decision state at one moment (:meth:`RemediationPolicy.checkpoint`)."""

    done: set[str]
    incident: dict[str, int]
    active: dict[str, str]
    out_of_service: dict[str, set[str]]
    held: dict[str, Finding]
    held_plan: dict[str, tuple[list[PlannedStep], tuple[str, str] | None]]
    shared: dict[str, dict[tuple[str, str, str, str], tuple[str, set[str]]]]


class RemediationPolicy:
    """Decides which remediation steps to request for a finding, under the guards.

    Guards, in the order they are checked for each step other than ``notify``:

    1. per-node opt-out (``opt_out_nodes``): held back;
    2. a predicted failure (kind ``prediction``) unless ``act_on_predictions``: held
       back, it only notifies (nothing is broken yet, and a predictor's precision is
       rarely good enough to take nodes out on its word: measure it on the site's own
       history with ``gpuhealth evaluate`` first);
    3. confidence below ``min_confidence``: held back;
    4. the disruption budget: a step that takes a node out of service (cordon,
       node drain, reboot, hand-off) is held back when
       ``max(1, floor(max_disrupted_fraction * cluster_size))`` nodes are already
       out of service because of gpuhealth and this node is not one of them. The last
       ``ceil(critical_reserve_fraction * limit)`` slots (none when the limit is 1) are
       kept for ``critical`` findings: a node whose GPU is already failing work must not
       wait behind degraded ones (``major``) that took the budget first.

    Once a step of a plan is held back, the steps after it are held back too
    (no reset without its drain). Idempotency: a step is requested once per
    incident, keyed ``<fingerprint>/<step>`` (``<fingerprint>.<n>/<step>`` for the
    n-th recurrence after a resolve); asking again yields a ``duplicate`` record.

    Args:
        dry_run: Mark requests as dry-run (record only, change nothing).
        max_disrupted_fraction: Fleet share of nodes that gpuhealth may hold out of
            service at once, in (0, 1]; default 0.10.
        cluster_size: Number of nodes in the fleet, >= 1.
        opt_out_nodes: Nodes never remediated automatically (notify still happens).
        gpu_level_drain: Whether the scheduler can drain one GPU's work.
        min_confidence: Findings below this confidence (0-1) only notify.
        act_on_predictions: Let predicted failures take steps beyond ``notify``
            (drain at the next safe point, hand-off); default off.
        critical_reserve_fraction: Share of the disruption budget, in [0, 1), that only
            critical findings may use (rounded up; 0 reserves nothing); default 0.25.
        actor: The ``actor`` of audit records.
        clock: Returns now, epoch seconds.

    Raises:
        ValueError: A fraction, size or confidence out of range.
    """

    def __init__(
        self,
        *,
        dry_run: bool = True,
        max_disrupted_fraction: float = 0.10,
        cluster_size: int = 1,
        opt_out_nodes: frozenset[str] = frozenset(),
        gpu_level_drain: bool = True,
        min_confidence: float = 0.5,
        act_on_predictions: bool = False,
        critical_reserve_fraction: float = 0.25,
        actor: str = "gpuhealth",
        clock: Clock = system_clock,
    ) -> None:
        if not 0.0 < max_disrupted_fraction <= 1.0:
            raise ValueError(
                f"max_disrupted_fraction must be in (0, 1], got {max_disrupted_fraction!r}"
            )
        if cluster_size < 1:
            raise ValueError(f"cluster_size must be >= 1, got {cluster_size!r}")
        if not 0.0 <= critical_reserve_fraction < 1.0:
            raise ValueError("critical_reserve_fraction must be in [0, 1), got "
                             f"{critical_reserve_fraction!r}")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence!r}")
        self.dry_run = dry_run
        self.max_disrupted_fraction = max_disrupted_fraction
        self.cluster_size = cluster_size
        self.opt_out_nodes = frozenset(opt_out_nodes)
        self.gpu_level_drain = gpu_level_drain
        self.min_confidence = min_confidence
        self.act_on_predictions = act_on_predictions
        self.critical_reserve_fraction = critical_reserve_fraction
        self.actor = actor
        self.clock = clock
        self._done: set[str] = set()
        self._incident: dict[str, int] = {}
        self._active: dict[str, str] = {}
        self._out_of_service: dict[str, set[str]] = {}
        self._held: dict[str, Finding] = {}
        self._held_plan: dict[str, tuple[list[PlannedStep], tuple[str, str] | None]] = {}
        self._shared: dict[str, dict[tuple[str, str, str, str], tuple[str, set[str]]]] = {}
        self.work_priority: dict[str, float] = {}
        """Top scheduling priority of the work on a node (Slurm job priority, pod
        ``spec.priority``), set by the engine for the nodes of held findings
        (:mod:`remediation.priority`): within one severity, the budget goes to the node
        of the highest-priority work first."""

    @property
    def disruption_limit(self) -> int:
        """Nodes gpuhealth may hold out of service at once: ``max(1, floor(fraction x size))``."""
        return max(1, math.floor(self.max_disrupted_fraction * self.cluster_size + 1e-9))

    @property
    def critical_reserve(self) -> int:
        """Budget slots only critical findings may take: ``ceil(fraction x limit)``.

        None when the limit is 1: a small cluster keeps its one slot for any fault.
        """
        limit = self.disruption_limit
        if limit < 2:
            return 0
        return min(limit - 1, math.ceil(self.critical_reserve_fraction * limit - 1e-9))

    @property
    def out_of_service(self) -> frozenset[str]:
        """Nodes out of service because of gpuhealth now (in dry-run: would be)."""
        return frozenset(self._out_of_service)

    @property
    def open_incidents(self) -> dict[str, str]:
        """Fingerprints the policy decided on and that have not resolved, with their node."""
        return dict(self._active)

    @property
    def held(self) -> frozenset[str]:
        """Fingerprints with steps held back, retried by :meth:`retry_held`."""
        return frozenset(self._held)

    @property
    def held_nodes(self) -> frozenset[str]:
        """Nodes of the findings with steps held back (whose work the engine reads)."""
        return frozenset(str(f.node) for f in self._held.values())

    def _work_rank(self, node: str) -> float:
        """Sort key of a node's work: its top priority, negated (unknown or idle: last)."""
        top = self.work_priority.get(node)
        return float("inf") if top is None else -top

    def checkpoint(self) -> PolicyCheckpoint:
        """Return a copy of the decision state, for :meth:`rollback`."""
        return PolicyCheckpoint(
            done=set(self._done), incident=dict(self._incident), active=dict(self._active),
            out_of_service={n: set(f) for n, f in self._out_of_service.items()},
            held=dict(self._held), held_plan=dict(self._held_plan),
            shared={n: {k: (key, set(fps)) for k, (key, fps) in steps.items()}
                    for n, steps in self._shared.items()})

    def rollback(self, checkpoint: PolicyCheckpoint) -> None:
        """Put the decision state back as it was at ``checkpoint``.

        For decisions that could not be recorded: the budget then counts no node that no
        recorded decision holds, and deciding again gives the same keys.
        """
        c = checkpoint
        self._done, self._incident, self._active = set(c.done), dict(c.incident), dict(c.active)
        self._out_of_service = {n: set(f) for n, f in c.out_of_service.items()}
        self._held, self._held_plan = dict(c.held), dict(c.held_plan)
        self._shared = {n: {k: (key, set(fps)) for k, (key, fps) in steps.items()}
                        for n, steps in c.shared.items()}

    def _prefix(self, fingerprint: str) -> tuple[str, int]:
        n = self._incident.get(fingerprint, 1)
        return (fingerprint if n == 1 else f"{fingerprint}.{n}"), n

    def decide(self, finding: Finding, *, fingerprint: str) -> PolicyResult:
        """Decide the steps for ``finding``, whose alert has ``fingerprint``.

        Returns:
            The new requests (in ladder order) and one audit record per step:
            ``requested``, ``held`` (with why) or ``duplicate``.
        """
        return self._decide(finding, fingerprint, quiet_holds=False)

    def retry_held(self) -> PolicyResult:
        """Decide again for every finding with held-back steps (after the budget freed up).

        The most severe first (:meth:`decide_worst_first`). Holds that persist are not
        audited again; only steps now taken are.
        """
        return self.decide_worst_first(())

    def decide_worst_first(self, fresh: Sequence[tuple[Finding, str]]) -> PolicyResult:
        """Retry the held findings and decide ``fresh`` ones, the most severe first.

        The disruption budget goes to the worst faults: critical before major before
        warning; within one severity, the node of the higher-priority work first
        (:attr:`work_priority`, when the engine has read it: critical work recovers
        first), then held findings (older) before fresh ones, each in arrival order.
        Without this a major fault that came first in a burst took the last slot, and a
        GPU that had fallen off the bus after it waited.

        Args:
            fresh: (finding, alert fingerprint) pairs seen for the first time.
        """
        again = {fp for _, fp in fresh}
        queue = [(-finding.severity.rank, self._work_rank(str(finding.node)), 0, index, fp,
                  finding)
                 for index, (fp, finding) in enumerate(self._held.items()) if fp not in again]
        queue += [(-finding.severity.rank, self._work_rank(str(finding.node)), 1, index, fp,
                   finding) for index, (finding, fp) in enumerate(fresh)]
        queue.sort(key=lambda item: item[:4])
        result = PolicyResult()
        for _, _, is_fresh, _, fp, finding in queue:
            if is_fresh:
                result.extend(self.decide(finding, fingerprint=fp))
            elif fp in self._held:
                plan, escalation = self._held_plan.get(fp, (None, None))
                result.extend(self._decide(finding, fp, quiet_holds=True, plan=plan,
                                           escalation=escalation))
        return result

    def escalate(self, finding: Finding, *, fingerprint: str, why: str) -> PolicyResult:
        """Open the next incident of ``fingerprint`` with the escalated plan.

        The fault recurred after its fix: cordon, drain now, hand off to hardware service.

        The node keeps its disruption-budget slot across the two incidents (it is not
        returned to service in between). Its decisions carry ``escalated_from`` and ``why``
        (audit lines: ``escalated=true``, ``escalated_from``, ``why``).
        """
        prefix, incident = self._prefix(fingerprint)
        self._incident[fingerprint] = incident + 1
        self._unshare(finding.node, fingerprint)
        node = NODE_ENTITY
        plan = [
            PlannedStep(step=RemediationStep.CORDON, entity=node),
            PlannedStep(step=RemediationStep.DRAIN, entity=node, mode=MODE_EVICT),
            PlannedStep(step=RemediationStep.HAND_OFF, entity=finding.entity),
        ]
        return self._decide(finding, fingerprint, quiet_holds=False, plan=plan,
                            escalation=(prefix, why))

    def release(self, *, fingerprint: str, node: str, why: str) -> PolicyResult:
        """Stop acting on ``fingerprint`` without resuming the node (a human took over).

        Frees the budget slot the incident held and records ``resolved`` with ``why``;
        requests nothing (gpuhealth never undoes what a human did).
        """
        self._held.pop(fingerprint, None)
        if fingerprint not in self._active:
            return PolicyResult()
        now = self.clock()
        prefix, incident = self._prefix(fingerprint)
        self._active.pop(fingerprint, None)
        self._incident[fingerprint] = incident + 1
        self._unshare(node, fingerprint)
        holders = self._out_of_service.get(node)
        if holders is not None:
            holders.discard(fingerprint)
            if not holders:
                del self._out_of_service[node]
        return PolicyResult(decisions=[Decision(
            at=now, actor=self.actor, decision=DECISION_RESOLVED, node=NodeName(node),
            planned=None, reason=why, idempotency_key=prefix, dry_run=self.dry_run,
            fingerprint=fingerprint, incident=incident, why=why, released=True)])

    def _decide(
        self,
        finding: Finding,
        fp: str,
        *,
        quiet_holds: bool,
        plan: list[PlannedStep] | None = None,
        escalation: tuple[str, str] | None = None,
    ) -> PolicyResult:
        now = self.clock()
        prefix, incident = self._prefix(fp)
        node = finding.node
        name = alert_name(finding.kind, finding.code)
        reason = _cut(
            f"gpuhealth: {name} {finding.severity.value} {finding.action.value} "
            f"on {finding.entity}: {finding.summary}"
        )
        escalated_from, why_escalated = escalation or ("", "")
        rules = "; ".join(rule_notes(finding))

        def decision(kind: str, planned: PlannedStep, key: str, why: str,
                     request: ActionRequest | None = None) -> Decision:
            return Decision(
                at=now, actor=self.actor, decision=kind, node=node, planned=planned,
                reason=why, idempotency_key=key, dry_run=self.dry_run, fingerprint=fp,
                incident=incident, alertname=name, severity=finding.severity.value,
                action=finding.action.value, kind=finding.kind, code=finding.code,
                finding_entity=finding.entity, escalated_from=escalated_from,
                why=why_escalated, rules=rules, request=request)

        result = PolicyResult()
        self._active[fp] = node
        held_before: str | None = None
        any_held = False
        steps = plan if plan is not None else ladder(finding, gpu_level_drain=self.gpu_level_drain)
        for planned in steps:
            key = f"{prefix}/{planned.step.value}"
            if key in self._done:
                if not quiet_holds:
                    result.decisions.append(decision(DECISION_DUPLICATE, planned, key,
                                                     "already requested for this incident"))
                continue
            step_id = _step_id(planned)
            shared = self._shared.get(node, {}).get(step_id) if step_id else None
            if shared is not None:
                other, holders = shared
                holders.add(fp)
                if planned.disrupts_node:
                    self._out_of_service.setdefault(node, set()).add(fp)
                if not quiet_holds:
                    result.decisions.append(decision(
                        DECISION_DUPLICATE, planned, key,
                        f"already requested by another incident ({other})"))
                continue
            why = self._guard(finding, planned, fp, held_before)
            if why is not None:
                any_held = True
                held_before = held_before or why
                if not quiet_holds:
                    logger.info("held back %s on %s: %s", planned.step.value, node, why)
                    result.decisions.append(decision(DECISION_HELD, planned, key, why))
                continue
            request = ActionRequest(
                step=planned.step,
                node=node,
                entity=planned.entity,
                reason=reason,
                idempotency_key=key,
                dry_run=self.dry_run,
                # the rules travel with the step: the engine's submitted, succeeded,
                # probation... records carry them (its audit details hold the attrs)
                attrs={**planned.attrs(), **({"policy_rules": rules} if rules else {})},
            )
            self._done.add(key)
            if planned.disrupts_node:
                self._out_of_service.setdefault(node, set()).add(fp)
            if step_id is not None:
                self._shared.setdefault(node, {})[step_id] = (key, {fp})
            result.decisions.append(decision(DECISION_REQUESTED, planned, key, reason, request))
        if any_held:
            self._held[fp] = finding
            if plan is not None:
                self._held_plan[fp] = (plan, escalation)
        else:
            self._held.pop(fp, None)
            self._held_plan.pop(fp, None)
        return result

    def _guard(
        self, finding: Finding, planned: PlannedStep, fp: str, held_before: str | None
    ) -> str | None:
        """Return why ``planned`` must be held back, or ``None`` to take it."""
        if planned.step == RemediationStep.NOTIFY:
            return None
        if finding.node in self.opt_out_nodes:
            return "node opted out of automatic remediation"
        if finding.kind == PREDICTION_KIND and not self.act_on_predictions:
            return "predicted failure: notify only ([remediation] act_on_predictions = false)"
        if finding.confidence < self.min_confidence:
            return f"confidence {finding.confidence:.2f} below {self.min_confidence:.2f}"
        if held_before is not None:
            return f"an earlier step was held back ({held_before})"
        if planned.disrupts_node:
            holders = self._out_of_service.get(finding.node)
            used = len(self._out_of_service)
            if not holders and used >= self.disruption_limit:
                names = ", ".join(sorted(self._out_of_service))
                return (
                    f"disruption budget exhausted: {used} of "
                    f"{self.disruption_limit} node(s) out of service because of gpuhealth "
                    f"({names})"
                )
            reserve = self.critical_reserve
            if (not holders and finding.severity != Severity.CRITICAL
                    and used >= self.disruption_limit - reserve):
                return (
                    f"disruption budget: {used} of {self.disruption_limit} node(s) out of "
                    f"service because of gpuhealth; the last {reserve} slot(s) are kept for "
                    "critical faults"
                )
        return None

    def resolve(self, *, fingerprint: str, node: str) -> PolicyResult:
        """Account for the alert ``fingerprint`` on ``node`` having resolved.

        Frees the node's budget slot once no other incident holds it, and then
        requests ``resume`` for the node. Later recurrences of the fault are new
        incidents (new idempotency keys). Nothing is recorded for an alert the
        policy never decided on.
        """
        self._held.pop(fingerprint, None)
        if fingerprint not in self._active:
            return PolicyResult()
        now = self.clock()
        prefix, incident = self._prefix(fingerprint)
        result = PolicyResult()
        self._active.pop(fingerprint, None)
        self._incident[fingerprint] = incident + 1
        result.decisions.append(Decision(
            at=now, actor=self.actor, decision=DECISION_RESOLVED, node=NodeName(node),
            planned=None, reason="the finding is gone", idempotency_key=prefix,
            dry_run=self.dry_run, fingerprint=fingerprint, incident=incident))
        self._unshare(node, fingerprint)
        holders = self._out_of_service.get(node)
        if holders is not None and fingerprint in holders:
            holders.discard(fingerprint)
            if not holders:
                del self._out_of_service[node]
                planned = PlannedStep(step=RemediationStep.RESUME, entity=NODE_ENTITY)
                key = f"{prefix}/{RemediationStep.RESUME.value}"
                reason = "gpuhealth: resolved, return to service"
                request = ActionRequest(
                    step=RemediationStep.RESUME,
                    node=NodeName(node),
                    entity=NODE_ENTITY,
                    reason=reason,
                    idempotency_key=key,
                    dry_run=self.dry_run,
                    attrs=planned.attrs(),
                )
                self._done.add(key)
                result.decisions.append(Decision(
                    at=now, actor=self.actor, decision=DECISION_REQUESTED, node=NodeName(node),
                    planned=planned, reason=reason, idempotency_key=key, dry_run=self.dry_run,
                    fingerprint=fingerprint, incident=incident, request=request))
        return result

    def restore(self, records: Iterable[AuditRecord]) -> None:
        """Rebuild idempotency, incident and budget state from an earlier audit log.

        Each policy line is read back into its :class:`Decision` (:meth:`Decision.from_audit`),
        so replaying the same incident after a restart or a fail-over requests nothing twice.
        """
        for record in records:
            d = Decision.from_audit(record)
            if d is not None:
                self._apply(d)

    def _apply(self, d: Decision) -> None:
        """Account for one decision taken earlier (by this or another controller)."""
        fp, node = d.fingerprint, d.node
        if d.decision in (DECISION_REQUESTED, DECISION_DUPLICATE) and d.planned is not None:
            if d.decision == DECISION_REQUESTED:
                self._done.add(d.idempotency_key)
            if d.planned.step != RemediationStep.RESUME:
                self._active[fp] = node
            if d.disrupts_node:
                self._out_of_service.setdefault(node, set()).add(fp)
            step_id = _step_id(d.planned)
            if step_id is not None:
                steps = self._shared.setdefault(node, {})
                steps.setdefault(step_id, (d.idempotency_key, set()))[1].add(fp)
        elif d.decision == DECISION_RESOLVED:
            self._active.pop(fp, None)
            self._incident[fp] = d.incident + 1
            self._unshare(node, fp)
            holders = self._out_of_service.get(node)
            if holders is not None:
                holders.discard(fp)
                if not holders:
                    del self._out_of_service[node]

    def _unshare(self, node: str, fingerprint: str) -> None:
        """Drop ``fingerprint`` from the steps it shares on ``node``; forget steps nobody holds."""
        steps = self._shared.get(node)
        if steps is None:
            return
        for step_id in list(steps):
            holders = steps[step_id][1]
            holders.discard(fingerprint)
            if not holders:
                del steps[step_id]
        if not steps:
            del self._shared[node]


def _step_id(planned: PlannedStep) -> tuple[str, str, str, str] | None:
    """Return what makes a step the same as another incident's step, or ``None`` (never shared).

    Two incidents on one node that both need the node cordoned, or the same GPU
    reset, share one request: the second is recorded as a duplicate.
    """
    if planned.step in (RemediationStep.NOTIFY, RemediationStep.RESUME):
        return None
    return (planned.entity, planned.step.value, planned.scope, planned.when)


def _cut(text: str) -> str:
    return text if len(text) <= REASON_MAX_CHARS else text[: REASON_MAX_CHARS - 1] + "…"
