"""Boot windows (#16 item 6): links a reboot takes down for a while are not faults.

A replay of an NVLink-down burst right after the node's kernel log says it booted raises
nothing; the same burst an hour after the boot, or with no boot, remediates. In a live
pipeline a link still down when the window ends is a finding as usual.
"""

from __future__ import annotations

from pathlib import Path

from core.clock import FakeClock
from core.records import EntityId, Event, NodeName, Sample
from gpuhealth.pipeline import Pipeline
from gpuhealth.replay import replay

BOOT_AT = 1_700_000_000.0


def _kernel_log(path: Path, boot_at: float) -> Path:
    import datetime as dt

    def stamp(at: float) -> str:
        return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S+00:00")

    path.write_text(
        f"{stamp(boot_at - 5)} n1 kernel: Command line: BOOT_IMAGE=/vmlinuz ro\n"
        f"{stamp(boot_at)} n1 kernel: Linux version 6.5.0-1018-nvidia (buildd@lcy02) "
        "(gcc 12.3.0) #18-Ubuntu SMP\n")
    return path


def _nvlink_burst(path: Path, start: float, gpus: int = 8) -> Path:
    lines = []
    for step in range(3):  # three polls a minute apart, every link of every GPU down
        at = int((start + 60 * step) * 1e9)
        for g in range(gpus):
            for link in range(4):
                lines.append(f"gpu,entity=GPU-{g},node=n1,link={link} nvlink_state=0 {at}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _replay(tmp_path: Path, *, boot_at: float | None, burst_at: float):  # type: ignore[no-untyped-def]
    files = [] if boot_at is None else [str(_kernel_log(tmp_path / "kern.log", boot_at))]
    files.append(str(_nvlink_burst(tmp_path / "nvlink.lp", burst_at)))
    report = replay(files, facts={"nvlink": "expected", "node": "n1"}, cluster_size=10,
                    max_disrupted_fraction=1.0, clock=FakeClock(now=burst_at + 600))
    return [f for n in report.nodes for f in n.findings if f.kind == "nvlink"], [
        r for n in report.nodes for r in n.actions]


def test_an_nvlink_burst_during_the_boot_window_raises_nothing(tmp_path: Path) -> None:
    findings, actions = _replay(tmp_path, boot_at=BOOT_AT, burst_at=BOOT_AT + 30)
    assert findings == []
    assert actions == []


def test_the_same_burst_outside_the_window_remediates(tmp_path: Path) -> None:
    later, later_actions = _replay(tmp_path, boot_at=BOOT_AT, burst_at=BOOT_AT + 3600)
    assert {f.entity for f in later} == {f"GPU-{g}" for g in range(8)}
    assert later_actions
    none, none_actions = _replay(tmp_path, boot_at=None, burst_at=BOOT_AT + 30)
    assert len(none) == 8
    assert none_actions


def test_a_link_still_down_when_the_window_ends_is_a_finding() -> None:
    clock = FakeClock(now=BOOT_AT)
    p = Pipeline(facts={"nvlink": "expected"}, notifiers=[], audit_log_path=None,
                 clock=clock, event_window_seconds=86400.0)
    boot = Event(kind="kernel_boot", code="boot", node=NodeName("n1"), entity=EntityId("node"),
                 observed_at=BOOT_AT)

    def down(at: float) -> Sample:
        return Sample(metric="gpu_nvlink_state", value=0.0, observed_at=at,
                      node=NodeName("n1"), entity=EntityId("GPU-0"), labels={"link": "0"})

    p.observe([boot, down(BOOT_AT + 30)])
    clock.advance(30)
    assert [f for f in p.evaluate().findings if f.kind == "nvlink"] == []
    p.observe([down(BOOT_AT + 700)])  # still down 700 s after the boot
    clock.advance(670)
    (finding,) = [f for f in p.evaluate().findings if f.kind == "nvlink"]
    assert finding.entity == "GPU-0"
    p.boot_window_seconds = 0  # switched off: held back nothing
    p.observe([boot])
    assert [f.kind for f in p.evaluate().findings] == ["nvlink"]
    p.close()


def test_the_live_service_knows_its_own_boot_from_proc_stat(tmp_path: Path) -> None:
    from collectors.kernel_log import boot_event

    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4\nintr 5\nctxt 6\nbtime 1700000000\nprocesses 7\n")
    event = boot_event("n1", str(stat))
    assert event is not None
    assert (event.kind, event.node, event.observed_at) == ("kernel_boot", "n1", 1_700_000_000.0)
    assert boot_event("n1", str(tmp_path / "absent")) is None
