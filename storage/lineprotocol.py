r"""InfluxDB line protocol: the schema, a fast encoder, a decoder, export and import.

Syntax and escaping follow ``ecosystem-reference.md`` §4.1 (InfluxDB's line-protocol
reference): measurement escapes comma and space; tag keys, tag values and field keys
escape comma, ``=`` and space; string field values are double-quoted with ``"`` and
``\\`` escaped; timestamps are integer nanoseconds unless a precision is declared.

Schema (§4.3: bounded tags, float fields). A catalogued metric ``<prefix>_<rest>`` is
written as measurement ``<prefix>``, field ``<rest>``, so that VictoriaMetrics, which
names a series ``<measurement>_<field>``, stores it under the catalog name itself
(``gpu_temperature_celsius`` → ``gpu temperature_celsius=41.0``); a name without an
underscore, or whose rest would be ``value``, is written as measurement ``<name>``,
field ``value``. Tags: ``node``, ``entity`` (GPU UUID or PCI bus id, port, ``node``) and
the sample's labels (``link``, ``type``...), all bounded. Every value is a float field.
Events are measurement ``gpuhealth_event`` with tags ``node``, ``entity``, ``kind``,
``code`` and ``source`` and fields ``count=1`` (numeric, so VictoriaMetrics keeps a
``gpuhealth_event_count`` series), ``message``, ``attrs`` and ``evidence`` (JSON strings).

Operators move history with these files: :func:`export` writes a window of any store,
:func:`import_lines` writes files into a store in batches keeping the original
timestamps, and :func:`read_records` yields the records of files for ``gpuhealth replay``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from core.catalog import CATALOG
from core.clock import Clock, system_clock
from core.protocols import Batch, Store, write_batches
from core.records import EntityId, EntityRef, Event, Evidence, NodeName, Record, Sample
from storage.sanitize import (
    _NAME,
    MAX_FUTURE_SECONDS,
    MIN_AT,
    _bad_labels,
    check_events,
    check_samples,
)

if TYPE_CHECKING:
    import pandas as pd

logger = logging.getLogger(__name__)

Precision = Literal["ns", "us", "ms", "s"]
EVENT_MEASUREMENT = "gpuhealth_event"
_PER_SECOND: dict[str, int] = {"ns": 1_000_000_000, "us": 1_000_000, "ms": 1_000, "s": 1}

_MEAS_ESC = str.maketrans({",": "\\,", " ": "\\ "})
_TAG_ESC = str.maketrans({",": "\\,", "=": "\\=", " ": "\\ "})
_STR_ESC = str.maketrans({"\\": "\\\\", '"': '\\"'})


def escape_measurement(text: str) -> str:
    r"""Escape a measurement name.

    Examples:
        >>> escape_measurement("gpu metrics,x")
        'gpu\\ metrics\\,x'
    """
    return text.translate(_MEAS_ESC)


def escape_key(text: str) -> str:
    r"""Escape a tag key, tag value or field key (comma, ``=``, space).

    Examples:
        >>> escape_key('node 01,rack=a"b')
        'node\\ 01\\,rack\\=a"b'
    """
    return text.translate(_TAG_ESC)


def quote_string(text: str) -> str:
    r"""Quote a string field value.

    Examples:
        >>> quote_string('NVIDIA H100 "SXM"')
        '"NVIDIA H100 \\"SXM\\""'
    """
    return '"' + text.translate(_STR_ESC).replace("\n", "\\n") + '"'


def split_metric(metric: str) -> tuple[str, str]:
    """Return the ``(measurement, field)`` a metric is written as.

    Examples:
        >>> split_metric("gpu_temperature_celsius")
        ('gpu', 'temperature_celsius')
        >>> split_metric("up")
        ('up', 'value')
    """
    prefix, sep, rest = metric.partition("_")
    if not sep or not prefix or not rest or rest == "value":
        return metric, "value"
    return prefix, rest


def join_metric(measurement: str, field_key: str) -> str:
    """Return the metric a ``(measurement, field)`` pair stands for (inverse of split).

    Examples:
        >>> join_metric("gpu", "power_watts")
        'gpu_power_watts'
    """
    return measurement if field_key == "value" else f"{measurement}_{field_key}"


def _stamp(at: float, precision: Precision) -> int:
    if precision == "ns":
        return round(at * 1_000_000) * 1000  # microseconds are as far as a float epoch goes
    return round(at * _PER_SECOND[precision])


class LineEncoder:
    """Turns samples and events into line protocol, caching each series' prefix.

    The per-sample cost is one dictionary lookup and two list appends: the fields of one
    line (one reading of one tag set) are formatted by one ``%`` of a template cached per
    tuple of field keys, which keeps serialisation below a plain formatted string
    (``benchmarks/store_ingest.py``); a sample whose ``observed_at`` is the same object as
    its predecessor's (one reading, one ``now``) also skips the rounding of its timestamp
    and its time checks.

    Args:
        precision: Unit of the timestamps written (``ns`` for files, ``ms`` for stores
            that keep milliseconds anyway).
        max_series_cache: Series prefixes kept before the cache is cleared.
    """

    def __init__(self, *, precision: Precision = "ns", max_series_cache: int = 1_000_000,
                 merge_fields: bool = True) -> None:
        self.precision = precision
        self.max_series_cache = max_series_cache
        self.merge_fields = merge_fields
        self._parts: dict[tuple[Any, ...], tuple[str, str]] = {}
        self._heads: dict[str, str] = {}
        self._fields: dict[str, str] = {}
        self._templates: dict[tuple[str, ...], str] = {}

    def _miss(self, key: tuple[Any, ...], s: Sample) -> tuple[str, str]:
        if len(self._parts) > self.max_series_cache:
            self._parts.clear()
            self._heads.clear()
            self._fields.clear()
        measurement, field_key = split_metric(s.metric)
        tags = {"node": s.node, "entity": s.entity, **s.labels}
        head = escape_measurement(measurement) + "".join(
            f",{escape_key(k)}={escape_key(v)}" for k, v in sorted(tags.items()) if v)
        head = self._heads.setdefault(head, head)  # one object per tag set: compared by `is`
        feq = escape_key(field_key) + "="
        feq = self._fields.setdefault(feq, feq)  # shared: template keys compare by identity
        parts = self._parts[key] = (head, feq)
        return parts

    def samples(self, samples: Iterable[Sample]) -> list[str]:
        """Encode checked samples (float values, stamped) as lines without newlines.

        Consecutive samples of one tag set and timestamp (a collector's reading of one GPU)
        share a line, one field each, unless ``merge_fields`` is off: the tags are written
        once, and line protocol merges the fields of one point anyway.
        """
        return self._encode(samples, None)

    def checked_samples(
        self,
        samples: Iterable[Sample],
        *,
        now: float,
        counts: Counter[str],
        max_future_seconds: float = MAX_FUTURE_SECONDS,
        min_at: float = MIN_AT,
    ) -> list[str]:
        """Check and encode in one pass: :func:`storage.sanitize.check_samples` + :meth:`samples`.

        A sample of a series already encoded, with a finite float value and a float time in
        range, takes the fast path; any other goes through ``check_samples`` first (and is
        counted there when rejected or converted).
        """
        return self._encode(samples, (now, counts, max_future_seconds, min_at))

    def _encode(
        self,
        samples: Iterable[Sample],
        checks: tuple[float, Counter[str], float, float] | None,
    ) -> list[str]:
        """The loop of :meth:`samples`, and of :meth:`checked_samples` when ``checks`` is set.

        ``checks`` is ``(now, counts, max_future_seconds, min_at)``; ``None`` trusts the
        samples as checked already.
        """
        get = self._parts.get
        miss = self._miss
        flush = self._flush
        now, counts, max_future_seconds, min_at = checks or (0.0, Counter(), 0.0, 0.0)
        latest = now + max_future_seconds
        scale = 1_000_000 if self.precision == "ns" else _PER_SECOND[self.precision]
        factor = 1000 if self.precision == "ns" else 1
        merge = self.merge_fields
        out: list[str] = []
        prev_head: str | None = None
        prev_stamp = 0
        prev_at: object = object()  # the last time stamped; never a sample's
        keys: list[str] = []  # the current line's field keys ("power_watts=") and values
        add_key = keys.append
        values: list[float] = []
        add_value = values.append
        for s in samples:
            labels = s.labels
            key = (s.metric, s.node, s.entity, *labels.items()) if labels else (
                s.metric, s.node, s.entity)
            parts = get(key)
            value, at = s.value, s.observed_at
            if checks is None:
                if parts is None:
                    parts = miss(key, s)
            elif (parts is None or type(value) is not float or value - value != 0.0
                    or (at is not prev_at  # prev_at passed these checks already
                        and (type(at) is not float or not min_at <= at <= latest))):
                cleaned = check_samples([s], now=now, counts=counts,
                                        max_future_seconds=max_future_seconds, min_at=min_at)
                if not cleaned:
                    continue
                s = cleaned[0]
                value, at = s.value, s.observed_at
                labels = s.labels
                key = (s.metric, s.node, s.entity, *labels.items()) if labels else (
                    s.metric, s.node, s.entity)
                parts = get(key) or miss(key, s)
            head, feq = parts
            if at is prev_at:  # one reading's samples share the time object: skip the round
                if merge and head is prev_head:
                    add_key(feq)
                    add_value(value)
                    continue
                stamp = prev_stamp
            else:
                stamp = round(at * scale) * factor  # type: ignore[operator]
                prev_at = at
                if merge and head is prev_head and stamp == prev_stamp:
                    add_key(feq)
                    add_value(value)
                    continue
            if keys:
                flush(out, prev_head, keys, values, prev_stamp)
            prev_head, prev_stamp = head, stamp
            keys = [feq]
            add_key = keys.append
            values = [value]
            add_value = values.append
        if keys:
            flush(out, prev_head, keys, values, prev_stamp)
        return out

    def _flush(self, out: list[str], head: str | None, keys: list[str], values: list[float],
               stamp: int) -> None:
        """Append the line (or lines) of one tag set and time.

        The fields are formatted by one ``%`` of a template cached per field-key tuple (one
        reading of one collector has the same keys every time); a template is made only for
        keys without a repeat, and a repeated key (one series twice at one time) starts a
        new line, so that no value overwrites another.
        """
        if len(keys) == 1:
            out.append(f"{head} {keys[0]}{values[0]!r} {stamp}")
            return
        names = tuple(keys)
        template = self._templates.get(names)
        if template is None:
            if len(set(names)) == len(names):
                if len(self._templates) > 10_000:
                    self._templates.clear()
                template = self._templates[names] = ",".join(
                    k.replace("%", "%%") + "%r" for k in names)
            else:
                fields: list[str] = []
                seen: set[str] = set()
                for k, v in zip(names, values, strict=True):
                    if k in seen:
                        out.append(f"{head} {','.join(fields)} {stamp}")
                        fields, seen = [], set()
                    fields.append(f"{k}{v!r}")
                    seen.add(k)
                out.append(f"{head} {','.join(fields)} {stamp}")
                return
        out.append(f"{head} {template % tuple(values)} {stamp}")

    def events(self, events: Iterable[Event]) -> list[str]:
        """Encode stamped events as ``gpuhealth_event`` lines."""
        out = []
        for e in events:
            assert e.observed_at is not None
            tags = {"code": e.code, "entity": e.entity, "kind": e.kind, "node": e.node,
                    "source": e.source}
            head = EVENT_MEASUREMENT + "".join(
                f",{k}={escape_key(v)}" for k, v in sorted(tags.items()) if v)
            fields = ",".join((
                "count=1.0",
                f"message={quote_string(e.message)}",
                f"attrs={quote_string(json.dumps(dict(e.attrs), sort_keys=True))}",
                "evidence=" + quote_string(json.dumps([[v.file, v.line, v.text]
                                                       for v in e.evidence])),
            ))
            out.append(f"{head} {fields} {_stamp(e.observed_at, self.precision)}")
        return out


# --- decoding ------------------------------------------------------------------------------


def _split_unescaped(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside backslash escapes and double quotes, unescaping nothing."""
    if "\\" not in text and '"' not in text:
        return text.split(sep)
    parts: list[str] = []
    current: list[str] = []
    i, n, quoted = 0, len(text), False
    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n:
            current.append(text[i:i + 2])
            i += 2
            continue
        if ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append("".join(current))
            current = []
            i += 1
            continue
        current.append(ch)
        i += 1
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in ',= "\\':
            out.append(text[i + 1])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _unquote(text: str) -> str:
    body = text[1:-1]
    if "\\" not in body:
        return body
    return body.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


_TRUE = frozenset(("t", "T", "true", "True", "TRUE"))
_FALSE = frozenset(("f", "F", "false", "False", "FALSE"))


def _field_value(text: str) -> float | str | None:
    """Return a float (numbers and booleans), a string, or None when unparsable."""
    if text.startswith('"') and text.endswith('"') and len(text) >= 2:
        return _unquote(text)
    if text and text[-1] in "iu":
        try:
            return float(int(text[:-1]))
        except ValueError:
            return None
    if text in _TRUE:
        return 1.0
    if text in _FALSE:
        return 0.0
    try:
        return float(text)
    except ValueError:
        return None


CONVERSIONS = frozenset(("converted_type", "label_value"))
"""Reasons in :attr:`DecodeReport.skipped` that count values kept after a conversion."""

MAX_PROBLEMS_PER_REASON = 5
"""Lines listed per reason in :attr:`DecodeReport.problems` (the counts cover them all)."""

_EXCERPT = 80


@dataclass(frozen=True, slots=True)
class LineProblem:
    """One line of a file that was rejected (or had a value converted), for the operator.

    Attributes:
        file: The file as given.
        line: 1-based line number.
        reason: Why (``syntax``, ``truncated``, ``no_timestamp``, ``nan``, ``future``...).
        text: The line, its middle cut out when longer than 80 characters.
    """

    file: str
    line: int
    reason: str
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}: {self.text}"


