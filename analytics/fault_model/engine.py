"""Observation bookkeeping, the rule runner and the merging of findings."""

from __future__ import annotations

import importlib
import itertools
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeAlias

from core.records import (
    Action,
    Anomaly,
    EntityId,
    Event,
    Evidence,
    FeatureVector,
    Finding,
    NodeName,
    Record,
    Sample,
    Severity,
)
from core.series import SeriesMemo

MAX_EVIDENCE = 12
"""Evidence lines kept per event group and per finding: the first ones and the last ones."""

MAX_EVENTS = 16
"""Events kept per group (first ones) for rules that look at details; the count is exact."""

MAX_ATTR_VALUES = 32
"""Distinct values kept per attribute per group (process names, links...)."""

RULE_MODULES = (
    "analytics.fault_model.xid",
    "analytics.fault_model.host",
    "analytics.fault_model.gpu",
    "analytics.fault_model.network",
)
"""Modules whose ``RULES`` tuples make up the fault model."""


_YES = frozenset({"expected", "present", "yes", "true"})
_NO = frozenset({"absent", "no", "none", "false"})
_UNKNOWN = frozenset({"unknown", ""})


def _is_choice(value: str) -> bool:
    return value.strip().lower() in _YES | _NO | _UNKNOWN


def _is_positive_number(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False


def _is_port_list(value: str) -> bool:
    return all(item.strip() for item in value.split(","))


KNOWN_FACTS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "node": ("node name the input belongs to", lambda v: bool(v.strip())),
    "cluster": ("cluster name, for grouping pages", lambda v: bool(v.strip())),
    "nvlink": ("whether the GPUs have NVLink: expected|absent|unknown", _is_choice),
    "nvswitch": ("whether the board has NVSwitches: present|absent|unknown", _is_choice),
    "ib_unused": ("InfiniBand ports not cabled on purpose: mlx5_1:1,mlx5_2", _is_port_list),
    "expected_busbw_gbps": ("nccl-tests bus bandwidth expected, GB/s", _is_positive_number),
    "driver_version": ("NVIDIA driver version of the node", lambda v: bool(v.strip())),
    "switch": ("leaf switch the node is cabled to (fleet incidents)", lambda v: bool(v.strip())),
    "rack": ("rack of the node (fleet incidents)", lambda v: bool(v.strip())),
}
"""Facts the rules read, with what each means and a check of its value."""

LINK_FACT = "link:"
"""Facts ``link:<port>`` = ``<peer node>:<peer port>``: the other end of a port's cable
(the controller makes both ends' findings one incident)."""


def _is_link_end(value: str) -> bool:
    peer, sep, port = value.strip().rpartition(":")
    return bool(sep and peer and port)


def check_facts(facts: Mapping[str, str]) -> list[str]:
    """Return one problem per unknown fact or invalid value; ``[]`` when all are fine.

    Examples:
        >>> check_facts({"nvlink": "absent"})
        []
        >>> check_facts({"nvlnk": "absent"})[0].startswith("unknown fact 'nvlnk'; known: cluster")
        True
    """
    problems: list[str] = []
    for key, value in facts.items():
        if key.startswith(LINK_FACT):
            if not key[len(LINK_FACT):].strip() or not _is_link_end(value):
                problems.append(f"fact {key}={value!r} is invalid: link:<port> = "
                                "\"<peer node>:<peer port>\" (link:mlx5_0/1 = \"gpu-02:mlx5_0/1\")")
            continue
        known = KNOWN_FACTS.get(key)
        if known is None:
            problems.append(f"unknown fact {key!r}; known: {', '.join(sorted(KNOWN_FACTS))}")
        elif not known[1](value):
            problems.append(f"fact {key}={value!r} is invalid: {known[0]}")
    return problems


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """Machine facts that are not in the records, and the clock.

    Attributes:
        facts: ``--context KEY=VALUE`` pairs or the inventory of ``run``
            (``nvlink=expected|absent``, ``node=...``, ``ib_unused=mlx5_1:1,...``).
        now: Epoch seconds of the evaluation.
    """

    facts: Mapping[str, str] = field(default_factory=dict)
    now: float = 0.0

    def fact(self, key: str) -> str | None:
        """Return the fact ``key`` lower-cased, or ``None``."""
        value = self.facts.get(key)
        return value.strip().lower() if value is not None else None


