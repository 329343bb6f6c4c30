"""Helpers shared by the fault-model rule modules.

Evidence capping, attribute look-ups on event groups, the UUID-to-PCI map of the
kernel log, and the finding built from event groups (their evidence, time span
and count).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from analytics.fault_model.engine import MAX_EVIDENCE, EventGroup, Observations
from core.records import Action, EntityId, Evidence, Finding, Severity


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


def group_evidence(groups: Iterable[EventGroup], limit: int = MAX_EVIDENCE) -> list[Evidence]:
    """Return the distinct evidence lines of ``groups``, the first and the latest (``limit``)."""
    out: list[Evidence] = []
    for group in groups:
        for item in group.evidence:
            if item not in out:
                out.append(item)
    if len(out) > limit:
        half = limit // 2
        out = out[:half] + out[-(limit - half) :]
    return out


def span(groups: Sequence[EventGroup]) -> tuple[float | None, float | None]:
    """Return the first and last time seen over ``groups`` (``None`` where none has one)."""
    firsts = [g.first_seen_at for g in groups if g.first_seen_at is not None]
    lasts = [g.last_seen_at for g in groups if g.last_seen_at is not None]
    return (min(firsts) if firsts else None, max(lasts) if lasts else None)


def group_finding(
    groups: Sequence[EventGroup],
    *,
    kind: str,
    code: str,
    severity: Severity,
    action: Action,
    summary: str,
    source: str,
    entity: EntityId | None = None,
    folded: Sequence[EventGroup] = (),
) -> Finding:
    """Return the finding about ``groups``: their evidence, time span and event count.

    Node and (unless ``entity`` is given) entity are the first group's. ``folded``
    symptom groups add their evidence (at most half of :data:`MAX_EVIDENCE`) and
    widen the time span, but are not counted.
    """
    first, last = span([*groups, *folded])
    return Finding(
        node=groups[0].node,
        entity=groups[0].entity if entity is None else entity,
        kind=kind,
        code=code,
        severity=severity,
        action=action,
        summary=summary,
        evidence=tuple(group_evidence(groups) + group_evidence(folded, MAX_EVIDENCE // 2)),
        source=source,
        first_seen_at=first,
        last_seen_at=last,
        occurrences=sum(g.count for g in groups),
    )
