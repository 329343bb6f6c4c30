"""The #16 drill on a real Slurm 22.05 (slurmctld, slurmd, munge): Xid 79 under a running job.

The pipeline is the one ``gpuhealth run`` builds (:func:`gpuhealth.compose.service_pipeline`
from a TOML file: the Slurm adapter, work attribution, the local validator, the local
bundle collector), and the Xid 79 comes in through the real path: a kernel-log line read
by :class:`collectors.kernel_log.KernelLogCollector` following a file. Then:

1. the alert names the Slurm job ``squeue`` shows running on the node;
2. the node is drained (``scontrol show node``: DRAIN, reason ``gpuhealth: ...``) and the
   job requeued;
3. a diagnostic bundle is collected before the reboot;
4. the reboot is requested through ``scontrol reboot ASAP nextstate=DOWN`` (the test
   cluster's RebootProgram records it and restarts slurmd with ``-b``, a simulated
   successful reboot);
5. validation runs (``dcgmi diag``: a stand-in script printing DCGM's table) and, in the
   first run, fails: the node is handed to hardware service with the evidence (a bundle
   again first) and stays drained with the hand-off reason, never resumed;
6. in a second run (the node back from service, the same fault again) the validation
   passes and, after probation, the node is resumed and idle.

The NVML state check is left out of ``checks``: there is no GPU on this machine (it is
covered with a fake NVML in tests/unit/test_fix_validation.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collectors.kernel_log import KernelLogCollector
from core.records import Alert, RemediationStep
from gpuhealth.compose import service_pipeline
from gpuhealth.config import load_settings
from gpuhealth.pipeline import Pipeline
from remediation.slurm import HAND_OFF_PREFIX
from tests.slurm_server import SlurmCluster, slurm  # noqa: F401 - fixture

XID79 = ("NVRM: Xid (PCI:0000:b1:00): 79, pid='<unknown>', name=<unknown>, "
         "GPU has fallen off the bus.\n")
JOB = "#!/bin/bash\ntrap 'echo got USR1' USR1\nfor i in $(seq 600); do sleep 1; done\n"

DCGMI = """#!/bin/sh
# dcgmi stand-in: DCGM's diag table; fails while {flag} exists
if [ -e {flag} ]; then
  printf '+---------------------------+------------------------------------------------+\\n'
  printf '| Diagnostic                | Result                                         |\\n'
  printf '| Memory                    | Fail - GPU 0: DBE error detected (drill)       |\\n'
  exit 226
fi
printf '| Diagnostic                | Result                                         |\\n'
printf '| Memory                    | Pass                                           |\\n'
exit 0
"""


def _config(tmp: Path, cluster: SlurmCluster, dcgmi: Path) -> Path:
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
dry_run = false
scheduler = "slurm"
cluster_size = 10
max_disrupted_fraction = 1.0
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
""")
    return path


def _dcgmi(tmp: Path) -> tuple[Path, Path]:
    flag = tmp / "dcgm-fails"
    script = tmp / "dcgmi"
    script.write_text(DCGMI.format(flag=flag))
    script.chmod(0o755)
    return script, flag


def _inject(tmp: Path, node: str) -> list[Any]:
    """The Xid 79 line, read by the live kernel-log collector as ``gpuhealth run`` reads it."""
    log = tmp / "kern.log"
    log.write_text(XID79)
    collector = KernelLogCollector(node=node, path=str(log), source="file", from_start=True)
    try:
        event = next(iter(collector.stream()))
    finally:
        collector.close()
    assert (event.kind, event.code) == ("xid", "79")
    return [event]


def _drive(p: Pipeline, loop: asyncio.AbstractEventLoop, done: Callable[[], bool], *,
           timeout: float, alerts: list[Alert],
           seen: Callable[[], None] = lambda: None) -> None:
    """Evaluate every second and tick the engine every 0.2 s (as the service does)."""
    deadline = time.monotonic() + timeout
    evaluated = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - evaluated >= 1.0:
            alerts.extend(loop.run_until_complete(p.aevaluate()).alerts)
            evaluated = time.monotonic()
        loop.run_until_complete(p.atick())
        seen()
        if done():
            return
        time.sleep(0.2)
    raise AssertionError("drill did not get there in time: " + "; ".join(
        f"{a.step.value} {a.phase.value} {a.message}" for a in p.actions.actions()))


def _steps(p: Pipeline) -> list[tuple[str, str]]:
    return [(a.step.value, a.phase.value) for a in p.actions.actions()]


def _audit(tmp: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp / "data" / "audit.jsonl").read_text().splitlines()]


def _running_job(cluster: SlurmCluster) -> str:
    job = cluster.sbatch(JOB, "--requeue", "--gres=gpu:1")
    cluster.wait(lambda: cluster.job(job).get("JobState") == "RUNNING", 30, "job running")
    running = cluster.run("squeue", "-h", "-w", cluster.host, "-t", "R", "-o", "%i").stdout
    assert job in running.split()
    return job


def _named(alerts: list[Alert], cluster: SlurmCluster, job: str) -> Alert:
    expected = f"work on {cluster.host} when it happened: slurm job {job} (root, partition debug)"
    xid = [a for a in alerts if a.labels.get("kind") == "xid" and a.labels.get("code") == "79"]
    assert xid, [a.labels for a in alerts]
    assert expected in xid[0].annotations["evidence"], xid[0].annotations
    return xid[0]


