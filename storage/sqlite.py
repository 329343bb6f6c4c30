"""The embedded time-series store: one SQLite file in WAL mode.

Schema (times are integer epoch milliseconds)::

    series(id, metric, node, entity, labels)   labels: sorted JSON; one row per series
    samples(series_id, ts, value)              WITHOUT ROWID, primary key (series_id, ts)
    events(id, ts, kind, code, node, entity, message, attrs, evidence, source)

Series are dictionary-encoded so a sample row costs three integers and a float. WAL mode
lets readers in other processes read while this process writes; one process writes.
``sqlite3.OperationalError`` "database is locked"/"busy" becomes
:class:`core.errors.TemporaryError` at one seam (:func:`_mapped_errors`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd

from core.clock import Clock, system_clock
from core.errors import TemporaryError
from core.records import EntityId, EntityRef, Event, NodeName, Sample

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS series (
    id INTEGER PRIMARY KEY,
    metric TEXT NOT NULL,
    node TEXT NOT NULL,
    entity TEXT NOT NULL,
    labels TEXT NOT NULL,
    UNIQUE (metric, node, entity, labels)
);
CREATE TABLE IF NOT EXISTS samples (
    series_id INTEGER NOT NULL REFERENCES series(id),
    ts INTEGER NOT NULL,
    value REAL NOT NULL,
    PRIMARY KEY (series_id, ts)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    ts INTEGER NOT NULL,
    kind TEXT NOT NULL,
    code TEXT NOT NULL,
    node TEXT NOT NULL,
    entity TEXT NOT NULL,
    message TEXT NOT NULL,
    attrs TEXT NOT NULL,
    evidence TEXT NOT NULL,
    source TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
"""

_BASE_COLUMNS = ["observed_at", "node", "entity", "value"]
_PRUNE_EVERY_SECONDS = 3600.0


