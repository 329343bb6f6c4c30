"""Artifact parsers for ``nvidia-smi`` output.

Kinds handled here:

* ``nvidia_smi_table``: the default ``nvidia-smi`` table (old and new layouts,
  any number of GPUs, truncated names, ``ERR!`` and ``N/A`` in any field).
* ``nvidia_smi_q``: ``nvidia-smi -q`` text, whole or pasted fragments.
* ``nvidia_smi_xml``: ``nvidia-smi -q -x`` XML, whole, truncated or fragments.
* ``nvidia_smi_csv``: ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]``
  (also ``--query-remapped-rows``); ``clocks_event_reasons.active`` bitmasks are split
  into reasons.
* ``nvidia_smi_nvlink``: ``nvidia-smi nvlink -s`` / ``--status`` and ``-e``.
* ``lspci``: ``lspci -vv`` link capability (``LnkCap``) and status (``LnkSta``)
  of NVIDIA (vendor 10de) GPUs.

Field meanings follow the NVML API reference (``nvmlDeviceGetTotalEccErrors``,
``nvmlDeviceGetMemoryErrorCounter``, ``nvmlDeviceGetRemappedRows``,
``nvmlDeviceGetRetiredPages*``, ``nvmlDeviceGetCurrentClocksEventReasons``,
field 230 ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``), NVIDIA's GPU memory error
management and dynamic page retirement documents, and the ``nvidia-smi`` man
page. Values are converted to base units (W, bytes, Hz, degrees C, ratio 0-1);
``N/A``, ``[N/A]`` and ``Not Supported`` fields are omitted; ``ERR!`` never
becomes a value but an ``nvidia_smi_err`` event. A field that reads an NVML error
naming the GPU's state becomes an event: ``[GPU is lost]`` a ``gpu_lost`` event
(code ``nvml_gpu_is_lost``), ``[GPU requires reset]`` a ``reset_required`` event
(code ``NV_ERR_RESET_REQUIRED``). ``fabric`` events (code the state, attrs
``status``, ``health_summary``...) come from ``-q``, ``-q -x`` and the CSV
``fabric.*`` fields; a health summary missing from the output is derived from the
``Health`` sub-fields (bandwidth, route recovery/unhealthy, access timeout).

Pastes are taken as they come: indented or quoted as a whole, CRLF, tabs, a table
followed directly by another kind's text (handed to that kind's parser), XML copied
from a web page (``&gt;``, ``&nbsp;``), ``nvidia-smi -L`` lines, a root prompt
(``# nvidia-smi --query-gpu=...``) before CSV.

Entities: the canonical PCI bus id when the output names it, else the GPU UUID,
else ``gpu:<index>``. A pasted ``-q`` fragment without its ``GPU 0000...`` header
(or an XML fragment without ``<gpu id=...>``) belongs to :data:`UNKNOWN_GPU`:
the GPU is real but unidentified, so no index is guessed.
"""

from __future__ import annotations

import html
import logging
import math
import re
import xml.parsers.expat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from collectors.artifact import MIN_SCORE, ArtifactParser, Line, ParseContext
from collectors.textparse import Session, line_evidence
from core.catalog import BY_NAME
from core.ids import gpu_index_entity, normalize_pci_bus_id
from core.records import EntityId, Event, NodeName, Record, Sample

logger = logging.getLogger(__name__)

UNKNOWN_GPU = EntityId("gpu:unknown")
"""Entity of a pasted fragment that does not say which GPU it describes."""

_MIB = 1024.0 * 1024.0
_MHZ = 1e6

_MISSING = {
    "n/a",
    "[n/a]",
    "not supported",
    "[not supported]",
    "notsupported",
    "unknown",
    "[unknown error]",
    "unknown error",
    "requested functionality has been deprecated",
    "insufficient permissions",
    "[insufficient permissions]",
    "",
    "-",
}

RECOVERY_ACTIONS: dict[str, int] = {
    "none": 0,
    "reset": 1,
    "gpu reset": 1,
    "gpu reset required": 1,
    "gpu_reset": 1,
    "node reboot": 2,
    "node reboot required": 2,
    "reboot": 2,
    "node_reboot": 2,
    "drain p2p": 3,
    "drain_p2p": 3,
    "drain and reset": 4,
    "drain_and_reset": 4,
    "drain and reset recommended": 4,
    "gpu_reset_required": 1,
    "reset required": 1,
    "reset_required": 1,
    "node reboot recommended": 2,
    "reboot required": 2,
    "reboot_required": 2,
    "drain p2p required": 3,
    "drain_and_reset_required": 4,
    "drain and reset required": 4,
    "recover imex domain": 5,
    "recover_imex_domain": 5,
}
"""``nvidia-smi`` recovery-action texts to NVML enum values (NVML API reference:
``NVML_GPU_RECOVERY_ACTION_NONE`` 0, ``_GPU_RESET`` 1, ``_NODE_REBOOT`` 2,
``_DRAIN_P2P`` 3, ``_DRAIN_AND_RESET`` 4)."""


def recovery_code(value: str) -> int | None:
    """Return the NVML recovery-action enum value of an ``nvidia-smi`` text, or ``None``.

    Accepts the texts of several driver versions, NVML enum names and the number.

    Examples:
        >>> recovery_code("Node Reboot Required")
        2
        >>> recovery_code("NVML_GPU_RECOVERY_ACTION_GPU_RESET")
        1
        >>> recovery_code("Drain and Reset"), recovery_code("0"), recovery_code("banana")
        (4, 0, None)
    """
    v = re.sub(r"^nvml_gpu_recovery_action_", "", value.strip().lower())
    v = re.sub(r"[\s_]+", " ", v).strip().rstrip(".")
    if v.isdigit():
        return int(v)
    code = RECOVERY_ACTIONS.get(v)
    if code is None:
        code = RECOVERY_ACTIONS.get(v.replace(" ", "_"))
    return code


CLOCK_REASONS: dict[str, str] = {
    "idle": "gpu_idle",
    "gpu_idle": "gpu_idle",
    "applications_clocks_setting": "clocks_setting",
    "user_defined_clocks": "clocks_setting",
    "sw_power_cap": "power_cap",
    "hw_slowdown": "hw_slowdown",
    "hw_thermal_slowdown": "hw_thermal",
    "hw_power_brake_slowdown": "hw_power_brake",
    "sync_boost": "sync_boost",
    "sw_thermal_slowdown": "sw_thermal",
    "display_clock_setting": "display_clocks",
    "display_clocks_setting": "display_clocks",
}
"""Clock event (throttle) reason names, text and XML, to dcgm-exporter label values
(ecosystem-reference §1.4; same bits under the deprecated "throttle" names)."""

CLOCK_EVENT_BITS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "clocks_setting",
    0x004: "power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal",
    0x040: "hw_thermal",
    0x080: "hw_power_brake",
    0x100: "display_clocks",
}
"""NVML ``nvmlClocksEventReason*`` bits (ecosystem-reference §1.4) to reason labels, for
``clocks_event_reasons.active`` (``0x0000000000000004``) and DCGM bitmask fields."""


def _bitmask(value: str) -> int | None:
    """Parse a bitmask printed as hex (``0x...``) or decimal; ``None`` otherwise.

    Examples:
        >>> _bitmask("0x0000000000000088"), _bitmask("4"), _bitmask("[N/A]")
        (136, 4, None)
    """
    v = value.strip().lower()
    try:
        if v.startswith("0x"):
            return int(v, 16)
        if v.isdigit():
            return int(v)
    except ValueError:
        return None
    return None


_ECC_LOCATIONS: dict[str, str] = {
    "device_memory": "dram",
    "dram": "dram",
    "sram": "sram",
    "register_file": "register_file",
    "l1_cache": "l1_cache",
    "l2_cache": "l2_cache",
    "texture_memory": "texture_memory",
    "texture_shm": "texture_shm",
    "texture_shared": "texture_shm",
    "cbu": "cbu",
    "total": "total",
}


# --------------------------------------------------------------------------- helpers


def is_missing(value: str) -> bool:
    """Return True for values that mean "no reading" (``N/A``, ``Not Supported``...).

    Examples:
        >>> is_missing("[N/A]"), is_missing("Not Supported"), is_missing("0")
        (True, True, False)
    """
    return value.strip().lower() in _MISSING


def is_err(value: str) -> bool:
    """Return True for ``nvidia-smi``'s ``ERR!`` reading (a failed NVML query)."""
    return value.strip().upper().startswith("ERR!")


_NUM = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)\s*([A-Za-z%/()]*(?:/s)?)\s*$")


