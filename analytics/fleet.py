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

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

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


LINK_FACT_PREFIX = "link:"
"""``[inventory]`` facts naming a port's other end: ``"link:mlx5_0/1" = "gpu-02:mlx5_0/1"``
(``<peer node>:<peer port>``; the peer may be a switch, ``leaf-3:17``)."""

PORT_KINDS = frozenset({"ib_port", "ib_counters", "port_errors", "counter_saturated",
                        "nic_port", "rdma_counters", "roce_qos", "ethernet"})
"""Finding kinds about one port, whose entity is the port (``mlx5_0/1``, ``eth0``)."""

Port = tuple[str, str]
"""``(node, port)``."""


def link_map(facts: Mapping[str, Mapping[str, str]]) -> dict[Port, Port]:
    """Return each port's other end, both ways, from the agents' ``link:<port>`` facts.

    Args:
        facts: Per node, its reported facts.

    Returns:
        ``{(node, port): (peer node, peer port)}``; a fact without ``:`` in its value, or
        with an empty side, is ignored.

    Examples:
        >>> link_map({"a": {"link:mlx5_0/1": "b:mlx5_0/1"}})[("b", "mlx5_0/1")]
        ('a', 'mlx5_0/1')
    """
    links: dict[Port, Port] = {}
    for node, node_facts in facts.items():
        for key, value in node_facts.items():
            if not key.startswith(LINK_FACT_PREFIX):
                continue
            port = key[len(LINK_FACT_PREFIX):].strip()
            peer_node, sep, peer_port = value.strip().rpartition(":")
            if not (port and sep and peer_node and peer_port):
                continue
            links[(node, port)] = (peer_node, peer_port)
            links.setdefault((peer_node, peer_port), (node, port))
    return links


def join_link_ends(findings: Sequence[Finding],
                   facts: Mapping[str, Mapping[str, str]]) -> list[Finding]:
    """Make the two ends of one link one finding (one alert, one incident).

    A port fault on a link is seen from both ends (symbol errors, link down, flapping on
    node A's ``mlx5_0/1`` and on node B's port it is cabled to). When both ends have a
    finding of a :data:`PORT_KINDS` kind, the worse one (then the earlier, then the one
    on the lower node name) stands for the link: it carries both ends' evidence and says
    which other end sees it; the other end's finding is folded into it, so the link is
    one incident and only the standing end's node is remediated. A port whose other end
    is known but shows nothing keeps its finding, with the peer named.

    Args:
        findings: The current findings (any kinds; others pass through unchanged).
        facts: Per node, its reported facts (:func:`link_map` reads ``link:<port>``).

    Returns:
        The findings with each joined pair replaced by its standing end, in input order.
    """
    links = link_map(facts)
    if not links:
        return list(findings)
    ends: dict[Port, Finding] = {}
    for f in findings:
        if f.kind in PORT_KINDS and (f.node, f.entity) in links:
            held = ends.get((f.node, f.entity))
            if held is None or f.severity.rank > held.severity.rank:
                ends[(f.node, f.entity)] = f
    replaced: dict[tuple[str, str, str, str], Finding | None] = {}
    for (node, port), f in ends.items():
        peer = links[(node, port)]
        other = ends.get(peer)
        if other is None:
            if f.key not in replaced:
                replaced[f.key] = replace(f, summary=f"{f.summary} (link to {peer[0]}:{peer[1]})")
            continue
        if f.key in replaced and replaced[f.key] is None:
            continue
        keep, fold = sorted((f, other), key=lambda x: (-x.severity.rank,
                                                      x.first_seen_at or 0.0, x.node))
        joined = replace(
            keep,
            summary=(f"{keep.summary}; the other end of this link, {fold.node}:{fold.entity}, "
                     f"sees it too ({fold.kind} {fold.code}): one link fault"),
            evidence=(*keep.evidence,
                      *(Evidence(file=e.file, line=e.line, text=f"{fold.node}: {e.text}")
                        for e in fold.evidence),
                      Evidence(file=fold.node, line=None, text=fold.summary)),
            occurrences=keep.occurrences + fold.occurrences)
        replaced[keep.key] = joined
        replaced[fold.key] = None
    out: list[Finding] = []
    for f in findings:
        if f.key in replaced:
            new = replaced.pop(f.key)
            if new is not None:
                out.append(new)
        else:
            out.append(f)
    return out


SILENT_KIND, SILENT_CODE = "agent", "silent"
"""The finding of a node whose agent went silent."""


@dataclass(frozen=True, slots=True)
class SilenceChange:
    """What one :meth:`AgentSilence.update` found: agents gone silent, agents back.

    Attributes:
        gone: One ``warning`` finding per node whose agent went silent now.
        back: The ``(node, entity, kind, code)`` keys of the findings to clear.
        silent: Every node silent now.
    """

    gone: list[Finding]
    back: list[tuple[str, str, str, str]]
    silent: frozenset[str]


class AgentSilence:
    """A node whose agent has not been heard from is watched, never drained on that alone.

    node-problem-detector and NVSentinel treat a missing heartbeat the same way: the node
    may be down, the agent stopped or the network cut, and none of these says a GPU is
    bad. An agent silent for longer than ``after_seconds`` gets a ``warning`` finding
    (``agent``/``silent``, action none: it alerts, remediation plans no step); a heartbeat
    clears it.

    Args:
        after_seconds: Silence that makes a finding, > 0 (``[controller] agent_silent_seconds``).

    Raises:
        ValueError: ``after_seconds`` <= 0.
    """

    def __init__(self, *, after_seconds: float) -> None:
        if after_seconds <= 0:
            raise ValueError(f"after_seconds must be > 0, got {after_seconds!r}")
        self.after_seconds = after_seconds
        self.silent: frozenset[str] = frozenset()

    def update(self, last_heartbeat: Mapping[str, float], *, now: float,
               store_back_since: float | None = None) -> SilenceChange:
        """Account for the registry's last heartbeats; return what changed.

        Args:
            last_heartbeat: Per node, its agent's last heartbeat, epoch seconds.
            now: Epoch seconds.
            store_back_since: Seconds since the state store was last unreachable
                (``None``: it never was). A heartbeat could not be written while it was
                away, so no agent is called silent until it has been back for a whole
                ``after_seconds``.
        """
        after = self.after_seconds
        silent_now = {n for n, last in last_heartbeat.items() if now - last > after}
        back = self.silent - silent_now
        if store_back_since is not None and store_back_since < after:
            silent_now &= self.silent
        gone = silent_now - self.silent
        self.silent = frozenset(silent_now)
        return SilenceChange(
            gone=[self._finding(n, last_heartbeat[n], now) for n in sorted(gone)],
            back=[(n, "node", SILENT_KIND, SILENT_CODE) for n in sorted(back)],
            silent=self.silent)

    def _finding(self, node: str, last: float, now: float) -> Finding:
        after = self.after_seconds
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last))
        return Finding(
            node=NodeName(node), entity=EntityId("node"), kind=SILENT_KIND, code=SILENT_CODE,
            severity=Severity.WARNING, action=Action.NONE,
            summary=f"gpuhealth agent on {node} silent for more than {after:.0f} s "
                    "(node down, agent stopped or network cut); not remediated on that alone",
            evidence=(Evidence(file="controller", line=None,
                               text=f"last heartbeat at {stamp}"),),
            source="analytics.fleet: agent registry (docs/fleet.md)",
            first_seen_at=last + after, last_seen_at=now)
