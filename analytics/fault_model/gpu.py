"""Fault-model rules for GPU state.

Memory errors, recovery action, clocks, NVLink, PCIe link, fabric, DCGM
diagnostics and health, and ``ERR!`` readings.

Each rule follows the severity/action table of ``docs/fault-model.md`` and names
the NVIDIA document behind it in its docstring and in each finding's ``source``.
Rules read the samples and events written by ``collectors.nvidia_smi``,
``collectors.dcgm``, ``collectors.dcgm_exporter`` and the NVML collector:

* samples ``gpu_ecc_errors_total{type,scope,location}``, ``gpu_sram_threshold_exceeded``,
  ``gpu_row_remap_pending``, ``gpu_row_remap_failure``, ``gpu_retired_pages_pending``,
  ``gpu_recovery_action``, ``gpu_last_xid``, ``gpu_clock_event_active{reason}``,
  ``gpu_nvlink_state{link}``, ``gpu_pcie_link_generation{bound}``,
  ``gpu_pcie_link_width{bound}``, ``gpu_info{model,...}``;
* events ``nvidia_smi_err``, ``fabric``, ``dcgm_diag``, ``dcgm_diag_error``,
  ``dcgm_diag_perf``, ``dcgm_health``, ``thermal_violation``, ``nvswitch_inventory``
  and (from the kernel-log parser) ``xid``.

Single snapshots of cumulative counters are judged only against the thresholds
stated here; rates need two readings and belong to ``run`` and ``replay``.
"""

from __future__ import annotations

import logging
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence

from analytics.fault_model.engine import Context, EventGroup, Observations, Rule
from core.records import (
    NODE_ENTITY,
    Action,
    EntityId,
    Evidence,
    Finding,
    NodeName,
    Sample,
    Severity,
)

logger = logging.getLogger(__name__)

MEMERR = "NVIDIA GPU memory error management"
DPR = "NVIDIA dynamic page retirement"
NVML = "NVML API reference"
DCGM = "DCGM user guide"
FM = "Fabric Manager user guide"

SRAM_LOCATIONS = frozenset(
    {
        "sram",
        "sram_parity",
        "sram_secded",
        "register_file",
        "l1_cache",
        "l2_cache",
        "texture_memory",
        "texture_shm",
        "cbu",
    }
)
"""ECC locations on the GPU die (SRAM), NVML ``nvmlMemoryLocation_t`` plus the
parity/SEC-DED split of ``nvmlEccSramErrorStatus_v1_t``."""

DRAM_LOCATIONS = frozenset({"dram", "device_memory"})
"""ECC locations in device memory (HBM/GDDR)."""

PEER_THROUGHPUT_RATIO = 0.5
"""A GPU under this fraction of its peers' median throughput in one diagnostic is
degraded (fault-model.md: "for example under half the peer median")."""

_NVSWITCH_MODELS = re.compile(
    r"SXM[3-9]|HGX|DGX|\bB[23]00\b|\bGB[23]00\b|H100 80G|H200|H800|\bH20\b", re.I
)
_BRIDGED_OR_PCIE = re.compile(r"\bNVL\b|PCIe", re.I)
_NVLINK_MODELS = re.compile(
    r"SXM|HGX|DGX|NVL\b|NVL\d|\bB[23]00\b|\bGB[23]00\b|H100 80G|H200|H800|\bH20\b", re.I
)
_NO_NVLINK_MODELS = re.compile(
    r"\b(?:L40S?|L4|L20|L2|T4|A10G?|A10M|A16|A2|RTX\s+\d{4}\s+Ada|RTX\s+PRO\s+\d{4})\b"
    r"(?!.*\bNVL)",
    re.I,
)
"""Boards without an NVLink connector (PCIe data-center and workstation cards: L40S,
L4, T4, A10, A16, A2, RTX Ada): NVLink-down reports on them are the known false
positive (NVML says "all links are inActive")."""

_SamplesByEntity = dict[tuple[NodeName, EntityId], list[Sample]]


# ---------------------------------------------------------------------------- helpers


def _by_entity(obs: Observations, metric: str) -> _SamplesByEntity:
    grouped: _SamplesByEntity = defaultdict(list)
    for (node, entity, _name, _labels), sample in obs.by_metric.get(metric, {}).items():
        grouped[(NodeName(node), EntityId(entity))].append(sample)
    return grouped


def _sample(obs: Observations, node: str, entity: str, metric: str) -> Sample | None:
    for (n, e, _m, _labels), sample in obs.by_metric.get(metric, {}).items():
        if n == node and e == entity:
            return sample
    return None


def _ev(samples: Iterable[Sample]) -> list[Evidence]:
    return [s.evidence for s in samples if s.evidence is not None]


def _times(samples: Sequence[Sample]) -> tuple[float | None, float | None]:
    at = [s.observed_at for s in samples if s.observed_at is not None]
    return (min(at), max(at)) if at else (None, None)


def _finding(
    *,
    node: str,
    entity: str,
    kind: str,
    code: str,
    severity: Severity,
    action: Action,
    summary: str,
    evidence: Iterable[Evidence],
    source: str,
    first: float | None = None,
    last: float | None = None,
    occurrences: int = 1,
) -> Finding:
    kept: list[Evidence] = []
    for item in evidence:
        if item not in kept:
            kept.append(item)
    return Finding(
        node=NodeName(node),
        entity=EntityId(entity),
        kind=kind,
        code=code,
        severity=severity,
        action=action,
        summary=summary,
        evidence=tuple(kept[:12]),
        source=source,
        first_seen_at=first,
        last_seen_at=last,
        occurrences=occurrences,
    )


def _flagged(
    obs: Observations, metric: str, diag_code: str
) -> Iterator[tuple[tuple[NodeName, EntityId], list[Sample], list[Evidence]]]:
    """Yield ``(key, flag samples set, DCGM diag evidence)`` per GPU that shows the condition.

    A GPU shows it when a ``metric`` flag sample reads >= 1 or a ``dcgm_diag_error``
    event with code ``diag_code`` names it; keys come in sorted order.
    """
    flags = _by_entity(obs, metric)
    diag = {(g.node, g.entity): g for g in obs.events("dcgm_diag_error", diag_code)}
    for key in sorted(set(flags) | set(diag)):
        hits = [s for s in flags.get(key, []) if s.value >= 1]
        group = diag.get(key)
        if hits or group is not None:
            yield key, hits, list(group.evidence) if group else []


def _group_evidence(groups: Iterable[EventGroup]) -> list[Evidence]:
    return [e for g in groups for e in g.evidence]


def _gpu_name(entity: str) -> str:
    return "unidentified GPU" if entity == "gpu:unknown" else f"GPU {entity}"


# ------------------------------------------------------------------------------- ECC