@dataclass(slots=True)
class EventGroup:
    """All events of one ``(node, entity, kind, code)``: one ongoing thing.

    Attributes:
        first: The first event seen.
        count: Exact number of events.
        first_seen_at: Earliest ``observed_at``, or ``None``.
        last_seen_at: Latest ``observed_at``, or ``None``.
        events: The first :data:`MAX_EVENTS` events.
        evidence: Up to :data:`MAX_EVIDENCE` lines: the first ones, then the latest.
        attr_values: Distinct values seen per attribute (capped).
        received_at: When the live service last received one of its events, or ``None``.
    """

    first: Event
    count: int = 0
    first_seen_at: float | None = None
    last_seen_at: float | None = None
    events: list[Event] = field(default_factory=list)
    evidence: list[Evidence] = field(default_factory=list)
    attr_values: dict[str, set[str]] = field(default_factory=dict)
    received_at: float | None = None

    @property
    def node(self) -> NodeName:
        """Node of the group."""
        return self.first.node

    @property
    def entity(self) -> EntityId:
        """Entity of the group."""
        return self.first.entity

    @property
    def kind(self) -> str:
        """Event kind of the group."""
        return self.first.kind

    @property
    def code(self) -> str:
        """Event code of the group."""
        return self.first.code

    def add(self, event: Event) -> None:
        """Account for one more event."""
        self.count += 1
        at = event.observed_at
        if at is not None:
            if self.first_seen_at is None or at < self.first_seen_at:
                self.first_seen_at = at
            if self.last_seen_at is None or at > self.last_seen_at:
                self.last_seen_at = at
        if len(self.events) < MAX_EVENTS:
            self.events.append(event)
        for key, value in event.attrs.items():
            values = self.attr_values.setdefault(key, set())
            if len(values) < MAX_ATTR_VALUES:
                values.add(value)
        keep_evidence(self.evidence, event.evidence)


def keep_evidence(kept: list[Evidence], new: Iterable[Evidence]) -> None:
    """Append ``new`` to ``kept``, keeping the first half and the latest lines."""
    head = MAX_EVIDENCE // 2
    for item in new:
        if item in kept:
            continue
        if len(kept) >= MAX_EVIDENCE:
            del kept[head]
        kept.append(item)


SeriesKey: TypeAlias = tuple[str, str, str, tuple[tuple[str, str], ...]]


