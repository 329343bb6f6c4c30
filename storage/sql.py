"""One small SQL layer over SQLite and PostgreSQL for gpuhealth's state stores.

The action store, the audit trail, the fleet store, the notification outbox and the
incident history are written once, in a portable subset of SQL with ``?`` placeholders
(``INSERT ... ON CONFLICT ... DO NOTHING`` or ``DO UPDATE SET ... = excluded. ...``,
``RETURNING``), and run on either engine. Write no other ``?`` than placeholders (no
JSONB ``?`` operators); a literal ``%`` is fine.

- :class:`SqliteDatabase`: one file (WAL) or memory, one connection, one writer at a
  time (``BEGIN IMMEDIATE``): the embedded ``run``, tests.
- :class:`PostgresDatabase`: a small *fixed* ``psycopg_pool`` pool (``min_size =
  max_size``, never a connection per caller). :meth:`~PostgresDatabase.transaction`
  may take a named ``pg_advisory_xact_lock`` first, so the writers of one store are
  serialized across every process sharing the database (two controllers,
  ``gpuhealth actions``) as SQLite's single writer serializes them. A lost connection
  or a restarting server raises :class:`~core.errors.TemporaryError` naming the server,
  never the password.

:func:`open_database` picks the engine from the target. psycopg is imported only when a
PostgreSQL target is opened, so the node agent imports this module without it.

Schemas are versioned in the package: ``storage/migrations/sqlite/NNNN_name.sql`` and
``storage/migrations/postgres/NNNN_name.sql`` (plain statements separated by ``;``),
applied in order, once, by :meth:`Database.migrate` and recorded in
``gpuhealth_schema_migrations (component, version, applied_at)``:

- SQLite keeps each store in its own file, so a component gets the files named after it
  (``NNNN_<component>.sql`` or ``NNNN_<component>_<what>.sql``);
- PostgreSQL keeps every store in one database shared by the controller pair, so any
  component applies the whole shared schema (component :data:`SHARED_SCHEMA`, every file
  of the folder) under ``pg_advisory_xact_lock(MIGRATE_LOCK_KEY)``: two controllers
  starting together apply each migration once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from core.errors import ConfigError, PluginError, TemporaryError

logger = logging.getLogger(__name__)

MIGRATE_LOCK_KEY = 0x67707568_6d67  # "gpuh" "mg"
"""``pg_advisory_xact_lock`` key that lets one process apply migrations at a time."""

SHARED_SCHEMA = "gpuhealth"
"""The component that stands for every migration of a dialect (PostgreSQL's shared schema)."""

SQLITE_SYNCHRONOUS = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
"""Accepted ``PRAGMA synchronous`` levels."""

_MIGRATIONS_TABLE = (
    "CREATE TABLE IF NOT EXISTS gpuhealth_schema_migrations (component TEXT NOT NULL, "
    "version INTEGER NOT NULL, applied_at {real} NOT NULL, PRIMARY KEY (component, version))"
)


class Cursor(Protocol):
    """What :meth:`Connection.execute` returns (the DB-API subset the stores use)."""

    @property
    def rowcount(self) -> int:
        """Rows the statement changed (``-1`` when the engine does not know)."""

    def fetchone(self) -> Any:
        """The next row (a tuple), or ``None``."""

    def fetchall(self) -> list[Any]:
        """The remaining rows (tuples)."""


class Connection(Protocol):
    """A connection inside a transaction."""

    def execute(self, sql: str, args: Sequence[Any] = (), /) -> Cursor:
        """Run one statement (``?`` placeholders)."""

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]], /) -> int:
        """Run one statement once per row of arguments; return the rows changed in all."""