@dataclass
class DecodeReport:
    """What decoding skipped or converted, by reason, and the first lines of each reason.

    ``skipped`` counts per reason: lines for ``syntax``, ``truncated`` and
    ``no_timestamp``, fields for ``value``, ``string_field`` and ``converted_type`` (a
    boolean field stored as 1.0 or 0.0), samples and events for the reasons of
    :mod:`storage.sanitize`; the reasons in :data:`CONVERSIONS` are values kept after a
    conversion, every other one a value or line left out. ``problems`` lists, when the
    records came from :func:`read_records`, the first ``max_per_reason`` lines of each
    reason with file and line number.
    """

    skipped: Counter[str] = field(default_factory=Counter)
    problems: list[LineProblem] = field(default_factory=list)
    max_per_reason: int = MAX_PROBLEMS_PER_REASON
    _listed: Counter[str] = field(default_factory=Counter, repr=False)

    def note(self, file: str, line: int, reason: str, text: str) -> None:
        """List one line under ``reason`` unless ``max_per_reason`` are listed already."""
        if self._listed[reason] >= self.max_per_reason:
            return
        self._listed[reason] += 1
        excerpt = "".join(c if c.isprintable() else "?" for c in text.strip())
        if len(excerpt) > _EXCERPT:  # the start (series) and the end (value, time)
            excerpt = f"{excerpt[:_EXCERPT - 35]} ... {excerpt[-30:]}"
        self.problems.append(LineProblem(file=file, line=line, reason=reason, text=excerpt))


