"""``gpuhealth drill`` against the Kubernetes API stand-in, dry-run and live.

No Kubernetes API server can run on the test machines; ``tests/k8s_api.py`` follows the
real API's requests, responses and error codes for nodes, pods and evictions. A thread
plays the site's reboot daemon (kured-style): it sees ``gpuhealth.io/reboot-required``
and "reboots" the node (a new ``bootID``), as a kubelet reports after a real reboot.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from click.testing import CliRunner

from gpuhealth.cli import main
from remediation.kubernetes import OPT_OUT_LABEL, REBOOT_LABEL
from tests.k8s_api import K8sApi, running_k8s_api

DCGMI = """#!/bin/sh
printf '| Diagnostic                | Result                                         |\\n'
printf '| Memory                    | Pass                                           |\\n'
exit 0
"""


def _config(tmp: Path, url: str) -> Path:
    dcgmi = tmp / "dcgmi"
    dcgmi.write_text(DCGMI)
    dcgmi.chmod(0o755)
    path = tmp / "gpuhealth.toml"
    path.write_text(f"""
[node]
name = "ctl"
data_dir = "{tmp / 'data'}"

[analytics]
detectors = false
predictor = false

[remediation]
scheduler = "kubernetes"
cluster_size = 10
max_disrupted_fraction = 0.1
probation_seconds = 1

[remediation.scheduler_options]
host = "{url}"
poll_seconds = 0.1
eviction_retry_seconds = 0.2

[remediation.validation]
checks = ["dcgm_diag"]
dcgmi = "{dcgmi}"
dcgm_level = 1
dcgm_timeout_seconds = 30

[drill]
timeout_seconds = 60
evaluate_seconds = 0.3

[drill.slo]
detect = "5s"
alert = "5s"
cordon = "10s"
drain = "20s"
reboot = "30s"
validate = "40s"
resume = "50s"
total = "60s"
""")
    return path


class _RebootDaemon:
    """Reboots a node asked to (a new bootID), as kured and the kubelet would."""

    def __init__(self, api: K8sApi, node: str) -> None:
        self.api, self.node = api, node
        self.reboots = 0
        self.seen: list[tuple[bool, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            node = self.api.node(self.node)
            meta = node["metadata"]
            seen = (bool(node["spec"].get("unschedulable")),
                    meta["annotations"].get("gpuhealth.io/reason", ""))
            if not self.seen or self.seen[-1] != seen:
                self.seen.append(seen)
            if meta["labels"].get(REBOOT_LABEL) == "true":
                self.reboots += 1
                boot = f"{node['status']['nodeInfo']['bootID']}+"

                def reboot(n: dict, boot: str = boot) -> None:
                    n["status"]["nodeInfo"]["bootID"] = boot
                    n["metadata"]["labels"].pop(REBOOT_LABEL, None)

                time.sleep(0.3)
                self.api.edit_node(self.node, reboot)
            time.sleep(0.1)

    def __enter__(self) -> _RebootDaemon:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _rows(output: str) -> dict[str, list[str]]:
    stages = ("detect", "alert", "cordon", "drain", "reboot", "reset_gpu", "validate",
              "resume", "total")
    return {line.split()[0]: line.split() for line in output.splitlines()
            if line.split() and line.split()[0] in stages}


def _drill(config: Path, *args: str) -> tuple[int, str]:
    out = CliRunner().invoke(main, ["drill", "--config", str(config), *args])
    return out.exit_code, out.output


def test_dry_run_drill_on_kubernetes_changes_nothing(tmp_path):
    with running_k8s_api() as api:
        api.add_node("gpu-node-1")
        api.add_pod("train-0", "gpu-node-1", owner_kind="ReplicaSet", gpus=8)
        config = _config(tmp_path, api.url)
        code, output = _drill(config, "--node", "gpu-node-1", "--id", "kdry")
        assert code == 0, output
        rows = _rows(output)
        for stage in ("detect", "alert", "cordon", "drain", "reboot", "resume", "total"):
            assert rows[stage][-1] == "ok", output
        node = api.node("gpu-node-1")
        assert not node["spec"].get("unschedulable")
        assert "gpuhealth.io/reason" not in node["metadata"]["annotations"]
        assert api.evictions.get("default/train-0", 0) == 0
        assert api.requests.get("POST eviction", 0) == 0


def test_live_drill_on_kubernetes_cordons_evicts_reboots_validates_resumes(tmp_path):
    with running_k8s_api() as api:
        api.add_node("gpu-node-1")
        api.add_node("spare")
        api.reschedule_to = "spare"
        api.add_pod("train-0", "gpu-node-1", owner_kind="ReplicaSet", gpus=8)
        api.add_pod("dcgm-exporter-x", "gpu-node-1", owner_kind="DaemonSet")
        config = _config(tmp_path, api.url)
        with _RebootDaemon(api, "gpu-node-1") as daemon:
            code, output = _drill(config, "--node", "gpu-node-1", "--live", "--id", "klive")
        assert code == 0, output
        rows = _rows(output)
        for stage in ("detect", "alert", "cordon", "drain", "reboot", "validate", "resume",
                      "total"):
            assert rows[stage][-1] == "ok", output
        assert "LIVE" in output
        assert daemon.reboots == 1
        assert api.evictions["default/train-0"] == 1
        assert "default/dcgm-exporter-x" not in api.evictions
        cordoned = [reason for unschedulable, reason in daemon.seen if unschedulable]
        assert cordoned, daemon.seen
        assert cordoned[0].startswith("gpuhealth: drill klive: GpuXid79"), daemon.seen
        node = api.node("gpu-node-1")
        assert not node["spec"].get("unschedulable")  # resumed

        # an impossible SLO: the same drill fails loudly, exit 1
        with _RebootDaemon(api, "gpu-node-1"):
            code, output = _drill(config, "--node", "gpu-node-1", "--live", "--id", "kslo",
                                  "--slo", "alert=0")
        assert code == 1, output
        assert _rows(output)["alert"][-1] == "missed", output
        assert "drill kslo FAILED" in output


def test_a_node_with_the_opt_out_label_is_refused(tmp_path):
    with running_k8s_api() as api:
        api.add_node("gpu-node-1", labels={OPT_OUT_LABEL: "true"})
        config = _config(tmp_path, api.url)
        code, output = _drill(config, "--node", "gpu-node-1", "--live", "--id", "kopt")
        assert code == 3, output
        assert "opt-out" in output
        node = api.node("gpu-node-1")
        assert not node["spec"].get("unschedulable")


def test_a_node_a_human_cordoned_is_refused(tmp_path):
    with running_k8s_api() as api:
        api.add_node("gpu-node-1", unschedulable=True)
        config = _config(tmp_path, api.url)
        code, output = _drill(config, "--node", "gpu-node-1", "--live", "--id", "khum")
        assert code == 3, output
        assert "out of service already (a human" in output
        assert "gpuhealth.io/reason" not in api.node("gpu-node-1")["metadata"]["annotations"]
