"""A fresh user's trial of ``gpuhealth report`` and ``gpuhealth mark-healthy`` (#16 trial).

Clean errors with sysexits statuses, node names checked on both ends, report figures
that are never built from nothing, and ``policy_rules`` on every step record.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from core.clock import FakeClock
from core.names import node_name_problem
from core.records import Action, EntityId, Evidence, Finding, NodeName, Severity
from dashboards.report import ReportOptions, build_report, render
from gpuhealth.api import AlertingApi
from gpuhealth.cli import main
from gpuhealth.pipeline import Pipeline
from remediation.audit import read_audit_log
from storage.history import IncidentHistory, IncidentRecord

BAD_NAMES = ["gpu-01?", "*", "../../etc", "a\nb", "n" * 5000, "gpu 017", "gpu;rm -rf",
             "-x", "gpu-[1-4]", "ñø∂é", ""]


def _finding(node: str = "gpu-017", code: str = "79") -> Finding:
    return Finding(node=NodeName(node), entity=EntityId("GPU-1"), kind="xid", code=code,
                   severity=Severity.CRITICAL, action=Action.RESET_GPU, summary=f"Xid {code}",
                   evidence=(Evidence(file="kern.log", line=1, text=f"Xid {code}"),),
                   source="xid catalog", first_seen_at=0.0, last_seen_at=0.0)


# -- 1. report: unwritable output, a history that is no database ---------------------------


def _history(tmp_path: Path) -> Path:
    db = tmp_path / "h.sqlite"
    with IncidentHistory(db) as store:
        store.upsert_incidents([IncidentRecord(
            incident_id="gpu-017/a", node="gpu-017", entity="0000:b1:00.0", kind="xid",
            code="43", severity="major", cause="xid", detected_at=1000.0,
            out_of_service_at=None, back_in_service_at=None, resolved_at=None,
            attrs={"dry_run": "true", "state": "probation"})])
    return db


def test_report_output_that_cannot_be_created_exits_73(tmp_path: Path) -> None:
    db = _history(tmp_path)
    out = CliRunner().invoke(main, ["report", "--since", "all", "--history", str(db),
                                    "-o", "/proc/nope/x.html"])
    assert out.exit_code == 73, out.output
    assert "cannot create /proc/nope/x.html" in out.output
    assert "Traceback" not in out.output


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_report_output_that_cannot_be_written_exits_74(tmp_path: Path) -> None:
    db = _history(tmp_path)
    out = CliRunner().invoke(main, ["report", "--since", "all", "--history", str(db),
                                    "-o", "/dev/full"])
    assert out.exit_code == 74, out.output
    assert "cannot write /dev/full" in out.output


def test_report_history_that_is_not_a_database_exits_66(tmp_path: Path) -> None:
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    for args in (["report", "--history", str(binary)],
                 ["report", "--history", str(tmp_path)]):
        out = CliRunner().invoke(main, args)
        assert out.exit_code == 66, out.output
        assert "cannot be read as an incident history" in out.output
        assert str(args[-1]) in out.output


# -- 2. mark-healthy: --url and configuration ------------------------------------------------


def _config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "g.toml"
    path.write_text(f'[node]\ndata_dir = "{tmp_path}"\n{extra}')
    return path


@pytest.mark.parametrize("url", ["http://256.1.1.1:99999", "notaurl", "ftp://host/x",
                                 "http://127.0.0.1:99999", "http://"])
def test_mark_healthy_bad_url_is_a_usage_error(tmp_path: Path, url: str) -> None:
    out = CliRunner().invoke(main, ["mark-healthy", "gpu-017", "--reason", "x", "--url", url,
                                    "--config", str(_config(tmp_path))])
    assert out.exit_code == 64, out.output
    assert "--url" in out.output
    assert "Traceback" not in out.output
    assert "cannot reach" not in out.output


def test_mark_healthy_unset_token_variable_is_a_configuration_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GH_TRIAL_TOKEN_UNSET", raising=False)
    path = _config(tmp_path, '[alerting]\napi_token_env = "GH_TRIAL_TOKEN_UNSET"\n')
    out = CliRunner().invoke(main, ["mark-healthy", "gpu-017", "--reason", "x",
                                    "--config", str(path)])
    assert out.exit_code == 78, out.output
    assert "GH_TRIAL_TOKEN_UNSET" in out.output


# -- 3. node names ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpu-017", "GPU017", "node1.cluster.example", "a",
                                  "n" * 63 + "." + "m" * 63])
def test_node_names_that_are_names(name: str) -> None:
    assert node_name_problem(name) is None


@pytest.mark.parametrize("name", BAD_NAMES)
def test_mark_healthy_refuses_a_malformed_node_before_any_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    def no_request(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("no request may be made")

    monkeypatch.setattr(httpx, "post", no_request)
    out = CliRunner().invoke(main, ["mark-healthy", name, "--reason", "x",
                                    "--config", str(_config(tmp_path))])
    assert out.exit_code == 64, out.output
    assert "recorded" not in out.output


def test_mark_healthy_refuses_control_characters_in_entity_reason_by(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpx, "post", lambda *a, **k: pytest.fail("no request"))
    for args in (["gpu-017", "GPU-1\n", "--reason", "x"],
                 ["gpu-017", "--reason", "two\nlines"],
                 ["gpu-017", "--reason", "x", "--by", "eve\x1b[2J"]):
        out = CliRunner().invoke(main, ["mark-healthy", *args,
                                        "--config", str(_config(tmp_path))])
        assert out.exit_code == 64, (args, out.output)


def _api(tmp_path: Path) -> tuple[AlertingApi, Pipeline]:
    from alerting.silences import SilenceStore

    clock = FakeClock(now=1000.0)
    p = Pipeline(facts={}, notifiers=[], audit_log_path=str(tmp_path / "audit.jsonl"),
                 clock=clock)
    p.observe_findings([_finding()], hold_seconds=3600)
    p.evaluate()
    return AlertingApi(pipeline=p, silences=SilenceStore(clock=clock)), p


def _post(api: AlertingApi, body: dict[str, Any]) -> tuple[int, Any]:
    return api.handle("POST", "/api/v1/mark-healthy", {}, json.dumps(body).encode())


def test_api_refuses_malformed_names_and_unknown_nodes_recording_nothing(
        tmp_path: Path) -> None:
    api, p = _api(tmp_path)
    try:
        before = len(read_audit_log(str(tmp_path / "audit.jsonl")))
        for name in BAD_NAMES:
            status, answer = _post(api, {"node": name, "reason": "odd"})
            assert status == 400, (name, answer)
        for body in ({"node": "gpu-017", "entity": "GPU-1\n", "reason": "x"},
                     {"node": "gpu-017", "reason": "a\nb"},
                     {"node": "gpu-017", "reason": "x", "by": "e\x00ve"}):
            assert _post(api, body)[0] == 400, body
        status, answer = _post(api, {"node": "gpu-999", "reason": "x"})
        assert status == 404
        assert answer["error"].startswith("unknown node gpu-999")
        records = read_audit_log(str(tmp_path / "audit.jsonl"))
        assert len(records) == before  # nothing of the above reached the audit trail
        status, answer = _post(api, {"node": "gpu-017", "reason": "reseated", "by": "bob"})
        assert status == 200, answer
        assert [c["code"] for c in answer["cleared"]] == ["79"]
        marked = [r for r in read_audit_log(str(tmp_path / "audit.jsonl"))
                  if r.decision == "marked_healthy"]
        assert [r.node for r in marked] == ["gpu-017"]
    finally:
        p.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mark_healthy_unknown_node_exits_68_without_recorded(tmp_path: Path) -> None:
    from gpuhealth.api import start_api
    from gpuhealth.config import load_settings

    port = _free_port()
    path = _config(tmp_path, f"[alerting]\napi_port = {port}\n")
    _, p = _api(tmp_path)
    server = start_api(load_settings(path), p)
    assert server is not None
    try:
        out = CliRunner().invoke(main, ["mark-healthy", "gpu-999", "--reason", "x",
                                        "--config", str(path)])
        assert out.exit_code == 68, out.output
        assert "unknown node gpu-999" in out.output
        assert "recorded in the audit trail" not in out.output
    finally:
        server.stop()
        p.close()


# -- 4. report figures from nothing ----------------------------------------------------------


def test_report_without_inventory_shows_na_and_counts_that_agree(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite"
    now = 1796220800.0
    with IncidentHistory(db) as store:  # two dry-run incidents, cleared; no inventory
        store.upsert_incidents([
            IncidentRecord(incident_id=f"gpu-017/{i}", node="gpu-017", entity=e, kind="xid",
                           code=c, severity="major", cause=cause, detected_at=now - 60 + i,
                           out_of_service_at=None, back_in_service_at=None,
                           resolved_at=None, actions=("drain", "reset_gpu"),
                           attrs={"dry_run": "true", "state": "probation"})
            for i, (e, c, cause) in enumerate([("0000:b1:00.0", "43", "xid"),
                                               ("0000:3b:00.0", "48", "memory")])])
        figures = build_report(store, ReportOptions(since=now - 7 * 86400, until=now),
                               now=lambda: now)
    s = figures["sections"]
    assert (s["availability"]["units"], s["availability"]["nodes"]) == (0, 0)
    assert s["mtbf"]["fleet"]["failures"] == 2
    assert s["mtbf"]["fleet"]["system_mtbf_hours"] is None  # not 84.0 = 168 h / 2
    assert [r["system_mtbf_hours"] for r in s["mtbf"]["by_node"]] == [None]
    assert s["mtbf"]["nodes_total"] == s["availability"]["nodes"] == 0
    assert s["mtbf"]["nodes_not_in_inventory"] == 1
    assert s["availability"]["open_at_end"] == 0
    assert s["mttr"]["unrepaired"] == 0  # "Not yet repaired" agrees with "still out" 0
    assert s["mttr"]["not_out_of_service"] == 2
    md = render(figures, "md")
    assert "| Mean time between failures anywhere in the fleet (hours) | n/a |" in md
    assert "84.00" not in md
    assert "1 nodes in all" not in md
    assert "| Not yet repaired | 0 |" in md
    assert "| Never taken out of service | 2 |" in md


# -- 5. policy_rules on every step record ----------------------------------------------------


def test_policy_rules_on_submitted_succeeded_and_probation(tmp_path: Path) -> None:
    from analytics.fault_model.site_rules import SiteRule, SiteRules

    clock = FakeClock(now=0.0)
    p = Pipeline(facts={"node": "ctl"}, notifiers=[], audit_log_path=str(tmp_path / "a.jsonl"),
                 cluster_size=10, max_disrupted_fraction=1.0, clock=clock, dry_run=True)
    p.site_rules = SiteRules([SiteRule(name="dbe-sticky", kind="xid", code="48",
                                       sticky=True)])
    p.observe_findings([_finding("n1", "48")], hold_seconds=600)
    for _ in range(4):
        p.evaluate()
        clock.advance(1)
    records = read_audit_log(str(tmp_path / "a.jsonl"))
    steps = [r for r in records if r.step is not None
             and r.decision in ("requested", "submitted", "succeeded", "probation")]
    decisions = {r.decision for r in steps}
    assert {"requested", "submitted", "succeeded"} <= decisions, decisions
    assert all("policy rule 'dbe-sticky'" in r.details.get("policy_rules", "")
               for r in steps), [(r.decision, r.step, r.details) for r in steps]
    p.close()
