"""The webhook scheduler adapter: signed delivery, durable in-order retries, status, reports.

The receiver is a local HTTP server that checks every request's Standard Webhooks
signature with its own implementation (``hmac``/``hashlib``/``base64`` per the
Standard Webhooks 1.0 spec, ecosystem-reference §7.3), not with gpuhealth's signing
code, and answers what each test scripts (2xx, 4xx, 5xx with ``Retry-After``...).
Clocks are fake, jitter is 1, so back-off times are exact.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from alerting.silences import SilenceStore
from core.clock import FakeClock
from core.errors import ConfigError, PermanentError, SchedulerUnavailable
from core.protocols import SchedulerAdapter
from core.records import (
    ActionPhase,
    ActionRequest,
    EntityId,
    NodeName,
    RemediationStep,
)
from gpuhealth.api import AlertingApi
from gpuhealth.pipeline import Pipeline
from remediation.webhook import EVENT_TYPE, WebhookScheduler, action_ref
from tests.servers import free_port

SECRET_BYTES = b"0123456789abcdef0123456789abcdef"
SECRET = "whsec_" + base64.b64encode(SECRET_BYTES).decode()
NOW = 1_800_000_000.0


def independent_verify(headers: dict[str, str], body: bytes, now: float) -> bool:
    """Standard Webhooks 1.0 verification written from the spec, not from gpuhealth."""
    msg_id = headers.get("webhook-id")
    stamp = headers.get("webhook-timestamp")
    sigs = headers.get("webhook-signature", "")
    if not msg_id or not stamp or abs(now - int(stamp)) > 300:
        return False
    content = f"{msg_id}.{stamp}.".encode() + body
    expected = base64.b64encode(hmac.new(SECRET_BYTES, content, hashlib.sha256).digest())
    for sig in sigs.split(" "):
        version, _, value = sig.partition(",")
        if version == "v1" and hmac.compare_digest(value.encode(), expected):
            return True
    return False


@dataclass
class Receiver:
    url: str
    clock: FakeClock
    answers: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    """Scripted answers, used in order; 200 once they run out."""
    got: list[tuple[dict[str, str], bytes, bool]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bodies(self) -> list[dict[str, Any]]:
        with self.lock:
            return [json.loads(body) for _, body, _ in self.got]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(now=NOW)


@pytest.fixture
def receiver(clock: FakeClock) -> Iterator[Receiver]:
    port = free_port()
    rec = Receiver(url=f"http://127.0.0.1:{port}/hook", clock=clock)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k.lower(): v for k, v in self.headers.items()}
            ok = independent_verify(headers, body, rec.clock())
            with rec.lock:
                rec.got.append((headers, body, ok))
                status, extra = rec.answers.pop(0) if rec.answers else (200, {})
            if not ok:
                status, extra = 401, {}
            self.send_response(status)
            for key, value in extra.items():
                self.send_header(key, value)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def request(n: int = 1, step: RemediationStep = RemediationStep.CORDON,
            dry_run: bool = False) -> ActionRequest:
    return ActionRequest(step=step, node=NodeName(f"gpu-{n:03d}"), entity=EntityId("node"),
                         reason=f"gpuhealth: GpuXid79 critical reboot_node on node {n}",
                         idempotency_key=f"fp{n:04d}/{step.value}", dry_run=dry_run,
                         attrs={"when": "now", "scope": "node"})


def scheduler(url: str, clock: FakeClock, **kw: Any) -> WebhookScheduler:
    kw.setdefault("jitter", lambda: 1.0)
    return WebhookScheduler(url=url, secret=SECRET, clock=clock, **kw)


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


def test_delivers_a_signed_message_once_and_reports_succeeded(receiver, clock):
    sched = scheduler(receiver.url, clock, status_url_base="http://ctl:9836/")
    assert isinstance(sched, SchedulerAdapter)

    async def go() -> tuple[str, str, Any]:
        ref = await sched.submit(request(1))
        again = await sched.submit(request(1))
        return ref, again, await sched.status(ref)

    ref, again, status = run(go)
    assert ref == again == action_ref("fp0001/cordon")
    assert status.phase is ActionPhase.SUCCEEDED
    assert "delivered (200)" in status.message
    [(headers, body, verified)] = receiver.got
    assert verified
    assert headers["webhook-id"] == "fp0001/cordon"
    assert headers["webhook-timestamp"] == str(int(NOW))
    message = json.loads(body)
    assert message["type"] == EVENT_TYPE
    assert message["timestamp"] == "2027-01-15T08:00:00.000Z"
    assert message["status_url"] == f"http://ctl:9836/api/v1/actions/{ref}/status"
    assert message["data"] == {
        "ref": ref, "step": "cordon", "node": "gpu-001", "entity": "node",
        "reason": "gpuhealth: GpuXid79 critical reboot_node on node 1",
        "idempotency_key": "fp0001/cordon", "dry_run": False, "not_before_at": None,
        "attrs": {"when": "now", "scope": "node"}}


def test_a_receiver_that_is_down_gets_everything_later_in_order(clock, tmp_path):
    port = free_port()  # nothing listens yet
    url = f"http://127.0.0.1:{port}/hook"
    db = str(tmp_path / "outbox" / "actions.sqlite")
    sched = scheduler(url, clock, path=db)

    async def queue() -> list[str]:
        return [await sched.submit(request(n)) for n in (3, 1, 2)]

    refs = run(queue)
    async def poll() -> list[Any]:
        return [await sched.status(r) for r in refs]

    statuses = run(poll)
    assert [s.phase for s in statuses] == [ActionPhase.PENDING] * 3
    assert "ConnectError" in statuses[0].message
    assert "attempt 1" in statuses[0].message
    assert sched.pending() == 3
    assert sched.next_attempt_at() == NOW + 1.0
    sched.close()

    # gpuhealth restarts; the receiver comes up; the backlog goes out in order.
    with _receiver_on(port, clock) as rec:
        again = scheduler(url, clock, path=db)
        clock.advance(1.0)
        first = run(lambda: again.status(refs[0]))
        assert first.phase is ActionPhase.SUCCEEDED
        assert [b["data"]["node"] for b in rec.bodies()] == ["gpu-003", "gpu-001", "gpu-002"]
        assert all(ok for _, _, ok in rec.got)
        assert again.pending() == 0
        assert run(lambda: again.submit(request(3))) == refs[0]  # still idempotent
        assert len(rec.got) == 3
        again.close()


@pytest.mark.parametrize(("status", "headers", "wait"), [
    (503, {"retry-after": "120"}, 120.0),
    (429, {"retry-after": "30"}, 30.0),
    (408, {}, 1.0),
    (500, {}, 1.0),
])
def test_temporary_answers_back_off_honouring_retry_after(receiver, clock, status, headers,
                                                          wait):
    receiver.answers = [(status, headers), (502, {})]
    sched = scheduler(receiver.url, clock)
    ref = run(lambda: sched.submit(request(1)))
    assert run(lambda: sched.status(ref)).phase is ActionPhase.PENDING
    assert sched.next_attempt_at() == NOW + wait
    clock.advance(wait - 0.5)
    assert run(lambda: sched.status(ref)).phase is ActionPhase.PENDING
    assert len(receiver.got) == 1  # not before it is due
    clock.advance(0.5)
    status2 = run(lambda: sched.status(ref))
    assert status2.phase is ActionPhase.PENDING
    assert "answered 502" in status2.message
    assert sched.next_attempt_at() == clock() + 2.0  # exponential: 1 s, then 2 s
    clock.advance(2.0)
    assert run(lambda: sched.status(ref)).phase is ActionPhase.SUCCEEDED
    assert len(receiver.got) == 3
    assert len({h["webhook-id"] for h, _, _ in receiver.got}) == 1  # same id on retries


@pytest.mark.parametrize("status", [400, 401, 404, 410, 302])
def test_permanent_refusal_fails_that_action_and_the_queue_moves_on(receiver, clock, status):
    receiver.answers = [(status, {})]
    sched = scheduler(receiver.url, clock)

    async def go() -> list[Any]:
        refs = [await sched.submit(request(1)), await sched.submit(request(2))]
        return [await sched.status(r) for r in refs]

    first, second = run(go)
    assert first.phase is ActionPhase.FAILED
    assert f"({status})" in first.message
    assert second.phase is ActionPhase.SUCCEEDED
    assert sched.pending() == 0


def test_wrong_secret_is_refused_by_an_independent_verifier(receiver, clock):
    other = "whsec_" + base64.b64encode(b"x" * 32).decode()
    sched = WebhookScheduler(url=receiver.url, secret=other, clock=clock, jitter=lambda: 1.0)
    ref = run(lambda: sched.submit(request(1)))
    assert run(lambda: sched.status(ref)).phase is ActionPhase.FAILED
    assert receiver.got[0][2] is False


def test_gives_up_after_the_deadline(clock):
    sched = scheduler(f"http://127.0.0.1:{free_port()}/", clock, give_up_after_seconds=60.0)
    ref = run(lambda: sched.submit(request(1)))
    clock.advance(59.0)
    assert run(lambda: sched.status(ref)).phase is ActionPhase.PENDING
    clock.advance(5.0)
    status = run(lambda: sched.status(ref))
    assert status.phase is ActionPhase.FAILED
    assert "gave up after" in status.message


def test_dry_run_requests_are_not_sent_by_default(receiver, clock):
    sched = scheduler(receiver.url, clock)
    ref = run(lambda: sched.submit(request(1, dry_run=True)))
    status = run(lambda: sched.status(ref))
    assert (status.phase, status.message) == (ActionPhase.SUCCEEDED, "dry run: not sent")
    assert receiver.got == []
    sent = scheduler(receiver.url, clock, send_dry_run=True)
    run(lambda: sent.submit(request(2, dry_run=True)))
    assert receiver.bodies()[0]["data"]["dry_run"] is True


def test_finished_actions_are_forgotten_after_the_retention(receiver, clock):
    sched = scheduler(receiver.url, clock, retention_seconds=3600.0)
    done = run(lambda: sched.submit(request(1)))
    clock.advance(3601.0)
    run(lambda: sched.submit(request(2)))
    with pytest.raises(PermanentError, match="unknown"):
        run(lambda: sched.status(done))
    assert len(receiver.got) == 2


def test_cancel_withdraws_an_undelivered_action_only(clock):
    port = free_port()
    sched = scheduler(f"http://127.0.0.1:{port}/hook", clock)
    first = run(lambda: sched.submit(request(1)))
    second = run(lambda: sched.submit(request(2)))
    assert sched.cancel(first).phase is ActionPhase.CANCELLED
    with _receiver_on(port, clock) as rec:
        clock.advance(1.0)
        assert run(lambda: sched.status(second)).phase is ActionPhase.SUCCEEDED
        assert [b["data"]["node"] for b in rec.bodies()] == ["gpu-002"]
        assert sched.cancel(second).phase is ActionPhase.SUCCEEDED  # too late: unchanged
    assert run(lambda: sched.status(first)).phase is ActionPhase.CANCELLED
    with pytest.raises(PermanentError):
        sched.cancel("webhook-nope")


def test_the_queue_is_bounded_without_dropping(clock):
    sched = scheduler(f"http://127.0.0.1:{free_port()}/", clock, max_pending=2)
    run(lambda: sched.submit(request(1)))
    run(lambda: sched.submit(request(2)))
    with pytest.raises(SchedulerUnavailable):
        run(lambda: sched.submit(request(3)))
    assert sched.pending() == 2


def test_unknown_ref_and_bad_keys(clock):
    sched = scheduler("http://127.0.0.1:1/", clock)
    with pytest.raises(PermanentError, match="unknown"):
        run(lambda: sched.status("webhook-nope"))
    bad = ActionRequest(step=RemediationStep.CORDON, node=NodeName("n"), entity=EntityId("node"),
                        reason="r", idempotency_key="a\nb")
    with pytest.raises(ValueError, match="webhook-id"):
        run(lambda: sched.submit(bad))


@pytest.mark.parametrize("kw", [
    {"url": "ftp://x"}, {"secret": ""}, {"secret": "whsec_***"}, {"timeout_seconds": 0},
    {"backoff_initial_seconds": 10, "backoff_max_seconds": 1}, {"max_pending": 0},
])
def test_bad_configuration(kw):
    args = {"url": "http://x/", "secret": SECRET, **kw}
    with pytest.raises(ConfigError):
        WebhookScheduler(**args)
    assert SECRET not in repr(WebhookScheduler(url="http://x/", secret=SECRET))


def test_the_secret_comes_from_the_environment_or_a_file(receiver, clock, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("GH_WEBHOOK_SECRET", SECRET)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    for kw in ({"secret_env": "GH_WEBHOOK_SECRET"}, {"secret_file": str(secret_file)}):
        sched = WebhookScheduler(url=receiver.url, clock=clock, **kw)
        run(lambda s=sched: s.submit(request(len(receiver.got) + 1)))
    assert [ok for _, _, ok in receiver.got] == [True, True]
    with pytest.raises(ConfigError, match="'GH_NOPE' is not set"):
        WebhookScheduler(url=receiver.url, secret_env="GH_NOPE")
    with pytest.raises(ConfigError, match="secret_file: cannot read"):
        WebhookScheduler(url=receiver.url, secret_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="exactly one of"):
        WebhookScheduler(url=receiver.url, secret=SECRET, secret_env="GH_WEBHOOK_SECRET")


# --------------------------------------------------------------------------- completion


def make_api(sched: WebhookScheduler, clock: FakeClock) -> AlertingApi:
    store = SilenceStore(clock=clock)
    pipeline = Pipeline(facts={}, notifiers=[], page_notifiers=[], audit_log_path=None,
                        clock=clock, silences=store, cluster_size=10)
    return AlertingApi(pipeline=pipeline, silences=store, token="s3cret",
                       on_action_report=sched.report)


AUTH = {"authorization": "Bearer s3cret"}


def test_receiver_reports_completion_through_the_api(receiver, clock):
    sched = scheduler(receiver.url, clock, await_completion=True)
    api = make_api(sched, clock)
    ref = run(lambda: sched.submit(request(1)))
    status = run(lambda: sched.status(ref))
    assert status.phase is ActionPhase.RUNNING
    assert "awaiting" in status.message
    path = f"/api/v1/actions/{ref}/status"
    assert api.handle("POST", path, {}, b'{"phase": "succeeded"}')[0] == 401
    assert api.handle("POST", path, AUTH, b'{"phase": "pending"}')[0] == 400
    assert api.handle("POST", path, AUTH, b"nope")[0] == 400
    assert api.handle("POST", "/api/v1/actions/webhook-0/status", AUTH,
                      b'{"phase": "failed"}')[0] == 404
    code, answer = api.handle("POST", path, AUTH,
                              b'{"phase": "failed", "message": "BMC unreachable"}')
    assert code == 200
    assert answer["phase"] == "failed"
    status = run(lambda: sched.status(ref))
    assert status.phase is ActionPhase.FAILED
    assert "BMC unreachable" in status.message
    assert api.handle("POST", path, AUTH, b'{"phase": "failed"}')[0] == 200  # same again
    assert api.handle("POST", path, AUTH, b'{"phase": "succeeded"}')[0] == 409
    assert api.handle("POST", path, AUTH, b'{"phase": "running"}')[0] == 200  # late, ignored
    assert run(lambda: sched.status(ref)).phase is ActionPhase.FAILED


def test_reports_without_a_scheduler_are_404(clock):
    store = SilenceStore(clock=clock)
    pipeline = Pipeline(facts={}, notifiers=[], page_notifiers=[], audit_log_path=None,
                        clock=clock, silences=store, cluster_size=10)
    api = AlertingApi(pipeline=pipeline, silences=store, token=None)
    assert api.handle("POST", "/api/v1/actions/x/status", {}, b'{"phase": "failed"}')[0] == 404


# --------------------------------------------------------------------------- helpers


class _receiver_on:
    """A receiver on a given port (for the 'comes up later' test)."""

    def __init__(self, port: int, clock: FakeClock) -> None:
        self.port = port
        self.clock = clock

    def __enter__(self) -> Receiver:
        rec = Receiver(url=f"http://127.0.0.1:{self.port}/hook", clock=self.clock)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with rec.lock:
                    rec.got.append((headers, body, independent_verify(headers, body,
                                                                      rec.clock())))
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return rec

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def test_outbox_file_is_created_with_its_folder(tmp_path: Path, clock):
    path = tmp_path / "a" / "b" / "actions.sqlite"
    scheduler("http://x/", clock, path=str(path)).close()
    assert path.is_file()
