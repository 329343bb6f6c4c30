"""Reliability statistics over an incident history: pure functions over pandas DataFrames.

The frames are those of :class:`storage.history.IncidentHistory`: ``incidents`` (one row per
failure, columns ``storage.history.INCIDENT_COLUMNS``), ``inventory`` (one row per GPU or
node residency, ``INVENTORY_COLUMNS``) and ``predictions`` (``PREDICTION_COLUMNS``). Times
are epoch seconds; every duration this module returns is in **hours** (``*_hours``) unless
its name says seconds.

Definitions (docs/report.md gives the same with examples):

* **Exposure** (operating time) of a residency in a window ``[start, end)``: the overlap
  of ``[first_seen_at, last_seen_at]`` with the window; a residency without a start time
  has none. GPU-hours are the sum over residencies.
* **MTBF** of a group = exposure hours / failures (the maximum-likelihood estimate of an
  exponential mean under time-terminated observation), with the two-sided chi-square
  interval ``[2T / chi2(1 - a/2; 2r + 2), 2T / chi2(a/2; 2r)]`` (Epstein 1960, "Estimation
  from life test data", Technometrics 2(4); the time-terminated bounds tabulated in
  MIL-HDBK-781A). With no failure only the lower bound exists.
* **System MTBF** (mean time between failure events anywhere in the group) = window hours /
  failures, the "span / records" figure the Titan and LANL sources quote.
* **MTTR** = ``back_in_service_at - detected_at`` over incidents that have both.
* **Availability** = 1 - hours lost / exposure hours, hours lost being the overlap of each
  incident's ``[out_of_service_at, back_in_service_at)`` (open incidents: to the end of
  the window) with the window.
* **Cohort comparison**: failure rates per million GPU-hours with exact Poisson (Garwood
  1936) intervals, and the rate ratio candidate/baseline with the exact conditional
  interval: given ``r1 + r2`` failures, ``r1`` is binomial with ``p = T1 l1 / (T1 l1 + T2
  l2)``, so Clopper-Pearson bounds on ``p`` give the ratio's bounds and the two-sided
  binomial test its p-value (Breslow & Day 1987, Statistical Methods in Cancer Research II,
  section 2.2). Not a log-rank test: the history gives exposure, not a common time origin.
* **Checkpoint interval**: Young (1974) ``sqrt(2 C M)``; Daly (2006) higher-order
  ``sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C`` for ``C < 2M``, else ``M``;
  a job on ``n`` nodes has ``M = node MTBF / n``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pandas as pd
from scipy import stats  # type: ignore[import-untyped,unused-ignore]

HOUR = 3600.0
"""Seconds in an hour."""

CAUSE_ORDER = (
    "xid", "memory", "nvlink", "network", "host", "thermal", "power", "gpu_lost", "other",
)
"""Causes in display order (``storage.history.CAUSES``; repeated to keep analytics free of
the storage import in the statistics)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """A half-open time window ``[start, end)`` in epoch seconds (``end > start``)."""

    start: float
    end: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise ValueError("window bounds must be finite epoch seconds")
        if self.end <= self.start:
            raise ValueError(f"window end {self.end} must be after its start {self.start}")

    @property
    def hours(self) -> float:
        """Return the window's length in hours."""
        return (self.end - self.start) / HOUR

    def previous(self) -> Window:
        """Return the window of the same length just before this one."""
        return Window(start=2 * self.start - self.end, end=self.start)


def data_window(inventory: pd.DataFrame, incidents: pd.DataFrame) -> Window | None:
    """Return the window the data covers: earliest start to one second past the latest stamp.

    Returns:
        ``None`` when both frames are empty.
    """
    starts: list[float] = []
    ends: list[float] = []
    if len(inventory):
        for column, bucket in (("first_seen_at", starts), ("last_seen_at", ends)):
            values = pd.to_numeric(inventory[column], errors="coerce").dropna()
            if len(values):
                bucket.append(float(values.min() if column == "first_seen_at" else values.max()))
    if len(incidents):
        detected = pd.to_numeric(incidents["detected_at"], errors="coerce").dropna()
        if len(detected):
            starts.append(float(detected.min()))
            ends.append(float(detected.max()))
        back = pd.to_numeric(incidents["back_in_service_at"], errors="coerce").dropna()
        if len(back):
            ends.append(float(back.max()))
    if not starts or not ends:
        return None
    # One second past the last stamp, so that the window (half-open) holds the last event.
    return Window(start=min(starts), end=max(ends) + 1.0)