def _parse_head(text: str) -> tuple[str, dict[str, str], NodeName, EntityId] | None:
    """Return ``(measurement, tags, node, entity)`` of a line's series part, or ``None``.

    ``tags`` are the tags other than the node's and the entity's (``node``, else ``host``;
    ``entity``, else ``uuid``); ``None`` for a tag without ``=`` (a syntax error).
    """
    head = _split_unescaped(text, ",")
    measurement = _unescape(head[0])
    tags: dict[str, str] = {}
    for item in head[1:]:
        key, sep, value = item.partition("=")
        while key.endswith("\\") and sep:  # an escaped '=' inside the key
            more_key, sep, value = value.partition("=")
            key = f"{key}={more_key}"
        if not sep:
            return None
        tags[_unescape(key)] = _unescape(value)
    node = NodeName(tags.pop("node", "") or tags.pop("host", "") or "unknown")
    entity = EntityId(tags.pop("entity", "") or tags.pop("uuid", "") or "node")
    return measurement, tags, node, entity


def decode_line(line: str, *, precision: Precision = "ns",
                report: DecodeReport | None = None) -> list[Record]:
    r"""Decode one line into samples (one per numeric field) or one event.

    Args:
        line: One line without its newline; comments and blank lines give ``[]``.
        precision: Unit of the line's timestamp.
        report: Counts what was skipped, and boolean fields (``converted_type``).

    Returns:
        Records stamped with the line's time in epoch seconds (``None`` when it has none).

    Examples:
        >>> decode_line("gpu,entity=GPU-a,node=n\\ 1 power_watts=312.5 1700000000000000000")[0]
        ... # doctest: +NORMALIZE_WHITESPACE
        Sample(metric='gpu_power_watts', value=312.5, observed_at=1700000000.0, node='n 1',
               entity='GPU-a', labels={}, evidence=None)
    """
    line = line.strip()
    if not line or line.startswith("#"):
        return []
    report = report if report is not None else DecodeReport()
    parts = _split_unescaped(line, " ")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        report.skipped["syntax"] += 1
        return []
    at: float | None = None
    if len(parts) == 3:
        try:
            at = int(parts[2]) / _PER_SECOND[precision]
        except (ValueError, OverflowError):  # not an integer, or beyond any float
            report.skipped["syntax"] += 1
            return []
    parsed_head = _parse_head(parts[0])
    if parsed_head is None:
        report.skipped["syntax"] += 1
        return []
    measurement, tags, node, entity = parsed_head
    fields: dict[str, float | str] = {}
    for item in _split_unescaped(parts[1], ","):
        key, sep, value = item.partition("=")
        parsed = _field_value(value) if sep else None
        if parsed is None:
            report.skipped["value"] += 1
            continue
        if value in _TRUE or value in _FALSE:
            report.skipped["converted_type"] += 1  # stored as a float (storage.sanitize)
        fields[_unescape(key)] = parsed
    if measurement == EVENT_MEASUREMENT:
        def text(key: str) -> str:
            found = fields.get(key, "")
            return found if isinstance(found, str) else ""
        try:
            attrs = json.loads(text("attrs") or "{}")
            evidence = tuple(Evidence(file=f, line=ln, text=t)
                             for f, ln, t in json.loads(text("evidence") or "[]"))
        except (ValueError, TypeError):
            report.skipped["value"] += 1
            return []
        return [Event(kind=tags.get("kind", ""), code=tags.get("code", ""), node=node,
                      entity=entity, observed_at=at, message=text("message"), attrs=attrs,
                      evidence=evidence, source=tags.get("source", ""))]
    records: list[Record] = []
    for key, field_value in fields.items():
        if isinstance(field_value, str):
            report.skipped["string_field"] += 1
            continue
        records.append(Sample(metric=join_metric(measurement, key), value=field_value,
                              observed_at=at, node=node, entity=entity, labels=dict(tags)))
    return records


