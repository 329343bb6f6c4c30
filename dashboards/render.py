"""Render the dashboard specs of :mod:`dashboards.panels` into Grafana dashboard JSON.

Two flavours (:class:`Flavour`):

* **prometheus**: PromQL over gpuhealth's own metric names. Where the catalog maps a
  metric to a dcgm-exporter series (``MetricSpec.dcgm``, ``dcgm_scale``), the query also
  reads that series, scaled into our unit, relabelled (``Hostname``/``hostname`` to
  ``node``, ``UUID`` to ``entity``) and used only where gpuhealth's series is absent
  (PromQL ``or``): a fleet that runs dcgm-exporter without gpuhealth's collectors still
  fills the panels (ecosystem-reference §2, §11).
* **influxdb**: Flux over the schema gpuhealth's InfluxDB store writes, taken from
  :func:`storage.lineprotocol.split_metric` so the two cannot drift apart: metric
  ``<prefix>_<rest>`` is measurement ``<prefix>``, field ``<rest>`` (a float); tags are
  ``node``, ``entity``, the metric's catalogued labels and, where the writer adds it,
  ``cluster``. Events (the Xid annotations) are measurement ``gpuhealth_event`` with tags
  ``kind`` and ``code`` and field ``count`` (``docs/dashboards.md``).

Output is deterministic: dashboard uids derive from the dashboard name and flavour,
panel ids and grid positions from the panel order, and JSON is written with sorted
keys, so the files can be compared with golden copies (style.md C.3.17). The JSON model
follows ecosystem-reference §8.1 (Grafana's "JSON model" documentation), with
``schemaVersion`` 41 (Grafana 12).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from dashboards.panels import (
    DASHBOARDS,
    Agg,
    DashboardSpec,
    Fn,
    PanelKind,
    PanelSpec,
    Query,
    Ratio,
    Scope,
    metric_scope,
)
from storage.lineprotocol import EVENT_MEASUREMENT, split_metric

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 41
"""Grafana dashboard ``schemaVersion`` written (Grafana 12; ecosystem-reference §8.1)."""

DEFAULT_PROVISIONING_PATH = "/var/lib/grafana/dashboards/gpuhealth"
"""Where the provisioning YAML tells Grafana to look for the dashboard files."""

DCGM_HOST_LABELS = ("Hostname", "hostname")
"""dcgm-exporter's host label: ``Hostname`` in every release, ``hostname`` on main."""


class Flavour(StrEnum):
    """Which datasource a dashboard queries."""

    PROMETHEUS = "prometheus"
    INFLUXDB = "influxdb"


_FLAVOUR_TITLE = {Flavour.PROMETHEUS: "Prometheus", Flavour.INFLUXDB: "InfluxDB"}

_BASE_UNIT = {
    "celsius": "celsius",
    "watts": "watt",
    "joules": "joule",
    "ratio": "percentunit",
    "bytes": "bytes",
    "hertz": "hertz",
    "seconds": "s",
    "bits_per_second": "bps",
    "1": "short",
}
_RATE_UNIT = {"bytes": "Bps", "1": "cps", "seconds": "percentunit", "joules": "watt"}
_FLUX_AGG = {Agg.SUM: "sum", Agg.MAX: "max", Agg.AVG: "mean", Agg.COUNT: "count"}
_GPU_KEYS = "cluster, node, entity"
_RATE_WINDOW = "$__rate_interval"


def dashboard_uid(name: str, flavour: Flavour) -> str:
    """Return the stable uid of a dashboard (8-40 characters, ecosystem-reference §8.1).

    Examples:
        >>> dashboard_uid("gpu", Flavour.PROMETHEUS)
        'gpuhealth-gpu-prometheus'
    """
    uid = f"gpuhealth-{name}-{flavour.value}"
    if not 8 <= len(uid) <= 40:
        raise ValueError(f"uid {uid!r} must be 8-40 characters")
    return uid


def folder_uid(title: str) -> str:
    """Return a stable folder uid derived from a folder title.

    Examples:
        >>> folder_uid("GPU Health")
        'gpuhealth-gpu-health'
    """
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "folder"
    return f"gpuhealth-{slug}"[:40].rstrip("-")


