"""Drills: a labelled synthetic fault sent through the real path, every stage timed.

A drill injects one fault on one node, marked as a drill, and times each stage of
its handling from the moment it was injected: ``detect`` (the fault model found it),
``alert`` (the alert fired), ``cordon``, ``drain``, ``reboot`` or ``reset_gpu`` (the
fix), ``validate`` (the node's validation passed) and ``resume`` (back in service).
:func:`judge` compares each with its service-level objective and fails a drill when
a stage missed its SLO or never happened.

The faults (:data:`FAULTS`) come in as the service reads real ones: an Xid line read
from a kernel-log file by :class:`~collectors.kernel_log.KernelLogCollector`, or the
NVLink state readings the NVML collector makes. The marker travels with the fault:

* the kernel-log line ends with ``gpuhealth-drill=<id>`` (it is in the evidence);
* the alerts carry the label ``drill=<id>`` (their fingerprints differ from a real
  fault's on the same GPU, so a drill never merges with one);
* every step given to the scheduler adapter carries ``attrs["drill"]`` and a reason
  ``gpuhealth: drill <id>: ...`` (what Slurm's ``Reason=`` or the node's annotation
  shows); :func:`drill_adapter` wraps the adapter to do that, and turns a hand-off to
  hardware service into a no-op recorded as a drill (:attr:`DrillAdapter.handed_off`):
  a drill never files a hardware ticket;
* every audit record has ``details["drill"]`` (:class:`DrillAuditLog`);
* the incident history row has ``attrs["drill"]`` (:func:`history_attrs`), so the weekly
  report counts it as a drill, never as a failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from collectors.kernel_log import KernelLogCollector
from core import drill as core_drill
from core.errors import GpuHealthError, PermanentError
from core.records import (
    ActionPhase,
    ActionRequest,
    ActionStatus,
    Alert,
    AlertState,
    AuditRecord,
    EntityId,
    Finding,
    NodeName,
    Record,
    RemediationStep,
    Sample,
)
from remediation.actions import StoredAction
from remediation.audit import AuditLog
from remediation.policy import SCOPE_GPU, PolicyResult

logger = logging.getLogger(__name__)

DRILL = core_drill.DRILL
"""The marker's key: alert label, step attribute, audit detail, history attribute."""

MARK = core_drill.MARK
"""Written into the injected kernel-log line as ``gpuhealth-drill=<id>``."""

OWNER_PREFIX = "gpuhealth:"
"""What a reason gpuhealth writes on a node starts with (Slurm ``Reason=``)."""

STAGES = ("detect", "alert", "cordon", "drain", "reboot", "reset_gpu", "validate", "resume")
"""The stages of a drill, in the order they happen."""

SLO_KEYS = (*STAGES, "total")
"""Stages an SLO may be set for (``total``: injection to the last stage)."""

_STEP_STAGES = {RemediationStep.CORDON: "cordon", RemediationStep.DRAIN: "drain",
                RemediationStep.REBOOT: "reboot", RemediationStep.RESET_GPU: "reset_gpu",
                RemediationStep.RESUME: "resume"}

_ID = re.compile(rf"^{core_drill.ID_PATTERN}$")

OK, MISSED, NEVER, SKIPPED = "ok", "missed", "never", "skipped"
"""A stage's verdict: within its SLO (or none set), over it, did not happen, not expected."""


