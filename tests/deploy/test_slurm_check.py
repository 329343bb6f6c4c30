"""deploy/slurm/gpuhealth-check: Slurm's argument-less entry to `gpuhealth check`.

As a prolog it runs the real `gpuhealth check` over a stand-in `nvidia-smi` (a script
printing a recorded output) and fails the prolog on a bad GPU. As the health check it
hands over to `gpuhealth check --slurm`, whose drains and resumes are tested on real
Slurm in tests/integration/test_check_slurm.py; here a recording stand-in checks the
arguments it gets.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT

CHECK = ROOT / "deploy" / "slurm" / "gpuhealth-check"
FIXTURES = ROOT / "tests" / "fixtures"
CRITICAL = FIXTURES / "cases" / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"
HEALTHY = FIXTURES / "nvidia-smi" / "titan-v-q.txt"
TOOLS = ("sh", "cat", "hostname")
GPUHEALTH = Path(sys.executable).with_name("gpuhealth")


def run(tmp_path: Path, smi_output: Path | None, *, gpuhealth: Path | None = GPUHEALTH,
        **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if smi_output is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat '{smi_output}'\n")
        smi.chmod(0o755)
    tools = tmp_path / "tools"  # only these: no host nvidia-smi, journalctl, scontrol
    tools.mkdir(exist_ok=True)
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        if not (tools / tool).exists():
            (tools / tool).symlink_to(found)
    full = {"PATH": os.pathsep.join([str(bin_dir), str(tools)]), "HOME": str(tmp_path),
            "GPUHEALTH_BIN": str(gpuhealth or tmp_path / "absent"),
            "GPUHEALTH_CHECK_CONFIG": str(tmp_path / "none.toml"), **env}
    return subprocess.run(["/bin/sh", str(CHECK)], env=full, capture_output=True, text=True,
                          timeout=120, check=False)


def recorder(tmp_path: Path, status: int = 0) -> tuple[Path, Path]:
    """A stand-in gpuhealth that records its arguments and exits with ``status``."""
    calls = tmp_path / "gpuhealth.calls"
    fake = tmp_path / "fake-gpuhealth"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> '{calls}'\nexit {status}\n")
    fake.chmod(0o755)
    return fake, calls


@pytest.fixture(autouse=True)
def _tools() -> None:
    for tool in TOOLS:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing")


def test_prolog_fails_on_a_gpu_fallen_off_the_bus(tmp_path: Path) -> None:
    done = run(tmp_path, CRITICAL, SLURM_JOB_ID="42", SLURM_SCRIPT_CONTEXT="prolog_slurmd")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "prolog of job 42" in done.stderr
    assert "exit 3" in done.stderr  # gpuhealth check: critical
    assert "xid" in done.stdout.lower()


def test_prolog_passes_a_healthy_node(tmp_path: Path) -> None:
    done = run(tmp_path, HEALTHY, SLURM_JOB_ID="42")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ready" in done.stdout


def test_prolog_never_fails_for_what_it_could_not_check(tmp_path: Path) -> None:
    assert run(tmp_path, None, SLURM_JOB_ID="42").returncode == 0  # no nvidia-smi
    assert run(tmp_path, CRITICAL, gpuhealth=None, SLURM_JOB_ID="42").returncode == 0
    broken = tmp_path / "broken.toml"
    broken.write_text("[node\n")
    done = run(tmp_path, CRITICAL, SLURM_JOB_ID="42", GPUHEALTH_CHECK_CONFIG=str(broken))
    assert done.returncode == 0
    assert "could not judge" in done.stderr


def test_prolog_passes_the_settings_on(tmp_path: Path) -> None:
    fake, calls = recorder(tmp_path, status=2)
    config = tmp_path / "check.toml"
    config.write_text("")
    done = run(tmp_path, HEALTHY, gpuhealth=fake, SLURM_JOB_ID="7",
               GPUHEALTH_CHECK_FAIL_AT="critical", GPUHEALTH_CHECK_TIMEOUT="5",
               GPUHEALTH_CHECK_CONFIG=str(config))
    assert done.returncode == 1
    assert calls.read_text() == f"check --fail-at critical --timeout 5 --config {config}\n"


def test_health_check_hands_over_to_check_slurm(tmp_path: Path) -> None:
    fake, calls = recorder(tmp_path, status=3)
    done = run(tmp_path, HEALTHY, gpuhealth=fake)
    assert done.returncode == 0  # slurmd ignores it; the drain is gpuhealth check's
    assert calls.read_text() == "check --slurm\n"
    calls.unlink()
    run(tmp_path, HEALTHY, gpuhealth=fake, GPUHEALTH_CHECK_DRY_RUN="1")
    assert calls.read_text() == "check --dry-run --slurm\n"
