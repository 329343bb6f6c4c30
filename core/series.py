"""What a stage works out once per series of samples, found again in O(1) per sample.

Every stage that reads samples one at a time (the fault model's observations, the online
detectors, the failure predictor's features) needs, per sample, something it worked out
from the sample's series: its key, its state, what to do with it. Building the key again
for every sample (``tuple(sorted(labels.items()))``) costs more than the work it leads to
when a replay reads millions of samples (issue #15: a month of a 256-GPU fleet is 60 M).

:class:`SeriesMemo` remembers that value by the **identity** of the sample's labels
dictionary and its metric: the line-protocol reader and the collectors share one labels
dictionary between the samples of one series part (records are immutable), so the lookup
is one dictionary probe. Each hit is checked against the labels object itself (kept alive
by the memo, so its ``id`` cannot be reused), the node and the entity; a new dictionary
or another entity only costs one new entry. The memo is bounded: past ``limit`` entries it
starts over, and what it held is worked out again.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from core.records import Sample

T = TypeVar("T")


class SeriesMemo(Generic[T]):
    """A value per series of samples, keyed by the sample's labels object and metric.

    Args:
        limit: Entries kept before the memo starts over, >= 1.

    Raises:
        ValueError: ``limit`` below 1.

    Examples:
        >>> from core.records import Sample, NodeName, EntityId
        >>> labels = {"type": "corrected"}
        >>> s = Sample(metric="gpu_ecc_errors_total", value=1.0, observed_at=1.0,
        ...            node=NodeName("n1"), entity=EntityId("GPU-0"), labels=labels)
        >>> memo: SeriesMemo[str] = SeriesMemo()
        >>> memo.get(s) is None
        True
        >>> memo.put(s, "ce")
        >>> memo.get(s)
        'ce'
        >>> memo.get(Sample(metric=s.metric, value=2.0, observed_at=2.0, node=s.node,
        ...                 entity=EntityId("GPU-1"), labels=labels)) is None
        True
    """

    __slots__ = ("_entries", "limit")

    def __init__(self, limit: int = 65_536) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._entries: dict[tuple[int, str], tuple[object, str, str, T]] = {}

    def get(self, sample: Sample) -> T | None:
        """Return the value put for ``sample``'s series, or ``None``."""
        labels = sample.labels
        entry = self._entries.get((id(labels), sample.metric))
        if (entry is not None and entry[0] is labels and entry[1] == sample.node
                and entry[2] == sample.entity):
            return entry[3]
        return None

    def put(self, sample: Sample, value: T) -> None:
        """Remember ``value`` for ``sample``'s series (starting over past :attr:`limit`)."""
        entries = self._entries
        if len(entries) >= self.limit:
            entries.clear()
        labels = sample.labels
        entries[(id(labels), sample.metric)] = (labels, sample.node, sample.entity, value)

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