def exposure_hours(inventory: pd.DataFrame, window: Window) -> pd.Series:
    """Return each residency's operating hours inside ``window`` (0 without a start time).

    Args:
        inventory: Residencies with ``first_seen_at`` and ``last_seen_at`` (epoch s).
        window: The window.

    Returns:
        Float hours >= 0, aligned with ``inventory``'s index.
    """
    first = pd.to_numeric(inventory["first_seen_at"], errors="coerce").to_numpy(dtype=float)
    last = pd.to_numeric(inventory["last_seen_at"], errors="coerce").to_numpy(dtype=float)
    lo = np.maximum(first, window.start)
    hi = np.minimum(last, window.end)
    hours = np.where(np.isnan(first), 0.0, np.clip(hi - lo, 0.0, None) / HOUR)
    return pd.Series(hours, index=inventory.index, dtype=float)


def mtbf_interval(exposure: float, failures: int,
                  confidence: float = 0.90) -> tuple[float | None, float | None, float | None]:
    """Return the MTBF point estimate and two-sided chi-square bounds (time-terminated).

    Args:
        exposure: Total operating time T (any unit; the result has the same unit), >= 0.
        failures: Number of failures r >= 0.
        confidence: Two-sided confidence level in (0, 1).

    Returns:
        ``(mtbf, lower, upper)``: ``mtbf = T / r`` and ``upper`` are ``None`` when r = 0;
        all three are ``None`` when T = 0. Source: Epstein (1960); see the module docstring.

    Raises:
        ValueError: Negative inputs or a confidence outside (0, 1).

    Examples:
        >>> m, lo, hi = mtbf_interval(1000.0, 4, 0.90)
        >>> m, round(lo, 1), round(hi, 1)
        (250.0, 109.2, 731.9)
    """
    if exposure < 0 or failures < 0:
        raise ValueError("exposure and failures must be >= 0")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if exposure == 0:
        return None, None, None
    alpha = 1.0 - confidence
    lower = 2.0 * exposure / float(stats.chi2.ppf(1.0 - alpha / 2.0, 2 * failures + 2))
    if failures == 0:
        return None, lower, None
    upper = 2.0 * exposure / float(stats.chi2.ppf(alpha / 2.0, 2 * failures))
    return exposure / failures, lower, upper


def poisson_rate_interval(count: int, exposure: float,
                          confidence: float = 0.90) -> tuple[float, float]:
    """Return the exact (Garwood 1936) two-sided interval of a Poisson rate count/exposure.

    Args:
        count: Events observed, >= 0.
        exposure: Exposure (> 0); the rate's unit is events per exposure unit.
        confidence: Two-sided level in (0, 1).

    Returns:
        ``(lower, upper)`` rates.

    Examples:
        >>> lo, hi = poisson_rate_interval(0, 10.0, 0.95)
        >>> lo, round(hi, 4)
        (0.0, 0.3689)
    """
    if exposure <= 0:
        raise ValueError("exposure must be > 0")
    alpha = 1.0 - confidence
    lower = 0.0 if count == 0 else float(stats.chi2.ppf(alpha / 2, 2 * count)) / 2.0
    upper = float(stats.chi2.ppf(1 - alpha / 2, 2 * count + 2)) / 2.0
    return lower / exposure, upper / exposure


def _incident_column(incidents: pd.DataFrame, inventory: pd.DataFrame, by: str) -> pd.Series:
    """Return each incident's value of ``by``, filled from the entity's residency if empty."""
    values = incidents[by].astype(str) if by in incidents else pd.Series(
        "", index=incidents.index, dtype=str)
    missing = values == ""
    if missing.any() and by in inventory and len(inventory):
        lookup = (inventory[inventory[by].astype(str) != ""]
                  .drop_duplicates(["entity", "node"], keep="last")
                  .set_index(["entity", "node"])[by].astype(str))
        keys = pd.MultiIndex.from_arrays([incidents["entity"], incidents["node"]])
        filled = pd.Series(lookup.reindex(keys).to_numpy(), index=incidents.index)
        values = values.where(~missing, filled.fillna(""))
    return values


def _units(inventory: pd.DataFrame) -> pd.Series:
    """Return each residency's unit: the entity, or the node for node-level entities."""
    entity = inventory["entity"].astype(str)
    return entity.where(entity != "node", "node@" + inventory["node"].astype(str))


