"""Settings: one TOML file validated into frozen pydantic models at start-up (style.md C.3.13).

The file has one table per stage (``[node]``, ``[metrics]``, ``[collectors.<name>]``,
``[storage]``, ``[analytics]``, ``[alerting]``, ``[remediation]``, ``[inventory]``,
``[time]``). Unknown keys are errors that name the file and the key path; durations may
be written ``"30s"``, ``"5m"``, ``"1h"``, ``"7d"`` or as numbers of seconds and are
normalised to float ``*_seconds``; environment variables ``GPUHEALTH_<SECTION>__<KEY>``
override the file and are validated the same way; secrets are never read from the file,
only from the environment (``webhook_secret_env``) or a file (``webhook_secret_file``).

``docs/configuration.md`` is the reference for every key.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import socket
import tomllib
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from alerting.alerts import AlertPolicy
from analytics.fault_model import check_facts
from analytics.fault_model.debounce import (
    DEBOUNCED_KINDS,
    DEFAULT_DEBOUNCE,
    MAX_WINDOW,
    check_policy,
)
from analytics.fault_model.kinds import FINDING_KINDS
from analytics.fault_model.site_rules import pattern_problem
from analytics.online import DEFAULT_DETECTOR_BY_METRIC, check_detector_by_metric
from core.errors import ConfigError, PluginError
from core.plugins import available
from core.protocols import Closeable
from core.records import Action, RemediationStep, Severity

if TYPE_CHECKING:
    from remediation.priority import PreemptionPolicy

logger = logging.getLogger(__name__)

ENV_PREFIX = "GPUHEALTH_"
"""Prefix of the environment overrides; ``__`` separates the key path."""

DEFAULT_DATA_DIR = Path("./gpuhealth-data")
"""Where ``run`` keeps its database and audit log unless ``[node] data_dir`` says otherwise."""

DEFAULT_METRICS_PORT = 9835
"""The ``/metrics`` port: the one nvidia_gpu_exporter-style GPU exporters commonly use."""

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)\s*$")


def parse_duration(value: object) -> object:
    """Turn ``"30s"``, ``"5m"``, ``"1h"``, ``"7d"``, ``"250ms"`` or a number into seconds.

    Args:
        value: A number of seconds or a string with one unit suffix.

    Returns:
        Float seconds; values of other types are returned unchanged for pydantic to reject.

    Raises:
        ValueError: A string that is not a duration, a boolean, or a negative or infinite
            number.

    Examples:
        >>> parse_duration("5m")
        300.0
        >>> parse_duration(2)
        2.0
        >>> parse_duration("250ms")
        0.25
    """
    if isinstance(value, bool):  # pydantic would read true as 1 s
        raise ValueError(f"not a duration: the boolean {str(value).lower()} (write e.g. 30s, "  # noqa: TRY004
                         "5m, 1h, 7d or a number of seconds)")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            try:
                seconds = float(value)
            except ValueError:
                raise ValueError(
                    f"not a duration: {value!r} (write e.g. 30s, 5m, 1h, 7d or a number of seconds)"
                ) from None
        else:
            seconds = float(match["num"]) * _UNITS[match["unit"]]
    else:
        return value
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration must be a finite number of seconds >= 0, got {value!r}")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]
"""Seconds, written as a number or as ``"30s"``/``"5m"``/``"1h"``/``"7d"``."""


def _number_not_bool(value: Any) -> Any:
    """Refuse ``true``/``false`` where a number is meant (pydantic would read 1.0/0.0)."""
    if isinstance(value, bool):
        # pydantic turns a ValueError into a ValidationError naming the key; a TypeError not
        raise ValueError(f"a number is needed, got the boolean {str(value).lower()}")  # noqa: TRY004
    return value


Fraction = Annotated[float, BeforeValidator(_number_not_bool)]
"""A share, a plain number (``0.25``); a boolean is refused rather than read as 1 or 0."""

_FROZEN = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class NodeSettings(BaseModel):
    """``[node]``: who this node is and where it keeps its data."""

    model_config = _FROZEN

    name: str = Field(default_factory=socket.gethostname, min_length=1)
    """Node name put on every record; default the host name, as schedulers know the node."""

    data_dir: Path = DEFAULT_DATA_DIR
    """Folder for the database and audit log, relative to the working directory unless
    absolute; ``run`` creates it. Default ``./gpuhealth-data`` so that a first run needs no
    root and writes nowhere surprising."""


class MetricsSettings(BaseModel):
    """``[metrics]``: the Prometheus ``/metrics`` endpoint."""

    model_config = _FROZEN

    enabled: StrictBool = True
    """Serve ``/metrics``; on by default because it is how Prometheus and Grafana see us."""

    listen_address: str = "127.0.0.1"
    """Address to bind; loopback by default (architecture principle 5: safe by default)."""

    port: int = Field(default=DEFAULT_METRICS_PORT, ge=0, le=65535)
    """TCP port; 9835, the port GPU exporters in the nvidia_gpu_exporter family use, so
    existing scrape configs find it. 0 picks a free port (logged at start)."""


class CollectorSettings(BaseModel):
    """``[collectors.<name>]``: one collector plugin and its keyword arguments.

    ``type``, ``enabled`` and ``interval_seconds`` are read by the service; every other
    key is passed to the plugin's constructor (keys ending in ``_seconds`` accept durations).
    """

    model_config = ConfigDict(frozen=True, extra="allow", validate_default=True)

    type: str = Field(min_length=1)
    """Entry-point name in ``gpuhealth.collectors`` (``nvml``, ``kernel_log``, ``network``,
    ``probe``, ``dcgm_exporter``); defaults to the table name."""

    enabled: StrictBool = True
    """Run this collector; set ``false`` to switch off a default one."""

    interval_seconds: Duration | None = Field(default=None, gt=0)
    """Seconds between two ``collect()`` calls; default the plugin's
    ``fast_interval_seconds`` when it has one, else 10 s (counters every 10 s resolve a
    link flap without filling the store)."""

    @model_validator(mode="before")
    @classmethod
    def _durations(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        out = {}
        for k, v in data.items():
            try:
                out[k] = (parse_duration(v) if k.endswith("_seconds") and k != "interval_seconds"
                          else v)
            except ValueError as exc:  # a model's validator: pydantic names only the table
                raise ValueError(f"{k}: {exc}") from None
        return out

    @property
    def options(self) -> dict[str, Any]:
        """Return the plugin's keyword arguments (every key but the service's own)."""
        return dict(self.model_extra or {})

    @property
    def poll_interval_seconds(self) -> float:
        """Return the seconds between two polls of this collector."""
        if self.interval_seconds is not None:
            return self.interval_seconds
        fast = self.options.get("fast_interval_seconds")
        if isinstance(fast, int | float) and not isinstance(fast, bool) and fast > 0:
            return float(fast)
        return 10.0


DEFAULT_COLLECTORS: dict[str, dict[str, Any]] = {
    "nvml": {"type": "nvml", "fast_interval_seconds": 1.0, "slow_interval_seconds": 30.0},
    "kernel_log": {"type": "kernel_log"},
    "network": {"type": "network", "interval_seconds": 10.0},
    "probe": {"type": "probe", "peers": [], "interval_seconds": 10.0},
}
"""Collector tables present unless switched off; a file's table of the same name is merged
over its default. ``dcgm_exporter`` is absent: add ``[collectors.dcgm_exporter] url = ...``."""


class StorageSettings(BaseModel):
    """``[storage]``: the time-series store and the buffer in front of it."""

    model_config = _FROZEN

    type: Literal["sqlite", "influxdb", "promql"] = "sqlite"
    """Store plugin (``gpuhealth.stores``): ``sqlite``, the embedded default that needs no
    server; ``influxdb`` writes to InfluxDB 2 or VictoriaMetrics through a durable spool;
    ``promql`` only reads Prometheus or VictoriaMetrics (``/api/v1/query_range``: gpuhealth's
    series as scraped from its ``/metrics``, and dcgm-exporter's), for ``export`` and reads;
    ``gpuhealth run`` then writes nothing itself."""

    path: Path | None = None
    """SQLite file; default ``<data_dir>/gpuhealth.sqlite``."""

    url: str | None = None
    """``influxdb`` and ``promql``: base URL (``http://victoria:8428``,
    ``http://influx:8086``, ``http://prometheus:9090``); required."""

    org: str = "gpuhealth"
    """``influxdb``: organization (any value for VictoriaMetrics)."""

    bucket: str = "gpuhealth"
    """``influxdb``: bucket written and read."""

    token_env: str = "INFLUX_TOKEN"
    """``influxdb``: environment variable holding the API token (never the file)."""

    spool_max_bytes: int = Field(default=256 * 1024 * 1024, ge=4096)
    """``influxdb``: bound of the on-disk spool in ``<data_dir>/spool`` (256 MiB holds about
    an hour of 10,000 GPUs x 30 metrics); beyond it the oldest samples are dropped and
    counted, events never."""

    @field_validator("url")
    @classmethod
    def _url_for_influxdb(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("type")
        if kind in ("influxdb", "promql") and not value:
            raise ValueError(f"required when type = {kind!r}")
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http:// or https:// URL")
        return value

    retention_seconds: Duration = Field(default=7 * 86400.0, gt=0)
    """How long samples and events are kept (default ``7d``): a week covers the weekly report
    and keeps the file near 2 GB for 8 GPUs sampled at 1 Hz."""

    flush_interval_seconds: Duration = Field(default=1.0, gt=0)
    """Longest a record waits in memory before it is written (1 s: one transaction per
    second is cheap for SQLite and loses at most a second on a crash)."""

    flush_max_records: int = Field(default=5000, ge=1)
    """Write as soon as this many records are buffered (one transaction per batch)."""

    queue_max_records: int = Field(default=200_000, ge=1)
    """Bound of the in-memory buffer; the oldest records are dropped (and counted) beyond it,
    so a stuck store cannot exhaust memory (about a minute of 1 Hz data for 100 GPUs)."""


class DebounceSettings(BaseModel):
    """``[analytics.debounce] <kind> = { n = 2, m = 3 }``: ``n`` bad of the last ``m`` readings."""

    model_config = _FROZEN

    n: int = Field(ge=1)
    """Readings that must show the state bad."""
    m: int = Field(ge=1, le=MAX_WINDOW)
    """Of this many latest readings (the window), ``m >= n``."""

    @model_validator(mode="after")
    def _n_of_m(self) -> DebounceSettings:
        if self.n > self.m:
            raise ValueError(f"n = {self.n} is more than m = {self.m} (n of the last m "
                             "readings)")
        return self


def debounce_policies(analytics: AnalyticsSettings) -> dict[str, tuple[int, int]]:
    """The ``(n, m)`` per kind of ``[analytics.debounce]`` (for the ``Debouncer``)."""
    return {kind: (p.n, p.m) for kind, p in analytics.debounce.items()}


class AnalyticsSettings(BaseModel):
    """``[analytics]``: how often the rules look at what was collected."""

    model_config = _FROZEN

    evaluate_interval_seconds: Duration = Field(default=5.0, gt=0)
    """Seconds between two rule evaluations; 5 s alerts quickly without re-evaluating per sample."""

    event_window_seconds: Duration = Field(default=86400.0, gt=0)
    """How long an event (an Xid, an AER error) keeps its finding open without recurring
    (default ``24h``: a day covers a drain and a repair; states such as a lost GPU or a
    pending remap are re-read by the collectors and stay open while they hold)."""
    boot_window_seconds: Duration = Field(default=600.0, ge=0)
    """After a node boots (its kernel log's ``Linux version`` line), findings of
    ``boot_window_kinds`` last seen within this long are held back: links train and
    services start on every reboot (NVSentinel #1701); 0 holds nothing back."""
    boot_window_kinds: tuple[str, ...] = ("nvlink", "ib_port", "nic_port", "bond", "fabric",
                                          "fabric_manager", "nvls")
    """Finding kinds a boot raises for a while (docs/remediation.md, "Boot windows")."""

    debounce: dict[str, DebounceSettings] = Field(
        default_factory=lambda: {k: DebounceSettings(n=n, m=m)
                                 for k, (n, m) in DEFAULT_DEBOUNCE.items()})
    """``[analytics.debounce]``: a polled state (NVLink, PCIe link, IB port, bond) becomes a
    finding only when ``n`` of its last ``m`` readings show it bad, per finding kind
    (``nvlink = { n = 2, m = 3 }``, the default of each); ``{ n = 1, m = 1 }`` switches a
    kind off. A file's keys are merged over the defaults. Events (an Xid) are never
    debounced (``docs/configuration.md``, "Debounce")."""

    @field_validator("debounce", mode="before")
    @classmethod
    def _debounced_kinds(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        for kind in value:
            if kind not in DEBOUNCED_KINDS:
                raise ValueError(f"{kind}: {check_policy(str(kind), 1, 1)}")
        return {**{k: {"n": n, "m": m} for k, (n, m) in DEFAULT_DEBOUNCE.items()}, **value}

    detectors: StrictBool = True
    """Run the online detectors (``analytics.online``) on every sample the service handles:
    per-series anomalies (``warning`` findings of kind ``anomaly``, never more), telemetry
    gaps and peer comparison of GPU temperature at equal power."""

    detector: Literal["dspot", "spot", "ewma_z", "quantile"] = "dspot"
    """The per-series detector for every signal ``detector_by_metric`` does not name
    (``docs/analytics.md``); ``dspot`` follows slow drifts and scored best on NAB."""

    detector_by_metric: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_DETECTOR_BY_METRIC))
    """Detector per signal: keys are catalog metric names or ``metric{type=...}``
    (``"gpu_ecc_errors_total{type=corrected}"``), values ``dspot``, ``spot``, ``ewma_z``,
    ``quantile`` or ``none`` (not scored). The defaults are the best detector per signal on
    the labelled stream (``docs/analytics.md``, "Per-signal detectors"); a file's table
    replaces them whole (``{}``: ``detector`` for every signal)."""

    @field_validator("detector_by_metric")
    @classmethod
    def _known_signals(cls, value: dict[str, str]) -> dict[str, str]:
        # Keys as the detectors match them (``{type="corrected"}`` -> ``{type=corrected}``);
        # every key that could never match is named, not just the first.
        return check_detector_by_metric(value)

    warmup_samples: int = Field(default=500, ge=20)
    """Samples per series before the detector may flag one (SPOT's calibration window)."""

    gap_seconds: Duration = Field(default=120.0, gt=0)
    """Shortest silence of a GPU that becomes a ``telemetry_gap`` finding (and at least five
    of its usual intervals between samples)."""

    anomaly_hold_seconds: Duration = Field(default=3600.0, gt=0)
    """How long an anomaly finding stays open after its last flagged sample."""

    predictor: StrictBool = True
    """Run the online failure predictor (``analytics.prediction_stage``): features per GPU
    and InfiniBand port, a probability of failure within the horizon, labels from later
    critical findings, state checkpointed to ``<data_dir>/predictor.pkl``."""

    predictor_horizon_seconds: Duration = Field(default=86400.0, gt=0)
    """The prediction horizon: a failure within it after a vector makes the vector positive."""

    predictor_interval_seconds: Duration = Field(default=300.0, gt=0)
    """One prediction per entity at most this often."""

    predictor_sustain_seconds: Duration = Field(default=1800.0, ge=0, le=86400.0)
    """A published probability is the lowest the model gave the GPU or port over this
    window (``analytics.prediction_stage.SustainedProbability``): a half-hour burst of
    evidence is no warning. 0 publishes every prediction as the model gives it; at most a
    day (a longer window would hold back nearly every warning, and its memory grows with it)."""

    vector_detector: StrictBool = False
    """Also score each GPU's and port's whole feature vector with river's HalfSpaceTrees
    (``warning`` anomalies); off by default: its precision on the labelled stream is low
    (``docs/analytics.md``)."""

    predictor_min_positives: int = Field(default=5, ge=0)
    """Failures the model must have learned before its predictions alert (an untrained
    model would flag everything)."""

    predictor_refit: StrictBool | None = None
    """Refit the scikit-learn batch model hourly from the predictor's labelled history and
    serve it while it beats the online model (``analytics.refit``). ``None`` (default): on
    for ``gpuhealth run``, off for ``gpuhealth agent``, where importing scikit-learn would
    add ~40 MiB to every node (issue #13) for a model of one node's few failures; the
    online predictor runs either way."""


class AlertPolicySettings(BaseModel):
    """``[alerting.policies."<class>"]``: when one fault class (``xid:13``) alerts."""

    model_config = _FROZEN

    for_seconds: Duration = Field(default=0.0, alias="for")
    """How long a finding must hold before it fires (Prometheus ``for``); 0 fires on first
    sight, right for states that persist (a port down, a lost GPU)."""

    debounce_count: int = Field(default=1, ge=1)
    """Occurrences needed within ``debounce_window`` before it alerts; 1 = no debounce."""

    debounce_window_seconds: Duration = Field(default=0.0, alias="debounce_window")
    """The debounce window (for example ``"10m"`` for three Xid 13 in ten minutes)."""

    keep_firing_for_seconds: Duration = Field(default=0.0, alias="keep_firing_for")
    """How long an alert keeps firing after its finding disappears (anti-flap)."""

    @model_validator(mode="after")
    def _window_with_count(self) -> AlertPolicySettings:
        if self.debounce_count > 1 and self.debounce_window_seconds <= 0:
            raise ValueError("debounce_count > 1 needs a debounce_window")
        return self


class AlertingSettings(BaseModel):
    """``[alerting]``: which findings become alerts, how they are grouped, and where they go."""

    model_config = _FROZEN

    min_severity: Severity = Severity.WARNING
    """Lowest severity that alerts; ``info`` findings are for dashboards and reports only."""

    page_severity: Severity = Severity.MAJOR
    """Lowest severity that pages (fault-model.md: critical and major page, warnings are
    tickets)."""

    group_by: tuple[str, ...] = ("cluster", "node")
    """Labels that group alerts into one page: one page per node and cluster."""

    cluster: str | None = None
    """``cluster`` label on every alert (and the PagerDuty dedup key prefix); none by default."""

    resend_interval_seconds: Duration = Field(default=4 * 3600.0, gt=0)
    """Re-send an unchanged firing alert to every notifier after this long (Alertmanager's
    ``repeat_interval`` default, 4 h)."""

    runbook_base_url: str = "docs/runbooks"
    """Prefix of the ``runbook_url`` annotation (``<base>/<kind>.md``); the site's URL of
    the runbooks, or the folder shipped with gpuhealth."""

    policies: dict[str, AlertPolicySettings] = Field(default_factory=dict)
    """Alert policy per fault class (``kind:code``, ``kind`` or ``*``); every class alerts on
    first sight by default."""

    webhook_url: str | None = None
    """Signed webhook receiver (https://...); none by default, alerts go to the log."""

    webhook_secret_env: str | None = None
    """Name of the environment variable holding the webhook signing secret."""

    webhook_secret_file: Path | None = None
    """File holding the webhook signing secret (first line); alternative to the variable."""

    webhook_route: Literal["alerts", "pages"] = "alerts"
    """What the webhook gets: every alert, or only pages (one per node group)."""

    alertmanager_url: str | None = None
    """Alertmanager to push alerts to (``http://127.0.0.1:9093``); none by default."""

    alertmanager_resend_interval_seconds: Duration = Field(default=60.0, gt=0)
    """How often firing alerts are re-sent to Alertmanager, which resolves alerts that stop
    coming (each carries ``endsAt`` four intervals ahead)."""

    pagerduty_routing_key_env: str | None = None
    """Environment variable holding the PagerDuty Events API v2 routing key; pages go to
    PagerDuty when this or ``pagerduty_routing_key_file`` is set."""

    pagerduty_routing_key_file: Path | None = None
    """File holding the PagerDuty routing key (first line)."""

    pagerduty_url: str = "https://events.pagerduty.com/v2/enqueue"
    """Events API v2 endpoint (PagerDuty's EU endpoint, or a local server in tests)."""

    silences_file: Path | None = None
    """Silences shared by the CLI, the HTTP API and the service; default
    ``<data_dir>/silences.json``."""

    outbox_file: Path | None = None
    """Durable outbox of undelivered notifications; default ``<data_dir>/outbox.sqlite``."""

    outbox_max_per_notifier: int = Field(default=10_000, ge=1)
    """Notifications kept per notifier while it is down (re-sends of one alert coalesce);
    10,000 covers an hour-long outage of a large fleet."""

    api_enabled: StrictBool = True
    """Serve the alerting HTTP API (alerts, silences, ingest) beside ``/metrics``."""

    api_listen_address: str = "127.0.0.1"
    """Address of the alerting API; loopback by default (architecture principle 5)."""

    api_port: int = Field(default=9836, ge=0, le=65535)
    """Port of the alerting API; the one after ``/metrics``' 9835."""

    api_token_env: str | None = None
    """Environment variable holding the bearer token that creating or expiring silences and
    ingesting need; required when the API listens beyond loopback."""

    @model_validator(mode="after")
    def _one_secret_source(self) -> AlertingSettings:
        if self.webhook_secret_env and self.webhook_secret_file:
            raise ValueError("set webhook_secret_env or webhook_secret_file, not both")
        if self.pagerduty_routing_key_env and self.pagerduty_routing_key_file:
            raise ValueError("set pagerduty_routing_key_env or pagerduty_routing_key_file, "
                             "not both")
        if self.api_listen_address not in ("127.0.0.1", "::1", "localhost") and not (
            self.api_token_env
        ):
            raise ValueError("api_token_env is required when the API listens beyond loopback")
        return self


def _known_plugin(group: str, name: str) -> str:
    """Refuse a plugin name that is not installed (a typo shows at ``config check``)."""
    installed = available(group)
    if name not in installed:
        raise ValueError(f"no plugin {name!r} in {group}; installed: {', '.join(installed)}")
    return name


class PreemptionSettings(BaseModel):
    """``[remediation.preemption]``: preempt low-priority work for a critical recovery.

    Places a critical job's recovery when capacity is short (``docs/remediation.md``,
    "Priority-aware recovery"). Off by default.
    """

    model_config = _FROZEN

    enabled: StrictBool = False
    """Preempt at all. Only where the site allows gpuhealth to requeue (Slurm) or evict
    (Kubernetes) other users' running work; every preemption is audited before it is
    done, counts against the disruption budget, and is only recorded in a dry run."""

    critical_priority: int | None = None
    """Work with at least this priority (Slurm job priority, pod ``spec.priority``) is
    critical: its recovery may preempt. ``None``: by class only."""

    critical_classes: tuple[str, ...] = ()
    """Slurm QOS names or Kubernetes PriorityClass names of critical work."""

    max_victim_priority: int | None = None
    """Highest priority a preempted job may have; ``None``: any priority below the
    critical job's."""

    protected_classes: tuple[str, ...] = ("system-cluster-critical", "system-node-critical")
    """QOS / PriorityClass names never preempted."""

    wait_seconds: Duration = Field(default=60.0, ge=0)
    """How long a critical job's recovery must have waited for capacity (since its node
    was taken out of service) before a preemption is considered; gives the scheduler the
    chance to place it on free GPUs first."""

    max_preemptions: int = Field(default=1, ge=1)
    """Preemptions within ``window_seconds`` (the preemption budget)."""

    window_seconds: Duration = Field(default=3600.0, gt=0)
    """The preemption budget's window; a preempted job's node also counts against the
    disruption budget for this long."""

    @model_validator(mode="after")
    def _critical_is_defined(self) -> PreemptionSettings:
        if self.enabled and self.critical_priority is None and not self.critical_classes:
            raise ValueError("enabled = true needs critical_priority or critical_classes: "
                             "no work could ever be critical")
        return self

    def policy(self) -> PreemptionPolicy:
        """The engine's :class:`remediation.priority.PreemptionPolicy` for these settings."""
        from remediation.priority import PreemptionPolicy

        return PreemptionPolicy.from_options(self.model_dump())


class RemediationSettings(BaseModel):
    """``[remediation]``: the guard rails around actions (all dry-run by default)."""

    model_config = _FROZEN

    dry_run: StrictBool = True
    """Record what would be done and change nothing (architecture principle 3). ``false``
    needs a real ``scheduler`` (``slurm``, ``kubernetes`` or ``webhook``)."""

    scheduler: str = "dry_run"
    """Scheduler adapter (entry-point group ``gpuhealth.schedulers``) that carries steps out."""

    scheduler_options: dict[str, Any] = Field(default_factory=dict)
    """``[remediation.scheduler_options]``: keyword arguments of the adapter
    (``docs/slurm.md``, ``docs/kubernetes.md``, ``docs/remediation-webhook.md``)."""

    node_agent: dict[str, Any] = Field(default_factory=dict)
    """``[remediation.node_agent]``: options of the ``node_agent`` adapter that asks a
    node's own gpuhealth to reset a GPU (``url_template``, ``secret_env``); empty: GPU
    resets go to the scheduler adapter."""

    gpu_reset_agent: dict[str, Any] = Field(default_factory=dict)
    """``[remediation.gpu_reset_agent]``: serve ``POST /api/v1/gpu-reset`` on this GPU node
    so a controller can ask it to reset a GPU (``secret_env`` or ``secret_file``: the shared
    signing secret; ``nvidia_smi``: the command; the other keys are
    :class:`remediation.gpu_reset.GpuResetter` arguments: ``systemctl``, ``services``,
    ``fabric_services``, ``domain_reset``, ``fallback``, the timeouts, ``verify_attempts``,
    ``verify_interval_seconds``; ``validation``: the checks this node runs when the
    controller asks it to validate it, ``ValidationRunner`` arguments; ``bundle``: the
    diagnostic bundle collected before each reset and on the controller's request,
    ``BundleCollector`` arguments; ``docs/remediation-webhook.md`` §3-§5). Empty: not
    served."""

    validation: dict[str, Any] = Field(default_factory=dict)
    """``[remediation.validation]``: validate a node after its fix (GPU reset, reboot) and
    before it is resumed (``docs/remediation-webhook.md`` §4). ``where = "local"`` runs
    the checks in this process (``gpuhealth run`` on one machine; the other keys are
    :class:`remediation.validation.ValidationRunner` arguments: ``checks``,
    ``dcgm_level``, ``load_command``, ``nccl_min_bus_gbps``, the timeouts);
    ``where = "node_agent"`` asks the node's agent (``url_template``, ``secret_env`` or
    ``secret_file``, ``deadline_seconds``), which runs the checks of its
    ``[remediation.gpu_reset_agent.validation]``. Empty: no validation."""

    bundle: dict[str, Any] = Field(default_factory=dict)
    """``[remediation.bundle]``: collect a diagnostic bundle (``nvidia-bug-report.sh``,
    ``nvidia-smi -q``, the kernel log window, gpuhealth's evidence) before a reboot or
    hand-off (``docs/remediation-webhook.md`` §5). ``where = "local"``: on this machine
    (:class:`remediation.bundle.BundleCollector` arguments: ``directory``, default
    ``<data_dir>/bundles``; ``max_bytes``, ``timeout_seconds``, ``keep``,
    ``kernel_window_seconds``); ``where = "node_agent"``: by the node's agent
    (``url_template``, ``secret_env`` or ``secret_file``, ``timeout_seconds``). The step
    waits at most ``timeout_seconds`` for it. Empty: no bundle."""

    action_store: Path | None = None
    """SQLite file of actions and incidents; default ``<data_dir>/actions.db``. A standby
    controller must see the same file (shared storage) to resume where the leader stopped."""

    breaker_max_nodes: int | None = Field(default=None, ge=1)
    """The circuit breaker opens when more distinct nodes than this need disruptive steps
    within ``breaker_window_seconds``; default ``max(3, ceil(20 % of cluster_size))``,
    above the 15-20 % spare capacity a fleet plans for failures."""

    breaker_window_seconds: Duration = Field(default=600.0, gt=0)
    """Window of the circuit breaker, seconds."""

    max_actions_per_minute: float = Field(default=600.0, gt=0)
    """Fleet-wide rate limit on submitted steps."""

    approval_min_severity: Severity | None = None
    """Steps for findings at or above this severity wait for ``gpuhealth actions approve``."""

    approval_steps: tuple[RemediationStep, ...] = ()
    """Steps that always wait for approval (e.g. ``["reboot", "hand_off"]``)."""

    act_on_predictions: StrictBool = False
    """Let a predicted failure (``prediction`` alerts, ``major`` from 0.9) drain its node at
    the next safe point and hand it off, as a recognised fault would. Off: predictions only
    notify. Turn it on once ``gpuhealth evaluate`` on the site's own history shows the
    predictor precise enough (docs/analytics.md)."""

    probation_seconds: Duration = Field(default=3600.0, ge=0)
    """After a fix (reboot, GPU reset), how long without recurrence before resuming."""

    step_timeout_seconds: Duration = Field(default=3600.0, gt=0)
    """A step still running after this long fails (and the incident stops there)."""

    step_attempts: int = Field(default=8, ge=1)
    """Tries of a step whose adapter fails transiently (HTTP 409 after the adapter's own
    retries, 429, 5xx, slurmctld unreachable) before it fails for good and is escalated to
    a person; between tries it waits 5 s doubling to ``step_retry_max_seconds``."""

    step_retry_max_seconds: Duration = Field(default=300.0, ge=5.0)
    """Longest wait between two tries of a transiently failing step."""

    tick_seconds: Duration = Field(default=0.5, gt=0)
    """How often running steps are polled."""

    election: str = "local"
    """Leader election backend (entry-point group ``gpuhealth.electors``): ``local`` (one
    controller), ``etcd``, ``postgres`` or ``kubernetes`` (``docs/high-availability.md``)."""

    election_options: dict[str, Any] = Field(default_factory=dict)
    """``[remediation.election_options]``: keyword arguments of the elector."""

    identity: str | None = None
    """This controller's name in the election and the audit log; default ``<host>:<pid>``."""

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str) -> str:
        return _known_plugin("gpuhealth.schedulers", value)

    @field_validator("election")
    @classmethod
    def _known_elector(cls, value: str) -> str:
        return _known_plugin("gpuhealth.electors", value)

    @model_validator(mode="after")
    def _live_needs_adapter(self) -> RemediationSettings:
        if not self.dry_run and self.scheduler == "dry_run":
            raise ValueError(
                "dry_run = false needs a real scheduler adapter: set [remediation] scheduler "
                '= "slurm", "kubernetes" or "webhook"'
            )
        return self

    audit_log: Path | None = None
    """Append-only JSON-lines audit log; default ``<data_dir>/audit.jsonl``."""

    max_disrupted_fraction: Fraction = Field(default=0.10, gt=0, le=1)
    """Most nodes (fraction of ``cluster_size``, never fewer than one) out of service
    because of gpuhealth at once; 10 % keeps a cluster serving through a bad rule."""

    critical_reserve_fraction: Fraction = Field(default=0.25, ge=0, lt=1)
    """Share of the disruption budget (rounded up; none when the budget is one node) that
    only ``critical`` faults may take: a node whose GPU already fails work is not held back
    behind degraded (``major``) nodes that took the budget first. 0 reserves nothing."""

    cluster_size: int = Field(default=1, ge=1)
    """Nodes in the cluster, for the disruption budget; 1 for a single machine."""

    opt_out_nodes: tuple[str, ...] = ()
    """Nodes never acted on (only alerted about)."""

    preemption: PreemptionSettings = Field(default_factory=PreemptionSettings)
    """``[remediation.preemption]``: priority-aware recovery may preempt low-priority work
    for a critical job whose recovery waits for capacity; off by default."""


class ReportSettings(BaseModel):
    """``[report]``: the weekly reliability report (``docs/report.md``)."""

    model_config = _FROZEN

    enabled: StrictBool = True
    """Run the weekly report from ``gpuhealth run``."""
    history: Path | None = None
    """Incident history file; default ``<data_dir>/history.sqlite``."""
    folder: Path | None = None
    """Where weekly reports are written; default ``<data_dir>/reports``."""
    webhook_url: str | None = None
    """Where the JSON summary is POSTed; none: files only."""
    link_base: str | None = None
    """URL under which ``folder`` is served, for links in the webhook message."""
    weekday: Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"] = "mon"
    """Report day: the week's figures are on the desk when the week starts."""
    time: str = Field(default="06:00", pattern=r"^([01]\d|2[0-3]):[0-5]\d$")
    """HH:MM (24 h) in ``timezone``, before the working day."""
    timezone: str = "UTC"
    """IANA zone of ``time``."""
    spare_fraction: float = Field(default=0.15, ge=0, le=1)
    """Spare capacity as a fraction of the fleet; 15 % is the low end of the usual 15-20 %."""
    formats: tuple[Literal["html", "md", "json"], ...] = ("html", "json")
    """Formats written each week: HTML for people, JSON for machines."""

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r} (use an IANA name like UTC)") from None
        return value


