"""``gpuhealth run`` keeps the incident history the weekly report reads: a report of what
happened on the machine (an Xid 79, its cordon, drain, reboot and resume) makes sense."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

from core.clock import FakeClock
from core.records import EntityId, NodeName, Sample
from gpuhealth.cli import main
from gpuhealth.history_sync import HistoryRecorder
from gpuhealth.pipeline import Pipeline
from storage.history import IncidentHistory
from tests.fake_scheduler import FakeCluster, FakeNode, FakeScheduler
from tests.unit.test_engine import run, xid79


def test_incidents_and_inventory_reach_the_history_and_the_report(tmp_path):
    now = time.time() - 3600
    clock = FakeClock(now=now)
    cluster = FakeCluster(nodes={"n001": FakeNode(), "n002": FakeNode()})
    p = Pipeline(facts={}, notifiers=[], audit_log_path=None, dry_run=False,
                 scheduler=FakeScheduler(cluster), clock=clock, rules=[], cluster_size=2,
                 max_disrupted_fraction=1.0, engine_options={"probation_seconds": 600.0})
    history = IncidentHistory(tmp_path / "history.sqlite")
    recorder = HistoryRecorder(history)
    recorder.observe([Sample(metric="gpu_info", value=1.0, observed_at=now,
                             node=NodeName("n001"), entity=EntityId("GPU-1"),
                             labels={"model": "NVIDIA H100 80GB HBM3", "driver_version": "550.54",
                                     "vbios_version": "96.00.99", "pci_bus_id": "0000:b1:00.0"})])
    p.observe_findings([xid79("n001", at=now)], hold_seconds=1e6)
    p.evaluate()
    run(p, 5, clock)
    recorder.sync(p.actions, clock())
    clock.advance(700)
    run(p, 3, clock)  # probation over: resumed
    recorder.sync(p.actions, clock())
    frame = history.incidents()
    assert len(frame) == 1
    row = frame.iloc[0]
    assert row["kind"] == "xid"
    assert row["code"] == "79"
    assert row["model"] == "NVIDIA H100 80GB HBM3"
    assert row["out_of_service_at"] is not None
    assert row["resolved_at"] >= row["out_of_service_at"]
    assert "reboot" in row["actions"]
    assert len(history.inventory()) == 1
    history.close()
    out = CliRunner().invoke(main, ["report", "--since", "7d", "--format", "json",
                                    "--history", str(tmp_path / "history.sqlite")])
    assert out.exit_code == 0, out.output
    body = json.loads(out.output)
    assert "xid" in json.dumps(body)
