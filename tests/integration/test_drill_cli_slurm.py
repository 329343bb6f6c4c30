"""``gpuhealth drill`` on a real Slurm 22.05 (slurmctld, slurmd, munge), dry-run and live.

The drill builds ``run``'s pipeline from the TOML file (the Slurm adapter, the local
validator with a ``dcgmi`` stand-in, the local bundle collector), injects an Xid 79
kernel-log line marked ``gpuhealth-drill=<id>`` and times every stage:

1. dry-run: every stage is timed and the node never changes (idle, no reason);
2. live, under a running job: the node is drained with a ``gpuhealth: drill <id>:``
   reason, the job requeued, the node rebooted through ``scontrol reboot`` (the test
   cluster's RebootProgram), validated and resumed: every stage within its SLO, exit 0;
3. live with an impossible SLO: exit 1, the stage named;
4. live with a failing validation: the node is not handed to hardware service (no
   hand-off reason on it; the drill fails, exit 1, and says so);
5. the cluster's opted-out node is refused (exit 3) before anything is injected.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from click.testing import CliRunner

from gpuhealth.cli import main
from remediation.slurm import HAND_OFF_PREFIX
from storage.history import IncidentHistory
from tests.slurm_server import SlurmCluster, slurm  # noqa: F401 - fixture

JOB = "#!/bin/bash\nfor i in $(seq 600); do sleep 1; done\n"

DCGMI = """#!/bin/sh
# dcgmi stand-in: DCGM's diag table; fails while {flag} exists
if [ -e {flag} ]; then
  printf '| Diagnostic                | Result                                         |\\n'
  printf '| Memory                    | Fail - GPU 0: DBE error detected (drill)       |\\n'
  exit 226
fi
printf '| Diagnostic                | Result                                         |\\n'
printf '| Memory                    | Pass                                           |\\n'
exit 0
"""


def _config(tmp: Path, cluster: SlurmCluster) -> tuple[Path, Path]:
    flag = tmp / "dcgm-fails"
    dcgmi = tmp / "dcgmi"
    dcgmi.write_text(DCGMI.format(flag=flag))
    dcgmi.chmod(0o755)
    env = json.dumps(cluster.env).replace(":", " =")
    path = tmp / "gpuhealth.toml"
    path.write_text(f"""
[node]
name = "{cluster.host}"
data_dir = "{tmp / 'data'}"

[analytics]
detectors = false
predictor = false

[remediation]
dry_run = true
scheduler = "slurm"
cluster_size = 10
max_disrupted_fraction = 0.1
probation_seconds = 2

[remediation.scheduler_options]
env = {env}
grace_seconds = 1
reboot_nextstate = "DOWN"

[remediation.validation]
checks = ["dcgm_diag"]
dcgmi = "{dcgmi}"
dcgm_level = 1
dcgm_timeout_seconds = 30

[remediation.bundle]
timeout_seconds = 20
kernel_window_seconds = 600
nvidia_bug_report = ""

[drill]
timeout_seconds = 120
evaluate_seconds = 0.5

