"""GPU reset on the node: a fake ``nvidia-smi`` on PATH, the real API server, signed requests.

The fake ``nvidia-smi`` is a shell script in a temporary folder, first on ``PATH``:
it appends its arguments to ``calls.log``, prints ``pids`` (the compute processes) for
``--query-compute-apps``, and for ``-r`` exits with the code in ``reset_rc`` after
printing ``reset_stderr`` and sleeping ``reset_sleep`` seconds. The node agent is
gpuhealth's real HTTP API server on a free loopback port; the controller side is
:class:`NodeAgentResetter` talking to it over HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from alerting.silences import SilenceStore
from core.clock import FakeClock
from core.errors import ConfigError, PermanentError
from core.protocols import SchedulerAdapter
from core.records import ActionPhase, ActionRequest, EntityId, NodeName, RemediationStep
from gpuhealth.api import AlertingApi, ApiServer
from gpuhealth.pipeline import Pipeline
from remediation.gpu_reset import (
    CommandResult,
    GpuResetEndpoint,
    GpuResetter,
    NodeAgentResetter,
    ResetOutcome,
    fallback_of,
    validate_gpu,
)
from remediation.validation import GpuState

SECRET = "whsec_" + base64.b64encode(b"node-agent-shared-secret-32bytes").decode()
KEY = b"node-agent-shared-secret-32bytes"
NOW = 1_800_000_000.0
BUS = "0000:b1:00.0"

FAKE_SMI = """#!/bin/sh
D="{folder}"
echo "$*" >> "$D/calls.log"
case "$1" in
  --query-gpu=pci.bus_id,persistence_mode)
    if [ -f "$D/identify_rc" ]; then
      echo "No devices were found" >&2; exit "$(cat "$D/identify_rc")"
    fi
    if [ -f "$D/gpus" ]; then cat "$D/gpus"; else echo "00000000:B1:00.0, Disabled"; fi
    exit 0 ;;
  --query-compute-apps=pid)
    if [ -f "$D/query_rc" ]; then echo "NVML: Unknown Error" >&2; exit "$(cat "$D/query_rc")"; fi
    [ -f "$D/pids" ] && cat "$D/pids"
    exit 0 ;;
  -pm)
    [ -f "$D/pm_rc" ] && {{ echo "Unable to set persistence mode" >&2; exit "$(cat "$D/pm_rc")"; }}
    echo "Persistence mode set to $2 for GPU $4."
    exit 0 ;;
  -r)
    [ -f "$D/reset_sleep" ] && sleep "$(cat "$D/reset_sleep")"
    [ -f "$D/reset_stderr" ] && cat "$D/reset_stderr" >&2
    rc=0; [ -f "$D/reset_rc" ] && rc="$(cat "$D/reset_rc")"
    [ "$rc" = 0 ] && echo "GPU 00000000:B1:00.0 was successfully reset."
    exit "$rc" ;;
esac
exit 2
"""

FAKE_SYSTEMCTL = """#!/bin/sh
# systemctl stand-in: a service's holder process lives in $D/proc/<pid> (see FakeNode);
# stopping the service moves it to $D/stopped, starting it moves it back.
D="{folder}"
echo "systemctl $*" >> "$D/calls.log"
verb="$1"; unit="$2"
if [ -f "$D/${{verb}}_rc_$unit" ]; then
  echo "Job for $unit.service failed." >&2; exit "$(cat "$D/${{verb}}_rc_$unit")"
fi
pid=""; [ -f "$D/pid_$unit" ] && pid="$(cat "$D/pid_$unit")"
case "$verb" in
  is-active) [ -f "$D/active_$unit" ] && {{ echo active; exit 0; }}; echo inactive; exit 3 ;;
  stop) [ -n "$pid" ] && [ -d "$D/proc/$pid" ] && mv "$D/proc/$pid" "$D/stopped/"
        rm -f "$D/active_$unit"; exit 0 ;;
  start) [ -n "$pid" ] && [ -d "$D/stopped/$pid" ] && mv "$D/stopped/$pid" "$D/proc/"
         touch "$D/active_$unit"; exit 0 ;;