def ecc_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge uncorrectable ECC counts by location.

    Sources: NVIDIA GPU memory error management (SRAM vs DRAM uncorrectable
    errors, the SRAM threshold behind ``SRAM Threshold Exceeded`` / NVML
    ``nvmlEccSramErrorStatus_v1_t.bThresholdExceeded``), NVML API reference
    (``nvmlDeviceGetMemoryErrorCounter`` locations). Fault-model rows:

    * SRAM threshold exceeded: critical, ``service_hardware``.
    * volatile SRAM uncorrectable > 0: critical, ``reset_gpu``.
    * volatile DRAM (or unknown-location) uncorrectable > 0 without a row-remap
      failure: warning, ``reset_gpu`` (the remap failure rule covers the rest).
    * aggregate SRAM uncorrectable > 0 below the threshold: info (history).
    """
    del ctx
    ecc = _by_entity(obs, "gpu_ecc_errors_total")
    flags = _by_entity(obs, "gpu_sram_threshold_exceeded")
    for key in sorted(set(ecc) | set(flags)):
        node, entity = key
        samples = ecc.get(key, [])
        unc = [s for s in samples if s.labels.get("type") == "uncorrected"]
        vol = [s for s in unc if s.labels.get("scope") == "volatile"]
        agg = [s for s in unc if s.labels.get("scope") == "aggregate"]
        vol_sram = [s for s in vol if s.labels.get("location") in SRAM_LOCATIONS and s.value > 0]
        vol_dram = [s for s in vol if s.labels.get("location") in DRAM_LOCATIONS and s.value > 0]
        vol_total = [s for s in vol if s.labels.get("location") == "total" and s.value > 0]
        agg_sram = [s for s in agg if s.labels.get("location") in SRAM_LOCATIONS and s.value > 0]
        threshold = [s for s in flags.get(key, []) if s.value >= 1]
        source_doc = f"gpu.ecc_rule ({MEMERR}; {NVML} nvmlDeviceGetMemoryErrorCounter)"
        if threshold:
            yield _finding(
                node=node,
                entity=entity,
                kind="ecc",
                code="sram_threshold_exceeded",
                severity=Severity.CRITICAL,
                action=Action.SERVICE_HARDWARE,
                summary=f"{_gpu_name(entity)}: aggregate SRAM uncorrectable errors passed "
                "NVIDIA's threshold (SRAM Threshold Exceeded): RMA candidate",
                evidence=_ev(threshold + vol_sram + agg_sram),
                source=source_doc,
            )
        elif vol_sram:
            count = int(sum(s.value for s in vol_sram))
            yield _finding(
                node=node,
                entity=entity,
                kind="ecc",
                code="sram_uncorrectable",
                severity=Severity.CRITICAL,
                action=Action.RESET_GPU,
                summary=f"{_gpu_name(entity)}: {count} volatile SRAM uncorrectable ECC "
                "error(s): reset the GPU before reuse",
                evidence=_ev(vol_sram + agg_sram),
                source=source_doc,
            )
        elif agg_sram:
            yield _finding(
                node=node,
                entity=entity,
                kind="ecc",
                code="sram_uncorrectable_history",
                severity=Severity.INFO,
                action=Action.NONE,
                summary=f"{_gpu_name(entity)}: aggregate SRAM uncorrectable ECC errors in the "
                "InfoROM, below NVIDIA's threshold",
                evidence=_ev(agg_sram),
                source=source_doc,
            )
        failure = _sample(obs, node, entity, "gpu_row_remap_failure")
        if failure is not None and failure.value >= 1:
            continue  # the row-remap failure finding is the root cause
        if vol_dram or (vol_total and not vol_sram and not vol_dram):
            where = "DRAM" if vol_dram else "unknown-location"
            items = vol_dram or vol_total
            count = int(max(s.value for s in items))
            pending = _sample(obs, node, entity, "gpu_row_remap_pending")
            extra = [pending] if pending is not None and pending.value >= 1 else []
            yield _finding(
                node=node,
                entity=entity,
                kind="ecc",
                code="dram_uncorrectable",
                severity=Severity.WARNING,
                action=Action.RESET_GPU,
                summary=f"{_gpu_name(entity)}: {count} volatile {where} uncorrectable ECC "
                "error(s), contained; reset the GPU at the next opportunity (applies a pending "
                "row remap, clears the volatile count)",
                evidence=_ev(items + extra),
                source=source_doc,
            )


# ------------------------------------------------------------------ remap / retirement


def row_remap_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge row-remapping state.

    Sources: NVIDIA GPU memory error management; NVML ``nvmlDeviceGetRemappedRows``.

    * remap failure (``Remapping Failure Occurred: Yes``, DCGM row-remap failure):
      critical, ``service_hardware`` (RMA threshold).
    * pending remap (``Pending: Yes``; DCGM deployment error "uncorrectable memory
      errors and row remappings are pending"): warning, ``reset_gpu`` at the next
      opportunity; running work may continue.
    """
    del ctx
    source = f"gpu.row_remap_rule ({MEMERR}; {NVML} nvmlDeviceGetRemappedRows)"
    remapped = _by_entity(obs, "gpu_remapped_rows")
    failed: set[tuple[str, str]] = set()
    for key, hits, diag in _flagged(obs, "gpu_row_remap_failure", "row_remap_failure"):
        node, entity = key
        failed.add(key)
        unc = list(remapped.get(key, []))
        yield _finding(
            node=node,
            entity=entity,
            kind="row_remap",
            code="failure",
            severity=Severity.CRITICAL,
            action=Action.SERVICE_HARDWARE,
            summary=f"{_gpu_name(entity)}: row remapping failed: the GPU has reached "
            "NVIDIA's RMA threshold for memory errors",
            evidence=_ev(hits + unc) + diag,
            source=source,
        )
    for key, hits, diag in _flagged(obs, "gpu_row_remap_pending", "row_remap_pending"):
        if key in failed:
            continue
        if hits and not diag and all(s.labels.get("repair") for s in hits):
            continue  # only a channel or TPC repair pending: repair_pending_rule
        node, entity = key
        extra = [s for s in remapped.get(key, []) if s.value > 0]
        yield _finding(
            node=node,
            entity=entity,
            kind="row_remap",
            code="pending",
            severity=Severity.WARNING,
            action=Action.RESET_GPU,
            summary=f"{_gpu_name(entity)}: a row remap is pending: reset the GPU at the next "
            "opportunity to apply it (not an RMA unless remapping fails)",
            evidence=_ev(hits + extra) + diag,
            source=source,
        )