def number(value: str) -> tuple[float, str] | None:
    """Return ``(number, unit)`` of a reading such as ``71W``, ``4 MiB``, ``16x``.

    Examples:
        >>> number("250.00 W")
        (250.0, 'W')
        >>> number("N/A") is None
        True
    """
    if is_missing(value) or is_err(value):
        return None
    match = _NUM.match(value)
    if match is None:
        return None
    result = float(match[1])
    if not math.isfinite(result):
        return None
    return result, match[2]


def to_base(value: float, unit: str) -> float:
    """Convert a reading to base units: MiB/GiB/KiB to bytes, MHz/GHz to Hz, % to ratio, mW to W.

    Examples:
        >>> to_base(4, "MiB")
        4194304.0
        >>> to_base(93, "%")
        0.93
    """
    u = unit.strip().lower()
    factors = {
        "mib": _MIB,
        "gib": _MIB * 1024.0,
        "kib": 1024.0,
        "mhz": _MHZ,
        "ghz": 1e9,
        "%": 0.01,
        "mw": 1e-3,
    }
    return float(value) * factors.get(u, 1.0)


def yes_no(value: str) -> float | None:
    """Return 1.0/0.0 for Yes/No, Active/Not Active, True/False; ``None`` otherwise."""
    v = value.strip().lower()
    if v in {"yes", "active", "true", "enabled", "1"}:
        return 1.0
    if v in {"no", "not active", "false", "disabled", "0", "inactive"}:
        return 0.0
    return None


def norm_key(text: str) -> str:
    """Normalise a field name: lower case, runs of non-alphanumerics to ``_``.

    Examples:
        >>> norm_key("SRAM Uncorrectable SEC-DED")
        'sram_uncorrectable_sec_ded'
    """
    return re.sub(r"[^a-z0-9]+", "_", text.strip().lower()).strip("_")


def gpu_entity(
    *, bus_id: str | None = None, uuid: str | None = None, index: str | int | None = None
) -> EntityId | None:
    """Return a GPU's entity id: PCI bus id, else UUID, else ``gpu:<index>``.

    Examples:
        >>> gpu_entity(bus_id="00000000:1A:00.0", index=0)
        '0000:1a:00.0'
        >>> gpu_entity(uuid="GPU-0a1b", index=3)
        'GPU-0a1b'
        >>> gpu_entity(index="3")
        'gpu:3'
    """
    if bus_id:
        canonical = normalize_pci_bus_id(bus_id)
        if canonical is not None:
            return EntityId(canonical)
    if uuid and re.match(r"^(?:GPU|MIG)-[0-9a-fA-F]", uuid.strip()):
        return EntityId(uuid.strip())
    if index is not None and str(index).strip().isdigit():
        return EntityId(gpu_index_entity(int(str(index).strip())))
    return None


def make_sample(
    ctx: ParseContext,
    metric: str,
    value: float,
    entity: EntityId,
    line: Line | None,
    labels: Mapping[str, str] | None = None,
    *,
    node: NodeName | None = None,
) -> Sample | None:
    """Return a catalogued Sample, or ``None`` for a non-finite value or an unknown name."""
    if metric not in BY_NAME:
        logger.warning("not a catalogued metric: %s", metric)
        return None
    if not math.isfinite(value):
        return None
    return Sample(
        metric=metric,
        value=float(value),
        observed_at=None,
        node=node or ctx.node,
        entity=entity,
        labels=dict(labels or {}),
        evidence=line_evidence(ctx, line) if line is not None else None,
    )


def err_event(
    ctx: ParseContext, entity: EntityId, field_name: str, lines: Sequence[Line], source: str
) -> Event:
    """Return the event for an ``ERR!`` reading of ``field_name`` (never a value)."""
    return Event(
        kind="nvidia_smi_err",
        code=field_name,
        node=ctx.node,
        entity=entity,
        observed_at=None,
        message=f"nvidia-smi could not read {field_name} (ERR!)",
        attrs={"field": field_name},
        evidence=tuple(line_evidence(ctx, line) for line in lines),
        source=source,
    )


_NVML_LOST = re.compile(r"^\[?\s*GPU (?:is lost|has fallen off the bus)\s*\]?\.?$", re.I)
_NVML_RESET = re.compile(r"^\[?\s*GPU (?:requires|needs) (?:a )?reset\s*\]?\.?$", re.I)


def nvml_error_event(
    ctx: ParseContext,
    entity: EntityId,
    field_name: str,
    value: str,
    lines: Sequence[Line],
    source: str,
) -> Event | None:
    """Return the event for a field that reads an NVML error naming the GPU's state.

    ``nvidia-smi`` prints the NVML error string in place of a value:
    ``[GPU is lost]`` (``NVML_ERROR_GPU_IS_LOST``: a ``gpu_lost`` event) and
    ``[GPU requires reset]`` (``NVML_ERROR_RESET_REQUIRED``: a ``reset_required``
    event). Other errors (``[Unknown Error]``, ``[N/A]``) are not GPU states.

    Examples:
        >>> ctx = ParseContext(file="f", node=NodeName("n"))
        >>> line = Line(1, "1, [GPU is lost]")
        >>> nvml_error_event(ctx, EntityId("gpu:1"), "temp", "[GPU is lost]", [line], "t").kind
        'gpu_lost'
        >>> nvml_error_event(ctx, EntityId("gpu:1"), "temp", "[Unknown Error]", [line], "t") is None
        True
    """
    v = value.strip()
    if _NVML_LOST.match(v):
        kind, code = "gpu_lost", "nvml_gpu_is_lost"
        message = f"nvidia-smi reads {field_name} as {v}: NVML_ERROR_GPU_IS_LOST"
    elif _NVML_RESET.match(v):
        kind, code = "reset_required", "NV_ERR_RESET_REQUIRED"
        message = f"nvidia-smi reads {field_name} as {v}: NVML_ERROR_RESET_REQUIRED"
    else:
        return None
    return Event(
        kind=kind,
        code=code,
        node=ctx.node,
        entity=entity,
        observed_at=None,
        message=message,
        attrs={"field": field_name, "message": message},
        evidence=tuple(line_evidence(ctx, line) for line in lines),
        source=source,
    )


# ------------------------------------------------------------- -q / -q -x field mapping


_FABRIC_HEALTH_FIELDS: dict[str, tuple[str, ...]] = {
    "bandwidth": ("degraded",),
    "route_recovery_in_progress": ("true", "yes"),
    "route_unhealthy": ("true", "yes"),
    "access_timeout_recovery": ("true", "yes"),
    "incorrect_configuration": (),
}
"""Sub-fields of ``Fabric / Health`` (NVML ``nvmlGpuFabricInfo_v3`` health mask:
``NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW``, ``_ROUTE_RECOVERY``, ``_ROUTE_UNHEALTHY``,
``_ACCESS_TIMEOUT_RECOVERY``, ``_INCORRECT_CONFIGURATION``) and the values that mean
"not healthy"; ``incorrect_configuration`` is unhealthy unless it reads None/No."""


def _fabric_health(attrs: Mapping[str, str]) -> str | None:
    """Derive the fabric health summary from its sub-fields when no Summary line is given.

    Examples:
        >>> _fabric_health({"health_bandwidth": "Degraded", "health_route_unhealthy": "False"})
        'Unhealthy (bandwidth Degraded)'
        >>> _fabric_health({"health_bandwidth": "Full"})
        'Healthy'
        >>> _fabric_health({}) is None
        True
    """
    seen = False
    bad: list[str] = []
    for name, unhealthy in _FABRIC_HEALTH_FIELDS.items():
        value = attrs.get(f"health_{name}")
        if value is None or is_missing(value):
            continue
        seen = True
        v = value.strip().lower()
        if name == "incorrect_configuration":
            if v not in {"none", "no", "false", "0"}:
                bad.append(f"incorrect configuration {value}")
        elif v in unhealthy:
            bad.append(f"{name.replace('_', ' ')} {value}")
    if not seen:
        return None
    return f"Unhealthy ({', '.join(bad)})" if bad else "Healthy"


@dataclass(slots=True)
class _GpuState:
    """What one GPU section of ``-q`` / ``-q -x`` said, for the records built at its end."""

    entity: EntityId
    header: Line | None = None
    info: dict[str, str] = field(default_factory=dict)
    fabric: dict[str, tuple[str, Line]] = field(default_factory=dict)
    recovery_explicit: bool = False
    reset_flags: dict[str, Line] = field(default_factory=dict)
    power_seen: bool = False
    nvml_state: bool = False


