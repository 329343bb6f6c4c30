"""``gpuhealth run``: wire collectors, the store, the pipeline and ``/metrics`` into one process.

Threads:

- one per polled collector, calling ``collect()`` every ``interval_seconds``;
- one per streaming collector (``stream()``, e.g. the kernel log);
- one writer, which takes buffered records in batches (every ``flush_interval_seconds`` or
  ``flush_max_records``), feeds them to the pipeline, writes them to the store, and runs
  ``Pipeline.evaluate()`` every ``evaluate_interval_seconds``;
- the ``/metrics`` HTTP server.

A collector that raises :class:`CollectorUnavailable` is reported once at WARNING and
retried rarely; any other exception in one collector is logged (once per exception type)
and counted and never stops the others. SIGTERM and SIGINT set the stop event; shutdown
joins the threads, writes every buffered record and closes the store.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal

from alerting.inbound import InboundBatch
from analytics.online import OnlineAnalytics
from analytics.prediction_stage import PredictionStage
from analytics.stage import AnalyticsStage
from collectors.kernel_log import boot_event
from collectors.nvml_events import XidDedup
from core import plugins
from core.errors import (
    CollectorUnavailable,
    ConfigError,
    GpuHealthError,
    PermanentError,
    PluginError,
    TemporaryError,
)
from core.protocols import (
    ActionReporter,
    Closeable,
    Collector,
    ErrorCounting,
    Store,
    StreamingCollector,
)
from core.records import AlertState, Event, Finding, Record, Sample, Severity
from gpuhealth.agent import DRILL_INBOX, AgentLink, drill_inbox
from gpuhealth.api import ApiServer, recover_ingests, start_api
from gpuhealth.compose import (
    agent_pipeline,
    build_analytics,
    build_protective,
    service_pipeline,
)
from gpuhealth.config import (
    Settings,
    collector_options,
)
from gpuhealth.health import Health
from gpuhealth.history_sync import HistoryRecorder
from gpuhealth.leader import build_leader_loop
from gpuhealth.metrics import MetricsExporter, MetricsServer
from gpuhealth.pipeline import Pipeline
from remediation.bundle import BundleCollector
from remediation.gpu_reset import (
    GpuResetEndpoint,
    GpuResetter,
    QuiescibleCollector,
    quiesce_all,
)
from remediation.metrics import RemediationCollector
from remediation.policy import RemediationPolicy
from remediation.protective import ProtectiveCordon
from remediation.validation import ValidationRunner, ValidationService
from remediation.webhook import resolve_secret
from storage import open_store, store_stats
from storage.factory import READ_ONLY_STORES
from storage.history import IncidentHistory

logger = logging.getLogger(__name__)

INBOUND_SOURCE = "alertmanager:"
"""Journal source of a finding from an inbound Alertmanager alert (``alertmanager:<fp>``)."""

UNAVAILABLE_RETRY_SECONDS = 60.0
"""How long to wait before retrying a collector whose source is gone (unless it says)."""

STREAM_RESTART_SECONDS = 5.0
"""Pause before restarting a stream that ended or failed."""

JOIN_TIMEOUT_SECONDS = 5.0
"""How long shutdown waits for each thread."""

EVALUATE_TIMEOUT_SECONDS = 120.0
"""Longest one evaluation may take on the service's loop before it is given up on."""


def disrupted(policy: RemediationPolicy) -> frozenset[str]:
    """Nodes gpuhealth has taken out of service; none in dry run.

    A dry-run policy still counts the nodes it *would* take out, to show what the budget
    would hold back (audit log); nothing is out of service, so the metrics say so.
    """
    return frozenset() if policy.dry_run else policy.out_of_service