def new_drill_id(now: float | None = None) -> str:
    """Return a fresh drill id: ``d<UTC yyyymmddHHMMSS>-<4 hex>``.

    Examples:
        >>> new_drill_id(0.0).startswith("d19700101000000-")
        True
    """
    stamp = time.strftime("%Y%m%d%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"d{stamp}-{secrets.token_hex(2)}"


def check_drill_id(drill_id: str) -> str:
    """Return ``drill_id`` if it can be a label value and a folder name.

    Raises:
        ValueError: It cannot (letters, digits, ``_.-``; 63 at most).
    """
    if not _ID.match(drill_id):
        raise ValueError(f"drill id {drill_id!r}: use letters, digits and _.- (63 at most)")
    return drill_id


@dataclass(frozen=True, slots=True, kw_only=True)
class DrillFault:
    """One kind of synthetic fault a drill can inject.

    Attributes:
        name: What ``--kind`` takes (``xid79``).
        kind: The finding's kind (``xid``, ``nvlink``).
        code: The finding's code (``79``), or ``""`` for any code of ``kind``.
        line: The kernel-log line (``{bus}``, ``{mark}`` filled in), or ``""``.
        polls: NVLink readings given, one poll per evaluation (NVML faults only); the
            GPU is named by its PCI bus id, as the kernel-log faults name it.
        summary: One line for ``--help`` and the docs.
    """

    name: str
    kind: str
    code: str
    line: str = ""
    polls: int = 0
    summary: str = ""

    def inject(self, *, node: str, drill_id: str, folder: Path, bus: str,
               now: float) -> list[list[Record]]:
        """Return the records of the fault, one batch per evaluation.

        A kernel-log fault is written to ``folder/kern.log`` and read back by the real
        kernel-log collector (its parser, its evidence); an NVML fault is the readings
        the NVML collector makes of a GPU with link 0 down, repeated for the debounce.
        """
        if self.line:
            folder.mkdir(parents=True, exist_ok=True)
            log = folder / "kern.log"
            log.write_text(self.line.format(bus=bus, mark=f"{MARK}={drill_id}") + "\n",
                           encoding="utf-8")
            collector = KernelLogCollector(node=node, path=str(log), source="file",
                                           from_start=True)
            try:
                event = next(iter(collector.stream()))
            finally:
                collector.close()
            return [[event]]
        entity = EntityId(bus.lower() if "." in bus else f"{bus.lower()}.0")  # as Xid lines
        return [[Sample(metric="gpu_nvlink_state", value=0.0 if link == 0 else 1.0,
                        observed_at=now + i, node=NodeName(node), entity=entity,
                        labels={"link": str(link), DRILL: drill_id})
                 for link in range(4)] for i in range(self.polls)]

    def matches(self, finding: Finding, node: str) -> bool:
        """Whether ``finding`` is this fault on ``node``."""
        return (finding.node == node and finding.kind == self.kind
                and (not self.code or finding.code == self.code))


_XID = "NVRM: Xid (PCI:{bus}): "

FAULTS: Mapping[str, DrillFault] = {
    "xid79": DrillFault(
        name="xid79", kind="xid", code="79",
        line=_XID + "79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus. {mark}",
        summary="GPU fallen off the bus (cordon, drain, reboot)"),
    "xid48": DrillFault(
        name="xid48", kind="xid", code="48",
        line=_XID + "48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error "
                    "(DBE) has been detected on GPU in the framebuffer at partition 0, "
                    "subpartition 0. {mark}",
        summary="double-bit ECC error (drain the GPU's work, reset the GPU)"),
    "nvlink": DrillFault(
        name="nvlink", kind="nvlink", code="", polls=3,
        summary="NVLink 0 down on a GPU, as NVML reads it (needs nvlink = \"expected\")"),
}
"""The faults ``gpuhealth drill --kind`` injects."""


def parse_slos(values: Iterable[str]) -> dict[str, float]:
    """Parse ``stage=duration`` pairs (``detect=5s``, ``resume=2m``, ``total=300``).

    Raises:
        ValueError: An unknown stage or a bad duration (names it).

    Examples:
        >>> parse_slos(["detect=5s", "resume=2m"])
        {'detect': 5.0, 'resume': 120.0}
    """
    out: dict[str, float] = {}
    for value in values:
        stage, sep, text = value.partition("=")
        stage = stage.strip()
        if not sep:
            raise ValueError(f"--slo {value!r}: write stage=duration, e.g. detect=5s")
        out[check_stage(stage)] = duration_seconds(text)
    return out


def check_stage(stage: str) -> str:
    """Return ``stage`` (``reset`` is ``reset_gpu``) if an SLO may be set for it.

    Raises:
        ValueError: Not a stage (names the known ones).
    """
    stage = "reset_gpu" if stage == "reset" else stage
    if stage not in SLO_KEYS:
        raise ValueError(f"unknown drill stage {stage!r} (known: {', '.join(SLO_KEYS)})")
    return stage


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration_seconds(text: str | float) -> float:
    """Return seconds of ``"250ms"``, ``"5s"``, ``"2m"``, ``"1h"`` or a number.

    Raises:
        ValueError: Not a duration >= 0.

    Examples:
        >>> duration_seconds("250ms"), duration_seconds(3)
        (0.25, 3.0)
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        match = _DURATION.match(str(text))
        if match is None:
            raise ValueError(f"not a duration: {text!r} (write e.g. 5s, 250ms, 2m)")
        seconds = float(match[1]) * _UNITS[match[2]]
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be >= 0 s, got {text!r}")
    return seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class StageResult:
    """One stage of a drill against its SLO.

    Attributes:
        stage: One of :data:`SLO_KEYS`.
        seconds: From injection to the stage, seconds; ``None``: it did not happen.
        slo_seconds: The SLO, seconds; ``None``: none set.
        status: :data:`OK`, :data:`MISSED`, :data:`NEVER` or :data:`SKIPPED`.
        note: Why it never happened or was skipped, when known.
    """

    stage: str
    seconds: float | None
    slo_seconds: float | None
    status: str
    note: str = ""

    @property
    def ok(self) -> bool:
        """Whether the stage does not fail the drill."""
        return self.status in (OK, SKIPPED)


@dataclass(slots=True, kw_only=True)
class DrillTimeline:
    """When each stage of one drill happened, from what the pipeline produced.

    Feed it every evaluation's findings and alerts (:meth:`saw_findings`,
    :meth:`saw_alerts`), the audit records (:meth:`saw_audit`) and, at the end, the
    drill's actions (:meth:`saw_actions`); :func:`judge` then compares it with the SLOs.

    Attributes:
        drill_id: The drill.
        node: The drilled node.
        fault: What was injected.
        injected_at: When, epoch seconds (every stage is timed from it).
        validating: Whether a validator is configured (``validate`` is expected).
        at: Stage -> when it happened, epoch seconds.
        expected: Stages the remediation plan implies (steps requested or held).
        problems: Why the drill cannot pass, beyond the times (a step failed or was
            held back, the node would have been handed to hardware service).
        fingerprints: The drill's alert fingerprints.
    """

    drill_id: str
    node: str
    fault: DrillFault
    injected_at: float
    validating: bool = False
    at: dict[str, float] = field(default_factory=dict)
    expected: set[str] = field(default_factory=lambda: {"detect", "alert"})
    problems: list[str] = field(default_factory=list)
    fingerprints: set[str] = field(default_factory=set)
    notes: dict[str, str] = field(default_factory=dict)

    def _mark(self, stage: str, at: float) -> None:
        if stage not in self.at:
            self.at[stage] = max(at, self.injected_at)

    def saw_findings(self, findings: Iterable[Finding], *, at: float) -> None:
        """Take one evaluation's findings (``detect`` is the first that is the fault)."""
        if "detect" not in self.at and any(self.fault.matches(f, self.node) for f in findings):
            self._mark("detect", at)

    def saw_alerts(self, alerts: Iterable[Alert], *, at: float) -> None:
        """Take one evaluation's changed alerts (``alert``: the drill's first firing)."""
        for alert in alerts:
            if alert.labels.get(DRILL) != self.drill_id:
                continue
            self.fingerprints.add(alert.fingerprint)
            if alert.state == AlertState.FIRING and alert.labels.get("node") == self.node:
                self._mark("alert", at)

    def saw_audit(self, records: Iterable[AuditRecord]) -> None:
        """Take audit records: steps requested or held, validation, failures."""
        for r in records:
            stage = _STEP_STAGES.get(r.step) if r.step is not None else None
            if r.decision in ("requested", "held") and stage is not None:
                self.expected.add(stage)
                if stage in ("reboot", "reset_gpu") and self.validating:
                    self.expected.add("validate")
                if stage in ("cordon", "drain") and r.details.get("scope") != SCOPE_GPU:
                    self.expected.add("resume")  # a node taken out comes back
            if r.decision == "held" and r.step is not None:
                self._problem(f"{r.step.value} held back: {r.reason}")
            elif r.decision == "succeeded" and stage is not None:
                self._mark(stage, r.at)
            elif r.decision == "validated":
                self._mark("validate", r.at)
            elif r.decision == "validation_failed":
                why = " ".join(r.reason.split())
                self.notes["validate"] = "failed"
                self._problem(why if why.startswith("validation failed") else
                              f"validation failed: {why}")
            elif r.decision == "awaiting_approval" and r.step is not None:
                self._problem(f"{r.step.value} waits for a human's approval: {r.reason}")
            elif r.decision in ("failed", "cancelled") and r.step is not None:
                self._problem(f"{r.step.value} {r.decision}: {r.reason}")
            if r.step == RemediationStep.HAND_OFF and r.decision == "requested":
                self._problem("the node would have been handed to hardware service "
                              "(not done: a drill)")

    def _problem(self, text: str) -> None:
        text = " ".join(text.split())[:500]
        if text not in self.problems:
            self.problems.append(text)

    def saw_actions(self, actions: Iterable[StoredAction]) -> None:
        """Take the drill's actions (their finish times for steps the audit did not time)."""
        for a in actions:
            stage = _STEP_STAGES.get(a.step)
            if stage is None:
                continue
            self.expected.add(stage)
            if a.phase == ActionPhase.SUCCEEDED and a.finished_at is not None:
                self._mark(stage, a.finished_at)
            elif a.phase in (ActionPhase.FAILED, ActionPhase.CANCELLED):
                self._problem(f"{a.step.value} {a.phase.value}: {a.message}")

    def finished(self) -> bool:
        """Whether every expected stage happened, or the drill cannot pass any more."""
        if self.problems:
            return True
        if "alert" not in self.at:
            return False
        return self.expected <= set(self.at)