def test_drill_xid79_job_named_drain_bundle_reboot_validation_fails_then_passes(
        slurm, tmp_path):  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    dcgmi, flag = _dcgmi(tmp_path)
    flag.touch()  # the first validation fails

    # ---- first run: validation fails -> hand-off to hardware service
    first = tmp_path / "first"
    first.mkdir()
    settings = load_settings(_config(first, cluster, dcgmi))
    job = _running_job(cluster)
    reboots = len(cluster.reboot_requests())
    p = service_pipeline(settings, identity="drill", is_leader=lambda: True)
    loop = asyncio.new_event_loop()
    alerts: list[Alert] = []
    try:
        states: list[tuple[str, str]] = []

        def seen() -> None:  # what scontrol show node says along the way
            node = cluster.node(cluster.host)
            if not states or states[-1] != (node["State"], node["Reason"]):
                states.append((node["State"], node["Reason"]))

        p.observe(_inject(first, cluster.host))
        _drive(p, loop, lambda: ("hand_off", "succeeded") in _steps(p), timeout=90,
               alerts=alerts, seen=seen)
        _named(alerts, cluster, job)
        drained = [(s, r) for s, r in states if "DRAIN" in s]
        assert drained, states
        assert drained[0][1].startswith("gpuhealth: GpuXid79 critical"), states
        assert any("REBOOT" in s for s, _ in states), states  # the reboot Slurm carried out
        steps = [s for s, _ in _steps(p)]
        assert steps[:3] == ["cordon", "drain", "reboot"], _steps(p)
        assert steps[-1] == "hand_off"
        assert "resume" not in steps
        node = cluster.node(cluster.host)
        assert "DRAIN" in node["State"], node
        assert node["Reason"].startswith(HAND_OFF_PREFIX), node
        assert "GpuXid79" in node["Reason"]  # the evidence is in the hand-off (below)
        assert len(cluster.reboot_requests()) == reboots + 1
        info = cluster.job(job)  # signalled and requeued off the node
        assert info.get("Restarts") == "1" or info.get("JobState") in ("PENDING",
                                                                        "REQUEUED"), info
        records = _audit(first)
        decisions = [r["decision"] for r in records]
        assert decisions.index("validating") < decisions.index("validation_failed")
        failed = next(r for r in records if r["decision"] == "validation_failed")
        assert "DBE error detected (drill)" in failed["reason"]
        assert any(r["decision"] == "escalated" and "hand-off to hardware service"
                   in r["reason"] for r in records)
        order = [(r["decision"], r["step"] or "") for r in records]
        for step in ("reboot", "hand_off"):  # a bundle before each destructive step
            assert order.index(("bundle", step)) < order.index(("submitted", step)), order
        bundles = [r["details"]["bundle"] for r in records if r["decision"] == "bundle"]
        assert bundles
        assert all(Path(b).is_file() and b.endswith(".tar.gz") for b in bundles)
        hand_off = next(a for a in p.actions.actions() if a.step == RemediationStep.HAND_OFF)
        assert "DBE error detected" in hand_off.attrs["evidence"]
        (incident,) = p.actions.incidents()
        assert incident.state == "open"
        assert incident.note.startswith("validation failed")
        # probation is long over: a handed-off node is resumed by a human, not by gpuhealth
        time.sleep(2.5)
        for _ in range(5):
            loop.run_until_complete(p.aevaluate())
            loop.run_until_complete(p.atick())
        assert "resume" not in [s for s, _ in _steps(p)]
        assert cluster.node(cluster.host)["Reason"].startswith(HAND_OFF_PREFIX)
    finally:
        loop.run_until_complete(p.aclose())
        loop.close()
        p.close()
        cluster.run("scancel", job, check=False)

    # ---- second run: back from service, the same fault; validation passes -> resumed
    cluster.reset_host()
    flag.unlink()
    second = tmp_path / "second"
    second.mkdir()
    settings = load_settings(_config(second, cluster, dcgmi))
    job = _running_job(cluster)
    reboots = len(cluster.reboot_requests())
    p = service_pipeline(settings, identity="drill", is_leader=lambda: True)
    loop = asyncio.new_event_loop()
    alerts = []
    try:
        p.observe(_inject(second, cluster.host))
        _drive(p, loop, lambda: ("resume", "succeeded") in _steps(p), timeout=90,
               alerts=alerts)
        _named(alerts, cluster, job)
        steps = [s for s, _ in _steps(p)]
        assert steps == ["cordon", "drain", "reboot", "resume"], _steps(p)
        assert len(cluster.reboot_requests()) == reboots + 1
        records = _audit(second)
        decisions = [r["decision"] for r in records]
        assert "validation_failed" not in decisions
        assert decisions.index("validated") < max(
            i for i, r in enumerate(records) if r["step"] == "resume")
        cluster.wait(lambda: cluster.sinfo_state(cluster.host) == "idle", 30, "node idle")
        assert not cluster.node(cluster.host)["Reason"]
        (incident,) = p.actions.incidents()
        assert incident.state == "closed"  # validated, resumed, probation passed
        assert incident.note == "probation passed without recurrence"
    finally:
        loop.run_until_complete(p.aclose())
        loop.close()
        p.close()
        cluster.run("scancel", job, check=False)
        cluster.reset_host()
