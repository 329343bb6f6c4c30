"""Online failure predictor: probability that a GPU (or link) fails within a horizon.

One river pipeline (running standard scaler, then logistic regression trained by SGD) is shared
by all entities of a kind: failures are rare, so per-GPU models would never see a positive. For
each feature vector the predictor first **predicts** (a ``Prediction`` with the probability and
the features that drove it: the largest ``weight * standardised value`` terms), then keeps the
vector until its label is known:

* a **critical finding** about the entity (``fault-model.md`` severities) within
  ``horizon_seconds`` after the vector labels it positive;
* a vector that reaches ``horizon_seconds`` of age with no such finding is labelled negative.

Labels therefore arrive late, as they do in production, and the model learns each vector once,
in time order, after it was scored (prequential evaluation). Negatives are subsampled by
``negative_rate`` (seeded) to temper the class imbalance. The whole state (model, pending vectors,
random generator) is checkpointed to disk atomically and restored at start, so a restarted or
standby controller resumes warm.

The features are whatever the windowing stage puts in ``FeatureVector.values`` (corrected-error
rates and trends, remap state, Xid counts by class, temperature deviation from peers, throttle
time, PCIe replay rate, link error rates, probe loss and RTT); missing features are simply
absent, never zero-filled by this module.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import tempfile
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.records import EntityId, FeatureVector, Finding, NodeName, Prediction, Severity

logger = logging.getLogger(__name__)

_CHECKPOINT_VERSION = 1


class OnlineFailurePredictor:
    """Shared online logistic regression over per-entity features, with delayed labels.

    Args:
        horizon_seconds: Failure horizon: a critical finding within this time after a vector
            makes it positive; > 0.
        learning_rate: SGD step of the logistic regression; > 0.
        negative_rate: Fraction of negative vectors learned, in (0, 1].
        top_features: Features reported per prediction, >= 1.
        seed: Seed of the negative subsampling; always set in tests.
        history_size: Labelled vectors kept for the batch refit (oldest dropped first).

    Raises:
        ValueError: An argument is out of range.
    """

    name = "failure_predictor"

    def __init__(
        self,
        *,
        horizon_seconds: float = 86_400.0,
        learning_rate: float = 0.05,
        negative_rate: float = 0.2,
        top_features: int = 5,
        seed: int | None = None,
        history_size: int = 50_000,
    ) -> None:
        if horizon_seconds <= 0:
            raise ValueError(f"horizon_seconds must be > 0, got {horizon_seconds!r}")
        if learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
        if not 0.0 < negative_rate <= 1.0:
            raise ValueError(f"negative_rate must be in (0, 1], got {negative_rate!r}")
        if top_features < 1:
            raise ValueError(f"top_features must be >= 1, got {top_features}")
        self.horizon_seconds = horizon_seconds
        self.learning_rate = learning_rate
        self.negative_rate = negative_rate
        self.top_features = top_features
        self.seed = seed
        self._river_scaler: Any = None  # river's models, made at first use (river's import
        self._river_model: Any = None  # costs ~1 s and ~90 MiB; an agent starts without it)
        self._pending: deque[FeatureVector] = deque()
        self._failed_at: dict[tuple[NodeName, EntityId], list[float]] = {}
        self._rng = random.Random(seed)
        self.learned_positive = 0
        self.learned_negative = 0
        self._scored: dict[tuple[NodeName, EntityId, float], float] = {}
        self.history: deque[tuple[dict[str, float], bool, float, float]] = deque(
            maxlen=history_size)
        """Labelled vectors in the order learned: ``(features, label, probability the online
        model gave before learning it, window end)``, for the batch refit
        (:mod:`analytics.refit`) to train on and to compare against, prequentially."""

    def _build(self) -> None:
        from river import linear_model, optim, preprocessing

        if self._river_scaler is None:
            self._river_scaler = preprocessing.StandardScaler()
        if self._river_model is None:
            self._river_model = linear_model.LogisticRegression(
                optimizer=optim.SGD(self.learning_rate))

    @property
    def _scaler(self) -> Any:
        """River ``StandardScaler`` of the features (made at first use)."""
        if self._river_scaler is None:
            self._build()
        return self._river_scaler

    @_scaler.setter
    def _scaler(self, value: Any) -> None:
        self._river_scaler = value

    @property
    def _model(self) -> Any:
        """River ``LogisticRegression`` with SGD (made at first use)."""
        if self._river_model is None:
            self._build()
        return self._river_model

    @_model.setter
    def _model(self, value: Any) -> None:
        self._river_model = value

    def predict(self, x: FeatureVector) -> Prediction:
        """Predict failure of ``x``'s entity within the horizon, then queue ``x`` for labelling."""
        features = dict(x.values)
        scaled = self._scaler.transform_one(features)
        probability = float(self._model.predict_proba_one(scaled).get(True, 0.0))
        weights = self._model.weights
        terms = {f: float(weights.get(f, 0.0)) * v for f, v in scaled.items()}
        top = sorted(terms.items(), key=lambda kv: -abs(kv[1]))[: self.top_features]
        self._scaler.learn_one(features)
        self._pending.append(x)
        self._scored[(x.node, x.entity, x.window_end_at)] = probability
        self._settle(x.window_end_at)
        return Prediction(
            node=x.node,
            entity=x.entity,
            probability=probability,
            horizon_seconds=self.horizon_seconds,
            top_features=dict(top),
            predicted_at=x.window_end_at,
        )

    def observe_finding(self, finding: Finding) -> None:
        """Record a finding; a critical one labels the entity's recent vectors positive."""
        if finding.severity is not Severity.CRITICAL:
            return
        at = finding.first_seen_at if finding.first_seen_at is not None else finding.last_seen_at
        if at is None:
            return
        self._failed_at.setdefault((finding.node, finding.entity), []).append(at)

    def _label(self, x: FeatureVector) -> bool | None:
        failures = self._failed_at.get((x.node, x.entity), ())
        if any(x.window_end_at <= t <= x.window_end_at + self.horizon_seconds for t in failures):
            return True
        return None

    def _settle(self, now: float) -> None:
        """Learn every pending vector whose label is known at ``now``, oldest first."""
        while self._pending:
            x = self._pending[0]
            label = self._label(x)
            if label is None and now - x.window_end_at < self.horizon_seconds:
                break  # the oldest is still open; later ones are younger
            self._pending.popleft()
            scored = self._scored.pop((x.node, x.entity, x.window_end_at), None)
            if label:
                self._learn(x, True, scored)
            elif self._rng.random() < self.negative_rate:
                self._learn(x, False, scored)
        # Vectors after a failure in the queue may already be positive; they wait their turn.
        oldest = self._pending[0].window_end_at if self._pending else now
        for key, times in list(self._failed_at.items()):
            kept = [t for t in times if t >= oldest]
            if kept:
                self._failed_at[key] = kept
            else:
                del self._failed_at[key]

    def _learn(self, x: FeatureVector, label: bool, scored: float | None = None) -> None:
        if scored is not None:
            self.history.append((dict(x.values), label, scored, x.window_end_at))
        self._model.learn_one(self._scaler.transform_one(dict(x.values)), label)
        if label:
            self.learned_positive += 1
        else:
            self.learned_negative += 1

    def settle(self, now: float) -> None:
        """Learn what can be labelled at ``now`` (call when findings arrive between vectors)."""
        self._settle(now)

    def save(self, path: Path) -> None:
        """Checkpoint the whole state to ``path`` atomically (write, fsync, rename)."""
        state: dict[str, Any] = {
            "version": _CHECKPOINT_VERSION,
            "params": {
                "horizon_seconds": self.horizon_seconds,
                "learning_rate": self.learning_rate,
                "negative_rate": self.negative_rate,
                "top_features": self.top_features,
                "seed": self.seed,
            },
            "scaler": self._scaler,
            "model": self._model,
            "pending": list(self._pending),
            "scored": dict(self._scored),
            "history": list(self.history),
            "failed_at": self._failed_at,
            "rng": self._rng.getstate(),
            "counts": (self.learned_positive, self.learned_negative),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as handle:
                pickle.dump(state, handle, protocol=pickle.HIGHEST_PROTOCOL)
                handle.flush()
                os.fsync(handle.fileno())
            Path(tmp).replace(path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def restore(cls, path: Path) -> OnlineFailurePredictor:
        """Load a checkpoint written by :meth:`save` (trusted local file: it is a pickle).

        Raises:
            ValueError: The file is not a checkpoint of this version.
        """
        with path.open("rb") as handle:
            state = pickle.load(handle)  # our own checkpoint file, never downloaded
        if not isinstance(state, dict) or state.get("version") != _CHECKPOINT_VERSION:
            raise ValueError(f"{path} is not a version {_CHECKPOINT_VERSION} predictor checkpoint")
        predictor = cls(**state["params"])
        predictor._scaler = state["scaler"]
        predictor._model = state["model"]
        predictor._pending = deque(state["pending"])
        predictor._scored = dict(state.get("scored", {}))
        predictor.history.extend(state.get("history", []))
        predictor._failed_at = state["failed_at"]
        predictor._rng.setstate(state["rng"])
        predictor.learned_positive, predictor.learned_negative = state["counts"]
        logger.info(
            "restored failure predictor from %s (%d positive, %d negative learned, %d pending)",
            path,
            predictor.learned_positive,
            predictor.learned_negative,
            len(predictor._pending),
        )
        return predictor

    def pending(self) -> Sequence[FeatureVector]:
        """Vectors scored but not yet labelled, oldest first."""
        return tuple(self._pending)
