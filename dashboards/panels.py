"""What the gpuhealth dashboards show, independent of the datasource.

A :class:`DashboardSpec` is a list of :class:`PanelSpec`; a panel plots one or more
:class:`Query` (one catalogued metric each) or a :class:`Ratio` of two. Nothing here
knows PromQL or Flux: :mod:`dashboards.render` turns these specs into Grafana JSON for
each :class:`~dashboards.render.Flavour`. Every metric named here must be in
``core.catalog`` (checked when a :class:`Query` is built), so renaming a metric breaks
the build, not a production dashboard (style.md C.3.17).

Scopes decide which template variables filter a query: ``fleet`` queries filter on
``$cluster`` only, ``node`` queries also on ``$node``, ``gpu`` queries also on ``$gpu``.
A query never filters on a variable its metric cannot carry: gpuhealth's own metrics
(``gpuhealth_*``) have no ``node`` label, and network metrics have no GPU entity.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any

from core.catalog import BY_NAME, MetricSpec, MetricType


class Scope(IntEnum):
    """How far down a dashboard (or a query) filters: cluster, then node, then GPU."""

    FLEET = 1
    NODE = 2
    GPU = 3


class Fn(StrEnum):
    """What is done to each series before aggregation."""

    VALUE = "value"
    """The value as stored (gauges)."""
    RATE = "rate"
    """Per-second rate of a counter."""
    INCREASE = "increase"
    """Increase of a counter over the panel's interval."""


class Agg(StrEnum):
    """Aggregation across series (Prometheus aggregation operators, Flux aggregates)."""

    SUM = "sum"
    MAX = "max"
    AVG = "avg"
    COUNT = "count"


class PanelKind(StrEnum):
    """Grafana panel types used (ecosystem-reference §8.1)."""

    TIMESERIES = "timeseries"
    STAT = "stat"
    GAUGE = "gauge"


_GPU_KEYS = ("cluster", "node", "entity")


def metric_scope(spec: MetricSpec) -> Scope:
    """Return the narrowest scope a metric's labels allow.

    Examples:
        >>> metric_scope(BY_NAME["gpu_power_watts"]).name
        'GPU'
        >>> metric_scope(BY_NAME["probe_rtt_seconds"]).name
        'NODE'
        >>> metric_scope(BY_NAME["gpuhealth_open_findings"]).name
        'FLEET'
    """
    if spec.name.startswith("gpuhealth_"):
        return Scope.FLEET
    if spec.name.startswith("gpu_"):
        return Scope.GPU
    return Scope.NODE


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    """One catalogued metric, transformed and aggregated.

    Attributes:
        metric: Catalogued metric name.
        legend: Legend template with ``{{label}}`` placeholders (Prometheus).
        fn: Transformation of each series before aggregation.
        matchers: Exact label matches on catalogued labels, as ``(label, value)`` pairs.
        agg: Aggregation across series, or ``None`` to plot every series.
        by: Labels kept by ``agg``; empty for one total.
        above: Keep only values above this (after ``fn``, before ``agg``), or ``None``.
        dcgm: Also read dcgm-exporter's series for the same signal when gpuhealth's own
            series is absent (Prometheus flavour only). ``None`` uses the catalog mapping
            (``MetricSpec.dcgm`` and ``dcgm_scale``) when the query has no matchers and
            the metric has no labels besides ``node`` and ``entity`` (or the query
            aggregates them away, keeping only ``cluster``, ``node`` and ``entity``);
            ``""`` turns it off; a ``DCGM_FI_*`` name overrides the mapping (the scale
            stays the catalog's).

    Raises:
        ValueError: The metric is not catalogued, a matcher names a label the metric does
            not have, ``by`` is given without ``agg``, or ``fn`` does not suit the type.
    """

    metric: str
    legend: str = ""
    fn: Fn = Fn.VALUE
    matchers: tuple[tuple[str, str], ...] = ()
    agg: Agg | None = None
    by: tuple[str, ...] = ()
    above: float | None = None
    dcgm: str | None = None

    def __post_init__(self) -> None:
        spec = BY_NAME.get(self.metric)
        if spec is None:
            raise ValueError(f"metric {self.metric!r} is not in core.catalog")
        for label, _ in self.matchers:
            if label not in spec.labels:
                raise ValueError(f"{self.metric} has no label {label!r}")
        if self.by and self.agg is None:
            raise ValueError("'by' needs 'agg'")
        if self.fn is not Fn.VALUE and spec.type is not MetricType.COUNTER:
            raise ValueError(f"{self.fn} of gauge {self.metric}")
        if self.dcgm and not self.dcgm.startswith("DCGM_"):
            raise ValueError(f"not a dcgm-exporter series: {self.dcgm!r}")

    @property
    def spec(self) -> MetricSpec:
        """The catalog entry of :attr:`metric`."""
        return BY_NAME[self.metric]

    @property
    def dcgm_series(self) -> str:
        """The dcgm-exporter series read as a fallback, or ``""`` for none."""
        if self.dcgm is not None:
            return self.dcgm
        keeps_gpu_keys = self.agg is not None and all(label in _GPU_KEYS for label in self.by)
        plain = not self.matchers and (not self.spec.labels or keeps_gpu_keys)
        return self.spec.dcgm if plain else ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ratio:
    """One total divided by another (both aggregated to one series).

    Attributes:
        numerator: The dividend; its ``agg`` must be set and its ``by`` empty.
        denominator: The divisor, same constraints.
        legend: Legend of the quotient.

    Raises:
        ValueError: A side is not aggregated to one series.
    """

    numerator: Query
    denominator: Query
    legend: str = ""

    def __post_init__(self) -> None:
        for side in (self.numerator, self.denominator):
            if side.agg is None or side.by:
                raise ValueError("both sides of a Ratio must aggregate to one series")


