"""Titan survival evaluation on the real OLCF data (issue 5).

Reads ``$GPUHEALTH_TEST_DATA/titan-gpu-lifetimes`` (CI points it at the shared copy), else
``../shared/data/titan-gpu-lifetimes``; skips when neither holds ``gc_full.csv``, fails when
``GPUHEALTH_TEST_DATA`` is set but holds no Titan data.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from analytics import survival


@pytest.fixture(scope="module")
def titan() -> Path:
    root = survival.data_dir()
    if not (root / "gc_full.csv").is_file():
        if os.environ.get("GPUHEALTH_TEST_DATA"):
            pytest.fail(f"GPUHEALTH_TEST_DATA is set but {root} holds no gc_full.csv")
        pytest.skip(f"Titan data absent: set GPUHEALTH_TEST_DATA or provide {root}")
    return root


@pytest.fixture(scope="module")
def intervals(titan: Path) -> pd.DataFrame:
    return survival.load_intervals(titan / "gc_full.csv")


def _truncate(intervals: pd.DataFrame, at: pd.Timestamp) -> pd.DataFrame:
    """What was known on ``at``: later rows gone, open residencies with no end and no event."""
    known = intervals[intervals["insert"].isna() | (intervals["insert"] <= at)]
    known = known[known["insert"].notna() | (known["remove"] <= at)].copy()
    open_ = known["remove"] > at
    known.loc[open_, "remove"] = pd.Timestamp("2100-01-01")
    known.loc[open_, "failed"] = False
    known.loc[open_, "event"] = ""
    return known


def test_landmark_covariates_use_no_information_after_the_split(
    intervals: pd.DataFrame,
) -> None:
    """Covariates computed from the whole file equal those computed from the file as it
    stood on the split date (every later row removed, every open residency's end unknown)."""
    split = survival.SPLIT
    end = pd.Timestamp("2100-01-02")
    full = survival.landmark_table(intervals, split, end).set_index("SN").sort_index()
    then = survival.landmark_table(_truncate(intervals, split), split, end)
    then = then.set_index("SN").sort_index()
    assert list(full.index) == list(then.index)
    columns = ["location", *survival.LOCATION_PARTS, "prefix", *survival.NUMERIC_FEATURES]
    pd.testing.assert_frame_equal(full[columns], then[columns])
    # and the outcome does depend on the future (the check above can fail)
    assert bool(full["event"].any())
    assert not bool(then["event"].any())


def test_training_landmarks_stop_at_the_split(intervals: pd.DataFrame) -> None:
    for at in survival.TRAIN_LANDMARKS:
        table = survival.landmark_table(intervals, at, survival.SPLIT)
        assert (at + pd.to_timedelta(table["time"], unit="D") <= survival.SPLIT).all()
        assert table["event"].sum() > 0


def test_evaluate_titan_reports_concordance(titan: Path, intervals: pd.DataFrame) -> None:
    result = survival.evaluate_titan(titan, intervals=intervals)
    c, base = result["concordance"], result["baseline_concordance"]
    assert 0.5 < base < 1.0
    assert 0.5 < c < 1.0
    assert result["test_gpus"] > 10_000
    assert result["test_events"] > 1_000
    assert result["met"] == (c >= 0.70 and c - base >= 0.05)
    # measured 2026-11-30: 0.752 against 0.607, goal met; the figures are in the message
    assert result["met"], (
        f"Titan concordance {c:.3f}, location-only baseline {base:.3f}: goal no longer met")
    assert len(result["top_slots"]) == 10
    for slot in result["repeat_slots"]:
        assert slot["p_value"] <= result["repeat_p_threshold"]
