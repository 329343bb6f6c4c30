"""The Prometheus ``/metrics`` endpoint: latest value per series, rendered once per collection.

:class:`MetricsExporter` keeps the latest sample of every series it has seen plus
gpuhealth's own counters, and exposes them through one prometheus-client *custom
collector* on a private registry (ecosystem-reference §3.3), with HELP and TYPE taken
from ``core.catalog``. :meth:`MetricsExporter.render` renders once after each collection
(the text ``generate_latest`` would write, with the exporter's own lines formatted from
per-series prefixes made once) and caches the body; :class:`MetricsServer` answers every
scrape from that cache, so a scrape costs a memory copy, not a render.

Collected metrics carry ``node`` and ``entity`` labels plus their catalogued labels;
gpuhealth's own metrics (``gpuhealth_*``) carry only their catalogued labels.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from math import copysign
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample as _PromSample
from prometheus_client.utils import floatToGoString

from core.catalog import BY_NAME, MetricSpec, MetricType
from core.records import Event, Sample
from gpuhealth._serving import ServingThread
from gpuhealth.health import Health

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""What ``generate_latest`` writes: the Prometheus text format 0.0.4."""

_OWN_PREFIX = "gpuhealth_"

_LEGACY_METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LEGACY_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _go_float(value: float) -> str:
    """Format a sample value as ``generate_latest`` does (Go's notation, ``+Inf``, ``NaN``)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


def _label_value(value: str) -> str:
    """Escape a label value as ``generate_latest`` does (backslash, newline, quote)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def label_names(spec: MetricSpec) -> tuple[str, ...]:
    """Return the label names of a catalogued metric as exported.

    Examples:
        >>> label_names(BY_NAME["gpu_clock_event_active"])
        ('node', 'entity', 'reason')
        >>> label_names(BY_NAME["gpuhealth_findings_total"])
        ('severity',)
    """
    if spec.name.startswith(_OWN_PREFIX):
        return spec.labels
    return ("node", "entity", *spec.labels)


class _Snapshot(Collector):
    """prometheus-client custom collector over the exporter's latest values."""

    def __init__(self, exporter: MetricsExporter) -> None:
        self._exporter = exporter

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        yield from self._exporter._families()