_PARSE_REASONS = ("syntax", "value")


def looks_like_line_protocol(text: str, *, lines: int = 5) -> bool:
    r"""Whether ``text`` (the start of a file or body) is InfluxDB line protocol.

    True when its first ``lines`` lines that are neither blank nor comments all decode
    (:func:`decode_line`) into records stamped with their own time, and there is at least
    one. A kernel log, syslog or tool output never does: their lines have more than two
    unescaped spaces or no ``key=value`` fields. Used to read a recording as telemetry
    rather than let a log parser see "Xid 48" in an event's message and find nothing.

    Examples:
        >>> looks_like_line_protocol("gpu,node=n1 power_watts=300 1700000000000000000\n")
        True
        >>> looks_like_line_protocol("[Mon Nov 30 08:00:00 2026] NVRM: Xid (PCI:0000:b1:00): 79")
        False
    """
    checked = 0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        report = DecodeReport()
        records = decode_line(line, report=report)
        if not records or report.skipped or any(r.observed_at is None for r in records):
            return False
        checked += 1
        if checked >= lines:
            break
    return checked > 0


def head_is_line_protocol(head: bytes, *, cut: bool) -> bool:
    """:func:`looks_like_line_protocol` on the first bytes of a file or body.

    ``cut``: ``head`` may end inside a line, which is then left out (unless it is the only
    one). Binary (NUL bytes) and gzip heads are not line protocol here.
    """
    if b"\x00" in head or head[:2] == b"\x1f\x8b":
        return False
    text = head.decode("utf-8", errors="replace")
    if cut:
        text = text.rpartition("\n")[0] or text
    return looks_like_line_protocol(text)


