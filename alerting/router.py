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

import itertools
import logging
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from alerting.alerts import fingerprint
from alerting.silences import Matcher, MatchOp, matches_all
from core.clock import Clock, system_clock
from core.records import Alert, AlertState, Severity

logger = logging.getLogger(__name__)

_RANK = {s.value: s.rank for s in Severity}
_FINGERPRINT = operator.attrgetter("fingerprint")
_STATE = operator.attrgetter("state")

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
    """:func:`inhibited`, kept up to date from one call to the next (incremental).

    A fingerprint stands for a label set, so whether an alert matches a rule's source or
    target never changes; only the set of firing alerts does. The inhibitor keeps, per
    rule and ``equal`` values, the firing sources and targets and the first source (in
    the order the alerts are given, as :func:`inhibited` picks it). At each call it
    compares the firing fingerprints with the last ones: the same list is the same
    answer; otherwise only the alerts added or gone, and the targets of a group whose
    first source changed, are judged again. When the alerts that stay are given in
    another order, or a fingerprint is given twice, it starts again from nothing.

    Args:
        rules: Inhibition rules.

    Attributes:
        touched: Alerts the last :meth:`muted` judged again (added, gone or re-judged).
    """

    def __init__(self, rules: Sequence[InhibitRule]) -> None:
        self.rules = tuple(rules)
        self._cache: dict[str, tuple[tuple[bool, bool, tuple[str, ...]], ...]] = {}
        self._order: list[str] = []
        self._rows: dict[str, tuple[tuple[bool, bool, tuple[str, ...]], ...]] = {}
        self._sources: list[dict[tuple[str, ...], set[str]]] = [{} for _ in self.rules]
        self._targets: list[dict[tuple[str, ...], set[str]]] = [{} for _ in self.rules]
        self._first: list[dict[tuple[str, ...], str]] = [{} for _ in self.rules]
        self._verdicts: dict[str, tuple[int, str]] = {}
        self._result: dict[str, str] = {}
        self.touched = 0

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

    def _reset(self) -> None:
        self._order, self._rows, self._verdicts, self._result = [], {}, {}, {}
        self._sources = [{} for _ in self.rules]
        self._targets = [{} for _ in self.rules]
        self._first = [{} for _ in self.rules]

    def muted(self, alerts: Sequence[Alert]) -> dict[str, str]:
        """Return ``{target fingerprint: source fingerprint}`` for the firing ``alerts``."""
        states = list(map(_STATE, alerts))
        if states.count(AlertState.FIRING) == len(states):  # all firing: listed in C
            order = list(map(_FINGERPRINT, alerts))
        else:
            order = [a.fingerprint for a in alerts if a.state is AlertState.FIRING]
        if order == self._order:
            self.touched = 0
            return dict(self._result)
        if len(self._cache) > 4 * len(alerts) + 1024:
            self._cache.clear()
        now = set(order)
        rows = self._rows
        added = now - rows.keys()
        gone = rows.keys() - now
        if len(now) != len(order) or (
                (list(itertools.filterfalse(added.__contains__, order)) if added else order)
                != (list(itertools.filterfalse(gone.__contains__, self._order)) if gone
                    else self._order)):
            self._reset()  # reordered or repeated: judge all again
            rows, added, gone = self._rows, now, set()
        positions: dict[str, int] | None = None
        judge: set[str] = set()
        changed: set[tuple[int, tuple[str, ...]]] = set()
        for fp in gone:
            for index, (is_source, is_target, key) in enumerate(rows.pop(fp)):
                if is_source:
                    self._sources[index][key].discard(fp)
                    changed.add((index, key))
                elif is_target:
                    targets = self._targets[index][key]
                    targets.discard(fp)
                    if not targets:
                        del self._targets[index][key]
            self._verdicts.pop(fp, None)
        if added:
            for alert in alerts:
                fp = alert.fingerprint
                if fp not in added or fp in rows or alert.state is not AlertState.FIRING:
                    continue
                matches = rows[fp] = self._matches(alert)
                for index, (is_source, is_target, key) in enumerate(matches):
                    if is_source:
                        self._sources[index].setdefault(key, set()).add(fp)
                        changed.add((index, key))
                    elif is_target:
                        self._targets[index].setdefault(key, set()).add(fp)
                        judge.add(fp)
        for index, key in changed:
            sources = self._sources[index].get(key)
            if not sources:
                self._sources[index].pop(key, None)
                first = None
            elif len(sources) == 1:
                first = next(iter(sources))
            else:
                if positions is None:
                    positions = _positions(order)
                first = min(sources, key=positions.__getitem__)
            if first != self._first[index].get(key):
                if first is None:
                    del self._first[index][key]
                else:
                    self._first[index][key] = first
                judge.update(self._targets[index].get(key, ()))
        verdicts = self._verdicts
        moved = bool(gone & self._result.keys())
        for fp in judge:
            verdict = self._verdict(rows[fp])
            if verdict != verdicts.get(fp):
                moved = True
                if verdict is None:
                    del verdicts[fp]
                else:
                    verdicts[fp] = verdict
        self.touched = len(gone) + len(judge | added)
        self._order = order
        if moved:  # as inhibited() lists them: by rule, then in the order of the alerts
            if positions is None:
                positions = _positions(order)
            at = positions
            self._result = {fp: source for fp, (_, source) in sorted(
                verdicts.items(), key=lambda item: (item[1][0], at[item[0]]))}
        return dict(self._result)

    def _verdict(self, matches: tuple[tuple[bool, bool, tuple[str, ...]], ...]
                 ) -> tuple[int, str] | None:
        """The first rule that mutes an alert with these matches, and its source."""
        for index, (is_source, is_target, key) in enumerate(matches):
            if is_target and not is_source:
                source = self._first[index].get(key)
                if source is not None:
                    return index, source
        return None


