"""Real-world nvidia-smi / DCGM / dcgm-exporter artifacts diagnose as an expert would.

Each file in ``tests/fixtures/artifacts/gpu`` is one pasted artifact (anonymised;
codes, counters and formats kept); ``expected.json`` beside them gives the verdict
in the format of ``../shared/cases/expected.json``. A fixture added there is tested
with no code change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.artifact import command_of
from gpuhealth.diagnose import diagnose

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "artifacts" / "gpu"
EXPECTED: dict[str, dict[str, object]] = json.loads((FIXTURES / "expected.json").read_text())


def test_every_fixture_has_a_verdict() -> None:
    files = {p.name for p in FIXTURES.iterdir() if p.is_file() and p.name != "expected.json"}
    assert files == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_artifact(name: str) -> None:
    expected = EXPECTED[name]
    context = expected.get("context", {})
    assert isinstance(context, dict)
    result = diagnose([str(FIXTURES / name)], context)
    out = result.to_json()
    detail = json.dumps({"findings": out["findings"], "errors": out["errors"]}, indent=1)[:4000]
    assert out["worst_severity"] == expected["worst_severity"], detail
    acceptable = expected["acceptable_actions"]
    assert isinstance(acceptable, list)
    assert set(out["worst_actions"]) <= set(acceptable), detail
    assert result.exit_status != 4, detail


def _variants(text: str) -> dict[str, str]:
    """The same artifact pasted differently: no command line, CRLF, a trailing prompt."""
    lines = text.splitlines()
    out = {
        "crlf": text.replace("\n", "\r\n"),
        "trailing-prompt": text + "user@host:~$ \n",
        "leading-blank-lines": "\n\n" + text,
    }
    is_command, command = command_of(lines[0]) if lines else (False, None)
    if is_command and not (command and "noheader" in command):
        # a noheader CSV needs its command to name the fields; every other kind is
        # detected from its content
        out["no-command"] = "\n".join(ln for ln in lines if not command_of(ln)[0]) + "\n"
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_artifact_pasted_differently(name: str, tmp_path: Path) -> None:
    expected = EXPECTED[name]
    context = expected.get("context", {})
    assert isinstance(context, dict)
    acceptable = expected["acceptable_actions"]
    assert isinstance(acceptable, list)
    for variant, body in _variants((FIXTURES / name).read_text()).items():
        path = tmp_path / f"{variant}-{name}"
        path.write_bytes(body.encode())
        result = diagnose([str(path)], context)
        out = result.to_json()
        assert out["worst_severity"] == expected["worst_severity"], (variant, out["findings"])
        assert set(out["worst_actions"]) <= set(acceptable), (variant, out["findings"])
        assert result.exit_status != 4, variant
