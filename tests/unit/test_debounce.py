"""Debounce (#16 item 6): a polled state becomes a finding only after N of M bad readings.

One NVLink reading down between good ones raises nothing; two of three raise; the same
counting holds in ``run``/``agent`` (the service passes repeated readings too) and in
``replay`` of a recording; events (an Xid) are never debounced; ``config check`` names a
wrong ``[analytics.debounce]`` key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from analytics.fault_model.debounce import DEFAULT_DEBOUNCE, Debouncer
from core.clock import FakeClock
from core.errors import ConfigError
from core.records import EntityId, Event, NodeName, Sample
from gpuhealth.compose import agent_pipeline, debouncer, service_pipeline
from gpuhealth.config import load_settings
from gpuhealth.pipeline import Pipeline
from gpuhealth.replay import replay

T0 = 1_800_000_000.0


def _link(at: float, up: bool, *, gpu: str = "GPU-0", node: str = "n1") -> list[Sample]:
    return [Sample(metric="gpu_nvlink_state", value=1.0 if (up or link) else 0.0,
                   observed_at=at, node=NodeName(node), entity=EntityId(gpu),
                   labels={"link": str(link)}) for link in range(4)]


def _pipeline(policies: dict[str, tuple[int, int]] | None = None) -> tuple[Pipeline, FakeClock]:
    clock = FakeClock(now=T0)
    p = Pipeline(facts={"nvlink": "expected"}, notifiers=[], audit_log_path=None, clock=clock,
                 event_window_seconds=86400.0)
    p.debounce = Debouncer(DEFAULT_DEBOUNCE if policies is None else policies)
    return p, clock


def _nvlink(p: Pipeline) -> list[str]:
    return [f.code for f in p.evaluate().findings if f.kind == "nvlink"]


def test_one_bad_reading_of_three_raises_nothing() -> None:
    p, clock = _pipeline()
    for step, up in enumerate((True, False, True, True)):
        p.observe(_link(T0 + 30 * step, up))
        clock.advance(30)
        assert _nvlink(p) == []  # the rule sees link 0 down at step 1: held back
    assert p.debounce.counts("n1", "GPU-0", "nvlink", "link_down") == (1, 3)
    assert not p.active_alerts()
    p.close()


def test_two_bad_readings_of_three_raise() -> None:
    p, clock = _pipeline()
    p.observe(_link(T0, False))
    assert _nvlink(p) == []
    assert [f.kind for f in p.debounce.held] == ["nvlink"]
    p.observe(_link(T0 + 30, False))
    clock.advance(30)
    assert _nvlink(p) == ["link_down"]
    (alert,) = p.active_alerts()
    assert alert.labels["kind"] == "nvlink"
    # standing, it stays while the rule yields it, and clears with the first good reading
    p.observe(_link(T0 + 60, True))
    clock.advance(30)
    assert _nvlink(p) == []
    p.close()


def test_many_evaluations_of_one_reading_are_one_observation() -> None:
    """The counting is per poll, not per evaluation (5 s evaluations, 30 s polls)."""
    p, clock = _pipeline()
    p.observe(_link(T0, False))
    for _ in range(6):
        clock.advance(5)
        assert _nvlink(p) == []
    assert p.debounce.counts("n1", "GPU-0", "nvlink", "link_down") == (1, 1)
    p.close()


def test_a_reading_in_two_batches_is_one_reading() -> None:
    p, _ = _pipeline()
    samples = _link(T0, False)
    p.observe(samples[:2])
    assert _nvlink(p) == []
    p.observe(samples[2:])  # the rest of the same poll, after an evaluation
    assert _nvlink(p) == []
    assert p.debounce.counts("n1", "GPU-0", "nvlink", "link_down") == (1, 1)
    p.close()


def test_configured_n_of_m() -> None:
    p, clock = _pipeline({"nvlink": (3, 5)})
    for step, up in enumerate((False, True, False, True)):
        p.observe(_link(T0 + 30 * step, up))
        clock.advance(30)
        assert _nvlink(p) == []  # 2 of 4: not yet 3 of 5
    p.observe(_link(T0 + 120, False))
    assert _nvlink(p) == ["link_down"]  # 3 of 5
    p.close()


def test_a_kind_switched_off_raises_on_first_sight() -> None:
    p, _ = _pipeline({"nvlink": (1, 1)})
    assert not p.debounce
    p.observe(_link(T0, False))
    assert _nvlink(p) == ["link_down"]
    p.close()


def test_an_ib_port_down_once_raises_nothing_and_down_twice_raises() -> None:
    p, clock = _pipeline()

    def reading(at: float, state: float, code: str | None) -> list[Sample | Event]:
        records: list[Sample | Event] = [Sample(
            metric="ib_port_state", value=state, observed_at=at, node=NodeName("n1"),
            entity=EntityId("mlx5_0:1"), labels={"device": "mlx5_0", "port": "1"})]
        if code is not None:  # the collector's event on a change of state
            records.append(Event(kind="ib_port_state", code=code, node=NodeName("n1"),
                                 entity=EntityId("mlx5_0:1"), observed_at=at,
                                 attrs={"phys_state": "polling"}))
        return records

    p.observe(reading(T0, 1.0, "down"))
    p.observe(reading(T0 + 10, 4.0, "active"))
    p.observe(reading(T0 + 20, 4.0, None))
    clock.advance(20)
    assert [f for f in p.evaluate().findings if f.kind == "ib_port"] == []
    p.observe(reading(T0 + 30, 1.0, "down"))
    p.observe(reading(T0 + 40, 1.0, None))  # the service passes the repeated reading too
    clock.advance(20)
    assert [f.code for f in p.evaluate().findings if f.kind == "ib_port"] == ["state_down"]
    p.close()


def test_the_service_counts_repeated_readings() -> None:
    """``observe_readings``: what the service gives for samples whose value did not change."""
    p, clock = _pipeline()
    p.observe(_link(T0, False))
    assert _nvlink(p) == []
    p.observe_readings(_link(T0 + 30, False))  # same values, next poll
    clock.advance(30)
    assert _nvlink(p) == ["link_down"]
    p.close()


def test_an_xid_is_never_debounced() -> None:
    p, _ = _pipeline()
    p.observe([Event(kind="xid", code="79", node=NodeName("n1"),
                     entity=EntityId("0000:3b:00.0"), observed_at=T0,
                     message="NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")])
    assert any(f.kind == "xid" and f.code == "79" for f in p.evaluate().findings)
    p.close()


def test_a_snapshot_without_times_is_not_debounced() -> None:
    p, _ = _pipeline()
    p.observe([Sample(metric="gpu_nvlink_state", value=0.0, observed_at=None,
                      node=NodeName("n1"), entity=EntityId("GPU-0"), labels={"link": "0"})])
    assert _nvlink(p) == ["all_down"]
    p.close()


def _recording(path: Path, states: list[bool]) -> Path:
    lines = []
    for step, up in enumerate(states):  # one poll a minute, link 0 of GPU-0
        at = int((T0 + 60 * step) * 1e9)
        lines += [f"gpu,entity=GPU-0,node=n1,link={link} nvlink_state={1 if up or link else 0} "
                  f"{at}" for link in range(4)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("states", "raised"), [
    ([True, True, True, False], False),   # down in 1 of the last 3 readings
    ([True, True, False, False], True),   # 2 of 3
])
def test_replay_counts_the_recordings_readings(tmp_path: Path, states: list[bool],
                                               raised: bool) -> None:
    report = replay([str(_recording(tmp_path / "n1.lp", states))],
                    facts={"nvlink": "expected", "node": "n1"}, cluster_size=10,
                    max_disrupted_fraction=1.0, analyse=False,
                    clock=FakeClock(now=T0 + 600))
    alerted = [a for n in report.nodes for a in n.alerts if a.labels.get("kind") == "nvlink"]
    assert bool(alerted) is raised
    assert bool([r for n in report.nodes for r in n.actions]) is raised


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "gpuhealth.toml"
    path.write_text(f'[node]\nname = "n1"\ndata_dir = "{tmp_path / "data"}"\n{body}')
    return path


def test_run_agent_and_replay_build_the_same_debounce(tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path, "[analytics.debounce]\n"
                                     "nvlink = { n = 3, m = 4 }\n"))
    run = service_pipeline(settings, identity="t", is_leader=lambda: True)
    agent = agent_pipeline(settings)
    try:
        for p in (run, agent):
            assert p.debounce.policies == debouncer(settings.analytics).policies
            assert p.debounce.policies["nvlink"] == (3, 4)
            assert p.debounce.policies["pcie"] == (2, 3)  # merged over the defaults
    finally:
        run.close()
        agent.close()
    assert debouncer(None).policies == dict(DEFAULT_DEBOUNCE)


@pytest.mark.parametrize(("body", "message"), [
    ("xid = { n = 2, m = 3 }", "[analytics] debounce: xid: not a polled state"),
    ("nvlink = { n = 4, m = 3 }", "[analytics.debounce] nvlink: n = 4 is more than m = 3"),
    ("nvlink = { n = 0, m = 3 }", "[analytics.debounce.nvlink] n:"),
    ("nvlink = { n = 2 }", "[analytics.debounce.nvlink] m: Field required"),
    ("nvlink = { n = 2, m = 3, for = 1 }", "[analytics.debounce.nvlink] unknown key 'for'"),
    ("ib_port = { n = 2, m = 1000 }", "[analytics.debounce.ib_port] m:"),
])
def test_config_errors_name_the_key(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(_config(tmp_path, f"[analytics.debounce]\n{body}\n"))
    assert message in str(err.value)


def test_config_check_refuses_a_wrong_debounce(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gpuhealth.cli import main

    path = _config(tmp_path, "[analytics.debounce]\nxid = { n = 2, m = 3 }\n")
    result = CliRunner().invoke(main, ["config", "check", "--config", str(path)])
    assert result.exit_code != 0
    assert "xid: not a polled state" in result.output


def test_the_service_raises_a_link_that_stays_down_after_two_polls(tmp_path: Path) -> None:
    """``gpuhealth run``'s service, a fake NVML: the state is sent once (only changes reach
    the fault model), yet every poll counts, so a link that stays down is raised."""
    import time as _time

    from collectors.nvml import NvmlCollector
    from collectors.testing import FakeNvml, given_for_dump
    from gpuhealth.service import Service

    dumps = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
    settings = load_settings(_config(tmp_path, """