class DrillSettings(BaseModel):
    """``[drill]``: ``gpuhealth drill`` and its schedule (``docs/remediation.md``, "Drills")."""

    model_config = _FROZEN

    nodes: tuple[str, ...] = ()
    """Nodes drilled when ``--node`` is not given; a scheduled drill takes the next one in
    turn. Empty: ``[node] name``."""
    kind: Literal["xid79", "xid48", "nvlink"] = "xid79"
    """The fault injected when ``--kind`` is not given (``remediation.drill.FAULTS``)."""
    notify: StrictBool = True
    """Send the drill's alerts (labelled ``drill=<id>``) to the ``[alerting]`` notifiers and
    pagers, as a real fault's; ``false``: to the log only."""
    live: StrictBool = False
    """Drill through the ``[remediation] scheduler`` (the node is really cordoned, drained,
    rebooted); ``false``: through the dry-run adapter (nothing changes on the node)."""
    schedule: str | None = None
    """Crontab line (minute hour day month weekday, apscheduler's ``from_crontab``) of
    ``gpuhealth drill --scheduled``; none: drills run only when asked (the default)."""
    timezone: str = "UTC"
    """IANA zone of ``schedule``."""
    timeout_seconds: Duration = 900.0
    """Longest a drill waits for its last stage; a stage not reached by then fails it."""
    probation_seconds: Duration = 5.0
    """How long a drilled node stays on probation before the drill resumes it; the shorter
    of this and ``[remediation] probation_seconds`` is used (the site's probation is for
    real faults: a drill on the defaults would wait an hour)."""
    evaluate_seconds: Duration = Field(default=0.5, gt=0)
    """How often the drill's pipeline evaluates (the service's cadence is ``[analytics]``)."""
    pci_bus_id: str = Field(default="0000:b1:00", pattern=r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:"
                            r"[0-9a-fA-F]{2}(\.[0-7])?$")
    """The GPU the kernel-log faults name (``NVRM: Xid (PCI:<bus>)``)."""
    slo: dict[str, Duration] = Field(default_factory=dict)
    """``[drill.slo]``: the service-level objective of each stage, seconds from injection
    (``detect``, ``alert``, ``cordon``, ``drain``, ``reboot``, ``reset_gpu``, ``validate``,
    ``resume``, ``total``); ``--slo stage=duration`` overrides one."""

    @field_validator("slo")
    @classmethod
    def _known_stages(cls, value: dict[str, float]) -> dict[str, float]:
        from remediation.drill import check_stage

        return {check_stage(k): v for k, v in value.items()}

    @field_validator("timezone")
    @classmethod
    def _drill_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r} (use an IANA name like UTC)") from None
        return value

    @model_validator(mode="after")
    def _cron(self) -> DrillSettings:
        if self.schedule is not None:
            from apscheduler.triggers.cron import CronTrigger

            try:
                CronTrigger.from_crontab(self.schedule, timezone=self.timezone)
            except ValueError as exc:
                raise ValueError(f"schedule {self.schedule!r} is not a crontab line "
                                 f"(minute hour day month weekday): {exc}") from None
        return self


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class AgentSettings(BaseModel):
    """``[agent]``: how ``gpuhealth agent`` reaches its controllers (docs/fleet.md)."""

    model_config = _FROZEN

    controllers: tuple[str, ...] = ()
    """Base URLs of every controller replica (``https://ctl-a:9837``); the agent sends to
    the first that answers, so it needs no leader discovery. Required by ``agent``."""
    token_env: str | None = None
    """Environment variable holding this agent's bearer token (one token per node)."""
    token_file: Path | None = None
    """File holding the token (a mounted Kubernetes Secret); re-read at each send."""
    ca_file: Path | None = None
    """CA bundle that signed the controllers' TLS certificates (default: the system's)."""
    outbox_max_records: int = Field(default=100_000, ge=1)
    """Records kept while no controller answers; beyond it the oldest are dropped and
    counted (``gpuhealth_agent_outbox_dropped_total``). 100,000 findings is days of a
    failing node's output."""
    batch_max_records: int = Field(default=500, ge=1)
    """Records per request to the controller."""
    send_interval_seconds: Duration = Field(default=1.0, gt=0)
    """Shortest pause between two sends while a controller answers, seconds, and the first
    retry delay while none does; queued findings wake the sender at once."""
    heartbeat_interval_seconds: Duration = Field(default=10.0, gt=0)
    """Longest time between two batches when nothing is queued, seconds."""
    timeout_seconds: Duration = Field(default=10.0, gt=0)
    """Connect and read timeout of one request, seconds."""
    protective_cordon: StrictBool = False
    """Opt-in: while no controller has answered for ``protective_cordon_after_seconds``, a
    ``critical`` finding on this node cordons it through ``[remediation] scheduler`` (as
    NHC drains its own node); dry-run unless ``[remediation] dry_run = false``; never
    returned to service by the agent (docs/fleet.md)."""
    protective_cordon_after_seconds: Duration = Field(default=300.0, gt=0)
    """How long no controller must have answered before the protective cordon, seconds."""

    @model_validator(mode="after")
    def _one_token_source(self) -> AgentSettings:
        if self.token_env and self.token_file:
            raise ValueError("set token_env or token_file, not both")
        for url in self.controllers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"controllers: {url!r} is not an http(s) URL")
            host = urllib.parse.urlsplit(url).hostname or ""
            if url.startswith("http://") and host not in _LOOPBACK:
                raise ValueError(f"controllers: {url!r} would send this agent's token in "
                                 "clear text beyond loopback: use https:// (the controller "
                                 "listens with TLS there)")
        return self


