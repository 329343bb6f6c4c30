"""Live GPU telemetry through NVML (``nvidia-ml-py``, import name ``pynvml``).

A basic collector: every call of :meth:`NvmlCollector.collect` reads the fast fields
(temperatures, power, energy, utilization, memory, clocks, clock event reasons) and, once
per ``slow_interval_seconds``, the slow ones (identity, ECC, row remapping, retired pages,
PCIe replays, recovery action). Units are converted here and nowhere else: mW → W,
mJ → J, % → ratio, MHz → Hz (ecosystem-reference §1, §11).

Fields the device does not support are omitted and counted in :attr:`errors_total`
(``not_supported``); each (GPU, field) is tried once and then skipped until NVML is
initialised again. A GPU that answers ``GPU_IS_LOST`` yields one ``gpu_lost`` event while
the other GPUs keep being read. No NVML library or driver raises
:class:`core.errors.CollectorUnavailable`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from core.clock import Clock, system_clock
from core.errors import CollectorUnavailable
from core.ids import gpu_index_entity, normalize_pci_bus_id
from core.records import EntityId, Event, Evidence, NodeName, Sample

logger = logging.getLogger(__name__)

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

_FIELD_MEMORY_TEMP = 82
_FIELD_RECOVERY_ACTION = 230
_MHZ = 1e6

# NVML return codes (nvml.h); the injected module's constants win when present.
_ERR_NOT_SUPPORTED = 3
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_REASONS = {
    3: "not_supported",
    4: "no_permission",
    13: "function_not_found",
    15: "gpu_is_lost",
    16: "reset_required",
    14: "corrupted_inforom",
    2: "invalid_argument",
    10: "timeout",
    21: "no_data",
    27: "not_ready",
    999: "unknown",
}

_HINTS = {
    12: "no NVIDIA driver: libnvidia-ml.so.1 not found",
    9: "the NVIDIA kernel driver is not loaded",
    18: "the NVIDIA user-space library and kernel driver versions differ (reboot after upgrade?)",
    4: "no permission to use NVML",
}


class _Skip(Exception):
    """The field could not be read; it is omitted."""


class _Lost(Exception):
    """The GPU answered GPU_IS_LOST."""


@dataclass
class _Gpu:
    index: int
    handle: Any
    entity: EntityId
    uuid: str = ""
    pci_bus_id: str = ""
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False


class NvmlCollector:
    """Reads every GPU on this node through NVML.

    Args:
        node: Node name put on every record.
        fast_interval_seconds: How often the service polls (power, temperatures, clocks,
            utilization, clock events), seconds.
        slow_interval_seconds: Minimum seconds between two reads of the slow fields (ECC,
            retired pages, row remapping, PCIe replays, recovery action, identity).
        nvml: The ``pynvml`` module, or a stand-in for tests; imported lazily when ``None``.
        clock: Epoch seconds, stamped on every record.
    """

    name = "nvml"

    def __init__(
        self,
        *,
        node: str,
        fast_interval_seconds: float = 1.0,
        slow_interval_seconds: float = 30.0,
        nvml: Any = None,
        clock: Clock = system_clock,
    ) -> None:
        if fast_interval_seconds <= 0 or slow_interval_seconds <= 0:
            raise ValueError("fast_interval_seconds and slow_interval_seconds must be > 0")
        self.node = node
        self.fast_interval_seconds = fast_interval_seconds
        self.slow_interval_seconds = slow_interval_seconds
        self.nvml = nvml
        self.clock = clock
        self.errors_total: Counter[str] = Counter()
        """Omitted fields and failures by reason (``not_supported``, ``gpu_is_lost``...)."""
        self._lib: Any = None
        self._gpus: list[_Gpu] = []
        self._driver_version = ""
        self._slow_at: float | None = None
        self._logged: set[tuple[str, ...]] = set()

    # --- lifecycle -------------------------------------------------------------------

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
                f"NVML unavailable: {self._describe(lib, exc)}", retry_after_seconds=60.0
            ) from exc
        except OSError as exc:
            raise CollectorUnavailable(f"NVML unavailable: {exc}") from exc
        try:
            count = int(lib.nvmlDeviceGetCount())
            self._driver_version = str(self._text(lib.nvmlSystemGetDriverVersion()))
            gpus = [self._discover(lib, i) for i in range(count)]
        except lib.NVMLError as exc:
            self._shutdown(lib)
            raise CollectorUnavailable(f"NVML unavailable: {self._describe(lib, exc)}") from exc
        self._lib, self._gpus, self._slow_at = lib, gpus, None
        logger.info("NVML started: %d GPU(s), driver %s", count, self._driver_version)
        return lib

    def _discover(self, lib: Any, index: int) -> _Gpu:
        """Return the GPU at ``index``; one that is lost gets no handle (retried per collect)."""
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
        except lib.NVMLError as exc:
            if self._code(lib, exc) != getattr(lib, "NVML_ERROR_GPU_IS_LOST", _ERR_GPU_IS_LOST):
                raise
            return _Gpu(index=index, handle=None, entity=EntityId(gpu_index_entity(index)))
        uuid = pci = ""
        try:
            uuid = str(self._text(lib.nvmlDeviceGetUUID(handle)))
        except lib.NVMLError:
            logger.info("GPU %d: no UUID from NVML; keyed by PCI bus id", index)
        try:
            bus_id = self._text(lib.nvmlDeviceGetPciInfo(handle).busId)
            pci = normalize_pci_bus_id(bus_id) or ""
        except lib.NVMLError:
            pci = ""
        entity = EntityId(uuid or pci or gpu_index_entity(index))
        return _Gpu(index=index, handle=handle, entity=entity, uuid=uuid, pci_bus_id=pci)

    @staticmethod
    def _shutdown(lib: Any) -> None:
        try:
            lib.nvmlShutdown()
        except Exception:  # shutting down after a failure: nothing more to do
            logger.debug("nvmlShutdown failed", exc_info=True)

    def close(self) -> None:
        """Shut NVML down; the next :meth:`collect` initialises it again."""
        if self._lib is not None:
            self._shutdown(self._lib)
            self._lib, self._gpus = None, []

    # --- helpers ---------------------------------------------------------------------

    @staticmethod
    def _text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def _code(self, lib: Any, exc: BaseException) -> int | None:
        value = getattr(exc, "value", None)
        return value if isinstance(value, int) else None

    def _describe(self, lib: Any, exc: BaseException) -> str:
        try:
            text = str(exc) or type(exc).__name__
        except Exception:
            text = type(exc).__name__
        hint = _HINTS.get(self._code(lib, exc) or 0)
        return f"{hint} ({text})" if hint else text

    def _reason(self, lib: Any, exc: BaseException) -> str:
        code = self._code(lib, exc)
        return _REASONS.get(code, f"error_{code}") if code is not None else "unknown"

    def _log_once(self, key: tuple[str, ...], msg: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.info(msg, *args)

    def _read(self, gpu: _Gpu, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call one NVML function for one GPU, mapping its errors.

        Raises:
            _Skip: The field is not available; it was counted (and skipped from now on
                when not supported).
            _Lost: The GPU is lost.
        """
        if what in gpu.unsupported:
            raise _Skip(what)
        lib = self._lib
        try:
            return fn(gpu.handle, *args)
        except lib.NVMLError as exc:
            code = self._code(lib, exc)
            if code == getattr(lib, "NVML_ERROR_GPU_IS_LOST", _ERR_GPU_IS_LOST):
                raise _Lost(what) from exc
            reason = self._reason(lib, exc)
            if code in (
                getattr(lib, "NVML_ERROR_NOT_SUPPORTED", _ERR_NOT_SUPPORTED),
                getattr(lib, "NVML_ERROR_FUNCTION_NOT_FOUND", _ERR_FUNCTION_NOT_FOUND),
            ):
                gpu.unsupported.add(what)
                self.errors_total[reason] += 1
                self._log_once(
                    (str(gpu.entity), what, reason),
                    "GPU %s: %s %s; omitted",
                    gpu.entity,
                    what,
                    reason.replace("_", " "),
                )
            else:
                self.errors_total[reason] += 1
                self._log_once(
                    (str(gpu.entity), what, reason),
                    "GPU %s: reading %s failed: %s",
                    gpu.entity,
                    what,
                    self._describe(lib, exc),
                )
            raise _Skip(what) from exc

    def _field(self, gpu: _Gpu, what: str, field_id: int) -> float:
        """Read one field value (``nvmlDeviceGetFieldValues``), checking its own status."""
        lib = self._lib
        fn = getattr(lib, "nvmlDeviceGetFieldValues", None)
        if fn is None:
            gpu.unsupported.add(what)
            self.errors_total["not_supported"] += 1
            raise _Skip(what)
        (value,) = self._read(gpu, what, fn, [field_id])[:1]
        ret = int(getattr(value, "nvmlReturn", 0))
        if ret != 0:
            if ret == getattr(lib, "NVML_ERROR_GPU_IS_LOST", _ERR_GPU_IS_LOST):
                raise _Lost(what)
            reason = _REASONS.get(ret, f"error_{ret}")
            if ret in (_ERR_NOT_SUPPORTED, _ERR_FUNCTION_NOT_FOUND):
                gpu.unsupported.add(what)
            self.errors_total[reason] += 1
            self._log_once(
                (str(gpu.entity), what, reason),
                "GPU %s: %s %s; omitted",
                gpu.entity,
                what,
                reason.replace("_", " "),
            )
            raise _Skip(what)
        union = value.value
        kind = int(getattr(value, "valueType", 1))
        member = {
            0: "dVal",
            1: "uiVal",
            2: "ulVal",
            3: "ullVal",
            4: "sllVal",
            5: "siVal",
            6: "usVal",
        }.get(kind, "uiVal")
        return float(getattr(union, member))

    # --- collection ------------------------------------------------------------------

    def collect(self) -> Iterable[Sample | Event]:
        """Read every GPU once.

        Returns:
            Samples of the fast fields (and the slow ones when due) for every GPU that
            answers, plus one ``gpu_lost`` event per GPU that was lost since the last call.

        Raises:
            CollectorUnavailable: No NVML library or driver (``nvmlInit`` failed).
        """
        self._start()
        now = self.clock()
        slow = self._slow_at is None or now - self._slow_at >= self.slow_interval_seconds
        if slow:
            self._slow_at = now
        out: list[Sample | Event] = []
        for position, known in enumerate(self._gpus):
            gpu = known
            records: list[Sample | Event] = []
            try:
                if gpu.handle is None:
                    gpu = self._rediscover(position, known)
                self._fast(gpu, now, records)
                if slow:
                    self._slow(gpu, now, records)
            except _Lost as lost:
                if not gpu.lost:
                    gpu.lost = True
                    self.errors_total["gpu_is_lost"] += 1
                    logger.warning(
                        "GPU %s (index %d) is lost: NVML answered GPU_IS_LOST",
                        gpu.entity,
                        gpu.index,
                    )
                    out.append(self._lost_event(gpu, now, str(lost)))
                continue
            except _Skip:
                continue
            gpu.lost = False
            out.extend(records)
        return out

    def _rediscover(self, position: int, gpu: _Gpu) -> _Gpu:
        """Try again to get a handle for a GPU that was lost at start-up.

        Raises:
            _Lost: It is still lost.
        """
        lib = self._lib
        try:
            found = self._discover(lib, gpu.index)
        except lib.NVMLError as exc:
            raise _Skip("handle") from exc
        if found.handle is None:
            raise _Lost("handle")
        self._gpus[position] = found
        return found

    def _lost_event(self, gpu: _Gpu, now: float, what: str) -> Event:
        text = f"NVML: GPU {gpu.index} ({gpu.entity}) is lost (GPU_IS_LOST while reading {what})"
        attrs = {"index": str(gpu.index)}
        if gpu.pci_bus_id:
            attrs["pci_bus_id"] = gpu.pci_bus_id
        return Event(
            kind="gpu_lost",
            code="nvml_gpu_is_lost",
            node=NodeName(self.node),
            entity=gpu.entity,
            observed_at=now,
            message=text,
            attrs=attrs,
            evidence=(Evidence(file="nvml", line=None, text=text),),
            source="nvml",
        )

    def _sample(
        self, gpu: _Gpu, metric: str, value: float, now: float, labels: dict[str, str] | None = None
    ) -> Sample:
        return Sample(
            metric=metric,
            value=float(value),
            observed_at=now,
            node=NodeName(self.node),
            entity=gpu.entity,
            labels=labels or {},
        )

    def _try(
        self,
        out: list[Sample | Event],
        gpu: _Gpu,
        now: float,
        metric: str,
        read: Callable[[], Any],
        labels: dict[str, str] | None = None,
        *,
        scale: float = 1.0,
        count: bool = False,
    ) -> None:
        try:
            raw = read()
        except _Skip:
            return
        value = float(len(raw)) if count else float(raw) * scale
        out.append(self._sample(gpu, metric, value, now, labels))

    def _temperature(self, gpu: _Gpu) -> float:
        lib = self._lib
        sensor = getattr(lib, "NVML_TEMPERATURE_GPU", 0)
        fn_v = getattr(lib, "nvmlDeviceGetTemperatureV", None)
        if fn_v is not None and "temperature_v" not in gpu.unsupported:
            try:
                return float(self._read(gpu, "temperature_v", fn_v, sensor))
            except _Skip:
                pass
        return float(self._read(gpu, "temperature", lib.nvmlDeviceGetTemperature, sensor))

    def _fast(self, gpu: _Gpu, now: float, out: list[Sample | Event]) -> None:
        lib = self._lib
        r = self._read
        self._try(out, gpu, now, "gpu_temperature_celsius", lambda: self._temperature(gpu))
        self._try(
            out,
            gpu,
            now,
            "gpu_memory_temperature_celsius",
            lambda: self._field(gpu, "memory_temperature", _FIELD_MEMORY_TEMP),
        )
        self._try(
            out,
            gpu,
            now,
            "gpu_power_watts",
            lambda: r(gpu, "power", lib.nvmlDeviceGetPowerUsage) / 1000.0,
        )
        self._try(
            out,
            gpu,
            now,
            "gpu_energy_joules_total",
            lambda: r(gpu, "energy", lib.nvmlDeviceGetTotalEnergyConsumption) / 1000.0,
        )
        try:
            util = r(gpu, "utilization", lib.nvmlDeviceGetUtilizationRates)
        except _Skip:
            pass
        else:
            out.append(self._sample(gpu, "gpu_utilization_ratio", util.gpu / 100.0, now))
            out.append(self._sample(gpu, "gpu_memory_utilization_ratio", util.memory / 100.0, now))
        try:
            mem = r(gpu, "memory", lib.nvmlDeviceGetMemoryInfo)
        except _Skip:
            pass
        else:
            out.append(self._sample(gpu, "gpu_memory_used_bytes", mem.used, now))
            out.append(self._sample(gpu, "gpu_memory_total_bytes", mem.total, now))
        for metric, clock_name in (
            ("gpu_sm_clock_hertz", "NVML_CLOCK_SM"),
            ("gpu_memory_clock_hertz", "NVML_CLOCK_MEM"),
        ):
            clock_type = getattr(lib, clock_name, 1 if clock_name == "NVML_CLOCK_SM" else 2)
            read = functools.partial(r, gpu, metric, lib.nvmlDeviceGetClockInfo, clock_type)
            self._try(out, gpu, now, metric, read, scale=_MHZ)
        self._clock_events(gpu, now, out)

    def _clock_events(self, gpu: _Gpu, now: float, out: list[Sample | Event]) -> None:
        lib = self._lib
        current = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        if current is None:
            return
        try:
            mask = int(self._read(gpu, "clock_event_reasons", current))
        except _Skip:
            return
        supported_fn = getattr(lib, "nvmlDeviceGetSupportedClocksEventReasons", None) or getattr(
            lib, "nvmlDeviceGetSupportedClocksThrottleReasons", None
        )
        supported = 0xFFFFFFFFFFFFFFFF
        if supported_fn is not None:
            with contextlib.suppress(_Skip):
                supported = int(self._read(gpu, "supported_clock_event_reasons", supported_fn))
        for bit, reason in CLOCK_EVENT_REASONS:
            if supported & bit:
                out.append(
                    self._sample(
                        gpu,
                        "gpu_clock_event_active",
                        1.0 if mask & bit else 0.0,
                        now,
                        {"reason": reason},
                    )
                )

    def _slow(self, gpu: _Gpu, now: float, out: list[Sample | Event]) -> None:
        lib = self._lib
        r = self._read
        self._info(gpu, now, out)
        self._try(
            out,
            gpu,
            now,
            "gpu_power_limit_watts",
            lambda: r(gpu, "power_limit", lib.nvmlDeviceGetEnforcedPowerLimit) / 1000.0,
        )
        corrected = getattr(lib, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        uncorrected = getattr(lib, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        volatile = getattr(lib, "NVML_VOLATILE_ECC", 0)
        aggregate = getattr(lib, "NVML_AGGREGATE_ECC", 1)
        for type_name, err_type in (("corrected", corrected), ("uncorrected", uncorrected)):
            for scope, counter in (("volatile", volatile), ("aggregate", aggregate)):
                read = functools.partial(
                    r,
                    gpu,
                    f"ecc_{type_name}_{scope}",
                    lib.nvmlDeviceGetTotalEccErrors,
                    err_type,
                    counter,
                )
                self._try(
                    out,
                    gpu,
                    now,
                    "gpu_ecc_errors_total",
                    read,
                    {"type": type_name, "scope": scope, "location": "all"},
                )
        try:
            corr, unc, pending, failure = r(gpu, "remapped_rows", lib.nvmlDeviceGetRemappedRows)
        except _Skip:
            pass
        else:
            out.append(self._sample(gpu, "gpu_remapped_rows", corr, now, {"type": "correctable"}))
            out.append(self._sample(gpu, "gpu_remapped_rows", unc, now, {"type": "uncorrectable"}))
            out.append(self._sample(gpu, "gpu_row_remap_pending", 1.0 if pending else 0.0, now))
            out.append(self._sample(gpu, "gpu_row_remap_failure", 1.0 if failure else 0.0, now))
        self._try(
            out,
            gpu,
            now,
            "gpu_retired_pages_pending",
            lambda: (
                1.0
                if r(gpu, "retired_pages_pending", lib.nvmlDeviceGetRetiredPagesPendingStatus)
                else 0.0
            ),
        )
        for cause, cause_id in (("multiple_single_bit_ecc", 0), ("double_bit_ecc", 1)):
            pages = functools.partial(
                r, gpu, f"retired_pages_{cause}", lib.nvmlDeviceGetRetiredPages, cause_id
            )
            self._try(out, gpu, now, "gpu_retired_pages", pages, {"cause": cause}, count=True)
        self._try(
            out,
            gpu,
            now,
            "gpu_pcie_replays_total",
            lambda: r(gpu, "pcie_replays", lib.nvmlDeviceGetPcieReplayCounter),
        )
        self._try(
            out,
            gpu,
            now,
            "gpu_recovery_action",
            lambda: self._field(gpu, "recovery_action", _FIELD_RECOVERY_ACTION),
        )

    def _info(self, gpu: _Gpu, now: float, out: list[Sample | Event]) -> None:
        lib = self._lib

        def text(what: str, fn: Callable[..., Any]) -> str:
            try:
                return self._text(self._read(gpu, what, fn))
            except _Skip:
                return ""

        labels = {
            "uuid": gpu.uuid,
            "serial": text("serial", lib.nvmlDeviceGetSerial),
            "model": text("name", lib.nvmlDeviceGetName),
            "pci_bus_id": gpu.pci_bus_id,
            "driver_version": self._driver_version,
            "vbios_version": text("vbios_version", lib.nvmlDeviceGetVbiosVersion),
        }
        out.append(self._sample(gpu, "gpu_info", 1.0, now, labels))

    def __repr__(self) -> str:
        return (
            f"NvmlCollector(node={self.node!r}, fast_interval_seconds="
            f"{self.fast_interval_seconds!r}, slow_interval_seconds="
            f"{self.slow_interval_seconds!r})"
        )
