"""Online failure predictor: probability that a GPU (or link) fails within a horizon.

One online pipeline (running standard scaler, then logistic regression trained by SGD) is shared
by all entities of a kind: failures are rare, so per-GPU models would never see a positive. For
each feature vector the predictor first **predicts** (a ``Prediction`` with the probability and
the features that drove it: the largest ``weight * standardised value`` terms), then keeps the
vector until its label is known:

* a **failure** about the entity within ``horizon_seconds`` after the vector labels it
  positive: a critical finding, a port taken out of service, a thermal fault
  (:func:`analytics.identity.failure_kind`); failures without numeric precursor (a GPU
  fallen off the bus) label nothing and are counted in ``unpredictable``;
* a vector that reaches ``horizon_seconds`` of age with no such finding is labelled negative;
* a vector within ``horizon_seconds`` after a failure of its entity (of any kind) is not
  learned at all: the entity is out of service, its errors say nothing of health;
* a would-be negative followed within the horizon by a failure without numeric precursor
  (a GPU fallen off the bus) is not learned either (such failures are reported apart);
* a would-be negative that shows evidence (``delay_when``) waits a second horizon and is
  not learned if its entity fails then (a precursor longer than the horizon).

Labels therefore arrive late, as they do in production, and the model learns each vector once,
in time order, after it was scored (prequential evaluation). Negatives are subsampled by
``negative_rate`` (seeded) to temper the class imbalance. The whole state (model, pending vectors,
random generator) is checkpointed to disk atomically and restored at start, so a restarted or
standby controller resumes warm.

The features are whatever the windowing stage puts in ``FeatureVector.values`` (corrected-error
rates and trends, remap state, Xid counts by class, temperature deviation from peers, throttle
time, PCIe replay rate, link error rates, probe loss and RTT); missing features are simply
absent, never zero-filled by this module.

The scaler and the model are :class:`RunningStandardScaler` and :class:`SgdLogisticRegression`:
plain-Python ports of river's ``preprocessing.StandardScaler`` and
``linear_model.LogisticRegression(optimizer=optim.SGD(learning_rate))`` (same updates, same
defaults: log loss, intercept step 0.01, no L2), on dicts of a few features. They exist
because importing those river modules loads scipy, pandas and scikit-learn (~90 MiB of
resident memory, ~1 s) into every node agent, for a model of a dozen weights. A version 1
checkpoint (river's objects) is converted on restore.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import random
import tempfile
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from analytics.identity import UNPREDICTABLE, failure_kind
from core.records import EntityId, FeatureVector, Finding, NodeName, Prediction

logger = logging.getLogger(__name__)

_CHECKPOINT_VERSION = 2
"""Version 2: the model is :class:`SgdLogisticRegression`; version 1 held river's objects."""

_RIVER_CHECKPOINT_VERSION = 1


