"""``gpuhealth check`` reads: a missing, failing or hanging tool is a gap, never a fault."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from collectors.node_check import Source, gather
from gpuhealth.cli import main


def _tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_gaps_are_named_and_the_next_tool_is_tried(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "hangs", "exec /bin/sleep 30")
    _tool(bin_dir, "fails", "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    _tool(bin_dir, "answers", "echo 'NVRM: loading NVIDIA UNIX x86_64 Kernel Module'")
    monkeypatch.setenv("PATH", str(bin_dir))
    out = tmp_path / "out"
    out.mkdir()
    files, gaps = gather(out, timeout_seconds=0.5, sources=(
        (Source("a.xml", ("missing",)),),
        (Source("b.log", ("hangs",)),),
        (Source("c.xml", ("fails",)),),
        (Source("d.log", ("fails",)), Source("d.log", ("answers",))),
    ))
    assert [f.name for f in files] == ["d.log"]
    assert [(g.what, g.why.split(" ")[0]) for g in gaps] == [
        ("a.xml", "missing"), ("b.log", "hangs"), ("c.xml", "fails")]
    assert "did not answer within" in gaps[1].why
    assert "exited 9: NVIDIA-SMI has failed" in gaps[2].why


def test_a_node_without_tools_is_not_failed(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, no journalctl, no dmesg
    result = CliRunner().invoke(main, ["check", "--node", "n1"])
    assert result.exit_code == 0, result.output
    assert "not read: nvidia-smi-q.xml: nvidia-smi not installed" in result.output
    assert "n1: not judged: nothing could be read" in result.output  # nor called ready
    assert "n1: ready" not in result.output
    assert os.environ["PATH"] == str(tmp_path)


def test_a_critical_artifact_fails_the_check_with_its_findings() -> None:
    case = (Path(__file__).resolve().parents[1] / "fixtures" / "cases"
            / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log")
    result = CliRunner().invoke(main, ["check", "--node", "n1", "--input", str(case)])
    assert result.exit_code == 3
    assert "critical xid 79" in result.output
    assert "n1: NOT ready" in result.output
    warning_only = CliRunner().invoke(main, ["check", "--node", "n1", "--fail-at", "critical",
                                             "--input", str(case)])
    assert warning_only.exit_code == 3
