"""The public surface of the shared packages is explicit and sorted (style.md C.3.4)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    "package", ["core", "analytics", "analytics.fault_model", "storage", "alerting", "dashboards"]
)
def test_all_is_sorted_and_resolves(package: str) -> None:
    module = importlib.import_module(package)
    names = module.__all__
    # isort-style order, as ruff's RUF022 keeps it: CONSTANTS, then Classes, then functions.
    assert names == sorted(
        names, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n)
    )
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(module, name), name


def test_catalog_names_follow_prometheus_conventions() -> None:
    from core.catalog import CATALOG, MetricType

    names = [spec.name for spec in CATALOG]
    assert len(names) == len(set(names))
    for spec in CATALOG:
        assert spec.name == spec.name.lower()
        assert spec.help
        if spec.type is MetricType.COUNTER:
            assert spec.name.endswith("_total"), spec.name
        assert "percent" not in spec.name
        if spec.unit not in ("1",):
            assert spec.unit in spec.name or spec.name.endswith(f"{spec.unit}_total"), spec.name
