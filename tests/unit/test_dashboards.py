"""The generated Grafana dashboards: golden files, catalog names, Grafana's JSON model.

Regenerate the golden files (and review the diff) with::

    GPUHEALTH_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_dashboards.py

``deploy/grafana`` is generated output too: ``gpuhealth dashboards render --out
deploy/grafana`` rewrites it (the same switch rewrites it from this test).
"""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from core.catalog import BY_DCGM, BY_NAME
from dashboards import (
    DASHBOARDS,
    SCHEMA_VERSION,
    Agg,
    Flavour,
    Fn,
    Query,
    Ratio,
    Scope,
    dumps,
    promql,
    render_all,
    write_dashboards,
)
from dashboards.panels import GPU, PanelSpec
from storage.lineprotocol import EVENT_MEASUREMENT, join_metric

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "dashboards"
DEPLOY = ROOT / "deploy" / "grafana"
UPDATE = os.environ.get("GPUHEALTH_UPDATE_GOLDEN") == "1"

ALL = [(flavour, name) for flavour in Flavour for name in (d.name for d in DASHBOARDS)]

# dcgm-exporter's series (ecosystem-reference §2.2: etc/default-counters.csv, active and
# commented-out rows); the catalog's own dcgm mapping (core.catalog.BY_DCGM) is added below.
DCGM_EXPORTER_SERIES = frozenset({
    "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES",
    "DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "DCGM_FI_DEV_RETIRED_SBE",
    "DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_RETIRED_PENDING",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_L0", "DCGM_FI_DEV_POWER_VIOLATION",
    "DCGM_FI_DEV_THERMAL_VIOLATION", "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
    "DCGM_FI_DEV_RELIABILITY_VIOLATION", "DCGM_EXP_CLOCK_EVENTS_COUNT",
    "DCGM_EXP_XID_ERRORS_COUNT", "DCGM_EXP_GPU_HEALTH_STATUS", "DCGM_EXP_P2P_STATUS",
    "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE", "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
}) | frozenset(BY_DCGM)

# JSON Schema of the Grafana dashboard JSON model, written for this test from Grafana's
# documentation "JSON model" (grafana/grafana docs/sources/dashboards/build-dashboards/
# view-dashboard-json-model/index.md), as summarised in ecosystem-reference §8.1: the
# documented top-level keys, uid 8-40 characters, graphTooltip 0-2, time {from, to},
# templating {list}, annotations {list}, integer schemaVersion; panels with type, title,
# id, gridPos {x, y, w, h} on the 24-column grid, datasource {type, uid} and targets with
# refId; template variables with type and name. It is not Grafana's own (CUE/TypeScript)
# schema, which is not vendored here; no Grafana server can run in this environment.
_DATASOURCE = {
    "type": "object",
    "required": ["type", "uid"],
    "properties": {"type": {"enum": ["prometheus", "influxdb", "grafana"]},
                   "uid": {"type": "string", "minLength": 1}},
}
GRAFANA_DASHBOARD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["annotations", "editable", "graphTooltip", "id", "links", "panels",
                 "refresh", "schemaVersion", "tags", "templating", "time", "timepicker",
                 "timezone", "title", "uid", "version"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": ["integer", "null"]},
        "uid": {"type": "string", "minLength": 8, "maxLength": 40, "pattern": "^[a-zA-Z0-9_-]+$"},
        "title": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "timezone": {"enum": ["browser", "utc", ""]},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "time": {"type": "object", "required": ["from", "to"],
                 "properties": {"from": {"type": "string"}, "to": {"type": "string"}}},
        "timepicker": {"type": "object"},
        "refresh": {"type": ["string", "boolean"]},
        "schemaVersion": {"type": "integer", "minimum": 1},
        "version": {"type": "integer", "minimum": 0},
        "links": {"type": "array", "items": {"type": "object", "required": ["type", "title"]}},
        "annotations": {
            "type": "object",
            "required": ["list"],
            "properties": {"list": {"type": "array", "items": {
                "type": "object",
                "required": ["name", "datasource", "enable", "iconColor"],
                "properties": {"datasource": _DATASOURCE, "name": {"type": "string"},
                               "enable": {"type": "boolean"}},
            }}},
        },
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {"list": {"type": "array", "items": {
                "type": "object",
                "required": ["type", "name", "query"],
                "properties": {
                    "type": {"enum": ["query", "custom", "datasource", "constant", "interval",
                                      "textbox", "adhoc"]},
                    "name": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
                    "query": {"type": ["string", "object"]},
                    "multi": {"type": "boolean"},
                    "includeAll": {"type": "boolean"},
                    "refresh": {"enum": [0, 1, 2]},
                },
            }}},
        },
        "panels": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["type", "title", "id", "gridPos", "datasource", "targets"],
            "properties": {
                "type": {"enum": ["timeseries", "stat", "gauge", "table", "text", "graph"]},
                "title": {"type": "string", "minLength": 1},
                "id": {"type": "integer", "minimum": 1},
                "gridPos": {
                    "type": "object",
                    "required": ["x", "y", "w", "h"],
                    "additionalProperties": False,
                    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 23},
                                   "y": {"type": "integer", "minimum": 0},
                                   "w": {"type": "integer", "minimum": 1, "maximum": 24},
                                   "h": {"type": "integer", "minimum": 1}},
                },
                "datasource": _DATASOURCE,
                "targets": {"type": "array", "minItems": 1, "items": {
                    "type": "object",
                    "required": ["refId", "datasource"],
                    "properties": {"refId": {"type": "string", "pattern": "^[A-Z]+$"},
                                   "datasource": _DATASOURCE,
                                   "expr": {"type": "string", "minLength": 1},
                                   "query": {"type": "string", "minLength": 1}},
                    "oneOf": [{"required": ["expr"]}, {"required": ["query"]}],
                }},
                "fieldConfig": {"type": "object", "required": ["defaults", "overrides"],
                                "properties": {"defaults": {"type": "object"},
                                               "overrides": {"type": "array"}}},
                "options": {"type": "object"},
            },
        }},
    },
}

