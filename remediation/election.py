"""Leader election: only one ``gpuhealth run`` controller acts (issue #6, high availability).

Backends implement :class:`core.protocols.LeaderElector` (entry-point group
``gpuhealth.electors``):

- :class:`EtcdElector` (``etcd``): a key bound to an etcd lease, through etcd's plain
  HTTP v3 gateway (``/v3/lease/grant``, ``/v3/kv/txn``, ``/v3/lease/keepalive``,
  ``/v3/lease/revoke``; etcd API reference, "gRPC gateway"); etcd deletes the key when
  the lease expires, so a dead leader is replaced after at most one TTL.
- :class:`PostgresElector` (``postgres``): a session-level ``pg_try_advisory_lock`` on
  a dedicated connection (PostgreSQL 15 manual §9.27.10 "Advisory Lock Functions");
  the lock goes away with the session.
- :class:`LocalElector` (``local``, alias ``null``): always leader, for a single
  controller (the default).

:class:`LeaderLoop` drives an elector: it acquires every ``ttl/3``, renews while
leading, reports gain and loss to a callback, and *fences* its own belief: it stops
believing it leads as soon as a renewal fails or its own monotonic clock says the
lease may have lapsed, even when no renewal could be attempted (a paused process, a
hung request). ``docs/high-availability.md`` has the timing argument and the settings.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from core.errors import GpuHealthError, PermanentError, PluginError, TemporaryError
from core.protocols import LeaderElector

if TYPE_CHECKING:
    import psycopg

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

__all__ = [
    "ELECTOR_GROUP",
    "EtcdElector",
    "LeaderLoop",
    "LocalElector",
    "NullElector",
    "PostgresElector",
    "advisory_key",
    "build_elector",
    "default_identity",
]

ELECTOR_GROUP = "gpuhealth.electors"
"""Entry-point group of election backends."""

DEFAULT_TTL_SECONDS = 15.0
"""Lease length; client-go's leader election uses the same default ``LeaseDuration``."""


def default_identity() -> str:
    """Return ``"<host name>-<pid>"``, unique per controller process.

    Examples:
        >>> default_identity().endswith(f"-{os.getpid()}")
        True
    """
    return f"{socket.gethostname()}-{os.getpid()}"


def _check_common(identity: str | None, ttl_seconds: float, name: str) -> str:
    if not isinstance(ttl_seconds, int | float) or not math.isfinite(ttl_seconds) \
            or ttl_seconds <= 0:
        raise ValueError(f"ttl_seconds must be a finite number > 0, got {ttl_seconds!r}")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if identity is None:
        return default_identity()
    if not isinstance(identity, str) or not identity.strip():
        raise ValueError(f"identity must be a non-empty string, got {identity!r}")
    return identity


# --- single controller ---------------------------------------------------------------


class LocalElector:
    """The single-controller elector: this process is always the leader.

    Args:
        identity: This process's name (default ``"<host>-<pid>"``).
        ttl_seconds: Kept for the Protocol; nothing expires (> 0).

    Raises:
        ValueError: ``ttl_seconds`` is not a positive finite number or ``identity`` is empty.
    """

    def __init__(self, *, identity: str | None = None,
                 ttl_seconds: float = DEFAULT_TTL_SECONDS) -> None:
        self.identity = _check_common(identity, ttl_seconds, "local")
        self.ttl_seconds = float(ttl_seconds)

    def try_acquire(self) -> bool:
        """Return ``True``: there is no one else."""
        return True

    def renew(self) -> bool:
        """Return ``True``: leadership cannot be lost."""
        return True

    def release(self) -> None:
        """Do nothing: there is nothing to hand over."""

    def leader(self) -> str | None:
        """Return this process's identity."""
        return self.identity


NullElector = LocalElector
"""Alias of :class:`LocalElector` (``type = "null"``)."""


# --- etcd ----------------------------------------------------------------------------

_GRPC_TEMPORARY = {1, 4, 8, 10, 13, 14}
"""gRPC codes worth retrying: CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED,
INTERNAL, UNAVAILABLE (grpc/doc/statuscodes.md)."""
_GRPC_NOT_FOUND = 5


