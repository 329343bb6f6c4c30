"""Counters to rates: resets, wraps and saturating InfiniBand counters (analytics/rates.py)."""

from __future__ import annotations

import numpy as np
import pytest

from analytics.rates import IB_SATURATING_BITS, CounterRates
from analytics.windowing import SeriesBatch
from core.catalog import CATALOG, MetricType


def _tick(rates: CounterRates, slot: int, value: float, at: float):
    return rates.rate_many(
        SeriesBatch(series=np.array([slot]), values=np.array([value]), observed_at=np.array([at]))
    )


def test_first_sample_has_no_rate_then_rates_follow() -> None:
    rates = CounterRates()
    first = _tick(rates, 0, 100.0, 0.0)
    assert not first.valid[0]
    second = _tick(rates, 0, 160.0, 30.0)
    assert second.valid[0]
    assert second.rates[0] == pytest.approx(2.0)


def test_decrease_is_a_reset_counted_from_zero() -> None:
    rates = CounterRates()
    _tick(rates, 0, 1_000_000.0, 0.0)
    after = _tick(rates, 0, 50.0, 10.0)
    assert after.reset[0]
    assert after.valid[0]
    assert after.rates[0] == pytest.approx(5.0)


def test_wrapping_32_bit_counter() -> None:
    rates = CounterRates()
    rates.configure(np.array([0]), bits=32)
    _tick(rates, 0, 2.0**32 - 100.0, 0.0)
    after = _tick(rates, 0, 400.0, 10.0)
    assert after.wrapped[0]
    assert not after.reset[0]
    assert after.rates[0] == pytest.approx(50.0)


def test_wrapping_counter_low_in_its_range_is_a_reset() -> None:
    rates = CounterRates()
    rates.configure(np.array([0]), bits=32)
    _tick(rates, 0, 5_000.0, 0.0)
    after = _tick(rates, 0, 10.0, 10.0)
    assert after.reset[0]
    assert not after.wrapped[0]


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_saturating_legacy_ib_counter_stops_at_all_ones(bits: int) -> None:
    top = 2.0**bits - 1.0
    rates = CounterRates()
    rates.configure(np.array([0]), bits=bits, saturating=True)
    _tick(rates, 0, top - 3.0, 0.0)
    reached = _tick(rates, 0, top, 1.0)
    assert reached.saturated[0]
    assert reached.valid[0]  # a lower bound
    assert reached.rates[0] == pytest.approx(3.0)
    stuck = _tick(rates, 0, top, 2.0)
    assert stuck.saturated[0]
    assert not stuck.valid[0]  # unknown: the counter no longer counts
    cleared = _tick(rates, 0, 2.0, 3.0)  # perfquery -R
    assert cleared.reset[0]
    assert not cleared.saturated[0]
    assert not cleared.wrapped[0]


def test_duplicate_and_out_of_order_times() -> None:
    rates = CounterRates()
    _tick(rates, 0, 10.0, 10.0)
    assert not _tick(rates, 0, 20.0, 10.0).valid[0]
    assert not _tick(rates, 0, 20.0, 5.0).valid[0]
    assert _tick(rates, 0, 30.0, 20.0).rates[0] == pytest.approx(2.0)


def test_many_series_and_repeats_in_one_batch() -> None:
    rates = CounterRates()
    batch = SeriesBatch(
        series=np.array([0, 1, 0, 1, 0]),
        values=np.array([0.0, 10.0, 5.0, 30.0, 15.0]),
        observed_at=np.array([0.0, 0.0, 1.0, 2.0, 2.0]),
    )
    out = rates.rate_many(batch)
    assert out.valid.tolist() == [False, False, True, True, True]
    np.testing.assert_allclose(out.rates, [0.0, 0.0, 5.0, 10.0, 10.0])


def test_saturating_widths_name_catalogued_ib_counters() -> None:
    counters = {spec.name for spec in CATALOG if spec.type is MetricType.COUNTER}
    assert set(IB_SATURATING_BITS) <= counters
    assert set(IB_SATURATING_BITS.values()) == {4, 8, 16}


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ValueError, match="width"):
        CounterRates().configure(np.array([0]), bits=None, saturating=True)
    with pytest.raises(ValueError, match="bits"):
        CounterRates().configure(np.array([0]), bits=65)
