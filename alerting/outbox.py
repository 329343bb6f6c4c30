"""A durable, bounded outbox of notifications, one queue per notifier.

Every alert and page meant for a notifier is written here first (SQLite; a file
for ``gpuhealth run``, memory for replays and tests) and deleted only once the
notifier took it. Delivery is in order per notifier; a notifier that fails
temporarily is retried with capped, jittered exponential backoff (honouring
``retry_after_seconds``, e.g. PagerDuty's 429) and blocks nobody else; one that
rejects an alert for good (:class:`~core.errors.PermanentError`) drops that alert
(counted and logged). A restart resumes from the file, so an outage of an hour,
or a crash in the middle, loses nothing.

Bounded: a newer notification about the same alert in the same state replaces
the queued one in place (a re-send of a firing alert while the receiver is down
is one entry, not one per minute), and each notifier's queue holds at most
``max_per_notifier`` entries; beyond that the oldest are dropped, counted and
logged at ERROR. The depth of each queue is :meth:`Outbox.depths` (exported as
the ``gpuhealth_outbox_depth`` metric).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alerting.alerts import alert_from_json, alert_to_json
from core.clock import Clock, system_clock
from core.errors import PermanentError, TemporaryError
from core.protocols import Notifier
from core.records import Alert

logger = logging.getLogger(__name__)

DEFAULT_MAX_PER_NOTIFIER = 10_000
"""Entries kept per notifier: 10,000 alerts, far more than an hour of changes on a big fleet."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    notifier TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    state TEXT NOT NULL,
    body TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL DEFAULT 0,
    enqueued_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_by_notifier ON outbox (notifier, seq);
