"""A labelled synthetic GPU and InfiniBand-link telemetry stream, for scoring detectors (issue 5).

The stream is what a gpuhealth collector would deliver for a fleet of nodes with eight GPUs and
eight InfiniBand ports each, one reading per ``interval_seconds``, with failures whose times and
precursors are drawn as below, benign confounders around them, and a **label** per failure.
Metric names come from the catalog (``core.catalog``); samples and events are the project's
records, and :func:`write_line_protocol` writes the stream with the project's encoder so that
``gpuhealth replay`` reads it back.

**Failure times.** GPU failures form a fleet-level renewal process whose gaps follow the Weibull
fitted to Titan's GPU failures (:data:`TITAN_WEIBULL_SHAPE`, :data:`TITAN_WEIBULL_SCALE_HOURS`),
rescaled from Titan's 18,688 GPUs to the synthetic fleet and sped up by ``acceleration`` (the
real rate gives about four failures per 1,000 GPUs per month, too few to score). Each failure
is a double-bit ECC error (DBE) or an off-the-bus (OTB, Xid 79) in Titan's proportions
(:data:`TITAN_DBE_FRACTION`). Link failures form a second renewal process with the Weibull shape
of LANL system 18's hardware failures (:data:`LANL_WEIBULL_SHAPE`) and a mean set by LANL's node
failure rate times the share of network root causes (:data:`LANL_LINK_MEAN_HOURS_PER_LINK`), sped
up by the same factor. Link downtimes follow LANL's median repair time (59 minutes).

**Precursors** (fixed before any detector was scored on this stream, 2026-11-30):

* DBE: with probability ``p_dbe_precursor`` the corrected-error (SBE) rate rises exponentially
  from 2 to 200 per hour over the lead time before the DBE (SBEs precede many but not all DBEs:
  Nie et al., "A large-scale study of soft-errors on GPUs in the field", HPCA 2016, on Titan;
  NVIDIA's dynamic page retirement doc treats repeated SBEs as a warning of a failing page).
  At the DBE: Xid 48, the uncorrected counter steps, the GPU is drained 30 min later.
* OTB: **no numeric precursor** except, with probability ``p_otb_precursor``, a rising PCIe
  replay rate (0.5 to 60 per minute; replays precede some Xid 79s, NVIDIA Xid catalogue and
  the GPU debug guidelines); the GPU's series simply stop at the failure (Xid 79 event).
* Link down: with probability ``p_link_precursor`` symbol errors rise from 5 to 2,000 per
  minute and link error recoveries from 0.01 to 2 per minute before the port goes Down
  (IBTA vol. 1 PortCounters; the usual signature of a degrading cable or transceiver); the
  port is Down (``ib_port_state`` 1, ``ib_link_downed_total`` + 1) for the downtime.

Lead times are lognormal (median ``lead_median_hours``, clipped to ``[lead_min_hours,
lead_max_hours]``). With the default probabilities about 45 % of failures have no precursor
(the issue asks for at least 30 %).

**Benign confounders**: workload swings per node (idle/job phases moving utilisation, power and,
with a lag, temperature), node cooling excursions (+12 degC on all GPUs of a node for hours),
healthy GPUs with a steady high corrected-error rate and healthy risers with steady PCIe replays,
bursts of symbol errors on healthy links, counter resets (driver reloads reset the volatile ECC
and replay counters; ``perfquery -R`` clears a port's counters), and collector restarts and
outages that leave gaps in every series of a node.

All randomness comes from ``numpy.random.default_rng`` seeded with ``(seed, stream part,
chunk)``, so a stream is a pure function of its config (``chunk_ticks`` included) and seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from core.catalog import BY_NAME, MetricType
from core.records import EntityId, Event, NodeName, Sample
from storage.lineprotocol import LineEncoder

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]

# --- constants fitted to the public data (2026-11-30; fits in docs/analytics.md) -------------

TITAN_GPUS = 18_688
"""GPU slots of Titan (Cray XK7), the fleet the GPU-failure fit describes."""
TITAN_WEIBULL_SHAPE = 0.595
"""Weibull shape of the gaps between Titan GPU failures (DBE and OTB, one per serial per day),
2013-11 to 2019-08, 5,605 failures: ``scipy.stats.weibull_min.fit(gaps, floc=0)`` on
``titan-gpu-lifetimes/gc_full.csv`` (Ostrouchov et al., SC20)."""
TITAN_WEIBULL_SCALE_HOURS = 5.33
"""Weibull scale of the same fit, hours (mean gap 8.70 h for 18,688 GPUs)."""
TITAN_DBE_FRACTION = 4220 / 5605
"""Share of DBE among Titan's DBE + OTB failures (same deduplication), 0.753."""
LANL_WEIBULL_SHAPE = 0.893
"""Weibull shape of the gaps between hardware failures of LANL system 18 (1,024 nodes,
2,977 failures; LA-UR-05-7318, Schroeder & Gibson, DSN 2006); network root causes alone are too
few to fit (17 on system 18)."""
LANL_LINK_MEAN_HOURS_PER_LINK = 7.48 * 1024 / (421 / 23_739)
"""Mean hours between failures of one link: LANL system 18's mean gap between all failures
(7.48 h over 1,024 nodes) divided by the share of network root causes in the whole LANL data
(421 of 23,739 records); about 432,000 h."""
LANL_MEDIAN_DOWNTIME_MINUTES = 59.0
"""Median downtime of a LANL failure (``Down Time`` column), the median link downtime here."""

