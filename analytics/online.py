"""Online analytics for ``gpuhealth run``: detectors, counter rates, gaps and peers in one stage.

:class:`OnlineAnalytics` takes the batches of samples the service already handles and returns
:class:`OnlineResult` records: a per-series anomaly (a gauge, or the rate of a counter, past
its adaptive threshold), a telemetry gap (a GPU whose samples stopped arriving, as a GPU that
fell off the bus does) or a peer outlier (a GPU hotter than its node peers at equal power).
:func:`to_finding` turns each into a fault-model finding: ``warning`` at most, action ``none``
(a statistical outlier alone never cordons). Deterministic, CPU only, no I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from analytics.gaps import TelemetryGapDetector
from analytics.peers import PeerComparison
from analytics.rates import IB_SATURATING_BITS, CounterRates
from analytics.thresholds import (
    DspotDetector,
    EwmaZScoreDetector,
    QuantileThresholdDetector,
    SpotDetector,
)
from analytics.windowing import SeriesBatch, SeriesIndex, SeriesKey, VectorDetector
from core.catalog import BY_NAME, MetricType
from core.records import (
    Action,
    Anomaly,
    EntityId,
    Evidence,
    Finding,
    NodeName,
    Sample,
    Severity,
)

logger = logging.getLogger(__name__)

DETECTORS: tuple[str, ...] = ("dspot", "ewma_z", "quantile", "spot")
"""Names accepted by ``OnlineAnalytics(detector=...)``."""

TEMPERATURE = "gpu_temperature_celsius"
POWER = "gpu_power_watts"
_NODE = "node"
GAP_CODE = "samples_stopped"
"""Code of the ``telemetry_gap`` findings of :func:`to_finding`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OnlineResult:
    """One finding-worthy result of :class:`OnlineAnalytics`.

    Attributes:
        kind: ``anomaly`` (a series past its threshold), ``telemetry_gap`` (silence),
            ``gap_closed`` (samples of a silent GPU or node arrive again: its gap finding
            closes) or ``peer`` (a GPU hotter than its node peers at equal power).
        metric: The series' metric (the counter's name for a rate); ``""`` for a gap.
        anomaly: The detector's verdict (``detector``, ``score``, ``threshold``, time).
    """

    kind: str
    metric: str
    anomaly: Anomaly


def _make_detector(name: str, warmup_samples: int) -> VectorDetector:
    if name == "dspot":
        return DspotDetector(calibration_samples=warmup_samples)
    if name == "spot":
        return SpotDetector(calibration_samples=warmup_samples)
    if name == "ewma_z":
        return EwmaZScoreDetector(warmup_samples=warmup_samples)
    if name == "quantile":
        return QuantileThresholdDetector(warmup_samples=warmup_samples)
    raise ValueError(f"detector must be one of {', '.join(DETECTORS)}, got {name!r}")


def _is_gpu(sample: Sample) -> bool:
    return sample.metric.startswith("gpu_") and sample.entity != _NODE