_PROM_METRIC = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{")
_FLUX_METRIC = re.compile(r'r\._measurement == "([^"]+)" and r\._field == "([^"]+)"')


def _dashboards() -> dict[tuple[Flavour, str], dict[str, Any]]:
    return {(flavour, name): dashboard for flavour in Flavour
            for name, dashboard in render_all(flavour).items()}


def _queries(dashboard: dict[str, Any]) -> list[str]:
    """Every query text in a dashboard: panel targets, variables, annotations."""
    texts = [t.get("expr") or t["query"] for p in dashboard["panels"] for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            texts.append(variable["query"])
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            texts.append(annotation["expr"])
        elif "target" in annotation:
            texts.append(annotation["target"]["query"])
    return texts


def _metric_names(text: str) -> set[str]:
    flux = {join_metric(measurement, field) for measurement, field in _FLUX_METRIC.findall(text)}
    return set(_PROM_METRIC.findall(text)) | flux


@pytest.mark.parametrize(("flavour", "name"), ALL, ids=[f"{f.value}-{n}" for f, n in ALL])
def test_matches_golden_file(flavour: Flavour, name: str) -> None:
    text = dumps(render_all(flavour)[name])
    golden = GOLDEN / f"{flavour.value}-{name}.json"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    assert golden.exists(), f"missing {golden}; run with GPUHEALTH_UPDATE_GOLDEN=1"
    assert text == golden.read_text(encoding="utf-8"), (
        f"{golden.name} differs; review and regenerate with GPUHEALTH_UPDATE_GOLDEN=1")


def test_deploy_tree_is_current(tmp_path: Path) -> None:
    if UPDATE:
        write_dashboards(DEPLOY)
    written = write_dashboards(tmp_path)
    for path in written:
        shipped = DEPLOY / path.relative_to(tmp_path)
        assert shipped.exists(), f"missing {shipped}; run gpuhealth dashboards render"
        assert shipped.read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), shipped


def test_rendering_is_deterministic() -> None:
    first = {key: dumps(d) for key, d in _dashboards().items()}
    second = {key: dumps(d) for key, d in _dashboards().items()}
    assert first == second


@pytest.mark.parametrize(("flavour", "name"), ALL, ids=[f"{f.value}-{n}" for f, n in ALL])
def test_validates_against_grafana_json_model(flavour: Flavour, name: str) -> None:
    dashboard = json.loads(dumps(render_all(flavour)[name]))
    jsonschema.validate(dashboard, GRAFANA_DASHBOARD_SCHEMA)
    assert dashboard["schemaVersion"] == SCHEMA_VERSION
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"]["type"] == flavour.value
        assert all(t["datasource"]["type"] == flavour.value for t in panel["targets"])
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_schema_rejects_what_grafana_would() -> None:
    dashboard = render_all(Flavour.PROMETHEUS)["gpu"]
    broken = json.loads(dumps(dashboard))
    del broken["panels"][0]["gridPos"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, GRAFANA_DASHBOARD_SCHEMA)
    broken = json.loads(dumps(dashboard))
    broken["uid"] = "short"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, GRAFANA_DASHBOARD_SCHEMA)


