"""Alertmanager webhook payloads (version ``"4"``) in, findings out.

A site's existing Prometheus alert rules can drive gpuhealth's remediation: point an
Alertmanager ``webhook_config`` at ``POST /api/v1/alertmanager`` of ``gpuhealth run``
(``docs/remediation-webhook.md``). :func:`parse_alertmanager` checks the whole payload
first (Alertmanager's ``<webhook_config>`` body, ``docs/ecosystem-reference.md`` §3.5,
and the sample Alertmanager 0.25 sent in ``docs/infra.md`` §3) and maps it to an
:class:`InboundBatch`: one :class:`InboundAlert` (a :class:`~core.records.Finding`)
per firing alert about a node, and the fingerprints of the resolved alerts.

Mapping of one firing alert (labels win over annotations):

* **node**: label ``node``, else ``Hostname``/``hostname`` (dcgm-exporter), else
  ``instance`` without its port (``10.0.0.7:9400`` -> ``10.0.0.7``, ``[::1]:9400`` ->
  ``::1``). An alert with none of them is about no node: it is *ignored* (listed in
  the batch with the reason), not an error.
* **entity**: label ``entity`` (gpuhealth's own rules), else the GPU of the
  dcgm-exporter labels ``pci_bus_id`` (normalised, ``0000:b1:00.0``), ``UUID``/``uuid``,
  ``gpu`` (an index: ``gpu:<n>``) as :func:`collectors.nvidia_smi.gpu_entity` names
  them, else ``"node"``.
* **severity**: label ``severity``: ``critical``/``crit``/``page``/``fatal``/
  ``emergency`` -> critical; ``major``/``error``/``high`` -> major (PagerDuty's
  ``error`` sits between critical and warning, as fault-model ``major`` does);
  ``warning``/``warn``/``minor``/``medium`` -> warning; ``info``/``informational``/
  ``notice``/``low``/``none`` -> info. A missing label takes the fault model's
  severity for a known fault; an unknown word, or a missing label on an unknown
  fault, is ``warning`` (enough to notify, below what drains a node).
* **kind/code**: labels ``kind`` and ``code`` when both are present (gpuhealth's
  rules, :mod:`alerting.promrules`); else a known dcgm-exporter series, found in the
  ``__name__`` label, the alert name or the rule expression (``g0.expr`` of
  ``generatorURL``): ``DCGM_FI_DEV_XID_ERRORS`` with the Xid from the ``xid`` label,
  a numeric ``value`` annotation or ``== N`` in the expression becomes an ``xid``
  event; other ``DCGM_FI_*`` series become the sample dcgm-exporter would give
  (:func:`collectors.dcgm_exporter.parse_exposition`, value from the ``value``
  annotation, else 1). Either is judged by the fault model itself
  (:func:`analytics.fault_model.evaluate`: Xid table, ECC, row remap...), which
  gives kind, code, severity, action and summary; else kind ``external`` with the
  alert name as code.
* **action**: label ``action``, else annotation ``action`` (gpuhealth's rules put it
  there), else the fault model's (for ``kind="xid"`` labels too: the Xid table), else
  ``none``. An unknown action word is an error.
* **confidence**: label ``confidence`` (0-1), else :data:`GPUHEALTH_CONFIDENCE` for
  alerts with ``kind``/``code`` labels, :data:`KNOWN_FAULT_CONFIDENCE` for a dcgm
  series the fault model recognises and :data:`EXTERNAL_CONFIDENCE` otherwise.
* **evidence**: one line per annotation (``summary``, ``description`` first), then
  the alert's labels, file ``alertmanager:<receiver>``.

A payload with a structural error (not an object, wrong ``version``, a bad
``status``, labels that are not strings, a time that is not RFC 3339...) raises
:class:`InboundError` naming the field (``alerts[2].startsAt``); nothing of it is
handed on.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from analytics.fault_model import Context, Observations, evaluate
from collectors.artifact import Line
from collectors.dcgm_exporter import canonical_name, parse_exposition
from collectors.nvidia_smi import gpu_entity
from core.records import (
    NODE_ENTITY,
    Action,
    EntityId,
    Event,
    Evidence,
    Finding,
    NodeName,
    Severity,
)

PAYLOAD_VERSION = "4"
"""The Alertmanager webhook payload version this module reads."""

GPUHEALTH_CONFIDENCE = 0.9
"""Confidence of an alert from gpuhealth's own rules (``kind`` and ``code`` labels)."""

