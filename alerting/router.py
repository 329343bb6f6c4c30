"""Inhibition and grouping: which firing alerts are muted, and the pages they make.

Inhibition follows Alertmanager's ``inhibit_rules`` (``docs/ecosystem-reference.md``
§3.5): a firing *source* alert mutes every *target* alert whose ``equal`` labels have
the same values; an alert that matches both the source and the target matchers
cannot mute itself. The defaults (:data:`DEFAULT_INHIBIT_RULES`) encode the fault
model's "root cause over symptoms" (``docs/fault-model.md``):

- a node that is down or silent mutes its GPU and link alerts;
- a lost GPU mutes the other alerts of that GPU (``nvidia-smi`` errors, NVML errors);
- a root Xid (major or critical) mutes the sympathetic and app-level Xids of the
  same GPU (45, 13, 31, 32, 43, 68, 69).

Grouping makes *pages*: one notification per group (by default per ``cluster`` and
``node``) for the firing, unmuted alerts at or above ``page_severity`` (``major``;
``docs/fault-model.md``: critical and major page, warnings become tickets). A
group's page fires when the group gets its first such alert, fires again (the same
fingerprint, so PagerDuty keeps one incident) only when its worst severity
changes, is marked acknowledged when every one of its alerts is silenced, and
resolves when none is left.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from alerting.alerts import fingerprint
from alerting.silences import Matcher, MatchOp, matches_all
from core.clock import Clock, system_clock
from core.records import Alert, AlertState, Severity

logger = logging.getLogger(__name__)

_RANK = {s.value: s.rank for s in Severity}

PAGE_ALERTNAME = "GpuhealthPage"
"""``alertname`` of a page (a group notification)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InhibitRule:
    """One inhibition rule, as Alertmanager's ``inhibit_rules`` entry.

    Attributes:
        source: Matchers a firing alert must satisfy to mute others.
        target: Matchers of the alerts it mutes.
        equal: Labels whose values must be equal in source and target.
        name: A short name for logs and docs.
    """

    source: tuple[Matcher, ...]
    target: tuple[Matcher, ...]
    equal: tuple[str, ...] = ()
    name: str = ""


def _m(name: str, op: str, value: str) -> Matcher:
    return Matcher(name=name, op=MatchOp(op), value=value)


SYMPATHETIC_XIDS = "13|31|32|43|45|68|69"
"""Xids that follow a root Xid or are app-level (fault-model.md: Xid 45 and app-level Xids)."""

DEFAULT_INHIBIT_RULES: tuple[InhibitRule, ...] = (
    InhibitRule(
        name="node_down",
        source=(_m("kind", "=~", "node_down|node_unreachable|telemetry_gap"),
                _m("entity", "=", "node")),
        target=(_m("entity", "!=", "node"),),
        equal=("node",),
    ),
    InhibitRule(
        name="gpu_lost",
        source=(_m("kind", "=", "gpu_lost"),),
        target=(_m("kind", "!=", "gpu_lost"),),
        equal=("node", "entity"),
    ),
    InhibitRule(
        name="root_xid",
        source=(_m("kind", "=", "xid"), _m("severity", "=~", "major|critical"),
                _m("code", "!~", SYMPATHETIC_XIDS)),
        target=(_m("kind", "=", "xid"), _m("code", "=~", SYMPATHETIC_XIDS)),
        equal=("node", "entity"),
    ),
)
"""The built-in inhibition rules (see the module docstring)."""


