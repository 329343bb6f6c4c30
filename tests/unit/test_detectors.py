"""Every detector satisfies the Detector Protocol and the C.3.7 rules; river, peers, gaps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from analytics.gaps import TelemetryGapDetector
from analytics.hst import HalfSpaceTreesDetector, StandardAbsoluteDeviationDetector
from analytics.peers import PeerComparison, PeerDetector
from analytics.thresholds import (
    DspotDetector,
    EwmaZScoreDetector,
    QuantileThresholdDetector,
    SpotDetector,
)
from core.protocols import Detector
from core.records import EntityId, FeatureVector, NodeName

N1, GPU0 = NodeName("node-1"), EntityId("GPU-0")

SERIES_DETECTORS: dict[str, Callable[[], Detector]] = {
    "spot": lambda: SpotDetector(calibration_samples=200),
    "dspot": lambda: DspotDetector(calibration_samples=200),
    "quantile": lambda: QuantileThresholdDetector(warmup_samples=200),
    "ewma_z": lambda: EwmaZScoreDetector(warmup_samples=200),
    "hst": lambda: HalfSpaceTreesDetector(warmup_samples=200, seed=42),
    "sad": lambda: StandardAbsoluteDeviationDetector(warmup_samples=200),
}


def _vector(temp: float, power: float, t: float, entity: EntityId = GPU0) -> FeatureVector:
    return FeatureVector(
        node=N1,
        entity=entity,
        values={"gpu_temperature_celsius": temp, "gpu_power_watts": power},
        window_end_at=t,
    )


@pytest.mark.parametrize(
    "factory",
    [*SERIES_DETECTORS.values(), PeerDetector, TelemetryGapDetector],
    ids=[*SERIES_DETECTORS, "peers", "gaps"],
)
def test_implements_the_protocol(factory: Callable[[], Detector]) -> None:
    detector = factory()
    assert isinstance(detector, Detector)
    assert detector.name


@pytest.mark.parametrize("name", sorted(SERIES_DETECTORS))
def test_hot_reading_after_1000_normal_ones_is_an_anomaly(name: str) -> None:
    """style.md example 3's test, for every per-series detector."""
    rng = np.random.default_rng(0)
    detector = SERIES_DETECTORS[name]()
    flagged_before = 0
    for t in range(1000):
        temp = 60.0 + rng.normal(0.0, 0.5)
        flagged_before += (
            detector.observe(_vector(temp, 300.0 + rng.normal(0, 5), float(t))) is not None
        )
    anomaly = detector.observe(_vector(95.0, 300.0, 1000.0))
    assert anomaly is not None
    assert anomaly.score > anomaly.threshold
    assert (anomaly.node, anomaly.entity, anomaly.detector) == (N1, GPU0, detector.name)
    assert anomaly.observed_at == 1000.0
    assert flagged_before <= 15


@pytest.mark.parametrize("name", sorted(SERIES_DETECTORS))
def test_warmup_suppresses_alerts(name: str) -> None:
    detector = SERIES_DETECTORS[name]()
    for t in range(150):
        detector.observe(_vector(60.0 + (t % 3) * 0.1, 300.0, float(t)))
    assert detector.observe(_vector(1e4, 300.0, 150.0)) is None


@pytest.mark.parametrize("name", ["hst", "sad"])
def test_river_models_are_per_entity_and_seeded(name: str) -> None:
    def run() -> list[float]:
        detector = SERIES_DETECTORS[name]()
        rng = np.random.default_rng(1)
        scores = []
        for t in range(300):
            for gpu in ("GPU-0", "GPU-1"):
                x = _vector(60 + rng.normal(), 300 + rng.normal(), float(t), EntityId(gpu))
                scores.append(detector.score(x)[0])  # type: ignore[attr-defined]
        assert len(detector) == 2  # type: ignore[arg-type]
        return scores

    assert run() == run()


def test_river_detector_does_not_learn_flagged_points() -> None:
    detector = HalfSpaceTreesDetector(warmup_samples=100, window_size=50, seed=7)
    rng = np.random.default_rng(2)
    for t in range(400):
        detector.observe(_vector(60 + rng.normal(0, 0.5), 300.0, float(t)))
    # A GPU stuck hot keeps being flagged: it never becomes "normal".
    flags = [detector.observe(_vector(95.0, 300.0, 400.0 + t)) is not None for t in range(100)]
    assert all(flags)


