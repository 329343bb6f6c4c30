"""``gpuhealth drill --fleet``: a drill through the deployed path, real processes.

Two real ``gpuhealth agent`` processes report to a real ``gpuhealth controller``
(SQLite state, the dry-run scheduler, probation 1 s). The drill drops a marked Xid 79
line into agent ``gpu-01``'s drill inbox; the agent's kernel-log parser reads it, the
finding goes to the controller through the outbox, the controller alerts (label
``drill=<id>``), cordons, drains, reboots and resumes (dry-run), and the drill times each
stage from the controller's API. Every record is marked drill, nothing is handed to
hardware service, and ``gpu-02``, opted out, is refused (exit 3).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuhealth.cli import main
from tests.drill_helpers import (
    GPUHEALTH,
    Proc,
    agent_config,
    controller_config,
    get_json,
    write_tokens,
)

NODES = ("gpu-01", "gpu-02")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _eventually(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = _free_port()
    tokens = write_tokens(tmp_path / "tokens", NODES)
    state = tmp_path / "state.sqlite"
    config = controller_config(
        tmp_path / "controller.toml", name="ctl", port=port, state=str(state),
        tokens=tmp_path / "tokens", remediation="""probation_seconds = 1
tick_seconds = 0.1
opt_out_nodes = ["gpu-02"]
[drill]
timeout_seconds = 60
""")
    url = f"http://127.0.0.1:{port}"
    procs = [Proc([GPUHEALTH, "controller", "--config", str(config)],
                  tmp_path / "controller.log").start()]
    for node in NODES:
        (tmp_path / f"{node}.kern.log").write_text("")
        cfg = agent_config(tmp_path / f"{node}.toml", node=node,
                           data_dir=tmp_path / f"{node}-data",
                           kern_log=tmp_path / f"{node}.kern.log", controllers=[url])
        procs.append(Proc([GPUHEALTH, "agent", "--config", str(cfg)], tmp_path / f"{node}.log",
                          env={"AGENT_TOKEN": tokens[node]}).start())
    try:
        _eventually(lambda: len(get_json(f"{url}/api/v1/agents") or []) == len(NODES), 60,
                    "both agents registered")
        yield {"url": url, "config": config, "state": state, "tmp": tmp_path, "procs": procs}
    finally:
        for proc in reversed(procs):
            proc.stop()
        for log in sorted(tmp_path.glob("*.log")):
            if log.name.endswith("kern.log"):
                continue
            text = log.read_text(errors="replace")
            assert "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"


def _drill(fleet: dict[str, Any], node: str, drill_id: str) -> tuple[int, str, dict[str, Any]]:
    out = CliRunner().invoke(main, [
        "drill", "--config", str(fleet["config"]), "--fleet", "--controller", fleet["url"],
        "--node", node, "--kind", "xid79", "--id", drill_id, "--slo", "detect=10s",
        "--slo", "total=60s",
        "--agent-data-dir", str(fleet["tmp"] / "{node}-data"), "--json"])
    body = out.stdout[out.stdout.index("{"):] if "{" in out.stdout else "{}"
    return out.exit_code, out.output, json.loads(body)


def test_a_drill_goes_through_the_fleet_marked_and_an_opted_out_node_is_refused(
        fleet: dict[str, Any]) -> None:
    from remediation.actions import ActionStore
    from remediation.audit import read_audit_log

    started = time.monotonic()
    code, output, result = _drill(fleet, "gpu-01", "fd1")
    took = time.monotonic() - started
    assert code == 0, output
    stages = {s["stage"]: s for s in result["stages"]}
    for stage in ("detect", "alert", "cordon", "drain", "reboot", "resume", "total"):
        assert stages[stage]["status"] == "ok", stages
        assert stages[stage]["seconds"] is not None
    assert stages["reset_gpu"]["status"] == "skipped"
    seconds = [stages[s]["seconds"] for s in ("detect", "alert", "cordon", "drain",
                                               "reboot", "resume")]
    assert seconds == sorted(seconds), stages
    assert stages["resume"]["seconds"] >= 1.0  # after the 1 s probation
    assert result["mode"] == "dry-run"
    assert result["passed"] is True
    timed = ", ".join(f"{s} {v:.3f} s" for s, v in zip(
        ("detect", "alert", "cordon", "drain", "reboot", "resume"), seconds, strict=True))
    print(f"fleet drill: {took:.2f} s; {timed}")  # noqa: T201 (the stages, shown with -s)

    # The agent took the file; the controller's alert carries drill=fd1.
    inbox = fleet["tmp"] / "gpu-01-data" / "drill-inbox"
    assert (inbox / "fd1.taken").exists()
    assert not (inbox / "fd1.line").exists()
    alerts = get_json(f"{fleet['url']}/api/v1/alerts") or []
    ours = [a for a in alerts if a["labels"].get("drill") == "fd1"]
    assert ours
    assert all(a["labels"]["node"] == "gpu-01" for a in ours)
    assert "gpuhealth-drill=fd1" in ours[0]["annotations"]["evidence"]

    # Every step of the incident is the drill's, none a hand-off; the audit says drill.
    actions = get_json(f"{fleet['url']}/api/v1/actions") or []
    mine = [a for a in actions if a["node"] == "gpu-01"]
    assert {a["step"] for a in mine} >= {"cordon", "drain", "reboot", "resume"}
    assert all(a["attrs"].get("drill") == "fd1" for a in mine), mine
    assert all("drill fd1" in a["reason"] for a in mine), [a["reason"] for a in mine]
    assert not [a for a in actions if a["step"] == "hand_off"]
    data = fleet["tmp"] / "ctl"  # a controller on SQLite keeps them in its data folder
    records = [r for r in read_audit_log(str(data / "audit.jsonl"))
               if r.node == "gpu-01" and r.step is not None]
    assert records
    assert all(r.details.get("drill") == "fd1" for r in records), [
        (r.decision, r.step, r.details) for r in records if r.details.get("drill") != "fd1"]

    # The incident history (as the leader writes it) marks it a drill, never a failure.
    from gpuhealth.history_sync import HistoryRecorder
    from storage.history import IncidentHistory

    store = ActionStore(str(data / "actions.db"))
    history = IncidentHistory(str(fleet["tmp"] / "history-check.sqlite"))
    try:
        recorder = HistoryRecorder(history)
        incidents = recorder._incidents(store)
    finally:
        history.close()
        store.close()
    drilled = [i for i in incidents if i.node == "gpu-01"]
    assert drilled
    assert all(i.attrs.get("drill") == "fd1" for i in drilled)
    assert all(i.attrs.get("drill_mode") == "dry-run" for i in drilled)

    # A second drill of the same fault on the same GPU is a drill of its own.
    code, output, again = _drill(fleet, "gpu-01", "fd3")
    assert code == 0, output
    assert {s["stage"]: s["status"] for s in again["stages"]}["resume"] == "ok"
    actions = get_json(f"{fleet['url']}/api/v1/actions") or []
    assert {a["step"] for a in actions if a["attrs"].get("drill") == "fd3"} >= {
        "cordon", "drain", "reboot", "resume"}
    assert not [a for a in actions if a["step"] == "hand_off"]

    # gpu-02 opted out: refused before anything is injected.
    code, output, result = _drill(fleet, "gpu-02", "fd2")
    assert code == 3, output
    assert "opted out" in output
    assert not (fleet["tmp"] / "gpu-02-data" / "drill-inbox" / "fd2.line").exists()
    assert not [a for a in get_json(f"{fleet['url']}/api/v1/actions") or []
                if a["node"] == "gpu-02"]


def test_a_line_without_the_marker_is_refused_by_the_running_agent(
        fleet: dict[str, Any]) -> None:
    inbox = fleet["tmp"] / "gpu-01-data" / "drill-inbox"
    _eventually(inbox.is_dir, 30, "the agent created its inbox")
    (inbox / "fake.line").write_text(
        "NVRM: Xid (PCI:0000:b1:00): 79, pid=1, GPU has fallen off the bus.\n")
    (inbox / "junk.line").write_bytes(b"\xff\xfe\x00binary")
    _eventually(lambda: (inbox / "fake.refused").exists() and (inbox / "junk.refused")
                .exists(), 30, "both files refused")
    assert "gpuhealth-drill=<id>" in (inbox / "fake.why").read_text()
    assert "UTF-8" in (inbox / "junk.why").read_text()
    time.sleep(2.0)
    assert fleet["procs"][1].alive(), "the agent died"
    assert not [a for a in get_json(f"{fleet['url']}/api/v1/alerts") or []
                if a["labels"].get("node") == "gpu-01"]
    assert os.path.exists(fleet["tmp"] / "gpu-01-data" / "agent-outbox.sqlite")
