from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from collectors.nvml import NvmlCollector
from core.catalog import BY_NAME
from core.clock import FakeClock
from core.errors import CollectorUnavailable
from core.protocols import Collector
from core.records import Event, Sample


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(3)


class NVMLError_GpuIsLost(NVMLError):
    def __init__(self) -> None:
        super().__init__(15)


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        Exception.__init__(self, "NVML Shared Library Not Found")
        self.value = 12


class FakeNvml:
    """The part of pynvml the collector uses; per-GPU values and injectable failures."""

    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1

    def __init__(self, gpus: int = 2, *, no_library: bool = False) -> None:
        self.no_library = no_library
        self.handles = [f"h{i}" for i in range(gpus)]
        self.fail: dict[tuple[str, str], type[Exception]] = {}
        self.calls: list[str] = []
        self.temperature_v = True

    def _check(self, fn: str, handle: str) -> None:
        self.calls.append(fn)
        exc = self.fail.get((fn, handle)) or self.fail.get((fn, "*"))
        if exc is not None:
            raise exc()

    def nvmlInit(self) -> None:
        if self.no_library:
            raise NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.handles)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return self.handles[i]

    def nvmlDeviceGetUUID(self, h: str) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetPciInfo(self, h: str) -> Any:
        return SimpleNamespace(busId=f"00000000:{10 + int(h[1:]):02X}:00.0".encode())

    def nvmlDeviceGetName(self, h: str) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetSerial(self, h: str) -> str:
        self._check("serial", h)
        return "1650123456789"

    def nvmlDeviceGetVbiosVersion(self, h: str) -> str:
        return "96.00.99.00.01"

    def nvmlDeviceGetTemperatureV(self, h: str, sensor: int) -> int:
        self._check("temperature_v", h)
        return 41

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        self._check("temperature", h)
        return 40

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        self._check("power", h)
        return 123456  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h: str) -> int:
        return 700000

    def nvmlDeviceGetTotalEnergyConsumption(self, h: str) -> int:
        self._check("energy", h)
        return 5_000_000  # mJ

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        self._check("utilization", h)
        return SimpleNamespace(gpu=75, memory=20)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        return SimpleNamespace(used=1024**3, total=80 * 1024**3, free=79 * 1024**3)

    def nvmlDeviceGetClockInfo(self, h: str, clock: int) -> int:
        return 1980 if clock == 1 else 2619

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: str) -> int:
        return 0x004 | 0x008

    def nvmlDeviceGetSupportedClocksEventReasons(self, h: str) -> int:
        return 0x1FF

    def nvmlDeviceGetTotalEccErrors(self, h: str, err: int, counter: int) -> int:
        self._check("ecc", h)
        return 10 * err + counter

    def nvmlDeviceGetRemappedRows(self, h: str) -> tuple[int, int, int, int]:
        return (2, 1, 1, 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: str) -> int:
        self._check("retired_pending", h)
        return 0

    def nvmlDeviceGetRetiredPages(self, h: str, cause: int) -> list[int]:
        return [0x1000] * cause

    def nvmlDeviceGetPcieReplayCounter(self, h: str) -> int:
        return 7

    def nvmlDeviceGetFieldValues(self, h: str, ids: list[int]) -> list[Any]:
        self._check("fields", h)
        out = []
        for fid in ids:
            if fid == 82:
                out.append(SimpleNamespace(nvmlReturn=3, valueType=1, value=SimpleNamespace()))
            else:
                out.append(SimpleNamespace(nvmlReturn=0, valueType=1,
                                           value=SimpleNamespace(uiVal=1)))
        return out


