"""A fresh user's trial (#16): folder bounds, policy rules in replay/check, clean errors."""

from __future__ import annotations

import os
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
    assert "[policy]: rule 'b': bogus: unknown key" in out
    assert "[policy]: rule 'c': count: Input should be a valid integer" in out


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
        assert "known kinds: " in out
        assert "xid" in out


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
    assert '"policy"' in out
    assert len(out.splitlines()) > 50


# ------------------------------------------------------------------ replay and check rules
BURST = """\
[Wed Dec  2 10:00:00 2026] Linux version 6.8.0-45-generic (buildd@lcy02) #45-Ubuntu SMP
[Wed Dec  2 10:01:00 2026] NVRM: Xid (PCI:0000:b1:00): 43, pid=1234, name=python, Ch 00000008
[Wed Dec  2 10:02:00 2026] NVRM: Xid (PCI:0000:b1:00): 43, pid=1234, name=python, Ch 00000008
[Wed Dec  2 10:03:00 2026] NVRM: Xid (PCI:0000:b1:00): 43, pid=1234, name=python, Ch 00000008
[Wed Dec  2 10:04:00 2026] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.
"""
RULES = """\
[[policy.rule]]
name = "xid43-repeat"
kind = "xid"
code = "43"
count = 3
window = "10m"
severity = "major"
action = "reset_gpu"

[[policy.rule]]
name = "quiet79"
kind = "xid"
code = "79"
ignore = true
"""


def test_replay_applies_the_policy_rules_of_config(tmp_path: Path) -> None:
    log = tmp_path / "burst.log"
    log.write_text(BURST)
    config = tmp_path / "g.toml"
    config.write_text(RULES)
    plain = CliRunner().invoke(main, ["replay", str(log)])
    assert "CRITICAL reboot_node" in plain.output
    out = CliRunner().invoke(main, ["replay", "--config", str(config), str(log)])
    assert out.exit_code == 2, out.output
    assert "MAJOR    reset_gpu        0000:b1:00.0 [xid 43]" in out.output
    assert "reboot" not in out.output  # the ignored Xid 79 asks for nothing
    assert "cordon" not in out.output


def test_check_applies_the_policy_rules_of_config(tmp_path: Path) -> None:
    log = tmp_path / "burst.log"
    log.write_text(BURST)
    config = tmp_path / "g.toml"
    config.write_text(RULES)
    plain = CliRunner().invoke(main, ["check", "--node", "n1", "--input", str(log)])
    assert plain.exit_code == 3, plain.output
    out = CliRunner().invoke(main, ["check", "--node", "n1", "--config", str(config),
                                    "--input", str(log)])
    assert out.exit_code == 2, out.output
    assert "major    xid 43 on 0000:b1:00.0" in out.output
    assert "xid 79" not in out.output


def _tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def test_journal_without_entries_falls_back_to_dmesg(tmp_path: Path) -> None:
    from collectors.node_check import Source, gather

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "journalctl", "echo '-- No entries --'")
    _tool(bin_dir, "dmesg", "echo '[Wed Dec  2 10:04:00 2026] NVRM: Xid (PCI:0000:3b:00): 79, "
          "pid=1, GPU has fallen off the bus.'")
    out = tmp_path / "out"
    out.mkdir()
    sources = ((Source("kernel.log", (str(bin_dir / "journalctl"), "-k", "-b")),
                Source("kernel.log", (str(bin_dir / "dmesg"), "-T"))),)
    files, gaps = gather(out, sources=sources)
    assert gaps == []
    assert [f.name for f in files] == ["kernel.log"]
    assert "Xid" in files[0].read_text()
    _tool(bin_dir, "dmesg", "exit 1")
    files, gaps = gather(out, sources=sources)
    assert files == []
    assert "printed no entries" in gaps[0].why or "exited 1" in gaps[0].why


def test_nothing_read_is_not_judged_not_ready(tmp_path: Path) -> None:
    empty = tmp_path / "empty.log"
    empty.write_text("")
    out = CliRunner().invoke(main, ["check", "--node", "n1", "--input", str(empty)])
    assert out.exit_code == 0, out.output
    assert "n1: not judged: nothing could be read" in out.output
    assert "ready" not in out.output.replace("not judged", "")