class RecordBuffer:
    """A bounded FIFO of records between the collector threads and the writer.

    Args:
        max_records: Capacity; beyond it the oldest records are dropped and counted.
    """

    def __init__(self, *, max_records: int) -> None:
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records!r}")
        self.max_records = max_records
        self.dropped = 0
        self._items: collections.deque[Record] = collections.deque()
        self._cond = threading.Condition()
        self._urgent = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, records: Sequence[Record]) -> None:
        """Append records; wake the writer when a batch is full."""
        if not records:
            return
        with self._cond:
            self._items.extend(records)
            if not self._urgent and any(isinstance(r, Event) for r in records):
                self._urgent = True  # an event (an Xid) is judged at once, not at the next flush
            over = len(self._items) - self.max_records
            if over > 0:
                for _ in range(over):
                    self._items.popleft()
                if self.dropped == 0:
                    logger.warning("record buffer full (%d records): dropping the oldest; "
                                   "the store is not keeping up", self.max_records)
                self.dropped += over
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake a :meth:`take` that waits (its ``stop`` was set)."""
        with self._cond:
            self._cond.notify_all()

    def take(self, *, max_records: int, wait_seconds: float,
             stop: threading.Event | None = None) -> list[Record]:
        """Wait until ``max_records`` are buffered, ``wait_seconds`` pass or ``stop`` is set.

        Returns:
            Up to ``max_records`` records, oldest first (possibly none).
        """
        deadline = time.monotonic() + wait_seconds
        with self._cond:
            while len(self._items) < max_records and not (stop is not None and stop.is_set()):
                if self._urgent:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)  # put() and wake() notify: no polling while idle
            self._urgent = False
            count = min(max_records, len(self._items))
            return [self._items.popleft() for _ in range(count)]


@dataclass
class _Counters:
    """Errors of one collector by reason, as the service saw them."""

    by_reason: collections.Counter[str] = field(default_factory=collections.Counter)
    logged: set[str] = field(default_factory=set)


class Service:
    """The running service; :func:`run` is the usual way in.

    Args:
        settings: Loaded settings.
        stop: Set to stop; one is made when ``None``.
        collectors: Ready-made collectors by name, instead of building the enabled
            ``[collectors.*]`` tables (for tests and embedding); polled every
            ``interval_seconds`` of the table of the same name, else every second.
        role: ``"run"``: the whole stack in one process. ``"agent"``: one GPU node of a
            fleet: collect, store, judge and detect on this node, and forward findings
            to the controllers through the durable outbox (:class:`AgentLink`); no
            alerting, remediation, history or report here (the controller's).

    Raises:
        ConfigError: ``role="agent"`` without ``[agent] controllers`` or a token.
    """

    def __init__(self, settings: Settings, *, stop: threading.Event | None = None,
                 collectors: Mapping[str, Collector] | None = None,
                 role: Literal["run", "agent"] = "run") -> None:
        self.settings = settings
        self.role = role
        self.link: AgentLink | None = None
        self.protective: ProtectiveCordon | None = None
        self.stop = stop or threading.Event()
        self._given = dict(collectors) if collectors is not None else None
        self.exporter = MetricsExporter()
        # /healthz: stages' failures as _log_once reports them, and the store's state
        self.health = Health()
        self.health.check("store", lambda: store_stats(self.store).failing
                          if self.store is not None else None)
        storage = settings.storage
        self.buffer = RecordBuffer(max_records=storage.queue_max_records)
        self.store: Store | None = None
        self.pipeline: Pipeline | None = None
        self.server: MetricsServer | None = None
        self.api: ApiServer | None = None
        self._xid_dedup = XidDedup(hold_seconds=2.0)
        self.collectors: dict[str, Collector] = {}
        self._errors: dict[str, _Counters] = {}
        self._threads: list[threading.Thread] = []
        self._writer: threading.Thread | None = None
        self._remediator: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._remediation_metrics: RemediationCollector | None = None
        self._inbound: dict[str, tuple[str, str, str, str]] = {}
        self._gpus: set[tuple[str, str]] = set()
        self.recorder: HistoryRecorder | None = None
        self._report_scheduler: Any = None
        self.elector = build_leader_loop(settings)
        self._unwritten: list[Record] = []
        self._last_value: dict[tuple[Any, ...], float] = {}
        self._seen_findings: set[tuple[str, str, str, str]] = set()
        self._logged: set[str] = set()
        self._dirty = False
        self.analytics: AnalyticsStage = build_analytics(settings, role=role)
        self.online: OnlineAnalytics | None = self.analytics.online
        self.prediction: PredictionStage | None = self.analytics.prediction

    # --- start-up ----------------------------------------------------------------------

    def start(self) -> None:
        """Create the data folder, build every plugin, start the threads.

        Raises:
            GpuHealthError: The store cannot be opened.
            OSError: The data folder cannot be created or ``/metrics`` cannot be bound.
        """
        s = self.settings
        data_dir = s.node.data_dir
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise StartupError(f"[node] data_dir {data_dir}: not a directory") from exc
        except OSError as exc:
            raise StartupError(f"[node] data_dir {data_dir}: {exc.strerror}") from exc
        try:
            if s.storage.type in READ_ONLY_STORES:
                logger.info("[storage] type = %r only reads (%s): this service writes no "
                            "samples; let Prometheus scrape its /metrics", s.storage.type,
                            s.storage.url)
            else:
                self.store = open_store(s.storage.type, s.store_options,
                                        spool_path=data_dir / "spool",
                                        spool_max_bytes=s.storage.spool_max_bytes)
        except Exception as exc:  # a corrupt or unreadable database file, a bad plugin
            raise StartupError(
                f"[storage] cannot open the {s.storage.type} store "
                f"({s.storage.url or s.storage_path}): {exc}"
            ) from exc
        if self._given is None:
            self._build_collectors()
        else:
            self.collectors = dict(self._given)
        if self.role == "agent":  # drills through the fleet (gpuhealth drill --fleet)
            self.collectors.setdefault(DRILL_INBOX, drill_inbox(s))
        self.pipeline = self._build_pipeline()
        if self.role != "agent":
            self._remediation_metrics = RemediationCollector(
                self.pipeline.remediation, is_leader=self.elector.is_leader_now)
            self._remediation_metrics.refresh()
            self.exporter.register(self._remediation_metrics)
        if self.role == "agent":
            self.link = AgentLink.start(s, exporter=self.exporter, stop=self.stop,
                                        inventory=self._inventory)
            self.protective = build_protective(s)
        else:
            try:
                self.recorder = HistoryRecorder(IncidentHistory(s.history_path))
            except Exception as exc:
                raise StartupError(f"[report] cannot open the incident history "
                                   f"{s.history_path}: {exc}") from exc
            if s.report.enabled:
                self._start_weekly_report()
        if s.metrics.enabled:
            self.server = MetricsServer(exporter=self.exporter,
                                        listen_address=s.metrics.listen_address,
                                        port=s.metrics.port, health=self.health)
            try:
                self.server.start()
            except OSError as exc:
                self.server = None
                raise StartupError(
                    f"[metrics] cannot listen on {s.metrics.listen_address}:{s.metrics.port}: "
                    f"{exc.strerror} (set [metrics] port or listen_address)"
                ) from exc
        try:
            self.api = start_api(s, self.pipeline, on_alertmanager=self._on_alertmanager,
                                 on_action_report=scheduler.report
                                 if isinstance(scheduler := self.pipeline.engine.scheduler,
                                               ActionReporter) else None,
                                 gpu_reset=self._gpu_reset_endpoint())
        except OSError as exc:
            raise StartupError(
                f"[alerting] cannot listen on {s.alerting.api_listen_address}:"
                f"{s.alerting.api_port} for the HTTP API: {exc.strerror} "
                "(set [alerting] api_port or api_listen_address)"
            ) from exc
        self.exporter.inc("gpuhealth_samples_written_total", amount=0.0)
        self.exporter.inc("gpuhealth_events_written_total", amount=0.0)
        self.exporter.render()
        if self.role == "agent":
            logger.info("gpuhealth agent running on node %s: data in %s (store %s), metrics "
                        "at %s; findings go to the controllers", s.node.name, s.node.data_dir,
                        _store_name(s), self.server.url if self.server else "disabled")
        else:
            logger.info(
                "gpuhealth running on node %s: data in %s (store %s), metrics at %s, audit log "
                "%s (remediation %s)",
                s.node.name, s.node.data_dir, _store_name(s),
                self.server.url if self.server else "disabled", s.audit_log_path,
                "dry-run" if s.remediation.dry_run else "LIVE")
        for name, collector in self.collectors.items():
            if isinstance(collector, StreamingCollector):
                target, args = self._stream_loop, (name, collector)
            else:
                table = s.collectors.get(name)
                interval = table.poll_interval_seconds if table else 1.0
                target, args = self._poll_loop, (name, collector, interval)  # type: ignore[assignment]
            thread = threading.Thread(target=target, args=args, name=f"gpuhealth-{name}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
        self._writer = threading.Thread(target=self._writer_loop, name="gpuhealth-writer",
                                        daemon=True)
        self._writer.start()
        if self.role == "agent":
            self._remediator = threading.Thread(target=self._loop_thread,
                                                name="gpuhealth-loop", daemon=True)
            self._remediator.start()
            return
        self.elector.start()
        if s.remediation.election != "local" and not self.elector.is_leader_now():
            logger.warning(
                "remediation: %s is standby (leader election %r: not leader now); it alerts "
                "but takes no remediation action until it leads", self.elector.identity,
                s.remediation.election)
        self._remediator = threading.Thread(target=self._loop_thread,
                                            name="gpuhealth-loop", daemon=True)
        self._remediator.start()

    def _build_collectors(self) -> None:
        for name, table in self.settings.enabled_collectors().items():
            if table.type == "dcgm_exporter" and not table.options.get("url"):
                logger.info("collector %r: no url set; dcgm-exporter is not scraped", name)
                continue
            try:
                factory = plugins.load("gpuhealth.collectors", table.type)
                options = collector_options(self.settings, table, factory)
                self.collectors[name] = plugins.build(
                    "gpuhealth.collectors", table.type, options, expect=Collector)
            except PluginError as exc:
                raise ConfigError(f"{self.settings.source}: [collectors.{name}] {exc}") from exc

    def _build_pipeline(self) -> Pipeline:
        pipeline = self._pipeline_of_role()
        boot = boot_event(self.settings.node.name)  # the boot window needs this boot's time
        if boot is not None:
            pipeline.observe([boot])
        return pipeline

    def _pipeline_of_role(self) -> Pipeline:
        if self.role == "agent":
            return agent_pipeline(self.settings)
        pipeline = service_pipeline(self.settings, identity=self.elector.identity,
                                    is_leader=self.elector.is_leader_now)
        # What was accepted before a restart (ingested artifacts, detector and
        # Alertmanager findings) comes back from the journal.
        try:
            recover_ingests(pipeline, window_seconds=self.settings.analytics.event_window_seconds)
            for finding, source in pipeline.recover():
                if source.startswith(INBOUND_SOURCE):
                    self._inbound[source[len(INBOUND_SOURCE):]] = finding.key
        except TemporaryError as exc:
            logger.error("cannot read the input journal: %s", exc)  # noqa: TRY400
        return pipeline

    # --- collector threads ---------------------------------------------------------------

    def _count(self, name: str, reason: str) -> bool:
        """Count one error of collector ``name``; return True the first time for ``reason``."""
        counters = self._errors.setdefault(name, _Counters())
        counters.by_reason[reason] += 1
        first = reason not in counters.logged
        counters.logged.add(reason)
        self._publish_errors(name)
        self._dirty = True
        return first

    def _publish_errors(self, name: str) -> None:
        own = self._errors.get(name, _Counters()).by_reason
        collector = self.collectors.get(name)
        reported = collector.errors_total if isinstance(collector, ErrorCounting) else None
        merged: collections.Counter[str] = collections.Counter(own)
        if reported is not None:
            for reason, count in reported.items():
                if isinstance(count, int | float):
                    merged[str(reason)] += int(count)
        for reason, count in merged.items():
            self.exporter.set("gpuhealth_collector_errors_total", count,
                              {"collector": name, "reason": reason})

    def _accept(self, name: str, records: Sequence[Record]) -> None:
        # One Xid seen by NVML and by the kernel log is one event (issue 3).
        records = self._xid_dedup.filter(records)
        self.buffer.put(records)
        self.exporter.update(records)
        self._publish_errors(name)

    def _poll_loop(self, name: str, collector: Collector, interval: float) -> None:
        unavailable = False
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                records = list(collector.collect())
            except CollectorUnavailable as exc:
                delay = max(interval, exc.retry_after_seconds or UNAVAILABLE_RETRY_SECONDS)
                self._count(name, "unavailable")
                if not unavailable:
                    logger.warning("%s; running without the %r collector (retrying every %.0f s)",
                                   exc, name, delay)
                    unavailable = True
                self.stop.wait(delay)
                continue
            except Exception as exc:
                self._failed(name, exc)
                self.stop.wait(interval)
                continue
            if unavailable:
                logger.warning("collector %r is available again", name)
                unavailable = False
            elapsed = time.monotonic() - started
            self._accept(name, records)
            self.exporter.set("gpuhealth_collection_duration_seconds", elapsed,
                              {"collector": name})
            self.exporter.render()
            self.stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def _failed(self, name: str, exc: BaseException) -> None:
        reason = type(exc).__name__
        if self._count(name, reason):
            logger.error("collector %r failed: %s: %s (counted from now on; the others keep "
                         "running)", name, reason, exc)
        logger.debug("collector %r failed", name, exc_info=exc)

    def _stream_loop(self, name: str, collector: StreamingCollector) -> None:
        unavailable = False
        while not self.stop.is_set():
            delay = STREAM_RESTART_SECONDS
            try:
                for event in collector.stream():
                    if unavailable:
                        logger.warning("collector %r is available again", name)
                        unavailable = False
                    self._accept(name, [event])
                    self._dirty = True
                    if self.stop.is_set():
                        break
            except CollectorUnavailable as exc:
                delay = exc.retry_after_seconds or UNAVAILABLE_RETRY_SECONDS
                self._count(name, "unavailable")
                if not unavailable:
                    logger.warning("%s; running without the %r collector (retrying every %.0f s)",
                                   exc, name, delay)
                    unavailable = True
            except Exception as exc:
                self._failed(name, exc)
            self.stop.wait(delay)

    # --- writer thread -------------------------------------------------------------------

    def _writer_loop(self) -> None:
        s = self.settings
        next_eval = time.monotonic() + s.analytics.evaluate_interval_seconds
        while not self.stop.is_set():
            batch = self.buffer.take(max_records=s.storage.flush_max_records,
                                     wait_seconds=s.storage.flush_interval_seconds,
                                     stop=self.stop)
            self._deliver(batch)
            urgent = any(isinstance(r, Event) for r in batch)
            if urgent or time.monotonic() >= next_eval:
                next_eval = time.monotonic() + s.analytics.evaluate_interval_seconds
                self._evaluate()
            if self._dirty:
                self._dirty = False
                self.exporter.render()

    def _observe(self, batch: Sequence[Record]) -> None:
        """Give the pipeline every event and every sample whose value changed."""
        if self.pipeline is None or not batch:
            return
        changed: list[Record] = []
        repeated: list[Record] = []  # still readings: a debounced state counts every poll
        for record in batch:
            if isinstance(record, Sample):
                if record.metric.startswith("gpu_") and record.entity != "node":
                    self._gpus.add((str(record.node), str(record.entity)))
                key = (record.metric, record.node, record.entity,
                       tuple(sorted(record.labels.items())))
                if self._last_value.get(key) == record.value:
                    repeated.append(record)
                    continue
                self._last_value[key] = record.value
            changed.append(record)
        try:
            self.pipeline.observe(changed)
            self.pipeline.observe_readings(repeated)
        except Exception as exc:
            self._log_once("observe", "pipeline.observe failed: %s", exc)

    def _analyse(self, batch: Sequence[Record]) -> None:
        """Run the analytics stage over ``batch`` and pass on what it gives.

        The online detectors see every sample, the failure predictor every record (and
        steps when due); the pipeline takes their findings, closed gaps and predictions
        (:meth:`Pipeline.observe_analytics`), as in ``replay``. Called with an empty batch
        too, so gaps open while nothing arrives.
        """
        analytics, pipeline = self.analytics, self.pipeline
        if pipeline is None or (analytics.online is None and analytics.prediction is None):
            return
        try:
            output = analytics.observe(batch, time.time())
            pipeline.observe_analytics(
                output, hold_seconds=self.settings.analytics.anomaly_hold_seconds)
            if output.predictions and self.recorder is not None:
                self.recorder.record_predictions(output.predictions)
        except Exception as exc:
            self._log_once("analyse", "analytics failed: %s", exc)
            logger.debug("analytics failed", exc_info=exc)
            return
        detectors = [r.anomaly.detector for r in output.results if r.kind != "gap_closed"]
        detectors += [a.detector for a in output.vector_anomalies]
        for detector in detectors:
            self.exporter.inc("gpuhealth_anomalies_total", {"detector": detector})
        if output.results:
            self._dirty = True
        if output.predictions:
            horizon = f"{self.settings.analytics.predictor_horizon_seconds:.0f}s"
            self.exporter.update([
                Sample(metric="gpu_failure_probability_ratio", value=p.probability,
                       observed_at=p.predicted_at, node=p.node, entity=p.entity,
                       labels={"horizon": horizon}) for p in output.predictions])

    def _deliver(self, batch: Sequence[Record]) -> bool:
        """Observe ``batch`` and write it with anything left from before; False on failure."""
        self._observe(batch)
        self._analyse(batch)
        if self.recorder is not None:
            self.recorder.observe(r for r in batch if isinstance(r, Sample))
        if self.store is None:  # a read-only store: nothing is written here
            return True
        self._unwritten.extend(batch)
        if not self._unwritten:
            return True
        samples = [r for r in self._unwritten if isinstance(r, Sample)]
        events = [r for r in self._unwritten if isinstance(r, Event)]
        try:
            self.store.write(samples, events)
        except TemporaryError as exc:
            self._log_once("store_temporary", "store write failed, will retry: %s", exc)
            self.exporter.inc("gpuhealth_collector_errors_total",
                              {"collector": "store", "reason": "temporary"})
            return False
        except Exception as exc:
            logger.error("store write failed; %d records lost: %s",  # noqa: TRY400
                         len(self._unwritten), exc)
            self.exporter.inc("gpuhealth_collector_errors_total",
                              {"collector": "store", "reason": type(exc).__name__})
            self._unwritten = []
            return False
        self._unwritten = []
        self.exporter.inc("gpuhealth_samples_written_total", amount=len(samples))
        self.exporter.inc("gpuhealth_events_written_total", amount=len(events))
        stats = store_stats(self.store)
        self.exporter.set("gpuhealth_spool_depth", stats.spool_depth)
        self.exporter.set("gpuhealth_spool_dropped_total", stats.spool_dropped)
        for reason, count in stats.rejected.items():
            self.exporter.set("gpuhealth_store_rejected_total", count, {"reason": reason})
        self._dirty = True
        return True

    def _evaluate(self) -> None:
        if self.pipeline is None:
            return
        started = time.monotonic()
        try:
            output = self._run_on_loop(self.pipeline)
        except Exception as exc:
            self._log_once("evaluate", "pipeline.evaluate failed: %s", exc)
            logger.debug("pipeline.evaluate failed", exc_info=exc)
            return
        if self.link is not None:
            self.link.forward(output.findings)
            if self.protective is not None and self.link.unreachable_since is not None:
                self._protect(self.protective, output.findings, self.link.unreachable_since)
        self.exporter.set("gpuhealth_pipeline_lag_seconds", time.monotonic() - started,
                          {"stage": "evaluate"})
        for name, depth in self.pipeline.outbox_depths(every_notifier=True).items():
            self.exporter.set("gpuhealth_outbox_depth", depth, {"notifier": name})
        worst: dict[tuple[str, str], int] = {}
        order = {sev: i for i, sev in enumerate(Severity)}
        for f in output.findings:
            key = (str(f.node), str(f.entity))
            if key in self._gpus:
                worst[key] = max(worst.get(key, -1), order[f.severity])
        out_nodes = disrupted(self.pipeline.policy)
        states: collections.Counter[str] = collections.Counter()
        for node, entity in self._gpus:
            if node in out_nodes:
                states["out_of_service"] += 1
            else:
                level = worst.get((node, entity), -1)
                states["healthy" if level <= order[Severity.INFO]
                       else list(Severity)[level].value] += 1
        for state in ("healthy", "warning", "major", "critical", "out_of_service"):
            self.exporter.set("gpuhealth_gpus", states.get(state, 0), {"state": state})
        open_by_severity = collections.Counter(f.severity.value for f in output.findings)
        for severity in Severity:
            self.exporter.set("gpuhealth_open_findings", open_by_severity.get(severity.value, 0),
                              {"severity": severity.value})
        for record in output.audit:
            self.exporter.inc("gpuhealth_remediation_decisions_total",
                              {"step": record.step.value if record.step else "none",
                               "decision": record.decision})
        self.analytics.observe_findings(output.findings)  # the stage picks the failures
        resolved = sum(1 for a in output.alerts if a.state is AlertState.RESOLVED)
        if resolved:
            self.exporter.inc("gpuhealth_incidents_resolved_total", amount=resolved)
        for finding in output.findings:
            if finding.key not in self._seen_findings:
                self._seen_findings.add(finding.key)
                self.exporter.inc("gpuhealth_findings_total",
                                  {"severity": finding.severity.value})
        self._dirty = True

    def _start_weekly_report(self) -> None:
        """Schedule the weekly reliability report (apscheduler, in its own thread)."""
        from apscheduler.schedulers.background import BackgroundScheduler

        from gpuhealth.report_cli import schedule_weekly_report

        r = self.settings.report
        scheduler = BackgroundScheduler(timezone=r.timezone)
        schedule_weekly_report(
            scheduler, history_path=self.settings.history_path,
            folder=r.folder or self.settings.node.data_dir / "reports",
            webhook_url=r.webhook_url, weekday=r.weekday, at=r.time, timezone=r.timezone,
            spare_fraction=r.spare_fraction, formats=r.formats, link_base=r.link_base)
        scheduler.start()
        self._report_scheduler = scheduler

    def _inventory(self) -> list[dict[str, str]]:
        """This node's GPUs as the samples name them (the agent's heartbeat)."""
        node = self.settings.node.name
        return [{"entity": entity} for n, entity in sorted(self._gpus) if n == node]

    def _gpu_reset_endpoint(self) -> GpuResetEndpoint | None:
        """The node side of GPU resets, when ``[remediation.gpu_reset_agent]`` is set."""
        agent = dict(self.settings.remediation.gpu_reset_agent)
        if not agent:
            return None
        try:
            secret = resolve_secret(secret=None, secret_env=agent.pop("secret_env", None),
                                    secret_file=agent.pop("secret_file", None),
                                    what="[remediation.gpu_reset_agent]")
            checks = agent.pop("validation", None)
            validation = (ValidationService(runner=ValidationRunner(
                node=self.settings.node.name, **dict(checks)))
                if isinstance(checks, Mapping) else None)
            bundling = agent.pop("bundle", None)
            bundle = (BundleCollector(**{"directory": str(self.settings.node.data_dir /
                                                          "bundles"),
                                         "node": self.settings.node.name, **dict(bundling)})
                      if isinstance(bundling, Mapping) else None)
            # this process's own NVML collectors hold the GPUs: the reset pauses them
            held = [name for name, collector in self.collectors.items()
                    if getattr(self.settings.collectors.get(name), "type", name) == "nvml"
                    and not isinstance(collector, QuiescibleCollector)]
            for name in held:
                self.collectors[name] = QuiescibleCollector(self.collectors[name])
            paused = [c for c in self.collectors.values() if isinstance(c, QuiescibleCollector)]
            agent.setdefault("quiesce", quiesce_all(paused) if paused else None)
            return GpuResetEndpoint(resetter=GpuResetter(bundle=bundle, **agent),
                                    secrets=(secret,), node=self.settings.node.name,
                                    validation=validation, bundle=bundle)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.settings.source}: [remediation.gpu_reset_agent]: {exc}"
                              ) from exc

    def _on_alertmanager(self, batch: InboundBatch) -> None:
        """Alerts from a site's own Prometheus rules drive remediation like our findings."""
        pipeline = self.pipeline
        if pipeline is None:
            return
        for alert in batch.firing:
            self._inbound[alert.fingerprint] = alert.finding.key
            pipeline.observe_findings([alert.finding],
                                      hold_seconds=self.settings.analytics.event_window_seconds,
                                      source=f"{INBOUND_SOURCE}{alert.fingerprint}")
        keys = [self._inbound.pop(fp) for fp in batch.resolved if fp in self._inbound]
        if keys:
            pipeline.clear_findings(keys)
        pipeline.wake.set()

    # --- remediation thread ----------------------------------------------------------

    def _loop_thread(self) -> None:
        """Run the service's one event loop: evaluations, notifier sends, remediation.

        Every network call of the pipeline (notifiers, scheduler adapters) runs here, so
        their HTTP clients live as long as the service. The loop advances the remediation
        engine every ``tick_seconds`` and at once on new work (not in the agent role); at
        the end it closes the notifiers' clients.
        """
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._aremediate() if self.role != "agent"
                                    else asyncio.to_thread(self.stop.wait))
            if self.pipeline is not None:
                loop.run_until_complete(self.pipeline.aclose())
        except Exception as exc:
            logger.error("the service's event loop stopped: %s", exc)  # noqa: TRY400
        finally:
            self.loop = None
            loop.close()

    def _protect(self, protective: ProtectiveCordon, findings: Sequence[Finding],
                 since: float) -> None:
        """The agent's protective cordon (no controller answers), on the service's loop."""
        work = protective.update(findings, unreachable_since=since)
        loop = self.loop
        try:
            if loop is not None and loop.is_running():
                asyncio.run_coroutine_threadsafe(work, loop).result(
                    timeout=EVALUATE_TIMEOUT_SECONDS)
            else:
                asyncio.run(work)
        except Exception as exc:
            logger.error("protective cordon: %s", exc)  # noqa: TRY400

    def _run_on_loop(self, pipeline: Pipeline) -> Any:
        """One evaluation on the service's loop (or a loop of its own before it runs)."""
        loop = self.loop
        if loop is not None and loop.is_running():
            try:
                future = asyncio.run_coroutine_threadsafe(pipeline.aevaluate(), loop)
            except RuntimeError:  # the loop closed meanwhile (shut-down)
                return pipeline.evaluate()
            return future.result(timeout=EVALUATE_TIMEOUT_SECONDS)
        return pipeline.evaluate()

    async def _aremediate(self) -> None:
        pipeline = self.pipeline
        if pipeline is None:
            return
        tick = self.settings.remediation.tick_seconds
        next_tick = 0.0
        next_history = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if pipeline.wake.is_set() or now >= next_tick:
                pipeline.wake.clear()
                next_tick = now + tick
                try:
                    await pipeline.atick()
                except Exception as exc:
                    self._log_once("remediate", "remediation tick failed: %s", exc)
                    logger.debug("remediation tick failed", exc_info=exc)
                self._export_remediation(pipeline)
                if self.recorder is not None and now >= next_history:
                    next_history = now + 30.0
                    self.recorder.sync(pipeline.actions, time.time())
            await asyncio.sleep(0.01)

    def _export_remediation(self, pipeline: Pipeline) -> None:
        """The remediation metrics are its collector's: refresh them after a tick."""
        if self._remediation_metrics is not None:
            try:
                self._remediation_metrics.refresh()
            except Exception as exc:
                self._log_once("remediation_metrics", "remediation metrics: %s", exc)
        self._dirty = True

    def _log_once(self, key: str, msg: str, *args: object) -> None:
        self.health.fail(key, msg % args)  # every time: /healthz fails while it repeats
        if key not in self._logged:
            self._logged.add(key)
            logger.error(msg, *args)

    # --- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the threads, write everything buffered, close the store and the server."""
        self.stop.set()
        self.buffer.wake()
        for collector in self.collectors.values():
            if isinstance(collector, Closeable):
                try:
                    collector.close()
                except Exception as exc:
                    logger.warning("closing collector %r failed: %s", collector, exc)
        threads = [*self._threads, *([self._writer] if self._writer else []),
                   *([self._remediator] if self._remediator else [])]
        for thread in threads:
            thread.join(timeout=JOIN_TIMEOUT_SECONDS)
            if thread.is_alive():
                logger.warning("thread %s did not stop within %.0f s", thread.name,
                               JOIN_TIMEOUT_SECONDS)
        self.buffer.put(self._xid_dedup.flush())
        self._drain()
        if self.prediction is not None:
            self.prediction.save()
        if self.recorder is not None and self.pipeline is not None:
            self.recorder.sync(self.pipeline.actions, time.time())
            self.recorder.history.close()
        if self._report_scheduler is not None:
            self._report_scheduler.shutdown(wait=False)
        self.elector.stop()
        if self.link is not None:
            self.link.close()
        if self.api is not None:
            self.api.stop()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.server is not None:
            self.server.stop()
        if isinstance(self.store, Closeable):
            self.store.close()
        if self.buffer.dropped:
            logger.warning("%d records were dropped because the buffer was full",
                           self.buffer.dropped)
        logger.info("gpuhealth stopped")

    def _drain(self) -> None:
        """Write every buffered record (a locked store is retried a few times)."""
        attempts = 0
        while len(self.buffer) or self._unwritten:
            batch = self.buffer.take(max_records=self.settings.storage.flush_max_records,
                                     wait_seconds=0.0)
            if self._deliver(batch):
                attempts = 0
                continue
            attempts += 1
            if not self._unwritten or attempts >= 10:
                if self._unwritten:
                    logger.error("%d records could not be written at shutdown",
                                 len(self._unwritten))
                break
            time.sleep(0.5)