def panel_unit(panel: PanelSpec) -> str:
    """Return the Grafana unit of a panel: its own, or derived from its first query.

    Examples:
        >>> from dashboards.panels import GPU
        >>> [panel_unit(p) for p in GPU.panels[:2]]
        ['celsius', 'watt']
    """
    if panel.unit:
        return panel.unit
    first = panel.queries[0]
    query = first.numerator if isinstance(first, Ratio) else first
    unit = query.spec.unit
    if query.fn is Fn.RATE:
        return _RATE_UNIT.get(unit, "short")
    return _BASE_UNIT.get(unit, "short")


# --- PromQL -----------------------------------------------------------------------------


def _prom_selector(metric: str, scope: Scope, matchers: Iterable[tuple[str, str]],
                   *, dcgm: bool) -> str:
    parts = ['cluster=~"$cluster"']
    if scope >= Scope.NODE:
        parts.append('$dcgm_host_label=~"$node"' if dcgm else 'node=~"$node"')
    if scope >= Scope.GPU:
        parts.append('UUID=~"$gpu"' if dcgm else 'entity=~"$gpu"')
    parts.extend(f'{label}="{value}"' for label, value in matchers)
    return f"{metric}{{{', '.join(parts)}}}"


def _prom_fn(fn: Fn, selector: str) -> str:
    if fn is Fn.RATE:
        return f"rate({selector}[{_RATE_WINDOW}])"
    if fn is Fn.INCREASE:
        return f"increase({selector}[{_RATE_WINDOW}])"
    return selector


def promql(query: Query, scope: Scope) -> str:
    """Return the PromQL expression of one query on a dashboard of ``scope``.

    Args:
        query: The query.
        scope: The dashboard's scope; the query filters on no more than its metric allows.

    Returns:
        PromQL with Grafana variables (``$cluster``, ``$node``, ``$gpu``,
        ``$dcgm_host_label``, ``$__rate_interval``) left for Grafana to interpolate.

    Examples:
        >>> from dashboards.panels import Agg, Scope, Query
        >>> promql(Query(metric="gpuhealth_open_findings", agg=Agg.SUM, by=("severity",)),
        ...        Scope.GPU)
        'sum by (severity) (gpuhealth_open_findings{cluster=~"$cluster"})'
    """
    spec = query.spec
    scope = min(scope, metric_scope(spec))
    expr = _prom_fn(query.fn, _prom_selector(spec.name, scope, query.matchers, dcgm=False))
    series = query.dcgm_series
    if series:
        dcgm = _prom_fn(query.fn, _prom_selector(series, scope, (), dcgm=True))
        if spec.dcgm_scale != 1.0:
            dcgm = f"{dcgm} * {spec.dcgm_scale!r}"
        dcgm = (
            f'label_replace(label_replace({dcgm}, "node", "$1", "$dcgm_host_label", "(.*)"), '
            f'"entity", "$1", "UUID", "(.*)")'
        )
        expr = f"max by ({_GPU_KEYS}) ({expr}) or max by ({_GPU_KEYS}) ({dcgm})"
    if query.above is not None:
        expr = f"({expr}) > {query.above!r}"
    if query.agg is not None:
        by = f" by ({', '.join(query.by)})" if query.by else ""
        expr = f"{query.agg.value}{by} ({expr})"
        if query.agg is Agg.COUNT and not query.by:
            expr = f"{expr} or vector(0)"
    return expr


def _prom_target(item: Query | Ratio, scope: Scope, ref_id: str,
                 datasource: Mapping[str, str]) -> dict[str, Any]:
    if isinstance(item, Ratio):
        expr = f"({promql(item.numerator, scope)}) / ({promql(item.denominator, scope)})"
        legend = item.legend
    else:
        expr, legend = promql(item, scope), item.legend
    return {
        "datasource": dict(datasource),
        "editorMode": "code",
        "expr": expr,
        "instant": False,
        "legendFormat": legend or "__auto",
        "range": True,
        "refId": ref_id,
    }


# --- Flux -------------------------------------------------------------------------------


def _flux_string(value: str) -> str:
    return json.dumps(value)


def _flux_scope(scope: Scope) -> list[str]:
    conds = ["(not exists r.cluster or r.cluster =~ /^${cluster:regex}$/)"]
    if scope >= Scope.NODE:
        conds.append("r.node =~ /^${node:regex}$/")
    if scope >= Scope.GPU:
        conds.append("r.entity =~ /^${gpu:regex}$/")
    return conds


