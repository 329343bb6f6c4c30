from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def cases_dir() -> Path:
    """The case collection: GPUHEALTH_CASES, else the project's copy."""
    return Path(os.environ.get("GPUHEALTH_CASES") or FIXTURES / "cases")


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