@contextlib.contextmanager
def _mapped_errors(path: str) -> Iterator[None]:
    """Translate a locked or busy database into :class:`TemporaryError`."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc).lower()
        if "locked" in text or "busy" in text:
            raise TemporaryError(f"{path}: {exc}", retry_after_seconds=1.0) from exc
        raise


def _ms(seconds: float) -> int:
    return round(seconds * 1000.0)


class SqliteStore:
    """A :class:`core.protocols.Store` in one SQLite file.

    Args:
        path: The database file; its folder is created. ``":memory:"`` for tests.
        retention_seconds: Samples and events older than this are deleted (checked at most
            hourly during writes); ``None`` keeps everything.
        busy_timeout_seconds: How long a write waits for a reader's lock before it fails
            with :class:`TemporaryError`.
        clock: Stamps samples and events whose ``observed_at`` is ``None``; epoch seconds.
    """

    def __init__(
        self,
        *,
        path: str | Path,
        retention_seconds: float | None = None,
        busy_timeout_seconds: float = 5.0,
        clock: Clock = system_clock,
    ) -> None:
        if retention_seconds is not None and retention_seconds <= 0:
            raise ValueError(f"retention_seconds must be > 0, got {retention_seconds!r}")
        self.path = path
        self.retention_seconds = retention_seconds
        self.busy_timeout_seconds = busy_timeout_seconds
        self.clock = clock
        self._name = str(path)
        if self._name != ":memory:":
            Path(self._name).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(
            self._name, timeout=busy_timeout_seconds, check_same_thread=False,
            isolation_level=None,
        )
        with _mapped_errors(self._name):
            if self._name != ":memory:":
                self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
        self._series: dict[tuple[str, str, str, str], int] = {
            (m, n, e, lab): sid
            for sid, m, n, e, lab in self._conn.execute(
                "SELECT id, metric, node, entity, labels FROM series")
        }
        self._pruned_at: float | None = None
        self._closed = False

    def write(self, samples: Sequence[Sample], events: Sequence[Event]) -> None:
        """Write a batch in one transaction.

        Raises:
            TemporaryError: The database is locked by another process; nothing was written.
        """
        if not samples and not events:
            return
        now = self.clock()
        with self._lock, _mapped_errors(self._name):
            new_series: dict[tuple[str, str, str, str], int] = {}
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                rows = []
                for s in samples:
                    key = (s.metric, str(s.node), str(s.entity),
                           json.dumps(dict(s.labels), sort_keys=True))
                    sid = self._series.get(key) or new_series.get(key)
                    if sid is None:
                        sid = self._series_id(key)
                        new_series[key] = sid
                    at = s.observed_at if s.observed_at is not None else now
                    rows.append((sid, _ms(at), float(s.value)))
                self._conn.executemany(
                    "INSERT OR REPLACE INTO samples (series_id, ts, value) VALUES (?, ?, ?)", rows)
                self._conn.executemany(
                    "INSERT INTO events (ts, kind, code, node, entity, message, attrs, evidence,"
                    " source) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (_ms(e.observed_at if e.observed_at is not None else now), e.kind, e.code,
                         str(e.node), str(e.entity), e.message,
                         json.dumps(dict(e.attrs), sort_keys=True),
                         json.dumps([[v.file, v.line, v.text] for v in e.evidence]), e.source)
                        for e in events
                    ],
                )
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            self._series.update(new_series)
            self._maybe_prune(now)

    def _series_id(self, key: tuple[str, str, str, str]) -> int:
        self._conn.execute(
            "INSERT OR IGNORE INTO series (metric, node, entity, labels) VALUES (?, ?, ?, ?)", key)
        row = self._conn.execute(
            "SELECT id FROM series WHERE metric = ? AND node = ? AND entity = ? AND labels = ?",
            key).fetchone()
        return int(row[0])

    def _maybe_prune(self, now: float) -> None:
        if self.retention_seconds is None:
            return
        if self._pruned_at is not None and now - self._pruned_at < _PRUNE_EVERY_SECONDS:
            return
        self._pruned_at = now
        cutoff = _ms(now - self.retention_seconds)
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            for sid in sorted(set(self._series.values())):
                self._conn.execute("DELETE FROM samples WHERE series_id = ? AND ts < ?",
                                   (sid, cutoff))
            self._conn.execute("DELETE FROM events WHERE ts < ?", (cutoff,))
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def read(
        self,
        metric: str,
        entities: Sequence[EntityRef] | None,
        since_at: float,
        until_at: float,
        step_seconds: float | None = None,
    ) -> pd.DataFrame:
        """Read one metric over ``[since_at, until_at]`` (epoch seconds, inclusive).

        Args:
            metric: Catalogued metric name.
            entities: Only these entities; ``None`` for all.
            since_at: Window start, epoch seconds.
            until_at: Window end, epoch seconds.
            step_seconds: When set, values are averaged per bucket of this many seconds and
                ``observed_at`` is the bucket start.

        Returns:
            Columns ``observed_at`` (float epoch seconds), ``node``, ``entity``, ``value`` and
            one column per label key, sorted by node, entity, labels and time.

        Raises:
            TemporaryError: The database is locked.
        """
        if step_seconds is not None and step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds!r}")
        where = ["s.metric = ?", "p.ts >= ?", "p.ts <= ?"]
        params: list[object] = [metric, _ms(since_at), _ms(until_at)]
        if entities is not None:
            if not entities:
                return pd.DataFrame(columns=_BASE_COLUMNS)
            pairs = " OR ".join("(s.node = ? AND s.entity = ?)" for _ in entities)
            where.append(f"({pairs})")
            for ref in entities:
                params.extend((str(ref.node), str(ref.entity)))
        if step_seconds is None:
            sql = (
                "SELECT p.ts, s.node, s.entity, p.value, s.labels FROM samples p "
                f"JOIN series s ON s.id = p.series_id WHERE {' AND '.join(where)} "
                "ORDER BY s.node, s.entity, s.labels, p.ts"
            )
        else:
            step_ms = max(1, _ms(step_seconds))
            sql = (
                f"SELECT (p.ts / {step_ms}) * {step_ms} AS bucket, s.node, s.entity, "
                "AVG(p.value), s.labels FROM samples p "
                f"JOIN series s ON s.id = p.series_id WHERE {' AND '.join(where)} "
                "GROUP BY p.series_id, bucket ORDER BY s.node, s.entity, s.labels, bucket"
            )
        with self._lock, _mapped_errors(self._name):
            rows = self._conn.execute(sql, params).fetchall()
        records: list[dict[str, object]] = []
        label_keys: set[str] = set()
        for ts, node, entity, value, labels_json in rows:
            labels = json.loads(labels_json)
            label_keys.update(labels)
            records.append({"observed_at": ts / 1000.0, "node": node, "entity": entity,
                            "value": float(value), **labels})
        columns = _BASE_COLUMNS + sorted(label_keys - set(_BASE_COLUMNS))
        return pd.DataFrame.from_records(records, columns=columns)

    def read_events(self, since_at: float, until_at: float) -> list[Event]:
        """Return the events stamped in ``[since_at, until_at]`` (epoch seconds), oldest first."""
        from core.records import Evidence

        with self._lock, _mapped_errors(self._name):
            rows = self._conn.execute(
                "SELECT ts, kind, code, node, entity, message, attrs, evidence, source "
                "FROM events WHERE ts >= ? AND ts <= ? ORDER BY ts, id",
                (_ms(since_at), _ms(until_at))).fetchall()
        return [
            Event(kind=kind, code=code, node=NodeName(node), entity=EntityId(entity),
                  observed_at=ts / 1000.0, message=message, attrs=json.loads(attrs),
                  evidence=tuple(Evidence(file=f, line=ln, text=t)
                                 for f, ln, t in json.loads(evidence)),
                  source=source)
            for ts, kind, code, node, entity, message, attrs, evidence, source in rows
        ]

    def entities(self) -> Sequence[EntityRef]:
        """List the entities with stored samples, sorted by node and entity."""
        with self._lock, _mapped_errors(self._name):
            rows = self._conn.execute(
                "SELECT DISTINCT node, entity FROM series ORDER BY node, entity").fetchall()
        return [EntityRef(node=NodeName(n), entity=EntityId(e)) for n, e in rows]

    def close(self) -> None:
        """Close the database; idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __repr__(self) -> str:
        return f"SqliteStore(path={self._name!r}, retention_seconds={self.retention_seconds!r})"