@pytest.mark.parametrize(("flavour", "name"), ALL, ids=[f"{f.value}-{n}" for f, n in ALL])
def test_every_query_names_a_known_metric(flavour: Flavour, name: str) -> None:
    for text in _queries(render_all(flavour)[name]):
        names = _metric_names(text)
        assert names, f"no metric found in {text!r}"
        for metric in names:
            if metric == f"{EVENT_MEASUREMENT}_count":
                continue  # events (the Xid annotations), not a metric: storage.lineprotocol
            assert metric in BY_NAME or metric in DCGM_EXPORTER_SERIES, (metric, text)
        if flavour is Flavour.INFLUXDB:
            assert "DCGM_" not in text, text


def test_panels_and_grid_do_not_overlap() -> None:
    for (flavour, name), dashboard in _dashboards().items():
        cells: set[tuple[int, int]] = set()
        for panel in dashboard["panels"]:
            g = panel["gridPos"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                    for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, (flavour, name, panel["title"])
            cells |= mine
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert ids == list(range(1, len(ids) + 1))


def test_uids_are_stable_unique_and_derived_from_names() -> None:
    uids = {key: d["uid"] for key, d in _dashboards().items()}
    assert len(set(uids.values())) == len(uids)
    assert uids[(Flavour.PROMETHEUS, "gpu")] == "gpuhealth-gpu-prometheus"
    assert uids[(Flavour.INFLUXDB, "fleet")] == "gpuhealth-fleet-influxdb"
    titles = [d["title"] for d in _dashboards().values()]
    assert len(set(titles)) == len(titles)  # one folder can hold both flavours


def test_template_variables_follow_the_scope() -> None:
    for (flavour, name), dashboard in _dashboards().items():
        spec = next(d for d in DASHBOARDS if d.name == name)
        names = [v["name"] for v in dashboard["templating"]["list"]]
        assert names[0] == "datasource"
        assert "cluster" in names
        assert ("node" in names) == (spec.scope >= Scope.NODE)
        assert ("gpu" in names) == (spec.scope >= Scope.GPU)
        assert ("dcgm_host_label" in names) == (flavour is Flavour.PROMETHEUS)
        for text in _queries(dashboard):
            for variable in re.findall(r"\$\{?([a-z_]+)", text):
                assert variable in names or variable.startswith("__"), (name, variable)


def test_gpu_dashboard_covers_the_issue() -> None:
    dashboard = render_all(Flavour.PROMETHEUS)["gpu"]
    text = "\n".join(_queries(dashboard))
    for metric in ("gpu_temperature_celsius", "gpu_memory_temperature_celsius",
                   "gpu_power_watts", "gpu_ecc_errors_total", "gpu_remapped_rows",
                   "gpu_retired_pages", "gpu_clock_event_active", "gpu_xid_events_total",
                   "gpu_failure_probability_ratio"):
        assert metric in text, metric
    names = [a["name"] for a in dashboard["annotations"]["list"]]
    assert "Xid" in names


def test_dcgm_fallback_uses_the_catalog_scale() -> None:
    expr = promql(Query(metric="gpu_utilization_ratio"), Scope.GPU)
    assert "DCGM_FI_DEV_GPU_UTIL{" in expr
    assert "* 0.01" in expr
    assert ' or max by (cluster, node, entity) (label_replace(' in expr
    expr = promql(Query(metric="gpu_sm_clock_hertz"), Scope.GPU)
    assert "DCGM_FI_DEV_SM_CLOCK{" in expr
    assert "* 1000000.0" in expr
    expr = promql(Query(metric="gpu_energy_joules_total", fn=Fn.RATE), Scope.NODE)
    assert "rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in expr
    assert "* 0.001" in expr
    assert "UUID" not in expr.split("label_replace(")[0]
    # A metric with labels keeps them, so no fallback that would drop them.
    assert "DCGM" not in promql(Query(metric="gpu_retired_pages"), Scope.GPU)
    # ... unless the query aggregates them away.
    summed = promql(Query(metric="gpu_retired_pages", agg=Agg.SUM, by=("node", "entity")),
                    Scope.GPU)
    assert "DCGM_FI_DEV_RETIRED_DBE" in summed


def test_own_metrics_filter_on_cluster_only() -> None:
    expr = promql(Query(metric="gpuhealth_spool_depth", agg=Agg.SUM), Scope.GPU)
    assert expr == 'sum (gpuhealth_spool_depth{cluster=~"$cluster"})'
    expr = promql(Query(metric="probe_rtt_seconds"), Scope.GPU)
    assert "entity" not in expr
    assert 'node=~"$node"' in expr


def test_specs_reject_unknown_metrics_and_labels() -> None:
    with pytest.raises(ValueError, match=r"not in core\.catalog"):
        Query(metric="gpu_temp")
    with pytest.raises(ValueError, match="no label"):
        Query(metric="gpu_power_watts", matchers=(("type", "x"),))
    with pytest.raises(ValueError, match="gauge"):
        Query(metric="gpu_power_watts", fn=Fn.RATE)
    with pytest.raises(ValueError, match="one series"):
        Ratio(numerator=Query(metric="gpuhealth_spool_depth"),
              denominator=Query(metric="gpuhealth_outbox_depth", agg=Agg.SUM))
    with pytest.raises(ValueError, match="width"):
        PanelSpec(title="x", queries=(Query(metric="gpu_power_watts"),), width=25)


def test_every_catalogued_gpu_signal_is_shown_somewhere() -> None:
    shown = {q.metric for d in DASHBOARDS for p in d.panels for item in p.queries
             for q in ((item.numerator, item.denominator) if isinstance(item, Ratio)
                       else (item,))}
    assert {"gpuhealth_gpus", "gpuhealth_open_incidents", "gpuhealth_open_findings",
            "gpuhealth_disrupted_nodes", "gpu_failure_probability_ratio",
            "gpuhealth_remediation_actions_total", "gpuhealth_time_to_remediate_seconds_total",
            "gpuhealth_collector_errors_total", "gpuhealth_samples_written_total",
            "gpuhealth_pipeline_lag_seconds", "probe_loss_ratio", "probe_rtt_seconds",
            "ib_symbol_errors_total"} <= shown
    assert GPU.xid_annotations


def test_provisioning_yaml_names_each_flavour() -> None:
    text = (DEPLOY / "provisioning" / "dashboards" / "gpuhealth.yaml").read_text()
    assert text.startswith("# Generated")
    assert "apiVersion: 1" in text
    for flavour in Flavour:
        assert f"path: /var/lib/grafana/dashboards/gpuhealth/{flavour.value}" in text


def test_all_is_sorted() -> None:
    module = importlib.import_module("dashboards")
    names = module.__all__
    assert names == sorted(
        names, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n))
    for name in names:
        assert hasattr(module, name), name


