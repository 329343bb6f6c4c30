"""The fake NVML (collectors.testing): built from real nvidia-smi dumps, never makes a value up."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pynvml
import pytest

from collectors.testing import (
    NOT_SUPPORTED,
    FakeNvml,
    FakeNvmlGap,
    given_for_dump,
    parse_nvidia_smi_dump,
)

DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
ALL_DUMPS = sorted(p.name for p in DUMPS.iterdir() if p.suffix in {".txt", ".xml"})


@pytest.mark.parametrize("name", ALL_DUMPS)
def test_every_dump_builds_devices_with_identity(name: str) -> None:
    gpus = parse_nvidia_smi_dump(DUMPS / name)
    assert gpus
    for gpu in gpus:
        assert str(gpu.facts["uuid"]).startswith("GPU-")
        assert isinstance(gpu.facts["temperature_c"], int)
        assert isinstance(gpu.facts["power_mw"], int)
        assert isinstance(gpu.facts["memory_total"], int)


def test_values_are_the_dumps_in_nvml_units() -> None:
    gpus = parse_nvidia_smi_dump(DUMPS / "h100-80gb-hbm3-x8-q.txt")
    assert len(gpus) == 8
    gpu = gpus[2]  # 00000000:75:00.0, the throttling one
    f = gpu.facts
    assert f["pci_bus_id"] == "00000000:75:00.0"
    assert f["power_mw"] == 118010
    assert f["power_limit_mw"] == 700000
    assert f["memory_total"] == 81559 * 1024 * 1024
    # SW Power Cap, SW Thermal Slowdown and HW Power Brake Slowdown are Active
    assert f["clock_event_reasons"] == 0x004 | 0x020 | 0x080
    assert f["clock_event_reasons_supported"] == 0x1FF
    assert f["pcie_replays"] == 58
    assert f["remap_histogram"] == {"max": 2560, "high": 0, "partial": 0, "low": 0, "none": 0}
    assert f["retired_pending"] is NOT_SUPPORTED  # "Pending Page Blacklist : N/A"
    assert f["recovery_action"] is NOT_SUPPORTED  # driver 535 prints no recovery action


def test_text_and_xml_layouts() -> None:
    (a10,) = parse_nvidia_smi_dump(DUMPS / "a10-q.txt")
    assert (a10.facts["remap_uncorrectable"], a10.facts["remap_pending"]) == (4, 1)
    (a100,) = parse_nvidia_smi_dump(DUMPS / "a100-sxm4-80gb-mig-qx.xml")
    assert a100.facts["mig_current"] == 1
    assert [gi for gi, _ci, _t, _u in a100.facts["mig_devices"]] == [3, 4, 5, 6]
    assert a100.facts["remap_pending"] is NOT_SUPPORTED  # <remapped_rows>N/A</remapped_rows>
    (titan,) = parse_nvidia_smi_dump(DUMPS / "titan-v-q.txt")
    assert titan.facts["ecc_mode"] is NOT_SUPPORTED
    assert titan.facts[("ecc", 1, 0, "total")] is NOT_SUPPORTED  # legacy layout, N/A


def test_not_supported_raises_the_bindings_own_class() -> None:
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetMigMode(h)  # MIG Mode Current: N/A
    assert fake.nvmlDeviceGetPowerUsage(h) == 43890
    # the binding's own struct: busId reads back as text in nvidia-ml-py 13
    assert fake.nvmlDeviceGetPciInfo_v3(h).busId in ("00000000:07:00.0", b"00000000:07:00.0")


def test_a_call_the_dump_cannot_answer_is_a_gap_not_a_value() -> None:
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(FakeNvmlGap, match="energy_mj"):
        fake.nvmlDeviceGetTotalEnergyConsumption(h)
    with pytest.raises(FakeNvmlGap, match="deprecated"):
        fake.nvmlDeviceGetTemperature(h, 0)
    assert len(fake.gaps) == 2
    given = FakeNvml.from_dump(DUMPS / "a10-q.txt", **given_for_dump(energy_mj=5000))
    assert given.nvmlDeviceGetTotalEnergyConsumption(given.handles[0]) == 5000
    assert not given.gaps


def test_field_values_answer_per_entry() -> None:
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt", **given_for_dump())
    values = fake.nvmlDeviceGetFieldValues(
        fake.handles[0],
        [
            pynvml.NVML_FI_DEV_REMAPPED_UNC,
            pynvml.NVML_FI_DEV_MEMORY_TEMP,
            pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
        ],
    )
    assert values[0].nvmlReturn == pynvml.NVML_SUCCESS
    assert values[0].value.ullVal == 4
    assert values[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # Memory Current Temp: N/A
    assert values[2].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # given as not supported
    with pytest.raises(FakeNvmlGap, match="field 1 "):
        fake.nvmlDeviceGetFieldValues(fake.handles[0], [1])


def test_sram_status_fills_the_bindings_struct() -> None:
    fake = FakeNvml.from_dump(DUMPS / "h100-80gb-hbm3-x8-q.txt")
    status = pynvml.c_nvmlEccSramErrorStatus_v1_t()
    fake.nvmlDeviceGetSramEccErrorStatus(fake.handles[0], ctypes.byref(status))
    assert status.bThresholdExceeded == 0


def test_injected_errors_loss_and_limits() -> None:
    fake = FakeNvml.from_dump(DUMPS / "h100-80gb-hbm3-x8-q.txt")
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, gpu=1, times=1)
    assert fake.nvmlDeviceGetPowerUsage(fake.handles[0]) == 71970
    with pytest.raises(pynvml.NVMLError_Unknown):
        fake.nvmlDeviceGetPowerUsage(fake.handles[1])
    assert fake.nvmlDeviceGetPowerUsage(fake.handles[1]) > 0  # times=1 spent
    fake.lose(3)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUUID(fake.handles[3])
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(3)
    fake.no_library = True
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        fake.nvmlInit()


def test_hang_blocks_until_released() -> None:
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt")
    release = fake.hang("nvmlDeviceGetPowerUsage")
    got: list[int] = []
    thread = threading.Thread(
        target=lambda: got.append(fake.nvmlDeviceGetPowerUsage(fake.handles[0]))
    )
    thread.start()
    thread.join(0.05)
    assert thread.is_alive()
    assert not got
    release.set()
    thread.join(2.0)
    assert got == [43890]


def test_events_are_delivered_only_when_registered() -> None:
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt", **given_for_dump(supported_events=0x000B))
    event_set = fake.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceRegisterEvents(fake.handles[0], 0x8000, event_set)
    fake.push_event(0, pynvml.nvmlEventTypeXidCriticalError, 79)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(event_set, 0)  # not registered: not delivered
    fake.nvmlDeviceRegisterEvents(fake.handles[0], 0x0008, event_set)
    fake.push_event(0, pynvml.nvmlEventTypeXidCriticalError, 48)
    data = fake.nvmlEventSetWait_v2(event_set, 100)
    assert (data.device, data.eventType, data.eventData) == (fake.handles[0], 0x8, 48)
