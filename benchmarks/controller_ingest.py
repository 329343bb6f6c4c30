"""Controller ingest and fault-to-cordon latency through agent, controller and adapter.

Part 1, ingest (``--seconds``, default 20): one ``gpuhealth controller`` process pinned to
one core (``taskset``-style affinity), its fleet state on a real PostgreSQL (loopback,
``tests/pg_server.py``), takes agents' batches of findings over HTTP from a load generator
in this process (pinned to another core, asyncio, ``--agents`` simulated agents with their
own tokens, ``--batch`` findings per batch):

* sustained: as fast as the controller acknowledges (findings/s; goal >= 5,000/s on one
  core; NVSentinel's 1,500-node test saw bursts of 1,500-4,200 events/s);
* burst: 4,200 findings/s offered for ``--burst-seconds`` (default 10): acknowledgement
  latency p50/p99 and the count stored against the count sent (no loss);
* anchor: the same records inserted straight into the same PostgreSQL with psycopg
  ``executemany`` on one connection (the database's own rate for this schema).

Part 2, latency (``--trials``, default 5): ``--trials`` real ``gpuhealth agent`` processes,
each following its own kernel-log file, report to a live controller whose scheduler is the
Kubernetes API stand-in (``tests/k8s_api.py``; no API server runs here). Per trial one
Xid 79 line is appended to one agent's file; the clock stops when the stand-in has the node
``spec.unschedulable`` (cordon). p50/p99 beside the goal (p99 < 1 s).

Usage::

    .venv/bin/python benchmarks/controller_ingest.py [--seconds 20] [--trials 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.k8s_api import running_k8s_api
from tests.pg_server import start_postgres
from tests.servers import free_port

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
XID79 = ("[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:b1:00): 79, pid=1234, "
         "GPU has fallen off the bus.\n")


def finding(node: str, n: int) -> dict[str, Any]:
    """A realistic finding body (an SBE storm on one GPU) as an agent sends it."""
    return {
        "node": node, "entity": f"GPU-{uuid.UUID(int=n % 8)}", "kind": "ecc", "code": "sbe",
        "severity": "warning", "action": "none",
        "summary": "corrected ECC errors rising on this GPU: watch for a row remap",
        "evidence": [{"file": "nvml", "line": None,
                      "text": f"volatile SBE count {n} (nvmlDeviceGetTotalEccErrors)"}],
        "source": "gpu.ecc_rule (NVIDIA memory error documentation)",
        "first_seen_at": 1.7e9, "last_seen_at": 1.7e9 + n, "occurrences": n + 1,
        "confidence": 1.0,
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@contextlib.contextmanager
def controller(folder: Path, *, dsn: str, tokens: dict[str, str], extra: str = "",
               cpu: int | None = 0) -> Iterator[int]:
    """A ``gpuhealth controller`` process; yields its port."""
    port = free_port()
    (folder / "tokens").write_text("".join(f"{n} {t}\n" for n, t in tokens.items()))
    config = folder / "ctl.toml"
    config.write_text(f"""
[node]
name = "ctl-bench"
data_dir = "{folder / 'data'}"
[metrics]
enabled = false
[alerting]
api_enabled = false
[report]
enabled = false
[analytics]
evaluate_interval_seconds = 1
[controller]
port = {port}
state = "{dsn}"
agent_tokens_file = "{folder / 'tokens'}"
consume_interval_seconds = 0.05
{extra}
""")
    with (folder / "ctl.log").open("ab") as log:
        proc = subprocess.Popen([GPUHEALTH, "-q", "controller", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if cpu is not None and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, {cpu})
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"controller did not start: {(folder / 'ctl.log').read_text()}")
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


async def load(port: int, tokens: dict[str, str], *, seconds: float, batch: int,
               rate: float | None) -> tuple[int, list[float], int]:
    """Post batches for ``seconds``; return (findings acknowledged, latencies, errors)."""
    acked = 0
    errors = 0
    latencies: list[float] = []
    nodes = list(tokens)
    per_agent = None if rate is None else rate / len(nodes) / batch  # batches/s per agent
    limits = httpx.Limits(max_connections=len(nodes), max_keepalive_connections=len(nodes))
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        stop_at = time.monotonic() + seconds

        async def agent(node: str) -> None:
            nonlocal acked, errors
            headers = {"Authorization": f"Bearer {tokens[node]}"}
            n = 0
            next_at = time.monotonic()
            while time.monotonic() < stop_at:
                records = [{"key": f"{node}:{uuid.uuid4().hex}", "kind": "finding",
                            "at": time.time(), "body": finding(node, n + i)}
                           for i in range(batch)]
                n += batch
                body = json.dumps({"node": node, "agent_version": "bench",
                                   "heartbeat": {"at": time.time(), "gpus": []},
                                   "records": records}).encode()
                started = time.monotonic()
                answer = await client.post(f"http://127.0.0.1:{port}/api/v1/agents/{node}/batch",
                                           content=body, headers=headers)
                latencies.append(time.monotonic() - started)
                if answer.status_code == 200:
                    acked += batch
                else:
                    errors += 1
                if per_agent is not None:
                    next_at += 1.0 / per_agent
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))

        await asyncio.gather(*(agent(n) for n in nodes))
    return acked, latencies, errors


def stored(dsn: str) -> int:
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM fleet_records").fetchone()
        return int(row[0]) if row else 0


def anchor(dsn: str, count: int) -> float:
    """Raw PostgreSQL inserts of the same records on one connection, records/s."""
    import psycopg

    rows = [(f"anchor:{uuid.uuid4().hex}", "anchor", "finding", time.time(),
             json.dumps(finding("anchor", i)), time.time()) for i in range(count)]
    with psycopg.connect(dsn) as conn:
        started = time.perf_counter()
        for i in range(0, count, 500):
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO fleet_records (key, node, kind, at, body, "
                                "accepted_at) VALUES (%s,%s,%s,%s,%s,%s) ON CONFLICT (key) "
                                "DO NOTHING", rows[i:i + 500])
            conn.commit()
        return count / (time.perf_counter() - started)


def latency_trials(folder: Path, dsn: str, trials: int) -> list[float]:
    """Fault line on an agent to node cordoned in the Kubernetes stand-in, seconds."""
    nodes = [f"gpu-{i:03d}" for i in range(trials)]
    tokens = {n: f"tok-{n}-{uuid.uuid4().hex}" for n in nodes}
    out: list[float] = []
    with running_k8s_api() as api:
        for n in nodes:
            api.add_node(n)
        extra = f"""
