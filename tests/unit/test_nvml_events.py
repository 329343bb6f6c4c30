"""NVML events: the watcher thread over the fake NVML, and Xid deduplication."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from analytics.fault_model import Context, Observations, evaluate
from collectors.artifact import ParseContext
from collectors.kernel_log import parse_kernel_lines
from collectors.nvml_events import NvmlEventWatcher, WatchedGpu, XidDedup
from collectors.testing import FakeNvml, given_for_dump
from core.clock import FakeClock
from core.records import Action, EntityId, Event, NodeName, Record, Sample, Severity

DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
PCI = EntityId("0000:75:00.0")  # GPU index 2 of the H100 x8 dump
UUID = "GPU-c4be30fc-fca0-1402-ffb5-90fbbd9a9bd2"
ALL = 0x800B  # Xid, SBE, DBE, recovery action


def _watched(fake: FakeNvml) -> list[WatchedGpu]:
    out = []
    for i, handle in enumerate(fake.handles):
        facts = fake.gpus[i].facts
        pci = EntityId("0000:" + str(facts["pci_bus_id"]).lower()[-7:])
        out.append(
            WatchedGpu(
                index=i,
                handle=handle,
                pci_bus_id=pci,
                sample_entity=EntityId(str(facts["uuid"])),
                uuid=str(facts["uuid"]),
            )
        )
    return out


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml.from_dump(
        DUMPS / "h100-80gb-hbm3-x8-q.txt", **given_for_dump(supported_events=ALL)
    )


@pytest.fixture
def watcher(fake: FakeNvml) -> Iterator[NvmlEventWatcher]:
    w = NvmlEventWatcher(
        fake,
        _watched(fake),
        node="n1",
        clock=FakeClock(now=50.0),
        wait_ms=20,
        read_recovery_action=lambda gpu: 1,
    )
    assert w.start()
    yield w
    w.stop()
    assert not w.alive
    assert not fake.gaps


def _wait_records(w: NvmlEventWatcher, count: int) -> list[Record]:
    got: list[Record] = []
    deadline = time.monotonic() + 2.0
    while len(got) < count and time.monotonic() < deadline:
        got.extend(w.drain())
        time.sleep(0.005)
    time.sleep(0.03)  # nothing more should come
    got.extend(w.drain())
    return got


def test_xid_event_matches_the_kernel_log_record(fake: FakeNvml, watcher: NvmlEventWatcher) -> None:
    fake.push_event(2, pynvml.nvmlEventTypeXidCriticalError, 79)
    (event,) = _wait_records(watcher, 1)
    assert isinstance(event, Event)
    (kernel,) = parse_kernel_lines(
        [
            "[ 1234.5] NVRM: Xid (PCI:0000:75:00): 79, pid='<unknown>', name=<unknown>, "
            "GPU has fallen off the bus."
        ],
        ParseContext(file="k", node=NodeName("n1")),
    )
    assert (event.kind, event.code, event.node, event.entity) == (
        kernel.kind,
        kernel.code,
        kernel.node,
        kernel.entity,
    )
    assert event.source == "nvml"
    assert event.observed_at == 50.0
    assert event.evidence
    assert event.evidence[0].file == "nvml"
    assert event.attrs["uuid"] == UUID


def test_nvml_xid79_is_the_same_critical_finding_as_the_kernel_logs(
    fake: FakeNvml, watcher: NvmlEventWatcher
) -> None:
    fake.push_event(2, pynvml.nvmlEventTypeXidCriticalError, 79)
    obs = Observations()
    obs.extend(_wait_records(watcher, 1))
    (finding,) = [f for f in evaluate(obs, Context()) if f.entity == PCI]
    assert (finding.kind, finding.code, finding.severity, finding.action) == (
        "xid",
        "79",
        Severity.CRITICAL,
        Action.REBOOT_NODE,
    )


def test_dbe_event_is_xid_48_and_pairs_with_the_xid_event(
    fake: FakeNvml, watcher: NvmlEventWatcher
) -> None:
    fake.push_event(2, pynvml.nvmlEventTypeDoubleBitEccError)
    fake.push_event(2, pynvml.nvmlEventTypeXidCriticalError, 48)
    records = _wait_records(watcher, 1)
    assert [(r.kind, r.code, r.entity) for r in records if isinstance(r, Event)] == [
        ("xid", "48", PCI)
    ]


def test_recovery_action_event_is_xid_154_with_the_action(
    fake: FakeNvml, watcher: NvmlEventWatcher
) -> None:
    fake.push_event(2, pynvml.nvmlEventTypeGpuRecoveryAction, 1)
    fake.push_event(2, pynvml.nvmlEventTypeXidCriticalError, 154)  # the same occurrence
    records = _wait_records(watcher, 2)
    (event,) = [r for r in records if isinstance(r, Event)]
    samples = [r for r in records if isinstance(r, Sample)]
    assert (event.kind, event.code) == ("xid", "154")
    assert event.attrs["recovery_action"] == "GPU Reset Required"
    assert event.attrs["recovery_action_code"] == "1"
    assert next((s.metric, s.value, s.entity) for s in samples) == (
        "gpu_recovery_action",
        1.0,
        UUID,
    )
    obs = Observations()
    obs.extend(records)
    worst = evaluate(obs, Context())[0]
    assert (worst.severity, worst.action) == (Severity.CRITICAL, Action.RESET_GPU)


def test_single_bit_events_are_rate_limited(fake: FakeNvml, watcher: NvmlEventWatcher) -> None:
    for _ in range(5):
        fake.push_event(0, pynvml.nvmlEventTypeSingleBitEccError)
    records = _wait_records(watcher, 1)
    assert [(r.kind, r.code) for r in records if isinstance(r, Event)] == [
        ("ecc_event", "single_bit")
    ]


def test_mig_attribution_is_kept(fake: FakeNvml, watcher: NvmlEventWatcher) -> None:
    fake.push_event(1, pynvml.nvmlEventTypeXidCriticalError, 13, gpu_instance_id=3)
    (event,) = _wait_records(watcher, 1)
    assert isinstance(event, Event)
    assert event.attrs["gpu_instance_id"] == "3"


def test_only_supported_events_are_registered() -> None:
    fake = FakeNvml.from_dump(
        DUMPS / "h100-80gb-hbm3-x8-q.txt", **given_for_dump(supported_events=0x0008)
    )
    fake.gpus[0].set(supported_events=0)
    errors: list[str] = []
    w = NvmlEventWatcher(fake, _watched(fake), node="n1", wait_ms=10, on_error=errors.append)
    assert w.start()
    try:
        assert 0 not in w.registered
        assert set(w.registered.values()) == {0x0008}
        assert errors == ["not_supported"]
    finally:
        w.stop()


def test_no_gpu_supports_events() -> None:
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt", **given_for_dump(supported_events=0))
    w = NvmlEventWatcher(fake, _watched(fake), node="n1", wait_ms=10)
    assert not w.start()
    assert fake.calls["nvmlEventSetFree"] == 1


def test_a_failing_wait_backs_off_and_recovers(fake: FakeNvml) -> None:
    errors: list[str] = []
    w = NvmlEventWatcher(fake, _watched(fake), node="n1", wait_ms=10, on_error=errors.append)
    fake.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_UNKNOWN, times=1)
    assert w.start()
    try:
        fake.push_event(2, pynvml.nvmlEventTypeXidCriticalError, 79)
        records = _wait_records(w, 1)
        assert [(r.kind, r.code) for r in records if isinstance(r, Event)] == [("xid", "79")]
        assert errors == ["event_wait_999"]
    finally:
        w.stop(timeout=2.0)


# ------------------------------------------------------------------------------- dedup


def _xid(code: str, source: str, entity: str = PCI) -> Event:
    return Event(
        kind="xid",
        code=code,
        node=NodeName("n1"),
        entity=EntityId(entity),
        observed_at=None,
        source=source,
    )


def test_dedup_pairs_one_copy_per_source() -> None:
    clock = FakeClock(now=0.0)
    dedup = XidDedup(window_seconds=30.0, clock=clock)
    assert dedup.admit(_xid("79", "nvml"))
    assert not dedup.admit(_xid("79", "kernel_log"))  # the same Xid seen by the kernel log
    assert dedup.suppressed == 1
    # a second occurrence, seen by both: again one event
    clock.advance(5)
    assert dedup.admit(_xid("79", "kernel_log"))
    assert not dedup.admit(_xid("79", "nvml"))


def test_dedup_keeps_repeats_from_one_source_and_other_gpus() -> None:
    dedup = XidDedup(clock=FakeClock(now=0.0))
    assert dedup.admit(_xid("13", "kernel_log"))
    assert dedup.admit(_xid("13", "kernel_log"))
    assert dedup.admit(_xid("13", "nvml", entity="0000:53:00.0"))
    assert not dedup.admit(_xid("13", "nvml"))
    assert not dedup.admit(_xid("13", "nvml"))
    assert dedup.admit(_xid("13", "nvml"))  # a third one: no kernel copy left to pair with


def test_dedup_window_expires() -> None:
    clock = FakeClock(now=0.0)
    dedup = XidDedup(window_seconds=30.0, clock=clock)
    assert dedup.admit(_xid("48", "nvml"))
    clock.advance(31)
    assert dedup.admit(_xid("48", "kernel_log"))


def test_dedup_filter_over_both_streams_gives_one_finding(
    fake: FakeNvml, watcher: NvmlEventWatcher
) -> None:
    fake.push_event(2, pynvml.nvmlEventTypeXidCriticalError, 79)
    nvml = _wait_records(watcher, 1)
    kernel = list(
        parse_kernel_lines(
            [
                "[ 1234.5] NVRM: Xid (PCI:0000:75:00): 79, pid='<unknown>', name=<unknown>, "
                "GPU has fallen off the bus."
            ],
            ParseContext(file="k", node=NodeName("n1")),
        )
    )
    dedup = XidDedup()
    kept = dedup.filter([*nvml, *kernel])
    assert len([r for r in kept if isinstance(r, Event) and r.kind == "xid"]) == 1
    obs = Observations()
    obs.extend(kept)
    (finding,) = evaluate(obs, Context())
    assert finding.occurrences == 1


def test_dedup_rejects_bad_window() -> None:
    with pytest.raises(ValueError, match="window"):
        XidDedup(window_seconds=0)


def test_dedup_hold_lets_the_richer_kernel_copy_win() -> None:
    clock = FakeClock(now=0.0)
    dedup = XidDedup(clock=clock, hold_seconds=2.0)
    nvml = _xid("13", "nvml")
    kernel = Event(
        kind="xid",
        code="13",
        node=NodeName("n1"),
        entity=PCI,
        observed_at=None,
        attrs={"process": "python3", "pid": "4242"},
        source="kernel_log",
    )
    assert dedup.filter([nvml]) == []  # held for the kernel log's copy
    clock.advance(0.5)
    assert dedup.filter([kernel]) == [kernel]
    clock.advance(5.0)
    assert dedup.filter([]) == []  # the NVML copy was replaced, not released
    assert dedup.suppressed == 1


def test_dedup_hold_releases_an_unpaired_nvml_copy_and_drops_a_late_kernel_copy() -> None:
    clock = FakeClock(now=0.0)
    dedup = XidDedup(clock=clock, hold_seconds=2.0)
    nvml = _xid("79", "nvml")
    assert dedup.filter([nvml]) == []
    clock.advance(2.5)
    assert dedup.filter([]) == [nvml]
    clock.advance(1.0)
    assert dedup.filter([_xid("79", "kernel_log")]) == []  # late copy of the same Xid
    assert dedup.flush() == []


def test_dedup_rejects_a_hold_longer_than_the_window() -> None:
    with pytest.raises(ValueError, match="hold_seconds"):
        XidDedup(window_seconds=5.0, hold_seconds=5.0)