esac
exit 1
"""


class FakeSmi:
    """The fake ``nvidia-smi`` and ``systemctl``, a fake ``/proc`` and ``/dev``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.proc = folder / "proc"
        self.dev = folder / "dev"
        for sub in (self.proc, self.dev, folder / "stopped"):
            sub.mkdir()
        info = self.proc / "driver" / "nvidia" / "gpus" / BUS
        info.mkdir(parents=True)
        (info / "information").write_text("Model: NVIDIA H100 80GB HBM3\nIRQ: 0\n"
                                          "Device Minor: 0\nBus Location: 0000:b1:00.0\n")

    def set(self, name: str, text: str) -> None:
        (self.folder / name).write_text(text)

    def clear(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)

    def calls(self) -> list[str]:
        log = self.folder / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def holder(self, pid: int, comm: str, unit: str | None, device: str = "/dev/nvidia0",
               *, active: bool = True) -> None:
        """A process holding ``device``, in systemd unit ``unit`` (a service, if given)."""
        base = self.proc / str(pid)
        (base / "fd").mkdir(parents=True)
        os.symlink(device, base / "fd" / "3")
        os.symlink("/dev/null", base / "fd" / "0")
        (base / "comm").write_text(comm + "\n")
        cgroup = f"/system.slice/{unit}.service" if unit else "/user.slice/session-4.scope"
        (base / "cgroup").write_text(f"0::{cgroup}\n")
        if unit:
            self.set(f"pid_{unit}", str(pid))
            if active:
                self.set(f"active_{unit}", "")

    def resetter(self, **kw: Any) -> GpuResetter:
        kw.setdefault("state_check", CleanState())
        kw.setdefault("sleep", lambda seconds: None)
        return GpuResetter(proc_root=str(self.proc), dev_root=str(self.dev), **kw)


class CleanState:
    """A GPU state check: answers the next of ``answers`` (problems per call), then clean."""

    def __init__(self, *answers: tuple[str, ...]) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[tuple[str, ...], float | None]] = []

    def __call__(self, gpus, since_at):
        self.asked.append((tuple(gpus), since_at))
        problems = self.answers.pop(0) if self.answers else ()
        return [GpuState(gpu=g, problems=problems) for g in gpus]


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("nvidia-smi", FAKE_SMI), ("systemctl", FAKE_SYSTEMCTL)):
        script = folder / name
        script.write_text(text.format(folder=folder))
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return FakeSmi(folder)


# --------------------------------------------------------------------------- node side


@pytest.mark.parametrize(("text", "expected"), [
    ("0000:b1:00.0", "0000:b1:00.0"),
    ("0000:B1:00.0", "0000:b1:00.0"),
    ("00000000:1A:00.7", "0000:1a:00.7"),
    (" 0000:b1:00.0 ", "0000:b1:00.0"),
    ("GPU-0a1b2c3d-1111-2222-3333-444455556666", "GPU-0a1b2c3d-1111-2222-3333-444455556666"),
])
def test_gpu_ids_accepted(text, expected):
    assert validate_gpu(text) == expected


@pytest.mark.parametrize("text", ["", "0", "gpu:0", "node", "0000:b1:00", "0000:b1:00.8",
                                  "0000:zz:00.0", "b1:00.0", "0000:b1:00.0;reboot",
                                  "GPU-0a1b", "-r", "MIG-0a1b2c3d-1111-2222-3333-444455556666"])
def test_gpu_ids_refused(text):
    with pytest.raises(ValueError, match="gpu: expected a PCI bus id"):
        validate_gpu(text)


IDENTIFY = f"--query-gpu=pci.bus_id,persistence_mode --format=csv,noheader -i {BUS}"
APPS = f"--query-compute-apps=pid --format=csv,noheader -i {BUS}"


def test_an_idle_gpu_is_reset(smi):
    state = CleanState()
    result = smi.resetter(state_check=state).reset("0000:B1:00.0")
    assert result.outcome is ResetOutcome.OK
    assert result.gpu == BUS
    assert "successfully reset" in result.message
    assert smi.calls() == [IDENTIFY, APPS, f"-r -i {BUS}"]
    assert [s.name for s in result.steps] == ["identify", "processes", "holders", "reset",
                                              "verify"]
    assert all(s.ok for s in result.steps)
    assert state.asked[0][0] == (BUS,)
    assert result.fallback == ""


