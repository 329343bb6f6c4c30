"""From alert changes to remediation decisions: new faults, resolutions, recurrences, take-over.

The pipeline tracks alerts (:mod:`alerting.alerts`); this module turns each evaluation's
alert changes into the policy's decisions (``docs/remediation.md``):

- a resolved alert frees its budget slot (:meth:`RemediationPolicy.resolve`);
- new alerts are decided worst first (:meth:`RemediationPolicy.decide_worst_first`), so
  the critical reserve of the budget goes to critical faults;
- an alert that fires again while its node is on probation, with an occurrence *after*
  the fix (a backlog line or a second copy of the old event is not a recurrence),
  escalates to the next rung (:meth:`RemediationPolicy.escalate`); the stage ends the
  probation once the escalation is recorded (:mod:`remediation.stage`);
- only the leader decides; a standby tracks alerts and decides nothing, and on becoming
  leader rebuilds the policy from the audit trail and decides every active alert (the
  idempotency keys keep it from acting twice): :func:`take_over`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from core.drill import DRILL, drill_of_evidence
from core.records import Alert, AlertState, Finding
from remediation.drill import mark_drill_decisions
from remediation.engine import RemediationEngine
from remediation.policy import DECISION_DUPLICATE, PolicyResult, RemediationPolicy

RECURRED = "the fault recurred on probation after its fix"


def decide_on_alerts(policy: RemediationPolicy, engine: RemediationEngine,
                     changed: Sequence[Alert], *, before: set[str],
                     finding_of: Callable[[str], Finding | None], leader: bool) -> PolicyResult:
    """Decide what one evaluation's alert changes ask of remediation (module docstring).

    Args:
        policy: The remediation policy (budget, ladder).
        engine: The engine (probation state).
        changed: The alerts that changed in this evaluation.
        before: Fingerprints of the alerts that were firing before it.
        finding_of: The finding behind an alert's fingerprint.
        leader: Whether this controller may decide now; a standby gets nothing.

    Returns:
        The requests and audit records decided (empty on a standby).
    """
    if not leader:
        return PolicyResult()
    decided = PolicyResult()
    fresh: list[tuple[Finding, str]] = []
    for alert in changed:
        if alert.state == AlertState.RESOLVED:
            decided.extend(policy.resolve(fingerprint=alert.fingerprint,
                                          node=alert.labels["node"]))
        elif alert.fingerprint not in before:
            finding = finding_of(alert.fingerprint)
            if finding is not None:
                fresh.append((finding, alert.fingerprint))
    decided.extend(policy.decide_worst_first(fresh))
    again = [a for a in changed if a.state == AlertState.FIRING and a.fingerprint in before]
    on_probation = engine.on_probation_by_fingerprint() if again else {}  # one read
    for alert in again:
        probation = on_probation.get(alert.fingerprint)
        if probation is None:
            continue
        finding = finding_of(alert.fingerprint)
        if (finding is not None and finding.last_seen_at is not None
                and probation.fixed_at is not None
                and finding.last_seen_at > probation.fixed_at):
            decided.extend(policy.escalate(finding, fingerprint=alert.fingerprint,
                                           why=RECURRED))
    drills = {a.fingerprint: a.labels[DRILL] for a in changed if a.labels.get(DRILL)}
    return mark_drill_decisions(decided, drills) if drills else decided


def take_over(policy: RemediationPolicy, active: Sequence[tuple[Finding, str]]
              ) -> PolicyResult:
    """Decide every active alert with a policy rebuilt from the audit trail.

    Args:
        policy: This controller's policy, restored from the (shared) audit trail
            (:meth:`RemediationPolicy.restore`), whole or kept warm as it grew.
        active: ``(finding, fingerprint)`` of every alert firing now.

    Returns:
        Its decisions, without the duplicates (steps the old leader already took stay
        its own).
    """
    decided = policy.decide_worst_first(active)
    decided.decisions = [d for d in decided.decisions if d.decision != DECISION_DUPLICATE]
    drills = {fp: drill for f, fp in active if (drill := drill_of_evidence(f.evidence))}
    return mark_drill_decisions(decided, drills) if drills else decided
