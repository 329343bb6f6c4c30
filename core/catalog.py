"""The metric catalog: every metric gpuhealth collects or exports, in one place.

Collectors emit only names listed here, stores and dashboards read it, and the
``/metrics`` endpoint takes HELP and TYPE from it. Names follow the Prometheus
naming guide (base units in the name, counters end in ``_total``, ratios 0-1;
``docs/ecosystem-reference.md`` §3.1 and the cross-walk in §11). ``nvml`` names the
NVML call or field the value comes from; ``dcgm`` names the dcgm-exporter series
carrying the same signal (``DCGM_FI_*``), with ``dcgm_scale`` the factor that turns
the exporter's unit into ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class MetricType(StrEnum):
    """Prometheus metric type."""

    GAUGE = "gauge"
    COUNTER = "counter"


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One catalogued metric.

    Attributes:
        name: Prometheus name with its base unit (``gpu_power_watts``).
        type: Gauge or counter.
        unit: Base unit (``watts``, ``celsius``, ``bytes``, ``ratio``, ``1`` for counts).
        help: One-line description for HELP.
        labels: Label names besides ``node`` and ``entity``.
        nvml: NVML call or field the value comes from, or ``""``.
        dcgm: dcgm-exporter series name with the same signal, or ``""``.
        dcgm_scale: Multiply the dcgm-exporter value by this to get ``unit``.
    """

    name: str
    type: MetricType
    unit: str
    help: str
    labels: tuple[str, ...] = ()
    nvml: str = ""
    dcgm: str = ""
    dcgm_scale: float = 1.0


G, C = MetricType.GAUGE, MetricType.COUNTER
_MHZ = 1e6
_MIB = 1024.0 * 1024.0