def test_a_busy_gpu_is_not_reset(smi):
    smi.set("pids", "4242\n77\n4242\n")
    result = smi.resetter().reset(BUS)
    assert (result.outcome, result.pids) == (ResetOutcome.BUSY, (77, 4242))
    assert smi.calls() == [IDENTIFY, APPS]  # nothing changed


def test_failed_query_means_no_reset(smi):
    smi.set("query_rc", "15")
    result = smi.resetter().reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert "NVML: Unknown Error" in result.stderr
    assert len(smi.calls()) == 2
    assert result.fallback == "reboot"


def test_failed_reset_reports_stderr_and_in_use_is_busy(smi):
    smi.set("reset_rc", "3")
    smi.set("reset_stderr", "GPU Reset couldn't run because GPU 00000000:B1:00.0 is the "
                            "primary GPU.")
    result = smi.resetter().reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert "primary GPU" in result.stderr
    assert "exit 3" in result.message
    assert result.fallback == "reboot"
    assert "falls back to a node reboot" in result.message
    assert result.steps[-1].name == "fallback"
    smi.set("reset_stderr", "Unable to reset this GPU because it's being used by some "
                            "other process (e.g. CUDA application)")
    assert smi.resetter().reset(BUS).outcome is ResetOutcome.BUSY


def test_a_hung_reset_times_out(smi):
    smi.set("reset_sleep", "5")
    started = time.monotonic()
    result = smi.resetter(reset_timeout_seconds=0.3).reset(BUS)
    assert time.monotonic() - started < 4
    assert result.outcome is ResetOutcome.FAILED
    assert "timed out" in result.stderr


def test_missing_nvidia_smi_fails_cleanly(smi, tmp_path):
    result = smi.resetter(nvidia_smi=str(tmp_path / "absent")).reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert "cannot run" in result.stderr


def test_never_two_resets_at_once_and_a_key_resets_once(smi):
    smi.set("reset_sleep", "1")
    resetter = smi.resetter()
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(resetter.reset(BUS,
                                                                          idempotency_key="k")))
    first.start()
    deadline = time.monotonic() + 5
    while len(smi.calls()) < 3 and time.monotonic() < deadline:  # the reset is running
        time.sleep(0.01)
    second = resetter.reset("0000:b2:00.0")
    first.join()
    assert second.outcome is ResetOutcome.BUSY
    assert "another GPU reset" in second.message
    assert results[0].outcome is ResetOutcome.OK
    again = resetter.reset(BUS, idempotency_key="k")
    assert again == results[0]
    assert [c for c in smi.calls() if c.startswith("-r")] == [f"-r -i {BUS}"]


def test_injected_runner(tmp_path):
    seen: list[list[str]] = []

    def runner(argv, timeout_seconds):
        seen.append(list(argv))
        if argv[1].startswith("--query-gpu"):
            return CommandResult(returncode=0, stdout="00000000:B1:00.0, Disabled\n")
        return CommandResult(returncode=0, stdout="No running processes found\n")

    resetter = GpuResetter(nvidia_smi="smi", runner=runner, state_check=CleanState(),
                           proc_root=str(tmp_path), dev_root=str(tmp_path))
    assert resetter.reset(BUS).outcome is ResetOutcome.OK
    assert [a[1] for a in seen] == ["--query-gpu=pci.bus_id,persistence_mode",
                                    "--query-compute-apps=pid", "-r"]


# -- the reset that works on real nodes: holders, services, persistence, verification


