"""Every real case in the collection diagnoses as expected.json says.

The cases come from GPUHEALTH_CASES (CI points it at ../shared/cases), else the
copy in tests/fixtures/cases. A case added to expected.json is tested with no code change.
"""

from __future__ import annotations

import json

import pytest

from gpuhealth.diagnose import diagnose
from tests.conftest import cases_dir

CASES = cases_dir()
EXPECTED = json.loads((CASES / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_case(name: str) -> None:
    expected = EXPECTED[name]
    result = diagnose([str(CASES / name)], expected.get("context", {}))
    out = result.to_json()
    detail = json.dumps(out["findings"], indent=1)[:3000]
    assert out["worst_severity"] == expected["worst_severity"], detail
    assert set(out["worst_actions"]) <= set(expected["acceptable_actions"]), detail
    assert result.exit_status != 4