_SKIP_SECTIONS = {
    "mig_device",
    "mig_devices",
    "processes",
    "process_info",
    "supported_clocks",
    "clocks_event_reasons_counters",
    "clocks_throttle_reasons_counters",
    "clock_event_reasons_counters",
    "aggregate_uncorrectable_sram_sources",
    "accounted_processes",
    "encoder_stats",
    "fbc_stats",
    "module_power_readings",
    "gpu_memory_power_readings",
    "max_clocks",
    "max_customer_boost_clocks",
    "applications_clocks",
    "default_applications_clocks",
    "deferred_clocks",
    "capabilities",
}


class _FieldMapper:
    """Turn ``-q`` / ``-q -x`` leaves (normalised path, raw value) into records.

    Text and XML name most fields alike once normalised (``ecc_errors/volatile/
    sram_uncorrectable``); the remaining differences are aliases below.
    """

    def __init__(self, ctx: ParseContext, source: str) -> None:
        self.ctx = ctx
        self.source = source
        self.gpu: _GpuState | None = None
        self.driver_version: str | None = None

    def start_gpu(self, entity: EntityId, header: Line | None) -> list[Record]:
        out = self.finish_gpu()
        self.gpu = _GpuState(entity=entity, header=header)
        return out

    def _state(self) -> _GpuState:
        if self.gpu is None:
            self.gpu = _GpuState(entity=UNKNOWN_GPU)
        return self.gpu

    def leaf(self, path: Sequence[str], raw: str, line: Line) -> list[Record]:
        """Map one leaf; ``path`` ends with the field's own normalised name."""
        path = tuple(path)
        if not path:
            return []
        if any(p in _SKIP_SECTIONS for p in path[:-1]):
            return []
        key = path[-1]
        value = raw.strip()
        if len(path) == 1 and key == "driver_version":
            self.driver_version = value
            return []
        if len(path) == 1 and key in {
            "timestamp",
            "cuda_version",
            "attached_gpus",
            "driver_version",
        }:
            return []
        gpu = self._state()
        entity = gpu.entity
        if is_err(value):
            return [err_event(self.ctx, entity, key, [line], self.source)]
        state_event = nvml_error_event(self.ctx, entity, key, value, [line], self.source)
        if state_event is not None:
            if gpu.nvml_state:
                return []
            gpu.nvml_state = True
            return [state_event]
        if path[-2:-1] == ("fabric",) or (len(path) >= 2 and "fabric" in path[:-1]):
            if key in {
                "state",
                "status",
                "cliqueid",
                "clique_id",
                "clusteruuid",
                "cluster_uuid",
            } or (key == "summary" and "health" in path):
                name = {"cliqueid": "clique_id", "clusteruuid": "cluster_uuid"}.get(key, key)
                if name == "summary":
                    name = "health_summary"
                gpu.fabric[name] = (value, line)
            elif "health" in path[:-1] and key in _FABRIC_HEALTH_FIELDS:
                gpu.fabric[f"health_{key}"] = (value, line)
            return []
        if is_missing(value):
            return []
        out: list[Record] = []

        def add(metric: str, val: float, labels: Mapping[str, str] | None = None) -> None:
            s = make_sample(self.ctx, metric, val, entity, line, labels)
            if s is not None:
                out.append(s)

        sections = set(path[:-1])
        # identity
        if key in {"product_name", "gpu_uuid", "uuid", "serial_number", "serial", "vbios_version"}:
            gpu.info[
                {"gpu_uuid": "uuid", "serial_number": "serial", "product_name": "model"}.get(
                    key, key
                )
            ] = value
            return out
        if key in {"bus_id", "pci_bus_id"} and "pci" in sections:
            gpu.info["pci_bus_id"] = value
            return out
        # memory repair (Blackwell, R575+): channel or TPC repair applied at the next reset
        if key in {"channel_repair_pending", "tpc_repair_pending"}:
            flag = yes_no(value)
            if flag is not None:
                # the repair, like a row remap, waits for a GPU reset
                add("gpu_row_remap_pending", flag, {"repair": key.split("_")[0]})
            return out
        # ECC
        if "ecc_errors" in sections:
            return self._ecc(path, key, value, add, out)
        if key == "sram_threshold_exceeded":
            flag = yes_no(value)
            if flag is not None:
                add("gpu_sram_threshold_exceeded", flag)
            return out
        # retired pages
        if "retired_pages" in sections:
            if key == "retired_count":
                cause = "dbe" if "double_bit_retirement" in sections else "multiple_sbe"
                parsed = number(value)
                if parsed:
                    add("gpu_retired_pages", parsed[0], {"cause": cause})
            elif key in {"single_bit_ecc", "double_bit_ecc"}:
                parsed = number(value)
                if parsed:
                    cause = "dbe" if key == "double_bit_ecc" else "multiple_sbe"
                    add("gpu_retired_pages", parsed[0], {"cause": cause})
            elif key in {
                "pending_page_blacklist",
                "pending_blacklist",
                "pending",
                "pending_retirement",
                "pending_page_retirement",
                "pending_page_retirements",
            }:
                flag = yes_no(value)
                if flag is not None:
                    add("gpu_retired_pages_pending", flag)
            return out
        # row remapping
        if (
            "remapped_rows" in sections
            or key.startswith("remapped_row")
            or key.startswith("row_remap")
        ):
            return self._remap(key, value, add, out)
        # clock event reasons
        reason_sections = {
            "clocks_event_reasons",
            "clocks_throttle_reasons",
            "clock_throttle_reasons",
            "clock_event_reasons",
        }
        if sections & reason_sections:
            name = re.sub(r"^clocks?_(?:event|throttle)_reasons?_", "", key)
            reason = CLOCK_REASONS.get(name)
            flag = yes_no(value)
            if reason is not None and flag is not None:
                add("gpu_clock_event_active", flag, {"reason": reason})
            return out
        # recovery action
        if key == "gpu_recovery_action":
            code = recovery_code(value)
            if code is None:
                self._unknown(line, f"unknown GPU recovery action {value!r}")
                return out
            gpu.recovery_explicit = True
            add("gpu_recovery_action", code)
            return out
        if key in {"reset_required", "drain_and_reset_recommended"}:
            if yes_no(value) == 1.0:
                gpu.reset_flags[key] = line
            return out
        # PCIe link
        if sections & {"pcie_generation", "pcie_gen"}:
            bound = {
                "max": "max",
                "max_link_gen": "max",
                "current": "current",
                "current_link_gen": "current",
                "device_current": "device_current",
                "device_current_link_gen": "device_current",
                "device_max": "device_max",
                "max_device_link_gen": "device_max",
                "host_max": "host_max",
                "max_host_link_gen": "host_max",
            }.get(key)
            parsed = number(value)
            if bound and parsed:
                add("gpu_pcie_link_generation", parsed[0], {"bound": bound})
            return out
        if sections & {"link_width", "link_widths"}:
            bound = {
                "max": "max",
                "max_link_width": "max",
                "current": "current",
                "current_link_width": "current",
            }.get(key)
            parsed = number(value)
            if bound and parsed:
                add("gpu_pcie_link_width", parsed[0], {"bound": bound})
            return out
        if key in {"replays_since_reset", "replay_counter"}:
            parsed = number(value)
            if parsed:
                add("gpu_pcie_replays_total", parsed[0])
            return out
        # temperature
        if "temperature" in sections:
            parsed = number(value)
            if parsed and key in {"gpu_current_temp", "gpu_temp"}:
                add("gpu_temperature_celsius", parsed[0])
            elif parsed and key in {"memory_current_temp", "memory_temp"}:
                add("gpu_memory_temperature_celsius", parsed[0])
            return out
        # power
        if sections & {"gpu_power_readings", "power_readings"}:
            parsed = number(value)
            if parsed is None:
                return out
            watts = to_base(*parsed)
            if key in {"power_draw", "average_power_draw"}:
                gpu.power_seen = True
                add("gpu_power_watts", watts)
            elif key in {"instantaneous_power_draw", "instant_power_draw"} and not gpu.power_seen:
                add("gpu_power_watts", watts)
            elif key in {"current_power_limit", "enforced_power_limit", "power_limit"}:
                add("gpu_power_limit_watts", watts)
            return out
        if sections & {"fb_memory_usage"}:
            parsed = number(value)
            if parsed and key in {"used", "total"}:
                add(f"gpu_memory_{key}_bytes", to_base(parsed[0], parsed[1] or "MiB"))
            return out
        if "utilization" in sections:
            parsed = number(value)
            if parsed and key in {"gpu", "gpu_util"}:
                add("gpu_utilization_ratio", parsed[0] / 100.0)
            elif parsed and key in {"memory", "memory_util"}:
                add("gpu_memory_utilization_ratio", parsed[0] / 100.0)
            return out
        if path[-2:-1] == ("clocks",):
            parsed = number(value)
            if parsed and key in {"sm", "sm_clock"}:
                add("gpu_sm_clock_hertz", to_base(parsed[0], parsed[1] or "MHz"))
            elif parsed and key in {"memory", "mem_clock"}:
                add("gpu_memory_clock_hertz", to_base(parsed[0], parsed[1] or "MHz"))
            return out
        if key == "fan_speed" and len(path) <= 2:
            parsed = number(value)
            if parsed:
                add("gpu_fan_speed_ratio", parsed[0] / 100.0)
            return out
        return out

    def _unknown(self, line: Line, reason: str) -> None:
        logger.info("%s:%d: %s", self.ctx.file, line.number, reason)

    def _ecc(
        self,
        path: Sequence[str],
        key: str,
        value: str,
        add: _Adder,
        out: list[Record],
    ) -> list[Record]:
        sections = set(path[:-1])
        if key == "sram_threshold_exceeded":
            flag = yes_no(value)
            if flag is not None:
                add("gpu_sram_threshold_exceeded", flag)
            return out
        scope = (
            "aggregate"
            if "aggregate" in sections
            else "volatile"
            if "volatile" in sections
            else None
        )
        if scope is None:
            return out
        parsed = number(value)
        if parsed is None:
            return out
        if "single_bit" in sections or "double_bit" in sections:
            kind = "uncorrected" if "double_bit" in sections else "corrected"
            location = _ECC_LOCATIONS.get(key)
        else:
            match = re.match(r"^(sram|dram)_(correctable|uncorrectable)(?:_(.*))?$", key)
            if match is None:
                return out
            kind = "corrected" if match[2] == "correctable" else "uncorrected"
            sub = (match[3] or "").replace("sec_ded", "secded")
            location = match[1] if not sub else f"{match[1]}_{sub}"
        if location is None:
            return out
        add(
            "gpu_ecc_errors_total",
            parsed[0],
            {"type": kind, "scope": scope, "location": location},
        )
        return out

    def _remap(self, key: str, value: str, add: _Adder, out: list[Record]) -> list[Record]:
        hist = re.sub(r"^row_remap(?:per)?_histogram_", "", key)
        if key in {"correctable_error", "remapped_row_corr"}:
            parsed = number(value)
            if parsed:
                add("gpu_remapped_rows", parsed[0], {"type": "correctable"})
        elif key in {"uncorrectable_error", "remapped_row_unc"}:
            parsed = number(value)
            if parsed:
                add("gpu_remapped_rows", parsed[0], {"type": "uncorrectable"})
        elif key in {"pending", "remapped_row_pending"}:
            flag = yes_no(value)
            if flag is not None:
                add("gpu_row_remap_pending", flag)
        elif key in {"remapping_failure_occurred", "remapped_row_failure"}:
            flag = yes_no(value)
            if flag is not None:
                add("gpu_row_remap_failure", flag)
        elif hist in {"max", "high", "partial", "low", "none"}:
            parsed = number(value)
            if parsed:
                add("gpu_row_remap_bank_availability", parsed[0], {"availability": hist})
        return out

    def finish_gpu(self) -> list[Record]:
        """Return the records of the GPU section that ends: identity, fabric, reset flags."""
        gpu, self.gpu = self.gpu, None
        if gpu is None:
            return []
        out: list[Record] = []
        ctx = self.ctx
        if gpu.info:
            labels = dict(gpu.info)
            if self.driver_version:
                labels["driver_version"] = self.driver_version
            s = make_sample(ctx, "gpu_info", 1.0, gpu.entity, gpu.header, labels)
            if s is not None:
                out.append(s)
        state = gpu.fabric.get("state")
        if state is not None and not is_missing(state[0]):
            attrs = {k: v for k, (v, _l) in gpu.fabric.items() if k != "state"}
            if "health_summary" not in attrs:
                derived = _fabric_health(attrs)
                if derived is not None:
                    attrs["health_summary"] = derived
            lines = [ln for _v, ln in gpu.fabric.values()]
            out.append(
                Event(
                    kind="fabric",
                    code=norm_key(state[0]),
                    node=ctx.node,
                    entity=gpu.entity,
                    observed_at=None,
                    message=f"NVLink fabric state {state[0]}, status "
                    f"{attrs.get('status', 'N/A')}, health {attrs.get('health_summary', 'N/A')}",
                    attrs=attrs,
                    evidence=tuple(line_evidence(ctx, ln) for ln in lines),
                    source=self.source,
                )
            )
        if not gpu.recovery_explicit and gpu.reset_flags:
            code = 4 if "drain_and_reset_recommended" in gpu.reset_flags else 1
            line = (
                gpu.reset_flags.get("drain_and_reset_recommended")
                or gpu.reset_flags["reset_required"]
            )
            s = make_sample(ctx, "gpu_recovery_action", code, gpu.entity, line)
            if s is not None:
                out.append(s)
        return out