def repair_pending_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge pending memory repairs (``Channel Repair Pending``, ``TPC Repair Pending``).

    Sources: ``nvidia-smi`` (R575+) ``-q`` ECC fields; NVML ``nvmlDeviceGetRepairStatus``;
    NVIDIA GPU memory error management (Xid 160: memory marked for repair). Like a
    pending row remap, the repair is applied at the next GPU reset: warning,
    ``reset_gpu`` at the next opportunity.
    """
    del ctx
    source = f"gpu.repair_pending_rule ({MEMERR}; {NVML} nvmlDeviceGetRepairStatus)"
    for key, samples in sorted(_by_entity(obs, "gpu_row_remap_pending").items()):
        hits = [s for s in samples if s.value >= 1 and s.labels.get("repair")]
        if not hits or any(s.value >= 1 and not s.labels.get("repair") for s in samples):
            continue  # none pending, or a row remap pending too (the row-remap finding)
        node, entity = key
        kinds = sorted({s.labels.get("repair", "") for s in hits})
        what = " and ".join(kinds) or "memory"
        yield _finding(
            node=node,
            entity=entity,
            kind="row_remap",
            code="repair_pending",
            severity=Severity.WARNING,
            action=Action.RESET_GPU,
            summary=f"{_gpu_name(entity)}: a {what} repair is pending: reset the GPU at the "
            "next opportunity to apply it",
            evidence=_ev(hits),
            source=source,
        )


def retired_pages_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge dynamic page retirement.

    Sources: NVIDIA dynamic page retirement; NVML
    ``nvmlDeviceGetRetiredPagesPendingStatus``.

    A page pending retirement (``Pending Page Blacklist: Yes``) is applied at the
    next driver reload or GPU reset: warning, ``reset_gpu``. (Blacklisting
    failures come as Xid 64 and are judged by the Xid rules.)
    """
    del ctx
    source = f"gpu.retired_pages_rule ({DPR}; {NVML} nvmlDeviceGetRetiredPagesPendingStatus)"
    retired = _by_entity(obs, "gpu_retired_pages")
    for key, hits, diag in _flagged(obs, "gpu_retired_pages_pending", "retired_pages_pending"):
        node, entity = key
        counts = [s for s in retired.get(key, []) if s.value > 0]
        yield _finding(
            node=node,
            entity=entity,
            kind="retired_pages",
            code="pending",
            severity=Severity.WARNING,
            action=Action.RESET_GPU,
            summary=f"{_gpu_name(entity)}: retired page(s) pending: reset the GPU (or reload "
            "the driver) at the next opportunity to blacklist them",
            evidence=_ev(hits + counts) + diag,
            source=source,
        )


# ------------------------------------------------------------------- recovery action

_RECOVERY = {
    1: ("gpu_reset", Severity.CRITICAL, Action.RESET_GPU, "GPU Reset Required"),
    2: ("node_reboot", Severity.CRITICAL, Action.REBOOT_NODE, "Node Reboot Required"),
    3: ("drain_p2p", Severity.MAJOR, Action.RESET_GPU, "Drain P2P"),
    4: ("drain_and_reset", Severity.CRITICAL, Action.RESET_GPU, "Drain and Reset"),
    6: ("bus_reset", Severity.CRITICAL, Action.RESET_GPU, "Bus Reset"),
    7: ("system_reboot", Severity.CRITICAL, Action.REBOOT_NODE, "System Reboot"),
}


def recovery_action_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Act on the driver's GPU recovery action.

    Sources: NVML field 230 ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, "Error
    Recovery and Response Flags" in the NVML API reference; Xid 154 carries the
    same value.

    GPU Reset / Drain and Reset: critical ``reset_gpu``; Node Reboot: critical
    ``reboot_node``; Drain P2P: major ``reset_gpu``; None: nothing. A DCGM health
    "Healthy" verdict never overrides it (it is kept as evidence), and the last
    Xid DCGM reported for the GPU is added as supporting evidence.
    """
    del ctx
    healthy = {g.node: g for g in obs.events("dcgm_health", "healthy", entity=NODE_ENTITY)}
    for (node, entity), samples in sorted(_by_entity(obs, "gpu_recovery_action").items()):
        for sample in samples:
            spec = _RECOVERY.get(int(sample.value))
            if spec is None:
                if int(sample.value) == 5:
                    spec = (
                        "recover_imex_domain",
                        Severity.MAJOR,
                        Action.CHECK_NETWORK,
                        "Recover IMEX Domain",
                    )
                else:
                    continue
            code, severity, action, label = spec
            evidence = _ev([sample])
            notes: list[str] = []
            last_xid = _sample(obs, node, entity, "gpu_last_xid")
            if last_xid is not None and last_xid.value > 0:
                evidence += _ev([last_xid])
                notes.append(f"last Xid {int(last_xid.value)}")
            for group in obs.events("nvidia_smi_err", node=node, entity=entity):
                evidence += group.evidence
            health = healthy.get(node)
            if health is not None:
                evidence += health.evidence
                notes.append("DCGM health says Healthy: a false negative, overridden")
            first, last = _times([sample])
            yield _finding(
                node=node,
                entity=entity,
                kind="recovery_action",
                code=code,
                severity=severity,
                action=action,
                summary=f"{_gpu_name(entity)}: recovery action {label}"
                + (f" ({'; '.join(notes)})" if notes else ""),
                evidence=evidence,
                source=f"gpu.recovery_action_rule ({NVML}: GPU recovery action, field 230)",
                first=first,
                last=last,
            )


def last_xid_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Record DCGM's last-Xid pointer.

    Sources: ``DCGM_FI_DEV_XID_ERRORS`` (field 230 in ``dcgmi dmon``), DCGM user
    guide field list.

    The gauge holds the last Xid, not a count: alone it is info, ``none`` ("look
    in the kernel log"); with a recovery action it is folded into that finding.
    The finding uses kind ``xid`` and the Xid number as code so that it merges
    with the kernel-log finding for the same Xid on the same entity.
    """
    del ctx
    for (node, entity), samples in sorted(_by_entity(obs, "gpu_last_xid").items()):
        for sample in samples:
            if sample.value <= 0:
                continue
            action = _sample(obs, node, entity, "gpu_recovery_action")
            if action is not None and action.value > 0:
                continue
            xid = int(sample.value)
            yield _finding(
                node=node,
                entity=entity,
                kind="xid",
                code=str(xid),
                severity=Severity.INFO,
                action=Action.NONE,
                summary=f"{_gpu_name(entity)}: DCGM's last Xid is {xid} (a pointer, not a "
                "count): look for it in the kernel log",
                evidence=_ev([sample]),
                source=f"gpu.last_xid_rule ({DCGM}: DCGM_FI_DEV_XID_ERRORS is the last Xid)",
            )


# ------------------------------------------------------------------------- throttling