@dataclass(frozen=True, slots=True, kw_only=True)
class PanelSpec:
    """One Grafana panel.

    Attributes:
        title: Panel title.
        queries: What it plots, one target each (refId A, B, ...).
        kind: Panel type.
        unit: Grafana unit id (``celsius``, ``watt``, ``percentunit``, ``s``, ...), or
            ``""`` to derive it from the first query's catalogued unit and ``fn``.
        description: Panel description; ``""`` takes the first metric's help text.
        width: Grid columns, 1-24.
        height: Grid rows (30 px each).
        thresholds: Steps ``(value, colour)`` after a green base, for stat and gauge.
        max_value: Fixed maximum of the axis or gauge, or ``None``.
    """

    title: str
    queries: tuple[Query | Ratio, ...]
    kind: PanelKind = PanelKind.TIMESERIES
    unit: str = ""
    description: str = ""
    width: int = 12
    height: int = 8
    thresholds: tuple[tuple[float, str], ...] = ()
    max_value: float | None = None

    def __post_init__(self) -> None:
        if not self.queries:
            raise ValueError(f"panel {self.title!r} has no query")
        if not 1 <= self.width <= 24:
            raise ValueError(f"panel width must be 1-24, got {self.width}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DashboardSpec:
    """One dashboard, before rendering.

    Attributes:
        name: Short slug (``fleet``, ``gpu``); the uid is derived from it and the flavour.
        title: Title without the flavour suffix.
        description: One line on what the dashboard is for.
        scope: Which template variables it has (cluster; + node; + GPU).
        panels: Panels, laid out left to right, top to bottom.
        xid_annotations: Mark Xid events on the time axis.
    """

    name: str
    title: str
    description: str
    scope: Scope
    panels: tuple[PanelSpec, ...]
    xid_annotations: bool = False


def _q(metric: str, legend: str = "", **kwargs: Any) -> Query:
    return Query(metric=metric, legend=legend, **kwargs)


_IB_ERRORS = (
    ("ib_symbol_errors_total", "symbol"),
    ("ib_link_error_recovery_total", "link error recovery"),
    ("ib_link_downed_total", "link downed"),
    ("ib_port_rcv_errors_total", "rcv errors"),
    ("ib_port_rcv_remote_physical_errors_total", "rcv remote physical"),
    ("ib_port_xmit_discards_total", "xmit discards"),
    ("ib_local_link_integrity_errors_total", "local link integrity"),
    ("ib_excessive_buffer_overrun_errors_total", "buffer overrun"),
)

_SEVERITY_STEPS = ((1.0, "orange"), (5.0, "red"))


def _increase_by(title: str, metric: str, by: tuple[str, ...], legend: str = "") -> PanelSpec:
    """A panel of a counter's increase per interval, summed by ``by`` (legend: those labels)."""
    legend = legend or " ".join(f"{{{{{label}}}}}" for label in by)
    return PanelSpec(
        title=title,
        queries=(_q(metric, legend, fn=Fn.INCREASE, agg=Agg.SUM, by=by),),
        unit="short",
    )


# Panels that stand the same on more than one dashboard.
_OPEN_INCIDENTS_BY_PHASE = PanelSpec(
    title="Open incidents by phase",
    queries=(_q("gpuhealth_open_incidents", "{{phase}}", agg=Agg.SUM, by=("phase",)),),
)
_OUT_OF_SERVICE_AND_BUDGET = (
    _q("gpuhealth_disrupted_nodes", "out of service", agg=Agg.SUM),
    _q("gpuhealth_disruption_budget_nodes", "budget", agg=Agg.SUM),
)
_GPU_XID_EVENTS = PanelSpec(
    title="Xid events",
    queries=(_q("gpu_xid_events_total", "{{entity}} Xid {{xid}}", fn=Fn.INCREASE),),
    unit="short",
)
_GPU_CLOCK_EVENTS = PanelSpec(
    title="Clock event reasons active",
    queries=(_q("gpu_clock_event_active", "{{entity}} {{reason}}"),),
)
_GPU_FAILURE_PROBABILITY = PanelSpec(
    title="Failure probability",
    queries=(_q("gpu_failure_probability_ratio", "{{entity}} {{horizon}}"),),
    max_value=1.0,
)
_GPU_NVLINK_ERRORS = PanelSpec(
    title="NVLink errors",
    queries=(
        _q("gpu_nvlink_errors_total", "{{entity}} link {{link}} {{type}}", fn=Fn.INCREASE),
    ),
    unit="short",
)
_GPU_PCIE_REPLAYS = PanelSpec(
    title="PCIe replays",
    queries=(_q("gpu_pcie_replays_total", "{{entity}}", fn=Fn.RATE),),
)

FLEET = DashboardSpec(
    name="fleet",
    title="GPU fleet overview",
    description="GPUs by health state, open incidents and findings, disruption budget, "
    "predicted failures",
    scope=Scope.FLEET,
    panels=(
        PanelSpec(
            title="GPUs by health state",
            kind=PanelKind.STAT,
            queries=(_q("gpuhealth_gpus", "{{state}}", agg=Agg.SUM, by=("state",)),),
            width=8,
        ),
        PanelSpec(
            title="Open incidents by severity",
            kind=PanelKind.STAT,
            queries=(
                _q("gpuhealth_open_incidents", "{{severity}}", agg=Agg.SUM, by=("severity",)),
            ),
            thresholds=_SEVERITY_STEPS,
            width=8,
        ),
        PanelSpec(
            title="Open findings by severity",
            kind=PanelKind.STAT,
            queries=(
                _q("gpuhealth_open_findings", "{{severity}}", agg=Agg.SUM, by=("severity",)),
            ),
            thresholds=_SEVERITY_STEPS,
            width=8,
        ),
        PanelSpec(
            title="Disruption budget in use",
            kind=PanelKind.GAUGE,
            description="Nodes out of service because of gpuhealth, as a fraction of the "
            "disruption budget (gpuhealth never exceeds 1)",
            queries=(
                Ratio(
                    numerator=_q("gpuhealth_disrupted_nodes", agg=Agg.SUM),
                    denominator=_q("gpuhealth_disruption_budget_nodes", agg=Agg.SUM),
                    legend="budget in use",
                ),
            ),
            unit="percentunit",
            thresholds=((0.8, "orange"), (1.0, "red")),
            max_value=1.0,
            width=6,
        ),
        PanelSpec(
            title="Nodes out of service (gpuhealth)",
            kind=PanelKind.STAT,
            queries=_OUT_OF_SERVICE_AND_BUDGET,
            width=6,
        ),
        PanelSpec(
            title="GPUs predicted to fail (p > 0.5)",
            kind=PanelKind.STAT,
            description="GPUs whose predicted failure probability within any horizon is "
            "above 0.5",
            queries=(
                _q("gpu_failure_probability_ratio", "GPUs", agg=Agg.COUNT, above=0.5),
            ),
            unit="short",
            thresholds=_SEVERITY_STEPS,
            width=6,
        ),
        PanelSpec(
            title="Fleet GPU power",
            kind=PanelKind.STAT,
            queries=(_q("gpu_power_watts", "power", agg=Agg.SUM),),
            width=6,
        ),
        PanelSpec(
            title="GPUs by health state over time",
            queries=(_q("gpuhealth_gpus", "{{state}}", agg=Agg.SUM, by=("state",)),),
        ),
        _OPEN_INCIDENTS_BY_PHASE,
        PanelSpec(
            title="Failure probability (GPUs above 0.1)",
            queries=(
                _q(
                    "gpu_failure_probability_ratio",
                    "{{node}} {{entity}} {{horizon}}",
                    above=0.1,
                ),
            ),
            max_value=1.0,
        ),
        _increase_by("Xid events by code", "gpu_xid_events_total", ("xid",), "Xid {{xid}}"),
        _increase_by("Findings by severity", "gpuhealth_findings_total", ("severity",)),
        PanelSpec(
            title="Hottest GPU per node",
            queries=(_q("gpu_temperature_celsius", "{{node}}", agg=Agg.MAX, by=("node",)),),
        ),
    ),
)

NODE = DashboardSpec(
    name="node",
    title="GPU node",
    description="Every GPU and link of one node side by side",
    scope=Scope.NODE,
    xid_annotations=True,
    panels=(
        PanelSpec(title="GPU temperature", queries=(_q("gpu_temperature_celsius", "{{entity}}"),)),
        PanelSpec(title="GPU power", queries=(_q("gpu_power_watts", "{{entity}}"),)),
        PanelSpec(title="GPU utilization", queries=(_q("gpu_utilization_ratio", "{{entity}}"),)),
        PanelSpec(title="GPU memory used", queries=(_q("gpu_memory_used_bytes", "{{entity}}"),)),
        _GPU_XID_EVENTS,
        PanelSpec(
            title="ECC errors",
            queries=(
                _q("gpu_ecc_errors_total", "{{entity}} {{type}} {{scope}}", fn=Fn.INCREASE,
                   agg=Agg.SUM, by=("node", "entity", "type", "scope")),
            ),
            unit="short",
        ),
        _GPU_CLOCK_EVENTS,
        _GPU_FAILURE_PROBABILITY,
        _GPU_NVLINK_ERRORS,
        _GPU_PCIE_REPLAYS,
        PanelSpec(
            title="Network throughput",
            queries=(
                _q("net_rx_bytes_total", "{{interface}} rx", fn=Fn.RATE),
                _q("net_tx_bytes_total", "{{interface}} tx", fn=Fn.RATE),
            ),
        ),
        PanelSpec(
            title="InfiniBand port state",
            description="4 is ACTIVE; anything lower is a port not carrying traffic",
            queries=(_q("ib_port_state", "{{device}}/{{port}}"),),
        ),
    ),
)

GPU = DashboardSpec(
    name="gpu",
    title="GPU detail",
    description="One GPU: thermals, power, memory errors, clock events, Xids, prediction",
    scope=Scope.GPU,
    xid_annotations=True,
    panels=(
        PanelSpec(
            title="Temperatures",
            queries=(
                _q("gpu_temperature_celsius", "{{entity}} GPU"),
                _q("gpu_memory_temperature_celsius", "{{entity}} memory"),
            ),
        ),
        PanelSpec(
            title="Power",
            queries=(
                _q("gpu_power_watts", "{{entity}} draw"),
                _q("gpu_power_limit_watts", "{{entity}} limit"),
            ),
        ),
        PanelSpec(
            title="ECC errors",
            queries=(
                _q("gpu_ecc_errors_total", "{{entity}} {{type}} {{scope}} {{location}}",
                   fn=Fn.INCREASE),
            ),
            unit="short",
        ),
        PanelSpec(
            title="Remapped rows",
            queries=(
                _q("gpu_remapped_rows", "{{entity}} uncorrectable",
                   matchers=(("type", "uncorrectable"),),
                   dcgm="DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
                _q("gpu_remapped_rows", "{{entity}} correctable",
                   matchers=(("type", "correctable"),),
                   dcgm="DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"),
            ),
        ),
        PanelSpec(
            title="Row remap pending and failure",
            queries=(
                _q("gpu_row_remap_pending", "{{entity}} pending"),
                _q("gpu_row_remap_failure", "{{entity}} failure"),
            ),
        ),
        PanelSpec(
            title="Retired pages",
            queries=(
                _q("gpu_retired_pages", "{{entity}} {{cause}}"),
                _q("gpu_retired_pages_pending", "{{entity}} pending"),
            ),
        ),
        _GPU_CLOCK_EVENTS,
        PanelSpec(
            title="Time held back by thermal and power limits",
            queries=(
                _q("gpu_thermal_violation_seconds_total", "{{entity}} thermal", fn=Fn.RATE),
                _q("gpu_power_violation_seconds_total", "{{entity}} power", fn=Fn.RATE),
            ),
            unit="percentunit",
        ),
        PanelSpec(
            title="Clocks",
            queries=(
                _q("gpu_sm_clock_hertz", "{{entity}} SM"),
                _q("gpu_memory_clock_hertz", "{{entity}} memory"),
            ),
        ),
        PanelSpec(
            title="Utilization",
            queries=(
                _q("gpu_utilization_ratio", "{{entity}} GPU"),
                _q("gpu_memory_utilization_ratio", "{{entity}} memory"),
            ),
            max_value=1.0,
        ),
        _GPU_XID_EVENTS,
        PanelSpec(
            title="Last Xid and recovery action",
            description="The last Xid number (a pointer, not a count) and NVML's recovery "
            "action (0 none, 1 reset, 2 reboot, 3 drain P2P, 4 drain and reset)",
            queries=(
                _q("gpu_last_xid", "{{entity}} last Xid"),
                _q("gpu_recovery_action", "{{entity}} recovery action"),
            ),
            unit="short",
        ),
        _GPU_FAILURE_PROBABILITY,
        _GPU_NVLINK_ERRORS,
        _GPU_PCIE_REPLAYS,
        PanelSpec(
            title="Memory used",
            queries=(_q("gpu_memory_used_bytes", "{{entity}}"),),
        ),
    ),
)

NETWORK = DashboardSpec(
    name="network",
    title="GPU network",
    description="Probe loss and RTT, NIC counters, InfiniBand error rates per port",
    scope=Scope.NODE,
    panels=(
        PanelSpec(
            title="Probe loss",
            queries=(_q("probe_loss_ratio", "{{node}} to {{peer}} ({{method}})"),),
            max_value=1.0,
        ),
        PanelSpec(
            title="Probe RTT",
            queries=(_q("probe_rtt_seconds", "{{node}} to {{peer}} ({{method}})"),),
        ),
        PanelSpec(
            title="NIC errors and drops",
            queries=(
                _q("net_rx_errors_total", "{{node}} {{interface}} rx errors", fn=Fn.RATE),
                _q("net_tx_errors_total", "{{node}} {{interface}} tx errors", fn=Fn.RATE),
                _q("net_rx_dropped_total", "{{node}} {{interface}} rx dropped", fn=Fn.RATE),
                _q("net_tx_dropped_total", "{{node}} {{interface}} tx dropped", fn=Fn.RATE),
            ),
        ),
        PanelSpec(
            title="Link flaps",
            queries=(
                _q("net_carrier_changes_total", "{{node}} {{interface}}", fn=Fn.INCREASE),
            ),
            unit="short",
        ),
        *(
            PanelSpec(
                title=f"InfiniBand {label} errors per port",
                queries=(_q(metric, "{{node}} {{device}}/{{port}}", fn=Fn.RATE),),
                width=8,
            )
            for metric, label in _IB_ERRORS
        ),
        PanelSpec(
            title="InfiniBand congestion (xmit wait)",
            description="Ticks with data to send but no credits: congestion, not a fault",
            queries=(_q("ib_port_xmit_wait_total", "{{node}} {{device}}/{{port}}", fn=Fn.RATE),),
            width=8,
        ),
        PanelSpec(
            title="InfiniBand throughput",
            queries=(
                _q("ib_port_rcv_bytes_total", "{{node}} {{device}}/{{port}} rx", fn=Fn.RATE),
                _q("ib_port_xmit_bytes_total", "{{node}} {{device}}/{{port}} tx", fn=Fn.RATE),
            ),
        ),
        PanelSpec(
            title="InfiniBand port state",
            description="4 is ACTIVE; anything lower is a port not carrying traffic",
            queries=(_q("ib_port_state", "{{node}} {{device}}/{{port}}"),),
        ),
        PanelSpec(
            title="RDMA transport counters",
            queries=(
                _q("rdma_hw_counter_total", "{{node}} {{device}}/{{port}} {{counter}}",
                   fn=Fn.RATE),
            ),
        ),
    ),
)

REMEDIATION = DashboardSpec(
    name="remediation",
    title="GPU remediation",
    description="Remediation actions over time, time to remediate, disruption budget",
    scope=Scope.FLEET,
    panels=(
        _increase_by("Actions by step and phase", "gpuhealth_remediation_actions_total",
                     ("step", "phase")),
        _increase_by("Policy decisions", "gpuhealth_remediation_decisions_total",
                     ("step", "decision")),
        PanelSpec(
            title="Mean time to remediate",
            description="Mean time from detection to back in service of the incidents "
            "resolved in each interval",
            queries=(
                Ratio(
                    numerator=_q("gpuhealth_time_to_remediate_seconds_total", fn=Fn.RATE,
                                 agg=Agg.SUM),
                    denominator=_q("gpuhealth_incidents_resolved_total", fn=Fn.RATE,
                                   agg=Agg.SUM),
                    legend="mean time to remediate",
                ),
            ),
            unit="s",
        ),
        PanelSpec(
            title="Incidents resolved",
            queries=(
                _q("gpuhealth_incidents_resolved_total", "resolved", fn=Fn.INCREASE,
                   agg=Agg.SUM),
            ),
            unit="short",
        ),
        PanelSpec(
            title="Nodes out of service and budget",
            queries=_OUT_OF_SERVICE_AND_BUDGET,
        ),
        _OPEN_INCIDENTS_BY_PHASE,
    ),
)

SELF = DashboardSpec(
    name="self",
    title="gpuhealth health",
    description="gpuhealth's own health: collector errors, samples written, lag, queues",
    scope=Scope.FLEET,
    panels=(
        _increase_by("Collector errors", "gpuhealth_collector_errors_total",
                     ("collector", "reason")),
        PanelSpec(
            title="Records written",
            queries=(
                _q("gpuhealth_samples_written_total", "samples", fn=Fn.RATE, agg=Agg.SUM),
                _q("gpuhealth_events_written_total", "events", fn=Fn.RATE, agg=Agg.SUM),
            ),
        ),
        PanelSpec(
            title="Pipeline lag",
            queries=(
                _q("gpuhealth_pipeline_lag_seconds", "{{stage}}", agg=Agg.MAX, by=("stage",)),
            ),
        ),
        PanelSpec(
            title="Collection duration",
            queries=(
                _q("gpuhealth_collection_duration_seconds", "{{collector}}", agg=Agg.MAX,
                   by=("collector",)),
            ),
        ),
        PanelSpec(
            title="Spool and outbox depth",
            queries=(
                _q("gpuhealth_spool_depth", "spool", agg=Agg.SUM),
                _q("gpuhealth_outbox_depth", "outbox", agg=Agg.SUM),
            ),
            unit="short",
        ),
        _increase_by("Alerts delivered", "gpuhealth_alerts_sent_total", ("notifier",)),
    ),
)

DASHBOARDS: tuple[DashboardSpec, ...] = (FLEET, NODE, GPU, NETWORK, REMEDIATION, SELF)
"""Every dashboard gpuhealth ships, in menu order."""