class ControllerSettings(BaseModel):
    """``[controller]``: the fleet controller's listener and state (docs/fleet.md)."""

    model_config = _FROZEN

    listen_address: str = "127.0.0.1"
    """Address of the agents' API and the fleet ``/metrics``; beyond loopback it needs TLS."""
    port: int = Field(default=9837, ge=0, le=65535)
    """Port of the agents' API and the fleet ``/metrics``."""
    state: str | None = None
    """Fleet state store: a PostgreSQL URI or libpq string (password from
    ``state_password_file``, ``PGPASSWORD`` or ``~/.pgpass``, never here), or a SQLite
    file for one controller; default: a SQLite file in the data folder. Incidents,
    actions, the audit trail, accepted agent records and the agent registry live there,
    shared by the controller replicas."""
    state_password_file: Path | None = None
    """File holding the PostgreSQL password of ``state`` alone (a mounted Kubernetes
    Secret's key), re-read when it changes: new connections log in with the new
    password, open ones stay. Not with a password in ``state`` or ``PGPASSWORD``."""
    pool_size: int = Field(default=4, ge=1, le=64)
    """Database connections per replica for the agents' batches and the API, fixed (never one
    per node); the consumer of accepted records has one more of its own."""
    agent_tokens_file: Path | None = None
    """File of ``node token`` lines (or a JSON object ``{node: token}``): the only agents
    accepted, each only for its own node. Re-read when it changes."""
    tls_cert_file: Path | None = None
    """PEM certificate chain of the listener; required beyond loopback. Re-read with the
    key when either changes (new handshakes get the new pair; a pair that does not load
    is logged and the one in use stays)."""
    tls_key_file: Path | None = None
    """PEM private key of the listener."""
    agent_silent_seconds: Duration = Field(default=60.0, gt=0)
    """An agent not heard from for this long gets a ``warning`` finding (its node is not
    drained on that alone)."""
    agent_clock_skew_warn_seconds: Duration = Field(default=60.0, gt=0)
    """An agent whose clock (its batches' ``sent_at``) is further off the controller's than
    this is logged once, until back within half of it; the skew of every agent is the
    gauge ``gpuhealth_agent_clock_skew_seconds{node}``. Nothing is decided on it."""
    consume_interval_seconds: Duration = Field(default=0.2, gt=0)
    """How often every replica reads newly accepted records, seconds."""
    retention_seconds: Duration = Field(default=7 * 86400.0, gt=0)
    """Accepted agent records older than this are deleted from the state store."""
    correlate_by: tuple[str, ...] = ("switch", "driver_version", "rack")
    """``[inventory]`` facts of the agents that group failing nodes into one fleet incident."""
    correlate_min_nodes: int = Field(default=3, ge=2)
    """Failing nodes under one value of a ``correlate_by`` fact that make a fleet incident
    (and open the circuit breaker instead of draining them one by one)."""
    correlate_window_seconds: Duration = Field(default=600.0, gt=0)
    """How close in time their ``major`` or worse findings must be first seen."""

    @model_validator(mode="after")
    def _tls_beyond_loopback(self) -> ControllerSettings:
        if self.listen_address not in _LOOPBACK and not (self.tls_cert_file
                                                         and self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file are required when the "
                             "controller listens beyond loopback")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("set both tls_cert_file and tls_key_file, or neither")
        if self.state_password_file is not None:
            from storage.sql import _password_of, is_postgres

            if not is_postgres(self.state):
                raise ValueError("state_password_file is the password of a PostgreSQL "
                                 "state; state is not one")
            if _password_of(str(self.state)):
                raise ValueError("state holds a password and state_password_file names "
                                 "another: keep the password out of state")
        return self