def mtbf_by(inventory: pd.DataFrame, incidents: pd.DataFrame, by: str, window: Window,
            confidence: float = 0.90) -> pd.DataFrame:
    """Return MTBF per value of ``by`` (``model``, ``node``, ``driver_version``, ``batch``...).

    Failures are incidents detected in the window; exposure is residency time in the
    window (:func:`exposure_hours`). An incident whose ``by`` is empty takes its entity's
    value from the inventory.

    Returns:
        One row per group with exposure or failures in the window, sorted by MTBF
        ascending (worst first): ``group``, ``units`` (distinct GPUs, or nodes for
        node-level entities), ``exposure_hours``, ``failures``, ``mtbf_hours``,
        ``mtbf_lower_hours``, ``mtbf_upper_hours`` (NaN where undefined),
        ``system_mtbf_hours`` (hours from the group's first residency start to its last end,
        clipped to the window, / failures: the mean time between failure events anywhere in
        the group, LANL's "span / records") and ``failures_per_million_hours``.
    """
    inv = inventory.assign(_hours=exposure_hours(inventory, window))
    inv["_group"] = inv[by].astype(str) if by in inv else ""
    inv["_unit"] = _units(inv)
    exposure = inv.groupby("_group")["_hours"].sum()
    live = inv[inv["_hours"] > 0]
    units = live.groupby("_group")["_unit"].nunique()
    spans = live.assign(
        _lo=pd.to_numeric(live["first_seen_at"]).clip(lower=window.start),
        _hi=pd.to_numeric(live["last_seen_at"]).clip(upper=window.end),
    ).groupby("_group").agg(lo=("_lo", "min"), hi=("_hi", "max"))
    span_hours = (spans["hi"] - spans["lo"]) / HOUR
    in_window = incidents[(incidents["detected_at"] >= window.start)
                          & (incidents["detected_at"] < window.end)]
    failures = _incident_column(in_window, inventory, by).value_counts()
    groups = sorted(set(exposure.index) | set(failures.index))
    hours = exposure.reindex(groups).fillna(0.0).to_numpy(dtype=float)
    counts = failures.reindex(groups).fillna(0).to_numpy(dtype=int)
    point, lower, upper = _mtbf_arrays(hours, counts, confidence)
    span = span_hours.reindex(groups).fillna(window.hours).to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        system = np.where(counts > 0, span / np.maximum(counts, 1), np.nan)
        per_million = np.where(hours > 0, counts / np.where(hours > 0, hours, 1.0) * 1e6,
                               np.nan)
    frame = pd.DataFrame({
        "group": groups, "units": units.reindex(groups).fillna(0).to_numpy(dtype=int),
        "exposure_hours": hours, "failures": counts, "mtbf_hours": point,
        "mtbf_lower_hours": lower, "mtbf_upper_hours": upper, "system_mtbf_hours": system,
        "failures_per_million_hours": per_million,
    })
    frame = frame[(frame["exposure_hours"] > 0) | (frame["failures"] > 0)]
    key = frame["mtbf_hours"].astype(float).fillna(math.inf)
    frame = frame.assign(_k=key).sort_values(["_k", "group"]).drop(columns="_k")
    return frame.reset_index(drop=True)