@pytest.mark.parametrize(
    "sizes",
    [
        {"n_trees": 5, "height": 6, "window_size": 100},
        {"n_trees": 3, "height": 4, "window_size": 20},
    ],
)
def test_shared_half_space_trees_score_exactly_as_river(sizes: dict[str, int]) -> None:
    """Each entity's model (shared trees, own masses) equals river's HalfSpaceTrees pipeline
    with the same seed: scores bit for bit, through window pivots, missing features (the
    first vector lacks one, later ones drop one now and then) and points not learned."""
    detector = HalfSpaceTreesDetector(seed=11, **sizes)
    ours = [detector._template() for _ in range(3)]
    river = [detector.river_pipeline() for _ in range(3)]
    rng = np.random.default_rng(5)
    names = [f"f{i}" for i in range(5)]
    mismatches = []
    for t in range(700):
        for e in range(3):
            x = dict(zip(names, (rng.normal(60.0, 2.0, 5) * (1 + e)).tolist(), strict=True))
            if t % 13 == 0:
                del x[names[t % 5]]
            if t % 97 == 50:
                x["f1"] = 1e4
            a, b = ours[e].score_one(x), float(river[e].score_one(x))
            if a != b:
                mismatches.append((t, e, a, b))
            if t % 5 != 1:
                ours[e].learn_one(x)
                river[e].learn_one(x)
    assert not mismatches
    assert len(detector._forests) == 1  # every entity's first vector had the same names
    assert 0.0 < ours[0].score_one(dict.fromkeys(names, 60.0)) < 1.0


