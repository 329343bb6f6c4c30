"""A notifier that pushes alerts to Alertmanager's API v2 (entry point ``alertmanager``).

``POST /api/v2/alerts`` takes a JSON list of ``{labels, annotations, startsAt, endsAt,
generatorURL}`` (``docs/ecosystem-reference.md`` §3.6; Alertmanager 0.25 and later,
no field added after 0.25 is used). Alertmanager's client contract says to re-send
firing alerts periodically: the pipeline re-queues every firing alert each
``resend_interval_seconds`` (60 s), and each firing alert carries
``endsAt = now + ends_after_seconds`` (4 min by default, several re-sends), so that
Alertmanager resolves it on its own if gpuhealth stops. A resolved alert is sent
with its real ``endsAt``. Alertmanager deduplicates on the label set, which is
the alert's fingerprint source, so re-sends never make new alerts.

Errors are mapped as for the webhook notifier: connection errors, timeouts, 429 and
5xx are :class:`~core.errors.NotifierUnavailable`; other 4xx answers (a bad
label set) are :class:`~core.errors.PermanentError`.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from alerting.http import LoopClient
from alerting.silences import Silence
from alerting.webhook import _mapped_errors, _retry_after, _ssl_context
from core.clock import Clock, system_clock
from core.errors import NotifierUnavailable, PermanentError
from core.records import Alert, AlertState

logger = logging.getLogger(__name__)


def rfc3339(epoch_seconds: float) -> str:
    """Return epoch seconds as an RFC 3339 UTC time with milliseconds.

    Examples:
        >>> rfc3339(0)
        '1970-01-01T00:00:00.000Z'
    """
    when = dt.datetime.fromtimestamp(epoch_seconds, tz=dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


class AlertmanagerNotifier:
    """Pushes alerts to one Alertmanager (or an HA pair behind one URL).

    Args:
        url: Alertmanager base URL, e.g. ``http://127.0.0.1:9093``.
        timeout_seconds: Whole-request timeout, seconds.
        resend_interval_seconds: How often the pipeline re-sends every firing
            alert, seconds (must stay well below ``ends_after_seconds``).
        ends_after_seconds: ``endsAt`` of a firing alert, seconds after the send;
            Alertmanager resolves the alert if no re-send comes by then.
        generator_url: ``generatorURL`` of every alert (the gpuhealth API or a
            dashboard); empty by default.
        clock: Returns now, epoch seconds.
        transport: httpx transport (tests); the default network transport otherwise.

    Raises:
        ValueError: Bad URL scheme, a non-positive timeout, or ``ends_after_seconds``
            not larger than ``resend_interval_seconds``.
    """

    name = "alertmanager"

    def __init__(
        self,
        *,
        url: str,
        timeout_seconds: float = 10.0,
        resend_interval_seconds: float = 60.0,
        ends_after_seconds: float = 240.0,
        generator_url: str = "",
        clock: Clock = system_clock,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"alertmanager url must start with http:// or https://, got {url!r}")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        if not 0 < resend_interval_seconds < ends_after_seconds:
            raise ValueError("need 0 < resend_interval_seconds < ends_after_seconds")
        self.url = url
        self.timeout_seconds = timeout_seconds
        self.resend_interval_seconds = resend_interval_seconds
        self.ends_after_seconds = ends_after_seconds
        self.generator_url = generator_url
        self.clock = clock
        self.transport = transport
        self._http = LoopClient(timeout=timeout_seconds, transport=transport,
                                verify=_ssl_context())
        self._endpoint = url.rstrip("/") + "/api/v2/alerts"

    async def aclose(self) -> None:
        """Close the HTTP client (the service calls it at shut-down, on its loop)."""
        await self._http.aclose()
    def __repr__(self) -> str:
        return f"AlertmanagerNotifier(url={self.url!r})"

    def payload(self, alert: Alert) -> dict[str, Any]:
        """Return one alert as Alertmanager API v2 ``postableAlert`` JSON."""
        now = self.clock()
        if alert.state is AlertState.RESOLVED:
            ends_at = alert.ends_at if alert.ends_at is not None else now
        else:
            ends_at = now + self.ends_after_seconds
        body: dict[str, Any] = {
            "labels": {k: v for k, v in alert.labels.items() if v != ""},
            "annotations": {k: v for k, v in alert.annotations.items() if v != ""},
            "startsAt": rfc3339(alert.starts_at),
            "endsAt": rfc3339(max(ends_at, alert.starts_at)),
        }
        if self.generator_url:
            body["generatorURL"] = self.generator_url
        return body

    async def send(self, alert: Alert) -> None:
        """Push one alert (see :meth:`send_many`)."""
        await self.send_many([alert])

    async def send_many(self, alerts: Sequence[Alert]) -> None:
        """Push several alerts in one request.

        Raises:
            NotifierUnavailable: Connection error, timeout, 429 or 5xx.
            PermanentError: Any other non-2xx answer (Alertmanager rejected the alerts).
        """
        if not alerts:
            return
        body = [self.payload(a) for a in alerts]
        with _mapped_errors(self._endpoint):
            response = await self._http.get().post(self._endpoint, json=body)
        status = response.status_code
        if 200 <= status < 300:
            logger.debug("alertmanager %s took %d alert(s)", self.url, len(alerts))
            return
        if status == 429 or status >= 500:
            raise NotifierUnavailable(
                f"alertmanager {self.url} answered {status}",
                retry_after_seconds=_retry_after(response.headers.get("retry-after"),
                                                 self.clock()),
            )
        raise PermanentError(f"alertmanager {self.url} answered {status}: {response.text[:200]}")


def silence_payload(silence: Silence) -> dict[str, Any]:
    """Return one of gpuhealth's silences as Alertmanager API v2 ``postableSilence`` JSON.

    Only the fields Alertmanager 0.25 knows are used (no ``annotations``).
    """
    return {
        "matchers": [m.to_alertmanager() for m in silence.matchers],
        "startsAt": rfc3339(silence.starts_at),
        "endsAt": rfc3339(silence.ends_at),
        "createdBy": silence.created_by,
        "comment": silence.comment,
    }


async def post_silence(
    url: str,
    silence: Silence,
    *,
    timeout_seconds: float = 10.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> str:
    """Create ``silence`` in the Alertmanager at ``url``; return Alertmanager's silence id.

    For sites that silence in Alertmanager too: the same matchers then mute the
    alerts gpuhealth pushed there.

    Raises:
        NotifierUnavailable: Alertmanager cannot be reached, or answered 429 or 5xx.
        PermanentError: It rejected the silence.
    """
    endpoint = url.rstrip("/") + "/api/v2/silences"
    with _mapped_errors(endpoint):
        async with httpx.AsyncClient(timeout=timeout_seconds, transport=transport,
                                     verify=_ssl_context()) as client:
            response = await client.post(endpoint, json=silence_payload(silence))
    if response.status_code == 429 or response.status_code >= 500:
        raise NotifierUnavailable(f"alertmanager {url} answered {response.status_code}")
    if not 200 <= response.status_code < 300:
        raise PermanentError(f"alertmanager {url} refused the silence "
                             f"({response.status_code}): {response.text[:200]}")
    try:
        return str(response.json()["silenceID"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PermanentError(f"alertmanager {url}: unexpected answer {response.text[:200]}"
                             ) from exc