KNOWN_FAULT_CONFIDENCE = 0.8
"""Confidence of an alert on a dcgm-exporter series the fault model judges."""

EXTERNAL_CONFIDENCE = 0.6
"""Confidence of any other alert: above the policy's default ``min_confidence`` (0.5),
so a site rule with an explicit ``action`` label acts, but below gpuhealth's own."""

SEVERITY_WORDS: dict[str, Severity] = {
    "critical": Severity.CRITICAL,
    "crit": Severity.CRITICAL,
    "page": Severity.CRITICAL,
    "fatal": Severity.CRITICAL,
    "emergency": Severity.CRITICAL,
    "major": Severity.MAJOR,
    "error": Severity.MAJOR,
    "high": Severity.MAJOR,
    "warning": Severity.WARNING,
    "warn": Severity.WARNING,
    "minor": Severity.WARNING,
    "medium": Severity.WARNING,
    "info": Severity.INFO,
    "informational": Severity.INFO,
    "notice": Severity.INFO,
    "low": Severity.INFO,
    "none": Severity.INFO,
}
"""Alert ``severity`` label words (lower-cased) to gpuhealth severities."""

_ZERO_TIME_YEAR = 1
"""Alertmanager sends ``endsAt: 0001-01-01T00:00:00Z`` (Go's zero time) while firing."""

_DCGM_NAME = re.compile(r"\b(DCGM_(?:FI|EXP)_[A-Z0-9_]+|dcgm_[a-z0-9_]+)\b")
_XID_IN_EXPR = re.compile(r"DCGM_FI_DEV_XID_ERRORS\b[^=<>!]*==\s*(\d+)")
_ANNOTATION_ORDER = ("summary", "description")


class InboundError(ValueError):
    """A payload that is not a valid Alertmanager version 4 webhook body.

    Attributes:
        field: The offending field, e.g. ``alerts[2].startsAt``.
        reason: What is wrong with it.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class InboundAlert:
    """One firing alert as gpuhealth reads it.

    Attributes:
        fingerprint: Alertmanager's fingerprint (stable per label set); the resolved
            notification later names the same one.
        alertname: The ``alertname`` label (``""`` when missing).
        labels: The alert's labels as sent.
        finding: The finding the alert stands for.
    """

    fingerprint: str
    alertname: str
    labels: Mapping[str, str]
    finding: Finding


@dataclass(frozen=True, slots=True, kw_only=True)
class IgnoredAlert:
    """A well-formed alert gpuhealth does not act on, and why (no node label...)."""

    fingerprint: str
    alertname: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InboundBatch:
    """One Alertmanager notification, checked and mapped.

    Attributes:
        receiver: The Alertmanager receiver name.
        group_key: Alertmanager's ``groupKey``.
        status: ``firing`` or ``resolved`` (of the group).
        external_url: Alertmanager's ``externalURL``.
        received_at: When gpuhealth received it, epoch seconds.
        firing: Firing alerts about a node, in payload order.
        resolved: Fingerprints of the resolved alerts, in payload order.
        ignored: Firing alerts gpuhealth cannot place on a node.
        truncated: Alerts Alertmanager left out (``truncatedAlerts``, ``max_alerts``).
    """

    receiver: str
    group_key: str
    status: str
    external_url: str
    received_at: float
    firing: tuple[InboundAlert, ...]
    resolved: tuple[str, ...]
    ignored: tuple[IgnoredAlert, ...] = ()
    truncated: int = 0


def parse_alertmanager_body(body: bytes, *, received_at: float) -> InboundBatch:
    """Parse the raw body of an Alertmanager webhook request.

    Raises:
        InboundError: The body is not JSON (field ``body``) or not a valid payload.
    """
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InboundError("body", f"not JSON: {exc}") from None
    return parse_alertmanager(payload, received_at=received_at)


def parse_alertmanager(payload: Any, *, received_at: float) -> InboundBatch:
    """Check a decoded Alertmanager version 4 payload and map it to findings.

    Args:
        payload: The decoded JSON body.
        received_at: Now, epoch seconds (``last_seen_at`` of the findings).

    Returns:
        The batch; see the module docstring for the mapping.

    Raises:
        InboundError: A structural error, naming the field. Nothing is returned
            for a payload with any error.

    Examples:
        >>> batch = parse_alertmanager({"version": "4", "status": "resolved",
        ...     "alerts": [{"status": "resolved", "labels": {"alertname": "X"},
        ...                 "annotations": {}, "startsAt": "2026-11-30T04:09:56Z",
        ...                 "endsAt": "2026-11-30T04:10:09Z", "fingerprint": "ab12"}]},
        ...     received_at=0.0)
        >>> batch.resolved, batch.firing
        (('ab12',), ())
    """
    if not isinstance(payload, dict):
        raise InboundError("body", "expected a JSON object")
    version = payload.get("version")
    if version != PAYLOAD_VERSION:
        raise InboundError("version", f"expected {PAYLOAD_VERSION!r}, got {version!r}")
    status = _status(payload.get("status"), "status")
    receiver = _optional_str(payload, "receiver", "receiver")
    group_key = _optional_str(payload, "groupKey", "groupKey")
    external_url = _optional_str(payload, "externalURL", "externalURL")
    truncated = payload.get("truncatedAlerts", 0)
    if isinstance(truncated, bool) or not isinstance(truncated, int) or truncated < 0:
        raise InboundError("truncatedAlerts", f"expected an integer >= 0, got {truncated!r}")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise InboundError("alerts", "expected a list")
    firing: list[InboundAlert] = []
    resolved: list[str] = []
    ignored: list[IgnoredAlert] = []
    source_file = f"alertmanager:{receiver}" if receiver else "alertmanager"
    for i, raw in enumerate(alerts):
        where = f"alerts[{i}]"
        parsed = _alert(raw, where, received_at=received_at, source_file=source_file)
        if isinstance(parsed, str):
            resolved.append(parsed)
        elif isinstance(parsed, IgnoredAlert):
            ignored.append(parsed)
        else:
            firing.append(parsed)
    return InboundBatch(
        receiver=receiver,
        group_key=group_key,
        status=status,
        external_url=external_url,
        received_at=received_at,
        firing=tuple(firing),
        resolved=tuple(resolved),
        ignored=tuple(ignored),
        truncated=truncated,
    )


def batch_summary(batch: InboundBatch) -> dict[str, Any]:
    """Return the API's answer for a batch: counts and the ignored alerts with reasons."""
    return {
        "firing": len(batch.firing),
        "resolved": len(batch.resolved),
        "ignored": [
            {"fingerprint": a.fingerprint, "alertname": a.alertname, "reason": a.reason}
            for a in batch.ignored
        ],
    }


