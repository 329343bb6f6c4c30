"""Per-entity feature vectors from the telemetry stream, for the failure predictor.

:class:`FeatureBuilder` keeps a short history per GPU and per InfiniBand port and, every
``interval_seconds``, turns it into one :class:`~core.records.FeatureVector` per entity
with the features the literature ties to failures that follow (issue #5; NVIDIA's
memory error management docs for row remapping, Xid catalog for the Xid classes,
Liu et al., SYSTOR 2023 for corrected-error trends before uncorrectable ones):

GPU features (names are stable; units per hour unless said):

* ``dram_ce_rate``, ``sram_ce_rate``: corrected (single-bit) ECC errors per hour over the
  window, from ``gpu_ecc_errors_total{type="corrected",location=...}``;
* ``ce_rate_trend``: the corrected-error rate in the newer half of the window minus the
  older half (a rising rate precedes double-bit errors);
* ``ue_rate``: uncorrected (double-bit) errors per hour;
* ``remap_pending``, ``remap_failure`` (0/1), ``remapped_rows``, ``retired_pages``;
* ``xid_rate``: Xid events per hour (``gpu_xid_events_total``);
* ``temp_dev``, ``power_dev``: temperature (degC) and power (W) minus the median of the
  other GPUs of the node (robust to a whole node heating up);
* ``throttle_ratio``: thermal plus power violation seconds per second;
* ``pcie_replay_rate``, ``nvlink_error_rate``.

Every counter rate above (and the port rates below) also comes over hours, since a
precursor may change only how often errors come, which no per-sample threshold and no
hourly rate sees (issue #15): ``<rate>_6h`` and ``<rate>_24h`` (per hour, over the last 6
and 24 hours or since first seen), and ``<rate>_trend``, the 6-hour rate minus the
24-hour one. They are kept as 24 hourly increases per counter.

InfiniBand port features (entity ``<device>:<port>``, as
:func:`analytics.identity.port_identity` names it): ``ib_symbol_rate``,
``ib_link_recovery_rate``, ``ib_link_downed_rate``, ``ib_rcv_error_rate``, per hour.

Counters are turned into increases with resets handled as Prometheus ``increase()``
does (a drop means the counter restarted from zero). Missing signals are absent from
``values``, never zero-filled.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from analytics.identity import port_identity
from analytics.precursors import EVIDENCE_CAP, HourlyCounter, HourlyGauge, advance_hours
from core.records import EntityId, FeatureVector, NodeName, Sample
from core.series import SeriesMemo

HOUR = 3600.0

LONG_HOURS = 24
"""Longest horizon of the counter rates over hours (``*_6h``, ``*_24h``, ``*_trend``)."""

RATE_HORIZONS = (6, LONG_HOURS)

_GPU_COUNTERS = {
    "gpu_xid_events_total": "xid_rate",
    "gpu_pcie_replays_total": "pcie_replay_rate",
    "gpu_nvlink_errors_total": "nvlink_error_rate",
}
_IB_COUNTERS = {
    "ib_symbol_errors_total": "ib_symbol_rate",
    "ib_link_error_recovery_total": "ib_link_recovery_rate",
    "ib_link_downed_total": "ib_link_downed_rate",
    "ib_port_rcv_errors_total": "ib_rcv_error_rate",
}
PRECURSOR_FAMILIES = {
    "dram_ce": "corrected_ecc",
    "sram_ce": "corrected_ecc",
    "pcie_replay_rate": "pcie_replay",
    "nvlink_error_rate": "nvlink_error",
    "ib_symbol_rate": "ib_symbol",
    "ib_link_recovery_rate": "ib_link_recovery",
    "ib_rcv_error_rate": "ib_rcv_error",
}
"""Counter features whose rise over the entity's own baseline is precursor evidence
(:mod:`analytics.precursors`), by family (named in the field's terms, so that the evidence
a warning names reads as what it is: ``corrected_ecc_evidence``). Xids (application errors
among them) and the failures' own signals (uncorrected errors, link downed) are not precursors."""

