"""Records passed between pipeline stages.

Every value that crosses a stage boundary is one of these frozen, slotted,
keyword-only dataclasses (``docs/style.md`` C.3.1). Identity fields have the
same names everywhere: ``node`` (host name) and ``entity`` (GPU UUID, or PCI bus
id where the UUID is unknown, NIC or HCA port, or ``"node"``). Times are epoch
seconds, UTC.

The severity and action vocabularies follow ``docs/fault-model.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

NodeName = NewType("NodeName", str)
EntityId = NewType("EntityId", str)

NODE_ENTITY = EntityId("node")
"""The entity of node-wide records (host memory, the kernel, the whole machine)."""


class Severity(StrEnum):
    """How bad a finding is (fault-model.md, "Severity"); compare with :attr:`rank`."""

    INFO = "info"
    WARNING = "warning"
    MAJOR = "major"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        """Order of the severity, 0 (info) to 3 (critical).

        Examples:
            >>> Severity.CRITICAL.rank > Severity.MAJOR.rank
            True
        """
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.MAJOR: 2, Severity.CRITICAL: 3}


class Action(StrEnum):
    """The recommended fix for a finding (fault-model.md, "Recommended action")."""

    NONE = "none"
    RESTART_APP = "restart_app"
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    CHECK_NETWORK = "check_network"
    FIX_CONFIG = "fix_config"
    SERVICE_HARDWARE = "service_hardware"


class RemediationStep(StrEnum):
    """A step the remediation policy takes (fault-model.md): not the same as an :class:`Action`."""

    NOTIFY = "notify"
    CORDON = "cordon"
    DRAIN = "drain"
    MIGRATE = "migrate"
    RESTART = "restart"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"
    HAND_OFF = "hand_off"
    RESUME = "resume"


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """One raw line a record or finding rests on.

    Attributes:
        file: Path of the input as given, or the live source name (``"nvml"``).
        line: 1-based line number in ``file``; ``None`` for live sources.
        text: The line as read, without its trailing newline.
    """

    file: str
    line: int | None
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EntityRef:
    """A monitored thing: one entity on one node."""

    node: NodeName
    entity: EntityId


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One measurement of one catalogued metric on one entity.

    Attributes:
        metric: Name from ``core.catalog`` ending in its base unit, e.g.
            ``gpu_temperature_celsius``. Never NaN: unsupported fields are omitted.
        value: Value in the unit the name states.
        observed_at: When the source took the measurement, epoch seconds; ``None``
            for a snapshot without an absolute time (a pasted ``nvidia-smi -q``).
        node: Cluster node the entity belongs to.
        entity: The device measured; ``"node"`` for node-wide metrics.
        labels: Extra labels with a small, fixed set of values (``link``, ``type``).
        evidence: The raw line the value was read from, for artifacts.
    """

    metric: str
    value: float
    observed_at: float | None
    node: NodeName
    entity: EntityId
    labels: Mapping[str, str] = field(default_factory=dict)
    evidence: Evidence | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Something that happened or a state that was seen: an Xid, a port down.

    Attributes:
        kind: Event family, e.g. ``xid``, ``gpu_lost``, ``recovery_action``,
            ``row_remap``, ``ib_port_state`` (see ``docs/events.md``).
        code: The code inside the family as a string (Xid number, state name,
            counter name, status code).
        node: Node the event belongs to.
        entity: GPU UUID or PCI bus id (``0000:b1:00.0``), port, or ``"node"``.
        observed_at: Epoch seconds; ``None`` when the source has no absolute time.
        message: The human-readable message, continuation lines joined.
        attrs: Parsed details with a small set of keys (``pid``, ``process``,
            ``link``, ``status``...).
        evidence: The raw lines the event was read from.
        source: Where it was read: ``kernel_log``, ``nvml``, ``nvidia_smi_q``...
    """

    kind: str
    code: str
    node: NodeName
    entity: EntityId
    observed_at: float | None
    message: str = ""
    attrs: Mapping[str, str] = field(default_factory=dict)
    evidence: tuple[Evidence, ...] = ()
    source: str = ""


Record = Sample | Event


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One diagnosis about one entity (fault-model.md, "A finding").

    Attributes:
        node: Node the finding is about.
        entity: GPU, port, link or ``"node"``.
        kind: Fault family (``xid``, ``ecc``, ``row_remap``, ``nvlink``...).
        code: Code within the family (Xid number, counter or status name).
        severity: How bad it is.
        action: The recommended fix.
        summary: One line a person understands.
        evidence: Raw lines it rests on, including folded symptoms.
        source: The rule and the document it cites.
        first_seen_at: Epoch seconds of the first occurrence, or ``None``.
        last_seen_at: Epoch seconds of the last occurrence, or ``None``.
        occurrences: How many events the finding groups.
        confidence: 0-1, how sure the rule is (1.0 for catalogued faults).
    """

    node: NodeName
    entity: EntityId
    kind: str
    code: str
    severity: Severity
    action: Action
    summary: str
    evidence: tuple[Evidence, ...]
    source: str
    first_seen_at: float | None = None
    last_seen_at: float | None = None
    occurrences: int = 1
    confidence: float = 1.0

    @property
    def key(self) -> tuple[str, str, str, str]:
        """The identity of the ongoing fault: ``(node, entity, kind, code)``."""
        return (self.node, self.entity, self.kind, self.code)