class PolicyRuleSettings(BaseModel):
    """One ``[[policy.rule]]``: what the site does about matching findings (docs/remediation.md)."""

    model_config = _FROZEN

    name: str = Field(min_length=1)
    """Unique name, shown in findings and in the audit record of every decision it changes."""
    kind: str | None = None
    """Finding kind to match (``xid``, ``ecc``, ``ib_port``); any when unset."""
    code: str | None = None
    """Code to match (``43``); any when unset."""
    entity: str = "*"
    """``fnmatch`` pattern of the entity (``GPU-*``, ``mlx5_*``)."""
    nodes: str = "*"
    """``fnmatch`` pattern of the node (``gpu-a*``)."""
    count: int = Field(default=1, ge=1)
    """Occurrences needed within ``window`` before the finding alerts or remediates."""
    window: Duration | None = Field(default=None, gt=0)
    """Window of ``count`` (``"10m"``); unset: ever."""
    severity: Severity | None = None
    """Severity override."""
    action: Action | None = None
    """Recommended-action override (``reset_gpu``, ``reboot_node``, ``service_hardware``...)."""
    sticky: StrictBool = False
    """Keep the finding open until a person clears it (``gpuhealth mark-healthy``)."""
    ignore: StrictBool = False
    """Drop matching findings (never alerted or remediated; ``diagnose`` still shows them)."""

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str | None) -> str | None:
        if value is not None and value not in FINDING_KINDS:
            raise ValueError(f"unknown finding kind {value!r}: the rule would never match "
                             f"(known kinds: {', '.join(sorted(FINDING_KINDS))})")
        return value

    @field_validator("entity", "nodes")
    @classmethod
    def _valid_pattern(cls, value: str) -> str:
        problem = pattern_problem(value)
        if problem:
            raise ValueError(f"{problem}: the rule would never match")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PolicyRuleSettings:
        if self.kind is None and self.code is None and self.entity == "*" and self.nodes == "*":
            raise ValueError("matches every finding: set kind, code, entity or nodes")
        if self.ignore and (self.severity or self.action or self.sticky or self.count > 1):
            raise ValueError("ignore drops the finding: it takes no count, severity, action "
                             "or sticky")
        if self.window is not None and self.count < 2:
            raise ValueError("window needs count >= 2")
        if not (self.ignore or self.severity or self.action or self.sticky or self.count > 1):
            raise ValueError("changes nothing: set ignore, count, severity, action or sticky")
        return self


