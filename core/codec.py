"""JSON shapes of records that cross a process boundary (agent → controller, ``--json``).

:func:`finding_to_json` is the finding object of ``docs/fault-model.md`` (``diagnose
--json`` prints it); :func:`finding_from_json` reads it back and names the first bad key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.records import Action, EntityId, Evidence, Finding, NodeName, Severity


class CodecError(ValueError):
    """A JSON object is not the record it should be; the message names the key."""


def finding_to_json(finding: Finding) -> dict[str, Any]:
    """Return one finding as the contract's JSON object (fault-model.md, "A finding")."""
    return {
        "node": finding.node,
        "entity": finding.entity,
        "kind": finding.kind,
        "code": finding.code,
        "severity": finding.severity.value,
        "action": finding.action.value,
        "summary": finding.summary,
        "evidence": [{"file": e.file, "line": e.line, "text": e.text} for e in finding.evidence],
        "source": finding.source,
        "first_seen_at": finding.first_seen_at,
        "last_seen_at": finding.last_seen_at,
        "occurrences": finding.occurrences,
        "confidence": finding.confidence,
    }


def _str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise CodecError(f"{where}.{key}: expected a non-empty string, got {value!r}")
    return value


def _time(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CodecError(f"{where}.{key}: expected epoch seconds or null, got {value!r}")
    return float(value)


def finding_from_json(obj: Any, *, where: str = "finding") -> Finding:
    """Read a finding written by :func:`finding_to_json`.

    Args:
        obj: The decoded JSON object.
        where: Its place in the document, for messages (``records[3].body``).

    Raises:
        CodecError: A key is missing or has the wrong type or value (named).
    """
    if not isinstance(obj, Mapping):
        raise CodecError(f"{where}: expected an object, got {type(obj).__name__}")
    try:
        severity = Severity(str(obj.get("severity")))
    except ValueError:
        raise CodecError(f"{where}.severity: unknown severity {obj.get('severity')!r}") from None
    try:
        action = Action(str(obj.get("action")))
    except ValueError:
        raise CodecError(f"{where}.action: unknown action {obj.get('action')!r}") from None
    raw_evidence = obj.get("evidence", [])
    if not isinstance(raw_evidence, list):
        raise CodecError(f"{where}.evidence: expected a list")
    evidence: list[Evidence] = []
    for i, e in enumerate(raw_evidence):
        at = f"{where}.evidence[{i}]"
        if not isinstance(e, Mapping) or not isinstance(e.get("text"), str):
            raise CodecError(f"{at}: expected {{file, line, text}}")
        line = e.get("line")
        if line is not None and (isinstance(line, bool) or not isinstance(line, int)):
            raise CodecError(f"{at}.line: expected an integer or null, got {line!r}")
        evidence.append(Evidence(file=str(e.get("file", "")), line=line, text=e["text"]))
    occurrences = obj.get("occurrences", 1)
    if isinstance(occurrences, bool) or not isinstance(occurrences, int) or occurrences < 1:
        raise CodecError(f"{where}.occurrences: expected an integer >= 1, got {occurrences!r}")
    confidence = obj.get("confidence", 1.0)
    if isinstance(confidence, bool) or not isinstance(confidence, int | float) \
            or not 0.0 <= confidence <= 1.0:
        raise CodecError(f"{where}.confidence: expected a number in [0, 1], got {confidence!r}")
    return Finding(
        node=NodeName(_str(obj, "node", where)),
        entity=EntityId(_str(obj, "entity", where)),
        kind=_str(obj, "kind", where),
        code=str(obj.get("code", "")),
        severity=severity,
        action=action,
        summary=str(obj.get("summary", "")),
        evidence=tuple(evidence),
        source=str(obj.get("source", "")),
        first_seen_at=_time(obj, "first_seen_at", where),
        last_seen_at=_time(obj, "last_seen_at", where),
        occurrences=occurrences,
        confidence=float(confidence),
    )
