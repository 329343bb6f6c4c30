"""``[[policy.rule]]``: per-code policy (count in a window, overrides, sticky, ignore) and
``gpuhealth mark-healthy`` (#16 items 5 and 7).

The CLI test talks to the real alerting API of ``gpuhealth run`` (``start_api``) on
loopback.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from analytics.fault_model.site_rules import SiteRule, SiteRules
from core.clock import FakeClock
from core.records import Action, EntityId, Evidence, Finding, NodeName, RemediationStep, Severity
from gpuhealth.api import start_api
from gpuhealth.cli import main
from gpuhealth.compose import site_rules
from gpuhealth.config import load_settings
from gpuhealth.pipeline import Pipeline
from remediation.audit import read_audit_log


def xid(code: str = "43", occurrences: int = 1, at: float = 0.0, node: str = "n1",
        severity: Severity = Severity.WARNING) -> Finding:
    return Finding(node=NodeName(node), entity=EntityId("GPU-1"), kind="xid", code=code,
                   severity=severity, action=Action.RESTART_APP, summary=f"Xid {code}",
                   evidence=(Evidence(file="kern.log", line=1, text=f"Xid {code}"),),
                   source="xid catalog", first_seen_at=0.0, last_seen_at=at,
                   occurrences=occurrences)


THREE_IN_TEN = SiteRule(name="xid43-repeat", kind="xid", code="43", count=3,
                        window_seconds=600.0, severity=Severity.MAJOR,
                        action=Action.RESET_GPU)


def test_three_times_in_ten_minutes_then_the_override() -> None:
    rules = SiteRules([THREE_IN_TEN])
    assert rules.apply([xid(occurrences=1, at=0)], now=0) == []
    assert rules.apply([xid(occurrences=2, at=100)], now=100) == []
    (f,) = rules.apply([xid(occurrences=3, at=200)], now=200)
    assert (f.severity, f.action) == (Severity.MAJOR, Action.RESET_GPU)
    assert "policy rule 'xid43-repeat': severity warning -> major" in f.source
    spread = SiteRules([THREE_IN_TEN])
    spread.apply([xid(occurrences=1, at=0)], now=0)
    spread.apply([xid(occurrences=2, at=700)], now=700)  # the first fell out of the window
    assert spread.apply([xid(occurrences=3, at=1400)], now=1400) == []


def test_first_match_wins_patterns_and_ignore() -> None:
    rules = SiteRules([
        SiteRule(name="quiet-a", kind="xid", code="43", nodes="gpu-a*", ignore=True),
        SiteRule(name="loud", kind="xid", severity=Severity.CRITICAL, entity="GPU-*"),
    ])
    assert rules.apply([xid(node="gpu-a1")], now=0) == []
    (loud,) = rules.apply([xid(node="gpu-b1")], now=0)
    assert loud.severity == Severity.CRITICAL
    other = Finding(node=NodeName("gpu-b1"), entity=EntityId("mlx5_0/1"), kind="xid",
                    code="43", severity=Severity.WARNING, action=Action.NONE, summary="s",
                    evidence=(), source="t")
    assert rules.apply([other], now=0) == [other]  # no rule matches that entity


def test_sticky_stays_until_marked_healthy_and_the_rule_is_in_the_audit(tmp_path: Path) -> None:
    clock = FakeClock(now=0.0)
    p = Pipeline(facts={"node": "ctl"}, notifiers=[], audit_log_path=str(tmp_path / "a.jsonl"),
                 cluster_size=10, max_disrupted_fraction=1.0, clock=clock)
    p.site_rules = SiteRules([SiteRule(name="dbe-sticky", kind="xid", code="48",
                                       severity=Severity.CRITICAL,
                                       action=Action.SERVICE_HARDWARE, sticky=True)])
    fault = xid("48", severity=Severity.MAJOR)
    p.observe_findings([fault], hold_seconds=60)
    out = p.evaluate()
    assert [r.step for r in out.actions][:2] == [RemediationStep.CORDON, RemediationStep.DRAIN]
    requested = [r for r in read_audit_log(str(tmp_path / "a.jsonl"))
                 if r.decision == "requested"]
    assert all("policy rule 'dbe-sticky'" in r.details["policy_rules"] for r in requested)
    clock.advance(120)  # the held finding expired: a sticky one stays
    assert [f.code for f in p.evaluate().findings] == ["48"]
    cleared = p.mark_healthy("n1", None, reason="GPU replaced, dcgmi diag -r 3 passed",
                             by="alice")
    assert [f.code for f in cleared] == ["48"]
    out = p.evaluate()
    assert [f.code for f in out.findings] == []
    assert RemediationStep.RESUME in [r.step for r in out.actions]  # back to service
    marked = [r for r in read_audit_log(str(tmp_path / "a.jsonl"))
              if r.decision == "marked_healthy"]
    assert [(r.actor, r.reason) for r in marked] == [
        ("alice", "GPU replaced, dcgmi diag -r 3 passed")]
    assert "xid 48 on GPU-1" in marked[0].details["findings"]
    with pytest.raises(ValueError, match="reason"):
        p.mark_healthy("n1", None, reason=" ", by="alice")
    p.close()


def test_rules_come_from_the_configuration(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text('[[policy.rule]]\nname = "xid43-repeat"\nkind = "xid"\ncode = "43"\n'
                    'count = 3\nwindow = "10m"\nseverity = "major"\n')
    (rule,) = site_rules(load_settings(path)).rules
    assert (rule.name, rule.count, rule.window_seconds, rule.severity) == (
        "xid43-repeat", 3, 600.0, Severity.MAJOR)


@pytest.mark.parametrize(("body", "message"), [
    ('name = "a"\nkind = "xid"\ncount = "three"\n', "rule 'a': count: Input should be"),
    ('name = "a"\nkind = "xid"\nignore = true\nsticky = true\n', "rule 'a': (table): ignore"),
    ('name = "a"\nkind = "xid"\nignore = true\nfoo = 1\n', "rule 'a': foo: unknown key"),
    ('name = "a"\ncount = 2\n', "matches every finding"),
    ('kind = "xid"\nignore = true\n', "rule #1: name: Field required"),
])
def test_config_check_names_the_rule_and_the_key(tmp_path: Path, body: str,
                                                 message: str) -> None:
    path = tmp_path / "g.toml"
    path.write_text(f"[[policy.rule]]\n{body}")
    out = CliRunner().invoke(main, ["config", "check", str(path)])
    assert out.exit_code == 1
    assert message in out.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mark_healthy_command_through_the_running_api(tmp_path: Path) -> None:
    port = _free_port()
    path = tmp_path / "g.toml"
    path.write_text(f'[node]\ndata_dir = "{tmp_path}"\n[alerting]\napi_port = {port}\n')
    settings = load_settings(path)
    p = Pipeline(facts={}, notifiers=[], audit_log_path=str(tmp_path / "audit.jsonl"))
    p.observe_findings([xid("79", severity=Severity.CRITICAL)], hold_seconds=3600)
    p.evaluate()
    server = start_api(settings, p)
    assert server is not None
    try:
        runner = CliRunner()
        out = runner.invoke(main, ["mark-healthy", "n1", "GPU-1", "--reason", "reseated",
                                   "--by", "bob", "--config", str(path)])
        assert out.exit_code == 0, out.output
        assert "1 finding(s) cleared" in out.output
        assert "xid 79 on GPU-1" in out.output
        assert p.evaluate().findings == []
        again = runner.invoke(main, ["mark-healthy", "n1", "--reason", "check",
                                     "--config", str(path)])
        assert again.exit_code == 0
        assert "nothing was open" in again.output
        missing = runner.invoke(main, ["mark-healthy", "n1", "--config", str(path)])
        assert missing.exit_code == 64  # usage: --reason is required (EX_USAGE)
    finally:
        server.stop()
        p.close()
    gone = runner.invoke(main, ["mark-healthy", "n1", "--reason", "x", "--config", str(path)])
    assert gone.exit_code == 75
    assert "cannot reach" in gone.output
