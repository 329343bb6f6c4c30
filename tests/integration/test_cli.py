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
    code, _, err = invoke("diagnose", str(tmp_path / "nope.log"))
    assert code == 4
    assert "nope.log" in err
    assert "Traceback" not in err


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
