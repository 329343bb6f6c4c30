"""Periodic batch refit of the failure predictor with scikit-learn, swapped in only if better.

The online predictor (:mod:`analytics.predictor`, river logistic regression) learns one
vector at a time and is linear. From the labelled vectors it has seen (its ``history``:
features, label, and the probability the online model gave *before* learning the
vector), :func:`refit` trains a gradient-boosted tree model
(``sklearn.ensemble.HistGradientBoostingClassifier``, which takes missing features as
NaN natively) on the older part of the history, in time order, and compares the two
models on the most recent part, which the batch model never saw: the online model by
its prequential scores, the batch model by its predictions. The batch model is adopted
only when its average precision (``sklearn.metrics.average_precision_score``, the area
under the precision-recall curve, the right measure for rare failures) beats the online
model's by ``min_gain``; otherwise the online model keeps serving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Labelled = tuple[dict[str, float], bool, float, float]
"""One history row: ``(features, label, online probability before learning, window end)``."""


@dataclass(frozen=True, slots=True)
class BatchModel:
    """A fitted batch model and the feature order it expects."""

    features: tuple[str, ...]
    model: Any

    def probability(self, values: dict[str, float]) -> float:
        """Return the probability of failure for one feature vector (missing -> NaN)."""
        row = np.array([[values.get(f, math.nan) for f in self.features]], dtype=np.float64)
        return float(self.model.predict_proba(row)[0, 1])

    def probabilities(self, rows: list[dict[str, float]]) -> list[float]:
        """Return :meth:`probability` of many vectors in one call (a call costs ~9 ms)."""
        if not rows:
            return []
        table = np.array(
            [[r.get(f, math.nan) for f in self.features] for r in rows], dtype=np.float64
        )
        return [float(p) for p in self.model.predict_proba(table)[:, 1]]


@dataclass(frozen=True, slots=True)
class RefitDecision:
    """What :func:`refit` concluded.

    Attributes:
        adopted: Whether the batch model should replace the online one.
        batch_ap: Average precision of the batch model on the recent holdout (0-1).
        online_ap: Average precision of the online model's prequential scores there.
        train_rows, holdout_rows, holdout_positives: Sizes used.
        model: The batch model (also when not adopted), or ``None`` when too few data.
        why: A sentence for the log and the audit.
    """

    adopted: bool
    batch_ap: float
    online_ap: float
    train_rows: int
    holdout_rows: int
    holdout_positives: int
    model: BatchModel | None
    why: str


def refit(
    history: Sequence[Labelled],
    *,
    holdout_fraction: float = 0.25,
    min_positives: int = 20,
    min_gain: float = 0.01,
    seed: int = 0,
) -> RefitDecision:
    """Fit the batch model on the older history and compare it on the recent part.

    Args:
        history: Labelled rows in time order (see :data:`Labelled`).
        holdout_fraction: Newest share of the rows held out for the comparison, (0, 1).
        min_positives: Failures needed in the training part (and 3 in the holdout).
        min_gain: Average-precision margin the batch model must win by.
        seed: Seed of the tree model.

    Raises:
        ValueError: ``holdout_fraction`` outside (0, 1).
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    rows = sorted(history, key=lambda r: r[3])
    cut = int(len(rows) * (1.0 - holdout_fraction))
    train, hold = rows[:cut], rows[cut:]
    pos_train = sum(1 for r in train if r[1])
    pos_hold = sum(1 for r in hold if r[1])
    if pos_train < min_positives or pos_hold < 3 or pos_hold == len(hold):
        return RefitDecision(
            adopted=False,
            batch_ap=math.nan,
            online_ap=math.nan,
            train_rows=len(train),
            holdout_rows=len(hold),
            holdout_positives=pos_hold,
            model=None,
            why=f"too few failures to refit ({pos_train} in training, {pos_hold} recent)",
        )
    from sklearn.ensemble import HistGradientBoostingClassifier  # ~1 s: only when refitting
    from sklearn.metrics import average_precision_score

    features = tuple(sorted({k for r in rows for k in r[0]}))

    def matrix(part: Sequence[Labelled]) -> Any:
        return np.array([[r[0].get(f, math.nan) for f in features] for r in part], dtype=np.float64)

    model = HistGradientBoostingClassifier(
        max_iter=200, learning_rate=0.1, class_weight="balanced", random_state=seed
    )
    model.fit(matrix(train), np.array([r[1] for r in train]))
    labels = np.array([r[1] for r in hold])
    batch_ap = float(average_precision_score(labels, model.predict_proba(matrix(hold))[:, 1]))
    online_ap = float(average_precision_score(labels, np.array([r[2] for r in hold])))
    adopted = batch_ap >= online_ap + min_gain
    why = (
        f"batch model average precision {batch_ap:.3f} vs online {online_ap:.3f} on the "
        f"{len(hold)} most recent vectors ({pos_hold} failures): "
        f"{'adopted' if adopted else 'online model kept'}"
    )
    return RefitDecision(
        adopted=adopted,
        batch_ap=batch_ap,
        online_ap=online_ap,
        train_rows=len(train),
        holdout_rows=len(hold),
        holdout_positives=pos_hold,
        model=BatchModel(features, model),
        why=why,
    )
