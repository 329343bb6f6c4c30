"""The CLI as a user runs it: the diagnose --json contract, exit statuses, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from gpuhealth.cli import main
from tests.conftest import cases_dir

SCHEMA = json.loads((Path(__file__).parents[2] / "gpuhealth" / "diagnose.schema.json").read_text())
CASES = cases_dir()
EXPECTED = json.loads((CASES / "expected.json").read_text())
EXIT = {"info": 0, "warning": 1, "major": 2, "critical": 3}


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_case_output_matches_the_schema_and_exit_status(name: str) -> None:
    context = [f"--context={k}={v}" for k, v in EXPECTED[name].get("context", {}).items()]
    code, out, _ = invoke("diagnose", "--json", *context, str(CASES / name))
    doc = json.loads(out)
    jsonschema.validate(doc, SCHEMA)
    assert code == EXIT[doc["worst_severity"]]
    for finding in doc["findings"]:
        assert finding["evidence"], finding


def test_human_output_names_severity_action_and_evidence() -> None:
    code, out, _ = invoke(
        "diagnose", str(CASES / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log")
    )
    assert code == 3
    assert "CRITICAL" in out
    assert "reboot_node" in out
    assert "Xid" in out


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"", "empty file"), (b"\x7fELF\x02\x01\x01\x00\x00\x00garbage", "binary")],
)
def test_unparseable_input_exits_4_with_a_reason_naming_the_file(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    path = tmp_path / "input.log"
    path.write_bytes(content)
    code, out, _ = invoke("diagnose", "--json", str(path))
    doc = json.loads(out)
    assert code == 4
    assert doc["worst_severity"] == "info"
    assert doc["errors"][0]["file"] == str(path)
    assert reason in doc["errors"][0]["reason"]


def test_missing_file_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    code, out, err = invoke("diagnose", str(tmp_path / "nope.log"))
    assert code == 4
    assert "nope.log" in err
    assert "Traceback" not in err
    assert "nothing could be read" in out  # not "no findings", which reads as healthy
    assert "no findings" not in out


def test_usage_errors_exit_64() -> None:
    assert invoke("diagnose")[0] == 64
    assert invoke("diagnose", "--context", "novalue", "x")[0] == 64


def test_plugins_list_names_every_group() -> None:
    code, out, _ = invoke("plugins", "list")
    assert code == 0
    for group in ("collectors", "stores", "detectors", "notifiers", "schedulers"):
        assert f"gpuhealth.{group}:" in out
    assert "nvml" in out


def test_each_file_of_a_folder_is_its_own_node(tmp_path: Path) -> None:
    """An NVLink board in one file must not make another file's PCIe cards 'NVLink expected'."""
    import shutil

    for prefix in ("010", "040"):
        (src,) = CASES.glob(f"{prefix}-*")
        shutil.copy(src, tmp_path / src.name)
    code, out, _ = invoke("diagnose", "--json", str(tmp_path))
    doc = json.loads(out)
    by_node = {f["node"][:3]: f for f in doc["findings"] if f["kind"] == "nvlink"}
    assert by_node["040"]["severity"] == "major"
    assert by_node["010"]["severity"] == "warning"  # topology unknown, not borrowed from 040
    assert code == 2


def test_config_check_takes_the_file_as_argument_or_as_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[remediation]\nact_on_predictions = "yes"\n')
    for args in (["config", "check", str(bad)], ["config", "check", "--config", str(bad)]):
        code, _, err = invoke(*args)
        assert code == 1
        assert "act_on_predictions" in err
    boolean = tmp_path / "boolean.toml"
    boolean.write_text("[remediation]\ncritical_reserve_fraction = true\n")
    code, _, err = invoke("config", "check", str(boolean))
    assert code == 1
    assert "critical_reserve_fraction: a number is needed, got the boolean true" in err
    good = tmp_path / "good.toml"
    good.write_text("[remediation]\nact_on_predictions = true\ncritical_reserve_fraction = 0\n")
    assert invoke("config", "check", "--config", str(good))[0] == 0
    # a non-sqlite store shows no SQLite file
    influx = tmp_path / "influx.toml"
    influx.write_text('[storage]\ntype = "influxdb"\nurl = "http://127.0.0.1:9"\n')
    code, out, _ = invoke("config", "check", "--config", str(influx))
    assert code == 0
    assert "gpuhealth.sqlite" not in out
    promql = tmp_path / "promql.toml"
    promql.write_text('[storage]\ntype = "promql"\n')
    code, _, err = invoke("config", "check", str(promql))
    assert code == 1
    assert "url" in err
    assert "required when type = 'promql'" in err


