"""Test doubles for the collectors: a fake NVML built from real ``nvidia-smi`` dumps.

:class:`FakeNvml` stands in for the ``pynvml`` module at its call boundary: the NVML
collector receives it as ``nvml=`` and calls the same functions, with the same
arguments, that it calls on the real binding. It raises the binding's own exception
classes (``pynvml.NVMLError_NotSupported``, ``NVMLError_GpuIsLost``...) and returns the
binding's own ``ctypes`` structures (``c_nvmlFieldValue_t``, ``c_nvmlMemory_t``...), so
code that works against the fake works against the driver.

Devices are built from whole ``nvidia-smi -q`` (text) or ``-q -x`` (XML) dumps
(:meth:`FakeNvml.from_dump`). The rule for what the fake may answer:

* a value printed in the dump is answered, converted to NVML's raw unit (W to mW,
  MiB to bytes, "Active" to a clock-event bit);
* ``N/A``, ``Not Supported`` and ``Requested functionality has been deprecated``
  become ``NVML_ERROR_NOT_SUPPORTED`` (nvidia-smi prints them when NVML says so);
  ``ERR!`` becomes ``NVML_ERROR_UNKNOWN``;
* a block that ``nvidia-smi -q`` prints for GPUs that support it, missing from a whole
  dump (row remapping on Volta, the SRAM error status before Hopper, the recovery
  action before driver 550, the ECC layout nvidia-smi did not choose) is
  ``NOT_SUPPORTED`` too; in a pasted fragment (the case files) it is unknown, and
  asking for it is a gap unless the test declares it (:meth:`FakeGpu.declare_absent`);
* what ``nvidia-smi -q`` never prints (the energy counter, NVLink state and error
  counters, supported event types, the maximum number of MIG devices) must be given
  by the test (:meth:`FakeGpu.set`); otherwise the call raises :class:`FakeNvmlGap`,
  which is recorded in :attr:`FakeNvml.gaps` so that the test fails even where the
  collector swallows the exception. The fake never makes a value up.

Errors are injected per call and GPU (:meth:`FakeNvml.fail`), a GPU can be lost
(:meth:`FakeNvml.lose`), a call can hang until released (:meth:`FakeNvml.hang`), and
NVML events are pushed with :meth:`FakeNvml.push_event`.
"""

from __future__ import annotations

import collections
import queue
import re
import threading
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from collectors.nvidia_smi import CLOCK_EVENT_BITS, CLOCK_REASONS, norm_key

__all__ = [
    "NOT_SUPPORTED",
    "FakeEventData",
    "FakeGpu",
    "FakeHandle",
    "FakeNvml",
    "FakeNvmlGap",
    "given_for_dump",
    "parse_nvidia_smi_dump",
]


class FakeNvmlGap(AssertionError):
    """The fake was asked for something its dump does not say and the test did not give."""


class _NotSupported:
    """Marker: NVML answers ``NVML_ERROR_NOT_SUPPORTED`` for this fact."""

    def __repr__(self) -> str:
        return "NOT_SUPPORTED"


NOT_SUPPORTED: Any = _NotSupported()
"""Give this as a fact's value to make NVML answer ``NVML_ERROR_NOT_SUPPORTED``."""

_ABSENT: Any = object()
"""While parsing: the dump does not print this fact (see :func:`parse_nvidia_smi_dump`)."""