def read_records(
    paths: Sequence[str | Path],
    *,
    precision: Precision = "ns",
    report: DecodeReport | None = None,
    clock: Clock = system_clock,
    max_future_seconds: float = MAX_FUTURE_SECONDS,
    min_at: float = MIN_AT,
) -> Iterator[Record]:
    """Yield the checked records of line-protocol files in file and line order.

    This is what ``gpuhealth replay`` and ``gpuhealth import`` read files with, so that
    both apply the same checks: each line is decoded (:func:`decode_line`), then its
    samples and events go through :func:`storage.sanitize.check_samples` and
    :func:`~storage.sanitize.check_events` (a NaN, a value of the wrong type, a time more
    than ``max_future_seconds`` after ``clock()`` or before ``min_at`` is left out; a
    boolean is converted to 1.0 or 0.0 and counted). A record that is yielded keeps the
    timestamp written in the file.

    A line **without a timestamp** is rejected (``no_timestamp``): recorded history must
    keep its own times, and InfluxDB's "stamp it with the server's now" makes no sense for
    a file read later. A last line without a trailing newline that fails to parse, lacks
    a timestamp, or whose timestamp is before ``min_at`` (digits cut off) is a file cut off
    while it was written: it is rejected as ``truncated`` rather than read as a reading at
    the current time.

    Every line left out (or converted) is counted in ``report.skipped`` by reason, and
    the first lines of each reason are listed in ``report.problems`` with file, line
    number and an excerpt.

    Args:
        paths: The files, in order.
        precision: Unit of the files' timestamps.
        report: Receives the counts and the lines listed; a throwaway one by default.
        clock: Epoch seconds, read once per file, for the future bound.
        max_future_seconds: Latest accepted timestamp after ``clock()``.
        min_at: Earliest accepted timestamp, epoch seconds.
    """
    for records in read_lines(paths, precision=precision, report=report, clock=clock,
                              max_future_seconds=max_future_seconds, min_at=min_at):
        yield from records


def _sample_factory() -> Callable[[str, float, float, NodeName, EntityId, dict[str, str]],
                                  Sample]:
    """A constructor of :class:`~core.records.Sample` for the decoder's hot loop.

    The dataclass ``__init__`` of a frozen, slotted, keyword-only record costs about 2 us a
    sample (``object.__setattr__`` per field behind keyword arguments), as much as the rest
    of decoding a line; this sets the slots directly, about 2.5 times faster, to the same
    record. Should ``Sample`` ever have other fields, the plain constructor is used.
    """
    names = tuple(f.name for f in dataclasses.fields(Sample))
    if names != ("metric", "value", "observed_at", "node", "entity", "labels", "evidence"):
        def plain(metric: str, value: float, at: float, node: NodeName, entity: EntityId,
                  labels: dict[str, str]) -> Sample:
            return Sample(metric=metric, value=value, observed_at=at, node=node,
                          entity=entity, labels=labels)
        return plain
    new = object.__new__
    set_metric, set_value, set_at, set_node, set_entity, set_labels, set_evidence = (
        getattr(Sample, name).__set__ for name in names)

    def make(metric: str, value: float, at: float, node: NodeName, entity: EntityId,
             labels: dict[str, str]) -> Sample:
        sample: Sample = new(Sample)
        set_metric(sample, metric)
        set_value(sample, value)
        set_at(sample, at)
        set_node(sample, node)
        set_entity(sample, entity)
        set_labels(sample, labels)
        set_evidence(sample, None)
        return sample

    return make


_new_sample = _sample_factory()


_HeadInfo = tuple[str, NodeName, EntityId, dict[str, str], dict[str, str]]
"""A series part known good: measurement, node, entity, labels, metric per field key."""

_MAX_HEADS = 1_000_000
"""Series parts the fast path remembers before it starts over (bounded memory)."""


