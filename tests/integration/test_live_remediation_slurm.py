"""Live remediation on a real Slurm (slurmctld, slurmd, munge), end to end.

A real case's kernel-log line (Xid 79) is replayed into gpuhealth with ``replay --live``
against the node running a job: the node is drained with a reason starting
``gpuhealth:``, the job is signalled and requeued, the node is rebooted through
``scontrol reboot ASAP nextstate=RESUME`` (the test cluster's RebootProgram records the
request and restarts slurmd with ``-b``, a simulated successful reboot), and after
probation the incident closes with the node in service. A human's resume in the middle
is respected: gpuhealth does not drain the node again or reboot it.
"""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from gpuhealth.cli import main
from tests.slurm_server import SlurmCluster, slurm  # noqa: F401 - fixture

XID79 = ("[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:b1:00): 79, pid='<unknown>', "
         "name=<unknown>, GPU has fallen off the bus.\n")
JOB = "#!/bin/bash\ntrap 'echo got USR1' USR1\nfor i in $(seq 600); do sleep 1; done\n"


def _config(tmp, cluster: SlurmCluster, *, probation: float, grace: float) -> str:
    path = tmp / "slurm.toml"
    env = json.dumps(cluster.env)
    path.write_text(f"""
[node]
data_dir = "{tmp / 'data'}"

[remediation]
dry_run = false
scheduler = "slurm"
cluster_size = 10
max_disrupted_fraction = 1.0
probation_seconds = {probation}
tick_seconds = 0.2

[remediation.scheduler_options]
env = {env.replace(':', ' =')}
grace_seconds = {grace}
""")
    return str(path)


def _replay(tmp, cluster: SlurmCluster, config: str, wait: float) -> str:
    log = tmp / "kern.log"
    log.write_text(XID79)
    out = CliRunner().invoke(main, ["replay", str(log), "--context", f"node={cluster.host}",
                                    "--live", "--config", config, "--wait", str(wait)])
    assert out.exit_code == 0, out.output
    return out.output


def _running_job(cluster: SlurmCluster) -> str:
    job = cluster.sbatch(JOB, "--requeue", "--gres=gpu:1")
    cluster.wait(lambda: cluster.job(job).get("JobState") == "RUNNING", 30, "job running")
    return job


def test_xid79_drains_requeues_reboots_and_resumes_after_probation(slurm, tmp_path):  # noqa: F811
    cluster = slurm
    cluster.reset_host()
    job = _running_job(cluster)
    before = len(cluster.reboot_requests())
    config = _config(tmp_path, cluster, probation=3.0, grace=1.0)
    output = _replay(tmp_path, cluster, config, wait=60)
    assert "LIVE" in output
    # the job was signalled and requeued; the node was rebooted once through Slurm
    info = cluster.job(job)
    assert info.get("Restarts") == "1" or info.get("JobState") in ("PENDING", "REQUEUED"), info
    assert len(cluster.reboot_requests()) == before + 1
    actions = {a.split()[2]: a for a in output.splitlines() if a.startswith("action ")}
    assert "succeeded" in actions["cordon"]
    assert "succeeded" in actions["drain"]
    assert "succeeded" in actions["reboot"]
    # probation passes (3 s) without recurrence: the incident closes with the node in service
    time.sleep(3.5)
    out = CliRunner().invoke(main, ["replay", str(tmp_path / "kern.log"), "--context",
                                    f"node={cluster.host}", "--live", "--config", config,
                                    "--wait", "20"])
    assert out.exit_code == 0, out.output
    final = [a for a in out.output.splitlines() if a.startswith("action ")]
    assert any(" resume " in a and "succeeded" in a for a in final), out.output
    state = cluster.sinfo_state(cluster.host)
    assert "drain" not in state, state
    audit = [json.loads(x) for x in (tmp_path / "data" / "audit.jsonl").read_text().splitlines()]
    reasons = [r["reason"] for r in audit if r["decision"] == "requested" and r["step"] == "cordon"]
    assert reasons
    assert all(r.startswith("gpuhealth:") for r in reasons)
    cluster.run("scancel", job, check=False)


def test_a_human_resume_in_between_is_not_undone(slurm, tmp_path):  # noqa: F811
    cluster = slurm
    cluster.reset_host()
    job = _running_job(cluster)
    before = len(cluster.reboot_requests())
    # a long grace: the drain waits for the job, and the human resumes the node meanwhile
    config = _config(tmp_path, cluster, probation=3600.0, grace=30.0)
    log = tmp_path / "kern.log"
    log.write_text(XID79)
    import threading

    result: dict[str, str] = {}

    def replay() -> None:
        out = CliRunner().invoke(main, ["replay", str(log), "--context", f"node={cluster.host}",
                                        "--live", "--config", config, "--wait", "12"])
        result["output"] = out.output

    thread = threading.Thread(target=replay)
    thread.start()
    cluster.wait(lambda: cluster.node(cluster.host).get("Reason", "").startswith("gpuhealth:"),
                 20, "gpuhealth's drain")
    cluster.run("scontrol", "update", f"NodeName={cluster.host}", "State=RESUME")
    thread.join(60)
    output = result.get("output", "")
    assert "a human returned" in output or "cancelled" in output, output
    assert len(cluster.reboot_requests()) == before  # no reboot after the human's resume
    assert "drain" not in cluster.sinfo_state(cluster.host)
    assert not cluster.node(cluster.host).get("Reason", "").startswith("gpuhealth:")
    cluster.run("scancel", job, check=False)