class _Adder(Protocol):
    """Callable type of the ``add`` closures (for mypy)."""

    def __call__(self, metric: str, val: float, labels: Mapping[str, str] | None = None) -> None:
        """Add one sample."""
        ...


# ----------------------------------------------------------------------------- -q text

_Q_KEYS = re.compile(
    r"^\s*(?:Product Name|Driver Version|Attached GPUs|ECC Errors|Retired Pages|Remapped Rows|"
    r"Clocks (?:Event|Throttle) Reasons|GPU Recovery Action|Pending Page Blacklist|"
    r"Remapping Failure Occurred|SRAM (?:Unc|C)orrectable|DRAM (?:Unc|C)orrectable|"
    r"Single Bit ECC|Double Bit ECC|SW Power Cap|HW Slowdown|HW Thermal Slowdown|"
    r"PCIe Generation|Link Width|Fabric|Bank Remap Availability Histogram|GPU UUID|"
    r"Performance State|FB Memory Usage|Persistence Mode|Volatile|Aggregate|"
    r"Correctable Error|Uncorrectable Error|Pending|Temperature|GPU Current Temp|"
    r"Power Draw|Reset Required|Drain and Reset Recommended|Minor Number|Bus Id|"
    r"Device Memory|Register File|Texture Memory|Idle|Sync Boost)\b"
)
_Q_LINE = re.compile(r"^(?P<indent>[ \t]*)(?P<key>[^:\s][^:]*?)\s*:\s?(?P<value>.*)$")
_Q_SECTION = re.compile(r"^(?P<indent>[ \t]*)(?P<key>[A-Za-z][\w .()/+-]*?)\s*$")
_Q_GPU = re.compile(r"^GPU\s+(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_NVSMI_LOG = re.compile(r"^=+\s*NVSMI LOG\s*=+\s*$")


def _indent(text: str) -> int:
    return len(text.expandtabs(4)) - len(text.expandtabs(4).lstrip(" "))


class NvidiaSmiQParser:
    """Parse ``nvidia-smi -q`` text.

    Reads identity, ECC, retired pages, remapped rows, clock events, recovery
    action, PCIe link, fabric, temperatures and power. Follows the
    ``nvidia-smi`` man page field list and the NVML API reference for the
    meaning of each field (see the module docstring).
    """

    kind = "nvidia_smi_q"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score ``-q`` text: ``key : value`` lines with ``-q`` field names, indented sections."""
        if not lines:
            return 0
        known = 0
        kv = 0
        bad = 0
        for line in _unquote(lines[:200]):
            text = line.text
            if _NVSMI_LOG.match(text) or _Q_GPU.match(text.strip()):
                known += 3
                continue
            if text.lstrip().startswith(("<", "|", "{", "[", "#")):
                bad += 1
                continue
            if _Q_KEYS.match(text):
                known += 1
            if _Q_LINE.match(text) or _Q_SECTION.match(text):
                kv += 1
            else:
                bad += 1
        if known == 0:
            return 0
        score = min(90, 30 + 10 * known)
        if command and "nvidia-smi" in command and "-q" in command and "-x" not in command:
            score = max(score, 80)
        if bad > kv:
            score //= 3
        return score

    def open(self, ctx: ParseContext) -> _QSession:
        """Start parsing a ``-q`` section."""
        return _QSession(ctx)


class _QSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.mapper = _FieldMapper(ctx, "nvidia_smi_q")
        self.stack: list[tuple[int, str]] = []

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        out: list[Record] = []
        for line in _unquote(lines):
            try:
                out.extend(self._line(line))
            except Exception as exc:
                logger.debug("cannot parse line %d: %s", line.number, exc)
                self.issue(line.number, f"cannot parse nvidia-smi -q line: {exc}")
        return out

    def _line(self, line: Line) -> list[Record]:
        text = line.text.rstrip()
        if not text.strip() or _NVSMI_LOG.match(text.strip()) or text.lstrip().startswith("```"):
            return []  # blank, the banner, or a markdown fence around the paste
        gpu = _Q_GPU.match(text.strip())
        if gpu:  # at any indent: pastes quoted or indented as a whole keep their GPUs apart
            self.stack = []
            entity = gpu_entity(bus_id=gpu["bus"]) or UNKNOWN_GPU
            return self.mapper.start_gpu(entity, line)
        indent = _indent(text)
        while self.stack and self.stack[-1][0] >= indent:
            self.stack.pop()
        match = _Q_LINE.match(text)
        if match is not None:
            key = norm_key(match["key"])
            path = [name for _i, name in self.stack] + [key]
            return self.mapper.leaf(path, match["value"], line)
        section = _Q_SECTION.match(text)
        if section is not None:
            self.stack.append((indent, norm_key(section["key"])))
            return []
        self.issue(line.number, f"not a nvidia-smi -q line: {text.strip()[:80]!r}")
        return []

    def close(self) -> list[Record]:
        return self.mapper.finish_gpu()


# ---------------------------------------------------------------------------- -q -x XML

_XML_DECL = re.compile(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>")
_HTML_ESCAPED = re.compile(r"&(?:gt|lt|nbsp|#160|#xa0);", re.I)


def _xml_text(text: str) -> str:
    """Undo the HTML escaping of XML copied from a web page (``<gpu&gt;``, ``&nbsp;``).

    ``nvidia-smi`` never writes ``&nbsp;`` and does not escape ``>`` in its tags, so
    a line holding these was escaped on its way to the paste; other lines are kept.

    Examples:
        >>> _xml_text("&nbsp; &nbsp; <remapped_row_pending&gt;Yes</remapped_row_pending&gt;")
        '    <remapped_row_pending>Yes</remapped_row_pending>'
        >>> _xml_text("<pending_blacklist>No</pending_blacklist>")
        '<pending_blacklist>No</pending_blacklist>'
    """
    if "&" not in text or not _HTML_ESCAPED.search(text):
        return text
    return html.unescape(text).replace("\xa0", " ")


class NvidiaSmiXmlParser:
    """``nvidia-smi -q -x`` XML (``nvsmi_device_v*.dtd``), whole or pasted fragments.

    The document is parsed with the standard library's expat parser (the one
    ``xml.etree`` uses), which gives line numbers for evidence. Elements read up to
    a syntax error are kept; the error itself becomes a :class:`ParseIssue` naming
    the line, never an alarm. A fragment without its root is parsed wrapped in one.
    """

    kind = "nvidia_smi_xml"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score XML whose tags are ``nvidia-smi -q -x`` element names."""
        tags = 0
        for line in lines[:100]:
            text = _xml_text(line.text).strip()
            if text.startswith("<nvidia_smi_log") or "nvsmi_device" in text:
                return 95
            if re.match(
                r"^</?(?:gpu|ecc_errors|ecc_mode|retired_pages|remapped_rows|volatile|aggregate|"
                r"single_bit|double_bit|device_memory|clocks_(?:event|throttle)_reasons|"
                r"product_name|pci|temperature|gpu_power_readings|fb_memory_usage|fabric|"
                r"current_ecc|pending_ecc|sram_\w+|dram_\w+|gpu_recovery_action|"
                r"remapped_row_\w+)[\s>/]",
                text,
            ):
                tags += 1
        if tags == 0:
            return 0
        score = min(90, 40 + 10 * tags)
        if command and "-x" in command:
            score = max(score, 85)
        return score

    def open(self, ctx: ParseContext) -> _XmlSession:
        """Start parsing an XML section."""
        return _XmlSession(ctx)


