"""``gpuhealth replay``: recorded files through the same pipeline as ``gpuhealth run``.

Files (case files, folders of logs, a series of scrapes) are read in order with
the artifact parsers and fed to one :class:`~gpuhealth.pipeline.Pipeline`; the
pipeline evaluates after each file, as if the files arrived one after another.
By default each file is its own node, named after the file's stem (the case
collection's README: the same host name in two files is not the same machine);
a ``node`` fact puts every file on that node. The fleet for the disruption
budget is the set of replayed nodes unless ``cluster_size`` says otherwise.

Each file is a snapshot of its node (:meth:`~gpuhealth.pipeline.Pipeline.observe_snapshot`):
a later file that shows the node healthy clears its earlier findings and resolves its
alerts. Facts per node (``nvlink=absent`` for one case, ``expected`` for another) come
from ``node_facts``, which :func:`load_node_facts` reads from a JSON file shaped like
the cases' ``expected.json`` (``{file name: {"context": {...}}}``); a replayed folder
that holds a ``context.json`` (or, failing that, the case collection's
``expected.json``) supplies them itself, only its ``context`` entries being read. The report lists
the alerts and the pages (one per node group, ``major`` and worse) each node got;
undelivered notifications are tried once more at the end.

Remediation is dry-run unless ``replay --live`` gives a configured scheduler adapter:
the report lists, per node, the findings worst first, the steps the policy requested
(or would request) and the steps it held back, and why; a live replay also waits for
the steps to finish and lists each action's final phase.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from alerting.alerts import AlertPolicy, alert_to_json
from alerting.silences import SilenceStore
from analytics.fault_model import Rule, worst
from analytics.fault_model.site_rules import SiteRules
from analytics.online import OnlineResult
from analytics.stage import VECTOR_METRIC
from collectors.archive import archive_kind, read_archive, strip_archive_suffix
from collectors.artifact import ArtifactParser, ArtifactResult, ParseContext, ParseIssue
from collectors.artifact import read_artifact as _read_artifact
from collectors.parsers import artifact_parsers
from core.clock import Clock, system_clock
from core.codec import finding_to_json
from core.protocols import AsyncCloseable, Closeable, Notifier, SchedulerAdapter
from core.records import (
    ActionPhase,
    ActionRequest,
    Alert,
    AuditRecord,
    Event,
    Finding,
    NodeName,
    Prediction,
    Record,
    Sample,
    Severity,
)
from gpuhealth.compose import Guards, replay_guards, replay_pipeline
from gpuhealth.config import AnalyticsSettings
from gpuhealth.diagnose import (
    EXIT_FOR_SEVERITY,
    EXIT_UNPARSEABLE,
    LINE_PROTOCOL_SUFFIXES,
    expand_paths,
)
from gpuhealth.pipeline import Pipeline
from remediation.policy import DECISION_HELD, describe, describe_request
from storage import spill
from storage.lineprotocol import CONVERSIONS, DecodeReport, Precision, read_lines
from storage.spill import SpillList

SCHEMA_VERSION = 1

NODE_ITEMS = 256
"""Alerts (and pages) of one node kept in memory; the rest wait on disk for the report
(a month of a busy node is tens of thousands of alert changes)."""


@dataclass(slots=True, kw_only=True)
class NodeReplay:
    """What the replay produced for one node.

    Attributes:
        node: The node name.
        files: Input files attributed to the node.
        findings: Findings about the node at the end of the replay, worst first.
        findings_seen: Every finding the node had at any evaluation, one per episode (from
            the evaluation that first saw it to the last one), in the order they opened;
            the open ones as of the end.
        alerts: Alerts sent for the node, in order (every change; past the first
            :data:`NODE_ITEMS` on disk: :class:`~storage.spill.SpillList`).
        actions: Dry-run action requests for the node, in order.
        held: Audit records of steps held back for the node (budget, opt-out...).
        pages: Pages (node-group notifications) sent for the node, in order (as ``alerts``).
        healthy_files: Files that showed the node healthy and cleared its earlier state.
    """

    node: str
    files: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    findings_seen: list[Finding] = field(default_factory=list)
    alerts: SpillList[Alert] = field(default_factory=lambda: SpillList(memory_items=NODE_ITEMS))
    actions: list[ActionRequest] = field(default_factory=list)
    held: list[AuditRecord] = field(default_factory=list)
    pages: SpillList[Alert] = field(default_factory=lambda: SpillList(memory_items=NODE_ITEMS))
    healthy_files: list[str] = field(default_factory=list)

    @property
    def worst_severity(self) -> Severity:
        """The worst severity among the node's findings (``info`` when none)."""
        return worst(self.findings)[0]