# --------------------------------------------------------------------------- checking


def _status(value: Any, where: str) -> str:
    if value not in ("firing", "resolved"):
        raise InboundError(where, f"expected 'firing' or 'resolved', got {value!r}")
    return str(value)


def _optional_str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InboundError(where, f"expected a string, got {type(value).__name__}")
    return value


def _str_map(value: Any, where: str, *, required: bool) -> dict[str, str]:
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise InboundError(where, "expected an object of strings")
    for key, item in value.items():
        if not isinstance(item, str):
            raise InboundError(f"{where}.{key}", f"expected a string, got {type(item).__name__}")
    return dict(value)


def _time(value: Any, where: str) -> float | None:
    """Parse an RFC 3339 time; ``None`` for Go's zero time (``0001-01-01T00:00:00Z``)."""
    if not isinstance(value, str) or not value:
        raise InboundError(where, f"expected an RFC 3339 time, got {value!r}")
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise InboundError(where, f"not an RFC 3339 time: {value!r}") from None
    if when.tzinfo is None:
        raise InboundError(where, f"RFC 3339 time without a zone offset: {value!r}")
    if when.year <= _ZERO_TIME_YEAR:
        return None
    return when.timestamp()


def _alert(
    raw: Any, where: str, *, received_at: float, source_file: str
) -> InboundAlert | IgnoredAlert | str:
    if not isinstance(raw, dict):
        raise InboundError(where, "expected an object")
    status = _status(raw.get("status"), f"{where}.status")
    labels = _str_map(raw.get("labels"), f"{where}.labels", required=True)
    annotations = _str_map(raw.get("annotations"), f"{where}.annotations", required=False)
    fingerprint = raw.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise InboundError(f"{where}.fingerprint", "expected a non-empty string")
    starts_at = _time(raw.get("startsAt"), f"{where}.startsAt")
    if raw.get("endsAt") not in (None, ""):
        _time(raw.get("endsAt"), f"{where}.endsAt")
    generator = _optional_str(raw, "generatorURL", f"{where}.generatorURL")
    action = _action(labels, annotations, where)
    confidence = _confidence(labels, where)
    severity_word = labels.get("severity")
    if status == "resolved":
        return fingerprint
    alertname = labels.get("alertname", "")
    node = _node(labels)
    if node is None:
        return IgnoredAlert(
            fingerprint=fingerprint,
            alertname=alertname,
            reason="no node label (node, Hostname, hostname or instance)",
        )
    entity = _entity(labels)
    evidence = _evidence(labels, annotations, source_file)
    finding = _classify(
        labels=labels,
        annotations=annotations,
        generator=generator,
        node=node,
        entity=entity,
        received_at=received_at,
    )
    severity = _severity(severity_word, finding)
    if action is None:
        action = finding.action
    if confidence is None:
        confidence = finding.confidence
    summary = finding.summary
    if finding.kind in ("external",) or labels.get("kind"):
        summary = annotations.get("summary") or annotations.get("description") or summary
    finding = dataclasses.replace(
        finding,
        severity=severity,
        action=action,
        confidence=confidence,
        summary=summary,
        evidence=tuple(evidence) + tuple(e for e in finding.evidence if e not in evidence),
        first_seen_at=starts_at,
        last_seen_at=max(received_at, starts_at) if starts_at is not None else received_at,
    )
    return InboundAlert(
        fingerprint=fingerprint, alertname=alertname, labels=labels, finding=finding
    )