def inhibited(alerts: Sequence[Alert], rules: Sequence[InhibitRule]) -> dict[str, str]:
    """Return, for each muted alert's fingerprint, the fingerprint of an alert muting it.

    Args:
        alerts: The firing alerts.
        rules: Inhibition rules.

    Returns:
        ``{target fingerprint: source fingerprint}``.
    """
    muted: dict[str, str] = {}
    for rule in rules:
        sources: dict[tuple[str, ...], str] = {}
        for alert in alerts:
            if alert.state is AlertState.FIRING and matches_all(rule.source, alert.labels):
                key = tuple(alert.labels.get(name, "") for name in rule.equal)
                sources.setdefault(key, alert.fingerprint)
        if not sources:
            continue
        for alert in alerts:
            if alert.fingerprint in muted or not matches_all(rule.target, alert.labels):
                continue
            if matches_all(rule.source, alert.labels):
                continue  # an alert matching both sides cannot inhibit itself
            key = tuple(alert.labels.get(name, "") for name in rule.equal)
            source = sources.get(key)
            if source is not None and source != alert.fingerprint:
                muted[alert.fingerprint] = source
    return muted


class Inhibitor:
    """:func:`inhibited` with the per-alert rule matches cached by fingerprint.

    A fingerprint stands for a label set, so whether an alert matches a rule's
    source or target never changes; only the set of firing alerts does.

    Args:
        rules: Inhibition rules.
    """

    def __init__(self, rules: Sequence[InhibitRule]) -> None:
        self.rules = tuple(rules)
        self._cache: dict[str, tuple[tuple[bool, bool, tuple[str, ...]], ...]] = {}

    def _matches(self, alert: Alert) -> tuple[tuple[bool, bool, tuple[str, ...]], ...]:
        found = self._cache.get(alert.fingerprint)
        if found is None:
            labels = alert.labels
            found = self._cache[alert.fingerprint] = tuple(
                (matches_all(rule.source, labels), matches_all(rule.target, labels),
                 tuple(labels.get(name, "") for name in rule.equal))
                for rule in self.rules
            )
        return found

    def muted(self, alerts: Sequence[Alert]) -> dict[str, str]:
        """Return ``{target fingerprint: source fingerprint}`` for the firing ``alerts``."""
        if len(self._cache) > 4 * len(alerts) + 1024:
            self._cache.clear()
        rows = [(a.fingerprint, self._matches(a)) for a in alerts
                if a.state is AlertState.FIRING]
        muted: dict[str, str] = {}
        for index in range(len(self.rules)):
            sources: dict[tuple[str, ...], str] = {}
            for fp, matches in rows:
                is_source, _, key = matches[index]
                if is_source:
                    sources.setdefault(key, fp)
            if not sources:
                continue
            for fp, matches in rows:
                is_source, is_target, key = matches[index]
                if not is_target or is_source or fp in muted:
                    continue
                source = sources.get(key)
                if source is not None and source != fp:
                    muted[fp] = source
        return muted


@dataclass(slots=True)
class _Group:
    labels: dict[str, str]
    sent: Alert | None = None
    members: list[Alert] = field(default_factory=list)
    acknowledged: bool = False