class Observations:
    """Bounded-memory summary of the records seen so far."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str, str, str], EventGroup] = {}
        self.samples: dict[SeriesKey, Sample] = {}
        self.by_metric: dict[str, dict[SeriesKey, Sample]] = {}
        """:attr:`samples` per metric, in the same order (rules read one metric at a time)."""
        self.counter_increase: dict[SeriesKey, float] = {}
        """How much each timed counter (``*_total``) rose since its first reading (resets
        counted as Prometheus ``increase()`` counts them); absent after one reading."""
        self.records = 0
        self._series: SeriesMemo[tuple[SeriesKey, dict[SeriesKey, Sample], bool]] = (
            SeriesMemo())
        """Per series: its key, its metric's :attr:`by_metric` entry, whether a counter."""

    def add(self, record: Record, *, received_at: float | None = None) -> None:
        """Account for one record.

        Args:
            record: A sample or an event.
            received_at: When the live service received it, epoch seconds; an event
                group stays open at least a window after it (see :meth:`expire`).
        """
        self.records += 1
        if isinstance(record, Event):
            key = (record.node, record.entity, record.kind, record.code)
            group = self.groups.get(key)
            if group is None:
                group = self.groups[key] = EventGroup(first=record)
            group.add(record)
            if received_at is not None:
                group.received_at = max(group.received_at or received_at, received_at)
        else:
            known = self._series.get(record)
            if known is None:
                labels = tuple(sorted(record.labels.items())) if record.labels else ()
                series: SeriesKey = (record.node, record.entity, record.metric, labels)
                of_metric = self.by_metric.get(record.metric)
                if of_metric is None:
                    of_metric = self.by_metric[record.metric] = {}
                known = (series, of_metric, record.metric.endswith("_total"))
                self._series.put(record, known)
            series, of_metric, counter = known
            previous = self.samples.get(series)
            self.samples[series] = record
            of_metric[series] = record
            if (counter and previous is not None and record.observed_at is not None
                    and previous.observed_at is not None):
                v, before = record.value, previous.value
                step = v - before if v >= before else v  # a drop: the counter restarted
                self.counter_increase[series] = self.counter_increase.get(series, 0.0) + step

    def expire(self, before_at: float) -> int:
        """Forget event groups last seen before ``before_at`` (epoch seconds); return how many.

        A group's time is the later of its last ``observed_at`` and when it was last
        received, so an old log line read now stays open a window from now. Groups
        without a time (snapshots of pasted artifacts) never expire. The live service
        calls this so that a fault that stopped recurring resolves; states that persist
        are re-observed by the collectors and stay.
        """
        stale = [
            key
            for key, group in self.groups.items()
            if group.last_seen_at is not None
            and max(group.last_seen_at, group.received_at or group.last_seen_at) < before_at
        ]
        for key in stale:
            del self.groups[key]
        return len(stale)

    def forget(self, node: str, entity: str | None = None) -> int:
        """Forget the event groups of ``node`` (of one ``entity`` only, if given).

        What a person marking the node healthy asks for (``gpuhealth mark-healthy``): the
        events are history; states (samples) are read again by the collectors and stay.
        Returns how many groups were forgotten.
        """
        gone = [k for k, g in self.groups.items()
                if g.node == node and (entity is None or g.entity == entity)]
        for key in gone:
            del self.groups[key]
        return len(gone)

    def extend(self, records: Iterable[Record]) -> None:
        """Account for many records."""
        for record in records:
            self.add(record)

    def events(
        self,
        kind: str | None = None,
        code: str | None = None,
        *,
        node: str | None = None,
        entity: str | None = None,
    ) -> list[EventGroup]:
        """Return the event groups that match every given field, in first-seen order."""
        return [
            g
            for g in self.groups.values()
            if (kind is None or g.kind == kind)
            and (code is None or g.code == code)
            and (node is None or g.node == node)
            and (entity is None or g.entity == entity)
        ]

    def samples_of(self, metric: str, *, node: str | None = None) -> list[Sample]:
        """Return the latest sample of every series of ``metric``."""
        return [
            s
            for (n, _e, _m, _l), s in self.by_metric.get(metric, {}).items()
            if node is None or n == node
        ]


Rule: TypeAlias = Callable[[Observations, Context], Iterable[Finding]]


def all_rules() -> tuple[Rule, ...]:
    """Return every rule of the modules in :data:`RULE_MODULES`, in order."""
    rules: list[Rule] = []
    for name in RULE_MODULES:
        module = importlib.import_module(name)
        rules.extend(module.RULES)
    return tuple(rules)


def worst(findings: Sequence[Finding]) -> tuple[Severity, list[Action]]:
    """Return the worst severity and the sorted unique actions of the findings that carry it.

    ``(info, [none])`` when there are no findings (fault-model.md, diagnose contract).

    Examples:
        >>> worst([])
        (<Severity.INFO: 'info'>, [<Action.NONE: 'none'>])
    """
    if not findings:
        return Severity.INFO, [Action.NONE]
    top = max(findings, key=lambda f: f.severity.rank).severity
    actions = sorted({f.action for f in findings if f.severity == top})
    return top, actions


