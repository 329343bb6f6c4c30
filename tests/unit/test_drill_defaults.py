"""A drill on the defaults passes; a stopped drill ends its incident; a fault this
configuration would not act on is refused (docs/remediation.md, "Drills")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from core.records import ActionRequest, NodeName, NodeState, RemediationStep
from gpuhealth.cli import main
from gpuhealth.config import Settings
from gpuhealth.drill_cli import LOCK_FILE, drill_running
from remediation.actions import INCIDENT_CLOSED, ActionStore
from remediation.drill import (
    FAULTS,
    UNACTED,
    DrillAuditLog,
    DrillTimeline,
    check_acted_on,
    drill_adapter,
    judge,
    passed,
    resume_own,
)
from remediation.dry_run import DryRunScheduler

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")


def _defaults(tmp: Path, extra: str = "") -> Path:
    """A file that sets nothing the drill depends on (only where its state goes)."""
    path = tmp / "gpuhealth.toml"
    path.write_text(f'[node]\nname = "gpu-017"\ndata_dir = "{tmp / "data"}"\n{extra}\n')
    return path


def _drill(config: Path, *args: str) -> tuple[int, str, dict]:
    out = CliRunner().invoke(main, ["drill", "--config", str(config), "--json", *args])
    body = out.stdout[out.stdout.index("{"):] if "{" in out.stdout else "{}"
    return out.exit_code, out.output, json.loads(body)


# ------------------------------------------------------------------- 1. probation
def test_the_drills_probation_is_short_by_default():
    assert Settings().drill.probation_seconds == 5.0
    assert Settings().remediation.probation_seconds == 3600.0  # the site's is for real faults


def test_a_dry_run_drill_on_the_defaults_passes_quickly(tmp_path):
    config = _defaults(tmp_path)
    started = time.monotonic()
    code, output, result = _drill(config, "--node", "gpu-017", "--dry-run",
                                  "--timeout", "30s", "--id", "def1")
    assert code == 0, output
    assert result["passed"], output
    stages = {s["stage"]: s for s in result["stages"]}
    assert stages["resume"]["status"] == "ok"
    assert 5.0 <= stages["resume"]["seconds"] < 15.0  # after the drill's 5 s probation
    assert time.monotonic() - started < 25.0


def test_a_probation_not_shorter_than_the_timeout_is_a_bad_configuration(tmp_path):
    config = _defaults(tmp_path, '[drill]\nprobation_seconds = "1m"')
    code, output, _ = _drill(config, "--node", "gpu-017", "--timeout", "30s")
    assert code == 78, output
    assert "probation" in output


# --------------------------------------------------------- 2. stopped, leftovers
def _spawn(config: Path, drill_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [GPUHEALTH, "drill", "--config", str(config), "--node", "gpu-017", "--dry-run",
         "--id", drill_id],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_injected(proc: subprocess.Popen[str], folder: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if (folder / "actions.db").exists() and drill_running(folder):
            store = ActionStore(str(folder / "actions.db"))
            try:
                if any(i.out_of_service_at is not None for i in store.incidents()):
                    return
            finally:
                store.close()
        time.sleep(0.1)
    raise AssertionError("the drill did not take the node out")


def _open_incidents(folder: Path) -> list[str]:
    store = ActionStore(str(folder / "actions.db"))
    try:
        return [i.incident for i in store.incidents() if i.state != INCIDENT_CLOSED]
    finally:
        store.close()


def test_a_drill_stopped_by_sigterm_ends_its_incident_and_frees_the_node(tmp_path):
    config = _defaults(tmp_path, '[drill]\nprobation_seconds = "60s"')  # still on probation
    folder = tmp_path / "data/drills/stop1"
    proc = _spawn(config, "stop1")
    _wait_injected(proc, folder)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, (out, err)
    assert "interrupted (SIGTERM)" in err
    result = json.loads((folder / "result.json").read_text())
    assert result["interrupted"] == "SIGTERM"
    assert not result["passed"]
    assert _open_incidents(folder) == []
    assert not drill_running(folder)
    # the same drill again is not refused
    code, output, again = _drill(_defaults(tmp_path), "--node", "gpu-017", "--id", "stop2",
                                 "--timeout", "30s")
    assert code == 0, output
    assert again["passed"]


def test_leftover_state_of_a_killed_drill_holds_no_node(tmp_path, caplog):
    config = _defaults(tmp_path, '[drill]\nprobation_seconds = "60s"')
    folder = tmp_path / "data/drills/kill1"
    proc = _spawn(config, "kill1")
    _wait_injected(proc, folder)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up
    proc.communicate(timeout=30)
    assert _open_incidents(folder)  # left over
    assert not drill_running(folder)  # nobody holds the lock
    assert (folder / LOCK_FILE).exists()
    code, output, _ = _drill(_defaults(tmp_path), "--node", "gpu-017", "--id", "kill2",
                                 "--timeout", "30s")
    assert code == 0, output
    assert "leftover state" in output + caplog.text
    assert _open_incidents(folder) == []


def test_clear_closes_a_leftover_drill_and_refuses_a_running_one(tmp_path):
    config = _defaults(tmp_path, '[drill]\nprobation_seconds = "60s"')
    folder = tmp_path / "data/drills/clr1"
    proc = _spawn(config, "clr1")
    try:
        _wait_injected(proc, folder)
        out = CliRunner().invoke(main, ["drill", "--config", str(config), "--clear", "clr1"])
        assert out.exit_code == 3, out.output
        assert "still running" in out.output
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    out = CliRunner().invoke(main, ["drill", "--config", str(config), "--clear", "clr1"])
    assert out.exit_code == 0, out.output
    assert "gpu-017" in out.output
    assert _open_incidents(folder) == []
    out = CliRunner().invoke(main, ["drill", "--config", str(config), "--clear", "nope"])
    assert out.exit_code == 3


class _Node(DryRunScheduler):
    """A scheduler showing one node out of service with ``reason``; resume puts it back."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    async def node_state(self, node: NodeName, *, workload: bool = True) -> NodeState:
        if not self.reason:
            return NodeState(node=node)
        return NodeState(node=node, schedulable=False, reason=self.reason,
                         owned=self.reason.startswith("gpuhealth:"), state="DRAIN")

    async def submit(self, request: ActionRequest) -> str:
        ref = await super().submit(request)
        if request.step == RemediationStep.RESUME:
            self.reason = ""
        return ref