def clock_event_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge clock event (throttle) reasons.

    Sources: NVML API reference ``nvmlClocksEventReason*``; DCGM thermal violations.

    * HW power brake (asserted by the BMC/platform): major, ``fix_config``.
    * HW or SW thermal slowdown, DCGM thermal violations: warning,
      ``service_hardware`` (cooling).
    * HW slowdown alone (no thermal or power-brake sub-reason): warning,
      ``service_hardware``: NVML says HW slowdown cuts clocks by 2x or more for
      high temperature, an external power brake or power draw over the fast
      trigger, so with neither sub-flag set the cause is power delivery or
      cooling hardware to inspect.
    * SW power cap alone: info, ``none`` (the power limit at work).
    """
    del ctx
    source = f"gpu.clock_event_rule ({NVML}: nvmlClocksEventReason*; {DCGM}: thermal violations)"
    reasons = _by_entity(obs, "gpu_clock_event_active")
    thermal_events: dict[tuple[str, str], list[EventGroup]] = defaultdict(list)
    for group in obs.events("thermal_violation"):
        thermal_events[(group.node, group.entity)].append(group)
    keys = set(reasons) | {(NodeName(n), EntityId(e)) for n, e in thermal_events}
    for key in sorted(keys):
        node, entity = key
        active = {s.labels.get("reason", ""): s for s in reasons.get(key, []) if s.value >= 1}
        if "hw_power_brake" in active:
            yield _finding(
                node=node,
                entity=entity,
                kind="throttle",
                code="hw_power_brake",
                severity=Severity.MAJOR,
                action=Action.FIX_CONFIG,
                summary=f"{_gpu_name(entity)}: HW power brake slowdown asserted by the "
                "platform: check the BMC power policy / PSU configuration",
                evidence=_ev(
                    [active["hw_power_brake"]]
                    + ([active["hw_slowdown"]] if "hw_slowdown" in active else [])
                ),
                source=source,
            )
        thermal = [active[r] for r in ("hw_thermal", "sw_thermal") if r in active]
        groups = thermal_events.get(key, [])
        if thermal or groups:
            seconds = [v for g in groups for v in g.attr_values.get("seconds", set())]
            detail = f" (DCGM thermal violations {', '.join(sorted(seconds))} s)" if seconds else ""
            yield _finding(
                node=node,
                entity=entity,
                kind="throttle",
                code="thermal",
                severity=Severity.WARNING,
                action=Action.SERVICE_HARDWARE,
                summary=f"{_gpu_name(entity)}: thermal slowdown{detail}: inspect cooling "
                "(fans, heatsink, airflow)",
                evidence=_ev(thermal) + _group_evidence(groups),
                source=source,
            )
        if "hw_slowdown" in active and not ({"hw_power_brake", "hw_thermal"} & set(active)):
            yield _finding(
                node=node,
                entity=entity,
                kind="throttle",
                code="hw_slowdown",
                severity=Severity.WARNING,
                action=Action.SERVICE_HARDWARE,
                summary=f"{_gpu_name(entity)}: HW slowdown without a thermal or power-brake "
                "sub-reason: inspect power delivery and cooling",
                evidence=_ev([active["hw_slowdown"]]),
                source=source,
            )
        bad = {"hw_power_brake", "hw_thermal", "sw_thermal", "hw_slowdown"}
        if "power_cap" in active and not (bad & set(active)) and not groups:
            yield _finding(
                node=node,
                entity=entity,
                kind="throttle",
                code="sw_power_cap",
                severity=Severity.INFO,
                action=Action.NONE,
                summary=f"{_gpu_name(entity)}: clocks held at the power limit (SW power cap): "
                "normal under load",
                evidence=_ev([active["power_cap"]]),
                source=source,
            )


def temperature_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge a GPU's temperature against its own thresholds (NVML, per GPU).

    Sources: NVML ``nvmlDeviceGetTemperatureThreshold`` (shutdown, slowdown, GPU max
    operating temperature; ecosystem-reference §1) read into
    ``gpu_temperature_threshold_celsius{threshold}``; the clock event reasons for thermal
    slowdown. No fixed number: a GPU model's limits differ (an H100 slows down near 90 degC,
    an A100 PCIe at 92, a V100 at 97). Latest readings:

    * within 5 degC of the shutdown threshold: critical ``thermal`` ``near_shutdown``,
      ``service_hardware`` (the driver will power it off);
    * at or above the slowdown threshold: major ``thermal`` ``at_slowdown_temperature``,
      ``service_hardware`` (held there, the GPU runs at a fraction of its clocks; cooling);
    * at or above the maximum operating temperature with a HW/SW thermal slowdown
      active: major ``thermal`` ``thermal_slowdown_above_max_operating``;
    * at or above the maximum operating temperature alone: warning ``thermal``
      ``above_max_operating``.

    A GPU whose thresholds are not reported gives nothing here (``clock_event_rule``
    still judges its thermal clock events).
    """
    del ctx
    source = f"gpu.temperature_rule ({NVML}: nvmlDeviceGetTemperatureThreshold, " \
        "nvmlClocksEventReason*ThermalSlowdown)"
    temps = _by_entity(obs, "gpu_temperature_celsius")
    limits = _by_entity(obs, "gpu_temperature_threshold_celsius")
    reasons = _by_entity(obs, "gpu_clock_event_active")
    for key in sorted(set(temps) & set(limits)):
        node, entity = key
        temp = max(temps[key], key=lambda s: s.observed_at or 0.0)
        limit = {s.labels.get("threshold", ""): s.value for s in limits[key] if s.value > 0}
        thermal = [s for s in reasons.get(key, [])
                   if s.value >= 1 and s.labels.get("reason") in ("hw_thermal", "sw_thermal")]
        shutdown, slowdown = limit.get("shutdown"), limit.get("slowdown")
        max_operating = limit.get("max_operating")
        value = temp.value
        if shutdown is not None and value >= shutdown - 5.0:
            code, severity = "near_shutdown", Severity.CRITICAL
            what = f"{value:.0f} degC, within 5 degC of its shutdown threshold ({shutdown:.0f})"
        elif slowdown is not None and value >= slowdown:
            code, severity = "at_slowdown_temperature", Severity.MAJOR
            what = f"{value:.0f} degC, at or above its slowdown threshold ({slowdown:.0f})"
        elif max_operating is not None and value >= max_operating and thermal:
            code, severity = "thermal_slowdown_above_max_operating", Severity.MAJOR
            what = (f"{value:.0f} degC, above its maximum operating temperature "
                    f"({max_operating:.0f}) with thermal slowdown active")
        elif max_operating is not None and value >= max_operating:
            code, severity = "above_max_operating", Severity.WARNING
            what = (f"{value:.0f} degC, above its maximum operating temperature "
                    f"({max_operating:.0f})")
        else:
            continue
        yield _finding(
            node=node,
            entity=entity,
            kind="thermal",
            code=code,
            severity=severity,
            action=Action.SERVICE_HARDWARE,
            summary=f"{_gpu_name(entity)}: {what}: inspect cooling (fans, heatsink, airflow, "
            "inlet temperature)",
            evidence=_ev([temp, *thermal]),
            source=source,
            first=temp.observed_at,
            last=temp.observed_at,
        )


# ---------------------------------------------------------------------------- NVLink


def _models(obs: Observations, node: str, entity: str | None) -> list[str]:
    models = []
    for (n, e, _m, _l), sample in obs.by_metric.get("gpu_info", {}).items():
        if n == node and (entity is None or e == entity):
            model = sample.labels.get("model")
            if model:
                models.append(model)
    return models


def _nvswitch_system(obs: Observations, ctx: Context, node: str, entity: str) -> bool | None:
    """True/False when the node is known to have NVSwitches (or not), else None."""
    fact = ctx.fact("nvswitch")
    if fact in {"present", "expected", "yes", "true"}:
        return True
    if fact in {"absent", "no", "false"}:
        return False
    if obs.events("nvswitch_inventory", "present", node=node):
        return True
    if obs.events("nvswitch_inventory", "absent", node=node):
        return False
    if obs.events("fabric", "completed", node=node):
        return True  # fabric registration happens only with NVSwitches / multi-node NVLink
    models = _models(obs, node, entity) or _models(obs, node, None)
    if any(_NVSWITCH_MODELS.search(m) and not _BRIDGED_OR_PCIE.search(m) for m in models):
        return True
    return None