def _flux_metric(metric: str) -> str:
    measurement, field_key = split_metric(metric)
    return (f"r._measurement == {_flux_string(measurement)} and "
            f"r._field == {_flux_string(field_key)}")


def _flux_lines(query: Query, scope: Scope) -> list[str]:
    spec = query.spec
    conds = _flux_scope(min(scope, metric_scope(spec)))
    conds.extend(f"r.{label} == {_flux_string(value)}" for label, value in query.matchers)
    lines = [
        "from(bucket: v.defaultBucket)",
        "  |> range(start: v.timeRangeStart, stop: v.timeRangeStop)",
        f"  |> filter(fn: (r) => {_flux_metric(spec.name)})",
        f"  |> filter(fn: (r) => {' and '.join(conds)})",
    ]
    if query.fn is Fn.RATE:
        lines.append("  |> derivative(unit: 1s, nonNegative: true)")
        window_fn = "mean"
    elif query.fn is Fn.INCREASE:
        lines.append("  |> difference(nonNegative: true)")
        window_fn = "sum"
    else:
        window_fn = "last" if spec.unit == "1" else "mean"
    lines.append(f"  |> aggregateWindow(every: v.windowPeriod, fn: {window_fn}, "
                 "createEmpty: false)")
    if query.above is not None:
        lines.append(f"  |> filter(fn: (r) => r._value > {float(query.above)!r})")
    if query.agg is not None:
        columns = ", ".join(_flux_string(label) for label in query.by)
        lines.append(f"  |> group(columns: [{columns}])")
        lines.append(f"  |> aggregateWindow(every: v.windowPeriod, fn: {_FLUX_AGG[query.agg]}, "
                     "createEmpty: false)")
        kept = list(query.by)
    else:
        kept = ["cluster", "node", "entity", *spec.labels]
    lines.append(_flux_keep(["_time", "_value", *kept]))
    return lines


def _flux_keep(columns: Iterable[str]) -> str:
    # keep(fn:) rather than keep(columns:): a tag the points may lack (cluster) is no error.
    names = ", ".join(_flux_string(c) for c in columns)
    return f"  |> keep(fn: (column) => contains(value: column, set: [{names}]))"


def _flux_name(legend: str) -> list[str]:
    if legend and "{{" not in legend:
        return [f"  |> rename(columns: {{_value: {_flux_string(legend)}}})"]
    return []


def flux(item: Query | Ratio, scope: Scope) -> str:
    """Return the Flux query of one query (or ratio) on a dashboard of ``scope``.

    Args:
        item: The query, or a ratio of two one-series queries (a ``join`` on ``_time``;
            intervals with a zero divisor are left out).
        scope: The dashboard's scope.

    Returns:
        Flux using Grafana's macros (``v.timeRangeStart``, ``v.timeRangeStop``,
        ``v.windowPeriod``, ``v.defaultBucket``) and ``${var:regex}`` variables.
    """
    if isinstance(item, Query):
        return "\n".join(_flux_lines(item, scope) + _flux_name(item.legend))
    numerator = "\n".join(_flux_lines(item.numerator, scope))
    denominator = "\n".join(_flux_lines(item.denominator, scope))
    lines = [
        f"numerator = {numerator}",
        f"denominator = {denominator}",
        'join(tables: {n: numerator, d: denominator}, on: ["_time"])',
        "  |> filter(fn: (r) => r._value_d > 0.0)",
        "  |> map(fn: (r) => ({_time: r._time, _value: r._value_n / r._value_d}))",
        *_flux_name(item.legend),
    ]
    return "\n".join(lines)


def _flux_target(item: Query | Ratio, scope: Scope, ref_id: str,
                 datasource: Mapping[str, str]) -> dict[str, Any]:
    return {"datasource": dict(datasource), "query": flux(item, scope), "refId": ref_id}


# --- Dashboard JSON ---------------------------------------------------------------------


def _datasource(flavour: Flavour) -> dict[str, str]:
    return {"type": flavour.value, "uid": "${datasource}"}