class PolicySettings(BaseModel):
    """``[policy]``: the site's ``[[policy.rule]]`` tables, applied in file order."""

    model_config = _FROZEN

    rule: tuple[PolicyRuleSettings, ...] = ()
    """The rules; the first that matches a finding applies."""

    @model_validator(mode="before")
    @classmethod
    def _name_the_rule(cls, data: Any) -> Any:
        """Validate each rule on its own, so an error names the rule and its key."""
        if not isinstance(data, Mapping):
            return data
        rules = data.get("rule", ())
        if not isinstance(rules, list | tuple):
            raise ValueError("rule must be an array of tables ([[policy.rule]])")  # noqa: TRY004 - pydantic reports ValueError
        seen: set[str] = set()
        checked: list[PolicyRuleSettings] = []
        problems: list[str] = []  # every rule's every problem, reported at once
        for number, raw in enumerate(rules, start=1):
            name = raw.get("name") if isinstance(raw, Mapping) else None
            label = f"rule {name!r}" if isinstance(name, str) and name else f"rule #{number}"
            try:
                rule = PolicyRuleSettings.model_validate(raw)
            except ValidationError as exc:
                for error in exc.errors():
                    key = ".".join(str(p) for p in error["loc"]) or "(table)"
                    msg = error["msg"].removeprefix("Value error, ")
                    if error["type"] == "extra_forbidden":
                        msg = "unknown key"
                    problems.append(f"{label}: {key}: {msg}")
                continue
            if rule.name in seen:
                problems.append(f"{label}: name: used by an earlier rule")
                continue
            seen.add(rule.name)
            checked.append(rule)
        if problems:
            raise ValueError("\n".join(problems))
        return {**data, "rule": tuple(checked)}