def test_flux_queries_use_the_documented_schema() -> None:
    dashboard = render_all(Flavour.INFLUXDB)["gpu"]
    query = dashboard["panels"][0]["targets"][0]["query"]
    assert 'r._measurement == "gpu" and r._field == "temperature_celsius"' in query
    assert "r.node =~ /^${node:regex}$/" in query
    assert "r.entity =~ /^${gpu:regex}$/" in query
    assert "v.timeRangeStart" in query
    assert "v.windowPeriod" in query


def _balanced(text: str) -> bool:
    pairs, stack, quoted = {")": "(", "]": "[", "}": "{"}, [], False
    for index, char in enumerate(text):
        if char == '"' and text[index - 1] != "\\":
            quoted = not quoted
        elif quoted:
            continue
        elif char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack and not quoted


def test_flux_queries_are_well_formed_pipelines() -> None:
    # No InfluxDB 2.x (Flux) server can be had here (docs/infra.md §2), so Flux is checked
    # for shape only: balanced brackets and quotes, every pipeline step on its own line.
    for dashboard in render_all(Flavour.INFLUXDB).values():
        for text in _queries(dashboard):
            assert _balanced(text), text
            for line in text.splitlines()[1:]:
                stripped = line.strip()
                assert stripped.startswith(("|>", "denominator =", "join(", "schema.")), line
