"""The analytics stage: online detectors and failure predictor, one code path.

``run``, ``agent`` and ``replay`` all run it (issue #15 item 5).

:class:`AnalyticsStage` takes each batch of records with the time it is judged at (the wall
clock in ``run`` and ``agent``, the recording's time in ``replay``) and returns an
:class:`AnalyticsOutput`: what the alert pipeline takes (findings to hold, gap findings to
close, the predictions it alerts on) and what reports and metrics count (every detector
result, every prediction made, the warnings opened). The entry points only pass it on:
:meth:`gpuhealth.pipeline.Pipeline.observe_analytics` for the pipeline, their metrics or
their replay report for the rest.

What it does with a batch, in order:

1. the online detectors (:class:`~analytics.online.OnlineAnalytics`) score and learn the
   samples (with no sample, only time passing is checked, so a gap opens while nothing
   arrives); anomalies, gaps and peer outliers become ``warning`` findings
   (:func:`~analytics.online.to_finding`), a gap closure the key of the gap to close;
2. the failure predictor (:class:`~analytics.prediction_stage.PredictionStage`) takes the
   records (samples, and the inventory's identities) and, once ``step_seconds`` of the
   given time have passed since its last step, scores every entity due; the vector
   detector's anomalies become findings too, and the predictions pass the warning
   episodes' hysteresis (:meth:`~analytics.prediction_stage.PredictionStage.for_alerts`).

Failures reach the predictor through :meth:`AnalyticsStage.observe_findings`, with every
evaluation's findings: each failure (:func:`analytics.identity.failure_kind`) is passed
once per episode (by key and first time seen), however many evaluations still see it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from analytics.identity import failure_kind
from analytics.online import OnlineAnalytics, OnlineResult, to_finding
from analytics.prediction_stage import PredictionStage
from core.records import Anomaly, Finding, Prediction, Record, Sample

FindingKey = tuple[str, str, str, str]
"""``(node, entity, kind, code)``: :attr:`core.records.Finding.key`."""

VECTOR_METRIC = "feature_vector"
"""The ``code`` of the vector detector's anomaly findings."""


@dataclass(slots=True)
class AnalyticsOutput:
    """What one batch gave (see the module docstring).

    Attributes:
        results: Every online detector result, in the detectors' order (gap closures too).
        findings: Warning findings for the pipeline to hold: anomalies, gaps, peer
            outliers, vector anomalies.
        cleared: Keys of gap findings to close (the GPU sends samples again).
        predictions: Every prediction the predictor made at this batch (empty between
            steps and while it withholds them).
        for_alerts: Those the alert pipeline sees (an open episode's dip below the
            warning level is held back).
        warnings: Warnings opened at this batch, one per episode.
        vector_anomalies: The vector detector's anomalies at this batch.
        stepped: Whether the predictor stepped at this batch.
    """

    results: list[OnlineResult] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    cleared: list[FindingKey] = field(default_factory=list)
    predictions: list[Prediction] = field(default_factory=list)
    for_alerts: list[Prediction] = field(default_factory=list)
    warnings: list[Prediction] = field(default_factory=list)
    vector_anomalies: list[Anomaly] = field(default_factory=list)
    stepped: bool = False


class AnalyticsStage:
    """Online detectors and failure predictor over batches of records (module docstring).

    Args:
        online: The detectors, or ``None`` (``[analytics] detectors = false``).
        prediction: The predictor, or ``None`` (``predictor = false``).
        step_seconds: Least time between two predictor steps, seconds, > 0. The predictor
            emits one vector per entity per its own interval whatever this is; a step
            more often only finds the entities due sooner.

    Raises:
        ValueError: ``step_seconds`` is not > 0.
    """

    def __init__(self, online: OnlineAnalytics | None, prediction: PredictionStage | None, *,
                 step_seconds: float) -> None:
        if not step_seconds > 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds!r}")
        self.online = online
        self.prediction = prediction
        self.step_seconds = step_seconds
        self._stepped_at: float | None = None
        self._failures: set[tuple[FindingKey, float | None]] = set()

    def observe(self, records: Sequence[Record], now: float) -> AnalyticsOutput:
        """Judge ``records`` at ``now`` (epoch seconds); return what they gave.

        The online detectors read ``now`` from their own clock (for samples without a
        time and for gaps); the entry point sets it to the same time.
        """
        out = AnalyticsOutput()
        online = self.online
        if online is not None:
            samples = [r for r in records if isinstance(r, Sample)]
            out.results = online.observe(samples) if samples else online.check()
            for result in out.results:
                if result.kind == "gap_closed":
                    out.cleared.append(to_finding(result).key)
                else:
                    out.findings.append(to_finding(result))
        stage = self.prediction
        if stage is not None:
            stage.observe(records)  # samples, and the inventory's identities
            if self._stepped_at is None or now - self._stepped_at >= self.step_seconds:
                self._stepped_at = now
                out.stepped = True
                out.predictions = stage.step(now)
                out.for_alerts = stage.for_alerts(out.predictions)
                out.warnings = stage.take_warnings()
                out.vector_anomalies = stage.take_anomalies()
                out.findings.extend(
                    to_finding(OnlineResult(kind="anomaly", metric=VECTOR_METRIC, anomaly=a))
                    for a in out.vector_anomalies)
        return out

    def observe_findings(self, findings: Iterable[Finding]) -> None:
        """Give the predictor the failures among ``findings`` it has not seen yet."""
        if self.prediction is None:
            return
        fresh = []
        for f in findings:
            if failure_kind(f) is None:
                continue
            key = (f.key, f.first_seen_at)
            if key not in self._failures:
                self._failures.add(key)
                fresh.append(f)
        if fresh:
            self.prediction.observe_findings(fresh)
