"""The embedded time-series store: one SQLite file in WAL mode, chunked and columnar.

Recent samples are rows; older ones are compressed columnar chunks per series and window.

Schema (times are integer epoch milliseconds)::

    series(id, metric, node, entity, labels)        labels: sorted JSON; one row per series
    samples(series_id, ts, value)                   the head: recent samples, one row each,
        appended without an index (the write path is one ``executemany``)
    chunks(step, series_id, start_ts, n, ts, vals)  primary key (step, series_id, start_ts)
        step 0: one series over one ``chunk_seconds`` window, timestamps delta-encoded,
        both columns zlib-compressed numpy arrays; step > 0: a downsampling tier whose
        ``vals`` holds sum, count, min and max per bucket
    events(id, ts, kind, code, node, entity, message, attrs, evidence, source)

Why: a row per sample with a (series, time) B-tree caps ingest near 100k samples/s, and a
GPU-week read (30 metrics x 60k points) through Python tuples takes seconds. Appending to an
unindexed head runs at over a million rows a second, and a closed window of one series
decodes with two ``zlib.decompress`` and ``numpy.frombuffer`` calls.

Compaction: once a window has been closed for ``compact_delay_seconds`` (2 h: late data from
a spool replay after an outage, or from clock skew, then lands in the head instead of
forcing chunk rewrites), its head rows are read in one pass, regrouped by series into one
raw chunk per window plus one chunk per downsampling tier, and deleted. It runs during
writes at most every ``compact_interval_seconds`` (store clock); when the head holds more
than ``max_head_rows`` samples every closed window is compacted at once. A
sample that arrives late for a window already compacted is merged into that window's
chunk. The last write of a (series, timestamp) wins, as ``INSERT OR REPLACE`` did in the
first version (whose ``WITHOUT ROWID`` samples table is converted when such a file is
opened).

Retention: raw chunks older than ``retention_seconds`` and tier chunks older than their
tier's retention are deleted (checked at most hourly during writes); raw reads never return
samples older than ``retention_seconds`` even before that. Reads with ``step_seconds`` use
raw data where it is kept and the finest tier before it (mean = sum of sums / sum of
counts), so a 90-day view keeps working after raw data is gone.

WAL mode lets readers in other processes read while this process writes; one process
writes. ``sqlite3.OperationalError`` "database is locked"/"busy" becomes
:class:`core.errors.TemporaryError` at one seam (:func:`_mapped_errors`). The write path is
synchronous on purpose: SQLite is local, a write takes milliseconds, and the service calls
it from its one writer thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from core.clock import Clock, system_clock
from core.errors import TemporaryError
from core.records import EntityId, EntityRef, Event, Evidence, NodeName, Sample
from storage.sanitize import MAX_FUTURE_SECONDS, check_events, check_samples

if TYPE_CHECKING:
    import pandas as pd  # reads only (~50 MiB): an agent that only writes never loads it

logger = logging.getLogger(__name__)

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

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
    series_id INTEGER NOT NULL,
    ts INTEGER NOT NULL,
    value REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    step INTEGER NOT NULL,
    series_id INTEGER NOT NULL,
    start_ts INTEGER NOT NULL,
    n INTEGER NOT NULL,
    ts BLOB NOT NULL,
    vals BLOB NOT NULL,
    PRIMARY KEY (step, series_id, start_ts)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_age ON chunks (step, start_ts);
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

_EVENTS_IDENTITY = (
    "CREATE UNIQUE INDEX IF NOT EXISTS events_identity"
    " ON events (ts, kind, code, node, entity, message)"
)

_BASE_COLUMNS = ["observed_at", "node", "entity", "value"]
_PRUNE_EVERY_SECONDS = 3600.0
_IN_BATCH = 900
DEFAULT_DOWNSAMPLE: tuple[tuple[float, float], ...] = ((60.0, 90 * 86400.0),)
"""Default tiers ``(step_seconds, retention_seconds)``: 1-minute aggregates for 90 days."""


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


def _enc_ts(ts: I64) -> bytes:
    return zlib.compress(np.diff(ts, prepend=np.int64(0)).astype("<i8").tobytes(), 1)


def _dec_ts(blob: bytes) -> I64:
    return np.cumsum(np.frombuffer(zlib.decompress(blob), dtype="<i8")).astype(np.int64)


def _enc_vals(vals: F64) -> bytes:
    return zlib.compress(vals.astype("<f8").tobytes(), 1)


def _dec_vals(blob: bytes) -> F64:
    return np.frombuffer(zlib.decompress(blob), dtype="<f8").astype(np.float64)


def _last_wins(sid: I64, ts: I64, val: F64) -> tuple[I64, I64, F64]:
    """Sort by (series, time), keeping the last written value of each duplicate pair."""
    order = np.lexsort((ts, sid))  # stable: equal keys keep write order
    sid, ts, val = sid[order], ts[order], val[order]
    if len(sid) > 1:
        keep = np.ones(len(sid), dtype=bool)
        keep[:-1] = (sid[1:] != sid[:-1]) | (ts[1:] != ts[:-1])
        sid, ts, val = sid[keep], ts[keep], val[keep]
    return sid, ts, val


def _groups(sid: I64) -> Iterator[tuple[int, int, int]]:
    """Yield ``(series_id, start, stop)`` runs of a sorted id column."""
    if len(sid) == 0:
        return
    cuts = np.flatnonzero(sid[1:] != sid[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [len(sid)]))
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        yield int(sid[a]), a, b


def _rollup(ts: I64, val: F64, step_ms: int) -> tuple[I64, F64]:
    """Aggregate sorted samples into buckets: (bucket starts, [sum | count | min | max])."""
    bucket = ts // step_ms * step_ms
    starts = np.concatenate(([0], np.flatnonzero(bucket[1:] != bucket[:-1]) + 1))
    counts = np.diff(np.concatenate((starts, [len(ts)]))).astype(np.float64)
    agg = np.concatenate((np.add.reduceat(val, starts), counts,
                          np.minimum.reduceat(val, starts), np.maximum.reduceat(val, starts)))
    return bucket[starts].astype(np.int64), agg


def _combine_rollups(parts: Sequence[tuple[I64, F64]]) -> tuple[I64, F64]:
    """Add rollups of the same buckets (late data whose raw chunk was already pruned)."""
    ts = np.concatenate([p[0] for p in parts])
    aggs = [p[1].reshape(4, -1) for p in parts]
    sums = np.concatenate([a[0] for a in aggs])
    cnts = np.concatenate([a[1] for a in aggs])
    mins = np.concatenate([a[2] for a in aggs])
    maxs = np.concatenate([a[3] for a in aggs])
    uniq, inv = np.unique(ts, return_inverse=True)
    out = np.zeros((4, len(uniq)))
    np.add.at(out[0], inv, sums)
    np.add.at(out[1], inv, cnts)
    out[2] = np.inf
    out[3] = -np.inf
    np.minimum.at(out[2], inv, mins)
    np.maximum.at(out[3], inv, maxs)
    return uniq.astype(np.int64), out.reshape(-1)


class SqliteStore:
    """A :class:`core.protocols.Store` in one SQLite file.

    Args:
        path: The database file; its folder is created. ``":memory:"`` for tests.
        retention_seconds: Raw samples (and, unless ``events_retention_seconds`` is set,
            events) older than this are deleted; ``None`` keeps raw data forever.
        downsample: Tiers ``(step_seconds, retention_seconds)``, e.g. the default
            ``((60, 90 days),)``: per-bucket sum, count, min and max kept that long. Each
            step must divide ``chunk_seconds``. ``()`` keeps no aggregates.
        events_retention_seconds: How long events are kept; default the longest of
            ``retention_seconds`` and the tiers' retentions (events are rare and precious).
        chunk_seconds: Width of one chunk window; 1 h holds 360 points at 10 s resolution
            and 3,600 at 1 Hz.
        compact_interval_seconds: Closed windows are compacted at most this often (store
            clock), or sooner when the head holds more than ``max_head_rows`` samples.
        compact_delay_seconds: How long after its end a window is compacted.
        max_head_rows: Head samples that force a compaction of closed windows (bounds the
            full scans of reads that reach into the head).
        max_future_seconds: Samples stamped further ahead of the clock are rejected.
        min_at: Samples stamped before this epoch second are rejected. The embedded store
            accepts any non-negative time by default (replays of synthetic data use small
            epochs) and relies on retention for old data; remote stores use
            :data:`storage.sanitize.MIN_AT` (2000-01-01).
        busy_timeout_seconds: How long a write waits for a reader's lock before it fails
            with :class:`TemporaryError`.
        clock: Stamps samples and events whose ``observed_at`` is ``None``; epoch seconds.

    Attributes:
        rejected: Reason → samples and events rejected or converted (see
            :mod:`storage.sanitize`); the service exports it as
            ``gpuhealth_store_rejected_total{reason}``.
    """

    def __init__(
        self,
        *,
        path: str | Path,
        retention_seconds: float | None = None,
        downsample: Sequence[tuple[float, float]] = DEFAULT_DOWNSAMPLE,
        events_retention_seconds: float | None = None,
        chunk_seconds: float = 3600.0,
        compact_interval_seconds: float = 60.0,
        compact_delay_seconds: float = 7200.0,
        max_head_rows: int = 5_000_000,
        max_future_seconds: float = MAX_FUTURE_SECONDS,
        min_at: float = 0.0,
        busy_timeout_seconds: float = 5.0,
        clock: Clock = system_clock,
    ) -> None:
        if retention_seconds is not None and retention_seconds <= 0:
            raise ValueError(f"retention_seconds must be > 0, got {retention_seconds!r}")
        if chunk_seconds <= 0 or _ms(chunk_seconds) <= 0:
            raise ValueError(f"chunk_seconds must be > 0, got {chunk_seconds!r}")
        for step, keep in downsample:
            if step <= 0 or keep <= 0 or _ms(chunk_seconds) % _ms(step):
                raise ValueError(f"downsample tier ({step!r}, {keep!r}): step and retention "
                                 f"must be > 0 and step must divide chunk_seconds")
        self.path = path
        self.retention_seconds = retention_seconds
        self.downsample = tuple((float(a), float(b)) for a, b in downsample)
        self.events_retention_seconds = events_retention_seconds
        self.chunk_seconds = chunk_seconds
        self.compact_interval_seconds = compact_interval_seconds
        self.compact_delay_seconds = compact_delay_seconds
        self.max_head_rows = max_head_rows
        self._force_at = max_head_rows
        self.max_future_seconds = max_future_seconds
        self.min_at = min_at
        self.busy_timeout_seconds = busy_timeout_seconds
        self.clock = clock
        self.rejected: Counter[str] = Counter()
        self._chunk_ms = _ms(chunk_seconds)
        self._tiers = sorted((_ms(step), keep) for step, keep in self.downsample)
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
            try:  # one event is stored once, however often it is written (imports, replays)
                self._conn.execute(_EVENTS_IDENTITY)
            except sqlite3.IntegrityError:
                logger.warning("%s holds duplicate events from an older version; "
                               "events written again will be stored again", self._name)
        self._series: dict[tuple[str, str, str, str], int] = {
            (m, n, e, lab): sid
            for sid, m, n, e, lab in self._conn.execute(
                "SELECT id, metric, node, entity, labels FROM series")
        }
        self._sid_cache: dict[tuple[Any, ...], int] = {}
        self._pruned_at: float | None = None
        self._compacted_at: float | None = None
        self._closed = False
        self._migrate_rows()
        self._head_rows = int(
            self._conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0])

    # --- writing -----------------------------------------------------------------------

    def _migrate_rows(self) -> None:
        """Convert the first version's ``WITHOUT ROWID`` samples table into the head (once)."""
        with self._lock, _mapped_errors(self._name):
            sql = self._conn.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'samples'"
            ).fetchone()[0]
            if "WITHOUT ROWID" not in sql.upper():
                return

            def body() -> None:
                self._conn.execute("ALTER TABLE samples RENAME TO samples_v1")
                self._conn.execute("CREATE TABLE samples (series_id INTEGER NOT NULL,"
                                   " ts INTEGER NOT NULL, value REAL NOT NULL)")
                self._conn.execute("INSERT INTO samples SELECT series_id, ts, value"
                                   " FROM samples_v1 ORDER BY series_id, ts")
                self._conn.execute("DROP TABLE samples_v1")

            self._transaction(body)
            logger.info("%s: converted the samples table to the chunked layout", self._name)

    def _transaction(self, body: Any) -> None:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            body()
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def _sid(self, s: Sample, new: dict[tuple[str, str, str, str], int]) -> int:
        key = (s.metric, str(s.node), str(s.entity),
               json.dumps(dict(s.labels), sort_keys=True))
        sid = self._series.get(key) or new.get(key)
        if sid is None:
            self._conn.execute(
                "INSERT OR IGNORE INTO series (metric, node, entity, labels) VALUES (?, ?, ?, ?)",
                key)
            row = self._conn.execute(
                "SELECT id FROM series WHERE metric = ? AND node = ? AND entity = ? AND"
                " labels = ?", key).fetchone()
            sid = new[key] = int(row[0])
        return sid

    def write(self, samples: Sequence[Sample], events: Sequence[Event]) -> None:
        """Write a batch in one transaction; bad samples are counted in :attr:`rejected`.

        Raises:
            TemporaryError: The database is locked by another process; nothing was written.
        """
        if not samples and not events:
            return
        now = self.clock()
        good = check_samples(samples, now=now, counts=self.rejected,
                             max_future_seconds=self.max_future_seconds, min_at=self.min_at)
        good_events = check_events(events, now=now, counts=self.rejected,
                                   max_future_seconds=self.max_future_seconds,
                                   min_at=self.min_at)
        with self._lock, _mapped_errors(self._name):
            new_series: dict[tuple[str, str, str, str], int] = {}
            new_cache: dict[tuple[Any, ...], int] = {}
            cache = self._sid_cache
            sids: list[int] = []
            append = sids.append

            def body() -> None:
                for s in good:
                    labels = s.labels
                    key = (s.metric, s.node, s.entity, *labels.items()) if labels else (
                        s.metric, s.node, s.entity)
                    sid = cache.get(key)
                    if sid is None:
                        sid = new_cache.get(key)
                        if sid is None:
                            sid = new_cache[key] = self._sid(s, new_series)
                    append(sid)
                stamps = np.rint(np.fromiter((s.observed_at for s in good), dtype=np.float64,
                                             count=len(good)) * 1000.0).astype(np.int64)
                self._conn.executemany("INSERT INTO samples VALUES (?, ?, ?)",
                                       zip(sids, stamps.tolist(), [s.value for s in good],
                                           strict=True))
                if good_events:
                    self._conn.executemany(
                        "INSERT OR IGNORE INTO events (ts, kind, code, node, entity, message,"
                        " attrs, evidence, source) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [(_ms(e.observed_at or now), e.kind, e.code, str(e.node),
                          str(e.entity), e.message, json.dumps(dict(e.attrs), sort_keys=True),
                          json.dumps([[v.file, v.line, v.text] for v in e.evidence]), e.source)
                         for e in good_events])

            self._transaction(body)
            self._head_rows += len(good)
            self._series.update(new_series)
            cache.update(new_cache)
            self._maintain(now)

    # --- compaction and retention -----------------------------------------------------

    def _maintain(self, now: float) -> None:
        if self._head_rows > self._force_at:
            self._compacted_at = now
            self._compact(_ms(now))
            self._force_at = self._head_rows + self.max_head_rows // 2
        elif (self._compacted_at is None
              or now - self._compacted_at >= self.compact_interval_seconds):
            self._compacted_at = now
            self._compact(_ms(now - self.compact_delay_seconds))
            self._force_at = max(self._head_rows, self.max_head_rows)
        if self._pruned_at is None or now - self._pruned_at >= _PRUNE_EVERY_SECONDS:
            self._pruned_at = now
            self._prune(now)

    def compact(self) -> None:
        """Compact every closed window now, whatever its age (normally done during writes)."""
        with self._lock, _mapped_errors(self._name):
            self._compact(_ms(self.clock()))

    def _compact(self, now_ms: int) -> None:
        """Compact the windows that ended by ``now_ms``."""
        cutoff = now_ms // self._chunk_ms * self._chunk_ms
        if self._conn.execute("SELECT 1 FROM samples WHERE ts < ? LIMIT 1",
                              (cutoff,)).fetchone() is None:
            return

        def body() -> None:
            rows = self._conn.execute(
                "SELECT series_id, ts, value FROM samples WHERE ts < ? ORDER BY rowid",
                (cutoff,)).fetchall()
            sid_t, ts_t, val_t = zip(*rows, strict=True)
            sid = np.array(sid_t, dtype=np.int64)
            ts = np.array(ts_t, dtype=np.int64)
            val = np.array(val_t, dtype=np.float64)
            window = ts // self._chunk_ms * self._chunk_ms
            for w in np.unique(window).tolist():
                mask = window == w
                self._compact_window(int(w), sid[mask], ts[mask], val[mask])
            self._conn.execute("DELETE FROM samples WHERE ts < ?", (cutoff,))

        self._transaction(body)
        self._head_rows = int(self._conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0])

    def _compact_window(self, window: int, sid: I64, ts: I64, val: F64) -> None:
        sid, ts, val = _last_wins(sid, ts, val)
        existing = {int(s): (t, v) for s, t, v in self._conn.execute(
            "SELECT series_id, ts, vals FROM chunks WHERE step = 0 AND start_ts = ?", (window,))}
        chunk_rows = []
        for series_id, a, b in _groups(sid):
            t, v = ts[a:b], val[a:b]
            old = existing.get(series_id)
            if old is not None:
                old_t, old_v = _dec_ts(old[0]), _dec_vals(old[1])
                both = np.concatenate((np.full(len(old_t), series_id), np.full(len(t),
                                                                              series_id)))
                _, t, v = _last_wins(both.astype(np.int64), np.concatenate((old_t, t)),
                                     np.concatenate((old_v, v)))
            chunk_rows.append((0, series_id, window, len(t), _enc_ts(t), _enc_vals(v)))
            for step_ms, _ in self._tiers:
                bucket, agg = _rollup(t, v, step_ms)
                if old is None:
                    prev = self._conn.execute(
                        "SELECT ts, vals FROM chunks WHERE step = ? AND series_id = ? AND"
                        " start_ts = ?", (step_ms, series_id, window)).fetchone()
                    if prev is not None:  # raw already pruned: add to the aggregates
                        bucket, agg = _combine_rollups(
                            [(_dec_ts(prev[0]), _dec_vals(prev[1])), (bucket, agg)])
                chunk_rows.append((step_ms, series_id, window, len(bucket), _enc_ts(bucket),
                                   _enc_vals(agg)))
        self._conn.executemany(
            "INSERT OR REPLACE INTO chunks (step, series_id, start_ts, n, ts, vals)"
            " VALUES (?, ?, ?, ?, ?, ?)", chunk_rows)

    def _prune(self, now: float) -> None:
        def body() -> None:
            longest = self.retention_seconds
            if self.retention_seconds is not None:
                cutoff = _ms(now - self.retention_seconds)
                self._conn.execute("DELETE FROM chunks WHERE step = 0 AND start_ts + ? <= ?",
                                   (self._chunk_ms, cutoff))
            for step_ms, keep in self._tiers:
                self._conn.execute("DELETE FROM chunks WHERE step = ? AND start_ts + ? <= ?",
                                   (step_ms, self._chunk_ms, _ms(now - keep)))
                longest = None if longest is None else max(longest, keep)
            keep_events = self.events_retention_seconds or longest
            if keep_events is not None:
                self._conn.execute("DELETE FROM events WHERE ts < ?", (_ms(now - keep_events),))

        self._transaction(body)

    # --- reading -----------------------------------------------------------------------

    def _select_series(self, metric: str, entities: Sequence[EntityRef] | None
                       ) -> list[tuple[int, str, str, dict[str, str]]]:
        rows = self._conn.execute(
            "SELECT id, node, entity, labels FROM series WHERE metric = ?", (metric,)).fetchall()
        if entities is not None:
            wanted = {(str(r.node), str(r.entity)) for r in entities}
            rows = [r for r in rows if (r[1], r[2]) in wanted]
        rows.sort(key=lambda r: (r[1], r[2], r[3]))
        return [(int(i), n, e, json.loads(lab)) for i, n, e, lab in rows]

    def _raw(self, ids: list[int], lo: int, hi: int) -> tuple[I64, I64, F64]:
        """Raw samples of ``ids`` in ``[lo, hi]`` ms, deduplicated, sorted by (id, ts)."""
        sid_parts: list[I64] = []
        ts_parts: list[I64] = []
        val_parts: list[F64] = []
        first = lo // self._chunk_ms * self._chunk_ms
        for i in range(0, len(ids), _IN_BATCH):
            part = ids[i:i + _IN_BATCH]
            marks = ",".join("?" * len(part))
            for series_id, n, tb, vb in self._conn.execute(
                    f"SELECT series_id, n, ts, vals FROM chunks WHERE step = 0 AND series_id IN"
                    f" ({marks}) AND start_ts >= ? AND start_ts <= ?", (*part, first, hi)):
                sid_parts.append(np.full(n, series_id, dtype=np.int64))
                ts_parts.append(_dec_ts(tb))
                val_parts.append(_dec_vals(vb))
        head: list[tuple[int, int, float]] = []
        for i in range(0, len(ids), _IN_BATCH):
            part = ids[i:i + _IN_BATCH]
            marks = ",".join("?" * len(part))
            head += self._conn.execute(
                f"SELECT series_id, ts, value FROM samples WHERE series_id IN ({marks})"
                " AND ts >= ? AND ts <= ? ORDER BY rowid", (*part, lo, hi)).fetchall()
        if head:
            sid_t, ts_t, val_t = zip(*head, strict=True)
            sid_parts.append(np.array(sid_t, dtype=np.int64))
            ts_parts.append(np.array(ts_t, dtype=np.int64))
            val_parts.append(np.array(val_t, dtype=np.float64))
        if not sid_parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0)
        sid, ts, val = _last_wins(np.concatenate(sid_parts), np.concatenate(ts_parts),
                                  np.concatenate(val_parts))
        keep = (ts >= lo) & (ts <= hi)
        return sid[keep], ts[keep], val[keep]

    def _tier(self, ids: list[int], step_ms: int, lo: int, hi: int
              ) -> tuple[I64, I64, F64, F64]:
        """Tier buckets of ``ids`` starting in ``[lo, hi)``: (ids, bucket starts, sums, counts)."""
        sid_p, ts_p, sum_p, cnt_p = [], [], [], []
        first = lo // self._chunk_ms * self._chunk_ms
        for i in range(0, len(ids), _IN_BATCH):
            part = ids[i:i + _IN_BATCH]
            marks = ",".join("?" * len(part))
            for series_id, n, tb, vb in self._conn.execute(
                    f"SELECT series_id, n, ts, vals FROM chunks WHERE step = ? AND series_id IN"
                    f" ({marks}) AND start_ts >= ? AND start_ts < ?",
                    (step_ms, *part, first, hi)):
                agg = _dec_vals(vb).reshape(4, n)
                sid_p.append(np.full(n, series_id, dtype=np.int64))
                ts_p.append(_dec_ts(tb))
                sum_p.append(agg[0])
                cnt_p.append(agg[1])
        if not sid_p:
            e = np.zeros(0, dtype=np.int64)
            return e, e, np.zeros(0), np.zeros(0)
        sid, ts = np.concatenate(sid_p), np.concatenate(ts_p)
        sums, cnts = np.concatenate(sum_p), np.concatenate(cnt_p)
        keep = (ts >= lo) & (ts < hi)
        return sid[keep], ts[keep], sums[keep], cnts[keep]

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
            step_seconds: When set, values are averaged per bucket of this many seconds
                (aligned to the epoch) and ``observed_at`` is the bucket start; buckets
                older than ``retention_seconds`` come from the finest downsampling tier.

        Returns:
            Columns ``observed_at`` (float epoch seconds), ``node``, ``entity``, ``value`` and
            one column per label key, sorted by node, entity, labels and time.

        Raises:
            TemporaryError: The database is locked.
        """
        import pandas as pd

        if step_seconds is not None and step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds!r}")
        if entities is not None and not entities:
            return pd.DataFrame(columns=_BASE_COLUMNS)
        lo, hi = _ms(since_at), _ms(until_at)
        cutoff = (None if self.retention_seconds is None
                  else _ms(self.clock() - self.retention_seconds))
        with self._lock, _mapped_errors(self._name):
            series = self._select_series(metric, entities)
            if not series:
                return pd.DataFrame(columns=_BASE_COLUMNS)
            ids = [s[0] for s in series]
            if step_seconds is None:
                sid, ts, val = self._raw(ids, lo if cutoff is None else max(lo, cutoff), hi)
            else:
                sid, ts, val = self._bucketed(ids, lo, hi, cutoff, max(1, _ms(step_seconds)))
        return self._frame(series, sid, ts, val)

    def _bucketed(self, ids: list[int], lo: int, hi: int, cutoff: int | None,
                  step_ms: int) -> tuple[I64, I64, F64]:
        raw_lo = lo
        parts_sid, parts_ts, parts_sum, parts_cnt = [], [], [], []
        if cutoff is not None and cutoff > lo and self._tiers:
            tier_ms = self._tiers[0][0]
            raw_lo = -(-cutoff // tier_ms) * tier_ms  # tier buckets before, raw after
            s, t, sums, cnts = self._tier(ids, tier_ms, lo, min(raw_lo, hi + 1))
            parts_sid.append(s)
            parts_ts.append(t)
            parts_sum.append(sums)
            parts_cnt.append(cnts)
        elif cutoff is not None:
            raw_lo = max(lo, cutoff)
        s, t, v = self._raw(ids, raw_lo, hi)
        parts_sid.append(s)
        parts_ts.append(t)
        parts_sum.append(v)
        parts_cnt.append(np.ones(len(v)))
        sid = np.concatenate(parts_sid)
        bucket = np.concatenate(parts_ts) // step_ms * step_ms
        sums, cnts = np.concatenate(parts_sum), np.concatenate(parts_cnt)
        if not len(sid):
            return sid, bucket, sums
        order = np.lexsort((bucket, sid))
        sid, bucket, sums, cnts = sid[order], bucket[order], sums[order], cnts[order]
        starts = np.concatenate(([0], np.flatnonzero(
            (sid[1:] != sid[:-1]) | (bucket[1:] != bucket[:-1])) + 1))
        total = np.add.reduceat(sums, starts)
        count = np.add.reduceat(cnts, starts)
        return sid[starts], bucket[starts], total / count

    @staticmethod
    def _frame(series: list[tuple[int, str, str, dict[str, str]]], sid: I64, ts: I64,
               val: F64) -> pd.DataFrame:
        import pandas as pd

        if not len(sid):
            return pd.DataFrame(columns=_BASE_COLUMNS)
        rank = {s[0]: i for i, s in enumerate(series)}
        ids = np.array(sorted(rank), dtype=np.int64)
        ranks = np.array([rank[i] for i in ids.tolist()], dtype=np.int64)
        row_rank = ranks[np.searchsorted(ids, sid)]
        order = np.lexsort((ts, row_rank))
        row_rank, ts, val = row_rank[order], ts[order], val[order]
        nodes = np.array([s[1] for s in series], dtype=object)
        ents = np.array([s[2] for s in series], dtype=object)
        data: dict[str, Any] = {
            "observed_at": ts / 1000.0,
            "node": nodes[row_rank],
            "entity": ents[row_rank],
            "value": val,
        }
        keys = sorted({k for s in series for k in s[3]} - set(_BASE_COLUMNS))
        for key in keys:
            col = np.array([s[3].get(key) for s in series], dtype=object)
            data[key] = col[row_rank]
        return pd.DataFrame(data, columns=_BASE_COLUMNS + keys)

    def read_events(self, since_at: float, until_at: float) -> list[Event]:
        """Return the events stamped in ``[since_at, until_at]`` (epoch seconds), oldest first."""
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

    def metrics(self) -> list[str]:
        """List the metrics with stored series, sorted (used by ``gpuhealth export``)."""
        with self._lock, _mapped_errors(self._name):
            rows = self._conn.execute("SELECT DISTINCT metric FROM series ORDER BY metric")
            return [str(m) for (m,) in rows]

    def close(self) -> None:
        """Close the database; idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __repr__(self) -> str:
        return (f"SqliteStore(path={self._name!r}, retention_seconds={self.retention_seconds!r},"
                f" downsample={self.downsample!r})")
