from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from core.clock import FakeClock
from core.errors import PermanentError, TemporaryError
from core.records import EntityId, Event, NodeName, Sample
from storage.spool import SpoolingStore

T0 = 1.7e9


class FlakyStore:
    def __init__(self) -> None:
        self.down = False
        self.batches: list[tuple[list[Sample], list[Event]]] = []

    def write(self, samples, events) -> None:
        if self.down:
            raise TemporaryError("down")
        self.batches.append((list(samples), list(events)))

    def read(self, *args, **kw):
        raise NotImplementedError

    def entities(self):
        return []


def _batch(i: int, n: int = 10) -> list[Sample]:
    return [Sample(metric="gpu_power_watts", value=float(i), observed_at=T0 + i,
                   node=NodeName("n1"), entity=EntityId(f"GPU-{g}")) for g in range(n)]


def _values(store: FlakyStore) -> list[float]:
    return [s.value for samples, _ in store.batches for s in samples]


def test_spools_while_down_and_replays_in_order(tmp_path: Path) -> None:
    clock = FakeClock(now=T0 + 100)
    inner = FlakyStore()
    spool = SpoolingStore(store=inner, path=tmp_path, retry_seconds=1.0, clock=clock)
    spool.write(_batch(0), [])
    inner.down = True
    for i in range(1, 6):
        spool.write(_batch(i), [])
        clock.advance(0.3)
    assert spool.depth == 50
    inner.down = False
    clock.advance(5)
    spool.write(_batch(6), [])
    assert spool.depth == 0
    assert _values(inner) == [float(i) for i in range(7) for _ in range(10)]
    assert spool.retried_batches == 1


class StreamingFlakyStore(FlakyStore):
    """Streams batches; fails at the ``fail_at``-th batch (1-based) of a stream."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: int | None = None
        self.refuse: set[float] = set()
        self.streams = 0

    def write_stream(self, batches, *, on_written=None) -> int:
        self.streams += 1
        count = 0
        for samples, events in batches:
            if self.fail_at is not None and count + 1 == self.fail_at:
                raise TemporaryError("down")
            if samples and samples[0].value in self.refuse:
                raise PermanentError(f"refused {samples[0].value}")
            self.write(samples, events)
            count += 1
            if on_written is not None:
                on_written(count)
        return count


def test_a_stream_that_fails_midway_is_spooled_from_the_failed_batch_on(tmp_path: Path) -> None:
    clock = FakeClock(now=T0 + 100)
    inner = StreamingFlakyStore()
    spool = SpoolingStore(store=inner, path=tmp_path, retry_seconds=1.0, clock=clock)
    seen: list[int] = []
    assert spool.write_stream([(_batch(i), []) for i in range(3)], on_written=seen.append) == 3
    assert (inner.streams, seen) == (1, [1, 2, 3])
    assert _values(inner) == [float(i) for i in range(3) for _ in range(10)]
    inner.fail_at = 2
    seen.clear()
    assert spool.write_stream([(_batch(i), []) for i in range(3, 7)],
                              on_written=seen.append) == 4
    assert seen == [1, 2, 3, 4]
    assert spool.depth == 30  # batches 4-6: the failed one and the two after it
    # while the spool holds a backlog, a stream goes behind it, batch by batch
    spool.write_stream([(_batch(7), [])])
    assert (inner.streams, spool.depth) == (2, 40)
    inner.fail_at = None
    clock.advance(5)
    spool.write(_batch(8), [])
    assert spool.depth == 0
    assert _values(inner) == [float(i) for i in range(9) for _ in range(10)]
    assert spool.retried_batches == 1
    # a NaN is rejected and counted by the spool's check, in the stream as in write
    bad = [Sample(metric="gpu_power_watts", value=float("nan"), observed_at=T0,
                  node=NodeName("n1"), entity=EntityId("GPU-0"))]
    spool.write_stream([(bad, [])])
    assert spool.rejected["nan"] == 1


def test_a_backlog_streams_out_and_a_refused_batch_is_dropped_alone(tmp_path: Path) -> None:
    clock = FakeClock(now=T0 + 100)
    inner = StreamingFlakyStore()
    spool = SpoolingStore(store=inner, path=tmp_path, retry_seconds=1.0, clock=clock)
    inner.down = True
    for i in range(6):
        spool.write(_batch(i), [])
    assert spool.depth == 60
    inner.down = False
    inner.refuse = {2.0}
    clock.advance(5)
    assert spool.flush() == 50
    assert spool.depth == 0
    assert _values(inner) == [float(i) for i in (0, 1, 3, 4, 5) for _ in range(10)]
    assert spool.rejected["permanent"] == 10
    assert inner.streams >= 2  # the refused batch ended the first stream; the rest, another


def test_full_spool_drops_oldest_samples_never_events(tmp_path: Path) -> None:
    clock = FakeClock(now=T0 + 100)
    inner = FlakyStore()
    inner.down = True
    spool = SpoolingStore(store=inner, path=tmp_path, max_bytes=20_000, segment_bytes=2_000,
                          clock=clock, retry_seconds=1000)
    event = Event(kind="xid", code="79", node=NodeName("n1"), entity=EntityId("GPU-0"),
                  observed_at=T0, message="fallen off the bus")
    spool.write(_batch(0), [event])
    for i in range(1, 60):
        spool.write(_batch(i), [])
    assert spool.dropped_samples > 0
    inner.down = False
    spool.flush(budget_seconds=0)
    delivered = _values(inner)
    assert len(delivered) + spool.dropped_samples == 600
    assert delivered == sorted(delivered)  # the oldest were dropped, order kept
    assert delivered[-1] == 59.0
    assert [e for _, events in inner.batches for e in events] == [event]


def test_kill_9_loses_nothing_accepted(tmp_path: Path) -> None:
    child = textwrap.dedent(f"""
        import sys
        from core.errors import TemporaryError
        from core.records import EntityId, NodeName, Sample
        from storage.spool import SpoolingStore

        class Down:
            def write(self, samples, events):
                raise TemporaryError("down")
            def read(self, *a, **k): ...
            def entities(self): return []

        spool = SpoolingStore(store=Down(), path={str(tmp_path)!r}, retry_seconds=1000)
        i = 0
        while True:
            spool.write([Sample(metric="gpu_power_watts", value=float(i), observed_at={T0} + i,
                                node=NodeName("n1"), entity=EntityId("GPU-0"))], [])
            print(i, flush=True)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE,
                            cwd=Path(__file__).parents[2])
    assert proc.stdout is not None
    accepted = -1
    while accepted < 300:
        accepted = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for line in proc.stdout.read().decode().split():  # accepted before the kill landed
        accepted = int(line)
    proc.stdout.close()
    inner = FlakyStore()
    spool = SpoolingStore(store=inner, path=tmp_path)
    spool.flush(budget_seconds=0)
    values = _values(inner)
    assert values[: accepted + 1] == [float(i) for i in range(accepted + 1)]
    assert spool.depth == 0
