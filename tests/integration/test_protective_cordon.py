"""The agent's opt-in protective cordon while no controller answers (as NHC drains its node).

The guards are checked with a recording adapter; the effect on real Slurm (slurmctld,
slurmd, munge from the Debian packages): the node is drained with a ``gpuhealth:`` reason
and running work is left to finish.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from core.errors import SchedulerUnavailable
from core.records import (
    Action,
    ActionRequest,
    EntityId,
    Finding,
    NodeName,
    RemediationStep,
    Severity,
)
from gpuhealth.compose import build_protective
from gpuhealth.config import load_settings
from remediation.audit import AuditLog, read_audit_log
from remediation.protective import ProtectiveCordon
from remediation.slurm import SlurmScheduler
from tests.slurm_server import SlurmCluster, slurm  # noqa: F401 - fixture


class Recording:
    name = "recording"

    def __init__(self, fail: int = 0) -> None:
        self.requests: list[ActionRequest] = []
        self.fail = fail

    async def submit(self, request: ActionRequest) -> str:
        if self.fail:
            self.fail -= 1
            raise SchedulerUnavailable("slurmctld not answering")
        self.requests.append(request)
        return "ref"

    async def status(self, ref: str):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def fault(node: str = "n1", severity: Severity = Severity.CRITICAL) -> Finding:
    return Finding(node=NodeName(node), entity=EntityId("GPU-1"), kind="xid", code="79",
                   severity=severity, action=Action.REBOOT_NODE,
                   summary="GPU has fallen off the bus", evidence=(), source="t")


def cordon(tmp_path: Path, adapter: object, **kw: object) -> ProtectiveCordon:
    return ProtectiveCordon(adapter=adapter, node="n1", after_seconds=300,  # type: ignore[arg-type]
                            audit=AuditLog(path=str(tmp_path / "audit.jsonl")),
                            clock=lambda: 1000.0, **kw)  # type: ignore[arg-type]


def test_cordons_once_per_outage_only_for_a_critical_fault_after_the_wait(tmp_path) -> None:
    adapter = Recording()
    c = cordon(tmp_path, adapter, dry_run=False)
    run = asyncio.run
    assert run(c.update([fault()], unreachable_since=None)) == []  # a controller answers
    assert run(c.update([fault()], unreachable_since=900.0)) == []  # not long enough
    assert run(c.update([fault(severity=Severity.MAJOR)], unreachable_since=600.0)) == []
    assert run(c.update([fault(node="n2")], unreachable_since=600.0)) == []  # not this node
    records = run(c.update([fault()], unreachable_since=600.0))
    assert [r.decision for r in records] == ["requested", "submitted"]
    (request,) = adapter.requests
    assert (request.step, request.node, request.dry_run) == (RemediationStep.CORDON, "n1", False)
    assert request.reason.startswith("gpuhealth: protective cordon, no controller for 7 min")
    assert read_audit_log(str(tmp_path / "audit.jsonl")) == records  # audited first
    assert run(c.update([fault()], unreachable_since=600.0)) == []  # once per outage


def test_opt_out_and_dry_run_are_respected(tmp_path) -> None:
    adapter = Recording()
    assert asyncio.run(cordon(tmp_path, adapter, opted_out=True).update(
        [fault()], unreachable_since=0.0)) == []
    records = asyncio.run(cordon(tmp_path, adapter).update([fault()], unreachable_since=0.0))
    assert [r.dry_run for r in records] == [True, True]  # dry-run is the default
    assert adapter.requests[0].dry_run


def test_a_failed_cordon_is_audited_and_tried_again(tmp_path) -> None:
    adapter = Recording(fail=1)
    c = cordon(tmp_path, adapter, dry_run=False)
    first = asyncio.run(c.update([fault()], unreachable_since=0.0))
    assert [r.decision for r in first] == ["requested", "failed"]
    again = asyncio.run(c.update([fault()], unreachable_since=0.0))
    assert [r.decision for r in again] == ["requested", "submitted"]


def test_off_unless_configured(tmp_path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f'[node]\ndata_dir = "{tmp_path}"\n')
    assert build_protective(load_settings(path)) is None
    path.write_text(f'[node]\nname = "n1"\ndata_dir = "{tmp_path}"\n'
                    '[agent]\nprotective_cordon = true\nprotective_cordon_after_seconds = 60\n')
    built = build_protective(load_settings(path))
    assert built is not None
    assert (built.after_seconds, built.dry_run) == (60.0, True)


def test_real_slurm_drains_the_node_with_a_gpuhealth_reason(slurm, tmp_path) -> None:  # noqa: F811
    cluster: SlurmCluster = slurm
    cluster.reset_host()
    adapter = SlurmScheduler(env=cluster.env)
    c = ProtectiveCordon(adapter=adapter, node=cluster.host, after_seconds=60,
                         audit=AuditLog(path=str(tmp_path / "audit.jsonl")), dry_run=False)
    records = asyncio.run(c.update([fault(node=cluster.host)], unreachable_since=0.0))
    assert [r.decision for r in records] == ["requested", "submitted"]
    node = cluster.node(cluster.host)
    assert "DRAIN" in node.get("State", "")
    assert node["Reason"].startswith("gpuhealth: protective cordon")
    cluster.reset_host()
