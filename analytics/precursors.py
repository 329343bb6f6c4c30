"""Precursor evidence: how surely an entity's errors (or temperature) rose above its own past.

The failure predictor (:mod:`analytics.predictor`) learned from raw rates and their
differences did not carry over from one fleet to another (issue #15: precision 0.09 on a
fleet recording it had not seen): a rate in errors per hour means a different thing on a
GPU that has always had many corrected errors, on one that never had any, and in a fleet
whose counters move ten times faster. This module turns each signal into **evidence**, a
unit-free number that means the same on every fleet:

* **Counters** (corrected ECC, PCIe replays, NVLink errors, Xids, remapped rows and
  retired pages, InfiniBand symbol errors, link recoveries, receive errors): the count of
  the last few hours against what the entity's **own baseline** (the hours before,
  :data:`BASELINE_HOURS`) predicts. The evidence is the log10 likelihood ratio of a Poisson
  rise, ``(n ln(n / mu) - n + mu) / ln 10`` for ``n > mu`` (the Chernoff bound on the
  Poisson tail, ``P(N >= n) <= 10 ** -evidence``), where

  - the baseline rate is a gamma-Poisson estimate ``(count + 0.5) / (hours + 4)`` (a GPU
    with no error yet is not certain never to have one);
  - counts are divided by the baseline's **dispersion** (robust variance over median of
    its hourly counts, ``(1.4826 MAD)**2 / median``, at least 1) before the ratio, so a GPU
    whose error count always swung widely is not surprising when it swings again;
  - each hour of the window counts at most :data:`WINSOR` times the window's median hourly
    rate: one or two hours of burst are not a rise; errors that come more often over most
    of the window are;
  - a rise of less than :data:`MIN_FOLD` times the baseline is no evidence at all (a large
    count a little above a large baseline is statistically certain and means nothing).

* **Temperature**: the GPU's temperature minus the median of its node's other GPUs, at
  equal power (the fleet-wide slope of that excess on the power excess is removed), as
  hourly means. The evidence is the one-sided Gaussian log10 tail of the **smallest** of the
  last :data:`TEMP_PERSIST_HOURS` hourly excesses over the median of the baseline hours, in
  units of their robust spread (``1.4826 MAD``, at least 1 degC): a GPU that has always run
  warm has a warm baseline; a GPU warm for one hour of a workload has one hour.

No evidence is given until the entity has :data:`MIN_BASELINE_HOURS` of baseline: a counter
that is already high when gpuhealth starts, or a GPU always hotter than its peers, is a
static offset and predicts nothing (issue #15, items 3 and 9).

Everything is kept as hourly buckets (:data:`HISTORY_HOURS` floats per signal): a month
of a 256-GPU fleet costs the same memory as a day.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

HOUR = 3600.0

RECENT_HOURS = 6
"""The recent window judged against the baseline, hours."""

BASELINE_HOURS = 42
"""Hours before the recent window that make the baseline."""

HISTORY_HOURS = RECENT_HOURS + BASELINE_HOURS
"""Hourly buckets kept per signal."""

MIN_BASELINE_HOURS = 12.0
"""Hours of baseline needed before any evidence is given."""

MIN_FOLD = 3.0
"""Smallest rise over the baseline rate (recent rate / baseline rate) that counts."""

EVIDENCE_CAP = 30.0
"""Evidence is capped here (log10 units): beyond it, more is not more certain."""

WINSOR = 2.0
"""An hour counts at most this many times the recent window's median hourly rate."""

TEMP_PERSIST_HOURS = 3
"""Consecutive hours a temperature excess must hold."""

TEMP_MIN_SPREAD = 1.0
"""Smallest spread of a GPU's hourly temperature excess, degC."""

_EXPOSURES = [1.0] * RECENT_HOURS
_PRIOR_COUNT = 0.5
_PRIOR_HOURS = 4.0
_LN10 = math.log(10.0)


def advance_hours(buckets: Sequence[deque[Any]], hour_at: float, at: float) -> float:
    """Open hourly buckets up to the clock hour of ``at``; return the newest bucket's start.

    ``buckets`` are parallel deques of one bucket per clock hour (newest last, bounded by
    their ``maxlen``); a gap longer than they hold starts them again. The new buckets hold
    0 (``0.0`` for floats, ``0`` for counts: the type of the first bucket kept).
    """
    hour = at - at % HOUR
    span = buckets[0].maxlen or 0
    if not buckets[0] or hour - hour_at >= span * HOUR:
        for b in buckets:
            zero = type(b[0])() if b else 0
            b.clear()
            b.append(zero)
        return hour
    while hour > hour_at:
        for b in buckets:
            b.append(type(b[-1])())
        hour_at += HOUR
    return hour_at