class TimeSettings(BaseModel):
    """``[time]``: how time stamps that lack a time zone or a year are read."""

    model_config = _FROZEN

    timezone: str = "UTC"
    """IANA zone for stamps without an offset (syslog ``Nov 30 05:35:07``, ``dmesg -T``);
    UTC because servers usually run in UTC and a wrong guess is then visibly off by hours."""

    missing_year: Literal["recent"] | int = "recent"
    """Year for stamps without one: ``"recent"`` picks the year that puts the stamp in the
    last 12 months (at most a day ahead of now, so a log read on 1 January keeps its
    December lines in the old year); or a fixed year for old artifacts."""

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r} (use an IANA name like UTC)") from None
        return value


class Settings(BaseModel):
    """The whole configuration; see ``docs/configuration.md``."""

    model_config = _FROZEN

    node: NodeSettings = NodeSettings()
    """``[node]``: name and data folder."""
    metrics: MetricsSettings = MetricsSettings()
    """``[metrics]``: the ``/metrics`` listener."""
    collectors: dict[str, CollectorSettings] = Field(default_factory=dict)
    """``[collectors.<name>]`` by table name, with :data:`DEFAULT_COLLECTORS` merged in."""
    storage: StorageSettings = StorageSettings()
    """``[storage]``: the store and its write buffer."""
    analytics: AnalyticsSettings = AnalyticsSettings()
    """``[analytics]``: rule evaluation cadence."""
    alerting: AlertingSettings = AlertingSettings()
    """``[alerting]``: severity floors, grouping, policies, notifiers, silences, outbox, API."""
    remediation: RemediationSettings = RemediationSettings()
    """``[remediation]``: dry-run, audit log and disruption budget."""
    report: ReportSettings = ReportSettings()
    """``[report]``: the weekly reliability report."""
    inventory: dict[str, str] = Field(default_factory=dict)
    """Free-form machine facts for the rules (``nvlink = "absent"``, ``ib_unused = "mlx5_1:1"``)."""
    time: TimeSettings = TimeSettings()
    """``[time]``: reading stamps without a zone or a year."""
    policy: PolicySettings = PolicySettings()
    """``[policy]``: the site's per-rule policy (``[[policy.rule]]``)."""
    agent: AgentSettings = AgentSettings()
    """``[agent]``: the controllers an agent reports to."""
    controller: ControllerSettings = ControllerSettings()
    """``[controller]``: the fleet controller's listener, agents and state store."""
    drill: DrillSettings = DrillSettings()
    """``[drill]``: fault drills, their SLOs and schedule."""

    source: str = "(defaults)"
    """The file the settings came from, for messages."""

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        tables = data.get("collectors", {})
        if isinstance(tables, Mapping):
            merged: dict[str, Any] = {k: dict(v) for k, v in DEFAULT_COLLECTORS.items()}
            for name, table in tables.items():
                if isinstance(table, Mapping):
                    base = merged.get(name, {})
                    if table.get("type", base.get("type", name)) != base.get("type", name):
                        base = {}
                    merged[name] = {"type": name, **base, **table}
                else:
                    merged[name] = table
            data["collectors"] = merged
        node = data.get("node", {})
        data_dir = Path(str(node.get("data_dir", DEFAULT_DATA_DIR))) if isinstance(
            node, Mapping) else DEFAULT_DATA_DIR
        storage = data.get("storage", {})
        if (isinstance(storage, Mapping) and storage.get("path") is None
                and storage.get("type", "sqlite") == "sqlite"):  # the file only sqlite uses
            data["storage"] = {**storage, "path": str(data_dir / "gpuhealth.sqlite")}
        remediation = data.get("remediation", {})
        if isinstance(remediation, Mapping) and remediation.get("audit_log") is None:
            data["remediation"] = {**remediation, "audit_log": str(data_dir / "audit.jsonl")}
        return data

    @property
    def storage_path(self) -> Path:
        """Return the SQLite file path (always set after loading)."""
        return self.storage.path or self.node.data_dir / "gpuhealth.sqlite"

    @property
    def store_options(self) -> dict[str, Any]:
        """Return the keyword arguments of the ``[storage] type`` store plugin."""
        s = self.storage
        if s.type == "influxdb":
            return {"url": s.url, "org": s.org, "bucket": s.bucket, "token_env": s.token_env}
        if s.type == "promql":
            return {"url": s.url}
        return {"path": str(self.storage_path), "retention_seconds": s.retention_seconds}

    @property
    def history_path(self) -> Path:
        """Return the incident history file (``storage.history``)."""
        return self.report.history or self.node.data_dir / "history.sqlite"

    @property
    def action_store_path(self) -> Path:
        """Return the action store's SQLite file."""
        return self.remediation.action_store or self.node.data_dir / "actions.db"

    @property
    def audit_log_path(self) -> Path:
        """Return the audit log path (always set after loading)."""
        return self.remediation.audit_log or self.node.data_dir / "audit.jsonl"

    @property
    def fleet_state(self) -> str:
        """Return the controller's state store: ``[controller] state`` or a SQLite file."""
        return self.controller.state or str(self.node.data_dir / "fleet.sqlite")

    def enabled_collectors(self) -> dict[str, CollectorSettings]:
        """Return the collector tables that are switched on, by table name."""
        return {name: table for name, table in sorted(self.collectors.items()) if table.enabled}


