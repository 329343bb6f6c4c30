"""Validation before a node returns to service, and the NVML state check of a GPU reset.

NVML is :class:`collectors.testing.FakeNvml` built from a recorded 8 x H100 ``nvidia-smi
-q``; the kernel log is a fake ``journalctl`` (an injected runner).
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from alerting.silences import SilenceStore
from collectors.testing import FakeNvml, given_for_dump
from core.clock import FakeClock
from core.errors import ConfigError
from core.records import ActionPhase
from gpuhealth.api import AlertingApi, ApiServer
from gpuhealth.pipeline import Pipeline
from remediation.gpu_reset import GpuResetEndpoint, GpuResetter
from remediation.validation import (
    CommandResult,
    GpuState,
    NodeAgentValidator,
    NvmlStateCheck,
    ValidationRequest,
    ValidationRunner,
    ValidationService,
    xids_by_gpu,
)

DUMP = Path(__file__).parent.parent / "fixtures" / "nvidia-smi" / "h100-80gb-hbm3-x8-q.txt"


def h100(**given: Any) -> FakeNvml:
    facts = given_for_dump(energy_mj=1_000, nvlink_states=[1] * 18, supported_events=0)
    facts.update(given)
    return FakeNvml.from_dump(DUMP, **facts)


def kernel_log(*lines: str):
    seen: list[list[str]] = []

    def runner(argv, timeout_seconds):
        seen.append(list(argv))
        return CommandResult(returncode=0, stdout="\n".join(lines) + "\n")

    runner.seen = seen  # type: ignore[attr-defined]
    return runner


def test_nvml_state_of_clean_gpus():
    fake = h100()
    check = NvmlStateCheck(nvml=fake, runner=kernel_log())
    states = check([], since_at=None)
    assert len(states) == 8
    assert all(not s.problems for s in states), states
    first = states[0].gpu
    assert first.startswith("0000:")
    (one,) = check([first], since_at=None)
    assert one.gpu == first


def test_nvml_state_names_recovery_action_remap_and_xids():
    fake = h100()
    fake.gpus[0].set(recovery_action=2)  # NODE_REBOOT
    fake.gpus[1].set(remap_pending=1)
    log = kernel_log("2027-01-15T08:00:01+00:00 node kernel: NVRM: Xid (PCI:0000:75:00): 79, "
                     "pid=0, GPU has fallen off the bus.")
    check = NvmlStateCheck(nvml=fake, runner=log)
    states = {s.gpu: s.problems for s in check([], since_at=1_800_000_000.0)}
    problems = sorted(states.items())
    assert "recovery action node_reboot" in problems[0][1]
    assert "row remap pending" in problems[1][1]
    assert any("Xid 79 logged since the fix" in p for p in states["0000:75:00.0"])
    assert log.seen[0][-1] == "@1800000000"  # type: ignore[attr-defined]
    missing = check(["0000:ff:00.0"], since_at=None)
    assert missing[0].problems == ("not found by NVML",)


def test_xids_by_gpu():
    assert xids_by_gpu(["NVRM: Xid (PCI:0000:B1:00): 48, pid=1, DBE", "unrelated"]) == {
        "0000:b1:00.0": ["48"]}


# --------------------------------------------------------------------------- on the node agent

SECRET = "whsec_" + base64.b64encode(b"node-agent-shared-secret-32bytes").decode()


class Tools:
    def __init__(self) -> None:
        self.dcgm_rc = 0

    def __call__(self, argv, timeout_seconds):
        if argv[0] == "dcgmi":
            return CommandResult(returncode=self.dcgm_rc,
                                 stdout="| Memory | Fail |" if self.dcgm_rc else "| Pass |")
        return CommandResult(returncode=0, stdout="# Avg bus bandwidth    : 300.0\n")


def clean(gpus, since_at):
    return [GpuState(gpu="0000:b1:00.0")]


@pytest.fixture
def served():
    clock = FakeClock(now=1_800_000_000.0)
    tools = Tools()
    service = ValidationService(runner=ValidationRunner(
        node="127.0.0.1", state_check=clean, runner=tools,
        which=lambda name: f"/usr/bin/{name}"))
    store = SilenceStore(clock=clock)
    pipeline = Pipeline(facts={}, notifiers=[], page_notifiers=[], audit_log_path=None,
                        clock=clock, silences=store, cluster_size=10)
    endpoint = GpuResetEndpoint(resetter=GpuResetter(), secrets=(SECRET,), node="127.0.0.1",
                                clock=clock, validation=service)
    server = ApiServer(api=AlertingApi(pipeline=pipeline, silences=store, token="t",
                                       gpu_reset=endpoint), port=0)
    server.start()
    try:
        yield server, service, tools, clock
    finally:
        server.stop()


def poll(ctl, ref, service, key):
    status = asyncio.run(ctl.status(ref))
    deadline = time.monotonic() + 10
    while status.phase is ActionPhase.RUNNING and time.monotonic() < deadline:
        service.wait(key, 5)
        status = asyncio.run(ctl.status(ref))
    return status


def test_the_controller_validates_through_the_signed_node_agent(served):
    server, service, tools, clock = served
    ctl = NodeAgentValidator(secret=SECRET, clock=clock, poll_interval_seconds=0,
                             url_template=f"http://{{node}}:{server.port}/api/v1/gpu-reset")
    ref = asyncio.run(ctl.submit(ValidationRequest(node="127.0.0.1", idempotency_key="inc/v",
                                                   since_at=clock())))
    status = poll(ctl, ref, service, "inc/v")
    assert status.phase is ActionPhase.SUCCEEDED, status
    assert status.report is not None
    assert [c.name for c in status.report.checks] == ["nvml", "dcgm_diag", "load", "nccl"]
    tools.dcgm_rc = 226
    ref = asyncio.run(ctl.submit(ValidationRequest(node="127.0.0.1", idempotency_key="inc/w")))
    failed = poll(ctl, ref, service, "inc/w")
    assert failed.phase is ActionPhase.FAILED
    assert "dcgm_diag failed" in failed.message
    # a wrong secret is refused before anything runs
    wrong = NodeAgentValidator(secret="whsec_" + base64.b64encode(b"z" * 32).decode(),
                               clock=clock,
                               url_template=f"http://{{node}}:{server.port}/api/v1/gpu-reset")
    ref = asyncio.run(wrong.submit(ValidationRequest(node="127.0.0.1", idempotency_key="x")))
    refused = asyncio.run(wrong.status(ref))
    assert refused.phase is ActionPhase.FAILED
    assert "(401)" in refused.message
    dry = asyncio.run(ctl.submit(ValidationRequest(node="127.0.0.1", idempotency_key="d",
                                                   dry_run=True)))
    assert asyncio.run(ctl.status(dry)).phase is ActionPhase.SUCCEEDED


def test_settings_build_the_validators(tmp_path, monkeypatch):
    from gpuhealth.compose import build_validator
    from gpuhealth.config import load_settings
    from remediation.validation import LocalValidator

    local = tmp_path / "local.toml"
    local.write_text('[node]\nname = "n1"\n[remediation.validation]\nwhere = "local"\n'
                     'checks = ["nvml", "dcgm_diag"]\ndcgm_level = 1\n')
    built = build_validator(load_settings(local, env={}))
    assert isinstance(built, LocalValidator)
    assert built.runner.checks == ("nvml", "dcgm_diag")
    assert built.runner.dcgm_level == 1
    agent = tmp_path / "agent.toml"
    agent.write_text('[remediation.validation]\nwhere = "node_agent"\n'
                     'secret_env = "GPUHEALTH_TEST_SECRET"\n')
    monkeypatch.setenv("GPUHEALTH_TEST_SECRET", SECRET)
    assert isinstance(build_validator(load_settings(agent, env={})), NodeAgentValidator)
    assert build_validator(load_settings(None, env={})) is None
    bad = tmp_path / "bad.toml"
    bad.write_text('[remediation.validation]\nwhere = "moon"\n')
    with pytest.raises(ConfigError, match="where must be"):
        build_validator(load_settings(bad, env={}))
    typo = tmp_path / "typo.toml"
    typo.write_text('[remediation.validation]\nchecks = ["nvml", "burn"]\n')
    with pytest.raises(ConfigError, match="unknown validation check"):
        build_validator(load_settings(typo, env={}))


def test_slurm_reboot_resume_with_validation_is_warned(tmp_path, caplog):
    from gpuhealth.compose import build_validator
    from gpuhealth.config import load_settings

    config = tmp_path / "slurm.toml"
    config.write_text('[remediation]\nscheduler = "slurm"\n'
                      '[remediation.validation]\nwhere = "local"\n')
    with caplog.at_level("WARNING", logger="gpuhealth.compose"):
        build_validator(load_settings(config, env={}))
    assert "reboot_nextstate" in caplog.text


def test_the_agents_own_nvml_collector_lets_go_during_a_reset():
    """QuiescibleCollector: paused and closed inside ``quiesced()``, reopened after."""
    from collectors.nvml import NvmlCollector
    from remediation.gpu_reset import QuiescibleCollector, quiesce_all

    fake = h100()
    inner = NvmlCollector(node="n1", events=False, nvml=fake, deadline_seconds=0)
    wrapped = QuiescibleCollector(inner)
    assert wrapped.name == inner.name
    assert list(wrapped.collect())
    assert inner._lib is not None  # NVML open: the device files are held
    with quiesce_all([wrapped])():
        assert inner._lib is None  # shut down: released
        assert list(wrapped.collect()) == []
    assert wrapped.errors_total is inner.errors_total  # the rest is the collector's
    assert list(wrapped.collect()) is not None
    assert inner._lib is not None  # reopened on the first collection after
    inner.close()


def test_the_node_agent_service_wires_reset_validation_bundle_and_quiesce(tmp_path,
                                                                          monkeypatch):
    """``[remediation.gpu_reset_agent]`` with ``validation`` and ``bundle`` sub-tables."""
    from collectors.nvml import NvmlCollector
    from gpuhealth.config import load_settings
    from gpuhealth.service import Service
    from remediation.gpu_reset import QuiescibleCollector

    config = tmp_path / "agent.toml"
    config.write_text(f'[node]\nname = "n1"\ndata_dir = "{tmp_path}"\n'
                      '[remediation.gpu_reset_agent]\nsecret_env = "GH_TEST_S"\n'
                      'services = ["nvidia-persistenced"]\n'
                      '[remediation.gpu_reset_agent.validation]\nchecks = ["nvml", "nccl"]\n'
                      '[remediation.gpu_reset_agent.bundle]\ntimeout_seconds = 30\n')
    monkeypatch.setenv("GH_TEST_S", SECRET)
    nvml = NvmlCollector(node="n1", events=False, nvml=h100())
    service = Service(load_settings(config), stop=threading.Event(),
                      collectors={"nvml": nvml}, role="agent")
    service.collectors = {"nvml": nvml}
    endpoint = service._gpu_reset_endpoint()
    assert endpoint is not None
    assert endpoint.validation is not None
    assert endpoint.validation.runner.checks == ("nvml", "nccl")
    assert endpoint.bundle is not None
    assert endpoint.bundle.directory == str(tmp_path / "bundles")
    assert endpoint.resetter.bundle is endpoint.bundle
    assert endpoint.resetter.services == ("nvidia-persistenced",)
    assert isinstance(service.collectors["nvml"], QuiescibleCollector)
    assert endpoint.resetter.quiesce is not None


def test_the_node_agent_is_asked_at_most_every_poll_interval(served):
    server, service, _tools, clock = served
    gate = threading.Event()
    service.runner.state_check = lambda gpus, since: (gate.wait(10), clean(gpus, since))[1]
    ctl = NodeAgentValidator(secret=SECRET, clock=clock, poll_interval_seconds=15,
                             url_template=f"http://{{node}}:{server.port}/api/v1/gpu-reset")
    ref = asyncio.run(ctl.submit(ValidationRequest(node="127.0.0.1", idempotency_key="p")))
    first = asyncio.run(ctl.status(ref))
    assert first.phase is ActionPhase.RUNNING
    gate.set()
    service.wait("p", 5)
    assert asyncio.run(ctl.status(ref)) is first  # not asked again yet
    clock.advance(15)
    assert asyncio.run(ctl.status(ref)).phase is ActionPhase.SUCCEEDED
