"""Live GPU telemetry and events through NVML (``nvidia-ml-py``, import name ``pynvml``).

Two groups, each with its own interval (ecosystem-reference §1, §11 for calls and units):

* **fast** (``fast_interval_seconds``, default 1 s): GPU temperature
  (``nvmlDeviceGetTemperatureV``), power draw (``nvmlDeviceGetPowerUsage``, mW → W),
  utilization (% → ratio), framebuffer memory (bytes), SM and memory clocks (MHz → Hz),
  every supported clock event reason as its own 0/1 series
  (``nvmlDeviceGetCurrentClocksEventReasons``), and one batched
  ``nvmlDeviceGetFieldValues`` call for HBM temperature (field 82), the energy counter
  (83, mJ → J) and the GPU recovery action (230; on drivers without it, the deprecated
  reset-status fields 226/227 it replaced);
* **slow** (``slow_interval_seconds``, default 30 s): identity (``gpu_info``: UUID,
  serial, PCI bus id, name, driver and VBIOS versions), enforced power limit, fan
  speed, the supported clock event reasons, ECC counts per type, scope and location
  (``nvmlDeviceGetMemoryErrorCounter`` for SRAM and DRAM; fields 3-28 for totals and
  pre-Ampere locations), the SRAM threshold flag, retired pages (fields 29-31), row
  remapping (fields 142-145) and its bank histogram, PCIe replays (field 94), PCIe
  generation and width (current and maximum), NVLink state and error counters per link
  (CRC flit, CRC data, replay, recovery; per-link fields, batched), MIG mode and
  instances.

Every field that the field-value API covers is read through one batched call per group
and GPU; fields a GPU does not support are dropped from its batch. States that rarely
change are read every fast tick but sent only when they change and on every slow tick:
the nine clock-event flags (a throttle shows within one fast interval) and the memory
size. The deprecated calls (nvmlDeviceGetTemperature,
nvmlDeviceGetCurrentClocksThrottleReasons) are used only with an nvidia-ml-py that
lacks their replacements.

Entities: samples are keyed by GPU UUID (PCI bus id when NVML gives no UUID); events
by the canonical PCI bus id, as the kernel-log parser keys them, so that an Xid or a
lost GPU seen by both is one finding. One gpu_identity event per GPU at start pairs
the two (analytics.fault_model.xid.uuid_map).

Robustness:

* Unsupported fields are omitted, never filled, and counted in :attr:`errors_total`
  (``not_supported``...) once per GPU and field; they are probed again every
  ``reprobe_seconds`` (MIG reconfiguration, driver update).
* A GPU that answers ``GPU_IS_LOST``, or whose handle can no longer be obtained,
  yields one ``Event(kind="gpu_lost")`` on its PCI bus id (the fault model's Xid 79
  class: critical, ``reboot_node``) while the other GPUs keep being read;
  ``NVML_ERROR_RESET_REQUIRED`` yields one ``reset_required`` event.
* No NVML library or driver raises :class:`core.errors.CollectorUnavailable` (the
  service reports it once and retries).
* The GPUs are read in a worker thread; a collection waits at most
  ``deadline_seconds``. A GPU whose NVML call hangs is reported (log, count
  ``deadline_exceeded``, one ``telemetry_gap`` event naming the call) and skipped until
  the call returns; the worker stays with it and the next collections go to another
  worker, so the other GPUs are served (those queued behind the hung one miss that one
  collection, counted as ``skipped_behind_late_gpu``).

Events (Xid, ECC, recovery action) come from :class:`collectors.nvml_events.NvmlEventWatcher`
and are returned by the next :meth:`NvmlCollector.collect`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from collectors.nvml_events import NvmlEventWatcher, WatchedGpu, nvml_event
from core.clock import Clock, system_clock
from core.errors import CollectorUnavailable
from core.ids import gpu_index_entity, normalize_pci_bus_id
from core.records import EntityId, Event, NodeName, Record, Sample

logger = logging.getLogger(__name__)

_TEMPERATURE_THRESHOLDS: tuple[tuple[int, str], ...] = (
    (0, "shutdown"),  # NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
    (1, "slowdown"),  # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    (3, "max_operating"),  # NVML_TEMPERATURE_THRESHOLD_GPU_MAX
)
"""The GPU's own temperature thresholds read in the slow group (ecosystem-reference §1)."""

CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "clocks_setting"),
    (0x004, "power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal"),
    (0x040, "hw_thermal"),
    (0x080, "hw_power_brake"),
    (0x100, "display_clocks"),
)
"""Clock event reason bits and their label values (dcgm-exporter's names, §1.4)."""

# NVML return codes (nvml.h; the binding's NVML_ERROR_* constants have these values).
_OK = 0
_ERR_INVALID_ARGUMENT = 2
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_NOT_FOUND = 6
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_RESET_REQUIRED = 16
_ERR_GPU_NOT_FOUND = 28
_ERR_UNKNOWN = 999
_REASONS = {
    1: "uninitialized",
    2: "invalid_argument",
    3: "not_supported",
    4: "no_permission",
    6: "not_found",
    9: "driver_not_loaded",
    10: "timeout",
    13: "function_not_found",
    14: "corrupted_inforom",
    15: "gpu_is_lost",
    16: "reset_required",
    21: "no_data",
    27: "not_ready",
    28: "gpu_not_found",
    999: "unknown",
}
_PERMANENT = frozenset(
    {_ERR_NOT_SUPPORTED, _ERR_FUNCTION_NOT_FOUND, _ERR_NO_PERMISSION, _ERR_INVALID_ARGUMENT}
)
"""Errors that will not go away by asking again: the field is skipped until re-probed."""
_HANDLE_LOST = frozenset({_ERR_GPU_IS_LOST, _ERR_UNKNOWN, _ERR_GPU_NOT_FOUND})
"""``nvmlDeviceGetHandleByIndex`` errors that mean the GPU is gone."""
_HINTS = {
    12: "no NVIDIA driver: libnvidia-ml.so.1 not found",
    9: "the NVIDIA kernel driver is not loaded",
    18: "the NVIDIA user-space library and kernel driver versions differ (reboot after upgrade?)",
    4: "no permission to use NVML",
}