def _thresholds(panel: PanelSpec) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    steps.extend({"color": colour, "value": value} for value, colour in panel.thresholds)
    return {"mode": "absolute", "steps": steps}


def _options(kind: PanelKind) -> dict[str, Any]:
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if kind is PanelKind.STAT:
        return {"colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                "orientation": "auto", "reduceOptions": reduce, "textMode": "auto"}
    if kind is PanelKind.GAUGE:
        return {"orientation": "auto", "reduceOptions": reduce,
                "showThresholdLabels": False, "showThresholdMarkers": True}
    return {"legend": {"calcs": [], "displayMode": "list", "placement": "bottom",
                       "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"}}


def _description(panel: PanelSpec) -> str:
    if panel.description:
        return panel.description
    first = panel.queries[0]
    query = first.numerator if isinstance(first, Ratio) else first
    return query.spec.help


def _panels(spec: DashboardSpec, flavour: Flavour) -> list[dict[str, Any]]:
    datasource = _datasource(flavour)
    target = _prom_target if flavour is Flavour.PROMETHEUS else _flux_target
    out: list[dict[str, Any]] = []
    x = y = row_height = 0
    for number, panel in enumerate(spec.panels, start=1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        defaults: dict[str, Any] = {"thresholds": _thresholds(panel), "unit": panel_unit(panel)}
        if panel.max_value is not None:
            defaults["max"] = panel.max_value
            defaults["min"] = 0
        out.append({
            "datasource": dict(datasource),
            "description": _description(panel),
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
            "id": number,
            "options": _options(panel.kind),
            "targets": [
                target(item, spec.scope, chr(ord("A") + index), datasource)
                for index, item in enumerate(panel.queries)
            ],
            "title": panel.title,
            "type": panel.kind.value,
        })
        x += panel.width
        row_height = max(row_height, panel.height)
    return out


def _query_variable(name: str, label: str, flavour: Flavour, query: str,
                    regex: str = "") -> dict[str, Any]:
    return {
        "allValue": ".*",
        "current": {},
        "datasource": _datasource(flavour),
        "definition": query,
        "hide": 0,
        "includeAll": True,
        "label": label,
        "multi": True,
        "name": name,
        "options": [],
        "query": query,
        "refresh": 2,
        "regex": regex,
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def _prom_variables(scope: Scope) -> list[dict[str, Any]]:
    host = "$dcgm_host_label"
    node = (
        'query_result(count by (node) (gpu_info{cluster=~"$cluster"}) or count by (node) '
        f'(label_replace(DCGM_FI_DEV_GPU_TEMP{{cluster=~"$cluster"}}, "node", "$1", "{host}", '
        '"(.+)")))'
    )
    gpu = (
        'query_result(count by (entity) (gpu_info{cluster=~"$cluster", node=~"$node"}) or '
        'count by (entity) (label_replace(DCGM_FI_DEV_GPU_TEMP{cluster=~"$cluster", '
        f'{host}=~"$node"}}, "entity", "$1", "UUID", "(.+)")))'
    )
    cluster = (
        'query_result(count by (cluster) (gpu_info{cluster!=""}) or count by (cluster) '
        '(DCGM_FI_DEV_GPU_TEMP{cluster!=""}))'
    )
    variables = [
        {
            "current": {"selected": True, "text": DCGM_HOST_LABELS[0],
                        "value": DCGM_HOST_LABELS[0]},
            "description": "Host label of dcgm-exporter series: Hostname in releases, "
            "hostname on main",
            "hide": 0,
            "includeAll": False,
            "label": "dcgm-exporter host label",
            "multi": False,
            "name": "dcgm_host_label",
            "options": [
                {"selected": index == 0, "text": value, "value": value}
                for index, value in enumerate(DCGM_HOST_LABELS)
            ],
            "query": ",".join(DCGM_HOST_LABELS),
            "skipUrlSync": False,
            "type": "custom",
        },
        _query_variable("cluster", "Cluster", Flavour.PROMETHEUS, cluster,
                        '/cluster="([^"]+)"/'),
    ]
    if scope >= Scope.NODE:
        variables.append(_query_variable("node", "Node", Flavour.PROMETHEUS, node,
                                         '/node="([^"]+)"/'))
    if scope >= Scope.GPU:
        variables.append(_query_variable("gpu", "GPU", Flavour.PROMETHEUS, gpu,
                                         '/entity="([^"]+)"/'))
    return variables


def _flux_tag_values(tag: str, conds: Iterable[str]) -> str:
    predicate = " and ".join([_flux_metric("gpu_info"), *conds])
    return (
        'import "influxdata/influxdb/schema"\n'
        f'schema.tagValues(bucket: v.defaultBucket, tag: "{tag}", '
        f"predicate: (r) => {predicate}, start: -7d)"
    )


def _flux_variables(scope: Scope) -> list[dict[str, Any]]:
    cluster_cond = "r.cluster =~ /^${cluster:regex}$/"
    variables = [
        _query_variable("cluster", "Cluster", Flavour.INFLUXDB,
                        _flux_tag_values("cluster", [])),
    ]
    if scope >= Scope.NODE:
        node_query = _flux_tag_values(
            "node", [f"(not exists r.cluster or {cluster_cond})"])
        variables.append(_query_variable("node", "Node", Flavour.INFLUXDB, node_query))
    if scope >= Scope.GPU:
        gpu_query = _flux_tag_values(
            "entity", [f"(not exists r.cluster or {cluster_cond})",
                       "r.node =~ /^${node:regex}$/"])
        variables.append(_query_variable("gpu", "GPU", Flavour.INFLUXDB, gpu_query))
    return variables


def _templating(scope: Scope, flavour: Flavour) -> dict[str, Any]:
    datasource = {
        "current": {},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": flavour.value,
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }
    more = _prom_variables(scope) if flavour is Flavour.PROMETHEUS else _flux_variables(scope)
    return {"list": [datasource, *more]}


_BUILTIN_ANNOTATION: dict[str, Any] = {
    "builtIn": 1,
    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    "enable": True,
    "hide": True,
    "iconColor": "rgba(0, 211, 255, 1)",
    "name": "Annotations & Alerts",
    "type": "dashboard",
}


def _xid_annotations(scope: Scope, flavour: Flavour) -> list[dict[str, Any]]:
    datasource = _datasource(flavour)
    gpu_scope = min(scope, Scope.GPU)
    if flavour is Flavour.PROMETHEUS:
        ours = _prom_selector("gpu_xid_events_total", gpu_scope, (), dcgm=False)
        theirs = _prom_selector("DCGM_FI_DEV_XID_ERRORS", gpu_scope, (), dcgm=True)
        return [
            {
                "datasource": dict(datasource),
                "enable": True,
                "expr": f"increase({ours}[2m]) > 0 or ({ours} unless {ours} offset 2m)",
                "hide": False,
                "iconColor": "red",
                "name": "Xid",
                "step": "60s",
                "tagKeys": "node,entity,xid",
                "textFormat": "{{node}} {{entity}}",
                "titleFormat": "Xid {{xid}}",
                "useValueForTime": False,
            },
            {
                "datasource": dict(datasource),
                "enable": True,
                "expr": f"changes({theirs}[2m]) > 0",
                "hide": False,
                "iconColor": "orange",
                "name": "Xid (dcgm-exporter)",
                "step": "60s",
                "tagKeys": "UUID,gpu",
                "textFormat": "{{UUID}}",
                "titleFormat": "dcgm-exporter: last Xid changed",
                "useValueForTime": False,
            },
        ]
    # One point per event (storage.lineprotocol), so every Xid is marked, the first too.
    conds = _flux_scope(gpu_scope)
    query = "\n".join([
        "from(bucket: v.defaultBucket)",
        "  |> range(start: v.timeRangeStart, stop: v.timeRangeStop)",
        f"  |> filter(fn: (r) => r._measurement == {_flux_string(EVENT_MEASUREMENT)} "
        'and r._field == "count" and r.kind == "xid")',
        f"  |> filter(fn: (r) => {' and '.join(conds)})",
        _flux_keep(["_time", "_value", "node", "entity", "code"]),
    ])
    return [{
        "datasource": dict(datasource),
        "enable": True,
        "hide": False,
        "iconColor": "red",
        "name": "Xid",
        "target": {"query": query, "refId": "Anno"},
    }]


def render_dashboard(spec: DashboardSpec, flavour: Flavour) -> dict[str, Any]:
    """Return the Grafana dashboard JSON model of one dashboard in one flavour.

    Args:
        spec: The dashboard.
        flavour: The datasource it queries.

    Returns:
        The JSON model (ecosystem-reference §8.1) with ``id`` ``None``, ready for file
        provisioning or ``POST /api/dashboards/db``.
    """
    annotations = [dict(_BUILTIN_ANNOTATION)]
    if spec.xid_annotations:
        annotations.extend(_xid_annotations(spec.scope, flavour))
    return {
        "annotations": {"list": annotations},
        "description": spec.description,
        "editable": True,
        "graphTooltip": 1,
        "id": None,
        "links": [{
            "asDropdown": True,
            "includeVars": True,
            "keepTime": True,
            "tags": ["gpuhealth", flavour.value],
            "title": "gpuhealth",
            "type": "dashboards",
        }],
        "panels": _panels(spec, flavour),
        "refresh": "1m",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["gpuhealth", flavour.value, spec.name],
        "templating": _templating(spec.scope, flavour),
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "utc",
        "title": f"{spec.title} ({_FLAVOUR_TITLE[flavour]})",
        "uid": dashboard_uid(spec.name, flavour),
        "version": 1,
    }


def render_all(flavour: Flavour) -> dict[str, dict[str, Any]]:
    """Return every shipped dashboard in ``flavour``, keyed by dashboard name."""
    return {spec.name: render_dashboard(spec, flavour) for spec in DASHBOARDS}


def dumps(dashboard: Mapping[str, Any]) -> str:
    """Serialize a dashboard deterministically (sorted keys, two-space indent, newline)."""
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def provisioning_yaml(flavours: Iterable[Flavour] = tuple(Flavour),
                      path: str = DEFAULT_PROVISIONING_PATH) -> str:
    """Return a Grafana dashboard provisioning file, one provider per flavour.

    Args:
        flavours: Flavours provisioned; each reads ``<path>/<flavour>``.
        path: Where the dashboard JSON files are on the Grafana host.

    Returns:
        YAML for ``/etc/grafana/provisioning/dashboards/`` (ecosystem-reference §8.2).
    """
    lines = [
        "# Generated by `gpuhealth dashboards render`; do not edit.",
        "# Copy to /etc/grafana/provisioning/dashboards/ and the JSON files under",
        f"# {path}/<flavour>/ (ecosystem-reference §8.2).",
        "apiVersion: 1",
        "providers:",
    ]
    for flavour in flavours:
        lines += [
            f"  - name: gpuhealth-{flavour.value}",
            "    orgId: 1",
            f"    folder: 'GPU Health ({_FLAVOUR_TITLE[flavour]})'",
            f"    folderUid: {folder_uid(f'GPU Health {flavour.value}')}",
            "    type: file",
            "    disableDeletion: false",
            "    updateIntervalSeconds: 60",
            "    allowUiUpdates: false",
            "    options:",
            f"      path: {path}/{flavour.value}",
            "      foldersFromFilesStructure: false",
        ]
    return "\n".join(lines) + "\n"


def write_dashboards(out_dir: Path, flavours: Iterable[Flavour] = tuple(Flavour),
                     *, provisioning_path: str = DEFAULT_PROVISIONING_PATH) -> list[Path]:
    """Write the dashboards and the provisioning YAML under ``out_dir``.

    Layout: ``<out_dir>/dashboards/<flavour>/<name>.json`` and
    ``<out_dir>/provisioning/dashboards/gpuhealth.yaml``. Files are rewritten only when
    their content changes.

    Args:
        out_dir: Output folder (``deploy/grafana`` in the repository).
        flavours: Flavours to write.
        provisioning_path: Dashboard folder on the Grafana host, named in the YAML.

    Returns:
        Every file path written or already up to date, sorted.
    """
    chosen = tuple(flavours)
    files: dict[Path, str] = {}
    for flavour in chosen:
        for name, dashboard in render_all(flavour).items():
            files[out_dir / "dashboards" / flavour.value / f"{name}.json"] = dumps(dashboard)
    files[out_dir / "provisioning" / "dashboards" / "gpuhealth.yaml"] = provisioning_yaml(
        chosen, provisioning_path)
    for path, text in files.items():
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        logger.info("wrote %s", path)
    return sorted(files)