def merge_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Merge findings about the same ongoing fault and sort them worst first.

    Findings with the same ``(node, entity, kind, code)`` become one: the worse
    severity (and its action) wins, evidence is joined (capped), times span both,
    occurrences add up. The order is severity, then first time seen, then entity.
    """
    return sorted(_merged(findings).values(), key=_order_key)


def _merged(findings: Iterable[Finding]) -> dict[tuple[str, str, str, str], Finding]:
    """Return the findings merged per key (:func:`merge_findings` without the sort)."""
    found = findings if isinstance(findings, list) else list(findings)
    merged = {finding.key: finding for finding in found}
    if len(merged) == len(found):
        return merged  # no two about the same fault (the usual case): nothing to merge
    merged.clear()
    for finding in found:
        key = finding.key
        old = merged.get(key)
        if old is None:
            merged[key] = finding
            continue
        top = finding if finding.severity.rank > old.severity.rank else old
        evidence = list(old.evidence)
        keep_evidence(evidence, finding.evidence)
        merged[key] = replace(
            top,
            evidence=tuple(evidence),
            first_seen_at=_min(old.first_seen_at, finding.first_seen_at),
            last_seen_at=_max(old.last_seen_at, finding.last_seen_at),
            occurrences=old.occurrences + finding.occurrences,
        )
    return merged


_OrderKey: TypeAlias = tuple[int, float, str, str, str, str]


def _order_key(f: Finding) -> _OrderKey:
    """The order of :func:`merge_findings`: severity, first time seen, then the fault's key."""
    return (
        -f.severity.rank,
        f.first_seen_at if f.first_seen_at is not None else float("inf"),
        f.node,
        f.entity,
        f.kind,
        f.code,
    )


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass(frozen=True, slots=True)
class Fold:
    """A symptom that belongs to a root finding on the same GPU (one incident per fault).

    Attributes:
        symptom: ``(kind, code)`` of the finding that is folded; ``code`` ``None``
            matches any code of the kind.
        roots: ``(kind, code)`` pairs it folds into, tried in order.
        window_seconds: Largest gap between the two first times; ``None`` when the
            state is the same fault whatever the time (a remap pending is the state an
            Xid 63 announced).
        note: Why, as the fault model or NVIDIA's documents say.
    """

    symptom: tuple[str, str | None]
    roots: tuple[tuple[str, str | None], ...]
    window_seconds: float | None
    note: str


FOLDS: tuple[Fold, ...] = (
    Fold(
        symptom=("xid", "154"),
        roots=(("xid", None), ("gpu_lost", None), ("gsp_error", None),
               ("gsp_rpc_timeout", None), ("gpu_init_failure", None)),
        window_seconds=120.0,
        note="Xid 154 is the driver's summary of the recovery action the preceding Xid "
        "needs (Xid catalog, XID_154)",
    ),
    Fold(
        symptom=("xid", "63"),
        roots=(("row_remap", "failure"), ("row_remap", "pending")),
        window_seconds=None,
        note="Xid 63 records the row remap that nvidia-smi/NVML show pending "
        "(NVIDIA memory error management)",
    ),
    Fold(
        symptom=("ecc", "dram_uncorrectable"),
        roots=(("row_remap", "failure"), ("row_remap", "pending"), ("xid", "48"),
               ("xid", "94"), ("xid", "95")),
        window_seconds=None,
        note="the uncorrectable DRAM error is what the remap or the Xid reports "
        "(NVIDIA memory error management)",
    ),
    Fold(
        symptom=("xid", "94"),
        roots=(("row_remap", "failure"), ("row_remap", "pending")),
        window_seconds=None,
        note="a contained error leaves its row remap pending until reset "
        "(NVIDIA memory error management)",
    ),
    Fold(
        symptom=("xid", "64"),
        roots=(("xid", "48"),),
        window_seconds=60.0,
        note="the page retirement that failed is the one the DBE asked for (Xid catalog, "
        "WORKFLOW_XID_48)",
    ),
)
"""Symptom-to-root folds applied after the rules (fault-model.md, "Root cause over symptoms")."""

