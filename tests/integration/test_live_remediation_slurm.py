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
    assert out.exit_code == 3, out.output  # the Xid 79 stays critical: exit as diagnose
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
    assert out.exit_code == 3, out.output  # the Xid 79 stays critical: exit as diagnose
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


def test_the_budget_holds_under_a_burst_of_50_failing_nodes(slurm, tmp_path):  # noqa: F811
    """50 nodes report Xid 79 at once on a 100-node cluster (real slurmctld; the nodes have no
    slurmd, which scontrol drains and resumes all the same): 10 % budget -> 10 drained."""
    import asyncio

    from gpuhealth.pipeline import Pipeline
    from remediation.slurm import SlurmScheduler
    from tests.unit.test_engine import xid79

    cluster = slurm
    nodes = cluster.fake_nodes[:50]
    cluster.run("scontrol", "update", f"NodeName={','.join(cluster.fake_nodes)}",
                "State=RESUME", check=False)
    adapter = SlurmScheduler(env=cluster.env, grace_seconds=0.0)
    p = Pipeline(facts={}, notifiers=[], audit_log_path=str(tmp_path / "audit.jsonl"),
                 dry_run=False, scheduler=adapter, cluster_size=100,
                 max_disrupted_fraction=0.10, gpu_level_drain=False, rules=[],
                 engine_options={"breaker_max_nodes": 1000, "probation_seconds": 3600})
    p.observe_findings([xid79(n) for n in nodes], hold_seconds=1e6)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(p.aevaluate())
        for _ in range(10):
            loop.run_until_complete(p.atick())
        drained = [n for n in cluster.fake_nodes if "DRAIN" in cluster.node(n).get("State", "")]
        assert len(drained) == 10, [(a.step.value, a.node, a.phase.value, a.message)
                                    for a in p.actions.actions()][:12]
        assert set(drained) <= set(nodes)
        assert len(p.policy.held) == 40
        held = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
        assert sum(1 for r in held if r["decision"] == "held"
                   and "disruption budget" in r["reason"]) >= 40
        # the default breaker (above max(3, ceil(20 % of 100)) = 20 nodes) stops everything
        q = Pipeline(facts={}, notifiers=[], audit_log_path=None, dry_run=False,
                     scheduler=adapter, cluster_size=100, max_disrupted_fraction=0.10,
                     gpu_level_drain=False, rules=[],
                     engine_options={"breaker_max_nodes": 20})
        others = cluster.fake_nodes[50:]
        q.observe_findings([xid79(n) for n in others], hold_seconds=1e6)
        loop.run_until_complete(q.aevaluate())
        for _ in range(3):
            loop.run_until_complete(q.atick())
        assert q.engine.breaker_open
        assert not [n for n in others if "DRAIN" in cluster.node(n).get("State", "")]
    finally:
        loop.close()
        cluster.run("scontrol", "update", f"NodeName={','.join(cluster.fake_nodes)}",
                    "State=RESUME", check=False)
