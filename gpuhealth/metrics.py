"""The Prometheus ``/metrics`` endpoint: latest value per series, rendered once per collection.

:class:`MetricsExporter` keeps the latest sample of every series it has seen plus
gpuhealth's own counters, and exposes them through one prometheus-client *custom
collector* on a private registry (ecosystem-reference §3.3), with HELP and TYPE taken
from ``core.catalog``. :meth:`MetricsExporter.render` runs ``generate_latest`` once after
each collection and caches the body; :class:`MetricsServer` answers every scrape from that
cache, so a scrape costs a memory copy, not a render.

Collected metrics carry ``node`` and ``entity`` labels plus their catalogued labels;
gpuhealth's own metrics (``gpuhealth_*``) carry only their catalogued labels.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample as _PromSample

from core.catalog import BY_NAME, MetricSpec, MetricType
from core.records import Event, Sample
from gpuhealth._serving import ServingThread

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""What ``generate_latest`` writes: the Prometheus text format 0.0.4."""

_OWN_PREFIX = "gpuhealth_"


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

    def register(self, collector: Collector) -> None:
        """Add a stage's own prometheus-client collector (its families on every render)."""
        self._registry.register(collector)
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
                    self._values.setdefault(spec.name, {})[key] = float(record.value)
                elif record.kind == "xid" and record.code.isdigit():
                    node, entity = str(record.node), str(record.entity)
                    counts = self._values.setdefault("gpu_xid_events_total", {})
                    xkey = (node, entity, record.code)
                    counts[xkey] = counts.get(xkey, 0.0) + 1.0
                    self._values.setdefault("gpu_last_xid", {})[(node, entity)] = float(
                        record.code)

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

    def set(self, metric: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Set one of gpuhealth's own series (a gauge, or a counter read from elsewhere)."""
        with self._lock:
            spec = self._spec(metric)
            if spec is None:
                return
            key = tuple(str((labels or {}).get(name, "")) for name in label_names(spec))
            self._values.setdefault(spec.name, {})[key] = float(value)

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
        """Render the exposition text now and cache it for :meth:`body`; return it."""
        with self._render_lock:
            body: bytes = generate_latest(self._registry)
            self._body = body
        return body

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


class MetricsServer:
    """Serve :class:`MetricsExporter`'s cached body on ``/metrics`` from a thread.

    Args:
        exporter: Where the body comes from.
        listen_address: Address to bind (``127.0.0.1`` by default in the settings).
        port: TCP port; 0 picks a free one (see :attr:`port` after :meth:`start`).
    """

    def __init__(self, *, exporter: MetricsExporter, listen_address: str = "127.0.0.1",
                 port: int = 9835) -> None:
        self.exporter = exporter
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
        self.port = self._serving.start(server, name="gpuhealth-metrics", poll_interval=0.2)

    @property
    def url(self) -> str:
        """Return the ``/metrics`` URL."""
        return f"http://{self.listen_address}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket; idempotent."""
        self._serving.stop()
