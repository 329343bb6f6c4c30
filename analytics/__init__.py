"""gpuhealth analytics package.

The river-backed detectors live in :mod:`analytics.hst` and are not imported here, so that
importing ``analytics`` does not pay river's import time (about 1.4 s).
"""

from __future__ import annotations

from analytics.gaps import TelemetryGapDetector
from analytics.peers import PeerComparison, PeerDetector, PeerVerdict
from analytics.rates import IB_SATURATING_BITS, CounterRates, RateBatch
from analytics.thresholds import (
    DspotDetector,
    EwmaZScoreDetector,
    QuantileThresholdDetector,
    SpotDetector,
)
from analytics.windowing import BatchVerdict, SeriesBatch, SeriesIndex, SeriesKey, VectorDetector

__all__ = [
    "IB_SATURATING_BITS",
    "BatchVerdict",
    "CounterRates",
    "DspotDetector",
    "EwmaZScoreDetector",
    "PeerComparison",
    "PeerDetector",
    "PeerVerdict",
    "QuantileThresholdDetector",
    "RateBatch",
    "SeriesBatch",
    "SeriesIndex",
    "SeriesKey",
    "SpotDetector",
    "TelemetryGapDetector",
    "VectorDetector",
]
