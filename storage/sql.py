"""One small SQL layer over SQLite and PostgreSQL for gpuhealth's state stores.

The action store and the audit trail are written once, in a portable subset of SQL with
``?`` placeholders (``INSERT ... ON CONFLICT ... DO NOTHING``, ``RETURNING``), and run on
either engine:

- :class:`SqliteDatabase`: one file (WAL), one connection, one writer at a time
  (``BEGIN IMMEDIATE``): the embedded ``run``.
- :class:`PostgresDatabase`: a small *fixed* ``psycopg_pool`` pool; each write
  transaction first takes ``pg_advisory_xact_lock(<component>)``, so writers of one
  component are serialized across every process that shares the database (two
  controllers, ``gpuhealth actions``) exactly as SQLite's single writer serializes them.
  A lost connection or a restarting server raises :class:`~core.errors.TemporaryError`
  naming the server, never the password.

PostgreSQL schemas are versioned in ``storage/migrations/postgres`` (``NNNN_name.sql``)
and applied in order by :func:`migrate_postgres`, once, under an advisory lock, recorded
in ``gpuhealth_schema_migrations``.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from core.errors import PluginError, TemporaryError

MIGRATE_LOCK_KEY = 0x67707568_6d67  # "gpuh" "mg"
"""``pg_advisory_xact_lock`` key that lets one process apply migrations at a time."""


class Cursor(Protocol):
    """What :meth:`Database.execute` returns (the DB-API subset the stores use)."""

    @property
    def rowcount(self) -> int:
        """Rows the statement changed."""

    def fetchone(self) -> Any:
        """The next row, or ``None``."""

    def fetchall(self) -> list[Any]:
        """The remaining rows."""


class Connection(Protocol):
    """A connection inside a transaction."""

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        """Run one statement (``?`` placeholders)."""


class Database(Protocol):
    """A state store's database: transactions and plain reads."""

    dialect: str

    def transaction(self) -> Any:
        """A context manager: one write transaction, yields a :class:`Connection`."""

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        """Run one read statement and return all its rows."""

    def close(self) -> None:
        """Release the connections."""


def is_postgres(target: str | Path | None) -> bool:
    """Whether ``target`` names a PostgreSQL server (URI or libpq keywords), not a file.

    Examples:
        >>> is_postgres("postgresql://gpuhealth@db/fleet"), is_postgres("host=db dbname=f")
        (True, True)
        >>> is_postgres("/var/lib/gpuhealth/actions.db"), is_postgres(None)
        (False, False)
    """
    if target is None or isinstance(target, Path):
        return False
    return target.startswith(("postgresql://", "postgres://")) or any(
        part.startswith(("host=", "dbname=")) for part in target.split())


def server_of(dsn: str) -> str:
    """Host, port and database of a DSN for messages (never the password).

    Examples:
        >>> server_of("postgresql://u:secret@db:5433/fleet?sslmode=require")
        'db:5433/fleet'
        >>> server_of("host=db dbname=fleet password=secret")
        'db:5432/fleet'
    """
    if "://" in dsn:
        rest = dsn.split("://", 1)[1]
        return rest.rsplit("@", 1)[-1].split("?", 1)[0]
    keys = dict(p.split("=", 1) for p in dsn.split() if "=" in p)
    return f"{keys.get('host', 'localhost')}:{keys.get('port', '5432')}/{keys.get('dbname', '')}"


def lock_key(component: str) -> int:
    """A stable 63-bit advisory-lock key for ``component``."""
    return int.from_bytes(hashlib.sha256(f"gpuhealth:{component}".encode()).digest()[:8],
                          "big") >> 1


class SqliteDatabase:
    """SQLite behind the :class:`Database` interface.

    Args:
        path: The file (its folder is created), or ``None`` for memory.
        schema: Statements run at open (``CREATE TABLE IF NOT EXISTS ...``).
        synchronous: ``PRAGMA synchronous`` (``NORMAL`` or ``FULL``).

    Raises:
        OSError: The folder cannot be created.
        sqlite3.DatabaseError: The file is not a database.
    """

    dialect = "sqlite"

    def __init__(self, path: str | Path | None, *, schema: str = "",
                 synchronous: str = "NORMAL") -> None:
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(":memory:" if path is None else str(path), timeout=30.0,
                                   isolation_level=None, check_same_thread=False)
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        if schema:
            self._db.executescript(schema)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction (one writer at a time)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        """See :meth:`Database.execute`."""
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        """See :meth:`Database.close`."""
        with self._lock:
            self._db.close()


