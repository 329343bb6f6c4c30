"""``gpuhealth agent``: the link from one GPU node to its controllers.

The agent is :class:`gpuhealth.service.Service` in the ``agent`` role: collectors,
parsers, node-local fault rules, online detectors and the failure predictor run as in
``run``; samples go to the configured store through the spool and on ``/metrics``.
:class:`AgentLink` adds what makes it part of a fleet: each evaluation's findings go
into the durable outbox (:class:`storage.agent_outbox.FindingForwarder`), and a sender
thread posts the outbox with a heartbeat to the first controller replica that answers.

While no controller answers the agent keeps collecting, judging, detecting and
queueing (up to ``[agent] outbox_max_records``); the sender retries with a backoff
from ``send_interval_seconds`` doubling to :data:`MAX_BACKOFF_SECONDS`, logs the outage
once and the recovery once, and ``gpuhealth_agent_controller_up`` says which holds.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence

from collectors.drill_inbox import INBOX, DrillInbox
from core.errors import ConfigError
from core.records import Finding
from gpuhealth import __version__
from gpuhealth.config import Settings, agent_token
from gpuhealth.metrics import MetricsExporter
from gpuhealth.tokens import TokenFile
from storage.agent_outbox import AgentLinkCollector, AgentOutbox, FindingForwarder, OutboxSender

logger = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per batch is noise

MAX_BACKOFF_SECONDS = 30.0
"""Longest pause between two tries while no controller answers."""

ANSWERED_BACKOFF_SECONDS = 5.0
"""Longest pause while a controller answers but cannot take the batch (503, a token)."""


DRILL_INBOX = "drill_inbox"
"""The collector name of the agent's drill inbox (:mod:`collectors.drill_inbox`)."""


def drill_inbox(settings: Settings) -> DrillInbox:
    """The agent's drill inbox, ``<data_dir>/drill-inbox`` (``gpuhealth drill --fleet``).

    Polled like a collector (every second): each marked kernel-log line dropped there is
    read by the real kernel-log parser and handled as a real fault, labelled a drill.
    """
    return DrillInbox(node=settings.node.name, folder=settings.node.data_dir / INBOX)


