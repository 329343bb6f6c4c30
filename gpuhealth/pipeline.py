"""The analyse → alert → remediate wiring shared by ``gpuhealth run`` and ``gpuhealth replay``.

A :class:`Pipeline` takes records (samples and events) with :meth:`Pipeline.observe`
and, at each :meth:`Pipeline.evaluate`, runs the fault model over everything seen
(per node, with that node's facts), updates the alert lifecycle (pending, firing,
resolved; :class:`~alerting.alerts.AlertTracker`), decides remediation steps for new
alerts (and frees budget for resolved ones), records dry-run requests with the
scheduler adapter, appends every decision to the audit log, and delivers:

- to ``notifiers`` every alert that changed, unless a silence or an inhibition
  rule mutes it (:mod:`alerting.silences`, :mod:`alerting.router`); an alert muted
  while firing is not resolved, and one unmuted later is sent then; notifiers
  with a ``resend_interval_seconds`` (Alertmanager) get every firing alert again
  at that interval;
- to ``page_notifiers`` (PagerDuty) the pages: one per node group for the firing,
  unmuted alerts of severity ``major`` or worse (:class:`~alerting.router.PageGrouper`).

Everything goes through a durable, bounded :class:`~alerting.outbox.Outbox`: each
notifier has its own queue, its own backoff and its own timeout, so one that is
down for an hour loses nothing and delays no other. Failures are logged and
counted, never raised.

A *snapshot* (:meth:`Pipeline.observe_snapshot`: one file of a replay, one ingested
document) that on its own shows a node healthy, with at least one record and no
finding that alerts, replaces what was known about that node: its earlier findings
clear and their alerts resolve (a healthy ``nvidia-smi -q`` after a fault).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from alerting.alerts import AlertPolicy, AlertTracker, finding_from_prediction
from alerting.outbox import Outbox
from alerting.router import DEFAULT_INHIBIT_RULES, InhibitRule
from alerting.routing import MAX_BACKLOG, AlertRouter
from alerting.silences import SilenceStore
from analytics.fault_model import (
    Context,
    Observations,
    Rule,
    all_rules,
    evaluate,
    merge_findings,
)
from analytics.fault_model.boot import (
    BOOT_KINDS,
    DEFAULT_BOOT_WINDOW_SECONDS,
    boot_times,
    hold_boot_transients,
)
from analytics.fault_model.debounce import Debouncer
from analytics.fault_model.site_rules import SiteRules
from analytics.stage import AnalyticsOutput
from core.clock import Clock, system_clock
from core.errors import TemporaryError
from core.protocols import Notifier, SchedulerAdapter
from core.records import (
    ActionRequest,
    Alert,
    AuditRecord,
    EntityId,
    Finding,
    NodeName,
    Prediction,
    Record,
    Sample,
    Severity,
)
from remediation.actions import ActionStore
from remediation.attribution import WorkAttribution
from remediation.audit import open_audit
from remediation.dry_run import DryRunScheduler
from remediation.engine import RemediationEngine
from remediation.policy import RemediationPolicy
from remediation.stage import WRITE_ERRORS, RemediationStage
from storage.journal import InputJournal

logger = logging.getLogger(__name__)
_T = TypeVar("_T")



@dataclass(slots=True, kw_only=True)
class PipelineOutput:
    """What one evaluation produced.

    Attributes:
        findings: Every current finding, worst first.
        alerts: Alerts that changed in this evaluation (new, changed, re-sent, resolved).
        actions: Action requests decided in this evaluation, in order.
        audit: Audit records written in this evaluation (taken and held-back decisions).
        notify_failures: Failed deliveries in this evaluation, all notifiers together.
        notified: Alerts queued for ``notifiers`` in this evaluation (after silences
            and inhibition).
        pages: Pages (node-group notifications) queued for ``page_notifiers``.
        muted: Fingerprints of firing alerts muted now, with why
            (``silenced:<id>`` or ``inhibited:<fingerprint>``).
    """

    findings: list[Finding] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    actions: list[ActionRequest] = field(default_factory=list)
    audit: list[AuditRecord] = field(default_factory=list)
    notify_failures: int = 0
    notified: list[Alert] = field(default_factory=list)
    pages: list[Alert] = field(default_factory=list)
    muted: dict[str, str] = field(default_factory=dict)


class Pipeline:
    """Findings → alerts → notifications and dry-run remediation, one evaluation at a time.

    Args:
        facts: Machine facts for the fault model (``nvlink=absent``, ``node=...``).
        notifiers: Where alerts go; each is sent every alert that changed and is not muted.
        audit_log_path: JSONL audit log to append to (and to restore idempotency
            from at start), or ``None`` to keep records only in the outputs.
        dry_run: Record actions only (the ``dry_run`` adapter changes nothing); ``False``
            needs a ``scheduler`` other than the dry-run one.
        max_disrupted_fraction: Fleet share of nodes gpuhealth may hold out of
            service at once, in (0, 1].
        cluster_size: Nodes in the fleet, >= 1.
        opt_out_nodes: Nodes never remediated automatically.
        act_on_predictions: Let predicted failures take steps beyond notify (policy
            guard; default off).
        critical_reserve_fraction: Share of the disruption budget kept for critical
            findings (policy guard; default 0.25).
        min_alert_severity: Lowest severity that alerts (never below ``warning``).
        clock: Returns now, epoch seconds.
        resend_interval_seconds: Re-send an unchanged firing alert after this long.
        gpu_level_drain: Whether the scheduler can drain a single GPU's work.
        notify_timeout_seconds: Longest wait for one notifier's ``send``, seconds.
        scheduler: Adapter given the requests; a :class:`DryRunScheduler` by default.
        rules: Fault-model rules; all registered rules by default.
        event_window_seconds: Forget events not seen again for this long, seconds, so a
            fault that stopped recurring resolves (the live service; ``None`` keeps
            everything, as replay and diagnose do for recorded history).
        page_notifiers: Where pages go (one per node group, ``major`` and worse).
        node_facts: Facts per node, over ``facts`` (``{"node-a": {"nvlink": "absent"}}``).
        silences: Silence store consulted at each evaluation; none by default.
        inhibit_rules: Inhibition rules; :data:`~alerting.router.DEFAULT_INHIBIT_RULES`
            by default.
        alert_policies: Alert policy per fault class (``kind:code``, ``kind``, ``*``).
        extra_labels: Labels on every alert (``cluster``).
        group_by: Labels that group alerts into pages.
        page_severity: Lowest severity that pages.
        outbox_path: SQLite file of the durable outbox, a PostgreSQL DSN (a controller
            pair's shared outbox), or ``None`` for memory.
        max_outbox: Notifications kept per notifier while it is down.
        runbook_base_url: Prefix of the ``runbook_url`` annotation.
        action_store_path: SQLite file of the action store (shared with a standby
            controller and ``gpuhealth actions``), or ``None`` for memory.
        node_agent: Adapter for ``reset_gpu`` steps (the node's own gpuhealth).
        is_leader: Whether this controller may decide and act now (leader election);
            a standby tracks alerts but decides nothing.
        engine_options: Keyword arguments of :class:`~remediation.engine.RemediationEngine`
            (breaker, rate limit, approvals, probation, step timeout).
        tick_inline: Advance the remediation engine inside each evaluation (replay);
            ``False``: the service's remediation thread calls :meth:`atick`.
        notify_as_standby: Notify while not leader (a standby ``run`` watches its own
            node); ``False`` for a controller replica, whose leader notifies for the fleet:
            the standby routes nothing until it leads, then sends what the old leader did
            not (the outbox records what was sent as firing:
            :meth:`~alerting.routing.AlertRouter.resume`).
        join: Joins findings across nodes before they alert (the controller's
            :func:`~analytics.fleet.join_link_ends`: the two ends of one link, one finding).

    Raises:
        ValueError: ``dry_run`` is false with the dry-run scheduler, or a guard parameter
            is out of range.
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
        act_on_predictions: bool = False,
        critical_reserve_fraction: float = 0.25,
        min_alert_severity: Severity = Severity.WARNING,
        clock: Clock = system_clock,
        resend_interval_seconds: float = 4 * 3600.0,
        gpu_level_drain: bool = True,
        notify_timeout_seconds: float = 30.0,
        scheduler: SchedulerAdapter | None = None,
        rules: Sequence[Rule] | None = None,
        event_window_seconds: float | None = None,
        page_notifiers: Sequence[Notifier] = (),
        node_facts: Mapping[str, Mapping[str, str]] | None = None,
        silences: SilenceStore | None = None,
        inhibit_rules: Sequence[InhibitRule] = DEFAULT_INHIBIT_RULES,
        alert_policies: Mapping[str, AlertPolicy] | None = None,
        extra_labels: Mapping[str, str] | None = None,
        group_by: Sequence[str] = ("cluster", "node"),
        page_severity: Severity = Severity.MAJOR,
        outbox_path: str | None = None,
        max_outbox: int = MAX_BACKLOG,
        runbook_base_url: str = "docs/runbooks",
        action_store_path: str | None = None,
        node_agent: SchedulerAdapter | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        engine_options: Mapping[str, Any] | None = None,
        tick_inline: bool = True,
        notify_as_standby: bool = True,
        join: Callable[[list[Finding]], list[Finding]] | None = None,
    ) -> None:
        if not dry_run and (scheduler is None or isinstance(scheduler, DryRunScheduler)):
            raise ValueError(
                "live remediation needs a scheduler adapter ([remediation] scheduler = "
                '"slurm", "kubernetes" or "webhook"); the dry-run adapter changes nothing'
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
        if event_window_seconds is not None and event_window_seconds <= 0:
            raise ValueError("event_window_seconds must be > 0")
        self.event_window_seconds = event_window_seconds
        self.page_notifiers = page_notifiers
        self.node_facts = node_facts
        self.silences = silences
        self.inhibit_rules = inhibit_rules
        self.alert_policies = alert_policies
        self.extra_labels = extra_labels
        self.group_by = group_by
        self.page_severity = page_severity
        self.outbox_path = outbox_path
        self.max_outbox = max_outbox
        self.runbook_base_url = runbook_base_url
        self._scheduler: SchedulerAdapter = (
            scheduler if scheduler is not None else DryRunScheduler()
        )
        self._nodes: dict[str, Observations] = {}
        self._predicted: dict[tuple[str, str], Finding] = {}
        self._held: dict[tuple[str, str, str, str], tuple[Finding, float]] = {}
        self._node_facts = {str(k): dict(v) for k, v in (node_facts or {}).items()}
        self._tracker = AlertTracker(
            min_severity=min_alert_severity,
            resend_interval_seconds=resend_interval_seconds,
            clock=clock,
            policies=alert_policies,
            extra_labels=extra_labels,
            runbook_base_url=runbook_base_url,
        )
        self._router = AlertRouter(
            notifiers=notifiers, page_notifiers=page_notifiers, silences=silences,
            inhibit_rules=inhibit_rules, group_by=group_by, page_severity=page_severity,
            outbox_path=outbox_path, max_outbox=max_outbox, clock=clock,
            notify_timeout_seconds=notify_timeout_seconds)
        self.notify_failures = self._router.notify_failures
        """Failed deliveries per notifier name since start."""
        self._lock = threading.RLock()
        self.act_on_predictions = act_on_predictions
        self.critical_reserve_fraction = critical_reserve_fraction
        self.is_leader = is_leader
        self.tick_inline = tick_inline
        self.notify_as_standby = notify_as_standby
        self.join = join
        self.journal: InputJournal | None = None
        """Accepted inputs (ingested artifacts, held findings), written before they apply."""
        self.journal_held = True
        self.site_rules = SiteRules(())
        self.boot_window_seconds = DEFAULT_BOOT_WINDOW_SECONDS
        """Findings of :attr:`boot_kinds` last seen this soon after a node's boot are held
        back (:mod:`analytics.fault_model.boot`); 0 holds nothing back."""
        self.boot_kinds = BOOT_KINDS
        self.debounce = Debouncer({})
        """Polled states become findings after N of M bad readings
        (:mod:`analytics.fault_model.debounce`); none here, the composition root sets it."""
        self._routing = False
        self.attribution: WorkAttribution | None = None
        """Names the jobs or pods each new finding hit (:mod:`remediation.attribution`)."""
        """The site's ``[[policy.rule]]`` tables, applied to the findings before they alert."""
        """Journal held findings too (a controller's come back from the fleet records)."""
        self.wake = threading.Event()
        """Set when the engine has new work (the service's remediation thread waits on it)."""
        self.deliver_inline = True
        """Deliver the outbox at the end of each evaluation; ``False``: the caller runs its
        own delivery (a controller's, so a slow or busy notifier never delays a decision)
        and waits on :attr:`notify_due`."""
        self.notify_due = threading.Event()
        """Set after an evaluation that queued notifications (``deliver_inline`` off)."""
        engine = RemediationEngine(
            store=ActionStore(action_store_path),
            scheduler=self._scheduler,
            policy=self._new_policy(),
            node_agent=node_agent,
            clock=clock,
            is_leader=is_leader,
            lock=self._lock,
            **dict(engine_options or {}),
        )
        self._stage = RemediationStage(
            new_policy=self._new_policy, engine=engine,
            audit=open_audit(audit_log_path) if audit_log_path else None,
            is_leader=is_leader, lock=self._lock, active=self._active_findings)
        # Incidents still open in the trail keep their budget slot until they resolve here.
        self._stage.restore()

    @property
    def policy(self) -> RemediationPolicy:
        """The remediation policy (its budget and held-back state)."""
        return self._stage.policy

    @property
    def engine(self) -> RemediationEngine:
        """The remediation engine (actions, breaker, probation)."""
        return self._stage.engine

    @property
    def remediation(self) -> RemediationStage:
        """The remediation stage (policy, engine and audit trail; its write failures)."""
        return self._stage

    @property
    def actions(self) -> ActionStore:
        """The action store."""
        return self._stage.actions

    def store_pending(self) -> list[AuditRecord]:
        """Store every audited request still waiting in memory (the end of a replay).

        Returns:
            The audit records written.
        """
        with self._lock:
            return self._stage.queue_pending(everything=True)

    async def atick(self) -> list[AuditRecord]:
        """Advance remediation once (poll running steps, start the next ones); audit it.

        Returns:
            The audit records written.
        """
        return await self._stage.tick()

    def _new_policy(self) -> RemediationPolicy:
        return RemediationPolicy(
            dry_run=self.dry_run,
            max_disrupted_fraction=self.max_disrupted_fraction,
            cluster_size=self.cluster_size,
            opt_out_nodes=self.opt_out_nodes,
            gpu_level_drain=self.gpu_level_drain,
            act_on_predictions=self.act_on_predictions,
            critical_reserve_fraction=self.critical_reserve_fraction,
            clock=self.clock,
        )

    def _active_findings(self) -> list[tuple[Finding, str]]:
        """``(finding, fingerprint)`` of every alert firing now (decided on taking over)."""
        with self._lock:
            return [(finding, alert.fingerprint) for alert in self._tracker.active()
                    if (finding := self._tracker.finding_of(alert.fingerprint)) is not None]

    @property
    def outbox(self) -> Outbox:
        """The durable outbox (its depth per notifier is a metric)."""
        return self._router.outbox

    def outbox_depths(self, *, every_notifier: bool = False) -> dict[str, int]:
        """Return the undelivered notifications per notifier name (pagers prefixed ``page:``).

        Args:
            every_notifier: Also list this pipeline's notifiers with nothing queued (0),
                as the ``gpuhealth_outbox_depth{notifier}`` gauge wants.
        """
        return self._router.depths(every_notifier=every_notifier)

    def active_alerts(self) -> list[Alert]:
        """Return the alerts firing now (muted ones included)."""
        with self._lock:
            return self._tracker.active()

    def pending_alerts(self) -> list[Alert]:
        """Return the alerts pending now (waiting for their debounce or for-duration)."""
        with self._lock:
            return self._tracker.pending()

    def open_pages(self) -> list[Alert]:
        """Return the pages firing now."""
        with self._lock:
            return self._router.open_pages()

    def muted(self) -> dict[str, str]:
        """Return the fingerprints of muted firing alerts and why, as of the last evaluation."""
        with self._lock:
            return self._router.muted()

    def set_node_facts(self, node: str, facts: Mapping[str, str]) -> None:
        """Set the facts of one node (``nvlink=expected``), over the global ones."""
        with self._lock:
            self._node_facts[node] = {**self._node_facts.get(node, {}), **facts}

    def _context(self, node: str, now: float) -> Context:
        extra = self._node_facts.get(node)
        return Context(facts={**self.facts, **extra} if extra else self.facts, now=now)

    def observe(self, records: Iterable[Record], *, received_at: float | None = None) -> None:
        """Account for samples and events; they are judged at the next :meth:`evaluate`.

        Args:
            records: Samples and events.
            received_at: When they were received, epoch seconds (default now; an input
                recovered from the journal keeps its time, so it expires as it would have).
        """
        with self._lock:
            nodes = self._nodes
            if self.event_window_seconds is None:
                received_at = None
            elif received_at is None:
                received_at = self.clock()
            records = list(records) if self.debounce else records
            for record in records:
                obs = nodes.get(record.node)
                if obs is None:
                    obs = nodes[record.node] = Observations()
                obs.add(record, received_at=received_at)
            if self.debounce:
                self.debounce.observe(records)

    def observe_readings(self, samples: Iterable[Record]) -> None:
        """Count readings that repeat the last value of their series.

        The service gives :meth:`observe` only samples whose value changed; the readings
        of a debounced state count at every poll, and their time is kept as the state's
        latest reading (so a link still down when a boot window ends is seen after it, as
        a replay of the same polls sees it). Only those metrics are looked at.
        """
        if not self.debounce:
            return
        metrics = self.debounce.metrics
        kept = [s for s in samples if isinstance(s, Sample) and s.metric in metrics]
        if not kept:
            return
        with self._lock:
            self.debounce.observe(kept)
            for sample in kept:
                obs = self._nodes.get(sample.node)
                if obs is not None:
                    obs.add(sample)

    def observe_predictions(self, predictions: Iterable[Prediction]) -> None:
        """Account for failure predictions; the latest per entity alerts while it holds.

        A prediction at or above 0.5 becomes a ``warning`` alert, at or above 0.9 a
        ``major`` one (:func:`~alerting.alerts.finding_from_prediction`); a newer
        prediction below 0.5 for the same entity clears it.
        """
        with self._lock:
            for prediction in predictions:
                key = (prediction.node, prediction.entity)
                finding = finding_from_prediction(prediction)
                if finding is None:
                    self._predicted.pop(key, None)
                else:
                    self._predicted[key] = finding
                self._stage.engine.predictions[prediction.node] = max(
                    (p.confidence for (n, _), p in self._predicted.items()
                     if n == prediction.node), default=0.0)

    def observe_findings(self, findings: Iterable[Finding], *,
                         hold_seconds: float = 3600.0, replace_held: bool = False,
                         source: str = "") -> None:
        """Account for findings made outside the fault model (online detectors, gaps).

        Each finding stays open, and alerts like any other, until ``hold_seconds`` after
        it was last observed or until :meth:`clear_findings`; a newer finding with the
        same key replaces it, adding its occurrences to the held one's unless
        ``replace_held`` (a finding forwarded by an agent carries its whole count: a
        record delivered twice must not count twice). With :attr:`journal` set and
        :attr:`journal_held` on, they are journaled too (with ``source``, such as
        ``alertmanager:<fingerprint>``) and come back after a restart (:meth:`recover`).

        Raises:
            ValueError: ``hold_seconds`` is not > 0.
        """
        if hold_seconds <= 0:
            raise ValueError(f"hold_seconds must be > 0, got {hold_seconds!r}")
        with self._lock:
            now = self.clock()
            until = now + hold_seconds
            kept: list[tuple[Finding, float]] = []
            for finding in findings:
                held = self._held.get(finding.key)
                if held is not None and not replace_held:
                    first = held[0].first_seen_at
                    finding = replace(
                        finding,
                        first_seen_at=first if first is not None else finding.first_seen_at,
                        occurrences=held[0].occurrences + finding.occurrences)
                self._held[finding.key] = (finding, until)
                kept.append((finding, until))
            if self.journal is not None and self.journal_held:
                try:
                    self.journal.hold(kept, at=now, source=source)
                except WRITE_ERRORS as exc:
                    self._stage.report("journal", exc, f"{len(kept)} held finding(s) are "
                                       "not journaled (they hold until a restart)")
                else:
                    self._stage.report("journal", None)

    def recover(self) -> list[tuple[Finding, str]]:
        """Open again the held findings the journal has (after a restart or a take-over).

        Returns:
            ``(finding, source)`` of each, so the caller can map its own sources again
            (the service's Alertmanager fingerprints).

        Raises:
            TemporaryError: The shared journal cannot be read now.
        """
        if self.journal is None or not self.journal_held:
            return []
        with self._lock:
            back = self.journal.held(now=self.clock())
            for finding, until, _ in back:
                self._held[finding.key] = (finding, until)
        if back:
            logger.info("%d held finding(s) back from the journal", len(back))
        return [(f, source) for f, _, source in back]

    def held_findings(self) -> list[Finding]:
        """Return the findings given to :meth:`observe_findings` that are still open."""
        with self._lock:
            now = self.clock()
            return [f for f, until in self._held.values() if until > now]

    def trip_breaker(self, why: str, *, nodes: int) -> list[AuditRecord]:
        """Open the circuit breaker for a fleet event; audit it (only the leader acts).

        Returns:
            The audit records written (none on a standby or when it was open already).
        """
        return self._stage.trip_breaker(why, now=self.clock(), nodes=nodes)

    def clear_findings(self, keys: Iterable[tuple[str, str, str, str]]) -> None:
        """Close findings given to :meth:`observe_findings` by ``(node, entity, kind, code)``."""
        keys = list(keys)
        with self._lock:
            for key in keys:
                self._held.pop(key, None)
            if self.journal is not None and self.journal_held:
                try:
                    self.journal.clear(keys)
                except WRITE_ERRORS as exc:
                    self._stage.report("journal", exc, f"{len(keys)} cleared finding(s) "
                                       "are not journaled")

    def observe_analytics(self, output: AnalyticsOutput, *, hold_seconds: float) -> None:
        """Take what the analytics stage made of a batch (``run``, ``agent`` and ``replay``).

        Closed gaps are cleared, its findings held for ``hold_seconds`` after they were last
        seen (:meth:`observe_findings`), its predictions alerted on
        (:meth:`observe_predictions`).
        """
        if output.cleared:
            self.clear_findings(output.cleared)
        if output.findings:
            self.observe_findings(output.findings, hold_seconds=hold_seconds)
        if output.for_alerts:
            self.observe_predictions(output.for_alerts)

    def knows_node(self, node: str) -> bool:
        """Whether ``node`` is one this service has heard of.

        Observed (a reading, an event, an ingested file), with held or sticky findings,
        with facts, or with an incident in the action store.
        """
        with self._lock:
            if (node in self._nodes or node in self._node_facts
                    or any(k[0] == node for k in self._held)
                    or any(f.node == node for f in self.site_rules.sticky)):
                return True
        return any(inc.node == node for inc in self.actions.incidents())

    def mark_healthy(self, node: str, entity: str | None, *, reason: str, by: str
                     ) -> list[Finding]:
        """A person says ``node`` (or one ``entity`` of it) is healthy: clear its findings.

        Forgets the node's events (of that entity), its held findings (detectors,
        Alertmanager, agents) and its sticky site-rule findings, and writes one
        ``marked_healthy`` audit record naming the person, the reason and the findings
        cleared (before they clear). At the next evaluation the alerts resolve and
        remediation returns the node to service as for any resolved fault; a state the
        collectors still see (an NVML reading) comes back at once, which is the point.

        Returns:
            The findings that were open and are cleared.

        Raises:
            ValueError: ``reason`` is empty.
        """
        if not reason.strip():
            raise ValueError("a reason is required (it goes into the audit trail)")
        with self._lock:
            now = self.clock()
            cleared = [f for f in self._judge(now) if f.node == node
                       and (entity is None or f.entity == entity)]
            record = AuditRecord(
                at=now, actor=by, decision="marked_healthy", step=None, node=NodeName(node),
                entity=EntityId(entity or "node"), reason=reason,
                idempotency_key=f"mark-healthy/{node}/{entity or 'node'}/{now:.3f}",
                dry_run=False,
                details={"findings": "; ".join(f"{f.kind} {f.code} on {f.entity}"
                                               for f in cleared)})
            if not self._stage.write([record]):
                raise OSError("the audit trail cannot be written: nothing was cleared")
            obs = self._nodes.get(node)
            if obs is not None:
                obs.forget(node, entity)
            keys = [k for k in self._held if k[0] == node and (entity is None or k[1] == entity)]
            keys += [f.key for f in self.site_rules.sticky
                     if f.node == node and (entity is None or f.entity == entity)]
            self.site_rules.clear(keys)
            self.clear_findings(keys)
            self._predicted = {k: v for k, v in self._predicted.items()
                               if not (k[0] == node and (entity is None or k[1] == entity))}
        logger.warning("%s marked %s%s healthy (%s): %d finding(s) cleared", by, node,
                       f" {entity}" if entity else "", reason, len(cleared))
        return cleared

    def observe_snapshot(self, node: str, records: Iterable[Record], *,
                         received_at: float | None = None) -> bool:
        """Account for one complete observation of ``node`` (a file, an ingested document).

        When the snapshot on its own has at least one record and no finding at or
        above the alert threshold, it replaces what was known about the node: the
        node's earlier findings clear at the next evaluation and their alerts
        resolve. Otherwise its records are added as by :meth:`observe`.

        Args:
            node: The node the snapshot is about; every record is put on it.
            records: The snapshot's samples and events.
            received_at: When it was received (default now; see :meth:`observe`).

        Returns:
            Whether the snapshot replaced the node's state (it showed it healthy).
        """
        fresh = Observations()
        kept: list[Record] = []
        for record in records:
            kept.append(record)
            fresh.add(record)
        threshold = max(self.min_alert_severity.rank, Severity.WARNING.rank)
        with self._lock:
            healthy = bool(kept) and not any(
                f.severity.rank >= threshold
                for f in evaluate(fresh, self._context(node, self.clock()), self.rules)
            )
            if healthy:
                self.debounce.observe(kept)  # healthy readings count too
                by_node: dict[str, Observations] = {}
                for record in kept:
                    by_node.setdefault(record.node, Observations()).add(record)
                self._nodes[node] = by_node.pop(node, Observations())
                for other, obs in by_node.items():
                    self._nodes[other] = obs
                logger.info("node %s observed healthy: earlier findings cleared", node)
                return True
        self.observe(kept, received_at=received_at)
        return False

    def evaluate(self) -> PipelineOutput:
        """Run one evaluation (see :meth:`aevaluate`) from synchronous code.

        Raises:
            RuntimeError: Called from inside a running event loop; use :meth:`aevaluate`.
        """
        return asyncio.run(self._closing(self.aevaluate()))

    def _judge(self, now: float) -> list[Finding]:
        found: list[Finding] = self._stage.self_findings(self.facts.get("node", "gpuhealth"))
        rules = self.rules if self.rules is not None else all_rules()  # once, not per node
        for node, obs in self._nodes.items():
            found.extend(evaluate(obs, self._context(node, now), rules))
        if self.debounce:
            found = self.debounce.apply(found)
        if self._held:
            self._held = {k: v for k, v in self._held.items() if v[1] > now}
        if self._predicted or self._held:
            found.extend(self._predicted.values())
            found.extend(f for f, _ in self._held.values())
            found = merge_findings(found)
        elif len(self._nodes) > 1:
            found = merge_findings(found)
        if self.boot_window_seconds > 0:
            found, _ = hold_boot_transients(found, boot_times(self._nodes), now=now,
                                            window_seconds=self.boot_window_seconds,
                                            kinds=self.boot_kinds)
        if self.site_rules:
            found = self.site_rules.apply(found, now=now)
        return self.join(found) if self.join is not None else found

    async def aevaluate(self) -> PipelineOutput:
        """Judge everything observed so far; alert, notify and decide remediation.

        Never raises for a state store that cannot be written: the decisions then wait
        and are taken once it can (:class:`~remediation.stage.RemediationStage`); the
        alerts are sent either way.

        Returns:
            The current findings and what changed in this evaluation.
        """
        with self._lock:
            now = self.clock()
            if self.event_window_seconds is not None:
                for obs in self._nodes.values():
                    obs.expire(now - self.event_window_seconds)
            findings = self._judge(now)
        # the scheduler is asked outside the lock, by the process that alerts and decides
        if self.attribution is not None and (self.notify_as_standby or self.is_leader()):
            findings = await self.attribution.apply(findings)
        with self._lock:
            before = {a.fingerprint for a in self._tracker.active()}
            changed = self._tracker.update(findings)
            decided = self._stage.decide(changed, before=before,
                                         finding_of=self._tracker.finding_of)
            if self.notify_as_standby or self.is_leader():
                if not self._routing:  # started, or took over: what was sent stays sent
                    try:
                        self._router.resume(self._tracker.active(), now)
                        self._routing = True
                    except TemporaryError as exc:
                        logger.warning("cannot read what was notified: %s", exc)
                notified, pages = self._router.route(changed, self._tracker.active(), now)
            else:  # the leader notifies; a new leader sends what the old one did not
                notified, pages = [], []
                self._routing = False
        unsaved = self._router.outbox.unsaved()
        self._stage.report("outbox", TemporaryError(
            f"the notification outbox {self._router.outbox.where} cannot be written; "
            f"{unsaved} notification(s) wait in memory") if unsaved else None)
        output = PipelineOutput(
            findings=findings,
            alerts=changed,
            actions=decided.requests,
            audit=decided.audit,
            notified=notified,
            pages=pages,
            muted=self._router.muted(),
        )
        try:
            output.audit.extend(self._stage.queue_pending())
            if self.tick_inline:
                output.audit.extend(await self.atick())
            elif decided.requests:
                self.wake.set()
        finally:  # alerts go out even if the audit fails
            if self.deliver_inline:
                output.notify_failures = await self.deliver()
            elif notified or pages:
                self.notify_due.set()
        return output

    async def deliver(self, *, force: bool = False) -> int:
        """Deliver what is due from the outbox; return the failed and dropped deliveries.

        Only a process that notifies delivers: the leader, or ``run`` (which notifies as
        standby too); a controller's standby leaves the pair's shared outbox to the leader.

        Args:
            force: Try every queue now, ignoring backoff (end of a replay, shutdown).
        """
        if not (self.notify_as_standby or self.is_leader()):
            return 0
        return await self._router.deliver(force=force)

    async def aclose(self) -> None:
        """Close the notifiers' HTTP clients, on the loop that sent with them."""
        await self._router.aclose()

    async def _closing(self, work: Coroutine[Any, Any, _T]) -> _T:
        """Run ``work`` on a loop of its own, then close the clients made on it."""
        try:
            return await work
        finally:
            await self.aclose()

    def close(self) -> None:
        """Close the outbox and the action store (both keep their files for the next start)."""
        self._router.close()
        self._stage.close()
        if self.journal is not None:
            self.journal.close()

    def flush(self) -> int:
        """Try every undelivered notification once now, from synchronous code.

        Returns:
            Failed and dropped deliveries.
        """
        return asyncio.run(self._closing(self.deliver(force=True)))


