"""Helpers of the infrastructure drills (``tests/integration/test_infra_drills.py``).

- :class:`Proc`: a ``gpuhealth controller`` or ``gpuhealth agent`` process, stopped by
  its PID (SIGTERM, or SIGKILL for ``kill -9``).
- :func:`fresh_database`: a new database on the shared PostgreSQL of the session.
- :func:`controller_config` and :func:`agent_config`: small TOML files for loopback.
- :class:`SimAgents`: many simulated agents, each a real
  :class:`~storage.agent_outbox.AgentOutbox` with the real
  :class:`~storage.agent_outbox.OutboxSender` posting to every controller replica in
  turn, in one thread; every key queued is kept, so a drill can check that everything
  accepted was stored once.
- :func:`xid79`: an Xid 79 finding as an agent's outbox record body.
- :func:`flapping_agent`: the body of an agent process that is restarted over and over
  (run by :func:`flapping_agent_proc`): a real on-disk outbox, sender and finding
  forwarder, queueing numbered records and journaling each one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from storage.agent_outbox import AgentOutbox, OutboxSender

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")

XID79_LINE = ("[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:b1:00): 79, pid=1234, "
              "GPU has fallen off the bus.\n")


class Proc:
    """One ``gpuhealth`` process with its output appended to ``log``."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
                 ) -> None:
        self.argv, self.log = list(argv), log
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> Proc:
        with self.log.open("ab") as handle:  # the child keeps its own copy
            self.proc = subprocess.Popen(self.argv, stdout=handle, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env)
        self.starts += 1
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Signal the process (by its PID) and reap it; return its exit status."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return proc.returncode

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def fresh_database(admin_dsn: str, port: int, prefix: str) -> str:
    """Create a new database on the server of ``admin_dsn``; return its DSN."""
    import psycopg

    name = f"{prefix}_{os.getpid()}_{time.monotonic_ns()}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"host=127.0.0.1 port={port} user=postgres dbname={name}"


def write_tokens(path: Path, nodes: Sequence[str]) -> dict[str, str]:
    """Write one token per node (``node token`` lines); return them."""
    tokens = {n: f"tok-{n}-" + "x" * 24 for n in nodes}
    path.write_text("".join(f"{n} {t}\n" for n, t in tokens.items()))
    return tokens


def controller_config(path: Path, *, name: str, port: int, state: str, tokens: Path,
                      election: str = "", cluster_size: int = 10, silent_seconds: float = 60.0,
                      remediation: str = "") -> Path:
    """A controller's TOML: loopback, no report, fast evaluation (``election`` is TOML)."""
    path.write_text(f"""
[node]
name = "{name}"
data_dir = "{path.parent / name}"
[metrics]
enabled = false
[report]
enabled = false
[analytics]
evaluate_interval_seconds = 0.5
[controller]
port = {port}
state = "{state}"
agent_tokens_file = "{tokens}"
agent_silent_seconds = {silent_seconds}
[remediation]
identity = "{name}"
cluster_size = {cluster_size}
{election}
{remediation}""")
    return path


def postgres_election(dsn: str, name: str, ttl: float) -> str:
    return (f'election = "postgres"\nelection_options = {{ dsn = "{dsn}", '
            f'ttl_seconds = {ttl}, name = "{name}" }}')


def k8s_remediation(url: str) -> str:
    """Live remediation through the Kubernetes API stand-in, quick polls, no rate limit."""
    return f"""dry_run = false
scheduler = "kubernetes"
max_disrupted_fraction = 1.0
breaker_max_nodes = 1000
tick_seconds = 0.1
[remediation.scheduler_options]
host = "{url}"
poll_seconds = 0.1
eviction_retry_seconds = 0.2
"""


