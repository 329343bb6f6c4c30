"""The remediation stage: policy, engine and audit trail as one, each decision recorded first.

:class:`RemediationStage` is what the pipeline hands an evaluation's alert changes to. It
owns the :class:`~remediation.policy.RemediationPolicy` (budget, ladder, idempotency),
the :class:`~remediation.engine.RemediationEngine` (actions, breaker, probation) and the
audit trail, and keeps them in step:

1. the policy decides (typed :class:`~remediation.policy.Decision` records);
2. the decisions are written to the audit trail; only then are their requests queued in
   the action store (an audit log written before any step);
3. when the audit trail cannot be written (``ENOSPC``, a read-only remount, an I/O error,
   PostgreSQL away), the policy is put back as it was before the decision, so the budget
   counts no node that no recorded action holds, and the same alert changes are decided
   again at the next evaluation, in order, until the write succeeds (nothing accepted is
   lost; the pipeline goes on by itself once space returns);
4. when the audit was written but the action store cannot be, the requests stay queued
   here and are stored at the next evaluation or tick (``ActionStore.add`` is idempotent
   on the key); after a restart :meth:`RemediationStage.reconcile` stores every request
   of a still-open incident the audit trail has and the action store lacks.

Each failed write counts in :attr:`RemediationStage.write_failures` (per store: ``audit``,
``actions``) and makes :meth:`RemediationStage.failing_store` name the store, which the
service turns into a critical self-alert and the ``gpuhealth_state_write_failures_total``
metric.

Only the leader decides; on becoming leader the stage rebuilds the policy from the shared
audit trail and decides every active alert (:func:`~remediation.decisions.take_over`).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from core.errors import TemporaryError
from core.records import (
    Action,
    Alert,
    AlertState,
    AuditRecord,
    EntityId,
    Finding,
    NodeName,
    RemediationStep,
    Severity,
)
from remediation.actions import ActionStore
from remediation.audit import AuditLog, AuditStore
from remediation.decisions import decide_on_alerts, take_over
from remediation.engine import RemediationEngine
from remediation.policy import Decision, PolicyResult, RemediationPolicy

WARM_SECONDS = 2.0
"""How often a standby applies the audit trail's new records to its warm policy."""

NOTIFY_INCIDENTS_PER_TICK = 500
"""Most notify-only incidents whose requests one :meth:`RemediationStage.queue_pending`
stores (an evaluation and a tick call it once each). A take-over decides every
active alert at once (3,500 notify steps at 2,000 nodes), and storing them all in one
tick delayed the first cordon after a fail-over by over a second; the rest wait in
memory, audited, for the next ticks (a crash meanwhile: :meth:`RemediationStage.reconcile`
stores them when a controller next starts; a standby taking over does not look for them)."""

logger = logging.getLogger(__name__)

WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, sqlite3.Error, TemporaryError)
"""What a failed write of a state store raises: the file's ``OSError`` (``ENOSPC``,
``EROFS``, ``EIO``), SQLite's errors (``database or disk is full``) and an unreachable
PostgreSQL (:class:`~core.errors.TemporaryError`)."""

AUDIT, ACTIONS = "audit", "actions"
SELF_KIND, WRITE_FAILED = "gpuhealth", "state_write_failed"

SELF_ALERT_AFTER_SECONDS = 30.0
"""A store failing this long is a critical self-alert (a blip of a reconnecting database
is not worth a page; the metric shows every failure at once)."""


@dataclass(slots=True)
class _Undecided:
    """Alert changes whose decisions could not be recorded, to decide again in order."""

    changed: list[Alert] = field(default_factory=list)
    fresh: set[str] = field(default_factory=set)
    """Fingerprints of those that were new (not firing before) when they came."""


