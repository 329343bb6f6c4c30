"""Real-world NCCL/UCX/MPI/PyTorch and InfiniBand/RoCE artifacts diagnose as an expert would.

Each file in ``tests/fixtures/artifacts/network`` is one pasted artifact from a
public bug report, forum or vendor document (anonymised: host names, addresses,
GUIDs; codes, counters, values and formats kept); ``expected.json`` beside them
gives the verdict in the format of ``../shared/cases/expected.json``. A fixture
added there is tested with no code change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuhealth.diagnose import diagnose

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "artifacts" / "network"
EXPECTED: dict[str, dict[str, object]] = json.loads((FIXTURES / "expected.json").read_text())

SET_ASIDE: dict[str, str] = {}
"""Fixtures whose verdict depends on rules outside the network side (expected to fail)."""


def test_every_fixture_has_a_verdict() -> None:
    files = {p.name for p in FIXTURES.iterdir() if p.is_file() and p.name != "expected.json"}
    assert files == set(EXPECTED)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=SET_ASIDE[n], strict=False))
        if n in SET_ASIDE
        else n
        for n in sorted(EXPECTED)
    ],
)
def test_network_artifact(name: str) -> None:
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