def test_services_holding_the_gpu_are_stopped_and_restored(smi):
    """persistenced and DCGM hold /dev/nvidia0, persistence mode is on (NVSentinel #1690)."""
    smi.set("gpus", "00000000:B1:00.0, Enabled\n")
    smi.holder(101, "nvidia-persiste", "nvidia-persistenced")
    smi.holder(202, "nv-hostengine", "nvidia-dcgm")
    smi.holder(303, "bash", None, device="/dev/nvidia1")  # another GPU: not in the way
    audited: list[tuple[str, str]] = []
    resetter = smi.resetter(audit=lambda when, step: audited.append((when, step.name)))
    result = resetter.reset(BUS)
    assert result.outcome is ResetOutcome.OK, result
    assert smi.calls() == [
        IDENTIFY, APPS,
        "systemctl stop nvidia-dcgm", "systemctl stop nvidia-persistenced",
        f"-pm 0 -i {BUS}", f"-r -i {BUS}",
        f"-pm 1 -i {BUS}", "systemctl start nvidia-persistenced", "systemctl start nvidia-dcgm",
    ]
    holders = next(s for s in result.steps if s.name == "holders")
    assert "pid 101 nvidia-persiste (nvidia-persistenced) /dev/nvidia0" in holders.output
    assert "pid 202 nv-hostengine (nvidia-dcgm)" in holders.output
    assert "303" not in holders.output
    again = next(s for s in result.steps if s.name == "holders again")
    assert again.output == "none"
    # every step is audited before it runs, and again with its result
    assert audited.index(("about to", "reset")) < audited.index(("done", "reset"))
    assert audited.index(("done", "stop nvidia-dcgm")) < audited.index(("about to", "reset"))
    assert (smi.proc / "101").is_dir()  # running again
    assert (smi.proc / "202").is_dir()


def test_a_process_that_is_no_service_makes_the_gpu_busy(smi):
    smi.holder(404, "python3", None)
    result = smi.resetter().reset(BUS)
    assert (result.outcome, result.pids) == (ResetOutcome.BUSY, (404,))
    assert "pid 404 (python3)" in result.message
    assert smi.calls() == [IDENTIFY, APPS]


def test_this_process_lets_go_of_the_gpu_when_it_can(smi):
    """gpuhealth's own NVML collector holds the GPU: busy, unless ``quiesce`` is given."""
    smi.holder(os.getpid(), "gpuhealth", "gpuhealth")
    busy = smi.resetter().reset(BUS)
    assert busy.outcome is ResetOutcome.BUSY
    assert f"pid {os.getpid()} (gpuhealth, gpuhealth)" in busy.message
    events: list[str] = []

    @contextlib.contextmanager
    def quiesce():
        events.append("paused")
        (smi.proc / str(os.getpid())).rename(smi.folder / "stopped" / str(os.getpid()))
        yield
        events.append("resumed")

    result = smi.resetter(quiesce=quiesce).reset(BUS)
    assert result.outcome is ResetOutcome.OK, result
    assert events == ["paused", "resumed"]
    names = [s.name for s in result.steps]
    assert names.index("quiesce") < names.index("reset") < names.index("restore gpuhealth")


def test_a_service_that_cannot_be_stopped_fails_restores_and_falls_back(smi):
    smi.set("gpus", "00000000:B1:00.0, Enabled\n")
    smi.holder(101, "nvidia-persiste", "nvidia-persistenced")
    smi.holder(202, "nv-hostengine", "nvidia-dcgm")
    smi.set("stop_rc_nvidia-persistenced", "1")
    result = smi.resetter().reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert result.fallback == "reboot"
    assert "could not stop nvidia-persistenced" in result.message
    assert "Job for nvidia-persistenced.service failed" in result.stderr
    calls = smi.calls()
    assert not any(c.startswith(("-r", "-pm")) for c in calls)  # never reset
    assert calls[-1] == "systemctl start nvidia-dcgm"  # what was stopped is restored


def test_a_reset_that_does_not_come_back_clean_falls_back_to_reboot(smi):
    smi.set("gpus", "00000000:B1:00.0, Enabled\n")
    smi.holder(101, "nvidia-persiste", "nvidia-persistenced")
    state = CleanState(("recovery action node_reboot",), ("recovery action node_reboot",))
    result = smi.resetter(state_check=state, verify_attempts=2).reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert result.fallback == "reboot"
    assert "did not come back clean" in result.message
    assert "recovery action node_reboot" in result.stderr
    assert [s.name for s in result.steps if s.name == "verify"] == ["verify", "verify"]
    assert smi.calls()[-2:] == [f"-pm 1 -i {BUS}", "systemctl start nvidia-persistenced"]


def test_the_gpu_coming_back_on_the_second_look_is_ok(smi):
    slept: list[float] = []
    state = CleanState(("NVML: gpu lost",))
    result = smi.resetter(state_check=state, sleep=slept.append,
                          verify_interval_seconds=7).reset(BUS)
    assert result.outcome is ResetOutcome.OK
    assert slept == [7]