CATALOG: tuple[MetricSpec, ...] = (
    # --- GPU identity and telemetry (NVML; ecosystem-reference §1, §11) ---
    MetricSpec(
        name="gpu_info",
        type=G,
        unit="1",
        help="GPU identity; value is always 1",
        labels=("uuid", "serial", "model", "pci_bus_id", "driver_version", "vbios_version",
                "index"),
        nvml="nvmlDeviceGetUUID/GetSerial/GetName/GetPciInfo_v3",
    ),
    MetricSpec(
        name="gpu_temperature_celsius",
        type=G,
        unit="celsius",
        help="GPU die temperature",
        nvml="nvmlDeviceGetTemperatureV(NVML_TEMPERATURE_GPU)",
        dcgm="DCGM_FI_DEV_GPU_TEMP",
    ),
    MetricSpec(
        name="gpu_temperature_threshold_celsius",
        type=G,
        unit="celsius",
        help="The GPU's own temperature thresholds: shutdown, slowdown, max_operating",
        labels=("threshold",),
        nvml="nvmlDeviceGetTemperatureThreshold(NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"
        "|_SLOWDOWN|_GPU_MAX)",
    ),
    MetricSpec(
        name="gpu_memory_temperature_celsius",
        type=G,
        unit="celsius",
        help="GPU memory (HBM) temperature",
        nvml="field NVML_FI_DEV_MEMORY_TEMP (82)",
        dcgm="DCGM_FI_DEV_MEMORY_TEMP",
    ),
    MetricSpec(
        name="gpu_power_watts",
        type=G,
        unit="watts",
        help="GPU power draw",
        nvml="nvmlDeviceGetPowerUsage (mW)",
        dcgm="DCGM_FI_DEV_POWER_USAGE",
    ),
    MetricSpec(
        name="gpu_power_limit_watts",
        type=G,
        unit="watts",
        help="Enforced GPU power limit",
        nvml="nvmlDeviceGetEnforcedPowerLimit (mW)",
        dcgm="DCGM_FI_DEV_POWER_MGMT_LIMIT",
    ),
    MetricSpec(
        name="gpu_energy_joules_total",
        type=C,
        unit="joules",
        help="GPU energy consumed since driver load",
        nvml="nvmlDeviceGetTotalEnergyConsumption (mJ)",
        dcgm="DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        dcgm_scale=1e-3,
    ),
    MetricSpec(
        name="gpu_utilization_ratio",
        type=G,
        unit="ratio",
        help="GPU busy fraction, 0-1",
        nvml="nvmlDeviceGetUtilizationRates().gpu (%)",
        dcgm="DCGM_FI_DEV_GPU_UTIL",
        dcgm_scale=0.01,
    ),
    MetricSpec(
        name="gpu_memory_utilization_ratio",
        type=G,
        unit="ratio",
        help="GPU memory controller busy fraction, 0-1",
        nvml="nvmlDeviceGetUtilizationRates().memory (%)",
        dcgm="DCGM_FI_DEV_MEM_COPY_UTIL",
        dcgm_scale=0.01,
    ),
    MetricSpec(
        name="gpu_memory_used_bytes",
        type=G,
        unit="bytes",
        help="GPU framebuffer memory used",
        nvml="nvmlDeviceGetMemoryInfo().used",
        dcgm="DCGM_FI_DEV_FB_USED",
        dcgm_scale=_MIB,
    ),
    MetricSpec(
        name="gpu_memory_total_bytes",
        type=G,
        unit="bytes",
        help="GPU framebuffer size",
        nvml="nvmlDeviceGetMemoryInfo().total",
    ),
    MetricSpec(
        name="gpu_sm_clock_hertz",
        type=G,
        unit="hertz",
        help="SM clock",
        nvml="nvmlDeviceGetClockInfo(NVML_CLOCK_SM) (MHz)",
        dcgm="DCGM_FI_DEV_SM_CLOCK",
        dcgm_scale=_MHZ,
    ),
    MetricSpec(
        name="gpu_memory_clock_hertz",
        type=G,
        unit="hertz",
        help="Memory clock",
        nvml="nvmlDeviceGetClockInfo(NVML_CLOCK_MEM) (MHz)",
        dcgm="DCGM_FI_DEV_MEM_CLOCK",
        dcgm_scale=_MHZ,
    ),
    MetricSpec(
        name="gpu_clock_event_active",
        type=G,
        unit="1",
        help="Clock event (throttle) reason active, 0 or 1",
        labels=("reason",),
        nvml="nvmlDeviceGetCurrentClocksEventReasons",
    ),
    MetricSpec(
        name="gpu_fan_speed_ratio",
        type=G,
        unit="ratio",
        help="Fan speed, 0-1 of maximum",
        nvml="nvmlDeviceGetFanSpeed (%)",
        dcgm="DCGM_FI_DEV_FAN_SPEED",
        dcgm_scale=0.01,
    ),
    MetricSpec(
        name="gpu_mig_mode",
        type=G,
        unit="1",
        help="1 when MIG mode is enabled on the GPU (current mode), else 0",
        nvml="nvmlDeviceGetMigMode()[0]",
    ),
    MetricSpec(
        name="gpu_mig_instances",
        type=G,
        unit="1",
        help="MIG devices configured on the GPU",
        nvml="nvmlDeviceGetMaxMigDeviceCount / nvmlDeviceGetMigDeviceHandleByIndex",
    ),
    MetricSpec(
        name="gpu_mig_memory_used_bytes",
        type=G,
        unit="bytes",
        help="Framebuffer memory used by one MIG GPU instance (dcgm-exporter: FB_USED by GPU_I_ID)",
        labels=("gpu_instance",),
        nvml="nvmlDeviceGetMemoryInfo(MIG device handle).used",
    ),
    # --- memory errors (NVIDIA memory error management, dynamic page retirement) ---
    MetricSpec(
        name="gpu_ecc_errors_total",
        type=C,
        unit="1",
        help="ECC errors by type (corrected, uncorrected), scope and location",
        labels=("type", "scope", "location"),
        nvml="nvmlDeviceGetTotalEccErrors / nvmlDeviceGetMemoryErrorCounter",
    ),
    MetricSpec(
        name="gpu_retired_pages",
        type=G,
        unit="1",
        help="Retired framebuffer pages by cause",
        labels=("cause",),
        nvml="nvmlDeviceGetRetiredPages",
        dcgm="DCGM_FI_DEV_RETIRED_DBE",
    ),
    MetricSpec(
        name="gpu_retired_pages_pending",
        type=G,
        unit="1",
        help="1 when a retired page awaits a driver reload or reset",
        nvml="nvmlDeviceGetRetiredPagesPendingStatus",
        dcgm="DCGM_FI_DEV_RETIRED_PENDING",
    ),
    MetricSpec(
        name="gpu_remapped_rows",
        type=G,
        unit="1",
        help="Remapped DRAM rows by cause (correctable, uncorrectable)",
        labels=("type",),
        nvml="nvmlDeviceGetRemappedRows",
        dcgm="DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    ),
    MetricSpec(
        name="gpu_row_remap_pending",
        type=G,
        unit="1",
        help="1 when a row remap waits for a GPU reset",
        nvml="nvmlDeviceGetRemappedRows",
    ),
    MetricSpec(
        name="gpu_row_remap_failure",
        type=G,
        unit="1",
        help="1 when a row remap failed",
        nvml="nvmlDeviceGetRemappedRows",
        dcgm="DCGM_FI_DEV_ROW_REMAP_FAILURE",
    ),
    MetricSpec(
        name="gpu_row_remap_bank_availability",
        type=G,
        unit="1",
        help="Banks per remap-availability bucket (max, high, partial, low, none)",
        labels=("availability",),
        nvml="nvmlDeviceGetRowRemapperHistogram",
    ),
    MetricSpec(
        name="gpu_sram_threshold_exceeded",
        type=G,
        unit="1",
        help="1 when aggregate SRAM uncorrectable errors passed NVIDIA's threshold (RMA)",
        nvml="nvmlDeviceGetSramEccErrorStatus().bThresholdExceeded",
    ),
    MetricSpec(
        name="gpu_thermal_violation_seconds_total",
        type=C,
        unit="seconds",
        help="Time the GPU clocks were held back by thermal limits",
        nvml="nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_THERMAL) (ns)",
        dcgm="DCGM_FI_DEV_THERMAL_VIOLATION",
        dcgm_scale=1e-9,
    ),
    MetricSpec(
        name="gpu_power_violation_seconds_total",
        type=C,
        unit="seconds",
        help="Time the GPU clocks were held back by the power limit",
        nvml="nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_POWER) (ns)",
        dcgm="DCGM_FI_DEV_POWER_VIOLATION",
        dcgm_scale=1e-9,
    ),
    MetricSpec(
        name="gpu_recovery_action",
        type=G,
        unit="1",
        help="NVML GPU recovery action (0 none, 1 reset, 2 reboot, 3 drain P2P, 4 drain+reset)",
        nvml="field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230)",
    ),
    MetricSpec(
        name="gpu_xid_events_total",
        type=C,
        unit="1",
        help="Xid events seen",
        labels=("xid",),
        nvml="nvmlEventTypeXidCriticalError",
    ),
    MetricSpec(
        name="gpu_last_xid",
        type=G,
        unit="1",
        help="Last Xid reported (a pointer, not a count)",
        dcgm="DCGM_FI_DEV_XID_ERRORS",
    ),
    # --- interconnects ---
    MetricSpec(
        name="gpu_pcie_replays_total",
        type=C,
        unit="1",
        help="PCIe replay counter",
        nvml="nvmlDeviceGetPcieReplayCounter",
        dcgm="DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    ),
    MetricSpec(
        name="gpu_pcie_link_generation",
        type=G,
        unit="1",
        help="Current PCIe generation",
        labels=("bound",),
        nvml="nvmlDeviceGetCurrPcieLinkGeneration",
    ),
    MetricSpec(
        name="gpu_pcie_link_width",
        type=G,
        unit="1",
        help="Current PCIe link width (lanes)",
        labels=("bound",),
        nvml="nvmlDeviceGetCurrPcieLinkWidth",
    ),
    MetricSpec(
        name="gpu_nvlink_state",
        type=G,
        unit="1",
        help="NVLink state, 1 up, 0 down",
        labels=("link",),
        nvml="nvmlDeviceGetNvLinkState",
    ),
    MetricSpec(
        name="gpu_nvlink_errors_total",
        type=C,
        unit="1",
        help="NVLink errors per link and type (crc_flit, crc_data, replay, recovery)",
        labels=("link", "type"),
        nvml="nvmlDeviceGetNvLinkErrorCounter",
        dcgm="DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    ),
    # --- network (ecosystem-reference §10) ---
    MetricSpec(
        name="net_rx_bytes_total",
        type=C,
        unit="bytes",
        help="Bytes received",
        labels=("interface",),
    ),
    MetricSpec(
        name="net_tx_bytes_total", type=C, unit="bytes", help="Bytes sent", labels=("interface",)
    ),
    MetricSpec(
        name="net_rx_packets_total",
        type=C,
        unit="1",
        help="Packets received",
        labels=("interface",),
    ),
    MetricSpec(
        name="net_tx_packets_total", type=C, unit="1", help="Packets sent", labels=("interface",)
    ),
    MetricSpec(
        name="net_rx_errors_total", type=C, unit="1", help="Receive errors", labels=("interface",)
    ),
    MetricSpec(
        name="net_tx_errors_total", type=C, unit="1", help="Transmit errors", labels=("interface",)
    ),
    MetricSpec(
        name="net_rx_dropped_total",
        type=C,
        unit="1",
        help="Received packets dropped",
        labels=("interface",),
    ),
    MetricSpec(
        name="net_tx_dropped_total",
        type=C,
        unit="1",
        help="Packets dropped on send",
        labels=("interface",),
    ),
    MetricSpec(
        name="net_carrier_changes_total",
        type=C,
        unit="1",
        help="Link carrier changes",
        labels=("interface",),
    ),
    MetricSpec(
        name="net_up", type=G, unit="1", help="1 when operstate is up", labels=("interface",)
    ),
    MetricSpec(
        name="net_prio_bytes_total",
        type=C,
        unit="bytes",
        help="Bytes per priority (ethtool -S rx/tx_prioN_bytes)",
        labels=("interface", "direction", "priority"),
    ),
    MetricSpec(
        name="net_prio_packets_total",
        type=C,
        unit="1",
        help="Packets per priority (ethtool -S rx/tx_prioN_packets)",
        labels=("interface", "direction", "priority"),
    ),
    MetricSpec(
        name="net_prio_pause_frames_total",
        type=C,
        unit="1",
        help="PFC pause frames per priority (ethtool -S rx/tx_prioN_pause)",
        labels=("interface", "direction", "priority"),
    ),
    MetricSpec(
        name="net_nic_counter_total",
        type=C,
        unit="1",
        help="Other NIC driver counters (ethtool -S, per-queue counters left out)",
        labels=("interface", "counter"),
    ),
    MetricSpec(
        name="net_bond_up",
        type=G,
        unit="1",
        help="1 when the bond's MII status is up (/proc/net/bonding)",
        labels=("bond",),
    ),
    MetricSpec(
        name="net_bond_members",
        type=G,
        unit="1",
        help="Members enslaved to the bond (/proc/net/bonding Slave Interface blocks)",
        labels=("bond",),
    ),
    MetricSpec(
        name="net_bond_members_active",
        type=G,
        unit="1",
        help="Bond members carrying traffic (MII up, in the active 802.3ad aggregator)",
        labels=("bond",),
    ),
    MetricSpec(
        name="net_bond_member_up",
        type=G,
        unit="1",
        help="1 when the bond member carries traffic",
        labels=("bond", "interface"),
    ),
    MetricSpec(
        name="net_bond_member_link_failures_total",
        type=C,
        unit="1",
        help="Link Failure Count of a bond member (/proc/net/bonding)",
        labels=("bond", "interface"),
    ),
    MetricSpec(
        name="ib_port_state",
        type=G,
        unit="1",
        help="InfiniBand port logical state (1 down, 2 init, 3 armed, 4 active)",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_physical_state",
        type=G,
        unit="1",
        help="InfiniBand port physical state (2 polling, 5 linkup, ...)",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_rate_bits_per_second",
        type=G,
        unit="bits_per_second",
        help="InfiniBand port rate",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_symbol_errors_total",
        type=C,
        unit="1",
        help="IB SymbolErrorCounter",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_link_error_recovery_total",
        type=C,
        unit="1",
        help="IB LinkErrorRecoveryCounter",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_link_downed_total",
        type=C,
        unit="1",
        help="IB LinkDownedCounter",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_rcv_errors_total",
        type=C,
        unit="1",
        help="IB PortRcvErrors",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_rcv_remote_physical_errors_total",
        type=C,
        unit="1",
        help="IB PortRcvRemotePhysicalErrors",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_rcv_switch_relay_errors_total",
        type=C,
        unit="1",
        help="IB PortRcvSwitchRelayErrors",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_xmit_discards_total",
        type=C,
        unit="1",
        help="IB PortXmitDiscards",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_xmit_constraint_errors_total",
        type=C,
        unit="1",
        help="IB PortXmitConstraintErrors",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_rcv_constraint_errors_total",
        type=C,
        unit="1",
        help="IB PortRcvConstraintErrors",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_local_link_integrity_errors_total",
        type=C,
        unit="1",
        help="IB LocalLinkIntegrityErrors",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_excessive_buffer_overrun_errors_total",
        type=C,
        unit="1",
        help="IB ExcessiveBufferOverrunErrors",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_vl15_dropped_total",
        type=C,
        unit="1",
        help="IB VL15Dropped",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_xmit_wait_total",
        type=C,
        unit="1",
        help="IB PortXmitWait ticks (congestion, not an error)",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_xmit_bytes_total",
        type=C,
        unit="bytes",
        help="IB bytes sent (PortXmitData x 4)",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_rcv_bytes_total",
        type=C,
        unit="bytes",
        help="IB bytes received (PortRcvData x 4)",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_xmit_packets_total",
        type=C,
        unit="1",
        help="IB packets sent",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="ib_port_rcv_packets_total",
        type=C,
        unit="1",
        help="IB packets received",
        labels=("device", "port"),
    ),
    MetricSpec(
        name="rdma_hw_counter_total",
        type=C,
        unit="1",
        help="RDMA driver hw_counters (local_ack_timeout_err, np_cnp_sent, ...)",
        labels=("device", "port", "counter"),
    ),
    MetricSpec(
        name="probe_rtt_seconds",
        type=G,
        unit="seconds",
        help="Round-trip time to a peer",
        labels=("peer", "method"),
    ),
    MetricSpec(
        name="probe_loss_ratio",
        type=G,
        unit="ratio",
        help="Fraction of probes to a peer that failed, 0-1",
        labels=("peer", "method"),
    ),
    # --- gpuhealth's own health ---
    MetricSpec(
        name="gpuhealth_findings_total",
        type=C,
        unit="1",
        help="Findings by severity",
        labels=("severity",),
    ),
    MetricSpec(
        name="gpuhealth_anomalies_total",
        type=C,
        unit="1",
        help="Online detector verdicts (anomalies, telemetry gaps, peer outliers) by detector",
        labels=("detector",),
    ),
    MetricSpec(
        name="gpuhealth_collector_errors_total",
        type=C,
        unit="1",
        help="Collector errors and omitted fields",
        labels=("collector", "reason"),
    ),
    MetricSpec(
        name="gpuhealth_samples_written_total",
        type=C,
        unit="1",
        help="Samples written to the store",
    ),
    MetricSpec(
        name="gpuhealth_events_written_total", type=C, unit="1", help="Events written to the store"
    ),
    MetricSpec(
        name="gpuhealth_alerts_sent_total",
        type=C,
        unit="1",
        help="Alerts delivered",
        labels=("notifier",),
    ),
    MetricSpec(
        name="gpuhealth_remediation_decisions_total",
        type=C,
        unit="1",
        help="Remediation decisions by step and outcome",
        labels=("step", "decision"),
    ),
    MetricSpec(
        name="gpuhealth_collection_duration_seconds",
        type=G,
        unit="seconds",
        help="Time the last collection took",
        labels=("collector",),
    ),
    # --- fleet state, predictions and remediation (read by the Grafana dashboards) ---
    MetricSpec(
        name="gpu_failure_probability_ratio",
        type=G,
        unit="ratio",
        help="Predicted probability that the GPU fails within the horizon, 0-1",
        labels=("horizon",),
    ),
    MetricSpec(
        name="gpuhealth_gpus",
        type=G,
        unit="1",
        help="GPUs by health state (healthy, warning, major, critical, out_of_service)",
        labels=("state",),
    ),
    MetricSpec(
        name="gpuhealth_open_findings",
        type=G,
        unit="1",
        help="Findings not yet resolved, by severity",
        labels=("severity",),
    ),
    MetricSpec(
        name="gpuhealth_open_incidents",
        type=G,
        unit="1",
        help="Incidents not yet resolved or cancelled, by worst severity and phase",
        labels=("severity", "phase"),
    ),
    MetricSpec(
        name="gpuhealth_disrupted_nodes",
        type=G,
        unit="1",
        help="Nodes out of service because of gpuhealth (counted against the budget)",
    ),
    MetricSpec(
        name="gpuhealth_disruption_budget_nodes",
        type=G,
        unit="1",
        help="Most nodes gpuhealth may hold out of service at once (the disruption budget)",
    ),
    MetricSpec(
        name="gpuhealth_state_write_failures_total",
        type=C,
        unit="1",
        help="Failed writes of a remediation state store (audit, actions) since start",
        labels=("store",),
    ),
    MetricSpec(
        name="gpuhealth_state_store_writable",
        type=G,
        unit="1",
        help="1 while the last write of a remediation state store succeeded, 0 while it fails",
        labels=("store",),
    ),
    MetricSpec(
        name="gpuhealth_remediation_failures_total",
        type=C,
        unit="1",
        help="Failed attempts of remediation steps by classification (transient, "
             "exhausted, permanent, timeout)",
        labels=("step", "classification"),
    ),
    MetricSpec(
        name="gpuhealth_remediation_actions_total",
        type=C,
        unit="1",
        help="Remediation actions that reached a phase, by step and phase",
        labels=("step", "phase", "dry_run"),
    ),
    MetricSpec(
        name="gpuhealth_remediation_held_total",
        type=C,
        unit="1",
        help="Remediation steps held back, by why (breaker, rate_limit, approval, human, opt_out)",
        labels=("reason",),
    ),
    MetricSpec(
        name="gpuhealth_remediation_breaker_open",
        type=G,
        unit="1",
        help="1 while the remediation circuit breaker is open (no automatic action), else 0",
    ),
    MetricSpec(
        name="gpuhealth_remediation_leader",
        type=G,
        unit="1",
        help="1 while this controller is the remediation leader, else 0 (standby)",
    ),
    MetricSpec(
        name="gpuhealth_node_reliability_ratio",
        type=G,
        unit="ratio",
        help="Node reliability score for placement, 0 (fails often) to 1 (most stable)",
        labels=("node",),
    ),
    MetricSpec(
        name="gpuhealth_incidents_resolved_total",
        type=C,
        unit="1",
        help="Incidents resolved (back in service)",
    ),
    MetricSpec(
        name="gpuhealth_time_to_remediate_seconds_total",
        type=C,
        unit="seconds",
        help="Sum over resolved incidents of the time from detection to back in service",
    ),
    MetricSpec(
        name="gpuhealth_pipeline_lag_seconds",
        type=G,
        unit="seconds",
        help="How long the stage's last run took (stage evaluate: one rule evaluation)",
        labels=("stage",),
    ),
    MetricSpec(
        name="gpuhealth_spool_depth",
        type=G,
        unit="1",
        help="Records waiting in the store's durable spool",
    ),
    MetricSpec(
        name="gpuhealth_spool_dropped_total",
        type=C,
        unit="1",
        help="Raw samples the full spool dropped, oldest first (events are never dropped)",
    ),
    MetricSpec(
        name="gpuhealth_store_rejected_total",
        type=C,
        unit="1",
        help="Samples and events a store rejected or converted before writing, by reason",
        labels=("reason",),
    ),
    MetricSpec(
        name="gpuhealth_outbox_depth",
        type=G,
        unit="1",
        help="Alerts waiting in the notifier outbox",
    ),
    MetricSpec(
        name="gpuhealth_agent_outbox_depth",
        type=G,
        unit="1",
        help="Records waiting in the agent's outbox for a controller to acknowledge",
    ),
    MetricSpec(
        name="gpuhealth_agent_outbox_dropped_total",
        type=C,
        unit="1",
        help="Records dropped from the agent's outbox because it was full",
    ),
    MetricSpec(
        name="gpuhealth_agent_records_sent_total",
        type=C,
        unit="1",
        help="Agent records acknowledged by a controller",
    ),
    MetricSpec(
        name="gpuhealth_agent_records_refused_total",
        type=C,
        unit="1",
        help="Agent records a controller refused for their content, set aside one by one",
    ),
    MetricSpec(
        name="gpuhealth_agent_controller_up",
        type=G,
        unit="1",
        help="Whether a controller answered the last batch (1) or none did (0)",
    ),
    MetricSpec(
        name="gpuhealth_agent_clock_skew_seconds",
        type=G,
        unit="seconds",
        help="An agent's clock minus this controller replica's, from its last batch's "
        "sent_at (includes the transit time; > 0: the agent is ahead)",
        labels=("node",),
    ),
    MetricSpec(
        name="gpuhealth_controller_records_accepted_total",
        type=C,
        unit="1",
        help="Agent records a controller replica wrote to the fleet state store",
        labels=("kind",),
    ),
    MetricSpec(
        name="gpuhealth_controller_batches_total",
        type=C,
        unit="1",
        help="Agent batches a controller replica answered, by HTTP status code",
        labels=("code",),
    ),
    MetricSpec(
        name="gpuhealth_controller_agents",
        type=G,
        unit="1",
        help="Registered agents, by state (reporting or silent)",
        labels=("state",),
    ),
    MetricSpec(
        name="gpuhealth_controller_consumer_lag_records",
        type=G,
        unit="1",
        help="Accepted agent records this replica has not consumed yet",
    ),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOG}
"""The catalog keyed by metric name."""

BY_DCGM: dict[str, MetricSpec] = {spec.dcgm: spec for spec in CATALOG if spec.dcgm}
"""The catalog keyed by dcgm-exporter series name."""


def spec(name: str) -> MetricSpec:
    """Return the spec of ``name``.

    Raises:
        KeyError: ``name`` is not catalogued (a collector bug).

    Examples:
        >>> spec("gpu_power_watts").unit
        'watts'
    """
    return BY_NAME[name]