class Database(Protocol):
    """A state store's database: transactions, plain reads and migrations.

    Attributes:
        dialect: ``"sqlite"`` or ``"postgres"``.
        where: The file or ``host:port/dbname`` for messages (never a password).
    """

    dialect: str
    where: str

    def transaction(self, *, lock: str | int | None = None
                    ) -> AbstractContextManager[Connection]:
        """One transaction: committed when the block ends, rolled back if it raises.

        Args:
            lock: PostgreSQL: the name (or 63-bit key) of an advisory transaction lock
                taken first, serializing every transaction with that lock across
                processes. SQLite serializes every transaction anyway.
        """

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        """Run one read statement in a transaction of its own; return all its rows."""

    def migrate(self, component: str) -> list[int]:
        """Apply ``component``'s pending migrations (module docstring); return their versions."""

    def close(self) -> None:
        """Release the connections (idempotent)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Migration:
    """One schema migration file.

    Attributes:
        version: ``NNNN`` of the file name, unique per dialect.
        name: The rest of the name, without ``.sql``.
        sql: Its statements.
    """

    version: int
    name: str
    sql: str


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


def _password_of(dsn: str) -> str:
    """The password written in a DSN, or ``""`` (to keep it out of messages)."""
    if "://" in dsn:
        userinfo = dsn.split("://", 1)[1].rsplit("@", 1)
        return userinfo[0].partition(":")[2] if len(userinfo) == 2 else ""
    match = re.search(r"(?:^|\s)password\s*=\s*(\S+)", dsn)
    return match.group(1).strip("'") if match else ""


class PasswordFile:
    """A PostgreSQL password kept in a file of its own (a mounted Kubernetes Secret), re-read.

    libpq reads a ``passfile`` at every new connection, but it wants ``host:port:db:user:
    password`` lines in a file that only its owner can read, and a Secret holds the bare
    password (kubelet may also make it group-readable). So the password file is copied
    into a private pgpass file (one ``*:*:*:*:`` line, mode 0600, in a folder of its own
    on ``/dev/shm`` where there is one, else the temporary folder), which :meth:`refresh`
    rewrites (atomically) when the password file changes, and :meth:`dsn` adds that copy
    to a DSN as its ``passfile``: every new connection made with the DSN, by any pool or
    thread, then logs in with the newest password. Connections already open stay
    (PostgreSQL does not end sessions when a role's password changes).

    The file holds the password alone; one trailing newline (``echo``) is dropped. A
    password in the DSN or in ``PGPASSWORD`` would win over any passfile: do not set one.

    Args:
        path: The password file.
        where: What names the setting in messages (``"[controller] state_password_file"``).

    Raises:
        ConfigError: The file cannot be read, is empty or holds more than one line.
    """

    def __init__(self, path: Path, *, where: str = "[controller] state_password_file") -> None:
        self.path = path
        self.where = where
        shm = Path("/dev/shm")
        folder = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None
        self._folder = Path(tempfile.mkdtemp(prefix="gpuhealth-pgpass-", dir=folder))
        self.passfile = self._folder / "pgpass"
        """The private pgpass copy (what :meth:`dsn` names)."""
        self._text: str | None = None
        self.problem = ""
        """Why the file as it is now was refused; ``""`` while the copy is its password."""
        try:
            self.refresh()
        except BaseException:
            self.close()
            raise

    def _password(self) -> str:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{self.where} {self.path}: {why}") from exc
        password = text[:-1] if text.endswith("\n") else text
        password = password[:-1] if password.endswith("\r") else password
        if not password:
            raise ConfigError(f"{self.where} {self.path}: empty (a half-written file?)")
        if "\n" in password or "\r" in password:
            raise ConfigError(f"{self.where} {self.path}: more than one line (the file holds "
                              "the password alone)")
        return password

    def refresh(self) -> bool:
        """Copy the password again if the file changed; return whether it did.

        Raises:
            ConfigError: The file cannot be read, is empty or holds more than one line;
                the copy keeps the password read before.
        """
        try:
            password = self._password()
        except ConfigError as exc:
            self.problem = str(exc)
            raise
        self.problem = ""
        if password == self._text:
            return False
        escaped = password.replace("\\", "\\\\").replace(":", "\\:")
        fd, name = tempfile.mkstemp(dir=self._folder, prefix=".pgpass-")  # mode 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(f"*:*:*:*:{escaped}\n")
            os.replace(name, self.passfile)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name)
            raise
        first = self._text is None
        self._text = password
        if not first:
            logger.info("%s %s re-read: new PostgreSQL connections use the new password",
                        self.where, self.path)
        return True

    def dsn(self, dsn: str) -> str:
        """``dsn`` (a URI or libpq keywords) with :attr:`passfile` as its ``passfile``."""
        return self.with_passfile(dsn, self.passfile)

    @staticmethod
    def with_passfile(dsn: str, passfile: Path) -> str:
        """``dsn`` (a URI or libpq keywords) with ``passfile``.

        Examples:
            >>> PasswordFile.with_passfile("host=db dbname=f", Path("/run/p"))
            "host=db dbname=f passfile='/run/p'"
            >>> PasswordFile.with_passfile("postgresql://u@db/f?sslmode=require", Path("/run/p"))
            'postgresql://u@db/f?sslmode=require&passfile=%2Frun%2Fp'
        """
        if "://" in dsn:
            return (f"{dsn}{'&' if '?' in dsn else '?'}passfile="
                    f"{urllib.parse.quote(str(passfile), safe='')}")
        quoted = str(passfile).replace("\\", "\\\\").replace("'", "\\'")
        return f"{dsn} passfile='{quoted}'"

    def close(self) -> None:
        """Remove the private copy (idempotent)."""
        shutil.rmtree(self._folder, ignore_errors=True)


def lock_key(name: str) -> int:
    """A stable 63-bit advisory-lock key for ``name``.

    Examples:
        >>> lock_key("actions") == lock_key("actions") != lock_key("audit")
        True
    """
    return int.from_bytes(hashlib.sha256(f"gpuhealth:{name}".encode()).digest()[:8],
                          "big") >> 1


def to_pyformat(sql: str) -> str:
    """The psycopg form of a portable statement: ``%s`` placeholders, ``%`` doubled.

    Examples:
        >>> to_pyformat("SELECT id FROM t WHERE name LIKE 'a%' AND id > ?")
        "SELECT id FROM t WHERE name LIKE 'a%%' AND id > %s"
    """
    return sql.replace("%", "%%").replace("?", "%s")


def migrations(dialect: str, component: str = SHARED_SCHEMA) -> list[Migration]:
    """Return the migrations of ``component`` in ``storage/migrations/<dialect>``, in order.

    Args:
        dialect: ``"sqlite"`` or ``"postgres"``.
        component: :data:`SHARED_SCHEMA` for every file, else the files named
            ``NNNN_<component>.sql`` or ``NNNN_<component>_<what>.sql``.

    Raises:
        ValueError: Two files share a version.
    """
    folder = resources.files("storage").joinpath("migrations", dialect)
    out: list[Migration] = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match is None:
            continue
        name = match.group(2)
        if component == SHARED_SCHEMA or name == component or name.startswith(f"{component}_"):
            out.append(Migration(version=int(match.group(1)), name=name,
                                 sql=entry.read_text(encoding="utf-8")))
    out.sort(key=lambda m: m.version)
    versions = [m.version for m in out]
    if len(set(versions)) != len(versions):
        raise ValueError(f"storage/migrations/{dialect}: two migrations share a version")
    return out


def _statements(sql: str) -> list[str]:
    """The statements of a migration file (split at ``;``, ``--`` comment lines dropped)."""
    lines = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def open_database(target: str | Path | None, *, pool_size: int = 4,
                  timeout_seconds: float = 10.0, sqlite_synchronous: str = "FULL",
                  sqlite_timeout_seconds: float = 30.0
                  ) -> SqliteDatabase | PostgresDatabase:
    """Open the database at ``target``.

    Args:
        target: A ``postgresql://``/``postgres://`` URI or a libpq keyword string with
            ``host=`` or ``dbname=`` (PostgreSQL; the password from ``PGPASSWORD`` or
            ``~/.pgpass``, never the configuration file); ``None`` (SQLite in memory);
            anything else is a SQLite file (its folder is created).
        pool_size: PostgreSQL connections, fixed (min = max).
        timeout_seconds: PostgreSQL connect timeout and the longest wait for a free
            connection.
        sqlite_synchronous: SQLite ``PRAGMA synchronous``.
        sqlite_timeout_seconds: How long a SQLite statement waits for another
            process's write lock before ``sqlite3.OperationalError`` ("database is
            locked"), seconds.

    Raises:
        ValueError: ``pool_size`` < 1, ``timeout_seconds`` <= 0, or an unknown
            ``sqlite_synchronous``.
        OSError: The SQLite folder cannot be created.
        sqlite3.DatabaseError: The file is not a database.
        PluginError: PostgreSQL without psycopg and psycopg_pool (the controller's extra).
        TemporaryError: The PostgreSQL server cannot be reached.
    """
    if is_postgres(target):
        return PostgresDatabase(str(target), pool_size=pool_size,
                                timeout_seconds=timeout_seconds)
    return SqliteDatabase(target, synchronous=sqlite_synchronous,
                          timeout_seconds=sqlite_timeout_seconds)


class _SqliteConnection:
    """:class:`Connection` over a ``sqlite3`` connection inside a transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = (), /) -> Cursor:
        return self._conn.execute(sql, tuple(args))

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]], /) -> int:
        if not rows:
            return 0
        return max(0, self._conn.executemany(sql, [tuple(r) for r in rows]).rowcount)


