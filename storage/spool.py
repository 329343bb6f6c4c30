"""A durable, bounded on-disk spool in front of a remote store.

``SpoolingStore(store=...)`` is itself a :class:`core.protocols.Store`. While the spool is
empty a batch goes straight to the remote store. When the store fails with
:class:`~core.errors.TemporaryError` (unreachable, slow, 5xx), the batch is appended to the
spool, and every later batch is appended behind it, so order is kept (a wrong URL or
token is such a failure too: the remote backends map 401/403/404 to it, and the error is
logged once per outage, naming the URL and the status); each ``write`` then
tries to deliver spooled batches oldest first, at most ``replay_budget_seconds`` per call,
and not before ``retry_seconds`` (doubling up to ``max_retry_seconds``) after a failure.
Only a batch the store refuses for its content (:class:`~core.errors.PermanentError`) is
dropped, counted (``rejected["permanent"]``) and named in the log.

On disk (``path`` is a folder)::

    000000000001.seg ...   append-only segments of records
    cursor                 "<segment> <offset>": where the next undelivered record starts

A record is a 17-byte header (magic ``GHSP``, payload length, CRC-32, record count, kind
``S`` for samples or ``E`` for events) and a payload of line protocol
(:mod:`storage.lineprotocol`, microsecond timestamps), readable with ``tail``. A batch is
"accepted" when ``write`` returns: its records are in the segment file (the page cache
survives ``kill -9``; ``fsync=True`` also survives power loss). A torn record at the end of
the last segment (a crash in mid-append) was never accepted and is cut off when the spool
is opened. A batch delivered just before a crash, whose cursor update was lost, is sent
again on restart: delivery is at-least-once, and stores deduplicate identical
(series, timestamp) points (VictoriaMetrics with ``-dedup.minScrapeInterval``, InfluxDB by
point identity, SQLite by primary key).

Bound: when the segments exceed ``max_bytes``, the oldest segment loses its sample records
(events are kept), oldest segment first; :attr:`SpoolingStore.dropped_samples` counts them
(exported as ``gpuhealth_spool_dropped_total``). Events are never dropped, so a spool that
holds only events may exceed the bound; that is logged.

Synchronous on purpose: the service writes from one writer thread, and the remote stores
this wraps are synchronous at their write call (see :mod:`storage.influxdb`).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from core.clock import Clock, system_clock
from core.errors import PermanentError, TemporaryError
from core.protocols import Batch, Closeable, Store, StreamingStore
from core.records import EntityRef, Event, Sample
from storage.lineprotocol import DecodeReport, LineEncoder, decode_line
from storage.sanitize import MAX_FUTURE_SECONDS, MIN_AT, check_events, check_samples

if TYPE_CHECKING:
    import pandas as pd  # only the read path's type; the agent never loads pandas

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sIIIc")
_MAGIC = b"GHSP"
_SAMPLES, _EVENTS = b"S", b"E"


class _Record:
    __slots__ = ("count", "kind", "offset", "payload", "seq")

    def __init__(self, seq: int, offset: int, kind: bytes, count: int, payload: bytes) -> None:
        self.seq, self.offset, self.kind, self.count, self.payload = (
            seq, offset, kind, count, payload)

    @property
    def end(self) -> int:
        return self.offset + _HEADER.size + len(self.payload)


def _read_records(path: Path, seq: int, start: int) -> Iterator[_Record]:
    """Yield whole, valid records from ``start``; stop at a torn or corrupt one."""
    with open(path, "rb") as handle:
        handle.seek(start)
        offset = start
        while True:
            header = handle.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return
            magic, length, crc, count, kind = _HEADER.unpack(header)
            payload = handle.read(length)
            if magic != _MAGIC or len(payload) < length or zlib.crc32(payload) != crc:
                return
            yield _Record(seq, offset, kind, count, payload)
            offset += _HEADER.size + length


def _decode(record: _Record) -> Batch:
    """Return the samples and events of a spooled record."""
    report = DecodeReport()
    samples: list[Sample] = []
    events: list[Event] = []
    for line in record.payload.decode().splitlines():
        for item in decode_line(line, precision="us", report=report):
            (samples if isinstance(item, Sample) else events).append(item)  # type: ignore[arg-type]
    return samples, events


def describe(samples: Sequence[Sample], events: Sequence[Event], *, most: int = 3) -> str:
    """Name a batch in a few words: counts, metric names or event kinds, nodes.

    Examples:
        >>> from core.records import EntityId, NodeName
        >>> s = Sample(metric="gpu_power_watts", value=1.0, observed_at=1.7e9,
        ...            node=NodeName("n1"), entity=EntityId("GPU-0"))
        >>> describe([s, s], [])
        '2 samples (gpu_power_watts on n1)'
    """
    parts = []
    for count, noun, names, nodes in (
            (len(samples), "sample", Counter(s.metric for s in samples),
             sorted({s.node for s in samples})),
            (len(events), "event", Counter(f"{e.kind} {e.code}" for e in events),
             sorted({e.node for e in events}))):
        if not count:
            continue
        shown = ", ".join(name for name, _ in names.most_common(most))
        if len(names) > most:
            shown += f" and {len(names) - most} more"
        where = ", ".join(nodes[:most]) + (f" and {len(nodes) - most} more"
                                           if len(nodes) > most else "")
        parts.append(f"{count} {noun}{'s' if count != 1 else ''} ({shown} on {where})")
    return " and ".join(parts) or "nothing"


class SpoolingStore:
    """A store that spools batches to disk while the wrapped store is unavailable.

    Args:
        store: The remote store (``influxdb``, or any :class:`~core.protocols.Store`).
        path: Spool folder; created.
        max_bytes: Bound of the spool on disk (default 256 MiB: about 40 minutes of
            1,000 GPUs x 30 metrics every 10 s).
        segment_bytes: Size at which a new segment starts; the unit in which samples are
            dropped when the spool is full.
        retry_seconds: First wait after a failed delivery before the store is tried again.
        max_retry_seconds: Longest wait between tries (the wait doubles per failure).
        replay_budget_seconds: Longest a ``write`` call spends delivering spooled batches.
        fsync: ``fsync`` after each append (survives power loss, costs a disk flush).
        max_future_seconds: Samples stamped further ahead of the clock are rejected.
        min_at: Samples stamped before this epoch second are rejected.
        clock: Stamps unstamped records when they are accepted, and times the retries.

    Attributes:
        dropped_samples: Samples dropped because the spool was full.
        retried_batches: Spooled batches (a batch's samples and its events count apart)
            delivered after an earlier attempt of theirs failed: they may have reached the
            store twice.
        rejected: Reason → samples and events rejected or converted on the way in.
    """

    def __init__(
        self,
        *,
        store: Store,
        path: str | Path,
        max_bytes: int = 256 * 1024 * 1024,
        segment_bytes: int | None = None,
        retry_seconds: float = 1.0,
        max_retry_seconds: float = 30.0,
        replay_budget_seconds: float = 2.0,
        fsync: bool = False,
        max_future_seconds: float = MAX_FUTURE_SECONDS,
        min_at: float = MIN_AT,
        clock: Clock = system_clock,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes!r}")
        self.store = store
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(4096, max_bytes // 16)
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.replay_budget_seconds = replay_budget_seconds
        self.fsync = fsync
        self.max_future_seconds = max_future_seconds
        self.min_at = min_at
        self.clock = clock
        self.dropped_samples = 0
        self.retried_batches = 0
        self.rejected: Counter[str] = Counter()
        self._encoder = LineEncoder(precision="us")
        self._lock = threading.RLock()
        self._retry_at: float | None = None
        self._wait = retry_seconds
        self._failed: set[tuple[int, int]] = set()
        self._outage: tuple[str, float] | None = None  # the last failure, when it began
        self._warned_events_only = False
        self.path.mkdir(parents=True, exist_ok=True)
        self._segments: list[int] = sorted(
            int(p.stem) for p in self.path.glob("*.seg") if p.stem.isdigit())
        self._cursor = self._load_cursor()
        self._segments = [s for s in self._segments if s >= self._cursor[0]]
        for stale in self.path.glob("*.seg"):
            if stale.stem.isdigit() and int(stale.stem) < self._cursor[0]:
                stale.unlink()
        self._depth = 0
        self._repair()
        self._active: int | None = None

    # --- files ---------------------------------------------------------------------------

    def _seg(self, seq: int) -> Path:
        return self.path / f"{seq:012d}.seg"

    def _load_cursor(self) -> tuple[int, int]:
        try:
            seq, offset = (self.path / "cursor").read_text().split()
            return int(seq), int(offset)
        except (OSError, ValueError):
            return (self._segments[0] if self._segments else 0), 0

    def _save_cursor(self) -> None:
        tmp = self.path / "cursor.tmp"
        tmp.write_text(f"{self._cursor[0]} {self._cursor[1]}\n")
        os.replace(tmp, self.path / "cursor")

    def _repair(self) -> None:
        """Count what is pending and cut a torn record off the end of each segment."""
        for seq in self._segments:
            start = self._cursor[1] if seq == self._cursor[0] else 0
            end = start
            for record in _read_records(self._seg(seq), seq, start):
                self._depth += record.count
                end = record.end
            if self._seg(seq).stat().st_size > end:
                logger.warning("spool %s: cutting a torn record at byte %d", self._seg(seq), end)
                os.truncate(self._seg(seq), end)

    def _bytes(self) -> int:
        total = sum(self._seg(s).stat().st_size for s in self._segments)
        if self._segments and self._segments[0] == self._cursor[0]:
            total -= self._cursor[1]
        return total

    @property
    def failing(self) -> str | None:
        """Why the store takes no writes now (its last error, how long, what is spooled).

        ``None`` once a spooled batch was delivered again (``/healthz`` reads it).
        """
        outage = self._outage
        if outage is None:
            return None
        error, since = outage
        return (f"{error}; {self._depth} record(s) spooled to {self.path} since "
                f"{self.clock() - since:.0f} s")

    @property
    def depth(self) -> int:
        """Samples and events waiting in the spool (``gpuhealth_spool_depth``)."""
        return self._depth

    def _append(self, kind: bytes, count: int, lines: list[str]) -> tuple[int, int]:
        """Append one record; return its ``(segment, offset)``."""
        payload = ("\n".join(lines) + "\n").encode()
        if self._active is None or self._seg(self._active).stat().st_size >= self.segment_bytes:
            self._active = (self._segments[-1] + 1) if self._segments else max(
                1, self._cursor[0])
            self._segments.append(self._active)
            if len(self._segments) == 1:
                self._cursor = (self._active, 0)
                self._save_cursor()
        with open(self._seg(self._active), "ab") as handle:
            offset = handle.tell()
            handle.write(_HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload), count, kind))
            handle.write(payload)
            handle.flush()
            if self.fsync:
                os.fsync(handle.fileno())
        self._depth += count
        return self._active, offset

    def _enforce_bound(self) -> None:
        """Drop sample records of the oldest segments until the spool fits ``max_bytes``."""
        index = 0
        while self._bytes() > self.max_bytes and index < len(self._segments):
            seq = self._segments[index]
            if seq == self._active:
                self._active = None  # the next append starts a new segment
            start = self._cursor[1] if seq == self._cursor[0] else 0
            kept: list[_Record] = []
            dropped = 0
            for record in _read_records(self._seg(seq), seq, start):
                if record.kind == _SAMPLES:
                    dropped += record.count
                else:
                    kept.append(record)
            if dropped:
                tmp = self._seg(seq).with_suffix(".tmp")
                with open(tmp, "wb") as handle:
                    for record in kept:
                        handle.write(_HEADER.pack(_MAGIC, len(record.payload),
                                                  zlib.crc32(record.payload), record.count,
                                                  record.kind))
                        handle.write(record.payload)
                os.replace(tmp, self._seg(seq))
                if seq == self._cursor[0]:
                    self._cursor = (seq, 0)
                    self._save_cursor()
                self._failed = {k for k in self._failed if k[0] != seq}
                self.dropped_samples += dropped
                self._depth -= dropped
                logger.warning("spool full (%d bytes): dropped %d oldest samples; events kept",
                               self.max_bytes, dropped)
            index += 1
        if self._bytes() > self.max_bytes and not self._warned_events_only:
            self._warned_events_only = True
            logger.warning("spool holds only events and exceeds %d bytes; events are never "
                           "dropped", self.max_bytes)

    # --- the Store protocol ----------------------------------------------------------------

    def write(self, samples: Sequence[Sample], events: Sequence[Event]) -> None:
        """Deliver a batch, or accept it into the spool when the store is unavailable.

        A batch the store refuses for its content (:class:`~core.errors.PermanentError`)
        is dropped, counted in ``rejected["permanent"]`` and named in an error log line;
        any other failure (:class:`~core.errors.TemporaryError`: unreachable, a wrong URL
        or token, 5xx) spools it.

        Raises:
            OSError: The spool folder cannot be written (disk full); the batch was not
                accepted.
        """
        now = self.clock()
        good, good_events = self._checked(samples, events, now)
        if not good and not good_events:
            return
        with self._lock:
            if not self._depth and self._may_try(now):
                try:
                    self.store.write(good, good_events)
                except TemporaryError as exc:
                    self._note_failure(now, exc)
                    self._spool(good, good_events, failed=True)
                except PermanentError as exc:
                    self._drop_refused(good, good_events, exc)
                    return
                else:
                    return
            else:
                self._spool(good, good_events, failed=False)
            self._enforce_bound()
            self.flush()

    def write_stream(self, batches: Iterable[Batch], *,
                     on_written: Callable[[int], None] | None = None) -> int:
        """Write a run of batches as :meth:`write` would, each delivered or accepted.

        While the spool is empty and the wrapped store is a
        :class:`~core.protocols.StreamingStore`, the batches go through its ``write_stream``
        (the next one checked and encoded while one is on the wire). When it fails with
        :class:`~core.errors.TemporaryError`, the batch that failed and every later one are
        appended to the spool in order, as :meth:`write` does for one batch. Otherwise one
        :meth:`write` after another.

        Args:
            batches: (samples, events) pairs.
            on_written: Called with ``n`` once the first ``n`` batches are accepted.

        Returns:
            The number of batches accepted (delivered or spooled): all of them.

        Raises:
            PermanentError: The store refused a batch; the ones before it were delivered,
                it and the later ones were not accepted.
            OSError: The spool folder cannot be written.
        """
        inner = self.store
        with self._lock:
            if (not isinstance(inner, StreamingStore) or self._depth
                    or not self._may_try(self.clock())):
                return self._write_each(batches, on_written, 0)
            iterator = iter(batches)
            unconfirmed: deque[Batch] = deque()

            def checked() -> Iterator[Batch]:
                for samples, events in iterator:  # runs on the store's helper thread
                    batch = self._checked(samples, events, self.clock())
                    unconfirmed.append(batch)
                    yield batch

            done = [0]

            def confirmed(count: int) -> None:
                unconfirmed.popleft()
                done[0] = count
                if on_written is not None:
                    on_written(count)

            try:
                return inner.write_stream(checked(), on_written=confirmed)
            except TemporaryError as exc:
                self._note_failure(self.clock(), exc)
                accepted = done[0]
                for index, (samples, events) in enumerate(unconfirmed):
                    # the first was tried and may have reached the store; the next never went
                    self._spool(samples, events, failed=index == 0)
                    accepted += 1
                    if on_written is not None:
                        on_written(accepted)
                self._enforce_bound()
                return self._write_each(iterator, on_written, accepted)

    def _write_each(self, batches: Iterable[Batch], on_written: Callable[[int], None] | None,
                    accepted: int) -> int:
        for samples, events in batches:
            self.write(samples, events)
            accepted += 1
            if on_written is not None:
                on_written(accepted)
        return accepted

    def _spool(self, samples: Sequence[Sample], events: Sequence[Event], *, failed: bool
               ) -> None:
        keys = []
        if events:
            keys.append(self._append(_EVENTS, len(events), self._encoder.events(events)))
        if samples:
            keys.append(self._append(_SAMPLES, len(samples), self._encoder.samples(samples)))
        if failed:  # this batch was tried once: it may have reached the store
            self._failed.update(keys)

    def _may_try(self, now: float) -> bool:
        return self._retry_at is None or now >= self._retry_at

    def _note_failure(self, now: float, exc: TemporaryError) -> None:
        """Schedule the next try; log the first failure of an outage (once, as an error)."""
        if self._retry_at is None:
            logger.error("store %r cannot take writes: %s -- spooling to %s and retrying "
                         "with backoff (up to every %.0f s); nothing is dropped unless the "
                         "spool passes %d bytes", self.store, exc, self.path,
                         self.max_retry_seconds, self.max_bytes)
        self._outage = (str(exc), self._outage[1] if self._outage else now)
        wait = max(self._wait, exc.retry_after_seconds or 0.0)
        self._retry_at = now + min(wait, max(self.max_retry_seconds, self._wait))
        self._wait = min(self._wait * 2.0, self.max_retry_seconds)

    def flush(self, *, budget_seconds: float | None = None) -> int:
        """Deliver spooled batches oldest first until one fails or the budget is spent.

        Through the wrapped store's ``write_stream`` when it is a
        :class:`~core.protocols.StreamingStore` (the next record decoded and encoded while
        one is on the wire; the cursor moves as each is confirmed), else one ``write``
        per record.

        Args:
            budget_seconds: Wall time to spend; default ``replay_budget_seconds``; ``0``
                or less means no limit.

        Returns:
            Records (samples plus events) delivered by this call.
        """
        budget = self.replay_budget_seconds if budget_seconds is None else budget_seconds
        deadline = time.monotonic() + budget if budget > 0 else None
        delivered = 0
        with self._lock:
            if not self._may_try(self.clock()) and budget_seconds is None:
                return 0
            while self._segments:
                seq = self._segments[0]
                start = self._cursor[1] if seq == self._cursor[0] else 0
                count, finished = self._deliver_segment(seq, start, deadline)
                delivered += count
                if not finished:
                    return delivered
                if seq == self._active and not count:
                    break
                if seq == self._active:
                    continue  # more may have been appended meanwhile; loop re-reads
                self._segments.pop(0)
                self._seg(seq).unlink(missing_ok=True)
                self._cursor = (self._segments[0], 0) if self._segments else (seq + 1, 0)
                self._save_cursor()
            if not self._segments or (self._depth == 0 and self._segments == [self._active]):
                self._reset()
        if delivered:
            logger.info("spool: delivered %d spooled record(s) to the store; %d still spooled",
                        delivered, self._depth)
        return delivered

    def _deliver_segment(self, seq: int, start: int,
                         deadline: float | None) -> tuple[int, bool]:
        """Deliver the records of segment ``seq`` from offset ``start``.

        Returns (records delivered, whether the segment was read to its end: False when a
        delivery failed or the deadline passed).
        """
        delivered = 0
        inner = self.store
        if not isinstance(inner, StreamingStore):
            for record in _read_records(self._seg(seq), seq, start):
                if deadline is not None and time.monotonic() > deadline:
                    return delivered, False
                if not self._deliver(record):
                    return delivered, False
                delivered += record.count
            return delivered, True
        while True:
            count, finished, refused_end = self._stream(inner, seq, start, deadline)
            delivered += count
            if refused_end is None:
                return delivered, finished
            start = refused_end  # the records after the refused one, in a new stream

    def _stream(self, inner: StreamingStore, seq: int, start: int,
                deadline: float | None) -> tuple[int, bool, int | None]:
        """Stream segment ``seq`` from ``start`` through ``inner.write_stream``.

        Returns (records delivered, whether the segment was read to its end, and the end
        offset of a record the store refused for good, which is dropped: the caller goes
        on after it).
        """
        sent: deque[_Record] = deque()
        stopped = False
        delivered = 0

        def batches() -> Iterator[Batch]:
            nonlocal stopped
            for record in _read_records(self._seg(seq), seq, start):  # on the helper thread
                if deadline is not None and time.monotonic() > deadline:
                    stopped = True
                    return
                batch = _decode(record)
                sent.append(record)
                yield batch

        def confirmed(_: int) -> None:
            nonlocal delivered
            record = sent.popleft()
            self._delivered(record)
            delivered += record.count

        try:
            inner.write_stream(batches(), on_written=confirmed)
        except TemporaryError as exc:
            self._note_failure(self.clock(), exc)
            if sent:
                self._failed.add((sent[0].seq, sent[0].offset))
            return delivered, False, None
        except PermanentError as exc:
            if not sent:
                raise
            record = sent.popleft()
            self._refused(record, exc)
            return delivered, False, record.end
        return delivered, not stopped, None

    def _reset(self) -> None:
        for seq in self._segments:
            self._seg(seq).unlink(missing_ok=True)
        next_seq = (self._segments[-1] + 1) if self._segments else self._cursor[0]
        self._segments = []
        self._active = None
        self._cursor = (max(1, next_seq), 0)
        self._save_cursor()
        self._failed.clear()

    def _deliver(self, record: _Record) -> bool:
        samples, events = _decode(record)
        try:
            self.store.write(samples, events)
        except TemporaryError as exc:
            self._note_failure(self.clock(), exc)
            self._failed.add((record.seq, record.offset))
            return False
        except PermanentError as exc:
            self._refused(record, exc)
            return True
        self._delivered(record)
        return True

    def _refused(self, record: _Record, exc: PermanentError) -> None:
        """Drop ``record``, which the store refused for good; count it and move on."""
        samples, events = _decode(record)
        logger.error("store refused a spooled batch for its content; dropped %s: %s",
                     describe(samples, events), exc)
        self.rejected["permanent"] += record.count
        self._delivered(record)

    def _drop_refused(self, samples: Sequence[Sample], events: Sequence[Event],
                      exc: PermanentError) -> None:
        """Drop a batch the store refused for its content; count and name it."""
        logger.error("store refused a batch for its content; dropped %s: %s",
                     describe(samples, events), exc)
        self.rejected["permanent"] += len(samples) + len(events)

    def _checked(self, samples: Sequence[Sample], events: Sequence[Event], now: float) -> Batch:
        """Return the batch without what the checks reject (counted in ``rejected``)."""
        return (check_samples(samples, now=now, counts=self.rejected,
                              max_future_seconds=self.max_future_seconds, min_at=self.min_at),
                check_events(events, now=now, counts=self.rejected,
                             max_future_seconds=self.max_future_seconds, min_at=self.min_at))

    def _delivered(self, record: _Record) -> None:
        """Move the cursor past ``record``, which the store took (or refused for good)."""
        key = (record.seq, record.offset)
        if key in self._failed:
            self._failed.discard(key)
            self.retried_batches += 1
        self._retry_at = None
        self._wait = self.retry_seconds
        self._outage = None
        self._depth -= record.count
        self._cursor = (record.seq, record.end)
        self._save_cursor()

    def read(
        self,
        metric: str,
        entities: Sequence[EntityRef] | None,
        since_at: float,
        until_at: float,
        step_seconds: float | None = None,
    ) -> pd.DataFrame:
        """Read from the wrapped store (spooled batches are not visible until delivered)."""
        return self.store.read(metric, entities, since_at, until_at, step_seconds)

    def entities(self) -> Sequence[EntityRef]:
        """List the wrapped store's entities."""
        return self.store.entities()

    def close(self) -> None:
        """Try one last delivery, then close the wrapped store; the spool stays on disk."""
        with self._lock:
            if self._depth:
                self.flush()
            if isinstance(self.store, Closeable):
                self.store.close()

    def __repr__(self) -> str:
        return f"SpoolingStore(store={self.store!r}, path={str(self.path)!r})"