def _by(records: list[Any], metric: str, entity: str = "GPU-h0", **labels: str) -> float:
    found = [r.value for r in records if isinstance(r, Sample) and r.metric == metric
             and r.entity == entity and all(r.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (metric, labels, found)
    return found[0]


def test_collects_every_gpu_in_base_units() -> None:
    fake = FakeNvml(gpus=2)
    c = NvmlCollector(node="n1", nvml=fake, clock=FakeClock(now=1000.0))
    assert isinstance(c, Collector)
    records = list(c.collect())
    assert {r.entity for r in records} == {"GPU-h0", "GPU-h1"}
    assert all(r.metric in BY_NAME for r in records if isinstance(r, Sample))
    assert all(r.observed_at == 1000.0 and r.node == "n1" for r in records)
    assert _by(records, "gpu_temperature_celsius") == 41.0
    assert _by(records, "gpu_power_watts") == pytest.approx(123.456)
    assert _by(records, "gpu_power_limit_watts") == 700.0
    assert _by(records, "gpu_energy_joules_total") == 5000.0
    assert _by(records, "gpu_utilization_ratio") == 0.75
    assert _by(records, "gpu_memory_utilization_ratio") == 0.2
    assert _by(records, "gpu_memory_used_bytes") == 1024**3
    assert _by(records, "gpu_memory_total_bytes") == 80 * 1024**3
    assert _by(records, "gpu_sm_clock_hertz") == 1980e6
    assert _by(records, "gpu_memory_clock_hertz") == 2619e6
    assert _by(records, "gpu_clock_event_active", reason="power_cap") == 1.0
    assert _by(records, "gpu_clock_event_active", reason="hw_slowdown") == 1.0
    assert _by(records, "gpu_clock_event_active", reason="gpu_idle") == 0.0
    assert _by(records, "gpu_ecc_errors_total", type="uncorrected", scope="volatile") == 10.0
    assert _by(records, "gpu_ecc_errors_total", type="corrected", scope="aggregate") == 1.0
    assert _by(records, "gpu_remapped_rows", type="correctable") == 2.0
    assert _by(records, "gpu_remapped_rows", type="uncorrectable") == 1.0
    assert _by(records, "gpu_row_remap_pending") == 1.0
    assert _by(records, "gpu_row_remap_failure") == 0.0
    assert _by(records, "gpu_retired_pages_pending") == 0.0
    assert _by(records, "gpu_retired_pages", cause="double_bit_ecc") == 1.0
    assert _by(records, "gpu_pcie_replays_total") == 7.0
    assert _by(records, "gpu_recovery_action") == 1.0
    info = next(r for r in records if isinstance(r, Sample) and r.metric == "gpu_info"
                and r.entity == "GPU-h1")
    assert info.labels == {"uuid": "GPU-h1", "serial": "1650123456789",
                           "model": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:0b:00.0",
                           "driver_version": "550.54.15", "vbios_version": "96.00.99.00.01"}


def test_slow_fields_only_when_due() -> None:
    clock = FakeClock(now=0.0)
    fake = FakeNvml(gpus=1)
    c = NvmlCollector(node="n1", nvml=fake, clock=clock, slow_interval_seconds=30.0)
    first = {r.metric for r in c.collect() if isinstance(r, Sample)}
    clock.advance(1.0)
    second = {r.metric for r in c.collect() if isinstance(r, Sample)}
    assert "gpu_ecc_errors_total" in first
    assert "gpu_ecc_errors_total" not in second
    assert "gpu_temperature_celsius" in second
    clock.advance(30.0)
    assert "gpu_ecc_errors_total" in {r.metric for r in c.collect() if isinstance(r, Sample)}


def test_not_supported_is_omitted_counted_and_not_retried() -> None:
    fake = FakeNvml(gpus=1)
    fake.fail[("power", "*")] = NVMLError_NotSupported
    fake.fail[("ecc", "*")] = NVMLError_NotSupported
    clock = FakeClock()
    c = NvmlCollector(node="n1", nvml=fake, clock=clock)
    records = list(c.collect())
    metrics = {r.metric for r in records if isinstance(r, Sample)}
    assert "gpu_power_watts" not in metrics
    assert "gpu_ecc_errors_total" not in metrics
    assert "gpu_temperature_celsius" in metrics
    # power + 4 ECC combinations + the memory-temperature field entry
    assert c.errors_total["not_supported"] == 6
    calls = fake.calls.count("power")
    clock.advance(60)
    list(c.collect())
    assert fake.calls.count("power") == calls
    assert c.errors_total["not_supported"] == 6


def test_temperature_falls_back_to_deprecated_call() -> None:
    fake = FakeNvml(gpus=1)
    fake.fail[("temperature_v", "*")] = NVMLError_NotSupported
    c = NvmlCollector(node="n1", nvml=fake)
    assert _by(list(c.collect()), "gpu_temperature_celsius") == 40.0


def test_lost_gpu_gives_one_event_and_others_are_served() -> None:
    fake = FakeNvml(gpus=2)
    fake.fail[("utilization", "h1")] = NVMLError_GpuIsLost
    clock = FakeClock(now=5.0)
    c = NvmlCollector(node="n1", nvml=fake, clock=clock)
    records = list(c.collect())
    events = [r for r in records if isinstance(r, Event)]
    assert len(events) == 1
    (event,) = events
    assert (event.kind, event.code, event.entity, event.source) == (
        "gpu_lost", "nvml_gpu_is_lost", "GPU-h1", "nvml")
    assert event.evidence
    assert not [r for r in records if isinstance(r, Sample) and r.entity == "GPU-h1"]
    assert _by(records, "gpu_power_watts") == pytest.approx(123.456)
    clock.advance(1.0)
    again = list(c.collect())
    assert not [r for r in again if isinstance(r, Event)]
    assert c.errors_total["gpu_is_lost"] == 1


def test_no_library_raises_collector_unavailable() -> None:
    c = NvmlCollector(node="n1", nvml=FakeNvml(no_library=True))
    with pytest.raises(CollectorUnavailable, match="NVML unavailable: no NVIDIA driver"):
        list(c.collect())


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="an NVIDIA driver is present")
def test_real_pynvml_without_driver_is_unavailable() -> None:
    pytest.importorskip("pynvml")
    c = NvmlCollector(node="n1")
    with pytest.raises(CollectorUnavailable, match=r"^NVML unavailable"):
        list(c.collect())


@pytest.mark.gpu
def test_real_gpu_samples_are_catalogued() -> None:
    c = NvmlCollector(node="n1")
    try:
        records = list(c.collect())
    finally:
        c.close()
    samples = [r for r in records if isinstance(r, Sample)]
    assert samples
    assert all(s.metric in BY_NAME for s in samples)
    assert any(s.metric == "gpu_temperature_celsius" for s in samples)


def test_rejects_bad_intervals() -> None:
    with pytest.raises(ValueError, match="interval"):
        NvmlCollector(node="n1", fast_interval_seconds=0)


def test_gpu_lost_at_start_is_reported_and_the_rest_is_read() -> None:
    fake = FakeNvml(gpus=2)
    real = fake.nvmlDeviceGetHandleByIndex

    def handle(i: int) -> str:
        if i == 0:
            raise NVMLError_GpuIsLost()
        return real(i)

    fake.nvmlDeviceGetHandleByIndex = handle  # type: ignore[method-assign]
    c = NvmlCollector(node="n1", nvml=fake)
    records = list(c.collect())
    events = [r for r in records if isinstance(r, Event)]
    assert [(e.kind, e.entity) for e in events] == [("gpu_lost", "gpu:0")]
    assert {r.entity for r in records if isinstance(r, Sample)} == {"GPU-h1"}
    assert not [r for r in c.collect() if isinstance(r, Event)]
