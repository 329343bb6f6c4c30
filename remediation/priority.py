"""Priority-aware recovery: critical work recovers first when capacity is short (#16 item 10).

Three parts, each following the scheduler's own priorities (Slurm job priority and QOS,
Kubernetes ``spec.priority`` and ``priorityClassName``):

* **What held the node** (:class:`WorkItem`): when an incident opens, the engine asks the
  adapter (:class:`PriorityScheduler`) for the jobs or pods on the node, with their
  priority, priority class, GPUs and start time, and keeps the answer with the incident
  (:meth:`~remediation.actions.ActionStore.set_work`). The weekly report counts them
  (interrupted jobs, GPU-hours of the jobs hit) and splits MTTR by priority class.
* **Order.** Incidents whose work has the higher priority take their steps first within a
  tick (so they get the rate limit's tokens first), and within one drain the adapters
  requeue (Slurm) or evict (Kubernetes) the highest-priority work first, so it is back in
  the scheduler's queue, and placed, before the rest.
* **Preemption** (:class:`PreemptionPolicy`, off by default): when a critical job's
  recovery still waits for capacity ``wait_seconds`` after its node was drained, a
  running low-priority job elsewhere is preempted (Slurm: requeued; Kubernetes: evicted)
  to make room for it, within a preemption budget and the disruption budget, audited
  before it is done, and only recorded in a dry run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from core.records import EntityId, NodeName

NO_CLASS = "none"
"""Priority class of an incident whose node held no known work (the report's label)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkItem:
    """One job or pod that held a node (or GPU), with what its scheduler knows about it.

    Attributes:
        kind: ``slurm_job`` or ``pod``.
        id: The Slurm job id, or ``<namespace>/<name>``.
        node: The node it runs on (``""`` while pending).
        gpus: GPUs it holds, its whole allocation (every node of a multi-node job: a
            fault on one node interrupts all of it); 0 when not known.
        started_at: When it started, epoch seconds (``None`` when not known).
        priority: Scheduling priority: Slurm's job priority, a pod's ``spec.priority``
            (higher runs first; 0 when not known).
        priority_class: Slurm QOS, or the pod's ``priorityClassName`` (``""``: none).
        owner: The job's user, or the pod's namespace.
        controller: The uid of a pod's controller (its replacement after an eviction has
            the same); ``""`` for Slurm, where a requeued job keeps its id.
        state: ``running`` or ``pending``.
    """

    kind: str
    id: str
    node: str = ""
    gpus: int = 0
    started_at: float | None = None
    priority: int = 0
    priority_class: str = ""
    owner: str = ""
    controller: str = ""
    state: str = "running"

    def gpu_hours(self, at: float) -> float | None:
        """GPU-hours it had run by ``at``: GPUs x (``at`` - start) / 3600; ``None`` unknown.

        Examples:
            >>> WorkItem(kind="slurm_job", id="1", gpus=4, started_at=0.0).gpu_hours(7200.0)
            8.0
        """
        if self.started_at is None or self.gpus <= 0:
            return None
        return self.gpus * max(0.0, at - self.started_at) / 3600.0

    def describe(self) -> str:
        """``slurm job 12 (priority 900, qos high, 4 GPUs)`` / ``pod ml/a (priority ...)``."""
        what = f"slurm job {self.id}" if self.kind == "slurm_job" else f"pod {self.id}"
        label = "qos" if self.kind == "slurm_job" else "class"
        extra = [f"priority {self.priority}"]
        if self.priority_class:
            extra.append(f"{label} {self.priority_class}")
        if self.gpus:
            extra.append(f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}")
        where = f" on {self.node}" if self.node else ""
        return f"{what}{where} ({', '.join(extra)})"


def work_to_json(items: Iterable[WorkItem]) -> str:
    """Serialize work items as a JSON list (sorted keys), the stored and reported form."""
    return json.dumps([asdict(w) for w in items], sort_keys=True)


def work_from_json(text: str) -> list[WorkItem]:
    """Parse :func:`work_to_json`'s output; unknown keys are ignored, bad rows skipped.

    Examples:
        >>> work_from_json(work_to_json([WorkItem(kind="pod", id="a/b", gpus=1)]))[0].gpus
        1
        >>> work_from_json("not json")
        []
    """
    try:
        rows = json.loads(text)
    except ValueError:
        return []
    out: list[WorkItem] = []
    names = set(WorkItem.__dataclass_fields__)
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict) or "kind" not in row or "id" not in row:
            continue
        try:
            out.append(WorkItem(**{k: v for k, v in row.items() if k in names}))
        except TypeError:
            continue
    return out