def judge(timeline: DrillTimeline, slos: Mapping[str, float]) -> list[StageResult]:
    """Compare each stage of ``timeline`` with its SLO (:data:`SLO_KEYS`, in order).

    A stage that is not in the remediation plan is :data:`SKIPPED`; one that is but did
    not happen is :data:`NEVER`; one over its SLO is :data:`MISSED`.
    """
    out: list[StageResult] = []
    expected = timeline.expected
    for stage in STAGES:
        slo = slos.get(stage)
        at = timeline.at.get(stage)
        if at is None:
            if stage in expected:
                out.append(StageResult(stage=stage, seconds=None, slo_seconds=slo,
                                       status=NEVER, note=timeline.notes.get(stage, "")))
            else:
                out.append(StageResult(stage=stage, seconds=None, slo_seconds=slo,
                                       status=SKIPPED, note=_skip_note(stage, timeline)))
            continue
        seconds = at - timeline.injected_at
        out.append(StageResult(stage=stage, seconds=seconds, slo_seconds=slo,
                               status=MISSED if slo is not None and seconds > slo else OK))
    done = [r for r in out if r.seconds is not None]
    whole = max((r.seconds for r in done if r.seconds is not None), default=None)
    complete = all(r.status != NEVER for r in out)
    slo = slos.get("total")
    status = (NEVER if not complete or whole is None
              else MISSED if slo is not None and whole > slo else OK)
    out.append(StageResult(stage="total", seconds=whole if complete else None,
                           slo_seconds=slo, status=status))
    return out