@dataclass(frozen=True, slots=True, kw_only=True)
class Anomaly:
    """A detector's verdict on one series: the score passed the threshold."""

    detector: str
    node: NodeName
    entity: EntityId
    score: float
    threshold: float
    observed_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class FeatureVector:
    """Features of one entity over a window, as detectors read them."""

    node: NodeName
    entity: EntityId
    values: Mapping[str, float]
    window_end_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """Probability that an entity fails within ``horizon_seconds``, with its top features."""

    node: NodeName
    entity: EntityId
    probability: float
    horizon_seconds: float
    top_features: Mapping[str, float]
    predicted_at: float


class IncidentPhase(StrEnum):
    """Where an incident stands (style.md C.1)."""

    DETECTED = "detected"
    QUARANTINED = "quarantined"
    DRAINED = "drained"
    REMEDIATED = "remediated"
    RESOLVED = "resolved"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True, kw_only=True)
class Incident:
    """Findings grouped into one ongoing fault: the root finding and folded symptoms."""

    incident_id: str
    root: Finding
    phase: IncidentPhase = IncidentPhase.DETECTED
    opened_at: float | None = None


class AlertState(StrEnum):
    """Alert lifecycle state (Prometheus/Alertmanager vocabulary)."""

    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


@dataclass(frozen=True, slots=True, kw_only=True)
class Alert:
    """A notification about a finding.

    Attributes:
        fingerprint: Stable hash of ``labels``.
        labels: ``alertname``, ``severity``, ``node``, ``entity``, ``kind``, ``code``.
        annotations: ``summary``, ``description``, ``action``, ``runbook_url``.
        state: Lifecycle state.
        starts_at: Epoch seconds the alert started firing.
        ends_at: Epoch seconds it resolved, or ``None``.
    """

    fingerprint: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    state: AlertState
    starts_at: float
    ends_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkRef:
    """Work that held a node or GPU when a fault happened (dcgm-exporter #625's question).

    Attributes:
        kind: ``slurm_job`` or ``pod``.
        id: The Slurm job id, or ``<namespace>/<name>``.
        owner: The job's user, or the pod's namespace.
        group: The job's partition, or the pod's priority class (``""`` when unknown).
    """

    kind: str
    id: str
    owner: str = ""
    group: str = ""

    def describe(self) -> str:
        """``slurm job 123 (alice, partition gpu)`` / ``pod ml/train-0 (priority high)``."""
        if self.kind == "slurm_job":
            extra = ", ".join(x for x in (self.owner, f"partition {self.group}"
                                          if self.group else "") if x)
            return f"slurm job {self.id}" + (f" ({extra})" if extra else "")
        extra = f" (priority {self.group})" if self.group else ""
        return f"pod {self.id}{extra}"