class _XmlSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.lines: list[Line] = []
        self.unread_lines = 0  # collectors.artifact.UnreadLines
        self._complete = 0  # elements read to their end tag

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        self.lines.extend(lines)
        return []

    def close(self) -> list[Record]:
        if not self.lines:
            return []
        body = "\n".join(_XML_DECL.sub("", _xml_text(ln.text)) for ln in self.lines)
        has_root = bool(re.search(r"^\s*<nvidia_smi_log\b", body))
        if has_root:
            records, error = self._parse(body, offset=0)
        else:
            records, error = self._parse("<fragment>" + body + "</fragment>", offset=0)
        if error is not None and not self._complete:
            # cut (or broken) before its first complete element: nothing in it was read,
            # which is not a document without findings
            line_index, reason = error
            self.unread_lines = len(self.lines)
            self.issue(self._line_number(line_index),
                       "nvidia-smi XML unreadable: it ends or breaks before its first "
                       f"complete element ({reason})")
        elif error is not None:
            line_index, reason = error
            number = self._line_number(line_index)
            if line_index >= len(self.lines):
                where = "truncated (the document ends inside an element)"
            else:
                where = "not well-formed"
            self.issue(number, f"nvidia-smi XML {where}: {reason}")
        return records

    def _line_number(self, index: int) -> int | None:
        if not self.lines:
            return None
        index = max(1, min(index, len(self.lines)))
        return self.lines[index - 1].number

    def _parse(self, text: str, offset: int) -> tuple[list[Record], tuple[int, str] | None]:
        mapper = _FieldMapper(self.ctx, "nvidia_smi_xml")
        out: list[Record] = []
        stack: list[str] = []
        texts: list[list[str]] = []
        parser = xml.parsers.expat.ParserCreate()

        def start(name: str, attrs: dict[str, str]) -> None:
            norm = norm_key(name)
            if norm == "gpu" and "id" in attrs:
                entity = gpu_entity(bus_id=attrs["id"]) or UNKNOWN_GPU
                out.extend(mapper.start_gpu(entity, self._line_at(parser.CurrentLineNumber)))
            stack.append(norm)
            texts.append([])

        def end(name: str) -> None:
            if name != "fragment":
                self._complete += 1
            content = "".join(texts.pop()) if texts else ""
            path = [p for p in stack if p not in {"fragment", "nvidia_smi_log", "gpu"}]
            leaf_name = stack[-1] if stack else ""
            stack.pop()
            if leaf_name == "gpu":
                out.extend(mapper.finish_gpu())
                return
            if content.strip() and path:
                line = self._line_at(parser.CurrentLineNumber)
                if line is not None:
                    out.extend(mapper.leaf(path, content, line))

        def chars(data: str) -> None:
            if texts:
                texts[-1].append(data)

        parser.StartElementHandler = start
        parser.EndElementHandler = end
        parser.CharacterDataHandler = chars
        error: tuple[int, str] | None = None
        try:
            parser.Parse(text, True)
        except xml.parsers.expat.ExpatError as exc:
            error = (int(exc.lineno) + offset, xml.parsers.expat.ErrorString(exc.code) or str(exc))
        except Exception as exc:  # a bad value must not crash the parse: report it
            logger.debug("nvidia-smi XML handler failed: %s", exc)
            error = (int(parser.CurrentLineNumber) + offset, f"cannot read element: {exc}")
        out.extend(mapper.finish_gpu())
        return out, error

    def _line_at(self, index: int) -> Line | None:
        if not self.lines:
            return None
        index = max(1, min(index, len(self.lines)))
        return self.lines[index - 1]


# ------------------------------------------------------------------------------ table

_QUOTE = re.compile(r"^[ \t]*(?:>[ \t]?)+")


def _unquote(lines: Sequence[Line]) -> Sequence[Line]:
    """Drop chat or mail quote markers (``> ``) in front of pasted lines.

    Operators paste tool output into tickets as quoted blocks, often under an
    unquoted chat header; the marker is never part of ``nvidia-smi`` output.

        >>> [ln.text for ln in _unquote([Line(1, "> | 0  H100 |"), Line(2, "x")])]
        ['| 0  H100 |', 'x']
    """
    if not any(ln.text.lstrip().startswith(">") for ln in lines):
        return lines
    return [Line(ln.number, _QUOTE.sub("", ln.text, count=1)) for ln in lines]