class _FastLines:
    """The decoding of the common line, one that needs no check to pass them all.

    A line of numeric fields with a time stamp in range, no escape and no quote, whose
    series part (``measurement,tags``) was seen before is decoded without
    :func:`decode_line` and :func:`~storage.sanitize.check_samples`: its series part is
    parsed and checked once, and its samples share one labels dictionary (records are
    immutable). Any other line (an event, a comment, a NaN, a boolean, a bad name, an
    escape, a time out of range, a cut-off last line) gives ``None`` and takes the full
    path, which counts and lists what it finds exactly as before.
    """

    def __init__(self, precision: Precision) -> None:
        self.per_second = _PER_SECOND[precision]
        self.heads: dict[str, _HeadInfo | None] = {}
        self.good_names: set[str] = set()

    def _learn(self, text: str) -> _HeadInfo | None:
        if len(self.heads) >= _MAX_HEADS:
            self.heads.clear()
        info: _HeadInfo | None = None
        parsed = _parse_head(text)
        if parsed is not None:
            measurement, tags, node, entity = parsed
            if (measurement != EVENT_MEASUREMENT and measurement
                    and not (tags and (_bad_labels(tags) or not all(tags.values())))):
                info = (measurement, node, entity, tags, {})
        self.heads[text] = info
        return info

    def decode(self, line: str, low: float, high: float) -> list[Sample] | None:
        """Return the samples of ``line`` (with its newline), or ``None`` for the full path."""
        if "\\" in line or '"' in line or line[:1].isspace():
            return None
        parts = line.split(" ")
        if len(parts) != 3:
            return None
        head, body, stamp = parts
        info = self.heads.get(head)
        if info is None:
            if head in self.heads:
                return None
            info = self._learn(head)
            if info is None:
                return None
        try:
            at = int(stamp) / self.per_second
        except (ValueError, OverflowError):
            return None
        if not low <= at <= high:
            return None
        measurement, node, entity, labels, metrics = info
        fields: dict[str, float] = {}
        for item in body.split(","):
            key, _, text = item.partition("=")
            try:
                value = float(text)
            except ValueError:
                return None
            if value - value != 0.0:  # NaN or infinite: counted by the full path
                return None
            fields[key] = value
        out: list[Sample] = []
        make = _new_sample
        for key, value in fields.items():
            metric = metrics.get(key)
            if metric is None:
                if not key:
                    return None
                metric = join_metric(measurement, key)
                if metric not in self.good_names:
                    if _NAME.match(metric) is None:
                        return None
                    self.good_names.add(metric)
                metrics[key] = metric
            out.append(make(metric, value, at, node, entity, labels))
        return out


def read_lines(
    paths: Sequence[str | Path],
    *,
    precision: Precision = "ns",
    report: DecodeReport | None = None,
    clock: Clock = system_clock,
    max_future_seconds: float = MAX_FUTURE_SECONDS,
    min_at: float = MIN_AT,
) -> Iterator[Sequence[Record]]:
    """:func:`read_records`, one line's records at a time (its samples, or one event).

    Lines that give no record give nothing. The records, the checks and what ``report``
    receives are :func:`read_records`' exactly (it is this, flattened); samples of one
    line share one ``labels`` dictionary, as they share their time.
    """
    report = report if report is not None else DecodeReport()
    line_report = DecodeReport()
    counts = line_report.skipped
    fast = _FastLines(precision)
    for path in paths:
        name = str(path)
        now = clock()
        low, high = min_at, now + max_future_seconds
        with open(path, "rb") as raw:
            if b"\x00" in raw.read(8192):
                # binary, not text: one problem for the file, not one per garbled line
                report.skipped["binary"] += 1
                report.note(name, 1, "binary", "binary file (NUL bytes), not text")
                continue
        with open(path, encoding="utf-8", errors="replace") as handle:
            number = 0
            for number, line in enumerate(handle, 1):
                if line.endswith("\n"):  # a cut-off last line takes the full path
                    quick = fast.decode(line, low, high)
                    if quick:
                        yield quick
                        continue
                records = decode_line(line, precision=precision, report=line_report)
                if records and records[0].observed_at is None:
                    counts["no_timestamp"] += 1
                    records = []
                if not line.endswith("\n") and (
                        counts["no_timestamp"] or any(counts[r] for r in _PARSE_REASONS)):
                    counts.clear()  # one reason for a cut-off line, whatever it broke
                    counts["truncated"] += 1
                    records = []
                if records:
                    if isinstance(records[0], Event):
                        good: Sequence[Record] = check_events(
                            records, now=now, counts=counts,  # type: ignore[arg-type]
                            max_future_seconds=max_future_seconds, min_at=min_at)
                    else:
                        good = check_samples(
                            records, now=now, counts=counts,  # type: ignore[arg-type]
                            max_future_seconds=max_future_seconds, min_at=min_at)
                    if not good and not line.endswith("\n") and counts["past"]:
                        # a timestamp cut short reads as one from long before 2000
                        counts.clear()
                        counts["truncated"] += 1
                    if good:
                        yield good
                if counts:
                    for reason, n in counts.items():
                        if n:
                            report.skipped[reason] += n
                            report.note(name, number, reason, line)
                    counts.clear()
            if number == 0:
                report.skipped["empty"] += 1
                report.note(name, 1, "empty", "empty file")


