"""Slurm's priorities in gpuhealth (#16 item 10), with stand-in ``squeue``/``scontrol`` scripts.

``squeue`` output carries each job's priority, QOS, start time and allocated GPUs (the
OpenAPI v0.0.38 and v0.0.40 forms, and the ``-O`` text fall-back); an evicting drain
requeues the node's jobs the highest priority first; a preemption is an
``scontrol requeue`` of the victim.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from core.errors import PermanentError
from core.records import NodeName
from remediation.priority import PriorityScheduler, WorkItem
from remediation.slurm import SlurmScheduler, gpus_of_tres, parse_squeue_json, parse_squeue_text

START = 1796000000


def squeue_json(plugin: str) -> str:
    def num(v: int) -> object:
        return v if plugin == "v0.0.38" else {"set": True, "infinite": False, "number": v}

    jobs = [
        {"job_id": 7, "job_state": "RUNNING" if plugin == "v0.0.38" else ["RUNNING"],
         "nodes": "gpu[01-02]", "requeue": True, "batch_flag": True, "restart_cnt": 0,
         "priority": num(4294901000), "qos": "high", "start_time": num(START),
         "tres_alloc_str": "cpu=16,mem=64G,node=2,billing=16,gres/gpu=8",
         "user_name": "alice", "partition": "train"},
        {"job_id": 8, "job_state": "PENDING", "nodes": "", "requeue": True,
         "batch_flag": True, "priority": num(10), "qos": "scavenger",
         "start_time": num(START + 99), "tres_alloc_str": ""},
    ]
    return json.dumps({"meta": {"plugin": {"type": f"openapi/{plugin}"}}, "errors": [],
                       "jobs": jobs})


@pytest.mark.parametrize("plugin", ["v0.0.38", "v0.0.40"])
def test_squeue_json_priority_qos_start_and_gpus(plugin: str) -> None:
    running, pending = parse_squeue_json(squeue_json(plugin))
    assert (running.priority, running.qos, running.started_at, running.gpus) == (
        4294901000, "high", float(START), 8)
    assert running.nodes == ("gpu01", "gpu02")
    assert (pending.priority, pending.qos, pending.started_at, pending.gpus) == (
        10, "scavenger", None, 0)  # a pending job's start_time is an estimate: not kept


def test_squeue_text_priority_qos_start_and_gpus() -> None:
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(START))
    line = (f"7|RUNNING|1|1|0|alice|train|900|high|{start}|cpu=4,node=1,gres/gpu=2|\n"
            "8|RUNNING|1|1|0|bob|train|\n")  # an older layout without the new fields
    new, old = parse_squeue_text(line, "gpu01")
    assert (new.priority, new.qos, new.started_at, new.gpus) == (900, "high", float(START), 2)
    assert (old.priority, old.qos, old.started_at, old.gpus) == (0, "", None, 0)
    assert gpus_of_tres("cpu=1,gres/gpu:h100=3") == 3


def fake_slurm(tmp_path: Path, squeue_text: str) -> SlurmScheduler:
    """Stand-in binaries: ``squeue`` prints the jobs until a requeue removes one from the
    node; ``scontrol`` logs every call."""
    (tmp_path / "jobs.txt").write_text(squeue_text)
    log = tmp_path / "calls.log"
    squeue = tmp_path / "squeue"
    squeue.write_text(f"#!/bin/sh\ncat {tmp_path / 'jobs.txt'}\n")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'if [ "$1" = requeue ]; then\n'
        f"  grep -v \"^$2|\" {tmp_path / 'jobs.txt'} > {tmp_path / 'jobs.new'}\n"
        f"  mv {tmp_path / 'jobs.new'} {tmp_path / 'jobs.txt'}\n"
        "fi\n")
    for script in (squeue, scontrol):
        script.chmod(0o755)
    return SlurmScheduler(scontrol_path=str(scontrol), squeue_path=str(squeue),
                          json_output=False, checkpoint_signal=None)


def line(job: str, priority: int, qos: str, gpus: int) -> str:
    return f"{job}|RUNNING|1|1|0|alice|train|{priority}|{qos}|N/A|node=1,gres/gpu={gpus}|\n"


def test_an_evicting_drain_requeues_the_highest_priority_first(tmp_path: Path) -> None:
    adapter = fake_slurm(tmp_path, line("21", 10, "scavenger", 1) + line("22", 5000, "critical",
                                                                        4)
                         + line("23", 700, "normal", 2))
    jobs, said = asyncio.run(adapter._evict("gpu01", "0123456789ab"))
    requeues = [c.split()[1] for c in (tmp_path / "calls.log").read_text().splitlines()
                if c.startswith("requeue")]
    assert requeues == ["22", "23", "21"]
    assert jobs == []
    assert said.index("requeued job 22") < said.index("requeued job 21")


def test_work_detail_and_preempt(tmp_path: Path) -> None:
    adapter = fake_slurm(tmp_path, line("31", 900, "high", 4))
    assert isinstance(adapter, PriorityScheduler)
    (item,) = asyncio.run(adapter.work_detail(NodeName("gpu01")))
    assert (item.id, item.priority, item.priority_class, item.gpus, item.node) == (
        "31", 900, "high", 4, "gpu01")
    done = asyncio.run(adapter.preempt(item, reason="gpuhealth: for job 9"))
    assert done.startswith("requeued job 31")
    assert "requeue 31" in (tmp_path / "calls.log").read_text()
    with pytest.raises(PermanentError):
        asyncio.run(adapter.preempt(WorkItem(kind="pod", id="a/b"), reason="x"))


def test_gpus_without_accounting_come_from_the_gres() -> None:
    # Slurm 22.05 without AccountingStorageTRES=gres/gpu: no gres/gpu in the TRES
    data = json.loads(squeue_json("v0.0.38"))
    data["jobs"][0].update(tres_alloc_str="cpu=1,node=2,billing=1",
                           gres_detail=["gpu:2(IDX:0-1)", "gpu:a100:2(IDX:2-3)"])
    (job, _) = parse_squeue_json(json.dumps(data))
    assert job.gpus == 4
    data["jobs"][0].update(gres_detail=[], tres_per_node="gres:gpu:3")
    (job, _) = parse_squeue_json(json.dumps(data))
    assert job.gpus == 6  # 3 per node on 2 nodes
    (text_job,) = parse_squeue_text("9|RUNNING|1|1|0|a|p|5|(null)|N/A|cpu=1,node=1|gres:gpu:2|",
                                    "gpu01")
    assert (text_job.gpus, text_job.qos, text_job.started_at) == (2, "", None)