def _nvlink_expected(obs: Observations, ctx: Context, node: str, entity: str) -> bool | None:
    fact = ctx.fact("nvlink")
    if fact in {"expected", "present", "yes", "true"}:
        return True
    if fact in {"absent", "no", "none", "false"}:
        return False
    if _nvswitch_system(obs, ctx, node, entity):
        return True
    models = _models(obs, node, entity) or _models(obs, node, None)
    if any(_NVLINK_MODELS.search(m) for m in models):
        return True
    if models and all(_NO_NVLINK_MODELS.search(m) for m in models):
        return False
    return None


def nvlink_verdict(
    obs: Observations, ctx: Context, node: str, entity: str, *, all_down: bool
) -> tuple[Severity, Action, str]:
    """Return severity, action and a reason for NVLinks down on one GPU.

    fault-model.md: every link down in an NVSwitch system: critical ``reset_gpu``;
    some links down, or all down on bridged cards: major ``reset_gpu`` when NVLink
    is expected (``nvlink=expected`` or an SXM/HGX/NVL board), info ``none`` with
    ``nvlink=absent`` (the known false positive on PCIe cards without a bridge),
    warning ``none`` ("verify topology") when unknown.
    """
    expected = _nvlink_expected(obs, ctx, node, entity)
    if expected is False:
        return Severity.INFO, Action.NONE, "no NVLink on this system (expected, not a fault)"
    if all_down and _nvswitch_system(obs, ctx, node, entity):
        return Severity.CRITICAL, Action.RESET_GPU, "every NVLink down in an NVSwitch system"
    if expected:
        return Severity.MAJOR, Action.RESET_GPU, "NVLink expected: P2P falls back to PCIe"
    return Severity.WARNING, Action.NONE, "NVLink topology unknown: verify topology"


def _link_order(sample: Sample) -> tuple[int, str]:
    """Sort key of a link label: numbers in order, then names such as ``all``/``total``."""
    link = sample.labels.get("link", "")
    return (int(link), "") if link.isdigit() else (1 << 30, link)


def nvlink_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge NVLink link states against the expected topology.

    Sources: NVML ``nvmlDeviceGetNvLinkState``; ``dcgmi nvlink --link-status``,
    DCGM user guide; Fabric Manager user guide for NVSwitch systems. See
    :func:`nvlink_verdict`.
    A passing diagnostic does not clear a down link.
    """
    for (node, entity), samples in sorted(_by_entity(obs, "gpu_nvlink_state").items()):
        down = sorted((s for s in samples if s.value < 1), key=_link_order)
        if not down:
            continue
        all_down = len(down) == len(samples)
        severity, action, why = nvlink_verdict(obs, ctx, node, entity, all_down=all_down)
        links = ", ".join(s.labels.get("link", "?") for s in down)
        what = f"all {len(samples)} NVLinks down" if all_down else f"NVLink(s) {links} down"
        yield _finding(
            node=node,
            entity=entity,
            kind="nvlink",
            code="all_down" if all_down else "link_down",
            severity=severity,
            action=action,
            summary=f"{_gpu_name(entity)}: {what} ({why})",
            evidence=_ev(down),
            source=f"gpu.nvlink_rule ({NVML} nvmlDeviceGetNvLinkState; {DCGM}; {FM})",
            # when it was seen down (a boot window, a recurrence after a fix need it)
            first=min((t for t in (x.observed_at for x in down) if t is not None),
                      default=None),
            last=max((t for t in (x.observed_at for x in down) if t is not None),
                     default=None),
        )


# --------------------------------------------------------------------- DCGM diag/health

_HARDWARE_TESTS = re.compile(
    r"memory|memtest|diagnostic|stress|targeted|sm_|eud|pulse|power|bandwidth|hardware|"
    r"nvbandwidth|cpu_eud|software",
    re.I,
)


_UNUSABLE = re.compile(
    r"busy or unavailable|cuCtxCreate|Unable to create CUDA context|cudaStreamCreate|"
    r"cuInit|NV_ERR_RESET_REQUIRED|failed to create a CUDA context|"
    r"no longer bound to a CUDA context|Unable to find a corresponding CUDA device|"
    r"context is destroyed|CUDA_ERROR_DEVICE_UNAVAILABLE",
    re.I,
)
"""Diagnostic messages saying the test could not run on the GPU at all."""


def dcgm_diag_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge DCGM diagnostic results.

    Sources: DCGM user guide, "Diagnostics", and its diagnostic error categories
    (memory, performance, PCIe...).

    * a GPU failing a memory, diagnostic or stress plugin: critical,
      ``service_hardware``;
    * a failure whose messages say the test could not create a CUDA context
      (device busy or unavailable): the GPU is unusable, not proven faulty:
      critical, ``reset_gpu`` (then rerun the diagnostic);
    * a failure whose only messages are NVLink-down reports follows the NVLink
      rows (:func:`nvlink_verdict`), e.g. info on a system without NVLink;
    * an Integration (PCIe) failure: major, ``service_hardware``;
    * a Deployment failure without a known cause: warning, ``fix_config``;
    * a Warn result: warning, ``none``;
    * a GPU under half its peers' median throughput in one test: major,
      ``service_hardware``.
    """
    source = f"gpu.dcgm_diag_rule ({DCGM}: dcgmi diag)"
    deploy_known = {g.node for g in obs.events("dcgm_diag_error")}
    for group in obs.events("dcgm_diag"):
        node, entity = group.node, group.entity
        for event in group.events[:1]:
            attrs = event.attrs
            result = attrs.get("result", "")
            category = attrs.get("category", "")
            test = attrs.get("test", group.code)
            if attrs.get("nvlink_only") == "yes":
                severity, action, why = _diag_nvlink_verdict(obs, ctx, node, entity)
                summary = f"DCGM {test} {result} rests only on NVLink-down reports ({why})"
            elif result == "fail" and _UNUSABLE.search(attrs.get("message", "")):
                severity, action = Severity.CRITICAL, Action.RESET_GPU
                who = "a GPU" if entity == NODE_ENTITY else _gpu_name(entity)
                summary = f"DCGM {test} could not use {who} (CUDA context or "
                summary += "device busy/unavailable): reset the GPU, then rerun the diagnostic"
            elif result == "warn":
                severity, action = Severity.WARNING, Action.NONE
                summary = f"DCGM {test} warned: {attrs.get('message', '')[:160]}"
            elif category == "deployment" or group.code in {"denylist", "blacklist"}:
                if node in deploy_known:
                    continue
                severity, action = Severity.WARNING, Action.FIX_CONFIG
                summary = f"DCGM deployment check {test} failed: {attrs.get('message', '')[:160]}"
            elif category == "integration" or group.code.startswith("pcie"):
                severity, action = Severity.MAJOR, Action.SERVICE_HARDWARE
                summary = f"DCGM {test} failed: {attrs.get('message', '')[:160]}"
            elif _HARDWARE_TESTS.search(group.code) or category in {"hardware", "stress"}:
                severity, action = Severity.CRITICAL, Action.SERVICE_HARDWARE
                summary = f"{_gpu_name(entity)} failed the DCGM {test} test: drain it, collect "
                summary += "nvidia-bug-report, rerun dcgmi diag -r 3, then hardware service"
            else:
                severity, action = Severity.MAJOR, Action.SERVICE_HARDWARE
                summary = f"DCGM {test} failed: {attrs.get('message', '')[:160]}"
            yield _finding(
                node=node,
                entity=entity,
                kind="diagnostic",
                code=group.code,
                severity=severity,
                action=action,
                summary=summary.strip(),
                evidence=group.evidence,
                source=source,
                occurrences=group.count,
            )
    yield from _peer_throughput(obs)


