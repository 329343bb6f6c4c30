"""Remediation: the action ladder, its guards, the audit log and scheduler adapters.

:mod:`remediation.policy` decides the steps for a finding under the guards
(dry-run, disruption budget, opt-out, idempotency); :mod:`remediation.audit`
keeps the append-only JSONL audit log; :mod:`remediation.dry_run` is the
scheduler adapter that records and changes nothing (``docs/remediation.md``).
"""

from __future__ import annotations

from remediation.audit import AuditLog, audit_from_json, audit_to_json, read_audit_log
from remediation.dry_run import DryRunScheduler
from remediation.policy import (
    PlannedStep,
    PolicyResult,
    RemediationPolicy,
    describe,
    describe_request,
    ladder,
)

__all__ = [
    "AuditLog",
    "DryRunScheduler",
    "PlannedStep",
    "PolicyResult",
    "RemediationPolicy",
    "audit_from_json",
    "audit_to_json",
    "describe",
    "describe_request",
    "ladder",
    "read_audit_log",
]