class _LeaseNotFound(Exception):
    """etcd answered ``requested lease not found`` (gRPC NOT_FOUND): the lease expired."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode("ascii")


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


class EtcdElector:
    """Leader election on an etcd v3 key bound to a lease, over the HTTP gateway.

    The leader's key ``<key_prefix><name>`` holds its identity and is attached to a
    lease of ``ceil(ttl_seconds)`` s. Acquiring is one transaction: "if the key's
    ``create_revision`` is 0 (absent) put it with my lease, else read it". Renewing is
    ``/v3/lease/keepalive`` plus a transaction checking that the key is still bound to
    this lease. Releasing revokes the lease, which deletes the key at once. A dead
    leader's key disappears when etcd expires its lease (at most the granted TTL after
    its last keepalive; etcd rounds TTLs up to its minimum, 2 s with default settings:
    ``ceil(1.5 × election timeout)``).

    Args:
        endpoints: One base URL or several (``http://host:2379``); on a transport error
            the next one is tried. Plain HTTP or HTTPS without client certificates; etcd
            authentication is not supported.
        name: Election name; controllers with the same name compete.
        identity: This process's identity, stored as the key's value (default
            ``"<host>-<pid>"``). Must be unique per process.
        ttl_seconds: Lease length in seconds (> 0; sent rounded up to whole seconds).
        key_prefix: Key prefix in etcd.
        timeout_seconds: Timeout of each HTTP request (> 0); keep it below
            ``ttl_seconds / 3`` so a hung request cannot outlast a renewal period.
        transport: An ``httpx`` transport (tests).

    Raises:
        ValueError: A bad argument (named in the message).
    """

    def __init__(self, *, endpoints: str | Sequence[str] = "http://127.0.0.1:2379",
                 name: str = "gpuhealth", identity: str | None = None,
                 ttl_seconds: float = DEFAULT_TTL_SECONDS,
                 key_prefix: str = "/gpuhealth/leader/", timeout_seconds: float = 2.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.identity = _check_common(identity, ttl_seconds, name)
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                               for u in urls):
            raise ValueError(f"endpoints must be http(s):// URLs, got {endpoints!r}")
        if not math.isfinite(timeout_seconds) or timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        self.endpoints = tuple(u.rstrip("/") for u in urls)
        self.name = name
        self.ttl_seconds = float(ttl_seconds)
        self.key_prefix = key_prefix
        self.timeout_seconds = float(timeout_seconds)
        self.retry_after_seconds: float | None = None
        """After a lost :meth:`try_acquire`: the holder's remaining lease, seconds."""
        self._key = _b64(key_prefix + name)
        self._value = _b64(self.identity)
        self._ttl_request = max(1, math.ceil(self.ttl_seconds))
        self._lease: str | None = None
        self._current = 0
        self._client = httpx.Client(timeout=self.timeout_seconds, transport=transport)

    @property
    def key(self) -> str:
        """The election key in etcd (``key_prefix + name``)."""
        return self.key_prefix + self.name

    def __repr__(self) -> str:
        return (f"EtcdElector(endpoints={self.endpoints!r}, name={self.name!r}, "
                f"identity={self.identity!r}, ttl_seconds={self.ttl_seconds!r})")

    # the seam where httpx and etcd errors become gpuhealth errors
    def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        for attempt in range(len(self.endpoints)):
            index = (self._current + attempt) % len(self.endpoints)
            url = self.endpoints[index] + path
            try:
                response = self._client.post(url, json=body)
            except httpx.TransportError as exc:
                last = exc
                continue
            self._current = index
            return self._answer(url, response)
        raise TemporaryError(f"etcd unreachable at {', '.join(self.endpoints)}: {last}",
                             retry_after_seconds=self.timeout_seconds) from last

    @staticmethod
    def _answer(url: str, response: httpx.Response) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            if response.status_code >= 500:
                raise TemporaryError(f"etcd {url}: HTTP {response.status_code}")
            raise PermanentError(f"etcd {url}: HTTP {response.status_code}, not an etcd v3 "
                                 f"gateway answer: {response.text[:200]!r}")
        if response.status_code == 200 and "error" not in data:
            return data
        code = data.get("code")
        message = data.get("message") or data.get("error") or response.text[:200]
        if code == _GRPC_NOT_FOUND and "lease not found" in str(message):
            raise _LeaseNotFound(str(message))
        if code in _GRPC_TEMPORARY or response.status_code >= 500:
            raise TemporaryError(f"etcd {url}: {message} (code {code})")
        raise PermanentError(f"etcd {url}: HTTP {response.status_code}: {message} "
                             f"(code {code})")

    def _range_holder(self) -> tuple[str | None, str | None]:
        """Return ``(identity, lease id)`` of the key's holder, or ``(None, None)``."""
        kvs = self._post("/v3/kv/range", {"key": self._key}).get("kvs") or []
        if not kvs:
            return None, None
        kv = kvs[0]
        return _unb64(kv.get("value", "")), (str(kv["lease"]) if kv.get("lease") else None)

    def _revoke(self, lease: str) -> None:
        with contextlib.suppress(_LeaseNotFound):
            self._post("/v3/lease/revoke", {"ID": lease})

    def try_acquire(self) -> bool:
        """Become leader if the key is free; stay leader (renew) if this process holds it.

        Returns:
            Whether this process is leader now. After ``False``,
            :attr:`retry_after_seconds` is the holder's remaining lease (``None`` if unknown).

        Raises:
            TemporaryError: No endpoint answered, or etcd is unavailable.
            PermanentError: etcd refused the request (authentication, bad request).
        """
        if self._lease is not None:
            return self.renew()
        self.retry_after_seconds = None
        holder, holder_lease = self._range_holder()
        if holder is not None:
            self._note_remaining(holder_lease)
            return False
        grant = self._post("/v3/lease/grant", {"TTL": self._ttl_request})
        lease = str(grant["ID"])
        granted = int(grant.get("TTL", 0))
        if granted > self._ttl_request:
            logger.info("etcd raised the lease TTL from %d s to its minimum %d s; "
                        "a standby takes over that much later", self._ttl_request, granted)
        try:
            txn = self._post("/v3/kv/txn", {
                "compare": [{"key": self._key, "target": "CREATE", "result": "EQUAL",
                             "create_revision": "0"}],
                "success": [{"request_put": {"key": self._key, "value": self._value,
                                             "lease": lease}}],
                "failure": [{"request_range": {"key": self._key}}],
            })
        except _LeaseNotFound:
            return False
        except TemporaryError:
            with contextlib.suppress(GpuHealthError):
                self._revoke(lease)
            raise
        if txn.get("succeeded"):
            self._lease = lease
            logger.info("leader election %s: %s is leader (etcd lease %s)",
                        self.key, self.identity, lease)
            return True
        with contextlib.suppress(GpuHealthError):
            self._revoke(lease)
        return False

    def _note_remaining(self, holder_lease: str | None) -> None:
        if holder_lease is None:
            return
        with contextlib.suppress(GpuHealthError, _LeaseNotFound):
            ttl = int(self._post("/v3/lease/timetolive", {"ID": holder_lease}).get("TTL", 0))
            self.retry_after_seconds = float(max(ttl, 0))

    def renew(self) -> bool:
        """Keep the lease alive and check the key is still bound to it.

        Returns:
            ``False`` when leadership is lost (lease expired or key changed) or etcd
            cannot be reached; the lease is kept locally in the second case, so a
            later :meth:`try_acquire` resumes leadership if the lease survived.
        """
        lease = self._lease
        if lease is None:
            return False
        try:
            alive = self._post("/v3/lease/keepalive", {"ID": lease})
            # an expired lease answers 200 with no TTL (etcd 3.4 gateway)
            expired = int((alive.get("result") or {}).get("TTL", 0)) <= 0
            check = {} if expired else self._post("/v3/kv/txn", {
                "compare": [{"key": self._key, "target": "LEASE", "result": "EQUAL",
                             "lease": lease}],
                "success": [], "failure": [],
            })
        except _LeaseNotFound:
            expired = True
        except TemporaryError as exc:
            logger.warning("leader election %s: cannot renew: %s", self.key, exc)
            return False
        if expired:
            logger.warning("leader election %s: %s lost leadership (lease %s expired)",
                           self.key, self.identity, lease)
            self._lease = None
            return False
        if not check.get("succeeded"):
            logger.warning("leader election %s: %s lost leadership (key no longer bound "
                           "to lease %s)", self.key, self.identity, lease)
            with contextlib.suppress(GpuHealthError):
                self._revoke(lease)
            self._lease = None
            return False
        return True

    def release(self) -> None:
        """Revoke the lease (deleting the key); forget it locally even if etcd is down."""
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            self._revoke(lease)
        except GpuHealthError as exc:
            logger.warning("leader election %s: revoke failed, the lease expires in "
                           "%s s: %s", self.key, self._ttl_request, exc)
        else:
            logger.info("leader election %s: %s released leadership", self.key, self.identity)

    def leader(self) -> str | None:
        """Return the identity stored in the key, or ``None`` when nobody leads.

        Raises:
            TemporaryError: etcd cannot be reached.
        """
        return self._range_holder()[0]

    def close(self) -> None:
        """Close the HTTP client (does not release leadership)."""
        self._client.close()


# --- PostgreSQL ----------------------------------------------------------------------


def advisory_key(name: str) -> int:
    """Return the 64-bit advisory-lock key of election ``name``.

    The first 8 bytes of SHA-256 of ``"gpuhealth.election:" + name``, read as a signed
    big-endian integer (the ``bigint`` that ``pg_try_advisory_lock`` takes).

    Examples:
        >>> advisory_key("gpuhealth") == advisory_key("gpuhealth")
        True
        >>> -2**63 <= advisory_key("x") < 2**63
        True
    """
    digest = hashlib.sha256(f"gpuhealth.election:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


_APP_PREFIX = "gpuhealth-leader:"
_IDENTIFIER = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


class PostgresElector:
    """Leader election on a PostgreSQL session-level advisory lock.

    The leader is the session holding ``pg_try_advisory_lock(advisory_key(name))`` on
    this elector's own connection (``autocommit``; ``application_name`` is
    ``"gpuhealth-leader:<identity>"``, cut to 63 bytes by the server). PostgreSQL frees
    the lock when the session ends: at once when the leader process dies, and, because
    each session sets ``idle_session_timeout`` to the TTL (PostgreSQL >= 14), at most
    one TTL after the last renewal of a leader that hangs, is paused or is cut off by
    the network (server-side TCP keepalives are also set to ``ttl/3`` idle, 1 s x 3).

    Because the server knows no lease time, the leader also stamps a row of ``table``
    (``name``, ``holder``, ``pid``, ``ttl_seconds``, ``renewed_at``, ``released``) at
    each renewal, with the server's clock. A process that gets the lock after a holder
    that did not release it cleanly waits until that holder's ``renewed_at +
    ttl_seconds`` before it reports leadership (``try_acquire`` returns ``False`` and
    sets :attr:`retry_after_seconds` meanwhile): the old holder's own clock has then
    told it to stop, so two leaders never act at once even when the old session was
    cut off rather than killed. The row is also what :meth:`leader` reports; it falls
    back to ``application_name`` when the holder has written no row.

    Args:
        dsn: libpq connection string or URI (password from ``PGPASSWORD`` or
            ``~/.pgpass``, never the configuration file).
        name: Election name; controllers with the same name compete.
        identity: This process's identity (default ``"<host>-<pid>"``); unique per process.
        ttl_seconds: How long a holder's belief lasts after a renewal, seconds (> 0).
        timeout_seconds: Connect timeout, TCP user timeout and statement timeout (> 0).
        table: Table for the holder rows, created on first leadership (needs CREATE
            on the schema); lower-case SQL identifier, optionally ``schema.table``.
        clock: Monotonic seconds for the take-over wait (tests).

    Raises:
        ValueError: A bad argument.
        PluginError: ``psycopg`` is not installed.
    """

    def __init__(self, *, dsn: str, name: str = "gpuhealth", identity: str | None = None,
                 ttl_seconds: float = DEFAULT_TTL_SECONDS, timeout_seconds: float = 2.0,
                 table: str = "gpuhealth_leader",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.identity = _check_common(identity, ttl_seconds, name)
        if not isinstance(dsn, str) or not dsn:
            raise ValueError("dsn must be a non-empty libpq connection string")
        if not math.isfinite(timeout_seconds) or timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        parts = table.split(".")
        if not 1 <= len(parts) <= 2 or not all(
                p and set(p) <= _IDENTIFIER and not p[0].isdigit() for p in parts):
            raise ValueError(f"table must be a lower-case identifier (schema.table), "
                             f"got {table!r}")
        try:
            import psycopg
        except ImportError as exc:
            raise PluginError("the postgres elector needs psycopg: "
                              "pip install 'psycopg[binary]>=3.1'") from exc
        self._psycopg = psycopg
        self.dsn = dsn
        self.name = name
        self.ttl_seconds = float(ttl_seconds)
        self.timeout_seconds = float(timeout_seconds)
        self.table = table
        self.clock = clock
        self.lock_key = advisory_key(name)
        self.retry_after_seconds: float | None = None
        """While waiting out a previous holder: seconds left, else ``None``."""
        self._conn: psycopg.Connection[Any] | None = None
        self._locked = False
        self._leading = False
        self._fence_until: float | None = None

    def __repr__(self) -> str:
        return (f"PostgresElector(name={self.name!r}, identity={self.identity!r}, "
                f"ttl_seconds={self.ttl_seconds!r}, table={self.table!r})")

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """Translate psycopg errors; a broken connection is dropped (and the lock with it)."""
        psycopg = self._psycopg
        try:
            yield
        except psycopg.OperationalError as exc:
            self._drop()
            raise TemporaryError(f"postgres elector ({doing}): {exc}".strip(),
                                 retry_after_seconds=self.timeout_seconds) from exc
        except psycopg.Error as exc:
            if self._conn is not None and self._conn.closed:
                self._drop()
                raise TemporaryError(f"postgres elector ({doing}): {exc}") from exc
            raise PermanentError(f"postgres elector ({doing}): {exc}") from exc

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._locked = self._leading = False
        self._fence_until = None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        self._drop()
        millis = max(1, int(self.timeout_seconds * 1000))
        lease = max(1, math.ceil(self.ttl_seconds * 1000))
        idle = max(1, math.ceil(self.ttl_seconds / 3))
        with self._errors("connect"):
            self._conn = self._psycopg.connect(
                self.dsn, autocommit=True,
                connect_timeout=max(1, math.ceil(self.timeout_seconds)),
                application_name=(_APP_PREFIX + self.identity)[:63],
                options=(f"-c statement_timeout={millis} -c idle_session_timeout={lease} "
                         f"-c tcp_keepalives_idle={idle} -c tcp_keepalives_interval=1 "
                         "-c tcp_keepalives_count=3"),
                keepalives=1, keepalives_idle=idle, keepalives_interval=1,
                keepalives_count=3, tcp_user_timeout=millis,
            )
        return self._conn

    def _reconnecting(self, doing: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        """Run ``doing`` on the session, retrying once on a fresh one.

        The retry happens only when no lock was held: the server may have ended an
        idle standby session (``idle_session_timeout``), which is not an outage.
        """
        stale = self._conn is not None and not self._locked
        try:
            return doing(self._connection())
        except TemporaryError:
            if not stale:
                raise
            logger.debug("leader election %s: idle session was closed, reconnecting",
                         self.name)
            return doing(self._connection())

    def try_acquire(self) -> bool:
        """Take the advisory lock if free; keep (renew) it if this process holds it.

        Returns:
            Whether this process is leader now. ``False`` also while it holds the lock
            but waits out a previous holder that did not release cleanly
            (:attr:`retry_after_seconds` says how long).

        Raises:
            TemporaryError: The server cannot be reached (the session, and any lock it
                held, is dropped).
            PermanentError: The server refused a statement (permissions, bad table name).
        """
        if self._leading:
            return self.renew()
        if not self._locked:
            self.retry_after_seconds = None
            if not self._reconnecting(self._lock):
                return False
        conn = self._connection()
        assert self._fence_until is not None
        wait = self._fence_until - self.clock()
        if wait > 0:
            self.retry_after_seconds = wait
            logger.info("leader election %s: %s holds the lock, waiting %.1f s for the "
                        "previous holder's lease to lapse", self.name, self.identity, wait)
            return False
        self.retry_after_seconds = None
        if not self._stamp(conn, claim=True):
            self._drop()
            return False
        self._leading = True
        logger.info("leader election %s: %s is leader (advisory lock %d)",
                    self.name, self.identity, self.lock_key)
        return True

    def _lock(self, conn: psycopg.Connection[Any]) -> bool:
        with self._errors("lock"):
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.lock_key,)).fetchone()
        if not row or not row[0]:
            return False
        self._locked = True
        self._fence_until = self.clock() + self._previous_holder_wait(conn)
        return True

    def _sql(self, text: str) -> psycopg.sql.Composed:
        """Compose ``text`` with ``{table}`` quoted as an identifier."""
        from psycopg import sql

        return sql.SQL(text).format(table=sql.Identifier(*self.table.split(".")))

    def _ensure_table(self, conn: psycopg.Connection[Any]) -> None:
        with self._errors("create table"):
            conn.execute(self._sql(
                "CREATE TABLE IF NOT EXISTS {table} ("
                "name text PRIMARY KEY, holder text NOT NULL, pid integer NOT NULL, "
                "ttl_seconds double precision NOT NULL, renewed_at timestamptz NOT NULL, "
                "released boolean NOT NULL DEFAULT false)"))

    def _previous_holder_wait(self, conn: psycopg.Connection[Any]) -> float:
        """Seconds until the last holder's belief has lapsed (0 after a clean release)."""
        with self._errors("read holder"):
            exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                  (self.table,)).fetchone()
            if not exists or not exists[0]:
                return 0.0
            row = conn.execute(self._sql(
                "SELECT released, extract(epoch FROM renewed_at - clock_timestamp()) "
                "+ ttl_seconds FROM {table} WHERE name = %s"), (self.name,)).fetchone()
        if row is None or row[0]:
            return 0.0
        return max(0.0, float(row[1]))

    def _stamp(self, conn: psycopg.Connection[Any], *, claim: bool) -> bool:
        """Write the holder row; return whether this session still holds the lock."""
        held = ("EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND pid = pg_backend_pid() AND objsubid = 1 "
                "AND ((classid::bigint << 32) | objid::bigint) = %s::bigint)")
        if claim:
            self._ensure_table(conn)
            text = ("INSERT INTO {table} AS t (name, holder, pid, ttl_seconds, renewed_at)"
                    " SELECT %s, %s, pg_backend_pid(), %s, clock_timestamp() WHERE " + held +
                    " "
                    "ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, "
                    "pid = EXCLUDED.pid, ttl_seconds = EXCLUDED.ttl_seconds, "
                    "renewed_at = EXCLUDED.renewed_at, released = false")
            params: tuple[Any, ...] = (self.name, self.identity, self.ttl_seconds,
                                       self.lock_key)
        else:
            text = ("UPDATE {table} SET renewed_at = clock_timestamp() "
                    "WHERE name = %s AND pid = pg_backend_pid() AND " + held)
            params = (self.name, self.lock_key)
        with self._errors("renew"):
            return conn.execute(self._sql(text), params).rowcount == 1

    def renew(self) -> bool:
        """Check this session still holds the lock and stamp ``renewed_at``.

        Returns:
            ``False`` when leadership is lost: the connection broke (it is dropped, so
            the lock is surely gone) or the lock is no longer held.
        """
        if not self._leading or self._conn is None:
            return False
        try:
            ok = self._stamp(self._conn, claim=False)
        except GpuHealthError as exc:
            logger.warning("leader election %s: cannot renew: %s", self.name, exc)
            self._drop()
            return False
        if not ok:
            logger.warning("leader election %s: %s lost the advisory lock",
                           self.name, self.identity)
            self._drop()
        return ok

    def release(self) -> None:
        """Mark the row released, unlock and close the session (errors are logged)."""
        conn = self._conn
        if conn is not None and self._locked and not conn.closed:
            try:
                with self._errors("release"):
                    if self._leading:
                        conn.execute(self._sql("UPDATE {table} SET released = true "
                                               "WHERE name = %s AND pid = pg_backend_pid()"),
                                     (self.name,))
                    conn.execute("SELECT pg_advisory_unlock(%s)", (self.lock_key,))
            except GpuHealthError as exc:
                logger.warning("leader election %s: release failed (closing the session "
                               "frees the lock): %s", self.name, exc)
            else:
                logger.info("leader election %s: %s released leadership",
                            self.name, self.identity)
        self._drop()

    def leader(self) -> str | None:
        """Return the lock holder's identity, or ``None`` when the lock is free.

        The identity comes from the holder's row (matched by backend pid), else from
        its ``application_name``. Needs a role that can see the holder's sessions in
        ``pg_stat_activity`` (the same role, or ``pg_read_all_stats``).

        Raises:
            TemporaryError: The server cannot be reached.
        """
        return self._reconnecting(self._leader)

    def _leader(self, conn: psycopg.Connection[Any]) -> str | None:
        with self._errors("leader"):
            row = conn.execute(
                "SELECT l.pid, a.application_name FROM pg_locks l "
                "LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
                "AND l.database = (SELECT oid FROM pg_database WHERE datname = "
                "current_database()) AND ((l.classid::bigint << 32) | l.objid::bigint) "
                "= %s::bigint", (self.lock_key,)).fetchone()
            if row is None:
                return None
            pid, application = row
            exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                  (self.table,)).fetchone()
            if exists and exists[0]:
                record = conn.execute(self._sql("SELECT holder FROM {table} "
                                                "WHERE name = %s AND pid = %s"),
                                      (self.name, pid)).fetchone()
                if record is not None:
                    return str(record[0])
        if isinstance(application, str) and application.startswith(_APP_PREFIX):
            return application[len(_APP_PREFIX):]
        return str(application) if application else f"pid {pid}"

    def close(self) -> None:
        """Close the session (frees the lock without marking a clean release)."""
        self._drop()


