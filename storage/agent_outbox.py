"""The agent's durable, bounded outbox to its controller, and the sender that drains it.

Everything the controller needs from a node (findings and their clearing, GPU
inventory) is put here first, each record with an idempotency key made once, when it
is put (``<node>:<random hex>``), and kept in one SQLite file (WAL, ``synchronous =
FULL``) until a controller has acknowledged it. So a record survives an agent restart,
a ``kill -9``, a controller outage of any length up to the bound and a controller
fail-over; a record sent twice (the answer was lost) carries the same key and the
controller stores it once (at-least-once delivery, exactly-once effect).

Bound: ``max_records``; beyond it the oldest records are dropped, counted
(:attr:`AgentOutbox.dropped`) and logged once per outage, never the newest.

Wire format (``POST <controller>/api/v1/agents/<node>/batch``, JSON,
``Authorization: Bearer <agent token>``)::

    {"node": "gpu-02", "agent_version": "0.1.0", "sent_at": 1764600000.5,
     "heartbeat": {"at": 1764600000.5, "gpus": [{"entity": "GPU-..."}],
                   "facts": {"switch": "leaf-12", "rack": "r07"}},
     "records": [{"key": "gpu-02:5f1c...", "kind": "finding", "at": 1764600000.1,
                  "body": {<finding JSON, docs/fault-model.md>}}]}

``sent_at`` is the agent's wall clock (epoch seconds) when this try left, stamped again
for each replica tried: the controller compares it with its own clock on receipt
(``gpuhealth_agent_clock_skew_seconds{node}``, :class:`storage.fleet.ClockSkewWatch`);
it is optional there (older agents send none). Record ``at`` and ``heartbeat.at`` are
the agent's clock too; the controller stamps the heartbeat with its own.

The controller answers 200 ``{"accepted": n, "duplicates": m}`` only after the records
are written to its state store; 401 for a missing or wrong token, 403 for a batch about
another node, 400 for a malformed batch (the body names the key), 5xx or no answer when
it cannot write. :class:`OutboxSender` tries the controllers in turn (every replica
accepts; agents need no leader discovery) and acknowledges only on 200.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from core.codec import finding_to_json
from core.records import Finding
from storage.fleet import AGENT_RECORD_KINDS

logger = logging.getLogger(__name__)

RECORD_KINDS = AGENT_RECORD_KINDS
"""What an agent puts in its outbox (the controller's list); heartbeats ride on every batch."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    at REAL NOT NULL,
    body TEXT NOT NULL
);
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxRecord:
    """One record waiting for the controller.

    Attributes:
        id: Row id (order of :meth:`AgentOutbox.put`).
        key: Idempotency key, unique across the fleet (``<node>:<hex>``).
        kind: One of :data:`RECORD_KINDS`.
        at: When it was made, epoch seconds.
        body: The JSON object sent.
    """

    id: int
    key: str
    kind: str
    at: float
    body: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The record as it goes on the wire."""
        return {"key": self.key, "kind": self.kind, "at": self.at, "body": dict(self.body)}


class AgentOutbox:
    """The durable, bounded queue of records for the controller (module docstring).

    Args:
        path: The SQLite file (its folder is created), or ``None`` for memory (tests).
        node: This node's name, the prefix of every key.
        max_records: Records kept while the controller is away, >= 1.

    Raises:
        ValueError: ``max_records`` < 1 or an empty ``node``.
        sqlite3.DatabaseError: The file is not an outbox.
    """

    def __init__(self, path: str | Path | None, *, node: str,
                 max_records: int = 100_000) -> None:
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records!r}")
        if not node:
            raise ValueError("node must not be empty")
        self.node = node
        self.max_records = max_records
        self.dropped = 0
        self._warned = False
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:" if path is None else str(path), timeout=30.0,
                                   isolation_level=None, check_same_thread=False)
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def put(self, kind: str, body: Mapping[str, Any], *, at: float) -> str:
        """Queue one record; return its idempotency key.

        Raises:
            ValueError: ``kind`` is not one of :data:`RECORD_KINDS`.
            sqlite3.Error: The file cannot be written (a full disk): nothing was queued.
        """
        if kind not in RECORD_KINDS:
            raise ValueError(f"unknown outbox record kind {kind!r}")
        key = f"{self.node}:{uuid.uuid4().hex}"
        text = json.dumps(dict(body), sort_keys=True, separators=(",", ":"))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT INTO outbox (key, kind, at, body) VALUES (?,?,?,?)",
                                 (key, kind, at, text))
                over = self._count() - self.max_records
                if over > 0:
                    self._db.execute("DELETE FROM outbox WHERE id IN "
                                     "(SELECT id FROM outbox ORDER BY id LIMIT ?)", (over,))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLite ends it itself on a full disk
                    self._db.execute("ROLLBACK")
                raise
        if over > 0:
            self.dropped += over
            if not self._warned:
                self._warned = True
                logger.warning("agent outbox full (%d records): dropping the oldest until "
                               "a controller answers", self.max_records)
        return key

    def _count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])

    def __len__(self) -> int:
        with self._lock:
            return self._count()

    def peek(self, limit: int) -> list[OutboxRecord]:
        """Return up to ``limit`` of the oldest records, oldest first (they stay queued)."""
        with self._lock:
            rows = self._db.execute("SELECT id, key, kind, at, body FROM outbox ORDER BY id "
                                    "LIMIT ?", (limit,)).fetchall()
        return [OutboxRecord(id=int(r[0]), key=str(r[1]), kind=str(r[2]), at=float(r[3]),
                             body=json.loads(r[4])) for r in rows]

    def ack(self, ids: Sequence[int]) -> None:
        """Remove acknowledged records."""
        if not ids:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])
                self._db.execute("COMMIT")
            except BaseException:  # a full disk: the records stay, sent again (same keys)
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            if not self._count():
                self._warned = False

    def close(self) -> None:
        """Close the file (what is queued stays for the next start)."""
        with self._lock:
            self._db.close()


class FindingForwarder:
    """Turn each evaluation's findings into outbox records: new or changed, and cleared.

    A finding is sent when it first appears and again whenever its severity,
    occurrences, last time or evidence change; when it is gone from an evaluation a
    ``finding_cleared`` record (its key) follows. Findings are only forwarded for this
    node's own entities' node (an agent reports only for itself).

    Args:
        outbox: Where the records go.
        node: This node.
    """

    def __init__(self, outbox: AgentOutbox, *, node: str) -> None:
        self.outbox = outbox
        self.node = node
        self._sent: dict[tuple[str, str, str, str], tuple[Any, ...]] = {}

    def observe(self, findings: Sequence[Finding], *, now: float) -> int:
        """Queue what changed since the last call; return the records queued."""
        queued = 0
        current: dict[tuple[str, str, str, str], Finding] = {}
        for f in findings:
            if f.node != self.node:
                continue
            current[f.key] = f
        for key, f in current.items():
            stamp = (f.severity, f.occurrences, f.last_seen_at, f.summary, len(f.evidence))
            if self._sent.get(key) != stamp:
                self.outbox.put("finding", finding_to_json(f), at=now)
                self._sent[key] = stamp
                queued += 1
        for key in [k for k in self._sent if k not in current]:
            node, entity, kind, code = key
            self.outbox.put("finding_cleared", {"node": node, "entity": entity, "kind": kind,
                                                "code": code}, at=now)
            del self._sent[key]
            queued += 1
        return queued


@dataclass(slots=True)
class SendResult:
    """What one :meth:`OutboxSender.send_once` did.

    Attributes:
        sent: Records acknowledged.
        duplicates: Of those, records the controller had already.
        controller: URL that answered 200, else ``None``.
        error: Why no controller took the batch, else ``""``.
    """

    sent: int = 0
    duplicates: int = 0
    controller: str | None = None
    error: str = ""
    refused: bool = False
    statuses: dict[str, int] = field(default_factory=dict)


class OutboxSender:
    """Send the outbox in batches to the first controller replica that takes them.

    Args:
        outbox: The queue.
        controllers: Base URLs of the controller replicas (``https://ctl-a:9837``).
        token: This agent's bearer token, or what returns it before each batch (a token
            file re-read when it changes).
        version: The agent's version, in every batch.
        inventory: Returns this node's GPUs (``[{"entity": ...}]``).
        facts: This node's ``[inventory]`` facts, in every heartbeat (the controller
            groups failing nodes by them: ``switch``, ``rack``, ``driver_version``).
        batch_max_records: Records per request.
        timeout_seconds: Connect and read timeout per request.
        verify: TLS verification: ``True``, a CA bundle path, or ``False`` (tests only).
        clock: Epoch seconds.
        transport: httpx transport (tests); the network by default.

    Raises:
        ValueError: No controller URL, or one that is not http(s).
    """

    def __init__(self, outbox: AgentOutbox, *, controllers: Sequence[str],
                 token: str | Callable[[], str],
                 version: str, inventory: Callable[[], list[dict[str, str]]] = list,
                 facts: Mapping[str, str] | None = None,
                 batch_max_records: int = 500, timeout_seconds: float = 10.0,
                 verify: bool | str = True, clock: Callable[[], float] = time.time,
                 transport: httpx.BaseTransport | None = None) -> None:
        urls = [u.rstrip("/") for u in controllers]
        if not urls:
            raise ValueError("no controller URL ([agent] controllers)")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"[agent] controllers: {url!r} is not an http(s) URL")
        self.outbox = outbox
        self.controllers = urls
        self.version = version
        self.inventory = inventory
        self.facts = dict(facts or {})
        self.batch_max_records = batch_max_records
        self.clock = clock
        self._token = token
        self._next = 0
        self.sent_total = 0
        """Records a controller acknowledged since start."""
        self.up: bool | None = None
        """Whether a controller answered the last batch (``None`` before the first)."""
        self.refused_total = 0
        """Records a controller refused for their content, each alone, and set aside."""
        self._careful_until = 0
        context: bool | ssl.SSLContext = (
            ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify)
        self._client = httpx.Client(timeout=timeout_seconds, verify=context, transport=transport)

    def send_once(self) -> SendResult:
        """Send one batch (with the heartbeat, even when nothing is queued).

        Returns:
            What was acknowledged, or why nothing was (every controller tried once).
        """
        head = self.outbox.peek(1)
        careful = bool(head) and head[0].id <= self._careful_until
        records = head if careful else self.outbox.peek(self.batch_max_records)
        now = self.clock()
        payload = {
            "node": self.outbox.node, "agent_version": self.version, "sent_at": now,
            "heartbeat": {"at": now, "gpus": self.inventory(), "facts": self.facts},
            "records": [r.to_json() for r in records],
        }
        body = json.dumps(payload, separators=(",", ":")).encode()
        token = self._token() if callable(self._token) else self._token
        headers = {"Authorization": f"Bearer {token}",
                   "Content-Type": "application/json"}
        result = SendResult()
        errors: list[str] = []
        for attempt in range(len(self.controllers)):
            url = self.controllers[(self._next + attempt) % len(self.controllers)]
            target = f"{url}/api/v1/agents/{self.outbox.node}/batch"
            if attempt:  # the try before may have waited a whole timeout: stamp anew
                payload["sent_at"] = self.clock()
                body = json.dumps(payload, separators=(",", ":")).encode()
            try:
                answer = self._client.post(target, content=body, headers=headers)
            except httpx.HTTPError as exc:
                errors.append(f"{target}: {type(exc).__name__}: {exc}")
                result.error = "; ".join(errors)
                continue
            result.statuses[url] = answer.status_code
            self.up = True  # a controller answered, whatever it said
            if answer.status_code == 200:
                self._next = (self._next + attempt) % len(self.controllers)
                try:
                    duplicates = int(answer.json().get("duplicates", 0))
                except (ValueError, AttributeError):
                    duplicates = 0
                self.outbox.ack([r.id for r in records])
                result.sent, result.duplicates, result.controller = (
                    len(records), duplicates, url)
                result.error = ""
                self.sent_total += len(records)
                self.up = True
                return result
            errors.append(f"{target}: HTTP {answer.status_code}: {answer.text[:200]}")
            result.error = "; ".join(errors)
            if answer.status_code in (400, 422) and records:
                # The content is refused, and would be by every replica: find the record
                # one at a time, and set aside only the one refused on its own.
                result.refused = True
                if len(records) > 1:
                    self._careful_until = records[-1].id
                else:
                    self.outbox.ack([records[0].id])
                    self.refused_total += 1
                    logger.error("agent: the controller refused record %s (%s) for good; "
                                 "dropped it, the next records go on: %s", records[0].key,
                                 records[0].kind, answer.text[:300])
                return result
            if answer.status_code in (401, 403):
                result.refused = True  # the token: every replica would say the same
                return result
        if not result.statuses:
            self.up = False
        return result

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()


class AgentLinkCollector:
    """The agent link's Prometheus metrics, read from the outbox and the sender at each scrape.

    ``gpuhealth_agent_outbox_depth``, ``gpuhealth_agent_outbox_dropped_total``,
    ``gpuhealth_agent_records_sent_total``, ``gpuhealth_agent_records_refused_total``
    (records a controller refused for their content, set aside one by one) and
    ``gpuhealth_agent_controller_up`` (1 when a controller answered the last batch).
    """

    def __init__(self, outbox: AgentOutbox, sender: OutboxSender) -> None:
        self.outbox = outbox
        self.sender = sender

    def describe(self) -> list[Any]:
        """Nothing up front (the registry then calls :meth:`collect` on every scrape)."""
        return []

    def collect(self) -> Any:
        """Yield the five families."""
        from core.exposition import family

        yield family("gpuhealth_agent_outbox_depth", [({}, len(self.outbox))])
        yield family("gpuhealth_agent_outbox_dropped_total", [({}, self.outbox.dropped)])
        yield family("gpuhealth_agent_records_sent_total", [({}, self.sender.sent_total)])
        yield family("gpuhealth_agent_controller_up", [({}, 1.0 if self.sender.up else 0.0)])
        yield family("gpuhealth_agent_records_refused_total", [({}, self.sender.refused_total)])
