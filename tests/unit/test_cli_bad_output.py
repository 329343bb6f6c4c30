"""Output that cannot be written and side files of the wrong shape: a named error and a
distinct exit status, never a traceback, never a severity's status (left from the fresh-user
trial of 2026-12-04)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuhealth.cli import EXIT_CONFIG, EXIT_IOERR, EXIT_USAGE, main
from remediation.audit import MAX_RECORD_BYTES, read_audit_log

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "cases"
XID79 = CASES / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"
LINE = "gpu_temperature_celsius,node=n1,gpu=GPU-1 value=50 1764800000000000000\n"
FULL = "/dev/full"  # every write fails with ENOSPC (Linux)

needs_dev_full = pytest.mark.skipif(not os.path.exists(FULL), reason="no /dev/full here")


def cli(*args: str, stdout: str | None = None) -> subprocess.CompletedProcess[str]:
    """The console script in a child process (a full stdout cannot be faked in-process)."""
    with open(stdout or os.devnull, "w") as out:
        return subprocess.run(
            [sys.executable, "-c", "from gpuhealth.cli import main; main()", *args],
            stdout=out, stderr=subprocess.PIPE, text=True, timeout=120, check=False)


@needs_dev_full
@pytest.mark.parametrize("args", [
    ("replay", "{lp}", "--json"), ("replay", "{lp}"),
    ("diagnose", str(XID79), "--json"), ("diagnose", str(XID79)),
])
def test_a_full_stdout_is_an_io_error_not_a_severity(tmp_path: Path, args: tuple[str, ...]):
    lp = tmp_path / "ok.lp"
    lp.write_text(LINE)
    done = cli(*(a.format(lp=lp) for a in args), stdout=FULL)
    assert done.returncode == EXIT_IOERR, done.stderr
    assert "cannot write the output: No space left on device" in done.stderr
    assert "Traceback" not in done.stderr


@needs_dev_full
def test_a_full_events_file_is_an_io_error(tmp_path: Path):
    lp = tmp_path / "ok.lp"
    lp.write_text(LINE)
    done = cli("replay", str(lp), "--events", FULL)
    assert done.returncode == EXIT_IOERR, done.stderr
    assert f"cannot write --events {FULL}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("content", "says"), [
    ("{bad", ":1: not JSON"),
    ("[1, 2]", "expected a JSON object of node names, got list"),
    ('{"n1": "x"}', "'n1': expected an object of facts, got str"),
    ('{"n1": {"context": [1]}}', "'n1': 'context' must be an object of facts"),
    ('{"n1": {"nvlink": {"a": 1}}}', "fact 'nvlink' must be a string"),
    ('{"n1": {"nvlnk": "absent"}}', "unknown fact 'nvlnk'"),
])
def test_a_bad_node_facts_file_is_a_usage_error_naming_it(tmp_path: Path, content: str,
                                                           says: str):
    facts = tmp_path / "nf.json"
    facts.write_text(content)
    result = CliRunner().invoke(main, ["replay", str(XID79), "--node-facts", str(facts)])
    assert result.exit_code == EXIT_USAGE, result.output
    assert str(facts) in result.output
    assert says in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_good_node_facts_are_still_read(tmp_path: Path):
    facts = tmp_path / "nf.json"
    facts.write_text(json.dumps({XID79.name: {"context": {"nvlink": "absent"}},
                                 "other.log": {"worst_severity": "info"}}))
    result = CliRunner().invoke(main, ["replay", str(XID79), "--node-facts", str(facts)])
    assert result.exit_code == 3, result.output


def test_json_and_events_on_stdout_are_refused(tmp_path: Path):
    result = CliRunner().invoke(main, ["replay", str(XID79), "--json", "--events", "-"])
    assert result.exit_code == EXIT_USAGE
    assert "both write to stdout" in result.output


def test_a_bad_config_is_a_config_error_as_for_run(tmp_path: Path):
    bad = tmp_path / "c.toml"
    bad.write_text("[metrics]\nprot = 1\n")
    for path in (bad, tmp_path / "nosuch.toml"):
        result = CliRunner().invoke(main, ["replay", str(XID79), "--config", str(path)])
        assert result.exit_code == EXIT_CONFIG, result.output
        assert str(path) in result.output


def test_an_audit_log_that_is_not_a_regular_file_is_refused(tmp_path: Path):
    result = CliRunner().invoke(main, ["replay", str(XID79), "--audit-log", str(tmp_path)])
    assert result.exit_code in (EXIT_USAGE, 2), result.output  # click refuses a folder
    if os.path.exists(FULL):  # reads without end: it was read into memory until killed
        result = CliRunner().invoke(main, ["replay", str(XID79), "--audit-log", FULL])
        assert result.exit_code == EXIT_USAGE, result.output
        assert "not a regular file" in result.output
        with pytest.raises(ValueError, match="regular file"):
            read_audit_log(FULL)


def test_an_overlong_audit_line_is_skipped_and_the_records_around_it_kept(tmp_path: Path):
    path = tmp_path / "audit.jsonl"
    CliRunner().invoke(main, ["replay", str(XID79), "--audit-log", str(path)])
    good = path.read_bytes()
    assert good.count(b"\n") >= 2
    path.write_bytes(good + b"x" * (MAX_RECORD_BYTES * 2 + 10) + b"\n" + good)
    records = read_audit_log(str(path))
    assert len(records) == 2 * good.count(b"\n")


def test_a_folder_with_nothing_to_replay_is_named(tmp_path: Path):
    (tmp_path / "labels.json").write_text("{}")
    result = CliRunner().invoke(main, ["replay", str(tmp_path)])
    assert result.exit_code == 4, result.output
    assert f"nothing in {tmp_path} could be replayed" in result.output
