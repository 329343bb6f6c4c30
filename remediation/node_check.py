"""What ``gpuhealth check`` does to its own node as Slurm's ``HealthCheckProgram``.

As LBNL NHC does: a node whose check finds a fault at or above the threshold drains
itself (``State=DRAIN``, running jobs finish) with a ``gpuhealth: check: ...`` reason; a
node the check drained earlier is resumed once the check passes again. Only the check's
own drains are resumed: a node drained by a person, by another tool or by the gpuhealth
controller (its reasons start otherwise) is left as it is. Slurm's drain is the audit:
the reason carries what was found; the command prints what it did.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.records import NODE_ENTITY, ActionRequest, Finding, NodeName, RemediationStep, Severity
from remediation.slurm import SlurmScheduler

CHECK_PREFIX = "gpuhealth: check: "
"""How the check's own drain reasons start (the controller's are ``gpuhealth: <alert>``)."""

REASON_MAX_CHARS = 200


def drain_reason(findings: Sequence[Finding]) -> str:
    """The ``Reason=`` for ``findings`` (the worst first), cut to :data:`REASON_MAX_CHARS`."""
    worst = findings[0]
    more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
    text = f"{CHECK_PREFIX}{worst.severity.value} {worst.kind} {worst.code} on " \
           f"{worst.entity}: {worst.summary}{more}"
    return text if len(text) <= REASON_MAX_CHARS else text[:REASON_MAX_CHARS - 1] + "…"


async def act(scheduler: SlurmScheduler, node: str, findings: Sequence[Finding], *,
              fail_at: Severity, dry_run: bool = False) -> str:
    """Drain or resume ``node`` for the check's ``findings``; return what was done.

    Args:
        scheduler: The Slurm adapter (``scontrol`` with the site's ``SLURM_CONF``).
        node: This node's Slurm name.
        findings: The check's findings, worst first.
        fail_at: The lowest severity that drains.
        dry_run: Say what would be done, change nothing.

    Returns:
        One line: ``drained``, ``already drained``, ``resumed``, ``healthy``, or
        ``left drained by someone else (...)``.

    Raises:
        SchedulerUnavailable: slurmctld cannot be reached.
        PermanentError: Slurm refused the update.
    """
    state = await scheduler.read_node(node)
    failing = [f for f in findings if f.severity.rank >= fail_at.rank]
    if failing:
        if state.drained:
            return f"already drained ({state.reason or 'no reason'})"
        reason = drain_reason(failing)
        if not dry_run:
            await scheduler.submit(ActionRequest(
                step=RemediationStep.CORDON, node=NodeName(node), entity=NODE_ENTITY,
                reason=reason, idempotency_key=f"check/{node}/{reason}", dry_run=False,
                attrs={"when": "now", "scope": "node"}))
        return f"{'would drain' if dry_run else 'drained'}: {reason}"
    if state.drained and state.reason.startswith(CHECK_PREFIX):
        if not dry_run:
            await scheduler.submit(ActionRequest(
                step=RemediationStep.RESUME, node=NodeName(node), entity=NODE_ENTITY,
                reason="gpuhealth: check passed", idempotency_key=f"check/{node}/resume",
                dry_run=False, attrs={"when": "now", "scope": "node"}))
        return f"{'would resume' if dry_run else 'resumed'} (the check's own drain)"
    if state.drained:
        return f"left drained by someone else ({state.reason or 'no reason'})"
    return "healthy"