def _resume(inner: _Node, tmp: Path) -> tuple[str, list[dict]]:
    audit_path = tmp / "audit.jsonl"
    audit = DrillAuditLog(path=str(audit_path), drill_id="lv1")
    text = asyncio.run(resume_own(drill_adapter(inner, "lv1"), node="n1", drill_id="lv1",
                                  why="interrupted by SIGTERM", audit=audit))
    lines = [json.loads(line) for line in audit_path.read_text().splitlines()]
    return text, lines


def test_a_stopped_live_drill_resumes_only_what_it_took_out(tmp_path):
    inner = _Node("gpuhealth: drill lv1: GpuXid79 critical")
    text, audit = _resume(inner, tmp_path)
    assert "resumed" in text
    assert [r.step for r in inner.requests] == [RemediationStep.RESUME]
    assert inner.requests[0].reason.startswith("gpuhealth: drill lv1:")
    assert [a["decision"] for a in audit] == ["requested", "succeeded"]
    assert all(a["details"]["drill"] == "lv1" for a in audit)


def test_a_stopped_live_drill_never_undoes_a_humans_drain(tmp_path):
    for reason in ("maintenance by alice", "gpuhealth: GpuXid79 critical",
                   "gpuhealth: drill other: GpuXid79"):
        inner = _Node(reason)
        text, audit = _resume(inner, tmp_path / reason.replace(" ", "_").replace(":", ""))
        assert "not by this drill" in text
        assert inner.requests == []
        assert [a["decision"] for a in audit] == ["held"]


# ------------------------------------------------------ 3. faults nothing acts on
def test_an_nvlink_drill_without_nvlink_expected_is_refused(tmp_path):
    code, output, result = _drill(_defaults(tmp_path), "--node", "gpu-017", "--kind",
                                  "nvlink", "--id", "nv1")
    assert code == 3, output
    assert '[inventory] nvlink = "expected"' in result["refused"]
    assert not (tmp_path / "data/drills/nv1").exists()  # nothing injected


def test_an_nvlink_drill_with_nvlink_expected_runs(tmp_path):
    config = _defaults(tmp_path, '[inventory]\nnvlink = "expected"')
    code, output, result = _drill(config, "--node", "gpu-017", "--kind", "nvlink",
                                  "--timeout", "60s")
    assert code == 0, output
    assert {s["stage"]: s["status"] for s in result["stages"]}["reset_gpu"] == "ok"


def test_an_alert_no_step_follows_fails_the_drill():
    timeline = DrillTimeline(drill_id="u1", node="n1", fault=FAULTS["xid79"], injected_at=0.0)
    timeline.at.update(detect=1.0, alert=1.0)
    assert passed(judge(timeline, {}), timeline)  # what it did before: tested nothing
    check_acted_on(timeline)
    assert timeline.problems == [UNACTED]
    assert not passed(judge(timeline, {}), timeline)
