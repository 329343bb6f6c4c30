"""The fleet shape with real processes on loopback: two controllers, three agents, real PostgreSQL.

Each controller is a ``gpuhealth controller`` process sharing one real PostgreSQL
(fleet state store, action store, audit trail and ``postgres`` leader election, TTL 3 s);
each agent is a ``gpuhealth agent`` process following its own kernel-log file. The first
test runs dry: alerts, tokens, both controllers away for 60 s while the agents keep
seeing faults, a fail-over. The second runs live through the Kubernetes API stand-in (no
API server can run here; ``tests/k8s_api.py`` follows its documented API) with the agents
writing samples to a real VictoriaMetrics.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.pg_server import Postgres, postgres  # noqa: F401 (fixture)
from tests.servers import eventually, free_port

OUTAGE_SECONDS = 60.0
"""How long both controllers are away (the issue's figure)."""

XID79 = ("[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:b1:00): 79, pid=1234, "
         "GPU has fallen off the bus.\n")
XID48 = ("[Fri Apr  5 21:{m:02d}:00 2024] NVRM: Xid (PCI:0000:{bus:02x}:00): 48, pid=99, "
         "An uncorrectable double bit error (DBE) has been detected on GPU in the "
         "framebuffer at partition 1, subpartition 0.\n")


class Proc:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.argv, self.log, self.env = argv, log, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as handle:  # the child keeps its own copy
            self.proc = subprocess.Popen(self.argv, stdout=handle, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@contextlib.contextmanager
def make_fleet(tmp_path: Path, postgres: Postgres, *, live_k8s: str | None = None,  # noqa: F811
               vm_url: str | None = None, burst_nodes: int = 0) -> Iterator[dict[str, Any]]:
    import psycopg

    db = f"fleet_it_{os.getpid()}_{time.monotonic_ns()}"
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    dsn = f"host=127.0.0.1 port={postgres.port} user=postgres dbname={db}"
    tokens = {f"gpu-0{i}": f"token-{i}-" + "x" * 24 for i in (1, 2, 3)}
    tokens.update({f"burst-{i:02d}": f"token-b{i}-" + "y" * 24 for i in range(burst_nodes)})
    (tmp_path / "tokens").write_text("".join(f"{n} {t}\n" for n, t in tokens.items()))
    exe = [str(Path(sys.executable).parent / "gpuhealth")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    remediation = "" if live_k8s is None else f"""dry_run = false
scheduler = "kubernetes"
max_disrupted_fraction = 1.0
breaker_max_nodes = 100
tick_seconds = 0.1
[remediation.scheduler_options]
host = "{live_k8s}"
poll_seconds = 0.1
eviction_retry_seconds = 0.2
"""
    controllers: dict[str, Proc] = {}
    ports: dict[str, int] = {}
    for name in ("ctl-a", "ctl-b"):
        ports[name] = free_port()
        config = tmp_path / f"{name}.toml"
        config.write_text(f"""
[node]
name = "{name}"
data_dir = "{tmp_path / name}"
[metrics]
enabled = false
[alerting]
api_enabled = false
[report]
enabled = false
[analytics]
evaluate_interval_seconds = 0.5
[controller]
port = {ports[name]}
state = "{dsn}"
agent_tokens_file = "{tmp_path / 'tokens'}"
[remediation]
election = "postgres"
identity = "{name}"
election_options = {{ dsn = "{dsn}", ttl_seconds = 3.0, name = "fleet-it" }}
cluster_size = {3 + burst_nodes}
{remediation}""")
        controllers[name] = Proc([*exe, "controller", "--config", str(config)],
                                 tmp_path / f"{name}.log", env)
    agents: dict[str, Proc] = {}
    storage = "" if vm_url is None else f"""[storage]
type = "influxdb"
url = "{vm_url}"
token_env = "INFLUX_TOKEN"
flush_interval_seconds = 0.5
[collectors.network]
interval_seconds = 1
"""
    for node in ("gpu-01", "gpu-02", "gpu-03"):
        (tmp_path / f"{node}.kern.log").touch()
        config = tmp_path / f"{node}.toml"
        network = "" if vm_url else "[collectors.network]\nenabled = false\n"
        config.write_text(f"""
[node]
name = "{node}"
data_dir = "{tmp_path / node}"
[metrics]
port = {free_port()}
[alerting]
api_port = {free_port()}
[collectors.nvml]
enabled = false
{network}[collectors.probe]
enabled = false
[collectors.kernel_log]
source = "file"
path = "{tmp_path / (node + '.kern.log')}"
[analytics]
evaluate_interval_seconds = 0.5
detectors = false
predictor = false
[agent]
controllers = ["http://127.0.0.1:{ports['ctl-a']}", "http://127.0.0.1:{ports['ctl-b']}"]
token_env = "AGENT_TOKEN"
send_interval_seconds = 0.3
heartbeat_interval_seconds = 1
{storage}""")
        agents[node] = Proc([*exe, "agent", "--config", str(config)],
                            tmp_path / f"{node}.log",
                            {**env, "AGENT_TOKEN": tokens[node], "INFLUX_TOKEN": "x"})
    for p in controllers.values():
        p.start()
    for p in agents.values():
        p.start()
    try:
        yield {"tmp": tmp_path, "dsn": dsn, "ports": ports, "controllers": controllers,
               "agents": agents, "tokens": tokens}
    finally:
        for p in [*agents.values(), *controllers.values()]:
            p.stop()


@pytest.fixture
def fleet(tmp_path: Path, postgres: Postgres) -> Iterator[dict[str, Any]]:  # noqa: F811
    with make_fleet(tmp_path, postgres) as made:
        yield made


def _get(port: int, path: str) -> Any:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).json()
    except httpx.HTTPError:
        return None


def _leader(fleet: dict[str, Any]) -> str | None:
    for name, port in fleet["ports"].items():
        ready = _get(port, "/-/ready")
        if ready and ready["leader"]:
            return str(name)
    return None


def _alerts(fleet: dict[str, Any], name: str) -> list[tuple[str, str]]:
    got = _get(fleet["ports"][name], "/api/v1/alerts") or []
    return sorted((a["labels"]["node"], a["labels"]["alertname"]) for a in got)


def _append(fleet: dict[str, Any], node: str, text: str) -> None:
    with (fleet["tmp"] / f"{node}.kern.log").open("a") as handle:
        handle.write(text)


def _records(fleet: dict[str, Any]) -> list[tuple[str, str]]:
    import psycopg

    with psycopg.connect(fleet["dsn"]) as conn:
        return [(r[0], r[1]) for r in conn.execute(
            "SELECT node, body->>'code' FROM fleet_records WHERE kind = 'finding' ORDER BY seq")]


def test_fleet_on_loopback(fleet: dict[str, Any]) -> None:
    leader = eventually(lambda: _leader(fleet), timeout=30)
    eventually(lambda: len(_get(fleet["ports"][leader], "/api/v1/agents") or []) == 3,
               timeout=30)

    # An Xid 79 on node 2: an alert with its evidence, on the leader and the standby.
    _append(fleet, "gpu-02", XID79)
    for name in fleet["ports"]:
        eventually(lambda n=name: ("gpu-02", "GpuXid79") in _alerts(fleet, n), timeout=20)
    got = _get(fleet["ports"][leader], "/api/v1/alerts")
    evidence = next(a for a in got if a["labels"]["node"] == "gpu-02")["annotations"]
    assert "NVRM: Xid (PCI:0000:b1:00): 79" in evidence["evidence"]

    # A wrong token is 401, another node's token 403 (the real controller process).
    url = f"http://127.0.0.1:{fleet['ports'][leader]}/api/v1/agents/gpu-02/batch"
    body = {"node": "gpu-02", "records": []}
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}
                      ).status_code == 401
    assert httpx.post(url, json=body, headers={
        "Authorization": f"Bearer {fleet['tokens']['gpu-01']}"}).status_code == 403

    # Both controllers away: the agents keep judging and queue; all arrives once after.
    for p in fleet["controllers"].values():
        p.stop()
    for i, node in enumerate(("gpu-01", "gpu-03")):
        _append(fleet, node, XID48.format(m=30 + i, bus=0x1b + i))
    time.sleep(OUTAGE_SECONDS)
    for p in fleet["controllers"].values():
        p.start()
    leader = eventually(lambda: _leader(fleet), timeout=30)
    for node in ("gpu-01", "gpu-03"):
        eventually(lambda n=node: (n, "GpuXid48") in _alerts(fleet, leader), timeout=30)
    records = _records(fleet)
    assert records.count(("gpu-01", "48")) == 1
    assert records.count(("gpu-03", "48")) == 1
    assert records.count(("gpu-02", "79")) == 1

    # The leader killed: the standby leads within the lease and has every alert.
    standby = next(n for n in fleet["ports"] if n != leader)
    fleet["controllers"][leader].stop(signal.SIGKILL)
    eventually(lambda: _leader(fleet) == standby, timeout=30)
    assert {("gpu-01", "GpuXid48"), ("gpu-02", "GpuXid79"), ("gpu-03", "GpuXid48")} <= set(
        _alerts(fleet, standby))
    with contextlib.suppress(Exception):
        fleet["controllers"][leader].start()


