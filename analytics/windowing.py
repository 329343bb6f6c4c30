"""Columnar batches of many series, and the shared plumbing of per-series detectors.

A *series* is one metric of one entity: ``(node, entity, metric)``. Per-series detectors keep
their state in numpy arrays indexed by a dense *slot* per series, so one call scores a whole
tick of the fleet (``observe_many``) instead of one Python object per series (river's way,
about 390x slower). :class:`SeriesIndex` turns keys into slots once; a :class:`SeriesBatch`
carries slots, values and times as columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from core.records import Anomaly, EntityId, FeatureVector, NodeName

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
_T = TypeVar("_T", bound=np.generic)


class SeriesKey(NamedTuple):
    """Identity of one series: a metric (or feature) of one entity."""

    node: NodeName
    entity: EntityId
    metric: str


@dataclass(slots=True)
class SeriesIndex:
    """Dense slot numbers for series keys, assigned in order of first sight.

    Examples:
        >>> index = SeriesIndex()
        >>> index.slots([SeriesKey(NodeName("n1"), EntityId("g0"), "t"),
        ...              SeriesKey(NodeName("n1"), EntityId("g1"), "t")]).tolist()
        [0, 1]
        >>> index.key(1).entity
        'g1'
    """

    _slots: dict[SeriesKey, int] = field(default_factory=dict)
    _keys: list[SeriesKey] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._keys)

    def slot(self, key: SeriesKey) -> int:
        """Return the slot of ``key``, assigning the next one if it is new."""
        found = self._slots.get(key)
        if found is None:
            found = self._slots[key] = len(self._keys)
            self._keys.append(key)
        return found

    def slots(self, keys: Iterable[SeriesKey]) -> IntArray:
        """Return the slots of ``keys``, shape ``(n,)``."""
        return np.fromiter((self.slot(k) for k in keys), dtype=np.int64)

    def key(self, slot: int) -> SeriesKey:
        """Return the key of ``slot``."""
        return self._keys[slot]


@dataclass(frozen=True, slots=True, kw_only=True)
class SeriesBatch:
    """A columnar batch of samples of many series.

    Attributes:
        series: Slot of each sample, shape ``(n,)``, from a :class:`SeriesIndex`.
        values: Sample values, shape ``(n,)``, in the metric's unit; never NaN.
        observed_at: Sample times, epoch seconds, shape ``(n,)``.
    """

    series: IntArray
    values: FloatArray
    observed_at: FloatArray

    def __post_init__(self) -> None:
        if not self.series.shape == self.values.shape == self.observed_at.shape:
            raise ValueError("series, values and observed_at must have the same shape")


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchVerdict:
    """Per-sample output of a vectorised detector, aligned with the batch.

    Attributes:
        scores: Score of each sample (detector-specific; compared with ``thresholds``).
        thresholds: Threshold in force when the sample was scored; ``inf`` during warm-up.
        flagged: Whether the sample is anomalous (``scores > thresholds``, after warm-up).
        probability: Anomaly score in [0, 1] for ranking and NAB (1 is most anomalous).
    """

    scores: FloatArray
    thresholds: FloatArray
    flagged: BoolArray
    probability: FloatArray


def occurrence_rounds(series: IntArray) -> list[IntArray]:
    """Split positions into rounds where every series occurs at most once, in time order.

    Examples:
        >>> [r.tolist() for r in occurrence_rounds(np.array([3, 1, 3, 3]))]
        [[0, 1], [2], [3]]
    """
    if series.size == 0:
        return []
    if series.min() >= 0 and np.bincount(series).max() == 1:
        return [np.arange(series.size)]  # a tick of distinct series (the usual batch)
    order = np.argsort(series, kind="stable")
    ordered = series[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(series.size), 0))
    rank = np.empty(series.size, dtype=np.int64)
    rank[order] = np.arange(series.size) - group_start
    if rank.max() == 0:
        return [np.arange(series.size)]
    return [np.flatnonzero(rank == r) for r in range(int(rank.max()) + 1)]


def grow(array: npt.NDArray[_T], size: int, fill: float | bool = 0.0) -> npt.NDArray[_T]:
    """Return ``array`` extended along axis 0 to at least ``size`` rows (doubling), filled."""
    if array.shape[0] >= size:
        return array
    new = np.full((max(size, 2 * array.shape[0], 64), *array.shape[1:]), fill, dtype=array.dtype)
    new[: array.shape[0]] = array
    return new


class VectorDetector:
    """Base of per-series vectorised detectors: ``observe`` and ``observe_many`` over slots.

    Subclasses implement :meth:`_step` for one round of distinct slots; this class keeps the
    key index, splits batches into rounds, and turns flagged samples into ``Anomaly`` records.
    """

    name = "vector"
    relearn_after: int | None = None

    def __init__(self) -> None:
        self.index = SeriesIndex()
        self._run = np.zeros(0, dtype=np.int64)

    def _learn_mask(self, slots: IntArray, flagged: BoolArray) -> BoolArray:
        """Which samples to learn: the unflagged ones, plus flagged ones of a long run.

        A series flagged ``relearn_after`` times in a row has shifted for good; it was
        reported when the run began, and from then on it is learned again so that one level
        shift does not flag the series forever. ``relearn_after=None`` never relearns.
        """
        self._run = grow(self._run, int(slots.max(initial=-1)) + 1, 0)
        run = np.where(flagged, self._run[slots] + 1, 0)
        self._run[slots] = run
        if self.relearn_after is None:
            return ~flagged
        return ~flagged | (run > self.relearn_after)

    def _ensure(self, size: int) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _step(self, slots: IntArray, values: FloatArray) -> BatchVerdict:  # pragma: no cover
        raise NotImplementedError

    def score_many(self, batch: SeriesBatch) -> BatchVerdict:
        """Score then learn a batch; return per-sample verdicts aligned with ``batch``."""
        n = batch.series.size
        self._ensure(int(batch.series.max(initial=-1)) + 1)
        rounds = occurrence_rounds(batch.series)
        if len(rounds) == 1:
            return self._step(batch.series, batch.values)
        scores, thresholds = np.empty(n), np.empty(n)
        flagged, probability = np.zeros(n, dtype=bool), np.empty(n)
        for positions in rounds:
            verdict = self._step(batch.series[positions], batch.values[positions])
            scores[positions] = verdict.scores
            thresholds[positions] = verdict.thresholds
            flagged[positions] = verdict.flagged
            probability[positions] = verdict.probability
        return BatchVerdict(
            scores=scores, thresholds=thresholds, flagged=flagged, probability=probability
        )

    def observe_many(self, batch: SeriesBatch) -> Sequence[Anomaly]:
        """Score then learn every sample of ``batch``; return an ``Anomaly`` per flagged sample."""
        return [anomaly for _, anomaly in self.flagged(batch, self.score_many(batch))]

    def flagged(self, batch: SeriesBatch, verdict: BatchVerdict) -> list[tuple[SeriesKey, Anomaly]]:
        """The series key and an ``Anomaly`` for each sample ``verdict`` flagged, in order."""
        out = []
        for position in np.flatnonzero(verdict.flagged):
            key = self.index.key(int(batch.series[position]))
            out.append((key, Anomaly(
                detector=self.name,
                node=key.node,
                entity=key.entity,
                score=float(verdict.scores[position]),
                threshold=float(verdict.thresholds[position]),
                observed_at=float(batch.observed_at[position]),
            )))
        return out

    def observe(self, x: FeatureVector) -> Anomaly | None:
        """Score then learn each feature of ``x`` as its own series.

        Returns:
            The ``Anomaly`` of the feature furthest past its threshold (relative to the
            threshold's magnitude), or ``None`` when no feature is flagged.
        """
        names = sorted(x.values)
        if not names:
            return None
        slots = self.index.slots(SeriesKey(x.node, x.entity, m) for m in names)
        values = np.fromiter((x.values[m] for m in names), dtype=np.float64, count=len(names))
        at = np.full(len(names), x.window_end_at)
        found = self.observe_many(SeriesBatch(series=slots, values=values, observed_at=at))
        if not found:
            return None
        return max(found, key=lambda a: (a.score - a.threshold) / max(abs(a.threshold), 1e-12))