def top_priority(items: Sequence[WorkItem]) -> int | None:
    """The highest priority among ``items`` (``None`` when there are none)."""
    return max((w.priority for w in items), default=None)


def priority_class_of(items: Sequence[WorkItem]) -> str:
    """The class of the highest-priority item (``none`` without work, ``default`` unnamed).

    This is the class an incident counts under in the report's MTTR by priority class.

    Examples:
        >>> priority_class_of([WorkItem(kind="pod", id="a", priority=10, priority_class="low"),
        ...                    WorkItem(kind="pod", id="b", priority=1000,
        ...                             priority_class="critical")])
        'critical'
        >>> priority_class_of([])
        'none'
    """
    if not items:
        return NO_CLASS
    top = max(items, key=lambda w: (w.priority, w.priority_class))
    return top.priority_class or "default"


def by_priority(items: Iterable[WorkItem]) -> list[WorkItem]:
    """``items`` highest priority first (ties: the earlier started first, then by id)."""
    return sorted(items, key=lambda w: (-w.priority, w.started_at if w.started_at is not None
                                        else math.inf, w.id))


@runtime_checkable
class PriorityScheduler(Protocol):
    """A scheduler adapter that shows priorities and can preempt (Slurm, Kubernetes).

    Every method may raise :class:`~core.errors.TemporaryError` when the scheduler
    cannot be reached, and :class:`~core.errors.PermanentError` when it refuses.
    """

    async def work_detail(self, node: NodeName,
                          entity: EntityId | None = None) -> list[WorkItem]:
        """The jobs or pods running on ``node`` (or its GPU ``entity``) now."""
        ...

    async def running_work(self) -> list[WorkItem]:
        """Every job or pod holding GPUs in the cluster now (preemption candidates)."""
        ...

    async def pending_of(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        """Of ``items`` (displaced work), those whose recovery waits for capacity now.

        Slurm: the job (same id) is pending; Kubernetes: a pod of the same controller is
        pending. Work that runs again, or is gone, is not returned.
        """
        ...

    async def preempt(self, item: WorkItem, *, reason: str) -> str:
        """Preempt ``item`` (Slurm: requeue; Kubernetes: evict); returns what was done."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PreemptionPolicy:
    """When gpuhealth may preempt low-priority work to place a critical job's recovery.

    Off by default: a site turns it on (``[remediation.preemption] enabled = true``)
    only where preempting is allowed. Work is critical when its priority is at least
    ``critical_priority`` or its class is one of ``critical_classes``; a victim must be
    running, not critical, below the critical work's priority, at most
    ``max_victim_priority`` (when set), not of a ``protected_classes`` class, and hold
    at least the GPUs the critical work needs.

    Attributes:
        enabled: Preempt at all (default ``False``).
        critical_priority: Priority from which work is critical (``None``: by class only).
        critical_classes: Slurm QOS names / PriorityClass names of critical work.
        max_victim_priority: Highest priority a victim may have (``None``: any lower one).
        protected_classes: Classes never preempted (``system-cluster-critical`` ...).
        wait_seconds: How long a critical job's recovery waits for capacity after its
            node was drained before a preemption is considered, >= 0.
        max_preemptions: Preemptions allowed per ``window_seconds`` (the preemption
            budget), >= 1.
        window_seconds: The preemption budget's window, > 0.

    Raises:
        ValueError: A value out of range, or enabled with no way to tell critical work.
    """

    enabled: bool = False
    critical_priority: int | None = None
    critical_classes: tuple[str, ...] = ()
    max_victim_priority: int | None = None
    protected_classes: tuple[str, ...] = ("system-cluster-critical", "system-node-critical")
    wait_seconds: float = 60.0
    max_preemptions: int = 1
    window_seconds: float = 3600.0

    def __post_init__(self) -> None:
        if not (self.wait_seconds >= 0 and math.isfinite(self.wait_seconds)):
            raise ValueError(f"wait_seconds must be >= 0, got {self.wait_seconds}")
        if self.max_preemptions < 1:
            raise ValueError(f"max_preemptions must be >= 1, got {self.max_preemptions}")
        if not (self.window_seconds > 0 and math.isfinite(self.window_seconds)):
            raise ValueError(f"window_seconds must be > 0, got {self.window_seconds}")
        if self.enabled and self.critical_priority is None and not self.critical_classes:
            raise ValueError("preemption enabled without critical_priority or "
                             "critical_classes: no work could ever be critical")

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> PreemptionPolicy:
        """Build from the ``[remediation.preemption]`` table (lists become tuples).

        Raises:
            ValueError: An unknown key or a value out of range.
        """
        opts = dict(options or {})
        unknown = set(opts) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} (known: "
                             f"{', '.join(sorted(cls.__dataclass_fields__))})")
        for key in ("critical_classes", "protected_classes"):
            if key in opts:
                opts[key] = tuple(str(v) for v in opts[key])
        return cls(**opts)

    def is_critical(self, item: WorkItem) -> bool:
        """Whether ``item`` is critical work (its recovery may preempt others)."""
        if item.priority_class and item.priority_class in self.critical_classes:
            return True
        return self.critical_priority is not None and item.priority >= self.critical_priority

    def victims(self, critical: WorkItem, running: Iterable[WorkItem], *,
                avoid_nodes: frozenset[str] = frozenset()) -> list[WorkItem]:
        """Running work that may be preempted for ``critical``, the best victim first.

        Best: the lowest priority, then the one that started last (the least work lost),
        then the fewest GPUs that are enough.
        """
        need = max(1, critical.gpus)
        out = [w for w in running
               if w.state == "running" and w.id != critical.id and not self.is_critical(w)
               and w.priority < critical.priority
               and (self.max_victim_priority is None or w.priority <= self.max_victim_priority)
               and w.priority_class not in self.protected_classes
               and w.node not in avoid_nodes and w.gpus >= need]
        return sorted(out, key=lambda w: (w.priority, -(w.started_at or 0.0), w.gpus, w.id))


HISTORY_WORK = "work"
"""``IncidentRecord.attrs`` key of the work an incident hit (:func:`work_to_json`)."""
HISTORY_PRIORITY_CLASS = "priority_class"
"""``IncidentRecord.attrs`` key of the incident's priority class (:func:`priority_class_of`)."""


def history_attrs(work_json: str | None) -> dict[str, str]:
    """The incident-history ``attrs`` for an incident's stored work (the report reads them).

    Args:
        work_json: What :meth:`~remediation.actions.ActionStore.work` returned for the
            incident (``None``: the scheduler was not asked, nothing is written).

    Returns:
        ``{"work": <JSON list>, "priority_class": <class>}``, or ``{}``.

    Examples:
        >>> history_attrs(work_to_json([WorkItem(kind="pod", id="a/b", priority_class="hi")]))
        ... # doctest: +ELLIPSIS
        {'work': '[{"controller": "", ...}]', 'priority_class': 'hi'}
        >>> history_attrs(None)
        {}
    """
    if work_json is None:
        return {}
    items = work_from_json(work_json)
    return {HISTORY_WORK: work_to_json(items), HISTORY_PRIORITY_CLASS: priority_class_of(items)}