GPU_METRICS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("gpu_utilization_ratio", ()),
    ("gpu_power_watts", ()),
    ("gpu_temperature_celsius", ()),
    ("gpu_ecc_errors_total", (("location", "total"), ("scope", "volatile"), ("type", "corrected"))),
    (
        "gpu_ecc_errors_total",
        (("location", "total"), ("scope", "volatile"), ("type", "uncorrected")),
    ),
    ("gpu_pcie_replays_total", ()),
)
"""Series of each GPU: metric and labels (labels as sorted pairs)."""
LINK_METRICS: tuple[str, ...] = (
    "ib_symbol_errors_total",
    "ib_link_error_recovery_total",
    "ib_link_downed_total",
    "ib_port_state",
)
"""Series of each InfiniBand port (labels ``device``, ``port``)."""

for _name in (*(m for m, _ in GPU_METRICS), *LINK_METRICS):
    if _name not in BY_NAME:  # pragma: no cover - a catalog edit would break the stream
        raise RuntimeError(f"synthetic stream metric {_name} is not in core.catalog")

_BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
FailureKind = Literal["dbe", "otb", "link_down"]
_HOUR = 3600.0
_DAY = 86_400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamConfig:
    """Parameters of a synthetic stream (fixed: see the module doc before changing any).

    Attributes:
        gpus: GPUs (and as many InfiniBand ports), a multiple of ``gpus_per_node``; >= 8.
        gpus_per_node: GPUs per node, 1 to 8.
        days: Length of the stream, days; > ``quiet_days``.
        interval_seconds: Collection interval, seconds; > 0.
        start: Epoch seconds of the first reading (default 2026-01-01T00:00Z).
        acceleration: Failure-rate multiplier over the real Titan/LANL rates; > 0.
        quiet_days: No failure before this (detectors calibrate), days; >= 0.
        p_dbe_precursor, p_otb_precursor, p_link_precursor: Probability that a failure of each
            kind has a precursor, in [0, 1].
        lead_median_hours, lead_sigma, lead_min_hours, lead_max_hours: Lognormal lead time of
            precursors (median, log-sd) and its clip, hours.
        chunk_ticks: Readings rendered per chunk (memory: ``chunk_ticks x 10 x gpus`` floats).
    """

    gpus: int = 1000
    gpus_per_node: int = 8
    days: float = 30.0
    interval_seconds: float = 60.0
    start: float = 1_767_225_600.0
    acceleration: float = 30.0
    quiet_days: float = 1.0
    p_dbe_precursor: float = 0.6
    p_otb_precursor: float = 0.25
    p_link_precursor: float = 0.6
    lead_median_hours: float = 6.0
    lead_sigma: float = 0.8
    lead_min_hours: float = 1.0
    lead_max_hours: float = 48.0
    chunk_ticks: int = 360

    def __post_init__(self) -> None:
        if not 1 <= self.gpus_per_node <= len(_BUS_IDS):
            raise ValueError(f"gpus_per_node must be in 1..8, got {self.gpus_per_node}")
        if self.gpus < self.gpus_per_node or self.gpus % self.gpus_per_node:
            raise ValueError(
                f"gpus must be a positive multiple of gpus_per_node={self.gpus_per_node}, "
                f"got {self.gpus}"
            )
        if self.interval_seconds <= 0 or self.acceleration <= 0 or self.chunk_ticks < 1:
            raise ValueError("interval_seconds, acceleration and chunk_ticks must be > 0")
        if not 0 <= self.quiet_days < self.days:
            raise ValueError(f"need 0 <= quiet_days < days, got {self.quiet_days}, {self.days}")
        for name in ("p_dbe_precursor", "p_otb_precursor", "p_link_precursor"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 < self.lead_min_hours <= self.lead_median_hours <= self.lead_max_hours:
            raise ValueError("need 0 < lead_min_hours <= lead_median_hours <= lead_max_hours")

    @property
    def ticks(self) -> int:
        """Readings per series."""
        return int(self.days * _DAY // self.interval_seconds)


FULL = StreamConfig()
"""1,000 GPUs and links, 30 days at 60 s (about 180 failures)."""
SMALL = StreamConfig(gpus=64, days=3.0, acceleration=600.0)
"""64 GPUs and links, 3 days at 60 s, failures sped up 600x (about 25 failures): CI."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureLabel:
    """The truth about one failure.

    Attributes:
        node, entity: Where: a GPU's PCI bus id, or an InfiniBand port ``mlx5_<i>:1``.
        kind: ``dbe`` (double-bit ECC error, Xid 48), ``otb`` (fell off the bus, Xid 79) or
            ``link_down``.
        at: Failure time, epoch seconds.
        precursor: Whether a numeric precursor precedes it.
        precursor_onset: When the precursor starts (``None`` without one), epoch seconds.
        recovered_at: When the entity reports healthy again (a new GPU in the slot, or the
            port back up), epoch seconds.
    """

    node: NodeName
    entity: EntityId
    kind: FailureKind
    at: float
    precursor: bool
    precursor_onset: float | None
    recovered_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Confounder:
    """A benign event in the stream (for tests and for reading false alarms).

    Attributes:
        kind: ``collector_gap``, ``collector_outage``, ``driver_reload`` (node gap, then the
            node's GPU counters reset), ``counter_reset`` (a port's counters cleared),
            ``cooling`` (node GPUs +12 degC), ``symbol_burst`` (symbol errors on a healthy
            link), ``noisy_sbe`` and ``noisy_replay`` (a healthy GPU with a steady high rate;
            whole stream), ``workload`` (one job on a node).
        node: The node.
        entity: The GPU or port, or ``node`` for node-wide ones.
        start, end: Epoch seconds.
    """

    kind: str
    node: NodeName
    entity: EntityId
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class SeriesSpec:
    """One series of the stream: metric, where, labels (sorted pairs)."""

    metric: str
    node: NodeName
    entity: EntityId
    labels: tuple[tuple[str, str], ...]

    @property
    def counter(self) -> bool:
        """Whether the metric is a catalogued counter."""
        return BY_NAME[self.metric].type is MetricType.COUNTER


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """Consecutive readings of every series, columnar.

    Attributes:
        times: Reading times, epoch seconds, shape ``(T,)``.
        values: Shape ``(T, S)`` in the order of :attr:`Plan.series`; meaningless where not
            ``present``.
        present: Shape ``(T, S)``: whether the reading was delivered.
        events: Events with ``times[0] - interval < observed_at <= times[-1]``, in time order.
    """

    times: FloatArray
    values: FloatArray
    present: BoolArray
    events: tuple[Event, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything decided before rendering: fleet, failures, confounders, per-GPU traits.

    Attributes:
        config, seed: What produced it.
        nodes: Node names, ``len = gpus / gpus_per_node``.
        gpus, links: ``(node, entity)`` per GPU slot and per port, aligned (GPU ``i`` and port
            ``i`` share a node).
        series: Every series, GPU series first (metric-major), then link series.
        failures: Labels, in time order.
        confounders: Benign events, by start time.
    """

    config: StreamConfig
    seed: int
    nodes: tuple[NodeName, ...]
    gpus: tuple[tuple[NodeName, EntityId], ...]
    links: tuple[tuple[NodeName, EntityId], ...]
    series: tuple[SeriesSpec, ...]
    failures: tuple[FailureLabel, ...]
    confounders: tuple[Confounder, ...]
    sbe_base_per_hour: FloatArray = field(repr=False)
    replay_base_per_minute: FloatArray = field(repr=False)
    temp_offset: FloatArray = field(repr=False)
    job_edges: tuple[FloatArray, ...] = field(repr=False)
    job_levels: tuple[FloatArray, ...] = field(repr=False)

    @property
    def gpu_days(self) -> float:
        """GPU-days of the stream (GPUs x days)."""
        return self.config.gpus * self.config.days


def _weibull_gaps(
    rng: np.random.Generator, shape: float, mean_hours: float, horizon: float
) -> list[float]:
    """Renewal times (seconds from 0) with Weibull gaps of ``shape`` and ``mean_hours``."""
    scale = mean_hours / math.gamma(1.0 + 1.0 / shape) * _HOUR
    out: list[float] = []
    t = 0.0
    while True:
        t += float(scale * rng.weibull(shape))
        if t >= horizon:
            return out
        out.append(t)


def _lead(rng: np.random.Generator, c: StreamConfig) -> float:
    hours = c.lead_median_hours * math.exp(c.lead_sigma * float(rng.standard_normal()))
    return min(max(hours, c.lead_min_hours), c.lead_max_hours) * _HOUR


def plan(config: StreamConfig = FULL, *, seed: int) -> Plan:
    """Draw the fleet, its failures and its confounders.

    Args:
        config: Stream parameters.
        seed: Seed of every random draw; the same ``(config, seed)`` gives the same stream.

    Returns:
        The :class:`Plan`; render it with :func:`chunks`, :func:`samples` or
        :func:`write_line_protocol`.
    """
    c = config
    rng = np.random.default_rng([seed, 0])
    n_nodes = c.gpus // c.gpus_per_node
    nodes = tuple(NodeName(f"node-{i:04d}") for i in range(n_nodes))
    gpus = tuple(
        (nodes[i // c.gpus_per_node], EntityId(f"00000000:{_BUS_IDS[i % c.gpus_per_node]}:00.0"))
        for i in range(c.gpus)
    )
    links = tuple(
        (nodes[i // c.gpus_per_node], EntityId(f"mlx5_{i % c.gpus_per_node}:1"))
        for i in range(c.gpus)
    )
    series = [SeriesSpec(m, n, e, labels) for m, labels in GPU_METRICS for n, e in gpus]
    series += [
        SeriesSpec(m, n, e, (("device", e.split(":")[0]), ("port", "1")))
        for m in LINK_METRICS
        for n, e in links
    ]
    start, end = c.start, c.start + c.ticks * c.interval_seconds
    quiet = start + c.quiet_days * _DAY
    horizon = end - quiet

    failures: list[FailureLabel] = []
    # GPU failures: Titan's fleet process, rescaled to this fleet and accelerated.
    titan_mean = TITAN_WEIBULL_SCALE_HOURS * math.gamma(1.0 + 1.0 / TITAN_WEIBULL_SHAPE)
    gpu_mean = titan_mean * TITAN_GPUS / c.gpus / c.acceleration
    busy = np.full(c.gpus, -math.inf)  # end of the last repair (+ a margin) per slot
    for offset in _weibull_gaps(rng, TITAN_WEIBULL_SHAPE, gpu_mean, horizon):
        at = quiet + offset
        free = np.flatnonzero(busy < at - c.lead_max_hours * _HOUR)
        if free.size == 0:
            continue
        i = int(rng.choice(free))
        kind: FailureKind = "dbe" if rng.random() < TITAN_DBE_FRACTION else "otb"
        p = c.p_dbe_precursor if kind == "dbe" else c.p_otb_precursor
        has = bool(rng.random() < p)
        lead = _lead(rng, c)
        repair = 24 * _HOUR * math.exp(0.5 * float(rng.standard_normal()))
        recovered = min(at + repair, end + _DAY)
        onset = max(at - lead, busy[i], start) if has else None
        if onset is not None and at - onset < c.lead_min_hours * _HOUR:
            has, onset = False, None
        failures.append(
            FailureLabel(
                node=gpus[i][0],
                entity=gpus[i][1],
                kind=kind,
                at=at,
                precursor=has,
                precursor_onset=onset,
                recovered_at=recovered,
            )
        )
        busy[i] = recovered
    # Link failures: LANL's shape, the network share of its rate, accelerated.
    link_mean = LANL_LINK_MEAN_HOURS_PER_LINK / c.gpus / c.acceleration
    busy = np.full(c.gpus, -math.inf)
    for offset in _weibull_gaps(rng, LANL_WEIBULL_SHAPE, link_mean, horizon):
        at = quiet + offset
        free = np.flatnonzero(busy < at - c.lead_max_hours * _HOUR)
        if free.size == 0:
            continue
        i = int(rng.choice(free))
        has = bool(rng.random() < c.p_link_precursor)
        lead = _lead(rng, c)
        down = LANL_MEDIAN_DOWNTIME_MINUTES * 60.0 * math.exp(float(rng.standard_normal()))
        down = min(max(down, 300.0), 12 * _HOUR)
        onset = max(at - lead, busy[i], start) if has else None
        if onset is not None and at - onset < c.lead_min_hours * _HOUR:
            has, onset = False, None
        failures.append(
            FailureLabel(
                node=links[i][0],
                entity=links[i][1],
                kind="link_down",
                at=at,
                precursor=has,
                precursor_onset=onset,
                recovered_at=at + down,
            )
        )
        busy[i] = at + down
    failures.sort(key=lambda f: f.at)

    confounders: list[Confounder] = []
    node_entity = EntityId("node")

    def poisson_windows(
        rate_per_day: float, length: tuple[float, float], log: bool = False
    ) -> list[tuple[float, float]]:
        count = int(rng.poisson(rate_per_day * c.days))
        starts = np.sort(rng.uniform(start, end, count))
        if log:
            lengths = length[0] * np.exp(length[1] * rng.standard_normal(count))
        else:
            lengths = rng.uniform(length[0], length[1], count)
        return [(float(s), float(s + w)) for s, w in zip(starts, lengths, strict=True)]

    for node in nodes:
        for s, e in poisson_windows(0.2, (120.0, 480.0)):
            confounders.append(
                Confounder(kind="collector_gap", node=node, entity=node_entity, start=s, end=e)
            )
        for s, e in poisson_windows(0.02, (1200.0, 7200.0)):
            confounders.append(
                Confounder(kind="collector_outage", node=node, entity=node_entity, start=s, end=e)
            )
        for s, e in poisson_windows(0.03, (150.0, 240.0)):
            confounders.append(
                Confounder(kind="driver_reload", node=node, entity=node_entity, start=s, end=e)
            )
        for s, e in poisson_windows(0.02, (2 * _HOUR, 0.6), log=True):
            confounders.append(
                Confounder(kind="cooling", node=node, entity=node_entity, start=s, end=e)
            )
    for node, entity in links:
        for s, _ in poisson_windows(0.02, (0.0, 0.0)):
            confounders.append(
                Confounder(kind="counter_reset", node=node, entity=entity, start=s, end=s)
            )
        for s, e in poisson_windows(0.05, (600.0, 3600.0)):
            confounders.append(
                Confounder(kind="symbol_burst", node=node, entity=entity, start=s, end=e)
            )
    # Per-GPU traits: sporadic SBEs on 8 %, a steady high rate on 2 % (healthy but noisy);
    # a trickle of PCIe replays everywhere and a steady 1/min on 3 % (a marginal riser).
    u = rng.random(c.gpus)
    sbe = np.where(
        u < 0.02, 10.0 * np.exp(0.5 * rng.standard_normal(c.gpus)), np.where(u < 0.10, 0.2, 0.0)
    )
    v = rng.random(c.gpus)
    replay = np.where(v < 0.03, 1.0, 0.01)
    for g in np.flatnonzero(u < 0.02).tolist():
        confounders.append(
            Confounder(kind="noisy_sbe", node=gpus[g][0], entity=gpus[g][1], start=start, end=end)
        )
    for g in np.flatnonzero(v < 0.03).tolist():
        confounders.append(
            Confounder(
                kind="noisy_replay", node=gpus[g][0], entity=gpus[g][1], start=start, end=end
            )
        )
    temp_offset = rng.normal(0.0, 2.0, c.gpus)
    # Workload: per node, idle (median 45 min) and job (median 3 h) phases; job load U(0.6, 1).
    edges: list[FloatArray] = []
    levels: list[FloatArray] = []
    for node in nodes:
        t, e_list, l_list = start - float(rng.uniform(0, 3 * _HOUR)), [], []
        busy_phase = bool(rng.random() < 0.7)
        while t < end:
            e_list.append(t)
            if busy_phase:
                level = float(rng.uniform(0.6, 1.0))
                length = 3 * _HOUR * math.exp(0.7 * float(rng.standard_normal()))
                confounders.append(
                    Confounder(
                        kind="workload", node=node, entity=node_entity, start=t, end=t + length
                    )
                )
            else:
                level, length = 0.0, 0.75 * _HOUR * math.exp(0.7 * float(rng.standard_normal()))
            l_list.append(level)
            t += max(length, 300.0)
            busy_phase = not busy_phase
        edges.append(np.asarray(e_list))
        levels.append(np.asarray(l_list))
    confounders.sort(key=lambda k: k.start)
    return Plan(
        config=c,
        seed=seed,
        nodes=nodes,
        gpus=gpus,
        links=links,
        series=tuple(series),
        failures=tuple(failures),
        confounders=tuple(confounders),
        sbe_base_per_hour=sbe,
        replay_base_per_minute=replay,
        temp_offset=temp_offset,
        job_edges=tuple(edges),
        job_levels=tuple(levels),
    )


def _ramp(times: FloatArray, onset: float, at: float, low: float, high: float) -> FloatArray:
    """Exponential ramp from ``low`` at ``onset`` to ``high`` at ``at``; 0 outside."""
    frac = (times - onset) / max(at - onset, 1.0)
    inside = (times >= onset) & (times < at)
    return np.where(inside, low * (high / low) ** np.clip(frac, 0.0, 1.0), 0.0)


class _Renderer:
    """Renders a plan chunk by chunk, carrying counters and temperatures between chunks."""

    def __init__(self, p: Plan) -> None:
        self.p = p
        n = p.config.gpus
        self.node_of = np.repeat(np.arange(len(p.nodes)), p.config.gpus_per_node)
        self.node_index = {name: i for i, name in enumerate(p.nodes)}
        self.gpu_index = {g: i for i, g in enumerate(p.gpus)}
        self.link_index = {link: i for i, link in enumerate(p.links)}
        self.counters = np.zeros((n, 6))  # ecc corr, ecc unc, replay, sym, recov, downed
        self.temp = 30.0 + p.temp_offset
        self.events = sorted(self._events(), key=lambda e: e.observed_at or 0.0)
        self.event_times = np.asarray([e.observed_at for e in self.events], dtype=np.float64)

    def _events(self) -> list[Event]:
        out = []
        for f in self.p.failures:
            if f.kind == "link_down":
                device = f.entity.split(":")[0]
                attrs = {"device": device, "port": "1", "phys_state": "polling"}
                out.append(
                    Event(
                        kind="ib_port_state",
                        code="down",
                        node=f.node,
                        entity=f.entity,
                        observed_at=f.at,
                        attrs=attrs,
                        message=f"{device} port 1 state Down",
                        source="synthetic",
                    )
                )
                out.append(
                    Event(
                        kind="ib_port_state",
                        code="active",
                        node=f.node,
                        entity=f.entity,
                        observed_at=f.recovered_at,
                        attrs={**attrs, "phys_state": "linkup"},
                        message=f"{device} port 1 state Active",
                        source="synthetic",
                    )
                )
            else:
                code = "48" if f.kind == "dbe" else "79"
                text = (
                    "Xid 48: double-bit ECC error"
                    if f.kind == "dbe"
                    else "Xid 79: GPU has fallen off the bus"
                )
                out.append(
                    Event(
                        kind="xid",
                        code=code,
                        node=f.node,
                        entity=f.entity,
                        observed_at=f.at,
                        message=text,
                        source="synthetic",
                    )
                )
        return out

    def chunk(self, k0: int, k1: int) -> Chunk:
        p, c = self.p, self.p.config
        rng = np.random.default_rng([p.seed, 1, k0 // c.chunk_ticks])
        n, dt = c.gpus, c.interval_seconds
        times = c.start + np.arange(k0, k1, dtype=np.float64) * dt
        t_len = times.size
        gpu_present = np.ones((t_len, n), dtype=bool)
        link_present = np.ones((t_len, n), dtype=bool)
        gpu_reset = np.zeros((t_len, n), dtype=bool)
        link_reset = np.zeros((t_len, n), dtype=bool)
        heat = np.zeros((t_len, n))
        sbe_rate = np.broadcast_to(p.sbe_base_per_hour / _HOUR * dt, (t_len, n)).copy()
        replay_rate = np.broadcast_to(p.replay_base_per_minute / 60.0 * dt, (t_len, n)).copy()
        sym_rate = np.zeros((t_len, n))
        rec_rate = np.zeros((t_len, n))
        downed_step = np.zeros((t_len, n))
        port_down = np.zeros((t_len, n), dtype=bool)
        unc_step = np.zeros((t_len, n))
        lo, hi = times[0] - dt, times[-1]

        def window(s: float, e: float) -> BoolArray:
            return (times >= s) & (times < e)

        def first_tick(t: float) -> int | None:
            """Index of the first reading at or after ``t`` in this chunk, if any."""
            if not lo < t <= hi + dt:
                return None
            idx = int(np.searchsorted(times, t, side="left"))
            return idx if idx < t_len else None

        for f in p.failures:
            if f.precursor_onset is not None and f.precursor_onset > hi:
                continue
            if f.precursor_onset is None and f.at > hi + dt:
                continue
            if f.recovered_at + _HOUR < lo:
                continue
            if f.kind == "link_down":
                j = self.link_index[(f.node, f.entity)]
                if f.precursor_onset is not None:
                    sym_rate[:, j] += _ramp(times, f.precursor_onset, f.at, 5.0, 2000.0) / 60 * dt
                    rec_rate[:, j] += _ramp(times, f.precursor_onset, f.at, 0.01, 2.0) / 60 * dt
                port_down[:, j] |= window(f.at, f.recovered_at)
                k = first_tick(f.at)
                if k is not None:
                    downed_step[k, j] += 1.0
            else:
                i = self.gpu_index[(f.node, f.entity)]
                if f.precursor_onset is not None and f.kind == "dbe":
                    sbe_rate[:, i] += _ramp(times, f.precursor_onset, f.at, 2.0, 200.0) / _HOUR * dt
                if f.precursor_onset is not None and f.kind == "otb":
                    replay_rate[:, i] += _ramp(times, f.precursor_onset, f.at, 0.5, 60.0) / 60 * dt
                gone = f.at + (1800.0 if f.kind == "dbe" else 0.0)
                gpu_present[:, i] &= ~window(gone, f.recovered_at)
                if f.kind == "dbe":
                    k = first_tick(f.at)
                    if k is not None:
                        unc_step[k, i] += 1.0
                k = first_tick(f.recovered_at)
                if k is not None:
                    gpu_reset[k, i] = True  # a new GPU: its counters start at zero
        for conf in p.confounders:
            if conf.end < lo - _HOUR or conf.start > hi:
                continue
            if conf.kind in ("collector_gap", "collector_outage", "driver_reload"):
                cols = self.node_of == self.node_index[conf.node]
                w = window(conf.start, conf.end)
                gpu_present[np.ix_(w, cols)] = False
                link_present[np.ix_(w, cols)] = False
                if conf.kind == "driver_reload":
                    k = first_tick(conf.end)
                    if k is not None:
                        gpu_reset[k, cols] = True
            elif conf.kind == "cooling":
                cols = self.node_of == self.node_index[conf.node]
                heat[np.ix_(window(conf.start, conf.end), cols)] += 12.0
            elif conf.kind == "counter_reset":
                k = first_tick(conf.start)
                if k is not None:
                    link_reset[k, self.link_index[(conf.node, conf.entity)]] = True
            elif conf.kind == "symbol_burst":
                j = self.link_index[(conf.node, conf.entity)]
                sym_rate[:, j] += window(conf.start, conf.end) * 50.0 / 60.0 * dt
        port_down_rates = ~port_down
        sym_rate *= port_down_rates
        rec_rate *= port_down_rates

        # workload -> utilisation -> power -> temperature (first-order lag, tau 5 min)
        node_load = np.empty((t_len, len(p.nodes)))
        for j, (edges, levels) in enumerate(zip(p.job_edges, p.job_levels, strict=True)):
            node_load[:, j] = levels[np.clip(np.searchsorted(edges, times, "right") - 1, 0, None)]
        load = node_load[:, self.node_of]
        util = np.clip(
            load * rng.uniform(0.93, 1.0, (t_len, n)) + rng.normal(0.0, 0.02, (t_len, n)), 0.0, 1.0
        )
        power = 70.0 + 330.0 * util + rng.normal(0.0, 6.0, (t_len, n))
        target = 28.0 + 0.12 * power + p.temp_offset + heat
        temp = np.empty((t_len, n))
        a = 1.0 - math.exp(-dt / 300.0)
        current = self.temp
        for k in range(t_len):
            current = current + a * (target[k] - current)
            temp[k] = current
        self.temp = current
        temp = temp + rng.normal(0.0, 0.4, (t_len, n))

        incs = [
            rng.poisson(sbe_rate).astype(np.float64),
            unc_step,
            rng.poisson(replay_rate).astype(np.float64),
            rng.poisson(sym_rate).astype(np.float64),
            rng.poisson(rec_rate).astype(np.float64),
            downed_step,
        ]
        resets = [gpu_reset, gpu_reset, gpu_reset, link_reset, link_reset, link_reset]
        counters = []
        for col, (inc, reset) in enumerate(zip(incs, resets, strict=True)):
            cs = np.cumsum(inc, axis=0) + self.counters[:, col]
            base = np.where(reset, cs - inc, np.nan)
            base[0] = np.where(reset[0], base[0], 0.0)
            # forward-fill the last reset's base down each column
            idx = np.where(~np.isnan(base), np.arange(t_len)[:, None], 0)
            np.maximum.accumulate(idx, axis=0, out=idx)
            filled = np.take_along_axis(np.nan_to_num(base), idx, axis=0)
            value = cs - filled
            self.counters[:, col] = value[-1]
            counters.append(value)
        state = np.where(port_down, 1.0, 4.0)
        values = np.concatenate(
            [
                util,
                power,
                temp,
                counters[0],
                counters[1],
                counters[2],
                counters[3],
                counters[4],
                counters[5],
                state,
            ],
            axis=1,
        )
        present = np.concatenate([gpu_present] * 6 + [link_present] * 4, axis=1)
        first = int(np.searchsorted(self.event_times, lo, side="right"))
        last = int(np.searchsorted(self.event_times, hi, side="right"))
        return Chunk(
            times=times, values=values, present=present, events=tuple(self.events[first:last])
        )


def chunks(p: Plan) -> Iterator[Chunk]:
    """Render the stream of ``p`` in time order, ``config.chunk_ticks`` readings at a time."""
    renderer = _Renderer(p)
    total, step = p.config.ticks, p.config.chunk_ticks
    for k0 in range(0, total, step):
        yield renderer.chunk(k0, min(k0 + step, total))


def samples(p: Plan) -> Iterator[list[Sample | Event]]:
    """The stream as records, one list per reading time (samples, then that tick's events).

    Samples of one reading share their ``observed_at`` object (the encoder's fast path).
    """
    specs = p.series
    # entity-major order: one reading of one GPU or port is one line-protocol point
    order = sorted(
        range(len(specs)), key=lambda s: (specs[s].node, specs[s].entity, specs[s].labels, s)
    )
    position = np.empty(len(specs), dtype=np.int64)
    position[np.asarray(order)] = np.arange(len(specs))
    for chunk in chunks(p):
        event_at = np.asarray([e.observed_at for e in chunk.events], dtype=np.float64)
        dt = p.config.interval_seconds
        for k, at in enumerate(chunk.times.tolist()):
            row, mask = chunk.values[k], chunk.present[k]
            shown = np.flatnonzero(mask)
            shown = shown[np.argsort(position[shown])]
            tick: list[Sample | Event] = [
                Sample(
                    metric=specs[s].metric,
                    value=float(row[s]),
                    observed_at=at,
                    node=specs[s].node,
                    entity=specs[s].entity,
                    labels=dict(specs[s].labels),
                )
                for s in shown.tolist()
            ]
            due = (event_at > at - dt) & (event_at <= at)
            tick.extend(chunk.events[i] for i in np.flatnonzero(due).tolist())
            yield tick


def write_line_protocol(p: Plan, path: Path) -> tuple[int, int]:
    """Write the stream of ``p`` to ``path`` as InfluxDB line protocol (ns timestamps).

    Uses ``storage.lineprotocol.LineEncoder`` (samples of one reading merged per tag set) and
    its event lines (``gpuhealth_event``), in time order, so ``gpuhealth replay`` reads the
    file as a recording.

    Returns:
        ``(lines written, failures labelled)``.
    """
    encoder = LineEncoder(precision="ns")
    lines = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for tick in samples(p):
            sample_part = [r for r in tick if isinstance(r, Sample)]
            event_part = [r for r in tick if isinstance(r, Event)]
            out = encoder.samples(sample_part) + encoder.events(event_part)
            if out:
                handle.write("\n".join(out) + "\n")
                lines += len(out)
    return lines, len(p.failures)


def labels_json(p: Plan) -> list[dict[str, object]]:
    """The failure labels as JSON-ready dicts (write them beside a line-protocol file)."""
    return [
        {
            "node": f.node,
            "entity": f.entity,
            "kind": f.kind,
            "at": f.at,
            "precursor": f.precursor,
            "precursor_onset": f.precursor_onset,
            "recovered_at": f.recovered_at,
        }
        for f in p.failures
    ]


def no_precursor_fraction(failures: Sequence[FailureLabel]) -> float:
    """Share of failures without a precursor (nan when there is none)."""
    if not failures:
        return float("nan")
    return sum(not f.precursor for f in failures) / len(failures)


# --- scoring alarms against the labels -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Alarm:
    """One alarm of a detector or predictor: where and when (epoch seconds)."""

    node: str
    entity: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    """How a detector's alarms match the labels (see :func:`score_alarms` for the rules).

    Attributes:
        alarms: Alarms scored (after dropping ignored and node-level ones).
        node_alarms: Node-level alarms (entity ``node``), not scored.
        episodes: Alarm episodes (alarms of one entity less than ``merge_seconds`` apart).
        true_episodes, false_episodes, ignored_episodes: Episodes by verdict.
        failures, detected: Failures labelled, and those with an alarm in their window.
        precursor_failures, precursor_detected: The same, for failures with a precursor.
        early_detected: Failures with an alarm strictly before the failure time.
        precision: ``true / (true + false)`` episodes (nan with no episode).
        recall: ``detected / failures``.
        recall_precursor: ``precursor_detected / precursor_failures``.
        median_lead_seconds: Median lead of the detected failures with a precursor (nan if none).
        false_alarms_per_1000_gpu_days: ``false_episodes / gpu_days x 1000``.
        leads: Lead of each detected failure, seconds, by failure index.
    """

    alarms: int
    node_alarms: int
    episodes: int
    true_episodes: int
    false_episodes: int
    ignored_episodes: int
    failures: int
    detected: int
    precursor_failures: int
    precursor_detected: int
    early_detected: int
    precision: float
    recall: float
    recall_precursor: float
    median_lead_seconds: float
    false_alarms_per_1000_gpu_days: float
    leads: dict[int, float]


class EpisodeScorer:
    """Streaming :func:`score_alarms`: alarms fed in time order, only episodes kept.

    Memory is a few numbers per entity (the time of its last alarm) and per failure (its
    earliest matching alarm), whatever the number of alarms, so a detector that alarms
    millions of times over a 1,000-GPU month is scored in constant memory. The rules are those
    of :func:`score_alarms`, which is this class fed with alarms sorted by time.

    Args:
        failures: The labels.
        gpu_days: Exposure for the false-alarm rate (GPUs x days; ports are not added); > 0.
        horizon_seconds: How long before a failure an alarm still predicts it; > 0.
        grace_seconds: How long after a failure an alarm still detects it; >= 0.
        merge_seconds: Episode merging gap; >= 0.
        settle_seconds: Alarms ignored this long after recovery; >= 0.
        entities: ``(node, entity)`` pairs coded first, in order (entity ``i`` gets code
            ``i``), so that several scorers share codes.

    Raises:
        ValueError: A window length is negative, ``horizon_seconds <= 0`` or ``gpu_days <= 0``.

    Examples:
        >>> scorer = EpisodeScorer([], gpu_days=1.0)
        >>> for at in (0.0, 60.0, 7200.0):
        ...     scorer.add("n1", "gpu0", at)
        >>> score = scorer.result()
        >>> (score.alarms, score.episodes, score.false_episodes)
        (3, 2, 2)
    """

    def __init__(
        self,
        failures: Sequence[FailureLabel],
        *,
        gpu_days: float,
        horizon_seconds: float = 86_400.0,
        grace_seconds: float = 900.0,
        merge_seconds: float = 3600.0,
        settle_seconds: float = 3600.0,
        entities: Sequence[tuple[str, str]] = (),
    ) -> None:
        if horizon_seconds <= 0 or gpu_days <= 0:
            raise ValueError("horizon_seconds and gpu_days must be > 0")
        if min(grace_seconds, merge_seconds, settle_seconds) < 0:
            raise ValueError("grace_seconds, merge_seconds and settle_seconds must be >= 0")
        self.failures = tuple(failures)
        self.gpu_days = gpu_days
        self.horizon_seconds = horizon_seconds
        self.grace_seconds = grace_seconds
        self.merge_seconds = merge_seconds
        self.settle_seconds = settle_seconds
        self._codes: dict[tuple[str, str], int] = {}
        self._last: FloatArray = np.zeros(0)
        self._special: BoolArray = np.zeros(0, dtype=bool)  # has failures, or is node-level
        self._node_level: set[int] = set()
        self._failures_of: dict[int, list[int]] = {}
        self._counts = {"true": 0, "false": 0, "ignored": 0}
        self._kept = 0
        self._node_alarms = 0
        self._earliest: dict[int, float] = {}
        self._now = -math.inf
        for node, entity in entities:
            self.code(node, entity)
        for index, f in enumerate(self.failures):
            code = self.code(f.node, f.entity)
            self._failures_of.setdefault(code, []).append(index)
            self._special[code] = True

    def code(self, node: str, entity: str) -> int:
        """The dense code of ``(node, entity)`` for :meth:`add_codes` (assigned on first use)."""
        key = (node, entity)
        found = self._codes.get(key)
        if found is not None:
            return found
        found = self._codes[key] = len(self._codes)
        if found >= self._last.size:
            size = max(64, 2 * self._last.size)
            self._last = np.concatenate([self._last, np.full(size - self._last.size, -math.inf)])
            self._special = np.concatenate(
                [self._special, np.zeros(size - self._special.size, dtype=bool)]
            )
        if entity == "node":
            self._node_level.add(found)
            self._special[found] = True
        return found

    def add(self, node: str, entity: str, at: float) -> None:
        """Score one alarm; ``at`` (epoch seconds) must not be before the previous one's."""
        self.add_codes(np.array([self.code(node, entity)], dtype=np.int64), at)

    def add_codes(self, codes: IntArray, at: float) -> None:
        """Score alarms of the entities ``codes`` (from :meth:`code`; repeats allowed) at ``at``.

        Raises:
            ValueError: ``at`` is before the time of the previous call.
        """
        if codes.size == 0:
            return
        if at < self._now:
            raise ValueError(f"alarms must come in time order: {at} after {self._now}")
        self._now = at
        uniq, repeats = np.unique(codes, return_counts=True)
        new = (at - self._last[uniq]) >= self.merge_seconds
        self._last[uniq] = at
        plain = ~self._special[uniq]
        self._kept += int(repeats[plain].sum())
        self._counts["false"] += int(np.count_nonzero(new & plain))
        for k in np.flatnonzero(~plain).tolist():
            code, count = int(uniq[k]), int(repeats[k])
            if code in self._node_level:
                self._node_alarms += count
                continue
            kind, matched = self._verdict(code, at)
            if matched is not None:
                self._earliest[matched] = min(self._earliest.get(matched, math.inf), at)
            if kind != "ignored":
                self._kept += count
            if new[k]:
                self._counts[kind] += 1

    def _verdict(self, code: int, at: float) -> tuple[str, int | None]:
        found = None
        failures = self.failures
        for index in self._failures_of.get(code, ()):
            f = failures[index]
            if f.at - self.horizon_seconds <= at <= f.at + self.grace_seconds:
                found = index if found is None or failures[found].at > f.at else found
        if found is not None:
            return "true", found
        for index in self._failures_of.get(code, ()):
            f = failures[index]
            if f.at + self.grace_seconds < at <= f.recovered_at + self.settle_seconds:
                return "ignored", None
        return "false", None

    def result(self) -> Score:
        """The score of the alarms fed so far."""
        failures, counts = self.failures, self._counts
        leads = {i: max(0.0, failures[i].at - t) for i, t in self._earliest.items()}
        with_precursor = [i for i, f in enumerate(failures) if f.precursor]
        precursor_leads = [leads[i] for i in with_precursor if i in leads]
        judged = counts["true"] + counts["false"]
        return Score(
            alarms=self._kept,
            node_alarms=self._node_alarms,
            episodes=sum(counts.values()),
            true_episodes=counts["true"],
            false_episodes=counts["false"],
            ignored_episodes=counts["ignored"],
            failures=len(failures),
            detected=len(leads),
            precursor_failures=len(with_precursor),
            precursor_detected=len(precursor_leads),
            early_detected=sum(1 for i, t in self._earliest.items() if t < failures[i].at),
            precision=counts["true"] / judged if judged else float("nan"),
            recall=len(leads) / len(failures) if failures else float("nan"),
            recall_precursor=(
                len(precursor_leads) / len(with_precursor) if with_precursor else float("nan")
            ),
            median_lead_seconds=(
                float(np.median(precursor_leads)) if precursor_leads else float("nan")
            ),
            false_alarms_per_1000_gpu_days=counts["false"] / self.gpu_days * 1000.0,
            leads=leads,
        )


def score_alarms(
    alarms: Sequence[Alarm],
    failures: Sequence[FailureLabel],
    *,
    gpu_days: float,
    horizon_seconds: float = 86_400.0,
    grace_seconds: float = 900.0,
    merge_seconds: float = 3600.0,
    settle_seconds: float = 3600.0,
) -> Score:
    """Match alarms to labelled failures.

    Rules (the same for every detector and predictor):

    * An alarm **matches** a failure when it is on the failure's ``(node, entity)`` and its time
      is in ``[at - horizon_seconds, at + grace_seconds]``. The grace lets an alarm raised by
      the failure itself count as a detection with lead 0: the gap that follows a GPU falling
      off the bus, or a step of the uncorrected counter at a DBE.
    * Alarms of an entity in ``(at + grace_seconds, recovered_at + settle_seconds]`` of one of
      its failures are **ignored**: the entity is down, drained or being replaced.
    * Alarms of one entity less than ``merge_seconds`` apart form one **episode** (an operator
      is paged once); an episode is true when its first alarm matches a failure, ignored when
      its first alarm is ignored, false otherwise.
    * Node-level alarms (entity ``node``: the gap detector's verdict that a whole node or its
      collector went silent) are about no GPU or port: they are counted apart
      (``node_alarms``) and neither match a failure nor count as false alarms.
    * A failure is **detected** when any alarm matches it; its **lead** is ``at`` minus its
      earliest matching alarm, floored at 0.

    This keeps every alarm in memory; :class:`EpisodeScorer` scores a stream of them.

    Args:
        alarms: Alarms in any order.
        failures: The labels.
        gpu_days: Exposure for the false-alarm rate (GPUs x days; ports are not added).
        horizon_seconds: How long before a failure an alarm still predicts it; > 0.
        grace_seconds: How long after a failure an alarm still detects it; >= 0.
        merge_seconds: Episode merging gap; >= 0.
        settle_seconds: Alarms ignored this long after recovery; >= 0.

    Raises:
        ValueError: A window length is negative, ``horizon_seconds <= 0`` or ``gpu_days <= 0``.
    """
    scorer = EpisodeScorer(
        failures,
        gpu_days=gpu_days,
        horizon_seconds=horizon_seconds,
        grace_seconds=grace_seconds,
        merge_seconds=merge_seconds,
        settle_seconds=settle_seconds,
    )
    for a in sorted(alarms, key=lambda a: a.at):
        scorer.add(a.node, a.entity, a.at)
    return scorer.result()