class AgentLink:
    """The outbox, the forwarder and the sender thread of one agent.

    Use :meth:`start`. Thread-safe: :meth:`forward` is called from the service's writer
    thread, the sender runs in its own.
    """

    def __init__(self, *, outbox: AgentOutbox, sender: OutboxSender, exporter: MetricsExporter,
                 stop: threading.Event, interval_seconds: float,
                 heartbeat_seconds: float) -> None:
        self.outbox = outbox
        self.sender = sender
        self.forwarder = FindingForwarder(outbox, node=outbox.node)
        self.exporter = exporter
        self.stop = stop
        self.interval_seconds = interval_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.wake = threading.Event()
        self.up: bool | None = None
        self.unreachable_since: float | None = None
        """Since when no controller took a batch (epoch seconds); ``None`` while one does."""
        self._queue_problem = ""
        self._ack_failed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="gpuhealth-agent-link",
                                        daemon=True)

    @classmethod
    def start(cls, settings: Settings, *, exporter: MetricsExporter, stop: threading.Event,
              inventory: Callable[[], list[dict[str, str]]]) -> AgentLink:
        """Open the outbox in the data folder and start sending.

        Raises:
            ConfigError: No ``[agent] controllers`` or no token (names the key).
        """
        a = settings.agent
        if not a.controllers:
            raise ConfigError(f"{settings.source}: [agent] controllers: the agent needs the "
                              "URL of at least one controller replica")
        try:
            token = agent_token(settings)
        except OSError as exc:
            raise ConfigError(f"{settings.source}: [agent] token_file: {a.token_file}: "
                              f"{exc.strerror}") from exc
        if not token:
            if a.token_env:
                why = f"token_env: environment variable {a.token_env!r} is not set"
            elif a.token_file:
                why = f"token_file: {a.token_file} is empty"
            else:
                why = "token_env or token_file: set one (the controller refuses agents without)"
            raise ConfigError(f"{settings.source}: [agent] {why}")
        source: str | Callable[[], str] = token
        if a.token_file is not None:  # re-read at each batch when it changes (a rotation)
            source = TokenFile(a.token_file)
        outbox = AgentOutbox(settings.node.data_dir / "agent-outbox.sqlite",
                             node=settings.node.name, max_records=a.outbox_max_records)
        try:
            sender = OutboxSender(outbox, controllers=a.controllers, token=source,
                                  version=__version__, inventory=inventory,
                                  facts=settings.inventory,
                                  batch_max_records=a.batch_max_records,
                                  timeout_seconds=a.timeout_seconds,
                                  verify=str(a.ca_file) if a.ca_file else True)
        except ValueError as exc:
            outbox.close()
            raise ConfigError(f"{settings.source}: {exc}") from exc
        link = cls(outbox=outbox, sender=sender, exporter=exporter, stop=stop,
                   interval_seconds=a.send_interval_seconds,
                   heartbeat_seconds=a.heartbeat_interval_seconds)
        exporter.register(AgentLinkCollector(outbox, sender))
        link._thread.start()
        logger.info("agent %s reports to %s (outbox %d records)", outbox.node,
                    ", ".join(a.controllers), len(outbox))
        return link

    def forward(self, findings: Sequence[Finding]) -> None:
        """Queue what changed in this evaluation's findings; wake the sender."""
        try:
            with self._lock:
                queued = self.forwarder.observe(findings, now=time.time())
        except Exception as exc:  # a full disk: the next evaluation tries again
            if str(exc) != self._queue_problem:  # once per problem, not per evaluation
                self._queue_problem = str(exc)
                logger.error("agent outbox: cannot queue findings: %s", exc)  # noqa: TRY400
            return
        if self._queue_problem:
            self._queue_problem = ""
            logger.warning("agent outbox: findings are queued again")
        if queued:
            self.wake.set()

    def _loop(self) -> None:
        delay = self.interval_seconds
        last_sent = 0.0
        shown: bool | None = None
        while not self.stop.is_set():
            due = len(self.outbox) > 0 or time.monotonic() - last_sent >= self.heartbeat_seconds
            if due:
                try:
                    result = self.sender.send_once()
                except (sqlite3.Error, OSError) as exc:  # a full disk: the acks; retry later
                    if not self._ack_failed:
                        logger.error("agent outbox: cannot record what the controller "  # noqa: TRY400
                                     "took (sent again later, same keys): %s", exc)
                    self._ack_failed = True
                    self.stop.wait(delay)
                    continue
                self._ack_failed = False
                if result.controller is not None:
                    last_sent = time.monotonic()
                    delay = self.interval_seconds
                    if self.up is False:
                        logger.warning("agent: controller %s answers again; %d records "
                                       "delivered, %d still queued", result.controller,
                                       result.sent, len(self.outbox))
                    self.up = True
                    self.unreachable_since = None
                    if len(self.outbox):
                        continue  # more queued: the next batch at once
                elif result.refused and not any(c in (401, 403)
                                                for c in result.statuses.values()):
                    continue  # a record's content was refused: the next try isolates it
                else:
                    if self.up is not False:
                        logger.error("agent: no controller took the batch (%s); collecting "
                                     "and queueing until one does", result.error)
                    self.up = False
                    if self.unreachable_since is None:
                        self.unreachable_since = time.time()
                    # A controller that answers (503: its database is away) is retried
                    # sooner than one that does not answer at all.
                    cap = ANSWERED_BACKOFF_SECONDS if result.statuses else MAX_BACKOFF_SECONDS
                    delay = min(cap, max(self.interval_seconds, delay * 2))
            if self.up is not shown:  # up or down shows at once; depths at the next collection
                shown = self.up
                self.exporter.render()
            if self.up is False:
                # New records do not cut the backoff short (a failing node queues a record
                # per evaluation: it would retry at each one); only a stop does.
                self.stop.wait(delay)
            else:  # idle: forward() wakes this thread for new records; else the heartbeat
                self.wake.wait(max(self.interval_seconds,
                                   self.heartbeat_seconds - (time.monotonic() - last_sent)))
            self.wake.clear()

    def close(self) -> None:
        """Stop the sender after one last try; keep the outbox file for the next start."""
        self.stop.set()
        self.wake.set()
        self._thread.join(timeout=15.0)
        if len(self.outbox):
            result = self.sender.send_once()
            if result.controller is None:
                logger.warning("agent: %d records stay queued for the next start",
                               len(self.outbox))
        self.sender.close()
        self.outbox.close()
