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
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from analytics.gaps import TelemetryGapDetector
from analytics.peers import PeerComparison, PeerEpisodes
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
from core.series import SeriesMemo

logger = logging.getLogger(__name__)

DETECTORS: tuple[str, ...] = ("dspot", "ewma_z", "quantile", "spot")
"""Names accepted by ``OnlineAnalytics(detector=...)``."""
NO_DETECTOR = "none"
"""A ``detector_by_metric`` value that leaves a signal unscored (its rates still feed gaps)."""
DEFAULT_DETECTOR_BY_METRIC: Mapping[str, str] = {
    "gpu_utilization_ratio": "spot",
    "gpu_power_watts": "spot",
    "gpu_temperature_celsius": "dspot",
    "gpu_ecc_errors_total{type=corrected}": "dspot",
    "gpu_ecc_errors_total{type=uncorrected}": "quantile",
    "gpu_pcie_replays_total": "spot",
    "ib_symbol_errors_total": "dspot",
    "ib_link_error_recovery_total": "quantile",
    "ib_link_downed_total": "quantile",
    "ib_port_state": "ewma_z",
}
"""The per-signal default of ``[analytics] detector_by_metric``: the best detector of each
signal of the labelled stream on development seeds 1-3 (precision, then fewest false alarms,
then recall, then cost per sample; for signals that carry no failure in the stream, fewest
false alarms, which NAB's reward-low-FP profile agrees with). Evidence in
``docs/analytics.md``, "Per-signal detectors"; signals not listed use ``detector``."""


def signal_of(metric: str, labels: Mapping[str, str]) -> str:
    """The signal a sample belongs to: its metric, plus ``{type=...}`` when it has a type label.

    These are the keys of ``detector_by_metric`` (besides bare metric names).

    Examples:
        >>> signal_of("gpu_ecc_errors_total", {"type": "corrected", "scope": "volatile"})
        'gpu_ecc_errors_total{type=corrected}'
        >>> signal_of("gpu_power_watts", {})
        'gpu_power_watts'
    """
    kind = labels.get("type")
    return f"{metric}{{type={kind}}}" if kind else metric


TYPE_VALUES: Mapping[str, tuple[str, ...]] = {
    "gpu_ecc_errors_total": ("corrected", "uncorrected"),
    "gpu_remapped_rows": ("correctable", "uncorrectable"),
    "gpu_nvlink_errors_total": ("crc_flit", "crc_data", "replay", "recovery"),
}
"""The ``type`` label values the collectors put on each catalog metric that has one: the
only ``{type=...}`` keys of ``detector_by_metric`` that can match a series."""


def signal_key(key: str) -> str:
    """Return the ``detector_by_metric`` key ``key`` as :func:`signal_of` spells signals.

    The Prometheus spelling ``metric{type="corrected"}`` (quotes, spaces) is accepted as
    ``metric{type=corrected}``.

    Raises:
        ValueError: Why ``key`` can never match a signal (unknown metric, a label other
            than ``type``, a metric without a type label, an unknown type value).

    Examples:
        >>> signal_key('gpu_ecc_errors_total{type="corrected"}')
        'gpu_ecc_errors_total{type=corrected}'
        >>> signal_key("gpu_ecc_errors_total{type=bogus}")
        Traceback (most recent call last):
        ...
        ValueError: type 'bogus' is not one gpu_ecc_errors_total has: corrected, uncorrected
    """
    metric, brace, rest = key.strip().partition("{")
    metric = metric.strip()
    spec = BY_NAME.get(metric)
    if spec is None:
        raise ValueError("not a catalog metric")
    if not brace:
        return metric
    name, eq, value = rest.removesuffix("}").partition("=")
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if (not rest.endswith("}") or name.strip() != "type" or not eq or not value
            or any(c in value for c in '{},="')):
        raise ValueError(
            "only a type label may follow the metric, as in gpu_ecc_errors_total{type=corrected}"
        )
    if "type" not in spec.labels:
        raise ValueError(f"{metric} has no type label: name the metric alone")
    known = TYPE_VALUES.get(metric)
    if known is not None and value not in known:
        hint = f" (did you mean {value.lower()!r}?)" if value.lower() in known else ""
        raise ValueError(
            f"type {value!r} is not one {metric} has: {', '.join(known)}{hint}"
        )
    return f"{metric}{{type={value}}}"


