"""GPU survival on Titan: a Cox model that ranks GPUs and slots by risk, and repeat-failure slots.

Data: the OLCF Titan GPU lifetimes (``gc_full.csv`` of https://github.com/olcf/TitanGPULife;
Ostrouchov et al., "GPU Lifetimes on Titan Supercomputer: Survival Analysis and Reliability",
SC20, doi:10.1109/SC41405.2020.00045): one row per residency of a GPU serial (``SN``) in a
location (Cray cname ``c<col>-<row>c<cage>s<slot>n<node>``), with ``insert``/``remove`` times and
the failure at removal (``DBE`` double-bit ECC error, ``OTB`` off the bus, empty = none). Rows
with an empty ``insert`` are extra failure records of a GPU (a second event at the same removal,
or one logged a few days before it); they count as failures of that GPU at their time.

Evaluation follows a **landmark time split** (van Houwelingen, "Dynamic prediction by
landmarking in event history analysis", Scand. J. Stat. 2007): at a landmark ``at`` the subjects
are the GPUs in service, each with covariates computed only from rows that ended at or before
``at`` (plus its location and serial, known at install), and the outcome is the first failure of
that GPU after ``at`` (censored at its last removal or at the end of follow-up). The model is fit
on landmarks before the split with follow-up cut at the split, and tested on the landmark at the
split over what happened after it, scored by Harrell's concordance index.

Covariates (all known on the landmark date):

* location: cabinet column and row, cage, slot and node (one-hot);
* batch: the serial-number prefix (first five digits; rare prefixes pooled as ``other``);
* ``age_years``: time since the serial was first installed;
* ``slot_days``: time the GPU has spent in its current location;
* ``slot_failures``, ``slot_gpus``: failures and GPUs removed at this location before ``at``;
* ``gpu_failures``: earlier failures of this serial;
* ``cabinet_failures``: failures in the same cabinet before ``at``.

Repeat-failure slots: a one-sided Poisson test per location of the number of distinct GPUs that
failed there before the split against the fleet rate times the location's GPU-years of exposure,
flagged at ``p <= 1e-3`` (a screening threshold; Benjamini-Hochberg q-values are reported too).
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd
from scipy import stats  # type: ignore[import-untyped,unused-ignore]
from sksurv.linear_model import (  # type: ignore[import-untyped,unused-ignore]
    CoxPHSurvivalAnalysis,
)
from sksurv.metrics import (  # type: ignore[import-untyped,unused-ignore]
    concordance_index_censored,
)

LOCATION_RE = re.compile(r"^c(\d+)-(\d+)c(\d+)s(\d+)n(\d+)$")
"""Cray XK7 cname of a node: cabinet column, cabinet row, cage (chassis), slot (blade), node."""

LOCATION_PARTS: tuple[str, ...] = ("col", "row", "cage", "slot", "node")
NUMERIC_FEATURES: tuple[str, ...] = (
    "age_years",
    "slot_days",
    "slot_failures",
    "slot_gpus",
    "gpu_failures",
    "cabinet_failures",
)
"""Non-location covariates of the full model, all computed from data before the landmark."""

SPLIT = pd.Timestamp("2017-01-01")
"""Split date of issue 5: fit on history before it, test on GPUs in service on it."""

TRAIN_LANDMARKS: tuple[pd.Timestamp, ...] = tuple(
    pd.Timestamp(t) for t in ("2015-01-01", "2015-07-01", "2016-01-01", "2016-07-01")
)
"""Landmarks of the training set (follow-up of each is cut at :data:`SPLIT`)."""

_SECONDS_PER_YEAR = 365.25 * 86_400.0
_REQUIRED = ("SN", "location", "insert", "remove", "event")
FloatArray = npt.NDArray[np.float64]


def parse_location(text: str) -> tuple[int, int, int, int, int]:
    """Split a Cray cname into ``(col, row, cage, slot, node)``.

    Raises:
        ValueError: ``text`` is not a node cname.

    Examples:
        >>> parse_location("c11-2c1s4n1")
        (11, 2, 1, 4, 1)
    """
    match = LOCATION_RE.match(text)
    if match is None:
        raise ValueError(f"not a Cray node cname (c<col>-<row>c<cage>s<slot>n<node>): {text!r}")
    col, row, cage, slot, node = (int(g) for g in match.groups())
    return col, row, cage, slot, node


def load_intervals(path: Path) -> pd.DataFrame:
    """Read ``gc_full.csv`` into a residency table.

    Returns:
        One row per CSV row: ``SN`` (str), ``location`` (str), ``insert`` and ``remove``
        (``datetime64``; ``insert`` is NaT for extra failure records), ``failed`` (bool),
        ``event`` (``DBE``, ``OTB`` or ``""``) and the location parts ``col``, ``row``,
        ``cage``, ``slot``, ``node`` (int).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: A required column is missing, or a row has a bad location, time or event
            (the message names the file and line).
    """
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in _REQUIRED if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing columns {missing} (need {list(_REQUIRED)})")
        rows: list[tuple[Any, ...]] = []
        for line, rec in enumerate(reader, start=2):
            event = rec["event"] or ""
            if event not in ("", "DBE", "OTB"):
                raise ValueError(f"{path}:{line}: unknown event {event!r} (DBE, OTB or empty)")
            try:
                parts = parse_location(rec["location"])
                insert = pd.Timestamp(rec["insert"]) if rec["insert"] else pd.NaT
                remove = pd.Timestamp(rec["remove"])
            except ValueError as exc:
                raise ValueError(f"{path}:{line}: {exc}") from exc
            if not rec["remove"] or pd.isna(remove):
                raise ValueError(f"{path}:{line}: empty remove time")
            if not pd.isna(insert) and insert > remove:
                raise ValueError(f"{path}:{line}: insert {insert} after remove {remove}")
            rows.append((rec["SN"], rec["location"], insert, remove, event != "", event, *parts))
    if not rows:
        raise ValueError(f"{path}: no rows")
    frame = pd.DataFrame(
        rows,
        columns=["SN", "location", "insert", "remove", "failed", "event", *LOCATION_PARTS],
    )
    frame["insert"] = pd.to_datetime(frame["insert"])
    frame["remove"] = pd.to_datetime(frame["remove"])
    return frame


def _years(delta: pd.Series) -> pd.Series:
    years: pd.Series = delta.dt.total_seconds() / _SECONDS_PER_YEAR
    return years


def landmark_table(
    intervals: pd.DataFrame, at: pd.Timestamp, end: pd.Timestamp
) -> pd.DataFrame:
    """Subjects in service at ``at``, covariates from before ``at``, outcome over ``(at, end]``.

    Args:
        intervals: Output of :func:`load_intervals`.
        at: Landmark; a GPU is in service if one of its residencies has ``insert <= at <
            remove``.
        end: End of follow-up (> ``at``): later events are not seen.

    Returns:
        One row per GPU in service: ``SN``, ``location``, location parts, ``prefix``,
        :data:`NUMERIC_FEATURES`, ``time`` (days from ``at`` to the first failure record of
        the serial after ``at``, else to its last removal or ``end``, > 0) and ``event`` (bool).
        Every covariate reads only rows whose ``remove`` is ``<= at`` (or the install times of
        the serial, which are ``<= at``).

    Raises:
        ValueError: ``end <= at``.
    """
    if end <= at:
        raise ValueError(f"end of follow-up {end} must be after the landmark {at}")
    known = intervals[intervals["insert"].notna()]
    live = known[(known["insert"] <= at) & (known["remove"] > at)]
    live = live.sort_values("insert").drop_duplicates("SN", keep="last").copy()
    past = intervals[intervals["remove"] <= at]
    past_fail = past[past["failed"]].drop_duplicates(["location", "remove"])
    first_seen = known[known["insert"] <= at].groupby("SN")["insert"].min()

    live["prefix"] = live["SN"].str[:5]
    live["age_years"] = _years(at - live["SN"].map(first_seen))
    live["slot_days"] = (at - live["insert"]).dt.total_seconds() / 86_400.0
    live["slot_failures"] = live["location"].map(past_fail.groupby("location").size())
    live["slot_gpus"] = live["location"].map(past.groupby("location")["SN"].nunique())
    live["gpu_failures"] = live["SN"].map(
        past[past["failed"]].drop_duplicates(["SN", "remove"]).groupby("SN").size()
    )
    cabinet = past_fail.groupby(["col", "row"]).size()
    keys = list(zip(live["col"], live["row"], strict=True))
    live["cabinet_failures"] = [float(cabinet.get(k, 0)) for k in keys]
    for name in ("slot_failures", "slot_gpus", "gpu_failures"):
        live[name] = live[name].fillna(0.0).astype(float)

    future = intervals[(intervals["remove"] > at) & intervals["SN"].isin(live["SN"])]
    first_failure = future[future["failed"]].groupby("SN")["remove"].min()
    last_seen = future.groupby("SN")["remove"].max()
    fail_at = pd.Series(first_failure.reindex(live["SN"]).to_numpy(), index=live.index,
                        dtype=intervals["remove"].dtype)
    stop_at = pd.Series(last_seen.reindex(live["SN"]).to_numpy(), index=live.index,
                        dtype=intervals["remove"].dtype)
    stop_at = stop_at.where(stop_at <= end, end)
    event = fail_at.notna() & (fail_at <= stop_at)
    until = fail_at.where(event, stop_at)
    live["time"] = (until - at).dt.total_seconds() / 86_400.0
    live["event"] = event.astype(bool)
    live["landmark"] = at
    return live.reset_index(drop=True)


@dataclass(frozen=True, slots=True)
class CoxModel:
    """A fitted Cox proportional-hazards model and its design.

    Attributes:
        model: The fitted scikit-survival estimator (ridge penalty ``alpha``).
        numeric: Numeric covariates, standardised with the training mean and deviation.
        categorical: Categorical covariates, one-hot with the training levels.
        columns: Design columns in fit order.
        mean, scale: Standardisation of ``numeric``.
        prefixes: Serial prefixes kept as their own level (others pooled as ``other``).
    """

    model: CoxPHSurvivalAnalysis
    numeric: tuple[str, ...]
    categorical: tuple[str, ...]
    columns: tuple[str, ...]
    mean: FloatArray
    scale: FloatArray
    prefixes: frozenset[str]

    def design(self, table: pd.DataFrame) -> pd.DataFrame:
        """The design matrix of ``table`` (rows aligned), shape ``(n, len(columns))``."""
        return _design(table, self.numeric, self.categorical, self.prefixes, self.mean,
                       self.scale).reindex(columns=list(self.columns), fill_value=0.0)

    def risk(self, table: pd.DataFrame) -> FloatArray:
        """Log partial hazard of each row of ``table``, shape ``(n,)`` (higher: fails sooner)."""
        return np.asarray(self.model.predict(self.design(table)), dtype=np.float64)

    def coefficients(self) -> dict[str, float]:
        """Coefficient per design column (log hazard ratio per unit, or per SD if numeric)."""
        return dict(zip(self.columns, (float(c) for c in self.model.coef_), strict=True))


def _design(
    table: pd.DataFrame,
    numeric: Sequence[str],
    categorical: Sequence[str],
    prefixes: frozenset[str],
    mean: FloatArray,
    scale: FloatArray,
) -> pd.DataFrame:
    parts = []
    if numeric:
        values = (table[list(numeric)].to_numpy(dtype=np.float64) - mean) / scale
        parts.append(pd.DataFrame(values, columns=list(numeric), index=table.index))
    for name in categorical:
        column = table[name].astype(str)
        if name == "prefix":
            column = column.where(column.isin(prefixes), "other")
        parts.append(pd.get_dummies(column, prefix=name, dtype=np.float64))
    return pd.concat(parts, axis=1)


def fit_cox(
    table: pd.DataFrame,
    *,
    numeric: Sequence[str] = (),
    categorical: Sequence[str] = (),
    alpha: float = 1.0,
    min_prefix_gpus: int = 100,
) -> CoxModel:
    """Fit a ridge-penalised Cox model (Breslow ties) on a landmark table.

    Args:
        table: Rows of :func:`landmark_table` (several landmarks may be stacked).
        numeric: Numeric covariates (standardised).
        categorical: Categorical covariates (one-hot; ``prefix`` pools rare prefixes).
        alpha: Ridge penalty of scikit-survival's ``CoxPHSurvivalAnalysis``; >= 0.
        min_prefix_gpus: Training rows a serial prefix needs to keep its own level.

    Raises:
        ValueError: No covariate, no event in ``table``, or ``alpha < 0``.
    """
    if not numeric and not categorical:
        raise ValueError("fit_cox needs at least one covariate")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha!r}")
    if not bool(table["event"].any()):
        raise ValueError("the training table has no failure: nothing to fit")
    counts = table["prefix"].value_counts() if "prefix" in table else pd.Series(dtype=int)
    prefixes = frozenset(str(p) for p, n in counts.items() if n >= min_prefix_gpus)
    values = table[list(numeric)].to_numpy(dtype=np.float64) if numeric else np.zeros((0, 0))
    mean = values.mean(axis=0) if numeric else np.zeros(0)
    scale = values.std(axis=0) if numeric else np.ones(0)
    scale = np.where(scale > 0, scale, 1.0)
    x = _design(table, numeric, categorical, prefixes, mean, scale)
    y = np.array(
        list(zip(table["event"].astype(bool), table["time"].astype(float), strict=True)),
        dtype=[("event", bool), ("time", float)],
    )
    model = CoxPHSurvivalAnalysis(alpha=alpha).fit(x, y)
    return CoxModel(model, tuple(numeric), tuple(categorical), tuple(x.columns), mean, scale,
                    prefixes)


def concordance(model: CoxModel, table: pd.DataFrame) -> float:
    """Harrell's concordance index of ``model``'s risk on ``table`` (0.5 = chance, 1 = perfect).

    Raises:
        ValueError: ``table`` has no event (the index is undefined).
    """
    if not bool(table["event"].any()):
        raise ValueError("concordance needs at least one event in the test table")
    result = concordance_index_censored(
        table["event"].to_numpy(dtype=bool), table["time"].to_numpy(dtype=float),
        model.risk(table),
    )
    return float(result[0])


def repeat_failure_slots(
    intervals: pd.DataFrame, before: pd.Timestamp, *, p_threshold: float = 1e-3
) -> pd.DataFrame:
    """Locations whose successive GPUs failed more often than chance, up to ``before``.

    Each location's failures (distinct serials that failed there, ``remove <= before``: a GPU
    re-seated and failing again in the same slot, or a storm of records of one failure, counts
    once) are tested against a Poisson count with mean ``fleet rate x the location's GPU-years``
    (time its residencies spent in it before ``before``), one-sided. A location is flagged when
    ``p_value <= p_threshold``: a screening threshold, so about ``p_threshold x locations`` are
    expected by chance alone (the caller prints that figure); ``q_value`` is the
    Benjamini-Hochberg adjusted p-value (Benjamini & Hochberg, JRSS B 1995) for a
    false-discovery-controlled reading.

    Returns:
        The flagged locations, most significant first: ``location``, ``failures``,
        ``gpu_years``, ``expected``, ``p_value``, ``q_value``; ``attrs["tested"]`` holds the
        number of locations tested.

    Raises:
        ValueError: ``p_threshold`` not in (0, 1), or no exposure before ``before``.
    """
    if not 0.0 < p_threshold < 1.0:
        raise ValueError(f"p_threshold must be in (0, 1), got {p_threshold!r}")
    known = intervals[intervals["insert"].notna() & (intervals["insert"] < before)]
    stop = known["remove"].where(known["remove"] <= before, before)
    exposure = _years(stop - known["insert"]).groupby(known["location"]).sum()
    total = float(exposure.sum())
    if total <= 0:
        raise ValueError(f"no GPU-years before {before}")
    fails = intervals[intervals["failed"] & (intervals["remove"] <= before)]
    counts = fails.drop_duplicates(["location", "SN"]).groupby("location").size()
    counts = counts.reindex(exposure.index, fill_value=0)
    rate = float(counts.sum()) / total
    expected = exposure * rate
    p = stats.poisson.sf(counts.to_numpy() - 1, expected.to_numpy())
    order = np.argsort(p)
    m = len(p)
    ranked = p[order] * m / np.arange(1, m + 1)
    q_sorted = np.minimum.accumulate(ranked[::-1])[::-1]
    q = np.empty(m)
    q[order] = np.minimum(q_sorted, 1.0)
    out = pd.DataFrame({
        "location": exposure.index,
        "failures": counts.to_numpy(),
        "gpu_years": exposure.to_numpy(),
        "expected": expected.to_numpy(),
        "p_value": p,
        "q_value": q,
    })
    flagged = out[out["p_value"] <= p_threshold].sort_values("p_value").reset_index(drop=True)
    flagged.attrs["tested"] = m
    return flagged


def data_dir(explicit: str | Path | None = None) -> Path:
    """The Titan folder.

    ``explicit``, else ``$GPUHEALTH_TEST_DATA/titan-gpu-lifetimes``, else
    ``../shared/data/titan-gpu-lifetimes`` relative to the repository.
    """
    if explicit:
        return Path(explicit)
    env = os.environ.get("GPUHEALTH_TEST_DATA")
    if env:
        return Path(env) / "titan-gpu-lifetimes"
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "titan-gpu-lifetimes"


def evaluate_titan(
    data_dir: str | Path,
    *,
    split: pd.Timestamp = SPLIT,
    landmarks: Sequence[pd.Timestamp] = TRAIN_LANDMARKS,
    alpha: float = 1.0,
    p_threshold: float = 1e-3,
    intervals: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """Fit on history before ``split``, test on GPUs in service at ``split`` (issue 5).

    Args:
        data_dir: Folder holding ``gc_full.csv``.
        split: The split date; every landmark must be before it.
        landmarks: Training landmarks (follow-up of each cut at ``split``).
        alpha: Ridge penalty of both Cox models (fixed, never tuned on the test period).
        p_threshold: Screening threshold of the repeat-failure slot test.
        intervals: ``load_intervals(data_dir / "gc_full.csv")`` when the caller has it already.

    Returns:
        A dict: ``concordance`` (full model), ``baseline_concordance`` (location only),
        ``goal_concordance`` (0.70), ``goal_margin`` (0.05), ``met`` (bool), train/test sizes
        and events, ``top_slots`` (the 10 locations of highest predicted risk at the split),
        ``repeat_slots`` (records of :func:`repeat_failure_slots` before the split, each with
        ``failed_after``) and the fraction of other locations with a failure after the split.

    Raises:
        FileNotFoundError: No ``gc_full.csv`` in ``data_dir``.
        ValueError: A landmark is not before ``split``, or the data are malformed.
    """
    if any(at >= split for at in landmarks):
        raise ValueError(f"every training landmark must be before the split {split}")
    if intervals is None:
        intervals = load_intervals(Path(data_dir) / "gc_full.csv")
    end = intervals["remove"].max()
    train = pd.concat([landmark_table(intervals, at, split) for at in landmarks],
                      ignore_index=True)
    test = landmark_table(intervals, split, end)
    location = list(LOCATION_PARTS)
    baseline = fit_cox(train, categorical=location, alpha=alpha)
    full = fit_cox(train, numeric=NUMERIC_FEATURES, categorical=[*location, "prefix"],
                   alpha=alpha)
    c_full = concordance(full, test)
    c_base = concordance(baseline, test)

    test = test.assign(risk=full.risk(test))
    top = (test.groupby("location")["risk"].max().sort_values(ascending=False).head(10))
    repeat = repeat_failure_slots(intervals, split, p_threshold=p_threshold)
    after = intervals[intervals["failed"] & (intervals["remove"] > split)]
    failed_after = set(after["location"])
    all_locations = set(intervals["location"])
    repeat_set = set(repeat["location"])
    others = all_locations - repeat_set
    repeat_records = [
        {**{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()},
         "failed_after": row["location"] in failed_after}
        for row in repeat.to_dict("records")
    ]
    return {
        "split": str(split.date()),
        "train_rows": len(train),
        "train_events": int(train["event"].sum()),
        "test_gpus": len(test),
        "test_events": int(test["event"].sum()),
        "concordance": c_full,
        "baseline_concordance": c_base,
        "goal_concordance": 0.70,
        "goal_margin": 0.05,
        "met": c_full >= 0.70 and c_full - c_base >= 0.05,
        "coefficients": full.coefficients(),
        "top_slots": [(str(k), float(v)) for k, v in top.items()],
        "repeat_slots": repeat_records,
        "repeat_failed_after": sum(r["failed_after"] for r in repeat_records),
        "repeat_tested": int(repeat.attrs["tested"]),
        "repeat_expected_by_chance": p_threshold * int(repeat.attrs["tested"]),
        "repeat_p_threshold": p_threshold,
        "other_failed_after_fraction": (
            len(others & failed_after) / len(others) if others else float("nan")
        ),
    }


def render(result: dict[str, Any]) -> str:
    """The printed report of :func:`analytics.survival.evaluate_titan`'s result."""
    c, base = result["concordance"], result["baseline_concordance"]
    goal, margin = result["goal_concordance"], result["goal_margin"]
    lines = [
        f"Titan GPU survival, split {result['split']}: train {result['train_rows']} "
        f"GPU-landmarks ({result['train_events']} failures), test {result['test_gpus']} GPUs "
        f"in service ({result['test_events']} failed after the split)",
        "",
        f"{'model':<52} {'concordance':>11}",
        f"{'Cox, location + batch + age + past events':<52} {c:>11.3f}",
        f"{'baseline Cox, location alone':<52} {base:>11.3f}",
        "",
        f"goal concordance >= {goal:.2f}: {'met' if c >= goal else 'NOT met'} ({c:.3f})",
        f"goal >= {margin:.2f} above baseline: "
        f"{'met' if c - base >= margin else 'NOT met'} (+{c - base:.3f})",
        "",
        "highest-risk locations at the split (log partial hazard):",
    ]
    lines += [f"  {loc:<16} {risk:6.2f}" for loc, risk in result["top_slots"]]
    repeat = result["repeat_slots"]
    lines += [
        "",
        f"repeat-failure slots before the split (one-sided Poisson on distinct failed GPUs vs "
        f"the fleet rate, p <= {result['repeat_p_threshold']:g}; {result['repeat_tested']} "
        f"locations tested, {result['repeat_expected_by_chance']:.1f} expected by chance):",
    ]
    lines += [
        f"  {r['location']:<16} failed GPUs {r['failures']:3d}  expected {r['expected']:.3f}  "
        f"p {r['p_value']:.2e}  BH q {r['q_value']:.2f}  failed again after: "
        f"{'yes' if r['failed_after'] else 'no'}"
        for r in repeat
    ]
    lines.append(
        f"  {len(repeat)} flagged, {result['repeat_failed_after']} failed again after the split "
        f"(other locations: {100 * result['other_failed_after_fraction']:.1f} % had a failure "
        "after the split)"
    )
    return "\n".join(lines) + "\n"
