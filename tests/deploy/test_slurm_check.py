"""deploy/slurm/gpuhealth-check: the prolog fails and the health check drains on a critical GPU.

`nvidia-smi` and `scontrol` are stand-ins on PATH (a script printing a recorded
`nvidia-smi` output, and one recording its arguments); `gpuhealth diagnose` is the real
one. The real-Slurm behaviour of a failed prolog (drain and requeue) is slurmd's own.
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
CASES = ROOT / "tests" / "fixtures"
CRITICAL = CASES / "cases" / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"
HEALTHY = CASES / "nvidia-smi" / "titan-v-q.txt"
TOOLS = ("sh", "cat", "cut", "grep", "hostname", "mktemp", "rm", "sed", "timeout", "tr")


def run(tmp_path: Path, smi_output: Path | None, *, state: str = "IDLE",
        **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    if smi_output is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat '{smi_output}'\nexit 255\n")
        smi.chmod(0o755)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> '{calls}'\n"
                        f"[ \"$1\" = show ] && echo \"NodeName=x Arch=x86_64 State={state} "
                        "Weight=1\"\nexit 0\n")
    scontrol.chmod(0o755)
    tools = tmp_path / "tools"  # only these: no host nvidia-smi, scontrol or gpuhealth
    tools.mkdir(exist_ok=True)
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        if not (tools / tool).exists():
            (tools / tool).symlink_to(found)
    path = os.pathsep.join([str(bin_dir), str(tools)])
    full = {"PATH": path, "GPUHEALTH_BIN": str(Path(sys.executable).with_name("gpuhealth")),
            "HOME": str(tmp_path), **env}
    done = subprocess.run(["/bin/sh", str(CHECK)], env=full, capture_output=True, text=True,
                          timeout=120, check=False)
    return done, calls.read_text() if calls.exists() else ""


@pytest.fixture(autouse=True)
def _tools() -> None:
    for tool in TOOLS:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing")


def test_prolog_fails_on_a_gpu_fallen_off_the_bus(tmp_path: Path) -> None:
    done, calls = run(tmp_path, CRITICAL, SLURM_JOB_ID="42",
                      SLURM_SCRIPT_CONTEXT="prolog_slurmd")
    assert done.returncode == 1, done.stderr
    assert "prolog of job 42" in done.stderr
    assert "Xid 79" in done.stderr
    assert calls == ""  # slurmd drains and requeues on a failed prolog, not the script


def test_prolog_passes_a_healthy_node(tmp_path: Path) -> None:
    done, calls = run(tmp_path, HEALTHY, SLURM_JOB_ID="42")
    assert done.returncode == 0, done.stderr
    assert calls == ""


def test_health_check_drains_with_a_gpuhealth_reason(tmp_path: Path) -> None:
    done, calls = run(tmp_path, CRITICAL)
    assert done.returncode == 0, done.stderr
    update = [line for line in calls.splitlines() if line.startswith("update")]
    assert len(update) == 1, calls
    assert "State=DRAIN" in update[0]
    assert "Reason=gpuhealth: node check: CRITICAL" in update[0]


def test_health_check_leaves_a_drained_node_and_a_healthy_one(tmp_path: Path) -> None:
    _, calls = run(tmp_path, CRITICAL, state="IDLE+DRAIN")
    assert "update" not in calls
    _, calls = run(tmp_path, HEALTHY)
    assert "update" not in calls


def test_it_never_fails_for_want_of_tools(tmp_path: Path) -> None:
    done, _ = run(tmp_path, None, SLURM_JOB_ID="42")
    assert done.returncode == 0
    assert "nvidia-smi not found" in done.stderr