def _diag_nvlink_verdict(
    obs: Observations, ctx: Context, node: str, entity: str
) -> tuple[Severity, Action, str]:
    entities = (
        [entity]
        if entity != NODE_ENTITY
        else [e for (n, e), _s in _by_entity(obs, "gpu_nvlink_state").items() if n == node]
    )
    verdicts = [nvlink_verdict(obs, ctx, node, e, all_down=False) for e in entities or [entity]]
    return max(verdicts, key=lambda v: v[0].rank)


def _peer_throughput(obs: Observations) -> Iterator[Finding]:
    by_test: dict[tuple[str, str, str], dict[str, tuple[float, EventGroup]]] = defaultdict(dict)
    for group in obs.events("dcgm_diag_perf"):
        for event in group.events:
            try:
                value = float(event.attrs.get("value", ""))
            except ValueError:
                continue
            metric = event.attrs.get("metric", "")
            unit = event.attrs.get("unit", "")
            by_test[(group.node, group.code, f"{unit} ({metric})" if metric else unit)][
                group.entity
            ] = (
                value,
                group,
            )
    for (node, test, unit), values in sorted(by_test.items()):
        if len(values) < 3:
            continue
        for entity, (value, group) in sorted(values.items()):
            peers = [v for e, (v, _g) in values.items() if e != entity]
            median = statistics.median(peers)
            if median > 0 and value < PEER_THROUGHPUT_RATIO * median:
                yield _finding(
                    node=node,
                    entity=entity,
                    kind="diagnostic",
                    code=f"{test}_throughput",
                    severity=Severity.MAJOR,
                    action=Action.SERVICE_HARDWARE,
                    summary=f"{_gpu_name(entity)}: {value:g} {unit} in "
                    f"{'DCGM ' if group.first.source != 'benchmark' else ''}{test}, under half "
                    f"its peers' median {median:g} {unit}: a straggler (a diagnostic that "
                    "passes does not clear it)",
                    evidence=group.evidence,
                    source=f"gpu.dcgm_diag_rule ({DCGM}: per-GPU throughput vs peers; "
                    "NVIDIA/DCGM #122)",
                )


def dcgm_health_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Record DCGM health-watch verdicts (DCGM user guide, "Health and Diagnostics").

    Healthy: no finding (it never overrides other evidence, see
    :func:`recovery_action_rule`). Warning: warning, ``none`` (investigate the named
    subsystem). Failure: major, ``service_hardware``. A verdict whose only cause is
    NVLink-down reports follows the NVLink rows (:func:`nvlink_verdict`): the known
    false positive on PCIe GPUs without a bridge is info with ``nvlink=absent``.
    The overall verdict is judged only when no GPU verdict says more, and a GPU
    verdict whose every message became a specific record (row remap, retired pages,
    Xid, ECC, thermal) is left to the rules for those.
    """
    groups = obs.events("dcgm_health")
    named = {g.node for g in groups if g.entity != NODE_ENTITY}
    for group in groups:
        if group.code in {"healthy", "pass"}:
            continue
        if group.entity == NODE_ENTITY and group.node in named:
            continue  # the overall verdict sums up the per-GPU ones, judged on their own
        if group.attr_values.get("explained") == {"yes"}:
            continue  # every message became a specific record (row remap, Xid...): judged there
        failure = group.code in {"failure", "fail"}
        message = next(iter(group.attr_values.get("message", {""})), "")
        severity = Severity.MAJOR if failure else Severity.WARNING
        action = Action.SERVICE_HARDWARE if failure else Action.NONE
        if group.attr_values.get("nvlink_only") == {"yes"}:
            severity, action, why = _diag_nvlink_verdict(obs, ctx, group.node, group.entity)
            message = f"{message[:120]} ({why})"
        yield _finding(
            node=group.node,
            entity=group.entity,
            kind="dcgm_health",
            code=group.code,
            severity=severity,
            action=action,
            summary=f"DCGM health {group.code} on {group.entity}: {message[:160]}".strip(),
            evidence=group.evidence,
            source=f"gpu.dcgm_health_rule ({DCGM}: dcgmi health -c)",
        )


# ---------------------------------------------------------------------- fabric / PCIe


def fabric_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge NVLink fabric registration.

    Sources: NVML ``nvmlDeviceGetGpuFabricInfo``; Fabric Manager user guide.

    State Completed with a Status other than Success: the GPU is outside its NVLink
    domain: critical, ``check_network``. Completed/Success with a health summary
    that is not Healthy: major, ``check_network``.
    """
    del ctx
    source = f"gpu.fabric_rule ({NVML} nvmlDeviceGetGpuFabricInfo; {FM})"
    for group in obs.events("fabric", "completed"):
        status = next(iter(group.attr_values.get("status", set())), "")
        health = next(iter(group.attr_values.get("health_summary", set())), "")
        if status and status.strip().lower() not in {"success", "n/a", "not supported"}:
            yield _finding(
                node=group.node,
                entity=group.entity,
                kind="fabric",
                code="status",
                severity=Severity.CRITICAL,
                action=Action.CHECK_NETWORK,
                summary=f"{_gpu_name(group.entity)}: NVLink fabric registration completed with "
                f"status {status}: the GPU is outside its NVLink domain",
                evidence=group.evidence,
                source=source,
            )
        elif health and health.strip().lower() not in {"healthy", "n/a", "not supported", ""}:
            yield _finding(
                node=group.node,
                entity=group.entity,
                kind="fabric",
                code="health",
                severity=Severity.MAJOR,
                action=Action.CHECK_NETWORK,
                summary=f"{_gpu_name(group.entity)}: NVLink fabric health {health} while "
                "registration succeeded",
                evidence=group.evidence,
                source=source,
            )


