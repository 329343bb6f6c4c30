"""The fleet state store: agents' accepted records and the agent registry.

Every controller replica writes here what agents send (``accept``) and acknowledges
only after the transaction committed; every replica reads the accepted records back in
order (``read_after``) into its pipeline. Two backends, one behaviour (the conformance
suite runs both):

- :class:`PostgresFleetStore`: PostgreSQL through a small *fixed* ``psycopg_pool``
  connection pool (never a connection per node). ``accept`` takes
  ``pg_advisory_xact_lock`` first, so transactions commit in ``seq`` order and a reader
  that follows ``seq > cursor`` never skips a record whose transaction committed late.
  The schema is versioned in ``storage/migrations/postgres`` and applied once, under an
  advisory lock, by the first replica that starts.
- :class:`SqliteFleetStore`: one SQLite file (WAL) for a single controller (``run``-sized
  sites, tests); SQLite's single writer gives the same order.

A record whose idempotency key was accepted before is counted as a duplicate and not
stored again: an agent that resends a batch whose answer it lost is counted once.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from core.errors import PluginError, TemporaryError
from storage.sql import is_postgres, migrate_postgres, migrations, server_of

ACCEPT_LOCK_KEY = 0x67707568_6661  # "gpuh" "fa": the accept order lock
"""``pg_advisory_xact_lock`` key that orders the accepting transactions."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetRecord:
    """One record an agent sent.

    Attributes:
        key: The agent's idempotency key, unique across the fleet (``<node>:<hex>``).
        node: The node it is about (the authenticated agent's own).
        kind: ``finding``, ``finding_cleared`` or ``inventory``.
        at: When the agent made it, epoch seconds.
        body: Its JSON object.
    """

    key: str
    node: str
    kind: str
    at: float
    body: Mapping[str, Any]


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


class FleetStore(Protocol):
    """The fleet state store's operations (both backends)."""

    def accept(self, node: str, records: Sequence[FleetRecord]) -> AcceptResult:
        """Store records in one transaction; duplicates of accepted keys are counted only."""

    def read_after(self, seq: int, *, limit: int = 1000) -> list[StoredFleetRecord]:
        """Return accepted records with ``seq`` greater than ``seq``, in order."""

    def heartbeat(self, node: str, *, version: str, gpus: Sequence[Mapping[str, str]],
                  at: float, facts: Mapping[str, str] | None = None) -> None:
        """Record an agent's heartbeat in the registry."""

    def agents(self) -> list[AgentRow]:
        """Return the registry, by node."""

    def prune(self, older_than: float) -> int:
        """Delete accepted records made before ``older_than``; return how many."""

    def close(self) -> None:
        """Release the connections."""


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


def _pg(sql: str) -> str:
    """The psycopg form of a statement: ``%s`` placeholders."""
    return sql.replace("?", "%s")


class SqliteFleetStore:
    """The fleet store in one SQLite file (module docstring).

    Args:
        path: The file (its folder is created), or ``None`` for memory.

    Raises:
        sqlite3.DatabaseError: The file is not a fleet store.
    """

    def __init__(self, path: str | Path | None, *, clock: Callable[[], float] | None = None
                 ) -> None:
        import time

        self.clock = clock or time.time
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:" if path is None else str(path), timeout=30.0,
                                   isolation_level=None, check_same_thread=False)
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._migrate()

    def _migrate(self) -> None:
        with self._tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS gpuhealth_schema_migrations (component "
                       "TEXT NOT NULL, version INTEGER NOT NULL, applied_at REAL NOT NULL, "
                       "PRIMARY KEY (component, version))")
            done = {int(r[0]) for r in db.execute(
                "SELECT version FROM gpuhealth_schema_migrations WHERE component = 'fleet'")}
            for version, _name, sql in migrations("sqlite"):
                if version in done:
                    continue
                for statement in (s.strip() for s in sql.split(";")):
                    if statement:
                        db.execute(statement)
                db.execute("INSERT INTO gpuhealth_schema_migrations VALUES ('fleet', ?, ?)",
                           (version, self.clock()))

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def accept(self, node: str, records: Sequence[FleetRecord]) -> AcceptResult:
        """See :meth:`FleetStore.accept`."""
        now = self.clock()
        accepted = 0
        with self._tx() as db:
            for r in records:
                cur = db.execute(_INSERT_RECORD,
                                 (r.key, node, r.kind, r.at, _json(dict(r.body)), now))
                accepted += cur.rowcount
        return AcceptResult(accepted, len(records) - accepted)

    def read_after(self, seq: int, *, limit: int = 1000) -> list[StoredFleetRecord]:
        """See :meth:`FleetStore.read_after`."""
        with self._lock:
            rows = self._db.execute(_READ_AFTER, (seq, limit)).fetchall()
        return [_stored(r) for r in rows]

    def heartbeat(self, node: str, *, version: str, gpus: Sequence[Mapping[str, str]],
                  at: float, facts: Mapping[str, str] | None = None) -> None:
        """See :meth:`FleetStore.heartbeat`."""
        with self._tx() as db:
            db.execute(_HEARTBEAT, (node, version, _json(list(gpus)),
                                    _json(dict(facts or {})), at, at))

    def agents(self) -> list[AgentRow]:
        """See :meth:`FleetStore.agents`."""
        with self._lock:
            rows = self._db.execute(_AGENTS).fetchall()
        return [_agent(r) for r in rows]

    def prune(self, older_than: float) -> int:
        """See :meth:`FleetStore.prune`."""
        with self._tx() as db:
            return int(db.execute(_PRUNE, (older_than,)).rowcount)

    def close(self) -> None:
        """See :meth:`FleetStore.close`."""
        with self._lock:
            self._db.close()