@contextlib.contextmanager
def _signals(stop: threading.Event) -> Iterator[None]:
    """Let SIGTERM and SIGINT set ``stop`` while inside (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        # Said once: a second signal while stopping (Ctrl-C sent to the whole process
        # group, a supervisor's TERM after an INT) changes nothing.
        if stop.is_set():
            logger.debug("received %s again; still stopping", signal.Signals(signum).name)
            return
        logger.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


EXIT_CONFIG = 78


def _store_name(settings: Settings) -> str:
    """Where samples go, for the start-up line: the SQLite file or the server's URL."""
    if settings.storage.type == "sqlite":
        return str(settings.storage_path)
    return f"{settings.storage.type} {settings.storage.url}"
"""Exit status for an invalid configuration (BSD sysexits EX_CONFIG)."""


class StartupError(PermanentError):
    """The service cannot start; the message names the setting and the path or address."""


def run(settings: Settings, *, stop: threading.Event | None = None,
        role: Literal["run", "agent"] = "run") -> int:
    """Run the service until ``stop`` is set or SIGTERM/SIGINT arrives.

    Args:
        settings: From :func:`gpuhealth.config.load_settings`.
        stop: An event that stops the service when set (tests); SIGTERM and SIGINT set it.
        role: ``"run"`` (the whole stack) or ``"agent"`` (one node of a fleet).

    Returns:
        0 after a clean stop; 78 (EX_CONFIG) when a collector's settings are invalid;
        1 when start-up failed otherwise (data folder, store or ``/metrics`` unavailable).
    """
    stop = stop or threading.Event()
    service = Service(settings, stop=stop, role=role)
    with _signals(stop):
        try:
            service.start()
        except ConfigError as exc:
            logger.error("gpuhealth cannot start: %s", exc)  # noqa: TRY400 (expected: no traceback)
            service.shutdown()
            return EXIT_CONFIG
        except (GpuHealthError, OSError) as exc:
            logger.error("gpuhealth cannot start: %s", exc)  # noqa: TRY400 (expected: no traceback)
            service.shutdown()
            return 1
        stop.wait()
        service.shutdown()
    return 0
