"""The NVML collector over the fake NVML built from real nvidia-smi dumps (and on a real GPU)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from collectors.nvml import CLOCK_EVENT_REASONS, NvmlCollector
from collectors.testing import FakeNvml, given_for_dump
from core import plugins
from core.catalog import BY_NAME
from core.clock import FakeClock
from core.errors import CollectorUnavailable
from core.protocols import Collector, StreamingCollector
from core.records import Event, Record, Sample

DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
H100X8 = DUMPS / "h100-80gb-hbm3-x8-q.txt"
UUID2 = "GPU-c4be30fc-fca0-1402-ffb5-90fbbd9a9bd2"  # index 2, 00000000:75:00.0
PCI2 = "0000:75:00.0"


def h100(**given: Any) -> FakeNvml:
    facts = given_for_dump(
        energy_mj=5_000_000, nvlink_states=[1] * 18, nvlink_errors={(3, 2): 7, (14, 1): 2}
    )
    facts.update(given)
    return FakeNvml.from_dump(H100X8, **facts)


def collector(fake: FakeNvml, clock: FakeClock | None = None, **kw: Any) -> NvmlCollector:
    kw.setdefault("deadline_seconds", 0)
    kw.setdefault("events", False)
    return NvmlCollector(node="n1", nvml=fake, clock=clock or FakeClock(now=1000.0), **kw)


def by(records: list[Record], metric: str, entity: str = UUID2, **labels: str) -> float:
    found = [
        r.value
        for r in records
        if isinstance(r, Sample)
        and r.metric == metric
        and r.entity == entity
        and all(r.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (metric, labels, found)
    return found[0]


def metrics(records: list[Record], entity: str | None = None) -> set[str]:
    return {
        r.metric
        for r in records
        if isinstance(r, Sample) and (entity is None or r.entity == entity)
    }


@pytest.fixture
def fake() -> Iterator[FakeNvml]:
    f = h100()
    yield f
    assert not f.gaps, f.gaps  # the collector asked nothing the dump cannot answer


def test_every_signal_in_base_units(fake: FakeNvml) -> None:
    c = collector(fake)
    assert isinstance(c, Collector)
    assert not isinstance(c, StreamingCollector)  # the service must poll it
    records = list(c.collect())
    assert {r.entity for r in records if isinstance(r, Sample)} == {
        str(g.facts["uuid"]) for g in fake.gpus
    }
    assert all(r.observed_at == 1000.0 and r.node == "n1" for r in records)
    # values are the dump's, converted (W, bytes, Hz, ratio, J)
    assert by(records, "gpu_temperature_celsius") == 39.0
    assert by(records, "gpu_memory_temperature_celsius") == 46.0
    assert by(records, "gpu_power_watts") == pytest.approx(118.01)
    assert by(records, "gpu_power_limit_watts") == 700.0
    assert by(records, "gpu_energy_joules_total") == 5000.0
    assert by(records, "gpu_utilization_ratio") == 0.0
    assert by(records, "gpu_memory_used_bytes") == 9221 * 1024 * 1024
    assert by(records, "gpu_memory_total_bytes") == 81559 * 1024 * 1024
    assert by(records, "gpu_sm_clock_hertz") == 1980e6
    assert by(records, "gpu_memory_clock_hertz") == 2619e6
    assert by(records, "gpu_clock_event_active", reason="hw_power_brake") == 1.0
    assert by(records, "gpu_clock_event_active", reason="sw_thermal") == 1.0
    assert by(records, "gpu_clock_event_active", reason="power_cap") == 1.0
    assert by(records, "gpu_clock_event_active", reason="hw_slowdown") == 0.0
    assert len(
        [
            r
            for r in records
            if isinstance(r, Sample) and r.entity == UUID2 and r.metric == "gpu_clock_event_active"
        ]
    ) == len(CLOCK_EVENT_REASONS)
    assert (
        by(records, "gpu_ecc_errors_total", type="uncorrected", scope="volatile", location="sram")
        == 0.0
    )
    assert (
        by(records, "gpu_ecc_errors_total", type="corrected", scope="aggregate", location="total")
        == 0.0
    )
    assert by(records, "gpu_sram_threshold_exceeded") == 0.0
    assert by(records, "gpu_remapped_rows", type="uncorrectable") == 0.0
    assert by(records, "gpu_row_remap_pending") == 0.0
    assert by(records, "gpu_row_remap_failure") == 0.0
    assert by(records, "gpu_row_remap_bank_availability", availability="max") == 2560.0
    assert by(records, "gpu_pcie_replays_total") == 58.0
    assert by(records, "gpu_pcie_link_generation", bound="current") == 5.0
    assert by(records, "gpu_pcie_link_width", bound="max") == 16.0
    assert by(records, "gpu_nvlink_state", link="17") == 1.0
    assert by(records, "gpu_nvlink_errors_total", link="3", type="crc_flit") == 7.0
    assert by(records, "gpu_nvlink_errors_total", link="14", type="recovery") == 2.0
    assert by(records, "gpu_mig_mode") == 0.0
    info = next(
        r for r in records if isinstance(r, Sample) and r.metric == "gpu_info" and r.entity == UUID2
    )
    assert info.labels == {
        "uuid": UUID2,
        "serial": "1654900000003",
        "model": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": PCI2,
        "driver_version": "535.183.01",
        "vbios_version": "96.00.74.00.01",
        "index": "2",
    }
    # not supported on this board (N/A in the dump): omitted, never filled
    assert "gpu_fan_speed_ratio" not in metrics(records)
    assert "gpu_retired_pages" not in metrics(records)
    identity = [r for r in records if isinstance(r, Event) and r.kind == "gpu_identity"]
    assert (identity[2].entity, identity[2].attrs["uuid"]) == (PCI2, UUID2)


def test_every_metric_is_catalogued_with_its_nvml_source(fake: FakeNvml) -> None:
    records = list(collector(fake).collect())
    for name in metrics(records):
        assert name in BY_NAME, name
        assert BY_NAME[name].nvml, name
        assert set(
            next(r for r in records if isinstance(r, Sample) and r.metric == name).labels
        ) <= set(BY_NAME[name].labels), name


def test_batched_field_values_one_call_per_group_and_gpu(fake: FakeNvml) -> None:
    clock = FakeClock(now=0.0)
    c = collector(fake, clock)
    list(c.collect())  # slow + fast: the batches drop what the GPU does not support
    before = fake.calls["nvmlDeviceGetFieldValues"]
    clock.advance(1.0)
    list(c.collect())  # fast only
    # one batch per GPU (memory temperature, energy, recovery action or its fallback)
    assert fake.calls["nvmlDeviceGetFieldValues"] - before == 8
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 0
    assert fake.calls["nvmlDeviceGetRemappedRows"] == 0  # fields 142-145 instead
    assert fake.calls["nvmlDeviceGetPcieReplayCounter"] == 0  # field 94 instead


def test_slow_group_only_when_due() -> None:
    clock = FakeClock(now=0.0)
    c = collector(h100(), clock, slow_interval_seconds=30.0)
    first = metrics(list(c.collect()))
    clock.advance(1.0)
    second = metrics(list(c.collect()))
    assert "gpu_ecc_errors_total" in first
    assert "gpu_ecc_errors_total" not in second
    assert {"gpu_temperature_celsius", "gpu_power_watts"} <= second
    clock.advance(30.0)
    assert "gpu_ecc_errors_total" in metrics(list(c.collect()))


def test_fast_group_has_its_own_interval() -> None:
    clock = FakeClock(now=0.0)
    c = collector(h100(), clock, fast_interval_seconds=5.0)
    assert metrics(list(c.collect()))
    clock.advance(1.0)
    assert not metrics(list(c.collect()))  # polled more often than configured
    clock.advance(4.0)
    assert "gpu_power_watts" in metrics(list(c.collect()))


def test_clock_event_flags_are_sent_on_change_and_on_slow_ticks() -> None:
    fake = h100()
    clock = FakeClock(now=0.0)
    c = collector(fake, clock, slow_interval_seconds=30.0)

    def flags() -> dict[str, float]:
        return {
            str(r.labels["reason"]): r.value
            for r in c.collect()
            if isinstance(r, Sample) and r.metric == "gpu_clock_event_active" and r.entity == UUID2
        }

    assert flags()["hw_power_brake"] == 1.0  # first tick: all nine
    clock.advance(1.0)
    assert flags() == {}  # read, unchanged: not re-sent
    fake.gpus[2].set(clock_event_reasons=0x040)  # HW thermal slowdown only
    clock.advance(1.0)
    changed = flags()
    assert (changed["hw_thermal"], changed["hw_power_brake"], len(changed)) == (1.0, 0.0, 9)
    clock.advance(30.0)
    assert len(flags()) == 9  # slow tick: refreshed
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 4 * 8


def test_not_supported_is_omitted_counted_once_and_not_retried() -> None:
    fake = h100()
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED)
    clock = FakeClock(now=0.0)
    c = collector(fake, clock)
    records = list(c.collect())
    assert "gpu_power_watts" not in metrics(records)
    assert "gpu_temperature_celsius" in metrics(records)
    counted = c.errors_total["not_supported"]
    calls = fake.calls["nvmlDeviceGetPowerUsage"]
    assert calls == 8
    clock.advance(1.0)
    list(c.collect())
    assert fake.calls["nvmlDeviceGetPowerUsage"] == calls
    assert c.errors_total["not_supported"] == counted


def test_unsupported_fields_are_probed_again_later() -> None:
    fake = h100()
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED)
    clock = FakeClock(now=0.0)
    c = collector(fake, clock, reprobe_seconds=100.0)
    list(c.collect())
    fake.clear_failures()
    clock.advance(120.0)
    assert "gpu_power_watts" in metrics(list(c.collect()))


def test_transient_errors_are_counted_and_retried() -> None:
    fake = h100()
    fake.fail("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_UNKNOWN, gpu=2, times=1)
    clock = FakeClock(now=0.0)
    c = collector(fake, clock)
    assert "gpu_utilization_ratio" not in metrics(list(c.collect()), UUID2)
    assert c.errors_total["unknown"] == 1
    clock.advance(1.0)
    assert "gpu_utilization_ratio" in metrics(list(c.collect()), UUID2)


def test_recovery_action_falls_back_to_the_reset_status_fields() -> None:
    # driver 535: no field 230; "Drain and Reset Recommended : No" is field 227
    fake = FakeNvml.from_dump(
        DUMPS / "a100-sxm4-80gb-mig-qx.xml", **given_for_dump(max_mig_devices=7)
    )
    clock = FakeClock(now=0.0)
    c = collector(fake, clock)
    records = list(c.collect())
    uuid = str(fake.gpus[0].facts["uuid"])
    assert by(records, "gpu_recovery_action", uuid) == 0.0
    fake.gpus[0].set(drain_and_reset=1)
    clock.advance(1.0)
    assert by(list(c.collect()), "gpu_recovery_action", uuid) == 4.0
    assert fake.calls["field:230"] == 1  # asked once, then the fallback
    assert not fake.gaps


def test_mig_instances_from_the_dump() -> None:
    fake = FakeNvml.from_dump(
        DUMPS / "a100-sxm4-80gb-mig-qx.xml", **given_for_dump(max_mig_devices=7)
    )
    records = list(collector(fake).collect())
    uuid = str(fake.gpus[0].facts["uuid"])
    assert by(records, "gpu_mig_mode", uuid) == 1.0
    assert by(records, "gpu_mig_instances", uuid) == 4.0
    assert by(records, "gpu_mig_memory_used_bytes", uuid, gpu_instance="5") == 12 * 1024 * 1024
    assert "gpu_utilization_ratio" not in metrics(records)  # N/A under MIG
    assert "gpu_remapped_rows" not in metrics(records)  # N/A under MIG
    assert not fake.gaps


def test_nvlink_down_link_is_reported() -> None:
    states = [1] * 18
    states[5] = 0
    records = list(collector(h100(nvlink_states=states)).collect())
    assert by(records, "gpu_nvlink_state", link="5") == 0.0
    assert by(records, "gpu_nvlink_state", link="6") == 1.0


def test_no_nvlink_means_no_nvlink_series() -> None:
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt", **given_for_dump())
    records = list(collector(fake).collect())
    assert not {"gpu_nvlink_state", "gpu_nvlink_errors_total"} & metrics(records)
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 0
    assert not fake.gaps


def test_pre_ampere_board_without_ecc() -> None:
    fake = FakeNvml.from_dump(DUMPS / "titan-v-q.txt", **given_for_dump())
    records = list(collector(fake).collect())
    assert "gpu_ecc_errors_total" not in metrics(records)  # ECC Mode: N/A
    assert fake.calls["nvmlDeviceGetMemoryErrorCounter"] == 0
    assert by(records, "gpu_fan_speed_ratio", str(fake.gpus[0].facts["uuid"])) == 0.30
    assert not fake.gaps


class _OldBinding:
    """An nvidia-ml-py without nvmlDeviceGetTemperatureV / ...ClocksEventReasons."""

    def __init__(self, fake: FakeNvml) -> None:
        self._fake = fake

    def __getattr__(self, name: str) -> Any:
        if name in {"nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons"}:
            raise AttributeError(name)
        return getattr(self._fake, name)


def test_an_older_binding_falls_back_to_the_deprecated_names(fake: FakeNvml) -> None:
    fake.allow_deprecated = True
    records = list(collector(_OldBinding(fake)).collect())  # type: ignore[arg-type]
    assert by(records, "gpu_temperature_celsius") == 39.0
    assert by(records, "gpu_clock_event_active", reason="hw_power_brake") == 1.0
    assert fake.calls["nvmlDeviceGetTemperature"] == 8


def test_the_deprecated_calls_are_never_used_when_the_new_ones_exist(fake: FakeNvml) -> None:
    list(collector(fake).collect())
    deprecated = {
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetPowerState",
        "nvmlDeviceGetDetailedEccErrors",
        "nvmlDeviceGetViolationStatus",
    }
    assert not deprecated & set(fake.calls)


# --------------------------------------------------------------------------- robustness


def test_lost_gpu_gives_one_event_and_the_others_are_served(fake: FakeNvml) -> None:
    clock = FakeClock(now=5.0)
    c = collector(fake, clock)
    list(c.collect())
    fake.lose(2)
    clock.advance(1.0)
    records = list(c.collect())
    (event,) = [r for r in records if isinstance(r, Event)]
    assert (event.kind, event.code, event.entity, event.source) == (
        "gpu_lost",
        "nvml_gpu_is_lost",
        PCI2,
        "nvml",
    )
    assert event.attrs["uuid"] == UUID2
    assert event.evidence
    assert UUID2 not in {r.entity for r in records if isinstance(r, Sample)}
    assert len({r.entity for r in records if isinstance(r, Sample)}) == 7
    clock.advance(1.0)
    assert not [r for r in c.collect() if isinstance(r, Event)]
    assert c.errors_total["gpu_is_lost"] == 1
    # probed again on slow ticks; read again once it answers
    fake.clear_failures()
    clock.advance(30.0)
    assert UUID2 in {r.entity for r in c.collect() if isinstance(r, Sample)}


def test_lost_in_a_field_entry_is_lost() -> None:
    fake = h100()
    fake.fail("field:82", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=2)
    records = list(collector(fake).collect())
    assert [
        (r.kind, r.entity) for r in records if isinstance(r, Event) and r.kind == "gpu_lost"
    ] == [("gpu_lost", PCI2)]


def test_gpu_without_a_handle_at_start() -> None:
    fake = h100()
    fake.fail("nvmlDeviceGetHandleByIndex", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0)
    c = collector(fake)
    records = list(c.collect())
    assert [
        (r.kind, r.entity) for r in records if isinstance(r, Event) and r.kind == "gpu_lost"
    ] == [("gpu_lost", "gpu:0")]
    assert len({r.entity for r in records if isinstance(r, Sample)}) == 7
    assert not [r for r in c.collect() if isinstance(r, Event) and r.kind == "gpu_lost"]


def test_reset_required_is_an_event() -> None:
    fake = h100()
    fake.fail("nvmlDeviceGetClockInfo", pynvml.NVML_ERROR_RESET_REQUIRED, gpu=2)
    records = list(collector(fake).collect())
    events = [r for r in records if isinstance(r, Event) and r.kind == "reset_required"]
    assert [(e.code, e.entity) for e in events] == [("nvml_reset_required", PCI2)]


def test_no_library_raises_collector_unavailable() -> None:
    fake = h100()
    fake.no_library = True
    c = collector(fake)
    with pytest.raises(CollectorUnavailable, match="NVML unavailable: no NVIDIA driver"):
        list(c.collect())


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="an NVIDIA driver is present")
def test_real_pynvml_without_driver_is_unavailable() -> None:
    c = NvmlCollector(node="n1")
    with pytest.raises(CollectorUnavailable, match=r"^NVML unavailable"):
        list(c.collect())


def test_a_hung_call_cannot_stall_the_collection() -> None:
    fake = h100()
    clock = FakeClock(now=0.0)
    c = NvmlCollector(node="n1", nvml=fake, clock=clock, deadline_seconds=0.2, events=False)
    try:
        list(c.collect())  # warm: workers started
        release = fake.hang("nvmlDeviceGetPowerUsage", gpu=2)
        clock.advance(1.0)
        started = time.monotonic()
        records = list(c.collect())
        assert time.monotonic() - started < 2.0
        # GPUs 0 and 1 were read before the hang; 3-7 wait behind it for this one tick
        assert len({r.entity for r in records if isinstance(r, Sample)}) == 2
        (gap,) = [r for r in records if isinstance(r, Event)]
        assert (gap.kind, gap.code, gap.entity) == ("telemetry_gap", "nvml_deadline_exceeded", PCI2)
        assert gap.attrs["call"] == "nvmlDeviceGetPowerUsage"
        assert c.errors_total["deadline_exceeded"] == 1
        assert c.errors_total["skipped_behind_late_gpu"] == 5
        clock.advance(1.0)
        started = time.monotonic()
        records = list(c.collect())  # still hung: skipped and counted; the others served
        assert time.monotonic() - started < 0.2
        assert len({r.entity for r in records if isinstance(r, Sample)}) == 7
        assert not [r for r in records if isinstance(r, Event)]
        assert c.errors_total["deadline_exceeded"] == 2
        release.set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the worker finishes its old job
            clock.advance(1.0)
            if UUID2 in {r.entity for r in c.collect() if isinstance(r, Sample)}:
                break
        else:
            pytest.fail("the GPU was not read again after its call returned")
    finally:
        fake.clear_failures()
        c.close()


def test_events_come_out_of_collect() -> None:
    fake = h100(supported_events=0x800B)
    c = NvmlCollector(
        node="n1", nvml=fake, clock=FakeClock(now=7.0), deadline_seconds=0, event_wait_ms=20
    )
    try:
        list(c.collect())
        fake.push_event(2, pynvml.nvmlEventTypeXidCriticalError, 94)
        deadline = time.monotonic() + 2.0
        got: list[Event] = []
        while not got and time.monotonic() < deadline:
            got = [r for r in c.collect() if isinstance(r, Event) and r.kind == "xid"]
            time.sleep(0.01)
        assert [(e.code, e.entity) for e in got] == [("94", PCI2)]
    finally:
        c.close()


def test_close_stops_the_threads_and_restarts_on_collect() -> None:
    fake = h100(supported_events=0x8)
    c = NvmlCollector(
        node="n1", nvml=fake, clock=FakeClock(now=0.0), deadline_seconds=0.5, event_wait_ms=20
    )
    list(c.collect())
    before = {t.name for t in threading.enumerate()}
    assert "gpuhealth-nvml-events" in before
    c.close()
    time.sleep(0.05)
    assert fake.initialised == 0
    assert list(c.collect())
    c.close()


CALLS_AND_ERRORS = [
    (call, error)
    for call in (
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetSerial",
        "nvmlDeviceGetName",
        "nvmlDeviceGetVbiosVersion",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTemperatureThreshold",
        "nvmlDeviceGetFanSpeed",
        "nvmlDeviceGetSupportedClocksEventReasons",
        "nvmlDeviceGetEccMode",
        "nvmlDeviceGetMemoryErrorCounter",
        "nvmlDeviceGetSramEccErrorStatus",
        "nvmlDeviceGetRowRemapperHistogram",
        "nvmlDeviceGetCurrPcieLinkGeneration",
        "nvmlDeviceGetMaxPcieLinkGeneration",
        "nvmlDeviceGetCurrPcieLinkWidth",
        "nvmlDeviceGetMaxPcieLinkWidth",
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetNvLinkErrorCounter",
        "nvmlDeviceGetMigMode",
    )
    for error in (
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_UNKNOWN,
        pynvml.NVML_ERROR_NO_PERMISSION,
    )
]


def test_the_suite_covers_every_call_the_collector_makes() -> None:
    fake = h100(supported_events=0x800B)
    c = NvmlCollector(
        node="n1", nvml=fake, clock=FakeClock(now=0.0), deadline_seconds=0.5, event_wait_ms=20
    )
    try:
        list(c.collect())
    finally:
        c.close()
    per_device = {
        name
        for name in fake.calls
        if name.startswith("nvmlDevice")
        and name
        not in {
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetPciInfo_v3",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetSupportedEventTypes",
            "nvmlDeviceRegisterEvents",
        }
    }
    assert per_device == {call for call, _e in CALLS_AND_ERRORS}
    mig = FakeNvml.from_dump(
        DUMPS / "a100-sxm4-80gb-mig-qx.xml", **given_for_dump(max_mig_devices=7)
    )
    list(collector(mig).collect())
    assert {
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetGpuInstanceId",
    } <= set(mig.calls)


@pytest.mark.parametrize(("call", "error"), CALLS_AND_ERRORS)
def test_each_call_survives_each_injected_error(call: str, error: int) -> None:
    fake = h100()
    fake.fail(call, error, gpu=2)
    c = collector(fake)
    records = list(c.collect())
    others = {r.entity for r in records if isinstance(r, Sample)} - {UUID2}
    assert len(others) == 7  # the other GPUs are served
    lost = [r for r in records if isinstance(r, Event) and r.kind == "gpu_lost"]
    if error == pynvml.NVML_ERROR_GPU_IS_LOST:
        assert [e.entity for e in lost] == [PCI2]
    else:
        assert not lost
        assert UUID2 in {r.entity for r in records if isinstance(r, Sample)}
        reason = {3: "not_supported", 999: "unknown", 4: "no_permission"}[error]
        assert c.errors_total[reason] >= 1
    assert not fake.gaps


def test_built_by_the_service_through_its_entry_point() -> None:
    built = plugins.build(
        "gpuhealth.collectors",
        "nvml",
        {"node": "n1", "fast_interval_seconds": 1.0, "slow_interval_seconds": 30.0},
        expect=Collector,
    )
    assert isinstance(built, NvmlCollector)
    assert built.name == "nvml"
    assert hasattr(built, "errors_total")


def test_rejects_bad_intervals() -> None:
    with pytest.raises(ValueError, match="interval"):
        NvmlCollector(node="n1", fast_interval_seconds=0)
    with pytest.raises(ValueError, match="deadline"):
        NvmlCollector(node="n1", deadline_seconds=-1)


# ----------------------------------------------------------------- on a real GPU (gpu)


@pytest.mark.gpu
def test_real_gpu_signals_are_catalogued_and_plausible() -> None:
    c = NvmlCollector(node="n1", deadline_seconds=5.0)
    try:
        records = list(c.collect())
    finally:
        c.close()
    samples = [r for r in records if isinstance(r, Sample)]
    assert samples
    assert all(s.metric in BY_NAME for s in samples)
    for s in samples:
        if s.metric == "gpu_temperature_celsius":
            assert 0 < s.value < 120
        elif s.metric.endswith("_ratio"):
            assert 0.0 <= s.value <= 1.0
        elif s.metric == "gpu_power_watts":
            assert 0 < s.value < 2000
        elif s.metric.endswith("_hertz"):
            assert 0 <= s.value < 1e10


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no nvidia-smi")
def test_real_gpu_agrees_with_nvidia_smi_query_gpu() -> None:
    fields = "uuid,temperature.gpu,memory.total,power.limit,clocks.max.sm"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    c = NvmlCollector(node="n1", deadline_seconds=5.0)
    try:
        records = list(c.collect())
    finally:
        c.close()
    for line in out.strip().splitlines():
        uuid, temp, mem_mib, limit_w, _sm = (x.strip() for x in line.split(","))
        assert by(records, "gpu_temperature_celsius", uuid) == pytest.approx(float(temp), abs=3)
        assert by(records, "gpu_memory_total_bytes", uuid) == pytest.approx(
            float(mem_mib) * 1024 * 1024, rel=0.01
        )
        assert by(records, "gpu_power_limit_watts", uuid) == pytest.approx(float(limit_w), rel=0.01)
