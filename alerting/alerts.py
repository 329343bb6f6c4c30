"""Findings to alerts: labels, annotations, fingerprints and the alert lifecycle.

An :class:`~core.records.Alert` is the notification form of a
:class:`~core.records.Finding` (``docs/fault-model.md``). Its labels follow the
Prometheus/Alertmanager vocabulary (``alertname``, ``severity``, ``node``,
``entity``, ``kind``, ``code``) and its fingerprint is a hash of the labels, so a
receiver can deduplicate on it. :class:`AlertTracker` keeps the lifecycle across
evaluations: a finding at or above ``min_severity`` becomes pending, then
fires once its fault class's policy (:class:`AlertPolicy`: a for-duration and a
count-in-window debounce) is met; a finding that disappears resolves (after
``keep_firing_for_seconds``), and an alert already sent is not sent again unless
it changed or ``resend_interval_seconds`` passed.

Fault classes are named ``kind`` or ``kind:code`` (``xid:13``, ``collective``);
the most specific policy wins. By default every class alerts on first sight:
states that persist (a port down, a counter that already shows damage, a GPU
lost) must not wait, and the fault model already folds repeats into one finding.
Transient signals that operators want debounced get a policy in ``[alerting]``
(for example ``xid:13`` needing three occurrences in ten minutes).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import heapq
import itertools
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from core.clock import Clock, system_clock
from core.drill import DRILL, drill_of_evidence
from core.records import (
    NODE_ENTITY,
    Action,
    Alert,
    AlertState,
    Evidence,
    Finding,
    Prediction,
    Severity,
)

logger = logging.getLogger(__name__)

MAX_EVIDENCE_LINES = 5
"""Evidence lines copied into the ``evidence`` annotation (the first ones)."""

NETWORK_KINDS = frozenset(
    {
        "ib_port",
        "ib_counters",
        "ib_fabric",
        "counter_saturated",
        "port_errors",
        "rdma_verbs",
        "rdma_transport",
        "rdma_async",
        "rdma_counters",
        "roce",
        "roce_qos",
        "nic_port",
        "nccl",
        "ethernet",
        "network",
        "collective",
    }
)
"""Finding kinds about the network; their alert names start with ``Net``."""

_WORD = re.compile(r"[A-Za-z0-9]+")


def _camel(words: Iterable[str]) -> str:
    return "".join(w[:1].upper() + w[1:].lower() for w in words)


@functools.lru_cache(maxsize=4096)  # per alert made, and pairs are few
def alert_name(kind: str, code: str) -> str:
    """Return the ``alertname`` label for a finding's kind and code.

    The prefix is ``Host`` for host kinds (``host_*``), ``Net`` for network
    kinds (:data:`NETWORK_KINDS`), ``Gpuhealth`` for the stack's own (``gpuhealth``),
    else ``Gpu``; kind and code are turned into CamelCase words, and a kind that starts
    with the prefix's own word (``gpu_lost``) does not say it twice. Only the part of the
    code before a ``:`` counts (a code such as ``uncorrected_nonfatal:0000:5e:00.0``
    carries an address, and an alert name must stay one per fault class, never one per
    device). Alert names are an API: the names this function gave before the doubled
    prefix was dropped are aliases for one release (:func:`legacy_alert_name`).

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
        >>> alert_name("pcie", "uncorrected_nonfatal:0000:5e:00.0")
        'GpuPcieUncorrectedNonfatal'
        >>> alert_name("gpu_lost", "rm_init_adapter")
        'GpuLostRmInitAdapter'
        >>> alert_name("gpuhealth", "notifier_backlog")
        'GpuhealthNotifierBacklog'
    """
    if kind.startswith("host_"):
        prefix, kind_words = "Host", kind[len("host_") :]
    elif kind in NETWORK_KINDS:
        prefix, kind_words = "Net", kind
    elif kind == "gpuhealth" or kind.startswith("gpuhealth_"):
        prefix, kind_words = "Gpuhealth", kind[len("gpuhealth") :]
    else:
        prefix, kind_words = "Gpu", kind
    words = _WORD.findall(kind_words)
    if words and words[0].lower() == prefix.lower():
        words = words[1:]
    return prefix + _camel(words + _WORD.findall(code.split(":", 1)[0]))


def legacy_alert_name(kind: str, code: str) -> str | None:
    """Return the name the alert had before its doubled prefix was dropped, if it had one.

    Deprecated aliases, kept for one release (``docs/alerting.md``, "Alert names"):
    gpuhealth's silences and routes that match ``alertname`` on an old name still select
    the alert, and the exported Prometheus rules carry the old name in their
    ``alias`` annotation. ``None`` when the name did not change.

    Examples:
        >>> legacy_alert_name("gpu_lost", "rm_init_adapter")
        'GpuGpuLostRmInitAdapter'
        >>> legacy_alert_name("gpuhealth", "notifier_backlog")
        'GpuGpuhealthNotifierBacklog'
        >>> legacy_alert_name("xid", "79") is None
        True
    """
    if kind.startswith("host_"):
        prefix, kind_words = "Host", kind[len("host_") :]
    elif kind in NETWORK_KINDS:
        prefix, kind_words = "Net", kind
    else:
        prefix, kind_words = "Gpu", kind
    old = prefix + _camel(_WORD.findall(kind_words) + _WORD.findall(code.split(":", 1)[0]))
    return old if old != alert_name(kind, code) else None


def alert_names(labels: Mapping[str, str]) -> tuple[str, ...]:
    """Return the names an alert answers to: its ``alertname``, then its deprecated alias.

    The alias comes from the ``kind`` and ``code`` labels gpuhealth's alerts carry.

    Examples:
        >>> alert_names({"alertname": "GpuLostRmInitAdapter", "kind": "gpu_lost",
        ...              "code": "rm_init_adapter"})
        ('GpuLostRmInitAdapter', 'GpuGpuLostRmInitAdapter')
        >>> alert_names({"alertname": "GpuXid79", "kind": "xid", "code": "79"})
        ('GpuXid79',)
    """
    name = labels.get("alertname", "")
    kind = labels.get("kind", "")
    old = legacy_alert_name(kind, labels.get("code", "")) if kind else None
    if old is None or old == name or name != alert_name(kind, labels.get("code", "")):
        return (name,)
    return (name, old)


PREDICTION_KIND = "prediction"
"""``Finding.kind`` of a failure prediction (:func:`finding_from_prediction`)."""

PREDICTION_WARNING = 0.5
"""Failure probability from which a prediction becomes a ``warning`` alert (a ticket)."""

PREDICTION_MAJOR = 0.9
"""Failure probability from which a prediction becomes a ``major`` alert (a page)."""


def finding_from_prediction(
    prediction: Prediction,
    *,
    warning_at: float = PREDICTION_WARNING,
    major_at: float = PREDICTION_MAJOR,
) -> Finding | None:
    """Return the finding that makes a failure prediction alert, or ``None`` below ``warning_at``.

    The finding's kind is ``prediction`` and its code ``failure``; the horizon and the
    top features go into the summary and the evidence. A prediction never pages as
    ``critical``: nothing is broken yet (fault-model.md, ``warning``: a trend).

    Examples:
        >>> from core.records import EntityId, NodeName, Prediction
        >>> p = Prediction(node=NodeName("n1"), entity=EntityId("GPU-1"), probability=0.95,
        ...                horizon_seconds=86400, top_features={"ecc_rate": 0.7},
        ...                predicted_at=0.0)
        >>> finding_from_prediction(p).severity
        <Severity.MAJOR: 'major'>
    """
    if prediction.probability < warning_at:
        return None
    severity = Severity.MAJOR if prediction.probability >= major_at else Severity.WARNING
    features = ", ".join(
        f"{name}={value:.3g}" for name, value in sorted(
            prediction.top_features.items(), key=lambda kv: -abs(kv[1]))[:5]
    )
    hours = prediction.horizon_seconds / 3600.0
    return Finding(
        node=prediction.node,
        entity=prediction.entity,
        kind=PREDICTION_KIND,
        code="failure",
        severity=severity,
        action=Action.SERVICE_HARDWARE,
        summary=f"{prediction.probability:.0%} chance of failure within {hours:.0f} h",
        evidence=(Evidence(file="prediction", line=None, text=f"top features: {features}"),),
        source="failure predictor",
        first_seen_at=prediction.predicted_at,
        last_seen_at=prediction.predicted_at,
        confidence=prediction.probability,
    )


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
    """Return the labels of the alert for ``finding`` (small, bounded values only).

    A drill's finding (its evidence ends with ``gpuhealth-drill=<id>``, :mod:`core.drill`)
    also gets ``drill=<id>``: its fingerprint then differs from a real fault's.
    """
    labels = {
        "alertname": alert_name(finding.kind, finding.code),
        "severity": finding.severity.value,
        "node": finding.node,
        "entity": finding.entity,
        "kind": finding.kind,
        "code": finding.code,
    }
    drill = drill_of_evidence(finding.evidence)
    if drill:
        labels[DRILL] = drill
    return labels


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


def _drill_changed(alert: Alert, finding: Finding, old: Finding) -> bool:
    """Whether ``finding``'s drill marker (:mod:`core.drill`) is not ``alert``'s any more.

    A new drill of the same fault, or a real occurrence after a drill: like a severity
    change, the labels change, the old alert resolves and the new one fires.
    """
    return (finding.evidence is not old.evidence
            and drill_of_evidence(finding.evidence) != alert.labels.get(DRILL, ""))


def alert_for(
    finding: Finding,
    *,
    starts_at: float,
    state: AlertState = AlertState.FIRING,
    runbook_base_url: str = "docs/runbooks",
    extra_labels: Mapping[str, str] | None = None,
) -> Alert:
    """Return the alert for ``finding`` in ``state``, started at ``starts_at`` (epoch seconds).

    Args:
        finding: The diagnosis.
        starts_at: Epoch seconds the alert started.
        state: Lifecycle state.
        runbook_base_url: Prefix of the ``runbook_url`` annotation.
        extra_labels: Site labels added to every alert (``cluster``); the finding's
            own labels win on a clash.
    """
    labels = {**extra_labels, **alert_labels(finding)} if extra_labels else alert_labels(finding)
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


def alert_from_json(data: Mapping[str, Any]) -> Alert:
    """Return the alert written by :func:`alert_to_json`.

    Raises:
        ValueError: Missing or invalid fields.
    """
    try:
        ends_at = data.get("ends_at")
        return Alert(
            fingerprint=str(data["fingerprint"]),
            labels={str(k): str(v) for k, v in data["labels"].items()},
            annotations={str(k): str(v) for k, v in data["annotations"].items()},
            state=AlertState(data["state"]),
            starts_at=float(data["starts_at"]),
            ends_at=float(ends_at) if ends_at is not None else None,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"invalid alert JSON: {exc}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertPolicy:
    """When a fault class alerts, and how long it keeps firing.

    Attributes:
        for_seconds: How long a finding must hold (pending) before it fires,
            seconds; 0 fires on first sight (Prometheus ``for``).
        debounce_count: Occurrences needed within ``debounce_window_seconds``
            before the alert becomes pending; 1 means no debounce. Counted from
            the finding's ``occurrences`` as seen at successive evaluations.
        debounce_window_seconds: The debounce window, seconds.
        keep_firing_for_seconds: How long a firing alert stays firing after its
            finding disappears, seconds (Prometheus ``keep_firing_for``; anti-flap).

    Raises:
        ValueError: A negative duration, a count below 1, or a count above 1
            with a zero window.
    """

    for_seconds: float = 0.0
    debounce_count: int = 1
    debounce_window_seconds: float = 0.0
    keep_firing_for_seconds: float = 0.0

    def __post_init__(self) -> None:
        if min(self.for_seconds, self.debounce_window_seconds,
               self.keep_firing_for_seconds) < 0:
            raise ValueError("alert policy durations must be >= 0")
        if self.debounce_count < 1:
            raise ValueError(f"debounce_count must be >= 1, got {self.debounce_count!r}")
        if self.debounce_count > 1 and self.debounce_window_seconds <= 0:
            raise ValueError("debounce_count > 1 needs debounce_window_seconds > 0")


FIRST_SIGHT = AlertPolicy()
"""The default policy: fire on first sight, resolve as soon as the finding is gone."""


def policy_for(policies: Mapping[str, AlertPolicy], kind: str, code: str) -> AlertPolicy:
    """Return the policy of a fault class: ``kind:code``, then ``kind``, then ``*``.

    Examples:
        >>> p = {"xid:13": AlertPolicy(debounce_count=3, debounce_window_seconds=600)}
        >>> policy_for(p, "xid", "13").debounce_count
        3
        >>> policy_for(p, "xid", "79") is FIRST_SIGHT
        True
    """
    return (
        policies.get(f"{kind}:{code}")
        or policies.get(kind)
        or policies.get("*")
        or FIRST_SIGHT
    )


@dataclass(slots=True)
class _Tracked:
    """What the tracker remembers about one ongoing fault."""

    alert: Alert
    finding: Finding
    last_sent_at: float
    firing: bool = False
    pending_since: float = 0.0
    missing_since: float | None = None
    history: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=64)
    )
    seq: int = 0
    """When it was first tracked (the order of :attr:`AlertTracker._active`)."""


class AlertTracker:
    """The alert lifecycle over successive evaluations of the fault model.

    Call :meth:`update` with the complete set of current findings at each
    evaluation. It returns the alerts to send now:

    - a finding at or above ``min_severity`` not seen before becomes pending
      (``info`` findings never alert); once its class's debounce count is
      reached within the window and it has been pending for ``for_seconds``,
      it fires (with the default policy, at once);
    - a firing finding still present is sent again only when its severity or
      occurrences changed, or ``resend_interval_seconds`` passed since it was
      last sent; a severity change changes the labels and so the fingerprint:
      the old alert resolves and the new one fires;
    - a firing finding that is gone (or fell below ``min_severity``) resolves,
      with ``ends_at`` set to now, once ``keep_firing_for_seconds`` passed; a
      pending one is dropped silently.

    Faults are identified by the finding's ``(node, entity, kind, code)``.

    Args:
        min_severity: Lowest severity that alerts; ``info`` is never alerted.
        resend_interval_seconds: Re-send an unchanged firing alert after this
            long, seconds (default 4 h, as Alertmanager's ``repeat_interval``).
        runbook_base_url: Prefix of the ``runbook_url`` annotation.
        clock: Returns now, epoch seconds.
        policies: Alert policy per fault class (``kind:code``, ``kind`` or ``*``).
        extra_labels: Labels added to every alert (``cluster``).

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
        policies: Mapping[str, AlertPolicy] | None = None,
        extra_labels: Mapping[str, str] | None = None,
    ) -> None:
        if resend_interval_seconds <= 0:
            raise ValueError(
                f"resend_interval_seconds must be > 0, got {resend_interval_seconds!r}"
            )
        self.min_severity = Severity(min_severity)
        self.resend_interval_seconds = resend_interval_seconds
        self.runbook_base_url = runbook_base_url
        self.clock = clock
        self.policies = dict(policies or {})
        self.extra_labels = dict(extra_labels or {})
        self._threshold = max(self.min_severity.rank, Severity.WARNING.rank)
        self._alerting = frozenset(s for s in Severity if s.rank >= self._threshold)
        self._active: dict[tuple[str, str, str, str], _Tracked] = {}
        self._by_fingerprint: dict[str, _Tracked] = {}
        self._firing: list[Alert] | None = None
        """:meth:`active` until an alert changes (``None``: to be listed again)."""
        self._seq = 0
        self._given: dict[int, Finding] | None = None
        """The last findings by ``id`` (held, so no id is reused); ``None``: look at all."""
        self._current: dict[tuple[str, str, str, str], Finding] = {}
        self._pending: set[tuple[str, str, str, str]] = set()
        self._missing: set[tuple[str, str, str, str]] = set()
        self._due: list[tuple[float, int, tuple[str, str, str, str]]] = []
        """Heap of when firing alerts are due for a re-send (stale entries are skipped)."""
        self.touched = 0
        """Findings the last :meth:`update` looked at beyond a comparison: new, changed,
        pending, due for a re-send, or gone (incremental evaluation, ``docs/scale.md``)."""

    def _new_alert(self, finding: Finding, now: float, state: AlertState) -> Alert:
        # A firing alert starts when its fault was first seen, so every controller replica
        # and a restarted service give it the same start (not their own start time).
        first = finding.first_seen_at
        started = first if (state is AlertState.FIRING and first is not None
                            and first <= now) else now
        return alert_for(
            finding,
            starts_at=started,
            state=state,
            runbook_base_url=self.runbook_base_url,
            extra_labels=self.extra_labels,
        )

    def _ready(self, tracked: _Tracked, policy: AlertPolicy, now: float) -> bool:
        """Whether a pending fault passes its debounce and for-duration now."""
        if policy.debounce_count > 1:
            history = tracked.history
            current = tracked.finding.occurrences
            baseline = 0
            for at, occurrences in history:
                if at <= now - policy.debounce_window_seconds:
                    baseline = occurrences
                else:
                    break
            if current - baseline < policy.debounce_count:
                tracked.pending_since = now
                return False
        return now - tracked.pending_since >= policy.for_seconds

    def update(self, findings: Iterable[Finding]) -> list[Alert]:
        """Account for the current findings; return the alerts to send now.

        Incremental: the findings are compared with the last ones by identity (the fault
        model hands the same objects for what did not change); only the new ones, the
        gone ones, the pending faults and the firing ones due for a re-send (a heap of
        due times) go through the lifecycle. When many changed, a finding is given
        twice, or two share a fault, every finding is looked at, as before.

        Args:
            findings: Every finding that holds now (not only new ones).

        Returns:
            Resolved alerts first, then firing ones in the order of ``findings``.
        """
        now = self.clock()
        found = findings if isinstance(findings, list) else list(findings)
        by_id = dict(zip(map(id, found), found, strict=True))
        out = None
        if self._given is not None and len(by_id) == len(found):
            out = self._update_changes(found, by_id, now)
        if out is None:
            out = self._update_all(found, by_id, now)
        for alert in out:
            if alert.state is AlertState.RESOLVED:
                logger.debug("alert %s (%s) resolved", alert.labels["alertname"],
                             alert.fingerprint)
        return out

    def _update_all(self, found: list[Finding], by_id: dict[int, Finding], now: float
                    ) -> list[Alert]:
        """:meth:`update` looking at every finding (a firing, unchanged one is compared)."""
        resolved: list[Alert] = []
        firing: list[Alert] = []
        current: dict[tuple[str, str, str, str], Finding] = {}
        alerting = self._alerting
        counted = 0
        for finding in found:
            if finding.severity in alerting:
                current[finding.key] = finding
                counted += 1
        active = self._active
        resend = self.resend_interval_seconds
        touched = 0
        for key, finding in current.items():
            tracked = active.get(key)
            if (tracked is not None and tracked.firing
                    and (tracked.finding is finding or tracked.finding == finding)
                    and now - tracked.last_sent_at < resend):
                tracked.missing_since = None
                tracked.finding = finding
                continue
            touched += 1
            self._one(key, finding, now, resolved, firing)
        ended: list[Alert] = []
        if len(active) > len(current):
            for key in [k for k in active if k not in current]:
                touched += 1
                self._gone(key, now, ended)
        self.touched = touched
        # What the next update compares with (nothing when two findings share a fault).
        self._given = by_id if counted == len(current) and len(by_id) == len(found) else None
        self._current = current
        self._pending = {k for k, t in active.items() if not t.firing}
        self._missing = {k for k, t in active.items() if t.missing_since is not None}
        self._due = [(t.last_sent_at + resend, t.seq, k) for k, t in active.items()
                     if t.firing]
        heapq.heapify(self._due)
        return ended + resolved + firing

    def _update_changes(self, found: list[Finding], by_id: dict[int, Finding], now: float
                        ) -> list[Alert] | None:
        """:meth:`update` for what changed since the last call; ``None``: look at all."""
        last = self._given
        assert last is not None
        new_ids = by_id.keys() - last.keys()
        gone_ids = last.keys() - by_id.keys()
        if 4 * (len(new_ids) + len(gone_ids)) > len(found) + 64:
            return None
        alerting = self._alerting
        current = self._current
        changed: dict[tuple[str, str, str, str], Finding] = {}
        for i in new_ids:
            finding = by_id[i]
            if finding.severity not in alerting:
                continue
            key = finding.key
            held = current.get(key)
            if key in changed or (held is not None and id(held) not in gone_ids):
                return None  # two findings about one fault: merged as a whole
            changed[key] = finding
        removed = []
        for i in gone_ids:
            finding = last[i]
            key = finding.key
            if current.get(key) is finding and key not in changed:
                removed.append(key)
        for key in removed:
            del current[key]
        current.update(changed)
        active = self._active
        resend = self.resend_interval_seconds
        work = dict(changed)
        for key in self._pending:
            if key not in work and key in current:
                work[key] = current[key]
        due = self._due
        while due and due[0][0] <= now:
            _, _, key = heapq.heappop(due)
            tracked = active.get(key)
            if (tracked is not None and tracked.firing and key in current
                    and now - tracked.last_sent_at >= resend):
                work.setdefault(key, current[key])
        resolved: list[Alert] = []
        firing: list[Alert] = []
        touched = 0
        items = list(work.items())
        if len(items) > 1:  # in the order of the findings, as before (picked out in C)
            wanted = {id(f) for f in work.values()}
            items = [(f.key, f) for f in itertools.compress(
                found, map(wanted.__contains__, map(id, found)))]
        for key, finding in items:
            tracked = active.get(key)
            self._missing.discard(key)
            if (tracked is not None and tracked.firing
                    and (tracked.finding is finding or tracked.finding == finding)
                    and now - tracked.last_sent_at < resend):
                tracked.missing_since = None
                tracked.finding = finding
                continue
            touched += 1
            sent = tracked.last_sent_at if tracked is not None else None
            self._one(key, finding, now, resolved, firing)
            tracked = active[key]
            if tracked.firing:
                self._pending.discard(key)
                if tracked.last_sent_at != sent:
                    heapq.heappush(due, (tracked.last_sent_at + resend, tracked.seq, key))
            else:
                self._pending.add(key)
        gone = [k for k in {*removed, *self._missing} if k in active and k not in current]
        gone.sort(key=lambda k: active[k].seq)  # in the order they were first tracked
        ended: list[Alert] = []
        for key in gone:
            touched += 1
            self._gone(key, now, ended)
            if key in active:
                self._missing.add(key)
            else:
                self._missing.discard(key)
                self._pending.discard(key)
        if len(due) > 2 * len(active) + 1024:  # re-sent alerts leave their old due times
            self._due = [(t.last_sent_at + resend, t.seq, k) for k, t in active.items()
                         if t.firing]
            heapq.heapify(self._due)
        self._given = by_id
        self.touched = touched
        return ended + resolved + firing

    def _one(self, key: tuple[str, str, str, str], finding: Finding, now: float,
             resolved: list[Alert], firing: list[Alert]) -> None:
        """The lifecycle of one current finding (appends what to send to the lists)."""
        tracked = self._active.get(key)
        policy = policy_for(self.policies, finding.kind, finding.code)
        if tracked is None:
            alert = self._new_alert(finding, now, AlertState.PENDING)
            self._seq += 1
            tracked = _Tracked(alert=alert, finding=finding, last_sent_at=now,
                               pending_since=now, seq=self._seq)
            tracked.history.append((now, 0))
            self._track(key, tracked)
        tracked.missing_since = None
        if tracked.history[-1][1] != finding.occurrences:
            tracked.history.append((now, finding.occurrences))
        old = tracked.finding
        if not tracked.firing:
            tracked.finding = finding
            if finding.severity != old.severity or _drill_changed(tracked.alert, finding, old):
                alert = self._new_alert(finding, tracked.pending_since, AlertState.PENDING)
                self._retrack(key, tracked, alert)
            if self._ready(tracked, policy, now):
                alert = self._new_alert(finding, now, AlertState.FIRING)
                self._retrack(key, tracked, alert)
                tracked.firing = True
                self._firing = None
                tracked.last_sent_at = now
                firing.append(alert)
            return
        if finding.severity != old.severity or _drill_changed(tracked.alert, finding, old):
            resolved.append(self._resolve(tracked.alert, now))
            alert = self._new_alert(finding, now, AlertState.FIRING)
            tracked.finding = finding
            tracked.last_sent_at = now
            self._retrack(key, tracked, alert)
            firing.append(alert)
        elif (
            finding.occurrences != old.occurrences
            or now - tracked.last_sent_at >= self.resend_interval_seconds
        ):
            alert = replace(
                tracked.alert,
                annotations=alert_annotations(finding, runbook_base_url=self.runbook_base_url),
            )
            tracked.finding = finding
            tracked.last_sent_at = now
            self._retrack(key, tracked, alert)
            firing.append(alert)
        else:
            tracked.finding = finding

    def _gone(self, key: tuple[str, str, str, str], now: float, ended: list[Alert]) -> None:
        """A tracked fault with no current finding: drop it, or resolve it once kept enough."""
        gone = self._active[key]
        if not gone.firing:
            self._forget(key)
            return
        keep = policy_for(self.policies, gone.finding.kind, gone.finding.code)
        if gone.missing_since is None:
            gone.missing_since = now
        if now - gone.missing_since >= keep.keep_firing_for_seconds:
            self._forget(key)
            ended.append(self._resolve(gone.alert, now))

    def _track(self, key: tuple[str, str, str, str], tracked: _Tracked) -> None:
        self._active[key] = tracked
        self._by_fingerprint[tracked.alert.fingerprint] = tracked
        self._firing = None

    def _retrack(self, key: tuple[str, str, str, str], tracked: _Tracked, alert: Alert) -> None:
        if alert.fingerprint != tracked.alert.fingerprint:
            self._by_fingerprint.pop(tracked.alert.fingerprint, None)
        tracked.alert = alert
        self._track(key, tracked)

    def _forget(self, key: tuple[str, str, str, str]) -> None:
        tracked = self._active.pop(key)
        self._by_fingerprint.pop(tracked.alert.fingerprint, None)
        self._firing = None

    def active(self) -> list[Alert]:
        """Return the alerts firing now."""
        if self._firing is None:
            self._firing = [t.alert for t in self._active.values() if t.firing]
        return list(self._firing)

    def pending(self) -> list[Alert]:
        """Return the alerts pending now (waiting for their debounce or for-duration)."""
        return [t.alert for t in self._active.values() if not t.firing]

    def finding_of(self, fingerprint: str) -> Finding | None:
        """Return the latest finding behind the firing alert ``fingerprint``, or ``None``."""
        tracked = self._by_fingerprint.get(fingerprint)
        return tracked.finding if tracked is not None and tracked.firing else None

    @staticmethod
    def _resolve(alert: Alert, now: float) -> Alert:
        return replace(alert, state=AlertState.RESOLVED, ends_at=now)