_REMAP_GAUGES = ("gpu_remapped_rows", "gpu_retired_pages")
"""Gauges that only grow on a healthy GPU: their increases are the ``remap`` family."""

LOAD_MATCH = 0.25
"""A GPU's temperature is compared with its peers' only while its power is within this
fraction of their median power."""

GPU_MODEL_INPUT = "gpu_precursor"
PORT_MODEL_INPUT = "port_precursor"
MODEL_INPUTS = (GPU_MODEL_INPUT, PORT_MODEL_INPUT, "kind_gpu", "kind_port")
"""What the failure predictor's model reads (:mod:`analytics.predictor` ``inputs``): the
strongest precursor evidence of the entity over 10 (0 to 3), and which kind of entity it
is (one intercept per kind). The other features are reported, refitted on, never modelled
online: raw rates encode a fleet's units and a GPU's static offset (issue #15)."""

_GAUGES = {
    "gpu_row_remap_pending": "remap_pending",
    "gpu_row_remap_failure": "remap_failure",
    "gpu_remapped_rows": "remapped_rows",
    "gpu_retired_pages": "retired_pages",
}


def _step(before: float, after: float) -> float:
    """Increase from one reading to the next; a drop means the counter restarted at zero."""
    return after - before if after >= before else after


@dataclass(slots=True)
class _Series:
    """Points of one counter (time, value), oldest first, within the window."""

    points: deque[tuple[float, float]] = field(default_factory=deque)
    hours: deque[float] = field(default_factory=lambda: deque(maxlen=LONG_HOURS))
    """Increase per clock hour over the last :data:`LONG_HOURS` (newest last): the rates
    over hours, in 24 floats rather than a day of points."""
    hour_at: float = 0.0
    """Start of the newest bucket of :attr:`hours`."""
    first_at: float | None = None
    total: float = 0.0
    """Increase over :attr:`points` (what :meth:`increase` of the whole window returns)."""

    def add(self, at: float, value: float, horizon: float) -> float | None:
        """Add a reading; return its increase since the last one (``None``: first or stale)."""
        step: float | None = None
        if self.points:
            before_at, before = self.points[-1]
            if at > before_at:
                step = value - before if value >= before else value
                self._bucket(at, step)
        else:
            self.first_at = at
            self._bucket(at, 0.0)
        points = self.points
        if points:
            self.total += _step(points[-1][1], value)
        points.append((at, value))
        while len(points) > 2 and points[0][0] < at - horizon:
            first = points.popleft()
            self.total -= _step(first[1], points[0][1])
        return step

    def _bucket(self, at: float, step: float) -> None:
        if not (self.hours and self.hour_at <= at < self.hour_at + HOUR):
            self.hour_at = advance_hours((self.hours,), self.hour_at, at)
        self.hours[-1] += step

    def long_rate(self, now: float, hours: int) -> float | None:
        """Return the increase per hour over the last ``hours`` hours (or since first seen)."""
        if self.first_at is None or not self.hours:
            return None
        take = min(hours, len(self.hours))
        total = sum(itertools.islice(reversed(self.hours), take))
        span = min(now - self.first_at, (take - 1) * HOUR + (now - self.hour_at))
        return total / span * HOUR if span > 0 else None

    def increase(self, since: float | None = None) -> tuple[float, float] | None:
        """Return (increase, seconds) over the points at or after ``since``; resets count."""
        points = self.points
        if since is None:  # the whole window: kept up to date as points come and go
            if len(points) < 2:
                return None
            return self.total, points[-1][0] - points[0][0]
        pts = [p for p in points if p[0] >= since]
        if len(pts) < 2:
            return None
        total = 0.0
        for (_, a), (_, b) in itertools.pairwise(pts):
            total += b - a if b >= a else b  # a drop: the counter restarted from zero
        return total, pts[-1][0] - pts[0][0]


def _series(counters: dict[str, _Series], key: str) -> _Series:
    """The series of ``key``, made on first use (not a new one built at every sample)."""
    series = counters.get(key)
    if series is None:
        series = counters[key] = _Series()
    return series