def pcie_link_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge a GPU's PCIe link against its capability and its peers.

    Sources: PCIe link status as NVML ``nvmlDeviceGetCurrPcieLinkGeneration/Width``
    and ``lspci`` LnkCap/LnkSta report it (ecosystem-reference §9b); the Linux PCI
    core's ``available PCIe bandwidth, limited by ...`` notice (fault-model.md).

    Width: links do not narrow at idle, so a width below capability is a fault:
    major, ``service_hardware`` (reseat, riser, slot) when the peers on the node run
    wider; warning, ``service_hardware`` otherwise (every GPU narrowed, or no peers).
    Generation (speed): GPUs lower their link speed at idle (power saving), so a
    generation below capability is info unless the GPU is known to be busy and its
    peers run faster: then major, ``service_hardware``. The same holds for the
    kernel's "limited by" notice, compared with its peers of the same capable link
    (notices and full-bandwidth lines); when every peer is limited alike (a Gen4
    switch) it stays the host rule's info, a platform limit.
    """
    del ctx
    source = f"gpu.pcie_link_rule ({NVML} nvmlDeviceGetCurrPcieLink*; lspci LnkCap/LnkSta)"
    for metric, what in (
        ("gpu_pcie_link_width", "width"),
        ("gpu_pcie_link_generation", "generation"),
    ):
        by_node: dict[str, dict[str, dict[str, Sample]]] = defaultdict(lambda: defaultdict(dict))
        for (node_name, entity_id), samples in _by_entity(obs, metric).items():
            for s in samples:
                by_node[node_name][entity_id][s.labels.get("bound", "")] = s
        for node, entities in sorted(by_node.items()):
            currents = {e: b["current"].value for e, b in entities.items() if "current" in b}
            for entity, bounds in sorted(entities.items()):
                cur, cap = bounds.get("current"), bounds.get("max")
                if cur is None or cap is None or cur.value >= cap.value:
                    continue
                if _port_explains(obs, node, entity, what, cur.value):
                    continue  # the GPU runs at its upstream port's lower capability
                peers = [v for e, v in currents.items() if e != entity]
                faster = bool(peers) and cur.value < statistics.median(peers)
                busy = what == "width" or _busy(obs, node, entity)
                head = (
                    f"{_gpu_name(entity)}: PCIe link {what} {cur.value:g} below its "
                    f"capability {cap.value:g}"
                )
                if faster and busy:
                    severity, action = Severity.MAJOR, Action.SERVICE_HARDWARE
                    summary = f"{head} and below its peers: downtrained link"
                elif what == "width":
                    severity, action = Severity.WARNING, Action.SERVICE_HARDWARE
                    summary = f"{head} ({'like its peers' if peers else 'no peers to compare'}"
                    summary += "; a link does not narrow at idle): downtrained or a narrow slot"
                elif faster:
                    severity, action = Severity.INFO, Action.NONE
                    summary = (
                        f"{head} while its peers run faster; load unknown or idle (GPUs lower "
                        "link speed at idle): check it under load"
                    )
                else:
                    severity, action = Severity.INFO, Action.NONE
                    summary = f"{head}, " + (
                        "like its peers (platform limit or idle)"
                        if peers
                        else "no peers to compare with (platform limit or idle)"
                    )
                yield _finding(
                    node=node,
                    entity=entity,
                    kind="pcie",
                    code=f"link_{what}",
                    severity=severity,
                    action=action,
                    summary=summary,
                    evidence=_ev([cur, cap]),
                    source=source,
                )
    yield from _limited_notices(obs)


_GTS_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}
"""PCIe transfer rate (GT/s) to generation."""


def _port_explains(obs: Observations, node: str, entity: str, what: str, current: float) -> bool:
    """True when ``lspci`` shows the GPU's link partner cannot do more than ``current``."""
    for group in obs.events("pcie_link", "gpu", node=node, entity=entity):
        if what == "width":
            cap = min((int(v) for v in group.attr_values.get("cap_width", set())), default=None)
            if cap is not None and cap <= current:
                return True
        else:
            speeds = [float(v) for v in group.attr_values.get("cap_speed", set())]
            gen = _GTS_GEN.get(min(speeds)) if speeds else None
            if gen is not None and gen <= current:
                return True
    return False


