"""Live remediation on Kubernetes, end to end, against the local API stand-in.

No Kubernetes API server can run on the test machines; ``tests/k8s_api.py`` follows
the real API's documented requests, responses and error codes for nodes, pods,
evictions and leases. The kernel-log line of a real case (Xid 79) goes through
``gpuhealth replay --live`` and the node ends cordoned, its pods evicted once each, and
a reboot requested; then two ``gpuhealth run`` controllers share one etcd election
(the real server) and the leader is killed in the middle of a drain.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from gpuhealth.cli import main
from tests.etcd_server import etcd  # noqa: F401 - fixture
from tests.k8s_api import running_k8s_api

XID79 = ("[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:b1:00): 79, pid='<unknown>', "
         "name=<unknown>, GPU has fallen off the bus.\n")


def _config(tmp: Path, url: str, *, extra: str = "", name: str = "ctl") -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(f"""
[node]
name = "{name}"
data_dir = "{tmp / name}"

[metrics]
enabled = false

[alerting]
api_enabled = false

[remediation]
dry_run = false
scheduler = "kubernetes"
cluster_size = 10
max_disrupted_fraction = 1.0
probation_seconds = 3600
tick_seconds = 0.1
action_store = "{tmp / 'actions.db'}"
audit_log = "{tmp / 'audit.jsonl'}"
{extra}
[remediation.scheduler_options]
host = "{url}"
poll_seconds = 0.1
eviction_retry_seconds = 0.2
""")
    return path


def test_replay_live_xid79_cordons_drains_and_requests_a_reboot(tmp_path):
    with running_k8s_api() as api:
        api.add_node("gpu-node-1")
        api.add_node("spare")
        api.reschedule_to = "spare"
        api.add_pod("train-0", "gpu-node-1", owner_kind="ReplicaSet", gpus=8)
        api.add_pod("dcgm-exporter-x", "gpu-node-1", owner_kind="DaemonSet")
        log = tmp_path / "kern.log"
        log.write_text(XID79)
        config = _config(tmp_path, api.url)
        out = CliRunner().invoke(main, ["replay", str(log), "--context", "node=gpu-node-1",
                                        "--live", "--config", str(config), "--wait", "20"])
        assert out.exit_code == 3, out.output  # the Xid 79 stays critical: exit as diagnose
        node = api.node("gpu-node-1")
        assert node["spec"]["unschedulable"] is True
        assert node["metadata"]["annotations"]["gpuhealth.io/reason"].startswith("gpuhealth:")
        assert api.evictions["default/train-0"] == 1
        assert "default/dcgm-exporter-x" not in api.evictions  # DaemonSet pods stay
        assert "gpuhealth.io/reboot-requested" in node["metadata"]["annotations"]
        assert "LIVE" in out.output
        # replaying the same incident again does nothing twice
        out = CliRunner().invoke(main, ["replay", str(log), "--context", "node=gpu-node-1",
                                        "--live", "--config", str(config), "--wait", "5"])
        assert out.exit_code == 3, out.output  # the Xid 79 stays critical: exit as diagnose
        assert api.evictions["default/train-0"] == 1
        assert api.requests["POST eviction"] >= 1


def _start(config: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GPUHEALTH_CONFIG": str(config)}
    with log.open("wb") as err:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-c",
                                 "from gpuhealth.cli import main; main()", "run"], env=env,
                                stdout=subprocess.DEVNULL, stderr=err)


def _wait(what, seconds: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(step)
    return False


def test_failover_kills_the_leader_mid_drain_and_the_drain_completes_once(
    tmp_path, etcd  # noqa: F811 - the fixture
):
    """Two `gpuhealth run` controllers, a real etcd election, the leader SIGKILLed mid-drain."""
    with running_k8s_api() as api:
        api.add_node("gpu-node-1")
        api.add_node("spare")
        api.reschedule_to = "spare"
        for i in range(3):
            api.add_pod(f"train-{i}", "gpu-node-1", owner_kind="ReplicaSet", gpus=1)
        api.block_evictions("default", "train-2")  # its PodDisruptionBudget holds the drain
        kern = tmp_path / "kern.log"
        kern.write_text("")
        extra = f"""election = "etcd"
[remediation.election_options]
endpoints = "{etcd.url}"
name = "failover-{os.getpid()}"
ttl_seconds = 2
[collectors.nvml]
enabled = false
[collectors.network]
enabled = false
[collectors.probe]
enabled = false
[collectors.kernel_log]
source = "file"
path = "{kern}"
node = "gpu-node-1"
"""
        # both controllers watch the node's kernel log; only the leader acts
        a_cfg = _config(tmp_path, api.url, extra=extra, name="a")
        b_cfg = _config(tmp_path, api.url, extra=extra, name="b")
        a = _start(a_cfg, tmp_path / "a.err")
        try:
            assert _wait(lambda: (tmp_path / "a").exists(), 30)
            time.sleep(2.0)  # a wins the election first
            b = _start(b_cfg, tmp_path / "b.err")
            a_pid, b_pid = a.pid, b.pid
            try:
                time.sleep(2.0)
                with kern.open("a") as handle:
                    handle.write(XID79)
                assert _wait(lambda: api.evictions["default/train-0"] == 1
                             and api.evictions["default/train-1"] == 1, 30), (
                    (tmp_path / "a.err").read_text()[-3000:])
                assert _wait(lambda: api.requests["POST eviction"] >= 4, 10)  # 429s: blocked
                a.send_signal(signal.SIGKILL)  # the leader dies in the middle of the drain
                a.wait(10)
                killed_at = time.monotonic()
                api.unblock_evictions("default", "train-2")
                assert _wait(lambda: api.evictions["default/train-2"] == 1, 30), (
                    (tmp_path / "b.err").read_text()[-3000:])
                took_over = time.monotonic() - killed_at
                assert _wait(lambda: "gpuhealth.io/reboot-requested" in
                             api.node("gpu-node-1")["metadata"]["annotations"], 30)
            finally:
                b.send_signal(signal.SIGTERM)
                b.wait(30)
        finally:
            if a.poll() is None:
                a.kill()
                a.wait(10)
        # exactly once: every pod evicted once, across both controllers
        assert dict(api.evictions) == {"default/train-0": 1, "default/train-1": 1,
                                       "default/train-2": 1}
        records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text()
                   .splitlines() if line.strip()]
        requested = [r["idempotency_key"] for r in records if r["decision"] == "requested"]
        assert len(requested) == len(set(requested))
        drains = [r for r in records if r["step"] == "drain" and r["decision"] == "succeeded"]
        assert len(drains) == 1
        assert drains[0]["actor"].endswith(f":{b_pid}")  # the standby finished it
        submitted = [r for r in records if r["step"] == "drain" and r["decision"] == "submitted"]
        assert submitted[0]["actor"].endswith(f":{a_pid}")  # the leader had started it
        logging.getLogger(__name__).warning(
            "standby finished the drain %.1f s after the leader was killed", took_over)
        assert took_over < 30