def test_slurm_dry_run_gives_a_verdict_without_slurmctld(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "scontrol", "echo 'scontrol: error: Unable to contact slurm controller' >&2;"
          " exit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "one.log"
    log.write_text("NVRM: Xid (PCI:0000:b1:00): 79, pid=1, GPU has fallen off the bus.\n")
    out = CliRunner().invoke(main, ["check", "--slurm", "--dry-run", "--node", "n1",
                                    "--input", str(log)])
    assert out.exit_code == 3, out.output
    assert "warning: the node's Slurm state could not be read" in out.output
    assert "n1: NOT ready: 1 finding(s) at or above major" in out.output


# ------------------------------------------------------------------ diagnose DIR bounds
XID79 = ("[Wed Dec  2 10:04:00 2026] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, "
         "GPU has fallen off the bus.\n")


def _tree(tmp_path: Path) -> Path:
    top = tmp_path / "logs"
    (top / "node1").mkdir(parents=True)
    (top / "node1" / "kern.log").write_text(XID79)
    (top / ".git").mkdir()
    (top / ".git" / "kern.log").write_text(XID79)
    venv = top / "env"
    (venv / "lib").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr\n")
    (venv / "lib" / "kern.log").write_text(XID79)
    (top / "site-packages").mkdir()
    (top / "site-packages" / "x.log").write_text(XID79)
    (top / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (top / "weights.log").write_bytes(b"\x89\x00\x01\x02\x03\x04\x05\x06" * 200)
    (top / "model.pkl").write_text(XID79)
    (top / "loop").symlink_to(top)
    (top / "link.log").symlink_to(top / "node1" / "kern.log")
    return top


def test_a_folder_walk_skips_what_is_not_a_log(tmp_path: Path) -> None:
    from collectors.folder import WalkReport, walk

    top = _tree(tmp_path)
    report = WalkReport()
    members = [m.path for m in walk([str(top)], report)]
    assert members == [str(top / "node1" / "kern.log")]
    assert report.skipped["binary file(s)"] == 2
    assert report.skipped["symbolic link(s)"] == 2
    assert report.skipped["folder(s) of code or hidden"] == 3
    assert report.skipped["file(s) whose extension is not a log's"] == 1


def test_a_named_file_is_never_skipped(tmp_path: Path) -> None:
    from collectors.folder import walk

    path = tmp_path / "model.pkl"
    path.write_text(XID79)
    assert [m.path for m in walk([str(path)])] == [str(path)]


def test_diagnose_of_a_folder_says_what_it_skipped(tmp_path: Path) -> None:
    top = _tree(tmp_path)
    out = CliRunner().invoke(main, ["diagnose", str(top)])
    assert out.exit_code == 3, out.output
    notes = [line for line in out.output.splitlines() if line.startswith("note: folder walk")]
    assert len(notes) == 1
    assert "2 binary file(s)" in notes[0]
    assert "2 symbolic link(s)" in notes[0]


def test_a_large_folder_member_is_read_from_its_tail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import collectors.folder
    from gpuhealth.diagnose import diagnose

    monkeypatch.setattr(collectors.folder, "MAX_FILE_BYTES", 4096)
    top = tmp_path / "logs"
    top.mkdir()
    noise = "[Wed Dec  2 09:00:00 2026] usb 1-1: new high-speed USB device number 3\n"
    old = "[Wed Dec  2 08:00:00 2026] NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE\n"
    (top / "n1.log").write_text(old + noise * 200 + XID79)
    result = diagnose([str(top)])
    codes = {f.code for f in result.findings}
    assert "79" in codes
    assert "48" not in codes  # before the tail: not read
    assert result.walk.tails == [str(top / "n1.log")]
    assert "read from their last" in result.walk.summary()
    whole = diagnose([str(top / "n1.log")])  # named: read whole
    assert "48" in {f.code for f in whole.findings}


def test_a_walk_stops_after_the_file_cap(tmp_path: Path) -> None:
    from collectors.folder import WalkReport, walk

    for i in range(5):
        (tmp_path / f"n{i}.log").write_text(XID79)
    report = WalkReport(max_files=3)
    assert len(list(walk([str(tmp_path)], report))) == 3
    assert report.stopped
    assert "stopped after 3 files" in report.summary()


def test_line_protocol_is_streamed_not_held(tmp_path: Path) -> None:
    import types

    from collectors.artifact import ArtifactResult
    from gpuhealth.diagnose import _line_protocol

    path = tmp_path / "r.lp"
    path.write_text("gpu,node=n1,entity=GPU-1 gpu_temperature_celsius=40 1764669600000000000\n")
    records = _line_protocol(str(path), ArtifactResult(), now=1764669700.0)
    assert isinstance(records, types.GeneratorType)
    assert len(list(records)) == 1


# ------------------------------------------------------------------ cosmetics
def test_a_stop_signal_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import signal
    import threading

    from gpuhealth.service import _signals

    stop = threading.Event()
    with caplog.at_level(logging.INFO, logger="gpuhealth.service"), _signals(stop):
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler)
        handler(signal.SIGINT, None)
        handler(signal.SIGINT, None)
    assert stop.is_set()
    assert [r.getMessage() for r in caplog.records].count("received SIGINT; stopping") == 1