@dataclass(slots=True)
class _Entity:
    node: NodeName
    entity: EntityId
    is_link: bool
    counters: dict[str, _Series] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    last_at: float = 0.0
    precursors: dict[str, HourlyCounter] = field(default_factory=dict)
    """Hourly increases per precursor family (``corrected_ecc``, ``pcie_replay``...)."""
    remap_seen: dict[str, float] = field(default_factory=dict)
    temp_excess: HourlyGauge | None = None
    """Hourly means of the temperature excess over the node's other GPUs at equal power."""


_SKIP, _TOUCH, _COUNTER, _GAUGE, _REMAP = range(5)
"""What :meth:`FeatureBuilder.observe` does with a sample (:class:`_Slot` ``kind``)."""

@dataclass(slots=True, eq=False)
class _Slot:
    """What a series' samples feed, worked out once (:meth:`FeatureBuilder._slot`)."""

    kind: int = _SKIP
    ent: _Entity = None  # type: ignore[assignment]  # set unless kind is _SKIP
    series: _Series = None  # type: ignore[assignment]  # set for _COUNTER
    family: HourlyCounter | None = None
    name: str = ""


class FeatureBuilder:
    """Builds per-entity feature vectors from samples (see the module docstring).

    Args:
        interval_seconds: One vector per entity at most this often, > 0.
        window_seconds: History the rates and trends look at, > 0.

    Raises:
        ValueError: A non-positive interval or window.
    """

    def __init__(self, *, interval_seconds: float = 60.0, window_seconds: float = HOUR) -> None:
        if interval_seconds <= 0 or window_seconds <= 0:
            raise ValueError("interval_seconds and window_seconds must be > 0")
        self.interval_seconds = interval_seconds
        self.window_seconds = window_seconds
        self._entities: dict[tuple[str, str], _Entity] = {}
        self._emitted: dict[tuple[str, str], float] = {}
        self._slots: SeriesMemo[_Slot] = SeriesMemo()
        self._slope = [0.0, 0.0]
        """Decayed sums of ``power_dev * temp_dev`` and ``power_dev ** 2`` over the fleet:
        the slope that puts temperature excesses at equal power."""

    def observe(self, samples: Iterable[Sample]) -> None:
        """Take samples (any order of entities; per series in time order)."""
        horizon = self.window_seconds
        known = self._slots.get
        for s in samples:
            at = s.observed_at
            if at is None:
                continue  # a snapshot without a time cannot make a rate
            slot = known(s)
            if slot is None:
                slot = self._slot(s)
            kind = slot.kind
            if kind == _SKIP:
                continue
            ent = slot.ent
            if at > ent.last_at:
                ent.last_at = at
            if kind == _TOUCH:
                continue
            value = s.value
            if kind == _COUNTER:
                step = slot.series.add(at, value, horizon)
                family = slot.family
                if family is not None:
                    family.add(at, step if step is not None else 0.0)
            elif kind == _GAUGE:
                ent.gauges[slot.name] = value
            else:  # _REMAP: a gauge that only grows on a healthy GPU
                ent.gauges[slot.name] = value
                before = ent.remap_seen.get(s.metric)
                ent.remap_seen[s.metric] = value
                family = ent.precursors.get("remap") or ent.precursors.setdefault(
                    "remap", HourlyCounter())
                family.add(at, max(value - before, 0.0) if before is not None else 0.0)

    def _slot(self, s: Sample) -> _Slot:
        """Work out once what :meth:`observe` does with ``s``'s series (memoised)."""
        metric = s.metric
        slot = _Slot()
        self._slots.put(s, slot)
        link = metric.startswith("ib_")
        if link:
            if metric not in _IB_COUNTERS:
                return slot
            entity = port_identity(s.entity, s.labels)
        elif metric.startswith("gpu_"):
            entity = s.entity
        else:
            return slot
        key = (s.node, entity)
        ent = self._entities.get(key)
        if ent is None:
            ent = self._entities[key] = _Entity(node=s.node, entity=entity, is_link=link)
        slot.ent = ent
        slot.kind = _TOUCH  # a GPU's or port's sample: it is alive
        if metric == "gpu_ecc_errors_total":
            kind = "ce" if s.labels.get("type") == "corrected" else "ue"
            where = "sram" if "sram" in s.labels.get("location", "").lower() else "dram"
            name = f"{where}_{kind}" if kind == "ce" else "ue"
            series_key = f"{name}|{s.labels.get('location', '')}|{s.labels.get('scope', '')}"
            self._counter_slot(slot, ent, name, series_key)
        elif metric in _GPU_COUNTERS or metric in _IB_COUNTERS:
            name = _GPU_COUNTERS.get(metric) or _IB_COUNTERS[metric]
            series_key = f"{name}|{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}"
            self._counter_slot(slot, ent, name, series_key)
        elif metric in ("gpu_thermal_violation_seconds_total",
                        "gpu_power_violation_seconds_total"):
            slot.kind = _COUNTER
            slot.series = _series(ent.counters, f"throttle|{metric}")
        elif metric in _GAUGES:
            slot.kind = _REMAP if metric in _REMAP_GAUGES else _GAUGE
            slot.name = _GAUGES[metric]
        elif metric == "gpu_temperature_celsius":
            slot.kind, slot.name = _GAUGE, "temp"
        elif metric == "gpu_power_watts":
            slot.kind, slot.name = _GAUGE, "power"
        return slot

    @staticmethod
    def _counter_slot(slot: _Slot, ent: _Entity, name: str, series_key: str) -> None:
        slot.kind = _COUNTER
        slot.series = _series(ent.counters, series_key)
        family = PRECURSOR_FAMILIES.get(name)
        if family is not None:
            counter = ent.precursors.get(family)
            if counter is None:
                counter = ent.precursors[family] = HourlyCounter()
            slot.family = counter

    def forget_history(self, node: str, entity: str) -> None:
        """Start an entity's precursor history again (it failed: repaired or replaced).

        Its evidence is judged again only once it has a new baseline
        (:data:`analytics.precursors.MIN_BASELINE_HOURS`): the errors before a repair say
        nothing about the part after it.
        """
        ent = self._entities.get((node, entity))
        if ent is not None:
            ent.precursors.clear()
            ent.temp_excess = None
            self._slots.clear()  # they hold the old precursor counters

    def vectors(self, now: float) -> list[FeatureVector]:
        """Return one vector per entity whose last one is ``interval_seconds`` old or more.

        Entities with no sample within the window are skipped (a silent GPU is the gap
        detector's business, not a feature of zeros).
        """
        out: list[FeatureVector] = []
        window, interval, emitted = self.window_seconds, self.interval_seconds, self._emitted
        due = [(key, ent) for key, ent in self._entities.items()
               if now - ent.last_at <= window
               and now - emitted.get(key, float("-inf")) >= interval]
        if not due:
            return out
        by_node: dict[str, list[_Entity]] = {}
        for ent in self._entities.values():
            if not ent.is_link:
                by_node.setdefault(ent.node, []).append(ent)
        for key, ent in due:
            values = self._features(ent, now, by_node.get(ent.node, []))
            if not values:
                continue
            self._emitted[key] = now
            out.append(FeatureVector(node=ent.node, entity=ent.entity, values=values,
                                     window_end_at=now))
        return out

    def _features(self, ent: _Entity, now: float, peers: list[_Entity]) -> dict[str, float]:
        values: dict[str, float] = {}
        mid = now - self.window_seconds / 2.0
        rates: dict[str, float] = {}
        trend_new: dict[str, float] = {}
        trend_old: dict[str, float] = {}
        long_rates: dict[str, float] = {}
        throttle: float | None = None
        for series_key, series in ent.counters.items():
            name = series_key.split("|", 1)[0]
            inc = series.increase()
            if inc is None or inc[1] <= 0:
                continue
            if name == "throttle":
                throttle = (throttle or 0.0) + inc[0] / inc[1]
                continue
            rate = inc[0] / inc[1] * HOUR
            feature = f"{name}_rate" if name in ("dram_ce", "sram_ce", "ue") else name
            rates[feature] = rates.get(feature, 0.0) + rate
            for hours in RATE_HORIZONS:  # how often errors come, over hours
                long = series.long_rate(now, hours)
                if long is not None:
                    key = f"{feature}_{hours}h"
                    long_rates[key] = long_rates.get(key, 0.0) + long
            if name in ("dram_ce", "sram_ce"):
                newer = series.increase(since=mid)
                older_pts = [p for p in series.points if p[0] <= mid]
                if newer is not None and newer[1] > 0:
                    trend_new[name] = trend_new.get(name, 0.0) + newer[0] / newer[1] * HOUR
                if len(older_pts) >= 2:
                    total = sum(b - a if b >= a else b for (_, a), (_, b)
                                in itertools.pairwise(older_pts))
                    span = older_pts[-1][0] - older_pts[0][0]
                    if span > 0:
                        trend_old[name] = trend_old.get(name, 0.0) + total / span * HOUR
        values.update(rates)
        values.update(long_rates)
        for feature in rates:
            short, day = long_rates.get(f"{feature}_6h"), long_rates.get(f"{feature}_24h")
            if short is not None and day is not None:
                values[f"{feature}_trend"] = short - day  # errors coming more often lately
        if trend_new or trend_old:
            values["ce_rate_trend"] = sum(trend_new.values()) - sum(trend_old.values())
        if throttle is not None:
            values["throttle_ratio"] = throttle
        for name in ("remap_pending", "remap_failure", "remapped_rows", "retired_pages"):
            if name in ent.gauges:
                values[name] = ent.gauges[name]
        for gauge, feature in (("temp", "temp_dev"), ("power", "power_dev")):
            own = ent.gauges.get(gauge)
            others = [p.gauges[gauge] for p in peers if p is not ent and gauge in p.gauges]
            if own is not None and others:
                values[feature] = own - statistics.median(others)
        self._evidence(ent, now, values)
        return values

    def _evidence(self, ent: _Entity, now: float, values: dict[str, float]) -> None:
        """Add the precursor evidence (:mod:`analytics.precursors`) and the model inputs."""
        strongest = 0.0
        for family, counter in ent.precursors.items():
            since = counter.hours_since_error(now)
            if since is not None:
                values[f"{family}_hours_since"] = min(since, 72.0)
            found = counter.evidence(now)
            if found is not None:
                values[f"{family}_evidence"], values[f"{family}_fold"] = found
                strongest = max(strongest, found[0])
        temp_dev, power_dev = values.get("temp_dev"), values.get("power_dev")
        power = ent.gauges.get("power")
        # a GPU at another load than its peers (drained, idle, or alone at work) is not
        # compared: the slope below corrects small differences, not an idle GPU's 20 degC
        comparable = (power_dev is None or power is None
                      or abs(power_dev) <= LOAD_MATCH * max(power - power_dev, 1.0))
        if temp_dev is not None and comparable:
            excess = temp_dev
            if power_dev is not None:
                slope = self._slope
                slope[0] = slope[0] * 0.9999 + power_dev * temp_dev
                slope[1] = slope[1] * 0.9999 + power_dev * power_dev
                per_watt = min(max(slope[0] / slope[1], 0.0), 1.0) if slope[1] > 0 else 0.0
                excess -= per_watt * power_dev
            if ent.temp_excess is None:
                ent.temp_excess = HourlyGauge()
            ent.temp_excess.add(now, excess)
        if temp_dev is not None and ent.temp_excess is not None:
            found = ent.temp_excess.evidence()
            if found is not None:
                values["temp_evidence"], values["temp_excess"] = found
                strongest = max(strongest, found[0])
        if ent.is_link:
            values[PORT_MODEL_INPUT] = min(strongest, EVIDENCE_CAP) / 10.0
            values["kind_port"] = 1.0
        else:
            values[GPU_MODEL_INPUT] = min(strongest, EVIDENCE_CAP) / 10.0
            values["kind_gpu"] = 1.0
