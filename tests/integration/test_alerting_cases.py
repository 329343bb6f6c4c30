"""The issue's judgement: the case folder replayed, one node per file, paged right, nothing lost.

Pages go to :class:`PagerDutyNotifier` pointed at a **local server that follows the
PagerDuty Events API v2** (``docs/ecosystem-reference.md`` §7.1): it validates the
event, answers 202 with a ``dedup_key``, 400 for an invalid event and 429 with
``Retry-After`` while throttling. PagerDuty itself cannot be reached from CI, so
this stands in for it (architecture principle 6). Alerts also go to a signed
webhook whose receiver verifies every request with :class:`WebhookVerifier`.

Both receivers fail in the middle of the replay (PagerDuty throttles, the webhook
answers 503); the outbox delivers everything once they are back.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from alerting.pagerduty import PagerDutyNotifier
from alerting.webhook import SignatureError, WebhookNotifier, WebhookVerifier
from core.clock import FakeClock
from core.records import AlertState
from gpuhealth.replay import load_node_facts, node_of_file, replay
from tests.conftest import cases_dir
from tests.servers import free_port

ROUTING_KEY = "R0123456789abcdef0123456789abcd"  # 32 characters, as an integration key
SECRET = "whsec_c2VjcmV0LWtleS1mb3ItdGVzdHMtb25seQ=="


@dataclass
class EventsApi:
    """A loopback server following PagerDuty Events API v2's documented answers."""

    url: str
    events: list[dict[str, Any]] = field(default_factory=list)
    throttle: bool = False
    answers: Counter[int] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def problems(event: Any) -> list[str]:
        if not isinstance(event, dict):
            return ["Event object is invalid"]
        errors = []
        if not event.get("routing_key"):
            errors.append("'routing_key' is missing or blank")
        if event.get("event_action") not in ("trigger", "acknowledge", "resolve"):
            errors.append("'event_action' is invalid")
        if event.get("event_action") in ("acknowledge", "resolve") and not event.get("dedup_key"):
            errors.append("'dedup_key' is required for acknowledge and resolve")
        if len(event.get("dedup_key", "")) > 255:
            errors.append("'dedup_key' is too long")
        if event.get("event_action") == "trigger":
            payload = event.get("payload") or {}
            for key in ("summary", "source", "severity"):
                if not payload.get(key):
                    errors.append(f"'payload.{key}' is missing or blank")
            if payload.get("severity") not in ("critical", "error", "warning", "info"):
                errors.append("'payload.severity' is invalid")
            if len(payload.get("summary", "")) > 1024:
                errors.append("'payload.summary' is too long")
        return errors


@pytest.fixture
def events_api():
    port = free_port()
    api = EventsApi(url=f"http://127.0.0.1:{port}/v2/enqueue")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            try:
                event = json.loads(body)
            except ValueError:
                event = None
            with api.lock:
                if api.throttle:
                    status, answer = 429, {"status": "throttle event", "message": "Requests "
                                           "for this service are arriving too quickly."}
                    headers = {"retry-after": "30"}
                else:
                    errors = api.problems(event)
                    if errors:
                        status, answer = 400, {"status": "invalid event",
                                               "message": "Event object is invalid",
                                               "errors": errors}
                    else:
                        api.events.append(event)
                        status, answer = 202, {"status": "success",
                                               "message": "Event processed",
                                               "dedup_key": event["dedup_key"]}
                    headers = {}
                api.answers[status] += 1
            raw = json.dumps(answer).encode()
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield api
    server.shutdown()
    server.server_close()


@dataclass
class Receiver:
    url: str
    verifier: WebhookVerifier
    accepted: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    down: bool = False


@pytest.fixture
def receiver(request):
    port = free_port()
    clock = getattr(request, "param", None)
    rx = Receiver(url=f"http://127.0.0.1:{port}/hook",
                  verifier=WebhookVerifier(secrets=(SECRET,), clock=clock or FakeClock()))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if rx.down:
                status = 503
            else:
                try:
                    rx.verifier.verify(dict(self.headers.items()), body)
                except SignatureError as exc:
                    rx.rejected.append(str(exc))
                    status = 400
                else:
                    rx.accepted.append(json.loads(body))
                    status = 204
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield rx
    server.shutdown()
    server.server_close()


