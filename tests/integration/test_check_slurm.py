"""``gpuhealth check --slurm`` on a real Slurm (slurmctld, slurmd, munge): NHC's contract.

A critical finding drains the node with a ``gpuhealth: check:`` reason and exits 3; a
passing check resumes only the check's own drain, never a person's or the controller's
(#16 item 3).
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from gpuhealth.cli import main
from tests.slurm_server import SlurmCluster, slurm  # noqa: F401 - fixture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
XID79 = FIXTURES / "cases" / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"
HEALTHY = FIXTURES / "nvidia-smi" / "titan-v-q.txt"


def _config(tmp_path: Path, cluster: SlurmCluster) -> str:
    path = tmp_path / "check.toml"
    env = json.dumps(cluster.env).replace(":", " =")
    path.write_text(f'[node]\nname = "{cluster.host}"\ndata_dir = "{tmp_path}"\n'
                    f'[remediation]\nscheduler = "slurm"\n'
                    f'[remediation.scheduler_options]\nenv = {env}\n')
    return str(path)


def _check(config: str, cluster: SlurmCluster, artifact: Path, *extra: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, ["check", "--slurm", "--config", config, "--node",
                                     cluster.host, "--input", str(artifact), *extra])


def test_a_failing_check_drains_its_node_and_a_passing_one_resumes_it(slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    config = _config(tmp_path, cluster)
    dry = _check(config, cluster, XID79, "--dry-run")
    assert dry.exit_code == 3, dry.output
    assert "would drain" in dry.output
    assert "DRAIN" not in cluster.node(cluster.host).get("State", "")
    failed = _check(config, cluster, XID79)
    assert failed.exit_code == 3, failed.output
    assert "critical xid 79" in failed.output
    node = cluster.node(cluster.host)
    assert "DRAIN" in node.get("State", "")
    assert node["Reason"].startswith("gpuhealth: check: critical xid 79")
    again = _check(config, cluster, XID79)  # still failing: nothing twice
    assert "already drained" in again.output
    passed = _check(config, cluster, HEALTHY)
    assert passed.exit_code == 0, passed.output
    assert "resumed (the check's own drain)" in passed.output
    cluster.wait(lambda: "DRAIN" not in cluster.node(cluster.host).get("State", ""), 30,
                 "resumed")
    cluster.reset_host()


def test_a_passing_check_leaves_other_drains_alone(slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    config = _config(tmp_path, cluster)
    for reason in ("maintenance by ops", "gpuhealth: GpuXid79 critical reboot_node on GPU"):
        cluster.reset_host()
        cluster.run("scontrol", "update", f"NodeName={cluster.host}", "State=DRAIN",
                    f"Reason={reason}")
        passed = _check(config, cluster, HEALTHY)
        assert passed.exit_code == 0, passed.output
        assert "left drained by someone else" in passed.output
        node = cluster.node(cluster.host)
        assert "DRAIN" in node.get("State", "")
        assert node["Reason"] == reason
    cluster.reset_host()
