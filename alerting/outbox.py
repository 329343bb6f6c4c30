"""A durable, bounded outbox of notifications, one queue per notifier.

Every alert and page meant for a notifier is written here first and deleted only once
the notifier took it: a SQLite file for ``gpuhealth run``, memory for replays and tests,
or the controller pair's shared PostgreSQL (:mod:`storage.sql`; schema
``storage/migrations/{sqlite,postgres}/NNNN_outbox.sql``). Delivery is in order per
notifier; a notifier that fails temporarily is retried with capped, jittered
exponential backoff (honouring ``retry_after_seconds``, e.g. PagerDuty's 429) and
blocks nobody else; one that rejects an alert for good
(:class:`~core.errors.PermanentError`) drops that alert (counted and logged). A restart
resumes from the database, so an outage of an hour, or a crash in the middle, loses
nothing.

Bounded: a newer notification about the same alert in the same state replaces the
queued one in place (a re-send of a firing alert while the receiver is down is one
entry, not one per minute), and each notifier's queue holds at most
``max_per_notifier`` entries; beyond that the oldest are dropped, counted and logged at
ERROR. The depth of each queue is :meth:`Outbox.depths` (exported as the
``gpuhealth_outbox_depth`` metric).

One deliverer per queue: several processes may share one outbox (the two replicas of a
controller pair; a leader that has not noticed yet that it lost its lease), and each
notifier's queue is delivered by one of them at a time. A process first *claims* the
queue (table ``outbox_claims``: owner and ``until_at``, taken in a transaction under
the advisory lock ``outbox`` that every write takes, so two claims never interleave),
renews the claim before each send for the send's timeout plus
:data:`CLAIM_GRACE_SECONDS`, deletes what the notifier took, and releases the claim at
the end of the round. So two live replicas never send the same entry, and the order per
notifier holds across them. A process that dies in the middle of a send leaves its
claim, which expires after at most that lease; the next deliverer then sends the entry
again (at least once: the receiver may see it twice, as after any crash between a send
and its acknowledgement). Claims are judged by the processes' clocks, which must agree
within :data:`CLAIM_GRACE_SECONDS`. An entry replaced in place while it is being sent
keeps its newer content: the deliverer deletes only the revision it sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alerting.alerts import alert_from_json, alert_to_json
from core.clock import Clock, system_clock
from core.errors import PermanentError, TemporaryError
from core.protocols import Notifier
from core.records import Alert
from storage.sql import Connection, Database, open_database

logger = logging.getLogger(__name__)

DEFAULT_MAX_PER_NOTIFIER = 10_000
"""Entries kept per notifier: 10,000 alerts, far more than an hour of changes on a big fleet."""

WRITER_LOCK = "outbox"
"""PostgreSQL advisory transaction lock that every write to the outbox takes."""

CLAIM_GRACE_SECONDS = 30.0
"""A claim lasts one send's timeout plus this long (s): the clock skew it tolerates, and
the longest wait, beyond a send's timeout, before another process delivers a queue whose
deliverer died in the middle of a send."""

_POOL_SIZE = 2
"""PostgreSQL connections per outbox (the pipeline and the HTTP API are its callers)."""


@dataclass(frozen=True, slots=True)
class _Entry:
    seq: int
    revision: int
    attempts: int
    next_at: float
    alert: Alert


@dataclass(slots=True, kw_only=True)
class DeliveryStats:
    """What one :meth:`Outbox.deliver` round did, per notifier name.

    Attributes:
        sent: Notifications delivered.
        failed: Attempts that failed temporarily (kept for retry).
        dropped: Notifications given up (permanent errors) or pushed out by the bound.
    """

    sent: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def failures(self) -> int:
        """Failed and dropped notifications, all notifiers together."""
        return sum(self.failed.values()) + sum(self.dropped.values())


def notifier_name(notifier: Notifier) -> str:
    """Return the notifier's ``name`` (its class name when it has none)."""
    return str(getattr(notifier, "name", type(notifier).__name__))