class RemediationStage:
    """Decide, record, queue and advance remediation (module docstring).

    Args:
        new_policy: Makes a fresh policy with this controller's guards (at start and on
            taking over leadership).
        engine: The engine; its ``policy`` is replaced when the policy is rebuilt.
        audit: The audit trail (JSONL file or SQL store), or ``None`` to keep the records
            only in the outputs (replays, tests).
        is_leader: Whether this controller may decide now.
        lock: Held while the policy and engine state change (the pipeline's lock).
        active: Lists ``(finding, fingerprint)`` of every alert firing now (decided again
            when this controller takes over leadership).
    """

    def __init__(self, *, new_policy: Callable[[], RemediationPolicy],
                 engine: RemediationEngine, audit: AuditLog | AuditStore | None,
                 is_leader: Callable[[], bool], lock: threading.RLock,
                 active: Callable[[], Sequence[tuple[Finding, str]]]) -> None:
        self._new_policy = new_policy
        self._active = active
        self.engine = engine
        self.audit = audit
        self.is_leader = is_leader
        self._lock = lock
        self._undecided = _Undecided()
        self._unqueued = PolicyResult()
        self.write_failures: dict[str, int] = {AUDIT: 0, ACTIONS: 0}
        """Failed writes per store since start (``gpuhealth_state_write_failures_total``)."""
        self._failing: dict[str, str] = {}
        self._failing_since: dict[str, float] = {}
        self._was_leader = is_leader()
        self._warm: tuple[RemediationPolicy, int] | None = None
        """A standby's policy restored up to an audit id (:meth:`_keep_warm`)."""
        self._warmed_at = float("-inf")

    @property
    def policy(self) -> RemediationPolicy:
        """The policy in use (rebuilt on taking over leadership)."""
        return self.engine.policy

    @property
    def actions(self) -> ActionStore:
        """The action store."""
        return self.engine.store

    def failing_store(self) -> dict[str, str]:
        """Stores whose last write failed, with the error (empty when all are writable)."""
        return dict(self._failing)

    def self_findings(self, node: str) -> list[Finding]:
        """The critical self-alert of each store that cannot be written now.

        Kind ``gpuhealth``, code ``state_write_failed``, entity the store, on ``node``
        (this controller's): remediation takes no step for it (``ladder`` plans none for
        gpuhealth's own faults), the alert says what waits.
        """
        now = self.engine.clock()
        return [
            Finding(node=NodeName(node), entity=EntityId(store), kind=SELF_KIND,
                    code=WRITE_FAILED, severity=Severity.CRITICAL, action=Action.NONE,
                    summary=(f"gpuhealth cannot write its {store} store for "
                             f"{now - self._failing_since.get(store, now):.0f} s ({error}): "
                             "remediation decisions wait until it can"),
                    evidence=(), source="gpuhealth remediation stage (docs/remediation.md)")
            for store, error in sorted(self._failing.items())
            if now - self._failing_since.get(store, now) >= SELF_ALERT_AFTER_SECONDS
        ]

    def restore(self) -> None:
        """Rebuild the policy from the audit trail, then store what the action store lacks.

        Raises:
            OSError: The JSONL audit log exists but cannot be read.
            TemporaryError: The shared audit trail cannot be read now.
        """
        if self.audit is None:
            return
        try:
            self.audit.create()  # the path announced at start exists from the start
        except OSError as exc:
            logger.error("cannot create the audit log: %s", exc)  # noqa: TRY400
        records = self.audit.read()
        with self._lock:
            self.policy.restore(records)
        if self.actions.path is not None or self.actions.db.dialect != "sqlite":
            self.reconcile(records)  # an action store in memory (replay) starts empty

    def reconcile(self, records: Iterable[AuditRecord]) -> int:
        """Store each request of an open incident that was audited but never stored.

        A crash or a full disk between the audit line and the action leaves the budget
        counting the node with no action holding it; this queues that action (once: the
        store is idempotent on the key). Returns how many were queued.
        """
        decisions = [d for r in records if (d := Decision.from_audit(r)) is not None]
        last = {d.fingerprint: i for i, d in enumerate(decisions)}
        open_incidents = self.policy.open_incidents
        missing = PolicyResult()
        for i, d in enumerate(decisions):
            if d.request is None:
                continue
            resume = d.planned is not None and d.planned.step == RemediationStep.RESUME
            # A step of an incident still open, or the resume that closed the last one.
            if not (d.fingerprint in open_incidents or (resume and last[d.fingerprint] == i)):
                continue
            if self.actions.by_key(d.idempotency_key) is None:
                missing.decisions.append(d)
        if missing.decisions:
            logger.warning("%d audited request(s) were never stored as actions: storing them "
                           "now", len(missing.decisions))
            self._queue(missing)
        return len(missing.decisions)

    def decide(self, changed: Sequence[Alert], *, before: set[str],
               finding_of: Callable[[str], Finding | None]) -> PolicyResult:
        """Decide, audit and queue what ``changed`` asks of remediation.

        Alert changes whose decisions could not be audited at an earlier call are decided
        first, in their order. Call with the pipeline's lock held.

        Args:
            changed: The alerts that changed in this evaluation.
            before: Fingerprints of the alerts firing before it.
            finding_of: The finding behind an alert's fingerprint.

        Returns:
            The decisions recorded now; empty when the audit trail could not be written
            (they are decided again at the next call). Their requests are stored by
            :meth:`queue_pending`.
        """
        leader = self.is_leader()
        taken = PolicyResult()
        if leader and not self._was_leader:
            # Lead first, then decide: the standby's own policy is stale (its budget knows
            # nothing of the incidents the old leader opened since this process started),
            # so deciding with it before the tick's take-over doubled the budget after a
            # fail-over. The take-over decides every alert firing now, these new ones too.
            try:
                taken = self._take_over()
            except TemporaryError as exc:  # the trail cannot be read now: lead at the tick
                logger.warning("cannot take over remediation yet: %s", exc)
                leader = False
            else:
                changed = [a for a in changed
                           if a.state == AlertState.RESOLVED or a.fingerprint in before]
        pending = self._undecided
        if pending.changed:
            latest = {a.fingerprint: a for a in changed}
            kept = [a for a in pending.changed
                    if not (a.fingerprint in pending.fresh and a.state != AlertState.RESOLVED
                            and latest.get(a.fingerprint, a).state == AlertState.RESOLVED)]
            dropped = {a.fingerprint for a in pending.changed} - {a.fingerprint for a in kept}
            # A pending new alert still firing is decided once, from its latest finding.
            again = {a.fingerprint for a in kept
                     if a.fingerprint in pending.fresh and a.state != AlertState.RESOLVED}
            changed = kept + [a for a in changed if a.fingerprint not in dropped
                              and not (a.fingerprint in again
                                       and a.state != AlertState.RESOLVED)]
            before = before - pending.fresh
        fresh = {a.fingerprint for a in changed
                 if a.fingerprint not in before and a.state != AlertState.RESOLVED}
        checkpoint = self.policy.checkpoint()
        decided = decide_on_alerts(self.policy, self.engine, changed, before=before,
                                   finding_of=finding_of, leader=leader)
        if not decided.decisions:
            self._undecided = _Undecided()
            return taken if taken.decisions else decided
        try:
            if self.audit is not None:
                self.audit.extend(decided.audit)
        except WRITE_ERRORS as exc:
            self.policy.rollback(checkpoint)
            self._undecided = _Undecided(changed=list(changed), fresh=fresh)
            self._failed(AUDIT, exc, f"{len(decided.decisions)} decision(s) wait: nothing is "
                                     "submitted that cannot be recorded first")
            return PolicyResult()
        self._undecided = _Undecided()
        self._ok(AUDIT)
        for fingerprint, why in {(d.fingerprint, d.why) for d in decided.decisions
                                 if d.escalated_from}:
            self.engine.end_probation(fingerprint, why=f"escalated: {why}")
        self._unqueued.extend(decided)
        if taken.decisions:
            taken.extend(decided)
            return taken
        return decided

    def queue_pending(self, *, everything: bool = False) -> list[AuditRecord]:
        """Store the audited requests not stored yet; audit what the engine did with them.

        Every incident with a disruptive step is stored; of those that only notify, at
        most :data:`NOTIFY_INCIDENTS_PER_TICK` per call unless ``everything`` (the end
        of a replay), the rest at the next calls.

        Returns:
            The engine's audit records (breaker opened, approvals awaited), written.
        """
        if not self._unqueued.decisions:
            return []
        limit = len(self._unqueued.decisions) if everything else NOTIFY_INCIDENTS_PER_TICK
        result, self._unqueued = urgent_first(self._unqueued, limit)
        return self._queue(result)

    def _queue(self, result: PolicyResult) -> list[AuditRecord]:
        try:
            records = self.engine.enqueue(result)
        except WRITE_ERRORS as exc:  # they go first again, ahead of what was deferred
            self._unqueued = PolicyResult([*result.decisions, *self._unqueued.decisions])
            self._failed(ACTIONS, exc, f"{len(result.requests)} request(s) stay queued")
            return []
        self._ok(ACTIONS)
        self.write(records)
        return records

    def write(self, records: Sequence[AuditRecord]) -> bool:
        """Append the engine's records (step results, breaker) to the audit trail.

        Returns:
            Whether they were written (a failure is logged and counted, never raised).
        """
        if not records or self.audit is None:
            return True
        try:
            self.audit.extend(records)
        except WRITE_ERRORS as exc:
            self._failed(AUDIT, exc, f"{len(records)} engine record(s) not written")
            return False
        self._ok(AUDIT)
        return True

    async def tick(self) -> list[AuditRecord]:
        """Check leadership, store pending requests, advance the engine once; audit it."""
        out = self.check_leadership()
        out += self.queue_pending()
        if self._failing.get(ACTIONS):
            return out  # the action store is not writable: advancing would not be recorded
        try:
            records = await self.engine.tick()
        except WRITE_ERRORS as exc:
            self._failed(ACTIONS, exc, "remediation does not advance until it is writable")
            return out
        self.write(records)
        return out + records

    def check_leadership(self) -> list[AuditRecord]:
        """On becoming leader, rebuild the policy from the audit trail and decide what is active.

        Returns:
            The audit records written.
        """
        leader = self.is_leader()
        records: list[AuditRecord] = []
        if not leader:
            self._keep_warm()
        elif not self._was_leader:
            records = list(self._take_over().audit)  # its requests: the tick's queue_pending
        self._was_leader = leader
        return records

    def _take_over(self) -> PolicyResult:
        """Rebuild the policy from the audit trail and decide every active alert with it.

        Returns:
            The decisions written to the trail (their requests wait for
            :meth:`queue_pending`); empty when they could not be written.

        Raises:
            TemporaryError: The shared audit trail cannot be read now (nothing changed:
                this controller takes over at the next call).
        """
        logger.warning("this controller is leader now: taking over remediation")
        started = time.monotonic()
        with self._lock:
            firing = self._active()
            if self._warm is not None and isinstance(self.audit, AuditStore):
                policy, after = self._warm  # only the tail is read (10^5 records at 10k)
                policy.restore(self.audit.read_after(after)[0])
            else:
                policy = self._new_policy()
                policy.restore(self.audit.read() if self.audit is not None else ())
            decided = take_over(policy, firing)
            self.engine.policy = policy
            self.engine.forget_published()
            self._warm = None
            self._was_leader = True
        if not self.write(decided.audit):
            return PolicyResult()
        self._unqueued.extend(decided)
        logger.info("taken over in %.2f s: %d active alert(s), %d new decision(s), "
                    "%d request(s)", time.monotonic() - started, len(firing),
                    len(decided.decisions), len(decided.requests))
        return decided

    def _keep_warm(self) -> None:
        """A standby applies the shared audit trail as it grows, every :data:`WARM_SECONDS`.

        On taking over it then reads only what was appended since (at 10,000 nodes the
        whole trail took the new leader most of a minute). A trail that cannot be read
        now is read at the next call (or whole on taking over); a file trail is not
        shared, so nothing is kept warm from it.
        """
        if not isinstance(self.audit, AuditStore):
            return
        now = time.monotonic()
        if now - self._warmed_at < WARM_SECONDS:
            return
        self._warmed_at = now
        policy, after = self._warm if self._warm is not None else (self._new_policy(), 0)
        try:
            records, after = self.audit.read_after(after)
        except TemporaryError as exc:
            logger.info("cannot read the audit trail to keep the policy warm: %s", exc)
            return
        policy.restore(records)
        self._warm = (policy, after)

    def trip_breaker(self, why: str, *, now: float, nodes: int) -> list[AuditRecord]:
        """Open the circuit breaker for a fleet event (leader only); audit it."""
        if not self.is_leader():
            return []
        with self._lock:
            records = self.engine.trip_breaker(why, now=now, nodes=nodes)
        self.write(records)
        return records

    def close(self) -> None:
        """Close the action store and a SQL audit trail (their files stay for the next start)."""
        self.actions.close()
        if isinstance(self.audit, AuditStore):
            self.audit.close()

    def report(self, store: str, exc: BaseException | None, what: str = "") -> None:
        """Another state store's write result (the input journal, the notification outbox).

        All state stores share one registry of failures: a store failing for
        :data:`SELF_ALERT_AFTER_SECONDS` is a critical self-alert, every failure counts in
        ``gpuhealth_state_write_failures_total{store}``.

        Args:
            store: The store's name (``journal``, ``outbox``).
            exc: The write's error, or ``None`` when it succeeded.
            what: What waits or was lost, for the log.
        """
        if exc is None:
            self._ok(store)
        else:
            self._failed(store, exc, what)

    def _failed(self, store: str, exc: BaseException, what: str) -> None:
        self.write_failures[store] = self.write_failures.get(store, 0) + 1
        first = store not in self._failing
        self._failing[store] = _why(exc)
        self._failing_since.setdefault(store, self.engine.clock())
        if first:
            logger.critical("cannot write the %s store: %s; %s", store, exc, what)

    def _ok(self, store: str) -> None:
        self._failing_since.pop(store, None)
        if self._failing.pop(store, None) is not None:
            logger.warning("the %s store is writable again", store)


