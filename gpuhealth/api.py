"""The alerting HTTP API of ``gpuhealth run``: alerts, pages, silences and ingest.

Endpoints (JSON; times RFC 3339 where Alertmanager uses them):

- ``GET /-/ready``: 200 once serving.
- ``GET /api/v1/alerts``: firing and pending alerts, each with ``muted`` (why, or null).
- ``GET /api/v1/pages``: open pages (one per node group).
- ``GET /api/v1/outbox``: undelivered notifications per notifier, and drops.
- ``GET /api/v2/silences``: silences as Alertmanager API v2 ``gettableSilence``.
- ``POST /api/v2/silences``: create (or, with ``id``, replace) a silence from
  Alertmanager's ``postableSilence``; answers ``{"silenceID": ...}``.
- ``GET /api/v2/silence/{id}``, ``DELETE /api/v2/silence/{id}``: read, expire.
- ``POST /api/v1/ingest?node=N&file=NAME&context=k=v``: a recorded artifact (its raw
  text as the body) as one snapshot of node ``N``, judged at the next evaluation; 400
  (the reasons in ``errors``) for an empty body, binary data or no known artifact kind,
  the checks of ``gpuhealth diagnose``.
- ``POST /api/v1/alertmanager``: an Alertmanager webhook payload (version 4), mapped to
  findings (:mod:`alerting.inbound`) and handed to the service's ``on_alertmanager``
  callback; 400 names the bad field, 404 when not configured, 503 when the callback
  fails (Alertmanager retries 5xx).
- ``POST /api/v1/actions/{ref}/status``: an external automation reports the outcome of
  an action it was sent (``{"phase": "running|succeeded|failed|cancelled",
  "message": ...}``), handed to ``on_action_report``; 404 unknown ref or not
  configured, 409 contradicts an earlier report.
- ``POST /api/v1/gpu-reset``: the node agent's GPU reset
  (:class:`remediation.gpu_reset.GpuResetEndpoint`), authenticated by its own
  Standard-Webhooks HMAC signature (not the bearer token); 404 when not configured.

The silence endpoints take the same JSON as Alertmanager 0.25's, so scripts written
for ``amtool``'s API work unchanged. Anything that changes state (``POST``,
``DELETE``) needs ``Authorization: Bearer <token>`` when a token is configured,
which the settings require once the API listens beyond loopback (architecture
principle 5); the token is compared in constant time and never logged.
"""

from __future__ import annotations

import codecs
import dataclasses
import datetime as dt
import hmac
import json
import logging
import os
import tempfile
import urllib.parse
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from alerting.alertmanager import rfc3339
from alerting.alerts import alert_to_json
from alerting.inbound import InboundBatch, InboundError, batch_summary, parse_alertmanager_body
from alerting.silences import Matcher, Silence, SilenceStore
from collectors.artifact import (
    ArtifactParser,
    ArtifactResult,
    ParseContext,
    ParseIssue,
    read_artifact,
)
from collectors.parsers import artifact_parsers
from core.errors import TemporaryError
from core.names import entity_problem, node_name_problem, text_problem
from core.records import ActionPhase, ActionStatus, NodeName, Record
from gpuhealth._serving import ServingThread
from gpuhealth.config import Settings, alerting_path, api_token
from gpuhealth.pipeline import Pipeline
from remediation.gpu_reset import RESET_PATH, GpuResetEndpoint
from remediation.stage import WRITE_ERRORS
from storage.journal import JournalIngest
from storage.lineprotocol import head_is_line_protocol

logger = logging.getLogger(__name__)

MAX_INGEST_BYTES = 64 * 1024 * 1024
"""Largest accepted ingest body, bytes (a day of a busy kernel log)."""


