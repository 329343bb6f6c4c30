"""Fleet-wide correlation: many nodes failing under one switch or driver version is one fault.

NVSentinel and operators' runbooks agree on the pattern: when several nodes that share a
leaf switch, a driver version or a rack fail within minutes, the cause is the shared part,
and draining every node would only take the fleet down with it. :class:`FleetCorrelator`
watches the findings the controller holds; when at least ``min_nodes`` distinct nodes
sharing one value of a correlation attribute (``switch``, ``driver_version``, ``rack``:
facts the agents report from their ``[inventory]``) have ``major`` or worse findings first
seen within ``window_seconds``, it reports one :class:`FleetEvent` with one fleet finding
(node ``fleet``, entity ``<attribute>:<value>``, kind ``fleet``, ``major``, action none:
notify and page, never a step), and the controller opens the circuit breaker so the nodes'
own remediation waits for a human. The event is reported once while it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from core.records import Action, EntityId, Evidence, Finding, NodeName, Severity

FLEET_NODE = NodeName("fleet")
"""The node name of fleet findings (no real node is remediated for them)."""

FLEET_KIND = "fleet"
IGNORED_KINDS = frozenset({FLEET_KIND, "agent", "prediction", "anomaly"})
"""Findings that never count toward a fleet event: their own kind, silence, statistics."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetEvent:
    """Many nodes under one shared part failing together.

    Attributes:
        attribute: The shared attribute (``switch``).
        value: Its value (``leaf-12``).
        nodes: The failing nodes, sorted.
        finding: The fleet finding that stands for them.
    """

    attribute: str
    value: str
    nodes: tuple[str, ...]
    finding: Finding


class FleetCorrelator:
    """Find shared causes among the controller's findings (module docstring).

    Args:
        attributes: Correlation attributes, in the order they are tried (``switch``).
        min_nodes: Distinct failing nodes under one value that make a fleet event, >= 2.
        window_seconds: How close in time the nodes' findings must be first seen, > 0.

    Raises:
        ValueError: ``min_nodes`` < 2 or ``window_seconds`` <= 0.
    """

    def __init__(self, *, attributes: Sequence[str], min_nodes: int = 3,
                 window_seconds: float = 600.0) -> None:
        if min_nodes < 2:
            raise ValueError(f"min_nodes must be >= 2, got {min_nodes!r}")
        if window_seconds <= 0:
            raise ValueError(f"window_seconds must be > 0, got {window_seconds!r}")
        self.attributes = tuple(attributes)
        self.min_nodes = min_nodes
        self.window_seconds = window_seconds
        self._first_seen: dict[tuple[str, str, str, str], float] = {}
        self._reported: set[tuple[str, str]] = set()

    def update(self, findings: Iterable[Finding], facts: Mapping[str, Mapping[str, str]],
               *, now: float) -> list[FleetEvent]:
        """Account for the current findings; return the fleet events that begin now.

        Args:
            findings: Every finding the controller holds now.
            facts: Per node, its reported facts (``{"gpu-01": {"switch": "leaf-12"}}``).
            now: Epoch seconds (when each finding was first seen here counts, not the
                time in its log line, which may be old).
        """
        current: dict[tuple[str, str, str, str], Finding] = {}
        for f in findings:
            if f.severity.rank >= Severity.MAJOR.rank and f.kind not in IGNORED_KINDS:
                current[f.key] = f
                self._first_seen.setdefault(f.key, now)
        self._first_seen = {k: t for k, t in self._first_seen.items() if k in current}
        recent: dict[str, list[Finding]] = {}
        for key, f in current.items():
            if now - self._first_seen[key] <= self.window_seconds:
                recent.setdefault(f.node, []).append(f)
        events: list[FleetEvent] = []
        holding: set[tuple[str, str]] = set()
        for attribute in self.attributes:
            groups: dict[str, list[str]] = {}
            for node in recent:
                value = facts.get(node, {}).get(attribute)
                if value:
                    groups.setdefault(value, []).append(node)
            for value, nodes in groups.items():
                if len(nodes) < self.min_nodes:
                    continue
                holding.add((attribute, value))
                if (attribute, value) in self._reported:
                    continue
                events.append(self._event(attribute, value, sorted(nodes), recent, now))
        self._reported = {r for r in self._reported if r in holding} | {
            (e.attribute, e.value) for e in events}
        return events

    def _event(self, attribute: str, value: str, nodes: list[str],
               recent: Mapping[str, list[Finding]], now: float) -> FleetEvent:
        causes = sorted({f"{f.kind} {f.code}" for n in nodes for f in recent[n]})
        summary = (f"{len(nodes)} nodes under {attribute} {value} failing within "
                   f"{self.window_seconds:.0f} s ({', '.join(causes)}): one shared cause is "
                   f"likely; their automatic remediation waits for a human (circuit breaker)")
        evidence = tuple(Evidence(file=n, line=None, text=recent[n][0].summary) for n in nodes)
        finding = Finding(node=FLEET_NODE, entity=EntityId(f"{attribute}:{value}"),
                          kind=FLEET_KIND, code=attribute, severity=Severity.MAJOR,
                          action=Action.NONE, summary=summary, evidence=evidence,
                          source="analytics.fleet: nodes sharing one part failing together "
                                 "(docs/fleet.md, 'Fleet incidents')",
                          first_seen_at=now, last_seen_at=now, occurrences=len(nodes))
        return FleetEvent(attribute=attribute, value=value, nodes=tuple(nodes), finding=finding)
