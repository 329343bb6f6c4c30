"""Store ingest and read benchmark (issue 4).

Prints samples per second from one process into each backend beside the raw limit measured
in the same run (a pre-built line-protocol body posted in a loop to a local
VictoriaMetrics), the serialisation cost of our encoder against a plain formatted string
and influxdb-client's ``Point``, SQLite ingest in batches, the GPU-week read, and the share
of one core that 30,000 samples/s (10,000 GPUs x 30 metrics every 10 s) costs.

Run: ``.venv/bin/python benchmarks/store_ingest.py [--seconds 5]`` (VictoriaMetrics from
PATH for the remote figures; without it they are skipped).
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import sys
import tempfile
import time
from pathlib import Path

from core.clock import FakeClock
from core.records import EntityId, EntityRef, NodeName, Sample
from storage.lineprotocol import LineEncoder
from storage.sqlite import SqliteStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.vm_server

T0 = float(int(time.time()) - 3600)
METRICS = [f"gpu_bench{i}_celsius" for i in range(30)]


def batch(round_no: int, gpus: int = 166) -> list[Sample]:
    at = T0 + round_no * 0.001
    return [Sample(metric=m, value=40.0 + (g % 7) + round_no % 3, observed_at=at,
                   node=NodeName(f"node{g // 8:03d}"), entity=EntityId(f"GPU-{g:05d}"))
            for g in range(gpus) for m in METRICS]  # 4,980 samples: one 5,000-line body


def rate(fn, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += fn()
    return n / (time.perf_counter() - start)


def serialisation(samples: list[Sample]) -> None:
    plain = rate(lambda: len([f"{s.metric},node={s.node},entity={s.entity} value={s.value} "
                              f"{int(s.observed_at * 1e9)}" for s in samples]), 1.0)
    n = len(samples)
    ours = rate(lambda: (LineEncoder(precision="ms").samples(samples), n)[1], 1.0)
    encoder = LineEncoder(precision="ms")
    cached = rate(lambda: (encoder.samples(samples), n)[1], 1.0)
    single = LineEncoder(precision="ms", merge_fields=False)
    one_per_line = rate(lambda: (single.samples(samples), n)[1], 1.0)
    print(f"serialise: plain f-string {plain:,.0f}/s; LineEncoder cold {ours:,.0f}/s "
          f"(cost {plain / ours:.2f}x), warm cache {cached:,.0f}/s (cost {plain / cached:.2f}x;"
          f" one line per sample {one_per_line:,.0f}/s, {plain / one_per_line:.2f}x)")
    try:
        from influxdb_client import Point
    except ImportError:
        return
    point = rate(lambda: len([Point(s.metric).tag("node", s.node).tag("entity", s.entity)
                              .field("value", s.value).time(int(s.observed_at * 1e9))
                              .to_line_protocol() for s in samples]), 1.0)
    print(f"serialise: influxdb-client Point {point:,.0f}/s (cost {plain / point:.2f}x)")


def remote(seconds: float) -> None:
    if shutil.which("victoria-metrics") is None:
        print("victoria-metrics not on PATH: remote figures skipped")
        return
    from storage.influxdb import InfluxDbStore
    from tests.vm_server import start_victoria_metrics

    with tempfile.TemporaryDirectory() as tmp:
        server = start_victoria_metrics(Path(tmp))
        try:
            host, port = server.url.removeprefix("http://").split(":")
            samples = batch(0)  # the raw body is the same encoding the backend sends
            body = "\n".join(LineEncoder(precision="ms").samples(samples)).encode()
            conn = http.client.HTTPConnection(host, int(port))

            def post() -> int:
                conn.request("POST", "/api/v2/write?org=o&bucket=b&precision=ms", body)
                conn.getresponse().read()
                return len(samples)

            raw = rate(post, seconds)
            store = InfluxDbStore(url=server.url, org="o", bucket="b", token="x")
            rounds = iter(range(1, 10**9))
            batches = [batch(i) for i in range(20)]
            ours = rate(lambda: (store.write(batches[next(rounds) % 20], []), 4980)[1], seconds)
            lines = store.encode(samples, [])
            client_only = rate(lambda: (store.write_lines(lines), len(samples))[1], seconds)
            cpu0 = time.process_time()
            wall0 = time.perf_counter()
            for b in batches:
                store.write(b, [])
            cpu = (time.process_time() - cpu0) / (len(batches) * len(samples))
            store.close()
            print(f"remote raw limit (pre-built body, http.client): {raw:,.0f} samples/s")
            print(f"influxdb backend (check + encode + influxdb-client POST): {ours:,.0f} "
                  f"samples/s = {ours / raw:.0%} of raw")
            print(f"influxdb-client HTTP layer alone (pre-encoded lines): {client_only:,.0f} "
                  f"samples/s = {client_only / raw:.0%} of raw")
            print(f"influxdb backend CPU: {cpu * 1e6:.2f} us/sample -> 30,000 samples/s uses "
                  f"{cpu * 30000:.0%} of one core (wall {time.perf_counter() - wall0:.2f} s)")
        finally:
            server.stop()


def sqlite(seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clock = FakeClock(now=T0 - 86400)
        store = SqliteStore(path=Path(tmp) / "bench.sqlite", clock=clock)
        rounds = 400
        batches = [[Sample(metric=s.metric, value=s.value, observed_at=T0 - 86400 + i * 10,
                           node=s.node, entity=s.entity) for s in batch(i)]
                   for i in range(rounds)]
        state = {"i": 0}

        def write() -> int:  # 10 s of a 167-GPU fleet per batch; compaction included
            i = state["i"]
            state["i"] += 1
            b = batches[i % rounds]
            clock.now = T0 - 86400 + i * 10 + 1
            if i >= rounds:  # keep going with fresh timestamps
                b = [Sample(metric=s.metric, value=s.value, observed_at=clock.now - 1,
                            node=s.node, entity=s.entity) for s in b]
            store.write(b, [])
            return len(b)

        cpu0 = time.process_time()
        ingest = rate(write, seconds)
        cpu = time.process_time() - cpu0
        print(f"sqlite ingest (4,980-sample batches): {ingest:,.0f} samples/s; 30,000 samples/s"
              f" uses {30000 / ingest * cpu / seconds:.0%} of one core")
        store.close()

        week_clock = FakeClock(now=T0)
        week = SqliteStore(path=Path(tmp) / "week.sqlite", clock=week_clock)
        points = 7 * 86400 // 10
        start = T0 - 7 * 86400
        for k in range(0, points, 360):
            week.write([Sample(metric=m, value=float(j), observed_at=start + j * 10,
                               node=NodeName("n1"), entity=EntityId("GPU-a"))
                        for j in range(k, min(points, k + 360)) for m in METRICS], [])
        week_clock.advance(7200)
        week.compact()
        ref = [EntityRef(node=NodeName("n1"), entity=EntityId("GPU-a"))]
        t = time.perf_counter()
        total = sum(len(week.read(m, ref, start, T0)) for m in METRICS)
        elapsed = time.perf_counter() - t
        print(f"sqlite GPU-week read: {total:,} points ({len(METRICS)} metrics x {points:,}) in"
              f" {elapsed:.3f} s")
        week.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    serialisation(batch(0))
    sqlite(args.seconds)
    remote(args.seconds)


if __name__ == "__main__":
    main()