# NVML enums (nvml.h).
_TEMPERATURE_GPU = 0
_CLOCK_SM, _CLOCK_MEM = 1, 2
_CORRECTED, _UNCORRECTED = 0, 1
_VOLATILE, _AGGREGATE = 0, 1
_LOCATION_DRAM, _LOCATION_SRAM = 2, 7
_NVLINK_COUNTERS = ((0, "replay"), (1, "recovery"), (2, "crc_flit"), (3, "crc_data"))
"""``NVML_NVLINK_ERROR_DL_*`` counters and their ``type`` label values."""

# Field ids (nvml.h ``NVML_FI_DEV_*``).
FI_MEMORY_TEMP = 82
FI_ENERGY = 83
FI_RECOVERY_ACTION = 230
FI_RESET_STATUS = 226
FI_DRAIN_AND_RESET_STATUS = 227
FI_NVLINK_LINK_COUNT = 91
FI_PCIE_REPLAY = 94

FAST_FIELDS: tuple[int, ...] = (FI_MEMORY_TEMP, FI_ENERGY, FI_RECOVERY_ACTION)
"""Fields of the fast group's batch (226/227 replace 230 where it is not supported)."""

_SCALAR_FIELDS: dict[int, tuple[str, float, Mapping[str, str]]] = {
    FI_MEMORY_TEMP: ("gpu_memory_temperature_celsius", 1.0, {}),
    FI_ENERGY: ("gpu_energy_joules_total", 1e-3, {}),
    FI_RECOVERY_ACTION: ("gpu_recovery_action", 1.0, {}),
    29: ("gpu_retired_pages", 1.0, {"cause": "multiple_sbe"}),
    30: ("gpu_retired_pages", 1.0, {"cause": "dbe"}),
    142: ("gpu_remapped_rows", 1.0, {"type": "correctable"}),
    143: ("gpu_remapped_rows", 1.0, {"type": "uncorrectable"}),
    FI_PCIE_REPLAY: ("gpu_pcie_replays_total", 1.0, {}),
}
"""Fields whose value is a sample as is: metric, scale to base units, labels."""

_FLAG_FIELDS: dict[int, str] = {
    31: "gpu_retired_pages_pending",
    144: "gpu_row_remap_pending",
    145: "gpu_row_remap_failure",
}
"""Fields that are flags (0/1)."""

_ECC_FIELDS: dict[int, tuple[str, str, str]] = {
    3: ("corrected", "volatile", "total"),
    4: ("uncorrected", "volatile", "total"),
    5: ("corrected", "aggregate", "total"),
    6: ("uncorrected", "aggregate", "total"),
    7: ("corrected", "volatile", "l1_cache"),
    8: ("uncorrected", "volatile", "l1_cache"),
    9: ("corrected", "volatile", "l2_cache"),
    10: ("uncorrected", "volatile", "l2_cache"),
    13: ("corrected", "volatile", "register_file"),
    14: ("uncorrected", "volatile", "register_file"),
    15: ("corrected", "volatile", "texture_memory"),
    16: ("uncorrected", "volatile", "texture_memory"),
    17: ("uncorrected", "volatile", "cbu"),
    18: ("corrected", "aggregate", "l1_cache"),
    19: ("uncorrected", "aggregate", "l1_cache"),
    20: ("corrected", "aggregate", "l2_cache"),
    21: ("uncorrected", "aggregate", "l2_cache"),
    24: ("corrected", "aggregate", "register_file"),
    25: ("uncorrected", "aggregate", "register_file"),
    26: ("corrected", "aggregate", "texture_memory"),
    27: ("uncorrected", "aggregate", "texture_memory"),
    28: ("uncorrected", "aggregate", "cbu"),
}
"""ECC fields: totals (3-6) and the pre-Ampere per-location counters (DRAM, fields 11/12
/22/23, is read with ``nvmlDeviceGetMemoryErrorCounter`` like SRAM)."""

SLOW_FIELDS: tuple[int, ...] = (
    29,
    30,
    31,
    142,
    143,
    144,
    145,
    FI_PCIE_REPLAY,
    FI_NVLINK_LINK_COUNT,
)
"""Fields of the slow group's batch besides ECC (read when ECC is enabled)."""