_SECRET_KEYS = re.compile(r"(secret|password|token)$")


def _where(loc: tuple[int | str, ...]) -> tuple[str, str]:
    """Split a pydantic location into ``("[section.sub]", "key")``."""
    parts = [str(p) for p in loc]
    if len(parts) == 1:
        return "", parts[0]
    return f"[{'.'.join(parts[:-1])}]", parts[-1]


def _env_overrides(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """Turn ``GPUHEALTH_A__B=v`` variables into a nested dict and remember their names."""
    tree: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name[len(ENV_PREFIX):]:
            continue
        path = tuple(p.lower() for p in name[len(ENV_PREFIX):].split("__"))
        if any(not p for p in path):
            continue
        try:
            value: Any = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = value
        origin[path] = name
    return tree, origin


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _messages(
    source: str, exc: ValidationError, origin: Mapping[tuple[str, ...], str]
) -> list[str]:
    out: list[str] = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        section, key = _where(loc)
        prefix = f"{source}: "
        from_env = origin.get(loc) or next(
            (var for path, var in origin.items() if path[: len(loc)] == loc), None
        )
        if from_env:
            prefix = f"{source}: environment {from_env}: "
        if err["type"] == "extra_forbidden":
            hint = ""
            if _SECRET_KEYS.search(key):
                hint = f" (secrets are not read from the file: use {key}_env or {key}_file)"
            where = f"{section} " if section else ""
            out.append(f"{prefix}{where}unknown key {key!r}{hint}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        where = f"{section} {key}" if section else key
        got = err.get("input")
        shown = (
            "" if isinstance(got, Mapping) or got is None or err["type"] == "missing"
            or repr(got) in msg or f"got {got}" in msg
            else f" (got {got!r})"
        )
        if not section and isinstance(got, Mapping):  # a table's own check: "[agent] key: …"
            where = f"[{key}]"
            head, sep, rest = msg.partition(": ")
            if sep and head.isidentifier():
                where, msg = f"[{key}] {head}", rest
        lines = msg.splitlines() or [msg]
        if len(lines) > 1:  # a table that reports several problems at once ([[policy.rule]])
            out.extend(f"{prefix}{where}: {line}" for line in lines)
            continue
        out.append(f"{prefix}{where}: {msg}{shown}")
    return out


def load_settings(path: str | os.PathLike[str] | None, env: Mapping[str, str] = os.environ
                  ) -> Settings:
    """Read, merge and validate the configuration.

    Args:
        path: The TOML file, or ``None`` for the embedded defaults.
        env: Environment for ``GPUHEALTH_<SECTION>__<KEY>`` overrides and secrets.

    Returns:
        Frozen settings with every default filled in (paths resolved against ``data_dir``).

    Raises:
        ConfigError: The file is missing or not TOML, a key is unknown, a value has the
            wrong type, or a secret variable is unset; the message names the file and key.
    """
    source = str(path) if path is not None else "(defaults)"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"{source}: no such file") from None
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:  # a binary file: TOML is UTF-8 text
            raise ConfigError(f"{source}: not valid TOML: not UTF-8 text (byte "
                              f"0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    overrides, origin = _env_overrides(env)
    merged = _merge(raw, overrides)
    if "source" in merged:
        raise ConfigError(f"{source}: unknown key 'source'")
    try:
        settings = Settings.model_validate({**merged, "source": source})
    except ValidationError as exc:
        raise ConfigError("\n".join(_messages(source, exc, origin))) from None
    problems = _secret_problems(settings, env)
    problems += [f"{source}: [inventory] {p}" for p in check_facts(settings.inventory)]
    if problems:
        raise ConfigError("\n".join(problems))
    return settings


def fleet_problems(settings: Settings, env: Mapping[str, str] = os.environ) -> list[str]:
    """What stops ``gpuhealth agent`` or ``gpuhealth controller`` with these settings.

    ``[agent]``: its token source (the variable set, the file there and not empty);
    ``[controller]``: the agent tokens file and the TLS files readable. Each line names
    the file and the key. (``agent`` also needs ``[agent] controllers``; ``controller``
    needs ``agent_tokens_file``: the commands say so, ``config check`` cannot know the
    role.)
    """
    src = settings.source
    a, c = settings.agent, settings.controller
    problems: list[str] = []
    if a.token_env and not env.get(a.token_env):
        problems.append(f"{src}: [agent] token_env: environment variable {a.token_env!r} is "
                        "not set")
    if a.token_file is not None:
        try:
            if not a.token_file.read_text(encoding="utf-8").strip():
                problems.append(f"{src}: [agent] token_file: {a.token_file} is empty")
        except OSError as exc:
            problems.append(f"{src}: [agent] token_file: {a.token_file}: {exc.strerror}")
    if a.controllers and not (a.token_env or a.token_file):
        problems.append(f"{src}: [agent] token_env or token_file: the agent needs its token")
    if a.ca_file is not None and not a.ca_file.is_file():
        problems.append(f"{src}: [agent] ca_file: no such file {str(a.ca_file)!r}")
    for key in ("agent_tokens_file", "tls_cert_file", "tls_key_file", "state_password_file"):
        path = getattr(c, key)
        if path is not None and not path.is_file():
            problems.append(f"{src}: [controller] {key}: no such file {str(path)!r}")
    if c.state_password_file is not None and env.get("PGPASSWORD"):
        problems.append(f"{src}: [controller] state_password_file: PGPASSWORD is set, and "
                        "libpq would log in with it instead")
    if c.agent_tokens_file is not None and c.agent_tokens_file.is_file():
        from gpuhealth.tokens import token_file_problems

        problems.extend(f"{src}: [controller] agent_tokens_file: {p}"
                        for p in token_file_problems(c.agent_tokens_file))
    return problems


def _secret_problems(settings: Settings, env: Mapping[str, str]) -> list[str]:
    alerting = settings.alerting
    problems: list[str] = [*fleet_problems(settings, env)]
    if alerting.webhook_secret_env and not env.get(alerting.webhook_secret_env):
        problems.append(f"{settings.source}: [alerting] webhook_secret_env: environment "
                        f"variable {alerting.webhook_secret_env!r} is not set")
    if alerting.webhook_secret_file and not alerting.webhook_secret_file.is_file():
        problems.append(f"{settings.source}: [alerting] webhook_secret_file: no such file "
                        f"{str(alerting.webhook_secret_file)!r}")
    for key in ("pagerduty_routing_key_env", "api_token_env"):
        name = getattr(alerting, key)
        if name and not env.get(name):
            problems.append(f"{settings.source}: [alerting] {key}: environment "
                            f"variable {name!r} is not set")
    key_file = alerting.pagerduty_routing_key_file
    if key_file and not key_file.is_file():
        problems.append(f"{settings.source}: [alerting] pagerduty_routing_key_file: no such "
                        f"file {str(key_file)!r}")
    return problems


def webhook_secret(settings: Settings, env: Mapping[str, str] = os.environ) -> str | None:
    """Return the webhook signing secret from the environment or its file, or ``None``.

    Never log the result.
    """
    alerting = settings.alerting
    if alerting.webhook_secret_env:
        return env.get(alerting.webhook_secret_env) or None
    if alerting.webhook_secret_file:
        text = alerting.webhook_secret_file.read_text(encoding="utf-8")
        return text.splitlines()[0].strip() if text.strip() else None
    return None


def _secret_from(env_name: str | None, path: Path | None, env: Mapping[str, str]
                 ) -> str | None:
    if env_name:
        return env.get(env_name) or None
    if path:
        text = path.read_text(encoding="utf-8")
        return text.splitlines()[0].strip() if text.strip() else None
    return None


def agent_token(settings: Settings, env: Mapping[str, str] = os.environ) -> str | None:
    """Return this agent's bearer token from ``[agent] token_env`` or ``token_file``.

    Never log the result.
    """
    return _secret_from(settings.agent.token_env, settings.agent.token_file, env)


def pagerduty_routing_key(settings: Settings, env: Mapping[str, str] = os.environ
                          ) -> str | None:
    """Return the PagerDuty routing key from the environment or its file, or ``None``.

    Never log the result.
    """
    alerting = settings.alerting
    return _secret_from(alerting.pagerduty_routing_key_env,
                        alerting.pagerduty_routing_key_file, env)


def api_token(settings: Settings, env: Mapping[str, str] = os.environ) -> str | None:
    """Return the alerting API's bearer token from the environment, or ``None``.

    Never log the result.
    """
    return _secret_from(settings.alerting.api_token_env, None, env)


def alert_policies(settings: Settings) -> dict[str, AlertPolicy]:
    """Return ``[alerting.policies]`` as alert policies per fault class."""
    return {
        name: AlertPolicy(
            for_seconds=p.for_seconds,
            debounce_count=p.debounce_count,
            debounce_window_seconds=p.debounce_window_seconds,
            keep_firing_for_seconds=p.keep_firing_for_seconds,
        )
        for name, p in settings.alerting.policies.items()
    }


def alerting_path(settings: Settings, name: Literal["silences", "outbox"]) -> Path:
    """Return the silences file or the outbox file, defaulting into the data folder."""
    alerting = settings.alerting
    if name == "silences":
        return alerting.silences_file or settings.node.data_dir / "silences.json"
    return alerting.outbox_file or settings.node.data_dir / "outbox.sqlite"


def collector_options(settings: Settings, table: CollectorSettings,
                      factory: Any) -> dict[str, Any]:
    """Return the constructor kwargs for a collector table.

    Adds ``node`` (the node name) and ``state_dir`` (the data folder) when the plugin
    accepts them and the table does not set them.

    Args:
        settings: The loaded settings (for the node name).
        table: The collector's table.
        factory: The plugin class (or callable) the options are for.
    """
    options = table.options
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return options
    if "node" in params and "node" not in options:
        options["node"] = settings.node.name
    if "state_dir" in params and "state_dir" not in options:
        # Where a collector keeps its read position across restarts (the kernel log).
        options["state_dir"] = str(settings.node.data_dir)
    return options


def check(path: str | os.PathLike[str] | None, env: Mapping[str, str] = os.environ
          ) -> list[str]:
    """Validate a configuration as ``gpuhealth config check`` does; ``[]`` when it is fine.

    Besides :func:`load_settings`, checks that every enabled collector names an installed
    plugin and that its keys are arguments of that plugin (without starting it).

    Args:
        path: The TOML file, or ``None`` for the embedded defaults.
        env: Environment for overrides and secrets.

    Returns:
        One line per problem, each naming the file and the key.
    """
    from core import plugins

    try:
        settings = load_settings(path, env)
    except ConfigError as exc:
        return str(exc).splitlines()
    problems: list[str] = []
    for name, table in settings.enabled_collectors().items():
        try:
            factory = plugins.load("gpuhealth.collectors", table.type)
        except PluginError as exc:
            problems.append(f"{settings.source}: [collectors.{name}] type: {exc}")
            continue
        options = collector_options(settings, table, factory)
        try:  # as `run` refuses it: the unknown key named, the valid ones listed
            plugins.check_options("gpuhealth.collectors", table.type, options, factory)
        except PluginError as exc:
            problems.append(f"{settings.source}: [collectors.{name}] {exc}")
            continue
        # Constructors only validate and store their arguments (style.md C.3.8), so
        # building the plugin checks the values too without starting anything.
        try:
            built = factory(**options)
        except (TypeError, ValueError) as exc:
            problems.append(f"{settings.source}: [collectors.{name}]: {exc}")
            continue
        if isinstance(built, Closeable):
            built.close()
    return problems
