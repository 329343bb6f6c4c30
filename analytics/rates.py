"""Counters to rates, vectorised over many series: resets, wraps and saturating counters.

A counter sample becomes a rate (units per second) from the previous sample of its series:

* first sample of a series, or a non-increasing time: no rate (``valid`` is false);
* the value went up: ``(value - previous) / dt``;
* the value went down on a *wrapping* counter of ``bits`` bits whose previous value was in the
  top half of its range: a wrap, ``(value + 2^bits - previous) / dt``;
* the value went down otherwise: a reset (driver reload, reboot, ``perfquery -R``); the counter
  restarted from zero, so the increase is at least ``value`` (Prometheus ``rate()`` does the
  same) and ``reset`` is set;
* a *saturating* counter at all-ones (``2^bits - 1``) has stopped counting: the rate is a lower
  bound when it just got there and unknown once it stays there; ``saturated`` is set either way,
  and is itself a signal (a port that filled a 16-bit error counter needs attention).

The legacy InfiniBand PortCounters saturate rather than wrap (InfiniBand Architecture
Specification vol. 1, 16.1.3.5, PortCounters; as read by ``perfquery`` and exposed in
``/sys/class/infiniband/<hca>/ports/<n>/counters``): 4-bit LocalLinkIntegrityErrors and
ExcessiveBufferOverrunErrors, 8-bit LinkErrorRecovery, LinkDowned and the constraint errors,
16-bit SymbolErrors, PortRcvErrors, the remote-physical and switch-relay errors, XmitDiscards
and VL15Dropped; :data:`IB_SATURATING_BITS` maps the catalog names to those widths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analytics.windowing import (
    BoolArray,
    FloatArray,
    IntArray,
    SeriesBatch,
    grow,
    occurrence_rounds,
)

IB_SATURATING_BITS: dict[str, int] = {
    "ib_local_link_integrity_errors_total": 4,
    "ib_excessive_buffer_overrun_errors_total": 4,
    "ib_link_error_recovery_total": 8,
    "ib_link_downed_total": 8,
    "ib_port_xmit_constraint_errors_total": 8,
    "ib_port_rcv_constraint_errors_total": 8,
    "ib_symbol_errors_total": 16,
    "ib_port_rcv_errors_total": 16,
    "ib_port_rcv_remote_physical_errors_total": 16,
    "ib_port_rcv_switch_relay_errors_total": 16,
    "ib_port_xmit_discards_total": 16,
    "ib_vl15_dropped_total": 16,
}
"""Catalog name -> width in bits of the legacy InfiniBand counters, which stop at all-ones."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RateBatch:
    """Rates computed for a batch, aligned with it.

    Attributes:
        rates: Units per second, ``0.0`` where not ``valid``.
        valid: A rate could be computed.
        reset: The counter went down and was taken as a reset.
        wrapped: The counter went down and was taken as a wrap.
        saturated: The counter is at all-ones of a saturating width (the rate is a lower
            bound, or invalid when it was already there).
    """

    rates: FloatArray
    valid: BoolArray
    reset: BoolArray
    wrapped: BoolArray
    saturated: BoolArray


class CounterRates:
    """Turns counter samples of many series into rates, keeping the last sample per series.

    Counter kinds are set per series slot with :meth:`configure`; unconfigured series are
    plain monotonic counters (every decrease is a reset).

    Examples:
        >>> rates = CounterRates()
        >>> rates.configure(np.array([0]), bits=16, saturating=True)
        >>> def tick(value, at):
        ...     batch = SeriesBatch(series=np.array([0]), values=np.array([float(value)]),
        ...                         observed_at=np.array([float(at)]))
        ...     r = rates.rate_many(batch)
        ...     return float(r.rates[0]), bool(r.valid[0]), bool(r.saturated[0])
        >>> tick(65000, 0), tick(65500, 10), tick(65535, 20), tick(65535, 30)
        ((0.0, False, False), (50.0, True, False), (3.5, True, True), (0.0, False, True))
    """

    def __init__(self) -> None:
        self._size = 0
        self._value = np.zeros(0)
        self._at = np.zeros(0)
        self._has = np.zeros(0, dtype=bool)
        self._bits = np.zeros(0, dtype=np.int64)  # 0: unbounded
        self._saturating = np.zeros(0, dtype=bool)

    def _ensure(self, size: int) -> None:
        if size <= self._size:
            return
        self._size = size
        self._value = grow(self._value, size)
        self._at = grow(self._at, size)
        self._has = grow(self._has, size, False)
        self._bits = grow(self._bits, size, 0)
        self._saturating = grow(self._saturating, size, False)

    def configure(self, slots: IntArray, *, bits: int | None, saturating: bool = False) -> None:
        """Declare the counter width of ``slots``: wrapping, or saturating at all-ones.

        Raises:
            ValueError: ``bits`` is not in 1..64, or ``saturating`` without ``bits``.
        """
        if bits is not None and not 1 <= bits <= 64:
            raise ValueError(f"bits must be in 1..64, got {bits}")
        if saturating and bits is None:
            raise ValueError("a saturating counter needs its width in bits")
        self._ensure(int(slots.max(initial=-1)) + 1)
        self._bits[slots] = bits or 0
        self._saturating[slots] = saturating

    def rate_many(self, batch: SeriesBatch) -> RateBatch:
        """Compute the rate of each sample from the previous sample of its series.

        Samples of one series within a batch must be in time order; each is compared with
        the one before it.
        """
        self._ensure(int(batch.series.max(initial=-1)) + 1)
        n = batch.series.size
        rates, valid = np.zeros(n), np.zeros(n, dtype=bool)
        reset, wrapped, saturated = (np.zeros(n, dtype=bool) for _ in range(3))
        for positions in occurrence_rounds(batch.series):
            s = batch.series[positions]
            value, at = batch.values[positions], batch.observed_at[positions]
            prev, prev_at, has = self._value[s], self._at[s], self._has[s]
            bits, sat = self._bits[s], self._saturating[s]
            span = np.where(bits > 0, np.exp2(bits.astype(np.float64)), np.inf)
            top = span - 1.0
            dt = at - prev_at
            delta = value - prev
            down = delta < 0
            is_wrap = down & (bits > 0) & ~sat & (prev >= span / 2)
            is_reset = down & ~is_wrap
            increase = np.where(is_wrap, value + span - prev, np.where(is_reset, value, delta))
            at_top = sat & (value >= top)
            stuck = at_top & (prev >= top) & has
            ok = has & (dt > 0) & ~stuck
            with np.errstate(divide="ignore", invalid="ignore"):
                r = np.where(ok, increase / np.where(dt > 0, dt, 1.0), 0.0)
            rates[positions], valid[positions] = r, ok
            reset[positions], wrapped[positions] = is_reset & has, is_wrap & has
            saturated[positions] = at_top
            newer = ~has | (dt > 0)
            self._value[s[newer]], self._at[s[newer]] = value[newer], at[newer]
            self._has[s] = True
        return RateBatch(
            rates=rates, valid=valid, reset=reset, wrapped=wrapped, saturated=saturated
        )