def test_a_failing_restore_fails_the_reset(smi):
    smi.holder(202, "nv-hostengine", "nvidia-dcgm")
    smi.set("start_rc_nvidia-dcgm", "1")
    result = smi.resetter().reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert result.message.startswith("GPU reset, but the restore failed")
    assert result.fallback == "reboot"


def test_fallback_none_says_nothing_of_a_reboot(smi):
    smi.set("reset_rc", "3")
    result = smi.resetter(fallback="none").reset(BUS)
    assert (result.outcome, result.fallback) == (ResetOutcome.FAILED, "")


def test_nvswitch_system_stops_the_fabric_and_resets_the_domain(smi):
    """On an NVSwitch system the fabric is stopped and all GPUs are reset together."""
    (smi.dev / "nvidia-nvswitch0").write_text("")
    smi.set("gpus", "00000000:B1:00.0, Enabled\n00000000:B2:00.0, Enabled\n")
    smi.holder(505, "nv-fabricmanage", "nvidia-fabricmanager", device="/dev/nvidia-nvswitch0")
    smi.set("active_nvidia-imex", "")
    result = smi.resetter().reset(BUS)
    assert result.outcome is ResetOutcome.OK, result
    assert result.gpus == (BUS, "0000:b2:00.0")
    calls = smi.calls()
    assert calls[:2] == ["--query-gpu=pci.bus_id,persistence_mode --format=csv,noheader",
                         "--query-compute-apps=pid --format=csv,noheader"]
    assert "systemctl stop nvidia-imex" in calls
    assert "systemctl stop nvidia-fabricmanager" in calls
    assert "-r" in calls  # the whole domain
    assert calls.index("systemctl stop nvidia-fabricmanager") < calls.index("-r")
    assert calls[-2:] == ["systemctl start nvidia-fabricmanager", "systemctl start nvidia-imex"]
    single = smi.resetter(domain_reset="gpu").reset(BUS)
    assert single.gpus == (BUS,)


def test_bad_resetter_settings(smi):
    for kw in ({"domain_reset": "all"}, {"fallback": "pray"}, {"verify_attempts": 0},
               {"service_timeout_seconds": 0}):
        with pytest.raises(ConfigError):
            smi.resetter(**kw)


# --------------------------------------------------------------------------- the endpoint


def sign(msg_id: str, timestamp: int, body: bytes, key: bytes = KEY) -> str:
    """Standard Webhooks signature computed here, independently of gpuhealth's code."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(now=NOW)


@pytest.fixture
def agent(smi, clock) -> Iterator[ApiServer]:
    """gpuhealth's real API server, serving the GPU reset of node ``127.0.0.1``."""
    store = SilenceStore(clock=clock)
    pipeline = Pipeline(facts={}, notifiers=[], page_notifiers=[], audit_log_path=None,
                        clock=clock, silences=store, cluster_size=10)
    endpoint = GpuResetEndpoint(resetter=smi.resetter(), secrets=(SECRET,), node="127.0.0.1",
                                clock=clock)
    api = AlertingApi(pipeline=pipeline, silences=store, token="api-token", gpu_reset=endpoint)
    server = ApiServer(api=api, port=0)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def signed(body: bytes, msg_id: str, timestamp: int, key: bytes = KEY) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(msg_id, timestamp, body, key)}


def test_endpoint_accepts_a_signed_request_and_refuses_the_rest(agent, smi, clock):
    url = agent.url + "/api/v1/gpu-reset"
    body = json.dumps({"node": "127.0.0.1", "gpu": "0000:B1:00.0",
                       "idempotency_key": "fp/reset_gpu"}).encode()
    now = int(clock())
    # no signature, a wrong key, a tampered body, a stale and a future timestamp
    assert post(url, body, {})[0] == 401
    assert post(url, body, {"authorization": "Bearer api-token"})[0] == 401
    assert post(url, body, signed(body, "m1", now, key=b"x" * 32))[0] == 401
    tampered = body.replace(b"B1", b"B2")
    assert post(url, tampered, signed(body, "m2", now))[0] == 401
    assert post(url, body, signed(body, "m3", now - 301))[0] == 401
    assert post(url, body, signed(body, "m4", now + 301))[0] == 401
    assert smi.calls() == []
    # a good one
    headers = signed(body, "m5", now)
    status, answer = post(url, body, headers)
    assert (status, answer["outcome"], answer["gpu"]) == (200, "ok", BUS)
    # the same request replayed at once, and the old request five minutes later
    status, answer = post(url, body, headers)
    assert status == 401
    assert "replayed" in answer["error"]
    clock.advance(301)
    assert post(url, body, headers)[0] == 401
    assert [c for c in smi.calls() if c.startswith("-r")] == [f"-r -i {BUS}"]