def check_detector_by_metric(mapping: Mapping[str, str]) -> dict[str, str]:
    """Validate a ``detector_by_metric`` mapping; return it with its keys as signals match.

    Keys are catalog metric names (``gpu_temperature_celsius``) or a metric with its type
    (``gpu_ecc_errors_total{type=corrected}``, see :func:`signal_key`); values are one of
    :data:`DETECTORS` or :data:`NO_DETECTOR`.

    Raises:
        ValueError: Naming every bad key and why, separated by ``; ``.

    Examples:
        >>> check_detector_by_metric({"gpu_power_watts": "spot"})
        {'gpu_power_watts': 'spot'}
        >>> check_detector_by_metric({"gpu_pwr": "spot"})
        Traceback (most recent call last):
        ...
        ValueError: key 'gpu_pwr': not a catalog metric
    """
    problems: list[str] = []
    out: dict[str, str] = {}
    first: dict[str, str] = {}
    for key, name in mapping.items():
        try:
            signal = signal_key(key)
        except ValueError as exc:
            problems.append(f"key {key!r}: {exc}")
            continue
        if name not in (*DETECTORS, NO_DETECTOR):
            problems.append(
                f"key {key!r}: detector {name!r} is not one of "
                f"{', '.join((*DETECTORS, NO_DETECTOR))}"
            )
            continue
        if signal in first:
            problems.append(f"key {key!r}: the same signal as key {first[signal]!r}")
            continue
        first[signal] = key
        out[signal] = name
    if problems:
        raise ValueError("; ".join(problems))
    return out


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


def _series_name(sample: Sample) -> str:
    """Name a series by its metric and sorted labels.

    Two counters of one GPU that differ only by a label (corrected and uncorrected ECC errors)
    are two series, each with its own rate.
    """
    if not sample.labels:
        return sample.metric
    labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
    return f"{sample.metric}{{{labels}}}"


def _is_gpu(sample: Sample) -> bool:
    return sample.metric.startswith("gpu_") and sample.entity != _NODE


class _Series:
    """What :meth:`OnlineAnalytics.observe` knows of one series once it has seen it.

    Attributes:
        key: The series' key in the detectors' and the rates' indexes.
        counter: Whether the metric is a counter (scored as a rate).
        detector: The detector that scores it (``none``: not scored).
        detector_slot: Its slot in that detector's index, ``-1`` until scored once.
        counter_slot: Its slot in the rates' index, ``-1`` until a rate was asked once.
        gpu: ``(node, entity)`` for a GPU's series (arrivals for the gaps), else ``None``.
        gap_slot: The GPU's slot in the gap detector, ``-1`` for other series.
        latest: The GPU's latest temperature and power (peer comparison), for those two
            metrics only.
    """

    __slots__ = ("counter", "counter_slot", "detector", "detector_slot", "gap_slot", "gpu",
                 "key", "latest")

    def __init__(self, key: SeriesKey, *, counter: bool, detector: str) -> None:
        self.key = key
        self.counter = counter
        self.detector = detector
        self.detector_slot = -1
        self.counter_slot = -1
        self.gpu: tuple[NodeName, EntityId] | None = None
        self.gap_slot = -1
        self.latest: dict[str, float] | None = None


_UNCATALOGUED = _Series(SeriesKey(NodeName(""), EntityId(""), ""), counter=False,
                        detector=NO_DETECTOR)
"""The series of a metric the catalog does not know: not analysed."""

_MAX_SERIES = 1_000_000
"""Series :class:`OnlineAnalytics` remembers (:class:`_Series`) before it starts over."""