def poisson_rise(n: float, mu: float) -> float:
    """Return the log10 likelihood ratio of ``n`` events where ``mu`` were expected.

    ``(n ln(n / mu) - n + mu) / ln 10`` when ``n > mu``, else 0: the Chernoff bound on the
    Poisson upper tail, ``P(N >= n | mu) <= 10 ** -poisson_rise(n, mu)``.

    Args:
        n: Events counted, >= 0.
        mu: Events expected, > 0.

    Examples:
        >>> poisson_rise(0.5, 1.0)
        0.0
        >>> round(poisson_rise(10.0, 1.0), 2)
        6.09
    """
    if n <= mu or mu <= 0.0:
        return 0.0
    return (n * math.log(n / mu) - n + mu) / _LN10


@dataclass(slots=True)
class HourlyCounter:
    """Increases of one counter (or of a family of counters) per clock hour."""

    hours: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_HOURS))
    hour_at: float = 0.0
    """Start of the newest bucket."""
    first_at: float | None = None
    last_error_at: float | None = None
    _baseline: tuple[float, float, float, float] | None = None
    """``(hour it was fitted in, hours, rate, dispersion)`` of the baseline."""

    def add(self, at: float, increase: float) -> None:
        """Add ``increase`` (>= 0) at ``at`` (epoch seconds, non-decreasing per counter)."""
        if self.first_at is None:
            self.first_at = at
        if not (self.hours and self.hour_at <= at < self.hour_at + HOUR):
            self.hour_at = advance_hours((self.hours,), self.hour_at, at)
        if increase > 0:  # a late reading of an older hour counts in the newest
            self.hours[-1] += increase
            self.last_error_at = at

    def evidence(self, now: float) -> tuple[float, float] | None:
        """Return ``(evidence, fold)`` of the recent hours against the baseline, or ``None``.

        ``None`` while the baseline is shorter than :data:`MIN_BASELINE_HOURS`. ``fold`` is
        the recent rate over the baseline rate. The baseline (rate, dispersion) is worked
        out once per clock hour; only the recent window is judged at every call.
        """
        if self.first_at is None or not self.hours:
            return None
        # exposure of the newest (current) bucket, and of the baseline hours observed
        current = min(max(now - self.hour_at, 1.0), HOUR) / HOUR
        baseline = self._baseline
        if baseline is None or baseline[0] != self.hour_at:
            baseline = self._baseline = (self.hour_at, *self._fit_baseline(now, current))
        _, base_hours, rate, dispersion = baseline
        if base_hours < MIN_BASELINE_HOURS:
            return None
        if self.last_error_at is None:
            return 0.0, 0.0  # never an error: nothing rose
        hours = self.hours
        recent = [hours[i] if i >= 0 else 0.0
                  for i in range(len(hours) - RECENT_HOURS, len(hours))]
        exposures = [*_EXPOSURES[:-1], current]
        # each hour's count is capped at WINSOR times the window's median hourly rate (at
        # least MIN_FOLD times the baseline's): one or two hours of burst add little, a rise
        # over most of the window all of itself
        rates = sorted(c / e for c, e in zip(recent, exposures, strict=True))
        middle = (rates[RECENT_HOURS // 2 - 1] + rates[RECENT_HOURS // 2]) / 2.0
        cap = max(WINSOR * middle, MIN_FOLD * rate)
        n = sum(min(c, cap * e) for c, e in zip(recent, exposures, strict=True))
        mu = rate * sum(exposures)
        fold = n / mu
        if fold < MIN_FOLD:
            return 0.0, fold
        return min(poisson_rise(n / dispersion, mu / dispersion), EVIDENCE_CAP), fold

    def _fit_baseline(self, now: float, current: float) -> tuple[float, float, float]:
        """Return ``(hours, rate per hour, dispersion)`` of the hours before the window."""
        assert self.first_at is not None
        observed = max(now - self.first_at, 0.0) / HOUR
        base_hours = min(float(BASELINE_HOURS), observed - (RECENT_HOURS - 1) - current)
        if base_hours < MIN_BASELINE_HOURS:
            return base_hours, 0.0, 1.0
        buckets = list(self.hours)[:-RECENT_HOURS]
        used = ([0.0] * max(0, math.ceil(base_hours) - len(buckets))
                + buckets[-math.ceil(base_hours):])
        rate = (sum(used) + _PRIOR_COUNT) / (base_hours + _PRIOR_HOURS)
        # robust dispersion (a rise already under way in the baseline is not noise)
        centre = statistics.median(used)
        spread = 1.4826 * statistics.median(abs(c - centre) for c in used)
        return base_hours, rate, max(1.0, spread * spread / max(centre, rate))

    def hours_since_error(self, now: float) -> float | None:
        """Hours since the last increase, or ``None`` if none was seen."""
        if self.last_error_at is None:
            return None
        return max(now - self.last_error_at, 0.0) / HOUR


@dataclass(slots=True)
class HourlyGauge:
    """Hourly means of a gauge (a GPU's temperature excess over its peers, degC)."""

    sums: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_HOURS))
    counts: deque[int] = field(default_factory=lambda: deque(maxlen=HISTORY_HOURS))
    hour_at: float = 0.0
    _baseline: tuple[float, float, float] | None = None
    """``(hour it was fitted in, median, spread)`` of the baseline."""

    def add(self, at: float, value: float) -> None:
        """Add a reading at ``at`` (epoch seconds)."""
        self.hour_at = advance_hours((self.sums, self.counts), self.hour_at, at)
        self.sums[-1] += value
        self.counts[-1] += 1

    def evidence(self) -> tuple[float, float] | None:
        """Return ``(evidence, excess degC)`` of a persistent rise, or ``None``.

        The excess is the smallest of the last :data:`TEMP_PERSIST_HOURS` hourly means
        over the baseline's median; the evidence its one-sided Gaussian log10 tail in units
        of the baseline's robust spread. ``None`` while the baseline has fewer than
        :data:`MIN_BASELINE_HOURS` hours with readings.
        """
        sums, counts = self.sums, self.counts
        if len(sums) < RECENT_HOURS + MIN_BASELINE_HOURS:
            return None
        recent: list[float] = []
        for i in range(len(sums) - TEMP_PERSIST_HOURS, len(sums)):
            if not counts[i]:
                return None
            recent.append(sums[i] / counts[i])
        baseline = self._baseline
        if baseline is None or baseline[0] != self.hour_at:
            baseline = self._baseline = (self.hour_at, *self._fit_baseline())
        _, centre, spread = baseline
        if math.isnan(centre):
            return None
        excess = min(recent) - centre
        if excess <= 0:
            return 0.0, excess
        return min(gaussian_tail(excess / spread), EVIDENCE_CAP), excess

    def _fit_baseline(self) -> tuple[float, float]:
        """Return ``(median, robust spread)`` of the baseline hours (NaN: too few)."""
        base = [s / c for s, c in itertools.islice(zip(self.sums, self.counts, strict=True),
                                                   len(self.sums) - RECENT_HOURS) if c]
        if len(base) < MIN_BASELINE_HOURS:
            return math.nan, math.nan
        centre = statistics.median(base)
        spread = max(1.4826 * statistics.median(abs(m - centre) for m in base),
                     TEMP_MIN_SPREAD)
        return centre, spread