def _action(labels: Mapping[str, str], annotations: Mapping[str, str], where: str
            ) -> Action | None:
    if "action" in labels:
        word, field = labels["action"], f"{where}.labels.action"
    elif "action" in annotations:
        word, field = annotations["action"], f"{where}.annotations.action"
    else:
        return None
    try:
        return Action(word.strip().lower())
    except ValueError:
        known = ", ".join(a.value for a in Action)
        raise InboundError(field, f"unknown action {word!r} (one of {known})") from None


def _confidence(labels: Mapping[str, str], where: str) -> float | None:
    if "confidence" not in labels:
        return None
    try:
        value = float(labels["confidence"])
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise InboundError(f"{where}.labels.confidence",
                           f"expected a number in [0, 1], got {labels['confidence']!r}")
    return value


def _severity(word: str | None, finding: Finding) -> Severity:
    if word is None:
        return finding.severity if finding.kind != "external" else Severity.WARNING
    return SEVERITY_WORDS.get(word.strip().lower(), Severity.WARNING)


# --------------------------------------------------------------------------- mapping


def _node(labels: Mapping[str, str]) -> NodeName | None:
    for key in ("node", "Hostname", "hostname"):
        value = labels.get(key, "").strip()
        if value:
            return NodeName(value)
    instance = labels.get("instance", "").strip()
    if not instance:
        return None
    return NodeName(strip_port(instance))


def strip_port(instance: str) -> str:
    """Return a Prometheus ``instance`` label without its port (and IPv6 brackets).

    Examples:
        >>> strip_port("gpu-001:9400"), strip_port("[fe80::1]:9400"), strip_port("fe80::1")
        ('gpu-001', 'fe80::1', 'fe80::1')
        >>> strip_port("10.0.0.7:9400"), strip_port("Node-A"), strip_port("Node-A:9100")
        ('10.0.0.7', 'Node-A', 'Node-A')
    """
    text = instance.strip()
    if text.startswith("["):
        end = text.find("]")
        return text[1:end] if end > 0 else text
    host, sep, port = text.rpartition(":")
    if sep and host and ":" not in host and port.isdigit():
        return host
    return text  # no port, or a bare IPv6 address


def _entity(labels: Mapping[str, str]) -> EntityId:
    value = labels.get("entity", "").strip()
    if value:
        return EntityId(value)
    gpu = gpu_entity(
        bus_id=labels.get("pci_bus_id") or None,
        uuid=labels.get("UUID") or labels.get("uuid"),
        index=labels.get("gpu"),
    )
    return gpu if gpu is not None else NODE_ENTITY


def _evidence(labels: Mapping[str, str], annotations: Mapping[str, str], file: str
              ) -> list[Evidence]:
    keys = [k for k in _ANNOTATION_ORDER if k in annotations]
    keys += sorted(k for k in annotations if k not in _ANNOTATION_ORDER)
    lines = [Evidence(file=file, line=None, text=f"{k}: {annotations[k]}") for k in keys]
    name = labels.get("alertname", "")
    rest = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "alertname")
    lines.append(Evidence(file=file, line=None, text=f"{name}{{{rest}}}"))
    return lines