_TABLE_ROW1 = re.compile(
    r"^\s*\|\s*(?P<index>\d+)\s+(?P<name>.*?)\s+(?P<persist>On|Off|ERR!|N/A)?\s*\|\s*"
    r"(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]|ERR!|\S+)\s*(?P<disp>\S+)?\s*\|"
    r"\s*(?P<ecc>.*?)\s*\|?\s*$"
)
_TABLE_ROW2 = re.compile(
    r"^\s*\|\s*(?P<fan>\S+)\s+(?P<temp>\S+)\s+(?P<perf>\S+)\s+(?P<pwr>\S+)\s*/\s*(?P<cap>\S+)\s*\|"
    r"\s*(?P<mem>\S+)\s*/\s*(?P<memtot>\S+)\s*\|\s*(?P<util>\S+)(?:\s+(?P<mode>.*?))?\s*\|?\s*$"
)
_TABLE_HINT = re.compile(r"NVIDIA-SMI \d|\|\s*GPU\s+Name\b|Pwr:Usage/Cap|Volatile Uncorr\. ECC")


class NvidiaSmiTableParser:
    """The default ``nvidia-smi`` table: one two- or three-line row per GPU.

    Row fields (``nvidia-smi`` man page): index, name, persistence, bus id,
    display, volatile uncorrected ECC; fan, temperature, perf state,
    power usage/cap; memory used/total; utilization and compute mode.
    """

    kind = "nvidia_smi_table"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score table borders, the header and GPU rows."""
        lines = _unquote(lines[:200])
        rows = 0
        hint = 0
        for line in lines[:200]:
            if _TABLE_HINT.search(line.text):
                hint += 1
            if (
                _TABLE_ROW1.match(line.text)
                and re.search(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", line.text)
            ) or _TABLE_ROW2.match(line.text):
                rows += 1
        if rows == 0 and hint == 0:
            return 0
        return min(95, 40 + 15 * hint + 15 * rows)

    def open(self, ctx: ParseContext) -> _TableSession:
        """Start parsing a table."""
        return _TableSession(ctx)


_TABLE_LINE = re.compile(r"^\s*[|+]")


class _TableSession(Session):
    """Rows of the default table.

    Text of another ``nvidia-smi`` kind pasted right after the table without a
    prompt or blank line (``-q`` text, CSV...) goes to that kind's parser instead
    of being dropped.
    """

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.row1: tuple[Line, re.Match[str]] | None = None
        self.foreign: list[Line] = []

    def _flush_foreign(self) -> list[Record]:
        lines, self.foreign = self.foreign, []
        if not lines:
            return []
        best: ArtifactParser | None = None
        score = 0
        for parser in _EMBEDDED_PARSERS:
            s = parser.detect(lines, None)
            if s > score:
                best, score = parser, s
        if best is None or score < MIN_SCORE:
            return []
        session = best.open(self.ctx)
        out = list(session.feed(lines))
        out.extend(session.close())
        self.issues.extend(session.issues)
        return out

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        out: list[Record] = []
        for line in _unquote(lines):
            if not _TABLE_LINE.match(line.text):
                self.foreign.append(line)
                continue
            if self.foreign:
                out.extend(self._flush_foreign())
            m1 = _TABLE_ROW1.match(line.text)
            if (
                m1 is not None
                and re.search(r"\|\s*\d+\s+\S", line.text)
                and (
                    "ERR!" in (m1["bus"] or "")
                    or re.match(r"[0-9A-Fa-f]{4,8}:", m1["bus"] or "") is not None
                )
            ):
                self.row1 = (line, m1)
                continue
            m2 = _TABLE_ROW2.match(line.text)
            if m2 is not None and self.row1 is not None:
                out.extend(self._row(self.row1[0], self.row1[1], line, m2))
                self.row1 = None
        return out

    def _row(self, l1: Line, m1: re.Match[str], l2: Line, m2: re.Match[str]) -> list[Record]:
        ctx = self.ctx
        entity = gpu_entity(bus_id=m1["bus"], index=m1["index"]) or UNKNOWN_GPU
        out: list[Record] = []
        errs: list[str] = []

        def add(
            metric: str,
            raw: str | None,
            name: str,
            line: Line,
            scale: float = 1.0,
            labels: Mapping[str, str] | None = None,
        ) -> None:
            if raw is None:
                return
            if is_err(raw):
                errs.append(name)
                return
            parsed = number(raw)
            if parsed is None:
                return
            value = to_base(*parsed) if parsed[1] in {"MiB", "GiB", "%"} else parsed[0]
            s = make_sample(ctx, metric, value * scale, entity, line, labels)
            if s is not None:
                out.append(s)

        for name, raw in (
            ("name", m1["name"]),
            ("persistence", m1["persist"]),
            ("bus_id", m1["bus"]),
            ("display", m1["disp"]),
            ("perf", m2["perf"]),
            ("compute_mode", m2["mode"]),
        ):
            if raw is not None and is_err(raw):
                errs.append(name)
        add(
            "gpu_ecc_errors_total",
            m1["ecc"],
            "volatile_uncorrected_ecc",
            l1,
            labels={"type": "uncorrected", "scope": "volatile", "location": "total"},
        )
        add("gpu_fan_speed_ratio", m2["fan"], "fan", l2)
        temp = m2["temp"]
        add(
            "gpu_temperature_celsius",
            temp.rstrip("C") if not is_err(temp) else temp,
            "temperature",
            l2,
        )
        add("gpu_power_watts", m2["pwr"], "power", l2)
        add("gpu_power_limit_watts", m2["cap"], "power_limit", l2)
        add("gpu_memory_used_bytes", m2["mem"], "memory_used", l2)
        add("gpu_memory_total_bytes", m2["memtot"], "memory_total", l2)
        add("gpu_utilization_ratio", m2["util"], "utilization", l2)
        name = m1["name"].strip()
        if name and not is_err(name):
            s = make_sample(ctx, "gpu_info", 1.0, entity, l1, {"model": name})
            if s is not None:
                out.append(s)
        if len(errs) >= 4:
            out.append(
                Event(
                    kind="nvidia_smi_err",
                    code="row",
                    node=ctx.node,
                    entity=entity,
                    observed_at=None,
                    message=f"every field of GPU {m1['index']} reads ERR! ({', '.join(errs)})",
                    attrs={"field": "row", "fields": ",".join(errs)},
                    evidence=(line_evidence(ctx, l1), line_evidence(ctx, l2)),
                    source="nvidia_smi_table",
                )
            )
        else:
            for field_name in errs:
                out.append(err_event(ctx, entity, field_name, [l1, l2], "nvidia_smi_table"))
        return out

    def close(self) -> list[Record]:
        if self.row1 is not None:
            self.issue(self.row1[0].number, "nvidia-smi table row cut off after its first line")
            self.row1 = None
        return self._flush_foreign()


# -------------------------------------------------------------------------------- CSV

_CSV_FIELDS = {
    "index",
    "name",
    "gpu_name",
    "pci.bus_id",
    "gpu_bus_id",
    "uuid",
    "gpu_uuid",
    "serial",
    "gpu_serial",
    "vbios_version",
    "driver_version",
    "gpu_recovery_action",
    "temperature.gpu",
    "power.draw",
    "memory.used",
    "utilization.gpu",
}


def _csv_field(name: str) -> str:
    return re.sub(r"\s*\[[^\]]*\]\s*$", "", name.strip()).lower()


class NvidiaSmiCsvParser:
    """``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]``.

    The header names the fields; with ``noheader`` the pasted command does. Field
    names follow ``nvidia-smi --help-query-gpu``.
    """

    kind = "nvidia_smi_csv"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score from the command (``--query-gpu``) or a header of known field names."""
        if not lines:
            return 0
        pasted = _comment_command(lines[0].text)
        if pasted is not None:
            command, lines = pasted, lines[1:]
            if not lines:
                return 0
        if command and re.search(_QUERY_OPTION, command) and "csv" in command:
            return 95
        first = [_csv_field(f) for f in lines[0].text.split(",")]
        known = sum(1 for f in first if f in _CSV_FIELDS or ("." in f and " " not in f))
        if len(first) >= 2 and known == len(first):
            return 70
        return 0

    def open(self, ctx: ParseContext) -> _CsvSession:
        """Start parsing a CSV section."""
        return _CsvSession(ctx)


_QUERY_OPTION = r"--query-(?:gpu|remapped-rows|retired-pages|accounted-apps|compute-apps)"
"""The ``nvidia-smi`` CSV query options (``--query-gpu``, ``--query-remapped-rows``...)."""

_COMMENT_COMMAND = re.compile(r"^\s*#\s*(?P<cmd>(?:sudo\s+)?nvidia-smi\s.*--query-[\w-]+.*?)\s*$")