_ACTION_STRENGTH = {
    Action.NONE: 0,
    Action.RESTART_APP: 1,
    Action.RESET_GPU: 2,
    Action.REBOOT_NODE: 3,
    Action.SERVICE_HARDWARE: 4,
}


def _matches(finding: Finding, kind: str, code: str | None) -> bool:
    return finding.kind == kind and (code is None or finding.code == code)


def _close_in_time(a: Finding, b: Finding, window: float | None) -> bool:
    if window is None or a.first_seen_at is None or b.first_seen_at is None:
        return True
    return abs(a.first_seen_at - b.first_seen_at) <= window


def _covers(root: Finding, symptom: Finding) -> bool:
    """True when acting on ``root`` also deals with ``symptom``."""
    if root.severity.rank < symptom.severity.rank:
        return False
    if root.action == symptom.action:
        return True
    strength_root = _ACTION_STRENGTH.get(root.action)
    strength_symptom = _ACTION_STRENGTH.get(symptom.action)
    return (
        strength_root is not None
        and strength_symptom is not None
        and strength_root >= strength_symptom
    )


def fold_symptoms(findings: Sequence[Finding], folds: Sequence[Fold] = FOLDS) -> list[Finding]:
    """Fold symptom findings into their root finding on the same node and entity.

    A symptom is folded only when a matching root exists within the fold's time
    window and acting on the root also deals with the symptom (same or stronger
    action, same or higher severity); otherwise both stay, so nothing is hidden.
    The root keeps its severity and action and gains the symptom's evidence
    (capped); a folded state (no time window) also widens the root's time span.
    """
    result: list[Finding | None] = list(findings)
    # Roots are looked for among the findings of the symptom's own node and entity only:
    # linear in the findings (an index per (node, entity)), not quadratic.
    groups: dict[tuple[str, str], list[int]] = {}
    for index, finding in enumerate(findings):
        groups.setdefault((finding.node, finding.entity), []).append(index)
    for fold in folds:
        for i, symptom in enumerate(result):
            if symptom is None or not _matches(symptom, *fold.symptom):
                continue
            members = groups[(symptom.node, symptom.entity)]
            found = next(
                (
                    (j, r)
                    for kind, code in fold.roots
                    for j in members
                    if j != i
                    and (r := result[j]) is not None
                    and _matches(r, kind, code)
                    and _close_in_time(r, symptom, fold.window_seconds)
                    and _covers(r, symptom)
                ),
                None,
            )
            if found is None:
                continue
            j, root = found
            evidence = list(root.evidence)
            keep_evidence(evidence, symptom.evidence)
            spans = fold.window_seconds is None  # a state folds whole; an event keeps its time
            result[j] = replace(
                root,
                evidence=tuple(evidence),
                first_seen_at=(
                    _min(root.first_seen_at, symptom.first_seen_at) if spans
                    else root.first_seen_at
                ),
                last_seen_at=(
                    _max(root.last_seen_at, symptom.last_seen_at) if spans
                    else root.last_seen_at
                ),
                source=f"{root.source}; folded {symptom.kind} {symptom.code}: {fold.note}",
            )
            result[i] = None
    return [f for f in result if f is not None]


_Key: TypeAlias = tuple[str, str, str, str]
_Group: TypeAlias = tuple[str, str]


