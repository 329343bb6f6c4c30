"""The Slurm adapter against a real Slurm 22.05 (slurmctld, slurmd, munge; tests/slurm_server.py).

The first tests need no Slurm: they parse output recorded from the same Slurm 22.05.8
(``scontrol show node -o``, ``sinfo --json``, ``squeue --json``, ``squeue -O``,
``scontrol show job -o``) and check the adapter's arguments and mappings. The rest
drive the real cluster: the real node (the host's short name, 4 fake GPUs, a
RebootProgram that records and simulates the reboot) and 100 slurmd-less nodes.
Grace periods run on a fake clock, so no test sleeps through one.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.clock import FakeClock
from core.errors import (
    ConfigError,
    NodeNotFound,
    PermanentError,
    ReturnedToService,
    SchedulerUnavailable,
)
from core.protocols import NodeInspector, ReliabilityPublisher, SchedulerAdapter
from core.records import (
    ActionPhase,
    ActionRequest,
    ActionStatus,
    EntityId,
    NodeName,
    RemediationStep,
)
from remediation.slurm import (
    SlurmScheduler,
    admin_comment_of,
    expand_hostlist,
    job_marks,
    key_hash,
    parse_scontrol_node,
    parse_sinfo_json,
    parse_squeue_json,
    parse_squeue_text,
    reliability_weight,
)
from tests.slurm_server import SlurmCluster
from tests.slurm_server import slurm as slurm  # fixture

# --- recorded output (Slurm 22.05.8, Debian 12) --------------------------------------

NODE_HUMAN_DRAIN = (
    "NodeName=gpu098 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=N/A "
    "AvailableFeatures=gpu ActiveFeatures=gpu Gres=gpu:4 NodeAddr=127.0.0.1 NodeHostName=gpu098 "
    "Port=46899  RealMemory=1000 AllocMem=0 FreeMem=N/A Sockets=2 Boards=1 "
    "State=UNKNOWN+DRAIN+NOT_RESPONDING ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
    "MCS_label=N/A Partitions=fleet  BootTime=None SlurmdStartTime=None LastBusyTime=Unknown "
    "CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 "
    "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s "
    "Reason=human: fan [root@2026-11-30T07:55:31] Comment=rack 7 x=2\n"
)
NODE_REBOOT_REQUESTED = (
    "NodeName=gpu099 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=N/A "
    "AvailableFeatures=gpu ActiveFeatures=gpu Gres=gpu:4 NodeAddr=127.0.0.1 NodeHostName=gpu099 "
    "Port=46899  RealMemory=1000 AllocMem=0 FreeMem=N/A Sockets=2 Boards=1 "
    "State=UNKNOWN+DRAIN+REBOOT_REQUESTED+NOT_RESPONDING ThreadsPerCore=1 TmpDisk=0 Weight=1 "
    "Owner=N/A MCS_label=N/A NextState=RESUME Partitions=fleet  BootTime=None "
    "SlurmdStartTime=None LastBusyTime=Unknown CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES= "
    "CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 "
    "ExtSensorsTemp=n/s Reason=gpuhealth: r99 [root@2026-11-30T07:55:24]\n"
)
NODE_GPUHEALTH_DRAINING = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=2  CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=2.04 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:4 NodeAddr=vm NodeHostName=vm "
    "Version=22.05.8 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 "
    "AllocMem=0 FreeMem=21317 Sockets=1 Boards=1 State=MIXED+DRAIN ThreadsPerCore=1 TmpDisk=0 "
    "Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  BootTime=2026-11-30T07:55:09 "
    "SlurmdStartTime=2026-11-30T07:55:10 LastBusyTime=2026-11-30T07:55:10 "
    "CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES=cpu=1 CapWatts=n/a CurrentWatts=0 AveWatts=0 "
    "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=gpuhealth: GpuXid79 "
    "critical reboot_node on 0000:b1:00.0: Xid 79 [root@2026-11-30T08:01:21] "
    "Comment=gpuhealth: reboot k1 boot=123\n"
)
SINFO_JSON = (
    '{"meta": {"plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"}, '
    '"Slurm": {"version": {"major": 22, "micro": 8, "minor": 5}, "release": "22.05.8"}}, '
    '"errors": [], "nodes": [{"name": "gpu098", "hostname": "gpu098", "state": "unknown", '
    '"state_flags": ["DRAIN", "NOT_RESPONDING"], "reason": "human: fan", '
    '"reason_set_by_user": "root", "boot_time": 0, "features": "gpu", "active_features": "gpu", '
    '"weight": 1, "comment": "rack 7 x=2", "next_state_after_reboot": "invalid", '
    '"next_state_after_reboot_flags": []}, {"name": "optout1", "hostname": "optout1", '
    '"state": "unknown", "state_flags": ["NOT_RESPONDING"], "reason": "", '
    '"reason_set_by_user": "root", "boot_time": 0, "features": "gpuhealth-opt-out", '
    '"active_features": "gpuhealth-opt-out", "weight": 7, "comment": "", '
    '"next_state_after_reboot": "invalid", "next_state_after_reboot_flags": []}, '
    '{"name": "vm", "hostname": "vm", "state": "mixed", "state_flags": ["DRAIN"], '
    '"reason": "gpuhealth: GpuXid79 critical reboot_node on 0000:b1:00.0: Xid 79", '
    '"reason_set_by_user": "root", "boot_time": 1796025309, "features": "", '
    '"active_features": "", "weight": 1, "comment": "gpuhealth: reboot k1 boot=123", '
    '"next_state_after_reboot": "invalid", "next_state_after_reboot_flags": []}]}'
)
SINFO_JSON_NO_CONTROLLER = (
    '{"meta": {"plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"}}, '
    '"errors": [{"error": "Unspecified error", "errno": -1}], "nodes": []}'
)
SQUEUE_JSON = (
    '{"meta": {"plugin": {"type": "openapi/v0.0.38", "name": "Slurm OpenAPI v0.0.38"}}, '
    '"errors": [], "jobs": [{"job_id": 3, "job_state": "RUNNING", "nodes": "vm", '
    '"requeue": true, "batch_flag": true, "restart_cnt": 0, '
    '"admin_comment": "site note; gpuhealth:0123456789ab:signal@vm:1796025301.444", '
    '"job_resources": {"nodes": "vm", "allocated_cores": 1, "allocated_hosts": 1, '
    '"allocated_nodes": [{"sockets": {"0": {"cores": {"0": "allocated"}}}, "nodename": "vm", '
    '"cpus_used": 0, "memory_used": 0, "memory_allocated": 0}]}, "array_task_id": null, '
    '"name": "job.sh", "user_name": "root"}, {"job_id": 4, "job_state": "PENDING", '
    '"nodes": "", "requeue": false, "batch_flag": true, "restart_cnt": 1, "admin_comment": "", '
    '"job_resources": {}, "array_task_id": null}]}'
)
SQUEUE_TEXT = (
    "3                                       |RUNNING             |1   |1   |0       |\n"
    "2                                       |RUNNING             |0   |1   |0       |\n"
)
JOB_LINE = (
    "JobId=3 JobName=job.sh UserId=root(0) GroupId=root(0) MCS_label=N/A JobState=RUNNING "
    "Reason=None Requeue=1 Restarts=0 BatchFlag=1 Partition=debug "
    "AllocNode:Sid=localhost:17262 NodeList=vm BatchHost=vm Command=/tmp/slurmexp/job.sh "
    "WorkDir=/tmp/slurmexp AdminComment=site note; gpuhealth:0123456789ab:signal@vm:"
    "1796025301.444  StdErr=/tmp/slurmexp/job-3.out StdIn=/dev/null TresPerNode=gres:gpu:1 \n"
)

logger = logging.getLogger(__name__)


def request(step: RemediationStep, node: str, key: str, *, reason: str = "",
            dry_run: bool = False, **attrs: str) -> ActionRequest:
    return ActionRequest(
        step=step, node=NodeName(node), entity=EntityId("node"),
        reason=reason or f"gpuhealth: GpuXid79 critical reboot_node on node: test {key}",
        idempotency_key=key, dry_run=dry_run, attrs=attrs,
    )


# --- without Slurm -------------------------------------------------------------------


def test_parse_scontrol_node_free_text_fields() -> None:
    node = parse_scontrol_node(NODE_HUMAN_DRAIN)
    assert (node.name, node.state, node.flags) == ("gpu098", "UNKNOWN",
                                                   ("DRAIN", "NOT_RESPONDING"))
    assert node.reason == "human: fan"
    assert node.comment == "rack 7 x=2"
    assert node.drained
    assert not node.schedulable
    assert not node.owned
    assert node.boot_time is None
    assert node.weight == 1

    draining = parse_scontrol_node(NODE_GPUHEALTH_DRAINING)
    assert draining.state_words == "MIXED+DRAIN"
    assert draining.reason == ("gpuhealth: GpuXid79 critical reboot_node on 0000:b1:00.0: "
                               "Xid 79")
    assert draining.owned
    assert draining.features == ()
    assert draining.boot_time == int(time.mktime(time.strptime("2026-11-30T07:55:09",
                                                               "%Y-%m-%dT%H:%M:%S")))
    rebooting = parse_scontrol_node(NODE_REBOOT_REQUESTED)
    assert rebooting.rebooting
    assert rebooting.reason == "gpuhealth: r99"

    with pytest.raises(PermanentError, match="cannot parse"):
        parse_scontrol_node("Node nosuch not found\n")


def test_parse_sinfo_json_matches_text() -> None:
    nodes = parse_sinfo_json(SINFO_JSON)
    assert set(nodes) == {"gpu098", "optout1", "vm"}
    text = parse_scontrol_node(NODE_HUMAN_DRAIN)
    assert nodes["gpu098"] == text
    assert nodes["optout1"].opted_out
    assert not nodes["vm"].opted_out
    assert nodes["optout1"].weight == 7
    assert nodes["vm"].owned
    assert nodes["vm"].boot_time == 1796025309
    with pytest.raises(SchedulerUnavailable, match="Unspecified error"):
        parse_sinfo_json(SINFO_JSON_NO_CONTROLLER)
    with pytest.raises(PermanentError, match="not JSON"):
        parse_sinfo_json("sinfo: unrecognized option '--json'")


def test_parse_jobs_json_text_and_marks() -> None:
    jobs = parse_squeue_json(SQUEUE_JSON)
    assert [(j.job_id, j.state, j.nodes, j.requeue) for j in jobs] == [
        ("3", "RUNNING", ("vm",), True), ("4", "PENDING", (), False)]
    assert job_marks(jobs[0].admin_comment, "0123456789ab", "signal", "vm") == [1796025301.444]
    assert job_marks(jobs[0].admin_comment, "0123456789ab", "signal", "gpu001") == []
    assert job_marks(jobs[0].admin_comment, "0123456789ab", "requeue", "vm") == []
    text = parse_squeue_text(SQUEUE_TEXT, "vm")
    assert [(j.job_id, j.requeue, j.batch) for j in text] == [("3", True, True),
                                                              ("2", False, True)]
    assert admin_comment_of(JOB_LINE) == jobs[0].admin_comment
    with pytest.raises(PermanentError, match="line 1"):
        parse_squeue_text("3|RUNNING\n", "vm")


def test_expand_hostlist() -> None:
    assert expand_hostlist("gpu[001-003,7],vm") == ["gpu001", "gpu002", "gpu003", "gpu7", "vm"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_hostlist("gpu[1-2")
    with pytest.raises(ValueError, match="bad range"):
        expand_hostlist("gpu[3-1]")


def test_a_listing_that_finished_before_the_caller_asked_is_run_again() -> None:
    # A run of `sinfo --json` that finished, its clean-up callback not run yet, while a
    # later caller asks: the caller must start a new run, not wait on the finished one
    # (awaiting a done future never yields: that loop once spun the event loop forever).
    import threading

    from remediation import slurm as slurm_module

    adapter = SlurmScheduler()
    runs: list[tuple[str, ...]] = []

    async def fake_run(*argv: str, check: bool = True,
                       mutating: bool = False) -> slurm_module._Result:
        runs.append(argv)
        return slurm_module._Result(argv=argv, returncode=0, stdout="new", stderr="")

    adapter._run = fake_run  # type: ignore[method-assign]

    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        old: asyncio.Future[slurm_module._Result] = loop.create_future()
        old.set_result(slurm_module._Result(argv=("sinfo", "--json"), returncode=0,
                                            stdout="old", stderr=""))
        adapter._loop_state().inflight["sinfo --json"] = (time.monotonic() - 10.0, old)
        result = await adapter._fresh("sinfo", "--json")
        return result.stdout

    out: list[str] = []
    worker = threading.Thread(target=lambda: out.append(asyncio.run(scenario())), daemon=True)
    worker.start()
    worker.join(10.0)
    assert not worker.is_alive(), "_fresh spun on a finished run"
    assert out == ["new"]
    assert runs == [("sinfo", "--json")]


def test_reliability_weight_and_options() -> None:
    assert [reliability_weight(s) for s in (1.0, 0.99, 0.5, 0.0)] == [1, 2, 51, 100]
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            reliability_weight(bad)
    with pytest.raises(ValueError, match="reboot_nextstate"):
        SlurmScheduler(reboot_nextstate="REBOOT")
    with pytest.raises(ValueError, match="grace_seconds"):
        SlurmScheduler(grace_seconds=-1)
    with pytest.raises(ValueError, match="checkpoint_signal"):
        SlurmScheduler(checkpoint_signal="USR1; rm -rf /")
    adapter = SlurmScheduler()
    assert isinstance(adapter, SchedulerAdapter)
    assert isinstance(adapter, NodeInspector)
    assert isinstance(adapter, ReliabilityPublisher)
    assert adapter.name == "slurm"
    assert adapter.gpu_level_drain is False


def test_refusals_without_running_anything() -> None:
    adapter = SlurmScheduler(scontrol_path="/nonexistent/scontrol",
                             sinfo_path="/nonexistent/sinfo")
    with pytest.raises(PermanentError, match="not a Slurm operation"):
        asyncio.run(adapter.submit(request(RemediationStep.RESET_GPU, "vm", "k/reset_gpu")))
    with pytest.raises(PermanentError, match="must start with 'gpuhealth:'"):
        asyncio.run(adapter.submit(request(RemediationStep.CORDON, "vm", "k/cordon",
                                           reason="maintenance")))
    with pytest.raises(PermanentError, match="hostlist"):
        asyncio.run(adapter.submit(request(RemediationStep.CORDON, "gpu[001-100]", "k/c2")))
    with pytest.raises(PermanentError, match="not a Slurm adapter ref"):
        asyncio.run(adapter.status("dry-run-1"))
    ref = asyncio.run(adapter.submit(request(RemediationStep.NOTIFY, "vm", "k/notify")))
    status = asyncio.run(adapter.status(ref))
    assert status.phase == ActionPhase.SUCCEEDED
    assert not adapter.commands
    with pytest.raises(ConfigError, match="cannot be run"):
        asyncio.run(adapter.node_state(NodeName("vm")))


# --- against the real Slurm ----------------------------------------------------------


@pytest.fixture
def cluster(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    slurm.reset_host()
    yield slurm
    slurm.reset_host()


def adapter_for(cluster: SlurmCluster, **options: object) -> SlurmScheduler:
    return SlurmScheduler(env=cluster.env, **options)  # type: ignore[arg-type]


def poll(adapter: SlurmScheduler, ref: str, *, until: tuple[ActionPhase, ...] = (
        ActionPhase.SUCCEEDED, ActionPhase.FAILED, ActionPhase.CANCELLED),
         timeout: float = 20.0) -> ActionStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = asyncio.run(adapter.status(ref))
        if status.phase in until or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


SIGNAL_JOB = """#!/bin/bash
#SBATCH --requeue
#SBATCH --gres=gpu:1
trap 'echo "USR1 $SLURM_JOB_ID restart=${{SLURM_RESTART_COUNT:-0}} $(date +%s.%N)" >> {log}' USR1
while true; do sleep 0.1; done
"""


def running(cluster: SlurmCluster, job_id: str) -> bool:
    return cluster.job(job_id).get("JobState") == "RUNNING"


@pytest.mark.parametrize("json_output", [True, False], ids=["json", "text"])
def test_cordon_then_resume_a_slurmd_less_node(cluster: SlurmCluster, json_output: bool) -> None:
    node = "gpu010" if json_output else "gpu011"
    adapter = adapter_for(cluster, json_output=json_output)
    reason = "gpuhealth: GpuXid79 critical reboot_node on 0000:b1:00.0: Xid 79"
    ref = asyncio.run(adapter.submit(request(RemediationStep.CORDON, node, f"{node}/cordon",
                                             reason=reason)))
    status = asyncio.run(adapter.status(ref))
    assert status.phase == ActionPhase.SUCCEEDED, status
    shown = cluster.node(node)
    assert "DRAIN" in shown["State"]
    assert shown["Reason"] == reason
    state = asyncio.run(adapter.node_state(NodeName(node)))
    assert state.exists
    assert not state.schedulable
    assert state.owned
    assert state.reason == reason

    ref = asyncio.run(adapter.submit(request(RemediationStep.RESUME, node, f"{node}/resume")))
    status = asyncio.run(adapter.status(ref))
    assert status.phase == ActionPhase.SUCCEEDED, status
    assert "DRAIN" not in cluster.node(node)["State"]
    state = asyncio.run(adapter.node_state(NodeName(node)))
    assert state.schedulable
    assert not state.owned


def test_drain_evict_signals_then_requeues_once_across_fail_over(cluster: SlurmCluster) -> None:
    signals = cluster.folder / "signals-evict.log"
    job = cluster.sbatch(SIGNAL_JOB.format(log=signals))
    cluster.wait(lambda: running(cluster, job), what=f"job {job} running")
    clock = FakeClock(now=time.time())
    first = adapter_for(cluster, grace_seconds=30, clock=clock)
    drain = request(RemediationStep.DRAIN, cluster.host, "fp1/drain", mode="evict")
    ref = asyncio.run(first.submit(drain))
    assert asyncio.run(first.submit(drain)) == ref  # same key, same instance: nothing new
    commands = list(first.commands)
    assert any("State=DRAIN" in c for c in commands)
    assert any("--signal=USR1 --batch" in c for c in commands)

    cluster.wait(lambda: signals.exists() and signals.read_text().strip(), what="USR1 trapped")
    status = asyncio.run(first.status(ref))
    assert status.phase == ActionPhase.RUNNING
    assert "grace period" in status.message
    assert running(cluster, job)  # signalled, not yet requeued

    # fail-over: a fresh instance re-submits the same key and must do nothing twice
    second = adapter_for(cluster, grace_seconds=30, clock=clock)
    ref2 = asyncio.run(second.submit(drain))
    assert not second.commands
    clock.advance(31)
    status = poll(second, ref2)
    assert status.phase == ActionPhase.SUCCEEDED, status
    assert sum("requeue" in c for c in second.commands) == 1
    assert asyncio.run(first.status(ref)).phase == ActionPhase.SUCCEEDED
    assert not any("requeue" in c for c in first.commands)

    shown = cluster.job(job)
    assert shown["JobState"] == "PENDING"
    assert shown["Restarts"] == "1"
    assert f"gpuhealth:{key_hash('fp1/drain')}:signal@{cluster.host}:" in shown["AdminComment"]
    assert len(signals.read_text().splitlines()) == 1
    out = (cluster.folder / f"job-{job}.out").read_text()
    assert "DUE TO JOB REQUEUE" in out
    assert cluster.sinfo_state(cluster.host) == "drained"
    # Not checked here: the requeued job running again on this same node. slurmd refuses
    # to launch a job it killed moments ago ("Job N already killed, do not launch batch
    # job", the job then FAILS with exit 1:0); in production it runs elsewhere once its
    # BeginTime (~120 s) has passed.


def test_unrequeueable_job_is_left_and_reported(cluster: SlurmCluster) -> None:
    job = cluster.sbatch("#!/bin/bash\nwhile true; do sleep 0.1; done\n", "--no-requeue")
    cluster.wait(lambda: running(cluster, job), what=f"job {job} running")
    adapter = adapter_for(cluster, checkpoint_signal=None, json_output=False)
    ref = asyncio.run(adapter.submit(request(RemediationStep.DRAIN, cluster.host, "fp2/drain",
                                             mode="evict")))
    status = asyncio.run(adapter.status(ref))
    assert status.phase == ActionPhase.RUNNING
    assert f"left job {job} running" in status.message
    assert running(cluster, job)


def test_job_killed_by_the_signal_is_requeued_all_the_same(cluster: SlurmCluster) -> None:
    job = cluster.sbatch("#!/bin/bash\nwhile true; do sleep 0.1; done\n", "--requeue")
    cluster.wait(lambda: running(cluster, job), what=f"job {job} running")
    adapter = adapter_for(cluster, clock=FakeClock(now=time.time()), json_output=False)
    ref = asyncio.run(adapter.submit(request(RemediationStep.DRAIN, cluster.host, "fp8/drain",
                                             mode="evict")))
    # bash does not trap USR1 here: the batch shell dies of it (exit 0:10)
    cluster.wait(lambda: cluster.job(job)["JobState"] == "FAILED", what="job died of USR1")
    status = poll(adapter, ref)
    assert status.phase == ActionPhase.SUCCEEDED, status
    assert "ended after the signal" in status.message
    shown = cluster.job(job)
    assert shown["JobState"] == "PENDING"
    assert shown["Restarts"] == "1"
    assert sum("requeue" in c for c in adapter.commands) == 1


def test_allow_completion_waits_for_the_job(cluster: SlurmCluster) -> None:
    job = cluster.sbatch("#!/bin/bash\nsleep 2\n", "--requeue")
    cluster.wait(lambda: running(cluster, job), what=f"job {job} running")
    adapter = adapter_for(cluster)
    ref = asyncio.run(adapter.submit(request(
        RemediationStep.DRAIN, cluster.host, "fp3/drain", when="next_safe_point",
        mode="allow_completion")))
    status = asyncio.run(adapter.status(ref))
    assert status.phase == ActionPhase.RUNNING
    assert job in status.message
    assert cluster.sinfo_state(cluster.host) == "draining"
    status = poll(adapter, ref, timeout=20)
    assert status.phase == ActionPhase.SUCCEEDED, status
    shown = cluster.job(job)
    assert shown["JobState"] == "COMPLETED"
    assert shown["Restarts"] == "0"
    assert not any("requeue" in c or "scancel" in c for c in adapter.commands)


def test_simulated_reboot_completes_and_is_recorded(cluster: SlurmCluster) -> None:
    before = len(cluster.reboot_requests())
    adapter = adapter_for(cluster)
    host = NodeName(cluster.host)
    boot_before = asyncio.run(adapter.node_state(host)).boot_id
    asyncio.run(adapter.submit(request(RemediationStep.CORDON, host, "fp4/cordon")))
    reboot = request(RemediationStep.REBOOT, host, "fp4/reboot")
    ref = asyncio.run(adapter.submit(reboot))
    status = poll(adapter, ref, timeout=90)
    assert status.phase == ActionPhase.SUCCEEDED, status
    assert len(cluster.reboot_requests()) == before + 1
    state = asyncio.run(adapter.node_state(host))
    assert state.boot_id != boot_before
    assert state.schedulable
    # a fresh instance re-submitting after the reboot does not reboot again
    fresh = adapter_for(cluster)
    ref2 = asyncio.run(fresh.submit(reboot))
    assert not any(" reboot " in c for c in fresh.commands)
    assert asyncio.run(fresh.status(ref2)).phase == ActionPhase.SUCCEEDED
    time.sleep(0.5)
    assert len(cluster.reboot_requests()) == before + 1


def test_reboot_nextstate_down_keeps_the_node_out_until_resume(cluster: SlurmCluster) -> None:
    adapter = adapter_for(cluster, reboot_nextstate="DOWN")
    host = NodeName(cluster.host)
    asyncio.run(adapter.submit(request(RemediationStep.CORDON, host, "fp9/cordon")))
    ref = asyncio.run(adapter.submit(request(RemediationStep.REBOOT, host, "fp9/reboot")))
    status = poll(adapter, ref, timeout=90)
    assert status.phase == ActionPhase.SUCCEEDED, status
    state = asyncio.run(adapter.node_state(host))
    assert not state.schedulable  # DOWN through the probation period
    assert state.owned
    assert state.reason.endswith("reboot complete")
    ref = asyncio.run(adapter.submit(request(RemediationStep.RESUME, host, "fp9/resume")))
    assert asyncio.run(adapter.status(ref)).phase == ActionPhase.SUCCEEDED
    assert asyncio.run(adapter.node_state(host)).schedulable


def test_human_drain_is_never_resumed(cluster: SlurmCluster) -> None:
    node = "gpu020"
    cluster.run("scontrol", "update", f"NodeName={node}", "State=DRAIN",
                "Reason=maintenance: fan replacement")
    adapter = adapter_for(cluster)
    state = asyncio.run(adapter.node_state(NodeName(node)))
    assert not state.schedulable
    assert not state.owned
    ref = asyncio.run(adapter.submit(request(RemediationStep.RESUME, node, "fp5/resume")))
    status = asyncio.run(adapter.status(ref))
    assert status.phase == ActionPhase.FAILED
    assert "never undone" in status.message
    assert cluster.node(node)["Reason"] == "maintenance: fan replacement"
    # a gpuhealth cordon on it keeps the human's reason and does not claim the node
    ref = asyncio.run(adapter.submit(request(RemediationStep.CORDON, node, "fp5/cordon")))
    assert "someone else" in asyncio.run(adapter.status(ref)).message
    assert cluster.node(node)["Reason"] == "maintenance: fan replacement"
    assert not any("update" in c for c in adapter.commands)
    cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)


def test_human_resume_in_between_shows_as_not_owned(cluster: SlurmCluster) -> None:
    node = NodeName("gpu021")
    adapter = adapter_for(cluster)
    ref = asyncio.run(adapter.submit(request(RemediationStep.CORDON, node, "fp6/cordon")))
    assert asyncio.run(adapter.node_state(node)).owned
    cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
    state = asyncio.run(adapter.node_state(node))
    assert state.schedulable
    assert not state.owned
    assert asyncio.run(adapter.status(ref)).phase == ActionPhase.CANCELLED
    # the incident's next steps (taken_out) leave the resumed node in service
    for step in (RemediationStep.DRAIN, RemediationStep.REBOOT, RemediationStep.HAND_OFF):
        with pytest.raises(ReturnedToService, match="no longer drained"):
            asyncio.run(adapter.submit(request(step, node, f"fp6/{step.value}",
                                               taken_out="yes")))
    assert "DRAIN" not in cluster.node(node)["State"]
    assert "REBOOT" not in cluster.node(node)["State"]
    cluster.run("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=ops: rma")
    state = asyncio.run(adapter.node_state(node))
    assert not state.schedulable
    assert not state.owned
    assert state.reason == "ops: rma"
    cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)


def test_hand_off_and_restart(cluster: SlurmCluster) -> None:
    adapter = adapter_for(cluster)
    node = "gpu022"
    ref = asyncio.run(adapter.submit(request(RemediationStep.HAND_OFF, node, "fp7/hand_off",
                                             reason="gpuhealth: GpuXid79 on GPU 3")))
    assert asyncio.run(adapter.status(ref)).phase == ActionPhase.SUCCEEDED
    assert cluster.node(node)["Reason"] == ("gpuhealth: hand-off to hardware service: "
                                            "GpuXid79 on GPU 3")
    cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)

    first = cluster.sbatch("#!/bin/bash\nwhile true; do sleep 0.1; done\n", "--requeue")
    second = cluster.sbatch("#!/bin/bash\nwhile true; do sleep 0.1; done\n", "--requeue")
    cluster.wait(lambda: running(cluster, first) and running(cluster, second),
                 what="jobs running")
    restart = request(RemediationStep.RESTART, cluster.host, "fp7/restart", job_id=first)
    ref = asyncio.run(adapter.submit(restart))
    assert asyncio.run(adapter.status(ref)).phase == ActionPhase.SUCCEEDED
    cluster.wait(lambda: cluster.job(first)["JobState"] == "PENDING", what="requeued")
    assert f"gpuhealth:{key_hash('fp7/restart')}:requeue@" in cluster.job(first)["AdminComment"]
    assert running(cluster, second)  # only the job named in attrs
    # fail-over: a fresh instance re-submits while a job carrying this key's requeue mark
    # runs on the node again (as after its restart): it is not requeued twice
    key = key_hash("fp7/restart-all")
    cluster.run("scontrol", "update", f"JobId={second}",
                f"AdminComment=gpuhealth:{key}:requeue@{cluster.host}:1796000000.000")
    fresh = adapter_for(cluster)
    ref = asyncio.run(fresh.submit(request(RemediationStep.RESTART, cluster.host,
                                           "fp7/restart-all")))
    assert not any("requeue" in c for c in fresh.commands)
    assert running(cluster, second)
    assert asyncio.run(fresh.status(ref)).phase == ActionPhase.SUCCEEDED


def test_weight_and_opt_out(cluster: SlurmCluster) -> None:
    adapter = adapter_for(cluster)
    node = NodeName("gpu030")
    for score, weight in ((0.0, "100"), (1.0, "1"), (0.5, "51")):
        asyncio.run(adapter.set_reliability(node, score))
        assert cluster.node(node)["Weight"] == weight
    ran = len(adapter.commands)
    asyncio.run(adapter.set_reliability(node, 0.5))
    assert len(adapter.commands) == ran  # unchanged: nothing run
    assert asyncio.run(adapter.node_state(NodeName(cluster.opt_out_node))).opted_out
    assert not asyncio.run(adapter.node_state(node)).opted_out


def test_fifty_slurmd_less_nodes_drained_and_resumed(cluster: SlurmCluster) -> None:
    adapter = adapter_for(cluster)
    nodes = cluster.fake_nodes[40:90]

    async def burst(step: RemediationStep) -> list[ActionPhase]:
        refs = await asyncio.gather(*(adapter.submit(request(step, n, f"{n}/{step.value}"))
                                      for n in nodes))
        return [(await adapter.status(r)).phase for r in refs]

    started = time.monotonic()
    assert set(asyncio.run(burst(RemediationStep.CORDON))) == {ActionPhase.SUCCEEDED}
    drained = time.monotonic() - started
    listed = cluster.run("sinfo", "-h", "-N", "-t", "drain", "-o", "%N").stdout.split()
    assert set(nodes) <= set(listed)
    started = time.monotonic()
    assert set(asyncio.run(burst(RemediationStep.RESUME))) == {ActionPhase.SUCCEEDED}
    resumed = time.monotonic() - started
    listed = cluster.run("sinfo", "-h", "-N", "-t", "drain", "-o", "%N").stdout.split()
    assert not set(nodes) & set(listed)
    logger.info("50 slurmd-less nodes: drained in %.2f s, resumed in %.2f s", drained, resumed)
    assert drained < 30
    assert resumed < 30


@pytest.mark.parametrize("json_output", [True, False], ids=["json", "text"])
def test_unknown_node(cluster: SlurmCluster, json_output: bool) -> None:
    adapter = adapter_for(cluster, json_output=json_output)
    with pytest.raises(NodeNotFound):
        asyncio.run(adapter.submit(request(RemediationStep.CORDON, "nosuch", "x/cordon")))
    assert asyncio.run(adapter.node_state(NodeName("nosuch"))).exists is False


def test_controller_unreachable(slurm: SlurmCluster, tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    text = slurm.conf.read_text().replace(f"SlurmctldPort={slurm.ctld_port}",
                                          f"SlurmctldPort={slurm.ctld_port + 1}")
    conf.write_text(text.replace("MessageTimeout=5", "MessageTimeout=2"))
    shutil.copy(slurm.folder / "gres.conf", tmp_path / "gres.conf")
    for json_output in (True, False):
        adapter = SlurmScheduler(env={"SLURM_CONF": str(conf)}, json_output=json_output)
        with pytest.raises(SchedulerUnavailable, match=r"contact slurm controller|errors"):
            asyncio.run(adapter.node_state(NodeName(slurm.host)))
    adapter = SlurmScheduler(env={"SLURM_CONF": str(conf)}, command_timeout_seconds=0.3)
    with pytest.raises(SchedulerUnavailable, match="timed out"):
        asyncio.run(adapter.submit(request(RemediationStep.CORDON, slurm.host, "y/cordon")))


def test_dry_run_changes_nothing(cluster: SlurmCluster) -> None:
    adapter = adapter_for(cluster)
    ref = asyncio.run(adapter.submit(request(RemediationStep.DRAIN, cluster.host, "z/drain",
                                             dry_run=True, mode="evict")))
    status = asyncio.run(adapter.status(ref))
    assert status.phase == ActionPhase.SUCCEEDED
    assert "dry run" in status.message
    assert not adapter.commands
    assert cluster.sinfo_state(cluster.host) == "idle"


def fake_scontrol(tmp_path: Path, node_line: str) -> str:
    """A stand-in ``scontrol`` that prints one recorded ``show node -o`` line."""
    (tmp_path / "node.txt").write_text(node_line)
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'node.txt'}\n")
    script.chmod(0o755)
    return str(script)


REBOOT_LINE = NODE_REBOOT_REQUESTED.replace("BootTime=None", "BootTime=2026-11-30T07:55:09")


@pytest.mark.parametrize(("state", "reason", "boot", "phase", "words"), [
    ("UNKNOWN+DRAIN+REBOOT_REQUESTED+NOT_RESPONDING", "gpuhealth: r99", "100",
     ActionPhase.RUNNING, "waiting for the node to become idle"),
    ("DOWN+DRAIN+REBOOT_ISSUED", "gpuhealth: r99 : reboot issued", "100",
     ActionPhase.RUNNING, "waiting for slurmd"),
    ("DOWN+DRAIN", "gpuhealth: r99 : reboot timed out", "100", ActionPhase.FAILED,
     "timed out"),
    ("DOWN+NOT_RESPONDING", "Not responding", "", ActionPhase.FAILED,
     "went DOWN without rebooting"),
    ("DOWN", "Node unexpectedly rebooted", "100", ActionPhase.FAILED, "set it DOWN"),
    ("DOWN+DRAIN", "gpuhealth: r99 : reboot complete", "100", ActionPhase.SUCCEEDED,
     "rebooted"),
    ("IDLE", "", "100", ActionPhase.SUCCEEDED, "rebooted"),
    ("IDLE+DRAIN", "gpuhealth: r99", "", ActionPhase.CANCELLED, "cancelled"),
])
def test_reboot_status_from_recorded_states(tmp_path: Path, state: str, reason: str, boot: str,
                                            phase: ActionPhase, words: str) -> None:
    line = REBOOT_LINE.replace("State=UNKNOWN+DRAIN+REBOOT_REQUESTED+NOT_RESPONDING",
                               f"State={state}")
    line = line.replace("Reason=gpuhealth: r99", f"Reason={reason}")
    if not boot:  # BootTime unchanged since the request
        boot = str(parse_scontrol_node(line).boot_time)
    adapter = SlurmScheduler(scontrol_path=fake_scontrol(tmp_path, line), json_output=False)
    status = asyncio.run(adapter.status(f"slurm/reboot/gpu099/0123456789ab?boot={boot}"))
    assert status.phase == phase, status
    assert words in status.message
