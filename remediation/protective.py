"""The agent's opt-in protective step: cordon its own node while no controller answers.

LBNL NHC drains the node it runs on when a check fails; a fleet controller decides for
the whole fleet, under one disruption budget, and the agent never does. Between the two:
when the controllers have been unreachable for ``after_seconds`` and a ``critical``
finding appears on this node (a GPU fallen off the bus, a double-bit ECC error: work that
lands on it now fails), an agent with ``[agent] protective_cordon = true`` cordons its own
node through the configured scheduler adapter (Slurm: ``State=DRAIN`` with a
``gpuhealth:`` reason, running jobs finish; Kubernetes: ``spec.unschedulable``).

Guards: the node's own opt-out (``[remediation] opt_out_nodes``) wins; in dry-run
(``[remediation] dry_run``, the default) the step is only audited; one cordon per outage
(idempotency key ``protective/<node>/<outage start>``); the audit line is written before
the step. The agent never returns the node to service: when a controller answers again
it receives the finding, decides under the fleet's budget and resumes the node when the
fault clears (the cordon carries gpuhealth's reason, so it is gpuhealth's to undo), or a
person does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from core.errors import GpuHealthError
from core.protocols import SchedulerAdapter
from core.records import (
    NODE_ENTITY,
    ActionRequest,
    AuditRecord,
    Finding,
    NodeName,
    RemediationStep,
    Severity,
)
from remediation.audit import AuditLog

logger = logging.getLogger(__name__)

PROTECTIVE = "protective"
"""Actor of the audit records and first part of the idempotency key."""

SKIPPED_KINDS = frozenset({"gpuhealth", "agent", "prediction", "anomaly"})
"""Kinds that never cordon: gpuhealth's own faults, statistics and predictions."""


class ProtectiveCordon:
    """Cordon this node for a critical finding while no controller answers (module docstring).

    Args:
        adapter: The scheduler adapter of ``[remediation] scheduler``.
        node: This node's name.
        after_seconds: How long no controller must have answered, > 0.
        audit: The agent's audit log (written before the step).
        dry_run: Audit only.
        opted_out: Whether this node opts out of automatic remediation.
        clock: Now, epoch seconds.

    Raises:
        ValueError: ``after_seconds`` <= 0.
    """

    def __init__(self, *, adapter: SchedulerAdapter, node: str, after_seconds: float,
                 audit: AuditLog, dry_run: bool = True, opted_out: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        if after_seconds <= 0:
            raise ValueError(f"after_seconds must be > 0, got {after_seconds!r}")
        self.adapter = adapter
        self.node = NodeName(node)
        self.after_seconds = after_seconds
        self.audit = audit
        self.dry_run = dry_run
        self.opted_out = opted_out
        self.clock = clock
        self.done: set[str] = set()

    async def update(self, findings: Sequence[Finding], *,
                     unreachable_since: float | None) -> list[AuditRecord]:
        """Cordon the node when the conditions hold (once per outage); return the audit records.

        Args:
            findings: This node's current findings.
            unreachable_since: Since when no controller answered (epoch seconds), or
                ``None`` while one does.

        Never raises for the adapter or the audit log: a failure is logged and audited
        where it can be, and tried again at the next call.
        """
        now = self.clock()
        if unreachable_since is None or now - unreachable_since < self.after_seconds:
            return []
        worst = next((f for f in findings if f.node == self.node
                      and f.severity == Severity.CRITICAL and f.kind not in SKIPPED_KINDS),
                     None)
        key = f"{PROTECTIVE}/{self.node}/{unreachable_since:.0f}"
        if worst is None or key in self.done or self.opted_out:
            return []
        minutes = (now - unreachable_since) / 60
        reason = (f"gpuhealth: protective cordon, no controller for {minutes:.0f} min: "
                  f"{worst.kind} {worst.code} on {worst.entity}: {worst.summary}")[:200]
        request = ActionRequest(step=RemediationStep.CORDON, node=self.node,
                                entity=NODE_ENTITY, reason=reason, idempotency_key=key,
                                dry_run=self.dry_run, attrs={"when": "now", "scope": "node"})
        requested = self._record("requested", reason, key, now)
        try:
            self.audit.extend([requested])
        except OSError as exc:
            logger.error("protective cordon not taken: the audit log cannot be written: %s",  # noqa: TRY400
                         exc)
            return []
        self.done.add(key)
        try:
            await self.adapter.submit(request)
        except (GpuHealthError, OSError) as exc:
            self.done.discard(key)
            failed = self._record("failed", f"{self.adapter.name}: {exc}", key, self.clock())
            logger.error("protective cordon of %s failed: %s", self.node, exc)  # noqa: TRY400
            try:
                self.audit.extend([failed])
            except OSError:
                return [requested]
            return [requested, failed]
        done = self._record("submitted", "dry-run: nothing changed" if self.dry_run
                            else reason, key, self.clock())
        logger.warning("%s %s: %s", "would cordon" if self.dry_run else "cordoned", self.node,
                       reason)
        try:
            self.audit.extend([done])
        except OSError as exc:
            logger.error("cannot write the audit log: %s", exc)  # noqa: TRY400
        return [requested, done]

    def _record(self, decision: str, reason: str, key: str, at: float) -> AuditRecord:
        return AuditRecord(at=at, actor=PROTECTIVE, decision=decision,
                           step=RemediationStep.CORDON, node=self.node, entity=NODE_ENTITY,
                           reason=reason, idempotency_key=key, dry_run=self.dry_run,
                           details={"protective": "true"})
