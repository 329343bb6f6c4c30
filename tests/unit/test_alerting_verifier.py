"""The receiving side of signed webhooks: signatures, tolerance, rotation and replays."""

from __future__ import annotations

import base64

import pytest

from alerting.webhook import SignatureError, WebhookVerifier, secret_key, sign
from core.clock import FakeClock

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
OLD = "whsec_" + base64.b64encode(b"fedcba9876543210fedcba9876543210").decode()
BODY = b'{"state":"firing"}'


def headers(msg_id="msg_1", timestamp=1000, secret=SECRET, body=BODY, extra=""):
    sig = sign(secret_key(secret), msg_id, timestamp, body)
    return {"Webhook-Id": msg_id, "Webhook-Timestamp": str(timestamp),
            "Webhook-Signature": (extra + " " + sig).strip()}


def verifier(now=1000.0, **kw):
    return WebhookVerifier(secrets=(SECRET,), clock=FakeClock(now=now), **kw)


def test_valid_request_is_accepted_and_returns_its_id():
    assert verifier().verify(headers(), BODY) == "msg_1"


def test_replayed_id_is_rejected():
    v = verifier()
    v.verify(headers(), BODY)
    with pytest.raises(SignatureError, match="replayed"):
        v.verify(headers(), BODY)


def test_tampered_body_and_wrong_secret_are_rejected():
    with pytest.raises(SignatureError, match="no valid signature"):
        verifier().verify(headers(), BODY + b" ")
    with pytest.raises(SignatureError, match="no valid signature"):
        verifier().verify(headers(secret=OLD), BODY)


@pytest.mark.parametrize("skew", [-301, 301])
def test_timestamp_outside_tolerance_is_rejected(skew):
    with pytest.raises(SignatureError, match="tolerance"):
        verifier(now=1000 + skew).verify(headers(), BODY)


def test_key_rotation_accepts_either_secret_and_any_of_several_signatures():
    v = WebhookVerifier(secrets=(SECRET, OLD), clock=FakeClock(now=1000))
    assert v.verify(headers(msg_id="a", secret=OLD), BODY) == "a"
    mixed = headers(msg_id="b", extra="v1,bm90LWEtc2lnbmF0dXJl")
    assert v.verify(mixed, BODY) == "b"


def test_missing_headers_and_bad_timestamp():
    with pytest.raises(SignatureError, match="missing"):
        verifier().verify({}, BODY)
    bad = headers()
    bad["Webhook-Timestamp"] = "yesterday"
    with pytest.raises(SignatureError, match="bad webhook-timestamp"):
        verifier().verify(bad, BODY)


def test_old_ids_are_forgotten_and_memory_is_bounded():
    clock = FakeClock(now=1000)
    v = WebhookVerifier(secrets=(SECRET,), clock=clock, max_remembered_ids=3)
    for i in range(5):
        v.verify(headers(msg_id=f"m{i}"), BODY)
    assert len(v._seen) == 3
    clock.advance(1000)
    v.verify(headers(msg_id="late", timestamp=2000), BODY)
    assert list(v._seen) == ["late"]


def test_constructor_validation_and_repr():
    with pytest.raises(ValueError, match="at least one secret"):
        WebhookVerifier(secrets=())
    with pytest.raises(ValueError, match="tolerance"):
        WebhookVerifier(secrets=(SECRET,), tolerance_seconds=0)
    assert SECRET not in repr(verifier())