class ApiError(Exception):
    """An HTTP error answer: status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _parse_time(value: Any, field: str) -> float:
    try:
        return dt.datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        raise ApiError(400, f"{field}: not an RFC 3339 time: {value!r}") from None


def silence_to_api(silence: Silence, now: float) -> dict[str, Any]:
    """Return a silence as Alertmanager API v2 ``gettableSilence`` JSON."""
    return {
        "id": silence.id,
        "status": {"state": silence.state(now).value},
        "updatedAt": rfc3339(silence.updated_at),
        "matchers": [m.to_alertmanager() for m in silence.matchers],
        "startsAt": rfc3339(silence.starts_at),
        "endsAt": rfc3339(silence.ends_at),
        "createdBy": silence.created_by,
        "comment": silence.comment,
    }


def create_silence(store: SilenceStore, body: Any) -> Silence:
    """Create or update a silence from Alertmanager API v2 ``postableSilence`` JSON.

    Raises:
        ApiError: 400 on a malformed body or an invalid silence, 404 for an unknown ``id``.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object")
    try:
        matchers = tuple(Matcher.from_alertmanager(m) for m in body.get("matchers") or [])
    except (ValueError, TypeError, AttributeError) as exc:
        raise ApiError(400, f"matchers: {exc}") from None
    if "endsAt" not in body:
        raise ApiError(400, "endsAt is required")
    starts_at = _parse_time(body["startsAt"], "startsAt") if body.get("startsAt") else None
    ends_at = _parse_time(body["endsAt"], "endsAt")
    silence_id = body.get("id") or None
    if silence_id is not None and store.get(str(silence_id)) is None:
        raise ApiError(404, f"no silence {silence_id!r}")
    try:
        return store.add(
            matchers,
            starts_at=starts_at,
            ends_at=ends_at,
            created_by=str(body.get("createdBy", "")),
            comment=str(body.get("comment", "")),
            silence_id=str(silence_id) if silence_id is not None else None,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


_TEXT_PROBE_BYTES = 8192
_BOMS = (codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, b"\x1f\x8b")
"""Byte-order marks and the gzip magic: bodies starting with one are left to the reader."""


def _not_text(data: bytes) -> str | None:
    """Return why ``data`` is binary rather than a text artifact, or ``None``.

    Stricter than the file reader of ``diagnose`` (which flags NUL bytes only): an HTTP body
    whose first 8 KiB are more than 2 % invalid UTF-8 or control bytes is refused before
    parsing, so no line of it reaches a log.
    """
    head = data[:_TEXT_PROBE_BYTES]
    if not head or head.startswith(_BOMS):
        return None
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=False)
    bad = sum(1 for c in text if c == "\ufffd" or (c < " " and c not in "\t\n\r\x1b\x00"))
    return "binary data (not UTF-8 text)" if bad > 0.02 * len(text) else None


def _short(data: bytes) -> str:
    """A short, ASCII-safe picture of a body for logs."""
    return f"{len(data)} bytes starting {data[:24]!r}"


