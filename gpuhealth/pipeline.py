"""The analyse → alert → remediate wiring shared by ``gpuhealth run`` and ``gpuhealth replay``.

A :class:`Pipeline` takes records (samples and events) with :meth:`Pipeline.observe`
and, at each :meth:`Pipeline.evaluate`, runs the fault model over everything seen,
updates the alert lifecycle, sends the alerts that changed to every notifier,
decides remediation steps for new alerts (and frees budget for resolved ones),
records dry-run requests with the scheduler adapter and appends every decision
to the audit log.

Notifiers are independent: each gets its own task, its own timeout and its own
backlog. A notifier that fails temporarily keeps its undelivered alerts and tries
them again at the next evaluation (bounded by :data:`MAX_BACKLOG`); one that fails
permanently drops that alert. Failures are logged and counted, never raised, and
never delay or lose the other notifiers' alerts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from alerting.alerts import AlertTracker
from analytics.fault_model import Context, Observations, Rule, evaluate
from core.clock import Clock, system_clock
from core.errors import GpuHealthError, PermanentError
from core.protocols import Notifier, SchedulerAdapter
from core.records import (
    ActionRequest,
    Alert,
    AlertState,
    AuditRecord,
    Finding,
    Record,
    Severity,
)
from remediation.audit import AuditLog, read_audit_log
from remediation.dry_run import DryRunScheduler
from remediation.policy import PolicyResult, RemediationPolicy

logger = logging.getLogger(__name__)

MAX_BACKLOG = 1000
"""Undelivered alerts kept per notifier; beyond it the oldest are dropped (and counted)."""


@dataclass(slots=True, kw_only=True)
class PipelineOutput:
    """What one evaluation produced.

    Attributes:
        findings: Every current finding, worst first.
        alerts: Alerts that changed in this evaluation (new, changed, re-sent, resolved).
        actions: Action requests decided in this evaluation, in order.
        audit: Audit records written in this evaluation (taken and held-back decisions).
        notify_failures: Failed deliveries in this evaluation, all notifiers together.
    """

    findings: list[Finding] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    actions: list[ActionRequest] = field(default_factory=list)
    audit: list[AuditRecord] = field(default_factory=list)
    notify_failures: int = 0


class Pipeline:
    """Findings → alerts → notifications and dry-run remediation, one evaluation at a time.

    Args:
        facts: Machine facts for the fault model (``nvlink=absent``, ``node=...``).
        notifiers: Where alerts go; each is sent every alert that changed.
        audit_log_path: JSONL audit log to append to (and to restore idempotency
            from at start), or ``None`` to keep records only in the outputs.
        dry_run: Record actions only. Live remediation needs the step executor
            (submit, poll status, then the next step), which is not built yet, so
            ``False`` is refused.
        max_disrupted_fraction: Fleet share of nodes gpuhealth may hold out of
            service at once, in (0, 1].
        cluster_size: Nodes in the fleet, >= 1.
        opt_out_nodes: Nodes never remediated automatically.
        min_alert_severity: Lowest severity that alerts (never below ``warning``).
        clock: Returns now, epoch seconds.
        resend_interval_seconds: Re-send an unchanged firing alert after this long.
        gpu_level_drain: Whether the scheduler can drain a single GPU's work.
        notify_timeout_seconds: Longest wait for one notifier's ``send``, seconds.
        scheduler: Adapter given the requests; a :class:`DryRunScheduler` by default.
        rules: Fault-model rules; all registered rules by default.

    Raises:
        ValueError: ``dry_run`` is false, or a guard parameter is out of range.
    """

    def __init__(
        self,
        *,
        facts: Mapping[str, str],
        notifiers: Sequence[Notifier],
        audit_log_path: str | None,
        dry_run: bool = True,
        max_disrupted_fraction: float = 0.10,
        cluster_size: int = 1,
        opt_out_nodes: frozenset[str] = frozenset(),
        min_alert_severity: Severity = Severity.WARNING,
        clock: Clock = system_clock,
        resend_interval_seconds: float = 4 * 3600.0,
        gpu_level_drain: bool = True,
        notify_timeout_seconds: float = 30.0,
        scheduler: SchedulerAdapter | None = None,
        rules: Sequence[Rule] | None = None,
    ) -> None:
        if not dry_run:
            raise ValueError(
                "live remediation is not available yet (no step executor); use dry_run=True"
            )
        if notify_timeout_seconds <= 0:
            raise ValueError(f"notify_timeout_seconds must be > 0, got {notify_timeout_seconds!r}")
        self.facts = facts
        self.notifiers = notifiers
        self.audit_log_path = audit_log_path
        self.dry_run = dry_run
        self.max_disrupted_fraction = max_disrupted_fraction
        self.cluster_size = cluster_size
        self.opt_out_nodes = opt_out_nodes
        self.min_alert_severity = min_alert_severity
        self.clock = clock
        self.resend_interval_seconds = resend_interval_seconds
        self.gpu_level_drain = gpu_level_drain
        self.notify_timeout_seconds = notify_timeout_seconds
        self.scheduler = scheduler
        self.rules = rules
        self.notify_failures: dict[str, int] = {}
        """Failed deliveries per notifier name since start."""
        self._scheduler: SchedulerAdapter = (
            scheduler if scheduler is not None else DryRunScheduler()
        )
        self._observations = Observations()
        self._tracker = AlertTracker(
            min_severity=min_alert_severity,
            resend_interval_seconds=resend_interval_seconds,
            clock=clock,
        )
        self._policy = RemediationPolicy(
            dry_run=dry_run,
            max_disrupted_fraction=max_disrupted_fraction,
            cluster_size=cluster_size,
            opt_out_nodes=opt_out_nodes,
            gpu_level_drain=gpu_level_drain,
            clock=clock,
        )
        self._audit = AuditLog(path=audit_log_path) if audit_log_path else None
        if audit_log_path:
            # Incidents still open in the log keep their budget slot until they resolve here.
            self._policy.restore(read_audit_log(audit_log_path))
        self._backlogs: list[list[Alert]] = [[] for _ in notifiers]

    @property
    def policy(self) -> RemediationPolicy:
        """The remediation policy (its budget and held-back state)."""
        return self._policy

    def observe(self, records: Iterable[Record]) -> None:
        """Account for samples and events; they are judged at the next :meth:`evaluate`."""
        self._observations.extend(records)

    def evaluate(self) -> PipelineOutput:
        """Run one evaluation (see :meth:`aevaluate`) from synchronous code.

        Raises:
            RuntimeError: Called from inside a running event loop; use :meth:`aevaluate`.
        """
        return asyncio.run(self.aevaluate())

    async def aevaluate(self) -> PipelineOutput:
        """Judge everything observed so far; alert, notify and decide remediation.

        Returns:
            The current findings and what changed in this evaluation.

        Raises:
            OSError: The audit log cannot be written; nothing is submitted then,
                but the alerts are still sent.
        """
        now = self.clock()
        findings = evaluate(self._observations, Context(facts=self.facts, now=now), self.rules)
        before = {a.fingerprint for a in self._tracker.active()}
        changed = self._tracker.update(findings)
        decided = PolicyResult()
        fresh: list[tuple[Finding, str]] = []
        for alert in changed:
            if alert.state == AlertState.RESOLVED:
                decided.extend(
                    self._policy.resolve(fingerprint=alert.fingerprint, node=alert.labels["node"])
                )
            elif alert.fingerprint not in before:
                finding = self._tracker.finding_of(alert.fingerprint)
                if finding is not None:
                    fresh.append((finding, alert.fingerprint))
        decided.extend(self._policy.retry_held())
        for finding, fp in fresh:
            decided.extend(self._policy.decide(finding, fingerprint=fp))
        try:
            if self._audit is not None:
                self._audit.extend(decided.audit)  # written before anything is submitted
            await self._submit(decided.requests)
        finally:
            failures = await self._notify(changed)  # alerts go out even if the audit fails
        return PipelineOutput(
            findings=findings,
            alerts=changed,
            actions=decided.requests,
            audit=decided.audit,
            notify_failures=failures,
        )

    async def _submit(self, requests: Sequence[ActionRequest]) -> None:
        for request in requests:
            try:
                await self._scheduler.submit(request)
            except GpuHealthError as exc:
                logger.warning(
                    "scheduler %s refused %s on %s: %s",
                    self._scheduler.name,
                    request.step.value,
                    request.node,
                    exc,
                )

    async def _notify(self, alerts: Sequence[Alert]) -> int:
        if not self.notifiers:
            return 0
        results = await asyncio.gather(
            *(self._notify_one(i, alerts) for i in range(len(self.notifiers)))
        )
        return sum(results)

    async def _notify_one(self, index: int, alerts: Sequence[Alert]) -> int:
        """Send the backlog and then ``alerts`` to one notifier; return the failures."""
        notifier = self.notifiers[index]
        name = getattr(notifier, "name", type(notifier).__name__)
        pending = self._backlogs[index] + list(alerts)
        keep: list[Alert] = []
        failures = 0
        for alert in pending:
            try:
                await asyncio.wait_for(notifier.send(alert), self.notify_timeout_seconds)
            except PermanentError as exc:
                failures += 1
                logger.warning(
                    "notifier %s rejected alert %s for good, dropped: %s",
                    name,
                    alert.fingerprint,
                    exc,
                )
            except (GpuHealthError, TimeoutError) as exc:
                failures += 1
                keep.append(alert)
                logger.warning(
                    "notifier %s could not deliver alert %s (will retry): %s",
                    name,
                    alert.fingerprint,
                    exc or "timed out",
                )
            except Exception:
                failures += 1
                keep.append(alert)
                logger.exception("notifier %s failed on alert %s", name, alert.fingerprint)
        if len(keep) > MAX_BACKLOG:
            dropped = len(keep) - MAX_BACKLOG
            failures += dropped
            logger.error("notifier %s backlog full: dropped %d oldest alert(s)", name, dropped)
            keep = keep[dropped:]
        self._backlogs[index] = keep
        if failures:
            self.notify_failures[name] = self.notify_failures.get(name, 0) + failures
        return failures