def test_half_space_trees_memory_per_entity_is_small() -> None:
    """Per-entity state stays far below river's ~150 KB of node objects (goal <= 100 KB)."""
    import tracemalloc

    detector = HalfSpaceTreesDetector(seed=1, warmup_samples=20)
    rng = np.random.default_rng(6)
    names = [f"f{i}" for i in range(12)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for t in range(150):
        for g in range(20):
            detector.observe(
                FeatureVector(
                    node=N1,
                    entity=EntityId(f"GPU-{g}"),
                    window_end_at=float(t),
                    values=dict(zip(names, rng.normal(60.0, 1.0, 12).tolist(), strict=True)),
                )
            )
    per_entity = (tracemalloc.get_traced_memory()[0] - before) / 20
    tracemalloc.stop()
    assert per_entity < 30_000


def test_peers_ignore_a_node_that_heats_up_as_a_whole() -> None:
    rng = np.random.default_rng(3)
    nodes = np.repeat(np.arange(20), 8)
    temp = 60.0 + rng.normal(0.0, 0.7, nodes.size)
    temp[nodes == 4] += 12.0  # the whole node's cooling failed
    temp[8 * 9 + 5] += 9.0  # one GPU of node 9 runs hot
    verdict = PeerComparison(min_scale=0.5).compare(
        temp, node=nodes, group=np.zeros(nodes.size, dtype=np.int64)
    )
    assert np.flatnonzero(verdict.flagged).tolist() == [8 * 9 + 5]
    assert set(nodes[verdict.node_flagged].tolist()) == {4}


def test_peers_compare_temperature_at_equal_power() -> None:
    rng = np.random.default_rng(4)
    nodes = np.repeat(np.arange(10), 8)
    power = rng.uniform(150.0, 700.0, nodes.size)
    temp = 35.0 + 0.06 * power + rng.normal(0.0, 0.5, nodes.size)
    hot_at_same_power = 8 * 3 + 2
    temp[hot_at_same_power] += 6.0
    group = np.zeros(nodes.size, dtype=np.int64)
    peers = PeerComparison(min_scale=0.5)
    raw = peers.compare(temp, node=nodes, group=group)
    at_power = peers.compare(temp, node=nodes, group=group, covariate=power)
    assert np.flatnonzero(at_power.flagged).tolist() == [hot_at_same_power]
    # Without the covariate, busy GPUs look hot and the comparison is noise.
    assert np.flatnonzero(raw.flagged).tolist() != [hot_at_same_power]


def test_peers_compare_like_with_like_models() -> None:
    nodes = np.repeat(np.arange(8), 4)
    group = (nodes >= 4).astype(np.int64)  # two GPU models, different normal temperatures
    temp = np.where(group == 1, 80.0, 55.0) + np.tile([0.0, 0.4, -0.3, 0.2], 8)
    verdict = PeerComparison(min_scale=0.5).compare(temp, node=nodes, group=group)
    assert not verdict.node_flagged.any()
    assert not verdict.flagged.any()


def test_peer_detector_flags_one_hot_gpu_through_observe() -> None:
    detector = PeerDetector(min_scale=0.5)
    anomaly = None
    for gpu in range(8):
        temp = 75.0 if gpu == 6 else 60.0 + 0.3 * (gpu % 3)
        anomaly = detector.observe(_vector(temp, 300.0, 10.0, EntityId(f"GPU-{gpu}"))) or anomaly
    assert anomaly is not None
    assert anomaly.entity == "GPU-6"


def _arrivals(detector: TelemetryGapDetector, gpus: list[str], t: float) -> None:
    detector.arrive([(N1, EntityId(g)) for g in gpus], t)


def test_gpu_that_falls_off_the_bus_is_a_gap() -> None:
    gaps = TelemetryGapDetector()
    gpus = [f"GPU-{i}" for i in range(8)]
    for t in range(0, 300, 10):
        _arrivals(gaps, gpus, float(t))
    for t in range(300, 500, 10):
        _arrivals(gaps, [g for g in gpus if g != "GPU-3"], float(t))
        found = gaps.check(float(t))
        if found:
            break
    assert [(a.entity, a.detector) for a in found] == [("GPU-3", "gaps")]
    assert found[0].score > found[0].threshold
    assert gaps.check(600.0) != []  # now the whole node is silent: one node-level gap
    assert [a.entity for a in gaps.check(700.0)] == []


def test_whole_node_silence_is_one_node_gap() -> None:
    gaps = TelemetryGapDetector()
    gpus = [f"GPU-{i}" for i in range(8)]
    for t in range(0, 300, 10):
        _arrivals(gaps, gpus, float(t))
    found = gaps.check(400.0)
    assert [(a.node, a.entity) for a in found] == [(N1, "node")]


def test_collector_restart_shorter_than_min_gap_is_not_a_gap() -> None:
    gaps = TelemetryGapDetector(min_gap_seconds=120.0)
    for t in range(0, 300, 10):
        _arrivals(gaps, ["GPU-0", "GPU-1"], float(t))
    _arrivals(gaps, ["GPU-1"], 360.0)  # GPU-0 missed 6 scrapes (60 s) during a restart
    assert gaps.check(360.0) == []
    _arrivals(gaps, ["GPU-0", "GPU-1"], 370.0)
    assert gaps.check(380.0) == []


def test_gap_rearms_after_samples_return() -> None:
    gaps = TelemetryGapDetector(min_gap_seconds=0.0)
    for t in range(0, 200, 10):
        _arrivals(gaps, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"], float(t))
    for t in range(200, 300, 10):
        _arrivals(gaps, ["GPU-1", "GPU-2", "GPU-3"], float(t))
    assert [a.entity for a in gaps.check(300.0)] == ["GPU-0"]
    _arrivals(gaps, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"], 310.0)
    for t in range(320, 420, 10):
        _arrivals(gaps, ["GPU-1", "GPU-2", "GPU-3"], float(t))
    assert [a.entity for a in gaps.check(420.0)] == ["GPU-0"]


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (HalfSpaceTreesDetector, {"quantile": 1.0}),
        (HalfSpaceTreesDetector, {"height": 0}),
        (StandardAbsoluteDeviationDetector, {"warmup_samples": 0}),
        (PeerComparison, {"min_peers": 1}),
        (PeerDetector, {"max_age_seconds": 0.0}),
        (TelemetryGapDetector, {"gap_factor": 1.0}),
    ],
)
def test_bad_arguments_fail_at_construction(factory: type, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        factory(**kwargs)


def test_peer_comparison_of_one_node_matches_the_grouped_computation() -> None:
    from analytics.peers import PeerComparison

    rng = np.random.default_rng(5)
    for trial in range(200):
        n = int(rng.integers(1, 10))
        peers = PeerComparison(
            min_scale=float(rng.choice([0.0, 1.0])), min_peers=int(rng.integers(2, 5))
        )
        v = rng.normal(60.0, 3.0, n)
        if trial % 3 == 0:
            v[:] = 60.0
        if trial % 5 == 0:
            v[0] = 90.0
        zeros = np.zeros(n, dtype=np.int64)
        fast = peers.compare(v, node=zeros, group=zeros)
        slow = peers._grouped(v, zeros, zeros)
        np.testing.assert_allclose(fast.z_node, slow.z_node)
        np.testing.assert_array_equal(fast.flagged, slow.flagged)
        np.testing.assert_array_equal(fast.node_flagged, slow.node_flagged)
        np.testing.assert_allclose(fast.z_fleet, slow.z_fleet)
