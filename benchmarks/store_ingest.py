"""Store ingest and read benchmark (issue 4).

Prints samples per second from one process into each backend beside the raw limit measured
in the same run (a pre-built line-protocol body posted in a loop to a local
VictoriaMetrics), the serialisation cost of our encoder against a plain formatted string
and influxdb-client's ``Point``, SQLite ingest in batches, the GPU-week read, and the share
of one core that 30,000 samples/s (10,000 GPUs x 30 metrics every 10 s) costs.

The remote figures break the backend down stage by stage (the raw ``http.client`` POST,
influxdb-client's HTTP layer on the same body, our check and encoding, the backend without
and with its overlap of encoding and posting), each the median of ``--repeats``
interleaved runs, and the backend's ratio to the raw run just before it, round by round.
Where ``taskset`` and two CPUs allow, the server is pinned to one CPU (``GOMAXPROCS=1``)
and this process to the others for every stage, as the output says (``--pin both`` prints
the unpinned figures too).

Run: ``.venv/bin/python benchmarks/store_ingest.py [--seconds 5] [--only remote]
[--pin auto|off|both]`` (VictoriaMetrics from PATH for the remote figures; without it they
are skipped).
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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


def rate(fn: Callable[[], int], seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += fn()
    return n / (time.perf_counter() - start)


def serialisation(samples: list[Sample], repeats: int = 3) -> None:
    """Our encoder against a plain formatted string (and ``Point``), medians of ``repeats``."""
    n = len(samples)
    encoder = LineEncoder(precision="ms")
    single = LineEncoder(precision="ms", merge_fields=False)
    stages: dict[str, Callable[[], int]] = {
        "plain": lambda: len([f"{s.metric},node={s.node},entity={s.entity} value={s.value} "
                              f"{int(s.observed_at * 1e9)}"  # type: ignore[operator]
                              for s in samples]),
        "cold": lambda: (LineEncoder(precision="ms").samples(samples), n)[1],
        "warm": lambda: (encoder.samples(samples), n)[1],
        "single": lambda: (single.samples(samples), n)[1],
    }
    runs: dict[str, list[float]] = {name: [] for name in stages}
    for _ in range(repeats):
        for name, fn in stages.items():
            runs[name].append(rate(fn, 1.0))
    got = {name: statistics.median(values) for name, values in runs.items()}
    plain, ours, cached, one_per_line = got["plain"], got["cold"], got["warm"], got["single"]
    print(f"serialise: plain f-string {plain:,.0f}/s; LineEncoder cold {ours:,.0f}/s "
          f"(cost {plain / ours:.2f}x), warm cache {cached:,.0f}/s (cost {plain / cached:.2f}x;"
          f" one line per sample {one_per_line:,.0f}/s, {plain / one_per_line:.2f}x)")
    try:
        from influxdb_client.client.write.point import Point
    except ImportError:
        return
    point = rate(lambda: len([Point(s.metric)  # type: ignore[no-untyped-call]
                              .tag("node", s.node).tag("entity", s.entity)
                              .field("value", s.value)
                              .time(int(s.observed_at * 1e9))  # type: ignore[operator]
                              .to_line_protocol() for s in samples]), 1.0)
    print(f"serialise: influxdb-client Point {point:,.0f}/s (cost {plain / point:.2f}x)")


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used, from ``/proc/<pid>/stat`` (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _staged(fn: Callable[[], int], seconds: float, pid: int) -> tuple[float, float, float]:
    """Run ``fn`` for ``seconds``; return (samples/s, our CPU ns/sample, server CPU ns/sample)."""
    ours0, theirs0 = time.process_time(), _cpu_seconds(pid)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += fn()
    wall = time.perf_counter() - start
    ours, theirs = time.process_time() - ours0, _cpu_seconds(pid) - theirs0
    return n / wall, ours / n * 1e9, theirs / n * 1e9


def pin_plan() -> tuple[set[int], set[int]] | None:
    """Return (client CPUs, server CPUs) to pin to, or ``None`` where pinning cannot be done.

    Pinning needs ``taskset`` and at least two CPUs this process may use: the server gets the
    last one (with ``GOMAXPROCS=1``), this process the others, as when the database runs on
    another machine. Unpinned, on a small machine, the server's threads and ours take turns
    on the same cores, so whatever the client does beside the server (encoding the next
    half while the server parses one) takes CPU from the server itself, which the raw loop
    (the client idle while waiting) never does.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or shutil.which("taskset") is None:
        return None
    return set(cpus[:-1]), {cpus[-1]}