[drill.slo]
detect = "5s"
alert = "5s"
cordon = "10s"
drain = "30s"
reboot = "60s"
validate = "90s"
resume = "100s"
""")
    return path, flag


def _drill(config: Path, *args: str) -> tuple[int, str]:
    out = CliRunner().invoke(main, ["drill", "--config", str(config), *args])
    return out.exit_code, out.output


def _rows(output: str) -> dict[str, list[str]]:
    stages = ("detect", "alert", "cordon", "drain", "reboot", "reset_gpu", "validate",
              "resume", "total")
    return {line.split()[0]: line.split() for line in output.splitlines()
            if line.split() and line.split()[0] in stages}


class _Watch:
    """What ``scontrol show node`` says of the node while the drill runs (every 0.2 s)."""

    def __init__(self, cluster: SlurmCluster) -> None:
        self.cluster = cluster
        self.states: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            node = self.cluster.node(self.cluster.host)
            seen = (node.get("State", ""), node.get("Reason", ""))
            if not self.states or self.states[-1] != seen:
                self.states.append(seen)
            time.sleep(0.2)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_dry_run_drill_times_every_stage_and_changes_nothing(slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    config, _ = _config(tmp_path, cluster)
    before = len(cluster.reboot_requests())
    with _Watch(cluster) as watch:
        code, output = _drill(config, "--node", cluster.host, "--id", "dry1")
    assert code == 0, output
    rows = _rows(output)
    for stage in ("detect", "alert", "cordon", "drain", "reboot", "resume", "total"):
        assert rows[stage][-1] == "ok", output
    assert rows["validate"][3] == "skipped"  # validation runs only in a live drill
    assert "dry-run" in output
    assert all("DRAIN" not in s and not r for s, r in watch.states), watch.states
    assert len(cluster.reboot_requests()) == before
    assert cluster.sinfo_state(cluster.host) == "idle"


def test_live_drill_drains_reboots_validates_and_resumes_within_slo(slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    config, _ = _config(tmp_path, cluster)
    job = cluster.sbatch(JOB, "--requeue", "--gres=gpu:1")
    cluster.wait(lambda: cluster.job(job).get("JobState") == "RUNNING", 30, "job running")
    before = len(cluster.reboot_requests())
    try:
        with _Watch(cluster) as watch:
            code, output = _drill(config, "--node", cluster.host, "--live", "--id", "live1")
        assert code == 0, output
        rows = _rows(output)
        for stage in ("detect", "alert", "cordon", "drain", "reboot", "validate", "resume",
                      "total"):
            assert rows[stage][-1] == "ok", output
            if stage != "total":
                assert float(rows[stage][1]) <= float(rows[stage][2]), output  # within SLO
        assert "LIVE" in output
        drained = [(s, r) for s, r in watch.states if "DRAIN" in s]
        assert drained, watch.states
        assert drained[0][1].startswith("gpuhealth: drill live1: GpuXid79"), watch.states
        assert not any(r.startswith(HAND_OFF_PREFIX) for _, r in watch.states)
        assert len(cluster.reboot_requests()) == before + 1
        info = cluster.job(job)
        assert info.get("Restarts") == "1" or info.get("JobState") in ("PENDING", "REQUEUED")
        cluster.wait(lambda: cluster.sinfo_state(cluster.host) == "idle", 30, "node idle")
        assert not cluster.node(cluster.host)["Reason"]
        # the report's history has it as a drill
        history = IncidentHistory(tmp_path / "data/history.sqlite")
        try:
            (row,) = history.incidents().to_dict("records")
        finally:
            history.close()
        assert row["attrs"]["drill"] == "live1"
        assert row["attrs"]["drill_mode"] == "live"
        assert row["attrs"]["drill_result"] == "passed"
    finally:
        cluster.run("scancel", job, check=False)
        cluster.reset_host()


def test_live_drill_with_an_impossible_slo_exits_non_zero(slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    config, _ = _config(tmp_path, cluster)
    try:
        code, output = _drill(config, "--node", cluster.host, "--live", "--id", "slo1",
                              "--slo", "drain=1ms")
        assert code == 1, output
        assert _rows(output)["drain"][-1] == "missed", output
        assert "drill slo1 FAILED" in output
        assert _rows(output)["resume"][-1] == "ok"  # the node still came back
    finally:
        cluster.reset_host()


def test_live_drill_whose_validation_fails_hands_nothing_off(slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    config, flag = _config(tmp_path, cluster)
    flag.touch()
    try:
        code, output = _drill(config, "--node", cluster.host, "--live", "--id", "ho1")
        assert code == 1, output
        assert "validation failed" in output
        assert "hand-offs to hardware service not made (a drill): 1" in output, output
        node = cluster.node(cluster.host)
        assert not node["Reason"].startswith(HAND_OFF_PREFIX), node
        assert node["Reason"].startswith("gpuhealth: drill ho1:"), node
        records = [json.loads(x) for x in
                   (tmp_path / "data/drills/ho1/audit.jsonl").read_text().splitlines()]
        assert all(r["details"]["drill"] == "ho1" for r in records)
    finally:
        cluster.reset_host()


def test_the_opted_out_node_is_refused(slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    config, _ = _config(tmp_path, cluster)
    code, output = _drill(config, "--node", cluster.opt_out_node, "--live", "--id", "oo1")
    assert code == 3, output
    assert "opt-out" in output
    assert not (tmp_path / "data/drills/oo1/kern.log").exists()