def agent_config(path: Path, *, node: str, data_dir: Path, kern_log: Path,
                 controllers: Sequence[str], extra: str = "") -> Path:
    """An agent's TOML: the kernel-log file only, no NVML, no network, no detectors."""
    path.write_text(f"""
[node]
name = "{node}"
data_dir = "{data_dir}"
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
path = "{kern_log}"
[analytics]
evaluate_interval_seconds = 0.3
detectors = false
predictor = false
[agent]
controllers = [{", ".join(f'"{c}"' for c in controllers)}]
token_env = "AGENT_TOKEN"
send_interval_seconds = 0.2
heartbeat_interval_seconds = 0.5
{extra}""")
    return path


def get_json(url: str, timeout: float = 2.0) -> Any:
    """GET ``url`` as JSON; ``None`` when nothing answers or the answer is not JSON."""
    try:
        return httpx.get(url, timeout=timeout).json()
    except (httpx.HTTPError, ValueError):
        return None


def leader_of(ports: dict[str, int]) -> str | None:
    """The replica whose ``/-/ready`` says it leads, else ``None``."""
    for name, port in ports.items():
        ready = get_json(f"http://127.0.0.1:{port}/-/ready", timeout=1.0)
        if isinstance(ready, dict) and ready.get("leader"):
            return name
    return None


def alerts(port: int) -> list[tuple[str, str]]:
    """``(node, alertname)`` of a controller's alerts."""
    got = get_json(f"http://127.0.0.1:{port}/api/v1/alerts") or []
    return sorted((a["labels"]["node"], a["labels"]["alertname"]) for a in got)


def xid79(node: str, at: float) -> dict[str, Any]:
    """An Xid 79 finding (GPU fallen off the bus) as an outbox record body."""
    return {"node": node, "entity": "0000:b1:00.0", "kind": "xid", "code": "79",
            "severity": "critical", "action": "reboot_node",
            "summary": "Xid 79: GPU has fallen off the bus",
            "evidence": [{"file": "kern.log", "line": 1, "text": XID79_LINE.strip()}],
            "source": "xid.gpu_driver_rule", "first_seen_at": at, "last_seen_at": at,
            "occurrences": 1, "confidence": 1.0}