def remote(seconds: float, repeats: int = 3, pin: bool = True) -> None:
    """The influxdb backend against a local VictoriaMetrics, stage by stage.

    Each figure is the median of ``repeats`` interleaved runs of ``seconds`` each (the
    machine is shared): the raw limit (the bodies of 20 batches, encoded beforehand, posted
    in turn with ``http.client``), the same bodies through influxdb-client's HTTP layer
    (urllib3, its retry wrapper), our check and encoding alone, and the whole backend on the
    same 20 batches; beside each, the CPU this process and the server spent per sample (the
    wall time is about their sum where they cannot overlap, as on a busy 2-core machine).

    With ``pin`` (and :func:`pin_plan` possible) the server runs on its own CPU with
    ``GOMAXPROCS`` set to match, and this process on the others, for every stage alike.
    """
    if shutil.which("victoria-metrics") is None:
        print("victoria-metrics not on PATH: remote figures skipped")
        return
    from storage.influxdb import InfluxDbStore
    from tests.vm_server import start_victoria_metrics

    plan = pin_plan() if pin else None
    mask = os.sched_getaffinity(0)
    if plan is None:
        placement = ("unpinned: server and client share all CPUs" if not pin else
                     "unpinned (pinning needs taskset and >= 2 CPUs): server and client share"
                     " all CPUs")
    else:
        placement = (f"pinned: server on CPU {','.join(map(str, sorted(plan[1])))} "
                     f"(GOMAXPROCS={len(plan[1])}), client on CPU "
                     f"{','.join(map(str, sorted(plan[0])))}")
    with tempfile.TemporaryDirectory() as tmp:
        server = start_victoria_metrics(Path(tmp), cpus=plan[1] if plan else None)
        if plan is not None:
            os.sched_setaffinity(0, plan[0])  # this thread, and the threads it starts
        try:
            assert server.proc is not None
            pid = server.proc.pid
            host, port = server.url.removeprefix("http://").split(":")
            # Every stage sends the same 20 batches in turn: the server's cost depends on the
            # data (posting one body again and again costs it about a third less per sample).
            batches = [batch(i) for i in range(20)]
            n = len(batches[0])
            texts = [LineEncoder(precision="ms").samples(b) for b in batches]
            bodies = ["\n".join(lines).encode() for lines in texts]
            conn = http.client.HTTPConnection(host, int(port))
            rounds = iter(range(1, 10**9))

            def post() -> int:
                body = bodies[next(rounds) % 20]
                conn.request("POST", "/api/v2/write?org=o&bucket=b&precision=ms", body)
                conn.getresponse().read()
                return n

            def post_one() -> int:  # the raw limit as first measured: one body, again and again
                conn.request("POST", "/api/v2/write?org=o&bucket=b&precision=ms", bodies[0])
                conn.getresponse().read()
                return n

            store = InfluxDbStore(url=server.url, org="o", bucket="b", token="x")
            serial = InfluxDbStore(url=server.url, org="o", bucket="b", token="x",
                                   overlap_min_samples=0)
            lines = texts[0]

            def client() -> int:
                store.write_lines(texts[next(rounds) % 20])
                return n

            def encode() -> int:
                store.encode(batches[next(rounds) % 20], [])
                return n

            def backend() -> int:
                store.write(batches[next(rounds) % 20], [])
                return n

            def one_by_one() -> int:
                serial.write(batches[next(rounds) % 20], [])
                return n

            def streamed() -> int:  # a run of 100 batches per call (the 20, five times)
                return n * store.write_stream((b, []) for b in batches * 5)

            stages: dict[str, tuple[str, Callable[[], int]]] = {
                "raw": ("raw limit: pre-built bodies, http.client", post),
                "one": ("  (one pre-built body again and again)", post_one),
                "client": ("same bodies through influxdb-client's HTTP layer", client),
                "encode": ("check + encode alone (no HTTP)", encode),
                "serial": ("backend without overlap: encode all, then POST", one_by_one),
                "backend": ("influxdb backend: check + encode + client POST", backend),
                "stream": ("influxdb backend, a run of batches (write_stream)", streamed),
            }
            for _ in range(2 * len(bodies)):  # untimed: the server creates its series first
                post()
            runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in stages}
            for _ in range(repeats):
                for name in ("raw", "backend", "stream", "serial", "client", "encode", "one"):
                    runs[name].append(_staged(stages[name][1], seconds, pid))
            got = {name: tuple(statistics.median(v[i] for v in values) for i in range(3))
                   for name, values in runs.items()}
            store.close()
            serial.close()
            raw = got["raw"][0]
            print(f"remote, {placement}; medians of {repeats} interleaved runs of {seconds:g} s"
                  f" ({n:,}-sample batches, {len(lines)} lines per body, 30 fields a line):")
            print(f"  {'stage':<50}{'samples/s':>12}{'of raw':>8}{'wall ns':>9}"
                  f"{'our CPU':>9}{'server CPU':>11}")
            for name, (label, _) in stages.items():
                per_s, ours, theirs = got[name]
                print(f"  {label:<50}{per_s:>12,.0f}{per_s / raw:>8.0%}{1e9 / per_s:>9.0f}"
                      f"{ours:>9.0f}{theirs:>11.0f}")
            whole = got["backend"]
            for name in ("stream", "backend", "serial"):  # the raw run before: less drift
                ratios = sorted(b[0] / r[0] for r, b in zip(runs["raw"], runs[name], strict=True))
                print(f"  {stages[name][0].strip()}: per-round ratio to the raw run before it,"
                      f" median {statistics.median(ratios):.0%} (range {ratios[0]:.0%}"
                      f"-{ratios[-1]:.0%})")
            print(f"  influxdb backend, a run of batches (gpuhealth import, a spool's backlog) = "
                  f"{got['stream'][0] / raw:.0%} of the raw limit (goal >= 60%), "
                  f"{got['stream'][0] / got['client'][0]:.0%} of influxdb-client's own limit "
                  f"on the same bodies; one write() per batch (the service's steady state) = "
                  f"{whole[0] / raw:.0%}")
            layer = got["client"][1] - got["raw"][1]
            print(f"  influxdb-client's HTTP layer costs {layer:+.0f} ns "
                  f"of our CPU per sample over http.client, check + encode "
                  f"{got['encode'][1]:.0f} ns; 30,000 samples/s use "
                  f"{whole[1] * 1e-9 * 30000:.1%} of one core")
        finally:
            os.sched_setaffinity(0, mask)
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
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--only", choices=("serialise", "sqlite", "remote"),
                        help="run one part only")
    parser.add_argument("--pin", choices=("auto", "off", "both"), default="auto",
                        help="remote figures with the server pinned to its own CPU (auto: where"
                             " taskset and >= 2 CPUs allow), unpinned (off), or both")
    args = parser.parse_args()
    if args.only in (None, "serialise"):
        serialisation(batch(0), args.repeats)
    if args.only in (None, "sqlite"):
        sqlite(args.seconds)
    if args.only in (None, "remote"):
        if args.pin in ("auto", "both"):
            remote(args.seconds, args.repeats, pin=True)
        if args.pin in ("off", "both"):
            remote(args.seconds, args.repeats, pin=False)


if __name__ == "__main__":
    main()
