"""The predictor's own scaler and logistic regression compute what river's did, and a
version 1 checkpoint (river's objects) restores into them."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

from river import linear_model, optim, preprocessing

from analytics.predictor import (
    OnlineFailurePredictor,
    RunningStandardScaler,
    SgdLogisticRegression,
)
from core.records import EntityId, FeatureVector, NodeName


def _rows(seed: int, n: int = 2000) -> list[tuple[dict[str, float], bool]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        x = {"ecc": rng.expovariate(5.0), "temp_z": rng.gauss(0, 1), "watts": rng.gauss(300, 20)}
        if i % 3:
            x["late_feature"] = rng.random()  # features appear later and go missing
        rows.append((x, x["ecc"] > 0.4 or rng.random() < 0.05))
    return rows


def test_same_arithmetic_as_river() -> None:
    ours_s, ours_m = RunningStandardScaler(), SgdLogisticRegression(learning_rate=0.05)
    river_s = preprocessing.StandardScaler()
    river_m = linear_model.LogisticRegression(optimizer=optim.SGD(0.05))
    for x, y in _rows(1):
        a, b = ours_s.transform_one(x), river_s.transform_one(x)
        assert a == b
        assert ours_m.predict_proba_one(a) == river_m.predict_proba_one(b)[True]
        ours_s.learn_one(x)
        river_s.learn_one(x)
        if y or x["temp_z"] > 0:
            ours_m.learn_one(a, y)
            river_m.learn_one(b, y)
    assert ours_m.weights == river_m.weights
    assert ours_m.intercept == river_m.intercept


def test_version_1_checkpoint_is_converted(tmp_path: Path) -> None:
    scaler = preprocessing.StandardScaler()
    model = linear_model.LogisticRegression(optimizer=optim.SGD(0.05))
    for x, y in _rows(2, 300):
        model.learn_one(scaler.transform_one(x), y)
        scaler.learn_one(x)
    params = {"horizon_seconds": 3600.0, "learning_rate": 0.05, "negative_rate": 0.2,
              "top_features": 5, "seed": 3}
    state = {"version": 1, "params": params, "scaler": scaler, "model": model, "pending": [],
             "scored": {}, "history": [], "failed_at": {}, "rng": random.Random(3).getstate(),
             "counts": (4, 40)}
    path = tmp_path / "predictor.pkl"
    path.write_bytes(pickle.dumps(state))
    restored = OnlineFailurePredictor.restore(path)
    assert isinstance(restored._model, SgdLogisticRegression)
    assert (restored.learned_positive, restored.learned_negative) == (4, 40)
    x = FeatureVector(node=NodeName("n0"), entity=EntityId("gpu0"),
                      values={"ecc": 0.9, "temp_z": 0.1, "watts": 310.0}, window_end_at=1.0)
    expected = model.predict_proba_one(scaler.transform_one(dict(x.values)))[True]
    assert restored.predict(x).probability == expected
    restored.save(path)  # written as version 2, read back without river
    assert OnlineFailurePredictor.restore(path).pending() == restored.pending()