class FindingFolder:
    """``merge_findings(fold_symptoms(merge_findings(found)))``, kept from one call to the next.

    Evaluation is incremental: a symptom folds only into a root of its own node and
    entity, so what one ``(node, entity)`` group folds into depends on that group's
    findings alone. The folder keeps each fault's merged finding, each group's folded
    findings and the sorted result. At each :meth:`fold` it merges the findings as
    :func:`merge_findings` does and compares each with the one it had (the same object or
    an equal one is no change); only the groups with a finding added, changed or removed
    are folded again, and only their findings move in the sorted result. The result is
    the list the three stateless calls give, in the same order (``tests/unit/
    test_incremental_evaluation.py`` checks it on random sequences of finding sets).

    Attributes:
        folded: Findings folded again by the last :meth:`fold` (those of changed groups).
        moved: Findings taken out of or put into the sorted result by the last call.
    """

    def __init__(self, folds: Sequence[Fold] = FOLDS) -> None:
        self.folds = tuple(folds)
        self._inputs: dict[_Key, Finding] = {}
        self._members: dict[_Group, dict[_Key, Finding]] = {}
        self._outputs: dict[_Group, list[Finding]] = {}
        self._sorted = _SortedFindings()
        self._given: dict[int, Finding] | None = None
        """The last findings by ``id`` (held, so no id is reused); ``None``: compare all."""
        self.folded = 0
        self.moved = 0

    def fold(self, findings: Iterable[Finding]) -> list[Finding]:
        """Return the current findings merged, folded and sorted worst first.

        Args:
            findings: Every finding that holds now (not only the changed ones).
        """
        found = findings if isinstance(findings, list) else list(findings)
        by_id = dict(zip(map(id, found), found, strict=True))
        changes = None
        if self._given is not None and len(by_id) == len(found):
            changes = self._changes(found, by_id)
        inputs, members = self._inputs, self._members
        if changes is None:  # compare every merged finding with the one held
            merged = _merged(found)
            updates, gone = merged, inputs.keys() - merged.keys()
            # The next call compares objects, unless two findings were merged into one.
            self._given = by_id if len(merged) == len(found) else None
        else:
            updates, gone = changes
            self._given = by_id
        dirty: set[_Group] = set()
        for key, finding in updates.items():
            old = inputs.get(key)
            inputs[key] = finding
            if old is finding or (old is not None and old == finding):
                continue
            group = (key[0], key[1])
            dirty.add(group)
            of_group = members.get(group)
            if of_group is None:
                of_group = members[group] = {}
            of_group[key] = finding
        for key in gone:
            del inputs[key]
            group = (key[0], key[1])
            dirty.add(group)
            del members[group][key]
        removed: list[Finding] = []
        added: list[tuple[_OrderKey, Finding]] = []
        folded = 0
        for group in dirty:
            before = self._outputs.get(group, [])
            of_group = members.get(group)
            if of_group:
                ordered = sorted(of_group.values(), key=_order_key)
                folded += len(ordered)
                after = fold_symptoms(ordered, self.folds)
            else:
                members.pop(group, None)
                after = []
            if after == before:
                continue  # the old objects stay (they are what the sorted result holds)
            if after:
                self._outputs[group] = after
            else:
                self._outputs.pop(group, None)
            removed.extend(before)
            added.extend((_order_key(f), f) for f in after)
        self.folded = folded
        self.moved = len(removed) + len(added)
        ordered_result = self._sorted
        if self.moved > len(ordered_result) // 4:
            ordered_result.reset(itertools.chain.from_iterable(self._outputs.values()))
        else:
            for finding in removed:
                ordered_result.remove(finding)
            for key_finding in added:
                ordered_result.add(*key_finding)
        return ordered_result.findings()


    def _changes(self, found: list[Finding], by_id: dict[int, Finding]
                 ) -> tuple[dict[_Key, Finding], set[_Key]] | None:
        """The findings new since the last call by identity, and the faults gone.

        ``None`` when many changed or a new finding shares its fault with another (they
        are merged: every finding is looked at).
        """
        last = self._given
        assert last is not None
        new_ids = by_id.keys() - last.keys()
        gone_ids = last.keys() - by_id.keys()
        if 4 * (len(new_ids) + len(gone_ids)) > len(found) + 64:
            return None
        inputs = self._inputs
        updates: dict[_Key, Finding] = {}
        for i in new_ids:
            finding = by_id[i]
            key = finding.key
            held = inputs.get(key)
            if key in updates or (held is not None and id(held) not in gone_ids):
                return None
            updates[key] = finding
        gone: set[_Key] = set()
        for i in gone_ids:
            finding = last[i]
            key = finding.key
            if inputs.get(key) is finding and key not in updates:
                gone.add(key)
        return updates, gone