def ingest(
    pipeline: Pipeline,
    *,
    node: str,
    text: str | bytes,
    file: str = "ingest",
    facts: dict[str, str] | None = None,
    parsers: Sequence[ArtifactParser] | None = None,
    accepted_at: float | None = None,
) -> dict[str, Any]:
    """Parse one recorded artifact and give it to the pipeline as a snapshot of ``node``.

    An artifact that was read is written to the pipeline's journal before it is applied
    (:class:`~storage.journal.InputJournal`), so it comes back after a restart
    (:func:`recover_ingests`).

    The body is read as ``gpuhealth diagnose`` reads a file (gzip, byte-order marks, NUL
    padding, cut long lines), with the same checks: an empty body, binary data and a body
    in which no artifact kind is recognised are refused, and the pipeline is not told.

    Args:
        pipeline: The running pipeline.
        node: The node the artifact is about (every record is put on it).
        text: The artifact's raw bytes (or text).
        file: Its name, for evidence and errors.
        facts: Facts about the node (``nvlink=expected``), kept for later evaluations.
        parsers: Artifact parsers; the registered ones by default.
        accepted_at: When it was accepted (recovery from the journal: it is not journaled
            again and its events keep their time); ``None``: now.

    Returns:
        ``{"node", "records", "healthy", "errors"}``: how many records were read,
        whether the snapshot showed the node healthy (and cleared its earlier state),
        and the parse errors. A refused body also has ``"error"`` (the first reason)
        and ``"errors"`` names why.

    Raises:
        IngestNotRecorded: The journal cannot be written (a full disk, PostgreSQL away):
            nothing was applied; the sender should retry.
    """
    data = text.encode() if isinstance(text, str) else text
    result = ArtifactResult()
    records: list[Record] = []
    reason = "empty body" if not data else _not_text(data)
    if reason is None and head_is_line_protocol(data[:_TEXT_PROBE_BYTES], cut=True):
        reason = ("InfluxDB line protocol (recorded telemetry), not an artifact: load it "
                  "with `gpuhealth import` or `gpuhealth replay`")
    if reason is not None:
        result.issues.append(ParseIssue(file=file, line=None, reason=reason))
    else:
        ctx = ParseContext(file=file, node=NodeName(node))
        with tempfile.TemporaryDirectory(prefix="gpuhealth-ingest-") as folder:
            path = os.path.join(folder, "body")
            with open(path, "wb") as fh:
                fh.write(data)
            for record in read_artifact(path, ctx, parsers or artifact_parsers(), result):
                records.append(record if record.node == node else _moved(record, node))
        result.issues[:] = [
            dataclasses.replace(i, file=file) if i.file == path else i for i in result.issues
        ]
        if result.parsed_lines == 0 and not result.issues:
            result.issues.append(ParseIssue(file=file, line=None, reason="no artifact lines"))
    errors = [{"file": i.file, "line": i.line, "reason": i.reason} for i in result.issues]
    if result.parsed_lines == 0:
        first = result.issues[0].reason
        logger.info("ingest for node %s refused: %s (%s, %s)", node, first, file, _short(data))
        return {"node": node, "records": 0, "healthy": False, "errors": errors, "error": first}
    if pipeline.journal is not None and accepted_at is None:
        try:
            pipeline.journal.add_ingest(JournalIngest(
                accepted_at=pipeline.clock(), node=node, file=file, facts=dict(facts or {}),
                body=data))
        except WRITE_ERRORS as exc:
            pipeline.remediation.report("journal", exc, f"ingest for node {node} refused")
            raise IngestNotRecorded(f"cannot record the artifact now ({exc}); retry") from exc
        pipeline.remediation.report("journal", None)
    if facts:
        pipeline.set_node_facts(node, facts)
    healthy = pipeline.observe_snapshot(node, records, received_at=accepted_at)
    return {"node": node, "records": len(records), "healthy": healthy, "errors": errors}


class IngestNotRecorded(TemporaryError):
    """The artifact was read but cannot be recorded now (the API answers 503)."""


def recover_ingests(pipeline: Pipeline, *, window_seconds: float) -> int:
    """Apply again the artifacts the journal accepted within the event window, in order.

    Older ones are pruned first (their events would be forgotten at once). Returns how
    many came back; one that no longer parses is logged and skipped.

    Raises:
        TemporaryError: The shared journal cannot be read now.
    """
    journal = pipeline.journal
    if journal is None:
        return 0
    now = pipeline.clock()
    try:
        journal.prune(before=now - window_seconds)
    except WRITE_ERRORS as exc:
        logger.warning("cannot prune the ingest journal: %s", exc)
    back = 0
    for item in journal.ingests(since=now - window_seconds):
        answer = ingest(pipeline, node=item.node, text=item.body, file=item.file,
                        facts=dict(item.facts), accepted_at=item.accepted_at)
        if "error" in answer:
            logger.warning("journaled ingest %s for %s no longer reads: %s", item.file,
                           item.node, answer["error"])
        else:
            back += 1
    if back:
        logger.info("%d ingested artifact(s) back from the journal", back)
    return back


