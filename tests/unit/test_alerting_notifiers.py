"""Alertmanager and PagerDuty notifiers: payloads and the error contract (httpx MockTransport).

The real-server checks are in tests/integration (a real Alertmanager; a local server
following PagerDuty's Events API v2).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from alerting.alertmanager import AlertmanagerNotifier, rfc3339, silence_payload
from alerting.alerts import alert_for
from alerting.pagerduty import PagerDutyNotifier, dedup_key, event_action
from alerting.router import PageGrouper
from alerting.silences import SilenceStore, parse_matchers
from core.clock import FakeClock
from core.errors import NotifierUnavailable, PermanentError
from core.protocols import Notifier
from core.records import AlertState
from tests.unit.test_alerts import make_finding

ALERT = alert_for(make_finding(), starts_at=1_700_000_000.0)


def transport(status, seen, headers=None):
    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(status, headers=headers or {}, json={"status": "x"})
    return httpx.MockTransport(handler)


def test_alertmanager_payload_and_resend_contract():
    seen = []
    am = AlertmanagerNotifier(url="http://am:9093", clock=FakeClock(now=1_700_000_060.0),
                              generator_url="http://gpuhealth:9835/",
                              transport=transport(200, seen))
    assert isinstance(am, Notifier)
    resolved = replace(ALERT, state=AlertState.RESOLVED, ends_at=1_700_000_100.0)
    asyncio.run(am.send_many([ALERT, resolved]))
    (body,) = seen
    firing, done = body
    assert firing["labels"]["alertname"] == "GpuXid79"
    assert firing["startsAt"] == "2023-11-14T22:13:20.000Z"
    assert firing["endsAt"] == rfc3339(1_700_000_060.0 + 240)  # re-sent every 60 s
    assert firing["generatorURL"] == "http://gpuhealth:9835/"
    assert done["endsAt"] == "2023-11-14T22:15:00.000Z"
    assert set(firing) == {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}


@pytest.mark.parametrize(("status", "error"), [(503, NotifierUnavailable),
                                               (429, NotifierUnavailable),
                                               (400, PermanentError)])
def test_alertmanager_errors(status, error):
    am = AlertmanagerNotifier(url="http://am:9093", transport=transport(status, []))
    with pytest.raises(error):
        asyncio.run(am.send(ALERT))


def test_alertmanager_validation():
    with pytest.raises(ValueError, match="http"):
        AlertmanagerNotifier(url="am:9093")
    with pytest.raises(ValueError, match="resend"):
        AlertmanagerNotifier(url="http://am", resend_interval_seconds=300)


def test_silence_payload_has_only_0_25_fields():
    s = SilenceStore(clock=FakeClock(now=0)).add(parse_matchers(["node=~gpu-0.*"]),
                                                 duration_seconds=60, created_by="a",
                                                 comment="b")
    assert set(silence_payload(s)) == {"matchers", "startsAt", "endsAt", "createdBy", "comment"}


def page(*findings, silenced=()):
    grouper = PageGrouper(clock=FakeClock())
    return grouper, grouper.update([alert_for(f, starts_at=0.0) for f in findings],
                                   silenced=silenced)


def test_pagerduty_trigger_acknowledge_resolve():
    seen = []
    pd = PagerDutyNotifier(routing_key="k" * 32, url="http://pd/v2/enqueue",
                           transport=transport(202, seen))
    assert isinstance(pd, Notifier)
    assert "k" * 32 not in repr(pd)
    grouper, (p,) = page(make_finding())
    asyncio.run(pd.send(p))
    trigger = seen[-1]
    assert trigger["event_action"] == "trigger"
    assert trigger["dedup_key"] == "gpuhealth/gpu-001"
    assert trigger["payload"]["severity"] == "critical"
    assert trigger["payload"]["source"] == "gpu-001"
    fp = p.annotations["fingerprints"]
    (ack,) = grouper.update([alert_for(make_finding(), starts_at=0.0)], silenced={fp})
    assert event_action(ack) == "acknowledge"
    asyncio.run(pd.send(ack))
    assert seen[-1] == {"routing_key": "k" * 32, "event_action": "acknowledge",
                        "dedup_key": "gpuhealth/gpu-001"}
    (gone,) = grouper.update([])
    asyncio.run(pd.send(gone))
    assert seen[-1]["event_action"] == "resolve"


def test_pagerduty_severity_mapping_and_single_alert_key():
    from core.records import Severity
    _, (p,) = page(make_finding(kind="ib_port", code="state_down", severity=Severity.MAJOR))
    pd = PagerDutyNotifier(routing_key="k", url="http://pd", transport=transport(202, []))
    assert pd.event(p)["payload"]["severity"] == "error"
    assert dedup_key(ALERT) == "gpuhealth/gpu-001/0000:b1:00.0/GpuXid79"


def test_pagerduty_429_and_errors():
    pd = PagerDutyNotifier(routing_key="k", url="http://pd", transport=transport(429, []))
    with pytest.raises(NotifierUnavailable) as info:
        asyncio.run(pd.send(ALERT))
    assert info.value.retry_after_seconds == 60
    pd = PagerDutyNotifier(routing_key="k", url="http://pd",
                           transport=transport(429, [], {"retry-after": "120"}))
    with pytest.raises(NotifierUnavailable) as info:
        asyncio.run(pd.send(ALERT))
    assert info.value.retry_after_seconds == 120
    pd = PagerDutyNotifier(routing_key="k", url="http://pd", transport=transport(400, []))
    with pytest.raises(PermanentError):
        asyncio.run(pd.send(ALERT))
    pd = PagerDutyNotifier(routing_key="k", url="http://pd", transport=transport(502, []))
    with pytest.raises(NotifierUnavailable):
        asyncio.run(pd.send(ALERT))
    with pytest.raises(ValueError, match="routing_key"):
        PagerDutyNotifier(routing_key="")