class RunningStandardScaler:
    """Scale each feature to zero mean and unit variance with running (Welford) estimates.

    The arithmetic of river's ``preprocessing.StandardScaler`` (population variance; a
    feature without variance scales to 0.0), on plain dicts.

    Examples:
        >>> scaler = RunningStandardScaler()
        >>> for v in (1.0, 3.0):
        ...     scaler.learn_one({"x": v})
        >>> scaler.transform_one({"x": 4.0, "y": 1.0})
        {'x': 2.0, 'y': 0.0}
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.means: dict[str, float] = {}
        self.vars: dict[str, float] = {}

    def learn_one(self, x: dict[str, float]) -> None:
        """Update the running mean and variance of each feature of ``x``."""
        counts, means, vars_ = self.counts, self.means, self.vars
        for i, xi in x.items():
            n = counts[i] = counts.get(i, 0) + 1
            old = means.get(i, 0.0)
            mean = means[i] = old + (xi - old) / n
            var = vars_.get(i, 0.0)
            vars_[i] = var + ((xi - old) * (xi - mean) - var) / n

    def transform_one(self, x: dict[str, float]) -> dict[str, float]:
        """Return ``x`` standardised by the estimates so far (unseen features: 0.0)."""
        means, vars_ = self.means, self.vars
        out: dict[str, float] = {}
        for i, xi in x.items():
            v = vars_.get(i, 0.0)
            out[i] = (xi - means.get(i, 0.0)) / v**0.5 if v else 0.0
        return out


class SgdLogisticRegression:
    """Binary logistic regression trained one example at a time by plain SGD.

    The updates of river's ``linear_model.LogisticRegression`` with ``optim.SGD(lr)``:
    log loss, weights start at zero, the intercept learns at a constant 0.01, no
    regularisation, the gradient clipped to ``clip_gradient``.

    Args:
        learning_rate: SGD step of the weights, > 0.
        intercept_learning_rate: Step of the intercept, >= 0.
        clip_gradient: Largest absolute loss gradient, > 0.

    Examples:
        >>> model = SgdLogisticRegression(learning_rate=0.5)
        >>> model.predict_proba_one({"x": 1.0})
        0.5
        >>> for _ in range(20):
        ...     model.learn_one({"x": 1.0}, True)
        ...     model.learn_one({"x": -1.0}, False)
        >>> model.predict_proba_one({"x": 1.0}) > 0.9
        True
    """

    def __init__(self, *, learning_rate: float = 0.01, intercept_learning_rate: float = 0.01,
                 clip_gradient: float = 1e12) -> None:
        if learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
        self.learning_rate = learning_rate
        self.intercept_learning_rate = intercept_learning_rate
        self.clip_gradient = clip_gradient
        self.weights: dict[str, float] = {}
        self.intercept = 0.0

    def _raw(self, x: dict[str, float]) -> float:
        w = self.weights
        return sum(w.get(i, 0.0) * xi for i, xi in x.items()) + self.intercept

    def predict_proba_one(self, x: dict[str, float]) -> float:
        """Return the probability that ``x`` is positive, in [0, 1]."""
        z = self._raw(x)
        if z < -30:
            return 0.0
        if z > 30:
            return 1.0
        return 1.0 / (1.0 + math.exp(-z))

    def learn_one(self, x: dict[str, float], y: bool) -> None:
        """Take one SGD step on the log loss of ``(x, y)``."""
        sign = 1 if y else -1
        z = self._raw(x) * sign
        if z > 18.0:
            gradient = math.exp(-z) * -sign
        elif z < -18.0:
            gradient = float(-sign)
        else:
            gradient = -sign / (math.exp(z) + 1.0)
        gradient = max(-self.clip_gradient, min(self.clip_gradient, gradient))
        self.intercept -= self.intercept_learning_rate * gradient
        w, lr = self.weights, self.learning_rate
        for i, xi in x.items():
            w[i] = w.get(i, 0.0) - lr * (xi * gradient)


def _from_river(scaler: Any, model: Any, learning_rate: float
                ) -> tuple[RunningStandardScaler, SgdLogisticRegression]:
    """Convert the river scaler and model of a version 1 checkpoint (same arithmetic)."""
    ours = RunningStandardScaler()
    ours.counts = {str(k): int(v) for k, v in scaler.counts.items()}
    ours.means = {str(k): float(v) for k, v in scaler.means.items()}
    ours.vars = {str(k): float(v) for k, v in scaler.vars.items()}
    lr = getattr(getattr(model.optimizer, "lr", None), "learning_rate", learning_rate)
    intercept_lr = getattr(model.intercept_lr, "learning_rate", 0.01)
    logistic = SgdLogisticRegression(learning_rate=float(lr),
                                     intercept_learning_rate=float(intercept_lr),
                                     clip_gradient=float(model.clip_gradient))
    logistic.weights = {str(k): float(v) for k, v in model.weights.items()}
    logistic.intercept = float(model.intercept)
    return ours, logistic


class ProbabilityModel(Protocol):
    """What the predictor needs of its model.

    :class:`SgdLogisticRegression` and :class:`~analytics.precursors.EvidenceCalibration`.
    """

    weights: dict[str, float]
    intercept: float
    learning_rate: float

    def predict_proba_one(self, x: dict[str, float]) -> float:
        """Return the probability that ``x`` is positive, in [0, 1]."""

    def learn_one(self, x: dict[str, float], y: bool) -> None:
        """Learn one labelled example."""


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
        inputs: The features the model reads (all of a vector's when ``None``); the others
            are kept in the history for the batch refit.
        scale: Standardise the inputs with running estimates; ``False`` for inputs that
            already mean the same on every fleet (precursor evidence,
            :mod:`analytics.precursors`).
        monotone: Inputs whose weights are kept >= 0: more evidence never lowers the risk.
        model: The model (a logistic regression by SGD when ``None``); the prediction
            stage gives :class:`~analytics.precursors.EvidenceCalibration`.
        delay_when: Inputs that, when above 0, make a vector that ages past the horizon
            without a failure wait a second horizon: followed by a failure then (a
            precursor longer than the horizon) it is not learned; else it is a negative.
            Without it one 40-hour precursor taught the prior that strong evidence is
            mostly healthy (issue #15).

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
        inputs: Sequence[str] | None = None,
        scale: bool = True,
        monotone: Sequence[str] = (),
        model: ProbabilityModel | None = None,
        delay_when: Sequence[str] = (),
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
        self.history_size = history_size
        self.inputs = tuple(inputs) if inputs is not None else None
        self.scale = scale
        self.monotone = tuple(monotone)
        self._scaler = RunningStandardScaler()
        self._model: ProbabilityModel = (
            model if model is not None else SgdLogisticRegression(learning_rate=learning_rate))
        self._pending: deque[FeatureVector] = deque()
        self._failed_at: dict[tuple[NodeName, EntityId], list[float]] = {}
        self._ended: dict[tuple[NodeName, EntityId], list[float]] = {}
        """Failure times of any kind, per entity, for :meth:`_censored`."""
        self.censor_seconds = horizon_seconds
        """After a failure an entity is out of service (drained, reset, replaced): its
        vectors for this long are neither positive nor negative (issue #15: the errors of a
        GPU that has already failed taught the model that evidence precedes health)."""
        self.censored = 0
        """Vectors not learned: after a failure of their entity, or delayed ones followed by
        a failure within the second horizon."""
        self.delay_when = tuple(delay_when)
        self._gray: deque[tuple[FeatureVector, float | None]] = deque()
        self._rng = random.Random(seed)
        self.learned_positive = 0
        self.learned_negative = 0
        self._scored: dict[tuple[NodeName, EntityId, float], float] = {}
        self.from_prior = False
        """Whether the model started from the shipped prior rather than from zero."""
        self.unpredictable: dict[str, int] = {}
        """Failures without numeric precursor seen, by ``kind/code`` (never labels)."""
        self._unpredictable_seen: dict[tuple[NodeName, EntityId], set[float]] = {}
        self.history: deque[tuple[dict[str, float], bool, float, float]] = deque(
            maxlen=history_size)
        """Labelled vectors in the order learned: ``(features, label, probability the online
        model gave before learning it, window end)``, for the batch refit
        (:mod:`analytics.refit`) to train on and to compare against, prequentially."""

    def predict(self, x: FeatureVector) -> Prediction:
        """Predict failure of ``x``'s entity within the horizon, then queue ``x`` for labelling."""
        features = self._inputs(x)
        scaled = self._scaler.transform_one(features) if self.scale else features
        probability = self._model.predict_proba_one(scaled)
        weights = self._model.weights
        terms = {f: float(weights.get(f, 0.0)) * v for f, v in scaled.items()}
        top = sorted(terms.items(), key=lambda kv: -abs(kv[1]))[: self.top_features]
        if self.scale:
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
        """Record a finding; a failure labels the entity's recent vectors positive.

        Failures are :func:`analytics.identity.failure_kind`'s.
        A failure without numeric precursor (a GPU fallen off the bus) labels nothing: it
        is counted in :attr:`unpredictable` by finding code instead.
        """
        kind = failure_kind(finding)
        if kind is None:
            return
        at = finding.first_seen_at if finding.first_seen_at is not None else finding.last_seen_at
        if at is None:
            return
        key = (finding.node, finding.entity)
        ended = self._ended.setdefault(key, [])
        if not ended or abs(at - ended[-1]) >= 600.0:
            ended.append(at)
        if kind == UNPREDICTABLE:
            seen = self._unpredictable_seen.setdefault(key, set())
            if at not in seen:
                seen.add(at)
                code = f"{finding.kind}/{finding.code}"
                self.unpredictable[code] = self.unpredictable.get(code, 0) + 1
            return
        times = self._failed_at.setdefault(key, [])
        # a state held for days (a GPU at its slowdown temperature) is seen at every
        # evaluation: times closer than this to one kept add nothing but work to _label
        merge = min(600.0, self.horizon_seconds / 100.0)
        if all(abs(at - t) >= merge for t in times[-8:]):
            times.append(at)

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
            if self._censored(x):
                self.censored += 1
            elif label:
                self._learn(x, True, scored)
            elif self._ends_within(x, 0.0, self.horizon_seconds):
                self.censored += 1  # before a failure without precursor: neither
            elif any(x.values.get(f, 0.0) > 0.0 for f in self.delay_when):
                self._gray.append((x, scored))  # judged after a second horizon
            elif self._rng.random() < self.negative_rate:
                self._learn(x, False, scored)
        horizon = self.horizon_seconds
        while self._gray and now - self._gray[0][0].window_end_at >= 2 * horizon:
            x, scored = self._gray.popleft()
            if self._ends_within(x, horizon, 2 * horizon):
                self.censored += 1  # a precursor longer than the horizon: not health
            elif self._rng.random() < self.negative_rate:
                self._learn(x, False, scored)
        # Vectors after a failure in the queue may already be positive; they wait their turn.
        oldest = self._pending[0].window_end_at if self._pending else now
        if self._gray:
            oldest = min(oldest, self._gray[0][0].window_end_at)
        for key, times in list(self._failed_at.items()):
            kept = [t for t in times if t >= oldest]
            if kept:
                self._failed_at[key] = kept
            else:
                del self._failed_at[key]
        for key, times in list(self._ended.items()):
            kept = [t for t in times if t >= oldest - self.censor_seconds]
            if kept:
                self._ended[key] = kept
            else:
                del self._ended[key]

    def _ends_within(self, x: FeatureVector, after: float, until: float) -> bool:
        """Whether ``x``'s entity failed (any kind) in ``(at + after, at + until]``."""
        at = x.window_end_at
        return any(at + after < t <= at + until
                   for t in self._ended.get((x.node, x.entity), ()))

    def _censored(self, x: FeatureVector) -> bool:
        """Whether ``x`` comes within :attr:`censor_seconds` after a failure of its entity."""
        at = x.window_end_at
        return any(t < at <= t + self.censor_seconds
                   for t in self._ended.get((x.node, x.entity), ()))

    def _inputs(self, x: FeatureVector) -> dict[str, float]:
        if self.inputs is None:
            return dict(x.values)
        values = x.values
        return {f: values[f] for f in self.inputs if f in values}

    def _learn(self, x: FeatureVector, label: bool, scored: float | None = None) -> None:
        if scored is not None:
            self.history.append((dict(x.values), label, scored, x.window_end_at))
        features = self._inputs(x)
        model = self._model
        model.learn_one(self._scaler.transform_one(features) if self.scale else features, label)
        for f in self.monotone:
            if model.weights.get(f, 0.0) < 0.0:
                model.weights[f] = 0.0
        if label:
            self.learned_positive += 1
        else:
            self.learned_negative += 1

    def model_state(self) -> tuple[RunningStandardScaler, ProbabilityModel]:
        """The scaler and the logistic model (for :mod:`analytics.prior` to write)."""
        return self._scaler, self._model

    def adopt_prior(self, scaler: RunningStandardScaler, model: ProbabilityModel, *,
                    inputs: Sequence[str] | None = None, scale: bool = True,
                    monotone: Sequence[str] = ()) -> None:
        """Start from a prior's model and what it reads (:mod:`analytics.prior`).

        The model goes on learning from the fleet's own labels at this predictor's
        learning rate.
        """
        self._scaler, self._model = scaler, model
        model.learning_rate = self.learning_rate
        self.inputs = tuple(inputs) if inputs is not None else None
        self.scale = scale
        self.monotone = tuple(monotone)
        self.from_prior = True

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
                "inputs": self.inputs,
                "scale": self.scale,
                "monotone": self.monotone,
                "delay_when": self.delay_when,
            },
            "scaler": self._scaler,
            "model": self._model,
            "pending": list(self._pending),
            "scored": dict(self._scored),
            "history": list(self.history),
            "failed_at": self._failed_at,
            "ended": self._ended,
            "gray": list(self._gray),
            "rng": self._rng.getstate(),
            "counts": (self.learned_positive, self.learned_negative),
            "unpredictable": dict(self.unpredictable),
            "from_prior": self.from_prior,
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
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (_CHECKPOINT_VERSION, _RIVER_CHECKPOINT_VERSION):
            raise ValueError(f"{path} is not a version {_CHECKPOINT_VERSION} predictor checkpoint")
        predictor = cls(**state["params"])
        if version == _RIVER_CHECKPOINT_VERSION:  # unpickling it imported river, once
            predictor._scaler, predictor._model = _from_river(
                state["scaler"], state["model"], predictor.learning_rate)
        else:
            predictor._scaler = state["scaler"]
            predictor._model = state["model"]
        predictor._pending = deque(state["pending"])
        predictor._scored = dict(state.get("scored", {}))
        predictor.history.extend(state.get("history", []))
        predictor._failed_at = state["failed_at"]
        predictor._ended = state.get("ended", {})
        predictor._gray = deque(state.get("gray", []))
        predictor._rng.setstate(state["rng"])
        predictor.learned_positive, predictor.learned_negative = state["counts"]
        predictor.unpredictable = dict(state.get("unpredictable", {}))
        predictor.from_prior = bool(state.get("from_prior", False))
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
