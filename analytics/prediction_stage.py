"""The failure-prediction stage of ``gpuhealth run``: stream -> features -> predictor.

Wraps :class:`~analytics.features.FeatureBuilder` and
:class:`~analytics.predictor.OnlineFailurePredictor`: samples go in as they arrive;
:meth:`PredictionStage.step` emits one prediction per GPU and InfiniBand port every
``interval_seconds``; critical findings label the vectors (a failure within the
horizon). Predictions are withheld until the model has learned from at least
``min_positives`` failures: an untrained logistic model answers 0.5 for everything,
which would page the whole fleet (issue #5: never a false alarm from an unready model).
The model is checkpointed to ``checkpoint_path`` every ``checkpoint_seconds`` and at
:meth:`close`, and restored at start, so a restarted or standby controller resumes warm.

Every ``refit_seconds`` (unless ``refit=False``) a scikit-learn model is refitted from
the labelled history (:mod:`analytics.refit`) and serves the probabilities instead of the
online model only while it beat it on the most recent vectors; the decision is logged and
kept in :attr:`PredictionStage.last_refit`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

from analytics.features import GPU_MODEL_INPUT, MODEL_INPUTS, PORT_MODEL_INPUT, FeatureBuilder
from analytics.hst import HalfSpaceTreesDetector
from analytics.identity import EntityResolver, failure_kind
from analytics.precursors import EvidenceCalibration
from analytics.predictor import OnlineFailurePredictor
from analytics.prior import load as load_prior
from analytics.refit import BatchModel, RefitDecision, refit
from core.records import Anomaly, Event, Finding, Prediction, Record, Sample

logger = logging.getLogger(__name__)


class PredictionStage:
    """Stream-fed failure prediction (see the module docstring).

    Args:
        checkpoint_path: Where the model state is kept, or ``None`` (not persisted).
        horizon_seconds: Failure horizon, > 0.
        interval_seconds: One prediction per entity at most this often, > 0.
        min_positives: Failures learned before predictions are published, >= 0.
        checkpoint_seconds: How often the state is saved, > 0.
        seed: Seed of the predictor's subsampling.
        refit_seconds: How often the scikit-learn batch model is refitted and compared, > 0.
        prior: A prior model to start from when no checkpoint is restored
            (:data:`analytics.prior.PRIOR_PATH` in ``run`` and ``replay``), or ``None``
            (blind until ``min_positives`` failures are learned).
        vector_detector: Also score every feature vector with river's HalfSpaceTrees
            (:class:`~analytics.hst.HalfSpaceTreesDetector`, trees shared per feature set,
            seeded): a GPU or port whose whole feature vector is unusual gives an anomaly.
        refit: Refit the batch model every ``refit_seconds``; ``False``: only the online
            model serves (:meth:`refresh_batch_model` still refits on demand), and
            scikit-learn is never imported (the node agent's default).
        sustain_seconds: A published probability is the lowest the model gave the entity
            over this window (:class:`SustainedProbability`), >= 0; 0 publishes each
            prediction as the model gives it.

    Raises:
        ValueError: An argument out of range.
    """

    def __init__(
        self,
        *,
        checkpoint_path: Path | None,
        horizon_seconds: float = 86_400.0,
        interval_seconds: float = 300.0,
        min_positives: int = 5,
        checkpoint_seconds: float = 300.0,
        seed: int | None = 0,
        refit_seconds: float = 3600.0,
        vector_detector: bool = False,
        refit: bool = True,
        prior: Path | None = None,
        sustain_seconds: float = 1800.0,
    ) -> None:
        if min_positives < 0 or checkpoint_seconds <= 0:
            raise ValueError("min_positives must be >= 0 and checkpoint_seconds > 0")
        self.checkpoint_path = checkpoint_path
        self.min_positives = min_positives
        self.checkpoint_seconds = checkpoint_seconds
        self.features = FeatureBuilder(interval_seconds=interval_seconds)
        self.identity = EntityResolver()
        """One entity per GPU (UUID, PCI bus id, index, serial), learned from the inventory."""
        def fresh() -> OnlineFailurePredictor:
            return OnlineFailurePredictor(
                horizon_seconds=horizon_seconds, seed=seed, inputs=MODEL_INPUTS, scale=False,
                negative_rate=1.0, model=EvidenceCalibration(),
                delay_when=(GPU_MODEL_INPUT, PORT_MODEL_INPUT))

        self.predictor = fresh()
        if checkpoint_path is not None and checkpoint_path.exists():
            try:
                restored = OnlineFailurePredictor.restore(checkpoint_path)
            except Exception as exc:
                logger.error(  # noqa: TRY400
                    "cannot restore the failure predictor from %s, starting cold: %s: %s",
                    checkpoint_path, type(exc).__name__, exc)
            else:
                if restored.inputs != MODEL_INPUTS or not isinstance(
                        restored.model_state()[1], EvidenceCalibration):
                    logger.warning(
                        "the failure-predictor checkpoint %s was written by an older model "
                        "(raw features, logistic regression): not restored; starting from "
                        "the prior", checkpoint_path)
                else:
                    self.predictor = restored
                    logger.info("failure predictor restored from %s (%d positives learned)",
                                checkpoint_path, restored.learned_positive)
        if prior is not None and not self.predictor.from_prior and (
                self.predictor.learned_positive == 0):
            loaded = load_prior(prior, horizon_seconds=horizon_seconds)
            if loaded is None:
                if prior.exists():
                    logger.warning(
                        "the failure-predictor prior %s is unreadable, of another format or "
                        "made for another horizon than %.0f s: starting blind (predictions "
                        "are withheld until %d failures are learned)", prior, horizon_seconds,
                        min_positives)
                else:
                    logger.warning("no failure-predictor prior at %s: starting blind", prior)
            else:
                self.predictor.adopt_prior(loaded.scaler, loaded.model, inputs=loaded.inputs,
                                           scale=loaded.scale, monotone=loaded.monotone)
                logger.info("failure predictor starts from the prior %s", prior)
        self._saved_at: float | None = None
        self.withheld = 0
        self.refit_seconds = refit_seconds
        self.refit = refit
        self.batch: BatchModel | None = None
        """The scikit-learn model serving now, or ``None`` (the online model serves)."""
        self.last_refit: RefitDecision | None = None
        self._refit_at: float | None = None
        self.vector_detector = HalfSpaceTreesDetector(seed=0) if vector_detector else None
        self.anomalies: list[Anomaly] = []
        """Anomalies of the vector detector since the last :meth:`take_anomalies`."""
        self.sustain = SustainedProbability(window_seconds=sustain_seconds)
        self.episodes = WarningEpisodes()
        self.warnings: list[Prediction] = []
        """Warnings opened since the last :meth:`take_warnings` (:class:`WarningEpisodes`)."""

    @property
    def ready(self) -> bool:
        """Whether predictions are published (from the prior, or enough failures learned)."""
        return (self.predictor.from_prior
                or self.predictor.learned_positive >= self.min_positives)

    def observe(self, records: Iterable[Record]) -> None:
        """Take records (samples, and the inventory).

        Samples feed the features under their GPU's one entity; the inventory
        (``gpu_info`` samples, ``gpu_identity`` events) teaches :attr:`identity` which
        aliases are one GPU.
        """
        identity = self.identity
        resolved: list[Sample] = []
        for r in records:
            if not isinstance(r, Sample):
                if isinstance(r, Event):
                    identity.learn(r)
                continue
            if r.metric.startswith("gpu_"):
                if r.metric == "gpu_info":
                    identity.learn(r)
                    continue
                entity = identity.gpu(r.node, r.entity)
                if entity != r.entity:
                    r = dataclasses.replace(r, entity=entity)
            resolved.append(r)
        self.features.observe(resolved)

    def observe_findings(self, findings: Iterable[Finding]) -> None:
        """Take findings; failures label the entity's recent vectors.

        Which findings are failures: :func:`analytics.identity.failure_kind`; the entity is
        resolved to its one identity first. A failed entity's precursor history starts again
        (:meth:`~analytics.features.FeatureBuilder.forget_history`).
        """
        for finding in findings:
            entity = self.identity.finding(finding)
            if entity != finding.entity:
                finding = dataclasses.replace(finding, entity=entity)
            self.predictor.observe_finding(finding)
            if failure_kind(finding) is not None:  # repaired or replaced after it
                self.features.forget_history(finding.node, finding.entity)
                self.sustain.forget(finding.node, finding.entity)

    def step(self, now: float) -> list[Prediction]:
        """Score every entity due; return the predictions to publish (none until ready)."""
        out: list[Prediction] = []
        if self._refit_at is None:
            self._refit_at = now
        elif self.refit and now - self._refit_at >= self.refit_seconds:
            self._refit_at = now
            self.refresh_batch_model()
        vectors = list(self.features.vectors(now))
        batch = (
            self.batch.probabilities([unit_free(v.values) for v in vectors])
            if self.batch is not None
            else None
        )
        for k, vector in enumerate(vectors):
            if self.vector_detector is not None:
                anomaly = self.vector_detector.observe(vector)
                if anomaly is not None:
                    self.anomalies.append(anomaly)
            # the predictor keeps what it learns from (unit-free features) until labelled
            prediction = self.predictor.predict(
                dataclasses.replace(vector, values=unit_free(vector.values)))
            if self.predictor.inputs is not None:  # name the signals, not the pooled input
                prediction = dataclasses.replace(
                    prediction, top_features=_evidence_of(vector.values, prediction))
            if batch is not None:
                prediction = dataclasses.replace(prediction, probability=batch[k])
            prediction = self.sustain.update(prediction)
            if self.ready:
                out.append(prediction)
                warning = self.episodes.update(prediction)
                if warning is not None:
                    self.warnings.append(warning)
            else:
                self.withheld += 1
        self.predictor.settle(now)
        if self._saved_at is None:
            self._saved_at = now
        elif now - self._saved_at >= self.checkpoint_seconds:
            self.save()
            self._saved_at = now
        return out

    def for_alerts(self, predictions: Iterable[Prediction]) -> list[Prediction]:
        """Return the predictions the alert pipeline should see, with hysteresis.

        A prediction below the warning level of an entity whose episode is still open
        (:class:`WarningEpisodes`) is held back, so the alert it raised stays until the
        episode closes instead of resolving and firing again at every wobble around 0.5.
        """
        episodes = self.episodes
        held = set(episodes.open())
        return [p for p in predictions
                if p.probability >= episodes.open_at or (p.node, p.entity) not in held]

    def take_warnings(self) -> list[Prediction]:
        """Return and forget the warnings opened since the last call (one per episode)."""
        out, self.warnings = self.warnings, []
        return out

    def take_anomalies(self) -> list[Anomaly]:
        """Return and forget the vector detector's anomalies."""
        out, self.anomalies = self.anomalies, []
        return out

    def refresh_batch_model(self) -> RefitDecision:
        """Refit the batch model now; adopt it only if it beats the online model."""
        decision = refit([(unit_free(v), y, p, t) for v, y, p, t in self.predictor.history],
                         gap_seconds=self.predictor.horizon_seconds)
        self.last_refit = decision
        self.batch = decision.model if decision.adopted else None
        logger.info("failure predictor refit: %s", decision.why)
        return decision

    def save(self) -> None:
        """Checkpoint now (errors are logged: the next checkpoint tries again)."""
        if self.checkpoint_path is None:
            return
        try:
            self.predictor.save(self.checkpoint_path)
        except OSError as exc:
            logger.error(  # noqa: TRY400
                "cannot checkpoint the failure predictor to %s: %s",
                self.checkpoint_path,
                exc,
            )


UNIT_FREE_SUFFIXES = ("_evidence", "_fold", "_hours_since", "_precursor")
"""Features that mean the same on every fleet (:mod:`analytics.precursors`): what the batch
refit may learn from. Raw rates and deviations encode a fleet's units and a GPU's static
offset, which a model fitted on one fleet's recent hours would learn as risk (issue #15)."""


def unit_free(values: Mapping[str, float]) -> dict[str, float]:
    """Return the unit-free features of a vector.

    Those ending in :data:`UNIT_FREE_SUFFIXES`, the ``kind_*`` indicators and
    ``temp_excess`` (degC over the node's peers at equal power: a difference, not a level).
    """
    return {k: v for k, v in values.items()
            if k.endswith(UNIT_FREE_SUFFIXES) or k.startswith("kind_") or k == "temp_excess"}


def _evidence_of(values: Mapping[str, float], prediction: Prediction, top: int = 5
                 ) -> dict[str, float]:
    """Return the precursor evidence behind a prediction, strongest first.

    The model's own terms when the entity shows no evidence.
    """
    found = sorted(((k, v) for k, v in values.items() if k.endswith("_evidence") and v > 0),
                   key=lambda kv: -kv[1])[:top]
    return dict(found) if found else dict(prediction.top_features)


class SustainedProbability:
    """Publish a probability only as high as it has held: the lowest of a recent window.

    The model's probability for an entity is replaced by the lowest it gave that entity in
    the last ``window_seconds`` (the predictions newer than ``now - window_seconds``; with
    the default 300-s interval and 1,800 s, the last 6). A burst of corrected errors that
    reads as strong evidence for half an hour and then fades is no warning; a precursor
    holds for hours, so a real warning comes at most one window later (issue #15: on two
    held-out 256-GPU x 10-day recordings, seeds 12 and 11, a 30-minute window took
    precision at 0.5 from 0.64 to 0.70 and from 0.62 to 0.73, recall of failures with a
    precursor 0.73 -> 0.65 and 0.77 -> 0.77; longer windows lost recall on seed 11,
    ``docs/analytics.md``). Calibration: a published "0.9" means every prediction of the
    window was at least 0.9, each calibrated on its own (conservative, never above the
    model's own value).

    Args:
        window_seconds: The window, >= 0; 0 publishes every probability unchanged.

    Raises:
        ValueError: ``window_seconds`` below 0.
    """

    def __init__(self, *, window_seconds: float = 1800.0) -> None:
        if window_seconds < 0:
            raise ValueError(f"window_seconds must be >= 0, got {window_seconds}")
        self.window_seconds = window_seconds
        self._recent: dict[tuple[str, str], deque[tuple[float, float]]] = {}
        """Per entity: ``(predicted_at, probability)`` of the window, oldest first."""

    def update(self, prediction: Prediction) -> Prediction:
        """Take the model's prediction; return it with the window's lowest probability."""
        if self.window_seconds == 0:
            return prediction
        key = (prediction.node, prediction.entity)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = deque()
        at = prediction.predicted_at
        if recent and recent[-1][0] > at:
            recent.clear()  # a clock that went back: start over
        while recent and recent[0][0] <= at - self.window_seconds:
            recent.popleft()
        recent.append((at, prediction.probability))
        lowest = min(p for _, p in recent)
        if lowest == prediction.probability:
            return prediction
        return dataclasses.replace(prediction, probability=lowest)

    def forget(self, node: str, entity: str) -> None:
        """Drop an entity's window (it failed: repaired or replaced after it)."""
        self._recent.pop((node, entity), None)


class WarningEpisodes:
    """One warning per episode of high failure probability, with hysteresis.

    An entity's episode opens when a prediction reaches ``open_at`` (the warning alert's
    level) and closes once its predictions have stayed below ``close_below`` for
    ``close_after_seconds``: a probability wavering around the alert level is one warning,
    not one per crossing (issue #15 item 4).

    Args:
        open_at: Probability that opens an episode, in (0, 1].
        close_below: Probability under which an episode may close, in [0, ``open_at``].
        close_after_seconds: Time below ``close_below`` that closes it, >= 0.

    Raises:
        ValueError: An argument out of range.
    """

    def __init__(self, *, open_at: float = 0.5, close_below: float = 0.3,
                 close_after_seconds: float = 3600.0) -> None:
        if not 0.0 < open_at <= 1.0 or not 0.0 <= close_below <= open_at:
            raise ValueError("need 0 < open_at <= 1 and 0 <= close_below <= open_at")
        if close_after_seconds < 0:
            raise ValueError("close_after_seconds must be >= 0")
        self.open_at = open_at
        self.close_below = close_below
        self.close_after_seconds = close_after_seconds
        self._open: dict[tuple[str, str], float | None] = {}
        """Open episodes: entity -> since when its predictions are below ``close_below``."""

    def update(self, prediction: Prediction) -> Prediction | None:
        """Take a prediction; return it when it opens a new episode, else ``None``."""
        key = (prediction.node, prediction.entity)
        at, p = prediction.predicted_at, prediction.probability
        if key not in self._open:
            if p >= self.open_at:
                self._open[key] = None
                return prediction
            return None
        if p >= self.close_below:
            self._open[key] = None
            return None
        below = self._open[key]
        if below is None:
            self._open[key] = at
        elif at - below >= self.close_after_seconds:
            del self._open[key]
        return None

    def open(self) -> list[tuple[str, str]]:
        """The entities with an open episode, as ``(node, entity)``."""
        return list(self._open)