def _post_finding(fleet: dict[str, Any], node: str, port: int) -> int:
    """An agent's batch with an Xid 79 finding, as a simulated agent with its own token."""
    finding = {"node": node, "entity": "0000:b1:00.0", "kind": "xid", "code": "79",
               "severity": "critical", "action": "reboot_node",
               "summary": "Xid 79: GPU has fallen off the bus",
               "evidence": [{"file": "kern.log", "line": 1, "text": XID79.strip()}],
               "source": "xid.gpu_driver_rule", "first_seen_at": time.time(),
               "last_seen_at": time.time(), "occurrences": 1, "confidence": 1.0}
    batch = {"node": node, "agent_version": "sim",
             "heartbeat": {"at": time.time(), "gpus": []},
             "records": [{"key": f"{node}:xid79", "kind": "finding", "at": time.time(),
                          "body": finding}]}
    return httpx.post(f"http://127.0.0.1:{port}/api/v1/agents/{node}/batch", json=batch,
                      headers={"Authorization": f"Bearer {fleet['tokens'][node]}"},
                      timeout=10).status_code


def _action_rows(dsn: str) -> list[tuple[str, str, str]]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return [(r[0], r[1], r[2]) for r in conn.execute(
            "SELECT node, step, phase FROM actions ORDER BY id")]