def _positions(order: Sequence[str]) -> dict[str, int]:
    """Each fingerprint's first place in ``order``."""
    return dict(zip(reversed(order), range(len(order) - 1, -1, -1), strict=True))


@dataclass(slots=True)
class _Group:
    labels: dict[str, str]
    sent: Alert | None = None
    members: list[Alert] = field(default_factory=list)
    acknowledged: bool = False
    order: int = 0


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
        self._given: dict[str, Alert] | None = None
        self._muted: set[str] = set()
        self._blocked: set[str] = set()
        self._members: dict[tuple[str, ...], dict[str, Alert]] = {}
        self._group_of: dict[str, tuple[str, ...]] = {}
        self._made = 0
        self.touched = 0
        """Alerts the last :meth:`update` looked at again (incremental evaluation)."""

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

        Incremental: only the groups of alerts that are new, changed (another object),
        gone, or newly muted or unmuted are looked at again; the pages are those that
        looking at every alert would send.

        Args:
            firing: Every alert firing now.
            silenced: Fingerprints muted by a silence (they acknowledge, not resolve).
            inhibited: Fingerprints muted by inhibition (they do not page).

        Returns:
            Pages (alerts named :data:`PAGE_ALERTNAME`): new or escalated groups
            firing, acknowledged ones (annotation ``acknowledged=true``) and
            emptied ones resolved.
        """
        alerts = list(firing)
        muted = set(silenced)
        blocked = set(inhibited)
        given = dict(zip(map(_FINGERPRINT, alerts), alerts, strict=True))
        if len(given) != len(alerts) or self._given is None:
            every = self._update_all(alerts, silenced=muted, inhibited=blocked)
            self._remember(given, muted, blocked)
            if len(given) != len(alerts):
                self._given = None  # an alert given twice: the next call looks at all too
            return every
        seen = self._given
        changed = set(itertools.compress(  # new or another object: compared in C
            given, map(operator.is_not, map(seen.get, given), given.values())))
        changed |= seen.keys() - given.keys()
        changed |= (muted ^ self._muted) | (blocked ^ self._blocked)
        self.touched = len(changed)
        dirty: set[tuple[str, ...]] = set()
        for fp in changed:
            old_key = self._group_of.pop(fp, None)
            if old_key is not None:
                self._members[old_key].pop(fp, None)
                dirty.add(old_key)
            alert = given.get(fp)
            if alert is None or not self._pages(alert, blocked):
                continue
            key = self._key(alert.labels)
            self._group_of[fp] = key
            self._members.setdefault(key, {})[fp] = alert
            dirty.add(key)
        self._remember(given, muted, blocked, members=False)
        if not dirty:
            return []
        now = self.clock()
        pages: list[Alert] = []
        live: list[tuple[int, tuple[str, ...], list[Alert]]] = []
        emptied = sorted((g.order, k) for k in dirty if not self._members.get(k)
                         and (g := self._groups.get(k)) is not None)
        for _, key in emptied:  # in the order the groups were made, as before
            self._members.pop(key, None)
            gone = self._groups.pop(key)
            if gone.sent is not None:
                pages.append(_page(gone.labels, gone.sent.labels["severity"], gone.members,
                                   state=AlertState.RESOLVED, starts_at=gone.sent.starts_at,
                                   ends_at=now))
        for key in dirty:
            members_of = self._members.get(key)
            if not members_of:
                self._members.pop(key, None)
                continue
            live.append((0, key, list(members_of.values())))
        if len(live) > 1:  # as the groups first appear among the alerts (picked out in C)
            group_of = self._group_of
            wanted = {a.fingerprint for _, _, members in live for a in members}
            rank: dict[tuple[str, ...], int] = {}
            for fp in itertools.compress(given, map(wanted.__contains__, given)):
                rank.setdefault(group_of[fp], len(rank))
            live = sorted((rank[key], key, members) for _, key, members in live)
        for _, key, members in live:
            self._page_group(key, members, muted, pages, now)
        return pages

    def _update_all(self, firing: Iterable[Alert], *, silenced: Iterable[str] = (),
                    inhibited: Iterable[str] = ()) -> list[Alert]:
        """:meth:`update`, looking at every alert (the first call, or alerts given twice)."""
        now = self.clock()
        muted = set(silenced)
        blocked = set(inhibited)
        current: dict[tuple[str, ...], list[Alert]] = {}
        for alert in firing:
            if self._pages(alert, blocked):
                current.setdefault(self._key(alert.labels), []).append(alert)
        pages: list[Alert] = []
        for key in [k for k in self._groups if k not in current]:
            gone = self._groups.pop(key)
            if gone.sent is not None:
                pages.append(_page(gone.labels, gone.sent.labels["severity"], gone.members,
                                   state=AlertState.RESOLVED, starts_at=gone.sent.starts_at,
                                   ends_at=now))
        for key, members in current.items():
            self._page_group(key, members, muted, pages, now)
        self.touched = sum(len(m) for m in current.values())
        return pages

    def _pages(self, alert: Alert, blocked: set[str]) -> bool:
        """Whether ``alert`` counts towards its group's page."""
        if alert.state is not AlertState.FIRING or alert.fingerprint in blocked:
            return False
        rank = _RANK.get(alert.labels.get("severity", ""))
        return rank is not None and rank >= self.page_severity.rank

    def _remember(self, given: dict[str, Alert], muted: set[str], blocked: set[str], *,
                  members: bool = True) -> None:
        self._given, self._muted, self._blocked = given, muted, blocked
        if members:
            self._members = {}
            self._group_of = {}
            for fp, alert in given.items():
                if self._pages(alert, blocked):
                    key = self._group_of[fp] = self._key(alert.labels)
                    self._members.setdefault(key, {})[fp] = alert

    def _page_group(self, key: tuple[str, ...], members: list[Alert], muted: set[str],
                    pages: list[Alert], now: float) -> None:
        """Decide the page of one group with these (unsorted) members."""
        group = self._groups.get(key)
        if group is None:
            labels = {name: value for name, value in zip(self.group_by, key, strict=True)
                      if value}
            self._made += 1
            group = self._groups[key] = _Group(labels=labels, order=self._made)
        members.sort(key=lambda a: (-_RANK[a.labels["severity"]], a.starts_at,
                                    a.fingerprint))
        group.members = members
        worst = members[0].labels["severity"]
        acked = all(a.fingerprint in muted for a in members)
        if group.sent is None:
            if acked:
                return  # silenced before it ever paged: never page
            group.sent = _page(group.labels, worst, members, state=AlertState.FIRING,
                               starts_at=now)
            group.acknowledged = False
            pages.append(group.sent)
        elif worst != group.sent.labels["severity"] or acked != group.acknowledged:
            group.sent = _page(group.labels, worst, members, state=AlertState.FIRING,
                               starts_at=group.sent.starts_at, acknowledged=acked)
            group.acknowledged = acked
            pages.append(group.sent)

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