def _moved(record: Record, node: str) -> Record:
    return dataclasses.replace(record, node=NodeName(node))


class AlertingApi:
    """The request handling, independent of the HTTP server (tests call :meth:`handle`).

    Args:
        pipeline: The running pipeline.
        silences: The silence store the pipeline consults.
        token: Bearer token required for changes, or ``None`` (loopback only).
        on_alertmanager: Receives each checked Alertmanager batch; ``None`` answers 404.
        on_action_report: Records an action outcome an external automation reports
            (``WebhookScheduler.report``): raises ``KeyError`` for an unknown ref and
            ``ValueError`` for a contradicting report; ``None`` answers 404.
        gpu_reset: The node agent's reset endpoint; ``None`` answers 404.
    """

    def __init__(self, *, pipeline: Pipeline, silences: SilenceStore,
                 token: str | None = None,
                 on_alertmanager: Callable[[InboundBatch], None] | None = None,
                 on_action_report: Callable[[str, ActionPhase, str], ActionStatus] | None = None,
                 gpu_reset: GpuResetEndpoint | None = None) -> None:
        self.pipeline = pipeline
        self.silences = silences
        self.token = token
        self.on_alertmanager = on_alertmanager
        self.on_action_report = on_action_report
        self.gpu_reset = gpu_reset

    def __repr__(self) -> str:
        """Return a representation that never shows the token."""
        return f"AlertingApi(token={'set' if self.token else 'none'})"

    def _authorize(self, headers: dict[str, str]) -> None:
        if self.token is None:
            return
        offered = headers.get("authorization", "")
        if not offered.startswith("Bearer ") or not hmac.compare_digest(
            offered[len("Bearer "):].encode(), self.token.encode()
        ):
            raise ApiError(401, "a valid bearer token is required")

    def handle(self, method: str, target: str, headers: dict[str, str], body: bytes
               ) -> tuple[int, Any]:
        """Answer one request; return the status and the JSON answer.

        Args:
            method: ``GET``, ``POST`` or ``DELETE``.
            target: The path with its query string.
            headers: Request headers, names lower-cased.
            body: The raw body.
        """
        try:
            return self._route(method, target, headers, body)
        except ApiError as exc:
            return exc.status, {"error": exc.message}

    def _route(self, method: str, target: str, headers: dict[str, str], body: bytes
               ) -> tuple[int, Any]:
        url = urllib.parse.urlsplit(target)
        path = url.path.rstrip("/") or "/"
        now = self.silences.clock()
        if method == "GET":
            if path == "/-/ready":
                return 200, {"status": "ready"}
            if path == "/api/v1/alerts":
                muted = self.pipeline.muted()
                alerts = self.pipeline.active_alerts() + self.pipeline.pending_alerts()
                return 200, [{**alert_to_json(a), "muted": muted.get(a.fingerprint)}
                             for a in alerts]
            if path == "/api/v1/pages":
                return 200, [alert_to_json(p) for p in self.pipeline.open_pages()]
            if path == "/api/v1/outbox":
                return 200, {"depths": self.pipeline.outbox_depths(),
                             "dropped": dict(self.pipeline.outbox.dropped)}
            if path == "/api/v2/silences":
                return 200, [silence_to_api(s, now) for s in self.silences.list_silences()]
            if path.startswith("/api/v2/silence/"):
                found = self.silences.get(path.rsplit("/", 1)[1])
                if found is None:
                    raise ApiError(404, "no such silence")
                return 200, silence_to_api(found, now)
            raise ApiError(404, f"no such endpoint {path}")
        if method not in ("POST", "DELETE"):
            raise ApiError(405, f"method {method} not allowed")
        if method == "POST" and path == RESET_PATH:  # signed by its own HMAC, not the token
            if self.gpu_reset is None:
                raise ApiError(404, "this node serves no GPU reset")
            return self.gpu_reset.handle(headers, body)
        self._authorize(headers)
        if method == "POST" and path == "/api/v1/alertmanager":
            return self._alertmanager(body)
        if method == "POST" and path.startswith("/api/v1/actions/") and path.endswith("/status"):
            return self._action_report(path, body)
        if method == "DELETE" and path.startswith("/api/v2/silence/"):
            try:
                self.silences.expire(path.rsplit("/", 1)[1])
            except KeyError:
                raise ApiError(404, "no such silence") from None
            return 200, {}
        if method == "POST" and path == "/api/v2/silences":
            try:
                data = json.loads(body or b"null")
            except ValueError:
                raise ApiError(400, "body is not JSON") from None
            return 200, {"silenceID": create_silence(self.silences, data).id}
        if method == "POST" and path == "/api/v1/mark-healthy":
            return self._mark_healthy(body)
        if method == "POST" and path == "/api/v1/ingest":
            query = urllib.parse.parse_qs(url.query)
            node = (query.get("node") or [""])[0]
            if not node:
                raise ApiError(400, "node is required")
            facts: dict[str, str] = {}
            for pair in query.get("context", []):
                key, sep, value = pair.partition("=")
                if not sep or not key:
                    raise ApiError(400, f"context must be key=value, got {pair!r}")
                facts[key] = value
            name = (query.get("file") or ["ingest"])[0]
            try:
                answer = ingest(self.pipeline, node=node, text=body, file=name, facts=facts)
            except IngestNotRecorded as exc:
                raise ApiError(503, str(exc)) from None
            return (400 if "error" in answer else 200), answer
        raise ApiError(404, f"no such endpoint {path}")

    def _mark_healthy(self, body: bytes) -> tuple[int, Any]:
        """``POST /api/v1/mark-healthy`` ``{"node", "entity"?, "reason", "by"?}``."""
        try:
            data = json.loads(body or b"null")
        except ValueError:
            raise ApiError(400, "body is not JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body must be a JSON object")
        node, entity = data.get("node"), data.get("entity")
        reason, by = data.get("reason"), data.get("by") or "api"
        if not isinstance(node, str) or not node:
            raise ApiError(400, "node: a node name is required")
        if entity is not None and (not isinstance(entity, str) or not entity):
            raise ApiError(400, "entity: a GPU, port or link name, or absent for the node")
        if not isinstance(reason, str) or not reason.strip():
            raise ApiError(400, "reason: required (it goes into the audit trail)")
        if not isinstance(by, str):
            raise ApiError(400, "by: a name")
        problem = (node_name_problem(node) or (entity_problem(entity) if entity else None)
                   or text_problem("reason", reason) or text_problem("by", by))
        if problem:
            raise ApiError(400, problem)
        if not self.pipeline.knows_node(node):
            raise ApiError(404, f"unknown node {node}: no reading, finding or incident of it "
                                "here (nothing was recorded)")
        try:
            cleared = self.pipeline.mark_healthy(node, entity, reason=reason, by=by)
        except OSError as exc:
            raise ApiError(503, str(exc)) from None
        return 200, {"node": node, "entity": entity,
                     "cleared": [{"kind": f.kind, "code": f.code, "entity": f.entity,
                                  "severity": f.severity.value} for f in cleared]}

    def _alertmanager(self, body: bytes) -> tuple[int, Any]:
        if self.on_alertmanager is None:
            raise ApiError(404, "Alertmanager inbound is not configured")
        try:
            batch = parse_alertmanager_body(body, received_at=self.silences.clock())
        except InboundError as exc:
            raise ApiError(400, str(exc)) from None
        try:
            self.on_alertmanager(batch)
        except Exception:
            logger.exception("the Alertmanager callback failed")
            raise ApiError(503, "could not take the alerts now; retry") from None
        return 200, batch_summary(batch)

    def _action_report(self, path: str, body: bytes) -> tuple[int, Any]:
        if self.on_action_report is None:
            raise ApiError(404, "action reports are not configured")
        ref = path[len("/api/v1/actions/"):-len("/status")]
        try:
            data = json.loads(body or b"null")
        except ValueError:
            raise ApiError(400, "body is not JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "expected a JSON object")
        message = data.get("message", "")
        if not isinstance(message, str):
            raise ApiError(400, "message: expected a string")
        reportable = ("running", "succeeded", "failed", "cancelled")
        if data.get("phase") not in reportable:
            raise ApiError(400, f"phase: expected one of {', '.join(reportable)}, "
                                f"got {data.get('phase')!r}")
        phase = ActionPhase(data["phase"])
        try:
            status = self.on_action_report(ref, phase, message)
        except KeyError:
            raise ApiError(404, f"no action {ref!r}") from None
        except ValueError as exc:
            raise ApiError(409, str(exc)) from None
        return 200, {"ref": status.ref, "phase": status.phase.value, "message": status.message}


class ApiServer:
    """Serves :class:`AlertingApi` on a thread.

    Args:
        api: The request handling.
        listen_address: Address to bind (loopback by default).
        port: TCP port; 0 picks a free one.
    """

    def __init__(self, *, api: AlertingApi, listen_address: str = "127.0.0.1",
                 port: int = 9836) -> None:
        self.api = api
        self.listen_address = listen_address
        self.port = port
        self._serving = ServingThread()

    def start(self) -> None:
        """Bind and serve in a daemon thread.

        Raises:
            OSError: The address cannot be bound.
        """
        server = ThreadingHTTPServer((self.listen_address, self.port), _handler(self.api.handle))
        self.port = self._serving.start(server, name="gpuhealth-api")
        logger.info("alerting API at %s", self.url)

    @property
    def url(self) -> str:
        """The base URL."""
        return f"http://{self.listen_address}:{self.port}"

    def stop(self) -> None:
        """Stop serving."""
        self._serving.stop()


def _handler(
    handle: Callable[[str, str, dict[str, str], bytes], tuple[int, Any]],
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # no delayed-ACK wait between headers and body

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_INGEST_BYTES:
                status, answer = 413, {"error": "body too large"}
            else:
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    status, answer = handle(method, self.path, headers, body)
                except Exception as exc:
                    logger.exception("alerting API failed on %s %s", method, self.path)
                    status, answer = 500, {"error": type(exc).__name__}
            raw = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("api: %s", format % args)

    return Handler


def start_api(
    settings: Settings,
    pipeline: Pipeline,
    *,
    on_alertmanager: Callable[[InboundBatch], None] | None = None,
    on_action_report: Callable[[str, ActionPhase, str], ActionStatus] | None = None,
    gpu_reset: GpuResetEndpoint | None = None,
) -> ApiServer | None:
    """Start the alerting API of ``gpuhealth run`` as ``[alerting]`` configures it.

    Args:
        settings: The loaded settings.
        pipeline: The service's pipeline (its silence store is shared with the API).
        on_alertmanager: Takes Alertmanager batches (``POST /api/v1/alertmanager``).
        on_action_report: Takes action outcomes reported by an external automation
            (``WebhookScheduler.report``).
        gpu_reset: Serves ``POST /api/v1/gpu-reset`` on a GPU node.

    Returns:
        The running server, or ``None`` when ``api_enabled`` is false.

    Raises:
        OSError: The address cannot be bound.
    """
    a = settings.alerting
    if not a.api_enabled:
        return None
    silences = pipeline.silences or SilenceStore(path=alerting_path(settings, "silences"))
    server = ApiServer(
        api=AlertingApi(pipeline=pipeline, silences=silences, token=api_token(settings),
                        on_alertmanager=on_alertmanager, on_action_report=on_action_report,
                        gpu_reset=gpu_reset),
        listen_address=a.api_listen_address,
        port=a.api_port,
    )
    server.start()
    return server
