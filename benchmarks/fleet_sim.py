"""Fleet simulator (#18 items 1-2): N simulated agents against a real controller pair.

What runs, all on loopback:

* a real PostgreSQL (``tests/pg_server.py``) holding the fleet state;
* two ``gpuhealth controller`` processes (``ctl-a``, ``ctl-b``) on it, ``postgres``
  leader election (lease ``--lease-seconds``), live remediation through the Kubernetes
  API stand-in (``tests/k8s_api.py``, every simulated node added) or ``--dry-run``;
* ``--workers`` processes of simulated agents (asyncio, aiohttp): every agent speaks the
  agent protocol of ``storage/agent_outbox.py`` (``POST /api/v1/agents/<node>/batch``
  with its own bearer token, a heartbeat with its 8 GPUs and its ``[inventory]`` facts on
  every batch, records with idempotency keys ``<node>:<hex>``), keeps an outbox that is
  emptied only on a 200, tries its two controllers in turn (half the fleet lists ``ctl-a``
  first, half ``ctl-b``) and backs off as the real agent does (1 s doubling to 30 s, 5 s
  while a controller answers but cannot write). One connection pool per worker process
  stands in for the agents' own connections (``--connections`` each).

The load, per phase:

1. *register*: every agent's first heartbeat, spread over one heartbeat interval;
2. *steady* (``--duration``): heartbeats of all nodes every ``--heartbeat-seconds``
   (the agent's default, 10 s), background findings (warnings: corrected ECC, PCIe
   replays, thermal slowdown, NVLink CRC; opened, updated and cleared) at
   ``max(production, 500/s)`` where production is 9 events/s per 600 nodes (the top of
   0.1-9 events/s per cluster of 15-600 nodes), and *probe faults*: one Xid 79 at a
   time on a fresh node, timed from the agent's record to the node cordoned in the
   stand-in (time-to-cordon). GPU and link failures at Llama 3's rate (466 interruptions
   in 54 days on 16,384 GPUs, scaled to N x 8 GPUs) run beside them; the probes run
   far faster than that rate so that p99 has samples (both rates printed);
3. *fail-over* (``--failover``, default at >= 10,000 nodes): the leader SIGKILLed under
   load; probes go on; decisions resume when a probe sent after the kill is cordoned;
4. *outage* (``--outage-seconds``, default at >= 10,000 nodes): both controllers stopped;
   the agents queue what a 10-minute outage at the production rate queues (generated in
   ``--outage-seconds`` of real time: scaled time), then both start again; catch-up is
   the time until every outbox is empty and the leader has consumed every record;
5. *burst*: a switch failure takes 5 % of the nodes at once (one ``switch`` fact): a
   major link-down finding on each, then 4,200 events/s for 30 s on those nodes (flapping
   links); no loss, event-to-decision (the agent's record to the leader's consumer past
   it, polled every 50 ms) p50/p99, and whether the fleet incident opened the breaker.

Accounting at the end: every record made was acknowledged, stored once (by key), and
consumed by the leader; no remediation step stored twice.

Usage::

    nice -n 19 .venv/bin/python benchmarks/fleet_sim.py --nodes 1000 --duration 60
    nice -n 19 .venv/bin/python benchmarks/fleet_sim.py --quick --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
GPUS_PER_NODE = 8
BATCH_MAX_RECORDS = 500
"""The agent's ``[agent] batch_max_records`` default."""
SEND_INTERVAL_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
ANSWERED_BACKOFF_SECONDS = 5.0
LLAMA3_PER_GPU_SECOND = 466 / (54 * 86400 * 16384)
"""Llama 3 405B pre-training: 466 job interruptions in 54 days on 16,384 GPUs."""
PRODUCTION_PER_NODE_SECOND = 9 / 600
"""Background findings: the top of 0.1-9 events/s per cluster of 15-600 nodes."""
SUSTAINED_GOAL = 500.0
BURST_RATE, BURST_SECONDS, BURST_FRACTION = 4200.0, 30.0, 0.05
OUTAGE_SIMULATED_SECONDS = 600.0
DRIVER = "550.54.15"
XID79 = ("[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:b1:00): 79, pid=1234, "
         "GPU has fallen off the bus.")
BACKGROUND = (
    ("ecc", "sbe", "corrected ECC errors rising on this GPU: watch for a row remap",
     "volatile SBE count {n} (nvmlDeviceGetTotalEccErrors)"),
    ("pcie", "replay", "PCIe replays rising on this GPU", "replay counter {n}"),
    ("thermal", "slowdown", "thermal slowdown on this GPU", "clocks event reasons 0x20 ({n})"),
    ("nvlink", "crc", "NVLink CRC errors on this GPU", "nvlink crc flit errors {n}"),
)
GOALS = {
    "memory": "both replicas + PostgreSQL < 8 GB at 100k nodes (NVSentinel ~221 GB)",
    "sustained": ">= 500 events/s with heartbeats of all nodes",
    "burst": "4,200 events/s for 30 s, no loss, p99 event-to-decision < 5 s",
    "cordon": "p99 < 1 s at 10k nodes, < 2 s at 100k (NVSentinel p50 26 ms / p99 165 ms "
              "at 50k)",
    "failover": "decisions resume within the lease + 5 s, nothing lost or doubled",
    "outage": "a 10-minute outage at 10k nodes caught up, nothing lost",
}


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def node_name(i: int) -> str:
    return f"gpu-{i:06d}"


def token_of(i: int, salt: str) -> str:
    return f"tok-{i}-{salt}"


def switch_of(i: int, nodes: int) -> str:
    """The aggregation switch of node ``i``: 20 of them, 5 % of the nodes each."""
    return f"agg-{i // max(1, math.ceil(nodes * BURST_FRACTION)):03d}"


