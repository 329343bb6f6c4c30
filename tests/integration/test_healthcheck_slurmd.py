"""``gpuhealth check`` as slurmd's own ``HealthCheckProgram`` on a real Slurm 22.05 (#16 item 3,
#17's Slurm shape).

slurm.conf gets ``HealthCheckProgram=`` (the shipped ``deploy/slurm/gpuhealth-check``,
reached through a two-line shim standing in for ``/etc/default/gpuhealth-check``: slurmd
runs the program without arguments and with an almost empty environment) and
``HealthCheckInterval=``; slurmctld asks slurmd to run it, and slurmd runs it as root.
The node's GPU state is a stand-in ``nvidia-smi`` printing a recorded output:

1. the output of a GPU fallen off the bus: the check drains its node, reason
   ``gpuhealth: check: critical xid 79 ...``;
2. a healthy output: the check resumes its own drain;
3. a drain by a person: the check leaves it (reason kept) however often it runs;
4. every run, timed by the shim, ends well inside slurmd's 60 s limit.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from tests.slurm_server import SlurmCluster, slurm  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "deploy" / "slurm" / "gpuhealth-check"
FIXTURES = ROOT / "tests" / "fixtures"
CRITICAL = FIXTURES / "cases" / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"
HEALTHY = FIXTURES / "nvidia-smi" / "titan-v-q.txt"
GPUHEALTH = Path(sys.executable).with_name("gpuhealth")
TOOLS = ("sh", "cat", "hostname", "date", "scontrol", "sinfo", "squeue")
INTERVAL = 5
SLURMD_LIMIT_SECONDS = 60.0


def _node_side(tmp: Path, cluster: SlurmCluster) -> tuple[Path, Path, Path]:
    """The node's files: the shim slurmd runs, the stand-in nvidia-smi's output, the run log."""
    bin_dir, tools = tmp / "bin", tmp / "tools"
    bin_dir.mkdir()
    tools.mkdir()
    output = tmp / "nvidia-smi.out"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat '{output}'\n")
    smi.chmod(0o755)
    for tool in TOOLS:  # only these: no host journalctl or dmesg, no real nvidia-smi
        found = shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin")
        assert found, tool
        (tools / tool).symlink_to(found)
    config = tmp / "check.toml"
    env = json.dumps(cluster.env).replace(":", " =")
    config.write_text(f'[node]\nname = "{cluster.host}"\ndata_dir = "{tmp / "data"}"\n'
                      f'[remediation]\nscheduler = "slurm"\n'
                      f'[remediation.scheduler_options]\nenv = {env}\n')
    runs = tmp / "runs.log"
    shim = tmp / "gpuhealth-check"
    # what /etc/default/gpuhealth-check holds on a node, then the shipped program
    shim.write_text(f"""#!/bin/sh
export PATH='{bin_dir}:{tools}' GPUHEALTH_BIN='{GPUHEALTH}' GPUHEALTH_CHECK_CONFIG='{config}'
started=$(date +%s.%N)
parent=$(cat /proc/$PPID/comm 2>/dev/null)
/bin/sh '{CHECK}' >> '{tmp}/check.out' 2>&1
status=$?
echo "$started $(date +%s.%N) $status $parent ${{SLURMD_NODENAME:-}}" >> '{runs}'
exit $status
""")
    shim.chmod(0o755)
    return shim, output, runs


def _runs(runs: Path) -> list[list[str]]:
    return [line.split() for line in runs.read_text().splitlines()] if runs.exists() else []


def _wait_runs(cluster: SlurmCluster, runs: Path, more: int, timeout: float = 120.0) -> None:
    start = len(_runs(runs))
    cluster.wait(lambda: len(_runs(runs)) >= start + more, timeout,
                 f"{more} more health check run(s) by slurmd")


def test_slurmd_runs_gpuhealth_check_as_its_health_check_program(slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    shim, output, runs = _node_side(tmp_path, cluster)
    shutil.copy(CRITICAL, output)
    try:
        with cluster.conf_lines(f"HealthCheckProgram={shim}",
                                f"HealthCheckInterval={INTERVAL}",
                                "HealthCheckNodeState=ANY"):
            # 1. a GPU fallen off the bus: the check drains its own node
            node = cluster.wait(lambda: (n := cluster.node(cluster.host)) and "DRAIN" in
                                n["State"] and n, 120, "drained by the health check",
                                detail=lambda: (_runs(runs), cluster.log("slurmd")[-1500:]))
            assert node["Reason"].startswith("gpuhealth: check: critical xid 79"), node
            (first, *_) = cluster.wait(lambda: _runs(runs), 60, "the run logged")
            assert first[3:4] == ["slurmd"], first  # slurmd itself ran it
            # 2. healthy again: it resumes its own drain
            shutil.copy(HEALTHY, output)
            cluster.wait(lambda: "DRAIN" not in cluster.node(cluster.host)["State"], 120,
                         "resumed by the health check",
                         detail=lambda: (_runs(runs)[-3:], cluster.node(cluster.host)))
            assert not cluster.node(cluster.host)["Reason"]
            cluster.wait(lambda: len(_runs(runs)) >= 2, 60, "the resuming run logged")
            # 3. a person's drain is not the check's: left alone, however often it runs
            cluster.run("scontrol", "update", f"NodeName={cluster.host}", "State=DRAIN",
                        "Reason=maintenance by ops")
            _wait_runs(cluster, runs, 2)  # so one at least started after the drain
            node = cluster.node(cluster.host)
            assert "DRAIN" in node["State"], node
            assert node["Reason"] == "maintenance by ops"
            out = (tmp_path / "check.out").read_text()
            assert "left drained by someone else" in out
            assert "resumed (the check's own drain)" in out
        # 4. every run within slurmd's limit (with room to spare)
        took = [float(end) - float(start) for start, end, *_ in _runs(runs)]
        assert len(took) >= 4
        assert max(took) < SLURMD_LIMIT_SECONDS / 2, took
        assert all(r[4:] == [cluster.host] for r in _runs(runs)), _runs(runs)  # SLURMD_NODENAME
    finally:
        time.sleep(0.1)
        cluster.reset_host()
