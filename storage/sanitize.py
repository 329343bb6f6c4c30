"""Bad data at the store's door: every sample and event is checked once, before any backend.

A sample is **rejected** (and counted by reason) when its value is not finite (``nan``),
is not a number (``type``), its timestamp lies more than ``max_future_seconds`` ahead of
the store's clock (``future``) or before ``min_at`` (``past``; the default floor,
2000-01-01, also catches milliseconds or nanoseconds passed as seconds), or its metric or
a label key is not a Prometheus name (``name``, ``label``). It is **converted** (and
counted) when its value is a ``bool``, ``int`` or numeric string (``converted_type``:
every value is stored as a float, ``ecosystem-reference.md`` §0 item 16, so one field
never changes type), or when a label value holds a newline or is empty (``label_value``:
newlines become spaces, empty labels are omitted as line protocol requires). Spaces,
commas, ``=`` and quotes in label values are kept and escaped by the encoder
(:mod:`storage.lineprotocol`); SQLite stores them verbatim.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from core.records import Event, Sample

MIN_AT = 946_684_800.0
"""2000-01-01T00:00:00Z, epoch seconds: the oldest timestamp a store accepts by default."""

MAX_FUTURE_SECONDS = 600.0
"""How far ahead of the store's clock a timestamp may lie (clock skew between nodes)."""

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _bad_labels(labels: Mapping[str, str]) -> bool:
    for key, value in labels.items():
        if not isinstance(key, str) or _LABEL.match(key) is None or key.startswith("__"):
            return True
        if not isinstance(value, str):
            return True
    return False


def check_samples(
    samples: Sequence[Sample],
    *,
    now: float,
    counts: Counter[str],
    max_future_seconds: float = MAX_FUTURE_SECONDS,
    min_at: float = MIN_AT,
) -> list[Sample]:
    """Return the samples fit to store, stamped and converted; count the rest in ``counts``.

    Args:
        samples: One batch as the pipeline produced it.
        now: The store's clock, epoch seconds; stamps samples whose ``observed_at`` is None.
        counts: Reason → number of samples rejected or converted; updated in place.
        max_future_seconds: Latest accepted timestamp, seconds after ``now``.
        min_at: Earliest accepted timestamp, epoch seconds.

    Returns:
        Samples with a float ``value`` and a float ``observed_at``, in the input order.

    Examples:
        >>> from core.records import EntityId, NodeName
        >>> counts = Counter()
        >>> s = Sample(metric="gpu_power_watts", value=float("nan"), observed_at=1.7e9,
        ...            node=NodeName("n1"), entity=EntityId("GPU-a"))
        >>> check_samples([s, replace(s, value=3)], now=1.7e9, counts=counts)[0].value
        3.0
        >>> dict(counts)
        {'nan': 1, 'converted_type': 1}
    """
    latest = now + max_future_seconds
    out: list[Sample] = []
    append = out.append
    isfinite = math.isfinite
    good_names: set[str] = set()
    for s in samples:
        value = s.value
        at = s.observed_at
        if type(value) is not float:
            try:
                value = float(value)  # bool, int, numpy scalar, numeric string
            except (TypeError, ValueError):
                counts["type"] += 1
                continue
            counts["converted_type"] += 1
        if not isfinite(value):
            counts["nan"] += 1
            continue
        if at is None:
            at = now
        elif type(at) is not float:
            try:
                at = float(at)
            except (TypeError, ValueError):
                counts["type"] += 1
                continue
        if not min_at <= at <= latest:
            if at != at:  # NaN timestamp
                counts["type"] += 1
            else:
                counts["future" if at > latest else "past"] += 1
            continue
        metric = s.metric
        if metric not in good_names:
            if not isinstance(metric, str) or _NAME.match(metric) is None:
                counts["name"] += 1
                continue
            good_names.add(metric)
        labels = s.labels
        if labels:
            if _bad_labels(labels):
                counts["label"] += 1
                continue
            if any(not v or "\n" in v or "\r" in v for v in labels.values()):
                counts["label_value"] += 1
                labels = {k: v.replace("\r", " ").replace("\n", " ")
                          for k, v in labels.items() if v}
        if value is not s.value or at is not s.observed_at or labels is not s.labels:
            s = replace(s, value=value, observed_at=at, labels=labels)
        append(s)
    return out


def check_events(
    events: Sequence[Event],
    *,
    now: float,
    counts: Counter[str],
    max_future_seconds: float = MAX_FUTURE_SECONDS,
    min_at: float = MIN_AT,
) -> list[Event]:
    """Return the events fit to store (stamped with ``now`` when unstamped); count the rest.

    An event is rejected only for a timestamp that is not finite, in the far future or
    before ``min_at`` (reasons ``event_type``, ``event_future``, ``event_past``); its text
    is kept whatever it holds (encoders escape it).
    """
    latest = now + max_future_seconds
    out: list[Event] = []
    for e in events:
        at = e.observed_at
        if at is None:
            out.append(replace(e, observed_at=now))
            continue
        if not isinstance(at, int | float) or not math.isfinite(at):
            counts["event_type"] += 1
            continue
        if at > latest:
            counts["event_future"] += 1
            continue
        if at < min_at:
            counts["event_past"] += 1
            continue
        out.append(e if type(at) is float else replace(e, observed_at=float(at)))
    return out