@dataclass(slots=True, kw_only=True)
class StreamAnalysis:
    """What the online detectors and the failure predictor made of recorded telemetry.

    Filled from line-protocol inputs only (recorded samples with their own times), as
    ``gpuhealth run`` would have seen them: samples go through
    :class:`~analytics.online.OnlineAnalytics` and
    :class:`~analytics.prediction_stage.PredictionStage` in time order, one prediction per
    GPU and port every ``predictor_interval_seconds`` of *record* time, labelled by the
    critical findings the fault model raises from the recorded events.

    Attributes:
        samples: Samples analysed.
        anomalies: Count per ``"<kind> <detector> <metric>"`` (kinds as in
            :class:`~analytics.online.OnlineResult`; gap closures not counted).
        listed: Every anomaly, gap and peer outlier, in time order (JSON-ready dicts; past
            the first few thousand on disk: :class:`~storage.spill.SpillList`).
        predictions: Published predictions at or above ``threshold``, in time order.
        predictions_made: Predictions published (any probability).
        withheld: Predictions withheld while the model had learned too few failures.
        positives_learned: Failure-labelled vectors the predictor learned.
        threshold: Probability from which a prediction is listed (the warning alert's 0.5).
        aliases: Other names of a GPU per ``(node, entity)`` (UUID, PCI bus id, ``gpu:N``,
            ``serial:S``), from the recording's inventory (``gpu_info`` samples,
            ``gpu_identity`` events); empty when it has none.
        warnings: The predictor's warnings, one per episode (the prediction that opened
            it: :class:`~analytics.prediction_stage.WarningEpisodes`), in time order.
    """

    samples: int = 0
    anomalies: dict[str, int] = field(default_factory=dict)
    listed: SpillList[dict[str, Any]] = field(default_factory=SpillList)
    predictions: list[Prediction] = field(default_factory=list)
    predictions_made: int = 0
    withheld: int = 0
    positives_learned: int = 0
    threshold: float = 0.5
    aliases: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    warnings: list[Prediction] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class ReplayReport:
    """The result of one replay.

    Attributes:
        nodes: Per-node results in the order the nodes first appeared.
        issues: Inputs or parts of inputs that could not be parsed.
        disruption_limit: Nodes the policy could hold out of service at once.
        audit: Every audit record written, in order.
        dry_run: Whether the replay was dry-run (``replay --live`` is not).
        undelivered: Notifications still queued per notifier at the end.
        parsed_lines: Input lines a parser understood, over all files.
        final_actions: Every action of the action store at the end (``to_json`` rows).
        analysis: What the detectors and the predictor found in line-protocol inputs
            (``None`` when there was none, or analytics were off).
    """

    nodes: list[NodeReplay] = field(default_factory=list)
    issues: list[ParseIssue] = field(default_factory=list)
    disruption_limit: int = 1
    audit: list[AuditRecord] = field(default_factory=list)
    dry_run: bool = True
    undelivered: dict[str, int] = field(default_factory=dict)
    parsed_lines: int = 0
    final_actions: list[dict[str, object]] = field(default_factory=list)
    analysis: StreamAnalysis | None = None

    def node(self, name: str) -> NodeReplay | None:
        """Return the result for node ``name``, or ``None``."""
        return next((n for n in self.nodes if n.node == name), None)

    @property
    def worst_severity(self) -> Severity:
        """The worst severity among every node's findings at the end (``info`` when none)."""
        return worst([f for n in self.nodes for f in n.findings])[0]

    @property
    def exit_status(self) -> int:
        """The exit status of ``gpuhealth replay``, as ``diagnose`` has it (fault-model.md).

        0 worst is info, 1 warning, 2 major, 3 critical (over the findings left at the end
        of the replay), 4 nothing in the input could be read.
        """
        if not self.parsed_lines:
            return EXIT_UNPARSEABLE
        return EXIT_FOR_SEVERITY[self.worst_severity]




def node_of_file(path: str) -> str:
    """Return the node name a file stands for when each file is its own node: its stem.

    Examples:
        >>> node_of_file("cases/001-xid79-fallen-off-bus.log")
        '001-xid79-fallen-off-bus'
    """
    name = os.path.basename(path)
    stripped = strip_archive_suffix(name)
    return stripped if stripped != name else os.path.splitext(name)[0]


def load_node_facts(path: str) -> dict[str, dict[str, str]]:
    """Read facts per node from a JSON file shaped like the cases' ``expected.json``.

    The file is ``{name: {"context": {key: value}}}`` or ``{name: {key: value}}``; an
    ``expected.json`` entry (one with ``worst_severity``) gives only its ``context``; a name
    with a file extension stands for its stem's node. Facts are checked as ``--context``
    checks them (:func:`analytics.fault_model.check_facts`).

    Raises:
        OSError: The file cannot be read.
        ValueError: It is not JSON (the message names the line and column), not such an
            object, or a fact is unknown or invalid (the message names the entry).
    """
    from analytics.fault_model import check_facts

    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not JSON: {exc.msg} (column {exc.colno})"
                         ) from exc
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 (bad file content, not a bad argument)
            f"{path}: expected a JSON object of node names, got {type(data).__name__}"
        )
    out: dict[str, dict[str, str]] = {}
    for name, entry in data.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: {name!r}: expected an object of facts, got "  # noqa: TRY004
                             f"{type(entry).__name__}")
        facts = entry.get("context", entry if "worst_severity" not in entry else {})
        if not isinstance(facts, dict):
            raise ValueError(f"{path}: {name!r}: 'context' must be an object of facts, got "  # noqa: TRY004
                             f"{type(facts).__name__}")
        nested = [k for k, v in facts.items() if isinstance(v, dict | list)]
        if nested:
            raise ValueError(f"{path}: {name!r}: fact {nested[0]!r} must be a string or a "
                             "number")
        named = {str(k): str(v) for k, v in facts.items()}
        problems = check_facts(named)
        if problems:
            raise ValueError(f"{path}: {name!r}: {'; '.join(problems)}")
        if named:
            out[node_of_file(str(name))] = named
    return out


CONTEXT_FILES = ("context.json", "expected.json")
"""Files in a replayed folder whose ``context`` entries give facts per file (first found)."""