# --- export and import ---------------------------------------------------------------------


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_when(text: str, *, now: float) -> float:
    """Parse a time given on the command line into epoch seconds.

    Accepts epoch seconds (``1700000000``), ISO 8601 (``2026-11-30T06:00:00Z``; no zone
    means UTC), ``now``, or a duration before ``now`` (``90s``, ``30m``, ``7d``).

    Raises:
        ValueError: None of these forms.

    Examples:
        >>> parse_when("7d", now=1_000_000.0)
        395200.0
        >>> parse_when("1970-01-02T00:00:00Z", now=0.0)
        86400.0
    """
    from datetime import UTC, datetime

    text = text.strip()
    if text == "now":
        return now
    for unit in sorted(_UNITS, key=len, reverse=True):
        number = text.removesuffix(unit)
        if number != text:
            try:
                return now - float(number) * _UNITS[unit]
            except ValueError:
                break
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a time: {text!r} (epoch seconds, ISO 8601, or 7d/30m ago)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


@dataclass
class TransferReport:
    """Counts of one export or import.

    Attributes:
        samples: Samples written out or into the store.
        events: Events written out or into the store.
        rejected: Reason → records skipped or converted (decode and sanitize reasons).
        problems: The first lines of each reason (file, line number, excerpt).
        past_raw_retention: Samples written that were older than the store's raw
            retention (``retention_seconds``) when written: only its downsampled
            aggregates keep them.
        past_all_retention: Of those, samples older than every downsampled tier's
            retention too: the store will not keep them at all.
        aggregated: Of the samples exported, those that are the finest tier's means
            rather than raw samples (the window reached back past the raw retention).
    """

    samples: int = 0
    events: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    problems: list[LineProblem] = field(default_factory=list)
    past_raw_retention: int = 0
    past_all_retention: int = 0
    aggregated: int = 0


class _HeaderFirst:
    """A text stream that writes ``header`` before the first write (an empty one too)."""

    def __init__(self, out: IO[str], header: str) -> None:
        self._out = out
        self._header: str | None = header

    def write(self, text: str) -> int:
        if self._header is not None:
            self._out.write(self._header)
            self._header = None
        return self._out.write(text) if text else 0