def _skip_note(stage: str, timeline: DrillTimeline) -> str:
    if stage == "validate":
        return "no [remediation.validation]" if not timeline.validating else "no fix step"
    return "not in this fault's plan"


def passed(results: Sequence[StageResult], timeline: DrillTimeline) -> bool:
    """Whether the drill passed: every stage ok and nothing went wrong on the way."""
    return not timeline.problems and all(r.ok for r in results)


def render_table(results: Sequence[StageResult]) -> str:
    """The per-stage table ``gpuhealth drill`` prints (stage, seconds, SLO, ok).

    Examples:
        >>> print(render_table([StageResult(stage="detect", seconds=0.5, slo_seconds=5.0,
        ...                                 status=OK)]))
        stage       seconds       slo  ok
        detect        0.500     5.000  ok
    """
    lines = [f"{'stage':<9} {'seconds':>9} {'slo':>9}  ok"]
    for r in results:
        seconds = f"{r.seconds:9.3f}" if r.seconds is not None else f"{'-':>9}"
        slo = f"{r.slo_seconds:9.3f}" if r.slo_seconds is not None else f"{'-':>9}"
        verdict = r.status if r.status != OK else "ok"
        if r.note:
            verdict += f" ({r.note})"
        lines.append(f"{r.stage:<9} {seconds} {slo}  {verdict}")
    return "\n".join(lines)


def results_to_json(results: Sequence[StageResult]) -> list[dict[str, Any]]:
    """The stages as JSON rows (``stage``, ``seconds``, ``slo_seconds``, ``status``, ``note``)."""
    return [{"stage": r.stage, "seconds": r.seconds, "slo_seconds": r.slo_seconds,
             "status": r.status, "note": r.note} for r in results]


def history_attrs(timeline: DrillTimeline, results: Sequence[StageResult], *,
                  live: bool) -> dict[str, str]:
    """The incident history attributes of a drill (the report counts it as a drill)."""
    return {
        DRILL: timeline.drill_id,
        "drill_kind": timeline.fault.name,
        "drill_mode": "live" if live else "dry-run",
        "drill_result": "passed" if passed(results, timeline) else "failed",
        "drill_stages": json.dumps({r.stage: r.seconds for r in results}, sort_keys=True),
        "drill_missed": ",".join(r.stage for r in results if not r.ok),
        "drill_problems": "; ".join(timeline.problems)[:1000],
    }


def drill_reason(reason: str, drill_id: str) -> str:
    """The reason a drilled step writes on the node: ``gpuhealth: drill <id>: ...``.

    Examples:
        >>> drill_reason("gpuhealth: GpuXid79 critical", "d1")
        'gpuhealth: drill d1: GpuXid79 critical'
    """
    text = reason[len(OWNER_PREFIX):].strip() if reason.startswith(OWNER_PREFIX) else reason
    marker = f"drill {drill_id}:"
    if text.startswith(marker):
        return reason
    return f"{OWNER_PREFIX} {marker} {text}"


class DrillAuditLog(AuditLog):
    """A JSONL audit log whose every record carries ``details["drill"] = <id>``.

    Args:
        path: The drill's own audit log (a drill's incidents never enter the service's
            trail, whose open incidents hold budget slots after a restart).
        drill_id: The drill.
    """

    def __init__(self, *, path: str, drill_id: str) -> None:
        super().__init__(path=path)
        self.drill_id = drill_id

    def extend(self, records: Iterable[AuditRecord]) -> None:
        """Append ``records``, each marked with the drill (see :meth:`AuditLog.extend`)."""
        super().extend(replace(r, details={**r.details, DRILL: self.drill_id})
                       for r in records)


class DrillAdapter:
    """Marks every step of a drill and never hands a node to hardware service.

    Built by :func:`drill_adapter` as a subclass that also offers exactly what the
    wrapped adapter offers (reading nodes, work, priorities...), so the engine's
    ownership checks and work attribution run as they do without a drill.

    Attributes:
        inner: The wrapped adapter (``slurm``, ``kubernetes``, ``dry_run``...).
        drill_id: The drill.
        handed_off: The hand-offs not made (they are recorded here and succeed).
    """

    name: str

    def __init__(self, inner: Any, drill_id: str) -> None:
        self.inner = inner
        self.drill_id = drill_id
        self.name = str(getattr(inner, "name", "adapter"))
        self.handed_off: list[ActionRequest] = []

    async def submit(self, request: ActionRequest) -> str:
        """Submit ``request`` marked as the drill's; a hand-off is recorded, not made."""
        marked = replace(request, reason=drill_reason(request.reason, self.drill_id),
                         attrs={**request.attrs, DRILL: self.drill_id})
        if request.step == RemediationStep.HAND_OFF:
            if all(r.idempotency_key != request.idempotency_key for r in self.handed_off):
                self.handed_off.append(marked)
                logger.warning("drill %s: hand-off of %s to hardware service not made "
                               "(a drill): %s", self.drill_id, request.node, request.reason)
            return f"drill-hand-off:{request.idempotency_key}"
        ref: str = await self.inner.submit(marked)
        return ref

    async def status(self, ref: str) -> ActionStatus:
        """The wrapped adapter's status; a drill's hand-off succeeded (nothing was done)."""
        if ref.startswith("drill-hand-off:"):
            if not any(f"drill-hand-off:{r.idempotency_key}" == ref for r in self.handed_off):
                raise PermanentError(f"unknown drill hand-off {ref!r}")
            return ActionStatus(ref=ref, phase=ActionPhase.SUCCEEDED,
                                message="drill: not handed to hardware service")
        status: ActionStatus = await self.inner.status(ref)
        return status