def test_cases_page_once_per_major_or_critical_file_and_lose_nothing(
    events_api, receiver, tmp_path
):
    cases = cases_dir()
    expected = json.loads((cases / "expected.json").read_text())
    # a later, healthy nvidia-smi -q of case 001's node (same stem: same node)
    first = sorted(name for name in expected if name.startswith("001-"))[0]
    later = tmp_path / "later"
    later.mkdir()
    healthy = later / (node_of_file(first) + ".txt")
    shutil.copy(cases / "027-nvidia-smi-q-clocks-event-reasons-sw-power-cap-active.txt", healthy)

    clock = FakeClock(now=1_800_000_000.0)
    receiver.verifier.clock = clock
    pager = PagerDutyNotifier(routing_key=ROUTING_KEY, url=events_api.url, clock=clock)
    hook = WebhookNotifier(url=receiver.url, secret=SECRET, clock=clock)
    files = sorted(name for name in expected)

    def outage(path, index):
        clock.advance(20)  # twenty seconds between files
        events_api.throttle = 8 <= index < 20  # PagerDuty throttles for twelve files
        receiver.down = 5 <= index < 25  # the webhook receiver is down for twenty

    report = replay(
        [str(cases), str(healthy)],
        clock=clock,
        notifiers=[hook],
        page_notifiers=[pager],
        node_facts=load_node_facts(str(cases / "expected.json")),
        on_file=outage,
    )
    assert report.undelivered == {}
    assert events_api.answers[429] > 0, "the outage did not happen"
    assert events_api.answers[400] == 0
    assert receiver.rejected == []

    triggers: dict[str, list[dict[str, Any]]] = {}
    for event in events_api.events:
        if event["event_action"] == "trigger":
            triggers.setdefault(event["payload"]["source"], []).append(event)
    to_pd = {"critical": "critical", "major": "error"}
    for name in files:
        node = node_of_file(name)
        severity = expected[name]["worst_severity"]
        got = triggers.get(node, [])
        if severity in to_pd:
            assert len(got) == 1, (name, got)
            assert got[0]["payload"]["severity"] == to_pd[severity], name
            assert got[0]["dedup_key"] == f"gpuhealth/{node}"
        else:
            assert got == [], (name, got)
    node_001 = node_of_file(first)
    resolves = [e for e in events_api.events if e["event_action"] == "resolve"]
    assert [e["dedup_key"] for e in resolves] == [f"gpuhealth/{node_001}"]
    result = report.node(node_001)
    assert result is not None
    assert result.healthy_files == [str(healthy)]
    assert [p.state for p in result.pages] == [AlertState.FIRING, AlertState.RESOLVED]
    assert [f for f in result.findings if f.severity.rank > 0] == []  # only info is left

    # every alert notification reached the webhook, in order per alert, none twice
    sent = [(a.fingerprint, a.state.value) for n in report.nodes for a in n.alerts]
    got = [(a["fingerprint"], a["state"]) for a in receiver.accepted]
    assert Counter(got) == Counter(sent)


def test_receiver_rejects_replays_and_forgeries_over_http(receiver):
    import asyncio

    from alerting.alerts import alert_for
    from core.errors import PermanentError
    from core.records import Action, EntityId, Finding, NodeName, Severity

    clock = FakeClock(now=1_800_000_000.0)
    receiver.verifier.clock = clock
    alert = alert_for(Finding(node=NodeName("n1"), entity=EntityId("GPU-1"), kind="xid",
                              code="79", severity=Severity.CRITICAL, action=Action.REBOOT_NODE,
                              summary="lost", evidence=(), source="t"), starts_at=clock())
    same_id = WebhookNotifier(url=receiver.url, secret=SECRET, clock=clock,
                              id_factory=lambda: "msg_fixed")
    asyncio.run(same_id.send(alert))
    with pytest.raises(PermanentError, match="400"):
        asyncio.run(same_id.send(alert))  # the same webhook-id again: a replay
    forged = WebhookNotifier(url=receiver.url, secret="whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB",
                             clock=clock)
    with pytest.raises(PermanentError):
        asyncio.run(forged.send(alert))
    stale = WebhookNotifier(url=receiver.url, secret=SECRET, clock=FakeClock(now=clock() - 600))
    with pytest.raises(PermanentError):
        asyncio.run(stale.send(alert))
    assert len(receiver.accepted) == 1
    assert [r.split(" ")[0] for r in receiver.rejected] == ["replayed", "no", "webhook-timestamp"]
