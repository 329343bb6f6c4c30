"""A fresh user's trial (#16): folder bounds, policy rules in replay/check, clean errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from analytics.fault_model.kinds import FINDING_KINDS
from analytics.fault_model.site_rules import pattern_problem
from gpuhealth.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _config_check(tmp_path: Path, body: str | bytes, *args: str) -> tuple[int, str]:
    path = tmp_path / "g.toml"
    if isinstance(body, bytes):
        path.write_bytes(body)
    else:
        path.write_text(body)
    out = CliRunner().invoke(main, ["config", "check", *args, str(path)])
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception
    return out.exit_code, out.output


# ------------------------------------------------------------------ configuration files
def test_a_binary_settings_file_is_a_clean_error(tmp_path: Path) -> None:
    code, out = _config_check(tmp_path, b"\x00\xa5\xff\x10binary" * 50)
    assert code == 1
    assert "g.toml: not valid TOML: not UTF-8 text" in out
    path = tmp_path / "g.toml"
    run = CliRunner().invoke(main, ["run", "--config", str(path)])
    assert run.exit_code == 78, run.output
    assert isinstance(run.exception, SystemExit)
    assert "not UTF-8 text" in run.output


def test_every_policy_rule_problem_is_reported_at_once(tmp_path: Path) -> None:
    code, out = _config_check(tmp_path, '[[policy.rule]]\nname = "b"\nkind = "xid"\n'
                              'bogus = 1\nignore = true\n[[policy.rule]]\nname = "c"\n'
                              'kind = "xid"\ncount = "x"\n')
    assert code == 1
    assert "policy: rule 'b': bogus: unknown key" in out
    assert "policy: rule 'c': count: Input should be a valid integer" in out


@pytest.mark.parametrize(("body", "message"), [
    ('kind = "xidd"\ncode = "43"\naction = "reset_gpu"\n',
     "rule 'r': kind: unknown finding kind 'xidd'"),
    ('nodes = ""\nignore = true\n', "rule 'r': nodes: empty pattern"),
    ('kind = "xid"\nnodes = "gpu-[a"\naction = "reset_gpu"\n',
     "rule 'r': nodes: unclosed '[' in pattern 'gpu-[a'"),
    ('kind = "xid"\nentity = "GPU-[0"\nignore = true\n', "rule 'r': entity: unclosed '['"),
])
def test_rules_that_can_never_match_are_refused(tmp_path: Path, body: str,
                                                message: str) -> None:
    code, out = _config_check(tmp_path, f'[[policy.rule]]\nname = "r"\n{body}')
    assert code == 1
    assert message in out
    if "kind" in message:
        assert "known kinds: " in out and "xid" in out


def test_valid_patterns_are_kept() -> None:
    assert pattern_problem("gpu-[a-c]*") == ""
    assert pattern_problem("gpu-[!]x]") == ""
    assert pattern_problem("*") == ""


def test_the_kind_catalogue_holds_every_kind_the_fault_model_writes() -> None:
    written: set[str] = set()
    for path in (ROOT / "analytics").rglob("*.py"):
        written |= set(re.findall(r'\bkind="([a-z_]+)"', path.read_text()))
    for path in (ROOT / "gpuhealth").rglob("*.py"):
        written |= set(re.findall(r'\bFinding\([^)]*\bkind="([a-z_]+)"', path.read_text()))
    written -= {"port", "gpu"}  # analytics' labels of the precursor study, not findings
    assert written <= FINDING_KINDS, sorted(written - FINDING_KINDS)


def test_a_value_is_not_repeated_in_the_message(tmp_path: Path) -> None:
    code, out = _config_check(tmp_path, '[storage]\nretention_seconds = "-1h"\n')
    assert code == 1
    assert "not a duration: '-1h'" in out
    assert "(got '-1h')" not in out


def test_config_check_prints_one_line_unless_show(tmp_path: Path) -> None:
    body = '[[policy.rule]]\nname = "r"\nkind = "xid"\ncode = "43"\naction = "reset_gpu"\n'
    code, out = _config_check(tmp_path, body)
    assert code == 0
    assert out.strip().splitlines() == [
        f"{tmp_path / 'g.toml'}: valid (4 collector(s) enabled, 1 policy rule(s); "
        "--show prints the settings in effect)"]
    code, out = _config_check(tmp_path, body, "--show")
    assert code == 0
    assert '"policy"' in out and len(out.splitlines()) > 50
