"""NAB scorer: windows, sigmoid, profiles, threshold sweep, normalisation (analytics/nab.py).

The data tests read ``$GPUHEALTH_TEST_DATA/nab`` (CI points it at the shared copy), else the
shared folder beside the repository; they skip when neither exists and fail when
``GPUHEALTH_TEST_DATA`` is set but holds no NAB data.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from analytics.nab import (
    PROFILES,
    NabFile,
    detect_corpus,
    load_corpus,
    load_profiles,
    load_results,
    load_scoreboard,
    score_corpus,
    suppress_repeats,
    sweep_scores,
)
from analytics.thresholds import DspotDetector

STANDARD = PROFILES[0]


def nab_root() -> Path:
    env = os.environ.get("GPUHEALTH_TEST_DATA")
    if env:
        root = Path(env) / "nab"
        if not (root / "labels" / "combined_windows.json").is_file():
            pytest.fail(f"GPUHEALTH_TEST_DATA={env} is set but {root} holds no NAB data")
        return root
    root = Path(__file__).resolve().parents[3] / "shared" / "data" / "nab"
    if not (root / "labels" / "combined_windows.json").is_file():
        pytest.skip(f"NAB data absent: set GPUHEALTH_TEST_DATA or provide {root}")
    return root


def _file(rows: int, windows: tuple[tuple[int, int], ...], key: str = "x/f.csv") -> NabFile:
    return NabFile(
        key=key,
        timestamps=np.arange(rows).astype("datetime64[m]").astype("datetime64[ns]"),
        values=np.zeros(rows),
        windows=windows,
    )


CORPUS = [_file(1000, ((300, 399), (700, 799)), "a/one.csv"), _file(1000, (), "b/none.csv")]


def _scores(**marks: list[int]) -> dict[str, np.ndarray]:
    out = {f.key: np.zeros(1000) for f in CORPUS}
    for key, rows in (("a/one.csv", marks.get("one", [])), ("b/none.csv", marks.get("none", []))):
        out[key][rows] = 1.0
    return out


def test_null_detector_scores_0_and_perfect_100() -> None:
    null = score_corpus(CORPUS, {f.key: np.full(1000, 0.5) for f in CORPUS})
    perfect = score_corpus(CORPUS, _scores(one=[300, 700]))
    for profile in PROFILES:
        assert null[profile.name].normalised == pytest.approx(0.0)
        assert perfect[profile.name].normalised == pytest.approx(100.0)


def test_earlier_detection_in_a_window_scores_more() -> None:
    early = score_corpus(CORPUS, _scores(one=[310, 710]))["standard"].raw
    late = score_corpus(CORPUS, _scores(one=[390, 790]))["standard"].raw
    assert 0 < late < early < 2


def test_false_positives_cost_by_profile() -> None:
    base = score_corpus(CORPUS, _scores(one=[300, 700]))
    # The same detections plus one false positive long before any window.
    noisy = score_corpus(CORPUS, _scores(one=[300, 700], none=[500]))
    fp_cost = {p: base[p].raw - noisy[p].raw for p in base}
    # The sweep keeps the threshold (1.0 catches all) and pays |A_FP| for the FP.
    assert fp_cost["standard"] == pytest.approx(0.11)
    assert fp_cost["reward_low_FP_rate"] == pytest.approx(0.22)
    assert fp_cost["reward_low_FN_rate"] == pytest.approx(0.11)


def test_false_positive_right_after_a_window_costs_less() -> None:
    sweep, window = sweep_scores(1000, ((300, 399), (700, 799)), STANDARD)
    assert window[:150].tolist() == [-2] * 150  # probationary rows are not scored
    assert sweep[400] > sweep[450] > sweep[600] >= -STANDARD.fp_weight
    assert sweep[200] == pytest.approx(-STANDARD.fp_weight)
    assert sweep[300] == pytest.approx(1.0)


def test_threshold_sweep_picks_the_best_threshold() -> None:
    scores = _scores(one=[300, 700])
    scores["b/none.csv"][[200, 400, 600]] = 0.9  # false positives a lower threshold would add
    result = score_corpus(CORPUS, scores)["standard"]
    assert result.threshold == 1.0
    assert result.normalised == pytest.approx(100.0)


def test_probationary_period_is_capped_at_750_rows() -> None:
    _, window = sweep_scores(10_000, (), STANDARD)
    assert int(np.sum(window == -2)) == 750


def test_wrong_length_is_rejected() -> None:
    with pytest.raises(ValueError, match="anomaly scores"):
        score_corpus(CORPUS, {"a/one.csv": np.zeros(10), "b/none.csv": np.zeros(1000)})


def test_suppress_repeats_is_causal() -> None:
    scores = np.array([0.2, 0.5, 0.4, 0.6, 0.1])
    assert suppress_repeats(scores, 0) is scores
    assert suppress_repeats(scores, 10).tolist() == [0.2, 0.5, 0.0, 0.6, 0.0]


def test_reproduces_windowed_gaussian_published_scores() -> None:
    root = nab_root()
    files = load_corpus(root)
    assert len(files) == 58
    assert sum(len(f.windows) for f in files) == 116
    result = score_corpus(files, load_results(root, "windowedGaussian", files), load_profiles(root))
    board = load_scoreboard(root)["windowedGaussian"]
    assert result["standard"].normalised == pytest.approx(39.65, abs=0.5)
    for profile, published in board.items():
        assert result[profile].normalised == pytest.approx(published, abs=0.5)
    assert result["standard"].threshold == 1.0


def test_detector_runs_on_a_small_slice() -> None:
    root = nab_root()
    keys = [
        "artificialWithAnomaly/art_daily_jumpsup.csv",
        "artificialWithAnomaly/art_daily_flatmiddle.csv",
        "artificialNoAnomaly/art_daily_small_noise.csv",
    ]
    files = load_corpus(root, keys=keys)
    detector = DspotDetector(side="both", calibration_samples=300, relearn_after=10)
    scores = detect_corpus(files, detector, cooldown_rows=200)
    assert all(s.min() >= 0.0 and s.max() <= 1.0 for s in scores.values())
    result = score_corpus(files, scores)
    assert result["standard"].normalised > 0.0  # better than the null detector


def test_a_slice_without_windows_cannot_be_normalised() -> None:
    files = [_file(1000, (), "b/none.csv")]
    with pytest.raises(ValueError, match="no labelled windows"):
        score_corpus(files, {"b/none.csv": np.zeros(1000)})
