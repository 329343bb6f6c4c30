"""Fault kinds that were missed (issue #14 item 7) diagnose as an expert would.

Each file in ``tests/fixtures/artifacts/missed`` is a real artifact from a public
issue tracker (``README.md`` there names the source); ``expected.json`` beside them
gives the verdict in the format of ``../shared/cases/expected.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuhealth.diagnose import diagnose

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "artifacts" / "missed"
EXPECTED: dict[str, dict[str, object]] = json.loads((FIXTURES / "expected.json").read_text())


def _diagnose(path: Path, context: dict[str, str] | None = None) -> dict[str, object]:
    result = diagnose([str(path)], context or {})
    assert result.exit_status != 4
    out: dict[str, object] = result.to_json()
    return out


def test_every_fixture_has_a_verdict() -> None:
    meta = {"expected.json", "README.md"}
    files = {p.name for p in FIXTURES.iterdir() if p.is_file() and p.name not in meta}
    assert files == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_missed_kind(name: str) -> None:
    expected = EXPECTED[name]
    context = expected.get("context", {})
    assert isinstance(context, dict)
    out = _diagnose(FIXTURES / name, context)
    detail = json.dumps({"findings": out["findings"], "errors": out["errors"]}, indent=1)[:4000]
    assert out["worst_severity"] == expected["worst_severity"], detail
    acceptable = expected["acceptable_actions"]
    assert isinstance(acceptable, list)
    assert set(out["worst_actions"]) <= set(acceptable), detail  # type: ignore[arg-type]


def test_shm_failure_folds_the_system_error() -> None:
    out = _diagnose(FIXTURES / "nccl-2.4-shm-open-permission-denied-unhandled-system-error.log")
    findings = out["findings"]
    assert isinstance(findings, list)
    assert [f["kind"] for f in findings] == ["shm"]
    assert "Permission denied" in findings[0]["summary"]


def test_local_protection_error_on_one_node_stays_a_warning(tmp_path: Path) -> None:
    text = (FIXTURES / "nccl-2.x-two-nodes-vm-error-4-local-protection-gdr.log").read_text()
    one = tmp_path / "one.log"
    one.write_text("\n".join(ln for ln in text.splitlines() if ln.startswith("node-b")) + "\n")
    out = _diagnose(one)
    assert out["worst_severity"] == "warning"
    assert out["worst_actions"] == ["restart_app"]


def test_local_protection_error_without_gdr_stays_a_warning(tmp_path: Path) -> None:
    text = (FIXTURES / "nccl-2.x-two-nodes-vm-error-4-local-protection-gdr.log").read_text()
    off = tmp_path / "off.log"
    off.write_text(
        "node-a:58934:58934 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 0\n" + text
    )
    out = _diagnose(off)
    assert out["worst_severity"] == "warning"