@pytest.mark.parametrize(("payload", "status", "error"), [
    (b"nope", 400, "body: not JSON"),
    (b"[1]", 400, "body: expected a JSON object"),
    (b'{"gpu": 3}', 400, "gpu: required string"),
    (b'{"gpu": "0"}', 400, "gpu: expected a PCI bus id"),
    (b'{"gpu": "0000:b1:00.0", "node": "gpu-999"}', 409, "node: this is '127.0.0.1'"),
])
def test_endpoint_bad_bodies(agent, clock, payload, status, error):
    got, answer = post(agent.url + "/api/v1/gpu-reset", payload,
                       signed(payload, f"id-{status}-{len(payload)}", int(clock())))
    assert got == status
    assert answer["error"].startswith(error)


def test_endpoint_busy_is_409_with_pids(agent, smi, clock):
    smi.set("pids", "31337\n")
    body = json.dumps({"gpu": BUS}).encode()
    status, answer = post(agent.url + "/api/v1/gpu-reset", body,
                          signed(body, "b1", int(clock())))
    assert (status, answer["outcome"], answer["pids"]) == (409, "busy", [31337])


def test_a_node_without_the_endpoint_answers_404(clock):
    store = SilenceStore(clock=clock)
    pipeline = Pipeline(facts={}, notifiers=[], page_notifiers=[], audit_log_path=None,
                        clock=clock, silences=store, cluster_size=10)
    api = AlertingApi(pipeline=pipeline, silences=store)
    assert api.handle("POST", "/api/v1/gpu-reset", {}, b"{}")[0] == 404


# --------------------------------------------------------------------------- controller


def reset_request(key: str = "fp1/reset_gpu", entity: str = BUS, dry_run: bool = False,
                  step: RemediationStep = RemediationStep.RESET_GPU) -> ActionRequest:
    return ActionRequest(step=step, node=NodeName("127.0.0.1"), entity=EntityId(entity),
                         reason="gpuhealth: GpuXid48 critical reset_gpu", idempotency_key=key,
                         dry_run=dry_run)


def controller(agent: ApiServer, clock: FakeClock, **kw: Any) -> NodeAgentResetter:
    return NodeAgentResetter(secret=SECRET, clock=clock,
                             url_template=f"http://{{node}}:{agent.port}/api/v1/gpu-reset",
                             **kw)


def test_controller_resets_through_the_node_agent(agent, smi, clock):
    ctl = controller(agent, clock)
    assert isinstance(ctl, SchedulerAdapter)

    async def go() -> Any:
        ref = await ctl.submit(reset_request())
        assert await ctl.submit(reset_request()) == ref
        return await ctl.wait(ref)

    status = asyncio.run(go())
    assert status.phase is ActionPhase.SUCCEEDED
    assert f"GPU {BUS} reset" in status.message
    assert smi.calls()[-1] == f"-r -i {BUS}"


def test_controller_keeps_a_busy_gpu_running_then_resets_it(agent, smi, clock):
    """Each poll runs in its own event loop, as ``gpuhealth run`` ticks do."""
    smi.set("pids", "1234\n")
    ctl = controller(agent, clock, retry_interval_seconds=30, deadline_seconds=600)
    ref = asyncio.run(ctl.submit(reset_request()))
    busy = asyncio.run(ctl.wait(ref))
    still = asyncio.run(ctl.status(ref))  # not due yet: no new try
    clock.advance(30)
    smi.clear("pids")
    asyncio.run(ctl.status(ref))  # due: starts the next try
    done = asyncio.run(ctl.wait(ref))
    assert busy.phase is ActionPhase.RUNNING
    assert "busy (pids 1234)" in busy.message
    assert "retry in 30 s" in busy.message
    assert still.phase is ActionPhase.RUNNING
    assert done.phase is ActionPhase.SUCCEEDED
    assert len([c for c in smi.calls() if c.startswith("--query-compute-apps")]) == 2


