"""Numenta Anomaly Benchmark (NAB) scorer, re-implemented from its published rules.

Sources: Lavin & Ahmad, "Evaluating Real-time Anomaly Detection Algorithms -- the
Numenta Anomaly Benchmark", ICMLA 2015; Ahmad et al., Neurocomputing 2017
(doi:10.1016/j.neucom.2017.04.070); and the rules of numenta/NAB's ``nab/sweeper.py``
(NAB v1.1), re-implemented here with numpy:

* the first ``min(floor(0.15 n), 750)`` rows of each file are probationary and never scored;
* a row inside a labelled window is worth ``tp_weight * sigma(p) / sigma(-1)`` where
  ``p = -(right - i + 1) / width`` and ``sigma(p) = 2 / (1 + exp(5 p)) - 1``; only the
  earliest detection in a window counts, a missed window costs ``fn_weight``;
* a detection outside every window costs ``fp_weight * sigma(|i - right_prev| / (width_prev - 1))``
  (``-fp_weight`` before the first window or three window-widths after one);
* the threshold is swept over every distinct anomaly score of the whole corpus and the best
  total is kept (detection means ``score >= threshold``);
* the total is normalised so the null detector scores 0 and the perfect one 100.

The data folder layout is NAB's: ``data/<folder>/<file>.csv``, ``labels/combined_windows.json``,
``config/profiles.json``, ``results/<detector>/<folder>/<detector>_<file>.csv``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pandas as pd

from analytics.thresholds import (
    DspotDetector,
    EwmaZScoreDetector,
    QuantileThresholdDetector,
    SpotDetector,
)
from analytics.windowing import SeriesBatch, SeriesKey, VectorDetector
from core.records import EntityId, NodeName

logger = logging.getLogger(__name__)

PROBATION_FRACTION = 0.15
"""Fraction of each file (capped at 750 rows) that is never scored."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class NabProfile:
    """One NAB application profile (a cost matrix).

    Attributes:
        name: ``standard``, ``reward_low_FP_rate`` or ``reward_low_FN_rate``.
        tp_weight: Reward of an on-time detection, A_TP.
        fp_weight: Cost of a false positive, |A_FP| (positive).
        fn_weight: Cost of a missed window, |A_FN| (positive).
    """

    name: str
    tp_weight: float
    fp_weight: float
    fn_weight: float


