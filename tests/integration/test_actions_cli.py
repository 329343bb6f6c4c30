"""``gpuhealth actions``: a human approves, cancels and undoes while the engine runs."""

from __future__ import annotations

import asyncio
import json

from click.testing import CliRunner

from core.clock import FakeClock
from core.records import Severity
from gpuhealth.cli import main
from gpuhealth.pipeline import Pipeline
from remediation.audit import read_audit_log
from tests.fake_scheduler import FakeCluster, FakeNode, FakeScheduler
from tests.unit.test_engine import xid79


def test_list_approve_cancel_undo_breaker(tmp_path):
    data = tmp_path / "data"
    config = tmp_path / "c.toml"
    config.write_text(f'[node]\nname = "ctl"\ndata_dir = "{data}"\n')
    cluster = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    clock = FakeClock(now=1000.0)
    p = Pipeline(
        facts={}, notifiers=[], audit_log_path=str(data / "audit.jsonl"), dry_run=False,
        scheduler=FakeScheduler(cluster, drain_polls=100), clock=clock, rules=[],
        cluster_size=2, max_disrupted_fraction=1.0, action_store_path=str(data / "actions.db"),
        engine_options={"approval_min_severity": Severity.CRITICAL},
    )
    p.observe_findings([xid79("n1"), xid79("n2")], hold_seconds=1e6)
    p.evaluate()
    runner = CliRunner()
    out = runner.invoke(main, ["actions", "list", "--json", "--config", str(config)])
    assert out.exit_code == 0, out.output
    listed = json.loads(out.output)
    assert {a["phase"] for a in listed} == {"awaiting_approval"}
    cordon1 = next(a["id"] for a in listed if a["node"] == "n1" and a["step"] == "cordon")
    cordon2 = next(a["id"] for a in listed if a["node"] == "n2" and a["step"] == "cordon")
    out = runner.invoke(main, ["actions", "approve", str(cordon1), "--by", "alice",
                               "--config", str(config)])
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["actions", "cancel", str(cordon2), "--by", "bob",
                               "--config", str(config)])
    assert out.exit_code == 0, out.output
    asyncio.run(p.atick())
    assert cluster.history == [("cordon", "n1")]
    out = runner.invoke(main, ["actions", "approve", str(cordon1), "--config", str(config)])
    assert out.exit_code == 1
    assert "not awaiting approval" in out.output
    out = runner.invoke(main, ["actions", "undo", str(cordon1), "--by", "carol",
                               "--config", str(config)])
    assert out.exit_code == 0, out.output
    assert "nothing happens while none runs" in out.stderr
    asyncio.run(p.atick())
    assert ("resume", "n1") in cluster.history
    assert cluster.nodes["n1"].schedulable
    out = runner.invoke(main, ["actions", "show", str(cordon1), "--config", str(config)])
    assert "succeeded" in out.output
    out = runner.invoke(main, ["actions", "breaker", "reset", "--by", "dave",
                               "--config", str(config)])
    assert out.exit_code == 0
    out = runner.invoke(main, ["actions", "breaker", "--config", str(config)])
    assert "closed" in out.output
    actors = {r.actor for r in read_audit_log(str(data / "audit.jsonl"))}
    assert {"alice", "bob", "carol", "dave"} <= actors
    out = runner.invoke(main, ["actions", "show", "999", "--config", str(config)])
    assert out.exit_code == 1


def test_actions_audit_shows_the_trail_filtered(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json as _json

    from click.testing import CliRunner as _Runner

    from core.records import AuditRecord, EntityId, NodeName, RemediationStep
    from gpuhealth.cli import main as _main
    from remediation.actions import ActionStore
    from remediation.audit import AuditLog

    config = tmp_path / "g.toml"
    config.write_text(f'[node]\ndata_dir = "{tmp_path}"\n')
    ActionStore(tmp_path / "actions.db").close()
    log = AuditLog(path=str(tmp_path / "audit.jsonl"))
    for i, (node, decision) in enumerate([("n1", "requested"), ("n2", "held"),
                                          ("n1", "succeeded")]):
        log.append(AuditRecord(at=1_700_000_000.0 + i, actor="gpuhealth", decision=decision,
                               step=RemediationStep.CORDON, node=NodeName(node),
                               entity=EntityId("node"), reason=f"why {i}",
                               idempotency_key=f"fp/{i}", dry_run=True))
    out = _Runner().invoke(_main, ["actions", "audit", "--node", "n1", "--config", str(config)])
    assert out.exit_code == 0, out.output
    lines = out.output.strip().splitlines()
    assert [ln.split()[1] for ln in lines] == ["requested", "succeeded"]
    assert "(dry-run)" in lines[0]
    held = _Runner().invoke(_main, ["actions", "audit", "--decision", "held", "--json",
                                    "--config", str(config)])
    assert [_json.loads(ln)["node"] for ln in held.output.strip().splitlines()] == ["n2"]