class OnlineAnalytics:
    """Vectorised per-series detection, counter rates, telemetry gaps and peer comparison.

    Args:
        detector: Per-series detector, one of :data:`DETECTORS`.
        gap_seconds: Shortest silence of a GPU reported as a telemetry gap, seconds; > 0.
        warmup_samples: Points per series before the detector may flag (SPOT's calibration
            window), >= 20.
        gap_warmup_samples: Arrivals of a GPU before its gaps are reported, >= 2.
        peer_z_threshold: Robust z (at equal power) beyond which a GPU is hotter than its
            node peers; > 0.
        clock: Epoch seconds now; used for gaps and for samples without a time.

    Raises:
        ValueError: An argument is out of range.

    Examples:
        >>> from core.records import EntityId, NodeName, Sample
        >>> online = OnlineAnalytics(detector="ewma_z", warmup_samples=20, clock=lambda: 0.0)
        >>> def s(v, t):
        ...     return Sample(metric="gpu_power_watts", value=v, observed_at=t,
        ...                   node=NodeName("n1"), entity=EntityId("GPU-0"))
        >>> [r for t in range(40) for r in online.observe([s(300.0 + t % 3, float(t))])]
        []
        >>> [(r.kind, r.metric) for r in online.observe([s(900.0, 40.0)])]
        [('anomaly', 'gpu_power_watts')]
    """

    def __init__(
        self,
        *,
        detector: str = "dspot",
        gap_seconds: float = 120.0,
        warmup_samples: int = 500,
        gap_warmup_samples: int = 10,
        peer_z_threshold: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if gap_seconds <= 0:
            raise ValueError(f"gap_seconds must be > 0, got {gap_seconds!r}")
        if warmup_samples < 20:
            raise ValueError(f"warmup_samples must be >= 20, got {warmup_samples}")
        self.detector = detector
        self.gap_seconds = gap_seconds
        self.warmup_samples = warmup_samples
        self.gap_warmup_samples = gap_warmup_samples
        self.peer_z_threshold = peer_z_threshold
        self.clock = clock
        self._detector = _make_detector(detector, warmup_samples)
        self._gaps = TelemetryGapDetector(min_gap_seconds=gap_seconds,
                                          warmup_samples=gap_warmup_samples)
        self._peers = PeerComparison(z_threshold=peer_z_threshold, min_scale=1.0)
        self._counters = SeriesIndex()
        self._rates = CounterRates()
        self._latest: dict[NodeName, dict[EntityId, dict[str, float]]] = {}
        self._peer_open: set[tuple[NodeName, EntityId]] = set()
        self._gap_open: set[tuple[NodeName, EntityId]] = set()

    def observe(self, samples: Iterable[Sample]) -> list[OnlineResult]:
        """Score then learn ``samples``; return anomalies, newly opened gaps and peer outliers.

        Samples of one series must come in time order. Gaps are also found by time passing:
        call :meth:`check` on a timer when no samples arrive.
        """
        now = self.clock()
        gauges: list[tuple[SeriesKey, float, float]] = []
        counters: list[tuple[SeriesKey, float, float]] = []
        arrivals: dict[float, set[tuple[NodeName, EntityId]]] = {}
        touched: set[NodeName] = set()
        for sample in samples:
            spec = BY_NAME.get(sample.metric)
            if spec is None or not np.isfinite(sample.value):
                continue
            at = now if sample.observed_at is None else sample.observed_at
            key = SeriesKey(sample.node, sample.entity, sample.metric)
            is_counter = spec.type is MetricType.COUNTER
            (counters if is_counter else gauges).append((key, sample.value, at))
            if _is_gpu(sample):
                arrivals.setdefault(at, set()).add((sample.node, sample.entity))
                if sample.metric in (TEMPERATURE, POWER):
                    self._latest.setdefault(sample.node, {}).setdefault(sample.entity, {})[
                        sample.metric] = sample.value
                    touched.add(sample.node)
        gauges.extend(self._counter_rates(counters))
        out: list[OnlineResult] = []
        if gauges:
            index = self._detector.index
            batch = SeriesBatch(
                series=index.slots(k for k, _, _ in gauges),
                values=np.fromiter((v for _, v, _ in gauges), dtype=np.float64, count=len(gauges)),
                observed_at=np.fromiter((t for _, _, t in gauges), dtype=np.float64,
                                        count=len(gauges)),
            )
            verdict = self._detector.score_many(batch)
            for position in np.flatnonzero(verdict.flagged):
                key = index.key(int(batch.series[position]))
                out.append(OnlineResult(kind="anomaly", metric=key.metric, anomaly=Anomaly(
                    detector=self._detector.name, node=key.node, entity=key.entity,
                    score=float(verdict.scores[position]),
                    threshold=float(verdict.thresholds[position]),
                    observed_at=float(batch.observed_at[position]))))
        for at in sorted(arrivals):
            self._gaps.arrive(arrivals[at], at)
            out.extend(self._close_gaps(arrivals[at], at))
        out.extend(self.check())
        for node in sorted(touched):
            out.extend(self._compare_peers(node, now))
        return out

    def check(self, now: float | None = None) -> list[OnlineResult]:
        """Return the telemetry gaps opened since the last call (each reported once)."""
        at = self.clock() if now is None else now
        found = self._gaps.check(at)
        self._gap_open.update((a.node, a.entity) for a in found)
        return [OnlineResult(kind="telemetry_gap", metric="", anomaly=a) for a in found]

    def _close_gaps(
        self, arrived: Iterable[tuple[NodeName, EntityId]], at: float
    ) -> list[OnlineResult]:
        if not self._gap_open:
            return []
        out: list[OnlineResult] = []
        for node, entity in sorted(arrived):
            for key in ((node, entity), (node, EntityId(_NODE))):
                if key in self._gap_open:
                    self._gap_open.discard(key)
                    out.append(OnlineResult(kind="gap_closed", metric="", anomaly=Anomaly(
                        detector=self._gaps.name, node=key[0], entity=key[1], score=0.0,
                        threshold=self._gaps.gap_factor, observed_at=at)))
        return out

    def _counter_rates(
        self, counters: Sequence[tuple[SeriesKey, float, float]]
    ) -> list[tuple[SeriesKey, float, float]]:
        if not counters:
            return []
        before = len(self._counters)
        slots = self._counters.slots(k for k, _, _ in counters)
        for slot in range(before, len(self._counters)):
            bits = IB_SATURATING_BITS.get(self._counters.key(slot).metric)
            if bits is not None:
                self._rates.configure(np.array([slot]), bits=bits, saturating=True)
        rates = self._rates.rate_many(SeriesBatch(
            series=slots,
            values=np.fromiter((v for _, v, _ in counters), dtype=np.float64,
                               count=len(counters)),
            observed_at=np.fromiter((t for _, _, t in counters), dtype=np.float64,
                                    count=len(counters)),
        ))
        return [(key, float(rates.rates[i]), at)
                for i, (key, _, at) in enumerate(counters) if rates.valid[i]]

    def _compare_peers(self, node: NodeName, now: float) -> list[OnlineResult]:
        gpus = sorted(e for e, m in self._latest.get(node, {}).items()
                      if TEMPERATURE in m and POWER in m)
        if len(gpus) <= self._peers.min_peers:
            return []
        latest = self._latest[node]
        temp = np.array([latest[e][TEMPERATURE] for e in gpus])
        power = np.array([latest[e][POWER] for e in gpus])
        zeros = np.zeros(len(gpus), dtype=np.int64)
        verdict = self._peers.compare(temp, node=zeros, group=zeros, covariate=power)
        out: list[OnlineResult] = []
        for i, entity in enumerate(gpus):
            key = (node, entity)
            if not verdict.flagged[i]:
                self._peer_open.discard(key)
                continue
            if key in self._peer_open:
                continue
            self._peer_open.add(key)
            out.append(OnlineResult(kind="peer", metric=TEMPERATURE, anomaly=Anomaly(
                detector="peers", node=node, entity=entity, score=float(verdict.z_node[i]),
                threshold=self._peers.z_threshold, observed_at=now)))
        return out


def to_finding(result: OnlineResult) -> Finding:
    """Return the fault-model finding of ``result``: ``warning``, action ``none``.

    An anomaly or a peer outlier is kind ``anomaly`` with the metric as code; a gap is kind
    ``telemetry_gap`` with code :data:`GAP_CODE` (entity ``node`` when every GPU of the node
    went silent); a ``gap_closed`` result gives the key of the gap finding to close.
    A statistical verdict alone never goes above ``warning`` (fault-model.md).

    Examples:
        >>> a = Anomaly(detector="dspot", node=NodeName("n1"), entity=EntityId("GPU-0"),
        ...             score=95.0, threshold=80.0, observed_at=10.0)
        >>> f = to_finding(OnlineResult(kind="anomaly", metric="gpu_temperature_celsius",
        ...                             anomaly=a))
        >>> (f.kind, f.code, f.severity.value, f.action.value)
        ('anomaly', 'gpu_temperature_celsius', 'warning', 'none')
    """
    a = result.anomaly
    if result.kind in ("telemetry_gap", "gap_closed"):
        kind, code = "telemetry_gap", GAP_CODE
        what = "node" if a.entity == _NODE else "GPU"
        summary = (f"no samples for {a.score:.0f} usual intervals "
                   f"(the {what} may have fallen off the bus)")
    elif result.kind == "peer":
        kind, code = "anomaly", result.metric
        summary = f"{result.metric} {a.score:.1f} robust z above its node peers at equal power"
    else:
        kind, code = "anomaly", result.metric
        summary = f"{result.metric} score {a.score:.4g} past its threshold {a.threshold:.4g}"
    return Finding(
        node=a.node,
        entity=a.entity,
        kind=kind,
        code=code,
        severity=Severity.WARNING,
        action=Action.NONE,
        summary=summary,
        evidence=(Evidence(file=a.detector, line=None,
                           text=f"score={a.score:.6g} threshold={a.threshold:.6g}"),),
        source=f"online detector {a.detector}",
        first_seen_at=a.observed_at,
        last_seen_at=a.observed_at,
        confidence=0.5,
    )
