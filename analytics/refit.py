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
model's by ``min_gain`` and its calibrated probabilities score no worse (Brier) there;
otherwise the online model keeps serving. Every split is by time, with the label horizon
between the training rows and the later ones (issue #15: a split where one failing GPU's
near-duplicate minute vectors fell on both sides adopted the trees at every refit, and
their balanced class weights put 18 % of all GPU-minutes above 0.5).
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
    """A fitted batch model, the feature order it expects and its calibration.

    ``calibration`` is Platt's ``(a, b)``: the served probability is
    ``1 / (1 + exp(-(a * logit(p) + b)))`` of the trees' raw ``p``, fitted on a
    time-ordered slice the trees never saw; ``(1, 0)`` serves ``p`` unchanged.
    """

    features: tuple[str, ...]
    model: Any
    calibration: tuple[float, float] = (1.0, 0.0)

    def _calibrated(self, raw: Any) -> Any:
        a, b = self.calibration
        p = np.clip(np.asarray(raw, dtype=np.float64), 1e-6, 1.0 - 1e-6)
        return 1.0 / (1.0 + np.exp(-np.clip(a * np.log(p / (1.0 - p)) + b, -30.0, 30.0)))

    def probability(self, values: dict[str, float]) -> float:
        """Return the probability of failure for one feature vector (missing -> NaN)."""
        row = np.array([[values.get(f, math.nan) for f in self.features]], dtype=np.float64)
        return float(self._calibrated(self.model.predict_proba(row)[:, 1])[0])

    def probabilities(self, rows: list[dict[str, float]]) -> list[float]:
        """Return :meth:`probability` of many vectors in one call (a call costs ~9 ms)."""
        if not rows:
            return []
        table = np.array(
            [[r.get(f, math.nan) for f in self.features] for r in rows], dtype=np.float64
        )
        return [float(p) for p in self._calibrated(self.model.predict_proba(table)[:, 1])]


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


def _platt(raw: Any, labels: Any) -> tuple[float, float]:
    """Fit Platt scaling ``(a, b)`` of ``logit(raw)`` to ``labels``.

    A one-feature logistic regression, lightly regularised so that a separable slice
    keeps ``a`` finite.
    """
    from sklearn.linear_model import LogisticRegression

    p = np.clip(np.asarray(raw, dtype=np.float64), 1e-6, 1.0 - 1e-6)
    x = np.log(p / (1.0 - p)).reshape(-1, 1)
    y = np.asarray(labels, dtype=bool)
    fit = LogisticRegression(C=1.0).fit(x, y)
    return float(fit.coef_[0, 0]), float(fit.intercept_[0])


