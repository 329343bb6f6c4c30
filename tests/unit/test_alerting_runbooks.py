"""Every alert links to a runbook that exists, and the shipped rule file is the generated one."""

from __future__ import annotations

import re
from pathlib import Path

from alerting.promrules import prometheus_rules, render_rules
from core.clock import FakeClock
from gpuhealth.replay import load_node_facts, replay
from tests.conftest import cases_dir

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "docs" / "runbooks"


def fault_model_kinds() -> set[str]:
    """Kinds the rules write literally (``kind="x"`` or a string after node and entity)."""
    kinds: set[str] = set()
    for path in (ROOT / "analytics" / "fault_model").glob("*.py"):
        text = path.read_text()
        kinds |= set(re.findall(r'kind="([a-z_]+)"', text))
        kinds |= set(re.findall(r'_finding\(\s*[^,()]+,\s*[^,()]+,\s*"([a-z_]+)"', text))
    return kinds


def test_every_kind_has_a_runbook():
    report = replay([str(cases_dir())], clock=FakeClock(now=1.8e9),
                    node_facts=load_node_facts(str(cases_dir() / "expected.json")))
    kinds = {f.kind for n in report.nodes for f in n.findings}
    kinds |= fault_model_kinds()
    kinds |= {r.kind for g in prometheus_rules() for r in g.rules}
    missing = sorted(k for k in kinds if not (RUNBOOKS / f"{k}.md").is_file())
    assert missing == []
    index = (RUNBOOKS / "README.md").read_text()
    for page in RUNBOOKS.glob("*.md"):
        if page.name != "README.md":
            assert f"({page.name})" in index


def test_shipped_rule_file_is_current():
    shipped = (ROOT / "deploy" / "prometheus" / "gpuhealth-rules.yml").read_text()
    hint = "regenerate: gpuhealth rules export deploy/prometheus/gpuhealth-rules.yml"
    assert shipped == render_rules(), hint
