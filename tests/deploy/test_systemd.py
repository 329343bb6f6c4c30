"""The systemd units: `systemd-analyze verify` says nothing, and each has an exposure score.

`verify` also checks that ExecStart's program exists: where ``/opt/gpuhealth`` (the
documented install) is absent, the units are checked as copies whose only change is
that path, replaced by this environment's ``gpuhealth``. ``.ci/run`` checks the files as
shipped and prints ``systemd-analyze security --offline=yes`` into the CI log.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT

UNITS = ("gpuhealth-agent.service", "gpuhealth-controller.service")
INSTALLED = "/opt/gpuhealth/bin/gpuhealth"


def analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        why = "systemd-analyze is not installed (apt-get install systemd)"
        if os.environ.get("GPUHEALTH_DEPLOY_TOOLS") == "required":
            pytest.fail(why)
        pytest.skip(why)
    return found


def units(tmp_path: Path) -> list[Path]:
    """Copies of the shipped units in ``tmp_path`` (a test may break its copy, never the
    shipped file), with ExecStart's path replaced unless the documented install exists."""
    shipped = [ROOT / "deploy" / "systemd" / name for name in UNITS]
    here = INSTALLED if Path(INSTALLED).is_file() else str(
        Path(sys.executable).with_name("gpuhealth"))
    assert Path(here).is_file()
    out = []
    for unit in shipped:
        text = unit.read_text()
        assert text.count(INSTALLED) == 1
        copy = tmp_path / unit.name
        copy.write_text(text.replace(INSTALLED, here))
        out.append(copy)
    return out


def test_units_verify_without_output(tmp_path: Path) -> None:
    done = subprocess.run([analyze(), "verify", *map(str, units(tmp_path))],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_verify_fails_on_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: an unknown key is stderr output (and exit 0)."""
    (agent, _) = units(tmp_path)
    agent.write_text(agent.read_text().replace("PrivateTmp=yes", "PrivateTemp=yes"))
    done = subprocess.run([analyze(), "verify", str(agent)], capture_output=True, text=True,
                          check=False)
    assert "Unknown key 'PrivateTemp'" in done.stderr


@pytest.mark.parametrize("name", UNITS)
def test_exposure_score(tmp_path: Path, name: str) -> None:
    (unit,) = (u for u in units(tmp_path) if u.name == name)
    done = subprocess.run([analyze(), "security", "--offline=yes", "--no-pager", str(unit)],
                          capture_output=True, text=True, check=False)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert m, done.stdout + done.stderr
    score = float(m[1])
    # the agent keeps its devices, the host's network and CAP_SYSLOG; the controller nothing
    assert score <= (3.0 if "agent" in name else 2.0), done.stdout


def test_units_run_the_documented_commands() -> None:
    for name, role in zip(UNITS, ("agent", "controller"), strict=True):
        text = (ROOT / "deploy" / "systemd" / name).read_text()
        assert f"ExecStart={INSTALLED} {role} --config /etc/gpuhealth/{role}.toml" in text
        for line in ("Restart=on-failure", "NoNewPrivileges=yes", "ProtectSystem=strict",
                     "ReadWritePaths=/var/lib/gpuhealth", "PrivateTmp=yes",
                     f"EnvironmentFile=/etc/gpuhealth/{role}.env", "User=gpuhealth"):
            assert line in text.splitlines(), (name, line)