def _iso(at: float) -> str:
    """Return epoch seconds as UTC ISO 8601 to the second (``2026-11-30T06:00:00Z``)."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_frame(out: _HeaderFirst, encoder: LineEncoder, metric: str, frame: pd.DataFrame) -> int:
    """Write the rows of a ``Store.read`` frame as line protocol; return how many."""
    if frame.empty:
        return 0
    label_cols = [c for c in frame.columns if c not in ("observed_at", "node", "entity", "value")]
    batch = []
    for rowd in frame.to_dict("records"):
        labels = {c: str(rowd[c]) for c in label_cols if isinstance(rowd[c], str) and rowd[c]}
        batch.append(Sample(metric=metric, value=float(rowd["value"]),
                            observed_at=float(rowd["observed_at"]),
                            node=NodeName(str(rowd["node"])),
                            entity=EntityId(str(rowd["entity"])), labels=labels))
    lines = encoder.samples(s for s in batch if math.isfinite(s.value))
    if lines:
        out.write("\n".join(lines) + "\n")
    return len(lines)


def _metrics_of(store: Store) -> list[str]:
    listed = getattr(store, "metrics", None)
    if callable(listed):
        return list(listed())
    return [spec.name for spec in CATALOG]


def export(
    store: Store,
    out: IO[str],
    *,
    since_at: float,
    until_at: float,
    metrics: Sequence[str] | None = None,
    entities: Sequence[EntityRef] | None = None,
    precision: Precision = "ns",
) -> TransferReport:
    """Write ``[since_at, until_at]`` of a store as line protocol, metric by metric.

    Args:
        store: Any store; its ``metrics()`` lists what to export when it has one, else
            every catalogued metric is read. Events come from ``read_events`` if present.
        out: Text stream to write to.
        since_at: Window start, epoch seconds (inclusive).
        until_at: Window end, epoch seconds (inclusive).
        metrics: Only these metrics.
        entities: Only these entities.
        precision: Timestamp unit written; a file without a declared unit is ``ns``.

    Returns:
        How many samples and events were written (``aggregated``: how many of the
        samples are means of the store's finest downsampling tier: a store with
        retention, SQLite, keeps only those past its raw retention, and the header line
        says from when).
    """
    encoder = LineEncoder(precision=precision)
    report = TransferReport()
    # A store with retention (SQLite) keeps raw samples only so long, then aggregates:
    # the older part of the window is exported as the finest tier's means.
    raw_keep: float | None = getattr(store, "retention_seconds", None)
    tiers = getattr(store, "downsample", ()) or ()
    store_clock = getattr(store, "clock", None)
    split: tuple[float, float] | None = None  # (tier step, first raw bucket)
    if raw_keep is not None and tiers and callable(store_clock):
        step = min(float(tier_step) for tier_step, _ in tiers)
        cutoff = float(store_clock()) - raw_keep
        raw_from = math.ceil(cutoff / step) * step  # tier buckets before, raw after
        if since_at < raw_from:
            split = (step, raw_from)
    header = (f"# gpuhealth export {_iso(since_at)} .. {_iso(until_at)} "
              f"(epoch {since_at!r}..{until_at!r}) precision={precision}")
    if split is not None:
        header += (f"; samples before {_iso(split[1])} are {split[0]:g}-second means (the "
                   "store keeps only aggregates older than its raw retention)")
    # the header goes out with the first data (or at the end): a read that fails at once
    # leaves no file behind a lazily opened output, not one holding only a header
    sink = _HeaderFirst(out, header + "\n")
    for metric in metrics if metrics is not None else _metrics_of(store):
        if split is not None:
            step, raw_from = split
            old = store.read(metric, entities, since_at, min(until_at, raw_from - 0.001),
                             step_seconds=step)
            report.aggregated += _write_frame(sink, encoder, metric, old)
        raw = store.read(metric, entities,
                         since_at if split is None else max(since_at, split[1]), until_at)
        report.samples += _write_frame(sink, encoder, metric, raw)
    report.samples += report.aggregated
    read_events = getattr(store, "read_events", None)
    if callable(read_events):
        events = [e for e in read_events(since_at, until_at)
                  if entities is None or EntityRef(node=e.node, entity=e.entity) in entities]
        if events:
            sink.write("\n".join(encoder.events(events)) + "\n")
        report.events = len(events)
    sink.write("")
    return report


def import_lines(
    store: Store,
    sources: Iterable[str | Path],
    *,
    precision: Precision = "ns",
    batch_size: int = 5000,
    clock: Clock = system_clock,
    max_future_seconds: float = 600.0,
) -> TransferReport:
    """Write line-protocol files into a store in batches, keeping their timestamps.

    The files are read with :func:`read_records`, the same checks as ``gpuhealth replay``:
    a line without a timestamp is rejected (``no_timestamp``; history keeps its own
    times), a cut-off last line is rejected as ``truncated``, and bad lines and values are
    skipped and counted (``syntax``, ``value``, ``string_field``, and the reasons of
    :mod:`storage.sanitize`), never written. The first lines of each reason are logged as
    warnings with file and line number, and kept in :attr:`TransferReport.problems`.

    Args:
        store: The target store.
        sources: Files to read, in order.
        precision: Timestamp unit of the files.
        batch_size: Records per batch (``store.write`` call, or one batch of its
            ``write_stream``: :func:`core.protocols.write_batches`).
        clock: Epoch seconds, for the future bound.
        max_future_seconds: Latest accepted timestamp after ``clock()``.

    Returns:
        Counts written and skipped.

    Raises:
        TemporaryError: The store failed; the batches before it were written.
    """
    report = TransferReport()
    decode = DecodeReport(skipped=report.rejected, problems=report.problems)
    # A store with retention (SQLite) keeps raw samples only so long, then aggregates:
    # history older than that is imported but not kept as it was; the report says so.
    raw_keep: float | None = getattr(store, "retention_seconds", None)
    tier_keep = max((keep for _, keep in getattr(store, "downsample", ()) or ()),
                    default=raw_keep or 0.0)

    def checked(samples: list[Sample], events: list[Event]) -> Batch:
        now = clock()
        good = check_samples(samples, now=now, counts=report.rejected,
                             max_future_seconds=max_future_seconds)
        good_events = check_events(events, now=now, counts=report.rejected,
                                   max_future_seconds=max_future_seconds)
        if raw_keep is not None:
            for sample in good:
                if sample.observed_at is None:
                    continue
                age = now - sample.observed_at
                if age > raw_keep:
                    report.past_raw_retention += 1
                    if age > tier_keep:
                        report.past_all_retention += 1
        report.samples += len(good)
        report.events += len(good_events)
        return good, good_events

    def batches() -> Iterator[Batch]:
        samples: list[Sample] = []
        events: list[Event] = []
        for record in read_records(list(sources), precision=precision, report=decode,
                                   clock=clock, max_future_seconds=max_future_seconds):
            if isinstance(record, Sample):
                samples.append(record)
            else:
                events.append(record)
            if len(samples) + len(events) >= batch_size:
                batch = checked(samples, events)
                samples, events = [], []
                if batch[0] or batch[1]:
                    yield batch
        batch = checked(samples, events)
        if batch[0] or batch[1]:
            yield batch

    # a remote store reads and encodes the next batch while one is on the wire
    write_batches(store, batches())
    for problem in report.problems:
        logger.warning("import: %s", problem)
    if report.rejected:
        logger.warning("import skipped or converted: %s", dict(report.rejected))
    return report
