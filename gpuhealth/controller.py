"""``gpuhealth controller``: one replica of the fleet's controller pair.

Every replica:

- serves the agents' API and the fleet ``/metrics`` (aiohttp, TLS beyond loopback):
  ``POST /api/v1/agents/{node}/batch`` authenticates the agent by its bearer token
  (401 for a missing or unknown token, 403 for a token of another node or a record
  about another node, 400 naming the bad key of a malformed batch), writes the records
  and the heartbeat to the fleet state store through a fixed pool of connections and
  answers 200 ``{"accepted", "duplicates"}`` only after the write (503 when the store
  cannot be written: the agent keeps the batch and retries);
  ``GET /api/v1/agents`` (the registry), ``GET /api/v1/actions`` (the remediation
  actions), ``GET /-/ready``, and ``run``'s alerting API (:class:`gpuhealth.api.AlertingApi`:
  alerts, pages, outbox, Alertmanager-style silences, ingest, inbound Alertmanager, action
  reports; anything that changes state needs ``[alerting] api_token_env``'s bearer token,
  which is required once the controller listens beyond loopback);
- consumes the accepted records in order (``seq``) into its pipeline, so a standby's
  alert state is as current as the leader's when it takes over.

Only the leader (``[remediation] election``) decides and acts: fleet-wide incidents,
alerting, remediation under one disruption budget and circuit breaker, with the action
store and the audit trail in the shared state store, so the standby resumes the
leader's actions (each exactly once, by its idempotency key) after a fail-over.

A node whose agent has sent nothing for ``[controller] agent_silent_seconds`` gets a
``warning`` finding (``agent``/``silent``, action none): it is watched, never drained
on that alone. Heartbeats are stamped with the replica's own clock; an agent's clock
is compared with it at every batch (``sent_at``, :class:`storage.fleet.ClockSkewWatch`):
``gpuhealth_agent_clock_skew_seconds{node}``, and a warning once per node beyond
``[controller] agent_clock_skew_warn_seconds``. All network I/O of a replica runs on one
event loop; database calls run on a thread pool of the pool's size.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from alerting.silences import SilenceStore
from analytics.canary import CanaryVerdict, CanaryWatch
from analytics.fleet import AgentSilence, FleetCorrelator
from core.errors import ConfigError, TemporaryError
from gpuhealth._serving import ReloadingTLS
from gpuhealth.api import AlertingApi, recover_ingests
from gpuhealth.compose import service_pipeline
from gpuhealth.config import Settings, api_token
from gpuhealth.history_sync import HistoryRecorder
from gpuhealth.leader import build_leader_loop
from gpuhealth.metrics import CONTENT_TYPE, MetricsExporter
from gpuhealth.pipeline import Pipeline
from gpuhealth.tokens import AgentTokens
from remediation.metrics import RemediationCollector
from storage.fleet import (
    AgentBatch,
    BatchError,
    ClockSkewWatch,
    FleetStore,
    GroupCommit,
    batch_sent_at,
    finding_updates,
    open_fleet_store,
    parse_batch,
)
from storage.history import IncidentHistory
from storage.sql import PasswordFile, is_postgres, server_of

logger = logging.getLogger(__name__)

MAX_BATCH_BYTES = 8 * 1024 * 1024
"""Largest batch body accepted (413 beyond)."""


HISTORY_INTERVAL_SECONDS = 30.0
"""How often the leader writes changed incidents and inventory into the history (s)."""

TOKENS_CHECK_SECONDS = 0.25
"""How often a batch checks the tokens file for changes (s); a refused batch checks it at
once, so a token removed is refused within this long and a token added at once (a
``stat`` per batch was 9 % of the API's thread at 2,000 nodes)."""

SLOW_ROUND_SECONDS = 2.0
"""A consumer round (read, evaluate, tick) this long is logged with its parts (info)."""
METRICS_REFRESH_SECONDS = 2.0
"""How often the incident gauges are read from the action store (s); a scrape reads the
last figures."""
DELIVER_INTERVAL_SECONDS = 1.0
"""The longest a due notification (a retry after backoff) waits for a delivery round (s)."""

SECRETS_CHECK_SECONDS = 1.0
"""How often the TLS certificate and key and the PostgreSQL password file are checked for
a change (s); the agents' tokens are checked at every batch."""



_LOOPBACK_ADDRESSES = ("127.0.0.1", "::1", "localhost")


def listener_token_problem(settings: Settings, env: Mapping[str, str] = os.environ
                           ) -> str | None:
    """Why the controller refuses to start without an alerting API token, or ``None``.

    The one check of ``gpuhealth controller`` and ``gpuhealth config check --role
    controller``: beyond loopback, the API that creates silences and takes action reports
    must need a bearer token.

    Args:
        settings: Loaded settings.
        env: The environment the token is read from.
    """
    address = settings.controller.listen_address
    if address in _LOOPBACK_ADDRESSES or api_token(settings, env):
        return None
    name = settings.alerting.api_token_env
    fix = (f"set {name} in the controller's environment (e.g. its EnvironmentFile)" if name
           else 'set api_token_env = "GPUHEALTH_API_TOKEN" (the name of an environment '
                "variable that holds the token) and that variable")
    found = (f"{name} is unset or empty" if name else "api_token_env is not set")
    return (f"{settings.source}: [alerting] api_token_env: the controller listens on "
            f"{address} (beyond loopback), so its alerting API (silences, action reports) "
            f"must require a bearer token, but {found}: {fix}, or listen on 127.0.0.1")

class Controller:
    """One controller replica (module docstring); :func:`run_controller` runs it.

    Args:
        settings: Loaded settings (``[controller]``, ``[remediation]``, ``[alerting]``).
        store: The fleet state store; opened from ``[controller] state`` by default.

    Raises:
        ConfigError: No ``[controller] agent_tokens_file``, a setting is wrong, the TLS pair
            does not load or the state password file cannot be read (names the file).
    """

    def __init__(self, settings: Settings, *, store: FleetStore | None = None) -> None:
        c = settings.controller
        if c.agent_tokens_file is None:
            raise ConfigError(f"{settings.source}: [controller] agent_tokens_file: the "
                              "controller accepts only agents with a token; list them")
        self.pg_password: PasswordFile | None = None
        """``[controller] state_password_file``'s private pgpass copy (module docstring)."""
        if c.state_password_file is not None and c.state is not None:
            settings = self._with_password_file(settings, c.state_password_file, c.state)
        try:
            self._init(settings, c.agent_tokens_file, store)
        except BaseException:
            if self.pg_password is not None:
                self.pg_password.close()
            raise

    def _with_password_file(self, settings: Settings, path: Path, state: str) -> Settings:
        """``settings`` whose state DSN names the password file's private pgpass copy.

        Every store of the state (fleet records, actions, audit trail, outbox, silences,
        history) is opened with that DSN, so each new connection reads the newest password.
        """
        if os.environ.get("PGPASSWORD"):
            raise ConfigError(f"{settings.source}: [controller] state_password_file: "
                              "PGPASSWORD is set, and libpq would log in with it instead; "
                              "unset one")
        self.pg_password = PasswordFile(
            path, where=f"{settings.source}: [controller] state_password_file")
        c = settings.controller
        return settings.model_copy(update={"controller": c.model_copy(
            update={"state": self.pg_password.dsn(state)})})

    def _init(self, settings: Settings, tokens_file: Path, store: FleetStore | None) -> None:
        c = settings.controller
        self.settings = settings
        self.tls: ReloadingTLS | None = None
        """The listener's certificate, re-read on change (``None`` without TLS)."""
        if c.tls_cert_file and c.tls_key_file:  # a pair that does not load: before any store
            self.tls = ReloadingTLS(c.tls_cert_file, c.tls_key_file,
                                    where=f"{settings.source}: [controller]")
        self.tokens = AgentTokens(tokens_file)
        self._tokens_problem = ""
        self._refused_logged: dict[str, float] = {}
        self.store = store or open_fleet_store(settings.fleet_state, pool_size=c.pool_size + 1)
        self.elector = build_leader_loop(settings)
        self.facts: dict[str, dict[str, str]] = {}
        """Per node, the facts its agent reports (``[inventory]``: switch, rack, links).

        Written on the API's loop (a batch's facts, each entry replaced whole) and read on
        the consumer's thread, which takes copies (a dict is copied in one step): iterating
        it there raised "dictionary changed size during iteration" at 10,000 nodes."""
        # On PostgreSQL the action store and the audit trail are the pair's, shared: the
        # standby resumes the leader's actions from them (each exactly once, by its key).
        self.pipeline: Pipeline = service_pipeline(
            settings, identity=self.elector.identity, is_leader=self.elector.is_leader_now,
            shared_state=settings.fleet_state if is_postgres(settings.fleet_state) else None,
            notify_as_standby=False, fleet_facts=lambda: dict(self.facts), journal_held=False)
        # Decisions never wait behind notifications: the outbox has its own task.
        self.pipeline.deliver_inline = False
        recover_ingests(self.pipeline, window_seconds=settings.analytics.event_window_seconds)
        token = api_token(settings)
        problem = listener_token_problem(settings)
        if problem:
            raise ConfigError(problem)
        self.api = AlertingApi(pipeline=self.pipeline, silences=self.pipeline.silences
                               or SilenceStore(), token=token)
        self.exporter = MetricsExporter()
        self.remediation_metrics = RemediationCollector(
            self.pipeline.remediation, is_leader=self.elector.is_leader_now)
        self.exporter.register(self.remediation_metrics)
        self._store_failed_at = float("-inf")
        self._started_at = time.monotonic()
        self.correlator = FleetCorrelator(attributes=c.correlate_by,
                                          min_nodes=c.correlate_min_nodes,
                                          window_seconds=c.correlate_window_seconds)
        self.cursor = 0
        self.silence = AgentSilence(after_seconds=c.agent_silent_seconds)
        self.clock_skew = ClockSkewWatch(warn_seconds=c.agent_clock_skew_warn_seconds)
        """Each agent's clock against this replica's (``sent_at`` of its batches)."""
        self.canary = CanaryWatch(attribute="driver_version")
        self.canary_verdict: CanaryVerdict | None = None
        self._canary_said = ""
        self.port: int | None = None
        self.ready = threading.Event()
        self.recorder: HistoryRecorder | None = None
        """The leader's incident history writer (opened by :meth:`serve`)."""
        self._report_scheduler: Any = None
        self._db = ThreadPoolExecutor(max_workers=c.pool_size,
                                      thread_name_prefix="gpuhealth-state")
        self._consumer_db = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix="gpuhealth-consume")
        """The consumer's reads never queue behind the agents' batches (its own thread;
        the store's pool holds a connection more than the API's threads)."""
        self._ingest = GroupCommit(lambda batches: self.store.accept_batches(batches),
                                   self._db_call)
        """Agents' batches that arrive together: one transaction (1,000 a second at 10k)."""
        self.secrets_check_seconds = SECRETS_CHECK_SECONDS
        self._password_problem = ""

    # --- HTTP --------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application of the agents' API and ``/metrics``."""
        app = web.Application(client_max_size=MAX_BATCH_BYTES)
        app.router.add_post("/api/v1/agents/{node}/batch", self._batch)
        app.router.add_get("/api/v1/agents", self._agents)
        app.router.add_get("/api/v1/actions", self._actions)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/-/ready", self._ready)
        app.router.add_get("/api/v1/canary", self._canary_api)
        for path in ("/api/v1/alerts", "/api/v1/pages", "/api/v1/outbox", "/api/v2/silences",
                     "/api/v2/silence/{id}", "/api/v1/ingest", "/api/v1/alertmanager",
                     "/api/v1/actions/{ref}/status"):
            app.router.add_route("*", path, self._alerting_api)
        return app

    async def _alerting_api(self, request: web.Request) -> web.Response:
        """The alerting API of ``run`` (alerts, pages, silences, ingest), as ``run`` serves it."""
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        status, answer = await asyncio.get_running_loop().run_in_executor(
            None, self.api.handle, request.method, request.path_qs, headers, body)
        return web.json_response(answer, status=status)

    async def _actions(self, request: web.Request) -> web.Response:
        """The remediation actions (``gpuhealth actions list`` over HTTP), newest last."""
        try:
            limit = int(request.query.get("limit", "200"))
        except ValueError:
            return web.json_response({"error": "limit: expected an integer"}, status=400)
        try:
            rows = await self._db_call(lambda: self.pipeline.actions.actions(limit=limit))
        except TemporaryError as exc:
            return web.json_response({"error": f"the state store is unavailable: {exc}"},
                                     status=503)
        return web.json_response([a.to_json() for a in rows])

    async def _db_call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._db, fn, *args)

    async def _consumer_call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._consumer_db, fn, *args)

    def _reload_tokens(self, unless_checked_within: float) -> None:
        try:
            self.tokens.reload(unless_checked_within=unless_checked_within)
        except ConfigError as exc:  # keep the last good tokens; say so once per change
            if str(exc) != self._tokens_problem:
                self._tokens_problem = str(exc)
                logger.error("controller: %s; the tokens read before stay in force", exc)  # noqa: TRY400
        else:
            self._tokens_problem = ""

    def _count(self, status: int) -> None:
        self.exporter.inc("gpuhealth_controller_batches_total", {"code": str(status)})

    async def _batch(self, request: web.Request) -> web.Response:
        received_at = time.time()  # before the body is read: the skew's other end
        node = request.match_info["node"]
        header = request.headers.get("Authorization", "")
        token = header[7:] if header.startswith("Bearer ") else ""
        self._reload_tokens(TOKENS_CHECK_SECONDS)
        status = self.tokens.check(node, token) if token else 401
        if status != 200 and token:  # a node added this second is not refused
            self._reload_tokens(0.0)
            status = self.tokens.check(node, token)
        if status != 200:
            self._count(status)
            now = time.monotonic()
            if now - self._refused_logged.get(node, float("-inf")) >= 60.0:
                self._refused_logged[node] = now
                logger.warning("controller: refused a batch for %s from %s: %s", node,
                               request.remote, "unknown or missing token" if status == 401
                               else "the token of another node")
            why = "unknown or missing token" if status == 401 else "token of another node"
            return web.json_response({"error": why}, status=status,
                                     headers={"WWW-Authenticate": "Bearer"}
                                     if status == 401 else None)
        try:
            payload = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            self._count(400)
            return web.json_response({"error": "the body is not JSON (or nested too deep)"},
                                     status=400)
        try:
            records, heartbeat = parse_batch(node, payload)
        except BatchError as exc:
            self._count(exc.status)
            return web.json_response({"error": str(exc)}, status=exc.status)
        skew = self.clock_skew.observe(node, batch_sent_at(payload), received_at)
        if skew is not None:
            self.exporter.set("gpuhealth_agent_clock_skew_seconds", skew.skew, {"node": node})
        gpus = heartbeat.get("gpus", []) if heartbeat else []
        facts = heartbeat.get("facts", {}) if heartbeat else {}
        facts = {str(k): str(v) for k, v in facts.items()} if isinstance(facts, dict) else {}
        self.facts[node] = facts  # at once: a burst may come with the first heartbeat
        try:  # with the batches of the other agents that arrive meanwhile: one commit
            result = await self._ingest.accept(AgentBatch(
                node=node, records=records, heartbeat_at=time.time(),
                version=str(payload.get("agent_version", "")),
                gpus=gpus if isinstance(gpus, list) else [], facts=facts))
        except TemporaryError as exc:
            self._count(503)
            self._store_failed_at = time.monotonic()
            logger.warning("controller: cannot write a batch of %s: %s", node, exc)
            return web.json_response({"error": "the state store is unavailable"}, status=503)
        except Exception as exc:  # the store refused the content: say so, never hang the agent
            self._count(422)
            logger.error("controller: the state store refused a batch of %s: %s",  # noqa: TRY400
                         node, exc)
            return web.json_response({"error": f"the state store refused the batch: {exc}"},
                                     status=422)
        self._count(200)
        for record in records:
            self.exporter.inc("gpuhealth_controller_records_accepted_total",
                              {"kind": record.kind})
        return web.json_response({"accepted": result.accepted,
                                  "duplicates": result.duplicates})

    async def _agents(self, request: web.Request) -> web.Response:
        try:
            rows = await self._db_call(self.store.agents)
        except TemporaryError as exc:
            return web.json_response({"error": f"the state store is unavailable: {exc}"},
                                     status=503)
        now = time.time()
        silent_after = self.settings.controller.agent_silent_seconds
        return web.json_response([{
            "node": r.node, "version": r.version, "gpus": list(r.gpus), "facts": dict(r.facts),
            "first_seen_at": r.first_seen_at, "last_heartbeat_at": r.last_heartbeat_at,
            "silent": now - r.last_heartbeat_at > silent_after} for r in rows])

    async def _metrics(self, request: web.Request) -> web.Response:
        body = self.exporter.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _canary_api(self, request: web.Request) -> web.Response:
        """``GET /api/v1/canary``: the newest driver version against the rest (or ``null``)."""
        v = self.canary_verdict
        return web.json_response(None if v is None else {
            "attribute": v.attribute, "candidate": v.candidate, "verdict": v.verdict,
            "failures": list(v.failures), "gpu_hours": list(v.gpu_hours), "ratio": v.ratio,
            "lower": v.lower, "upper": v.upper, "p_value": v.p_value})

    async def _ready(self, request: web.Request) -> web.Response:
        return web.json_response({"leader": self.elector.is_leader_now(),
                                  "consumed": self.cursor})

    # --- the consumer and the leader's work ----------------------------------------

    def _apply(self, records: list[Any]) -> int:
        """Give consumed records to the pipeline; return how many changed something."""
        updates = finding_updates(records, now=time.time(),
                                  window_seconds=self.settings.analytics.event_window_seconds)
        if updates.cleared:
            self.pipeline.clear_findings(updates.cleared)
        for finding, hold in updates.held:
            self.pipeline.observe_findings([finding], hold_seconds=hold, replace_held=True)
        return updates.changed

    async def _consume(self, stop: asyncio.Event) -> None:
        c = self.settings.controller
        interval = c.consume_interval_seconds
        next_eval = 0.0
        next_silent = 0.0
        next_history = 0.0
        next_metrics = 0.0
        next_prune = time.monotonic() + 60.0
        pending = 0  # changes not evaluated yet
        history: asyncio.Future[Any] | None = None  # the history's sync under way
        while not stop.is_set():
            changed = 0
            started = time.monotonic()
            try:
                while True:
                    batch = await self._consumer_call(self.store.read_after, self.cursor)
                    if not batch:
                        break
                    changed += self._apply(batch)
                    self.cursor = batch[-1].seq
                now = time.monotonic()
                read = now - started
                if now >= next_silent:
                    next_silent = now + min(5.0, c.agent_silent_seconds / 2)
                    changed += await self._check_silent()
                if now >= next_prune and self.elector.is_leader_now():
                    next_prune = now + 3600.0
                    pruned = await self._db_call(self.store.prune,
                                                 time.time() - c.retention_seconds)
                    if pruned:
                        logger.info("controller: %d accepted records older than %.0f s "
                                    "deleted", pruned, c.retention_seconds)
                # A standby decides nothing: it evaluates on the interval (warm for a
                # take-over), not on every change, which cost a shared host half a core.
                pending += changed
                due = now >= next_eval or (pending > 0 and self.elector.is_leader_now())
                if due and pending:
                    self._correlate()
                if due:
                    next_eval = now + self.settings.analytics.evaluate_interval_seconds
                    pending = 0
                    await self.pipeline.aevaluate()
                evaluated = time.monotonic()
                await self.pipeline.atick()
                ticked = time.monotonic()
                if now >= next_metrics:  # a scrape reads the last figures
                    next_metrics = now + METRICS_REFRESH_SECONDS
                    self.remediation_metrics.refresh()
                if (self.recorder is not None and now >= next_history
                        and self.elector.is_leader_now()
                        and (history is None or history.done())):
                    # Beside the rounds, not in them: a new leader's first sync writes
                    # every incident (14,000 at 2,000 nodes) and held the round after
                    # the take-over, and the first cordon after a fail-over, for 2.5 s.
                    next_history = now + HISTORY_INTERVAL_SECONDS
                    history = asyncio.ensure_future(self._db_call(
                        self.recorder.sync, self.pipeline.actions, time.time()))
                    history.add_done_callback(_log_failure)
                done = time.monotonic()
                if done - started >= SLOW_ROUND_SECONDS:  # what a decision waited behind
                    logger.info("controller: a slow round: %.1f s (reading %.1f s, "
                                "evaluating %.1f s, remediation tick %.1f s, metrics %.1f s)",
                                done - started, read, evaluated - now, ticked - evaluated,
                                done - ticked)
            except TemporaryError as exc:
                self._store_failed_at = time.monotonic()
                logger.warning("controller: state store unavailable: %s", exc)
            except Exception:
                logger.exception("controller: consuming accepted records failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
        if history is not None:
            with contextlib.suppress(Exception):
                await history  # its thread finishes anyway; the executor waits for it

    async def _work_apart(self, stop: asyncio.Event) -> None:
        """Consume, decide, act and deliver on a thread of their own, until ``stop``.

        The agents' batches and the API are served on the caller's loop. The consumer's
        work waits on the state store (the engine's reads and writes are synchronous), so
        on one loop every batch waited behind a whole evaluation and remediation tick
        (``benchmarks/fleet_sim.py`` at 200 nodes and 100 events/s: acknowledgements p99
        4-7 s, time to cordon 6-20 s). The notifiers' HTTP clients live on the consumer's
        loop, which delivers the outbox (and, still the leader, once more at the end).
        """
        started = threading.Event()
        own: dict[str, Any] = {}

        async def body() -> None:
            own["loop"], own["stop"] = asyncio.get_running_loop(), asyncio.Event()
            started.set()
            deliverer = asyncio.create_task(self._deliver(own["stop"]))
            try:
                await self._consume(own["stop"])
            finally:
                deliverer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await deliverer
                # still the leader: deliver what is due before handing the shared outbox over
                await self.pipeline.deliver(force=True)

        def main() -> None:
            try:
                asyncio.run(body())
            except Exception:
                logger.exception("controller: the consumer stopped")
            finally:
                started.set()

        thread = threading.Thread(target=main, name="gpuhealth-consumer", daemon=True)
        thread.start()
        await asyncio.to_thread(started.wait)
        try:
            await stop.wait()
        finally:
            loop, consumer_stop = own.get("loop"), own.get("stop")
            if loop is not None and consumer_stop is not None:
                with contextlib.suppress(RuntimeError):  # its loop already ended
                    loop.call_soon_threadsafe(consumer_stop.set)
            await asyncio.to_thread(thread.join)

    async def _deliver(self, stop: asyncio.Event) -> None:
        """Deliver the notification outbox beside the consumer (only the leader sends).

        Woken by an evaluation that queued notifications, and at least every second for
        retries that come due; one delivery round at a time.
        """
        due = self.pipeline.notify_due
        while not stop.is_set():
            deadline = time.monotonic() + DELIVER_INTERVAL_SECONDS
            while not due.is_set() and not stop.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            due.clear()
            try:
                await self.pipeline.deliver()
            except Exception:
                logger.exception("controller: delivering notifications failed")

    def _correlate(self) -> None:
        """Many nodes under one switch or driver version: one fleet incident, the breaker.

        Runs before the evaluation that would decide the nodes' own steps, so the breaker
        holds them instead of N drains.
        """
        for event in self.correlator.update(self.pipeline.held_findings(), dict(self.facts),
                                            now=time.time()):
            logger.error("controller: fleet incident: %s", event.finding.summary)
            self.pipeline.observe_findings(
                [event.finding], hold_seconds=self.settings.controller.correlate_window_seconds)
            self.pipeline.trip_breaker(
                f"fleet incident: {event.finding.summary}", nodes=len(event.nodes))

    def _canary(self, rows: list[Any], now: float) -> None:
        """The newest driver version against the rest: a no-go is a fleet finding."""
        verdict, finding = self.canary.update(
            facts={r.node: dict(r.facts) for r in rows},
            gpus={r.node: len(r.gpus) for r in rows},
            first_seen={r.node: r.first_seen_at for r in rows},
            findings=self.pipeline.held_findings(), now=now)
        self.canary_verdict = verdict
        if finding is not None:
            if self._canary_said != finding.entity:
                logger.error("controller: %s", finding.summary)
                self._canary_said = finding.entity
            self.pipeline.observe_findings([finding], hold_seconds=600.0, replace_held=True)
        else:
            self._canary_said = ""

    async def _check_silent(self) -> int:
        rows = await self._db_call(self.store.agents)
        now = time.time()
        self._canary(rows, now)
        self.facts.update({r.node: dict(r.facts) for r in rows})
        # Heartbeats could not arrive while this replica (or the store) was away: nobody is
        # called silent until both have been up for a whole silence period.
        up = time.monotonic() - max(self._store_failed_at, self._started_at)
        change = self.silence.update(
            {r.node: r.last_heartbeat_at for r in rows}, now=now, store_back_since=up)
        self.exporter.set("gpuhealth_controller_agents", float(len(change.silent)),
                          {"state": "silent"})
        self.exporter.set("gpuhealth_controller_agents", float(len(rows) - len(change.silent)),
                          {"state": "reporting"})
        if change.back:
            self.pipeline.clear_findings(change.back)
        if change.gone:
            self.pipeline.observe_findings(change.gone, hold_seconds=10 * 365 * 86400.0)
        return len(change.back) + len(change.gone)

    # --- running ----------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve and consume until ``stop`` is set.

        Raises:
            OSError: The listener cannot be bound.
        """
        c = self.settings.controller
        context: ssl.SSLContext | None = None if self.tls is None else self.tls.context
        runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, c.listen_address, c.port, ssl_context=context)
        await site.start()
        self.port = int(runner.addresses[0][1]) if runner.addresses else c.port
        self.recorder = self._open_history()
        if self.recorder is not None and self.settings.report.enabled:
            self._report_scheduler = self._start_weekly_report()
        self.elector.start()
        logger.info("gpuhealth controller %s listening on %s://%s:%d (state %s, remediation %s)",
                    self.elector.identity, "https" if context else "http", c.listen_address,
                    self.port, _state_name(self.settings.fleet_state),
                    "dry-run" if self.settings.remediation.dry_run else "LIVE")
        self.ready.set()
        watcher = asyncio.create_task(self._watch_secrets(stop))
        try:
            await self._work_apart(stop)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await runner.cleanup()
            if self.recorder is not None:
                self.recorder.history.close()
            if self._report_scheduler is not None:
                self._report_scheduler.shutdown(wait=False)
            self.elector.stop()
            self.pipeline.close()
            self._db.shutdown(wait=True)
            self._consumer_db.shutdown(wait=True)
            self.store.close()
            if self.pg_password is not None:
                self.pg_password.close()

    def reload_secrets(self) -> None:
        """Re-read the TLS pair and the PostgreSQL password file if they changed.

        What cannot be read is logged (once per problem) and what was read before stays.
        """
        if self.tls is not None:
            self.tls.reload()
        if self.pg_password is not None:
            try:
                self.pg_password.refresh()
            except ConfigError as exc:
                if str(exc) != self._password_problem:
                    logger.error("controller: %s; new PostgreSQL connections keep the "  # noqa: TRY400
                                 "password read before", exc)
                self._password_problem = str(exc)
            else:
                self._password_problem = ""

    async def _watch_secrets(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.reload_secrets()
            except Exception:
                logger.exception("controller: checking the TLS and password files failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.secrets_check_seconds)


    def _history_target(self) -> str:
        """The shared PostgreSQL state, else this replica's history file."""
        state = self.settings.fleet_state
        return state if is_postgres(state) else str(self.settings.history_path)

    def _start_weekly_report(self) -> Any:
        """Schedule the weekly report on every replica; only the leader writes it."""
        from apscheduler.schedulers.background import BackgroundScheduler

        from gpuhealth.report_cli import schedule_weekly_report

        r = self.settings.report
        scheduler = BackgroundScheduler(timezone=r.timezone)
        schedule_weekly_report(
            scheduler, history_path=self._history_target(),
            folder=r.folder or self.settings.node.data_dir / "reports",
            webhook_url=r.webhook_url, weekday=r.weekday, at=r.time, timezone=r.timezone,
            spare_fraction=r.spare_fraction, formats=r.formats, link_base=r.link_base,
            only_if=self.elector.is_leader_now)
        scheduler.start()
        return scheduler

    def _open_history(self) -> HistoryRecorder | None:
        """The history the leader records: the shared PostgreSQL state, else the file.

        One that cannot be opened is logged; the controller runs on without it.
        """
        target = self._history_target()
        try:
            return HistoryRecorder(IncidentHistory(target))
        except Exception as exc:  # an unreadable file, an unreachable server
            logger.error("controller: no incident history (the weekly report will miss "  # noqa: TRY400
                         "this run): %s: %s", _state_name(target), exc)
            return None


def _state_name(target: str) -> str:
    """The state store for logs: a server's host, port and database, never a password."""
    return server_of(target) if is_postgres(target) else target


def run_controller(settings: Settings, *, stop: threading.Event | None = None) -> int:
    """Run one controller replica until SIGTERM/SIGINT or ``stop``.

    Returns:
        0 after a clean stop; 78 for a configuration error; 1 when start-up failed.
    """
    from gpuhealth.service import EXIT_CONFIG, _signals

    stop = stop or threading.Event()
    try:
        settings.node.data_dir.mkdir(parents=True, exist_ok=True)
        controller = Controller(settings)
    except ConfigError as exc:
        logger.error("gpuhealth controller cannot start: %s", exc)  # noqa: TRY400
        return EXIT_CONFIG
    except (OSError, TemporaryError) as exc:
        logger.error("gpuhealth controller cannot start: %s", exc)  # noqa: TRY400
        return 1

    async def main() -> None:
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (stop.wait(), loop.call_soon_threadsafe(done.set)),
                         daemon=True).start()
        await controller.serve(done)

    with _signals(stop):
        try:
            asyncio.run(main())
        except ConfigError as exc:
            logger.error("gpuhealth controller cannot start: %s", exc)  # noqa: TRY400
            return EXIT_CONFIG
        except OSError as exc:
            c = settings.controller
            logger.error("gpuhealth controller cannot listen on %s:%d: %s",  # noqa: TRY400
                         c.listen_address, c.port, exc)
            return 1
    logger.info("gpuhealth controller stopped")
    return 0


def _log_failure(future: asyncio.Future[Any]) -> None:
    """Log what a background call raised (the history's sync logs its own write errors)."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        logger.warning("controller: writing the history failed: %s", exc)