class ActionPhase(StrEnum):
    """Phase of one remediation action (style.md C.1)."""

    PENDING = "pending"
    AWAITING_APPROVAL = "awaiting_approval"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionRequest:
    """What remediation asks a scheduler adapter to do; immutable.

    Attributes:
        step: The remediation step.
        node: Target node.
        entity: Target GPU for GPU-level steps, else ``"node"``.
        reason: Why, written onto the node (``gpuhealth: xid-79 ...``).
        idempotency_key: Alert fingerprint plus step; submitting twice does nothing twice.
        dry_run: Record only, change nothing.
        not_before_at: Epoch seconds before which the step must not run (deferred steps).
        attrs: How and when to carry the step out, a small fixed set of keys:
            ``when`` (``now``, ``next_safe_point``, ``idle``), ``scope`` (``node``,
            ``gpu``, ``multi_node_jobs``), ``mode`` (``evict``, ``allow_completion``),
            ``taken_out`` (``yes``: gpuhealth took the node out earlier in this incident;
            an adapter then raises :class:`~core.errors.ReturnedToService` rather than take
            out again a node someone has since returned to service).
    """

    step: RemediationStep
    node: NodeName
    entity: EntityId
    reason: str
    idempotency_key: str
    dry_run: bool = True
    not_before_at: float | None = None
    attrs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionStatus:
    """How far an action got, as the adapter reports it."""

    ref: str
    phase: ActionPhase
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditRecord:
    """One line of the append-only audit log: a decision taken or held back, and why."""

    at: float
    actor: str
    decision: str
    step: RemediationStep | None
    node: NodeName
    entity: EntityId
    reason: str
    idempotency_key: str
    dry_run: bool
    details: Mapping[str, str] = field(default_factory=dict)


OWNER_PREFIX = "gpuhealth:"
"""Every reason gpuhealth writes onto a node starts with this (Slurm ``Reason=``,
Kubernetes annotations): what starts otherwise is a human's or another tool's, and
gpuhealth never undoes it."""

OWNER_KEY_PREFIX = "gpuhealth.io/"
"""Kubernetes labels, taints and annotations gpuhealth owns start with this."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeState:
    """A node as its scheduler shows it now, read before and after each step.

    Attributes:
        node: The node.
        exists: Whether the scheduler knows the node at all.
        schedulable: Whether nobody took it out of service (Slurm: no DRAIN/FAIL flag and
            not DOWN by a person; Kubernetes: not ``spec.unschedulable``). A node the
            scheduler itself marked DOWN or NotReady counts as schedulable here: gpuhealth
            still takes it out, so it does not return to service by itself.
        reason: Why it is out of service, as the scheduler shows it (Slurm ``Reason=``;
            Kubernetes annotation ``gpuhealth.io/reason``, or ``""``).
        owned: Whether gpuhealth took it out of service: the reason starts with
            :data:`OWNER_PREFIX` (Slurm) or the node carries gpuhealth's cordon
            annotation (Kubernetes). ``False`` when schedulable.
        opted_out: The node opts out of automatic remediation (Slurm feature
            ``gpuhealth-opt-out``, Kubernetes label ``gpuhealth.io/opt-out=true``).
        running: Jobs (Slurm) or non-DaemonSet pods (Kubernetes) running on it now (0 when
            read with ``workload=False``).
        boot_id: Changes when the node reboots (Kubernetes ``nodeInfo.bootID``; Slurm
            ``BootTime``); ``""`` if unknown.
        state: The scheduler's own state words (``"DRAIN"``, ``"IDLE+DRAIN"``, ``"Ready"``).
    """

    node: NodeName
    exists: bool = True
    schedulable: bool = True
    reason: str = ""
    owned: bool = False
    opted_out: bool = False
    running: int = 0
    boot_id: str = ""
    state: str = ""