def refit(
    history: Sequence[Labelled],
    *,
    holdout_fraction: float = 0.25,
    calibration_fraction: float = 0.15,
    gap_seconds: float = 0.0,
    min_positives: int = 20,
    min_gain: float = 0.01,
    seed: int = 0,
) -> RefitDecision:
    """Fit the batch model on the older history, calibrate and compare it on later parts.

    The rows are split **by time**, never shuffled: the newest ``holdout_fraction`` is the
    holdout the two models are compared on, the ``calibration_fraction`` before it fits
    the batch model's Platt calibration, and the trees train only on rows older than the
    calibration slice by at least ``gap_seconds`` (the label horizon: the minute vectors
    of one failing GPU before one failure are near duplicates with the same label, and
    would otherwise sit on both sides of the cut and reward memorising them). The trees
    are fitted unweighted (no balanced class weights: they push every probability up)
    and without their own early stopping (a random split of the training rows). The batch
    model is adopted only when on the holdout its average precision beats the online
    model's by ``min_gain`` **and** its calibrated probabilities have no larger Brier
    score than the online model's.

    Args:
        history: Labelled rows in time order (see :data:`Labelled`).
        holdout_fraction: Newest share of the rows held out for the comparison, (0, 1).
        calibration_fraction: Share before the holdout that calibrates, [0, 1).
        gap_seconds: Time between the last training row and the calibration slice, >= 0.
        min_positives: Failures needed in the training part (and 3 in the holdout).
        min_gain: Average-precision margin the batch model must win by.
        seed: Seed of the tree model.

    Raises:
        ValueError: A fraction out of range or a negative gap.
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    if not 0.0 <= calibration_fraction < 1.0 - holdout_fraction or gap_seconds < 0:
        raise ValueError("calibration_fraction must be in [0, 1 - holdout_fraction) and "
                         "gap_seconds >= 0")
    rows = sorted(history, key=lambda r: r[3])
    cut = int(len(rows) * (1.0 - holdout_fraction))
    calib_cut = int(len(rows) * (1.0 - holdout_fraction - calibration_fraction))
    hold, calib = rows[cut:], rows[calib_cut:cut]
    first_later = rows[calib_cut][3] if calib_cut < len(rows) else math.inf
    train = [r for r in rows[:calib_cut] if r[3] < first_later - gap_seconds]
    pos_train = sum(1 for r in train if r[1])
    pos_hold = sum(1 for r in hold if r[1])
    pos_calib = sum(1 for r in calib if r[1])
    enough_calib = calibration_fraction == 0.0 or pos_calib >= 3
    if pos_train < min_positives or pos_hold < 3 or pos_hold == len(hold) or not enough_calib:
        return RefitDecision(
            adopted=False,
            batch_ap=math.nan,
            online_ap=math.nan,
            train_rows=len(train),
            holdout_rows=len(hold),
            holdout_positives=pos_hold,
            model=None,
            why=f"too few failures to refit ({pos_train} in training, {pos_calib} to "
            f"calibrate, {pos_hold} recent)",
        )
    from sklearn.ensemble import HistGradientBoostingClassifier  # ~1 s: only when refitting
    from sklearn.metrics import average_precision_score

    # a feature the training rows hold fewer than two values of teaches the trees nothing
    # (and an almost empty column made scikit-learn's binning raise)
    seen: dict[str, set[float]] = {}
    for r in train:
        for k, v in r[0].items():
            values = seen.setdefault(k, set())
            if len(values) < 2 and not math.isnan(v):
                values.add(v)
    features = tuple(sorted(k for k, values in seen.items() if len(values) >= 2))
    if not features:
        return RefitDecision(adopted=False, batch_ap=math.nan, online_ap=math.nan,
                             train_rows=len(train), holdout_rows=len(hold),
                             holdout_positives=pos_hold, model=None,
                             why="no feature to refit on")

    def matrix(part: Sequence[Labelled]) -> Any:
        return np.array([[r[0].get(f, math.nan) for f in features] for r in part], dtype=np.float64)

    model = HistGradientBoostingClassifier(
        max_iter=200, learning_rate=0.1, early_stopping=False, random_state=seed
    )
    try:
        model.fit(matrix(train), np.array([r[1] for r in train]))
    except ValueError as exc:  # a degenerate history: the online model keeps serving
        return RefitDecision(adopted=False, batch_ap=math.nan, online_ap=math.nan,
                             train_rows=len(train), holdout_rows=len(hold),
                             holdout_positives=pos_hold, model=None,
                             why=f"the batch model could not be fitted: {exc}")
    calibration = (1.0, 0.0)
    if calib:
        calibration = _platt(model.predict_proba(matrix(calib))[:, 1], [r[1] for r in calib])
    batch = BatchModel(features, model, calibration)
    labels = np.array([r[1] for r in hold])
    served = np.array(batch.probabilities([r[0] for r in hold]))
    online = np.array([r[2] for r in hold])
    batch_ap = float(average_precision_score(labels, served))
    online_ap = float(average_precision_score(labels, online))
    batch_brier = float(np.mean((served - labels) ** 2))
    online_brier = float(np.mean((online - labels) ** 2))
    adopted = batch_ap >= online_ap + min_gain and batch_brier <= online_brier
    why = (
        f"batch model average precision {batch_ap:.3f} vs online {online_ap:.3f}, Brier "
        f"{batch_brier:.4f} vs {online_brier:.4f}, on the {len(hold)} most recent vectors "
        f"({pos_hold} failures; trained on {len(train)} older by {gap_seconds:.0f} s, "
        f"calibrated on {len(calib)}): {'adopted' if adopted else 'online model kept'}"
    )
    return RefitDecision(
        adopted=adopted,
        batch_ap=batch_ap,
        online_ap=online_ap,
        train_rows=len(train),
        holdout_rows=len(hold),
        holdout_positives=pos_hold,
        model=batch,
        why=why,
    )