class _SortedFindings:
    """Findings in :func:`_order_key` order, kept in chunks so that one moves in a chunk."""

    CHUNK = 256

    def __init__(self) -> None:
        self._keys: list[list[_OrderKey]] = []
        self._items: list[list[Finding]] = []
        self._last: list[_OrderKey] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def reset(self, findings: Iterable[Finding]) -> None:
        """Hold ``findings`` (with unique keys) only."""
        pairs = sorted(((_order_key(f), f) for f in findings), key=_first)
        step = self.CHUNK
        self._keys = [[k for k, _ in pairs[i:i + step]] for i in range(0, len(pairs), step)]
        self._items = [[f for _, f in pairs[i:i + step]] for i in range(0, len(pairs), step)]
        self._last = [keys[-1] for keys in self._keys]
        self._size = len(pairs)

    def remove(self, finding: Finding) -> None:
        """Take out ``finding`` (it is held)."""
        key = _order_key(finding)
        chunk = bisect_left(self._last, key)
        keys, items = self._keys[chunk], self._items[chunk]
        at = bisect_left(keys, key)
        del keys[at], items[at]
        self._size -= 1
        if not keys:
            del self._keys[chunk], self._items[chunk], self._last[chunk]
        elif at == len(keys):
            self._last[chunk] = keys[-1]

    def add(self, key: _OrderKey, finding: Finding) -> None:
        """Put in ``finding``, whose order key is ``key`` (no held finding has it)."""
        self._size += 1
        if not self._last:
            self._keys, self._items, self._last = [[key]], [[finding]], [key]
            return
        chunk = min(bisect_left(self._last, key), len(self._last) - 1)
        keys, items = self._keys[chunk], self._items[chunk]
        at = bisect_left(keys, key)
        keys.insert(at, key)
        items.insert(at, finding)
        if at == len(keys) - 1:
            self._last[chunk] = key
        if len(keys) > 2 * self.CHUNK:
            half = self.CHUNK
            self._keys[chunk:chunk + 1] = [keys[:half], keys[half:]]
            self._items[chunk:chunk + 1] = [items[:half], items[half:]]
            self._last[chunk:chunk + 1] = [keys[half - 1], keys[-1]]

    def findings(self) -> list[Finding]:
        """Return the findings held, in order."""
        return list(itertools.chain.from_iterable(self._items))


def _first(entry: tuple[_OrderKey, Finding]) -> _OrderKey:
    return entry[0]


_FOLDERS: weakref.WeakKeyDictionary[Observations, FindingFolder] = weakref.WeakKeyDictionary()
"""The folder of each :class:`Observations` that :func:`evaluate` was given."""


def evaluate(
    observations: Observations, context: Context, rules: Sequence[Rule] | None = None
) -> list[Finding]:
    """Run the rules over the observations; return root findings, worst first.

    Findings about the same fault merge (:func:`merge_findings`), then symptoms fold
    into their root (:func:`fold_symptoms`).
    """
    found: list[Finding] = []
    for rule in rules if rules is not None else all_rules():
        found.extend(rule(observations, context))
    # Incremental: the same observations evaluated again fold only what changed since.
    folder = _FOLDERS.get(observations)
    if folder is None:
        folder = _FOLDERS[observations] = FindingFolder()
    return folder.fold(found)


class FaultRuleDetector:
    """The rule-based fault model behind the ``gpuhealth.detectors`` Protocol.

    It turns no feature vector into an anomaly (rules act on events and states,
    see :func:`evaluate`); it is registered so that ``plugins list`` shows the
    fault model beside the statistical detectors.
    """

    name = "fault_rules"

    def observe(self, x: FeatureVector) -> Anomaly | None:
        """Return ``None``: rules do not score numeric feature vectors."""
        del x
        return None
