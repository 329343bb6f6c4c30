from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from alerting.alerts import alert_for
from alerting.webhook import WebhookNotifier, secret_key, sign
from core.clock import FakeClock
from core.errors import NotifierUnavailable, PermanentError
from core.protocols import Notifier
from core.records import Action, EntityId, Finding, NodeName, Severity

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()

ALERT = alert_for(
    Finding(
        node=NodeName("gpu-001"),
        entity=EntityId("0000:b1:00.0"),
        kind="xid",
        code="79",
        severity=Severity.CRITICAL,
        action=Action.REBOOT_NODE,
        summary="GPU has fallen off the bus",
        evidence=(),
        source="test",
    ),
    starts_at=1_700_000_000.0,
)


def verify(secret: str, headers: Mapping[str, str], body: bytes) -> bool:
    """An independent Standard Webhooks verifier (ecosystem-reference §7.3)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(
        hmac.compare_digest(part.split(",", 1)[1], expected)
        for part in headers["webhook-signature"].split()
        if part.startswith("v1,")
    )


class Receiver:
    """A loopback HTTP server that checks signatures and answers a chosen status."""

    def __init__(
        self,
        status: int = 200,
        extra_headers: dict[str, str] | None = None,
        secret: str = SECRET,
    ) -> None:
        self.status = status
        self.extra_headers = extra_headers or {}
        self.secret = secret
        self.received: list[tuple[dict[str, str], bytes, bool | None]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                signed_ok = None
                if "webhook-signature" in self.headers:
                    signed_ok = verify(receiver.secret, dict(self.headers), body)
                receiver.received.append((dict(self.headers), body, signed_ok))
                status = receiver.status if signed_ok is not False else 401
                self.send_response(status)
                for key, value in receiver.extra_headers.items():
                    self.send_header(key, value)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def test_signed_post_verifies():
    clock = FakeClock(now=1_700_000_123.9)
    with Receiver() as rx:
        notifier = WebhookNotifier(
            url=rx.url, secret=SECRET, timeout_seconds=5, clock=clock, id_factory=lambda: "msg_1"
        )
        assert isinstance(notifier, Notifier)
        asyncio.run(notifier.send(ALERT))
    ((headers, body, signed_ok),) = rx.received
    assert signed_ok is True
    assert headers["webhook-id"] == "msg_1"
    assert headers["webhook-timestamp"] == "1700000123"
    assert headers["content-type"] == "application/json"
    payload = json.loads(body)
    assert payload["fingerprint"] == ALERT.fingerprint
    assert payload["state"] == "firing"
    assert payload["labels"]["alertname"] == "GpuXid79"


def test_wrong_secret_is_rejected_by_receiver_as_permanent():
    other = "whsec_" + base64.b64encode(b"another-secret-of-24-bytes!").decode()
    with Receiver() as rx:
        notifier = WebhookNotifier(url=rx.url, secret=other, clock=FakeClock(now=1.0))
        with pytest.raises(PermanentError, match="401"):
            asyncio.run(notifier.send(ALERT))
    assert rx.received[0][2] is False


def test_unsigned_without_secret():
    with Receiver() as rx:
        asyncio.run(WebhookNotifier(url=rx.url).send(ALERT))
    headers = rx.received[0][0]
    assert "webhook-signature" not in headers
    assert rx.received[0][2] is None


def test_429_with_retry_after_is_temporary():
    receiver = Receiver(status=429, extra_headers={"Retry-After": "7"})
    with receiver as rx, pytest.raises(NotifierUnavailable) as info:
        asyncio.run(WebhookNotifier(url=rx.url, secret=SECRET).send(ALERT))
    assert info.value.retry_after_seconds == 7.0


def test_5xx_is_temporary():
    with Receiver(status=503) as rx, pytest.raises(NotifierUnavailable) as info:
        asyncio.run(WebhookNotifier(url=rx.url).send(ALERT))
    assert info.value.retry_after_seconds is None


def test_4xx_is_permanent():
    with Receiver(status=400) as rx, pytest.raises(PermanentError, match="400"):
        asyncio.run(WebhookNotifier(url=rx.url).send(ALERT))


def test_connection_refused_is_temporary():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    notifier = WebhookNotifier(url=f"http://127.0.0.1:{port}/hook", timeout_seconds=2)
    with pytest.raises(NotifierUnavailable) as info:
        asyncio.run(notifier.send(ALERT))
    assert isinstance(info.value.__cause__, Exception)


def test_sign_matches_standard_webhooks_example():
    # Example from the Standard Webhooks spec / reference libraries.
    key = secret_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    body = b'{"test": 2432232314}'
    assert sign(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == (
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    )


def test_constructor_validation_and_repr_hides_secret():
    with pytest.raises(ValueError, match="http"):
        WebhookNotifier(url="ftp://x")
    with pytest.raises(ValueError, match="timeout_seconds"):
        WebhookNotifier(url="http://x", timeout_seconds=0)
    with pytest.raises(ValueError, match="base64"):
        WebhookNotifier(url="http://x", secret="whsec_***")
    assert SECRET not in repr(WebhookNotifier(url="http://x", secret=SECRET))
    assert secret_key("plain") == b"plain"