def _comment_command(text: str) -> str | None:
    """The command of a root-prompt line ``# nvidia-smi --query-gpu=...`` pasted before CSV.

    Examples:
        >>> _comment_command("# nvidia-smi --query-gpu=index,uuid --format=csv")
        'nvidia-smi --query-gpu=index,uuid --format=csv'
        >>> _comment_command("index, uuid") is None
        True
    """
    match = _COMMENT_COMMAND.match(text)
    return match["cmd"] if match else None


def _command_fields(command: str | None) -> list[str] | None:
    if not command:
        return None
    match = re.search(_QUERY_OPTION + r"[= ]\s*['\"]?([\w.,]+)", command)
    if match is None:
        return None
    return [f.strip().lower() for f in match[1].split(",") if f.strip()]


class _CsvSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.fields: list[str] | None = None
        cmd = ctx.command or ""
        self.noheader = "noheader" in cmd
        if self.noheader:
            self.fields = _command_fields(cmd)
        self.reported = False

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        out: list[Record] = []
        for line in lines:
            pasted = _comment_command(line.text)
            if pasted is not None:
                self.noheader = "noheader" in pasted
                self.fields = _command_fields(pasted) if self.noheader else None
                continue
            cells = [c.strip() for c in line.text.split(",")]
            if self.fields is None:
                header = [_csv_field(c) for c in cells]
                if any(h in _CSV_FIELDS or "." in h for h in header):
                    self.fields = header
                    continue
                if not self.reported:
                    self.issue(
                        line.number,
                        "CSV without a header and without the command naming its fields",
                    )
                    self.reported = True
                continue
            if len(cells) != len(self.fields):
                if [_csv_field(c) for c in cells] == self.fields:
                    continue
                self.issue(line.number, f"expected {len(self.fields)} CSV fields, got {len(cells)}")
                continue
            if [_csv_field(c) for c in cells] == self.fields:
                continue
            out.extend(self._row(dict(zip(self.fields, cells, strict=True)), line))
        return out

    def _row(self, row: dict[str, str], line: Line) -> list[Record]:
        ctx = self.ctx
        bus = row.get("pci.bus_id") or row.get("gpu_bus_id")
        uuid = row.get("uuid") or row.get("gpu_uuid")
        entity = gpu_entity(bus_id=bus, uuid=uuid, index=row.get("index"))
        if entity is None:
            entity = UNKNOWN_GPU
        out: list[Record] = []
        info: dict[str, str] = {}
        fabric: dict[str, str] = {}
        state_seen = False

        def add(metric: str, val: float, labels: Mapping[str, str] | None = None) -> None:
            s = make_sample(ctx, metric, val, entity, line, labels)
            if s is not None:
                out.append(s)

        for name, raw in row.items():
            value = raw.strip()
            if is_err(value):
                out.append(err_event(ctx, entity, name, [line], "nvidia_smi_csv"))
                continue
            state_event = nvml_error_event(ctx, entity, name, value, [line], "nvidia_smi_csv")
            if state_event is not None:
                if not state_seen:
                    out.append(state_event)
                state_seen = True
                continue
            if name.startswith("fabric."):
                fabric[name[len("fabric.") :]] = value
                continue
            if is_missing(value):
                continue
            if name in {"name", "gpu_name"}:
                info["model"] = value
            elif name in {"uuid", "gpu_uuid"}:
                info["uuid"] = value
            elif name in {"pci.bus_id", "gpu_bus_id"}:
                info["pci_bus_id"] = value
            elif name in {"serial", "gpu_serial"}:
                info["serial"] = value
            elif name in {"vbios_version", "driver_version"}:
                info[name] = value
            elif name == "gpu_recovery_action":
                code = recovery_code(value)
                if code is None:
                    self.issue(line.number, f"unknown GPU recovery action {value!r}")
                else:
                    add("gpu_recovery_action", code)
            else:
                self._numeric(name, value, add)
        if info:
            add("gpu_info", 1.0, info)
        state = fabric.pop("state", None)
        if state is not None and not is_missing(state):
            attrs = {
                ("health_summary" if k == "health.summary" else k): v for k, v in fabric.items()
            }
            out.append(
                Event(
                    kind="fabric",
                    code=norm_key(state),
                    node=ctx.node,
                    entity=entity,
                    observed_at=None,
                    message=f"NVLink fabric state {state}, status {attrs.get('status', 'N/A')}",
                    attrs=attrs,
                    evidence=(line_evidence(ctx, line),),
                    source="nvidia_smi_csv",
                )
            )
        return out

    @staticmethod
    def _numeric(name: str, value: str, add: _Adder) -> None:
        flag = yes_no(value)
        reason = re.match(r"^clocks?_(?:event|throttle)_reasons?\.(\w+)$", name)
        if reason and reason[1] == "active":
            mask = _bitmask(value)
            if mask is not None:
                for bit, label in CLOCK_EVENT_BITS.items():
                    add("gpu_clock_event_active", 1.0 if mask & bit else 0.0, {"reason": label})
            return
        if reason:
            mapped = CLOCK_REASONS.get(reason[1])
            if mapped and flag is not None:
                add("gpu_clock_event_active", flag, {"reason": mapped})
            return
        reset = re.match(
            r"^(?:gpu_)?reset_status\.(reset_required|drain_and_reset_recommended)$", name
        )
        if reset:
            if flag == 1.0:
                add("gpu_recovery_action", 1.0 if reset[1] == "reset_required" else 4.0)
            return
        flags = {
            "retired_pages.pending": "gpu_retired_pages_pending",
            "remapped_rows.pending": "gpu_row_remap_pending",
            "remapped_rows.failure": "gpu_row_remap_failure",
        }
        if name in flags:
            if flag is not None:
                add(flags[name], flag)
            return
        parsed = number(value)
        if parsed is None:
            return
        val, unit = parsed
        ecc = re.match(r"^ecc\.errors\.(corrected|uncorrected)\.(volatile|aggregate)\.(\w+)$", name)
        if ecc:
            location = _ECC_LOCATIONS.get(ecc[3], ecc[3])
            add(
                "gpu_ecc_errors_total", val, {"type": ecc[1], "scope": ecc[2], "location": location}
            )
            return
        simple: dict[str, tuple[str, str, dict[str, str]]] = {
            "temperature.gpu": ("gpu_temperature_celsius", "", {}),
            "temperature.memory": ("gpu_memory_temperature_celsius", "", {}),
            "power.draw": ("gpu_power_watts", "W", {}),
            "power.draw.average": ("gpu_power_watts", "W", {}),
            "power.limit": ("gpu_power_limit_watts", "W", {}),
            "enforced.power.limit": ("gpu_power_limit_watts", "W", {}),
            "memory.used": ("gpu_memory_used_bytes", "MiB", {}),
            "memory.total": ("gpu_memory_total_bytes", "MiB", {}),
            "utilization.gpu": ("gpu_utilization_ratio", "%", {}),
            "utilization.memory": ("gpu_memory_utilization_ratio", "%", {}),
            "clocks.sm": ("gpu_sm_clock_hertz", "MHz", {}),
            "clocks.current.sm": ("gpu_sm_clock_hertz", "MHz", {}),
            "clocks.mem": ("gpu_memory_clock_hertz", "MHz", {}),
            "clocks.current.memory": ("gpu_memory_clock_hertz", "MHz", {}),
            "fan.speed": ("gpu_fan_speed_ratio", "%", {}),
            "pcie.link.gen.current": ("gpu_pcie_link_generation", "", {"bound": "current"}),
            "pcie.link.gen.gpucurrent": ("gpu_pcie_link_generation", "", {"bound": "current"}),
            "pcie.link.gen.max": ("gpu_pcie_link_generation", "", {"bound": "max"}),
            "pcie.link.gen.gpumax": ("gpu_pcie_link_generation", "", {"bound": "device_max"}),
            "pcie.link.gen.hostmax": ("gpu_pcie_link_generation", "", {"bound": "host_max"}),
            "pcie.link.width.current": ("gpu_pcie_link_width", "", {"bound": "current"}),
            "pcie.link.width.max": ("gpu_pcie_link_width", "", {"bound": "max"}),
            "retired_pages.sbe": ("gpu_retired_pages", "", {"cause": "multiple_sbe"}),
            "retired_pages.single_bit_ecc.count": (
                "gpu_retired_pages",
                "",
                {"cause": "multiple_sbe"},
            ),
            "retired_pages.dbe": ("gpu_retired_pages", "", {"cause": "dbe"}),
            "retired_pages.double_bit.count": ("gpu_retired_pages", "", {"cause": "dbe"}),
            "remapped_rows.correctable": ("gpu_remapped_rows", "", {"type": "correctable"}),
            "remapped_rows.uncorrectable": ("gpu_remapped_rows", "", {"type": "uncorrectable"}),
        }
        spec = simple.get(name)
        if spec is None:
            return
        metric, default_unit, labels = spec
        add(metric, to_base(val, unit or default_unit), labels)


