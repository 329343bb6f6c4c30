"""river anomaly models behind the ``Detector`` Protocol, one model per ``(node, entity)``.

The only module that imports ``river`` for anomaly detection (style.md C.1). Each entity gets
its own model, made by the detector's template, and its own adaptive
threshold: the running ``quantile`` of its past scores (river ``stats.Quantile``, the P²
algorithm of Jain & Chlamtac, CACM 1985, O(1) per update). Each feature vector is scored
first, compared with the threshold in force, and learned only when it was not flagged
(river's ``protect_anomaly_detector`` idea), after a warm-up of ``warmup_samples`` vectors.

* :class:`HalfSpaceTreesDetector`: Half-Space Trees (Tan, Ting & Liu, IJCAI 2011) after a
  running standard scaler and a logistic squash into (0, 1), as HST expects features in [0, 1].
  river's ``HalfSpaceTrees`` keeps a tree of Python node objects per model (about 140 KB for 5
  trees of height 6); here the random trees, which depend only on the seed and the feature
  names, are built once by river's own ``make_padded_tree`` and shared, and each entity keeps
  only its node masses in two flat lists (:class:`SharedHalfSpaceTrees`, about 10 KB). Scores
  equal river's ``HalfSpaceTrees`` with the same seed exactly (``tests/unit/test_detectors.py``).
* :class:`StandardAbsoluteDeviationDetector`: river's Standard Absolute Deviation per
  feature, the entity's score being its worst feature.

Unlike river's ``QuantileFilter``, which calls ``score_one`` twice per point, each point is
scored once and that score feeds both the decision and the quantile.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from river import compose

# river is imported where it is used: its import costs about a second and 100 MiB
# (scipy, pandas, scikit-learn), which an agent without these detectors never pays.

from core.records import Anomaly, EntityId, FeatureVector, NodeName

logger = logging.getLogger(__name__)


def squash(x: dict[str, float]) -> dict[str, float]:
    """Map standardised features into (0, 1) with a logistic of ``z / 3``.

    Half-Space Trees split the unit cube, so features must lie in [0, 1]; a min-max scaler
    puts a never-seen 95 °C on the cube's edge next to the hottest normal reading, whereas this
    keeps normal readings near 0.5 and pushes outliers into the empty corners.

    Examples:
        >>> squash({"a": 0.0, "b": 30.0})
        {'a': 0.5, 'b': 0.9999546021312976}
    """
    exp = math.exp
    # Clipped to [-60, 60] as max(min(v, 60), -60) would, without two builtin calls per value.
    return {k: 1.0 / (1.0 + exp(-(60.0 if v > 60.0 else -60.0 if v < -60.0 else v) / 3.0))
            for k, v in x.items()}


@dataclass(frozen=True, slots=True)
class _Forest:
    """The random split structure of Half-Space Trees, flattened breadth-first.

    Node ``i`` of tree ``k`` sits at ``k * nodes + i``; its children are ``2i + 1`` and
    ``2i + 2``; the last ``2^height`` nodes of each tree are leaves.
    """

    features: tuple[str, ...]  # split feature of each branch node ("" at leaves)
    thresholds: tuple[float, ...]  # split point of each branch node (0.0 at leaves)
    n_trees: int
    height: int
    nodes: int

    @classmethod
    def build(cls, names: Sequence[str], *, n_trees: int, height: int,
              seed: int | None) -> _Forest:
        """Build the trees river's ``HalfSpaceTrees(n_trees, height, seed=seed)`` would build.

        river builds them on its first ``learn_one``, from a vector with these feature
        ``names``; the same calls make the same random draws (river's ``make_padded_tree``
        with padding 0.15 on the unit cube, one ``random.Random(seed)`` for all trees).
        """
        from river.tree.base import Branch
        from river.tree.padded import make_padded_tree

        rng = random.Random(seed)
        features: list[str] = []
        thresholds: list[float] = []
        for _ in range(n_trees):
            root = make_padded_tree(  # type: ignore[no-untyped-call]
                limits=dict.fromkeys(sorted(names), (0.0, 1.0)),
                height=height, padding=0.15, rng=rng, r_mass=0, l_mass=0,
            )
            level = [root]
            for _depth in range(height + 1):
                for node in level:
                    is_branch = isinstance(node, Branch)
                    features.append(node.feature if is_branch else "")
                    thresholds.append(node.threshold if is_branch else 0.0)
                level = [child for node in level if isinstance(node, Branch)
                         for child in node.children]
        return cls(tuple(features), tuple(thresholds), n_trees, height, 2 ** (height + 1) - 1)


class SharedHalfSpaceTrees:
    """One entity's Half-Space Trees over a shared :class:`_Forest`: masses only.

    Behaves as river's ``anomaly.HalfSpaceTrees`` (same ``score_one`` and ``learn_one``
    results for the same seed, missing features included): each node keeps the mass of the
    current window (``l``) and of the reference window (``r``); every ``window_size`` learned
    points the current window becomes the reference. State is ``2 * n_trees * (2^(height+1)
    - 1)`` list slots (10 KB at 5 trees of height 6, against river's ~140 KB of node objects).

    Args:
        forests: Feature names -> forest, shared by every entity of a detector; filled on a
            first ``learn_one``.
        n_trees, height, window_size, seed: As river's ``HalfSpaceTrees``.
    """

    __slots__ = (
        "_counter",
        "_first_window",
        "_forest",
        "_forests",
        "_l",
        "_r",
        "height",
        "n_trees",
        "seed",
        "window_size",
    )

    def __init__(self, forests: dict[tuple[str, ...], _Forest], *, n_trees: int, height: int,
                 window_size: int, seed: int | None) -> None:
        self._forests = forests
        self.n_trees = n_trees
        self.height = height
        self.window_size = window_size
        self.seed = seed
        self._forest: _Forest | None = None
        self._l: list[int] = []
        self._r: list[int] = []
        self._counter = 0
        self._first_window = True

    def _descend(self, at: int, base: int, x: dict[str, float]) -> int:
        """Return the child of node ``at`` (tree offset ``base``) that ``x`` goes down.

        A missing feature follows the child with more current mass (``PaddedBranch.next``).
        """
        assert self._forest is not None
        value = x.get(self._forest.features[base + at])
        if value is None:
            left, right = 2 * at + 1, 2 * at + 2
            return right if self._l[base + left] < self._l[base + right] else left
        return 2 * at + 1 if value < self._forest.thresholds[base + at] else 2 * at + 2

    def learn_one(self, x: dict[str, float]) -> None:
        """Add ``x`` to the current window's masses; pivot the windows when it is full."""
        forest = self._forest
        if forest is None:
            key = tuple(sorted(x))
            forest = self._forests.get(key)
            if forest is None:
                forest = self._forests[key] = _Forest.build(
                    key, n_trees=self.n_trees, height=self.height, seed=self.seed)
            self._forest = forest
            self._l = [0] * (forest.n_trees * forest.nodes)
            self._r = [0] * (forest.n_trees * forest.nodes)
        mass = self._l
        features, thresholds = forest.features, forest.thresholds
        height, nodes = forest.height, forest.nodes
        get = x.get
        for base in range(0, forest.n_trees * nodes, nodes):
            at = 0
            for _ in range(height):
                node = base + at
                mass[node] += 1
                value = get(features[node])
                if value is None:
                    at = self._descend(at, base, x)
                else:
                    at = 2 * at + 1 if value < thresholds[node] else 2 * at + 2
            mass[base + at] += 1
        self._counter += 1
        if self._counter == self.window_size:
            self._r = mass
            self._l = [0] * len(mass)
            self._first_window = False
            self._counter = 0

    def score_one(self, x: dict[str, float]) -> float:
        """Anomaly score in [0, 1] (1 most anomalous); 0 during the first window."""
        forest = self._forest
        if self._first_window or forest is None:
            return 0.0
        mass = self._r
        features, thresholds = forest.features, forest.thresholds
        height, nodes = forest.height, forest.nodes
        size_limit = 0.1 * self.window_size
        get = x.get
        score = 0.0
        for base in range(0, forest.n_trees * nodes, nodes):
            tree_score = 0.0
            at = 0
            depth_pow = 1
            for _ in range(height):
                node = base + at
                r = mass[node]
                tree_score += r * depth_pow
                if r < size_limit:
                    break
                value = get(features[node])
                if value is None:
                    at = self._descend(at, base, x)
                else:
                    at = 2 * at + 1 if value < thresholds[node] else 2 * at + 2
                depth_pow <<= 1
            else:
                tree_score += mass[base + at] * depth_pow
            score += tree_score
        return 1.0 - score / float(forest.n_trees * self.window_size * (2 ** (height + 1) - 1))


class _ScaledHst:
    """river's ``StandardScaler | FuncTransformer(squash) | HalfSpaceTrees`` pipeline.

    The last step is a :class:`SharedHalfSpaceTrees`; the calls are river's ``Pipeline``'s,
    in its order (the scaler learns before transforming a learned point, not a scored one).
    """

    __slots__ = ("scaler", "trees")

    def __init__(self, trees: SharedHalfSpaceTrees) -> None:
        from river import preprocessing

        self.scaler: Any = preprocessing.StandardScaler()
        self.trees = trees

    def score_one(self, x: dict[str, float]) -> float:
        return self.trees.score_one(squash(self.scaler.transform_one(x)))

    def learn_one(self, x: dict[str, float]) -> None:
        self.scaler.learn_one(x)
        self.trees.learn_one(squash(self.scaler.transform_one(x)))


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
            from river import stats

            model = self._models[key] = self._template()
            self._thresholds[key] = stats.Quantile(q=self.quantile)
            self._seen[key] = 0
        features = dict(x.values)
        score = float(model.score_one(features))
        quantile = self._thresholds[key]
        threshold: float | None = quantile.get()
        seen = self._seen[key] = self._seen[key] + 1
        flagged = seen > self.warmup_samples and threshold is not None and score > threshold
        # The threshold sees every score (feeding it only unflagged ones would truncate the
        # distribution and ratchet the quantile down); an untrained model's first scores are
        # meaningless, so it starts halfway through the warm-up. The model learns only
        # unflagged points.
        if seen > self.warmup_samples // 2:
            quantile.update(score)
        if not flagged:
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
        n_trees: Trees per model, >= 1. The defaults (5 trees of height 6, against river's 10
            of height 8) halve river's time per vector; height 5 was smaller still but missed
            a 70-sigma reading on two features. With the trees shared (module docstring) an
            entity costs about 13 KB (scaler, masses, threshold) instead of river's 148 KB, and
            about 40 us per 12-feature vector (``benchmarks/detectors.py``).
        height: Tree height, >= 1 (per-entity masses grow as ``n_trees * 2^(height + 1)``).
        window_size: Points per reference window, >= 1.
        quantile: Score quantile above which a point is anomalous, in (0, 1).
        warmup_samples: Vectors per entity learned before any detection.
        seed: Seed for the random trees; always set in tests. The trees are drawn once per
            feature set and shared by every entity (river's per-entity models with one seed
            draw the same trees anyway); ``None`` draws them once at random.

    Raises:
        ValueError: An argument is out of range.
    """

    name = "hst"

    def __init__(
        self,
        *,
        n_trees: int = 5,
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
        self._forests: dict[tuple[str, ...], _Forest] = {}

    def _template(self) -> Any:
        return _ScaledHst(SharedHalfSpaceTrees(
            self._forests, n_trees=self.n_trees, height=self.height,
            window_size=self.window_size, seed=self.seed))

    def river_pipeline(self) -> compose.Pipeline:
        """The river pipeline each entity's model reproduces (for tests and benchmarks)."""
        from river import anomaly, compose, preprocessing

        model: compose.Pipeline = (
            preprocessing.StandardScaler()
            | compose.FuncTransformer(squash)
            | anomaly.HalfSpaceTrees(
                n_trees=self.n_trees,
                height=self.height,
                window_size=self.window_size,
                seed=self.seed,
            )
        )
        return model


class _PerFeatureSad:
    """One river ``StandardAbsoluteDeviation`` per feature; the vector's score is the largest."""

    def __init__(self) -> None:
        self._models: dict[str, Any] = {}

    def _model(self, feature: str) -> Any:
        found = self._models.get(feature)
        if found is None:
            from river import anomaly

            found = self._models[feature] = anomaly.StandardAbsoluteDeviation()
        return found

    def score_one(self, x: dict[str, float]) -> float:
        return max((float(self._model(f).score_one(None, v)) for f, v in x.items()), default=0.0)

    def learn_one(self, x: dict[str, float]) -> None:
        for f, v in x.items():
            self._model(f).learn_one(None, v)


class StandardAbsoluteDeviationDetector(_RiverDetector):
    """river's Standard Absolute Deviation per feature of each entity, worst feature scored.

    SAD scores ``|y - mean| / std`` over everything the model has learned (Hochenbaum, Vallis
    & Kejariwal 2017; river's port of PySAD). Cheap and robust to a feature far outside its
    range; blind to odd combinations of in-range features (use Half-Space Trees for those).
    river's ``OneClassSVM`` (linear: it flags one side of a half-space only) and ``LODA``
    (scored a 70-sigma reading below the 99th percentile of normal ones on two features) were
    tried as the second model and dropped.

    Args:
        quantile: Score quantile above which a point is anomalous, in (0, 1).
        warmup_samples: Vectors per entity learned before any detection.
        seed: Unused (deterministic); accepted for a uniform detector API.

    Raises:
        ValueError: An argument is out of range.
    """

    name = "sad"

    def __init__(
        self, *, quantile: float = 0.999, warmup_samples: int = 200, seed: int | None = None
    ) -> None:
        super().__init__(quantile=quantile, warmup_samples=warmup_samples, seed=seed)

    def _template(self) -> Any:
        return _PerFeatureSad()