# --- the factory ---------------------------------------------------------------------

_BUILTIN: dict[str, Callable[..., LeaderElector]] = {
    "local": LocalElector,
    "null": LocalElector,
    "etcd": EtcdElector,
    "postgres": PostgresElector,
}


def build_elector(kind: str = "local", **options: Any) -> LeaderElector:
    """Build the elector named ``kind`` with keyword ``options``.

    Built-ins: ``local`` (alias ``null``), ``etcd``, ``postgres``; any other name is
    loaded from the ``gpuhealth.electors`` entry points (e.g. ``kubernetes``).

    Raises:
        PluginError: Unknown ``kind``, or options the backend rejects (the message names
            the backend and the option).
    """
    factory = _BUILTIN.get(kind)
    if factory is None:
        from core.plugins import build

        return build(ELECTOR_GROUP, kind, options, expect=LeaderElector)
    try:
        return factory(**options)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"elector {kind!r} rejected its options: {exc}") from exc


# --- the driver ----------------------------------------------------------------------


class LeaderLoop:
    """Drive a :class:`LeaderElector` and keep a fenced belief of leadership.

    Each :meth:`step` renews while leading, else tries to acquire. The belief is
    valid until ``t0 + ttl_seconds - safety_margin_seconds``, where ``t0`` is this
    loop's clock *before* the successful call was sent; :attr:`is_leader` checks that
    deadline on every read, so a hung request or a paused process stops acting on
    time even before the next step. Any failed renewal steps down at once. Because the
    backend's lease starts no earlier than ``t0``, the old holder stops believing
    before the lease can pass to a standby (as long as both clocks run at the same
    rate; the margin absorbs rate error).

    Args:
        elector: The backend.
        interval_seconds: Seconds between steps (default ``ttl_seconds / 3``; > 0 and
            < ``ttl_seconds``).
        safety_margin_seconds: Subtracted from the belief deadline (>= 0, default 10 %
            of the TTL).
        on_change: Called with ``True`` on gaining and ``False`` on losing leadership,
            from the loop's thread (exceptions are logged, not raised).
        clock: Monotonic seconds (tests inject a fake).
        sleep: Sleeps between steps in :meth:`run` (default: wait on the stop event).

    Raises:
        ValueError: A bad interval or margin.
    """

    def __init__(self, elector: LeaderElector, *, interval_seconds: float | None = None,
                 safety_margin_seconds: float | None = None,
                 on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] | None = None) -> None:
        ttl = float(elector.ttl_seconds)
        interval = ttl / 3 if interval_seconds is None else float(interval_seconds)
        margin = ttl / 10 if safety_margin_seconds is None else float(safety_margin_seconds)
        if not math.isfinite(interval) or not 0 < interval < ttl:
            raise ValueError(f"interval_seconds must be in (0, ttl_seconds={ttl}), "
                             f"got {interval_seconds!r}")
        if not math.isfinite(margin) or not 0 <= margin < ttl - interval:
            raise ValueError(f"safety_margin_seconds must be in [0, ttl - interval = "
                             f"{ttl - interval}), got {safety_margin_seconds!r}")
        self.elector = elector
        self.interval_seconds = interval_seconds
        self.safety_margin_seconds = safety_margin_seconds
        self.on_change = on_change
        self.clock = clock
        self.sleep = sleep
        self._interval = interval
        self._margin = margin
        self._valid_until = -math.inf
        self._believed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def is_leader(self) -> bool:
        """Whether to act now: a successful acquire/renew whose lease has not lapsed."""
        return self._believed and self.clock() < self._valid_until

    @property
    def valid_until(self) -> float | None:
        """Clock time at which the current belief lapses, or ``None`` when not leading."""
        return self._valid_until if self._believed else None

    def _notify(self, leading: bool) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(leading)
        except Exception:
            logger.exception("leader election: on_change(%s) raised", leading)

    def _step_down(self, why: str) -> None:
        if self._believed:
            self._believed = False
            self._valid_until = -math.inf
            logger.warning("leader election: %s steps down: %s", self.elector.identity, why)
            self._notify(False)

    def step(self) -> bool:
        """Run one round (renew or try to acquire); return :attr:`is_leader` afterwards.

        Errors from the backend never escape: any exception counts as "not leader"
        (``GpuHealthError`` is logged as a warning, anything else with its traceback).
        """
        with self._lock:
            if self._believed:
                started = self.clock()
                if started >= self._valid_until:
                    self._step_down("its lease lapsed by its own clock before renewing")
                else:
                    try:
                        renewed = self.elector.renew()
                    except GpuHealthError as exc:
                        logger.warning("leader election: renew failed: %s", exc)
                        renewed = False
                    except Exception:
                        logger.exception("leader election: renew raised")
                        renewed = False
                    deadline = started + self.elector.ttl_seconds - self._margin
                    if renewed and self.clock() < deadline:
                        self._valid_until = deadline
                    else:
                        self._step_down("renewal failed" if not renewed
                                        else "renewal answered after the lease lapsed")
            if not self._believed:
                started = self.clock()
                try:
                    acquired = self.elector.try_acquire()
                except GpuHealthError as exc:
                    logger.info("leader election: cannot acquire: %s", exc)
                    acquired = False
                except Exception:
                    logger.exception("leader election: try_acquire raised")
                    acquired = False
                deadline = started + self.elector.ttl_seconds - self._margin
                if acquired and self.clock() < deadline:
                    self._believed = True
                    self._valid_until = deadline
                    logger.info("leader election: %s is leader", self.elector.identity)
                    self._notify(True)
            return self.is_leader

    def next_delay(self) -> float:
        """Seconds to wait before the next step.

        The interval, shortened to the backend's ``retry_after_seconds`` hint (plus
        0.1 s, at least 0.1 s) when a standby has been told when the holder lapses.
        """
        if self._believed:
            return self._interval
        hint = getattr(self.elector, "retry_after_seconds", None)
        if isinstance(hint, int | float) and math.isfinite(hint) and hint >= 0:
            return min(self._interval, max(0.1, hint + 0.1))
        return self._interval

    def run(self) -> None:
        """Step until :meth:`stop` is called, then release leadership."""
        try:
            while not self._stop.is_set():
                self.step()
                delay = self.next_delay()
                if self.sleep is not None:
                    self.sleep(delay)
                else:
                    self._stop.wait(delay)
        finally:
            self._release()

    async def run_async(self) -> None:
        """Like :meth:`run` in an asyncio task (steps run in a worker thread)."""
        try:
            while not self._stop.is_set():
                await asyncio.to_thread(self.step)
                await asyncio.sleep(self.next_delay())
        finally:
            await asyncio.to_thread(self._release)

    def start(self) -> threading.Thread:
        """Run :meth:`run` in a daemon thread and return it."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, daemon=True,
                                        name=f"leader-{self.elector.identity}")
        self._thread.start()
        return self._thread

    def stop(self, timeout_seconds: float | None = None) -> None:
        """Stop the loop and wait for its thread (which releases leadership)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
            self._thread = None

    def _release(self) -> None:
        with self._lock:
            was = self._believed
            self._believed = False
            self._valid_until = -math.inf
            try:
                self.elector.release()
            except GpuHealthError as exc:
                logger.warning("leader election: release failed: %s", exc)
            if was:
                self._notify(False)
