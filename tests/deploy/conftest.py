"""Shared helpers of the deployment tests: the chart, its renders, the tools they need.

The tools (``helm-python-sdk``, ``kubernetes-validate``, ``systemd-analyze``) are not in
the ``test`` extra: a test that needs a missing one is skipped with the reason, unless
``GPUHEALTH_DEPLOY_TOOLS=required`` (``.ci/run`` sets it for its deploy step), under which
it fails instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuhealth"
VALUE_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
"""One values file per documented option set (values.yaml's comments say what each does)."""


def need(module: str, requirement: str) -> Any:
    """Import ``module`` or skip (fail under GPUHEALTH_DEPLOY_TOOLS=required)."""
    if importlib.util.find_spec(module) is None:
        why = f"{module} is not installed: pip install '{requirement}'"
        if os.environ.get("GPUHEALTH_DEPLOY_TOOLS") == "required":
            pytest.fail(why)
        pytest.skip(why)
    return importlib.import_module(module)


def render_module() -> Any:
    """``deploy/render.py`` as a module."""
    need("helm_python", "helm-python-sdk>=0.2.2")
    if str(ROOT / "deploy") not in sys.path:
        sys.path.insert(0, str(ROOT / "deploy"))
    return importlib.import_module("render")


def option_sets() -> list[Any]:
    """pytest params: the default values and each ci/ values file."""
    return [pytest.param(None, id="default"),
            *(pytest.param(p, id=p.name.removesuffix("-values.yaml")) for p in VALUE_FILES)]


def values_of(path: Path | None) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {} if path else {}


@cache
def _rendered(key: str) -> tuple[tuple[str, tuple[dict[str, Any], ...]], ...]:
    render = render_module()
    path = Path(key) if key else None
    out = []
    for template, text in render.render(values_of(path)).items():
        docs = tuple(d for d in yaml.safe_load_all(text) if d)
        out.append((template, docs))
    return tuple(out)


def rendered(path: Path | None) -> list[tuple[str, dict[str, Any]]]:
    """(template, object) for every object a render with ``path``'s values writes."""
    return [(t, d) for t, docs in _rendered(str(path) if path else "") for d in docs]


def objects(path: Path | None, kind: str) -> dict[str, dict[str, Any]]:
    """Rendered objects of one kind, by name."""
    return {d["metadata"]["name"]: d for _, d in rendered(path) if d["kind"] == kind}