class PostgresFleetStore:
    """The fleet store in PostgreSQL (module docstring).

    Args:
        dsn: libpq connection string or URI (the password from ``PGPASSWORD`` or
            ``~/.pgpass``, never the configuration file).
        pool_size: Connections of this replica, fixed (min = max).
        timeout_seconds: Connect timeout and the wait for a free connection.

    Raises:
        PluginError: psycopg or psycopg_pool is not installed.
        TemporaryError: The server cannot be reached at start.
    """

    def __init__(self, dsn: str, *, pool_size: int = 4, timeout_seconds: float = 10.0,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError as exc:
            raise PluginError("the PostgreSQL state store needs the controller's extra: "
                              "pip install 'gpuhealth[controller]'") from exc
        self.clock = clock or time.time
        self._errors: tuple[type[BaseException], ...] = (psycopg.OperationalError,
                                                         psycopg.InterfaceError)
        self._timeout_errors: tuple[type[BaseException], ...] = ()
        from psycopg_pool import PoolTimeout

        self._timeout_errors = (PoolTimeout,)
        self._where = server_of(dsn)
        self._pool = ConnectionPool(
            dsn, min_size=pool_size, max_size=pool_size, timeout=timeout_seconds,
            kwargs={"connect_timeout": max(1, int(timeout_seconds)),
                    "application_name": "gpuhealth-controller"},
            check=ConnectionPool.check_connection, open=False)
        try:
            self._pool.open(wait=True, timeout=timeout_seconds)
            self._migrate()
        except (*self._errors, *self._timeout_errors) as exc:
            self._pool.close()
            raise TemporaryError(f"PostgreSQL {self._where}: {exc}") from exc

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield conn
        except (*self._errors, *self._timeout_errors) as exc:
            raise TemporaryError(f"PostgreSQL {self._where}: {exc}") from exc

    def _migrate(self) -> None:
        with self._tx() as db:
            migrate_postgres(db)

    def accept(self, node: str, records: Sequence[FleetRecord]) -> AcceptResult:
        """See :meth:`FleetStore.accept`."""
        if not records:
            return AcceptResult(0, 0)
        now = self.clock()
        with self._tx() as db:
            db.execute("SELECT pg_advisory_xact_lock(%s)", (ACCEPT_LOCK_KEY,))
            cur = db.cursor()
            cur.executemany(
                _pg(_INSERT_RECORD),
                [(r.key, node, r.kind, r.at, _json(dict(r.body)), now) for r in records])
            accepted = max(0, cur.rowcount)
        return AcceptResult(accepted, len(records) - accepted)

    def read_after(self, seq: int, *, limit: int = 1000) -> list[StoredFleetRecord]:
        """See :meth:`FleetStore.read_after`."""
        with self._tx() as db:
            rows = db.execute(_pg(_READ_AFTER), (seq, limit)).fetchall()
        return [_stored(r) for r in rows]

    def heartbeat(self, node: str, *, version: str, gpus: Sequence[Mapping[str, str]],
                  at: float, facts: Mapping[str, str] | None = None) -> None:
        """See :meth:`FleetStore.heartbeat`."""
        with self._tx() as db:
            db.execute(_pg(_HEARTBEAT), (node, version, _json(list(gpus)),
                                         _json(dict(facts or {})), at, at))

    def agents(self) -> list[AgentRow]:
        """See :meth:`FleetStore.agents`."""
        with self._tx() as db:
            rows = db.execute(_AGENTS).fetchall()
        return [_agent(r) for r in rows]

    def prune(self, older_than: float) -> int:
        """See :meth:`FleetStore.prune`."""
        with self._tx() as db:
            return int(db.execute(_pg(_PRUNE), (older_than,)).rowcount)

    def close(self) -> None:
        """See :meth:`FleetStore.close`."""
        self._pool.close()


def open_fleet_store(target: str, *, pool_size: int = 4) -> SqliteFleetStore | PostgresFleetStore:
    """Open the fleet store at ``target``: a PostgreSQL DSN, else a SQLite file.

    Raises:
        PluginError: PostgreSQL without the controller's extra.
        TemporaryError: The PostgreSQL server cannot be reached.
    """
    if is_postgres(target):
        return PostgresFleetStore(target, pool_size=pool_size)
    return SqliteFleetStore(target)