def _mtbf_arrays(hours: np.ndarray, counts: np.ndarray,
                 confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised :func:`mtbf_interval` (NaN where undefined)."""
    alpha = 1.0 - confidence
    with np.errstate(divide="ignore", invalid="ignore"):
        lower = 2.0 * hours / stats.chi2.ppf(1.0 - alpha / 2.0, 2 * counts + 2)
        upper = 2.0 * hours / stats.chi2.ppf(alpha / 2.0, np.maximum(2 * counts, 1))
        point = hours / np.maximum(counts, 1)
    lower = np.where(hours > 0, lower, np.nan)
    upper = np.where((hours > 0) & (counts > 0), upper, np.nan)
    point = np.where((hours > 0) & (counts > 0), point, np.nan)
    return point, lower, upper


def fleet_summary(inventory: pd.DataFrame, incidents: pd.DataFrame, window: Window,
                  confidence: float = 0.90) -> dict[str, Any]:
    """Return the fleet's exposure, failures, MTBF (with interval) and system MTBF.

    Returns:
        ``units`` (distinct entities with exposure), ``nodes``, ``exposure_hours``,
        ``failures`` (detected in the window), ``mtbf_hours``, ``mtbf_lower_hours``,
        ``mtbf_upper_hours``, ``system_mtbf_hours``, ``node_mtbf_hours`` (node exposure
        hours / failures: each node's span of residencies in the window) and
        ``window_hours``.
    """
    hours = exposure_hours(inventory, window)
    live = inventory[hours > 0]
    in_window = incidents[(incidents["detected_at"] >= window.start)
                          & (incidents["detected_at"] < window.end)]
    count = len(in_window)
    total = float(hours.sum())
    point, lower, upper = mtbf_interval(total, count, confidence)
    node_hours = 0.0
    if len(live):
        spans = live.assign(
            _lo=pd.to_numeric(live["first_seen_at"]).clip(lower=window.start),
            _hi=pd.to_numeric(live["last_seen_at"]).clip(upper=window.end),
        ).groupby("node").agg(lo=("_lo", "min"), hi=("_hi", "max"))
        node_hours = float(((spans["hi"] - spans["lo"]).clip(lower=0) / HOUR).sum())
    return {
        "units": int(_units(live).nunique()) if len(live) else 0,
        "nodes": int(live["node"].nunique()) if len(live) else 0,
        "exposure_hours": total, "failures": count, "mtbf_hours": point,
        "mtbf_lower_hours": lower, "mtbf_upper_hours": upper,
        "system_mtbf_hours": window.hours / count if count else None,
        "node_mtbf_hours": node_hours / count if count and node_hours else None,
        "window_hours": window.hours, "confidence": confidence,
    }


def _lost_intervals(incidents: pd.DataFrame, window: Window) -> tuple[np.ndarray, np.ndarray]:
    out = pd.to_numeric(incidents["out_of_service_at"], errors="coerce").to_numpy(dtype=float)
    back = pd.to_numeric(incidents["back_in_service_at"], errors="coerce").to_numpy(
        dtype=float)
    back = np.where(np.isnan(back), window.end, back)
    lo = np.maximum(out, window.start)
    hi = np.minimum(back, window.end)
    keep = ~np.isnan(out) & (hi > lo)
    return lo[keep], hi[keep]


def fleet_incidents(inventory: pd.DataFrame, incidents: pd.DataFrame,
                    window: Window) -> pd.DataFrame:
    """Return the incidents on nodes that were in the inventory during ``window``.

    A node with no residency in the window is not part of the fleet being measured, so an
    incident left open there (a GPU never replaced) costs the fleet nothing.
    """
    hours = exposure_hours(inventory, window)
    nodes = pd.unique(inventory.loc[hours.to_numpy() > 0, "node"].to_numpy())
    return incidents[incidents["node"].isin(nodes)]


def availability(inventory: pd.DataFrame, incidents: pd.DataFrame,
                 window: Window) -> dict[str, Any]:
    """Return availability and GPU-hours lost to failures in ``window``.

    Only incidents on nodes of the fleet in the window count (:func:`fleet_incidents`).

    Returns:
        ``exposure_hours``, ``lost_hours`` (overlap of each incident's out-of-service
        interval with the window; open ones run to the window's end), ``availability``
        (``1 - lost / exposure``, ``None`` without exposure), ``incidents_out_of_service``
        (incidents out of service during the window) and ``open_at_end`` (still out at
        the end).
    """
    total = float(exposure_hours(inventory, window).sum())
    incidents = fleet_incidents(inventory, incidents, window)
    lo, hi = _lost_intervals(incidents, window)
    lost = float((hi - lo).sum() / HOUR)
    back = pd.to_numeric(incidents["back_in_service_at"], errors="coerce")
    out = pd.to_numeric(incidents["out_of_service_at"], errors="coerce")
    open_at_end = int(((out < window.end) & (back.isna() | (back >= window.end))).sum())
    return {
        "exposure_hours": total, "lost_hours": lost,
        "availability": 1.0 - lost / total if total > 0 else None,
        "incidents_out_of_service": len(lo), "open_at_end": open_at_end,
    }


def retired_after_failure(inventory: pd.DataFrame, incidents: pd.DataFrame,
                          window: Window) -> int:
    """Return how many GPUs failed in ``window`` and were removed from the system in it.

    Node-level incidents (entity ``"node"``) are not counted. On the Titan data this is the
    source's ``dead`` flag (5,089 GPUs over the whole history).
    """
    failed = incidents[(incidents["detected_at"] >= window.start)
                       & (incidents["detected_at"] < window.end)
                       & (incidents["entity"] != "node")]
    removed_at = pd.to_numeric(inventory["removed_at"], errors="coerce")
    removed = inventory[(removed_at >= window.start) & (removed_at < window.end)]
    return len(set(failed["entity"]) & set(removed["entity"]))


def peak_concurrent_out(incidents: pd.DataFrame, window: Window) -> int:
    """Return the most entities out of service at the same moment within ``window``."""
    lo, hi = _lost_intervals(incidents, window)
    if not len(lo):
        return 0
    times = np.concatenate([lo, hi])
    steps = np.concatenate([np.ones(len(lo)), -np.ones(len(hi))])
    order = np.lexsort((steps, times))  # at equal times, ends (-1) before starts
    return int(np.cumsum(steps[order]).max())


def mttr(incidents: pd.DataFrame) -> dict[str, Any]:
    """Return repair-time statistics: detection to back in service, in hours.

    Returns:
        ``repaired`` (incidents with both times), ``unrepaired``, ``mean_hours``,
        ``median_hours``, ``p90_hours`` and ``max_hours`` (``None`` when nothing was
        repaired).
    """
    detected = pd.to_numeric(incidents["detected_at"], errors="coerce")
    back = pd.to_numeric(incidents["back_in_service_at"], errors="coerce")
    hours = ((back - detected) / HOUR).dropna()
    hours = hours[hours >= 0]
    if not len(hours):
        return {"repaired": 0, "unrepaired": len(incidents), "mean_hours": None,
                "median_hours": None, "p90_hours": None, "max_hours": None}
    return {
        "repaired": len(hours), "unrepaired": len(incidents) - len(hours),
        "mean_hours": float(hours.mean()), "median_hours": float(hours.median()),
        "p90_hours": float(hours.quantile(0.9)), "max_hours": float(hours.max()),
    }


def failures_by_cause(incidents: pd.DataFrame) -> dict[str, Any]:
    """Return failure counts by cause, by kind and by ``kind:code`` (top 15).

    Returns:
        ``by_cause`` (every cause in :data:`CAUSE_ORDER`, zeros included), ``by_kind`` and
        ``top_codes`` (``{"kind": ..., "code": ..., "failures": n}``, most frequent first).
    """
    causes = incidents["cause"].value_counts()
    kinds = incidents["kind"].value_counts()
    codes = incidents.groupby(["kind", "code"]).size().sort_values(ascending=False)
    return {
        "by_cause": {c: int(causes.get(c, 0)) for c in CAUSE_ORDER},
        "by_kind": {str(k): int(v) for k, v in kinds.sort_index().items()},
        "top_codes": [{"kind": str(key[0]), "code": str(key[1]), "failures": int(n)}
                      for key, n in list(cast(Any, codes).items())[:15]],
    }


def failures_by_period(incidents: pd.DataFrame, freq: str, tz: str = "UTC") -> pd.DataFrame:
    """Return failures per calendar period and cause.

    Args:
        incidents: Incidents.
        freq: ``year``, ``month``, ``week`` or ``day``.
        tz: IANA zone in which periods are cut (a year of Titan events is cut in Oak Ridge
            time, as the source's per-year counts are).

    Returns:
        Index: period label (``2016``, ``2016-03``...); columns: causes seen; values: counts.
    """
    formats = {"year": "%Y", "month": "%Y-%m", "week": "%G-W%V", "day": "%Y-%m-%d"}
    if freq not in formats:
        raise ValueError(f"freq must be one of {', '.join(formats)}, got {freq!r}")
    if not len(incidents):
        return pd.DataFrame()
    stamps = pd.to_datetime(incidents["detected_at"], unit="s", utc=True).dt.tz_convert(tz)
    labels = stamps.dt.strftime(formats[freq])
    table = pd.crosstab(labels, incidents["cause"])
    table.index.name = "period"
    return table


def repeat_offenders(incidents: pd.DataFrame, k: int = 2, by: str = "entity",
                     limit: int | None = 20) -> pd.DataFrame:
    """Return the entities (or nodes, slots) with at least ``k`` failures.

    Returns:
        Columns ``key``, ``failures``, ``first_at``, ``last_at``, ``causes`` (comma-joined),
        most failures first, at most ``limit`` rows (``None``: all). Entities are keyed
        ``node/entity``; node-level incidents are left out of the entity ranking.
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    data = incidents if by != "entity" else incidents[incidents["entity"] != "node"]
    if not len(data):
        return pd.DataFrame(columns=["key", "failures", "first_at", "last_at", "causes"])
    key = data[by].astype(str) if by != "entity" else data["node"] + "/" + data["entity"]
    keyed = data.assign(_key=key)
    grouped = keyed.groupby("_key").agg(
        failures=("detected_at", "size"), first_at=("detected_at", "min"),
        last_at=("detected_at", "max"))
    grouped = grouped[grouped["failures"] >= k]
    kept = keyed[keyed["_key"].isin(grouped.index)].drop_duplicates(["_key", "cause"])
    causes = kept.sort_values("cause").groupby("_key")["cause"].agg(",".join)
    grouped = grouped.assign(causes=causes.reindex(grouped.index).fillna(""))
    grouped = grouped.reset_index().rename(columns={"_key": "key"})
    grouped = grouped.sort_values(["failures", "key"], ascending=[False, True])
    return (grouped if limit is None else grouped.head(limit)).reset_index(drop=True)


def lemon_slots(incidents: pd.DataFrame, k: int = 2, min_entities: int = 2,
                limit: int = 20) -> pd.DataFrame:
    """Return slots where failures keep coming back across successive GPUs.

    A slot is a lemon when at least ``min_entities`` different entities failed in it, with
    at least ``k`` failures in all: replacing the GPU did not cure it (the location effect
    of the Titan study, Ostrouchov et al. SC20).

    Returns:
        Columns ``slot``, ``failures``, ``entities`` (distinct failed GPUs), ``first_at``,
        ``last_at``; most failed GPUs first, then most failures; at most ``limit`` rows
        (``limit=0``: all).
    """
    data = incidents[incidents["slot"].astype(str) != ""]
    columns = ["slot", "failures", "entities", "first_at", "last_at"]
    if not len(data):
        return pd.DataFrame(columns=columns)
    grouped = data.groupby("slot").agg(
        failures=("detected_at", "size"), entities=("entity", "nunique"),
        first_at=("detected_at", "min"), last_at=("detected_at", "max")).reset_index()
    grouped = grouped[(grouped["failures"] >= k) & (grouped["entities"] >= min_entities)]
    grouped = grouped.sort_values(["entities", "failures", "slot"],
                                  ascending=[False, False, True])
    return (grouped.head(limit) if limit else grouped).reset_index(drop=True)[columns]


def _version_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Order version strings naturally: ``535.161.08 < 550.54.15``, ``9 < 10``."""
    parts = re.findall(r"\d+|[^\d.]+", text)
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def rate_ratio(r1: int, t1: float, r2: int, t2: float, confidence: float = 0.95
               ) -> tuple[float | None, float | None, float | None, float | None]:
    """Rate ratio of two Poisson counts with its exact interval and p-value.

    ``(r1 / t1) / (r2 / t2)``; the interval is the exact conditional one (Breslow & Day
    1987: given ``r1 + r2``, ``r1`` is binomial with ``p = t1 / (t1 + t2)`` under equal
    rates; Clopper-Pearson limits of ``p`` mapped to the ratio), the p-value the exact
    two-sided binomial test.

    Args:
        r1: Failures of the candidate.
        t1: Exposure of the candidate (any unit, the same for both: GPU-hours).
        r2: Failures of the baseline.
        t2: Exposure of the baseline.
        confidence: Interval level, in (0, 1).

    Returns:
        ``(ratio, lower, upper, p_value)``; all ``None`` without failures in either;
        ``ratio`` is ``None`` when the baseline has none, ``upper`` when unbounded.

    Raises:
        ValueError: An exposure that is not > 0.

    Examples:
        >>> ratio, lo, hi, p = rate_ratio(12, 1000.0, 10, 4000.0)
        >>> round(ratio, 1), lo > 1, p < 0.01
        (4.8, True, True)
    """
    if t1 <= 0 or t2 <= 0:
        raise ValueError(f"exposures must be > 0, got {t1!r} and {t2!r}")
    if r1 + r2 == 0:
        return None, None, None, None
    n = r1 + r2
    alpha = 1.0 - confidence
    p_lo = 0.0 if r1 == 0 else float(stats.beta.ppf(alpha / 2, r1, n - r1 + 1))
    p_hi = 1.0 if r1 == n else float(stats.beta.ppf(1 - alpha / 2, r1 + 1, n - r1))
    scale = t2 / t1
    lower = p_lo / (1 - p_lo) * scale
    upper = p_hi / (1 - p_hi) * scale if p_hi < 1 else None
    ratio = (r1 / t1) / (r2 / t2) if r2 else None
    p_value = float(stats.binomtest(r1, n, t1 / (t1 + t2)).pvalue)
    return ratio, lower, upper, p_value


def cohort_comparison(inventory: pd.DataFrame, incidents: pd.DataFrame, by: str,
                      window: Window, *, baseline: str | None = None,
                      candidate: str | None = None,
                      confidence: float = 0.90) -> dict[str, Any] | None:
    """Compare failure rates of two cohorts of ``by`` (``driver_version``, ``batch``...).

    The candidate is the version being rolled out: by default the cohort first seen most
    recently (on a tie, the highest version, compared naturally); the baseline is by
    default the cohort with the most exposure among the others.

    Returns:
        ``None`` when fewer than two cohorts have exposure; else ``by``, ``baseline``,
        ``candidate``, ``cohorts`` (per cohort: ``failures``, ``exposure_hours``,
        ``rate_per_million_hours`` and its exact interval, ``hours_per_failure``),
        ``rate_ratio`` (candidate / baseline), ``ratio_lower``, ``ratio_upper``,
        ``p_value`` (exact conditional binomial test), ``method`` and ``verdict`` (one
        sentence).
    """
    inv = inventory.assign(_hours=exposure_hours(inventory, window))
    inv = inv[inv[by].astype(str) != ""] if by in inv else inv.iloc[0:0]
    exposure = inv.groupby(by)["_hours"].sum()
    exposure = exposure[exposure > 0]
    if len(exposure) < 2:
        return None
    first_seen = pd.to_numeric(inv["first_seen_at"], errors="coerce").groupby(inv[by]).min()
    if candidate is None:
        seen = first_seen.reindex(exposure.index)
        newest = [str(name) for name, at in seen.items() if at == seen.max()]
        candidate = max(newest or [str(n) for n in exposure.index], key=_version_key)
    if baseline is None:
        others = exposure.drop(index=candidate, errors="ignore")
        baseline = str(others.idxmax())
    for name in (baseline, candidate):
        if name not in exposure.index:
            raise ValueError(f"cohort {name!r} has no exposure in the window; have "
                             f"{', '.join(map(str, exposure.index))}")
    in_window = incidents[(incidents["detected_at"] >= window.start)
                          & (incidents["detected_at"] < window.end)]
    failures = _incident_column(in_window, inventory, by).value_counts()
    cohorts: dict[str, dict[str, Any]] = {}
    for raw_name, hours in exposure.items():
        name = str(raw_name)
        count = int(failures.get(name, 0))
        lo, hi = poisson_rate_interval(count, float(hours) / 1e6, confidence)
        cohorts[name] = {
            "failures": count, "exposure_hours": float(hours),
            "rate_per_million_hours": count / float(hours) * 1e6,
            "rate_lower": lo, "rate_upper": hi,
            "hours_per_failure": float(hours) / count if count else None,
        }
    r1, t1 = cohorts[candidate]["failures"], cohorts[candidate]["exposure_hours"]
    r2, t2 = cohorts[baseline]["failures"], cohorts[baseline]["exposure_hours"]
    ratio, lower, upper, p_value = rate_ratio(r1, t1, r2, t2, confidence)
    level = round(confidence * 100)
    if lower is None:
        verdict = "no failures in either cohort: no comparison possible"
    elif lower > 1:
        verdict = (f"{candidate} fails more often than {baseline} "
                   f"({level}% interval of the rate ratio above 1)")
    elif upper is not None and upper < 1:
        verdict = (f"{candidate} fails less often than {baseline} "
                   f"({level}% interval of the rate ratio below 1)")
    else:
        verdict = (f"no significant difference between {candidate} and {baseline} "
                   f"({level}% interval of the rate ratio includes 1)")
    return {
        "by": by, "baseline": baseline, "candidate": candidate, "cohorts": cohorts,
        "rate_ratio": ratio, "ratio_lower": lower, "ratio_upper": upper, "p_value": p_value,
        "confidence": confidence,
        "method": "exact conditional binomial (Poisson rate ratio), Breslow & Day 1987",
        "verdict": verdict,
    }


def prediction_quality(predictions: pd.DataFrame, incidents: pd.DataFrame, window: Window,
                       *, threshold: float = 0.5) -> dict[str, Any]:
    """Score predictions against what happened.

    A prediction is *positive* when ``probability >= threshold``. A positive prediction is
    a hit when the same node (and entity, or any entity for a node-level prediction) has an
    incident detected in ``(at, at + horizon_seconds]``. An incident detected in the window
    is *caught* when a positive prediction for it came before it within its horizon, or
    when its ``predicted_at`` is set; its lead time is detection minus the earliest such
    prediction.

    Returns:
        ``predictions`` (positives made in the window), ``hits``, ``precision`` (hits /
        positives), ``incidents``, ``caught``, ``recall`` (caught / incidents),
        ``lead_time_median_hours``, ``lead_time_min_hours``, ``threshold``; ratios are
        ``None`` when their denominator is zero.
    """
    preds = predictions[(predictions["at"] >= window.start) & (predictions["at"] < window.end)
                        & (predictions["probability"] >= threshold)]
    occurred = incidents[(incidents["detected_at"] >= window.start)
                         & (incidents["detected_at"] < window.end)]
    all_positive = predictions[predictions["probability"] >= threshold]
    by_node: dict[str, list[tuple[float, str]]] = {}
    for node, entity, detected in zip(incidents["node"], incidents["entity"],
                                      incidents["detected_at"], strict=True):
        by_node.setdefault(str(node), []).append((float(detected), str(entity)))
    hits = 0
    for node, entity, at, horizon in zip(preds["node"], preds["entity"], preds["at"],
                                         preds["horizon_seconds"], strict=True):
        for detected, inc_entity in by_node.get(str(node), ()):
            if at < detected <= at + horizon and (entity in ("node", inc_entity)):
                hits += 1
                break
    pred_by_node: dict[str, list[tuple[float, float, str]]] = {}
    for node, entity, at, horizon in zip(all_positive["node"], all_positive["entity"],
                                         all_positive["at"], all_positive["horizon_seconds"],
                                         strict=True):
        pred_by_node.setdefault(str(node), []).append((float(at), float(horizon), str(entity)))
    leads: list[float] = []
    for node, entity, detected, predicted in zip(
            occurred["node"], occurred["entity"], occurred["detected_at"],
            occurred["predicted_at"], strict=True):
        earliest = [at for at, horizon, p_entity in pred_by_node.get(str(node), ())
                    if at < detected <= at + horizon and p_entity in ("node", entity)]
        if predicted is not None and not pd.isna(predicted) and float(predicted) < detected:
            earliest.append(float(predicted))
        if earliest:
            leads.append((float(detected) - min(earliest)) / HOUR)
    return {
        "predictions": len(preds), "hits": hits,
        "precision": hits / len(preds) if len(preds) else None,
        "incidents": len(occurred), "caught": len(leads),
        "recall": len(leads) / len(occurred) if len(occurred) else None,
        "lead_time_median_hours": float(np.median(leads)) if leads else None,
        "lead_time_min_hours": float(min(leads)) if leads else None,
        "threshold": threshold,
    }


def young_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Return Young's optimal checkpoint interval ``sqrt(2 C M)`` in seconds.

    Source: J. W. Young, "A first order approximation to the optimum checkpoint interval",
    CACM 17(9), 1974.

    Examples:
        >>> young_interval(300.0, 86400.0)
        7200.0
    """
    if checkpoint_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError("checkpoint cost and MTBF must be > 0 seconds")
    return math.sqrt(2.0 * checkpoint_seconds * mtbf_seconds)


def daly_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Return Daly's higher-order optimal checkpoint interval in seconds.

    ``sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C`` when ``C < 2M``, else
    ``M``. Source: J. T. Daly, "A higher order estimate of the optimum checkpoint interval
    for restart dumps", Future Generation Computer Systems 22(3), 2006, eq. (37).

    Examples:
        >>> round(daly_interval(300.0, 86400.0), 2)
        7001.39
    """
    if checkpoint_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError("checkpoint cost and MTBF must be > 0 seconds")
    c, m = checkpoint_seconds, mtbf_seconds
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def checkpoint_table(node_mtbf_hours: float | None, job_sizes: Sequence[int],
                     checkpoint_seconds: float) -> list[dict[str, Any]]:
    """Return the recommended checkpoint interval per job size.

    Args:
        node_mtbf_hours: The measured MTBF of one node (hours); ``None`` gives no rows.
        job_sizes: Job sizes in nodes (each >= 1).
        checkpoint_seconds: Time to write one checkpoint (s, > 0).

    Returns:
        Per size: ``nodes``, ``job_mtbf_hours`` (node MTBF / nodes),
        ``checkpoint_seconds``, ``young_minutes``, ``daly_minutes``.
    """
    if node_mtbf_hours is None or node_mtbf_hours <= 0:
        return []
    rows = []
    for nodes in job_sizes:
        if nodes < 1:
            raise ValueError(f"job size must be >= 1 node, got {nodes}")
        job_mtbf = node_mtbf_hours * HOUR / nodes
        rows.append({
            "nodes": nodes, "job_mtbf_hours": job_mtbf / HOUR,
            "checkpoint_seconds": checkpoint_seconds,
            "young_minutes": young_interval(checkpoint_seconds, job_mtbf) / 60.0,
            "daly_minutes": daly_interval(checkpoint_seconds, job_mtbf) / 60.0,
        })
    return rows


def spare_capacity(avail: Mapping[str, Any], peak_out: int, units: int,
                   spare_fraction: float) -> dict[str, Any]:
    """Say whether failure-driven unavailability fits the spare capacity.

    Args:
        avail: :func:`availability`'s result.
        peak_out: :func:`peak_concurrent_out`'s result.
        units: Entities in the fleet (> 0 for a verdict).
        spare_fraction: Spare capacity as a fraction of the fleet (0-1; 0.15-0.20 usual).

    Returns:
        ``spare_fraction``, ``mean_unavailable_fraction`` (lost / exposure),
        ``peak_unavailable_fraction`` (peak out / units), ``fits`` (peak within spare;
        ``None`` without data) and ``headroom_fraction`` (spare minus peak).
    """
    if not 0.0 <= spare_fraction <= 1.0:
        raise ValueError(f"spare_fraction must be within 0-1, got {spare_fraction}")
    exposure = float(avail.get("exposure_hours") or 0.0)
    mean = float(avail["lost_hours"]) / exposure if exposure > 0 else None
    peak = peak_out / units if units > 0 else None
    return {
        "spare_fraction": spare_fraction, "mean_unavailable_fraction": mean,
        "peak_unavailable_fraction": peak, "peak_out": peak_out, "units": units,
        "fits": None if peak is None else peak <= spare_fraction,
        "headroom_fraction": None if peak is None else spare_fraction - peak,
    }


def week_over_week(current: Mapping[str, Any], previous: Mapping[str, Any],
                   keys: Iterable[str]) -> list[dict[str, Any]]:
    """Return the change of each figure from the previous window to this one.

    Returns:
        Per key: ``figure``, ``previous``, ``current``, ``change`` (difference) and
        ``change_ratio`` (relative change; ``None`` when undefined).
    """
    rows = []
    for key in keys:
        now, before = current.get(key), previous.get(key)
        change = None if now is None or before is None else float(now) - float(before)
        ratio = None if change is None or not before else change / abs(float(before))
        rows.append({"figure": key, "previous": before, "current": now, "change": change,
                     "change_ratio": ratio})
    return rows