def _delegate_method(name: str) -> Any:
    def method(self: DrillAdapter, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)
    method.__name__ = name
    return method


def _delegate_value(name: str) -> property:
    return property(lambda self: getattr(self.inner, name))


def drill_adapter(inner: Any, drill_id: str, *,
                  base: type[DrillAdapter] = DrillAdapter) -> DrillAdapter:
    """Wrap ``inner`` for drill ``drill_id`` (see :class:`DrillAdapter`).

    The wrapper's class has every public attribute of ``inner`` (methods delegate,
    values read through), so ``isinstance`` with the adapter Protocols answers as for
    ``inner`` (the check reads the class, not ``__getattr__``).
    """
    own = {"submit", "status", "name", "inner", "drill_id", "handed_off"}
    members: dict[str, Any] = {}
    for attr in dir(inner):
        if attr.startswith("_") or attr in own:
            continue
        value = getattr(inner, attr, None)
        members[attr] = _delegate_method(attr) if callable(value) else _delegate_value(attr)
    cls = type(f"Drill{type(inner).__name__}", (base,), members)
    adapter: DrillAdapter = cls(inner, drill_id)
    return adapter


def held_out_of_service(store: Any, held: dict[str, str]) -> None:
    """Add to ``held`` the nodes ``store``'s open incidents took out of service, by incident.

    ``store`` is an :class:`~remediation.actions.ActionStore` (the service's or a drill's);
    a node already in ``held`` keeps its first incident.
    """
    from remediation.actions import INCIDENT_OPEN, INCIDENT_PROBATION

    for inc in store.incidents(states=(INCIDENT_OPEN, INCIDENT_PROBATION)):
        if inc.out_of_service_at is not None:
            held.setdefault(str(inc.node), inc.incident)


async def refusal(node: str, *, held: Mapping[str, str], disruption_limit: int,
                  adapter: Any = None) -> str:
    """Return why drilling ``node`` is refused now, or ``""``.

    Refused when gpuhealth holds the node out of service already (``held``: node ->
    incident), when the disruption budget (``disruption_limit`` nodes) is full, and, with
    a live ``adapter`` that can show nodes (:class:`~core.protocols.NodeInspector`), when
    the scheduler does not know the node, shows it opted out, or shows it out of service
    (by gpuhealth or by a human: a drill never undoes what a person did).
    """
    from core.protocols import NodeInspector
    from core.records import NodeName

    if node in held:
        return (f"node {node} is already out of service because of gpuhealth "
                f"(incident {held[node]}): no drill")
    if len(held) >= disruption_limit:
        return (f"disruption budget: {len(held)} of {disruption_limit} node(s) already out "
                f"of service because of gpuhealth ({', '.join(sorted(held))}): no drill")
    if adapter is not None and isinstance(adapter, NodeInspector):
        try:
            state = await adapter.node_state(NodeName(node), workload=False)
        except GpuHealthError as exc:
            return f"the scheduler cannot show node {node} ({exc}): no drill"
        if not state.exists:
            return f"node {node} is not known to the scheduler: no drill"
        if state.opted_out:
            return f"node {node} carries the opt-out label: no drill"
        if not state.schedulable:
            who = "gpuhealth" if state.owned else "a human"
            return (f"node {node} is out of service already ({who}: "
                    f"{state.reason or state.state}): no drill")
    return ""


def in_flight(store: Any) -> bool:
    """Whether ``store`` has a step pending or running."""
    from core.records import ActionPhase

    return bool(store.actions(phases=(ActionPhase.PENDING, ActionPhase.RUNNING)))


def not_acted_on(fault: DrillFault, inventory: Mapping[str, str]) -> str:
    """Why this configuration would not act on ``fault`` (the drill is refused), or ``""``.

    An NVLink down is a warning no step acts on unless ``[inventory] nvlink =
    "expected"`` says the node has NVLink: a drill of it would test nothing and pass.

    Examples:
        >>> not_acted_on(FAULTS["nvlink"], {}).startswith("--kind nvlink")
        True
        >>> not_acted_on(FAULTS["nvlink"], {"nvlink": "expected"})
        ''
    """
    if fault.kind == "nvlink" and inventory.get("nvlink") != "expected":
        return ("--kind nvlink: this configuration would not act on an NVLink down (without "
                '[inventory] nvlink = "expected" it is a warning with action none, every '
                'step skipped); set [inventory] nvlink = "expected" on NVLink nodes: no drill')
    return ""


