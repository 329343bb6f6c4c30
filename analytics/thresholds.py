"""Adaptive per-series thresholds, vectorised over many series.

* :class:`SpotDetector` -- SPOT, streaming peaks-over-threshold (Siffer, Fouque, Termier,
  Largouet, "Anomaly Detection in Streams with Extreme Value Theory", KDD 2017): an initial
  threshold ``t`` (the ``level`` quantile of a calibration window), a generalised Pareto
  distribution (GPD) fitted to the excesses over ``t`` by maximum likelihood with Grimshaw's
  one-dimensional reduction (Grimshaw, Technometrics 35(2), 1993), and the alert threshold
  ``z_q = t + sigma/gamma ((q n / N_t)^-gamma - 1)`` for a risk ``q``. Points above ``z_q``
  are flagged and not learned; points between ``t`` and ``z_q`` become peaks and refit the GPD.
* :class:`DspotDetector` -- DSPOT (same paper): SPOT on the residual from a moving average of
  the last ``depth`` normal values, for drifting series.
* :class:`QuantileThresholdDetector` -- a running quantile per series (stochastic
  approximation with a step scaled by a running mean absolute deviation; O(1) per sample).
* :class:`EwmaZScoreDetector` -- an EWMA z-score; also the bare-numpy baseline of
  ``benchmarks/detectors.py``.

Differences from the paper, all for bounded memory and vectorisation: the peaks of a series
live in a ring buffer of ``max_peaks`` (the most recent excesses), while ``n`` and ``N_t`` keep
counting all points, and the GPD of a series is refitted only when it gains a peak.

Cost (``benchmarks/detectors.py``): the refits dominate (about 2 % of points are peaks, and
each refit evaluates the profile likelihood at about 45 points). They touch only the peak
columns in use, reuse a golden-section point whenever its abscissa is bit-for-bit the one
needed again, and run under one ``errstate``; a whole tick of the fleet in slot order reads
state through views instead of gathers, and the tail probability is evaluated only above
``t``. Every result equals the plain evaluation exactly (same floats, not just close).
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np

from analytics.windowing import (
    BatchVerdict,
    BoolArray,
    FloatArray,
    IntArray,
    VectorDetector,
    grow,
)

logger = logging.getLogger(__name__)

Side = Literal["upper", "lower", "both"]

_GRID = 12
_REFINE = 14
_EPS = 1e-8


def _profile_loglik(
    x: FloatArray, peaks: FloatArray, count: FloatArray, ymax: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """Grimshaw's profile log-likelihood of a GPD at ``x = gamma / sigma``.

    Args:
        x: Candidate ratios, shape ``(k, g)``.
        peaks: Excesses, shape ``(k, p)``, zero-padded beyond each row's ``count`` (a zero
            adds ``log(1 + 0) = 0``, so padding needs no mask).
        count: Peaks per row, shape ``(k, 1)``.
        ymax: Largest peak per row, shape ``(k, 1)``; ``x`` must exceed ``-1 / ymax``.

    Returns:
        ``(loglik, gamma)``, shape ``(k, g)`` each; ``-inf`` where ``1 + x y <= 0``.

    Call it under ``np.errstate(invalid="ignore", divide="ignore")`` (as :func:`fit_gpd`
    does, once for all its calls).
    """
    valid = 1.0 + x * ymax > 0
    safe = np.where(valid, x, 0.0)
    terms = safe[:, :, None] * peaks[:, None, :]
    np.log1p(terms, out=terms)  # the bulk of a fit: one allocation, reused in place
    gamma = terms.sum(axis=2)
    gamma /= count
    sigma = gamma / safe  # the caller ignores divide and invalid (0 / 0, log of <= 0)
    loglik = -count * (np.log(sigma) + 1.0 + gamma)
    bad = ~valid | ~np.isfinite(loglik) | (sigma <= 0)
    loglik[bad] = -np.inf
    return loglik, gamma


def _used_columns(mask: BoolArray) -> int:
    """Columns of ``mask`` up to its last set entry, rounded up to a multiple of 8.

    numpy sums a contiguous row of 8 to 128 floats with eight running partial sums and no
    tail when the length is a multiple of 8, so trailing zero columns cut this way leave every
    row's sum bit-for-bit what it was over the full width: trimming is exact, not approximate.
    """
    if mask.shape[1] > 128:  # beyond one pairwise block the sum order depends on the width
        return int(mask.shape[1])
    used = np.flatnonzero(mask.any(axis=0))
    last = int(used[-1]) + 1 if used.size else 1
    return min(int(mask.shape[1]), -(-last // 8) * 8)


def fit_gpd(
    peaks: FloatArray, mask: BoolArray, *, min_shape: float | None = None
) -> tuple[FloatArray, FloatArray]:
    """Fit a GPD to each row of excesses by maximum likelihood (Grimshaw's reduction).

    Grimshaw (1993) reduces the two-parameter likelihood to one equation in
    ``x = gamma / sigma``: its roots are the stationary points of the profile likelihood
    ``l(x) = -n (log(gamma(x)/x) + 1 + gamma(x))`` with ``gamma(x) = mean(log(1 + x Y))``.
    As in Siffer et al.'s reference code, the roots are sought on ``(-1/Y_max, 0)`` and on
    ``(0, 2 (mean - min) / min^2)``, and the candidate with the
    highest likelihood wins, the exponential (``gamma = 0``, ``sigma = mean``) included.
    Here each interval is scanned on a grid and the best grid point refined by golden-section
    search, all vectorised over rows.

    Cost: ``12 * 2 + 2 * 14 + 1`` likelihood evaluations per row at most, each ``p`` ``log1p``
    over the used columns only (peaks beyond the last masked column are not touched); a
    golden-section point whose abscissa is bit-for-bit the one evaluated in the previous step
    is reused instead of being evaluated again, so the result equals a plain evaluation of
    every point exactly.

    Args:
        peaks: Excesses over the initial threshold, shape ``(k, p)``, positive where masked.
        mask: Which entries are peaks, shape ``(k, p)``; rows need at least one.
        min_shape: Floor on ``gamma``; a fit below it is replaced by ``gamma = min_shape`` with
            the sample mean kept. ``None`` keeps the plain maximum-likelihood fit.

    Returns:
        ``(gamma, sigma)``, shape ``(k,)`` each.

    Examples:
        >>> rng = np.random.default_rng(0)
        >>> y = rng.exponential(2.0, size=(1, 2000))
        >>> g, s = fit_gpd(y, np.ones_like(y, dtype=bool))
        >>> abs(float(g[0])) < 0.05, round(float(s[0]), 1)
        (True, 2.0)
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        return _fit_gpd(peaks, mask, min_shape)


def _fit_gpd(
    peaks: FloatArray, mask: BoolArray, min_shape: float | None
) -> tuple[FloatArray, FloatArray]:
    k = peaks.shape[0]
    width = _used_columns(mask)
    mask = mask[:, :width]
    peaks = np.where(mask, peaks[:, :width], 0.0)
    count = np.maximum(mask.sum(axis=1), 1).astype(np.float64)
    ymin = np.where(mask, peaks, np.inf).min(axis=1)
    ymax = peaks.max(axis=1, where=mask, initial=-np.inf)
    ymean = peaks.sum(axis=1) / count
    ymin = np.maximum(ymin, _EPS * np.maximum(ymean, _EPS))
    exp_sigma = np.maximum(ymean, _EPS)
    exp_loglik = -count * (np.log(exp_sigma) + 1.0)
    a = -1.0 / np.maximum(ymax, _EPS)
    c = 2.0 * (ymean - ymin) / (ymin * ymin)
    u = np.linspace(0.0, 1.0, _GRID + 2)[1:-1]
    left = a[:, None] * (1.0 - u[None, :] ** 2) * (1.0 - 1e-9)
    # Grimshaw's upper bound for a positive root is 2 (mean - min) / min^2; the lower end
    # is kept near 0 (a positive root can lie below Siffer's ``b``), scanned on a log grid.
    lo = np.log(1e-4 / np.maximum(ymean, _EPS))
    hi = np.log(np.maximum(c, 10.0 * np.exp(lo)))
    right = np.exp(lo[:, None] + (hi - lo)[:, None] * u[None, :])
    grid = np.concatenate([left, right], axis=1)
    cnt, top = count[:, None], ymax[:, None]
    loglik, grid_gamma = _profile_loglik(grid, peaks, cnt, top)
    best = np.argmax(loglik, axis=1)
    rows = np.arange(k)
    # Bracket the best grid point by its neighbours within the same interval, then refine.
    lo_i = np.where(best % _GRID == 0, best, best - 1)
    hi_i = np.where(best % _GRID == _GRID - 1, best, best + 1)
    lo_x = np.where(
        best % _GRID == 0, np.where(best < _GRID, a * (1 - 1e-9), np.exp(lo)), grid[rows, lo_i]
    )
    hi_x = np.where(
        best % _GRID == _GRID - 1, np.where(best < _GRID, -_EPS * np.abs(a), c), grid[rows, hi_i]
    )
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    # Golden section: each step keeps one interior point of the last, so only the other is
    # new; the kept one is reused where its abscissa is bit-for-bit the one this step needs.
    kept_x = np.full(k, np.nan)
    kept_l = np.full(k, -np.inf)
    for _ in range(_REFINE):
        step = ratio * (hi_x - lo_x)
        x1 = hi_x - step
        x2 = lo_x + step
        reuse1 = x1 == kept_x
        reuse2 = ~reuse1 & (x2 == kept_x)
        both = ~(reuse1 | reuse2)
        fresh = np.where(reuse1, x2, x1)  # the point not kept (x1 where neither is)
        n_both = int(np.count_nonzero(both))
        if n_both == k:
            l12, _ = _profile_loglik(np.stack([x1, x2], axis=1), peaks, cnt, top)
            l1, l2 = l12[:, 0], l12[:, 1]
        elif 4 * n_both > k:  # one (k, 2) call beats a second call on a large subset
            l12, _ = _profile_loglik(
                np.stack([fresh, np.where(both, x2, fresh)], axis=1), peaks, cnt, top
            )
            lf = l12[:, 0]
            l1 = np.where(reuse1, kept_l, lf)
            l2 = np.where(reuse1, lf, np.where(reuse2, kept_l, l12[:, 1]))
        else:
            lf, _ = _profile_loglik(fresh[:, None], peaks, cnt, top)
            lf = lf[:, 0]
            l1 = np.where(reuse1, kept_l, lf)
            l2 = np.where(reuse1, lf, np.where(reuse2, kept_l, lf))
            if n_both:
                lb, _ = _profile_loglik(x2[both, None], peaks[both], cnt[both], top[both])
                l2[both] = lb[:, 0]
        move_up = l2 > l1
        lo_x = np.where(move_up, x1, lo_x)
        hi_x = np.where(move_up, hi_x, x2)
        kept_x = np.where(move_up, x2, x1)
        kept_l = np.where(move_up, l2, l1)
    x_best = 0.5 * (lo_x + hi_x)
    lx, gx = _profile_loglik(x_best[:, None], peaks, cnt, top)
    grid_l, grid_g = loglik[rows, best], grid_gamma[rows, best]
    pick_root = lx[:, 0] >= grid_l  # np.argmax's first-wins tie rule of the pair
    root_loglik = np.where(pick_root, lx[:, 0], grid_l)
    root_gamma = np.where(pick_root, gx[:, 0], grid_g)
    root_x = np.where(pick_root, x_best, grid[rows, best])
    use_root = (root_loglik > exp_loglik) & np.isfinite(root_loglik) & (np.abs(root_gamma) > 1e-9)
    out_gamma = np.where(use_root, root_gamma, 0.0)
    out_sigma = np.where(use_root, root_gamma / root_x, exp_sigma)
    if min_shape is not None:
        # Below the floor, keep the sample mean (sigma / (1 - gamma)) with gamma at the floor.
        low = out_gamma < min_shape
        out_sigma = np.where(low, ymean * (1.0 - min_shape), out_sigma)
        out_gamma = np.where(low, min_shape, out_gamma)
    return out_gamma, out_sigma


def gpd_quantile(
    t: FloatArray, gamma: FloatArray, sigma: FloatArray, q: float, n: FloatArray, nt: FloatArray
) -> FloatArray:
    """SPOT's alert threshold ``z_q`` (Siffer et al. 2017, eq. 1), vectorised.

    Args:
        t: Initial thresholds.
        gamma: GPD shapes.
        sigma: GPD scales (positive).
        q: Risk: the probability of a normal point exceeding ``z_q``, in (0, 1).
        n: Points seen per series.
        nt: Peaks seen per series.

    Examples:
        >>> z = gpd_quantile(np.array([1.0]), np.array([0.0]), np.array([1.0]), 1e-3,
        ...                  np.array([1000.0]), np.array([20.0]))
        >>> round(float(z[0]), 3)  # 1 - log(1e-3 * 1000 / 20)
        3.996
    """
    r = q * n / np.maximum(nt, 1.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        power = (np.power(r, -gamma) - 1.0) / gamma
    power = np.where(np.abs(gamma) < 1e-9, -np.log(r), power)
    # With fewer peaks than q n (a constant series: one nominal peak, n growing), the risk-q
    # quantile would fall below t and flag every normal point from then on; it never goes
    # below the initial threshold.
    return t + sigma * np.maximum(power, 0.0)


def _tail_probability(
    excess: FloatArray, gamma: FloatArray, sigma: FloatArray, ratio: FloatArray
) -> FloatArray:
    """Return P(X > t + excess) under the tail: ``ratio (1 + gamma excess / sigma)^(-1/gamma)``."""
    z = np.maximum(excess, 0.0) / np.maximum(sigma, _EPS)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        tail = np.power(np.maximum(1.0 + gamma * z, 0.0), -1.0 / gamma)
    tail = np.where(np.abs(gamma) < 1e-9, np.exp(-z), tail)
    return np.clip(ratio * tail, 0.0, 1.0)


Index = IntArray | slice


def _dense(slots: IntArray) -> Index:
    """Return ``slice(0, n)`` when ``slots`` is ``0, 1, ..., n - 1``, else ``slots``.

    A whole tick of the fleet comes in slot order; its state is then read through views
    instead of being gathered (a gather per state array costs about 1 ns per series).
    """
    n = slots.size
    if n and slots[0] == 0 and slots[-1] == n - 1 and (n == 1 or bool((np.diff(slots) == 1).all())):
        return slice(0, n)
    return slots


class SpotDetector(VectorDetector):
    """SPOT: streaming peaks-over-threshold with a GPD tail per series (Siffer et al. 2017).

    Scores before learning; a flagged point is never learned (it neither becomes a peak nor
    moves a DSPOT average). No alert before ``depth + calibration_samples`` points of a series.

    Args:
        risk: ``q``, the probability that a normal point exceeds the alert threshold, (0, 0.1).
        level: Quantile of the calibration window used as the initial threshold ``t``, (0.5, 1).
        calibration_samples: Points per series used to pick ``t`` and the first GPD (the
            warm-up), at least 20.
        max_peaks: Most recent excesses kept per series for the GPD fit, at least 8.
        depth: DSPOT moving-average depth; 0 is plain SPOT.
        side: ``upper`` flags high values, ``lower`` low ones, ``both`` either (two tails).
        min_shape: Floor on the GPD shape ``gamma`` (``None``: plain MLE). With a few dozen
            peaks the MLE of ``gamma`` is biased low, and a short-tailed fit puts ``z_q``
            just above the largest peak; since flagged points are never learned, that fit
            then never loosens. The floor keeps the tail at least as heavy as ``gamma``.
        relearn_after: After this many consecutive flagged points a series is learned again
            (a lasting level shift is reported once, not forever); ``None`` never relearns.
        seed: Unused (SPOT is deterministic); accepted for a uniform detector API.

    Raises:
        ValueError: An argument is out of range.
    """

    name = "spot"

    def __init__(
        self,
        *,
        risk: float = 1e-4,
        level: float = 0.98,
        calibration_samples: int = 500,
        max_peaks: int = 64,
        depth: int = 0,
        side: Side = "upper",
        min_shape: float | None = 0.0,
        relearn_after: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 < risk < 0.1:
            raise ValueError(f"risk must be in (0, 0.1), got {risk!r}")
        if not 0.5 < level < 1.0:
            raise ValueError(f"level must be in (0.5, 1), got {level!r}")
        if calibration_samples < 20:
            raise ValueError(f"calibration_samples must be at least 20, got {calibration_samples}")
        if max_peaks < 8:
            raise ValueError(f"max_peaks must be at least 8, got {max_peaks}")
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        if side not in ("upper", "lower", "both"):
            raise ValueError(f"side must be upper, lower or both, got {side!r}")
        self.risk = risk
        self.level = level
        self.calibration_samples = calibration_samples
        self.max_peaks = max_peaks
        self.depth = depth
        self.side = side
        self.min_shape = min_shape
        self.relearn_after = relearn_after
        self.seed = seed
        self._tails = 2 if side == "both" else 1
        self._size = 0
        self._seen = np.zeros(0, dtype=np.int64)
        self._calib = np.zeros((0, calibration_samples), dtype=np.float64)
        self._window = np.zeros((0, max(depth, 1)), dtype=np.float64)
        self._wsum = np.zeros(0)
        # Per tail (rows = slot * tails + tail):
        self._t = np.zeros(0)
        self._z = np.full(0, np.inf)
        self._gamma = np.zeros(0)
        self._sigma = np.ones(0)
        self._n = np.zeros(0)
        self._nt = np.zeros(0)
        self._peaks = np.zeros((0, max_peaks), dtype=np.float64)
        self._npeaks = np.zeros(0, dtype=np.int64)

    def _ensure(self, size: int) -> None:
        if size <= self._size:
            return
        self._size = size
        tails = size * self._tails
        self._seen = grow(self._seen, size, 0)
        self._calib = grow(self._calib, size)
        self._window = grow(self._window, size)
        self._wsum = grow(self._wsum, size)
        self._t = grow(self._t, tails)
        self._z = grow(self._z, tails, np.inf)
        self._gamma = grow(self._gamma, tails)
        self._sigma = grow(self._sigma, tails, 1.0)
        self._n = grow(self._n, tails)
        self._nt = grow(self._nt, tails)
        self._peaks = grow(self._peaks, tails)
        self._npeaks = grow(self._npeaks, tails, 0)

    def memory_bytes_per_series(self) -> int:
        """State bytes per tracked series (excluding the key index)."""
        per_tail = 8 * (6 + self.max_peaks + 1)
        return 8 * (1 + self.calibration_samples + max(self.depth, 1) + 1) + per_tail * self._tails

    def _tail_values(self, slots: IntArray, values: FloatArray) -> tuple[IntArray, FloatArray]:
        if self._tails == 1:
            return slots, (values if self.side == "upper" else -values)
        rows = np.stack([slots * 2, slots * 2 + 1], axis=1).ravel()
        return rows, np.stack([values, -values], axis=1).ravel()

    def _tail_at(self, at: Index, values: FloatArray) -> tuple[Index, FloatArray]:
        """:meth:`_tail_values` for an index that may be a leading slice (see :func:`_dense`)."""
        if not isinstance(at, slice):
            return self._tail_values(at, values)
        if self._tails == 1:
            return at, (values if self.side == "upper" else -values)
        return slice(0, 2 * at.stop), np.stack([values, -values], axis=1).ravel()

    def _probability(self, rows: Index, excess: FloatArray) -> FloatArray:
        """Return ``1 - P(X > t + excess)`` where ``excess > 0``, else 0.

        The tail is evaluated only for the few points above ``t`` (about ``1 - level``).
        """
        prob = np.zeros(excess.size)
        pos = np.flatnonzero(excess > 0)
        if pos.size:
            sub = pos if isinstance(rows, slice) else rows[pos]
            prob[pos] = 1.0 - _tail_probability(
                excess[pos], self._gamma[sub], self._sigma[sub], self._nt[sub] / self._n[sub]
            )
        return prob

    def _refit(self, rows: IntArray) -> None:
        if rows.size == 0:
            return
        count = np.minimum(self._npeaks[rows], self.max_peaks)
        mask = np.arange(self.max_peaks)[None, :] < count[:, None]
        gamma, sigma = fit_gpd(self._peaks[rows], mask, min_shape=self.min_shape)
        self._gamma[rows], self._sigma[rows] = gamma, sigma
        self._z[rows] = gpd_quantile(
            self._t[rows], gamma, sigma, self.risk, self._n[rows], self._nt[rows]
        )

    def _add_peaks(self, rows: IntArray, excess: FloatArray) -> None:
        position = self._npeaks[rows] % self.max_peaks
        self._peaks[rows, position] = excess
        self._npeaks[rows] += 1
        self._nt[rows] += 1

    def _calibrate(self, slots: IntArray) -> None:
        data = self._calib[slots]
        rows, tails = self._tail_values(slots, np.zeros(slots.size))
        del tails
        if self._tails == 1:
            tail_data = data if self.side == "upper" else -data
        else:
            tail_data = np.stack([data, -data], axis=1).reshape(-1, data.shape[1])
        t = np.quantile(tail_data, self.level, axis=1, method="lower")
        excess = tail_data - t[:, None]
        is_peak = excess > 0
        self._t[rows] = t
        self._n[rows] = tail_data.shape[1]
        self._nt[rows] = is_peak.sum(axis=1)
        # Keep the most recent max_peaks excesses, oldest first.
        order = np.argsort(~is_peak, axis=1, kind="stable")
        packed = np.take_along_axis(np.where(is_peak, excess, 0.0), order, axis=1)
        counts = is_peak.sum(axis=1)
        keep = np.minimum(counts, self.max_peaks)
        start = counts - keep
        idx = start[:, None] + np.arange(self.max_peaks)[None, :]
        idx = np.minimum(idx, tail_data.shape[1] - 1)
        self._peaks[rows] = np.where(
            np.arange(self.max_peaks)[None, :] < keep[:, None],
            np.take_along_axis(packed, idx, axis=1),
            0.0,
        )
        self._npeaks[rows] = keep
        no_peaks = keep == 0
        if no_peaks.any():  # a constant calibration window: any rise is a peak
            self._peaks[rows[no_peaks], 0] = _EPS
            self._npeaks[rows[no_peaks]] = 1
            self._nt[rows[no_peaks]] = 1
        self._refit(rows)

    def _step(self, slots: IntArray, values: FloatArray) -> BatchVerdict:
        n = slots.size
        at = _dense(slots)
        seen = self._seen[at]
        depth = self.depth
        # Residual from the moving average of the last `depth` normal values (DSPOT).
        x = values - self._wsum[at] / np.maximum(np.minimum(seen, depth), 1) if depth else values
        calibrating = seen < depth + self.calibration_samples
        all_warm = not calibrating.any()
        warm = ~calibrating
        any_warm = all_warm or bool(warm.any())
        if any_warm:
            # A whole warm tick (the usual case) works on views and fresh arrays throughout;
            # a mixed tick gathers its warm part first.
            rows, tx = self._tail_at(at if all_warm else slots[warm], x if all_warm else x[warm])
            z = self._z[rows]
            over = tx > z
            excess = tx - self._t[rows]
            prob = self._probability(rows, excess)
            if self._tails == 2:
                over2 = over.reshape(-1, 2)
                prob2 = prob.reshape(-1, 2)
                tx2, z2 = tx.reshape(-1, 2), z.reshape(-1, 2)
                pick = np.argmax(prob2 + over2, axis=1)
                r = np.arange(tx2.shape[0])
                w_scores, w_thresholds = tx2[r, pick], z2[r, pick]
                w_flagged: BoolArray = np.any(over2, axis=1)
                w_probability = prob2[r, pick]
            else:
                w_scores, w_thresholds, w_flagged, w_probability = tx, z, over, prob
        if all_warm:
            scores = np.array(w_scores, dtype=np.float64)  # copies: never a view of state
            thresholds = np.array(w_thresholds, dtype=np.float64)
            flagged, probability = w_flagged, w_probability
        else:
            scores = np.zeros(n)
            thresholds = np.full(n, np.inf)
            flagged = np.zeros(n, dtype=bool)
            probability = np.zeros(n)
            if any_warm:
                scores[warm], thresholds[warm] = w_scores, w_thresholds
                flagged[warm], probability[warm] = w_flagged, w_probability
            cs = slots[calibrating]
            position = seen[calibrating] - depth
            in_calib = position >= 0
            if in_calib.any():
                self._calib[cs[in_calib], position[in_calib]] = x[calibrating][in_calib]
                done = cs[in_calib][position[in_calib] == self.calibration_samples - 1]
                if done.size:
                    self._calibrate(done)
        # Learn only from points that were not flagged (or end a long run of flags).
        learn = self._learn_mask(slots, flagged)
        learn_all = bool(learn.all())
        if any_warm:
            if all_warm and learn_all:
                lr: Index = rows
                le = excess
            else:
                normal_rows = np.repeat(learn if all_warm else learn[warm], self._tails)
                row_array = np.arange(rows.stop) if isinstance(rows, slice) else rows
                lr, le = row_array[normal_rows], excess[normal_rows]
            self._n[lr] += 1
            self._z[lr] = gpd_quantile(
                self._t[lr], self._gamma[lr], self._sigma[lr], self.risk, self._n[lr], self._nt[lr]
            )
            peak = le > 0
            if peak.any():
                peak_rows = np.flatnonzero(peak) if isinstance(lr, slice) else lr[peak]
                self._add_peaks(peak_rows, le[peak])
                self._refit(peak_rows)  # distinct: a round holds each series once
        if depth:
            ls = slots if learn_all else slots[learn]
            lv = values if learn_all else values[learn]
            slot_in_window = self._seen[ls] % depth
            self._wsum[ls] += lv - self._window[ls, slot_in_window]
            self._window[ls, slot_in_window] = lv
        self._seen[at if learn_all else slots[learn]] += 1
        return BatchVerdict(
            scores=scores, thresholds=thresholds, flagged=flagged, probability=probability
        )


class DspotDetector(SpotDetector):
    """DSPOT: SPOT on the residual from a moving average of normal values (Siffer et al. 2017).

    Same arguments as :class:`SpotDetector`; ``depth`` defaults to 20.
    """

    name = "dspot"

    def __init__(
        self,
        *,
        risk: float = 1e-4,
        level: float = 0.98,
        calibration_samples: int = 500,
        max_peaks: int = 64,
        depth: int = 20,
        side: Side = "upper",
        min_shape: float | None = 0.0,
        relearn_after: int | None = None,
        seed: int | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"DSPOT needs depth >= 1, got {depth}")
        super().__init__(
            risk=risk,
            level=level,
            calibration_samples=calibration_samples,
            max_peaks=max_peaks,
            depth=depth,
            side=side,
            min_shape=min_shape,
            relearn_after=relearn_after,
            seed=seed,
        )


class _RunningStatsDetector(VectorDetector):
    """Base of the O(1) detectors: float arrays named in ``_STATE`` and a count per series.

    Subclasses check their own arguments first, then call ``super().__init__``.
    """

    _STATE: tuple[str, ...] = ()

    def __init__(self, *, warmup_samples: int, relearn_after: int | None, seed: int | None) -> None:
        super().__init__()
        if warmup_samples < 1:
            raise ValueError(f"warmup_samples must be >= 1, got {warmup_samples}")
        self.warmup_samples = warmup_samples
        self.relearn_after = relearn_after
        self.seed = seed
        self._size = 0
        for name in self._STATE:
            setattr(self, name, np.zeros(0))
        self._seen = np.zeros(0, dtype=np.int64)

    def memory_bytes_per_series(self) -> int:
        """State bytes per tracked series (excluding the key index)."""
        return (len(self._STATE) + 1) * 8

    def _ensure(self, size: int) -> None:
        if size <= self._size:
            return
        self._size = size
        for name in self._STATE:
            setattr(self, name, grow(getattr(self, name), size))
        self._seen = grow(self._seen, size, 0)


class QuantileThresholdDetector(_RunningStatsDetector):
    """Running-quantile threshold per series, O(1) state and time per sample.

    The ``quantile`` of each series is tracked by stochastic approximation,
    ``Q += eta * s * (q - 1[x <= Q]) / max(q, 1 - q)``, with ``s`` a running mean absolute
    deviation so the step follows the series' scale. A point above ``Q + margin * s`` is
    flagged and not learned.

    Args:
        quantile: Quantile tracked, in (0.5, 1).
        margin: Multiples of the running absolute deviation added to the quantile, >= 0.
        learning_rate: ``eta``, in (0, 1].
        warmup_samples: Points per series before the first alert, >= 1.
        relearn_after: After this many consecutive flagged points a series is learned again;
            ``None`` never relearns.
        seed: Unused (deterministic); accepted for a uniform detector API.

    Raises:
        ValueError: An argument is out of range.
    """

    name = "quantile"
    _STATE = ("_q", "_mean", "_mad")
    _q: FloatArray
    _mean: FloatArray
    _mad: FloatArray

    def __init__(
        self,
        *,
        quantile: float = 0.99,
        margin: float = 3.0,
        learning_rate: float = 0.05,
        warmup_samples: int = 100,
        relearn_after: int | None = None,
        seed: int | None = None,
    ) -> None:
        if not 0.5 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0.5, 1), got {quantile!r}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin!r}")
        if not 0.0 < learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be in (0, 1], got {learning_rate!r}")
        super().__init__(warmup_samples=warmup_samples, relearn_after=relearn_after, seed=seed)
        self.quantile = quantile
        self.margin = margin
        self.learning_rate = learning_rate

    def _step(self, slots: IntArray, values: FloatArray) -> BatchVerdict:
        seen = self._seen[slots]
        first = seen == 0
        q, mean, mad = self._q[slots], self._mean[slots], self._mad[slots]
        q = np.where(first, values, q)
        mean = np.where(first, values, mean)
        scale = np.maximum(mad, 1e-9 * np.maximum(np.abs(mean), 1.0))
        threshold = q + self.margin * scale
        warm = seen >= self.warmup_samples
        flagged = warm & (values > threshold)
        thresholds = np.where(warm, threshold, np.inf)
        with np.errstate(over="ignore"):
            logistic = 1.0 / (1.0 + np.exp(-(values - threshold) / scale))
        probability = np.where(warm, logistic, 0.0)
        learn = self._learn_mask(slots, flagged)
        ls, lv = slots[learn], values[learn]
        rate = np.maximum(self.learning_rate, 1.0 / (seen[learn] + 1.0))
        d = np.abs(lv - mean[learn])
        self._mad[ls] = np.where(first[learn], 0.0, mad[learn] + rate * (d - mad[learn]))
        self._mean[ls] = mean[learn] + rate * (lv - mean[learn])
        step = self.learning_rate * scale[learn] / max(self.quantile, 1.0 - self.quantile)
        self._q[ls] = q[learn] + step * (self.quantile - (lv <= q[learn]))
        self._seen[ls] += 1
        return BatchVerdict(
            scores=values.astype(np.float64, copy=False),
            thresholds=thresholds,
            flagged=flagged,
            probability=probability,
        )


class EwmaZScoreDetector(_RunningStatsDetector):
    """Exponentially weighted mean and variance per series; flags ``|z| > z_threshold``.

    Args:
        alpha: EWMA weight of the newest point, in (0, 1).
        z_threshold: Alert when the absolute z-score exceeds this, > 0.
        warmup_samples: Points per series before the first alert, >= 1.
        relearn_after: After this many consecutive flagged points a series is learned again;
            ``None`` never relearns.
        seed: Unused; accepted for a uniform detector API.

    Raises:
        ValueError: An argument is out of range.
    """

    name = "ewma_z"
    _STATE = ("_mean", "_var")
    _mean: FloatArray
    _var: FloatArray

    def __init__(
        self,
        *,
        alpha: float = 0.01,
        z_threshold: float = 6.0,
        warmup_samples: int = 100,
        relearn_after: int | None = None,
        seed: int | None = None,
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        if z_threshold <= 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold!r}")
        super().__init__(warmup_samples=warmup_samples, relearn_after=relearn_after, seed=seed)
        self.alpha = alpha
        self.z_threshold = z_threshold

    def _step(self, slots: IntArray, values: FloatArray) -> BatchVerdict:
        seen = self._seen[slots]
        mean = np.where(seen == 0, values, self._mean[slots])
        var = self._var[slots]
        std = np.sqrt(var) + 1e-9 * np.maximum(np.abs(mean), 1.0)
        z = np.abs(values - mean) / std
        warm = seen >= self.warmup_samples
        flagged = warm & (z > self.z_threshold)
        learn = self._learn_mask(slots, flagged)
        ls = slots[learn]
        rate = np.maximum(self.alpha, 1.0 / (seen[learn] + 1.0))
        diff = values[learn] - mean[learn]
        self._mean[ls] = mean[learn] + rate * diff
        self._var[ls] = (1.0 - rate) * (var[learn] + rate * diff * diff)
        self._seen[ls] += 1
        return BatchVerdict(
            scores=z,
            thresholds=np.where(warm, self.z_threshold, np.inf),
            flagged=flagged,
            probability=np.where(warm, 1.0 - np.exp(-0.5 * np.minimum(z, 40.0) ** 2 / 4.0), 0.0),
        )
