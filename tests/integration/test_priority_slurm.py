"""Slurm's job priority, QOS, GPUs and start time as gpuhealth reads them (#16 item 10).

Against the real Slurm 22.05 (slurmctld, slurmd, munge): the ``squeue --json`` reading and
the ``squeue -O`` text fall-back (whose field names this checks) give the same work
items for a running GPU job.
"""

from __future__ import annotations

import asyncio

from core.records import NodeName
from remediation.slurm import SlurmScheduler
from tests.slurm_server import SlurmCluster, slurm  # noqa: F401 - fixture

JOB = "#!/bin/bash\nfor i in $(seq 600); do sleep 1; done\n"


def test_work_detail_names_priority_qos_gpus_and_start(slurm) -> None:  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    job = cluster.sbatch(JOB, "--gres=gpu:2")
    cluster.wait(lambda: cluster.job(job).get("JobState") == "RUNNING", 30, "job running")
    try:
        shown = cluster.job(job)
        items = {}
        for json_output in (True, False):
            adapter = SlurmScheduler(env=cluster.env, json_output=json_output)
            (item,) = asyncio.run(adapter.work_detail(NodeName(cluster.host)))
            items[json_output] = item
        assert items[True] == items[False]
        item = items[True]
        assert item.id == job
        assert item.gpus == 2
        assert item.priority == int(shown["Priority"])
        qos = shown.get("QOS", "")  # "(null)" on a cluster without accounting
        assert item.priority_class == ("" if qos == "(null)" else qos)
        assert item.started_at is not None
        running = asyncio.run(SlurmScheduler(env=cluster.env, json_output=False)
                              .running_work())
        assert [(w.id, w.node, w.gpus) for w in running] == [(job, cluster.host, 2)]
    finally:
        cluster.reset_host()