def pcie_path_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge the PCIe links between NVIDIA GPUs and their root ports (``lspci -vv``).

    Each link is judged against the lesser capability of its two ends (PCI Express Base
    Specification, Link Capabilities/Status; ``collectors.lspci_tree``), so a bridge that
    runs at its downstream device's lower capability is normal and gives nothing:

    * trained width below what both ends can do: the link lost lanes (links do not narrow
      at idle), major ``service_hardware`` for the GPUs below it (reseat, riser, cable,
      switch);
    * trained speed below what both ends can do: GPUs and some bridges lower the link speed
      at idle to save power, so info while the GPUs below are idle or their load is
      unknown, major ``service_hardware`` when one of them is busy.

    The finding says which ports and values were compared. (The GPU's own link is judged by
    :func:`pcie_link_rule`, which uses its port's capability in the same way.)
    """
    del ctx
    source = "gpu.pcie_path_rule (lspci -vv LnkCap/LnkSta of both ends; PCIe Base Spec)"
    for group in obs.events("pcie_link", "path"):
        node = group.node
        port = _one(group, "port")
        device = _one(group, "device")
        gpus = _one(group, "gpus")
        sta_w, cap_w = int(_one(group, "sta_width") or 0), int(_one(group, "cap_width") or 0)
        sta_s, cap_s = float(_one(group, "sta_speed") or 0), float(_one(group, "cap_speed") or 0)
        compared = (
            f"link {port} ({_one(group, 'port_type') or 'port'}, capable of "
            f"{_one(group, 'port_cap_speed')} GT/s x{_one(group, 'port_cap_width')}) -> {device} "
            f"({_one(group, 'device_type') or 'device'}, capable of "
            f"{_one(group, 'device_cap_speed')} GT/s x{_one(group, 'device_cap_width')}) "
            f"trained at {sta_s:g} GT/s x{sta_w}; GPUs below: {gpus}"
        )
        if sta_w and cap_w and sta_w < cap_w:
            severity, action = Severity.MAJOR, Action.SERVICE_HARDWARE
            summary = (
                f"PCIe {compared}: width x{sta_w} below the x{cap_w} both ends can do: the "
                "link lost lanes (a link does not narrow at idle); reseat the GPU/riser/cable "
                "or service the switch"
            )
            code = "path_link_width"
        elif sta_s and cap_s and sta_s < cap_s:
            busy = any(_busy(obs, node, g) for g in gpus.split(",") if g)
            code = "path_link_speed"
            if busy:
                severity, action = Severity.MAJOR, Action.SERVICE_HARDWARE
                summary = (
                    f"PCIe {compared}: speed {sta_s:g} GT/s below the {cap_s:g} GT/s both ends "
                    "can do while a GPU below is busy: downtrained link"
                )
            else:
                severity, action = Severity.INFO, Action.NONE
                summary = (
                    f"PCIe {compared}: speed {sta_s:g} GT/s below the {cap_s:g} GT/s both ends "
                    "can do; GPUs and bridges lower link speed at idle (load unknown or idle): "
                    "check it under load"
                )
        else:
            continue
        yield _finding(
            node=node,
            entity=device,
            kind="pcie",
            code=code,
            severity=severity,
            action=action,
            summary=summary,
            evidence=group.evidence,
            source=source,
        )


_LINK = re.compile(r"(?P<speed>\d+(?:\.\d+)?) GT/s PCIe x(?P<width>\d+)")


def _link(text: str) -> tuple[float, int] | None:
    """``(GT/s, lanes)`` of a kernel link text such as ``8.0 GT/s PCIe x4 link``.

    Examples:
        >>> _link("8.0 GT/s PCIe x4 link")
        (8.0, 4)
        >>> _link("unknown") is None
        True
    """
    m = _LINK.search(text)
    return None if m is None else (float(m["speed"]), int(m["width"]))


def _one(group: EventGroup, key: str) -> str:
    values = group.attr_values.get(key, set())
    return min(values) if values else ""


def _limited_notices(obs: Observations) -> Iterator[Finding]:
    """Judge the kernel's ``limited by`` notices against peers of the same capable link."""
    source = "gpu.pcie_link_rule (Linux PCI core bandwidth notice; fault-model.md)"
    # node -> capable link -> entity -> current link
    peers: dict[str, dict[tuple[float, int], dict[str, tuple[float, int]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    limited: list[tuple[EventGroup, tuple[float, int], tuple[float, int]]] = []
    for g in obs.events("pcie_bandwidth_limited"):
        cur, cap = _link(_one(g, "limited_by")), _link(_one(g, "capable_link"))
        if cur is None or cap is None:
            continue
        peers[g.node][cap][g.entity] = cur
        limited.append((g, cur, cap))
    if not limited:
        return
    for g in obs.events("pcie_bandwidth", "full"):
        full = _link(_one(g, "link"))
        if full is not None:
            peers[g.node][full][g.entity] = full
    for (node, ent), samples in _by_entity(obs, "gpu_pcie_link_width").items():
        bounds = {s.labels.get("bound", ""): int(s.value) for s in samples}
        if "current" in bounds and "max" in bounds:
            for cap_link, members in peers[node].items():
                if cap_link[1] == bounds["max"]:
                    members.setdefault(f"sample:{ent}", (0.0, bounds["current"]))
    for g, cur, cap in limited:
        others = [v for e, v in peers[g.node][cap].items() if e != g.entity]
        wider = [w for _s, w in others]
        faster = [s for s, _w in others if s > 0]
        below_width = cur[1] < cap[1]
        peers_wider = bool(wider) and cur[1] < statistics.median(wider)
        peers_faster = bool(faster) and cur[0] < statistics.median(faster)
        what = (
            f"{g.entity}: PCIe link limited to {cur[0]:g} GT/s x{cur[1]} "
            f"of {cap[0]:g} GT/s x{cap[1]}"
        )
        at = _one(g, "limited_at")
        where = f" (limited at {at})" if at else ""
        if below_width and peers_wider:
            severity, action = Severity.MAJOR, Action.SERVICE_HARDWARE
            summary = (
                f"{what}{where} while its peers run x{max(wider)}: downgraded link, "
                "not a platform limit"
            )
        elif below_width:
            severity, action = Severity.WARNING, Action.SERVICE_HARDWARE
            summary = f"{what}{where}: link width below capability (a link does not narrow at idle)"
        elif peers_faster:
            severity, action = Severity.INFO, Action.NONE
            summary = (
                f"{what}{where} while its peers run {max(faster):g} GT/s: not a platform "
                "limit; GPUs lower link speed at idle, check it under load"
            )
        else:
            continue  # limited like its peers: the host rule's platform-limit info
        yield _finding(
            node=g.node,
            entity=g.entity,
            kind="pcie",
            code="bandwidth_limited",
            severity=severity,
            action=action,
            summary=summary,
            evidence=g.evidence,
            source=source,
            first=g.first_seen_at,
            last=g.last_seen_at,
        )


def _busy(obs: Observations, node: str, entity: str) -> bool:
    """True when the GPU is known to be working (utilization > 10 %, or not idle)."""
    util = _sample(obs, node, entity, "gpu_utilization_ratio")
    if util is not None:
        return util.value > 0.1
    for (n, e, _m, labels), sample in obs.by_metric.get("gpu_clock_event_active", {}).items():
        if (n, e) == (node, entity) and (
            "reason",
            "gpu_idle",
        ) in labels:
            return sample.value < 1
    return False


# ---------------------------------------------------------------------------- ERR!


def err_field_rule(obs: Observations, ctx: Context) -> Iterator[Finding]:
    """Judge ``ERR!`` readings in ``nvidia-smi`` (fault-model.md, "Context decides").

    A whole row of ``ERR!``: NVML cannot query the GPU at all, GPU lost: critical,
    ``reboot_node``. A single ``ERR!`` field: info, ``none``; warning when it
    repeats across snapshots or comes with an Xid or a recovery action other than
    None on the same GPU.
    """
    del ctx
    source = "gpu.err_field_rule (fault-model.md: ERR! readings; nvidia-smi man page)"
    for group in obs.events("nvidia_smi_err"):
        node, entity = group.node, group.entity
        if group.code == "row":
            yield _finding(
                node=node,
                entity=entity,
                kind="gpu_lost",
                code="nvidia_smi_err_row",
                severity=Severity.CRITICAL,
                action=Action.REBOOT_NODE,
                summary=f"{_gpu_name(entity)}: every nvidia-smi field reads ERR!: NVML cannot "
                "reach the GPU (GPU lost): reboot the node; hardware service if it recurs",
                evidence=group.evidence,
                source=source,
                first=group.first_seen_at,
                last=group.last_seen_at,
                occurrences=group.count,
            )
            continue
        reasons = []
        if group.count > 1:
            reasons.append(f"seen {group.count} times")
        if obs.events("xid", node=node, entity=entity):
            reasons.append("with an Xid on the same GPU")
        action = _sample(obs, node, entity, "gpu_recovery_action")
        if action is not None and action.value > 0:
            reasons.append("with a recovery action other than None")
        severity = Severity.WARNING if reasons else Severity.INFO
        yield _finding(
            node=node,
            entity=entity,
            kind="nvidia_smi_err",
            code=group.code,
            severity=severity,
            action=Action.NONE,
            summary=f"{_gpu_name(entity)}: nvidia-smi could not read {group.code} (ERR!)"
            + (
                f", {', '.join(reasons)}: keep watching"
                if reasons
                else ": transient, keep watching"
            ),
            evidence=group.evidence,
            source=source,
            first=group.first_seen_at,
            last=group.last_seen_at,
            occurrences=group.count,
        )


RULES: tuple[Rule, ...] = (
    ecc_rule,
    row_remap_rule,
    repair_pending_rule,
    retired_pages_rule,
    recovery_action_rule,
    last_xid_rule,
    clock_event_rule,
    temperature_rule,
    nvlink_rule,
    dcgm_diag_rule,
    dcgm_health_rule,
    fabric_rule,
    pcie_link_rule,
    pcie_path_rule,
    err_field_rule,
)
"""The GPU-state rules, in evaluation order."""