[inventory]
nvlink = "expected"
[metrics]
enabled = false
[storage]
flush_interval_seconds = "50ms"
[analytics]
evaluate_interval_seconds = "100ms"
detectors = false
predictor = false
"""), env={})
    fake = FakeNvml.from_dump(dumps / "a10-q.txt", **given_for_dump())
    fake.gpus[0].set(nvlink_states=[1, 1, 1, 1])
    collector = NvmlCollector(node="n1", nvml=fake, fast_interval_seconds=0.1,
                              slow_interval_seconds=0.3, event_wait_ms=20)
    service = Service(settings, collectors={"nvml": collector})
    service.start()
    try:
        pipeline = service.pipeline
        assert pipeline is not None
        uuid = str(fake.gpus[0].facts["uuid"])

        def counts() -> tuple[int, int] | None:
            return pipeline.debounce.counts("n1", uuid, "nvlink", "link_down")

        def wait(check, seconds: float = 15.0):  # type: ignore[no-untyped-def]
            deadline = _time.monotonic() + seconds
            while _time.monotonic() < deadline:
                if (got := check()):
                    return got
                _time.sleep(0.05)
            raise AssertionError(f"not within {seconds} s: {counts()}")

        wait(lambda: (c := counts()) is not None and c[1] >= 2)  # healthy polls counted
        fake.gpus[0].set(nvlink_states=[0, 1, 1, 1])
        (alert,) = wait(lambda: [a for a in pipeline.active_alerts()
                                 if a.labels.get("kind") == "nvlink"])
        bad, readings = counts() or (0, 0)
        assert bad >= 2, (bad, readings)  # raised on the second bad poll, not the first
        assert alert.labels["entity"] == uuid
    finally:
        service.shutdown()


def test_a_repeated_reading_moves_the_state_on_past_a_boot_window() -> None:
    """A link down at boot, still down every poll after the window: the service sends the
    value once, yet the state's latest reading is the latest poll, so it is a finding."""
    p, clock = _pipeline()
    p.observe([Event(kind="kernel_boot", code="boot", node=NodeName("n1"),
                     entity=EntityId("node"), observed_at=T0)])
    p.observe(_link(T0 + 30, False))
    for at in (60, 90):
        p.observe_readings(_link(T0 + at, False))
    clock.advance(90)
    assert _nvlink(p) == []  # within the boot window
    for at in range(120, 721, 30):
        p.observe_readings(_link(T0 + at, False))
    clock.advance(630)
    (finding,) = [f for f in p.evaluate().findings if f.kind == "nvlink"]
    assert finding.last_seen_at == T0 + 720
    p.close()