UNACTED = ("the fault was not acted on by this configuration: no remediation step was "
           "asked for (see the drill's audit log and the fault's [alerting] policy)")
"""The problem of a drill whose alert fired but no step followed (it must not pass)."""


def check_acted_on(timeline: DrillTimeline) -> None:
    """Add :data:`UNACTED` to ``timeline``'s problems when its fault led to no step.

    Call it once the drill is over: the alert fired, but no step was requested, held
    or stored (only ``detect`` and ``alert`` were expected), so the drill tested nothing.
    """
    if "alert" in timeline.at and timeline.expected <= {"detect", "alert"}:
        timeline._problem(UNACTED)


def end_incidents(store: Any, now: float) -> None:
    """Close the drill's incidents in its own store once it is over.

    A node the drill left out of service (it failed on the way) is then seen as the
    scheduler shows it, and a human who resumes it frees it for the next drill.
    """
    from remediation.actions import INCIDENT_CLOSED, INCIDENT_OPEN, INCIDENT_PROBATION

    for inc in store.incidents(states=(INCIDENT_OPEN, INCIDENT_PROBATION)):
        store.update_incident(inc.incident, state=INCIDENT_CLOSED, closed_at=now,
                              note="drill over")


# --------------------------------------------------------------- through the fleet
# A fleet drill goes through the deployed path: the line is dropped into the agent's
# drill inbox (collectors.drill_inbox), parsed there by the real kernel-log parser,
# sent to the controller as a finding; the controller's alert carries ``drill=<id>``
# (alerting.alerts.alert_labels reads the marker in the evidence), its decisions and
# steps are marked by :func:`mark_drill_decisions`, and its adapter is wrapped by
# :func:`fleet_drill_adapter` (no hand-off for a drill). ``gpuhealth drill --fleet``
# times the stages from the controller's API (:func:`saw_alert_rows`,
# :func:`saw_action_rows`).

INBOX = "drill-inbox"
"""Folder of the agent's drill inbox inside its ``[node] data_dir``."""


def drill_line(fault: DrillFault, *, drill_id: str, bus: str) -> str:
    """The marked kernel-log line of ``fault`` (a kernel-log fault), without newline.

    Raises:
        ValueError: ``fault`` is not a kernel-log fault (NVML faults need the
            single-process drill).
    """
    if not fault.line:
        raise ValueError(f"--kind {fault.name}: a fleet drill injects kernel-log faults "
                         f"only ({', '.join(n for n, f in FAULTS.items() if f.line)})")
    return fault.line.format(bus=bus, mark=f"{MARK}={check_drill_id(drill_id)}")


def write_inbox(data_dir: Path, *, line: str, drill_id: str) -> Path:
    """Drop ``line`` into the agent's drill inbox in ``data_dir``; return the file.

    Written to a temporary name and renamed, so the agent never reads half a line.
    """
    folder = Path(data_dir) / INBOX
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{check_drill_id(drill_id)}.line"
    tmp = folder / f".{drill_id}.tmp"
    tmp.write_text(line.rstrip("\n") + "\n", encoding="utf-8")
    tmp.replace(final)
    return final


def mark_drill_decisions(result: PolicyResult, drills: Mapping[str, str]) -> PolicyResult:
    """Mark the decisions of drill alerts (``drills``: fingerprint -> drill id).

    Each such decision gets ``drill`` (its audit line's ``details["drill"]``) and its
    request ``attrs["drill"]`` and a ``gpuhealth: drill <id>:`` reason, so the engine's
    records, the follow-ups it queues and the adapter (:func:`fleet_drill_adapter`) all
    know the step is a drill's. Other decisions are left as they are.
    """
    out = PolicyResult()
    for d in result.decisions:
        drill_id = drills.get(d.fingerprint, "")
        if drill_id:
            request = d.request
            if request is not None:
                request = replace(request, reason=drill_reason(request.reason, drill_id),
                                  attrs={**request.attrs, DRILL: drill_id})
            d = replace(d, drill=drill_id, request=request)
        out.decisions.append(d)
    return out


class FleetDrillAdapter(DrillAdapter):
    """The controller's adapter: a drill's step is marked and never handed off.

    A request with ``attrs["drill"]`` (:func:`mark_drill_decisions`) goes on as
    :class:`DrillAdapter` sends it (its reason says ``drill <id>``; a hand-off to
    hardware service is not made and succeeds as a no-op, logged); any other request
    goes to the wrapped adapter unchanged.
    """

    async def submit(self, request: ActionRequest) -> str:
        """Submit ``request``; a drill's is marked, a drill's hand-off is not made."""
        drill_id = request.attrs.get(DRILL, "")
        if not drill_id:
            ref: str = await self.inner.submit(request)
            return ref
        self.drill_id = drill_id
        return await DrillAdapter.submit(self, request)

    async def status(self, ref: str) -> ActionStatus:
        """The wrapped adapter's status; a drill's hand-off (made by any replica) succeeded."""
        if ref.startswith("drill-hand-off:"):
            return ActionStatus(ref=ref, phase=ActionPhase.SUCCEEDED,
                                message="drill: not handed to hardware service")
        status: ActionStatus = await self.inner.status(ref)
        return status


