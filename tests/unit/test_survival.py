"""Titan survival model on small synthetic lifetime tables with a known risk factor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analytics import survival

START = pd.Timestamp("2014-01-01")


def _write(path: Path, rows: list[tuple[str, str, str, str, str]]) -> Path:
    lines = ["SN,location,insert,remove,duration,out,event"]
    lines += [f"{sn},{loc},{ins},{rem},0,FALSE,{ev}" for sn, loc, ins, rem, ev in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _fleet(tmp_path: Path, seed: int, *, lemon: str | None = None) -> Path:
    """A fleet of 384 slots over five years; cage 2 fails five times as often as cage 0/1.

    Every failed GPU is replaced a day later in the same slot. ``lemon`` makes one slot fail
    every 60 days whatever GPU sits in it.
    """
    rng = np.random.default_rng(seed)
    end = pd.Timestamp("2019-01-01")
    rows: list[tuple[str, str, str, str, str]] = []
    serial = 0
    locations = [f"c{col}-{row}c{cage}s{slot}n{node}" for col in range(4) for row in range(2)
                 for cage in range(3) for slot in range(4) for node in range(4)]
    for loc in locations:
        hazard_years = 1.0 if loc[loc.index("c", 1) + 1] == "2" else 5.0
        at = START
        while at < end:
            serial += 1
            life = pd.Timedelta(days=float(rng.exponential(hazard_years * 365.25)))
            if loc == lemon:
                life = pd.Timedelta(days=60)
            remove = min(at + life, end)
            event = "DBE" if remove < end else ""
            rows.append((f"03{serial:011d}", loc, str(at), str(remove), event))
            at = remove + pd.Timedelta(days=1)
    return _write(tmp_path / f"gc_full_{seed}.csv", rows)


def test_parse_location() -> None:
    assert survival.parse_location("c24-7c2s7n3") == (24, 7, 2, 7, 3)
    with pytest.raises(ValueError, match="cname"):
        survival.parse_location("c1-2c3s4")


def test_load_intervals_names_file_and_line(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.csv", [
        ("0320000000001", "c1-0c0s0n0", "2014-01-01", "2015-01-01", ""),
        ("0320000000002", "cabinet-1", "2014-01-01", "2015-01-01", "DBE"),
    ])
    with pytest.raises(ValueError, match=r"bad\.csv:3: .*cname"):
        survival.load_intervals(bad)
    worse = _write(tmp_path / "worse.csv", [
        ("0320000000001", "c1-0c0s0n0", "2014-01-01", "2015-01-01", "XYZ"),
    ])
    with pytest.raises(ValueError, match=r"worse\.csv:2: unknown event"):
        survival.load_intervals(worse)
    (tmp_path / "cols.csv").write_text("SN,location\n1,c1-0c0s0n0\n")
    with pytest.raises(ValueError, match="missing columns"):
        survival.load_intervals(tmp_path / "cols.csv")


def test_landmark_table_outcome_and_history(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.csv", [
        ("0320000000001", "c1-0c0s0n0", "2014-01-01", "2015-06-01", "DBE"),
        ("0320000000002", "c1-0c0s0n0", "2015-06-02", "2018-01-01", "OTB"),
        ("0320000000003", "c1-0c0s0n1", "2014-01-01", "2019-01-01", ""),
        # an extra failure record of serial 3 (no insert): its first failure after 2016
        ("0320000000003", "c1-0c0s0n1", "", "2017-01-01", "DBE"),
    ])
    iv = survival.load_intervals(path)
    table = survival.landmark_table(iv, pd.Timestamp("2016-01-01"), pd.Timestamp("2019-01-01"))
    table = table.set_index("SN")
    assert set(table.index) == {"0320000000002", "0320000000003"}
    two, three = table.loc["0320000000002"], table.loc["0320000000003"]
    assert bool(two["event"])
    assert two["time"] == pytest.approx(731.0)
    assert two["slot_failures"] == 1.0
    assert two["slot_gpus"] == 1.0
    assert two["gpu_failures"] == 0
    assert two["age_years"] == pytest.approx(213 / 365.25)
    assert bool(three["event"])
    assert three["time"] == pytest.approx(366.0)
    assert three["slot_failures"] == 0.0
    assert three["cabinet_failures"] == 1.0
    with pytest.raises(ValueError, match="after the landmark"):
        survival.landmark_table(iv, pd.Timestamp("2016-01-01"), pd.Timestamp("2015-01-01"))


def test_cox_ranks_the_known_risk_factor(tmp_path: Path) -> None:
    iv = survival.load_intervals(_fleet(tmp_path, seed=11))
    split = pd.Timestamp("2017-01-01")
    train = pd.concat([survival.landmark_table(iv, pd.Timestamp(t), split)
                       for t in ("2015-01-01", "2016-01-01")], ignore_index=True)
    test = survival.landmark_table(iv, split, pd.Timestamp("2019-01-01"))
    model = survival.fit_cox(train, categorical=["cage"])
    coef = model.coefficients()
    assert coef["cage_2"] > coef["cage_0"] + 0.5
    assert coef["cage_2"] > coef["cage_1"] + 0.5
    c = survival.concordance(model, test)
    assert 0.6 < c <= 1.0
    # a covariate without signal (node, independent of the hazard here) ranks near chance
    noise = survival.fit_cox(train, categorical=["node"])
    assert survival.concordance(noise, test) < c - 0.05


def test_fit_cox_rejects_bad_input(tmp_path: Path) -> None:
    iv = survival.load_intervals(_fleet(tmp_path, seed=3))
    train = survival.landmark_table(iv, pd.Timestamp("2015-01-01"), pd.Timestamp("2016-01-01"))
    with pytest.raises(ValueError, match="at least one covariate"):
        survival.fit_cox(train)
    with pytest.raises(ValueError, match="alpha"):
        survival.fit_cox(train, categorical=["cage"], alpha=-1.0)
    with pytest.raises(ValueError, match="no failure"):
        survival.fit_cox(train.assign(event=False), categorical=["cage"])


def test_repeat_failure_slots_finds_the_lemon(tmp_path: Path) -> None:
    lemon = "c3-0c1s1n0"
    iv = survival.load_intervals(_fleet(tmp_path, seed=5, lemon=lemon))
    flagged = survival.repeat_failure_slots(iv, pd.Timestamp("2017-01-01"))
    assert flagged["location"].iloc[0] == lemon
    assert flagged["failures"].iloc[0] >= 10
    assert flagged.attrs["tested"] >= 300
    # without the lemon the same fleet flags far fewer slots than it has
    clean = survival.repeat_failure_slots(
        survival.load_intervals(_fleet(tmp_path, seed=5)), pd.Timestamp("2017-01-01"))
    assert lemon not in set(clean["location"])
    with pytest.raises(ValueError, match="p_threshold"):
        survival.repeat_failure_slots(iv, pd.Timestamp("2017-01-01"), p_threshold=0.0)
