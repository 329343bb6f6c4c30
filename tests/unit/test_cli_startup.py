"""``gpuhealth --version`` and ``diagnose`` import only what they need (issue #14 item 6)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from gpuhealth.cli import main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("scipy", "pandas", "sklearn", "river", "matplotlib")

_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from gpuhealth.cli import main
try:
    main(sys.argv[2:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def _modules(*args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), *args], capture_output=True,
                         text=True, timeout=60, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".", 1)[0] in HEAVY)


def test_version_imports_no_analysis_library() -> None:
    modules = _modules("--version")
    assert not _heavy(modules)
    assert "numpy" not in modules
    assert "gpuhealth.report_cli" not in modules


def test_diagnose_of_a_small_case_imports_no_analysis_library() -> None:
    case = ROOT / "tests" / "fixtures" / "cases" / (
        "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log")
    assert not _heavy(_modules("diagnose", str(case)))


def test_commands_of_other_modules_are_listed_and_run() -> None:
    runner = CliRunner()
    listing = runner.invoke(main, ["--help"])
    assert listing.exit_code == 0
    for name in ("actions", "check", "mark-healthy", "report", "diagnose", "run"):
        assert f"  {name} " in listing.output
    assert runner.invoke(main, ["report", "--help"]).exit_code == 0
    assert runner.invoke(main, ["actions", "--help"]).exit_code == 0