class Outbox:
    """Durable per-notifier queues of alerts with retries (see the module docstring).

    Args:
        path: SQLite file (created with its folder), ``None`` for an in-memory outbox,
            or a PostgreSQL DSN (``postgresql://...`` or libpq keywords; a controller
            pair shares it).
        clock: Returns now, epoch seconds.
        max_per_notifier: Bound of each notifier's queue, >= 1.
        backoff_initial_seconds: First retry delay, seconds.
        backoff_max_seconds: Longest retry delay, seconds (5 min: an hour's
            outage costs a dozen attempts, and delivery resumes within 5 min).
        batch_size: Most alerts handed at once to a notifier that has
            ``send_many`` (Alertmanager takes a list).
        jitter: Returns a factor in [0.8, 1.2] applied to each delay (tests pass
            ``lambda: 1.0``).
        db_timeout_seconds: PostgreSQL: connect timeout and the longest wait of one call
            for a connection, seconds (a call on a server that is down fails after it).

    Raises:
        ValueError: A bound or delay out of range.
        OSError: The SQLite folder cannot be created.
        sqlite3.DatabaseError: The file is not an outbox.
        PluginError: A PostgreSQL DSN without the controller's extra.
        TemporaryError: The PostgreSQL server cannot be reached.
    """

    def __init__(
        self,
        *,
        path: str | Path | None = None,
        clock: Clock = system_clock,
        max_per_notifier: int = DEFAULT_MAX_PER_NOTIFIER,
        backoff_initial_seconds: float = 1.0,
        backoff_max_seconds: float = 300.0,
        batch_size: int = 500,
        jitter: Callable[[], float] | None = None,
        db_timeout_seconds: float = 10.0,
    ) -> None:
        if max_per_notifier < 1:
            raise ValueError(f"max_per_notifier must be >= 1, got {max_per_notifier!r}")
        if not 0 < backoff_initial_seconds <= backoff_max_seconds:
            raise ValueError("need 0 < backoff_initial_seconds <= backoff_max_seconds")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.path = path
        self.clock = clock
        self.max_per_notifier = max_per_notifier
        self.backoff_initial_seconds = backoff_initial_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self.batch_size = batch_size
        self.jitter = jitter
        self.db_timeout_seconds = db_timeout_seconds
        self.dropped: dict[str, int] = {}
        """Notifications dropped per notifier since start (bound or permanent error)."""
        self.db: Database = open_database(path, pool_size=_POOL_SIZE,
                                          timeout_seconds=db_timeout_seconds,
                                          sqlite_synchronous="NORMAL")
        try:
            self.db.migrate("outbox")
        except BaseException:
            self.db.close()
            raise
        self.where = self.db.where
        """The file or ``host:port/dbname`` for messages (never a password)."""
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        """Who this outbox is in ``outbox_claims`` (unique per object)."""
        self._lock = threading.RLock()
        self._delivering: set[str] = set()
        self._unavailable = False
        self._unsaved: list[tuple[str, list[Alert], float]] = []

    def close(self) -> None:
        """Release this outbox's claims (best effort) and close the database."""
        with self._lock:
            if self._unsaved:
                self._flush()
            if self._unsaved:  # the database is still away: do not wait for it twice
                logger.error("outbox %s unavailable at close: %d notification(s) not kept "
                             "(a new leader sends the active alerts again)", self.where,
                             self.unsaved())
            else:
                try:
                    with self._transaction() as db:
                        db.execute("DELETE FROM outbox_claims WHERE owner = ?", (self.owner,))
                except TemporaryError as exc:
                    logger.info("outbox %s: claims not released at close (they expire): %s",
                                self.where, exc)
            self.db.close()

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        """One write transaction (one writer at a time, across every process)."""
        with self._lock, self.db.transaction(lock=WRITER_LOCK) as db:
            yield db

    def _rows(self, sql: str, args: Sequence[object] = ()) -> list[Any]:
        with self._lock:
            return self.db.execute(sql, args)

    # --- what the notifiers were told is firing -------------------------------------

    def notified(self) -> dict[str, Alert]:
        """The alerts the notifiers were told are firing (and not resolved), by fingerprint.

        Raises:
            TemporaryError: The shared database cannot be read now.
        """
        out: dict[str, Alert] = {}
        for fp, body in self._rows("SELECT fingerprint, body FROM outbox_notified"):
            try:
                out[str(fp)] = alert_from_json(json.loads(body))
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("outbox_notified %s: unreadable, skipped: %s", fp, exc)
        return out

    def mark_notified(self, firing: Sequence[Alert], resolved: Sequence[str]) -> None:
        """Record that ``firing`` were sent as firing and ``resolved`` (fingerprints) resolved.

        Best effort: a failure is logged (the worst case is one notification again after a
        restart or a fail-over).
        """
        if not firing and not resolved:
            return
        now = self.clock()
        try:
            with self._transaction() as db:
                if resolved:
                    db.executemany("DELETE FROM outbox_notified WHERE fingerprint = ?",
                                   [(fp,) for fp in resolved])
                if firing:
                    db.executemany(
                        "INSERT INTO outbox_notified (fingerprint, body, notified_at) "
                        "VALUES (?, ?, ?) ON CONFLICT (fingerprint) DO UPDATE SET "
                        "body = excluded.body, notified_at = excluded.notified_at",
                        [(a.fingerprint, json.dumps(alert_to_json(a), sort_keys=True), now)
                         for a in firing])
        except (TemporaryError, sqlite3.Error, OSError) as exc:
            logger.warning("outbox %s: what was notified is not recorded: %s", self.where, exc)

    # --- queueing ----------------------------------------------------------------------

    def enqueue(self, name: str, alerts: Sequence[Alert]) -> int:
        """Queue ``alerts`` for notifier ``name``; return how many were dropped by the bound.

        A notification about an alert whose last queued entry has the same state
        replaces that entry in place (same position, newest content). While the
        database cannot be reached (PostgreSQL away), the notifications wait in memory,
        in order and within the same bound, and are written by the next call that can
        (an :meth:`enqueue` or a :meth:`deliver`); the outage is logged once.
        """
        if not alerts:
            return 0
        with self._lock:
            self._unsaved.append((name, list(alerts), self.clock()))
            dropped = self._trim_unsaved(name)
            return dropped + self._flush()

    def _trim_unsaved(self, name: str) -> int:
        """Keep at most ``max_per_notifier`` of ``name``'s notifications in memory."""
        over = sum(len(a) for n, a, _ in self._unsaved if n == name) - self.max_per_notifier
        dropped = max(0, over)
        for _, batch, _ in (u for u in self._unsaved if u[0] == name):
            if over <= 0:
                break
            cut = min(over, len(batch))
            del batch[:cut]
            over -= cut
        self._unsaved = [u for u in self._unsaved if u[1]]
        if dropped:
            self._count_dropped(name, dropped)
        return dropped

    def _flush(self) -> int:
        """Write what waits in memory, oldest first; return how many the bound dropped."""
        dropped = 0
        with self._lock:
            while self._unsaved:
                name, alerts, at = self._unsaved[0]
                try:
                    dropped += self._write(name, alerts, at)
                except TemporaryError as exc:
                    if not self._unavailable:
                        self._unavailable = True
                        logger.warning("outbox %s unavailable: notifications wait in memory "
                                       "until it is back: %s", self.where, exc)
                    return dropped
                self._unsaved.pop(0)
                if self._unavailable:
                    self._unavailable = False
                    logger.warning("outbox %s reachable again", self.where)
        return dropped

    def _write(self, name: str, alerts: Sequence[Alert], now: float) -> int:
        with self._transaction() as db:
            fingerprints = {a.fingerprint for a in alerts}
            if len(alerts) > 1 and len(fingerprints) == len(alerts):
                # a burst's alerts: one read of the latest rows and one round trip for
                # the updates and one for the inserts, not two per alert
                latest = {str(fp): (int(seq), str(state)) for fp, seq, state in db.execute(
                    "SELECT fingerprint, seq, state FROM outbox WHERE seq IN (SELECT "
                    "max(seq) FROM outbox WHERE notifier = ? GROUP BY fingerprint)",
                    (name,)).fetchall() if fp in fingerprints}
                updates: list[tuple[str, int]] = []
                inserts: list[tuple[str, str, str, str, float]] = []
                for alert in alerts:
                    body = _body(alert)
                    row = latest.get(alert.fingerprint)
                    if row is not None and row[1] == alert.state.value:
                        updates.append((body, row[0]))
                    else:
                        inserts.append((name, alert.fingerprint, alert.state.value, body, now))
                db.executemany(_UPDATE_BODY, updates)
                db.executemany(_INSERT_ENTRY, inserts)
            else:
                for alert in alerts:
                    body = _body(alert)
                    row = db.execute(
                        "SELECT seq, state FROM outbox WHERE notifier = ? AND fingerprint = ? "
                        "ORDER BY seq DESC LIMIT 1", (name, alert.fingerprint)).fetchone()
                    if row is not None and row[1] == alert.state.value:
                        db.execute(_UPDATE_BODY, (body, row[0]))
                    else:
                        db.execute(_INSERT_ENTRY,
                                   (name, alert.fingerprint, alert.state.value, body, now))
            over = int(db.execute("SELECT COUNT(*) FROM outbox WHERE notifier = ?",
                                  (name,)).fetchone()[0]) - self.max_per_notifier
            if over > 0:
                db.execute("DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE "
                           "notifier = ? ORDER BY seq LIMIT ?)", (name, over))
        if over > 0:
            self._count_dropped(name, over)
            return over
        return 0

    def _count_dropped(self, name: str, count: int) -> None:
        self.dropped[name] = self.dropped.get(name, 0) + count
        logger.error("outbox of notifier %s full (%d): dropped the %d oldest notification(s)",
                     name, self.max_per_notifier, count)

    def unsaved(self) -> int:
        """Return the notifications waiting in memory for the database to come back."""
        with self._lock:
            return sum(len(a) for _, a, _ in self._unsaved)

    def depths(self) -> dict[str, int]:
        """Return the queued notifications per notifier name.

        Raises:
            TemporaryError: PostgreSQL cannot be reached.
        """
        rows = self._rows("SELECT notifier, COUNT(*) FROM outbox GROUP BY notifier")
        return {str(name): int(count) for name, count in rows}

    def queued(self, name: str) -> list[Alert]:
        """Return the alerts queued for notifier ``name``, oldest first."""
        rows = self._rows("SELECT body FROM outbox WHERE notifier = ? ORDER BY seq", (name,))
        return [alert_from_json(json.loads(body)) for (body,) in rows]

    def next_attempt_at(self, name: str) -> float | None:
        """Return when notifier ``name``'s head entry is due (epoch seconds), or ``None``."""
        rows = self._rows("SELECT next_at FROM outbox WHERE notifier = ? ORDER BY seq "
                          "LIMIT 1", (name,))
        return float(rows[0][0]) if rows else None

    # --- claims ------------------------------------------------------------------------

    def claim(self, name: str, *, seconds: float) -> bool:
        """Claim notifier ``name``'s queue for ``seconds``; return whether this outbox holds it.

        Another owner's unexpired claim is left alone; this outbox's own claim is renewed.
        """
        now = self.clock()
        with self._transaction() as db:
            row = db.execute("SELECT owner, until_at FROM outbox_claims WHERE notifier = ?",
                             (name,)).fetchone()
            if row is not None and str(row[0]) != self.owner and float(row[1]) > now:
                return False
            db.execute("INSERT INTO outbox_claims (notifier, owner, until_at) VALUES (?, ?, ?) "
                       "ON CONFLICT (notifier) DO UPDATE SET owner = excluded.owner, "
                       "until_at = excluded.until_at", (name, self.owner, now + seconds))
        return True

    def release(self, name: str) -> None:
        """Give up the claim on notifier ``name``'s queue (if this outbox holds it)."""
        with self._transaction() as db:
            db.execute("DELETE FROM outbox_claims WHERE notifier = ? AND owner = ?",
                       (name, self.owner))

    # --- delivery ----------------------------------------------------------------------

    def _head(self, name: str, limit: int) -> list[_Entry]:
        rows = self._rows("SELECT seq, revision, attempts, next_at, body FROM outbox "
                          "WHERE notifier = ? ORDER BY seq LIMIT ?", (name, limit))
        out: list[_Entry] = []
        for seq, revision, attempts, next_at, body in rows:
            try:
                out.append(_Entry(int(seq), int(revision), int(attempts), float(next_at),
                                  alert_from_json(json.loads(body))))
            except ValueError:
                logger.exception("outbox entry %s of %s unreadable; dropped", seq, name)
                self._delete([(int(seq), int(revision))])
        return out

    def _delete(self, entries: Sequence[tuple[int, int]]) -> None:
        """Delete entries ``(seq, revision)``; one replaced since (a newer revision) stays."""
        if not entries:
            return
        with self._transaction() as db:
            db.executemany("DELETE FROM outbox WHERE seq = ? AND revision = ?",
                           [list(e) for e in entries])

    def _defer(self, entry: _Entry, retry_after: float | None) -> float:
        delay = min(self.backoff_max_seconds,
                    self.backoff_initial_seconds * (2.0 ** min(entry.attempts, 30)))
        factor = self.jitter() if self.jitter is not None else random.uniform(0.8, 1.2)
        delay *= factor
        if retry_after is not None:
            delay = max(delay, retry_after)
        next_at = self.clock() + delay
        with self._transaction() as db:
            db.execute("UPDATE outbox SET attempts = ?, next_at = ? WHERE seq = ?",
                       (entry.attempts + 1, next_at, entry.seq))
        return delay

    async def deliver(
        self,
        notifiers: Mapping[str, Notifier],
        *,
        timeout_seconds: float = 30.0,
        force: bool = False,
    ) -> DeliveryStats:
        """Deliver what is due to every notifier, concurrently, in order per notifier.

        Notifications waiting in memory (:meth:`enqueue`) are written first. A queue that
        another process (or another call on this outbox) is delivering is left to it. An
        unreachable PostgreSQL is logged once and ends the round; what is queued stays
        queued.

        Args:
            notifiers: Notifiers by name.
            timeout_seconds: Longest wait for one ``send`` (or ``send_many``), seconds.
            force: Try every queue now, ignoring backoff (end of a replay, shutdown).

        Returns:
            What was sent, failed and dropped, per notifier name.
        """
        stats = DeliveryStats()
        self._flush()
        await asyncio.gather(*(
            self._deliver_one(name, notifier, stats, timeout_seconds, force)
            for name, notifier in notifiers.items()
        ))
        return stats

    async def _deliver_one(self, name: str, notifier: Notifier, stats: DeliveryStats,
                           timeout_seconds: float, force: bool) -> None:
        with self._lock:
            if name in self._delivering:
                return
            self._delivering.add(name)
        claimed = False
        try:
            claimed = await self._deliver_claimed(name, notifier, stats, timeout_seconds,
                                                  force)
            if self._unavailable:
                self._unavailable = False
                logger.warning("outbox %s reachable again", self.where)
        except TemporaryError as exc:  # the database, not the notifier (handled inside)
            claimed = True  # it may have been taken; releasing a claim not held is harmless
            if not self._unavailable:
                self._unavailable = True
                logger.warning("outbox %s unavailable, delivery waits: %s", self.where, exc)
        finally:
            with self._lock:
                self._delivering.discard(name)
            if claimed:
                with contextlib.suppress(TemporaryError):  # else it expires
                    self.release(name)

    async def _deliver_claimed(self, name: str, notifier: Notifier, stats: DeliveryStats,
                               timeout_seconds: float, force: bool) -> bool:
        """The delivery loop of one queue; return whether a claim was taken."""
        send_many = getattr(notifier, "send_many", None)
        batched = callable(send_many)
        lease = timeout_seconds + CLAIM_GRACE_SECONDS
        claimed = False
        while True:
            if not claimed:  # a plain read first: no write for an empty or waiting queue
                peek = self._head(name, 1)
                if not peek or (not force and peek[0].next_at > self.clock()):
                    return claimed
            if not self.claim(name, seconds=lease):
                return claimed  # another process delivers this queue now
            claimed = True
            head = self._head(name, self.batch_size if batched else 1)
            if not head or (not force and head[0].next_at > self.clock()):
                return claimed
            alerts = [h.alert for h in head]
            try:
                if batched and send_many is not None:
                    await asyncio.wait_for(send_many(alerts), timeout_seconds)
                else:
                    await asyncio.wait_for(notifier.send(alerts[0]), timeout_seconds)
            except PermanentError as exc:
                if len(head) > 1:
                    batched = False  # find the one the receiver refuses; keep the others
                    continue
                self._delete([(head[0].seq, head[0].revision)])
                stats.dropped[name] = stats.dropped.get(name, 0) + 1
                self.dropped[name] = self.dropped.get(name, 0) + 1
                logger.warning("notifier %s rejected alert %s for good, dropped: %s",
                               name, alerts[0].fingerprint, exc)
                continue
            except (TemporaryError, TimeoutError, OSError) as exc:
                retry_after = getattr(exc, "retry_after_seconds", None)
                delay = self._defer(head[0], retry_after)
                stats.failed[name] = stats.failed.get(name, 0) + 1
                logger.warning("notifier %s could not deliver (retry in %.1f s, %d queued): %s",
                               name, delay, self.depths().get(name, 0), exc or "timed out")
                return claimed
            except Exception as exc:
                delay = self._defer(head[0], None)
                stats.failed[name] = stats.failed.get(name, 0) + 1
                logger.exception("notifier %s failed (retry in %.1f s)", name, delay,
                                 exc_info=exc)
                return claimed
            stats.sent[name] = stats.sent.get(name, 0) + len(head)
            self._delete([(h.seq, h.revision) for h in head])
            # Give the loop back between batches even where nothing above awaited (a
            # notifier that never waits): a controller delivers on its consumer's loop,
            # and a backlog after a fail-over must not hold a cordon decision behind it.
            await asyncio.sleep(0)


def outbox_to_json(outbox: Outbox) -> dict[str, Any]:
    """Return the outbox depths and drop counts as JSON (for the HTTP API)."""
    return {"depths": outbox.depths(), "dropped": dict(outbox.dropped)}


def _body(alert: Alert) -> str:
    return json.dumps(alert_to_json(alert), sort_keys=True, separators=(",", ":"))


_UPDATE_BODY = "UPDATE outbox SET body = ?, revision = revision + 1 WHERE seq = ?"
_INSERT_ENTRY = ("INSERT INTO outbox (notifier, fingerprint, state, body, enqueued_at) "
                 "VALUES (?, ?, ?, ?, ?)")