CREATE INDEX IF NOT EXISTS outbox_by_alert ON outbox (notifier, fingerprint, seq);
"""


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
    """Durable per-notifier queues of alerts with retries.

    Args:
        path: SQLite file, or ``None`` for an in-memory outbox.
        clock: Returns now, epoch seconds.
        max_per_notifier: Bound of each notifier's queue, >= 1.
        backoff_initial_seconds: First retry delay, seconds.
        backoff_max_seconds: Longest retry delay, seconds (5 min: an hour's
            outage costs a dozen attempts, and delivery resumes within 5 min).
        batch_size: Most alerts handed at once to a notifier that has
            ``send_many`` (Alertmanager takes a list).
        jitter: Returns a factor in [0.8, 1.2] applied to each delay (tests pass
            ``lambda: 1.0``).

    Raises:
        ValueError: A bound or delay out of range.
    """

    def __init__(
        self,
        *,
        path: str | None = None,
        clock: Clock = system_clock,
        max_per_notifier: int = DEFAULT_MAX_PER_NOTIFIER,
        backoff_initial_seconds: float = 1.0,
        backoff_max_seconds: float = 300.0,
        batch_size: int = 500,
        jitter: Callable[[], float] | None = None,
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
        self.dropped: dict[str, int] = {}
        """Notifications dropped per notifier since start (bound or permanent error)."""
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False,
                                   isolation_level=None)
        self._lock = threading.RLock()
        with self._lock:
            if path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    # --- queueing ----------------------------------------------------------------------

    def enqueue(self, name: str, alerts: Sequence[Alert]) -> int:
        """Queue ``alerts`` for notifier ``name``; return how many were dropped by the bound.

        A notification about an alert whose last queued entry has the same state
        replaces that entry in place (same position, newest content).
        """
        if not alerts:
            return 0
        now = self.clock()
        with self._lock:
            db = self._db
            db.execute("BEGIN")
            try:
                for alert in alerts:
                    body = json.dumps(alert_to_json(alert), sort_keys=True,
                                      separators=(",", ":"))
                    row = db.execute(
                        "SELECT seq, state FROM outbox WHERE notifier=? AND fingerprint=? "
                        "ORDER BY seq DESC LIMIT 1",
                        (name, alert.fingerprint),
                    ).fetchone()
                    if row is not None and row[1] == alert.state.value:
                        db.execute("UPDATE outbox SET body=? WHERE seq=?", (body, row[0]))
                    else:
                        db.execute(
                            "INSERT INTO outbox (notifier, fingerprint, state, body, enqueued_at)"
                            " VALUES (?, ?, ?, ?, ?)",
                            (name, alert.fingerprint, alert.state.value, body, now),
                        )
                over = int(db.execute("SELECT COUNT(*) FROM outbox WHERE notifier=?",
                                      (name,)).fetchone()[0]) - self.max_per_notifier
                if over > 0:
                    db.execute(
                        "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE "
                        "notifier=? ORDER BY seq LIMIT ?)",
                        (name, over),
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        if over > 0:
            self.dropped[name] = self.dropped.get(name, 0) + over
            logger.error("outbox of notifier %s full (%d): dropped the %d oldest notification(s)",
                         name, self.max_per_notifier, over)
            return over
        return 0

    def depths(self) -> dict[str, int]:
        """Return the queued notifications per notifier name."""
        with self._lock:
            rows = self._db.execute(
                "SELECT notifier, COUNT(*) FROM outbox GROUP BY notifier").fetchall()
        return {str(name): int(count) for name, count in rows}

    def queued(self, name: str) -> list[Alert]:
        """Return the alerts queued for notifier ``name``, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT body FROM outbox WHERE notifier=? ORDER BY seq", (name,)).fetchall()
        return [alert_from_json(json.loads(body)) for (body,) in rows]

    def next_attempt_at(self, name: str) -> float | None:
        """Return when notifier ``name``'s head entry is due (epoch seconds), or ``None``."""
        with self._lock:
            row = self._db.execute(
                "SELECT next_at FROM outbox WHERE notifier=? ORDER BY seq LIMIT 1",
                (name,)).fetchone()
        return float(row[0]) if row is not None else None

    # --- delivery ----------------------------------------------------------------------

    def _head(self, name: str, limit: int) -> list[tuple[int, int, float, Alert]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, attempts, next_at, body FROM outbox WHERE notifier=? "
                "ORDER BY seq LIMIT ?", (name, limit)).fetchall()
        out: list[tuple[int, int, float, Alert]] = []
        for seq, attempts, next_at, body in rows:
            try:
                out.append((int(seq), int(attempts), float(next_at),
                            alert_from_json(json.loads(body))))
            except ValueError:
                logger.exception("outbox entry %s of %s unreadable; dropped", seq, name)
                self._delete([int(seq)])
        return out

    def _delete(self, seqs: Sequence[int]) -> None:
        if not seqs:
            return
        with self._lock:
            self._db.executemany("DELETE FROM outbox WHERE seq=?", [(s,) for s in seqs])

    def _defer(self, seq: int, attempts: int, retry_after: float | None) -> float:
        delay = min(self.backoff_max_seconds,
                    self.backoff_initial_seconds * (2.0 ** min(attempts, 30)))
        factor = self.jitter() if self.jitter is not None else random.uniform(0.8, 1.2)
        delay *= factor
        if retry_after is not None:
            delay = max(delay, retry_after)
        next_at = self.clock() + delay
        with self._lock:
            self._db.execute("UPDATE outbox SET attempts=?, next_at=? WHERE seq=?",
                             (attempts + 1, next_at, seq))
        return delay

    async def deliver(
        self,
        notifiers: Mapping[str, Notifier],
        *,
        timeout_seconds: float = 30.0,
        force: bool = False,
    ) -> DeliveryStats:
        """Deliver what is due to every notifier, concurrently, in order per notifier.

        Args:
            notifiers: Notifiers by name.
            timeout_seconds: Longest wait for one ``send`` (or ``send_many``), seconds.
            force: Try every queue now, ignoring backoff (end of a replay, shutdown).

        Returns:
            What was sent, failed and dropped, per notifier name.
        """
        stats = DeliveryStats()
        await asyncio.gather(*(
            self._deliver_one(name, notifier, stats, timeout_seconds, force)
            for name, notifier in notifiers.items()
        ))
        return stats

    async def _deliver_one(self, name: str, notifier: Notifier, stats: DeliveryStats,
                           timeout_seconds: float, force: bool) -> None:
        send_many = getattr(notifier, "send_many", None)
        batched = callable(send_many)
        while True:
            head = self._head(name, self.batch_size if batched else 1)
            if not head:
                return
            if not force and head[0][2] > self.clock():
                return
            seqs = [h[0] for h in head]
            alerts = [h[3] for h in head]
            try:
                if batched and send_many is not None:
                    await asyncio.wait_for(send_many(alerts), timeout_seconds)
                else:
                    await asyncio.wait_for(notifier.send(alerts[0]), timeout_seconds)
            except PermanentError as exc:
                if len(seqs) > 1:
                    batched = False  # find the one the receiver refuses; keep the others
                    continue
                self._delete(seqs)
                stats.dropped[name] = stats.dropped.get(name, 0) + 1
                self.dropped[name] = self.dropped.get(name, 0) + 1
                logger.warning("notifier %s rejected alert %s for good, dropped: %s",
                               name, alerts[0].fingerprint, exc)
                continue
            except (TemporaryError, TimeoutError, OSError) as exc:
                retry_after = getattr(exc, "retry_after_seconds", None)
                delay = self._defer(head[0][0], head[0][1], retry_after)
                stats.failed[name] = stats.failed.get(name, 0) + 1
                logger.warning("notifier %s could not deliver (retry in %.1f s, %d queued): %s",
                               name, delay, self.depths().get(name, 0), exc or "timed out")
                return
            except Exception as exc:
                delay = self._defer(head[0][0], head[0][1], None)
                stats.failed[name] = stats.failed.get(name, 0) + 1
                logger.exception("notifier %s failed (retry in %.1f s)", name, delay,
                                 exc_info=exc)
                return
            self._delete(seqs)
            stats.sent[name] = stats.sent.get(name, 0) + len(seqs)


def outbox_to_json(outbox: Outbox) -> dict[str, Any]:
    """Return the outbox depths and drop counts as JSON (for the HTTP API)."""
    return {"depths": outbox.depths(), "dropped": dict(outbox.dropped)}