# --- the simulated agents (worker processes) --------------------------------------------


@dataclass(slots=True)
class SimAgent:
    """One simulated agent: its outbox, its controllers, its schedule."""

    index: int
    node: str
    token: str
    urls: tuple[str, str]
    facts: dict[str, str]
    outbox: deque[dict[str, Any]] = field(default_factory=deque)
    open: dict[tuple[str, str], int] = field(default_factory=dict)
    next_url: int = 0
    queued: bool = False
    inflight: bool = False
    due_at: float = 0.0
    backoff: float = SEND_INTERVAL_SECONDS
    down: bool = False
    serial: int = 0

    def key(self, tag: str) -> str:
        self.serial += 1
        return f"{self.node}:{tag}{self.serial:x}"

    def gpus(self) -> list[dict[str, str]]:
        return [{"entity": f"GPU-{uuid.UUID(int=self.index * GPUS_PER_NODE + g)}"}
                for g in range(GPUS_PER_NODE)]


def finding_body(agent: SimAgent, *, entity: str, kind: str, code: str, severity: str,
                 action: str, summary: str, evidence: str, occurrences: int,
                 at: float) -> dict[str, Any]:
    """A finding as an agent sends it (``core.codec.finding_to_json``'s shape)."""
    return {"node": agent.node, "entity": entity, "kind": kind, "code": code,
            "severity": severity, "action": action, "summary": summary,
            "evidence": [{"file": "nvml", "line": None, "text": evidence}],
            "source": "fleet_sim", "first_seen_at": at, "last_seen_at": at,
            "occurrences": occurrences, "confidence": 1.0}