[remediation]
dry_run = false
scheduler = "kubernetes"
cluster_size = {trials}
max_disrupted_fraction = 1.0
breaker_max_nodes = {trials + 1}
tick_seconds = 0.05
[remediation.scheduler_options]
host = "{api.url}"
poll_seconds = 0.05
"""
        with controller(folder, dsn=dsn, tokens=tokens, extra=extra, cpu=None) as port:
            agents = []
            for n in nodes:
                log = folder / f"{n}.kern.log"
                log.touch()
                cfg = folder / f"{n}.toml"
                cfg.write_text(f"""
[node]
name = "{n}"
data_dir = "{folder / n}"
[metrics]
enabled = false
[alerting]
api_enabled = false
[collectors.nvml]
enabled = false
[collectors.network]
enabled = false
[collectors.probe]
enabled = false
[collectors.kernel_log]
source = "file"
path = "{log}"
poll_interval_seconds = 0.02
[analytics]
evaluate_interval_seconds = 1
[agent]
controllers = ["http://127.0.0.1:{port}"]
token_env = "AGENT_TOKEN"
send_interval_seconds = 0.05
""")
                with (folder / f"{n}.log").open("ab") as handle:
                    agents.append(subprocess.Popen(
                        [GPUHEALTH, "-q", "agent", "--config", str(cfg)], stdout=handle,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        env={**os.environ, "AGENT_TOKEN": tokens[n]}))
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    seen = httpx.get(f"http://127.0.0.1:{port}/api/v1/agents").json()
                    if len(seen) == len(nodes):
                        break
                    time.sleep(0.2)
                time.sleep(1.0)
                for n in nodes:
                    started = time.perf_counter()
                    with (folder / f"{n}.kern.log").open("a") as handle:
                        handle.write(XID79)
                    while time.perf_counter() - started < 30:
                        if api.node(n)["spec"].get("unschedulable"):
                            out.append(time.perf_counter() - started)
                            break
                        time.sleep(0.002)
                    else:
                        print(f"  {n}: not cordoned within 30 s", flush=True)
            finally:
                for proc in agents:
                    proc.send_signal(signal.SIGTERM)
                for proc in agents:
                    try:
                        proc.wait(20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--burst-seconds", type=float, default=10.0)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)))
    with start_postgres() as pg, tempfile.TemporaryDirectory(prefix="gh-ingest-") as tmp:
        folder = Path(tmp)
        nodes = [f"node-{i:04d}" for i in range(args.agents)]
        tokens = {n: f"tok-{n}-{uuid.uuid4().hex}" for n in nodes}
        with controller(folder, dsn=pg.dsn, tokens=tokens) as port:
            acked, lat, errors = asyncio.run(load(port, tokens, seconds=args.seconds,
                                                  batch=args.batch, rate=None))
            sustained = acked / args.seconds
            before = stored(pg.dsn)
            burst_acked, burst_lat, burst_errors = asyncio.run(load(
                port, tokens, seconds=args.burst_seconds, batch=args.batch, rate=4200.0))
            burst_stored = stored(pg.dsn) - before
        raw = anchor(pg.dsn, 20_000)
        (folder / "lat").mkdir()
        trials = latency_trials(folder / "lat", pg.dsn, args.trials) if args.trials else []
    print("controller ingest (one replica pinned to one core, real PostgreSQL on loopback)")
    print(f"  sustained        {sustained:10.0f} findings/s   goal >= 5000/s   "
          f"{'met' if sustained >= 5000 else 'NOT met'}   "
          f"({args.agents} agents x {args.batch}/batch, {errors} errors, "
          f"ack p50 {pct(lat, 0.5) * 1e3:.0f} ms p99 {pct(lat, 0.99) * 1e3:.0f} ms)")
    print(f"  anchor           {raw:10.0f} records/s    raw psycopg executemany, one "
          f"connection: the controller reaches {sustained / raw:.2f}x of it")
    print(f"  burst 4200/s     {burst_acked / args.burst_seconds:10.0f} findings/s   "
          f"stored {burst_stored} of {burst_acked} acknowledged, {burst_errors} errors, "
          f"ack p50 {pct(burst_lat, 0.5) * 1e3:.0f} ms p99 {pct(burst_lat, 0.99) * 1e3:.0f} ms"
          f"   {'no loss' if burst_stored == burst_acked else 'LOSS'}")
    if trials:
        p99 = pct(trials, 0.99)
        print(f"fault line on agent -> node cordoned (Kubernetes stand-in), {len(trials)} trials")
        print(f"  p50 {statistics.median(trials) * 1e3:.0f} ms  p99 {p99 * 1e3:.0f} ms   "
              f"goal p99 < 1000 ms   {'met' if p99 < 1.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
