"""Findings to alerts: labels, annotations, fingerprints and the alert lifecycle.

An :class:`~core.records.Alert` is the notification form of a
:class:`~core.records.Finding` (``docs/fault-model.md``). Its labels follow the
Prometheus/Alertmanager vocabulary (``alertname``, ``severity``, ``node``,
``entity``, ``kind``, ``code``) and its fingerprint is a hash of the labels, so a
receiver can deduplicate on it. :class:`AlertTracker` keeps the lifecycle across
evaluations: a finding at or above ``min_severity`` fires, a finding that
disappears resolves, and an alert already sent is not sent again unless it
changed or ``resend_interval_seconds`` passed.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from core.clock import Clock, system_clock
from core.records import NODE_ENTITY, Alert, AlertState, Finding, Severity

logger = logging.getLogger(__name__)

MAX_EVIDENCE_LINES = 5
"""Evidence lines copied into the ``evidence`` annotation (the first ones)."""

NETWORK_KINDS = frozenset(
    {"ib_port", "ib_counters", "rdma_transport", "roce", "ethernet", "network", "collective"}
)
"""Finding kinds about the network; their alert names start with ``Net``."""

_WORD = re.compile(r"[A-Za-z0-9]+")


def alert_name(kind: str, code: str) -> str:
    """Return the ``alertname`` label for a finding's kind and code.

    The prefix is ``Host`` for host kinds (``host_*``), ``Net`` for network
    kinds (:data:`NETWORK_KINDS`), else ``Gpu``; kind and code are turned into
    CamelCase words.

    Args:
        kind: Finding kind, e.g. ``xid`` or ``row_remap``.
        code: Finding code, e.g. ``79`` or ``pending``.

    Returns:
        A name made of ``[A-Za-z0-9]`` only.

    Examples:
        >>> alert_name("xid", "79")
        'GpuXid79'
        >>> alert_name("row_remap", "pending")
        'GpuRowRemapPending'
        >>> alert_name("host_memory", "edac_ue")
        'HostMemoryEdacUe'
        >>> alert_name("ib_port", "Down")
        'NetIbPortDown'
    """
    if kind.startswith("host_"):
        prefix, kind_words = "Host", kind[len("host_") :]
    elif kind in NETWORK_KINDS:
        prefix, kind_words = "Net", kind
    else:
        prefix, kind_words = "Gpu", kind
    words = _WORD.findall(kind_words) + _WORD.findall(code)
    return prefix + "".join(w[:1].upper() + w[1:].lower() for w in words)


def fingerprint(labels: Mapping[str, str]) -> str:
    """Return the stable fingerprint of a label set: sha256 of the sorted labels, 16 hex digits.

    Examples:
        >>> fingerprint({"b": "2", "a": "1"}) == fingerprint({"a": "1", "b": "2"})
        True
        >>> len(fingerprint({"a": "1"}))
        16
    """
    text = "\n".join(f"{key}={labels[key]}" for key in sorted(labels))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def alert_labels(finding: Finding) -> dict[str, str]:
    """Return the labels of the alert for ``finding`` (small, bounded values only)."""
    return {
        "alertname": alert_name(finding.kind, finding.code),
        "severity": finding.severity.value,
        "node": finding.node,
        "entity": finding.entity,
        "kind": finding.kind,
        "code": finding.code,
    }


def alert_annotations(
    finding: Finding, *, runbook_base_url: str = "docs/runbooks"
) -> dict[str, str]:
    """Return the annotations of the alert for ``finding``.

    Args:
        finding: The diagnosis.
        runbook_base_url: Folder or URL prefix of the runbooks; the runbook of a
            finding is ``<base>/<kind>.md``.

    Returns:
        ``summary``, ``description``, ``action``, ``evidence`` (the first
        :data:`MAX_EVIDENCE_LINES` lines as ``file:line: text``), ``runbook_url``,
        ``occurrences``, ``source`` and, when known, ``first_seen_at`` and
        ``last_seen_at`` (epoch seconds).
    """
    where = finding.node if finding.entity == NODE_ENTITY else f"{finding.node}/{finding.entity}"
    description = (
        f"{finding.severity.value} {finding.kind} {finding.code} on {where}: {finding.summary}. "
        f"Recommended action: {finding.action.value}. Seen {finding.occurrences} time(s). "
        f"Rule: {finding.source}."
    )
    evidence = "\n".join(
        f"{e.file}:{e.line}: {e.text}" if e.line is not None else f"{e.file}: {e.text}"
        for e in finding.evidence[:MAX_EVIDENCE_LINES]
    )
    annotations = {
        "summary": finding.summary,
        "description": description,
        "action": finding.action.value,
        "evidence": evidence,
        "runbook_url": f"{runbook_base_url.rstrip('/')}/{finding.kind}.md",
        "occurrences": str(finding.occurrences),
        "source": finding.source,
    }
    if finding.first_seen_at is not None:
        annotations["first_seen_at"] = repr(finding.first_seen_at)
    if finding.last_seen_at is not None:
        annotations["last_seen_at"] = repr(finding.last_seen_at)
    return annotations


def alert_for(
    finding: Finding,
    *,
    starts_at: float,
    state: AlertState = AlertState.FIRING,
    runbook_base_url: str = "docs/runbooks",
) -> Alert:
    """Return the alert for ``finding`` in ``state``, started at ``starts_at`` (epoch seconds)."""
    labels = alert_labels(finding)
    return Alert(
        fingerprint=fingerprint(labels),
        labels=labels,
        annotations=alert_annotations(finding, runbook_base_url=runbook_base_url),
        state=state,
        starts_at=starts_at,
    )


def alert_to_json(alert: Alert) -> dict[str, Any]:
    """Return ``alert`` as a JSON object (webhook body, replay output) (times in epoch seconds)."""
    return {
        "version": "1",
        "fingerprint": alert.fingerprint,
        "state": alert.state.value,
        "labels": dict(alert.labels),
        "annotations": dict(alert.annotations),
        "starts_at": alert.starts_at,
        "ends_at": alert.ends_at,
    }


@dataclass(slots=True)
class _Tracked:
    """What the tracker remembers about one ongoing fault."""

    alert: Alert
    finding: Finding
    last_sent_at: float


class AlertTracker:
    """The alert lifecycle over successive evaluations of the fault model.

    Call :meth:`update` with the complete set of current findings at each
    evaluation. It returns the alerts to send now:

    - a finding at or above ``min_severity`` not seen before fires (``info``
      findings never alert);
    - a finding still present is sent again only when its severity or
      occurrences changed, or ``resend_interval_seconds`` passed since it was
      last sent; a severity change changes the labels and so the fingerprint:
      the old alert resolves and the new one fires;
    - a finding that is gone (or fell below ``min_severity``) resolves, with
      ``ends_at`` set to now.

    Faults are identified by the finding's ``(node, entity, kind, code)``.

    Args:
        min_severity: Lowest severity that alerts; ``info`` is never alerted.
        resend_interval_seconds: Re-send an unchanged firing alert after this
            long, seconds (default 4 h, as Alertmanager's ``repeat_interval``).
        runbook_base_url: Prefix of the ``runbook_url`` annotation.
        clock: Returns now, epoch seconds.

    Raises:
        ValueError: ``resend_interval_seconds`` is not positive.
    """

    def __init__(
        self,
        *,
        min_severity: Severity = Severity.WARNING,
        resend_interval_seconds: float = 4 * 3600.0,
        runbook_base_url: str = "docs/runbooks",
        clock: Clock = system_clock,
    ) -> None:
        if resend_interval_seconds <= 0:
            raise ValueError(
                f"resend_interval_seconds must be > 0, got {resend_interval_seconds!r}"
            )
        self.min_severity = Severity(min_severity)
        self.resend_interval_seconds = resend_interval_seconds
        self.runbook_base_url = runbook_base_url
        self.clock = clock
        self._threshold = max(self.min_severity.rank, Severity.WARNING.rank)
        self._active: dict[tuple[str, str, str, str], _Tracked] = {}

    def update(self, findings: Iterable[Finding]) -> list[Alert]:
        """Account for the current findings; return the alerts to send now.

        Args:
            findings: Every finding that holds now (not only new ones).

        Returns:
            Resolved alerts first, then firing ones in the order of ``findings``.
        """
        now = self.clock()
        resolved: list[Alert] = []
        firing: list[Alert] = []
        current: dict[tuple[str, str, str, str], Finding] = {}
        for finding in findings:
            if finding.severity.rank >= self._threshold:
                current[finding.key] = finding
        for key in [k for k in self._active if k not in current]:
            gone = self._active.pop(key)
            resolved.append(self._resolve(gone.alert, now))
        for key, finding in current.items():
            tracked = self._active.get(key)
            if tracked is None:
                alert = alert_for(finding, starts_at=now, runbook_base_url=self.runbook_base_url)
                self._active[key] = _Tracked(alert=alert, finding=finding, last_sent_at=now)
                firing.append(alert)
                continue
            old = tracked.finding
            if finding.severity != old.severity:
                resolved.append(self._resolve(tracked.alert, now))
                alert = alert_for(finding, starts_at=now, runbook_base_url=self.runbook_base_url)
                self._active[key] = _Tracked(alert=alert, finding=finding, last_sent_at=now)
                firing.append(alert)
            elif (
                finding.occurrences != old.occurrences
                or now - tracked.last_sent_at >= self.resend_interval_seconds
            ):
                alert = replace(
                    tracked.alert,
                    annotations=alert_annotations(finding, runbook_base_url=self.runbook_base_url),
                )
                self._active[key] = _Tracked(alert=alert, finding=finding, last_sent_at=now)
                firing.append(alert)
            else:
                tracked.finding = finding
        for alert in resolved:
            logger.debug("alert %s (%s) resolved", alert.labels["alertname"], alert.fingerprint)
        return resolved + firing

    def active(self) -> list[Alert]:
        """Return the alerts firing now."""
        return [t.alert for t in self._active.values()]

    def finding_of(self, fingerprint: str) -> Finding | None:
        """Return the latest finding behind the firing alert ``fingerprint``, or ``None``."""
        for tracked in self._active.values():
            if tracked.alert.fingerprint == fingerprint:
                return tracked.finding
        return None

    @staticmethod
    def _resolve(alert: Alert, now: float) -> Alert:
        return replace(alert, state=AlertState.RESOLVED, ends_at=now)