class Worker:
    """The agents of one worker process and their asyncio loop."""

    def __init__(self, *, indexes: list[int], nodes: int, salt: str, urls: list[str],
                 heartbeat_seconds: float, connections: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.heartbeat_seconds = heartbeat_seconds
        self.connections = connections
        self.agents: dict[int, SimAgent] = {}
        for i in indexes:
            order = (urls[0], urls[1]) if i % 2 == 0 else (urls[1], urls[0])
            self.agents[i] = SimAgent(
                index=i, node=node_name(i), token=token_of(i, salt), urls=order,
                facts={"switch": switch_of(i, nodes), "rack": f"rack-{i // 16:05d}",
                       "driver_version": DRIVER})
        self.order = list(self.agents.values())
        self.heap: list[tuple[float, int]] = []
        self.queue: asyncio.Queue[SimAgent] = asyncio.Queue()
        self.rate = 0.0
        self.burst: tuple[list[int], float, float] | None = None
        self.generating = True
        self.counts: dict[str, int] = {"made": 0, "made_burst": 0, "acked": 0,
                                       "accepted": 0, "duplicates": 0, "batches": 0,
                                       "heartbeat_only": 0, "failed_tries": 0,
                                       "refused": 0, "llama3": 0}
        self.statuses: dict[str, int] = {}
        self.latencies: list[float] = []
        self.session: Any = None

    # scheduling
    def schedule(self, agent: SimAgent, at: float) -> None:
        agent.due_at = at
        heapq.heappush(self.heap, (at, agent.index))

    def wake(self, agent: SimAgent) -> None:
        """New records: send at once (the real agent's forward() wakes its sender)."""
        if not agent.queued and not agent.inflight:
            agent.queued = True
            self.queue.put_nowait(agent)

    def put(self, agent: SimAgent, kind: str, body: dict[str, Any], *, at: float,
            tag: str) -> None:
        agent.outbox.append({"key": agent.key(tag), "kind": kind, "at": at, "body": body})
        self.counts["made"] += 1
        if tag == "b":
            self.counts["made_burst"] += 1
        self.wake(agent)

    async def ticker(self) -> None:
        while True:
            now = time.time()
            while self.heap and self.heap[0][0] <= now:
                at, index = heapq.heappop(self.heap)
                agent = self.agents[index]
                if at == agent.due_at and not agent.queued and not agent.inflight:
                    agent.queued = True
                    self.queue.put_nowait(agent)
            await asyncio.sleep(0.02)

    # what the agents see
    def background(self, agent: SimAgent, now: float) -> None:
        g = self.rng.randrange(GPUS_PER_NODE)
        kind, code, summary, evidence = BACKGROUND[self.rng.randrange(len(BACKGROUND))]
        entity = f"GPU-{uuid.UUID(int=agent.index * GPUS_PER_NODE + g)}"
        if (entity, kind) in agent.open and self.rng.random() < 0.5:
            del agent.open[(entity, kind)]
            self.put(agent, "finding_cleared", {"node": agent.node, "entity": entity,
                                                "kind": kind, "code": code}, at=now, tag="c")
            return
        n = agent.open.get((entity, kind), 0) + 1
        agent.open[(entity, kind)] = n
        self.put(agent, "finding", finding_body(
            agent, entity=entity, kind=kind, code=code, severity="warning", action="none",
            summary=summary, evidence=evidence.format(n=n), occurrences=n, at=now),
            at=now, tag="g")

    def fault(self, agent: SimAgent, at: float, *, clear: bool = False) -> None:
        entity = f"GPU-{uuid.UUID(int=agent.index * GPUS_PER_NODE)}"
        if clear:
            self.put(agent, "finding_cleared", {"node": agent.node, "entity": entity,
                                                "kind": "xid", "code": "79"}, at=at, tag="c")
            return
        self.put(agent, "finding", finding_body(
            agent, entity=entity, kind="xid", code="79", severity="critical",
            action="reboot_node", summary="Xid 79: GPU has fallen off the bus",
            evidence=XID79, occurrences=1, at=at), at=at, tag="p")

    def link_down(self, agent: SimAgent, at: float, port: int, n: int) -> None:
        self.put(agent, "finding", finding_body(
            agent, entity=f"mlx5_{port}/1", kind="ib_port", code="down", severity="major",
            action="check_network", summary="InfiniBand port down (switch side)",
            evidence=f"mlx5_{port} port 1 state DOWN phys LinkDown ({n})", occurrences=n,
            at=at), at=at, tag="b")

    async def generator(self) -> None:
        credit = 0.0
        burst_credit = 0.0
        last = time.time()
        llama3 = LLAMA3_PER_GPU_SECOND * GPUS_PER_NODE * len(self.order)
        flaps: dict[tuple[int, int], int] = {}
        while True:
            await asyncio.sleep(0.02)
            now = time.time()
            dt, last = now - last, now
            if not self.generating or not self.order:
                continue
            credit += self.rate * dt
            while credit >= 1.0:
                credit -= 1.0
                self.background(self.order[self.rng.randrange(len(self.order))], now)
            if self.rng.random() < llama3 * dt:  # a real GPU or link failure, scaled
                self.counts["llama3"] += 1
                agent = self.order[self.rng.randrange(len(self.order))]
                self.put(agent, "finding", finding_body(
                    agent, entity=f"GPU-{uuid.UUID(int=agent.index * GPUS_PER_NODE + 1)}",
                    kind="xid", code="48", severity="critical", action="reset_gpu",
                    summary="Xid 48: double-bit ECC error", evidence="NVRM: Xid 48",
                    occurrences=1, at=now), at=now, tag="l")
            if self.burst is not None:
                targets, rate, until = self.burst
                if now >= until:
                    self.burst = None
                    continue
                burst_credit += rate * dt
                while burst_credit >= 1.0:
                    burst_credit -= 1.0
                    i = targets[self.rng.randrange(len(targets))]
                    port = self.rng.randrange(GPUS_PER_NODE)
                    flaps[(i, port)] = flaps.get((i, port), 1) + 1
                    self.link_down(self.agents[i], now, port, flaps[(i, port)])

    async def sender(self) -> None:
        while True:
            agent = await self.queue.get()
            agent.queued = False
            agent.inflight = True
            try:
                ok, answered = await self.send(agent)
            except Exception as exc:  # never let one agent stop a sender
                ok, answered = False, False
                self.statuses[type(exc).__name__] = self.statuses.get(type(exc).__name__,
                                                                      0) + 1
            finally:
                agent.inflight = False
            now = time.time()
            if ok:
                agent.down = False
                agent.backoff = SEND_INTERVAL_SECONDS
                if agent.outbox:
                    self.wake(agent)
                else:
                    self.schedule(agent, now + self.heartbeat_seconds)
            else:
                agent.down = True
                cap = ANSWERED_BACKOFF_SECONDS if answered else MAX_BACKOFF_SECONDS
                agent.backoff = min(cap, max(SEND_INTERVAL_SECONDS, agent.backoff * 2))
                self.schedule(agent, now + agent.backoff)

    async def send(self, agent: SimAgent) -> tuple[bool, bool]:
        """One batch with the heartbeat; return (acknowledged, a controller answered)."""
        import aiohttp

        records = [agent.outbox[i] for i in range(min(len(agent.outbox), BATCH_MAX_RECORDS))]
        now = time.time()
        body = json.dumps({
            "node": agent.node, "agent_version": "fleet-sim", "sent_at": now,
            "heartbeat": {"at": now, "gpus": agent.gpus(), "facts": agent.facts},
            "records": records}, separators=(",", ":")).encode()
        headers = {"Authorization": f"Bearer {agent.token}",
                   "Content-Type": "application/json"}
        answered = False
        for attempt in range(len(agent.urls)):
            which = (agent.next_url + attempt) % len(agent.urls)
            url = f"{agent.urls[which]}/api/v1/agents/{agent.node}/batch"
            started = time.perf_counter()
            try:
                async with self.session.post(url, data=body, headers=headers) as answer:
                    status = answer.status
                    reply = await answer.json() if status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                self.counts["failed_tries"] += 1
                continue
            answered = True
            if status == 200 and isinstance(reply, dict):
                self.latencies.append(time.perf_counter() - started)
                agent.next_url = which
                for _ in records:
                    agent.outbox.popleft()
                self.counts["batches"] += 1
                self.counts["acked"] += len(records)
                self.counts["accepted"] += int(reply.get("accepted", 0))
                self.counts["duplicates"] += int(reply.get("duplicates", 0))
                if not records:
                    self.counts["heartbeat_only"] += 1
                return True, True
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            if status in (400, 401, 403, 413, 422):
                self.counts["refused"] += len(records)
                for _ in records:  # never happens in a healthy run: counted, set aside
                    agent.outbox.popleft()
                return True, True
        return False, answered

    def stats(self, *, reset: bool = True) -> dict[str, Any]:
        latencies = self.latencies
        if reset:
            self.latencies = []
        times = os.times()
        return {**self.counts, "statuses": dict(self.statuses), "latencies": latencies,
                "depth": sum(len(a.outbox) for a in self.order),
                "cpu_seconds": times.user + times.system}

    async def main(self, conn: Connection) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.connections, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=10.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.session = session
            now = time.time()
            for agent in self.order:  # first heartbeats spread over one interval
                self.schedule(agent, now + self.rng.random() * self.heartbeat_seconds)
            tasks = [asyncio.create_task(self.ticker()), asyncio.create_task(self.generator())]
            tasks += [asyncio.create_task(self.sender()) for _ in range(self.connections)]
            loop = asyncio.get_running_loop()
            commands: asyncio.Queue[Any] = asyncio.Queue()

            def read() -> None:
                while True:
                    try:
                        item = conn.recv()
                    except EOFError:
                        item = ("stop",)
                    loop.call_soon_threadsafe(commands.put_nowait, item)
                    if item[0] == "stop":
                        return

            threading.Thread(target=read, daemon=True).start()
            while True:
                item = await commands.get()
                what = item[0]
                if what == "rate":
                    self.rate = float(item[1])
                elif what == "fault":
                    self.fault(self.agents[item[1]], float(item[2]), clear=bool(item[3]))
                elif what == "burst":
                    targets = [i for i in item[1] if i in self.agents]
                    for n, i in enumerate(targets):  # the switch goes: each node's link
                        self.link_down(self.agents[i], time.time(), n % GPUS_PER_NODE, 1)
                    if targets:
                        self.burst = (targets, float(item[2]) * len(targets) / max(
                            1, len(item[1])), time.time() + float(item[3]))
                elif what == "stats":
                    conn.send(self.stats())
                elif what == "drain":
                    self.generating, self.rate, self.burst = False, 0.0, None
                    deadline = time.monotonic() + float(item[1])
                    while time.monotonic() < deadline and any(
                            a.outbox or a.inflight for a in self.order):
                        for a in self.order:
                            if a.outbox and not a.inflight and not a.queued:
                                self.wake(a)
                        await asyncio.sleep(0.2)
                    conn.send(self.stats())
                elif what == "resume":
                    self.generating = True
                elif what == "stop":
                    break
            for task in tasks:
                task.cancel()


def worker_main(conn: Connection, kwargs: dict[str, Any]) -> None:
    """Entry point of a worker process."""
    with contextlib.suppress(OSError):
        os.nice(0)
    worker = Worker(**kwargs)
    conn.send("ready")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(worker.main(conn))
    conn.close()


class Workers:
    """The worker processes, seen from the main process."""

    def __init__(self, *, nodes: int, workers: int, salt: str, urls: list[str],
                 heartbeat_seconds: float, connections: int) -> None:
        ctx = mp.get_context("spawn")
        self.nodes = nodes
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.owner: dict[int, int] = {}
        for w in range(workers):
            indexes = list(range(w, nodes, workers))
            for i in indexes:
                self.owner[i] = w
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, {
                "indexes": indexes, "nodes": nodes, "salt": salt, "urls": urls,
                "heartbeat_seconds": heartbeat_seconds, "connections": connections,
                "seed": 1000 + w}), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a worker did not start")
        self.lock = threading.Lock()

    def send_all(self, *item: Any) -> None:
        with self.lock:
            for c in self.conns:
                c.send(item)

    def rate(self, total: float) -> None:
        self.send_all("rate", total / len(self.conns))

    def fault(self, index: int, at: float, *, clear: bool = False) -> None:
        with self.lock:
            self.conns[self.owner[index]].send(("fault", index, at, clear))

    def stats(self, what: str = "stats", *args: Any) -> dict[str, Any]:
        with self.lock:
            for c in self.conns:
                c.send((what, *args))
            parts = [c.recv() for c in self.conns]
        out: dict[str, Any] = {"latencies": [], "statuses": {}}
        for p in parts:
            for k, v in p.items():
                if k == "latencies":
                    out["latencies"].extend(v)
                elif k == "statuses":
                    for s, n in v.items():
                        out["statuses"][s] = out["statuses"].get(s, 0) + n
                else:
                    out[k] = out.get(k, 0) + v
        return out

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.send_all("stop")
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# --- the controller pair and what is measured on it ---------------------------------------


