"""Alerts against a real Alertmanager (Debian ``prometheus-alertmanager``, 0.25).

Alertmanager runs on a free loopback port (``tests/servers.py``), routes with
``group_by: [cluster, node]`` to a Python webhook receiver. The pipeline pushes
through :class:`AlertmanagerNotifier`: alerts arrive (``GET /api/v2/alerts``), group
per node (``/api/v2/alerts/groups`` and the webhook payload, version "4"), are
silenced (gpuhealth's own silences keep them from being sent; an Alertmanager
silence made from the same matchers suppresses them there), resolve, and survive
Alertmanager being down. No field newer than 0.25 is relied upon.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from alerting.alertmanager import AlertmanagerNotifier, post_silence
from alerting.silences import SilenceStore, parse_matchers
from analytics.fault_model import Context, Observations
from core.clock import FakeClock
from core.records import Action, EntityId, Event, Finding, NodeName, Sample, Severity
from gpuhealth.pipeline import Pipeline
from tests.servers import eventually, free_port, start_alertmanager

TABLE = {
    "79": (Severity.CRITICAL, Action.REBOOT_NODE, "GPU has fallen off the bus"),
    "94": (Severity.WARNING, Action.RESET_GPU, "contained ECC error"),
    "119": (Severity.CRITICAL, Action.RESET_GPU, "GSP RPC timeout"),
}


def xid_rule(obs: Observations, ctx: Context):
    for group in obs.events("xid"):
        severity, action, summary = TABLE[group.code]
        yield Finding(node=group.node, entity=group.entity, kind="xid", code=group.code,
                      severity=severity, action=action, summary=summary,
                      evidence=tuple(group.evidence), source="test rule",
                      occurrences=group.count)


def xid(node: str, entity: str, code: str) -> Event:
    return Event(kind="xid", code=code, node=NodeName(node), entity=EntityId(entity),
                 observed_at=time.time())


def healthy(node: str) -> Sample:
    return Sample(metric="gpu_temperature_celsius", value=40.0, observed_at=time.time(),
                  node=NodeName(node), entity=EntityId("GPU-a"))


@pytest.fixture(scope="module")
def am():
    with start_alertmanager() as server:
        yield server


def make_pipeline(url: str, **kw) -> Pipeline:
    kw.setdefault("notifiers", [AlertmanagerNotifier(url=url)])
    return Pipeline(facts={}, audit_log_path=None, rules=[xid_rule], cluster_size=100, **kw)


def test_alerts_arrive_group_per_node_and_resolve(am):
    pipeline = make_pipeline(am.url, extra_labels={"cluster": "c1"})
    pipeline.observe([xid("am-a", "GPU-a", "79"), xid("am-a", "GPU-b", "94"),
                      xid("am-b", "GPU-c", "119")])
    out = pipeline.evaluate()
    assert out.notify_failures == 0
    assert pipeline.outbox_depths() == {}

    alerts = eventually(lambda: [a for a in am.alerts() if a["labels"].get("cluster") == "c1"
                                 and len(am.alerts()) >= 3])
    by_name = {(a["labels"]["node"], a["labels"]["alertname"]): a for a in alerts}
    assert set(by_name) == {("am-a", "GpuXid79"), ("am-a", "GpuXid94"), ("am-b", "GpuXid119")}
    xid79 = by_name[("am-a", "GpuXid79")]
    assert xid79["labels"]["severity"] == "critical"
    assert xid79["annotations"]["action"] == "reboot_node"
    assert xid79["annotations"]["runbook_url"].endswith("/xid.md")
    assert xid79["status"]["state"] == "active"

    groups = eventually(lambda: [g for g in am.groups()
                                 if g["labels"].get("cluster") == "c1"])
    sizes = {g["labels"]["node"]: len(g["alerts"]) for g in groups}
    assert sizes == {"am-a": 2, "am-b": 1}

    def group_posts(node, status):
        return [r.json() for r in am.receiver.on("/alertmanager")
                if r.json()["groupLabels"].get("node") == node and r.json()["status"] == status]

    posts = eventually(lambda: group_posts("am-a", "firing"))
    assert posts[0]["version"] == "4"
    assert {a["labels"]["alertname"] for a in posts[-1]["alerts"]} == {"GpuXid79", "GpuXid94"}

    # a healthy snapshot of am-a resolves its alerts in Alertmanager
    assert pipeline.observe_snapshot("am-a", [healthy("am-a")])
    out = pipeline.evaluate()
    assert {a.labels["alertname"] for a in out.notified} == {"GpuXid79", "GpuXid94"}
    eventually(lambda: not [a for a in am.alerts() if a["labels"].get("node") == "am-a"])
    resolved = eventually(lambda: group_posts("am-a", "resolved"))
    assert all(a["status"] == "resolved" for a in resolved[-1]["alerts"])
    assert [a for a in am.alerts() if a["labels"].get("node") == "am-b"]


def test_silences_ours_and_alertmanagers(am):
    store = SilenceStore()
    store.add(parse_matchers(['node="am-s"', 'alertname="GpuXid94"']), duration_seconds=600,
              created_by="test", comment="known ECC issue")
    pipeline = make_pipeline(am.url, silences=store)
    pipeline.observe([xid("am-s", "GPU-a", "79"), xid("am-s", "GPU-b", "94")])
    out = pipeline.evaluate()
    assert [a.labels["alertname"] for a in out.notified] == ["GpuXid79"]
    assert next(iter(out.muted.values())).startswith("silenced:")
    eventually(lambda: [a for a in am.alerts() if a["labels"].get("node") == "am-s"])
    names = {a["labels"]["alertname"] for a in am.alerts() if a["labels"].get("node") == "am-s"}
    assert names == {"GpuXid79"}

    # the same matchers as an Alertmanager silence suppress the alert there
    theirs = SilenceStore().add(parse_matchers(['{node="am-s", severity=~"crit.*"}']),
                                duration_seconds=600, created_by="test", comment="maintenance")
    silence_id = asyncio.run(post_silence(am.url, theirs))

    def suppressed():
        found = [a for a in am.alerts() if a["labels"].get("node") == "am-s"]
        return found and found[0]["status"]["state"] == "suppressed" and found

    (alert,) = eventually(suppressed)
    assert alert["status"]["silencedBy"] == [silence_id]


def test_outage_then_delivery_loses_nothing():
    port = free_port()
    clock = FakeClock(now=time.time())
    pipeline = make_pipeline(f"http://127.0.0.1:{port}", clock=clock)
    pipeline.observe([xid("am-o", f"GPU-{i}", "79") for i in range(5)])
    out = pipeline.evaluate()  # Alertmanager is not up yet
    assert out.notify_failures == 1
    assert pipeline.outbox_depths() == {"alertmanager": 5}
    with start_alertmanager(port=port) as server:
        clock.advance(30)
        pipeline.evaluate()
        assert pipeline.outbox_depths() == {}
        found = eventually(lambda: [a for a in server.alerts()
                                    if a["labels"].get("node") == "am-o"])
        assert len(found) == 5


def test_first_sight_critical_reaches_alertmanager_within_a_second(am):
    pipeline = make_pipeline(am.url)
    pipeline.observe([xid("am-fast", "GPU-a", "79")])
    started = time.perf_counter()
    pipeline.evaluate()
    eventually(lambda: [a for a in am.alerts() if a["labels"].get("node") == "am-fast"],
               timeout=5, interval=0.01)
    assert time.perf_counter() - started < 1.0
