"""Telemetry gaps as a signal: entities whose samples stop arriving.

A GPU that falls off the bus (Xid 79) often shows no numeric warning first: its series simply
stop, while the other GPUs of the node keep reporting. :class:`TelemetryGapDetector` learns each
entity's usual interval between samples (an EWMA of inter-arrival times) and, when
:meth:`~TelemetryGapDetector.check` runs, reports every entity silent for more than
``gap_factor`` intervals (and at least ``min_gap_seconds``). A gap is reported once; it ends when
samples return. When every entity of a node is silent the gap is reported once for the node
(``entity="node"``): a node or collector outage, not a device fault, and the collector restarts
that leave short gaps stay below ``min_gap_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from analytics.windowing import FloatArray, IntArray, SeriesIndex, SeriesKey, grow
from core.records import Anomaly, EntityId, FeatureVector, NodeName

_NODE = EntityId("node")


class TelemetryGapDetector:
    """Reports entities (and whole nodes) whose samples stopped arriving.

    Args:
        gap_factor: Silence, in learned intervals, that makes a gap; > 1.
        min_gap_seconds: Shortest silence ever reported, seconds; >= 0.
        warmup_samples: Arrivals per entity before its gaps are reported; >= 2.
        alpha: EWMA weight of the newest inter-arrival time, in (0, 1].

    Raises:
        ValueError: An argument is out of range.

    Examples:
        >>> gaps = TelemetryGapDetector(warmup_samples=3, min_gap_seconds=0)
        >>> gpus = [(NodeName("n1"), EntityId("gpu0")), (NodeName("n1"), EntityId("gpu1"))]
        >>> for t in range(5):
        ...     gaps.arrive(gpus, float(10 * t))
        >>> gaps.arrive([(NodeName("n1"), EntityId("gpu1"))], 50.0)
        >>> gaps.arrive([(NodeName("n1"), EntityId("gpu1"))], 60.0)
        >>> [(a.entity, a.score) for a in gaps.check(100.0)]
        [('gpu0', 6.0)]
        >>> gaps.check(110.0)  # reported once
        []
    """

    name = "gaps"

    def __init__(
        self,
        *,
        gap_factor: float = 5.0,
        min_gap_seconds: float = 60.0,
        warmup_samples: int = 10,
        alpha: float = 0.1,
    ) -> None:
        if gap_factor <= 1.0:
            raise ValueError(f"gap_factor must be > 1, got {gap_factor!r}")
        if min_gap_seconds < 0:
            raise ValueError(f"min_gap_seconds must be >= 0, got {min_gap_seconds!r}")
        if warmup_samples < 2:
            raise ValueError(f"warmup_samples must be >= 2, got {warmup_samples}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.gap_factor = gap_factor
        self.min_gap_seconds = min_gap_seconds
        self.warmup_samples = warmup_samples
        self.alpha = alpha
        self._index = SeriesIndex()
        self._nodes: dict[NodeName, int] = {}
        self._node_of = np.zeros(0, dtype=np.int64)
        self._last: FloatArray = np.zeros(0)
        self._interval: FloatArray = np.zeros(0)
        self._count = np.zeros(0, dtype=np.int64)
        self._open = np.zeros(0, dtype=bool)
        self._node_open: set[NodeName] = set()
        self._pending: list[Anomaly] = []

    def slot(self, node: NodeName, entity: EntityId) -> int:
        """Return the slot of one entity (for :meth:`arrive_slots`), assigning it if new."""
        return self._slot(node, entity)

    def _slot(self, node: NodeName, entity: EntityId) -> int:
        before = len(self._index)
        slot = self._index.slot(SeriesKey(node, entity, ""))
        if len(self._index) > before:
            size = len(self._index)
            self._node_of = grow(self._node_of, size, -1)
            self._last = grow(self._last, size)
            self._interval = grow(self._interval, size)
            self._count = grow(self._count, size, 0)
            self._open = grow(self._open, size, False)
            self._node_of[slot] = self._nodes.setdefault(node, len(self._nodes))
        return slot

    def arrive(self, entities: Iterable[tuple[NodeName, EntityId]], observed_at: float) -> None:
        """Record that samples of ``entities`` arrived at ``observed_at`` (epoch seconds)."""
        self.arrive_slots(np.fromiter((self._slot(n, e) for n, e in entities), dtype=np.int64),
                          observed_at)

    def arrive_slots(self, slots: IntArray, observed_at: float) -> None:
        """:meth:`arrive` for entities given by their :meth:`slot`."""
        slots = np.unique(slots)
        count = self._count[slots]
        dt = observed_at - self._last[slots]
        later = (count == 0) | (dt > 0)
        slots, count, dt = slots[later], count[later], dt[later]
        rate = np.maximum(self.alpha, 1.0 / np.maximum(count, 1))
        old = self._interval[slots]
        self._interval[slots] = np.where(
            count == 0, 0.0, np.where(count == 1, dt, old + rate * (dt - old))
        )
        self._last[slots] = observed_at
        self._count[slots] = count + 1
        self._open[slots] = False
        for node in {self._index.key(int(s)).node for s in slots}:
            self._node_open.discard(node)

    def check(self, now: float) -> Sequence[Anomaly]:
        """Return the gaps that opened since the last call (each reported once).

        Args:
            now: Current time, epoch seconds.

        Returns:
            One ``Anomaly`` per newly silent entity, or per newly silent node when all of its
            entities are silent; ``score`` is the silence in learned intervals and
            ``threshold`` is ``gap_factor``.
        """
        size = len(self._index)
        silence = now - self._last[:size]
        interval = np.maximum(self._interval[:size], 1e-9)
        ratio = silence / interval
        warm = self._count[:size] >= self.warmup_samples
        gap = warm & (ratio > self.gap_factor) & (silence >= self.min_gap_seconds)
        new = gap & ~self._open[:size]
        self._open[:size] |= gap
        found: list[Anomaly] = []
        if not new.any():
            return found
        nodes = self._node_of[:size]
        # A node all of whose warm entities are silent is one node-level gap.
        silent_nodes = set()
        for node_id in np.unique(nodes[new]):
            members = (nodes == node_id) & warm
            if gap[members].all():
                silent_nodes.add(int(node_id))
        reported_nodes: set[NodeName] = set()
        for slot in np.flatnonzero(new):
            key = self._index.key(int(slot))
            if int(nodes[slot]) in silent_nodes:
                if key.node in self._node_open or key.node in reported_nodes:
                    continue
                reported_nodes.add(key.node)
                entity = _NODE
            else:
                entity = key.entity
            found.append(
                Anomaly(
                    detector=self.name,
                    node=key.node,
                    entity=entity,
                    score=float(ratio[slot]),
                    threshold=self.gap_factor,
                    observed_at=now,
                )
            )
        self._node_open |= reported_nodes
        return found

    def observe(self, x: FeatureVector) -> Anomaly | None:
        """Record ``x``'s arrival, then return one gap opened by ``x.window_end_at``, if any.

        Gaps are found by time passing, not by a sample arriving, so the service should also
        call :meth:`check` on a timer; gaps found here beyond the first are returned by later
        calls.
        """
        self.arrive([(x.node, x.entity)], x.window_end_at)
        self._pending.extend(self.check(x.window_end_at))
        return self._pending.pop(0) if self._pending else None