class Controller:
    """One ``gpuhealth controller`` process."""

    def __init__(self, name: str, folder: Path, config: str) -> None:
        self.name = name
        self.folder = folder
        self.config = folder / f"{name}.toml"
        self.config.write_text(config)
        self.log = folder / f"{name}.log"
        self.port = int(config.split("port = ", 1)[1].split("\n", 1)[0])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as handle:
            # FLEET_SIM_LOG=-v: the controllers' info log in <tmp>/ctl-*.log, copied to
            # FLEET_SIM_KEEP=DIR at the end
            verbosity = os.environ.get("FLEET_SIM_LOG", "-q")
            self.proc = subprocess.Popen([GPUHEALTH, verbosity, "controller", "--config",
                                          str(self.config)], stdout=handle,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def ready(self) -> dict[str, Any] | None:
        import httpx

        try:
            got = httpx.get(f"{self.url}/-/ready", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return None
        return got if isinstance(got, dict) else None

    def rss_bytes(self) -> int:
        if self.proc is None:
            return 0
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0


def controller_config(name: str, folder: Path, *, dsn: str, nodes: int, api_url: str | None,
                      lease: float) -> str:
    live = "" if api_url is None else f"""dry_run = false
scheduler = "kubernetes"
max_disrupted_fraction = 1.0
[remediation.scheduler_options]
host = "{api_url}"
"""
    return f"""
[node]
name = "{name}"
data_dir = "{folder / name}"
[metrics]
enabled = false
[alerting]
api_enabled = false
[report]
enabled = false
[controller]
port = {free_port()}
state = "{dsn}"
agent_tokens_file = "{folder / 'tokens'}"
# a whole fleet shares one driver version: grouping by it would make a fleet incident of
# three unrelated failures in 10 minutes (Llama 3's rate gives that at ~50k nodes)
correlate_by = ["switch", "rack"]
[remediation]
election = "postgres"
identity = "{name}"
election_options = {{ dsn = "{dsn}", ttl_seconds = {lease}, name = "fleet-sim" }}
cluster_size = {nodes}
{live}"""


def _serve_k8s_api(nodes: int, conn: Connection) -> None:
    """The Kubernetes API stand-in in a process of its own (so the simulator's own work
    never slows the API server the controllers cordon through)."""
    from tests.k8s_api import running_k8s_api

    with running_k8s_api() as api:
        for i in range(nodes):
            api.add_node(node_name(i))
        conn.send(api.url)
        conn.recv()  # until the simulator is done


class K8sApiProcess:
    """The stand-in's process; nodes read over HTTP as an operator's ``kubectl`` would."""

    def __init__(self, nodes: int) -> None:
        import httpx

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_k8s_api, args=(nodes, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("the Kubernetes API stand-in did not start")
        self.url: str = self.conn.recv()
        self.http = httpx.Client(base_url=self.url, timeout=5.0)

    def cordoned(self, node: str) -> bool:
        got = self.http.get(f"/api/v1/nodes/{node}")
        return bool(got.json().get("spec", {}).get("unschedulable"))

    def close(self) -> None:
        self.http.close()
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def free_port() -> int:
    from tests.servers import free_port as free

    return free()


def pg_memory_bytes(postmaster: int | None) -> int:
    """PSS of the postmaster and its children (shared buffers counted once)."""
    if postmaster is None:
        return 0
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                pids.append(int(entry.name))
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class Sampler:
    """A thread sampling the replicas' RSS, PostgreSQL's memory and the leader's cursor."""

    def __init__(self, controllers: list[Controller], pg: Any) -> None:
        self.controllers = controllers
        self.pg = pg
        self.rss_max: dict[str, int] = {c.name: 0 for c in controllers}
        self.pg_max = 0
        self.cursor: list[tuple[float, int]] = []
        self.leader: str | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        next_mem = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_mem:
                next_mem = now + 2.0
                for c in self.controllers:
                    self.rss_max[c.name] = max(self.rss_max[c.name], c.rss_bytes())
                self.pg_max = max(self.pg_max, pg_memory_bytes(self.pg.pid()))
            leader = None
            for c in self.controllers:
                got = c.ready()
                if got and got.get("leader"):
                    leader = c.name
                    self.cursor.append((time.time(), int(got.get("consumed", 0))))
            self.leader = leader
            self.stop.wait(0.05)

    def consumed_at(self, seq: int, *, since: float) -> float | None:
        for at, cursor in self.cursor:
            if at >= since and cursor >= seq:
                return at
        return None


def sql(dsn: str, query: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return [tuple(r) for r in conn.execute(query, args).fetchall()]


@dataclass
class Probes:
    """Single faults, one at a time, timed from the record to the node cordoned."""

    workers: Workers
    api: Any
    rng: random.Random
    avoid: set[int]
    times: list[float] = field(default_factory=list)
    missed: int = 0
    used: set[int] = field(default_factory=set)
    timeout: float = 30.0
    trials: list[tuple[str, float, float | None]] = field(default_factory=list)
    """``(node, sent at, cordoned at or None)``, epoch seconds."""

    def pick(self) -> int:
        while True:
            i = self.rng.randrange(self.workers.nodes)
            if i not in self.used and i not in self.avoid:
                self.used.add(i)
                return i

    def one(self) -> tuple[float, float | None]:
        """Send one fault; return (sent at, seconds to the cordon or ``None``)."""
        i = self.pick()
        at = time.time()
        self.workers.fault(i, at)
        took: float | None = None
        while time.time() - at < self.timeout:
            if self.api is None:
                break
            cordoned = self.api.cordoned(node_name(i))
            if cordoned:
                took = time.time() - at
                break
            time.sleep(0.01)
        self.workers.fault(i, time.time(), clear=True)  # the switch never sees 3 at once
        if took is None:
            self.missed += 1
        else:
            self.times.append(took)
        self.trials.append((node_name(i), at, None if took is None else at + took))
        return at, took

    def stages(self, dsn: str) -> dict[str, float]:
        """Where the time to cordon went, p50 of each stage in ms (from the shared store).

        ``accept``: the agent's record to its acceptance; ``decide``: to the cordon step
        stored (consumed, evaluated, decided); ``submit``: to the step submitted (the
        tick); ``apply``: to the node seen cordoned in the stand-in.
        """
        parts: dict[str, list[float]] = {"accept": [], "decide": [], "submit": [],
                                         "apply": []}
        for node, at, cordoned in self.trials:
            rows = sql(dsn, "SELECT min(accepted_at) FROM fleet_records WHERE node = %s AND "
                       "kind = 'finding' AND at >= %s", (node, at - 1.0))
            steps = sql(dsn, "SELECT created_at, started_at FROM actions WHERE node = %s AND "
                        "step = 'cordon' AND created_at >= %s ORDER BY id LIMIT 1",
                        (node, at - 1.0))
            if not rows or rows[0][0] is None or not steps or cordoned is None:
                continue
            accepted, (decided, submitted) = float(rows[0][0]), steps[0]
            parts["accept"].append(accepted - at)
            parts["decide"].append(float(decided) - accepted)
            if submitted is not None:
                parts["submit"].append(float(submitted) - float(decided))
                parts["apply"].append(cordoned - float(submitted))
        return {k: pct(v, 0.5) * 1e3 for k, v in parts.items()}

    def run_for(self, seconds: float, *, gap: float = 0.3) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self.one()
            time.sleep(gap * (0.5 + self.rng.random()))


def wait_for(what: Any, timeout: float, step: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(step)
    return None


def run_size(args: argparse.Namespace, nodes: int, say: Any) -> dict[str, Any]:
    """Run every phase at one size; return the figures."""
    from tests.pg_server import start_postgres

    out: dict[str, Any] = {"nodes": nodes, "gpus": nodes * GPUS_PER_NODE,
                           "heartbeat_seconds": args.heartbeat_seconds,
                           "workers": args.workers, "lease_seconds": args.lease_seconds}
    failover = args.failover if args.failover is not None else nodes >= 10_000
    outage = args.outage_seconds if args.outage_seconds is not None else (
        60.0 if nodes >= 10_000 else 0.0)
    production = PRODUCTION_PER_NODE_SECOND * nodes
    background = max(production, args.sustained_rate)
    llama3 = LLAMA3_PER_GPU_SECOND * GPUS_PER_NODE * nodes
    out["rates"] = {"production_events_per_s": production, "offered_events_per_s": background,
                    "llama3_failures_per_hour": llama3 * 3600}
    salt = uuid.uuid4().hex[:16]
    rng = random.Random(7)
    started = time.monotonic()
    with start_postgres() as pg, tempfile.TemporaryDirectory(prefix="gh-fleet-") as tmp, \
            contextlib.ExitStack() as stack:
        folder = Path(tmp)
        api = None if args.dry_run else K8sApiProcess(nodes)
        if api is not None:
            stack.callback(api.close)
        (folder / "tokens").write_text("".join(f"{node_name(i)} {token_of(i, salt)}\n"
                                               for i in range(nodes)))
        controllers = [Controller(name, folder, controller_config(
            name, folder, dsn=pg.dsn, nodes=nodes, api_url=None if api is None else api.url,
            lease=args.lease_seconds)) for name in ("ctl-a", "ctl-b")]
        for c in controllers:
            c.start()
        for c in controllers:
            stack.callback(c.stop)
        if not wait_for(lambda: all(c.ready() for c in controllers), 60):
            raise RuntimeError("the controllers did not start: " + " / ".join(
                c.log.read_text()[-2000:] for c in controllers))
        sampler = Sampler(controllers, pg)
        stack.callback(sampler.stop.set)
        workers = Workers(nodes=nodes, workers=args.workers, salt=salt,
                          urls=[c.url for c in controllers],
                          heartbeat_seconds=args.heartbeat_seconds,
                          connections=args.connections)
        stack.callback(workers.stop)
        by_name = {c.name: c for c in controllers}

        # 1. register
        t0 = time.monotonic()
        registered = wait_for(lambda: sql(pg.dsn, "SELECT count(*) FROM fleet_agents")[0][0]
                              >= nodes, args.heartbeat_seconds * 3 + 600, step=1.0)
        out["register_seconds"] = time.monotonic() - t0 if registered else None
        say(f"  registered {nodes} agents in {out['register_seconds'] or float('nan'):.1f} s")
        workers.stats()

        # 2. steady: heartbeats, background, Llama 3 failures, probes
        workers.rate(background)
        burst_nodes = [i for i in range(nodes) if switch_of(i, nodes) == switch_of(0, nodes)]
        probes = Probes(workers=workers, api=api, rng=rng, avoid=set(burst_nodes))
        time.sleep(min(5.0, args.duration / 4))  # the rate settles
        before = workers.stats()
        t0 = time.monotonic()
        probes.run_for(args.duration)
        elapsed = time.monotonic() - t0
        after = workers.stats()
        out["steady"] = {
            "seconds": elapsed,
            "offered_events_per_s": background,
            "accepted_events_per_s": (after["acked"] - before["acked"]) / elapsed,
            "batches_per_s": (after["batches"] - before["batches"]) / elapsed,
            "heartbeat_batches_per_s": (after["heartbeat_only"] - before["heartbeat_only"])
            / elapsed,
            "ack_p50_ms": pct(after["latencies"], 0.5) * 1e3,
            "ack_p99_ms": pct(after["latencies"], 0.99) * 1e3,
            "outbox_depth_end": after["depth"],
            "failed_tries": after["failed_tries"] - before["failed_tries"],
            "simulator_cpu_per_s": (after["cpu_seconds"] - before["cpu_seconds"]) / elapsed,
        }
        out["cordon"] = {"trials": len(probes.times), "missed": probes.missed,
                         "p50_ms": pct(probes.times, 0.5) * 1e3,
                         "p99_ms": pct(probes.times, 0.99) * 1e3,
                         "max_ms": max(probes.times, default=float("nan")) * 1e3,
                         "stages_p50_ms": probes.stages(pg.dsn) if api is not None else {}}
        say(f"  steady {elapsed:.0f} s: {out['steady']['accepted_events_per_s']:.0f} events/s "
            f"accepted of {background:.0f} offered, cordon p50 {out['cordon']['p50_ms']:.0f} ms "
            f"p99 {out['cordon']['p99_ms']:.0f} ms ({len(probes.times)} trials, "
            f"{probes.missed} missed); stages p50 " + ", ".join(
                f"{k} {v:.0f} ms" for k, v in out["cordon"]["stages_p50_ms"].items()))

        # 3. fail-over
        if failover and api is not None:
            leader = sampler.leader
            assert leader is not None, "no leader"
            killed = by_name[leader]
            standby = next(c for c in controllers if c is not killed)
            killed_at = time.time()
            killed.stop(signal.SIGKILL)
            took_over = wait_for(lambda: sampler.leader == standby.name,
                                 args.lease_seconds + 60, step=0.05)
            led_at = time.time() if took_over else None
            first: float | None = None
            trials = []
            resume_deadline = time.time() + args.lease_seconds + 60
            while time.time() < resume_deadline:
                sent, took = probes.one()
                if took is not None:
                    trials.append(took)
                    first = sent + took - killed_at
                    break
            probes.run_for(min(20.0, args.duration / 2))
            killed.start()  # back as the standby
            out["failover"] = {"killed": leader, "standby_leads_after_s":
                               None if led_at is None else led_at - killed_at,
                               "decisions_resume_after_s": first,
                               "goal_s": args.lease_seconds + 5.0}
            say(f"  fail-over: {standby.name} leads {out['failover']['standby_leads_after_s']}"
                f" s after the kill; decisions resume after {first} s")

        # 4. outage: both away; the agents queue a 10-minute outage's records
        if outage > 0:
            before = workers.stats()
            for c in controllers:
                c.stop()
            down_at = time.monotonic()
            workers.rate(production * OUTAGE_SIMULATED_SECONDS / outage)
            time.sleep(outage)
            workers.rate(background)
            queued = workers.stats()
            for c in controllers:
                c.start()
            back_at = time.monotonic()
            wait_for(lambda: all(c.ready() for c in controllers), 120)
            ready_after = time.monotonic() - back_at
            # what was queued is delivered, and the leader consumed it
            drained = wait_for(lambda: workers.stats()["depth"] <= background * 2, 600, 1.0)
            delivered_after = time.monotonic() - back_at
            top = sql(pg.dsn, "SELECT coalesce(max(seq), 0) FROM fleet_records")[0][0]
            wait_for(lambda: sampler.cursor and sampler.cursor[-1][1] >= top, 600, 0.5)
            consumed_after = time.monotonic() - back_at
            out["outage"] = {
                "real_seconds": outage, "simulated_seconds": OUTAGE_SIMULATED_SECONDS,
                "queued_records": queued["depth"], "made_during": queued["made"]
                - before["made"], "controllers_ready_after_s": ready_after,
                "delivered_after_s": delivered_after if drained else None,
                "consumed_after_s": consumed_after,
                "outage_real_s": back_at - down_at}
            say(f"  outage: {queued['depth']} records queued; delivered "
                f"{delivered_after:.1f} s and consumed {consumed_after:.1f} s after the "
                "controllers came back")

        # 5. burst: a switch takes 5 % of the nodes
        burst_rate = args.burst_rate
        burst_seconds = args.burst_seconds
        top_before = sql(pg.dsn, "SELECT coalesce(max(seq), 0) FROM fleet_records")[0][0]
        before = workers.stats()
        burst_at = time.time()
        workers.send_all("burst", burst_nodes, burst_rate / len(workers.conns), burst_seconds)
        time.sleep(burst_seconds)
        during = workers.stats()
        wait_for(lambda: workers.stats()["depth"] <= background * 2, 300, 0.5)
        top = sql(pg.dsn, "SELECT coalesce(max(seq), 0) FROM fleet_records")[0][0]
        wait_for(lambda: sampler.cursor and sampler.cursor[-1][1] >= top, 300, 0.2)
        rows = sql(pg.dsn, "SELECT seq, at, accepted_at FROM fleet_records WHERE seq > %s "
                   "AND key LIKE %s", (top_before, "%:b%"))
        to_accept = [r[2] - r[1] for r in rows]
        to_decide: list[float] = []
        undecided = 0
        for seq, at, _ in rows:
            got = sampler.consumed_at(int(seq), since=burst_at)
            if got is None:
                undecided += 1
            else:
                to_decide.append(got - float(at))
        breaker = sql(pg.dsn, "SELECT value, at FROM control WHERE name = 'breaker'")
        cordoned = 0 if api is None else sum(
            1 for i in burst_nodes if api.cordoned(node_name(i)))
        out["burst"] = {
            "nodes": len(burst_nodes), "offered_events_per_s": burst_rate,
            "seconds": burst_seconds,
            "made": during["made_burst"] - before["made_burst"], "stored": len(rows),
            "accept_p99_ms": pct(to_accept, 0.99) * 1e3,
            "decision_p50_ms": pct(to_decide, 0.5) * 1e3,
            "decision_p99_ms": pct(to_decide, 0.99) * 1e3, "undecided": undecided,
            "breaker": breaker[0][0] if breaker else "closed",
            "breaker_after_s": breaker[0][1] - burst_at if breaker else None,
            "burst_nodes_cordoned": cordoned}
        say(f"  burst: {len(rows)} of {out['burst']['made']} stored, decision p50 "
            f"{out['burst']['decision_p50_ms']:.0f} ms p99 {out['burst']['decision_p99_ms']:.0f}"
            f" ms, breaker {out['burst']['breaker']}")

        # accounting
        final = workers.stats("drain", 300.0)
        top = sql(pg.dsn, "SELECT coalesce(max(seq), 0) FROM fleet_records")[0][0]
        wait_for(lambda: sampler.cursor and sampler.cursor[-1][1] >= top, 300, 0.2)
        stored, distinct = sql(pg.dsn, "SELECT count(*), count(DISTINCT key) FROM "
                               "fleet_records")[0]
        doubled = sql(pg.dsn, "SELECT count(*) FROM (SELECT node, step, incident FROM actions "
                      "GROUP BY node, step, incident HAVING count(*) > 1) d")[0][0]
        actions = sql(pg.dsn, "SELECT count(*) FROM actions")[0][0]
        out["accounting"] = {
            "made": final["made"], "acknowledged": final["acked"],
            "accepted": final["accepted"], "duplicates": final["duplicates"],
            "stored": stored, "distinct_keys": distinct, "refused": final["refused"],
            "left_in_outboxes": final["depth"], "statuses": final["statuses"],
            "consumed_by_leader": sampler.cursor[-1][1] if sampler.cursor else 0,
            "max_seq": top, "actions": actions, "steps_stored_twice": doubled,
            "llama3_failures": final["llama3"]}
        out["accounting"]["ok"] = bool(
            final["made"] == final["acked"] == stored == distinct and final["refused"] == 0
            and final["depth"] == 0 and doubled == 0
            and out["accounting"]["consumed_by_leader"] >= top)
        size = sql(pg.dsn, "SELECT pg_database_size(current_database())")[0][0]
        sampler.stop.set()
        out["memory"] = {"rss_bytes": dict(sampler.rss_max), "pg_pss_bytes": sampler.pg_max,
                         "pg_database_bytes": int(size)}
        out["memory"]["total_bytes"] = sum(sampler.rss_max.values()) + sampler.pg_max + int(size)
        out["simulator_cpu_seconds"] = final["cpu_seconds"]
        out["wall_seconds"] = time.monotonic() - started
        if keep := os.environ.get("FLEET_SIM_KEEP"):  # the controllers' logs, to read after
            Path(keep).mkdir(parents=True, exist_ok=True)
            for c in controllers:
                shutil.copy(c.log, Path(keep) / f"{nodes}-{c.log.name}")
    return out


def report(results: list[dict[str, Any]]) -> str:
    """The figures beside the goals and NVSentinel's."""
    lines = ["fleet simulation: two controllers (postgres election), real PostgreSQL, "
             "Kubernetes API stand-in; 8 GPUs a node"]
    for r in results:
        n = r["nodes"]
        m, s, c, b = r["memory"], r["steady"], r["cordon"], r["burst"]
        mib = 1024 * 1024
        lines.append(f"\n{n:,} nodes ({r['gpus']:,} GPUs), heartbeat every "
                     f"{r['heartbeat_seconds']:.0f} s, registered in "
                     f"{r['register_seconds'] or float('nan'):.1f} s")
        rss = ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in m["rss_bytes"].items())
        lines.append(f"  memory     {rss}; PostgreSQL {m['pg_pss_bytes'] / mib:.0f} MiB "
                     f"(PSS) + {m['pg_database_bytes'] / mib:.0f} MiB on disk; total "
                     f"{m['total_bytes'] / mib:.0f} MiB   goal: {GOALS['memory']}")
        lines.append(f"  sustained  {s['accepted_events_per_s']:.0f} events/s accepted of "
                     f"{s['offered_events_per_s']:.0f} offered, {s['batches_per_s']:.0f} "
                     f"batches/s ({s['heartbeat_batches_per_s']:.0f} heartbeat-only), ack "
                     f"p50 {s['ack_p50_ms']:.0f} ms p99 {s['ack_p99_ms']:.0f} ms, outbox "
                     f"depth at end {s['outbox_depth_end']}   goal: {GOALS['sustained']}")
        lines.append(f"  cordon     p50 {c['p50_ms']:.0f} ms p99 {c['p99_ms']:.0f} ms max "
                     f"{c['max_ms']:.0f} ms ({c['trials']} single faults, {c['missed']} not "
                     f"cordoned in 30 s; p50 by stage: " + ", ".join(
                         f"{k} {v:.0f} ms" for k, v in c.get("stages_p50_ms", {}).items())
                     + f")   goal: {GOALS['cordon']}")
        lines.append(f"  burst      {b['stored']} of {b['made']} stored ({b['nodes']} nodes, "
                     f"{b['offered_events_per_s']:.0f}/s for {b['seconds']:.0f} s); "
                     f"event-to-decision p50 {b['decision_p50_ms']:.0f} ms p99 "
                     f"{b['decision_p99_ms']:.0f} ms; breaker {b['breaker']}"
                     + (f" {b['breaker_after_s']:.1f} s after the switch failed"
                        if b["breaker_after_s"] is not None else "")
                     + f"; {b['burst_nodes_cordoned']} burst nodes cordoned   goal: "
                     f"{GOALS['burst']}")
        if "failover" in r:
            f = r["failover"]
            lines.append(f"  fail-over  {f['killed']} SIGKILLed: standby leads after "
                         f"{f['standby_leads_after_s']} s, decisions resume after "
                         f"{f['decisions_resume_after_s']} s (lease {r['lease_seconds']:.0f} s; "
                         f"goal <= {f['goal_s']:.0f} s)   goal: {GOALS['failover']}")
        if "outage" in r:
            o = r["outage"]
            lines.append(f"  outage     {o['simulated_seconds']:.0f} s of production queued in "
                         f"{o['real_seconds']:.0f} s: {o['queued_records']} records; "
                         f"delivered {o['delivered_after_s']} s, consumed "
                         f"{o['consumed_after_s']:.1f} s after restart   goal: "
                         f"{GOALS['outage']}")
        a = r["accounting"]
        lines.append(f"  accounting {a['made']} made, {a['acknowledged']} acknowledged, "
                     f"{a['stored']} stored ({a['duplicates']} resends counted once), "
                     f"{a['refused']} refused, {a['left_in_outboxes']} left queued, leader "
                     f"consumed {a['consumed_by_leader']} of {a['max_seq']}, "
                     f"{a['steps_stored_twice']} steps twice: {'OK' if a['ok'] else 'NOT OK'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000])
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of the steady phase")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 200 nodes, 10 s, a short burst")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--connections", type=int, default=32,
                        help="concurrent requests per worker process")
    parser.add_argument("--heartbeat-seconds", type=float, default=10.0)
    parser.add_argument("--sustained-rate", type=float, default=SUSTAINED_GOAL)
    parser.add_argument("--burst-rate", type=float, default=BURST_RATE)
    parser.add_argument("--burst-seconds", type=float, default=BURST_SECONDS)
    parser.add_argument("--lease-seconds", type=float, default=10.0)
    parser.add_argument("--failover", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--outage-seconds", type=float, default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="remediation in dry-run (no stand-in; no time-to-cordon)")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes = [200]
        args.duration = 10.0
        args.heartbeat_seconds = min(args.heartbeat_seconds, 5.0)
        args.sustained_rate = 100.0
        args.burst_rate, args.burst_seconds = 400.0, 5.0
        args.failover = bool(args.failover)
        args.outage_seconds = args.outage_seconds or 0.0

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    results = []
    for n in args.nodes:
        say(f"{n} nodes ...")
        results.append(run_size(args, n, say))
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(report(results))
    return 0 if all(r["accounting"]["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
