"""Grafana dashboards generated from the metric catalog (style.md C.3.17).

:mod:`dashboards.panels` says what each dashboard shows, :mod:`dashboards.render` turns
it into Grafana JSON for a Prometheus or an InfluxDB (Flux) datasource and writes the
file-provisioning tree, and :mod:`dashboards.grafana` saves the dashboards through
Grafana's HTTP API. The HTTP part is not re-exported here, so rendering never imports
``grafana-client`` (and its HTTP stack).
"""

from __future__ import annotations

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
)
from dashboards.render import (
    SCHEMA_VERSION,
    Flavour,
    dashboard_uid,
    dumps,
    flux,
    folder_uid,
    promql,
    provisioning_yaml,
    render_all,
    render_dashboard,
    write_dashboards,
)

__all__ = [
    "DASHBOARDS",
    "SCHEMA_VERSION",
    "Agg",
    "DashboardSpec",
    "Flavour",
    "Fn",
    "PanelKind",
    "PanelSpec",
    "Query",
    "Ratio",
    "Scope",
    "dashboard_uid",
    "dumps",
    "flux",
    "folder_uid",
    "promql",
    "provisioning_yaml",
    "render_all",
    "render_dashboard",
    "write_dashboards",
]