def test_controller_fails_a_gpu_busy_past_the_deadline(agent, smi, clock):
    smi.set("pids", "1234\n")
    ctl = controller(agent, clock, retry_interval_seconds=30, deadline_seconds=45)

    async def go() -> list[Any]:
        ref = await ctl.submit(reset_request())
        first = await ctl.wait(ref)
        clock.advance(30)
        await ctl.status(ref)
        return [first, await ctl.wait(ref)]

    first, last = asyncio.run(go())
    assert first.phase is ActionPhase.RUNNING
    assert last.phase is ActionPhase.FAILED
    assert "gave up at the deadline" in last.message
    assert not [c for c in smi.calls() if c.startswith("-r")]


def test_controller_reports_a_failed_reset_and_a_wrong_secret(agent, smi, clock):
    smi.set("reset_rc", "1")
    smi.set("reset_stderr", "Resetting GPU is not supported")
    ctl = controller(agent, clock)
    status = asyncio.run(_submit_and_wait(ctl, reset_request()))
    assert status.phase is ActionPhase.FAILED
    assert "not supported" in status.message
    assert "steps: identify ok, processes ok, holders ok, reset FAILED, fallback ok" \
        in status.message
    assert fallback_of(status.message) == "reboot"
    wrong = NodeAgentResetter(secret="whsec_" + base64.b64encode(b"y" * 32).decode(),
                              clock=clock,
                              url_template=f"http://{{node}}:{agent.port}/api/v1/gpu-reset")
    status = asyncio.run(_submit_and_wait(wrong, reset_request("fp2/reset_gpu")))
    assert status.phase is ActionPhase.FAILED
    assert "(401)" in status.message


def test_controller_retries_an_unreachable_agent(clock):
    from tests.servers import free_port

    ctl = NodeAgentResetter(secret=SECRET, clock=clock, retry_interval_seconds=10,
                            deadline_seconds=15,
                            url_template=f"http://{{node}}:{free_port()}/api/v1/gpu-reset")

    async def go() -> list[Any]:
        ref = await ctl.submit(reset_request())
        first = await ctl.wait(ref)
        clock.advance(10)
        await ctl.status(ref)
        return [first, await ctl.wait(ref)]

    first, last = asyncio.run(go())
    assert first.phase is ActionPhase.RUNNING
    assert "unreachable" in first.message
    assert last.phase is ActionPhase.FAILED


async def _submit_and_wait(ctl: NodeAgentResetter, request: ActionRequest) -> Any:
    return await ctl.wait(await ctl.submit(request))


def test_controller_refuses_what_it_cannot_do(clock):
    ctl = NodeAgentResetter(secret=SECRET, clock=clock)
    with pytest.raises(PermanentError, match="reset_gpu only"):
        asyncio.run(ctl.submit(reset_request(step=RemediationStep.REBOOT)))
    with pytest.raises(PermanentError, match="cannot reset"):
        asyncio.run(ctl.submit(reset_request(entity="node")))
    status = asyncio.run(_submit_and_wait(ctl, reset_request(dry_run=True)))
    assert (status.phase, status.message) == (ActionPhase.SUCCEEDED, "dry run: not sent")
    with pytest.raises(PermanentError, match="unknown"):
        asyncio.run(ctl.status("node-agent-nope"))


@pytest.mark.parametrize("kw", [
    {"url_template": "https://gpu-1:9836/api/v1/gpu-reset"},
    {"url_template": "ftp://{node}/"},
    {"deadline_seconds": 0},
    {"secret": ""},
    {"secret": "whsec_!!"},
])
def test_controller_bad_configuration(kw):
    with pytest.raises(ConfigError):
        NodeAgentResetter(**{"secret": SECRET, **kw})
    assert SECRET not in repr(NodeAgentResetter(secret=SECRET))
