"""A notifier for PagerDuty's Events API v2 (entry point ``pagerduty``).

Each alert becomes one event (``docs/ecosystem-reference.md`` §7.1): a firing alert
``trigger``s, a firing alert marked ``acknowledged`` (a page whose alerts were all
silenced) ``acknowledge``s, and a resolved one ``resolve``s, all with the same
``dedup_key`` so PagerDuty keeps one incident per fault. The pipeline sends pages
(one per node group) here, so the key is ``<cluster>/<node>`` for a page and
``<cluster>/<node>/<entity>/<alertname>`` for a single alert (the reference's
suggested shape). Severities map ``critical``→``critical``, ``major``→``error``,
``warning``→``warning``, ``info``→``info``.

Answers: 202 accepted; 400 (invalid event) is a
:class:`~core.errors.PermanentError`; 429 (throttled, about 120 events a minute per
key) and 5xx or network errors are :class:`~core.errors.NotifierUnavailable`, the
429 with ``Retry-After`` or else 60 s, since PagerDuty asks for backoff in minutes.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import httpx

from alerting.http import LoopClient
from alerting.webhook import _mapped_errors, _retry_after, _ssl_context
from core.clock import Clock, system_clock
from core.errors import NotifierUnavailable, PermanentError
from core.records import Alert, AlertState

logger = logging.getLogger(__name__)

EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
"""The Events API v2 endpoint."""

SEVERITY = {"critical": "critical", "major": "error", "warning": "warning", "info": "info"}
"""Fault-model severity to PagerDuty ``payload.severity``."""

THROTTLE_RETRY_SECONDS = 60.0
"""Wait after a 429 without ``Retry-After``, seconds."""

MAX_SUMMARY = 1024
"""``payload.summary`` length limit, characters."""


def dedup_key(alert: Alert) -> str:
    """Return the PagerDuty ``dedup_key`` of an alert or page (at most 255 characters).

    Examples:
        >>> from core.records import Alert, AlertState
        >>> page = Alert(fingerprint="f", labels={"alertname": "GpuhealthPage", "node": "n1"},
        ...              annotations={}, state=AlertState.FIRING, starts_at=0)
        >>> dedup_key(page)
        'gpuhealth/n1'
    """
    labels = alert.labels
    parts = [labels.get("cluster") or "gpuhealth", labels.get("node", "")]
    if labels.get("alertname") != "GpuhealthPage":
        parts += [labels.get("entity", ""), labels.get("alertname", "")]
    return "/".join(parts)[:255]


def event_action(alert: Alert) -> str:
    """Return ``trigger``, ``acknowledge`` or ``resolve`` for an alert."""
    if alert.state is AlertState.RESOLVED:
        return "resolve"
    if alert.annotations.get("acknowledged") == "true":
        return "acknowledge"
    return "trigger"


class PagerDutyNotifier:
    """Sends alerts or pages as PagerDuty Events API v2 events.

    Args:
        routing_key: The integration key (read by the caller from the environment or a
            file, never from the configuration file; never logged).
        url: Events API endpoint (a local server in tests).
        timeout_seconds: Whole-request timeout, seconds.
        client_url: ``client_url`` shown in PagerDuty (the gpuhealth API); optional.
        clock: Returns now, epoch seconds.
        transport: httpx transport (tests).

    Raises:
        ValueError: Empty routing key, bad URL scheme or non-positive timeout.
    """

    name = "pagerduty"

    def __init__(
        self,
        *,
        routing_key: str,
        url: str = EVENTS_URL,
        timeout_seconds: float = 10.0,
        client_url: str = "",
        clock: Clock = system_clock,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not routing_key:
            raise ValueError("routing_key must not be empty")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"pagerduty url must start with http:// or https://, got {url!r}")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        self.routing_key = routing_key
        self.url = url
        self.timeout_seconds = timeout_seconds
        self.client_url = client_url
        self.clock = clock
        self.transport = transport
        self._http = LoopClient(timeout=timeout_seconds, transport=transport,
                                verify=_ssl_context())

    async def aclose(self) -> None:
        """Close the HTTP client (the service calls it at shut-down, on its loop)."""
        await self._http.aclose()
    def __repr__(self) -> str:
        """Return a representation that never shows the routing key."""
        return f"PagerDutyNotifier(url={self.url!r})"

    def event(self, alert: Alert) -> dict[str, Any]:
        """Return the Events API v2 body for ``alert``."""
        action = event_action(alert)
        body: dict[str, Any] = {
            "routing_key": self.routing_key,
            "event_action": action,
            "dedup_key": dedup_key(alert),
        }
        if action != "trigger":
            return body
        labels, notes = alert.labels, alert.annotations
        summary = notes.get("summary") or labels.get("alertname", "gpuhealth alert")
        payload: dict[str, Any] = {
            "summary": summary[:MAX_SUMMARY],
            "source": labels.get("node") or "gpuhealth",
            "severity": SEVERITY.get(labels.get("severity", ""), "error"),
            "timestamp": dt.datetime.fromtimestamp(alert.starts_at, tz=dt.UTC).isoformat(),
            "custom_details": {**dict(labels), **{k: v for k, v in notes.items()
                                                 if k != "summary"}},
        }
        if labels.get("entity"):
            payload["component"] = labels["entity"]
        if labels.get("cluster"):
            payload["group"] = labels["cluster"]
        if labels.get("kind"):
            payload["class"] = labels["kind"]
        body["payload"] = payload
        body["client"] = "gpuhealth"
        if self.client_url:
            body["client_url"] = self.client_url
        if notes.get("runbook_url", "").startswith(("http://", "https://")):
            body["links"] = [{"href": notes["runbook_url"], "text": "runbook"}]
        return body

    async def send(self, alert: Alert) -> None:
        """Send one event.

        Raises:
            NotifierUnavailable: 429 (retry after ``Retry-After`` or 60 s), 5xx,
                connection error or timeout.
            PermanentError: 400 or another non-2xx answer.
        """
        body = self.event(alert)
        with _mapped_errors(self.url):
            response = await self._http.get().post(self.url, json=body)
        status = response.status_code
        if 200 <= status < 300:
            logger.debug("pagerduty took %s %s (%d)", body["event_action"], body["dedup_key"],
                         status)
            return
        if status == 429:
            retry = _retry_after(response.headers.get("retry-after"), self.clock())
            raise NotifierUnavailable(
                "pagerduty throttled (429)",
                retry_after_seconds=retry if retry is not None else THROTTLE_RETRY_SECONDS,
            )
        if status >= 500:
            raise NotifierUnavailable(f"pagerduty answered {status}")
        raise PermanentError(f"pagerduty answered {status}: {response.text[:200]}")