PROFILES: tuple[NabProfile, ...] = (
    NabProfile(name="standard", tp_weight=1.0, fp_weight=0.11, fn_weight=1.0),
    NabProfile(name="reward_low_FP_rate", tp_weight=1.0, fp_weight=0.22, fn_weight=1.0),
    NabProfile(name="reward_low_FN_rate", tp_weight=1.0, fp_weight=0.11, fn_weight=2.0),
)
"""NAB's three profiles (``config/profiles.json``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NabFile:
    """One NAB data file and its labelled windows.

    Attributes:
        key: Path relative to ``data/``, e.g. ``realKnownCause/nyc_taxi.csv``.
        timestamps: Row times, shape ``(n,)``, ``datetime64[ns]``.
        values: Row values, shape ``(n,)``.
        windows: Labelled windows as inclusive ``(first_row, last_row)`` index pairs.
    """

    key: str
    timestamps: npt.NDArray[np.datetime64]
    values: FloatArray
    windows: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class NabScore:
    """A detector's NAB result for one profile.

    Attributes:
        profile: Profile name.
        threshold: Anomaly-score threshold the sweep chose (detection is ``score >= threshold``).
        raw: Total raw score over the corpus.
        normalised: ``100 (raw - null) / (perfect - null)``; 0 is the null detector, 100 perfect.
        tp: Rows detected inside windows (NAB counts rows, not windows).
        fp: Rows detected outside windows.
        fn: Rows inside windows not detected.
    """

    profile: str
    threshold: float
    raw: float
    normalised: float
    tp: int
    fp: int
    fn: int


def scaled_sigmoid(position: FloatArray) -> FloatArray:
    """NAB's scaled sigmoid of a relative position: ``2 / (1 + exp(5 p)) - 1``, -1 from p >= 3.

    Args:
        position: Relative positions; -1 is a window's left edge, 0 its right edge.

    Returns:
        Values in [-1, 1], same shape.

    Examples:
        >>> [round(float(v), 5) for v in scaled_sigmoid(np.array([-1.0, 0.0, 3.0]))]
        [0.98661, 0.0, -1.0]
    """
    with np.errstate(over="ignore"):
        value = 2.0 / (1.0 + np.exp(5.0 * position)) - 1.0
    return np.where(position >= 3.0, -1.0, value)


def probation_length(rows: int, fraction: float = PROBATION_FRACTION) -> int:
    """Rows at the start of a file that are never scored: ``min(floor(f n), f 5000)``.

    Examples:
        >>> probation_length(4032), probation_length(22695)
        (604, 750)
    """
    return int(min(math.floor(fraction * rows), fraction * 5000))


def sweep_scores(
    rows: int, windows: Sequence[tuple[int, int]], profile: NabProfile
) -> tuple[FloatArray, IntArray]:
    """Per-row score contribution if that row were a detection, and its window.

    Args:
        rows: Rows in the file.
        windows: Inclusive ``(first_row, last_row)`` pairs, sorted, not overlapping.
        profile: Cost matrix.

    Returns:
        ``(sweep, window)``: shape ``(rows,)`` each. ``window`` is the window index within
        the file, ``-1`` outside windows and ``-2`` in the probationary period.
    """
    index = np.arange(rows, dtype=np.float64)
    sweep = np.empty(rows, dtype=np.float64)
    window = np.full(rows, -1, dtype=np.int64)
    max_tp = float(scaled_sigmoid(np.array([-1.0]))[0])
    # Before the first window: a flat false positive.
    first = windows[0][0] if windows else rows
    sweep[:first] = -profile.fp_weight
    for k, (left, right) in enumerate(windows):
        width = float(right - left + 1)
        inside = index[left : right + 1]
        sweep[left : right + 1] = (
            scaled_sigmoid(-(right - inside + 1.0) / width) * profile.tp_weight / max_tp
        )
        window[left : right + 1] = k
        stop = windows[k + 1][0] if k + 1 < len(windows) else rows
        after = index[right + 1 : stop]
        with np.errstate(divide="ignore", invalid="ignore"):
            position = np.abs(right - after) / (width - 1.0)
        sweep[right + 1 : stop] = scaled_sigmoid(np.nan_to_num(position, nan=3.0)) * (
            profile.fp_weight
        )
    window[: probation_length(rows)] = -2
    return sweep, window


def threshold_sweep(
    parts: Iterable[tuple[FloatArray, FloatArray, IntArray]], profile: NabProfile
) -> tuple[FloatArray, FloatArray, IntArray, IntArray]:
    """Score every threshold at once over a corpus.

    Args:
        parts: Per file ``(anomaly_scores, sweep, window)`` as from :func:`sweep_scores`.
        profile: Cost matrix (only ``fn_weight`` is read here; the sweep carries the rest).

    Returns:
        ``(thresholds, raw, tp, fp)``: thresholds in decreasing order starting with 1.1
        (nothing detected), the raw corpus score at each, and the detected row counts.
    """
    scores_l, sweep_l, wid_l = [], [], []
    offset = 0
    for scores, sweep, window in parts:
        keep = window != -2
        scores_l.append(np.asarray(scores, dtype=np.float64)[keep])
        sweep_l.append(sweep[keep])
        wid = window[keep]
        wid_l.append(np.where(wid >= 0, wid + offset, -1))
        offset += int(window.max(initial=-1)) + 1
    scores = np.concatenate(scores_l) if scores_l else np.empty(0)
    sweep = np.concatenate(sweep_l) if sweep_l else np.empty(0)
    wid = np.concatenate(wid_l) if wid_l else np.empty(0, dtype=np.int64)
    windows_seen = np.unique(wid[wid >= 0]).size
    order = np.argsort(-scores, kind="stable")
    scores, sweep, wid = scores[order], sweep[order], wid[order]
    in_window = wid >= 0
    gain = np.where(in_window, 0.0, sweep)
    if in_window.any():
        frame = pd.DataFrame({"w": wid[in_window], "s": sweep[in_window]})
        best = frame.groupby("w")["s"].cummax().to_numpy()
        previous = frame.assign(b=best).groupby("w")["b"].shift(1).to_numpy()
        previous = np.where(np.isnan(previous), -profile.fn_weight, previous)
        gain[in_window] = np.maximum(best, -profile.fn_weight) - np.maximum(
            previous, -profile.fn_weight
        )
    total = -windows_seen * profile.fn_weight + np.cumsum(gain)
    tp = np.cumsum(in_window)
    fp = np.cumsum(~in_window)
    # A threshold includes every row scoring at least that much: keep each tie group's last row.
    last = np.r_[scores[1:] != scores[:-1], True] if scores.size else np.empty(0, dtype=bool)
    thresholds = np.r_[1.1, scores[last]]
    raw = np.r_[-windows_seen * profile.fn_weight, total[last]]
    return thresholds, raw, np.r_[0, tp[last]], np.r_[0, fp[last]]


def normalise(raw: float, profile: NabProfile, windows: int) -> float:
    """Normalise a raw corpus score: null detector 0, perfect detector 100.

    Examples:
        >>> round(normalise(-24.0131054891, PROFILES[0], 116), 2)
        39.65
    """
    null = -windows * profile.fn_weight
    perfect = windows * profile.tp_weight
    return 100.0 * (raw - null) / (perfect - null)


def score_corpus(
    files: Sequence[NabFile],
    anomaly_scores: Mapping[str, FloatArray],
    profiles: Sequence[NabProfile] = PROFILES,
) -> dict[str, NabScore]:
    """Score a detector on a NAB corpus with NAB's threshold sweep, for each profile.

    Args:
        files: The corpus (or a slice of it).
        anomaly_scores: Per file key, the detector's anomaly score for every row, shape ``(n,)``,
            in [0, 1] by NAB's convention (any real values work).
        profiles: Profiles to score.

    Returns:
        Per profile name, the best-threshold :class:`NabScore`.

    Raises:
        ValueError: A file has no scores or the wrong number of them, or no file has a window.
    """
    windows = sum(len(f.windows) for f in files)
    if windows == 0:
        raise ValueError("no labelled windows in these files: NAB cannot normalise the score")
    out: dict[str, NabScore] = {}
    for profile in profiles:
        parts = []
        for f in files:
            scores = np.asarray(anomaly_scores.get(f.key, np.empty(0)), dtype=np.float64)
            if scores.shape != f.values.shape:
                raise ValueError(
                    f"{f.key}: {scores.shape[0]} anomaly scores for {f.values.shape[0]} rows"
                )
            sweep, window = sweep_scores(f.values.shape[0], f.windows, profile)
            parts.append((scores, sweep, window))
        thresholds, raw, tp, fp = threshold_sweep(parts, profile)
        best = int(np.argmax(raw))
        scorable = sum(int(np.sum(p[2] >= 0)) for p in parts)
        out[profile.name] = NabScore(
            profile=profile.name,
            threshold=float(thresholds[best]),
            raw=float(raw[best]),
            normalised=normalise(float(raw[best]), profile, windows),
            tp=int(tp[best]),
            fp=int(fp[best]),
            fn=scorable - int(tp[best]),
        )
    return out


def load_profiles(root: Path) -> tuple[NabProfile, ...]:
    """Read ``config/profiles.json`` (falls back to :data:`PROFILES` when absent)."""
    path = root / "config" / "profiles.json"
    if not path.is_file():
        return PROFILES
    raw = json.loads(path.read_text())
    return tuple(
        NabProfile(
            name=name,
            tp_weight=float(spec["CostMatrix"]["tpWeight"]),
            fp_weight=abs(float(spec["CostMatrix"]["fpWeight"])),
            fn_weight=abs(float(spec["CostMatrix"]["fnWeight"])),
        )
        for name, spec in sorted(raw.items())
    )


def load_corpus(root: Path, *, keys: Sequence[str] | None = None) -> list[NabFile]:
    """Load NAB data files and their windows.

    Args:
        root: NAB folder (holding ``data/`` and ``labels/``).
        keys: Only these files (``<folder>/<file>.csv``); all 58 when ``None``.

    Returns:
        Files sorted by key.

    Raises:
        FileNotFoundError: ``root`` is not a NAB folder.
    """
    labels = json.loads((root / "labels" / "combined_windows.json").read_text())
    wanted = sorted(labels) if keys is None else sorted(keys)
    files = []
    for key in wanted:
        frame = pd.read_csv(root / "data" / key)
        stamps = pd.to_datetime(frame["timestamp"]).to_numpy(dtype="datetime64[ns]")
        windows = []
        for start, end in labels[key]:
            left = int(np.searchsorted(stamps, np.datetime64(pd.Timestamp(start)), "left"))
            right = int(np.searchsorted(stamps, np.datetime64(pd.Timestamp(end)), "right")) - 1
            windows.append((left, right))
        files.append(
            NabFile(
                key=key,
                timestamps=stamps,
                values=frame["value"].to_numpy(dtype=np.float64),
                windows=tuple(windows),
            )
        )
    return files


def load_results(root: Path, detector: str, files: Sequence[NabFile]) -> dict[str, FloatArray]:
    """Read a published detector's anomaly scores from ``results/<detector>/``.

    Returns:
        Per file key, the ``anomaly_score`` column, shape ``(n,)``.
    """
    out = {}
    for f in files:
        folder, name = f.key.split("/", 1)
        path = root / "results" / detector / folder / f"{detector}_{name}"
        out[f.key] = pd.read_csv(path)["anomaly_score"].to_numpy(dtype=np.float64)
    return out


def load_scoreboard(root: Path) -> dict[str, dict[str, float]]:
    """Read ``nab_scoreboard_final_results.json``: detector -> profile -> normalised score."""
    raw = json.loads((root / "nab_scoreboard_final_results.json").read_text())
    return {name: {p: float(v) for p, v in scores.items()} for name, scores in raw.items()}


def suppress_repeats(scores: FloatArray, rows: int) -> FloatArray:
    """Keep a score only where it exceeds every score of the previous ``rows`` rows; else 0.

    A causal (online) debounce: an ongoing anomaly is reported when it starts or worsens,
    not on every row, as an alert pipeline would page once. NAB counts every detection
    outside a window as a false positive, so repeated scores cost there too.

    Examples:
        >>> suppress_repeats(np.array([0.1, 0.9, 0.8, 0.95, 0.2, 0.3]), 2).tolist()
        [0.1, 0.9, 0.0, 0.95, 0.0, 0.0]
    """
    if rows <= 0 or scores.size == 0:
        return scores
    padded = np.r_[np.full(rows, -np.inf), scores]
    previous = np.lib.stride_tricks.sliding_window_view(padded[:-1], rows).max(axis=1)
    return np.where(scores > previous, scores, 0.0)


def detect_corpus(
    files: Sequence[NabFile], detector: VectorDetector, *, cooldown_rows: int = 0
) -> dict[str, FloatArray]:
    """Run a vectorised detector over a NAB corpus, one series per file, in time order.

    All files advance together (row ``i`` of every file long enough is one batch), so a run
    over the corpus is one ``score_many`` call per row index. Scores are the detector's
    ``probability`` (in [0, 1]), as NAB expects.

    Args:
        files: The corpus.
        detector: A fresh detector; it learns online as it scores (prequential order).
        cooldown_rows: Debounce window of :func:`suppress_repeats`; 0 keeps every score.

    Returns:
        Per file key, the anomaly score of each row, shape ``(n,)``.
    """
    slots = detector.index.slots(
        SeriesKey(NodeName("nab"), EntityId(f.key), "value") for f in files
    )
    lengths = np.array([f.values.shape[0] for f in files])
    out = {f.key: np.zeros(f.values.shape[0]) for f in files}
    longest = int(lengths.max(initial=0))
    padded = np.zeros((len(files), longest))
    for i, f in enumerate(files):
        padded[i, : lengths[i]] = f.values
    for row in range(longest):
        alive = np.flatnonzero(lengths > row)
        verdict = detector.score_many(
            SeriesBatch(
                series=slots[alive],
                values=padded[alive, row],
                observed_at=np.full(alive.size, float(row)),
            )
        )
        for position, file_index in enumerate(alive.tolist()):
            out[files[file_index].key][row] = verdict.probability[position]
    return {key: suppress_repeats(scores, cooldown_rows) for key, scores in out.items()}


def default_detectors() -> dict[str, Callable[[], VectorDetector]]:
    """The gpuhealth detectors run on NAB, as fresh-instance factories (two-sided, debounced).

    ``calibration_samples`` stays inside NAB's probationary period (15 % of a file, at most
    750 rows), so the warm-up is never scored.
    """
    return {
        "gpuhealth_spot": lambda: SpotDetector(
            side="both", calibration_samples=300, relearn_after=10
        ),
        "gpuhealth_dspot": lambda: DspotDetector(
            side="both", calibration_samples=300, relearn_after=10
        ),
        "gpuhealth_quantile": lambda: QuantileThresholdDetector(
            warmup_samples=300, relearn_after=10
        ),
        "gpuhealth_ewma_z": lambda: EwmaZScoreDetector(warmup_samples=300, relearn_after=10),
    }


def evaluate(
    root: Path,
    detectors: Mapping[str, Callable[[], VectorDetector]] | None = None,
    *,
    keys: Sequence[str] | None = None,
    cooldown_rows: int = 200,
) -> dict[str, dict[str, NabScore]]:
    """Run detectors on NAB and score them for every profile.

    Args:
        root: NAB folder.
        detectors: Name -> factory of a fresh detector; :func:`default_detectors` when ``None``.
        keys: Only these files; the whole corpus when ``None``.
        cooldown_rows: Debounce of :func:`suppress_repeats` applied to every detector.

    Returns:
        Detector name -> profile name -> :class:`NabScore`.
    """
    files = load_corpus(root, keys=keys)
    profiles = load_profiles(root)
    out = {}
    for name, factory in (detectors or default_detectors()).items():
        scores = detect_corpus(files, factory(), cooldown_rows=cooldown_rows)
        out[name] = score_corpus(files, scores, profiles)
        logger.info(
            "NAB %s: %s",
            name,
            ", ".join(f"{p} {s.normalised:.2f}" for p, s in sorted(out[name].items())),
        )
    return out


def format_table(
    results: Mapping[str, Mapping[str, NabScore]], scoreboard: Mapping[str, Mapping[str, float]]
) -> str:
    """Render our scores beside the published scoreboard, best standard score first.

    Returns:
        A plain-text table, one detector per line; ours are marked ``*``.
    """
    names = ("standard", "reward_low_FP_rate", "reward_low_FN_rate")
    rows = [(f"* {d}", {p: s.normalised for p, s in r.items()}) for d, r in results.items()]
    rows += [(f"  {d}", dict(r)) for d, r in scoreboard.items()]
    rows.sort(key=lambda row: -row[1].get("standard", float("-inf")))
    lines = [f"{'detector':<28}" + "".join(f"{n:>20}" for n in names)]
    for label, scores in rows:
        lines.append(
            f"{label:<28}" + "".join(f"{scores.get(n, float('nan')):>20.2f}" for n in names)
        )
    return "\n".join(lines)


def data_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate the NAB folder.

    Returns:
        ``explicit``, else ``$GPUHEALTH_TEST_DATA/nab``, else ``../shared/data/nab`` relative
        to the working directory (the repository root in a checkout).
    """
    if explicit:
        return Path(explicit)
    env = os.environ.get("GPUHEALTH_TEST_DATA")
    if env:
        return Path(env) / "nab"
    return Path.cwd().parent / "shared" / "data" / "nab"


def is_nab_folder(root: Path) -> bool:
    """Whether ``root`` holds NAB's data and labels."""
    return (root / "labels" / "combined_windows.json").is_file() and (root / "data").is_dir()


def spread_keys(keys: Sequence[str], count: int) -> list[str]:
    """Pick ``count`` keys evenly spaced through ``keys`` (all when ``count`` is 0 or more).

    A slice of the sorted corpus taken from its start would hold only the artificial files
    without anomalies; spacing the picks covers every folder.

    Examples:
        >>> spread_keys(["a", "b", "c", "d", "e", "f"], 3)
        ['a', 'c', 'e']
    """
    if count <= 0 or count >= len(keys):
        return list(keys)
    step = len(keys) / count
    return [keys[int(i * step)] for i in range(count)]