class _PgConnection:
    """A psycopg connection inside a transaction, taking ``?`` placeholders."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        return self._conn.execute(sql.replace("?", "%s"), tuple(args))  # type: ignore[no-any-return]


class PostgresDatabase:
    """PostgreSQL behind the :class:`Database` interface (module docstring).

    Args:
        dsn: libpq connection string or URI (the password from ``PGPASSWORD`` or
            ``~/.pgpass``).
        component: Name of the writer lock (``actions``, ``audit``): writers of one
            component are serialized across processes.
        pool_size: Connections, fixed (min = max).
        timeout_seconds: Connect timeout and the longest wait for a free connection.

    Raises:
        PluginError: psycopg or psycopg_pool is not installed.
        TemporaryError: The server cannot be reached at start.
    """

    dialect = "postgres"

    def __init__(self, dsn: str, *, component: str, pool_size: int = 2,
                 timeout_seconds: float = 10.0) -> None:
        try:
            import psycopg
            from psycopg_pool import ConnectionPool, PoolTimeout
        except ImportError as exc:
            raise PluginError("a PostgreSQL state store needs the controller's extra: "
                              "pip install 'gpuhealth[controller]'") from exc
        self.where = server_of(dsn)
        self._lock_key = lock_key(component)
        self._errors: tuple[type[BaseException], ...] = (
            psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)
        self._pool = ConnectionPool(
            dsn, min_size=pool_size, max_size=pool_size, timeout=timeout_seconds,
            kwargs={"connect_timeout": max(1, int(timeout_seconds)),
                    "application_name": f"gpuhealth-{component}"},
            check=ConnectionPool.check_connection, open=False)
        try:
            self._pool.open(wait=True, timeout=timeout_seconds)
            with self._raw() as conn:
                migrate_postgres(conn)
        except self._errors as exc:
            self._pool.close()
            raise TemporaryError(f"PostgreSQL {self.where}: {exc}") from exc

    @contextmanager
    def _raw(self) -> Iterator[Any]:
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield conn
        except self._errors as exc:
            raise TemporaryError(f"PostgreSQL {self.where}: {exc}") from exc

    @contextmanager
    def transaction(self) -> Iterator[_PgConnection]:
        """One write transaction, serialized with every other writer of the component."""
        with self._raw() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_key,))
            yield _PgConnection(conn)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        """See :meth:`Database.execute`."""
        with self._raw() as conn:
            return list(conn.execute(sql.replace("?", "%s"), tuple(args)).fetchall())

    def close(self) -> None:
        """See :meth:`Database.close`."""
        self._pool.close()


def migrations(dialect: str) -> list[tuple[int, str, str]]:
    """Return ``(version, name, sql)`` of ``storage/migrations/<dialect>``, in order."""
    folder = resources.files("storage").joinpath("migrations", dialect)
    out: list[tuple[int, str, str]] = []
    for entry in folder.iterdir():
        name = entry.name
        if name.endswith(".sql") and name[:4].isdigit():
            out.append((int(name[:4]), name[5:-4], entry.read_text(encoding="utf-8")))
    return sorted(out)


def migrate_postgres(conn: Any) -> list[int]:
    """Apply the pending PostgreSQL migrations inside ``conn``'s transaction.

    Takes ``pg_advisory_xact_lock(MIGRATE_LOCK_KEY)`` first, so two processes starting
    together apply each migration once.

    Returns:
        The versions applied now.
    """
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK_KEY,))
    conn.execute("CREATE TABLE IF NOT EXISTS gpuhealth_schema_migrations (component TEXT "
                 "NOT NULL, version INTEGER NOT NULL, applied_at DOUBLE PRECISION NOT NULL, "
                 "PRIMARY KEY (component, version))")
    done = {int(r[0]) for r in conn.execute(
        "SELECT version FROM gpuhealth_schema_migrations WHERE component = 'gpuhealth'")}
    applied: list[int] = []
    for version, _name, sql in migrations("postgres"):
        if version not in done:
            conn.execute(sql)
            conn.execute("INSERT INTO gpuhealth_schema_migrations VALUES ('gpuhealth', %s, %s)",
                         (version, time.time()))
            applied.append(version)
    return applied