class SimAgents:
    """Simulated agents, each with its own outbox, sender and token, sent in one thread.

    ``queue(node, kind, body)`` puts a record into that agent's outbox; the thread sends
    every non-empty outbox (and a heartbeat from each at least every ``heartbeat``
    seconds), round-robin, until :meth:`finish` has seen every outbox empty.

    Args:
        nodes: The agents' nodes.
        tokens: Their tokens.
        controllers: Base URLs of the replicas (each sender tries them in turn).
        clock: The agents' clock (epoch seconds) for records, heartbeats and ``sent_at``.
        clocks: Per node, its own clock instead (an agent whose clock is off).
    """

    def __init__(self, nodes: Sequence[str], tokens: dict[str, str],
                 controllers: Sequence[str], *, clock: Callable[[], float] = time.time,
                 clocks: dict[str, Callable[[], float]] | None = None,
                 heartbeat: float = 0.5, timeout_seconds: float = 3.0) -> None:
        self.clock = clock
        self.clocks = {n: (clocks or {}).get(n, clock) for n in nodes}
        self.heartbeat = heartbeat
        self.outboxes = {n: AgentOutbox(None, node=n, max_records=1_000_000) for n in nodes}
        self.senders = {n: OutboxSender(self.outboxes[n], controllers=controllers,
                                        token=tokens[n], version="drill",
                                        clock=self.clocks[n], batch_max_records=50,
                                        timeout_seconds=timeout_seconds)
                        for n in nodes}
        self.silenced: set[str] = set()
        """Nodes whose agent sends nothing any more (:meth:`silence`)."""
        self.keys: dict[str, list[str]] = {n: [] for n in nodes}
        """Per node, every key queued, in order."""
        self.statuses: collections.Counter[int] = collections.Counter()
        """Controllers' answers by HTTP status (0: nobody answered a whole try)."""
        self.acked = 0
        self._last: dict[str, float] = dict.fromkeys(nodes, 0.0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-agents", daemon=True)

    def start(self) -> SimAgents:
        self._thread.start()
        return self

    def queue(self, node: str, kind: str, body: dict[str, Any]) -> str:
        with self._lock:
            key = self.outboxes[node].put(kind, body, at=self.clocks[node]())
            self.keys[node].append(key)
        return key

    def silence(self, node: str) -> None:
        """Stop sending for ``node`` (its agent gone: no heartbeat, nothing queued taken)."""
        self.silenced.add(node)

    def depth(self) -> int:
        return sum(len(o) for n, o in self.outboxes.items() if n not in self.silenced)

    def _round(self) -> None:
        for node, sender in self.senders.items():
            if node in self.silenced:
                continue
            now = time.monotonic()
            if not len(self.outboxes[node]) and now - self._last[node] < self.heartbeat:
                continue
            result = sender.send_once()
            if result.statuses:
                self.statuses.update(result.statuses.values())
            else:
                self.statuses[0] += 1
            if result.controller is not None:
                self._last[node] = now
                self.acked += result.sent

    def _run(self) -> None:
        while not self._stop.is_set():
            self._round()
            self._stop.wait(0.05)

    def finish(self, timeout: float = 30.0) -> None:
        """Stop the thread after every outbox is empty (fail after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.depth() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._stop.set()
        self._thread.join(10)
        assert not self.depth(), f"{self.depth()} records never taken: {self.statuses}"

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for n, sender in self.senders.items():
            sender.close()
            self.outboxes[n].close()


def flapping_agent(*, outbox: str, journal: str, node: str, token: str,
                   controllers: list[str], finding_at: float, period: float,
                   ack_pause: float = 0.0) -> None:
    """One life of an agent that is restarted over and over (run in its own process).

    The real on-disk :class:`AgentOutbox` (the same file in every life), the real
    :class:`OutboxSender` and :class:`~storage.agent_outbox.FindingForwarder`. Every
    ``period`` seconds it queues one ``inventory`` record ``{"n": n}`` (``n`` going on
    from the last life's), forwards its one open finding (an Xid 79 first seen at
    ``finding_at``; the forwarder's memory is the process's, so each life queues it once
    again) and sends one batch. SIGTERM stops it after the current step (as the agent's
    own handler does); SIGKILL anywhere. ``journal`` gets, each line written with one
    ``write``: ``start <pid>``, ``intent <n>`` before a put, ``queued <n> <key>`` after
    it, ``ack <records>`` when a controller's 200 is in and the batch is about to be
    removed from the outbox (then ``ack_pause`` seconds pass: a kill -9 aimed there hits
    a batch the controller stored and the agent never acknowledged), ``sent <records>
    <duplicates> <epoch s>`` for each batch (and so heartbeat) a controller took,
    ``stopped``.
    """
    from core.codec import finding_from_json
    from storage.agent_outbox import FindingForwarder

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    n = max(read_journal(Path(journal)).intended, default=-1) + 1
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(fd, f"{line}\n".encode())

    note(f"start {os.getpid()}")
    box = AgentOutbox(outbox, node=node)
    sender = OutboxSender(box, controllers=controllers, token=token, version="drill",
                          batch_max_records=10, timeout_seconds=2.0)
    forwarder = FindingForwarder(box, node=node)
    finding = finding_from_json(xid79(node, finding_at))
    acknowledge = box.ack

    def ack(ids: Sequence[int]) -> None:
        note(f"ack {len(ids)}")
        time.sleep(ack_pause)
        acknowledge(ids)

    box.ack = ack  # type: ignore[method-assign]
    try:
        while not stop.is_set():
            note(f"intent {n}")
            key = box.put("inventory", {"n": n}, at=time.time())
            note(f"queued {n} {key}")
            n += 1
            forwarder.observe([finding], now=time.time())
            result = sender.send_once()
            if result.controller is not None:
                note(f"sent {result.sent} {result.duplicates} {time.time():.3f}")
            stop.wait(period)
    finally:
        sender.close()
        box.close()
        note("stopped")
        os.close(fd)


def flapping_agent_proc(log: Path, **kwargs: Any) -> Proc:
    """A :class:`Proc` running :func:`flapping_agent` with ``kwargs`` (not started)."""
    import json

    code = ("import json, sys; from tests.drill_helpers import flapping_agent; "
            "flapping_agent(**json.loads(sys.argv[1]))")
    return Proc([sys.executable, "-c", code, json.dumps(kwargs)], log,
                {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})


@dataclasses.dataclass
class Journal:
    """What :func:`flapping_agent`'s lives wrote (:func:`read_journal`).

    Attributes:
        intended: Every ``n`` a life was about to queue, in order.
        queued: ``(n, key)`` of every put that returned, in order.
        starts: Lives started.
        stopped: Lives that stopped on SIGTERM (the rest were killed).
        sent: Records a controller acknowledged.
        duplicates: Of those, records it already had (resent after a restart).
        acks: Batches about to be acknowledged (``ack`` lines).
        taken_at: When each batch a controller took was acknowledged, epoch seconds.
    """

    intended: list[int]
    queued: list[tuple[int, str]]
    starts: int
    stopped: int
    sent: int
    duplicates: int
    acks: int = 0
    taken_at: list[float] = dataclasses.field(default_factory=list)


def read_journal(path: Path) -> Journal:
    """Read a :func:`flapping_agent` journal (empty when there is none yet)."""
    journal = Journal([], [], 0, 0, 0, 0)
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines():
        word, *rest = line.split()
        if word == "intent":
            journal.intended.append(int(rest[0]))
        elif word == "queued":
            journal.queued.append((int(rest[0]), rest[1]))
        elif word == "start":
            journal.starts += 1
        elif word == "stopped":
            journal.stopped += 1
        elif word == "ack":
            journal.acks += 1
        elif word == "sent":
            journal.sent += int(rest[0])
            journal.duplicates += int(rest[1])
            journal.taken_at.append(float(rest[2]))
    return journal


def stored_rows(dsn: str, node: str) -> list[tuple[int, str, str, dict[str, Any]]]:
    """``(seq, key, kind, body)`` of ``node``'s accepted records, in accepted order."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT seq, key, kind, body FROM fleet_records WHERE node = %s "
                            "ORDER BY seq", (node,)).fetchall()
    return [(int(r[0]), str(r[1]), str(r[2]),
             r[3] if isinstance(r[3], dict) else json.loads(r[3])) for r in rows]

def stored_records(dsn: str) -> list[tuple[int, str, str, str]]:
    """``(seq, key, node, kind)`` of every accepted record, in accepted order."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        return [(int(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in conn.execute(
            "SELECT seq, key, node, kind FROM fleet_records ORDER BY seq")]


def action_steps(dsn: str) -> list[tuple[str, str]]:
    """``(node, step)`` of every remediation action in the shared action store."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        return [(str(r[0]), str(r[1])) for r in conn.execute(
            "SELECT node, step FROM actions ORDER BY id")]


@contextlib.contextmanager
def controller_in_thread(config: Path) -> Iterator[Any]:
    """A real :class:`~gpuhealth.controller.Controller` of ``config`` serving in a thread."""
    from gpuhealth.config import load_settings
    from gpuhealth.controller import Controller

    settings = load_settings(config, env={})
    settings.node.data_dir.mkdir(parents=True, exist_ok=True)
    ctl = Controller(settings)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(ctl.serve(stop),),
                              name="drill-controller")
    thread.start()
    try:
        assert ctl.ready.wait(20)
        yield ctl
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)
        loop.close()
