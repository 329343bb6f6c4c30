"""The scikit-learn batch refit: adopted only when it beats the online model on recent data."""

from __future__ import annotations

import math
import random

from analytics.prediction_stage import PredictionStage
from analytics.refit import refit


def history(n: int, *, seed: int, online_good: bool, step: float = 1.0) -> list:
    """Failures when the error rate is high AND the temperature deviation is high (an AND the
    linear online model cannot draw); its prequential scores are noise unless online_good."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        ce, dev = rng.random() * 10, rng.random() * 10
        label = ce > 6 and dev > 6 and rng.random() < 0.9
        online = (0.9 if label else 0.1) if online_good else rng.random()
        rows.append(({"dram_ce_rate": ce, "temp_dev": dev}, label, online, i * step))
    return rows


def test_batch_model_adopted_when_it_beats_the_online_one():
    decision = refit(history(4000, seed=1, online_good=False), seed=0)
    assert decision.adopted, decision.why
    assert decision.batch_ap > decision.online_ap + 0.3
    assert decision.model is not None
    assert decision.model.probability({"dram_ce_rate": 9.0, "temp_dev": 9.0}) > 0.5
    assert decision.model.probability({"dram_ce_rate": 1.0, "temp_dev": 9.0}) < 0.5
    assert decision.model.probability({"dram_ce_rate": 9.0}) >= 0.0  # a missing feature is NaN


def test_online_model_kept_when_it_is_as_good():
    decision = refit(history(4000, seed=2, online_good=True), seed=0)
    assert not decision.adopted
    assert "online model kept" in decision.why


def test_too_few_failures_refits_nothing():
    rows = [({"x": float(i)}, False, 0.1, float(i)) for i in range(100)]
    decision = refit(rows)
    assert not decision.adopted
    assert decision.model is None
    assert math.isnan(decision.batch_ap)


def test_stage_serves_the_adopted_model(tmp_path):
    stage = PredictionStage(checkpoint_path=tmp_path / "p.pkl", min_positives=0)
    # one row a minute: the stage keeps a day (its horizon) between training and the rest
    rows = history(4000, seed=3, online_good=False, step=60.0)
    stage.predictor.history.extend(rows)
    raw = stage.refresh_batch_model()  # the stage refits on unit-free features only (#15)
    assert not raw.adopted
    assert raw.why == "no feature to refit on"
    stage.predictor.history.clear()
    stage.predictor.history.extend(  # the same rows under unit-free names
        ({"corrected_ecc_evidence": v["dram_ce_rate"], "temp_excess": v["temp_dev"]}, y, p, t)
        for v, y, p, t in rows)
    decision = stage.refresh_batch_model()
    assert decision.adopted
    assert stage.batch is not None
    stage.save()
    again = PredictionStage(checkpoint_path=tmp_path / "p.pkl")
    assert len(again.predictor.history) == 4000  # the history survives a restart


def test_trees_are_calibrated_on_later_rows_not_pushed_up() -> None:
    """No balanced class weights without calibration (#15 item 5): a weak precursor (the
    failure rate rises from 1 % to 9 % with the error rate) never reads as 50 %."""
    rng = random.Random(4)
    rows = []
    for i in range(8000):
        ce = rng.random() * 10
        label = rng.random() < 0.01 + 0.008 * ce
        rows.append(({"dram_ce_rate": ce, "noise": rng.random()}, label, rng.random(), i * 60.0))
    decision = refit(rows, seed=0)
    assert decision.model is not None, decision.why
    hold = rows[int(len(rows) * 0.75):]
    served = decision.model.probabilities([r[0] for r in hold])
    assert sum(p > 0.5 for p in served) / len(served) < 0.01
    mean = sum(served) / len(served)
    rate = sum(r[1] for r in hold) / len(hold)
    assert abs(mean - rate) < 0.03  # calibrated: the mean probability is the failure rate


def test_memorised_failure_episodes_are_not_adopted(tmp_path) -> None:
    """The vectors of one failing GPU over the day before its failure are near duplicates
    (its own steady readings: a fingerprint). A cut without a gap puts one episode on both
    sides and rewards the trees for memorising it (#15 item 5); with the horizon between
    training and the later rows their advantage is gone and the online model keeps serving."""
    rng = random.Random(0)
    day = 86_400.0
    failures = [day * d for d in (3, 7, 11, 15, 19, 23, 27)]  # day 23's episode straddles
    rows = []
    for i in range(int(30 * day / 600)):  # one vector every 10 minutes for 30 days
        t = i * 600.0
        episode = next((f for f in failures if 0 <= f - t <= day), None)
        label = episode is not None
        fingerprint = (episode / day * 0.7919) % 1.0 if label else rng.random()
        online = min(1.0, max(0.0, 0.5 + (0.1 if label else 0.0) + rng.gauss(0, 0.2)))
        rows.append(({"corrected_ecc_evidence": fingerprint, "noise_fold": rng.random()},
                     label, online, t))
    leaky = refit(rows, seed=0, gap_seconds=0.0, calibration_fraction=0.0)
    assert leaky.adopted, leaky.why  # what a cut without the gap concludes
    stage = PredictionStage(checkpoint_path=tmp_path / "p.pkl", min_positives=0)  # 24 h
    stage.predictor.history.extend(rows)
    decision = stage.refresh_batch_model()
    assert not decision.adopted, decision.why
    assert stage.batch is None


def test_a_feature_seen_once_never_breaks_the_refit() -> None:
    """A replay of a held-out fleet crashed in scikit-learn's binning (\"window shape cannot
    be larger than input array shape\") on a feature almost every row lacks; such features
    are left out and a fit that still fails keeps the online model serving."""
    rows = history(3000, seed=5, online_good=False, step=60.0)
    rows[10] = ({**rows[10][0], "remap_evidence": 3.0}, *rows[10][1:])
    decision = refit(rows, seed=0)
    assert decision.model is None or "remap_evidence" not in decision.model.features