def folder_node_facts(paths: Sequence[str]) -> dict[str, dict[str, str]]:
    """Return the facts per node that the replayed folders carry (see :data:`CONTEXT_FILES`).

    Unreadable or malformed files are ignored (they are not inputs of the replay).
    """
    out: dict[str, dict[str, str]] = {}
    for path in paths:
        if not os.path.isdir(path):
            continue
        for name in CONTEXT_FILES:
            candidate = os.path.join(path, name)
            if os.path.isfile(candidate):
                try:
                    out.update(load_node_facts(candidate))
                except (OSError, ValueError):
                    continue
                break
    return out


def _on_node(records: Iterable[Record], node: NodeName) -> Iterator[Record]:
    """Move every record onto ``node`` (host names inside a file do not name our nodes)."""
    for record in records:
        yield record if record.node == node else dataclasses.replace(record, node=node)


@dataclass(slots=True)
class _Step:
    """The records of one time stamp of a recording, in file order."""

    at: float
    records: list[Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    has_event: bool = False
    nodes: dict[str, None] = field(default_factory=dict)


def _time_steps(lines: Iterable[Sequence[Record]], node: NodeName | None = None
                ) -> Iterator[_Step]:
    """Group consecutive lines of one time stamp (a recording is written in time order).

    ``lines`` are :func:`storage.lineprotocol.read_lines`' (each line's records share a
    node and a time stamp, and an event is alone on its line); ``node`` moves every record
    onto that node (:func:`_on_node`).
    """
    step: _Step | None = None
    for line in lines:
        if node is not None:
            line = list(_on_node(line, node))
        first = line[0]
        at = first.observed_at
        if at is None:  # never from read_lines; grouped with what came before
            at = step.at if step is not None else 0.0
        if step is None or at != step.at:
            if step is not None:
                yield step
            step = _Step(at=at)
        step.records.extend(line)
        if isinstance(first, Event):
            step.has_event = True
        else:
            step.samples.extend(line)  # type: ignore[arg-type]
        step.nodes[first.node] = None
    if step is not None:
        yield step


BEHIND_TOLERANCE_SECONDS = 60.0
"""Records this much older than the replay's clock are reported (a second recording that
overlaps the first, or lines out of time order)."""


class RecordClock:
    """The replay's clock: the recording's own time while a recording plays.

    A line-protocol recording sets :attr:`at` to each time step's time stamp, so alerts,
    audit records, held findings and the remediation engine run in the recording's time, as
    ``run`` would have when it was recorded; other inputs (case files, logs) leave it
    unset and ``fallback`` gives the time. After the last file, :meth:`release` lets it run
    on from the recording's last time with the real time that passes (a live replay waits
    for its steps to finish).

    Args:
        fallback: The clock when no recording is playing.

    Examples:
        >>> clock = RecordClock(lambda: 5.0)
        >>> clock()
        5.0
        >>> clock.follow(1_700_000_000.0)
        >>> clock.follow(1_699_999_000.0)  # never backwards
        >>> clock()
        1700000000.0
        >>> clock.recording
        True
    """

    def __init__(self, fallback: Clock) -> None:
        self.fallback = fallback
        self.at: float | None = None
        self._released_at: float | None = None

    @property
    def recording(self) -> bool:
        """Whether the time is a recording's."""
        return self.at is not None

    def follow(self, at: float) -> None:
        """Move to ``at``, a recording's time stamp (epoch seconds), if it is later."""
        if self.at is None or at > self.at:
            self.at = at
        self._released_at = None

    def leave(self) -> None:
        """Go back to ``fallback`` (an input without its own times comes next)."""
        self.at = None
        self._released_at = None

    def release(self) -> None:
        """From now on, run on from the recording's last time with the real time passing."""
        if self.at is not None:
            self._released_at = time.monotonic()

    def __call__(self) -> float:
        """Return now, epoch seconds."""
        if self.at is None:
            return self.fallback()
        if self._released_at is None:
            return self.at
        return self.at + (time.monotonic() - self._released_at)


EVENT_TYPES = ("prediction", "predicted_failure", "anomaly", "finding", "alert", "warning")
"""The ``type`` of the lines of ``replay --events``."""


class EventStream:
    """Writes what a replay produces as JSON lines, as it comes (``replay --events FILE``).

    One object per line, each with ``type`` (one of :data:`EVENT_TYPES`), ``at`` (the
    recording's time, epoch seconds; ``null`` for a warning), ``node`` and ``entity``, then
    the payload, as ``--json`` spells it:

    - ``prediction``: every published prediction (:func:`prediction_to_json`, with
      ``aliases``); ``at`` is ``predicted_at``;
    - ``anomaly``: every anomaly, telemetry gap and peer outlier (``kind``, ``detector``,
      ``metric``, ``observed_at``, ``score``, ``threshold``); ``at`` is ``observed_at``;
    - ``finding``: a finding opening (``state`` ``open``) or gone (``cleared``) at an
      evaluation (:func:`~core.codec.finding_to_json`, times stamped as in the report);
      ``at`` is the evaluation's time;
    - ``alert``: every alert that changed (:func:`~alerting.alerts.alert_to_json`);
    - ``warning``: an input problem (``file``, ``line``, ``reason``), as ``errors`` in
      ``--json``.

    Args:
        handle: A text file open for writing; flushed, never closed, by the stream.
    """

    def __init__(self, handle: IO[str]) -> None:
        self.handle = handle
        self.written = 0
        self._encode = json.JSONEncoder(separators=(",", ":")).encode

    def write(self, kind: str, at: float | None, node: str | None, entity: str | None,
              payload: Mapping[str, Any]) -> None:
        """Write one line."""
        line = {"type": kind, "at": at, "node": node, "entity": entity}
        line.update(payload)
        self.handle.write(self._encode(line))
        self.handle.write("\n")
        self.written += 1

    def flush(self) -> None:
        """Flush the file."""
        self.handle.flush()


class _FindingLog:
    """Episodes of findings over the replay's evaluations, in the recording's time.

    A finding from the fault model's states (a sample past a threshold, a counter that
    rose) carries no time of its own; while a recording plays, it is stamped with the time
    of the first evaluation of its episode (``first_seen_at``) and of the latest one that
    still saw it (``last_seen_at``). A finding with times of its own (an event's) keeps them.
    """

    def __init__(self, events: EventStream | None) -> None:
        self.events = events
        self._open: dict[tuple[str, str, str, str], list[Any]] = {}  # key -> [first, Finding]
        self.closed: list[Finding] = []

    def update(self, findings: Sequence[Finding], now: float, *, stamp: bool) -> list[Finding]:
        """Account for one evaluation's findings; return them stamped."""
        out: list[Finding] = []
        current: set[tuple[str, str, str, str]] = set()
        for finding in findings:
            key = finding.key
            current.add(key)
            episode = self._open.get(key)
            fresh = episode is None
            if episode is None:
                episode = self._open[key] = [now, finding]
            if stamp and (finding.first_seen_at is None or finding.last_seen_at is None):
                finding = dataclasses.replace(
                    finding,
                    first_seen_at=(finding.first_seen_at if finding.first_seen_at is not None
                                   else episode[0]),
                    last_seen_at=(finding.last_seen_at if finding.last_seen_at is not None
                                  else now))
            episode[1] = finding
            out.append(finding)
            if fresh and self.events is not None:
                self.events.write("finding", now, finding.node, finding.entity,
                                  {"state": "open", **finding_to_json(finding)})
        for key in [k for k in self._open if k not in current]:
            gone: Finding = self._open.pop(key)[1]
            self.closed.append(gone)
            if self.events is not None:
                self.events.write("finding", now, gone.node, gone.entity,
                                  {"state": "cleared", **finding_to_json(gone)})
        return out

    def seen(self) -> list[Finding]:
        """Every episode, closed or still open, in the order they opened."""
        episodes = [*self.closed, *(f for _, f in self._open.values())]
        return sorted(episodes, key=lambda f: (
            f.first_seen_at if f.first_seen_at is not None else float("inf")))


class _Analyst:
    """Runs the analytics stage over recorded time steps, as ``run`` does over its batches.

    The stage is :func:`gpuhealth.compose.analytics_stage`'s, on the recording's clock; what
    it gives goes to the pipeline as in ``run`` (:meth:`Pipeline.observe_analytics`), and
    into the report and the event stream.
    """

    def __init__(self, settings: AnalyticsSettings, report: StreamAnalysis, pipeline: Pipeline,
                 events: EventStream | None = None) -> None:
        from gpuhealth.compose import analytics_stage

        self.report = report
        self.events = events
        self.pipeline = pipeline
        self.now = 0.0
        self.hold_seconds = settings.anomaly_hold_seconds
        self.stage = analytics_stage(settings, role="replay", checkpoint_path=None,
                                     clock=lambda: self.now)
        if self.stage.prediction is not None:  # the GPU's other names, from the inventory
            report.aliases = self.stage.prediction.identity.other_names

    def observe(self, step: _Step) -> None:
        self.now = max(self.now, step.at)
        self.report.samples += len(step.samples)
        out = self.stage.observe(step.records, self.now)
        self.pipeline.observe_analytics(out, hold_seconds=self.hold_seconds)
        for result in out.results:
            self._note(result)
        for anomaly in out.vector_anomalies:
            self._note(OnlineResult(kind="anomaly", metric=VECTOR_METRIC, anomaly=anomaly))
        prediction = self.stage.prediction
        if prediction is None or not out.stepped:
            return
        made, report = out.predictions, self.report
        report.predictions_made += len(made)
        report.predictions.extend(p for p in made if p.probability >= report.threshold)
        report.withheld = prediction.withheld
        report.positives_learned = prediction.predictor.learned_positive
        report.warnings.extend(out.warnings)
        if self.events is not None:
            of, write = report.aliases, self.events.write
            for w in out.warnings:
                write("predicted_failure", w.predicted_at, w.node, w.entity,
                      prediction_to_json(w, of.get((w.node, w.entity), ())))
            for p in made:
                write("prediction", p.predicted_at, p.node, p.entity,
                      prediction_to_json(p, of.get((p.node, p.entity), ())))

    def _note(self, result: OnlineResult) -> None:
        if result.kind == "gap_closed":
            return
        a = result.anomaly
        key = f"{result.kind} {a.detector} {result.metric or '-'}"
        self.report.anomalies[key] = self.report.anomalies.get(key, 0) + 1
        listed = {
            "kind": result.kind,
            "detector": a.detector,
            "metric": result.metric,
            "node": a.node,
            "entity": a.entity,
            "observed_at": a.observed_at,
            "score": a.score,
            "threshold": a.threshold,
        }
        self.report.listed.append(listed)
        if self.events is not None:
            self.events.write("anomaly", a.observed_at, a.node, a.entity, listed)

    def label(self, findings: Iterable[Finding]) -> None:
        """Give the predictor the failures it has not seen (its labels: failure_kind)."""
        self.stage.observe_findings(findings)


def replay(
    paths: Sequence[str],
    *,
    facts: Mapping[str, str] | None = None,
    audit_log_path: str | None = None,
    clock: Clock = system_clock,
    notifiers: Sequence[Notifier] = (),
    max_disrupted_fraction: float = 0.10,
    cluster_size: int | None = None,
    opt_out_nodes: frozenset[str] = frozenset(),
    min_alert_severity: Severity = Severity.WARNING,
    default_year: int | None = None,
    parsers: Sequence[ArtifactParser] | None = None,
    rules: Sequence[Rule] | None = None,
    page_notifiers: Sequence[Notifier] = (),
    node_facts: Mapping[str, Mapping[str, str]] | None = None,
    silences: SilenceStore | None = None,
    alert_policies: Mapping[str, AlertPolicy] | None = None,
    extra_labels: Mapping[str, str] | None = None,
    outbox_path: str | None = None,
    on_file: Callable[[str, int], None] | None = None,
    scheduler: SchedulerAdapter | None = None,
    dry_run: bool = True,
    action_store_path: str | None = None,
    engine_options: Mapping[str, Any] | None = None,
    wait_seconds: float = 0.0,
    poll_seconds: float = 0.5,
    analytics: AnalyticsSettings | None = None,
    analyse: bool = True,
    guard: Guards | None = None,
    events: IO[str] | None = None,
    evaluate_seconds: float = 300.0,
    precision: Precision = "ns",
    policy: SiteRules | None = None,
) -> ReplayReport:
    """Replay recorded files through a dry-run :class:`~gpuhealth.pipeline.Pipeline`.

    Args:
        paths: Files or folders (walked in sorted order; ``README.md`` and
            ``*.json`` are skipped).
        facts: Machine facts; ``node`` puts every file on that node.
        audit_log_path: JSONL audit log to append to; an existing log makes
            a replay of the same incidents request nothing twice.
        clock: Returns now, epoch seconds: the alert and audit times of inputs without
            their own times, the far-future check of line-protocol lines. While a
            line-protocol recording plays, the pipeline runs on the recording's time
            (:class:`RecordClock`).
        notifiers: Where alerts go (none by default).
        max_disrupted_fraction: Disruption budget as a fleet share, in (0, 1].
        cluster_size: Fleet size for the budget; the number of replayed nodes by default.
        opt_out_nodes: Nodes never remediated automatically.
        min_alert_severity: Lowest severity that alerts.
        default_year: Year for time stamps without one; ``None`` lets parsers infer it.
        parsers: Artifact parsers; the registered ones by default.
        rules: Fault-model rules; the registered ones by default.
        page_notifiers: Where pages go (PagerDuty).
        node_facts: Facts per node over ``facts`` (see :func:`load_node_facts`).
        silences: Silences to honour.
        alert_policies: Alert policy per fault class.
        extra_labels: Labels on every alert (``cluster``).
        outbox_path: Durable outbox file; in memory by default.
        on_file: Called after each file with its path and 0-based index (tests
            use it to take a notifier down in the middle).
        scheduler: Adapter that carries steps out (``dry_run=False``); dry-run by default.
        dry_run: ``False`` to act for real through ``scheduler`` (``replay --live``).
        action_store_path: The action store (SQLite); in memory by default.
        engine_options: Options of the remediation engine (breaker, probation, ...).
        wait_seconds: After the last file, keep advancing the engine for up to this
            long (real time), until no action is pending or running.
        poll_seconds: Pause between two engine ticks while waiting.
        analytics: ``[analytics]`` settings for line-protocol inputs (defaults if ``None``):
            which detectors, the predictor's horizon and interval.
        analyse: Run the online detectors and the failure predictor over line-protocol
            inputs (see :class:`StreamAnalysis`); the fault model runs whatever this says.
        guard: Every remediation guard at once (``replay --live``:
            :func:`gpuhealth.compose.guards` of the configuration, as ``run`` builds them);
            when given, ``max_disrupted_fraction``, ``cluster_size``, ``opt_out_nodes``,
            ``dry_run`` and ``engine_options`` are not used.
        events: Where to stream every prediction, anomaly, finding, alert and warning as
            JSON lines (:class:`EventStream`), or ``None``.
        evaluate_seconds: While a recording plays, the pipeline is evaluated at every time
            step that holds an event and at least every this many seconds of the
            recording's time (> 0), so a state finding's times are the recording's to
            within this.
        precision: Unit of the line-protocol files' timestamps (InfluxDB's ``ns``, ``us``,
            ``ms``, ``s``).
        policy: The site's ``[[policy.rule]]`` as ``run`` applies them
            (:func:`gpuhealth.compose.site_rules` of ``--config``); ``None``: none.

    Raises:
        ValueError: ``evaluate_seconds`` is not > 0.

    Returns:
        Per-node findings, alerts, pages, dry-run actions and held-back steps, and for
        recorded telemetry what the detectors and the predictor found.
    """
    if not evaluate_seconds > 0:
        raise ValueError(f"evaluate_seconds must be > 0, got {evaluate_seconds!r}")
    facts = dict(facts or {})
    files = list(expand_paths(list(paths)))
    record_clock = RecordClock(clock)
    stream = EventStream(events) if events is not None else None
    fixed_node = facts.get("node")
    if not fixed_node:
        node_facts = {**folder_node_facts(paths), **(node_facts or {})} or None
    node_names = [fixed_node] if fixed_node else list(dict.fromkeys(map(node_of_file, files)))
    size = cluster_size if cluster_size is not None else max(1, len(node_names))
    if guard is None:
        guard = replay_guards(max_disrupted_fraction=max_disrupted_fraction, cluster_size=size,
                              opt_out_nodes=opt_out_nodes, dry_run=dry_run,
                              engine_options=engine_options)
    dry_run = guard.dry_run
    pipeline = replay_pipeline(
        guard=guard,
        facts=facts,
        notifiers=notifiers,
        audit_log_path=audit_log_path,
        min_alert_severity=min_alert_severity,
        clock=record_clock,
        rules=rules,
        page_notifiers=page_notifiers,
        node_facts=node_facts,
        silences=silences,
        alert_policies=alert_policies,
        extra_labels=extra_labels,
        outbox_path=outbox_path,
        scheduler=scheduler,
        action_store_path=action_store_path,
        analytics=analytics,
        policy=policy,
    )
    # A live adapter may keep work running on its event loop between ticks (a drain's
    # evictions): every tick of a live replay runs on one loop, in its own thread.
    loop: asyncio.AbstractEventLoop | None = None
    loop_thread: threading.Thread | None = None
    if not dry_run:
        loop = asyncio.new_event_loop()
        loop_thread = threading.Thread(
            target=loop.run_forever, name="gpuhealth-replay-loop", daemon=True
        )
        loop_thread.start()

    def tick() -> list[AuditRecord]:
        if loop is None:
            return []
        return asyncio.run_coroutine_threadsafe(pipeline.atick(), loop).result()

    used_parsers = tuple(parsers) if parsers is not None else artifact_parsers()
    report = ReplayReport(disruption_limit=pipeline.policy.disruption_limit, dry_run=dry_run)
    per_node: dict[str, NodeReplay] = {}

    def slot(name: str) -> NodeReplay:
        found = per_node.get(name)
        if found is None:
            found = per_node[name] = NodeReplay(node=name)
            report.nodes.append(found)
        return found

    findings: list[Finding] = []
    analyst: _Analyst | None = None
    log = _FindingLog(stream)
    reported = 0

    def collect(output: Any, node: str) -> list[Finding]:
        output.audit.extend(tick())
        now = record_clock()
        for alert in output.alerts:
            slot(alert.labels.get("node", node)).alerts.append(alert)
            if stream is not None:
                stream.write("alert", now, alert.labels.get("node", node),
                             alert.labels.get("entity"), alert_to_json(alert))
        for page in output.pages:
            slot(page.labels.get("node", node)).pages.append(page)
        for request in output.actions:
            slot(request.node).actions.append(request)
        for record in output.audit:
            if record.decision == DECISION_HELD:
                slot(record.node).held.append(record)
        report.audit.extend(output.audit)
        return log.update(output.findings, now, stamp=record_clock.recording)

    for index, path in enumerate(files):
        node = NodeName(fixed_node or node_of_file(path))
        if path.endswith(LINE_PROTOCOL_SUFFIXES) and not os.access(path, os.R_OK):
            reason = "No such file or directory" if not os.path.exists(path) else "not readable"
            report.issues.append(ParseIssue(file=path, line=None, reason=f"cannot read: {reason}"))
        elif path.endswith(LINE_PROTOCOL_SUFFIXES):
            # Recorded telemetry (gpuhealth export, a fleet's history): its records keep
            # their own nodes and timestamps, and go in time step by time step, the
            # pipeline on the recording's clock.
            if (
                analyse
                and analyst is None
                and (analytics is None or analytics.detectors or analytics.predictor)
            ):
                report.analysis = StreamAnalysis()
                analyst = _Analyst(analytics or AnalyticsSettings(), report.analysis, pipeline,
                                  stream)
            # The same checks as `gpuhealth import` (read_records): a line without its
            # own time, a cut-off last line, a NaN, a far-future or pre-2000 time is
            # counted and listed with its line number, never fed to the pipeline.
            decoded = DecodeReport()
            lines = read_lines([path], report=decoded, clock=clock, precision=precision)
            count = 0
            seen: set[str] = set()
            evaluated_at: float | None = None
            behind, behind_by = 0, 0.0
            for step in _time_steps(lines, NodeName(fixed_node) if fixed_node else None):
                count += len(step.records)
                late = record_clock.at - step.at if record_clock.at is not None else 0.0
                if late > BEHIND_TOLERANCE_SECONDS:  # the clock goes forward only
                    behind += 1
                    behind_by = max(behind_by, late)
                for name in step.nodes:
                    if name not in seen:
                        seen.add(name)
                        slot(name).files.append(path)
                record_clock.follow(step.at)
                pipeline.observe(step.records)
                if analyst is not None:
                    analyst.observe(step)
                now = record_clock()
                if (step.has_event or evaluated_at is None
                        or now - evaluated_at >= evaluate_seconds):
                    evaluated_at = now
                    mid = pipeline.evaluate()
                    collect(mid, node)
                    if analyst is not None:
                        analyst.label(mid.findings)
            report.parsed_lines += count
            for reason, skipped in sorted(decoded.skipped.items()):
                verb = "converted" if reason in CONVERSIONS else "rejected"
                report.issues.append(
                    ParseIssue(file=path, line=None, reason=f"{skipped} {verb}: {reason}")
                )
            for problem in decoded.problems:
                report.issues.append(
                    ParseIssue(
                        file=path, line=problem.line, reason=f"{problem.reason}: {problem.text}"
                    )
                )
            if not count and not decoded.skipped:
                report.issues.append(ParseIssue(file=path, line=None, reason="no records"))
            out_of_range = decoded.skipped["past"] + decoded.skipped["future"]
            if out_of_range and out_of_range >= count:
                report.issues.append(ParseIssue(
                    file=path, line=None,
                    reason=f"{out_of_range} value(s) fell outside the accepted time range: is "
                    f"--precision {precision} the unit of the file's timestamps?"))
            if behind:
                report.issues.append(ParseIssue(
                    file=path, line=None,
                    reason=f"{behind} time steps are older than the replay's clock (up to "
                    f"{behind_by:.0f} s behind): a replay goes forward in time, so they were "
                    "judged late (gaps, missed predictions); give one recording in time "
                    "order, or replay overlapping files one at a time"))
        else:
            record_clock.leave()  # a file without a recording's times: the given clock
            result = ArtifactResult()
            ctx = ParseContext(file=path, node=node, default_year=default_year)
            # a bundle (sosreport, must-gather) is one snapshot of its node, read member
            # by member (evidence names archive:member:line)
            read = read_archive if archive_kind(path) else _read_artifact
            records = list(_on_node(read(path, ctx, used_parsers, result), node))
            report.parsed_lines += result.parsed_lines
            if result.parsed_lines or records:
                slot(node).files.append(path)  # an unreadable file is an issue, not a node
            if pipeline.observe_snapshot(node, records):
                slot(node).healthy_files.append(path)
            report.issues.extend(result.issues)
        output = pipeline.evaluate()
        findings = collect(output, node)
        if analyst is not None:
            analyst.label(output.findings)
        if stream is not None:
            for issue in report.issues[reported:]:
                stream.write("warning", None, None, None,
                             {"file": issue.file, "line": issue.line, "reason": issue.reason})
            stream.flush()
        reported = len(report.issues)
        if on_file is not None:
            on_file(path, index)
    record_clock.release()
    report.audit.extend(pipeline.store_pending())  # notify steps a tick had left for later
    deadline = time.monotonic() + wait_seconds
    while wait_seconds > 0 and time.monotonic() < deadline:
        live = pipeline.actions.actions(phases=(ActionPhase.PENDING, ActionPhase.RUNNING))
        if not live:
            break
        time.sleep(poll_seconds)
        report.audit.extend(tick())
    report.final_actions = [a.to_json() for a in pipeline.actions.actions()]
    if loop is not None and loop_thread is not None:
        if isinstance(scheduler, AsyncCloseable):
            asyncio.run_coroutine_threadsafe(scheduler.aclose(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(timeout=30)
        loop.close()
    if isinstance(scheduler, Closeable):
        scheduler.close()
    pipeline.flush()
    report.undelivered = {k: v for k, v in pipeline.outbox_depths().items() if v}
    pipeline.close()
    for finding in findings:
        slot(finding.node).findings.append(finding)
    for finding in log.seen():
        slot(finding.node).findings_seen.append(finding)
    if stream is not None:
        stream.flush()
    return report


def render_text(report: ReplayReport, *, errors: bool = True) -> str:
    """Return the replay as text: per node, the actions, then the findings worst first.

    A node's first line is ``node NAME: step, step, ... (dry-run)`` (``no action``
    when there is none); held-back steps follow with why. With ``errors``, the lines that
    could not be read close the text (``error: FILE:LINE: reason``; see
    :func:`render_errors`).
    """
    mode = "dry-run" if report.dry_run else "LIVE"
    lines = [
        f"replay: {len(report.nodes)} node(s), {mode}, disruption budget "
        f"{report.disruption_limit} node(s)"
    ]
    for node in report.nodes:
        steps = ", ".join(dict.fromkeys(describe_request(a) for a in node.actions))
        if steps:
            headline = f"{steps} ({mode})"
        elif node.held:
            headline = "every step held back (see below)"
        else:
            headline = "no action"
        lines.append(f"node {node.node}: {headline}")
        for page in node.pages:
            lines.append(
                f"  page {page.state.value} {page.labels.get('severity', '?')}: "
                f"{page.annotations.get('summary', '')}"
            )
        for held in node.held:
            step = describe(held.step, held.entity, dict(held.details)) if held.step else "?"
            lines.append(f"  held back: {step}: {held.reason}")
        for f in node.findings:
            lines.append(
                f"  {f.severity.value.upper():8} {f.action.value:16} {f.entity} "
                f"[{f.kind} {f.code}] {f.summary}"
            )
        if not node.findings:
            lines.append("  no findings")
    if not report.dry_run:
        for a in report.final_actions:
            lines.append(
                f"action {a['id']} {a['step']} {a['node']}/{a['entity']}: "
                f"{a['phase']} ({a['message']})"
            )
    if report.analysis is not None:
        lines.extend(_render_analysis(report.analysis))
    if errors:
        lines.extend(render_errors(report))
    return "\n".join(lines) + "\n"


def render_errors(report: ReplayReport) -> list[str]:
    """Return one ``error: FILE[:LINE]: reason`` line per input problem of the replay."""
    return [f"error: {issue.file}:{issue.line}: {issue.reason}" if issue.line is not None
            else f"error: {issue.file}: {issue.reason}" for issue in report.issues]


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def _features_text(features: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:+.3g}" for k, v in features.items())


TEXT_PREDICTIONS = 50
"""GPUs or ports listed in the text output, highest probability first (``--json`` has every
prediction)."""


def _render_analysis(a: StreamAnalysis) -> list[str]:
    lines = [
        f"analytics: {a.samples} samples; anomalies "
        + (", ".join(f"{k}: {v}" for k, v in sorted(a.anomalies.items())) or "none")
    ]
    lines.append(
        f"predictions: {a.predictions_made} published, {a.withheld} withheld (model not ready), "
        f"{a.positives_learned} failure vectors learned; {len(a.predictions)} at or above "
        f"{a.threshold:g}"
    )
    # One line per GPU or port: when it first crossed, how high it went, how often
    # (an entity at risk is predicted again at every step; --json lists every one).
    by_entity: dict[tuple[str, str], list[Prediction]] = {}
    for p in a.predictions:
        by_entity.setdefault((p.node, p.entity), []).append(p)
    ranked = sorted(by_entity.values(), key=lambda ps: (-max(x.probability for x in ps),
                                                        ps[0].predicted_at))
    for ps in ranked[:TEXT_PREDICTIONS]:
        first, top = ps[0], max(ps, key=lambda x: x.probability)
        lines.append(
            f"  {first.node}/{first.entity}: first {_utc(first.predicted_at)} "
            f"p={first.probability:.3f}, highest p={top.probability:.3f} at "
            f"{_utc(top.predicted_at)}, {len(ps)} prediction(s) within "
            f"{top.horizon_seconds / 3600:g} h: {_features_text(top.top_features)}"
        )
    if len(ranked) > TEXT_PREDICTIONS:
        lines.append(f"  ... {len(ranked) - TEXT_PREDICTIONS} more GPUs or ports "
                     "(--json lists every prediction)")
    return lines


def prediction_to_json(p: Prediction, aliases: Sequence[str] = ()) -> dict[str, Any]:
    """Return one prediction as a JSON object.

    ``aliases`` are the entity's other names (UUID, PCI bus id, ``gpu:N``, ``serial:S``)
    where the recording's inventory gave them, so a scorer can match any spelling.
    """
    return {
        "node": p.node,
        "entity": p.entity,
        "aliases": list(aliases),
        "probability": p.probability,
        "horizon_seconds": p.horizon_seconds,
        "predicted_at": p.predicted_at,
        "top_features": dict(p.top_features),
    }


def analysis_to_json(a: StreamAnalysis, *, lazy: bool = False) -> dict[str, Any]:
    """Return the stream analysis as a JSON object (its long lists iterables if ``lazy``)."""
    return {
        "samples": a.samples,
        "anomalies": dict(sorted(a.anomalies.items())),
        "anomalies_listed": a.listed if lazy else list(a.listed),
        "threshold": a.threshold,
        "predictions_made": a.predictions_made,
        "withheld": a.withheld,
        "positives_learned": a.positives_learned,
        "predictions": [prediction_to_json(p, a.aliases.get((p.node, p.entity), ()))
                        for p in a.predictions],
        "warnings": [prediction_to_json(p, a.aliases.get((p.node, p.entity), ()))
                     for p in a.warnings],
    }


def action_to_json(request: ActionRequest) -> dict[str, Any]:
    """Return one action request as a JSON object."""
    return {
        "step": request.step.value,
        "node": request.node,
        "entity": request.entity,
        "reason": request.reason,
        "idempotency_key": request.idempotency_key,
        "dry_run": request.dry_run,
        "not_before_at": request.not_before_at,
        "attrs": dict(request.attrs),
        "description": describe_request(request),
    }


def to_json(report: ReplayReport, *, lazy: bool = False) -> dict[str, Any]:
    """Return the replay as a JSON object (``schema_version`` 1).

    With ``lazy``, the long lists (every alert and page of a node, every anomaly listed) are
    iterables made as they are read, for :func:`write_json`; otherwise lists.
    """

    def each(encode: Any, items: Iterable[Any]) -> Any:
        return map(encode, items) if lazy else [encode(i) for i in items]

    return {
        "schema_version": SCHEMA_VERSION,
        "dry_run": report.dry_run,
        "disruption_limit": report.disruption_limit,
        "nodes": [
            {
                "node": n.node,
                "files": n.files,
                "worst_severity": n.worst_severity.value,
                "findings": [finding_to_json(f) for f in n.findings],
                "findings_seen": [finding_to_json(f) for f in n.findings_seen],
                "alerts": each(alert_to_json, n.alerts),
                "pages": each(alert_to_json, n.pages),
                "healthy_files": n.healthy_files,
                "actions": [action_to_json(a) for a in n.actions],
                "held": [
                    {
                        "step": h.step.value if h.step else None,
                        "entity": h.entity,
                        "why": h.reason,
                        "idempotency_key": h.idempotency_key,
                    }
                    for h in n.held
                ],
            }
            for n in report.nodes
        ],
        "errors": [{"file": i.file, "line": i.line, "reason": i.reason} for i in report.issues],
        "undelivered": dict(report.undelivered),
        "analytics": (None if report.analysis is None
                      else analysis_to_json(report.analysis, lazy=lazy)),
    }


def write_json(report: ReplayReport, out: IO[str]) -> None:
    """Write :func:`to_json` of ``report`` to ``out`` as it is encoded (indent 2, a newline).

    A month of a fleet is hundreds of MB of JSON: its alerts and anomalies are read back
    from disk one at a time (:func:`storage.spill.write_json`) instead of being built into
    one document first.
    """
    spill.write_json(to_json(report, lazy=True), out, indent=2)
    out.write("\n")
    out.flush()