def test_import_into_an_unreachable_store_says_the_samples_wait_in_the_spool(
        tmp_path: Path) -> None:
    config = tmp_path / "influx.toml"
    config.write_text(f'[node]\ndata_dir = "{tmp_path / "data"}"\n'
                      '[storage]\ntype = "influxdb"\nurl = "http://127.0.0.1:9"\n')
    recording = tmp_path / "fleet.lp"
    recording.write_text("gpu,node=n1,entity=GPU-0 temperature_celsius=41 1796000000000000000\n")
    code, _, err = invoke("import", "--config", str(config), str(recording))
    assert code == 0
    assert "accepted 1 samples" in err  # not "imported": it is only in the spool
    assert "warning: the store did not answer: 1 record(s) wait in the spool" in err


def test_export_refuses_a_window_that_ends_before_it_starts(tmp_path: Path) -> None:
    code, _, err = invoke("export", "--since", "1d", "--until", "2d")
    assert code == 64
    assert "is after --until" in err


def test_export_warns_of_an_unknown_metric_and_import_of_a_wrong_precision(
        tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[node]\ndata_dir = "{tmp_path / "data"}"\n')
    code, _, err = invoke("export", "--config", str(config), "--since", "1h", "--metric",
                          "gpu_temperature")
    assert code == 0
    assert "--metric gpu_temperature: not a catalogued metric" in err
    recording = tmp_path / "ns.lp"
    recording.write_text("gpu,node=n1,entity=GPU-0 temperature_celsius=41 1796000000000000000\n")
    code, _, err = invoke("import", "--config", str(config), "--precision", "s", str(recording))
    assert code == 1
    assert "is --precision s the unit of the file's timestamps?" in err
    # a URL that is not one is refused when the file is checked, not when it is used
    bad = tmp_path / "bad.toml"
    bad.write_text('[storage]\ntype = "promql"\nurl = "not a url"\n')
    code, _, err = invoke("config", "check", str(bad))
    assert code == 1
    assert "not an http:// or https:// URL" in err


def test_an_empty_folder_and_a_zero_budget_are_told_not_crashed(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, _ = invoke("diagnose", str(empty))
    assert code == 4
    assert "nothing in the input is a log or tool output gpuhealth knows" in out
    code, _, err = invoke("replay", "--max-disrupted-fraction", "0",
                          str(CASES / sorted(EXPECTED)[0]))
    assert code == 64
    assert "max-disrupted-fraction" in err


def test_replay_puts_unreadable_lines_on_stderr(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:b1:00): 79, pid=1, GPU has fallen off the bus.\n")
    recording = tmp_path / "fleet.lp"
    recording.write_text("gpu,node=n1,entity=GPU-0 temperature_celsius=41 1796000000000000000\n"
                         "gpu,node=n1,entity=GPU-0 temperature_celsius=")
    code, out, err = invoke("replay", str(log), str(recording))
    assert code == 3  # the Xid 79 is critical: replay exits as diagnose does
    assert "error:" not in out
    assert f"error: {recording}:2: truncated" in err


def test_a_folder_walk_skips_hidden_folders_and_environments(tmp_path: Path) -> None:
    import shutil

    (src,) = CASES.glob("001-*")
    for sub in (".venv/lib", "site-packages", "__pycache__", "logs"):
        (tmp_path / sub).mkdir(parents=True)
        shutil.copy(src, tmp_path / sub / src.name)
    code, out, _ = invoke("diagnose", "--json", str(tmp_path))
    files = {e["file"].split(str(tmp_path))[1] for f in json.loads(out)["findings"]
             for e in f["evidence"]}
    assert code == 3
    assert files == {f"/logs/{src.name}"}