def fleet_drill_adapter(inner: Any) -> DrillAdapter:
    """Wrap the controller's ``inner`` adapter for drills (:class:`FleetDrillAdapter`)."""
    return drill_adapter(inner, "", base=FleetDrillAdapter)


def saw_alert_rows(timeline: DrillTimeline, rows: Iterable[Mapping[str, Any]], *,
                   at: float) -> None:
    """Take the controller's ``GET /api/v1/alerts`` answer (``detect`` and ``alert``).

    ``detect`` is when the agent's parser stamped the fault (the alert's
    ``first_seen_at``), ``alert`` when the drill's alert was first seen firing (``at``;
    a firing alert's ``starts_at`` is its fault's first sighting, not its firing), or
    earlier when the first step it asked for was stored before (:func:`saw_action_rows`).
    """
    for row in rows:
        labels = row.get("labels") or {}
        if labels.get(DRILL) != timeline.drill_id or labels.get("node") != timeline.node:
            continue
        timeline.fingerprints.add(str(row.get("fingerprint", "")))
        seen = _number((row.get("annotations") or {}).get("first_seen_at"))
        if "detect" not in timeline.at:
            timeline._mark("detect", seen if seen is not None else at)
        if row.get("state") == AlertState.FIRING.value:
            timeline._mark("alert", at)


