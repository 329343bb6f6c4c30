"""SPOT, DSPOT, running-quantile and EWMA thresholds (analytics/thresholds.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from analytics.thresholds import (
    DspotDetector,
    EwmaZScoreDetector,
    QuantileThresholdDetector,
    SpotDetector,
    fit_gpd,
    gpd_quantile,
)
from analytics.windowing import BatchVerdict, SeriesBatch, VectorDetector

FACTORIES: dict[str, Callable[[], VectorDetector]] = {
    "spot": lambda: SpotDetector(calibration_samples=200),
    "dspot": lambda: DspotDetector(calibration_samples=200, depth=10),
    "spot_both": lambda: SpotDetector(calibration_samples=200, side="both"),
    "quantile": lambda: QuantileThresholdDetector(warmup_samples=200),
    "ewma_z": lambda: EwmaZScoreDetector(warmup_samples=200),
}


def _batch(values: np.ndarray, t: float, series: np.ndarray | None = None) -> SeriesBatch:
    slots = np.arange(values.size) if series is None else series
    return SeriesBatch(series=slots, values=values, observed_at=np.full(values.size, t))


def _feed(det: VectorDetector, data: np.ndarray) -> list[BatchVerdict]:
    """Feed a (steps, series) matrix; return the verdicts."""
    return [det.score_many(_batch(row, float(t))) for t, row in enumerate(data)]


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_spike_after_warmup_is_flagged(name: str) -> None:
    rng = np.random.default_rng(1)
    det = FACTORIES[name]()
    data = 60.0 + rng.normal(0.0, 1.0, size=(400, 4))
    data[350, 2] = 95.0
    verdicts = _feed(det, data)
    assert verdicts[350].flagged[2]
    assert verdicts[350].scores[2] > verdicts[350].thresholds[2]
    assert verdicts[350].probability[2] > 0.9


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_no_alert_during_warmup(name: str) -> None:
    det = FACTORIES[name]()
    data = np.full((150, 2), 60.0)
    data[100, 0] = 1e6
    verdicts = _feed(det, data)
    assert not any(v.flagged.any() for v in verdicts)
    assert all(np.isinf(v.thresholds).all() for v in verdicts)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_flagged_points_are_not_learned(name: str) -> None:
    rng = np.random.default_rng(2)
    data = 60.0 + rng.normal(0.0, 1.0, size=(450, 3))
    spiked = data.copy()
    spiked[300, 1] = 500.0
    plain, with_spike = FACTORIES[name](), FACTORIES[name]()
    a, b = _feed(plain, data), _feed(with_spike, spiked)
    assert b[300].flagged[1]
    # Skipping the flagged point leaves the series exactly where it was...
    skipped = FACTORIES[name]()
    c = _feed(skipped, np.delete(data, 300, axis=0)[:300])
    c += [skipped.score_many(_batch(spiked[300], 300.0))]
    c += _feed_from(skipped, data[301:], start=301)
    for t in range(301, 450):
        np.testing.assert_array_equal(b[t].thresholds, c[t].thresholds)
        np.testing.assert_array_equal(b[t].flagged, c[t].flagged)
    # ...and the other series are untouched by it.
    for t in range(301, 450):
        assert b[t].thresholds[0] == a[t].thresholds[0]


def _feed_from(det: VectorDetector, data: np.ndarray, start: int) -> list[BatchVerdict]:
    return [det.score_many(_batch(row, float(start + t))) for t, row in enumerate(data)]


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_vectorised_equals_one_series_at_a_time(name: str) -> None:
    rng = np.random.default_rng(3)
    data = 10.0 + rng.standard_t(4, size=(300, 5))
    together = _feed(FACTORIES[name](), data)
    for s in range(5):
        alone = FACTORIES[name]()
        for t in range(300):
            v = alone.score_many(_batch(data[t, s : s + 1], float(t)))
            assert v.flagged[0] == together[t].flagged[s]
            assert v.thresholds[0] == pytest.approx(together[t].thresholds[s], rel=1e-9, abs=0)


def test_repeated_series_in_one_batch_are_taken_in_order() -> None:
    rng = np.random.default_rng(4)
    values = 60.0 + rng.normal(0.0, 1.0, size=600)
    one_by_one = SpotDetector(calibration_samples=200)
    expected = [one_by_one.score_many(_batch(values[i : i + 1], float(i))) for i in range(600)]
    batched = SpotDetector(calibration_samples=200)
    got = batched.score_many(
        SeriesBatch(
            series=np.zeros(600, dtype=np.int64), values=values, observed_at=np.arange(600.0)
        )
    )
    assert got.flagged.tolist() == [bool(v.flagged[0]) for v in expected]


def test_spot_false_alarm_rate_is_near_its_risk() -> None:
    rng = np.random.default_rng(5)
    det = SpotDetector(risk=1e-3, calibration_samples=300)
    data = rng.normal(0.0, 1.0, size=(1300, 400))
    flags = sum(int(v.flagged.sum()) for v in _feed(det, data)[300:])
    rate = flags / (1000 * 400)
    assert rate < 3e-3


def test_dspot_keeps_its_sensitivity_on_a_drifting_series() -> None:
    rng = np.random.default_rng(6)
    steps = 1500
    drift = np.linspace(0.0, 30.0, steps)[:, None] + rng.normal(0.0, 1.0, size=(steps, 20))
    drift[1400, 3] += 8.0
    spot = _feed(SpotDetector(calibration_samples=300), drift)
    dspot = _feed(DspotDetector(calibration_samples=300, depth=20), drift)
    # Drift turns every point into a SPOT peak: its tail fattens and an 8-sigma step is missed.
    assert not spot[1400].flagged[3]
    assert spot[1400].thresholds[3] > 100.0
    # DSPOT models the residual from the moving average, so the step stands out.
    assert dspot[1400].flagged[3]
    assert sum(int(v.flagged.sum()) for v in dspot) < 10


def test_relearn_after_ends_a_level_shift() -> None:
    data = np.r_[np.random.default_rng(7).normal(0.0, 1.0, 300), np.full(200, 50.0)]
    data = data + np.random.default_rng(8).normal(0.0, 0.1, 500)
    never = _feed(EwmaZScoreDetector(warmup_samples=100), data[:, None])
    relearn = _feed(EwmaZScoreDetector(warmup_samples=100, relearn_after=20), data[:, None])
    assert all(v.flagged[0] for v in never[300:])
    assert relearn[300].flagged[0]
    assert not relearn[499].flagged[0]


def test_grimshaw_fit_recovers_gpd_parameters() -> None:
    rng = np.random.default_rng(9)
    for gamma, sigma in ((0.3, 2.0), (-0.2, 1.0), (0.0, 0.5)):
        u = rng.random((1, 4000))
        y = sigma / gamma * (u**-gamma - 1.0) if gamma else -sigma * np.log(u)
        g, s = fit_gpd(y, np.ones_like(y, dtype=bool))
        assert g[0] == pytest.approx(gamma, abs=0.1)
        assert s[0] == pytest.approx(sigma, rel=0.1)
        # It is the maximum: at least as likely as the true parameters.
        assert _loglik(y[0], g[0], s[0]) >= _loglik(y[0], gamma, sigma)


def _loglik(y: np.ndarray, gamma: float, sigma: float) -> float:
    if abs(gamma) < 1e-12:
        return float(-y.size * np.log(sigma) - y.sum() / sigma)
    return float(-y.size * np.log(sigma) - (1 + 1 / gamma) * np.log1p(gamma * y / sigma).sum())


def test_gpd_quantile_matches_the_paper_formula() -> None:
    z = gpd_quantile(
        np.array([2.0]), np.array([0.2]), np.array([1.5]), 1e-4, np.array([1e4]), np.array([200.0])
    )
    assert z[0] == pytest.approx(2.0 + 1.5 / 0.2 * ((1e-4 * 1e4 / 200.0) ** -0.2 - 1.0))


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (SpotDetector, {"risk": 0.5}),
        (SpotDetector, {"level": 0.2}),
        (SpotDetector, {"calibration_samples": 5}),
        (SpotDetector, {"side": "sideways"}),
        (DspotDetector, {"depth": 0}),
        (QuantileThresholdDetector, {"quantile": 1.5}),
        (EwmaZScoreDetector, {"alpha": 0.0}),
    ],
)
def test_bad_arguments_fail_at_construction(factory: type, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        factory(**kwargs)


def test_constructor_keeps_arguments() -> None:
    det = DspotDetector(risk=1e-3, depth=7, side="both", seed=3)
    assert (det.risk, det.depth, det.side, det.seed) == (1e-3, 7, "both", 3)


@pytest.mark.parametrize("make", [lambda: SpotDetector(seed=0), lambda: DspotDetector(seed=0)])
def test_a_constant_series_is_never_flagged_however_long(make: Any) -> None:
    """After 1/q points of a constant series (no peaks), z_q must not fall below t."""
    detector = make()
    flagged = 0
    for start in range(0, 30_000, 1000):
        values = np.zeros(1000)
        for k in range(0, 1000, 250):  # one series, 1,000 ticks per batch call
            batch = SeriesBatch(
                series=np.zeros(250, dtype=np.int64),
                values=values[k : k + 250],
                observed_at=np.arange(start + k, start + k + 250, dtype=float),
            )
            flagged += int(detector.score_many(batch).flagged.sum())
    assert flagged == 0
    step = SeriesBatch(
        series=np.zeros(1, dtype=np.int64), values=np.array([1.0]), observed_at=np.array([30_000.0])
    )
    assert detector.score_many(step).flagged.all()  # a rise is still flagged
