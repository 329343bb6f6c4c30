"""Helpers shared by the fault-model rule modules.

Evidence capping, attribute look-ups on event groups, the UUID-to-PCI map of the
kernel log, and the finding built from one :class:`EventGroup` (its evidence,
times and count carried over unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable

from analytics.fault_model.engine import MAX_EVIDENCE, EventGroup, Observations
from core.records import Action, EntityId, Evidence, Finding, Severity


def keep_evidence(kept: list[Evidence], new: Iterable[Evidence]) -> None:
    """Append ``new`` lines to ``kept``, keeping the first and the latest (at most MAX_EVIDENCE)."""
    head = MAX_EVIDENCE // 2
    for item in new:
        if item in kept:
            continue
        if len(kept) >= MAX_EVIDENCE:
            del kept[head]
        kept.append(item)


def attr(group: EventGroup, key: str) -> set[str]:
    """Return the distinct values of attribute ``key`` in ``group`` (empty when absent)."""
    return group.attr_values.get(key, set())


def uuid_map(obs: Observations) -> dict[str, str]:
    """Map GPU UUIDs to PCI bus ids from ``gpu_identity`` events (``NVRM: GPU at PCI:...``)."""
    mapping: dict[str, str] = {}
    for g in obs.events("gpu_identity"):
        for uuid in attr(g, "uuid"):
            mapping[uuid] = g.entity
    return mapping


def year_note(year: str | None) -> str:
    """Return the summary suffix for a log whose stamps carry no year ("" when none was assumed)."""
    return "" if year is None else f" (year {year} assumed: the log's stamps carry none)"


def group_finding(
    group: EventGroup,
    *,
    kind: str,
    code: str,
    severity: Severity,
    action: Action,
    summary: str,
    source: str,
    entity: EntityId | None = None,
) -> Finding:
    """Return the finding about one event group: its evidence, first/last time and count.

    ``entity`` defaults to the group's own.
    """
    evidence: list[Evidence] = []
    keep_evidence(evidence, group.evidence)
    return Finding(
        node=group.node,
        entity=group.entity if entity is None else entity,
        kind=kind,
        code=code,
        severity=severity,
        action=action,
        summary=summary,
        evidence=tuple(evidence),
        source=source,
        first_seen_at=group.first_seen_at,
        last_seen_at=group.last_seen_at,
        occurrences=group.count,
    )
