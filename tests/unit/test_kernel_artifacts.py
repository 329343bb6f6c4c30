"""Kernel-log artifacts of many drivers, formats and stamp styles diagnose as expected.

Every file in ``tests/fixtures/artifacts/kernel`` is a real-world excerpt (anonymised:
names, serials and UUIDs replaced; codes, values and formats kept) with its expected
verdict in the folder's ``expected.json`` (the format of ``../shared/cases``). A
fixture added to ``expected.json`` is tested with no code change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuhealth.diagnose import diagnose

KERNEL = Path(__file__).resolve().parents[1] / "fixtures" / "artifacts" / "kernel"
EXPECTED: dict[str, dict[str, object]] = json.loads((KERNEL / "expected.json").read_text())


def test_every_fixture_has_an_expectation() -> None:
    files = {p.name for p in KERNEL.iterdir() if p.name != "expected.json"}
    assert files == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_kernel_artifact(name: str) -> None:
    expected = EXPECTED[name]
    context = expected.get("context", {})
    assert isinstance(context, dict)
    result = diagnose([str(KERNEL / name)], context)
    out = result.to_json()
    detail = json.dumps(out["findings"], indent=1)[:3000]
    assert out["worst_severity"] == expected["worst_severity"], detail
    acceptable = expected["acceptable_actions"]
    assert isinstance(acceptable, list)
    assert set(out["worst_actions"]) <= set(acceptable), detail
    assert result.exit_status != 4