def _export(vm_url: str, node: str) -> dict[str, list[int]]:
    import urllib.parse

    query = urllib.parse.quote(f'{{__name__="net_rx_bytes_total",node="{node}"}}')
    text = httpx.get(f"{vm_url}/api/v1/export?match[]={query}", timeout=30).text
    out: dict[str, list[int]] = {}
    for line in text.splitlines():
        row = json.loads(line)
        key = ",".join(f"{k}={v}" for k, v in sorted(row["metric"].items()))
        out[key] = row["timestamps"]
    return out


def test_live_fleet_remediates_each_node_once_through_a_failover(
        tmp_path: Path, postgres: Postgres) -> None:  # noqa: F811
    from tests.k8s_api import running_k8s_api
    from tests.vm_server import start_victoria_metrics

    burst = 20
    (tmp_path / "vm").mkdir()
    vm = start_victoria_metrics(tmp_path / "vm", "-dedup.minScrapeInterval=1ms")
    try:
        with running_k8s_api() as api:
            for node in ["gpu-01", "gpu-02", "gpu-03", *[f"burst-{i:02d}" for i in range(burst)]]:
                api.add_node(node)
                api.add_pod(f"train-{node}", node, owner_kind="ReplicaSet", gpus=8)
            api.add_node("spare")
            api.reschedule_to = "spare"
            with make_fleet(tmp_path, postgres, live_k8s=api.url, vm_url=vm.url,
                            burst_nodes=burst) as fleet:
                started = time.time()
                leader = eventually(lambda: _leader(fleet), timeout=30)
                eventually(lambda: len(_get(fleet["ports"][leader], "/api/v1/agents") or [])
                           == 3, timeout=30)

                # An Xid 79 line on agent 2: node 2 cordoned and drained once.
                _append(fleet, "gpu-02", XID79)
                eventually(lambda: api.evictions.get("default/train-gpu-02") == 1, timeout=30)
                assert api.node("gpu-02")["spec"]["unschedulable"] is True

                # A 20-node burst; the leader SIGKILLed in the middle; the standby ends it.
                for i in range(burst):
                    assert _post_finding(fleet, f"burst-{i:02d}", fleet["ports"][leader]) == 200
                eventually(lambda: sum(1 for i in range(burst) if api.node(
                    f"burst-{i:02d}")["spec"].get("unschedulable")) >= 3, timeout=30)
                fleet["controllers"][leader].stop(signal.SIGKILL)
                done_at_kill = sum(1 for i in range(burst)
                                   if api.evictions.get(f"default/train-burst-{i:02d}"))
                assert done_at_kill < burst, "the burst ended before the kill: nothing tested"
                standby = next(n for n in fleet["ports"] if n != leader)
                eventually(lambda: _leader(fleet) == standby, timeout=30)
                for i in range(burst):
                    pod = f"default/train-burst-{i:02d}"
                    eventually(lambda p=pod: api.evictions.get(p) == 1, timeout=60)
                time.sleep(2.0)  # nothing more happens: no second eviction, no second step
                for i in range(burst):
                    assert api.evictions[f"default/train-burst-{i:02d}"] == 1
                rows = _action_rows(fleet["dsn"])
                steps = [(node, step) for node, step, _ in rows]
                assert len(steps) == len(set(steps)), "a step was stored twice"
                assert {n for n, s in steps if s == "drain"} >= {
                    f"burst-{i:02d}" for i in range(burst)} | {"gpu-02"}
                ended = time.time()
    finally:
        vm.flush()
        time.sleep(0.5)
        series = {n: _export(vm.url, n) for n in ("gpu-01", "gpu-02", "gpu-03")}
        vm.stop()
    # The agents' sample stream (network counters, 1 s) through it all: no gap, no duplicate.
    for node, by_series in series.items():
        assert by_series, f"no samples from {node}"
        for key, stamps in by_series.items():
            assert len(stamps) == len(set(stamps)), f"duplicates in {key}"
            inside = [t for t in sorted(stamps) if started * 1e3 <= t <= (ended - 2) * 1e3]
            gaps = [b - a for a, b in itertools.pairwise(inside)]
            assert inside, f"{key}: no samples during the test"
            assert max(gaps, default=0) <= 3_000, f"{key}: a gap of {max(gaps)} ms"
