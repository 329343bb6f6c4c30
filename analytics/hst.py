"""river anomaly models behind the ``Detector`` Protocol, one model per ``(node, entity)``.

The only module that imports ``river`` for anomaly detection (style.md C.1). Each entity gets
its own model, cloned from a template (``river.base.Base.clone``), and its own adaptive
threshold: the running ``quantile`` of its past scores (river ``stats.Quantile``, the P²
algorithm of Jain & Chlamtac, CACM 1985, O(1) per update). Each feature vector is scored
first, compared with the threshold in force, and learned only when it was not flagged
(river's ``protect_anomaly_detector`` idea), after a warm-up of ``warmup_samples`` vectors.

* :class:`HalfSpaceTreesDetector`: Half-Space Trees (Tan, Ting & Liu, IJCAI 2011) after a
  running min-max scaler, as HST expects features in [0, 1].
* :class:`LodaDetector`: LODA, sparse random projections with streaming histograms
  (Pevný, Machine Learning 102, 2016).

Unlike river's ``QuantileFilter``, which calls ``score_one`` twice per point, each point is
scored once and that score feeds both the decision and the quantile.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from river import anomaly, compose, preprocessing, stats

from core.records import Anomaly, EntityId, FeatureVector, NodeName

logger = logging.getLogger(__name__)


class _RiverDetector:
    """Shared machinery: a model and a score quantile per entity; score, decide, learn."""

    name = "river"

    def __init__(self, *, quantile: float, warmup_samples: int, seed: int | None) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
        if warmup_samples < 1:
            raise ValueError(f"warmup_samples must be >= 1, got {warmup_samples}")
        self.quantile = quantile
        self.warmup_samples = warmup_samples
        self.seed = seed
        self._models: dict[tuple[NodeName, EntityId], Any] = {}
        self._thresholds: dict[tuple[NodeName, EntityId], Any] = {}
        self._seen: dict[tuple[NodeName, EntityId], int] = {}

    def _template(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def __len__(self) -> int:
        """Entities tracked."""
        return len(self._models)

    def score(self, x: FeatureVector) -> tuple[float, float | None, bool]:
        """Score ``x``, learn it unless flagged; return ``(score, threshold, flagged)``."""
        key = (x.node, x.entity)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = self._template()
            self._thresholds[key] = stats.Quantile(q=self.quantile)
            self._seen[key] = 0
        features = dict(x.values)
        score = float(model.score_one(features))
        quantile = self._thresholds[key]
        threshold: float | None = quantile.get()
        seen = self._seen[key] = self._seen[key] + 1
        flagged = seen > self.warmup_samples and threshold is not None and score > threshold
        if not flagged:
            quantile.update(score)
            model.learn_one(features)
        return score, threshold, flagged

    def observe(self, x: FeatureVector) -> Anomaly | None:
        """Score ``x`` with its entity's model, then learn it unless it is anomalous."""
        score, threshold, flagged = self.score(x)
        if not flagged or threshold is None:
            return None
        return Anomaly(
            detector=self.name,
            node=x.node,
            entity=x.entity,
            score=score,
            threshold=threshold,
            observed_at=x.window_end_at,
        )

    def observe_many(self, batch: Sequence[FeatureVector]) -> Sequence[Anomaly]:
        """Observe a batch of feature vectors (one model call each; river is per-object)."""
        return [a for a in map(self.observe, batch) if a is not None]


class HalfSpaceTreesDetector(_RiverDetector):
    """Half-Space Trees per entity with an adaptive score-quantile threshold.

    Args:
        n_trees: Trees per model, >= 1.
        height: Tree height, >= 1 (memory grows as ``n_trees * 2^height``).
        window_size: Points per reference window, >= 1.
        quantile: Score quantile above which a point is anomalous, in (0, 1).
        warmup_samples: Vectors per entity learned before any detection.
        seed: Seed for the random trees; always set in tests.

    Raises:
        ValueError: An argument is out of range.
    """

    name = "hst"

    def __init__(
        self,
        *,
        n_trees: int = 10,
        height: int = 6,
        window_size: int = 100,
        quantile: float = 0.995,
        warmup_samples: int = 200,
        seed: int | None = None,
    ) -> None:
        super().__init__(quantile=quantile, warmup_samples=warmup_samples, seed=seed)
        if n_trees < 1 or height < 1 or window_size < 1:
            raise ValueError("n_trees, height and window_size must be >= 1")
        self.n_trees = n_trees
        self.height = height
        self.window_size = window_size

    def _template(self) -> Any:
        model: compose.Pipeline = preprocessing.MinMaxScaler() | anomaly.HalfSpaceTrees(
            n_trees=self.n_trees, height=self.height, window_size=self.window_size, seed=self.seed
        )
        return model


class LodaDetector(_RiverDetector):
    """LODA per entity with an adaptive score-quantile threshold.

    Args:
        n_bins: Bins per streaming histogram, >= 2.
        n_random_cuts: Random projections, >= 1.
        quantile: Score quantile above which a point is anomalous, in (0, 1).
        warmup_samples: Vectors per entity learned before any detection.
        seed: Seed for the projections; always set in tests.

    Raises:
        ValueError: An argument is out of range.
    """

    name = "loda"

    def __init__(
        self,
        *,
        n_bins: int = 10,
        n_random_cuts: int = 20,
        quantile: float = 0.995,
        warmup_samples: int = 200,
        seed: int | None = None,
    ) -> None:
        super().__init__(quantile=quantile, warmup_samples=warmup_samples, seed=seed)
        if n_bins < 2 or n_random_cuts < 1:
            raise ValueError("n_bins must be >= 2 and n_random_cuts >= 1")
        self.n_bins = n_bins
        self.n_random_cuts = n_random_cuts

    def _template(self) -> Any:
        return anomaly.LODA(n_bins=self.n_bins, n_random_cuts=self.n_random_cuts, seed=self.seed)
