"""A notifier that POSTs alerts as JSON, signed per Standard Webhooks (entry point ``webhook``).

The body is the alert as a JSON object (sorted keys, compact). When a secret is
set, three headers sign it as Standard Webhooks 1.0 specifies
(``docs/ecosystem-reference.md`` §7.3): ``webhook-id`` (unique per message),
``webhook-timestamp`` (Unix seconds) and ``webhook-signature: v1,<base64>``, the
HMAC-SHA256 of ``"{id}.{timestamp}.{body}"`` under the secret. A secret written
``whsec_<base64>`` is base64-decoded first (the Standard Webhooks form); any
other string is used as its UTF-8 bytes.

The receiving side is :class:`WebhookVerifier`: it checks a signature over the
exact raw body in constant time, accepts any of several signatures (key
rotation), rejects a timestamp outside the tolerance (5 min) and a ``webhook-id``
already seen within that window (replay protection).

Errors are translated at one seam: connection errors, timeouts, 5xx and 429
raise :class:`~core.errors.NotifierUnavailable` (with ``Retry-After`` as
``retry_after_seconds`` when the server sent one); other 3xx and 4xx raise
:class:`~core.errors.PermanentError`. The notifier never retries; the runner does.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import functools
import hashlib
import hmac
import json
import logging
import ssl
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

import httpx

from alerting.alerts import alert_to_json
from alerting.http import LoopClient
from core.clock import Clock, system_clock
from core.errors import NotifierUnavailable, PermanentError
from core.records import Alert

logger = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
"""Prefix of a base64-encoded Standard Webhooks secret."""


def secret_key(secret: str) -> bytes:
    """Return the HMAC key of ``secret``: base64-decoded after ``whsec_``, else its UTF-8 bytes.

    Raises:
        ValueError: A ``whsec_`` secret is not valid base64.

    Examples:
        >>> secret_key("whsec_c2VjcmV0")
        b'secret'
        >>> secret_key("plain")
        b'plain'
    """
    if secret.startswith(SECRET_PREFIX):
        try:
            return base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
        except ValueError as exc:
            raise ValueError("webhook secret after 'whsec_' is not valid base64") from exc
    return secret.encode("utf-8")


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """Return the ``webhook-signature`` header value for one message.

    Args:
        key: HMAC key (see :func:`secret_key`).
        msg_id: The ``webhook-id`` header value.
        timestamp: The ``webhook-timestamp`` header value, Unix seconds.
        body: The exact request body bytes.

    Returns:
        ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``.
    """
    signed = msg_id.encode("utf-8") + b"." + str(timestamp).encode("ascii") + b"." + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def _retry_after(value: str | None, now: float) -> float | None:
    """Parse a ``Retry-After`` header (seconds or an HTTP date) into seconds from now."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """Return one default TLS context for every client (building one costs ~20 ms)."""
    return ssl.create_default_context()


@contextlib.contextmanager
def _mapped_errors(url: str) -> Iterator[None]:
    """Translate httpx exceptions into the notifier error contract."""
    try:
        yield
    except httpx.TransportError as exc:
        raise NotifierUnavailable(f"webhook {url}: {type(exc).__name__}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise PermanentError(f"webhook {url}: {type(exc).__name__}: {exc}") from exc


class WebhookNotifier:
    """POSTs each alert as JSON to ``url``, signed when a secret is given.

    Args:
        url: ``http://`` or ``https://`` endpoint.
        secret: The signing secret's value (the caller reads it from the
            environment or a file, never from the configuration file), or
            ``None`` to send unsigned.
        timeout_seconds: Whole-request timeout, seconds.
        clock: Returns now, epoch seconds (the ``webhook-timestamp``).
        id_factory: Returns a new ``webhook-id`` per message.

    Raises:
        ValueError: Bad URL scheme, non-positive timeout, or a malformed ``whsec_`` secret.
    """

    name = "webhook"

    def __init__(
        self,
        *,
        url: str,
        secret: str | None = None,
        timeout_seconds: float = 10.0,
        clock: Clock = system_clock,
        id_factory: Callable[[], str] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook url must start with http:// or https://, got {url!r}")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        self.url = url
        self.secret = secret
        self.timeout_seconds = timeout_seconds
        self.clock = clock
        self.id_factory = id_factory
        self._key = secret_key(secret) if secret else None
        self._http = LoopClient(timeout=timeout_seconds, verify=_ssl_context())

    async def aclose(self) -> None:
        """Close the HTTP client (the service calls it at shut-down, on its loop)."""
        await self._http.aclose()

    def __repr__(self) -> str:
        """Return a representation that never shows the secret."""
        signed = "signed" if self._key is not None else "unsigned"
        return (
            f"WebhookNotifier(url={self.url!r}, {signed}, timeout_seconds={self.timeout_seconds})"
        )

    def _headers(self, body: bytes) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self._key is not None:
            msg_id = self.id_factory() if self.id_factory else f"msg_{uuid.uuid4().hex}"
            timestamp = int(self.clock())
            headers["webhook-id"] = msg_id
            headers["webhook-timestamp"] = str(timestamp)
            headers["webhook-signature"] = sign(self._key, msg_id, timestamp, body)
        return headers

    async def send(self, alert: Alert) -> None:
        """POST ``alert``.

        Raises:
            NotifierUnavailable: Connection error, timeout, 5xx or 429 (with
                ``retry_after_seconds`` from ``Retry-After`` when present).
            PermanentError: Any other non-2xx answer.
        """
        body = json.dumps(alert_to_json(alert), sort_keys=True, separators=(",", ":")).encode()
        headers = self._headers(body)
        with _mapped_errors(self.url):
            response = await self._http.get().post(self.url, content=body, headers=headers)
        status = response.status_code
        if 200 <= status < 300:
            logger.debug("webhook %s accepted alert %s (%d)", self.url, alert.fingerprint, status)
            return
        retry_after = _retry_after(response.headers.get("retry-after"), self.clock())
        if status == 429 or status >= 500:
            raise NotifierUnavailable(
                f"webhook {self.url} answered {status}", retry_after_seconds=retry_after
            )
        raise PermanentError(f"webhook {self.url} answered {status}: {response.text[:200]}")


class SignatureError(ValueError):
    """A webhook request whose signature, timestamp or id is not acceptable."""


DEFAULT_TOLERANCE_SECONDS = 300.0
"""Accepted clock skew and replay window of a received webhook (Standard Webhooks: 5 min)."""


class WebhookVerifier:
    """Verifies Standard Webhooks signatures on the receiving side, with a replay guard.

    Args:
        secrets: Current signing secrets (``whsec_...`` or plain); a signature by
            any of them is accepted, for key rotation.
        tolerance_seconds: Largest accepted difference between ``webhook-timestamp``
            and now, either way, seconds.
        clock: Returns now, epoch seconds.
        max_remembered_ids: Bound on the ``webhook-id`` values kept for the replay guard.

    Raises:
        ValueError: No secret, or a malformed one, or a non-positive tolerance.
    """

    def __init__(
        self,
        *,
        secrets: tuple[str, ...],
        tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
        clock: Clock = system_clock,
        max_remembered_ids: int = 100_000,
    ) -> None:
        if not secrets:
            raise ValueError("WebhookVerifier needs at least one secret")
        if tolerance_seconds <= 0:
            raise ValueError(f"tolerance_seconds must be > 0, got {tolerance_seconds!r}")
        self.secrets = secrets
        self.tolerance_seconds = tolerance_seconds
        self.clock = clock
        self.max_remembered_ids = max_remembered_ids
        self._keys = [secret_key(s) for s in secrets]
        self._seen: OrderedDict[str, float] = OrderedDict()

    def __repr__(self) -> str:
        """Return a representation that never shows the secrets."""
        return f"WebhookVerifier({len(self._keys)} secret(s), tolerance={self.tolerance_seconds})"

    def verify(self, headers: Mapping[str, str], body: bytes) -> str:
        """Check one request; return its ``webhook-id``.

        Args:
            headers: Request headers (names compared case-insensitively).
            body: The exact raw body bytes, before any JSON parsing.

        Raises:
            SignatureError: A header is missing, the timestamp is outside the
                tolerance, no signature matches, or the id was already accepted
                within the window (a replay).
        """
        lower = {k.lower(): v for k, v in headers.items()}
        msg_id = lower.get("webhook-id")
        stamp = lower.get("webhook-timestamp")
        signatures = lower.get("webhook-signature")
        if not msg_id or not stamp or not signatures:
            raise SignatureError("missing webhook-id, webhook-timestamp or webhook-signature")
        try:
            timestamp = int(stamp)
        except ValueError:
            raise SignatureError(f"bad webhook-timestamp {stamp!r}") from None
        now = self.clock()
        if abs(now - timestamp) > self.tolerance_seconds:
            raise SignatureError(f"webhook-timestamp {timestamp} outside the tolerance "
                                 f"of {self.tolerance_seconds:.0f} s")
        offered = [part.strip() for part in signatures.split(" ") if part.strip()]
        good = False
        for key in self._keys:
            expected = sign(key, msg_id, timestamp, body)
            if any(hmac.compare_digest(expected, candidate) for candidate in offered):
                good = True
        if not good:
            raise SignatureError("no valid signature")
        self._forget_old(now)
        if msg_id in self._seen:
            raise SignatureError(f"replayed webhook-id {msg_id!r}")
        self._seen[msg_id] = float(timestamp)
        while len(self._seen) > self.max_remembered_ids:
            self._seen.popitem(last=False)
        return msg_id

    def _forget_old(self, now: float) -> None:
        horizon = now - 2 * self.tolerance_seconds
        while self._seen:
            oldest_id, at = next(iter(self._seen.items()))
            if at >= horizon:
                break
            del self._seen[oldest_id]
