"""The fleet state store: agents' accepted records and the agent registry.

Every controller replica writes here what agents send (:meth:`FleetStore.accept`) and
acknowledges only after the transaction committed; every replica reads the accepted
records back in order (:meth:`FleetStore.read_after`) into its pipeline. One
:class:`FleetStore` over a :mod:`storage.sql` database, one behaviour on both engines
(the conformance suite runs both):

- PostgreSQL (a controller pair; a small *fixed* connection pool, never a connection
  per node). The schema is the shared ``storage/migrations/postgres``, applied once,
  under an advisory lock, by the first replica that starts.
- SQLite, one file (WAL) for a single controller (``run``-sized sites, tests); the
  schema is ``storage/migrations/sqlite/NNNN_fleet*.sql``.

**Order.** ``seq`` is handed out when a row is inserted, not when its transaction
commits. Were two accepting transactions to overlap, the one with the higher ``seq``
could commit first, a reader following ``seq > cursor`` would move its cursor past
the lower ``seq`` and never see that record once it committed. So :meth:`accept` takes
``pg_advisory_xact_lock(ACCEPT_LOCK_KEY)`` on PostgreSQL before inserting: accepting
transactions run one at a time and commit in ``seq`` order (a rolled-back one leaves
only a gap). SQLite's single writer (``BEGIN IMMEDIATE``) gives the same order.

**Idempotency.** A record whose key was accepted before is counted as a duplicate and
not stored again (``INSERT ... ON CONFLICT (key) DO NOTHING``): an agent that resends a
batch whose answer it lost is counted once. :meth:`FleetStore.prune` bounds the growth
(and forgets the keys of what it deletes: keep ``older_than`` well beyond how long an
agent may resend).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.codec import CodecError, finding_from_json
from core.errors import TemporaryError
from core.records import Finding
from storage.sql import (
    Database,
    PostgresDatabase,
    SqliteDatabase,
    is_postgres,
)

__all__ = [
    "ACCEPT_LOCK_KEY",
    "FLEET_RECORD_KINDS",
    "AcceptResult",
    "AgentRow",
    "ClockSkewWatch",
    "FleetRecord",
    "FleetStore",
    "PostgresFleetStore",
    "SqliteFleetStore",
    "StoredFleetRecord",
    "is_postgres",
    "open_fleet_store",
]

logger = logging.getLogger(__name__)

COMPONENT = "fleet"
"""The schema component (``storage/migrations/sqlite/NNNN_fleet*.sql``)."""

FLEET_RECORD_KINDS = frozenset(
    {"finding", "finding_cleared", "anomaly", "prediction", "inventory", "heartbeat"})
"""The kinds of :class:`FleetRecord`."""

ACCEPT_LOCK_KEY = 0x67707568_6661  # "gpuh" "fa": the accept order lock
"""``pg_advisory_xact_lock`` key that orders the accepting transactions."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentBatch:
    """One agent's batch for :meth:`FleetStore.accept_batches`.

    Attributes:
        node: The authenticated agent's node.
        records: Its records, in its order.
        heartbeat_at: When its registry row is refreshed (epoch seconds), or ``None``
            for no heartbeat.
        version: The agent's version (with a heartbeat).
        gpus: Its GPUs (``[{"entity": ...}]``).
        facts: Its ``[inventory]`` facts.
    """

    node: str
    records: Sequence[FleetRecord]
    heartbeat_at: float | None = None
    version: str = ""
    gpus: Sequence[Mapping[str, str]] = ()
    facts: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetRecord:
    """One record an agent sent.

    Attributes:
        key: The agent's idempotency key, unique across the fleet (``<node>:<hex>``).
        node: The node it is about (the authenticated agent's own).
        kind: One of :data:`FLEET_RECORD_KINDS`.
        at: When the agent made it, epoch seconds.
        body: Its JSON object (JSON-able values only).

    Raises:
        ValueError: An empty ``key`` or an unknown ``kind``.
    """

    key: str
    node: str
    kind: str
    at: float
    body: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("a fleet record needs a key")
        if self.kind not in FLEET_RECORD_KINDS:
            raise ValueError(f"kind must be one of {sorted(FLEET_RECORD_KINDS)}, "
                             f"got {self.kind!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredFleetRecord:
    """One accepted record, with its place in the accepted order (``seq`` from 1)."""

    seq: int
    key: str
    node: str
    kind: str
    at: float
    body: Mapping[str, Any]
    accepted_at: float


@dataclass(frozen=True, slots=True)
class AcceptResult:
    """What one :meth:`FleetStore.accept` stored: new records and duplicates."""

    accepted: int
    duplicates: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentRow:
    """One agent of the registry.

    Attributes:
        node: The node.
        version: The agent's version at its last heartbeat.
        gpus: Its GPUs (``[{"entity": ...}]``) at its last heartbeat.
        facts: Its ``[inventory]`` facts (``switch``, ``rack``, ``driver_version``), which
            fleet correlation groups nodes by.
        first_seen_at: First heartbeat, epoch seconds.
        last_heartbeat_at: Last heartbeat, epoch seconds.
    """

    node: str
    version: str
    gpus: Sequence[Mapping[str, str]] = field(default_factory=tuple)
    facts: Mapping[str, str] = field(default_factory=dict)
    first_seen_at: float = 0.0
    last_heartbeat_at: float = 0.0


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _stored(row: Sequence[Any]) -> StoredFleetRecord:
    body = row[5]
    return StoredFleetRecord(seq=int(row[0]), key=str(row[1]), node=str(row[2]),
                             kind=str(row[3]), at=float(row[4]),
                             body=json.loads(body) if isinstance(body, str) else dict(body),
                             accepted_at=float(row[6]))


def _agent(row: Sequence[Any]) -> AgentRow:
    gpus, facts = row[2], row[5]
    return AgentRow(node=str(row[0]), version=str(row[1]),
                    gpus=tuple(json.loads(gpus) if isinstance(gpus, str) else gpus),
                    facts=dict(json.loads(facts) if isinstance(facts, str) else facts),
                    first_seen_at=float(row[3]), last_heartbeat_at=float(row[4]))


_SELECT = "SELECT seq, key, node, kind, at, body, accepted_at FROM fleet_records"
# One text per statement for both backends, with ``?`` placeholders (``%s`` for psycopg).
_INSERT_RECORD = ("INSERT INTO fleet_records (key, node, kind, at, body, accepted_at) "
                  "VALUES (?,?,?,?,?,?) ON CONFLICT (key) DO NOTHING")
_READ_AFTER = f"{_SELECT} WHERE seq > ? ORDER BY seq LIMIT ?"
_HEARTBEAT = ("INSERT INTO fleet_agents (node, version, gpus, facts, first_seen_at, "
              "last_heartbeat_at) VALUES (?,?,?,?,?,?) ON CONFLICT (node) DO UPDATE SET "
              "version = excluded.version, gpus = excluded.gpus, facts = excluded.facts, "
              "last_heartbeat_at = excluded.last_heartbeat_at")
_AGENTS = ("SELECT node, version, gpus, first_seen_at, last_heartbeat_at, facts "
           "FROM fleet_agents ORDER BY node")
_PRUNE = "DELETE FROM fleet_records WHERE at < ?"


class FleetStore:
    """The fleet state store (module docstring) on a :mod:`storage.sql` database.

    Args:
        db: The database; migrated at construction. :meth:`close` closes it.
        clock: Epoch seconds for ``accepted_at`` (default :func:`time.time`).

    Raises:
        TemporaryError: The PostgreSQL server cannot be reached.
        sqlite3.DatabaseError: The SQLite file is not a fleet store.
    """

    def __init__(self, db: Database, *, clock: Callable[[], float] | None = None) -> None:
        self.db = db
        self.clock = clock or time.time
        try:
            db.migrate(COMPONENT)
        except BaseException:
            db.close()
            raise

    def accept(self, node: str, records: Sequence[FleetRecord]) -> AcceptResult:
        """Store records in one transaction; records with accepted keys are counted only.

        Args:
            node: The authenticated agent's node, stored as each record's ``node``.
            records: The batch, in the agent's order (stored in that order).

        Returns:
            How many were stored and how many were duplicates (by key).

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached (nothing was stored;
                the agent resends).
            TypeError: A body is not JSON-able (nothing was stored).
        """
        if not records:
            return AcceptResult(0, 0)
        return self.accept_batches([AgentBatch(node=node, records=records)])[0]

    def accept_batches(self, batches: Sequence[AgentBatch]) -> list[AcceptResult]:
        """Store many agents' batches and heartbeats in one transaction (a group commit).

        What :meth:`accept` and :meth:`heartbeat` do for each batch, in order, with one
        ``BEGIN``, one accept-order lock and one ``COMMIT`` for all: at 10,000 agents a
        controller takes about 1,000 batches a second, and two transactions each (six
        round trips and the lock twice) were its ingest limit.

        Returns:
            Each batch's result, in the order given.

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached (nothing was stored;
                every agent resends).
            TypeError: A body is not JSON-able (nothing was stored).
        """
        if not batches:
            return []
        rows = [[(r.key, b.node, r.kind, r.at, _json(dict(r.body))) for r in b.records]
                for b in batches]
        beats = [(b.node, b.version, _json([dict(g) for g in b.gpus]), _json(dict(b.facts)),
                  b.heartbeat_at, b.heartbeat_at) for b in batches if b.heartbeat_at is not None]
        out: list[AcceptResult] = []
        with self.db.transaction(lock=ACCEPT_LOCK_KEY) as db:
            now = self.clock()
            for batch, part in zip(batches, rows, strict=True):
                accepted = db.executemany(_INSERT_RECORD, [(*row, now) for row in part])
                out.append(AcceptResult(accepted, len(batch.records) - accepted))
            db.executemany(_HEARTBEAT, beats)
        return out

    def read_after(self, seq: int, *, limit: int = 1000) -> list[StoredFleetRecord]:
        """Return up to ``limit`` accepted records with a ``seq`` above ``seq``, by ``seq``.

        Raises:
            ValueError: ``limit`` < 1.
            TemporaryError: The PostgreSQL server cannot be reached.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit!r}")
        return [_stored(r) for r in self.db.execute(_READ_AFTER, (seq, limit))]

    def heartbeat(self, node: str, *, version: str, gpus: Sequence[Mapping[str, str]],
                  at: float, facts: Mapping[str, str] | None = None) -> None:
        """Upsert the agent's registry row (``first_seen_at`` is kept from the first).

        Args:
            node: The agent's node.
            version: The agent's version.
            gpus: Its GPUs (``[{"entity": ...}]``).
            at: When, epoch seconds (``last_heartbeat_at``).
            facts: Its ``[inventory]`` facts; ``None`` stores ``{}``.

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached.
        """
        with self.db.transaction() as db:
            db.execute(_HEARTBEAT, (node, version, _json([dict(g) for g in gpus]),
                                    _json(dict(facts or {})), at, at))

    def agents(self) -> list[AgentRow]:
        """Return the registry, by node.

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached.
        """
        return [_agent(r) for r in self.db.execute(_AGENTS)]

    def prune(self, older_than: float) -> int:
        """Delete accepted records made (``at``) before ``older_than``; return how many.

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached.
        """
        with self.db.transaction() as db:
            return max(0, int(db.execute(_PRUNE, (older_than,)).rowcount))

    def close(self) -> None:
        """Close the database."""
        self.db.close()


class GroupCommit:
    """Agents' batches that arrive together are stored in one transaction (asyncio).

    One transaction runs at a time; the batches that arrive meanwhile wait and go into the
    next one, up to ``max_batches`` (no added wait when the store is idle). A batch the
    store refuses (its content, not the store being away) fails alone: the group is
    stored again one batch at a time.

    Args:
        write: Stores a group (:meth:`FleetStore.accept_batches` of the current store).
        run: Runs a blocking call off the event loop (``loop.run_in_executor``'s way).
        max_batches: Batches per transaction, >= 1.

    Raises:
        ValueError: ``max_batches`` < 1.
    """

    def __init__(self, write: Callable[[list[AgentBatch]], list[AcceptResult]],
                 run: Callable[[Callable[..., Any], Any], Awaitable[Any]], *,
                 max_batches: int = 256) -> None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches!r}")
        self.write = write
        self.run = run
        self.max_batches = max_batches
        self._waiting: list[tuple[AgentBatch, asyncio.Future[AcceptResult]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def accept(self, batch: AgentBatch) -> AcceptResult:
        """Store ``batch`` (with the others waiting); return its result once committed.

        Raises:
            TemporaryError: The store cannot be reached (nothing of the group was stored).
            Exception: What the store raised for this batch's content.
        """
        future: asyncio.Future[AcceptResult] = asyncio.get_running_loop().create_future()
        self._waiting.append((batch, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        return await future

    async def _write(self) -> None:
        while self._waiting:
            group = self._waiting[:self.max_batches]
            del self._waiting[:len(group)]
            try:
                results = await self.run(self.write, [b for b, _ in group])
            except TemporaryError as exc:
                for _, future in group:
                    _fail(future, exc)
            except Exception as exc:  # one batch's content: the others must not fail
                if len(group) == 1:
                    _fail(group[0][1], exc)
                    continue
                for batch, future in group:
                    try:
                        [one] = await self.run(self.write, [batch])
                    except Exception as alone:
                        _fail(future, alone)
                    else:
                        _settle(future, one)
            else:
                for (_, future), result in zip(group, results, strict=True):
                    _settle(future, result)


def _settle(future: asyncio.Future[AcceptResult], result: AcceptResult) -> None:
    if not future.done():  # else its request went away (the agent hung up)
        future.set_result(result)


def _fail(future: asyncio.Future[AcceptResult], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class SqliteFleetStore(FleetStore):
    """A :class:`FleetStore` in one SQLite file.

    Args:
        path: The file (its folder is created), or ``None`` for memory.
        clock: See :class:`FleetStore`.

    Raises:
        OSError: The folder cannot be created.
        sqlite3.DatabaseError: The file is not a fleet store.
    """

    def __init__(self, path: str | Path | None, *, clock: Callable[[], float] | None = None
                 ) -> None:
        super().__init__(SqliteDatabase(path), clock=clock)


class PostgresFleetStore(FleetStore):
    """A :class:`FleetStore` in PostgreSQL.

    Args:
        dsn: libpq connection string or URI (the password from ``PGPASSWORD`` or
            ``~/.pgpass``, never the configuration file).
        pool_size: Connections of this replica, fixed (min = max).
        timeout_seconds: Connect timeout and the wait for a free connection.
        clock: See :class:`FleetStore`.

    Raises:
        PluginError: psycopg or psycopg_pool is not installed.
        TemporaryError: The server cannot be reached at start.
    """

    def __init__(self, dsn: str, *, pool_size: int = 4, timeout_seconds: float = 10.0,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(PostgresDatabase(dsn, pool_size=pool_size,
                                          timeout_seconds=timeout_seconds), clock=clock)


def open_fleet_store(target: str | Path | None, *, pool_size: int = 4) -> FleetStore:
    """Open the fleet store at ``target`` (see :func:`storage.sql.open_database`).

    Args:
        target: A PostgreSQL DSN, a SQLite file, or ``None`` (SQLite in memory).
        pool_size: PostgreSQL connections, fixed.

    Raises:
        PluginError: PostgreSQL without the controller's extra.
        TemporaryError: The PostgreSQL server cannot be reached.
        OSError: The SQLite folder cannot be created.
    """
    if is_postgres(target):
        return PostgresFleetStore(str(target), pool_size=pool_size)
    return SqliteFleetStore(target)


# --- what an agent may send ------------------------------------------------------

MAX_BATCH_RECORDS = 5_000
"""Most records in one batch (400 beyond): agents send 500 by default."""

AGENT_RECORD_KINDS = frozenset({"finding", "finding_cleared", "inventory"})
"""Record kinds an agent may send."""

MIN_EPOCH, MAX_EPOCH = 946_684_800.0, 4_102_444_800.0
"""A record's ``at`` must lie in 2000-2100 (NaN, infinities and nonsense are refused)."""

MAX_GPUS = 256
"""Most GPU entries in one heartbeat."""

MAX_FACTS = 64
"""Most ``[inventory]`` facts in one heartbeat."""


class BatchError(ValueError):
    """A batch is refused; ``status`` is the HTTP status, the message names the key."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_batch(node: str, payload: Any) -> tuple[list[FleetRecord], dict[str, Any] | None]:
    """Check one agent batch and return its records and its heartbeat.

    Raises:
        BatchError: 400 for a malformed batch, 403 for a record about another node.
    """
    if not isinstance(payload, dict):
        raise BatchError(400, "the batch must be a JSON object")
    if not isinstance(payload.get("node"), str) or not payload["node"]:
        raise BatchError(400, "node: expected the agent's node name")
    if payload["node"] != node:
        raise BatchError(403, f"node: the batch is for {payload['node']!r}, sent as {node!r}")
    payload = without_nul(payload)
    raw = payload.get("records", [])
    if not isinstance(raw, list):
        raise BatchError(400, "records: expected a list")
    if len(raw) > MAX_BATCH_RECORDS:
        raise BatchError(400, f"records: {len(raw)} records, at most {MAX_BATCH_RECORDS}")
    records: list[FleetRecord] = []
    for i, item in enumerate(raw):
        where = f"records[{i}]"
        if not isinstance(item, dict):
            raise BatchError(400, f"{where}: expected an object")
        key, kind, at, body = item.get("key"), item.get("kind"), item.get("at"), item.get("body")
        if not isinstance(key, str) or not key.startswith(f"{node}:") or len(key) > 200:
            raise BatchError(400, f"{where}.key: expected '{node}:<id>', got {key!r}")
        if kind not in AGENT_RECORD_KINDS:
            raise BatchError(400, f"{where}.kind: unknown kind {kind!r}")
        if isinstance(at, bool) or not isinstance(at, int | float) or not (
                MIN_EPOCH <= at <= MAX_EPOCH):
            raise BatchError(400, f"{where}.at: expected epoch seconds (2000-2100), got {at!r}")
        if not isinstance(body, dict):
            raise BatchError(400, f"{where}.body: expected an object")
        if kind in ("finding", "finding_cleared"):
            if body.get("node") != node:
                raise BatchError(403, f"{where}.body.node: {body.get('node')!r} is not {node!r}")
            if kind == "finding":
                try:
                    finding_from_json(body, where=f"{where}.body")
                except CodecError as exc:
                    raise BatchError(400, str(exc)) from exc
        records.append(FleetRecord(key=key, node=node, kind=str(kind), at=float(at), body=body))
    heartbeat = payload.get("heartbeat")
    if heartbeat is not None:
        if not isinstance(heartbeat, dict):
            raise BatchError(400, "heartbeat: expected an object")
        gpus, facts = heartbeat.get("gpus", []), heartbeat.get("facts", {})
        if not isinstance(gpus, list) or len(gpus) > MAX_GPUS or not all(
                isinstance(g, dict) and len(json.dumps(g)) <= 1024 for g in gpus):
            raise BatchError(400, f"heartbeat.gpus: expected at most {MAX_GPUS} small objects")
        if not isinstance(facts, dict) or len(facts) > MAX_FACTS or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= 512
                for k, v in facts.items()):
            raise BatchError(400, f"heartbeat.facts: expected at most {MAX_FACTS} short "
                                  "string pairs")
    return records, heartbeat


CLOCK_SKEW_WARN_SECONDS = 60.0
"""Default ``|skew|`` beyond which an agent's clock is logged as off (``[controller]
agent_clock_skew_warn_seconds``), seconds."""


def batch_sent_at(payload: Mapping[str, Any]) -> float | None:
    """The agent's wall clock when it sent the batch (``sent_at``, epoch seconds), or ``None``.

    Optional: agents before ``sent_at`` send none. Any finite number is taken as it is,
    however far off (a clock in 1970 is what the skew must show); anything else is
    ignored, never a reason to refuse the batch (it is a diagnostic, not data).

    Examples:
        >>> batch_sent_at({"sent_at": 1764600000.5}), batch_sent_at({})
        (1764600000.5, None)
        >>> batch_sent_at({"sent_at": "soon"}), batch_sent_at({"sent_at": float("nan")})
        (None, None)
    """
    value = payload.get("sent_at")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    sent_at = float(value)
    return sent_at if sent_at - sent_at == 0.0 else None  # not inf or NaN


@dataclass(frozen=True, slots=True)
class SkewChange:
    """What one :meth:`ClockSkewWatch.observe` found.

    Attributes:
        skew: The agent's clock minus the controller's, seconds (> 0: the agent is ahead).
        off: The clock just went beyond the threshold (log it, once).
        back: It just came back within half the threshold.
    """

    skew: float
    off: bool = False
    back: bool = False


class ClockSkewWatch:
    """Each agent's clock against this controller's, from the ``sent_at`` of its batches.

    ``skew = sent_at - received_at`` (seconds; > 0: the agent's clock is ahead). It
    includes the batch's transit time (loopback: milliseconds; after a failed try at
    another replica the agent stamps the next try anew), so it reads slightly
    negative on a synchronised fleet. Nothing the controller decides depends on it:
    heartbeats are stamped with the controller's own clock (no false "agent silent"),
    records keep the agent's ``at``. It is exported as
    ``gpuhealth_agent_clock_skew_seconds{node}`` and a node beyond ``warn_seconds`` is
    logged once, until it is back within half of it (hysteresis: a clock near the
    threshold does not log at every batch).

    Args:
        warn_seconds: ``|skew|`` beyond which a node is logged, > 0.

    Raises:
        ValueError: ``warn_seconds`` <= 0.

    Examples:
        >>> watch = ClockSkewWatch(warn_seconds=60.0)
        >>> watch.observe("gpu-01", 1000.0, 400.0)  # 10 min ahead: logged
        SkewChange(skew=600.0, off=True, back=False)
        >>> watch.observe("gpu-01", 1000.0, 405.0).off  # still off: not again
        False
        >>> watch.observe("gpu-01", 1000.0, 960.0).back  # 40 s: not yet within 30 s
        False
        >>> watch.observe("gpu-01", 1000.0, 1000.5)
        SkewChange(skew=-0.5, off=False, back=True)
        >>> watch.observe("gpu-02", None, 1000.0) is None  # an older agent: no sent_at
        True
    """

    def __init__(self, *, warn_seconds: float = CLOCK_SKEW_WARN_SECONDS) -> None:
        if not warn_seconds > 0:
            raise ValueError(f"warn_seconds must be > 0, got {warn_seconds!r}")
        self.warn_seconds = warn_seconds
        self.skew: dict[str, float] = {}
        """Per node, the skew of its last batch that carried ``sent_at``, seconds."""
        self.off: set[str] = set()
        """Nodes beyond ``warn_seconds`` (logged, not yet back)."""

    def observe(self, node: str, sent_at: float | None, received_at: float) -> SkewChange | None:
        """Account for one batch; ``None`` when it carried no ``sent_at``.

        Args:
            node: The agent's node.
            sent_at: :func:`batch_sent_at` of the batch, the agent's epoch seconds.
            received_at: When this controller received it, its own epoch seconds.
        """
        if sent_at is None:
            return None
        skew = sent_at - received_at
        self.skew[node] = skew
        if abs(skew) > self.warn_seconds and node not in self.off:
            self.off.add(node)
            logger.warning("controller: the clock of %s's agent is %+.1f s off this "
                           "controller's (beyond %.0f s): its records' times are its own; "
                           "check NTP on the node", node, skew, self.warn_seconds)
            return SkewChange(skew, off=True)
        if node in self.off and abs(skew) <= self.warn_seconds / 2:
            self.off.discard(node)
            logger.info("controller: the clock of %s's agent is back within %.0f s "
                        "(%+.1f s)", node, self.warn_seconds / 2, skew)
            return SkewChange(skew, back=True)
        return SkewChange(skew)


def without_nul(value: Any) -> Any:
    """``value`` with every NUL character in its strings replaced by U+FFFD.

    A kernel log cut by a power loss is often NUL-padded, and PostgreSQL text cannot hold
    NUL (``psycopg.DataError``): the line is kept, readable, instead of refusing the batch.
    """
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class FindingUpdates:
    """The findings a run of accepted records opens and closes, in accepted order.

    Only the latest record of each finding counts (a finding cleared and seen again is
    open; one seen and cleared is closed), so applying :attr:`cleared` and then
    :attr:`held` gives what applying the records one by one would.

    Attributes:
        held: ``(finding, hold seconds)``: each stays open that long unless cleared (what
            is left of the event window since the agent made it).
        cleared: ``(node, entity, kind, code)`` of the findings the agents cleared.
        changed: How many records changed something.
    """

    held: list[tuple[Finding, float]]
    cleared: list[tuple[str, str, str, str]]
    changed: int


def finding_updates(records: Sequence[StoredFleetRecord], *, now: float,
                    window_seconds: float) -> FindingUpdates:
    """Read the ``finding`` and ``finding_cleared`` records among ``records``.

    A finding older than the event window is not opened again (it would be forgotten at
    once); one a newer version accepted but this one cannot read is skipped with a
    warning naming its key. Other kinds (heartbeats, inventory) are the registry's.

    Args:
        records: Accepted records, in ``seq`` order.
        now: Epoch seconds.
        window_seconds: The event window (``[analytics] event_window_seconds``), seconds.
    """
    last: dict[tuple[str, str, str, str], tuple[Finding, float] | None] = {}
    changed = 0
    for record in records:
        if record.kind == "finding":
            hold = record.at + window_seconds - now
            if hold <= 0:
                continue
            try:
                finding = finding_from_json(record.body)
            except CodecError as exc:  # accepted by an older or newer version: say so
                logger.warning("fleet record %s skipped: %s", record.key, exc)
                continue
            last.pop(finding.key, None)  # the latest record of a finding decides
            last[finding.key] = (finding, hold)
            changed += 1
        elif record.kind == "finding_cleared":
            b = record.body
            key = (str(b.get("node")), str(b.get("entity")), str(b.get("kind")),
                   str(b.get("code")))
            last.pop(key, None)
            last[key] = None
            changed += 1
    return FindingUpdates(held=[v for v in last.values() if v is not None],
                          cleared=[k for k, v in last.items() if v is None], changed=changed)
