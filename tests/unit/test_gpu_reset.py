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
    validate_gpu,
)

SECRET = "whsec_" + base64.b64encode(b"node-agent-shared-secret-32bytes").decode()
KEY = b"node-agent-shared-secret-32bytes"
NOW = 1_800_000_000.0
BUS = "0000:b1:00.0"

FAKE_SMI = """#!/bin/sh
D="{folder}"
echo "$*" >> "$D/calls.log"
case "$1" in
  --query-compute-apps=pid)
    if [ -f "$D/query_rc" ]; then echo "NVML: Unknown Error" >&2; exit "$(cat "$D/query_rc")"; fi
    [ -f "$D/pids" ] && cat "$D/pids"
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


class FakeSmi:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def set(self, name: str, text: str) -> None:
        (self.folder / name).write_text(text)

    def clear(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)

    def calls(self) -> list[str]:
        log = self.folder / "calls.log"
        return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(FAKE_SMI.format(folder=folder))
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


def test_an_idle_gpu_is_reset(smi):
    result = GpuResetter().reset("0000:B1:00.0")
    assert result.outcome is ResetOutcome.OK
    assert result.gpu == BUS
    assert "successfully reset" in result.message
    assert smi.calls() == [f"--query-compute-apps=pid --format=csv,noheader -i {BUS}",
                           f"-r -i {BUS}"]


def test_a_busy_gpu_is_not_reset(smi):
    smi.set("pids", "4242\n77\n4242\n")
    result = GpuResetter().reset(BUS)
    assert (result.outcome, result.pids) == (ResetOutcome.BUSY, (77, 4242))
    assert len(smi.calls()) == 1  # the query only


def test_failed_query_means_no_reset(smi):
    smi.set("query_rc", "15")
    result = GpuResetter().reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert "NVML: Unknown Error" in result.stderr
    assert len(smi.calls()) == 1


def test_failed_reset_reports_stderr_and_in_use_is_busy(smi):
    smi.set("reset_rc", "3")
    smi.set("reset_stderr", "GPU Reset couldn't run because GPU 00000000:B1:00.0 is the "
                            "primary GPU.")
    result = GpuResetter().reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert "primary GPU" in result.stderr
    assert "exit 3" in result.message
    smi.set("reset_stderr", "Unable to reset this GPU because it's being used by some "
                            "other process (e.g. CUDA application)")
    assert GpuResetter().reset(BUS).outcome is ResetOutcome.BUSY


def test_a_hung_reset_times_out(smi):
    smi.set("reset_sleep", "5")
    started = time.monotonic()
    result = GpuResetter(reset_timeout_seconds=0.3).reset(BUS)
    assert time.monotonic() - started < 4
    assert result.outcome is ResetOutcome.FAILED
    assert "timed out" in result.stderr


def test_missing_nvidia_smi_fails_cleanly(tmp_path):
    result = GpuResetter(nvidia_smi=str(tmp_path / "absent")).reset(BUS)
    assert result.outcome is ResetOutcome.FAILED
    assert "cannot run" in result.stderr


def test_never_two_resets_at_once_and_a_key_resets_once(smi):
    smi.set("reset_sleep", "1")
    resetter = GpuResetter()
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(resetter.reset(BUS,
                                                                          idempotency_key="k")))
    first.start()
    deadline = time.monotonic() + 5
    while len(smi.calls()) < 2 and time.monotonic() < deadline:  # the reset is running
        time.sleep(0.01)
    second = resetter.reset("0000:b2:00.0")
    first.join()
    assert second.outcome is ResetOutcome.BUSY
    assert "another GPU reset" in second.message
    assert results[0].outcome is ResetOutcome.OK
    again = resetter.reset(BUS, idempotency_key="k")
    assert again == results[0]
    assert [c for c in smi.calls() if c.startswith("-r")] == [f"-r -i {BUS}"]


def test_injected_runner():
    seen: list[list[str]] = []

    def runner(argv, timeout_seconds):
        seen.append(list(argv))
        return CommandResult(returncode=0, stdout="No running processes found\n")

    assert GpuResetter(nvidia_smi="smi", runner=runner).reset(BUS).outcome is ResetOutcome.OK
    assert [a[1] for a in seen] == ["--query-compute-apps=pid", "-r"]


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
    endpoint = GpuResetEndpoint(resetter=GpuResetter(), secrets=(SECRET,), node="127.0.0.1",
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
    assert len([c for c in smi.calls() if c.startswith("--query")]) == 2


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