class OnlineAnalytics:
    """Vectorised per-series detection, counter rates, telemetry gaps and peer comparison.

    Args:
        detector: Per-series detector, one of :data:`DETECTORS`, for every signal that
            ``detector_by_metric`` does not name.
        detector_by_metric: Detector per signal (see :func:`check_detector_by_metric`): a
            ``metric{type=...}`` key wins over the bare metric, which wins over ``detector``;
            ``none`` leaves the signal unscored. ``None``: ``detector`` for every signal.
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
        detector_by_metric: Mapping[str, str] | None = None,
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
        if detector_by_metric is not None:
            try:
                detector_by_metric = check_detector_by_metric(detector_by_metric)
            except ValueError as exc:
                raise ValueError(f"detector_by_metric: {exc}") from None
        self.detector = detector
        self.detector_by_metric = detector_by_metric
        self.gap_seconds = gap_seconds
        self.warmup_samples = warmup_samples
        self.gap_warmup_samples = gap_warmup_samples
        self.peer_z_threshold = peer_z_threshold
        self.clock = clock
        self._detector = _make_detector(detector, warmup_samples)
        self._detectors: dict[str, VectorDetector] = {detector: self._detector}
        self._choice: dict[str, str] = {}  # series name -> detector name (cache)
        self._gaps = TelemetryGapDetector(
            min_gap_seconds=gap_seconds, warmup_samples=gap_warmup_samples
        )
        self._peers = PeerComparison(z_threshold=peer_z_threshold, min_scale=1.0)
        self._counters = SeriesIndex()
        self._rates = CounterRates()
        self._latest: dict[NodeName, dict[EntityId, dict[str, float]]] = {}
        self._peer_episodes = PeerEpisodes(open_z=peer_z_threshold,
                                           close_z=max(0.0, peer_z_threshold - 2.0))
        self._gap_open: set[tuple[NodeName, EntityId]] = set()
        self._series: dict[tuple[object, ...], _Series] = {}
        self._known: SeriesMemo[_Series] = SeriesMemo()
        """:attr:`_series` by the samples' labels objects (no key built per sample)."""

    def observe(self, samples: Iterable[Sample]) -> list[OnlineResult]:
        """Score then learn ``samples``; return anomalies, newly opened gaps and peer outliers.

        Samples of one series must come in time order. Gaps are also found by time passing:
        call :meth:`check` on a timer when no samples arrive.
        """
        now = self.clock()
        series = self._series
        learn = self._learn_series
        isfinite = math.isfinite
        counters: list[tuple[_Series, float, float]] = []
        gauges: list[tuple[_Series, float, float]] = []
        arrivals: dict[float, dict[tuple[NodeName, EntityId], int]] = {}
        touched: set[NodeName] = set()
        known = self._known.get
        for sample in samples:
            info = known(sample)
            if info is None:
                labels = sample.labels
                key = ((sample.metric, sample.node, sample.entity, *labels.items()) if labels
                       else (sample.metric, sample.node, sample.entity))
                info = series.get(key)
                if info is None:
                    info = learn(key, sample)
                self._known.put(sample, info)
            if info is _UNCATALOGUED:
                continue
            value = sample.value
            if not isfinite(value):
                continue
            at = now if sample.observed_at is None else sample.observed_at
            (counters if info.counter else gauges).append((info, value, at))
            if info.gpu is not None:
                arrived = arrivals.get(at)
                if arrived is None:
                    arrived = arrivals[at] = {}
                arrived[info.gpu] = info.gap_slot
                if info.latest is not None:
                    info.latest[sample.metric] = value
                    touched.add(sample.node)
        if counters:
            gauges.extend(self._counter_rates(counters))
        out: list[OnlineResult] = []
        by_detector: dict[str, list[tuple[_Series, float, float]]] = {}
        for item in gauges:
            name = item[0].detector
            if name != NO_DETECTOR:
                found = by_detector.get(name)
                if found is None:
                    by_detector[name] = [item]
                else:
                    found.append(item)
        for name in sorted(by_detector):
            out.extend(self._score(name, by_detector[name]))
        for at in sorted(arrivals):
            arrived = arrivals[at]
            self._gaps.arrive_slots(
                np.fromiter(arrived.values(), dtype=np.int64, count=len(arrived)), at)
            out.extend(self._close_gaps(arrived, at))
        out.extend(self.check())
        for node in sorted(touched):
            out.extend(self._compare_peers(node, now))
        return out

    def _learn_series(self, key: tuple[object, ...], sample: Sample) -> _Series:
        """Everything :meth:`observe` needs of a series, worked out once (see :class:`_Series`)."""
        series = self._series
        if len(series) >= _MAX_SERIES:
            series.clear()  # bounded memory; the slots stay in the detectors' indexes
            self._known.clear()
        spec = BY_NAME.get(sample.metric)
        if spec is None:
            series[key] = _UNCATALOGUED
            return _UNCATALOGUED
        name = _series_name(sample)
        info = _Series(SeriesKey(sample.node, sample.entity, name),
                       counter=spec.type is MetricType.COUNTER,
                       detector=self._detector_for(name))
        if _is_gpu(sample):
            info.gpu = (sample.node, sample.entity)
            info.gap_slot = self._gaps.slot(sample.node, sample.entity)
            if sample.metric in (TEMPERATURE, POWER):
                info.latest = self._latest.setdefault(sample.node, {}).setdefault(
                    sample.entity, {})
        series[key] = info
        return info

    def _detector_for(self, series: str) -> str:
        found = self._choice.get(series)
        if found is not None:
            return found
        mapping = self.detector_by_metric or {}
        metric, _, rest = series.partition("{")
        kind = next((p[5:] for p in rest.rstrip("}").split(",") if p.startswith("type=")), None)
        found = (mapping.get(f"{metric}{{type={kind}}}") if kind else None) or mapping.get(
            metric, self.detector
        )
        self._choice[series] = found
        return found

    def _score(
        self, name: str, gauges: Sequence[tuple[_Series, float, float]]
    ) -> list[OnlineResult]:
        detector = self._detectors.get(name)
        if detector is None:
            detector = self._detectors[name] = _make_detector(name, self.warmup_samples)
        index = detector.index
        slots = []
        for info, _, _ in gauges:
            slot = info.detector_slot
            if slot < 0:
                slot = info.detector_slot = index.slot(info.key)
            slots.append(slot)
        n = len(gauges)
        batch = SeriesBatch(
            series=np.array(slots, dtype=np.int64),
            values=np.fromiter((v for _, v, _ in gauges), dtype=np.float64, count=n),
            observed_at=np.fromiter((t for _, _, t in gauges), dtype=np.float64, count=n),
        )
        verdict = detector.score_many(batch)
        if not verdict.flagged.any():
            return []
        return [OnlineResult(kind="anomaly", metric=key.metric.partition("{")[0], anomaly=anomaly)
                for key, anomaly in detector.flagged(batch, verdict)]

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
                    out.append(
                        OnlineResult(
                            kind="gap_closed",
                            metric="",
                            anomaly=Anomaly(
                                detector=self._gaps.name,
                                node=key[0],
                                entity=key[1],
                                score=0.0,
                                threshold=self._gaps.gap_factor,
                                observed_at=at,
                            ),
                        )
                    )
        return out

    def _counter_rates(
        self, counters: Sequence[tuple[_Series, float, float]]
    ) -> list[tuple[_Series, float, float]]:
        index = self._counters
        slots = []
        for info, _, _ in counters:
            slot = info.counter_slot
            if slot < 0:
                slot = info.counter_slot = index.slot(info.key)
                bits = IB_SATURATING_BITS.get(info.key.metric.partition("{")[0])
                if bits is not None:
                    self._rates.configure(np.array([slot]), bits=bits, saturating=True)
            slots.append(slot)
        n = len(counters)
        rates = self._rates.rate_many(
            SeriesBatch(
                series=np.array(slots, dtype=np.int64),
                values=np.fromiter((v for _, v, _ in counters), dtype=np.float64, count=n),
                observed_at=np.fromiter((t for _, _, t in counters), dtype=np.float64, count=n),
            )
        )
        values = rates.rates.tolist()
        return [(counters[i][0], values[i], counters[i][2])
                for i in np.flatnonzero(rates.valid).tolist()]

    def _compare_peers(self, node: NodeName, now: float) -> list[OnlineResult]:
        gpus = sorted(
            e for e, m in self._latest.get(node, {}).items() if TEMPERATURE in m and POWER in m
        )
        if len(gpus) <= self._peers.min_peers:
            return []
        latest = self._latest[node]
        temp = np.array([latest[e][TEMPERATURE] for e in gpus])
        power = np.array([latest[e][POWER] for e in gpus])
        zeros = np.zeros(len(gpus), dtype=np.int64)
        verdict = self._peers.compare(temp, node=zeros, group=zeros, covariate=power)
        out: list[OnlineResult] = []
        for i, entity in enumerate(gpus):
            # one report per episode: the deviation must persist and exceed the GPU's own
            # usual deviation (PeerEpisodes), not merely cross the threshold again
            if not self._peer_episodes.update((node, entity), float(verdict.z_node[i]), now):
                continue
            out.append(
                OnlineResult(
                    kind="peer",
                    metric=TEMPERATURE,
                    anomaly=Anomaly(
                        detector="peers",
                        node=node,
                        entity=entity,
                        score=float(verdict.z_node[i]),
                        threshold=self._peers.z_threshold,
                        observed_at=now,
                    ),
                )
            )
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
        summary = (
            f"no samples for {a.score:.0f} usual intervals (the {what} may have fallen off the bus)"
        )
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
        evidence=(
            Evidence(
                file=a.detector, line=None, text=f"score={a.score:.6g} threshold={a.threshold:.6g}"
            ),
        ),
        source=f"online detector {a.detector}",
        first_seen_at=a.observed_at,
        last_seen_at=a.observed_at,
        confidence=0.5,
    )