# ----------------------------------------------------------------------- nvlink -s / -e

_NVL_GPU = re.compile(
    r"^GPU\s+(?P<index>\d+):\s*(?P<name>.*?)\s*(?:\(UUID:\s*(?P<uuid>[^)]*)\))?\s*$"
)
_NVL_LINK = re.compile(r"^\s*Link\s+(?P<link>\d+):\s*(?P<rest>.*?)\s*$")
_MIG_LIST = re.compile(r"^\s+MIG\s+\S+\s+Device\s+\d+:\s*\(UUID:")
"""A MIG device line of ``nvidia-smi -L``."""


class NvidiaSmiNvlinkParser:
    """``nvidia-smi nvlink -s`` (per-link speed or ``<inactive>``) and ``-e`` (error counters).

    A link shown ``<inactive>`` is down (NVML ``nvmlDeviceGetNvLinkState`` 0); a
    speed means it is active.
    """

    kind = "nvidia_smi_nvlink"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score ``GPU N: name (UUID: ...)`` headers followed by ``Link N:`` lines."""
        heads = sum(1 for ln in lines[:200] if _NVL_GPU.match(ln.text.strip()))
        links = sum(
            1
            for ln in lines[:200]
            if _NVL_LINK.match(ln.text)
            or re.match(r"^\s*Link\s+\d+\s*,", ln.text)
            or re.search(r"all links are inactive", ln.text, re.I)
        )
        if links == 0:
            if heads and command and "nvlink" in command and "nvidia-smi" in command:
                return 90  # GPUs without NVLink: the command prints only their lines
            listed = [ln for ln in lines[:200] if ln.text.strip()]
            if heads and all(
                _NVL_GPU.match(ln.text.strip()) or _MIG_LIST.match(ln.text) for ln in listed
            ):
                return 40  # GPU lines only: nvidia-smi -L, or nvlink -s of GPUs without NVLink
            return 0
        score = 50 + min(40, 10 * heads + links)
        if command and "nvlink" in command and "nvidia-smi" in command:
            score = 95
        return score

    def open(self, ctx: ParseContext) -> _NvlinkSession:
        """Start parsing an nvlink section."""
        return _NvlinkSession(ctx)


class _NvlinkSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.entity: EntityId | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        out: list[Record] = []
        ctx = self.ctx
        for line in lines:
            head = _NVL_GPU.match(line.text.strip())
            if head is not None:
                self.entity = gpu_entity(uuid=head["uuid"], index=head["index"]) or UNKNOWN_GPU
                name = head["name"].strip()
                if name:
                    labels = {"model": name}
                    s = make_sample(ctx, "gpu_info", 1.0, self.entity, line, labels)
                    if s is not None:
                        out.append(s)
                continue
            if re.search(r"all links are inactive", line.text, re.I):
                entity = self.entity or UNKNOWN_GPU
                s = make_sample(ctx, "gpu_nvlink_state", 0.0, entity, line, {"link": "all"})
                if s is not None:
                    out.append(s)
                continue
            if re.match(r"^\s*Link\s+\d+\s*,", line.text) or _MIG_LIST.match(line.text):
                continue  # nvlink -c capabilities ("Link 0, P2P is supported: true"), -L MIG
            link = _NVL_LINK.match(line.text)
            if link is None:
                if line.text.strip():
                    self.issue(
                        line.number, f"not an nvidia-smi nvlink line: {line.text.strip()[:80]!r}"
                    )
                continue
            entity = self.entity or UNKNOWN_GPU
            rest = link["rest"]
            labels = {"link": link["link"]}
            if "<inactive>" in rest.lower() or rest.strip().lower() in {"inactive", "down"}:
                s = make_sample(ctx, "gpu_nvlink_state", 0.0, entity, line, labels)
            elif re.match(r"^[\d.]+\s*[GM]B/s", rest):
                s = make_sample(ctx, "gpu_nvlink_state", 1.0, entity, line, labels)
            else:
                err = re.match(
                    r"^(Replay|Recovery|CRC|CRC Data|CRC Flit)\s+Errors?:\s*(\d+)", rest, re.I
                )
                if err is None:
                    continue
                kind = {
                    "replay": "replay",
                    "recovery": "recovery",
                    "crc": "crc_flit",
                    "crc data": "crc_data",
                    "crc flit": "crc_flit",
                }[err[1].lower()]
                s = make_sample(
                    ctx,
                    "gpu_nvlink_errors_total",
                    float(err[2]),
                    entity,
                    line,
                    {"link": link["link"], "type": kind},
                )
            if s is not None:
                out.append(s)
        return out


# ------------------------------------------------------------------------------ lspci

_LSPCI_DEV = re.compile(
    r"^(?P<addr>(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+(?P<cls>[^:]+):\s*(?P<desc>.*)$"
)
_LNK = re.compile(
    r"^\s*Lnk(?P<which>Cap|Sta):.*?Speed\s+(?P<speed>[\d.]+)GT/s[^,]*,\s*Width\s+x(?P<width>\d+)"
)
_GTS_TO_GEN = {"2.5": 1, "5": 2, "8": 3, "16": 4, "32": 5, "64": 6, "128": 7}


class LspciParser:
    """``lspci -vv``: link capability and negotiated link of NVIDIA GPUs (vendor 10de).

    Follows the PCIe capability registers as ``lspci`` prints them: ``LnkCap`` is
    what the port can do, ``LnkSta`` the negotiated speed and width.
    """

    kind = "lspci"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score device headers and ``LnkCap``/``LnkSta`` lines."""
        dev = sum(1 for ln in lines[:400] if _LSPCI_DEV.match(ln.text))
        lnk = sum(1 for ln in lines[:400] if "LnkSta:" in ln.text or "LnkCap:" in ln.text)
        if dev == 0 and lnk == 0:
            return 0
        if command and command.strip().split()[0:1] in (["lspci"], ["sudo"]) and "lspci" in command:
            return 90
        return min(80, 20 * dev + 15 * lnk) if lnk else min(30, 10 * dev)

    def open(self, ctx: ParseContext) -> _LspciSession:
        """Start parsing ``lspci`` output."""
        return _LspciSession(ctx)


class _LspciSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.entity: EntityId | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        out: list[Record] = []
        for line in lines:
            dev = _LSPCI_DEV.match(line.text)
            if dev is not None:
                cls = dev["cls"].lower()
                desc = dev["desc"]
                nvidia = "nvidia" in desc.lower() or "[10de:" in desc.lower()
                gpu = any(
                    w in cls for w in ("3d controller", "vga compatible", "display controller")
                )
                addr = dev["addr"] if dev["addr"].count(":") == 2 else "0000:" + dev["addr"]
                canonical = normalize_pci_bus_id(addr)
                self.entity = EntityId(canonical) if nvidia and gpu and canonical else None
                continue
            if self.entity is None:
                continue
            lnk = _LNK.match(line.text)
            if lnk is None:
                continue
            gen = _GTS_TO_GEN.get(
                lnk["speed"].rstrip("0").rstrip(".") if "." in lnk["speed"] else lnk["speed"]
            )
            bound = "max" if lnk["which"] == "Cap" else "current"
            if gen is not None:
                s = make_sample(
                    self.ctx, "gpu_pcie_link_generation", gen, self.entity, line, {"bound": bound}
                )
                if s is not None:
                    out.append(s)
            s = make_sample(
                self.ctx,
                "gpu_pcie_link_width",
                float(lnk["width"]),
                self.entity,
                line,
                {"bound": bound},
            )
            if s is not None:
                out.append(s)
        return out


PARSERS: tuple[ArtifactParser, ...] = (
    NvidiaSmiTableParser(),
    NvidiaSmiQParser(),
    NvidiaSmiXmlParser(),
    NvidiaSmiCsvParser(),
    NvidiaSmiNvlinkParser(),
    LspciParser(),
)
"""The ``nvidia-smi`` and ``lspci`` artifact parsers."""

_EMBEDDED_PARSERS: tuple[ArtifactParser, ...] = PARSERS[1:5]
"""Kinds that may follow a table in the same block (``-q``, XML, CSV, nvlink)."""