def _why(exc: BaseException) -> str:
    """What an operator should know of a write error: the cause and what to do."""
    if isinstance(exc, TemporaryError):
        return f"the database cannot be reached: {exc}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"no space left on the device: {exc.filename or exc}; free space"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return f"the file system is read-only: {exc.filename or exc}"
    if isinstance(exc, sqlite3.Error) and "full" in str(exc):
        return f"{exc}: free space"
    return str(exc) or type(exc).__name__


def urgent_first(result: PolicyResult, notify_incidents: int) -> tuple[PolicyResult, PolicyResult]:
    """Split ``result`` into what to store now and what can wait for a later tick.

    Every decision of an incident with a step other than ``notify`` goes now; of the
    incidents that only notify, the first ``notify_incidents`` go now and the rest wait.
    An incident's decisions are never split, and both parts keep the order they had.

    Args:
        result: The audited decisions waiting to be stored.
        notify_incidents: Most notify-only incidents to take now (>= 0).

    Returns:
        ``(now, later)``.
    """
    urgent = {d.incident_key for d in result.decisions
              if d.planned is not None and d.planned.step != RemediationStep.NOTIFY}
    taken: set[str] = set()
    now, later = PolicyResult(), PolicyResult()
    for d in result.decisions:
        key = d.incident_key
        if key not in urgent and key not in taken and len(taken) < notify_incidents:
            taken.add(key)
        (now if key in urgent or key in taken else later).decisions.append(d)
    return now, later