class PageGrouper:
    """Groups firing alerts into pages, one per group of ``group_by`` label values.

    Args:
        group_by: Labels that make a group (missing labels count as empty).
        page_severity: Lowest severity that pages.
        clock: Returns now, epoch seconds.

    Raises:
        ValueError: ``group_by`` is empty.
    """

    def __init__(
        self,
        *,
        group_by: Sequence[str] = ("cluster", "node"),
        page_severity: Severity = Severity.MAJOR,
        clock: Clock = system_clock,
    ) -> None:
        if not group_by:
            raise ValueError("group_by needs at least one label")
        self.group_by = tuple(group_by)
        self.page_severity = Severity(page_severity)
        self.clock = clock
        self._groups: dict[tuple[str, ...], _Group] = {}

    def _key(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        return tuple(labels.get(name, "") for name in self.group_by)

    def update(
        self,
        firing: Iterable[Alert],
        *,
        silenced: Iterable[str] = (),
        inhibited: Iterable[str] = (),
    ) -> list[Alert]:
        """Account for the alerts firing now; return the pages to send now.

        Args:
            firing: Every alert firing now.
            silenced: Fingerprints muted by a silence (they acknowledge, not resolve).
            inhibited: Fingerprints muted by inhibition (they do not page).

        Returns:
            Pages (alerts named :data:`PAGE_ALERTNAME`): new or escalated groups
            firing, acknowledged ones (annotation ``acknowledged=true``) and
            emptied ones resolved.
        """
        now = self.clock()
        muted = set(silenced)
        blocked = set(inhibited)
        current: dict[tuple[str, ...], list[Alert]] = {}
        for alert in firing:
            if alert.state is not AlertState.FIRING or alert.fingerprint in blocked:
                continue
            rank = _RANK.get(alert.labels.get("severity", ""))
            if rank is None or rank < self.page_severity.rank:
                continue
            current.setdefault(self._key(alert.labels), []).append(alert)
        pages: list[Alert] = []
        for key in [k for k in self._groups if k not in current]:
            gone = self._groups.pop(key)
            if gone.sent is not None:
                pages.append(_page(gone.labels, gone.sent.labels["severity"], gone.members,
                                   state=AlertState.RESOLVED, starts_at=gone.sent.starts_at,
                                   ends_at=now))
        for key, members in current.items():
            group = self._groups.get(key)
            if group is None:
                labels = {name: value for name, value in zip(self.group_by, key, strict=True)
                          if value}
                group = self._groups[key] = _Group(labels=labels)
            members.sort(key=lambda a: (-_RANK[a.labels["severity"]], a.starts_at,
                                        a.fingerprint))
            group.members = members
            worst = members[0].labels["severity"]
            acked = all(a.fingerprint in muted for a in members)
            if group.sent is None:
                if acked:
                    continue  # silenced before it ever paged: never page
                group.sent = _page(group.labels, worst, members, state=AlertState.FIRING,
                                   starts_at=now)
                group.acknowledged = False
                pages.append(group.sent)
            elif worst != group.sent.labels["severity"] or acked != group.acknowledged:
                group.sent = _page(group.labels, worst, members, state=AlertState.FIRING,
                                   starts_at=group.sent.starts_at, acknowledged=acked)
                group.acknowledged = acked
                pages.append(group.sent)
        return pages

    def open_pages(self) -> list[Alert]:
        """Return the pages firing now."""
        return [g.sent for g in self._groups.values() if g.sent is not None]


def _page(
    group_labels: Mapping[str, str],
    severity: str,
    members: Sequence[Alert],
    *,
    state: AlertState,
    starts_at: float,
    ends_at: float | None = None,
    acknowledged: bool = False,
) -> Alert:
    """Build the page of one group (fingerprint from the group labels only)."""
    labels = {"alertname": PAGE_ALERTNAME, **group_labels}
    fp = fingerprint(labels)
    labels["severity"] = severity
    where = group_labels.get("node") or ", ".join(group_labels.values()) or "the fleet"
    top = members[0] if members else None
    lines = [
        f"{a.labels.get('severity', '?')} {a.labels.get('alertname', '?')} "
        f"{a.labels.get('entity', '')}: {a.annotations.get('summary', '')}"
        for a in members[:20]
    ]
    if len(members) > 20:
        lines.append(f"... and {len(members) - 20} more")
    annotations = {
        "summary": (
            f"{severity} on {where}: {top.annotations.get('summary', '')}"
            + (f" (+{len(members) - 1} more)" if len(members) > 1 else "")
            if top is not None
            else f"resolved on {where}"
        ),
        "description": "\n".join(lines),
        "alerts": str(len(members)),
        "fingerprints": ",".join(a.fingerprint for a in members),
    }
    if top is not None:
        for key in ("action", "runbook_url"):
            if key in top.annotations:
                annotations[key] = top.annotations[key]
    if acknowledged:
        annotations["acknowledged"] = "true"
    return Alert(fingerprint=fp, labels=labels, annotations=annotations, state=state,
                 starts_at=starts_at, ends_at=ends_at)