def _expression(generator: str) -> str:
    """Return the PromQL expression of a Prometheus ``generatorURL`` (``g0.expr``)."""
    if not generator:
        return ""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(generator).query)
    return (query.get("g0.expr") or [""])[0]


def _dcgm_series(labels: Mapping[str, str], expr: str) -> str | None:
    for text in (labels.get("__name__", ""), labels.get("alertname", ""), expr):
        match = _DCGM_NAME.search(text)
        if match:
            return canonical_name(match.group(1))
    return None


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _xid(labels: Mapping[str, str], annotations: Mapping[str, str], expr: str) -> int | None:
    if labels.get("xid", "").strip().isdigit():
        return int(labels["xid"])
    value = _number(annotations.get("value"))
    if value is not None and value > 0 and value == int(value):
        return int(value)
    match = _XID_IN_EXPR.search(expr)
    return int(match.group(1)) if match else None


def _classify(
    *,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    generator: str,
    node: NodeName,
    entity: EntityId,
    received_at: float,
) -> Finding:
    """Return kind, code, severity, action, summary, source and confidence of one alert."""
    alertname = labels.get("alertname", "")
    kind, code = labels.get("kind", "").strip(), labels.get("code", "").strip()
    expr = _expression(generator)
    if kind and code:
        table = None
        if kind == "xid" and code.isdigit():  # the Xid table gives the action when unlabelled
            table = _judge("DCGM_FI_DEV_XID_ERRORS", {"xid": code}, {}, "", node, entity,
                           received_at)
        return _finding(node, entity, kind, code,
                        table.severity if table is not None else Severity.WARNING,
                        table.action if table is not None else Action.NONE,
                        f"{alertname or kind} on {node}/{entity}",
                        f"alertmanager: gpuhealth rule {alertname} (alerting/promrules.py)",
                        GPUHEALTH_CONFIDENCE)
    series = _dcgm_series(labels, expr)
    judged = _judge(series, labels, annotations, expr, node, entity, received_at)
    if judged is not None:
        return dataclasses.replace(
            judged,
            node=node,
            entity=entity,
            source=f"alertmanager: {alertname or series} on {series}, judged by "
                   f"{judged.source}",
            confidence=min(judged.confidence, KNOWN_FAULT_CONFIDENCE),
        )
    return _finding(node, entity, "external", alertname or "unnamed", Severity.WARNING,
                    Action.NONE, f"{alertname or 'alert'} firing on {node}",
                    f"alertmanager: external rule {alertname or '(unnamed)'} "
                    "(alerting/inbound.py)", EXTERNAL_CONFIDENCE)


def _judge(
    series: str | None,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    expr: str,
    node: NodeName,
    entity: EntityId,
    received_at: float,
) -> Finding | None:
    """Run the fault model over the record the alert stands for; the worst finding."""
    if series is None:
        return None
    obs = Observations()
    if series == "DCGM_FI_DEV_XID_ERRORS":
        xid = _xid(labels, annotations, expr)
        if xid is None:
            return None
        obs.add(Event(kind="xid", code=str(xid), node=node, entity=entity,
                      observed_at=received_at, message=f"Xid {xid} (Alertmanager alert)",
                      source="alertmanager"))
    else:
        value = _number(annotations.get("value"))
        rendered = ",".join(
            f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()) if k != "__name__"
        )
        line = Line(1, f"{series}{{{rendered}}} {value if value is not None else 1.0!r}")
        result = parse_exposition([line], file="alertmanager", node=node,
                                  observed_at=received_at, with_line_numbers=False)
        if not result.records:
            return None
        obs.extend(dataclasses.replace(r, node=node, entity=entity) for r in result.records)
    found = [f for f in evaluate(obs, Context(now=received_at)) if f.severity != Severity.INFO
             or f.action != Action.NONE]
    return found[0] if found else None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _finding(node: NodeName, entity: EntityId, kind: str, code: str, severity: Severity,
             action: Action, summary: str, source: str, confidence: float) -> Finding:
    return Finding(node=node, entity=entity, kind=kind, code=code, severity=severity,
                   action=action, summary=summary, evidence=(), source=source,
                   confidence=confidence)