def gaussian_tail(z: float) -> float:
    """Return ``-log10 P(Z > z)`` for a standard normal ``Z`` (0 for ``z <= 0``).

    Examples:
        >>> round(gaussian_tail(3.0), 2)
        2.87
    """
    if z <= 0:
        return 0.0
    if z < 30:
        return -math.log10(0.5 * math.erfc(z / math.sqrt(2.0)))
    # asymptotic: log P ~ -z^2/2 - log(z sqrt(2 pi))
    return (z * z / 2.0 + math.log(z * math.sqrt(2.0 * math.pi))) / _LN10


def strongest(evidence: Sequence[tuple[str, float]]) -> tuple[str, float]:
    """Return the ``(signal, evidence)`` with the most evidence (``("", 0.0)`` if none)."""
    best = ("", 0.0)
    for name, value in evidence:
        if value > best[1]:
            best = (name, value)
    return best


EVIDENCE_EDGES = (0.5, 1.0, 2.0, 3.0, 5.0, 7.0, 10.0, 14.0, 20.0, 29.9)
"""Lower edges of the evidence bins of :class:`EvidenceCalibration` after the first
(``[0, 0.5)``), log10 units; the last bin holds capped evidence."""


class EvidenceCalibration:
    """Probability of failure within the horizon given the strongest precursor evidence.

    A reliability table (Niculescu-Mizil & Caruana, ICML 2005: binned calibration, made
    monotone by isotonic regression, pool-adjacent-violators) per entity kind, over bins of
    evidence (:data:`EVIDENCE_EDGES`): each bin counts the labelled vectors that fell in it
    and how many were followed by a failure within the horizon, so "0.9" is what 9 of 10
    such vectors were. A bin's rate is shrunk with ``smoothing`` pseudo-vectors (a bin seen
    a few times says little) toward the same bin of the other kinds (evidence is unit-free:
    a rise in a GPU's errors means what the same rise on a port means), itself shrunk
    toward the overall rate; the no-evidence bin is shrunk toward its kind's rate. The
    rates are then made non-decreasing in evidence (more evidence never lowers the risk).

    It reads the model inputs of :mod:`analytics.features` (``gpu_precursor`` or
    ``port_precursor``: evidence / 10; ``kind_gpu`` / ``kind_port``) and has the interface of
    :class:`~analytics.predictor.SgdLogisticRegression` (``predict_proba_one``,
    ``learn_one``; no linear ``weights``). The shipped prior's counts are the starting
    point (:mod:`analytics.prior`); a fleet's own labels add to them, and counts older than
    ``half_life`` labelled vectors of a kind weigh half, so the fleet's own data takes over.

    Args:
        smoothing: Pseudo-vectors at the kind's rate in each bin, > 0.
        half_life: Labelled vectors of a kind after which earlier counts weigh half, > 0.

    Raises:
        ValueError: An argument out of range.
    """

    KINDS = ("gpu", "port")

    def __init__(self, *, smoothing: float = 5.0, half_life: float = 5e6) -> None:
        if smoothing <= 0 or half_life <= 0:
            raise ValueError("smoothing and half_life must be > 0")
        self.smoothing = smoothing
        self.half_life = half_life
        bins = len(EVIDENCE_EDGES) + 1
        self.positives = {k: [0.0] * bins for k in self.KINDS}
        self.totals = {k: [0.0] * bins for k in self.KINDS}
        self.weights: dict[str, float] = {}
        """No linear terms (the interface of the logistic model)."""
        self.intercept = 0.0
        self.learning_rate = 0.0
        self._table: dict[str, list[float]] = {}

    @staticmethod
    def _where(x: dict[str, float]) -> tuple[str, int]:
        kind = "port" if x.get("kind_port") else "gpu"
        evidence = 10.0 * x.get(f"{kind}_precursor", 0.0)
        return kind, bisect.bisect_right(EVIDENCE_EDGES, evidence)

    def predict_proba_one(self, x: dict[str, float]) -> float:
        """Return the calibrated probability of failure for the inputs ``x``, in [0, 1]."""
        kind, b = self._where(x)
        table = self._table.get(kind)
        if table is None:
            table = self._table[kind] = self._fit(kind)
        return table[b]

    def learn_one(self, x: dict[str, float], y: bool) -> None:
        """Count one labelled vector."""
        kind, b = self._where(x)
        totals, positives = self.totals[kind], self.positives[kind]
        decay = 0.5 ** (1.0 / self.half_life)
        for i in range(len(totals)):
            totals[i] *= decay
            positives[i] *= decay
        totals[b] += 1.0
        if y:
            positives[b] += 1.0
        self._table.pop(kind, None)

    def _fit(self, kind: str) -> list[float]:
        s = self.smoothing
        kinds = self.KINDS
        bins = range(len(self.totals[kind]))
        all_pos = sum(sum(self.positives[k]) for k in kinds)
        all_tot = sum(sum(self.totals[k]) for k in kinds)
        overall = (all_pos + 1.0) / (all_tot + 2.0)
        # the bin's rate on the other kinds (evidence means the same on a GPU and a port),
        # shrunk toward the overall rate; this kind's bin is shrunk toward that
        others = [k for k in kinds if k != kind]
        pooled = [(sum(self.positives[k][b] for k in others) + s * overall)
                  / (sum(self.totals[k][b] for k in others) + s) for b in bins]
        totals, positives = self.totals[kind], self.positives[kind]
        kind_rate = (sum(positives) + 1.0) / (sum(totals) + 2.0)
        rates = [(positives[b] + s * (pooled[b] if b else kind_rate)) / (totals[b] + s)
                 for b in bins]
        return _isotonic(rates, [t + s for t in totals])

    def table(self, kind: str) -> list[float]:
        """The calibrated probability of each evidence bin of ``kind``."""
        return list(self._fit(kind))


def _isotonic(values: list[float], weights: list[float]) -> list[float]:
    """Return the weighted non-decreasing fit of ``values`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for mean, _, n in blocks:
        out.extend([mean] * int(n))
    return out