class SqliteDatabase:
    """SQLite behind the :class:`Database` interface.

    Args:
        path: The file (its folder is created), or ``None`` for memory (one database
            per object).
        synchronous: ``PRAGMA synchronous`` (``NORMAL`` survives a crash of the
            process; ``FULL`` also a power loss).
        timeout_seconds: How long a statement waits for another process's write lock
            before ``sqlite3.OperationalError`` ("database is locked"), seconds.

    Raises:
        ValueError: An unknown ``synchronous``.
        OSError: The folder cannot be created.
        sqlite3.DatabaseError: The file is not a database.
    """

    dialect = "sqlite"

    def __init__(self, path: str | Path | None, *, synchronous: str = "FULL",
                 timeout_seconds: float = 30.0) -> None:
        if synchronous.upper() not in SQLITE_SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {sorted(SQLITE_SYNCHRONOUS)}, "
                             f"got {synchronous!r}")
        self.path = None if path is None else Path(path)
        self.synchronous = synchronous
        self.timeout_seconds = timeout_seconds
        self.where = ":memory:" if self.path is None else str(self.path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.where, timeout=timeout_seconds, isolation_level=None,
                                   check_same_thread=False)
        if self.path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")

    @contextmanager
    def transaction(self, *, lock: str | int | None = None) -> Iterator[Connection]:
        """See :meth:`Database.transaction` (``BEGIN IMMEDIATE``: ``lock`` is implied)."""
        del lock  # one writer at a time already
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteConnection(self._db)
                self._db.execute("COMMIT")
            except BaseException:
                # SQLite rolls back by itself on some errors (SQLITE_FULL, SQLITE_IOERR):
                # a ROLLBACK then fails with "no transaction is active" and would hide
                # the real error; one left open (a failed COMMIT) is rolled back here.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        """See :meth:`Database.execute`."""
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    def migrate(self, component: str) -> list[int]:
        """Apply the pending migrations named after ``component`` (module docstring).

        Raises:
            sqlite3.DatabaseError: A migration failed (none of this call's is kept).
        """
        with self.transaction() as db:
            db.execute(_MIGRATIONS_TABLE.format(real="REAL"))
            done = {int(r[0]) for r in db.execute(
                "SELECT version FROM gpuhealth_schema_migrations WHERE component = ?",
                (component,)).fetchall()}
            applied: list[int] = []
            for migration in migrations(self.dialect, component):
                if migration.version in done:
                    continue
                for statement in _statements(migration.sql):
                    db.execute(statement)
                db.execute("INSERT INTO gpuhealth_schema_migrations VALUES (?, ?, ?)",
                           (component, migration.version, time.time()))
                applied.append(migration.version)
        return applied

    def close(self) -> None:
        """See :meth:`Database.close`."""
        with self._lock:
            self._db.close()