class _Families(Collector):
    """A fixed list of families, to render them with ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self._list = families

    def collect(self) -> Iterable[Metric]:
        return self._list


class MetricsExporter:
    """Latest value per series plus gpuhealth's own counters, as exposition text.

    Thread-safe: collectors update it from their worker threads, the HTTP server reads the
    cached body from its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[str, ...], float]] = {}
        self._unknown: set[str] = set()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Snapshot(self))
        self._body = b""
        self._render_lock = threading.Lock()
        self._stages: list[Collector] = []
        self._stage_registry = CollectorRegistry(auto_describe=False)
        # Per metric: its HELP and TYPE lines and the sample name; per series: the text of
        # its line before the value (made once), the value last rendered and its line. A
        # render formats only the values that changed (most of a node's do not, each second).
        self._headers: dict[str, tuple[str, str]] = {}
        self._lines: dict[str, dict[tuple[str, ...], tuple[str, float, str]]] = {}
        # Per metric: its rendered text; rebuilt only when one of its series was set.
        self._blocks: dict[str, bytes] = {}
        self._touched: set[str] = set()

    def register(self, collector: Collector) -> None:
        """Add a stage's own prometheus-client collector (its families on every render)."""
        self._registry.register(collector)
        self._stage_registry.register(collector)
        self._stages.append(collector)

    def update(self, records: Iterable[Sample | Event]) -> None:
        """Remember the latest value of every sample's series; count Xid events.

        Args:
            records: Samples (kept, latest wins) and events (``xid`` events increment
                ``gpu_xid_events_total{xid}`` and set ``gpu_last_xid``; others are ignored).
        """
        with self._lock:
            for record in records:
                if isinstance(record, Sample):
                    spec = self._spec(record.metric)
                    if spec is None:
                        continue
                    key = (str(record.node), str(record.entity),
                           *(str(record.labels.get(name, "")) for name in spec.labels))
                    series = self._values.setdefault(spec.name, {})
                    value, old = float(record.value), series.get(key)
                    series[key] = value
                    if old != value or not value:  # a render redoes only what changed
                        self._touched.add(spec.name)
                elif record.kind == "xid" and record.code.isdigit():
                    node, entity = str(record.node), str(record.entity)
                    counts = self._values.setdefault("gpu_xid_events_total", {})
                    xkey = (node, entity, record.code)
                    counts[xkey] = counts.get(xkey, 0.0) + 1.0
                    self._values.setdefault("gpu_last_xid", {})[(node, entity)] = float(
                        record.code)
                    self._touched.update(("gpu_xid_events_total", "gpu_last_xid"))

    def inc(self, metric: str, labels: Mapping[str, str] | None = None,
            amount: float = 1.0) -> None:
        """Add ``amount`` to one of gpuhealth's own counters (``gpuhealth_*``)."""
        with self._lock:
            spec = self._spec(metric)
            if spec is None:
                return
            key = tuple(str((labels or {}).get(name, "")) for name in label_names(spec))
            series = self._values.setdefault(spec.name, {})
            series[key] = series.get(key, 0.0) + amount
            self._touched.add(spec.name)

    def set(self, metric: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Set one of gpuhealth's own series (a gauge, or a counter read from elsewhere)."""
        with self._lock:
            spec = self._spec(metric)
            if spec is None:
                return
            key = tuple(str((labels or {}).get(name, "")) for name in label_names(spec))
            series = self._values.setdefault(spec.name, {})
            old = series.get(key)
            series[key] = float(value)
            if old != value or not value:
                self._touched.add(spec.name)

    def value(self, metric: str, labels: Mapping[str, str] | None = None) -> float | None:
        """Return the current value of one series, or ``None`` (for tests and the CLI)."""
        spec = BY_NAME.get(metric)
        if spec is None:
            return None
        key = tuple(str((labels or {}).get(name, "")) for name in label_names(spec))
        with self._lock:
            found = self._values.get(metric, {}).get(key)
        if found is not None:
            return found
        wanted = dict(zip(label_names(spec), key, strict=True))
        for stage in self._stages:
            for fam in stage.collect():
                for sample in fam.samples:
                    if sample.name == metric and {
                            k: v for k, v in sample.labels.items() if k in wanted} == wanted:
                        return float(sample.value)
        return None

    def _spec(self, metric: str) -> MetricSpec | None:
        spec = BY_NAME.get(metric)
        if spec is None and metric not in self._unknown:
            self._unknown.add(metric)
            logger.warning("metric %r is not in core.catalog; not exported", metric)
        return spec

    def _families(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = {name: dict(series) for name, series in sorted(self._values.items())}
        for name, series in snapshot.items():
            spec = BY_NAME[name]
            names = list(label_names(spec))
            family: Any
            if spec.type is MetricType.COUNTER:
                family = CounterMetricFamily(name, spec.help, labels=names)
            else:
                family = GaugeMetricFamily(name, spec.help, labels=names)
            sample_name = f"{family.name}_total" if spec.type is MetricType.COUNTER else name
            # What add_metric does, without its per-call overhead (render is the hot path).
            family.samples.extend(
                _PromSample(sample_name, dict(zip(names, key, strict=True)), value)
                for key, value in series.items()
            )
            yield family

    def render(self) -> bytes:
        """Render the exposition text now and cache it for :meth:`body`; return it.

        The text is what ``generate_latest`` writes for :meth:`_families` followed by the
        registered stages' families, byte for byte; the exporter's own series are formatted
        from per-series line prefixes made once; a metric none of whose series was set since
        the last render keeps its text, and a series whose value did not change keeps its
        line (a render of a node's ~1,200 series costs ~0.1 ms instead of ~7: the agent
        renders after every collection).
        """
        with self._render_lock:
            with self._lock:
                touched, self._touched = self._touched, set()
                snapshot = [(name, list(self._values[name].items())) for name in touched]
                order = sorted(self._values)
            for name, series in snapshot:
                self._blocks[name] = self._block(name, series)
            body = b"".join([self._blocks[name] for name in order])
            if self._stages:
                body += generate_latest(self._stage_registry)
            self._body = body
        return body

    def _block(self, name: str, series: list[tuple[tuple[str, ...], float]]) -> bytes:
        """The text of one metric: its HELP and TYPE lines, then one line per series."""
        header, sample_name = self._header(name)
        parts = [header]
        lines = self._lines.setdefault(name, {})
        for key, value in series:
            cached = lines.get(key)
            if cached is not None and cached[1] == value and (
                    value or copysign(1.0, value) == copysign(1.0, cached[1])):
                parts.append(cached[2])  # unchanged (0.0 and -0.0 print apart)
                continue
            prefix = cached[0] if cached else self._prefix(name, sample_name, key)
            line = f"{prefix}{_go_float(value)}\n"
            lines[key] = (prefix, value, line)
            parts.append(line)
        return "".join(parts).encode("utf-8")

    def _header(self, name: str) -> tuple[str, str]:
        """The HELP and TYPE lines of catalogued metric ``name``, and its samples' name."""
        found = self._headers.get(name)
        if found is None:
            spec = BY_NAME[name]
            family: Any = (CounterMetricFamily(name, spec.help, labels=[])
                           if spec.type is MetricType.COUNTER
                           else GaugeMetricFamily(name, spec.help, labels=[]))
            sample_name = f"{family.name}_total" if spec.type is MetricType.COUNTER else name
            header = generate_latest(_Families([family])).decode("utf-8")
            found = self._headers[name] = (header, sample_name)
        return found

    def _prefix(self, name: str, sample_name: str, key: tuple[str, ...]) -> str:
        """The text of one series' line before its value, as ``generate_latest`` writes it."""
        names = label_names(BY_NAME[name])
        if _LEGACY_METRIC.match(sample_name) and all(_LEGACY_LABEL.match(n) for n in names):
            if not names:
                return f"{sample_name} "
            labels = ",".join(f'{k}="{_label_value(v)}"'
                              for k, v in sorted(zip(names, key, strict=True)))
            return f"{sample_name}{{{labels}}} "
        # A name outside the legacy character set: let prometheus-client escape it.
        family = GaugeMetricFamily(sample_name, "", labels=list(names))
        family.samples.append(_PromSample(sample_name, dict(zip(names, key, strict=True)), 0.0))
        line = generate_latest(_Families([family])).decode("utf-8").splitlines()[-1]
        return line[: -len("0.0")]

    def body(self) -> bytes:
        """Return the body rendered last (empty before the first :meth:`render`)."""
        return self._body


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    disable_nagle_algorithm = True  # headers and body go out without a delayed-ACK wait

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, self.server.exporter.body(), CONTENT_TYPE)
        elif path == "/healthz" and self.server.health is not None:
            status, body = self.server.health.answer()  # 503 with reasons when failing
            self._reply(status, body, "text/plain; charset=utf-8")
        elif path in ("/", "/healthz"):
            self._reply(200, b"gpuhealth: ok; metrics at /metrics\n", "text/plain; charset=utf-8")
        else:
            self._reply(404, b"not found\n", "text/plain; charset=utf-8")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s - %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    exporter: MetricsExporter
    health: Health | None = None


class MetricsServer:
    """Serve :class:`MetricsExporter`'s cached body on ``/metrics`` from a thread.

    Args:
        exporter: Where the body comes from.
        listen_address: Address to bind (``127.0.0.1`` by default in the settings).
        port: TCP port; 0 picks a free one (see :attr:`port` after :meth:`start`).
        health: What ``/healthz`` answers (200, or 503 naming the failing stages); without
            it ``/healthz`` answers 200 while the server runs.
    """

    def __init__(self, *, exporter: MetricsExporter, listen_address: str = "127.0.0.1",
                 port: int = 9835, health: Health | None = None) -> None:
        self.exporter = exporter
        self.health = health
        self.listen_address = listen_address
        self.port = port
        self._serving = ServingThread()

    def start(self) -> None:
        """Bind and start serving in a daemon thread.

        Raises:
            OSError: The address cannot be bound (port in use, address not local).
        """
        server = _Server((self.listen_address, self.port), _Handler)
        server.exporter = self.exporter
        server.health = self.health
        self.port = self._serving.start(server, name="gpuhealth-metrics", poll_interval=0.2)

    @property
    def url(self) -> str:
        """Return the ``/metrics`` URL."""
        return f"http://{self.listen_address}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket; idempotent."""
        self._serving.stop()