class _Err:
    """Marker: NVML answers this error code for the fact (``ERR!`` in the dump)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __repr__(self) -> str:
        return f"NVMLError({self.code})"


_MISSING = {
    "n/a",
    "[n/a]",
    "not supported",
    "[not supported]",
    "requested functionality has been deprecated",
}
_REASON_SECTIONS = {
    "clocks_event_reasons",
    "clocks_throttle_reasons",
    "clock_throttle_reasons",
    "clock_event_reasons",
}
_BIT_OF_REASON = {label: bit for bit, label in CLOCK_EVENT_BITS.items()}
_NUM = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)")

# ------------------------------------------------------------------------ dump parsing


@dataclass
class _Section:
    """The leaves of one GPU (or MIG device) section: normalised path -> raw text."""

    leaves: dict[tuple[str, ...], str] = field(default_factory=dict)
    mig: list[dict[tuple[str, ...], str]] = field(default_factory=list)

    def get(self, *paths: tuple[str, ...]) -> str | None:
        for path in paths:
            if path in self.leaves:
                return self.leaves[path]
        return None


@dataclass
class _Dump:
    driver_version: str | None
    gpus: list[tuple[str, _Section]]


def _parse_text(text: str) -> _Dump:
    driver: str | None = None
    gpus: list[tuple[str, _Section]] = []
    section: _Section | None = None
    target: dict[tuple[str, ...], str] | None = None
    stack: list[tuple[int, str]] = []
    mig_indent = -1
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("="):
            continue
        indent = len(raw) - len(raw.lstrip())
        body = raw.strip()
        header = re.match(r"^GPU\s+([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])$", body)
        if indent == 0 and header is not None:
            section = _Section()
            gpus.append((header[1], section))
            target, stack, mig_indent = section.leaves, [], -1
            continue
        key, sep, value = body.partition(":")
        name = norm_key(key)
        if indent == 0:
            if name == "driver_version" and sep:
                driver = value.strip()
            continue
        if section is None or target is None:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if mig_indent >= 0 and indent <= mig_indent:
            target, mig_indent = section.leaves, -1
        if name == "mig_device" and not sep:
            target = {}
            section.mig.append(target)
            mig_indent = indent
            stack = []
            continue
        path = (*(n for _i, n in stack), name)
        if sep and value.strip():
            target[path] = value.strip()
        stack.append((indent, name))
    return _Dump(driver_version=driver, gpus=gpus)


def _walk_xml(node: ET.Element, prefix: tuple[str, ...], out: dict[tuple[str, ...], str]) -> None:
    for child in node:
        path = (*prefix, norm_key(child.tag))
        if len(child):
            _walk_xml(child, path, out)
        elif child.text is not None and child.text.strip():
            out[path] = child.text.strip()


def _parse_xml(text: str) -> _Dump:
    root = ET.fromstring(text)
    driver = root.findtext("driver_version")
    gpus: list[tuple[str, _Section]] = []
    for gpu in root.findall("gpu"):
        section = _Section()
        for child in gpu:
            if child.tag == "mig_devices":
                for mig in child.findall("mig_device"):
                    leaves: dict[tuple[str, ...], str] = {}
                    _walk_xml(mig, (), leaves)
                    section.mig.append(leaves)
                continue
            if len(child):
                _walk_xml(child, (norm_key(child.tag),), section.leaves)
            elif child.text is not None and child.text.strip():
                section.leaves[(norm_key(child.tag),)] = child.text.strip()
        gpus.append((gpu.get("id", ""), section))
    return _Dump(driver_version=driver.strip() if driver else None, gpus=gpus)


def _value(raw: str | None, convert: Any = None) -> Any:
    """Turn a printed reading into a fact: a number, NOT_SUPPORTED, an error, or None."""
    if raw is None:
        return None
    text = raw.strip()
    if text.lower() in _MISSING:
        return NOT_SUPPORTED
    if text.upper().startswith("ERR!") or text.lower() in {"unknown error", "[unknown error]"}:
        return _Err(pynvml.NVML_ERROR_UNKNOWN)
    if convert is None:
        return text
    return convert(text)


def _num(text: str) -> float:
    match = _NUM.match(text)
    if match is None:
        raise ValueError(f"not a number: {text!r}")
    return float(match[1])


def _int(text: str) -> int:
    return int(_num(text))


def _mw(text: str) -> int:
    return round(_num(text) * 1000.0)


def _mib(text: str) -> int:
    return _int(text) * 1024 * 1024


def _yes(text: str) -> int:
    return 1 if text.strip().lower() in {"yes", "active", "enabled", "true"} else 0


_RECOVERY_TEXT = {
    "none": 0,
    "gpu reset": 1,
    "gpu reset required": 1,
    "reset": 1,
    "node reboot": 2,
    "node reboot required": 2,
    "drain p2p": 3,
    "drain and reset": 4,
}


def _recovery(text: str) -> int:
    value = _RECOVERY_TEXT.get(text.strip().lower())
    if value is None:
        raise ValueError(f"unknown recovery action {text!r}")
    return value


def parse_nvidia_smi_dump(path: str | Path) -> list[FakeGpu]:
    """Build one :class:`FakeGpu` per GPU section of an ``nvidia-smi -q`` or ``-q -x`` dump.

    A whole dump (the ``NVSMI LOG`` banner, or ``-q -x``) lists every block NVML
    answers, so a block it lacks is ``NOT_SUPPORTED``. A pasted fragment (the case
    files) says nothing about what it leaves out: those facts stay unknown (a call for
    them is a gap) and are listed in :attr:`FakeGpu.absent`.

    Args:
        path: The dump file (text or XML, detected from its first characters).

    Returns:
        The GPUs in the order the dump lists them (NVML index order).

    Raises:
        ValueError: The file holds no GPU section.
    """
    text = Path(path).read_text(encoding="utf-8")
    xml = text.lstrip().startswith("<?xml")
    dump = _parse_xml(text) if xml else _parse_text(text)
    if not dump.gpus:
        raise ValueError(f"{path}: no GPU section found")
    complete = xml or "NVSMI LOG" in text
    return [
        _gpu_from(bus, sec, dump.driver_version, str(path), complete=complete)
        for bus, sec in dump.gpus
    ]


def _gpu_from(
    bus: str, sec: _Section, driver: str | None, source: str, *, complete: bool
) -> FakeGpu:
    f: dict[Any, Any] = {}
    g = sec.get

    def put(name: str, raw: str | None, convert: Any = None) -> None:
        value = _value(raw, convert)
        # A fact nvidia-smi -q prints, missing from a whole dump: NVML did not support it.
        f[name] = _ABSENT if value is None else value

    f["driver_version"] = driver if driver is not None else _ABSENT
    put("name", g(("product_name",)))
    put("serial", g(("serial_number",), ("serial",)))
    put("uuid", g(("gpu_uuid",), ("uuid",)))
    put("pci_bus_id", g(("pci", "bus_id"), ("pci", "pci_bus_id")) or bus)
    put("vbios", g(("vbios_version",)))
    put("temperature_c", g(("temperature", "gpu_current_temp"), ("temperature", "gpu_temp")), _int)
    put(
        "memory_temperature_c",
        g(("temperature", "memory_current_temp"), ("temperature", "memory_temp")),
        _int,
    )
    for threshold in ("shutdown", "slowdown", "max_operating"):
        put(f"{threshold}_temperature_c", g(("temperature", f"gpu_{threshold}_temp")), _int)
    put(
        "power_mw",
        g(
            ("gpu_power_readings", "power_draw"),
            ("gpu_power_readings", "average_power_draw"),
            ("power_readings", "power_draw"),
        ),
        _mw,
    )
    put(
        "power_limit_mw",
        g(
            ("gpu_power_readings", "enforced_power_limit"),
            ("gpu_power_readings", "current_power_limit"),
            ("power_readings", "enforced_power_limit"),
            ("power_readings", "power_limit"),
        ),
        _mw,
    )
    put("util_gpu", g(("utilization", "gpu"), ("utilization", "gpu_util")), _int)
    put("util_memory", g(("utilization", "memory"), ("utilization", "memory_util")), _int)
    for part in ("total", "used", "free"):
        put(f"memory_{part}", g(("fb_memory_usage", part)), _mib)
    put("clock_graphics_mhz", g(("clocks", "graphics"), ("clocks", "graphics_clock")), _int)
    put("clock_sm_mhz", g(("clocks", "sm"), ("clocks", "sm_clock")), _int)
    put("clock_mem_mhz", g(("clocks", "memory"), ("clocks", "mem_clock")), _int)
    put("fan_pct", g(("fan_speed",)), _int)
    _reasons(sec, f)
    _ecc(sec, f)
    retired = "retired_pages"
    put(
        "retired_sbe",
        g(
            (retired, "single_bit_ecc"),
            (retired, "multiple_single_bit_retirement", "retired_count"),
        ),
        _int,
    )
    put(
        "retired_dbe",
        g((retired, "double_bit_ecc"), (retired, "double_bit_retirement", "retired_count")),
        _int,
    )
    put(
        "retired_pending",
        g(("retired_pages", "pending_page_blacklist"), ("retired_pages", "pending_blacklist")),
        _yes,
    )
    _remap(sec, f)
    put("recovery_action", g(("gpu_recovery_action",)), _recovery)
    put("reset_required", g(("gpu_reset_status", "reset_required")), _yes)
    put("drain_and_reset", g(("gpu_reset_status", "drain_and_reset_recommended")), _yes)
    put(
        "pcie_gen_max",
        g(
            ("pci", "gpu_link_info", "pcie_generation", "max"),
            ("pci", "pci_gpu_link_info", "pcie_gen", "max_link_gen"),
        ),
        _int,
    )
    put(
        "pcie_gen_current",
        g(
            ("pci", "gpu_link_info", "pcie_generation", "current"),
            ("pci", "pci_gpu_link_info", "pcie_gen", "current_link_gen"),
        ),
        _int,
    )
    put(
        "pcie_width_max",
        g(
            ("pci", "gpu_link_info", "link_width", "max"),
            ("pci", "pci_gpu_link_info", "link_widths", "max_link_width"),
        ),
        _int,
    )
    put(
        "pcie_width_current",
        g(
            ("pci", "gpu_link_info", "link_width", "current"),
            ("pci", "pci_gpu_link_info", "link_widths", "current_link_width"),
        ),
        _int,
    )
    put("pcie_replays", g(("pci", "replays_since_reset"), ("pci", "replay_counter")), _int)
    put("mig_current", g(("mig_mode", "current"), ("mig_mode", "current_mig")), _yes)
    put("mig_pending", g(("mig_mode", "pending"), ("mig_mode", "pending_mig")), _yes)
    f["mig_devices"] = [
        (
            _int(m.get(("gpu_instance_id",), "0")),
            _int(m.get(("compute_instance_id",), "0")),
            _value(
                m.get(("shared_fb_memory_usage", "total"), m.get(("fb_memory_usage", "total"))),
                _mib,
            ),
            _value(
                m.get(("shared_fb_memory_usage", "used"), m.get(("fb_memory_usage", "used"))), _mib
            ),
        )
        for m in sec.mig
    ]
    absent = {name for name, value in f.items() if value is _ABSENT}
    for name in absent:
        if complete:
            f[name] = NOT_SUPPORTED
        else:
            del f[name]
    return FakeGpu(facts=f, source=source, absent=set() if complete else absent)


def _reasons(sec: _Section, f: dict[Any, Any]) -> None:
    current = supported = 0
    seen = False
    for path, raw in sec.leaves.items():
        if not any(p in _REASON_SECTIONS for p in path[:-1]):
            continue
        if any(p.endswith("_counters") for p in path[:-1]):
            continue
        name = re.sub(r"^clocks?_(?:event|throttle)_reasons?_", "", path[-1])
        label = CLOCK_REASONS.get(name)
        if label is None:
            continue
        seen = True
        value = _value(raw)
        if value is NOT_SUPPORTED or isinstance(value, _Err):
            continue
        bit = _BIT_OF_REASON[label]
        supported |= bit
        if _yes(value):
            current |= bit
    f["clock_event_reasons"] = current if seen else _ABSENT
    f["clock_event_reasons_supported"] = supported if seen else _ABSENT


_LEGACY_LOCATIONS = {
    "device_memory": pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY,
    "register_file": pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE,
    "l1_cache": pynvml.NVML_MEMORY_LOCATION_L1_CACHE,
    "l2_cache": pynvml.NVML_MEMORY_LOCATION_L2_CACHE,
    "texture_memory": pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY,
    "texture_shared": pynvml.NVML_MEMORY_LOCATION_TEXTURE_SHM,
    "cbu": pynvml.NVML_MEMORY_LOCATION_CBU,
    "total": "total",
}
_ALL_LOCATIONS: tuple[int | str, ...] = (*range(pynvml.NVML_MEMORY_LOCATION_COUNT), "total")


def _ecc(sec: _Section, f: dict[Any, Any]) -> None:
    """ECC mode, counters per (type, counter, location) and the SRAM error status."""
    g = sec.get
    f["ecc_mode"] = _value(g(("ecc_mode", "current"), ("ecc_mode", "current_ecc")), _yes)
    if f["ecc_mode"] is None:
        f["ecc_mode"] = _ABSENT
    printed = any(p[0] == "ecc_errors" for p in sec.leaves)
    corr, unc = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    scopes = {"volatile": pynvml.NVML_VOLATILE_ECC, "aggregate": pynvml.NVML_AGGREGATE_ECC}
    legacy = any(
        len(p) >= 3 and p[0] == "ecc_errors" and p[2] in ("single_bit", "double_bit")
        for p in sec.leaves
    )
    for scope, counter in scopes.items():
        base = ("ecc_errors", scope)
        if legacy:
            for kind, etype in (("single_bit", corr), ("double_bit", unc)):
                for key, loc in _LEGACY_LOCATIONS.items():
                    value = _value(g((*base, kind, key)), _int)
                    f[("ecc", etype, counter, loc)] = _ABSENT if value is None else value
            f[("ecc", corr, counter, pynvml.NVML_MEMORY_LOCATION_SRAM)] = NOT_SUPPORTED
            f[("ecc", unc, counter, pynvml.NVML_MEMORY_LOCATION_SRAM)] = NOT_SUPPORTED
            continue
        sram_c = _value(g((*base, "sram_correctable")), _int)
        sram_u = _value(g((*base, "sram_uncorrectable")), _int)
        if sram_u is None:
            parity = _value(g((*base, "sram_uncorrectable_parity")), _int)
            secded = _value(g((*base, "sram_uncorrectable_sec_ded")), _int)
            if isinstance(parity, int) and isinstance(secded, int):
                sram_u = parity + secded  # NVML's SRAM counter holds both kinds
        dram_c = _value(g((*base, "dram_correctable")), _int)
        dram_u = _value(g((*base, "dram_uncorrectable")), _int)
        values = {
            (corr, pynvml.NVML_MEMORY_LOCATION_SRAM): sram_c,
            (unc, pynvml.NVML_MEMORY_LOCATION_SRAM): sram_u,
            (corr, pynvml.NVML_MEMORY_LOCATION_DRAM): dram_c,
            (unc, pynvml.NVML_MEMORY_LOCATION_DRAM): dram_u,
        }
        for (etype, loc), value in values.items():
            f[("ecc", etype, counter, loc)] = _ABSENT if value is None else value
        for etype, (a, b) in ((corr, (sram_c, dram_c)), (unc, (sram_u, dram_u))):
            # nvmlDeviceGetTotalEccErrors counts every location; on this layout nvidia-smi
            # lists them all (SRAM, DRAM), so the total is their sum.
            if isinstance(a, int) and isinstance(b, int):
                total = a + b
            elif a is None or b is None:
                total = _ABSENT
            else:
                total = NOT_SUPPORTED
            f[("ecc", etype, counter, "total")] = total
        for loc in _ALL_LOCATIONS:
            for etype in (corr, unc):
                # the layout nvidia-smi chose lists every location this GPU has
                f.setdefault(("ecc", etype, counter, loc), NOT_SUPPORTED if printed else _ABSENT)
    threshold = _value(
        g(
            ("ecc_errors", "aggregate", "sram_threshold_exceeded"),
            ("ecc_errors", "sram_threshold_exceeded"),
        ),
        _yes,
    )
    if threshold is None or threshold is NOT_SUPPORTED:
        f["sram_status"] = _ABSENT if threshold is None else NOT_SUPPORTED
        return
    status: dict[str, Any] = {"bThresholdExceeded": threshold}
    for scope in ("volatile", "aggregate"):
        base = ("ecc_errors", scope)
        status[f"{scope}UncParity"] = _value(g((*base, "sram_uncorrectable_parity")), _int)
        status[f"{scope}UncSecDed"] = _value(g((*base, "sram_uncorrectable_sec_ded")), _int)
        status[f"{scope}Cor"] = _value(g((*base, "sram_correctable")), _int)
    src = ("ecc_errors", "aggregate_uncorrectable_sram_sources")
    for name, key in (
        ("L2", "sram_l2"),
        ("Sm", "sram_sm"),
        ("Pcie", "sram_pcie"),
        ("Mcu", "sram_microcontroller"),
        ("Other", "sram_other"),
    ):
        status[f"aggregateUncBucket{name}"] = _value(g((*src, key)), _int)
    f["sram_status"] = status


def _remap(sec: _Section, f: dict[Any, Any]) -> None:
    g = sec.get
    whole = g(("remapped_rows",))
    names = ("remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure")
    hist_keys = ("max", "high", "partial", "low", "none")
    if whole is not None or not any(p[0] == "remapped_rows" for p in sec.leaves):
        verdict = _ABSENT if whole is None else NOT_SUPPORTED  # "Remapped Rows : N/A"
        for name in names:
            f[name] = verdict
        f["remap_histogram"] = verdict
        return
    base = ("remapped_rows",)
    f["remap_correctable"] = _value(
        g((*base, "correctable_error"), (*base, "remapped_row_corr")), _int
    )
    f["remap_uncorrectable"] = _value(
        g((*base, "uncorrectable_error"), (*base, "remapped_row_unc")), _int
    )
    f["remap_pending"] = _value(g((*base, "pending"), (*base, "remapped_row_pending")), _yes)
    f["remap_failure"] = _value(
        g((*base, "remapping_failure_occurred"), (*base, "remapped_row_failure")), _yes
    )
    for name in names:
        if f[name] is None:
            f[name] = _ABSENT
    hist: dict[str, Any] = {}
    for key in hist_keys:
        raw = g(
            (*base, "bank_remap_availability_histogram", key),
            (*base, "remapped_row_histogram", f"row_remap_histogram_{key}"),
        )
        hist[key] = _value(raw, _int)
    if any(v is None for v in hist.values()):
        f["remap_histogram"] = _ABSENT
    elif any(v is NOT_SUPPORTED for v in hist.values()):
        f["remap_histogram"] = NOT_SUPPORTED
    else:
        f["remap_histogram"] = hist


# ----------------------------------------------------------------------------- devices


@dataclass(eq=False)
class FakeHandle:
    """An opaque device handle (hashable by identity, like the driver's pointer)."""

    index: int
    mig_index: int | None = None

    def __repr__(self) -> str:
        mig = "" if self.mig_index is None else f"/mig{self.mig_index}"
        return f"<FakeHandle {self.index}{mig}>"


@dataclass
class FakeEventData:
    """What ``nvmlEventSetWait_v2`` returns (``c_nvmlEventData_t``'s fields)."""

    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeGpu:
    """One GPU's facts, in NVML's raw units, keyed by fact name.

    Facts set from a dump are listed in :func:`parse_nvidia_smi_dump`. Facts a test
    must give (``nvidia-smi -q`` never prints them): ``energy_mj``,
    ``nvlink_states`` (list of 0/1 per link, or ``NOT_SUPPORTED``),
    ``nvlink_errors`` (``{(link, counter): count}``), ``supported_events`` (mask),
    ``max_mig_devices``.
    """

    facts: dict[Any, Any]
    source: str = "test"
    absent: set[Any] = field(default_factory=set)
    """Facts a fragment did not print (unknown: a call for them is a gap)."""

    def set(self, **facts: Any) -> FakeGpu:
        """Give or override facts; returns ``self`` for chaining."""
        self.facts.update(facts)
        return self

    def declare_absent(self, value: Any = NOT_SUPPORTED) -> FakeGpu:
        """Give every fact a fragment left out, explicitly (``NOT_SUPPORTED`` by default)."""
        for name in self.absent:
            self.facts.setdefault(name, value)
        return self


_FIELD_FACTS: dict[int, Any] = {
    pynvml.NVML_FI_DEV_MEMORY_TEMP: "memory_temperature_c",
    pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: "energy_mj",
    pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: "recovery_action",
    pynvml.NVML_FI_DEV_RESET_STATUS: "reset_required",
    pynvml.NVML_FI_DEV_DRAIN_AND_RESET_STATUS: "drain_and_reset",
    pynvml.NVML_FI_DEV_RETIRED_SBE: "retired_sbe",
    pynvml.NVML_FI_DEV_RETIRED_DBE: "retired_dbe",
    pynvml.NVML_FI_DEV_RETIRED_PENDING: "retired_pending",
    pynvml.NVML_FI_DEV_REMAPPED_COR: "remap_correctable",
    pynvml.NVML_FI_DEV_REMAPPED_UNC: "remap_uncorrectable",
    pynvml.NVML_FI_DEV_REMAPPED_PENDING: "remap_pending",
    pynvml.NVML_FI_DEV_REMAPPED_FAILURE: "remap_failure",
    pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: "pcie_replays",
}
_C, _U = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_V, _A = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
_FIELD_FACTS.update(
    {
        pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: ("ecc", _C, _V, "total"),
        pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: ("ecc", _U, _V, "total"),
        pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: ("ecc", _C, _A, "total"),
        pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: ("ecc", _U, _A, "total"),
    }
)
for _loc_name, _loc in (
    ("L1", pynvml.NVML_MEMORY_LOCATION_L1_CACHE),
    ("L2", pynvml.NVML_MEMORY_LOCATION_L2_CACHE),
    ("DEV", pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY),
    ("REG", pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE),
    ("TEX", pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY),
    ("CBU", pynvml.NVML_MEMORY_LOCATION_CBU),
):
    for _bit, _etype in (("SBE", _C), ("DBE", _U)):
        for _scope, _counter in (("VOL", _V), ("AGG", _A)):
            _fid = getattr(pynvml, f"NVML_FI_DEV_ECC_{_bit}_{_scope}_{_loc_name}", None)
            if _fid is not None:
                _FIELD_FACTS[_fid] = ("ecc", _etype, _counter, _loc)

_NVLINK_FIELD_COUNTERS = (
    ("CRC_FLIT", pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    ("CRC_DATA", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
    ("REPLAY", pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ("RECOVERY", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
)
for _name, _counter in _NVLINK_FIELD_COUNTERS:
    for _link in range(12):
        _fid = getattr(pynvml, f"NVML_FI_DEV_NVLINK_{_name}_ERROR_COUNT_L{_link}", None)
        if _fid is not None:
            _FIELD_FACTS[_fid] = ("nvlink_error", _link, _counter)

_COUNTER_FIELDS = {
    pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
    pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER,
}


class FakeNvml:
    """A stand-in for the ``pynvml`` module (see the module docstring).

    Args:
        gpus: The devices, NVML index order.
        driver_version: What ``nvmlSystemGetDriverVersion`` answers.

    Attributes:
        calls: How many times each NVML function was called.
        gaps: Calls the fake could not answer (each one should fail the test).
        hung: Calls currently blocked by :meth:`hang`.
    """

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: Sequence[FakeGpu], *, driver_version: str | None = None) -> None:
        self.gpus = list(gpus)
        self.driver_version = driver_version
        if driver_version is None and self.gpus:
            found = self.gpus[0].facts.get("driver_version")
            self.driver_version = found if isinstance(found, str) else None
        self.handles = [FakeHandle(i) for i in range(len(self.gpus))]
        self.calls: collections.Counter[str] = collections.Counter()
        self.gaps: list[str] = []
        self.hung: list[str] = []
        self.no_library = False
        self.allow_deprecated = False
        """Answer the deprecated calls (to stand in for an nvidia-ml-py without their
        replacements); by default they are gaps, so that the collector never uses them."""
        self.initialised = 0
        self._fail: dict[tuple[str, int | None], tuple[int, int | None]] = {}
        self._lost: set[int] = set()
        self._hang: dict[tuple[str, int | None], threading.Event] = {}
        self._events: queue.Queue[FakeEventData] = queue.Queue()
        self._registered: dict[int, int] = {}
        self._sets = 0
        self._lock = threading.Lock()

    # --- construction ----------------------------------------------------------------

    @classmethod
    def from_dump(cls, *paths: str | Path, **given: Any) -> FakeNvml:
        """Build the fake from whole ``nvidia-smi -q`` / ``-q -x`` dumps (GPUs in order).

        Args:
            paths: Dump files; their GPUs are concatenated.
            given: Facts given to every GPU (for what ``-q`` never prints), e.g.
                ``energy_mj=NOT_SUPPORTED`` or ``supported_events=0``.
        """
        gpus = [gpu for path in paths for gpu in parse_nvidia_smi_dump(path)]
        for gpu in gpus:
            gpu.set(**given)
        return cls(gpus)

    def __getattr__(self, name: str) -> Any:
        # Constants and exception classes come from the real binding.
        if name.startswith(("NVML_", "NVMLError_", "nvmlEvent", "nvmlClocks", "c_nvml")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # --- injection -------------------------------------------------------------------

    def fail(
        self, call: str, error: int, gpu: int | None = None, *, times: int | None = None
    ) -> None:
        """Make ``call`` raise NVML error ``error`` (for one GPU index or all).

        ``call`` is a function name (``nvmlDeviceGetPowerUsage``) or ``field:<id>`` for one
        entry of ``nvmlDeviceGetFieldValues``; ``times`` limits how often it fails.
        """
        self._fail[(call, gpu)] = (error, times)

    def clear_failures(self) -> None:
        """Remove every injected error, loss and hang."""
        self._fail.clear()
        self._lost.clear()
        for event in self._hang.values():
            event.set()
        self._hang.clear()

    def lose(self, gpu: int) -> None:
        """Make every call on GPU ``gpu`` (and getting its handle) answer GPU_IS_LOST."""
        self._lost.add(gpu)

    def hang(self, call: str, gpu: int | None = None) -> threading.Event:
        """Make ``call`` block until the returned event is set (at most 10 s)."""
        release = threading.Event()
        self._hang[(call, gpu)] = release
        return release

    def push_event(
        self, gpu: int, event_type: int, data: int = 0, *, gpu_instance_id: int = 0xFFFFFFFF
    ) -> None:
        """Deliver one NVML event to whoever waits on an event set."""
        self._events.put(
            FakeEventData(
                device=self.handles[gpu],
                eventType=event_type,
                eventData=data,
                gpuInstanceId=gpu_instance_id,
            )
        )

    # --- plumbing --------------------------------------------------------------------

    def _enter(self, call: str, handle: Any = None) -> FakeGpu | None:
        with self._lock:
            self.calls[call] += 1
        index = None if handle is None else handle.index
        release = self._hang.get((call, index)) or self._hang.get((call, None))
        if release is not None:
            with self._lock:
                self.hung.append(call)
            release.wait(10.0)
        if index is not None and index in self._lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        injected = self._fail.get((call, index)) or self._fail.get((call, None))
        if injected is not None:
            self._spend(call, index)
            raise pynvml.NVMLError(injected[0])
        return None if handle is None else self.gpus[handle.index]

    def _spend(self, call: str, index: int | None) -> None:
        key = (call, index) if (call, index) in self._fail else (call, None)
        code, times = self._fail[key]
        if times is not None:
            if times <= 1:
                del self._fail[key]
            else:
                self._fail[key] = (code, times - 1)

    def _fact(self, gpu: FakeGpu, name: Any, call: str) -> Any:
        value = gpu.facts.get(name)
        if value is None:
            gap = f"{call}: {name!r} is not in {gpu.source} and the test did not give it"
            with self._lock:
                self.gaps.append(gap)
            raise FakeNvmlGap(gap)
        if value is NOT_SUPPORTED:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if isinstance(value, _Err):
            raise pynvml.NVMLError(value.code)
        return value

    def _deprecated(self, call: str) -> Any:
        gap = f"{call} is deprecated (ecosystem-reference §0, §1); use its replacement"
        with self._lock:
            self.gaps.append(gap)
        raise FakeNvmlGap(gap)

    # --- lifecycle and system ----------------------------------------------------------

    def nvmlInit(self) -> None:
        """Answer like ``pynvml.nvmlInit``."""
        self._enter("nvmlInit")
        if self.no_library:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        """Answer like ``pynvml.nvmlShutdown``."""
        self._enter("nvmlShutdown")
        self.initialised = max(0, self.initialised - 1)

    def nvmlSystemGetDriverVersion(self) -> str:
        """Answer like ``pynvml.nvmlSystemGetDriverVersion``."""
        self._enter("nvmlSystemGetDriverVersion")
        if self.driver_version is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        """Answer like ``pynvml.nvmlDeviceGetCount``."""
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        """Answer like ``pynvml.nvmlDeviceGetHandleByIndex``."""
        self._enter("nvmlDeviceGetHandleByIndex")
        if index in self._lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        injected = self._fail.get(("nvmlDeviceGetHandleByIndex", index))
        if injected is not None:
            self._spend("nvmlDeviceGetHandleByIndex", index)
            raise pynvml.NVMLError(injected[0])
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.handles[index]

    # --- identity ----------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, h: FakeHandle) -> str:
        """Answer like ``pynvml.nvmlDeviceGetUUID``."""
        gpu = self._enter("nvmlDeviceGetUUID", h)
        assert gpu is not None
        return str(self._fact(gpu, "uuid", "nvmlDeviceGetUUID"))

    def nvmlDeviceGetName(self, h: FakeHandle) -> str:
        """Answer like ``pynvml.nvmlDeviceGetName``."""
        gpu = self._enter("nvmlDeviceGetName", h)
        assert gpu is not None
        return str(self._fact(gpu, "name", "nvmlDeviceGetName"))

    def nvmlDeviceGetSerial(self, h: FakeHandle) -> str:
        """Answer like ``pynvml.nvmlDeviceGetSerial``."""
        gpu = self._enter("nvmlDeviceGetSerial", h)
        assert gpu is not None
        return str(self._fact(gpu, "serial", "nvmlDeviceGetSerial"))

    def nvmlDeviceGetVbiosVersion(self, h: FakeHandle) -> str:
        """Answer like ``pynvml.nvmlDeviceGetVbiosVersion``."""
        gpu = self._enter("nvmlDeviceGetVbiosVersion", h)
        assert gpu is not None
        return str(self._fact(gpu, "vbios", "nvmlDeviceGetVbiosVersion"))

    def nvmlDeviceGetPciInfo_v3(self, h: FakeHandle) -> Any:
        """Answer like ``pynvml.nvmlDeviceGetPciInfo_v3``."""
        gpu = self._enter("nvmlDeviceGetPciInfo_v3", h)
        assert gpu is not None
        bus = str(self._fact(gpu, "pci_bus_id", "nvmlDeviceGetPciInfo_v3"))
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus.encode()
        return info

    # --- fast group ----------------------------------------------------------------------

    def nvmlDeviceGetTemperatureV(self, h: FakeHandle, sensor: int) -> int:
        """Answer like ``pynvml.nvmlDeviceGetTemperatureV``."""
        gpu = self._enter("nvmlDeviceGetTemperatureV", h)
        assert gpu is not None
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(self._fact(gpu, "temperature_c", "nvmlDeviceGetTemperatureV"))

    def nvmlDeviceGetTemperatureThreshold(self, h: FakeHandle, kind: int) -> int:
        """Answer like ``pynvml.nvmlDeviceGetTemperatureThreshold`` (shutdown, slowdown, max)."""
        gpu = self._enter("nvmlDeviceGetTemperatureThreshold", h)
        assert gpu is not None
        name = {pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "shutdown",
                pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "slowdown",
                pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: "max_operating"}.get(kind)
        if name is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(self._fact(gpu, f"{name}_temperature_c", "nvmlDeviceGetTemperatureThreshold"))

    def nvmlDeviceGetPowerUsage(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetPowerUsage``."""
        gpu = self._enter("nvmlDeviceGetPowerUsage", h)
        assert gpu is not None
        return int(self._fact(gpu, "power_mw", "nvmlDeviceGetPowerUsage"))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetEnforcedPowerLimit``."""
        gpu = self._enter("nvmlDeviceGetEnforcedPowerLimit", h)
        assert gpu is not None
        return int(self._fact(gpu, "power_limit_mw", "nvmlDeviceGetEnforcedPowerLimit"))

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetTotalEnergyConsumption``."""
        gpu = self._enter("nvmlDeviceGetTotalEnergyConsumption", h)
        assert gpu is not None
        return int(self._fact(gpu, "energy_mj", "nvmlDeviceGetTotalEnergyConsumption"))

    def nvmlDeviceGetUtilizationRates(self, h: FakeHandle) -> Any:
        """Answer like ``pynvml.nvmlDeviceGetUtilizationRates``."""
        gpu = self._enter("nvmlDeviceGetUtilizationRates", h)
        assert gpu is not None
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = int(self._fact(gpu, "util_gpu", "nvmlDeviceGetUtilizationRates"))
        util.memory = int(self._fact(gpu, "util_memory", "nvmlDeviceGetUtilizationRates"))
        return util

    def nvmlDeviceGetMemoryInfo(self, h: FakeHandle, version: Any = None) -> Any:
        """Answer like ``pynvml.nvmlDeviceGetMemoryInfo``."""
        gpu = self._enter("nvmlDeviceGetMemoryInfo", h)
        assert gpu is not None
        if version is not None:
            return self._deprecated("nvmlDeviceGetMemoryInfo(version=...) in the fake")
        mem = pynvml.c_nvmlMemory_t()
        if h.mig_index is not None:
            _gi, _ci, total, used = self._mig(gpu, h.mig_index)
            if total is None or used is None:
                return self._fact(gpu, ("mig_memory", h.mig_index), "nvmlDeviceGetMemoryInfo")
            if total is NOT_SUPPORTED or used is NOT_SUPPORTED:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            mem.total, mem.used, mem.free = total, used, total - used
            return mem
        mem.total = int(self._fact(gpu, "memory_total", "nvmlDeviceGetMemoryInfo"))
        mem.used = int(self._fact(gpu, "memory_used", "nvmlDeviceGetMemoryInfo"))
        mem.free = int(self._fact(gpu, "memory_free", "nvmlDeviceGetMemoryInfo"))
        return mem

    def nvmlDeviceGetClockInfo(self, h: FakeHandle, clock: int) -> int:
        """Answer like ``pynvml.nvmlDeviceGetClockInfo``."""
        gpu = self._enter("nvmlDeviceGetClockInfo", h)
        assert gpu is not None
        name = {
            pynvml.NVML_CLOCK_GRAPHICS: "clock_graphics_mhz",
            pynvml.NVML_CLOCK_SM: "clock_sm_mhz",
            pynvml.NVML_CLOCK_MEM: "clock_mem_mhz",
        }.get(clock, f"clock_{clock}_mhz")
        return int(self._fact(gpu, name, "nvmlDeviceGetClockInfo"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetCurrentClocksEventReasons``."""
        gpu = self._enter("nvmlDeviceGetCurrentClocksEventReasons", h)
        assert gpu is not None
        return int(self._fact(gpu, "clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons"))

    def nvmlDeviceGetSupportedClocksEventReasons(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetSupportedClocksEventReasons``."""
        gpu = self._enter("nvmlDeviceGetSupportedClocksEventReasons", h)
        assert gpu is not None
        return int(
            self._fact(
                gpu, "clock_event_reasons_supported", "nvmlDeviceGetSupportedClocksEventReasons"
            )
        )

    def nvmlDeviceGetFanSpeed(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetFanSpeed``."""
        gpu = self._enter("nvmlDeviceGetFanSpeed", h)
        assert gpu is not None
        return int(self._fact(gpu, "fan_pct", "nvmlDeviceGetFanSpeed"))

    # --- field values ----------------------------------------------------------------------

    def nvmlDeviceGetFieldValues(self, h: FakeHandle, field_ids: Sequence[Any]) -> Any:
        """Answer like ``pynvml.nvmlDeviceGetFieldValues``."""
        gpu = self._enter("nvmlDeviceGetFieldValues", h)
        assert gpu is not None
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, item in enumerate(field_ids):
            fid, scope = item if isinstance(item, tuple) else (item, 0)
            entry = values[i]
            entry.fieldId, entry.scopeId = fid, scope
            with self._lock:
                self.calls[f"field:{fid}"] += 1
            injected = self._fail.get((f"field:{fid}", h.index)) or self._fail.get(
                (f"field:{fid}", None)
            )
            if injected is not None:
                self._spend(f"field:{fid}", h.index)
                entry.nvmlReturn = injected[0]
                continue
            name = _FIELD_FACTS.get(fid)
            if fid == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
                name = "nvlink_link_count"
            if name is None:
                gap = f"nvmlDeviceGetFieldValues: field {fid} has no meaning in the fake"
                with self._lock:
                    self.gaps.append(gap)
                raise FakeNvmlGap(gap)
            try:
                value = self._field_value(gpu, name)
            except pynvml.NVMLError as exc:
                entry.nvmlReturn = exc.value
                continue
            entry.nvmlReturn = pynvml.NVML_SUCCESS
            if fid in _COUNTER_FIELDS or (isinstance(name, tuple) and name[0] != "nvlink_error"):
                entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                entry.value.ullVal = int(value)
            else:
                entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                entry.value.uiVal = int(value)
        return values

    def _field_value(self, gpu: FakeGpu, name: Any) -> int:
        call = "nvmlDeviceGetFieldValues"
        if name == "nvlink_link_count":
            states = self._fact(gpu, "nvlink_states", call)
            return len(states)
        if isinstance(name, tuple) and name[0] == "nvlink_error":
            states = self._fact(gpu, "nvlink_states", call)
            if name[1] >= len(states):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            errors = self._fact(gpu, "nvlink_errors", call)
            return int(errors.get((name[1], name[2]), 0))
        return int(self._fact(gpu, name, call))

    # --- slow group ------------------------------------------------------------------------

    def nvmlDeviceGetEccMode(self, h: FakeHandle) -> list[int]:
        """Answer like ``pynvml.nvmlDeviceGetEccMode``."""
        gpu = self._enter("nvmlDeviceGetEccMode", h)
        assert gpu is not None
        current = int(self._fact(gpu, "ecc_mode", "nvmlDeviceGetEccMode"))
        return [current, current]

    def nvmlDeviceGetMemoryErrorCounter(
        self, h: FakeHandle, error_type: int, counter: int, location: int
    ) -> int:
        """Answer like ``pynvml.nvmlDeviceGetMemoryErrorCounter``."""
        gpu = self._enter("nvmlDeviceGetMemoryErrorCounter", h)
        assert gpu is not None
        return int(
            self._fact(
                gpu, ("ecc", error_type, counter, location), "nvmlDeviceGetMemoryErrorCounter"
            )
        )

    def nvmlDeviceGetTotalEccErrors(self, h: FakeHandle, error_type: int, counter: int) -> int:
        """Answer like ``pynvml.nvmlDeviceGetTotalEccErrors``."""
        gpu = self._enter("nvmlDeviceGetTotalEccErrors", h)
        assert gpu is not None
        return int(
            self._fact(gpu, ("ecc", error_type, counter, "total"), "nvmlDeviceGetTotalEccErrors")
        )

    def nvmlDeviceGetSramEccErrorStatus(self, h: FakeHandle, status: Any) -> int:
        """Answer like ``pynvml.nvmlDeviceGetSramEccErrorStatus``."""
        gpu = self._enter("nvmlDeviceGetSramEccErrorStatus", h)
        assert gpu is not None
        facts = self._fact(gpu, "sram_status", "nvmlDeviceGetSramEccErrorStatus")
        target = getattr(status, "_obj", status)
        for key, value in facts.items():
            if value is None or value is NOT_SUPPORTED:
                continue
            setattr(target, key, int(value))
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetRemappedRows(self, h: FakeHandle) -> tuple[int, int, int, int]:
        """Answer like ``pynvml.nvmlDeviceGetRemappedRows``."""
        gpu = self._enter("nvmlDeviceGetRemappedRows", h)
        assert gpu is not None
        call = "nvmlDeviceGetRemappedRows"
        return (
            int(self._fact(gpu, "remap_correctable", call)),
            int(self._fact(gpu, "remap_uncorrectable", call)),
            int(self._fact(gpu, "remap_pending", call)),
            int(self._fact(gpu, "remap_failure", call)),
        )

    def nvmlDeviceGetRowRemapperHistogram(self, h: FakeHandle) -> Any:
        """Answer like ``pynvml.nvmlDeviceGetRowRemapperHistogram``."""
        gpu = self._enter("nvmlDeviceGetRowRemapperHistogram", h)
        assert gpu is not None
        hist = self._fact(gpu, "remap_histogram", "nvmlDeviceGetRowRemapperHistogram")
        values = pynvml.c_nvmlRowRemapperHistogramValues()
        for key, value in hist.items():
            setattr(values, key, int(value))
        return values

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetCurrPcieLinkGeneration``."""
        gpu = self._enter("nvmlDeviceGetCurrPcieLinkGeneration", h)
        assert gpu is not None
        return int(self._fact(gpu, "pcie_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration"))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetMaxPcieLinkGeneration``."""
        gpu = self._enter("nvmlDeviceGetMaxPcieLinkGeneration", h)
        assert gpu is not None
        return int(self._fact(gpu, "pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"))

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetCurrPcieLinkWidth``."""
        gpu = self._enter("nvmlDeviceGetCurrPcieLinkWidth", h)
        assert gpu is not None
        return int(self._fact(gpu, "pcie_width_current", "nvmlDeviceGetCurrPcieLinkWidth"))

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetMaxPcieLinkWidth``."""
        gpu = self._enter("nvmlDeviceGetMaxPcieLinkWidth", h)
        assert gpu is not None
        return int(self._fact(gpu, "pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth"))

    def nvmlDeviceGetNvLinkState(self, h: FakeHandle, link: int) -> int:
        """Answer like ``pynvml.nvmlDeviceGetNvLinkState``."""
        gpu = self._enter("nvmlDeviceGetNvLinkState", h)
        assert gpu is not None
        states = self._fact(gpu, "nvlink_states", "nvmlDeviceGetNvLinkState")
        if link >= len(states):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(states[link])

    def nvmlDeviceGetNvLinkErrorCounter(self, h: FakeHandle, link: int, counter: int) -> int:
        """Answer like ``pynvml.nvmlDeviceGetNvLinkErrorCounter``."""
        gpu = self._enter("nvmlDeviceGetNvLinkErrorCounter", h)
        assert gpu is not None
        return self._field_value(gpu, ("nvlink_error", link, counter))

    # --- MIG -------------------------------------------------------------------------------

    def _mig(self, gpu: FakeGpu, index: int) -> tuple[int, int, Any, Any]:
        devices = self._fact(gpu, "mig_devices", "MIG")
        entry: tuple[int, int, Any, Any] = devices[index]
        return entry

    def nvmlDeviceGetMigMode(self, h: FakeHandle) -> list[int]:
        """Answer like ``pynvml.nvmlDeviceGetMigMode``."""
        gpu = self._enter("nvmlDeviceGetMigMode", h)
        assert gpu is not None
        return [
            int(self._fact(gpu, "mig_current", "nvmlDeviceGetMigMode")),
            int(self._fact(gpu, "mig_pending", "nvmlDeviceGetMigMode")),
        ]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetMaxMigDeviceCount``."""
        gpu = self._enter("nvmlDeviceGetMaxMigDeviceCount", h)
        assert gpu is not None
        return int(self._fact(gpu, "max_mig_devices", "nvmlDeviceGetMaxMigDeviceCount"))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeHandle, index: int) -> FakeHandle:
        """Answer like ``pynvml.nvmlDeviceGetMigDeviceHandleByIndex``."""
        gpu = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", h)
        assert gpu is not None
        devices = self._fact(gpu, "mig_devices", "nvmlDeviceGetMigDeviceHandleByIndex")
        if index >= len(devices):
            # nvidia-smi lists every MIG device: a slot it does not list is empty.
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeHandle(h.index, mig_index=index)

    def nvmlDeviceGetGpuInstanceId(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetGpuInstanceId``."""
        gpu = self._enter("nvmlDeviceGetGpuInstanceId", h)
        assert gpu is not None
        if h.mig_index is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mig(gpu, h.mig_index)[0]

    # --- events ----------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> int:
        """Answer like ``pynvml.nvmlEventSetCreate``."""
        self._enter("nvmlEventSetCreate")
        self._sets += 1
        return self._sets

    def nvmlDeviceGetSupportedEventTypes(self, h: FakeHandle) -> int:
        """Answer like ``pynvml.nvmlDeviceGetSupportedEventTypes``."""
        gpu = self._enter("nvmlDeviceGetSupportedEventTypes", h)
        assert gpu is not None
        return int(self._fact(gpu, "supported_events", "nvmlDeviceGetSupportedEventTypes"))

    def nvmlDeviceRegisterEvents(self, h: FakeHandle, mask: int, event_set: int) -> None:
        """Answer like ``pynvml.nvmlDeviceRegisterEvents``."""
        gpu = self._enter("nvmlDeviceRegisterEvents", h)
        assert gpu is not None
        supported = int(self._fact(gpu, "supported_events", "nvmlDeviceRegisterEvents"))
        if mask & ~supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._registered[h.index] = self._registered.get(h.index, 0) | mask

    def nvmlEventSetWait_v2(self, event_set: int, timeout_ms: int) -> FakeEventData:
        """Answer like ``pynvml.nvmlEventSetWait_v2``."""
        self._enter("nvmlEventSetWait_v2")
        deadline = max(0.0, timeout_ms / 1000.0)
        while True:
            try:
                data = self._events.get(timeout=deadline)
            except queue.Empty:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
            if self._registered.get(data.device.index, 0) & data.eventType:
                return data
            deadline = 0.0  # an event nobody registered for is not delivered

    def nvmlEventSetFree(self, event_set: int) -> None:
        """Answer like ``pynvml.nvmlEventSetFree``."""
        self._enter("nvmlEventSetFree")

    # --- deprecated calls the collector must not make -------------------------------------------

    def nvmlDeviceGetTemperature(self, h: FakeHandle, sensor: int) -> int:
        """Deprecated ``nvmlDeviceGetTemperature``: a gap unless :attr:`allow_deprecated`."""
        if not self.allow_deprecated:
            return int(self._deprecated("nvmlDeviceGetTemperature"))
        gpu = self._enter("nvmlDeviceGetTemperature", h)
        assert gpu is not None
        return int(self._fact(gpu, "temperature_c", "nvmlDeviceGetTemperature"))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeHandle) -> int:
        """Deprecated ``...ThrottleReasons``: a gap unless :attr:`allow_deprecated`."""
        if not self.allow_deprecated:
            return int(self._deprecated("nvmlDeviceGetCurrentClocksThrottleReasons"))
        gpu = self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        assert gpu is not None
        return int(
            self._fact(gpu, "clock_event_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        )

    def nvmlDeviceGetPowerState(self, h: FakeHandle) -> int:
        """Record a call to deprecated ``nvmlDeviceGetPowerState``."""
        return int(self._deprecated("nvmlDeviceGetPowerState"))

    def nvmlDeviceGetDetailedEccErrors(self, h: FakeHandle, *args: Any) -> Any:
        """Record a call to deprecated ``nvmlDeviceGetDetailedEccErrors``."""
        return self._deprecated("nvmlDeviceGetDetailedEccErrors")

    def nvmlDeviceGetViolationStatus(self, h: FakeHandle, *args: Any) -> Any:
        """Record a call to deprecated ``nvmlDeviceGetViolationStatus``."""
        return self._deprecated("nvmlDeviceGetViolationStatus")


def given_for_dump(
    *,
    energy_mj: Any = NOT_SUPPORTED,
    nvlink_states: Any = NOT_SUPPORTED,
    nvlink_errors: Mapping[tuple[int, int], int] | None = None,
    supported_events: Any = 0,
    max_mig_devices: Any = NOT_SUPPORTED,
) -> dict[str, Any]:
    """Facts ``nvidia-smi -q`` never prints, spelled out for a dump-built fake.

    The defaults say "not supported" / "no events": a test that wants these signals
    gives values; a test that does not still answers every call honestly.
    """
    return {
        "energy_mj": energy_mj,
        "nvlink_states": nvlink_states,
        "nvlink_errors": dict(nvlink_errors or {}),
        "supported_events": supported_events,
        "max_mig_devices": max_mig_devices,
    }


def ctypes_struct_fields(value: Any) -> dict[str, Any]:
    """Return a ctypes structure's fields as a dict (for test assertions)."""
    return {name: getattr(value, name) for name, _t in getattr(value, "_fields_", ())}
