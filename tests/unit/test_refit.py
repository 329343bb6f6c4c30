"""The scikit-learn batch refit: adopted only when it beats the online model on recent data."""

from __future__ import annotations

import math
import random

from analytics.prediction_stage import PredictionStage
from analytics.refit import refit


def history(n: int, *, seed: int, online_good: bool) -> list:
    """Failures when the error rate is high AND the temperature deviation is high (an AND the
    linear online model cannot draw); its prequential scores are noise unless online_good."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        ce, dev = rng.random() * 10, rng.random() * 10
        label = ce > 6 and dev > 6 and rng.random() < 0.9
        online = (0.9 if label else 0.1) if online_good else rng.random()
        rows.append(({"dram_ce_rate": ce, "temp_dev": dev}, label, online, float(i)))
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
    stage.predictor.history.extend(history(4000, seed=3, online_good=False))
    decision = stage.refresh_batch_model()
    assert decision.adopted
    assert stage.batch is not None
    stage.save()
    again = PredictionStage(checkpoint_path=tmp_path / "p.pkl")
    assert len(again.predictor.history) == 4000  # the history survives a restart