_NVLINK_FIELD_BASE = {
    "crc_flit": (32, 96),
    "crc_data": (39, 102),
    "replay": (46, 108),
    "recovery": (53, 114),
}
"""First per-link field id of links 0-5 and of links 6-11 for each NVLink counter
(``NVML_FI_DEV_NVLINK_<COUNTER>_ERROR_COUNT_L<n>``; none exist past link 11)."""
_NVLINK_FIELD_OF = {
    (kind, link): base[link // 6] + link % 6
    for kind, base in _NVLINK_FIELD_BASE.items()
    for link in range(12)
}
_NVLINK_FIELD_TYPE = {fid: kind for (kind, _link), fid in _NVLINK_FIELD_OF.items()}

_ECC_LOCATIONS = ((_LOCATION_SRAM, "sram"), (_LOCATION_DRAM, "dram"))
_NO_LABELS: Mapping[str, str] = {}
_REASON_LABELS: tuple[tuple[int, Mapping[str, str]], ...] = tuple(
    (bit, {"reason": label}) for bit, label in CLOCK_EVENT_REASONS
)
"""Label mappings shared by every sample of the hot path (samples are frozen; their labels
are read-only by contract), so that a tick allocates no label dicts."""
_MAX_LINKS = 64
_LINK_LABELS: tuple[Mapping[str, str], ...] = tuple({"link": str(n)} for n in range(_MAX_LINKS))
_LINK_TYPE_LABELS: dict[tuple[int, str], Mapping[str, str]] = {
    (n, kind): {"link": str(n), "type": kind}
    for n in range(_MAX_LINKS)
    for kind in ("crc_flit", "crc_data", "replay", "recovery")
}


def _link_labels(link: int, kind: str | None = None) -> Mapping[str, str]:
    if link < _MAX_LINKS:
        return _LINK_LABELS[link] if kind is None else _LINK_TYPE_LABELS[(link, kind)]
    return {"link": str(link)} if kind is None else {"link": str(link), "type": kind}


_HISTOGRAM = ("max", "high", "partial", "low", "none")
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


class _Lost(Exception):
    """The GPU answered GPU_IS_LOST."""


class _NotAvailable:
    __slots__ = ()


_NA: Any = _NotAvailable()
"""What :meth:`NvmlCollector._call` returns when the value is not available."""


@dataclass(eq=False)
class _Gpu:
    """One GPU as the collector tracks it."""

    index: int
    handle: Any
    entity: EntityId
    pci: EntityId
    uuid: str = ""
    unsupported: set[str] = field(default_factory=set)
    fast_fields: list[int] = field(default_factory=lambda: list(FAST_FIELDS))
    slow_fields: list[int] = field(default_factory=lambda: list(SLOW_FIELDS))
    ecc_fields: list[int] = field(default_factory=lambda: list(_ECC_FIELDS))
    nvlink_fields: list[tuple[int, int]] | None = None
    reasons_mask: int | None = None
    reasons_last: int | None = None
    recovery_checked: bool = False
    memory_total: int | None = None
    ecc_enabled: bool = False
    nvlink_links: int = 0
    lost: bool = False
    reset_reported: bool = False
    busy: bool = False
    late: bool = False
    current: str = ""
    new_unsupported: list[str] = field(default_factory=list)
    probed_at: float = 0.0


class _Worker(threading.Thread):
    """A daemon thread that runs collection ticks, one at a time.

    Attributes:
        idle: False while a tick runs (a worker stuck in a hung call stays busy).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.idle = True

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job()
            finally:
                self.idle = True


@dataclass(eq=False)
class _Tick:
    """One collection handed to a worker: the GPUs in order, and what came back."""

    gpus: list[_Gpu]
    now: float
    fast: bool
    slow: bool
    results: dict[int, list[Record]] = field(default_factory=dict)
    current: _Gpu | None = None
    abandoned: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class NvmlCollector:
    """Reads every GPU on this node through NVML (see the module docstring).

    Args:
        node: Node name put on every record.
        fast_interval_seconds: Interval of the fast group (power, temperatures, clocks,
            utilization, clock event reasons, recovery action), seconds. The service
            polls :meth:`collect` at this interval.
        slow_interval_seconds: Interval of the slow group (ECC, retired pages, row
            remapping, NVLink, PCIe, inventory, MIG), seconds.
        deadline_seconds: How long one :meth:`collect` waits for the GPUs, seconds;
            ``None``: 80 % of the fast interval. ``0`` reads the GPUs inline in the
            caller's thread (no protection against a hung call; benchmarks, tests).
        events: Watch NVML events (Xid, ECC, recovery action) in a thread.
        event_wait_ms: Timeout of each wait on the NVML event set, milliseconds: how
            long :meth:`close` may wait for the event thread.
        reprobe_seconds: How often fields found unsupported are tried again, seconds.
        nvml: The ``pynvml`` module, or a stand-in (``collectors.testing.FakeNvml``);
            imported lazily when ``None``.
        clock: Epoch seconds, stamped on every record.

    Raises:
        ValueError: A non-positive interval.
    """

    name = "nvml"

    def __init__(
        self,
        *,
        node: str,
        fast_interval_seconds: float = 1.0,
        slow_interval_seconds: float = 30.0,
        deadline_seconds: float | None = None,
        events: bool = True,
        event_wait_ms: int = 250,
        reprobe_seconds: float = 3600.0,
        nvml: Any = None,
        clock: Clock = system_clock,
    ) -> None:
        if fast_interval_seconds <= 0 or slow_interval_seconds <= 0:
            raise ValueError("fast_interval_seconds and slow_interval_seconds must be > 0")
        if deadline_seconds is not None and deadline_seconds < 0:
            raise ValueError("deadline_seconds must be >= 0")
        self.node = node
        self.fast_interval_seconds = fast_interval_seconds
        self.slow_interval_seconds = slow_interval_seconds
        self.deadline_seconds = (
            0.8 * fast_interval_seconds if deadline_seconds is None else deadline_seconds
        )
        self.events = events
        self.event_wait_ms = event_wait_ms
        self.reprobe_seconds = reprobe_seconds
        self.nvml = nvml
        self.clock = clock
        self.errors_total: Counter[str] = Counter()
        """Omitted fields and failures by reason (``not_supported``, ``gpu_is_lost``,
        ``deadline_exceeded``...): the service exports it as
        ``gpuhealth_collector_errors_total{collector,reason}``."""
        self._node = NodeName(node)
        self._lib: Any = None
        self._gpus: list[_Gpu] = []
        self._driver_version = ""
        self._fast_at: float | None = None
        self._slow_at: float | None = None
        self._pending: list[Record] = []
        self._watcher: NvmlEventWatcher | None = None
        self._logged: set[tuple[str, ...]] = set()
        self._fns: dict[str, Any] = {}
        self._temperature_fn = "nvmlDeviceGetTemperatureV"
        self._reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons"
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------------

    def _module(self) -> Any:
        if self.nvml is not None:
            return self.nvml
        try:
            import pynvml
        except ImportError as exc:
            raise CollectorUnavailable("NVML unavailable: nvidia-ml-py is not installed") from exc
        return pynvml

    def _start(self) -> Any:
        if self._lib is not None:
            return self._lib
        lib = self._module()
        try:
            lib.nvmlInit()
        except lib.NVMLError as exc:
            raise CollectorUnavailable(
                f"NVML unavailable: {_describe(exc)}", retry_after_seconds=60.0
            ) from exc
        except OSError as exc:
            raise CollectorUnavailable(f"NVML unavailable: {exc}") from exc
        self._lib = lib
        self._fns = {}
        # nvidia-ml-py older than the replacement calls: use the deprecated names
        self._temperature_fn = (
            "nvmlDeviceGetTemperatureV"
            if hasattr(lib, "nvmlDeviceGetTemperatureV")
            else "nvmlDeviceGetTemperature"
        )
        self._reasons_fn = (
            "nvmlDeviceGetCurrentClocksEventReasons"
            if hasattr(lib, "nvmlDeviceGetCurrentClocksEventReasons")
            else "nvmlDeviceGetCurrentClocksThrottleReasons"
        )
        try:
            count = int(lib.nvmlDeviceGetCount())
            try:
                self._driver_version = str(_text(lib.nvmlSystemGetDriverVersion()))
            except lib.NVMLError as exc:
                self._driver_version = ""
                self._count("driver_version", exc)
        except lib.NVMLError as exc:
            self._lib = None
            _shutdown(lib)
            raise CollectorUnavailable(f"NVML unavailable: {_describe(exc)}") from exc
        if count == 0:
            logger.warning("NVML is loaded but finds no GPU on this node")
        now = self.clock()
        self._gpus = [self._discover(i, now) for i in range(count)]
        self._fast_at = self._slow_at = None
        logger.info("NVML started: %d GPU(s), driver %s", count, self._driver_version or "?")
        if self.events:
            self._start_events()
        return lib

    def _discover(self, index: int, now: float) -> _Gpu:
        """Return the GPU at ``index``; one whose handle cannot be had is marked lost."""
        lib = self._lib
        gpu = _Gpu(
            index=index,
            handle=None,
            entity=EntityId(gpu_index_entity(index)),
            pci=EntityId(gpu_index_entity(index)),
            probed_at=now,
        )
        try:
            gpu.handle = lib.nvmlDeviceGetHandleByIndex(index)
        except lib.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _HANDLE_LOST:
                self._mark_lost(
                    gpu,
                    now,
                    f"nvmlDeviceGetHandleByIndex: {_describe(exc)}",
                    "nvml_gpu_is_lost" if code == _ERR_GPU_IS_LOST else "nvml_no_handle",
                )
            else:
                self._count_reason(_reason(exc))
                self._log_once(
                    ("handle", str(index)),
                    logging.WARNING,
                    "GPU %d: no NVML handle (%s); skipped, retried later",
                    index,
                    _describe(exc),
                )
            return gpu
        self._identify(gpu, now)
        return gpu

    def _identify(self, gpu: _Gpu, now: float) -> None:
        """Read the UUID and PCI bus id of a GPU that has a handle; announce the pair."""
        lib = self._lib
        index = gpu.index
        try:
            gpu.uuid = str(_text(lib.nvmlDeviceGetUUID(gpu.handle)))
        except lib.NVMLError as exc:
            if getattr(exc, "value", None) == _ERR_GPU_IS_LOST:
                self._mark_lost(gpu, now, "nvmlDeviceGetUUID", "nvml_gpu_is_lost")
                return
            self._count_reason(_reason(exc))
        try:
            bus_id = _text(lib.nvmlDeviceGetPciInfo_v3(gpu.handle).busId)
            pci = normalize_pci_bus_id(bus_id)
            if pci:
                gpu.pci = EntityId(pci)
        except lib.NVMLError as exc:
            if getattr(exc, "value", None) == _ERR_GPU_IS_LOST:
                self._mark_lost(gpu, now, "nvmlDeviceGetPciInfo_v3", "nvml_gpu_is_lost")
                return
            self._count_reason(_reason(exc))
        gpu.entity = EntityId(gpu.uuid) if gpu.uuid else gpu.pci
        if gpu.uuid and gpu.pci != gpu.entity:
            text = f"NVML: GPU {gpu.index} at PCI:{gpu.pci} is {gpu.uuid}"
            self._gpu_event(gpu, "gpu_identity", "uuid", now, text,
                            {"uuid": gpu.uuid, "index": str(index)})

    def _start_events(self) -> None:
        watched = [
            WatchedGpu(
                index=g.index,
                handle=g.handle,
                pci_bus_id=g.pci,
                sample_entity=g.entity,
                uuid=g.uuid,
            )
            for g in self._gpus
            if g.handle is not None and not g.lost
        ]
        if not watched:
            return
        watcher = NvmlEventWatcher(
            self._lib,
            watched,
            node=self.node,
            clock=self.clock,
            wait_ms=self.event_wait_ms,
            read_recovery_action=self._recovery_action_now,
            on_error=self._count_reason,
        )
        try:
            started = watcher.start()
        except Exception as exc:  # a broken binding must not take the polling down
            self._count_reason("event_thread")
            logger.warning("NVML events unavailable: %s", exc)
            return
        if started:
            self._watcher = watcher
        else:
            logger.info(
                "NVML events: no GPU supports Xid/ECC/recovery-action events; "
                "relying on the kernel log"
            )

    def close(self) -> None:
        """Stop the event thread and the workers, shut NVML down; :meth:`collect` restarts."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        for worker in self._workers:
            worker.jobs.put(None)  # a worker stuck in a hung call stays (daemon)
        self._workers = []
        if self._lib is not None:
            _shutdown(self._lib)
            self._lib, self._gpus = None, []

    # --- bookkeeping -------------------------------------------------------------------

    def _count_reason(self, reason: str, amount: int = 1) -> None:
        with self._lock:
            self.errors_total[reason] += amount

    def _count(self, what: str, exc: BaseException) -> None:
        reason = _reason(exc)
        self._count_reason(reason)
        self._log_once((what, reason), logging.INFO, "NVML %s failed: %s", what, _describe(exc))

    def _log_once(self, key: tuple[str, ...], level: int, msg: str, *args: object) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        logger.log(level, msg, *args)

    def _call(self, gpu: _Gpu, key: str, name: str, *args: Any) -> Any:
        """Call ``lib.<name>(*args)`` for ``gpu``; map its errors (see the module docstring).

        Returns:
            The result, or :data:`_NA` when the value is not available (counted).

        Raises:
            _Lost: The GPU answered GPU_IS_LOST.
        """
        if key in gpu.unsupported:
            return _NA
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = getattr(self._lib, name, _NA)
        if fn is _NA:  # a binding older than the call
            return self._unsupported(gpu, key, "function_not_found")
        gpu.current = name
        try:
            return fn(*args)
        except self._lib.NVMLError as exc:
            return self._failed(gpu, key, getattr(exc, "value", None), exc)

    def _failed(self, gpu: _Gpu, key: str, code: int | None, exc: BaseException | None) -> Any:
        if code == _ERR_GPU_IS_LOST:
            raise _Lost(key)
        if code == _ERR_NOT_FOUND:
            return _NA  # an empty slot (MIG device index): nothing to count
        reason = _REASONS.get(code, f"error_{code}") if code is not None else "unknown"
        if code == _ERR_RESET_REQUIRED:
            self._reset_required(gpu, key)
        if code in _PERMANENT:
            return self._unsupported(gpu, key, reason)
        self._count_reason(reason)
        self._log_once(
            (str(gpu.entity), key, reason),
            logging.WARNING,
            "GPU %s: reading %s failed: %s",
            gpu.entity,
            key,
            _describe(exc) if exc is not None else reason,
        )
        return _NA

    def _unsupported(self, gpu: _Gpu, key: str, reason: str) -> Any:
        gpu.unsupported.add(key)
        self._count_reason(reason)
        with self._lock:
            first = (str(gpu.entity), key, reason) not in self._logged
            self._logged.add((str(gpu.entity), key, reason))
        if first:  # logged once per GPU and field, one line per read (see _job)
            gpu.new_unsupported.append(key if reason == "not_supported" else f"{key} ({reason})")
        return _NA

    def _gpu_event(self, gpu: _Gpu, kind: str, code: str, now: float, text: str,
                   attrs: dict[str, str]) -> None:
        """Queue an NVML event about ``gpu`` (at its PCI address) for the next collect."""
        event = nvml_event(kind=kind, code=code, node=self._node, entity=gpu.pci,
                           observed_at=now, text=text, attrs=attrs)
        with self._lock:
            self._pending.append(event)

    def _reset_required(self, gpu: _Gpu, key: str) -> None:
        if gpu.reset_reported:
            return
        gpu.reset_reported = True
        text = f"NVML: GPU {gpu.pci} answered NVML_ERROR_RESET_REQUIRED while reading {key}"
        logger.warning("%s", text)
        self._gpu_event(gpu, "reset_required", "nvml_reset_required", self.clock(), text,
                        {"index": str(gpu.index)})

    def _mark_lost(self, gpu: _Gpu, now: float, what: str, code: str) -> None:
        if gpu.lost:
            return
        gpu.lost = True
        self._count_reason("gpu_is_lost")
        logger.warning(
            "GPU %s (index %d) is lost: %s; the other GPUs are still read", gpu.pci, gpu.index, what
        )
        text = f"NVML: GPU {gpu.index} ({gpu.pci}) is lost ({code}, from {what})"
        attrs = {"index": str(gpu.index)}
        if gpu.uuid:
            attrs["uuid"] = gpu.uuid
        self._gpu_event(gpu, "gpu_lost", code, now, text, attrs)

    def _recovery_action_now(self, watched: WatchedGpu) -> int | None:
        """Field 230 of one GPU, for an Xid 154 event (called from the event thread)."""
        lib = self._lib
        try:
            (entry,) = lib.nvmlDeviceGetFieldValues(watched.handle, [FI_RECOVERY_ACTION])
        except (lib.NVMLError, ValueError):
            return None
        if int(entry.nvmlReturn) != _OK:
            return None
        return int(_field_value(entry))

    # --- collection ----------------------------------------------------------------------

    def collect(self) -> Iterable[Sample | Event]:
        """Read the groups that are due, and return them with the events seen since.

        Returns:
            Samples of every GPU that answered within the deadline, NVML events, and
            ``gpu_lost`` / ``reset_required`` / ``telemetry_gap`` events.

        Raises:
            CollectorUnavailable: No NVML library or driver (``nvmlInit`` failed).
        """
        self._start()
        now = self.clock()
        fast = self._due(self._fast_at, self.fast_interval_seconds, now)
        slow = self._due(self._slow_at, self.slow_interval_seconds, now)
        if fast:
            self._fast_at = now
        if slow:
            self._slow_at = now
        out: list[Record] = []
        if fast or slow:
            out.extend(self._read_all(now, fast=fast, slow=slow))
        with self._lock:
            out.extend(self._pending)
            self._pending = []
        if self._watcher is not None:
            out.extend(self._watcher.drain())
        return out

    def _due(self, last: float | None, interval: float, now: float) -> bool:
        # slack of a quarter of the fast interval: a poll that comes a little early reads
        slack = 0.25 * min(interval, self.fast_interval_seconds)
        return last is None or now - last >= interval - slack

    def _read_all(self, now: float, *, fast: bool, slow: bool) -> list[Record]:
        gpus = [g for g in self._gpus if self._ready(g, now, slow)]
        out: list[Record] = []
        if self.deadline_seconds == 0:
            for gpu in gpus:
                out.extend(self._job(gpu, now, fast, slow))
            return out
        submitted: list[_Gpu] = []
        for gpu in gpus:
            if gpu.busy:  # still inside a call that hung in an earlier tick
                self._late(gpu, now)
            else:
                submitted.append(gpu)
        if not submitted:
            return []
        worker = self._worker()
        if worker is None:
            self._count_reason("deadline_exceeded", len(submitted))
            return []
        # One worker reads the GPUs one after the other and wakes this thread once: two
        # thread switches per tick, not two per GPU. A hung call keeps its worker; the
        # next tick goes to another one, without the hung GPU.
        tick = _Tick(gpus=submitted, now=now, fast=fast, slow=slow)
        worker.idle = False
        worker.jobs.put(functools.partial(self._run_tick, tick))
        tick.done.wait(self.deadline_seconds)
        with tick.lock:
            tick.abandoned = True
            results, current = dict(tick.results), tick.current
        for gpu in submitted:
            records = results.get(gpu.index)
            if records is not None:
                out.extend(records)
                if gpu.late:
                    gpu.late = False
                    logger.warning("GPU %s answers NVML again", gpu.pci)
            elif gpu is current:
                self._late(gpu, now)
            else:
                self._count_reason("skipped_behind_late_gpu")
        return out

    def _worker(self) -> _Worker | None:
        """An idle worker, started when none is; None when too many are stuck."""
        for worker in self._workers:
            if worker.idle:
                return worker
        if len(self._workers) > len(self._gpus):
            return None
        worker = _Worker(f"gpuhealth-nvml-{len(self._workers)}")
        worker.start()
        self._workers.append(worker)
        return worker

    def _run_tick(self, tick: _Tick) -> None:
        """Read the GPUs of one tick in order (in a worker), until done or abandoned."""
        for gpu in tick.gpus:
            with tick.lock:
                if tick.abandoned:
                    break
                tick.current = gpu
                gpu.busy = True
            records = self._job(gpu, tick.now, tick.fast, tick.slow)
            with tick.lock:
                tick.results[gpu.index] = records
                tick.current = None
        tick.done.set()

    @staticmethod
    def _ready(gpu: _Gpu, now: float, slow: bool) -> bool:
        """True when the GPU is to be read; a lost GPU is probed again on slow ticks."""
        del now
        return slow or (gpu.handle is not None and not gpu.lost)

    def _revive(self, gpu: _Gpu, now: float) -> bool:
        """Probe a lost GPU, or one without a handle (in a worker); True when it answers."""
        lib = self._lib
        if gpu.handle is None:
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(gpu.index)
            except lib.NVMLError:
                return False
            was_lost = gpu.lost
            gpu.handle, gpu.lost = handle, False
            self._identify(gpu, now)
            if gpu.lost:
                return False
            if was_lost:
                logger.warning("GPU %s (index %d) has an NVML handle again", gpu.pci, gpu.index)
            return True
        try:
            lib.nvmlDeviceGetUUID(gpu.handle)
        except lib.NVMLError:
            return False
        gpu.lost = gpu.reset_reported = False
        logger.warning("GPU %s (index %d) answers NVML again after GPU_IS_LOST", gpu.pci, gpu.index)
        return True

    def _late(self, gpu: _Gpu, now: float) -> None:
        self._count_reason("deadline_exceeded")
        if gpu.late:
            return
        gpu.late = True
        text = (
            f"NVML: GPU {gpu.index} ({gpu.pci}) did not answer within "
            f"{self.deadline_seconds:g} s (stuck in {gpu.current or 'an NVML call'}); "
            "its readings are skipped until the call returns"
        )
        logger.warning("%s", text)
        self._gpu_event(gpu, "telemetry_gap", "nvml_deadline_exceeded", now, text, {
            "index": str(gpu.index),
            "call": gpu.current or "",
            "deadline_seconds": f"{self.deadline_seconds:g}",
        })

    def _job(self, gpu: _Gpu, now: float, fast: bool, slow: bool) -> list[Record]:
        """Read one GPU (in a worker, or inline); never raises."""
        out: list[Record] = []
        try:
            if (gpu.handle is None or gpu.lost) and not self._revive(gpu, now):
                return out
            if slow and now - gpu.probed_at >= self.reprobe_seconds:
                self._reprobe(gpu, now)
            if slow:  # first: it learns which clock event reasons the GPU supports
                self._read_slow(gpu, now, out)
            if fast:
                self._read_fast(gpu, now, out, refresh=slow)
        except _Lost as lost:
            self._mark_lost(gpu, now, str(lost), "nvml_gpu_is_lost")
            out = []
        except Exception as exc:  # one GPU's surprise never stops the others
            self._count_reason("internal_error")
            self._log_once(
                (str(gpu.entity), "internal", type(exc).__name__),
                logging.ERROR,
                "GPU %s: reading NVML failed unexpectedly: %r",
                gpu.entity,
                exc,
            )
            logger.debug("GPU %s: reading NVML failed", gpu.entity, exc_info=True)
        finally:
            gpu.current = ""
            if gpu.new_unsupported:
                logger.info(
                    "GPU %s: not supported, omitted: %s", gpu.entity, ", ".join(gpu.new_unsupported)
                )
                gpu.new_unsupported = []
            gpu.busy = False
        return out

    def _reprobe(self, gpu: _Gpu, now: float) -> None:
        gpu.probed_at = now
        gpu.reasons_last = gpu.memory_total = None
        gpu.recovery_checked = False
        gpu.unsupported.clear()
        gpu.fast_fields = list(FAST_FIELDS)
        gpu.slow_fields = list(SLOW_FIELDS)
        gpu.ecc_fields = list(_ECC_FIELDS)
        gpu.nvlink_fields = None

    # --- samples ---------------------------------------------------------------------------

    def _s(
        self,
        gpu: _Gpu,
        metric: str,
        value: float,
        now: float,
        labels: Mapping[str, str] = _NO_LABELS,
    ) -> Sample:
        return Sample(
            metric=metric,
            value=float(value),
            observed_at=now,
            node=self._node,
            entity=gpu.entity,
            labels=labels,
        )

    def _fields(self, gpu: _Gpu, attr: str, now: float) -> dict[tuple[int, int], float]:
        """Read the batch ``gpu.<attr>`` (list of ids or ``(id, scope)``); drop unsupported ones.

        Returns:
            ``{(field id, scope id): value}`` of the entries that answered.
        """
        ids: list[Any] = getattr(gpu, attr)
        if not ids:
            return {}
        values = self._call(gpu, attr, "nvmlDeviceGetFieldValues", gpu.handle, ids)
        if values is _NA:
            return {}
        got: dict[tuple[int, int], float] = {}
        dropped: set[int] = set()
        for i, entry in enumerate(values):
            # entries come back in the order asked: the ids are ours, not re-read
            ret = entry.nvmlReturn
            item = ids[i]
            fid, scope = item if isinstance(item, tuple) else (item, 0)
            if ret == _OK:
                got[(fid, scope)] = _field_value(entry)
                continue
            key = f"field:{fid}" + (f"/{scope}" if scope else "")
            if ret in _PERMANENT:
                dropped.add(i)
            self._failed(gpu, key, ret, None)
        if dropped:
            setattr(gpu, attr, [fid for i, fid in enumerate(ids) if i not in dropped])
        return got

    def _read_fast(self, gpu: _Gpu, now: float, out: list[Record], *, refresh: bool) -> None:
        """Read the fast group; ``refresh`` (a slow tick) also re-sends unchanged states.

        The hot path: samples are built by a local helper, label mappings are shared.
        """
        h = gpu.handle
        call = self._call
        add = out.append
        node, entity = self._node, gpu.entity

        def sample(metric: str, value: float, labels: Mapping[str, str] = _NO_LABELS) -> None:
            add(Sample(metric=metric, value=value, observed_at=now, node=node, entity=entity,
                       labels=labels))

        value = call(gpu, "temperature", self._temperature_fn, h, _TEMPERATURE_GPU)
        if value is not _NA:
            sample("gpu_temperature_celsius", float(value))
        value = call(gpu, "power", "nvmlDeviceGetPowerUsage", h)
        if value is not _NA:
            sample("gpu_power_watts", value * 1e-3)
        util = call(gpu, "utilization", "nvmlDeviceGetUtilizationRates", h)
        if util is not _NA:
            sample("gpu_utilization_ratio", util.gpu / 100.0)
            sample("gpu_memory_utilization_ratio", util.memory / 100.0)
        mem = call(gpu, "memory", "nvmlDeviceGetMemoryInfo", h)
        if mem is not _NA:
            sample("gpu_memory_used_bytes", float(mem.used))
            total = mem.total
            if refresh or gpu.memory_total != total:  # fixed: sent when it changes
                gpu.memory_total = total
                sample("gpu_memory_total_bytes", float(total))
        value = call(gpu, "sm_clock", "nvmlDeviceGetClockInfo", h, _CLOCK_SM)
        if value is not _NA:
            sample("gpu_sm_clock_hertz", value * 1e6)
        value = call(gpu, "memory_clock", "nvmlDeviceGetClockInfo", h, _CLOCK_MEM)
        if value is not _NA:
            sample("gpu_memory_clock_hertz", value * 1e6)
        value = call(gpu, "clock_event_reasons", self._reasons_fn, h)
        if value is not _NA and (refresh or value != gpu.reasons_last):
            # read every tick; the 0/1 series are sent when the mask changes and on every
            # slow tick (a throttle shows within one fast interval, idle flags cost nothing)
            gpu.reasons_last = value
            supported = gpu.reasons_mask
            for bit, labels in _REASON_LABELS:
                if supported is None or supported & bit:
                    sample("gpu_clock_event_active", 1.0 if value & bit else 0.0, labels)
        fields = self._fields(gpu, "fast_fields", now)
        if not gpu.recovery_checked and FI_RECOVERY_ACTION not in gpu.fast_fields:
            # field 230 is not supported here: fall back to the (deprecated) fields it replaced
            gpu.recovery_checked = True
            gpu.fast_fields = [*gpu.fast_fields, FI_RESET_STATUS, FI_DRAIN_AND_RESET_STATUS]
            fields.update(self._fields(gpu, "fast_fields", now))
        elif FI_RECOVERY_ACTION in gpu.fast_fields:
            gpu.recovery_checked = True
        reset_fields = False
        for (fid, _scope), raw in fields.items():
            spec = _SCALAR_FIELDS.get(fid)
            if spec is not None:
                sample(spec[0], raw * spec[1], spec[2])
            elif fid in (FI_RESET_STATUS, FI_DRAIN_AND_RESET_STATUS):
                reset_fields = True
        if reset_fields:
            drain = fields.get((FI_DRAIN_AND_RESET_STATUS, 0), 0.0)
            reset = fields.get((FI_RESET_STATUS, 0), 0.0)
            action = 4.0 if drain else 1.0 if reset else 0.0
            add(self._s(gpu, "gpu_recovery_action", action, now))

    def _read_slow(self, gpu: _Gpu, now: float, out: list[Record]) -> None:
        h = gpu.handle
        call = self._call
        self._info(gpu, now, out)
        value = call(gpu, "power_limit", "nvmlDeviceGetEnforcedPowerLimit", h)
        if value is not _NA:
            out.append(self._s(gpu, "gpu_power_limit_watts", value * 1e-3, now))
        for which, name in _TEMPERATURE_THRESHOLDS:
            value = call(gpu, f"temperature_threshold_{name}",
                         "nvmlDeviceGetTemperatureThreshold", h, which)
            if value is not _NA:
                out.append(self._s(gpu, "gpu_temperature_threshold_celsius", float(value), now,
                                   {"threshold": name}))
        value = call(gpu, "fan", "nvmlDeviceGetFanSpeed", h)
        if value is not _NA:
            out.append(self._s(gpu, "gpu_fan_speed_ratio", value / 100.0, now))
        value = call(
            gpu, "clock_event_reasons_supported", "nvmlDeviceGetSupportedClocksEventReasons", h
        )
        gpu.reasons_mask = None if value is _NA else int(value)
        mode = call(gpu, "ecc_mode", "nvmlDeviceGetEccMode", h)
        gpu.ecc_enabled = mode is not _NA and bool(mode[0])
        fields = self._fields(gpu, "slow_fields", now)
        if gpu.ecc_enabled:
            fields.update(self._fields(gpu, "ecc_fields", now))
        for (fid, _scope), raw in fields.items():
            scalar = _SCALAR_FIELDS.get(fid)
            if scalar is not None:
                out.append(self._s(gpu, scalar[0], raw * scalar[1], now, scalar[2]))
            elif fid in _FLAG_FIELDS:
                out.append(self._s(gpu, _FLAG_FIELDS[fid], 1.0 if raw else 0.0, now))
            elif fid in _ECC_FIELDS:
                kind, scope, location = _ECC_FIELDS[fid]
                out.append(
                    self._s(
                        gpu,
                        "gpu_ecc_errors_total",
                        raw,
                        now,
                        {"type": kind, "scope": scope, "location": location},
                    )
                )
        if gpu.ecc_enabled:
            self._ecc_locations(gpu, now, out)
        self._remap_histogram(gpu, now, out)
        self._pcie(gpu, now, out)
        links = fields.get((FI_NVLINK_LINK_COUNT, 0))
        gpu.nvlink_links = int(links) if links is not None else 0
        if gpu.nvlink_links:
            self._nvlink(gpu, now, out)
        self._mig(gpu, now, out)

    def _info(self, gpu: _Gpu, now: float, out: list[Record]) -> None:
        def text(key: str, name: str) -> str:
            value = self._call(gpu, key, name, gpu.handle)
            return "" if value is _NA else str(_text(value))

        labels = {
            "uuid": gpu.uuid,
            "serial": text("serial", "nvmlDeviceGetSerial"),
            "model": text("name", "nvmlDeviceGetName"),
            "pci_bus_id": gpu.pci if gpu.pci != gpu_index_entity(gpu.index) else "",
            "index": str(gpu.index),
            "driver_version": self._driver_version,
            "vbios_version": text("vbios_version", "nvmlDeviceGetVbiosVersion"),
        }
        out.append(self._s(gpu, "gpu_info", 1.0, now, labels))

    def _ecc_locations(self, gpu: _Gpu, now: float, out: list[Record]) -> None:
        for location, label in _ECC_LOCATIONS:
            for kind, kind_label in ((_CORRECTED, "corrected"), (_UNCORRECTED, "uncorrected")):
                for counter, scope in ((_VOLATILE, "volatile"), (_AGGREGATE, "aggregate")):
                    value = self._call(
                        gpu,
                        f"ecc:{label}:{kind_label}:{scope}",
                        "nvmlDeviceGetMemoryErrorCounter",
                        gpu.handle,
                        kind,
                        counter,
                        location,
                    )
                    if value is not _NA:
                        out.append(
                            self._s(
                                gpu,
                                "gpu_ecc_errors_total",
                                value,
                                now,
                                {"type": kind_label, "scope": scope, "location": label},
                            )
                        )
        if "sram_status" in gpu.unsupported:
            return
        status_type = getattr(self._lib, "c_nvmlEccSramErrorStatus_v1_t", None)
        if status_type is None:
            self._unsupported(gpu, "sram_status", "function_not_found")
            return
        status = status_type()
        if (
            self._call(
                gpu,
                "sram_status",
                "nvmlDeviceGetSramEccErrorStatus",
                gpu.handle,
                ctypes.byref(status),
            )
            is not _NA
        ):
            out.append(
                self._s(
                    gpu,
                    "gpu_sram_threshold_exceeded",
                    1.0 if status.bThresholdExceeded else 0.0,
                    now,
                )
            )

    def _remap_histogram(self, gpu: _Gpu, now: float, out: list[Record]) -> None:
        hist = self._call(gpu, "remap_histogram", "nvmlDeviceGetRowRemapperHistogram", gpu.handle)
        if hist is _NA:
            return
        for name in _HISTOGRAM:
            out.append(
                self._s(
                    gpu,
                    "gpu_row_remap_bank_availability",
                    getattr(hist, name),
                    now,
                    {"availability": name},
                )
            )

    def _pcie(self, gpu: _Gpu, now: float, out: list[Record]) -> None:
        for metric, bound, name in (
            ("gpu_pcie_link_generation", "current", "nvmlDeviceGetCurrPcieLinkGeneration"),
            ("gpu_pcie_link_generation", "max", "nvmlDeviceGetMaxPcieLinkGeneration"),
            ("gpu_pcie_link_width", "current", "nvmlDeviceGetCurrPcieLinkWidth"),
            ("gpu_pcie_link_width", "max", "nvmlDeviceGetMaxPcieLinkWidth"),
        ):
            value = self._call(gpu, name, name, gpu.handle)
            if value is not _NA:
                out.append(self._s(gpu, metric, value, now, {"bound": bound}))

    def _nvlink(self, gpu: _Gpu, now: float, out: list[Record]) -> None:
        up: list[int] = []
        for link in range(gpu.nvlink_links):
            state = self._call(
                gpu, f"nvlink_state:{link}", "nvmlDeviceGetNvLinkState", gpu.handle, link
            )
            if state is _NA:
                continue
            up.append(link)
            out.append(
                self._s(gpu, "gpu_nvlink_state", 1.0 if state else 0.0, now, _link_labels(link))
            )
        if gpu.nvlink_fields is None:
            # per-link fields ignore the scope id; it is set to the link to read it back
            gpu.nvlink_fields = [
                (_NVLINK_FIELD_OF[(kind, link)], link)
                for link in up
                if link < 12
                for kind in _NVLINK_FIELD_BASE
            ]
        for (fid, link), raw in self._fields(gpu, "nvlink_fields", now).items():
            out.append(
                self._s(
                    gpu,
                    "gpu_nvlink_errors_total",
                    raw,
                    now,
                    _link_labels(link, _NVLINK_FIELD_TYPE[fid]),
                )
            )
        for link in (lk for lk in up if lk >= 12):
            for counter, kind in _NVLINK_COUNTERS:
                value = self._call(
                    gpu,
                    f"nvlink_error:{link}:{kind}",
                    "nvmlDeviceGetNvLinkErrorCounter",
                    gpu.handle,
                    link,
                    counter,
                )
                if value is not _NA:
                    out.append(
                        self._s(
                            gpu, "gpu_nvlink_errors_total", value, now, _link_labels(link, kind)
                        )
                    )

    def _mig(self, gpu: _Gpu, now: float, out: list[Record]) -> None:
        mode = self._call(gpu, "mig_mode", "nvmlDeviceGetMigMode", gpu.handle)
        if mode is _NA:
            return
        enabled = bool(mode[0])
        out.append(self._s(gpu, "gpu_mig_mode", 1.0 if enabled else 0.0, now))
        if not enabled:
            return
        slots = self._call(gpu, "mig_max", "nvmlDeviceGetMaxMigDeviceCount", gpu.handle)
        if slots is _NA:
            return
        instances = 0
        for slot in range(int(slots)):
            mig = self._call(
                gpu, f"mig_handle:{slot}", "nvmlDeviceGetMigDeviceHandleByIndex", gpu.handle, slot
            )
            if mig is _NA:
                continue
            instances += 1
            gi = self._call(gpu, "mig_gpu_instance", "nvmlDeviceGetGpuInstanceId", mig)
            mem = self._call(gpu, "mig_memory", "nvmlDeviceGetMemoryInfo", mig)
            if gi is not _NA and mem is not _NA:
                out.append(
                    self._s(
                        gpu, "gpu_mig_memory_used_bytes", mem.used, now, {"gpu_instance": str(gi)}
                    )
                )
        out.append(self._s(gpu, "gpu_mig_instances", instances, now))

    def __repr__(self) -> str:
        return (
            f"NvmlCollector(node={self.node!r}, fast_interval_seconds="
            f"{self.fast_interval_seconds!r}, slow_interval_seconds="
            f"{self.slow_interval_seconds!r})"
        )


# --------------------------------------------------------------------------- helpers


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    return _REASONS.get(code, f"error_{code}") if isinstance(code, int) else "unknown"


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc) or type(exc).__name__
    except Exception:  # pynvml's __str__ calls into the library
        text = type(exc).__name__
    code = getattr(exc, "value", None)
    hint = _HINTS.get(code) if isinstance(code, int) else None
    return f"{hint} ({text})" if hint else text


def _shutdown(lib: Any) -> None:
    try:
        lib.nvmlShutdown()
    except Exception:  # shutting down after a failure: nothing more to do
        logger.debug("nvmlShutdown failed", exc_info=True)


def _field_value(entry: Any) -> float:
    """Read the union member of a ``c_nvmlFieldValue_t`` that ``valueType`` names."""
    kind = int(entry.valueType)
    member = _VALUE_MEMBERS[kind] if 0 <= kind < len(_VALUE_MEMBERS) else "ullVal"
    return float(getattr(entry.value, member))