class _PgConnection:
    """:class:`Connection` over a psycopg connection inside a transaction."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = (), /) -> Cursor:
        cursor: Cursor = self._conn.execute(to_pyformat(sql), tuple(args))
        return cursor

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]], /) -> int:
        if not rows:
            return 0
        cursor = self._conn.cursor()
        cursor.executemany(to_pyformat(sql), [tuple(r) for r in rows])
        return max(0, int(cursor.rowcount))


class PostgresDatabase:
    """PostgreSQL behind the :class:`Database` interface (module docstring).

    Args:
        dsn: libpq connection string or URI (the password from ``PGPASSWORD`` or
            ``~/.pgpass``).
        component: If given, the shared schema is migrated at open and
            :meth:`transaction` takes the advisory lock named ``component`` unless told
            another (what :mod:`alerting.silences` relies on).
        pool_size: Connections, fixed (min = max).
        timeout_seconds: Connect timeout and the longest wait for a free connection
            (also how long a call waits while the server is down before it fails).

    Raises:
        ValueError: ``pool_size`` < 1 or ``timeout_seconds`` <= 0.
        PluginError: psycopg or psycopg_pool is not installed.
        TemporaryError: The server cannot be reached at start.
    """

    dialect = "postgres"

    def __init__(self, dsn: str, *, component: str | None = None, pool_size: int = 4,
                 timeout_seconds: float = 10.0) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size!r}")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        try:
            import psycopg
            from psycopg_pool import ConnectionPool, PoolTimeout
        except ImportError as exc:
            raise PluginError("a PostgreSQL state store needs the controller's extra: "
                              "pip install 'gpuhealth[controller]'") from exc
        self.component = component
        self.pool_size = pool_size
        self.timeout_seconds = timeout_seconds
        self.where = server_of(dsn)
        self._password = _password_of(dsn)
        self._errors: tuple[type[BaseException], ...] = (
            psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)
        self._pool = ConnectionPool(
            dsn, min_size=pool_size, max_size=pool_size, timeout=timeout_seconds,
            kwargs={"connect_timeout": max(1, round(timeout_seconds)),
                    "application_name": f"gpuhealth-{component or 'state'}"},
            check=ConnectionPool.check_connection, open=False)
        try:
            self._pool.open(wait=True, timeout=timeout_seconds)
        except self._errors as exc:
            self._pool.close()
            raise self._temporary(exc) from exc
        if component is not None:
            try:
                self.migrate(component)
            except BaseException:
                self._pool.close()
                raise

    def _temporary(self, exc: BaseException) -> TemporaryError:
        message = str(exc).strip() or type(exc).__name__
        if self._password:
            message = message.replace(self._password, "***")
        return TemporaryError(f"PostgreSQL {self.where}: {message}")

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        """A pooled connection in one transaction; connection failures become temporary."""
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield conn
        except self._errors as exc:
            raise self._temporary(exc) from exc

    @contextmanager
    def transaction(self, *, lock: str | int | None = None) -> Iterator[Connection]:
        """See :meth:`Database.transaction`.

        Raises:
            TemporaryError: The connection was lost or the server is down (the
                transaction did not commit; it may be retried).
        """
        name = self.component if lock is None else lock
        with self._connection() as conn:
            if name is not None:
                key = name if isinstance(name, int) else lock_key(name)
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
            yield _PgConnection(conn)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        """See :meth:`Database.execute`.

        Raises:
            TemporaryError: The connection was lost or the server is down.
        """
        with self._connection() as conn:
            return list(conn.execute(to_pyformat(sql), tuple(args)).fetchall())

    def migrate(self, component: str) -> list[int]:
        """Apply the shared schema's pending migrations whatever ``component`` (module docstring).

        Runs in one transaction under ``pg_advisory_xact_lock(MIGRATE_LOCK_KEY)``, so of
        two processes migrating together the second waits and then finds nothing to do.

        Raises:
            TemporaryError: The connection was lost or the server is down.
            psycopg.Error: A migration failed (none of this call's is kept).
        """
        del component  # one database holds every component's tables
        with self._connection() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK_KEY,))
            conn.execute(_MIGRATIONS_TABLE.format(real="DOUBLE PRECISION"))
            done = {int(r[0]) for r in conn.execute(
                "SELECT version FROM gpuhealth_schema_migrations WHERE component = %s",
                (SHARED_SCHEMA,)).fetchall()}
            applied: list[int] = []
            for migration in migrations(self.dialect):
                if migration.version in done:
                    continue
                conn.execute(migration.sql)
                conn.execute("INSERT INTO gpuhealth_schema_migrations VALUES (%s, %s, %s)",
                             (SHARED_SCHEMA, migration.version, time.time()))
                applied.append(migration.version)
        return applied

    def close(self) -> None:
        """See :meth:`Database.close`."""
        self._pool.close()
