"""Which work each fault hit (#16 item 8): the jobs on the node when the finding appeared.

Against real Slurm (slurmctld, slurmd, munge): a running job is named in the finding's
evidence and in the alert (job id, user, partition); the work recorded is that of the
moment of the fault, not of later.
"""

from __future__ import annotations

import asyncio

from core.errors import SchedulerUnavailable
from core.records import Action, EntityId, Evidence, Finding, NodeName, Severity, WorkRef
from gpuhealth.pipeline import Pipeline
from remediation.attribution import WorkAttribution
from remediation.slurm import SlurmScheduler
from tests.slurm_server import SlurmCluster, slurm  # noqa: F401 - fixture

JOB = "#!/bin/bash\nfor i in $(seq 600); do sleep 1; done\n"


def xid79(node: str) -> Finding:
    return Finding(node=NodeName(node), entity=EntityId("0000:b1:00.0"), kind="xid",
                   code="79", severity=Severity.CRITICAL, action=Action.REBOOT_NODE,
                   summary="GPU has fallen off the bus",
                   evidence=(Evidence(file="kern.log", line=3, text="NVRM: Xid 79"),),
                   source="t")


class Changing:
    """A locator whose answer changes, fails and hangs, as a scheduler's does."""

    def __init__(self) -> None:
        self.answer: list[WorkRef] | Exception | None = [WorkRef(kind="slurm_job", id="1")]

    async def work_on(self, node, entity=None):  # type: ignore[no-untyped-def]
        if self.answer is None:
            await asyncio.sleep(10)
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


class Counting(Changing):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    async def work_on(self, node, entity=None):  # type: ignore[no-untyped-def]
        self.asked.append(node)
        return await super().work_on(node, entity)


def test_warnings_are_not_asked_about_and_a_standby_asks_nothing() -> None:
    # benchmarks/fleet_sim.py: a fleet's warnings at production rates made one scheduler
    # query each, on both replicas, holding up every evaluation.
    locator = Counting()
    w = WorkAttribution(locator, timeout_seconds=0.2)  # type: ignore[arg-type]
    warning = Finding(node=NodeName("n1"), entity=EntityId("0000:b1:00.0"), kind="ecc",
                      code="sbe", severity=Severity.WARNING, action=Action.NONE,
                      summary="corrected ECC errors rising", evidence=(), source="t")
    (same,) = asyncio.run(w.apply([warning]))
    assert same == warning
    assert locator.asked == []
    leader = [False]
    p = Pipeline(facts={}, notifiers=[], rules=[], audit_log_path=None,
                 is_leader=lambda: leader[0],
                 notify_as_standby=False)
    p.attribution = w
    p.observe_findings([xid79("n2")], hold_seconds=60.0)
    p.evaluate()
    assert locator.asked == []  # the standby neither alerts nor decides
    leader[0] = True
    p.evaluate()
    assert locator.asked == ["n2"]


def test_the_work_of_the_moment_of_the_fault_is_kept() -> None:
    locator = Changing()
    w = WorkAttribution(locator, timeout_seconds=0.2)  # type: ignore[arg-type]
    (first,) = asyncio.run(w.apply([xid79("n1")]))
    assert first.evidence[0].text == "work on n1 when it happened: slurm job 1"
    locator.answer = [WorkRef(kind="slurm_job", id="2")]  # the next job on the node
    (again,) = asyncio.run(w.apply([xid79("n1")]))
    assert again.evidence[0].text.endswith("slurm job 1")
    locator.answer = SchedulerUnavailable("slurmctld down")
    (other,) = asyncio.run(w.apply([xid79("n2")]))
    assert other.evidence == xid79("n2").evidence  # nothing said, asked again next time
    locator.answer = None  # hangs past the timeout
    (late,) = asyncio.run(w.apply([xid79("n2")]))
    assert late.evidence == xid79("n2").evidence
    locator.answer = [WorkRef(kind="pod", id="ml/train-0", owner="ml", group="high")]
    (pod,) = asyncio.run(w.apply([xid79("n2")]))
    assert pod.evidence[0].text == "work on n2 when it happened: pod ml/train-0 (priority high)"


def test_a_running_slurm_job_is_named_in_the_alert(slurm) -> None:  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    job = cluster.sbatch(JOB, "--gres=gpu:1")
    cluster.wait(lambda: cluster.job(job).get("JobState") == "RUNNING", 30, "job running")
    try:
        scheduler = SlurmScheduler(env=cluster.env)
        (ref,) = asyncio.run(scheduler.work_on(NodeName(cluster.host)))
        assert (ref.kind, ref.id, ref.owner, ref.group) == ("slurm_job", job, "root", "debug")
        p = Pipeline(facts={}, notifiers=[], audit_log_path=None)
        p.attribution = WorkAttribution(scheduler)
        p.observe_findings([xid79(cluster.host)], hold_seconds=600)
        out = p.evaluate()
        (alert,) = out.alerts
        expected = (f"work on {cluster.host} when it happened: slurm job {job} "
                    "(root, partition debug)")
        assert expected in alert.annotations["evidence"]
        assert out.findings[0].evidence[0].text == expected
        p.close()
    finally:
        cluster.reset_host()
