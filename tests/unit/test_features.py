"""Feature vectors from the stream, and the prediction stage that withholds an untrained model."""

from __future__ import annotations

import random

import pytest

from analytics.features import FeatureBuilder
from analytics.prediction_stage import PredictionStage
from core.records import Action, EntityId, Evidence, Finding, NodeName, Sample, Severity


def s(metric: str, value: float, at: float, entity: str = "GPU-0", node: str = "n1",
      **labels: str) -> Sample:
    return Sample(metric=metric, value=value, observed_at=at, node=NodeName(node),
                  entity=EntityId(entity), labels=labels)


def test_corrected_error_rate_trend_and_reset():
    fb = FeatureBuilder(interval_seconds=60, window_seconds=3600)
    ce = {"type": "corrected", "scope": "volatile", "location": "dram"}
    # 10 errors in the first half hour, 40 in the second: a rising rate; a reset at 2400 s
    points = [(0, 0), (1800, 10), (2400, 3), (3600, 43)]
    fb.observe(s("gpu_ecc_errors_total", v, t, **ce) for t, v in points)
    [vec] = fb.vectors(3600)
    assert vec.values["dram_ce_rate"] == pytest.approx(10 + 3 + 40)  # per hour over 1 h
    assert vec.values["ce_rate_trend"] > 0
    assert "ue_rate" not in vec.values  # absent, not zero


def test_peer_deviation_is_robust_to_a_hot_node():
    fb = FeatureBuilder()
    for i, temp in enumerate([80, 81, 79, 95]):  # the whole node is hot; GPU-3 hotter
        fb.observe([s("gpu_temperature_celsius", temp, 100, entity=f"GPU-{i}")])
    vecs = {v.entity: v.values for v in fb.vectors(100)}
    assert vecs["GPU-3"]["temp_dev"] == pytest.approx(15)
    assert abs(vecs["GPU-0"]["temp_dev"]) <= 1


def test_ib_port_features_and_interval():
    fb = FeatureBuilder(interval_seconds=60)
    fb.observe([s("ib_symbol_errors_total", v, t, entity="node", device="mlx5_0", port="1")
                for t, v in [(0, 0), (600, 100)]])
    [vec] = fb.vectors(600)
    assert vec.entity == "mlx5_0:1"  # the port rules' and collectors' identity
    assert vec.values["ib_symbol_rate"] == pytest.approx(600)
    assert fb.vectors(630) == []  # within the interval
    assert fb.vectors(600 + 4000) == []  # silent for longer than the window: skipped


def failure(at: float) -> Finding:
    return Finding(node=NodeName("n1"), entity=EntityId("GPU-0"), kind="xid", code="48",
                   severity=Severity.CRITICAL, action=Action.RESET_GPU, summary="DBE",
                   evidence=(Evidence(file="x", line=1, text="x"),), source="t",
                   first_seen_at=at, last_seen_at=at)


def test_stage_withholds_until_trained_and_checkpoints(tmp_path):
    path = tmp_path / "predictor.pkl"
    stage = PredictionStage(checkpoint_path=path, horizon_seconds=600, interval_seconds=60,
                            min_positives=2, seed=1)
    ce = {"type": "corrected", "scope": "volatile", "location": "dram"}
    t = 0.0
    for _ in range(200):
        t += 60
        stage.observe([s("gpu_ecc_errors_total", t / 6, t, **ce)])
        out = stage.step(t)
        assert out == [] or stage.ready
    assert not stage.ready
    assert stage.withheld > 0
    stage.observe_findings([failure(t + 60), failure(t + 120)])
    for _ in range(30):
        t += 60
        stage.observe([s("gpu_ecc_errors_total", t / 6, t, **ce)])
        stage.step(t)
    assert stage.predictor.learned_positive >= 2
    stage.save()
    again = PredictionStage(checkpoint_path=path, min_positives=2)
    assert again.ready
    assert again.predictor.learned_positive == stage.predictor.learned_positive


def test_corrupt_checkpoint_starts_cold(tmp_path):
    path = tmp_path / "predictor.pkl"
    path.write_bytes(b"not a pickle")
    stage = PredictionStage(checkpoint_path=path)
    assert stage.predictor.learned_positive == 0


def test_vector_detector_runs_in_the_stage_when_enabled():
    """River's HalfSpaceTrees over whole feature vectors (opt-in: see docs/analytics.md for
    its precision on the labelled stream), seeded, after its warm-up of 200 vectors."""
    stage = PredictionStage(checkpoint_path=None, interval_seconds=60, min_positives=0,
                            vector_detector=True)
    off = PredictionStage(checkpoint_path=None, interval_seconds=60, min_positives=0)
    ce = {"type": "corrected", "scope": "volatile", "location": "dram"}
    rng = random.Random(7)
    t, total = 0.0, 0.0
    for _ in range(300):
        t += 60
        total += rng.randint(0, 3)
        batch = [s("gpu_ecc_errors_total", total, t, **ce),
                 s("gpu_temperature_celsius", 60.0 + rng.gauss(0, 1), t),
                 s("gpu_temperature_celsius", 60.0 + rng.gauss(0, 1), t, entity="GPU-1")]
        for st in (stage, off):
            st.observe(batch)
            st.step(t)
    anomalies = stage.take_anomalies()
    assert anomalies
    assert all(a.observed_at > 200 * 60 for a in anomalies)  # nothing during the warm-up
    assert {a.entity for a in anomalies} <= {"GPU-0", "GPU-1"}
    assert stage.take_anomalies() == []
    assert off.take_anomalies() == []


def test_shared_and_fresh_labels_give_the_same_vectors():
    """The observe memo (core.series.SeriesMemo) keys series by the labels object: samples
    that share one dictionary (the line-protocol reader) and samples that each bring their
    own (NVML collectors) must give the same features, for several GPUs sharing a dict."""
    rng = random.Random(3)
    shared = {"type": "corrected", "scope": "volatile", "location": "dram"}
    rows = [(entity, t, float(k * (t // 600) + rng.randrange(3)))
            for t in range(0, 7200, 60) for k, entity in ((1, "GPU-0"), (3, "GPU-1"))]
    one, other = FeatureBuilder(), FeatureBuilder()
    for entity, t, v in rows:
        one.observe([Sample(metric="gpu_ecc_errors_total", value=v, observed_at=t,
                            node=NodeName("n1"), entity=EntityId(entity), labels=shared)])
        other.observe([s("gpu_ecc_errors_total", v, t, entity=entity, **shared)])
    a = {v.entity: v.values for v in one.vectors(7200)}
    b = {v.entity: v.values for v in other.vectors(7200)}
    assert a == b
    assert set(a) == {"GPU-0", "GPU-1"}
    # one shared dictionary, two series: GPU-1's errors come three times as often
    assert a["GPU-1"]["dram_ce_rate"] > 2 * a["GPU-0"]["dram_ce_rate"]