def _number(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def saw_action_rows(timeline: DrillTimeline, rows: Iterable[Mapping[str, Any]]) -> None:
    """Take the controller's ``GET /api/v1/actions`` answer: the drill's steps.

    A step of the drill (``attrs["drill"]``) is expected once it exists; it happened
    when it succeeded (``finished_at``); a failed or cancelled one, one waiting for a
    human's approval, and a hand-off (not made: a drill) are problems.
    """
    for row in rows:
        attrs = row.get("attrs") or {}
        if attrs.get(DRILL) != timeline.drill_id:
            continue
        try:
            step = RemediationStep(str(row.get("step")))
            phase = ActionPhase(str(row.get("phase")))
        except ValueError:
            continue
        if step == RemediationStep.HAND_OFF:
            timeline._problem("the node would have been handed to hardware service "
                              "(not done: a drill)")
        stage = _STEP_STAGES.get(step)
        if stage is None:
            continue
        timeline.expected.add(stage)
        if stage in ("reboot", "reset_gpu") and timeline.validating:
            timeline.expected.add("validate")
        if stage in ("cordon", "drain") and attrs.get("scope") != SCOPE_GPU:
            timeline.expected.add("resume")
        created = _number(row.get("created_at"))
        if created is not None and "alert" in timeline.at and created < timeline.at["alert"]:
            timeline.at["alert"] = max(created, timeline.at.get("detect", created))
        finished = _number(row.get("finished_at"))
        if phase == ActionPhase.SUCCEEDED and finished is not None:
            timeline._mark(stage, finished)
        elif phase in (ActionPhase.FAILED, ActionPhase.CANCELLED):
            timeline._problem(f"{step.value} {phase.value}: {row.get('message', '')}")
        elif phase == ActionPhase.AWAITING_APPROVAL:
            timeline._problem(f"{step.value} waits for a human's approval")


RESUME_WAIT_SECONDS = 60.0
"""How long an interrupted live drill waits for the resume of the node it took out."""


async def resume_own(adapter: Any, *, node: str, drill_id: str, why: str,
                     audit: Any) -> str:
    """Resume ``node`` if it is out of service by this drill's own step; return what was done.

    Only a node the scheduler shows out of service by gpuhealth with this drill's reason
    (``gpuhealth: drill <id>:``) is resumed: a node a person or anything else took out is
    left as it is. Every outcome is audited in ``audit`` (the drill's audit log).
    """
    from core.protocols import NodeInspector

    key = f"drill-{drill_id}/resume-after-stop"
    reason = f"gpuhealth: drill {drill_id}: {why}, returning the node the drill took out"

    def record(decision: str, text: str) -> str:
        audit.extend([AuditRecord(at=time.time(), actor=f"drill:{drill_id}",
                                  decision=decision, step=RemediationStep.RESUME,
                                  node=NodeName(node), entity=EntityId("node"), reason=text,
                                  idempotency_key=key, dry_run=False)])
        return f"drill {drill_id}: {node}: {text}"

    inspector: Any = adapter
    if not isinstance(inspector, NodeInspector):
        return record("held", "the scheduler cannot show the node: left as it is, "
                      "resume it by hand if the drill took it out")
    try:
        state = await inspector.node_state(NodeName(node), workload=False)
    except GpuHealthError as exc:
        return record("held", f"the scheduler cannot show the node ({exc}): left as it is")
    if state.schedulable:
        return record("skipped", "in service already: nothing to resume")
    if not state.owned or f"drill {drill_id}:" not in state.reason:
        shown = state.reason or state.state
        return record("held", f"out of service, but not by this drill ({shown}): left as "
                      "it is")
    request = ActionRequest(step=RemediationStep.RESUME, node=NodeName(node),
                            entity=EntityId("node"), reason=reason, idempotency_key=key,
                            dry_run=False)
    record("requested", reason)
    try:
        ref = await adapter.submit(request)
        deadline = time.monotonic() + RESUME_WAIT_SECONDS
        status = await adapter.status(ref)
        while status.phase not in (ActionPhase.SUCCEEDED, ActionPhase.FAILED,
                                   ActionPhase.CANCELLED) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            status = await adapter.status(ref)
    except GpuHealthError as exc:
        return record("failed", f"resume failed ({exc}): resume it by hand")
    if status.phase == ActionPhase.SUCCEEDED:
        return record("succeeded", "resumed (it was out of service by this drill)")
    return record("failed", f"resume {status.phase.value}: {status.message}; resume it by "
                  "hand")


def held_from_actions(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Nodes out of service because of gpuhealth, by incident, from ``GET /api/v1/actions``.

    A node is held while an incident of it took it out (a node-wide cordon, drain,
    reboot or hand-off succeeded) and did not return it (no resume succeeded).
    """
    out_steps = {"cordon", "drain", "reboot", "hand_off"}
    taken: dict[str, str] = {}
    back: set[str] = set()
    for row in rows:
        attrs = row.get("attrs") or {}
        if row.get("phase") != "succeeded":
            continue
        incident, node = str(row.get("incident", "")), str(row.get("node", ""))
        if row.get("step") == "resume":
            back.add(incident)
        elif row.get("step") in out_steps and attrs.get("scope") != "gpu":
            taken.setdefault(incident, node)
    held: dict[str, str] = {}
    for incident, node in taken.items():
        if incident not in back:
            held.setdefault(node, incident)
    return held


SETTLE_SECONDS = 30.0
"""After a drill failed, how long the steps already decided (a hand-off) are still
carried out, so that what the drill did is complete, seconds."""


class DrivenPipeline(Protocol):
    """What :func:`drive` needs of the pipeline (``gpuhealth.pipeline.Pipeline``)."""

    @property
    def actions(self) -> Any: ...  # noqa: D102 (an ActionStore)

    def observe(self, records: Iterable[Record]) -> None: ...  # noqa: D102

    def observe_readings(self, samples: Iterable[Record]) -> None: ...  # noqa: D102

    async def aevaluate(self) -> Any: ...  # noqa: D102

    async def atick(self) -> list[AuditRecord]: ...  # noqa: D102


def drive(pipeline: DrivenPipeline, timeline: DrillTimeline, batches: list[list[Record]], *,
          loop: asyncio.AbstractEventLoop, evaluate_seconds: float, deadline: float,
          settle_seconds: float = SETTLE_SECONDS) -> None:
    """Run a drill on its own pipeline until its timeline finishes or ``deadline``.

    Every ``evaluate_seconds`` the next batch of the injected fault is observed and the
    pipeline evaluated (what it found, alerted and decided goes into ``timeline``);
    remediation ticks in between. After a problem (a stage that cannot happen), the steps
    already decided get up to ``settle_seconds`` more (a hand-off must reach its human).

    Args:
        pipeline: The drill's pipeline (its own action store, the drill's adapters).
        timeline: Filled in as the stages happen.
        batches: The fault's records, one batch per evaluation (``DrillFault.inject``).
        loop: The event loop the pipeline's coroutines run on.
        evaluate_seconds: Seconds between evaluations, > 0.
        deadline: ``time.monotonic()`` at which the drill stops, finished or not.
        settle_seconds: See above, seconds.

    Raises:
        Whatever interrupts the drill (a signal's exception) propagates; the caller ends
        the drill's incident.
    """
    evaluated = float("-inf")
    while True:
        if time.monotonic() - evaluated >= evaluate_seconds:
            if batches:
                batch = batches.pop(0)
                pipeline.observe(batch)
                pipeline.observe_readings(batch)
            out = loop.run_until_complete(pipeline.aevaluate())
            now = time.time()
            evaluated = time.monotonic()
            timeline.saw_findings(out.findings, at=now)
            timeline.saw_alerts(out.alerts, at=now)
            timeline.saw_audit(out.audit)
            timeline.saw_actions(pipeline.actions.actions())  # steps audited tersely
        timeline.saw_audit(loop.run_until_complete(pipeline.atick()))
        if timeline.finished() or time.monotonic() >= deadline:
            break
        time.sleep(min(0.1, evaluate_seconds))
    if timeline.problems:  # let the steps already decided (a hand-off) reach it
        settle = min(deadline, time.monotonic() + settle_seconds)
        while in_flight(pipeline.actions) and time.monotonic() < settle:
            timeline.saw_audit(loop.run_until_complete(pipeline.atick()))
            time.sleep(0.1)
