"""The pipeline's alert routing: silences, inhibition, pages, re-sends, snapshots, node facts."""

from __future__ import annotations

from alerting.silences import SilenceStore, parse_matchers
from alerting.testing import RecordingNotifier
from analytics.fault_model import Context, Observations
from core.clock import FakeClock
from core.records import Action, AlertState, EntityId, Event, Finding, NodeName, Sample, Severity
from gpuhealth.pipeline import Pipeline

TABLE = {
    "79": (Severity.CRITICAL, Action.REBOOT_NODE),
    "94": (Severity.WARNING, Action.RESET_GPU),
    "45": (Severity.WARNING, Action.NONE),
    "62": (Severity.CRITICAL, Action.RESET_GPU),
}


def rule(obs: Observations, ctx: Context):
    for g in obs.events("xid"):
        severity, action = TABLE[g.code]
        if ctx.fact("quiet") == "yes":
            severity = Severity.INFO
        yield Finding(node=g.node, entity=g.entity, kind="xid", code=g.code, severity=severity,
                      action=action, summary=f"Xid {g.code}", evidence=(), source="t",
                      occurrences=g.count)


def xid(code, entity="GPU-1", node="n1"):
    return Event(kind="xid", code=code, node=NodeName(node), entity=EntityId(entity),
                 observed_at=None)


def make(clock, **kw):
    return Pipeline(facts={}, audit_log_path=None, rules=[rule], clock=clock,
                    cluster_size=10, **kw)


def test_silence_mutes_then_expiry_sends_it():
    clock = FakeClock(now=0)
    store = SilenceStore(clock=clock)
    silence = store.add(parse_matchers(["code=79"]), duration_seconds=60, created_by="t",
                        comment="t")
    rec, pager = RecordingNotifier(), RecordingNotifier(name="pd")
    p = make(clock, notifiers=[rec], page_notifiers=[pager], silences=store)
    p.observe([xid("79")])
    out = p.evaluate()
    assert [a.state for a in out.alerts] == [AlertState.FIRING]
    assert out.notified == []
    assert list(out.muted.values()) == [f"silenced:{silence.id}"]
    assert rec.sent == []
    assert pager.sent == []  # silenced before it paged: no page
    clock.advance(61)
    out = p.evaluate()
    assert [a.labels["code"] for a in rec.sent] == ["79"]
    assert [pg.labels["severity"] for pg in pager.sent] == ["critical"]


def test_inhibited_alert_is_not_sent_and_resolves_quietly():
    clock = FakeClock(now=0)
    rec = RecordingNotifier()
    p = make(clock, notifiers=[rec])
    p.observe([xid("62"), xid("45")])
    out = p.evaluate()
    assert [a.labels["code"] for a in out.notified] == ["62"]
    assert len(out.muted) == 1
    assert p.muted() == out.muted


def test_notifier_resend_interval():
    clock = FakeClock(now=0)
    rec = RecordingNotifier(name="am")
    rec.resend_interval_seconds = 60  # type: ignore[attr-defined]
    p = make(clock, notifiers=[rec])
    p.observe([xid("79"), xid("94", entity="GPU-2")])
    p.evaluate()
    assert len(rec.sent) == 2
    clock.advance(30)
    p.evaluate()
    assert len(rec.sent) == 2
    clock.advance(31)
    p.evaluate()
    assert len(rec.sent) == 4


def test_healthy_snapshot_resolves_and_unhealthy_one_adds():
    clock = FakeClock(now=0)
    rec, pager = RecordingNotifier(), RecordingNotifier(name="pd")
    p = make(clock, notifiers=[rec], page_notifiers=[pager])
    assert not p.observe_snapshot("n1", [xid("79")])
    p.evaluate()
    assert not p.observe_snapshot("n1", [xid("94", entity="GPU-2")])
    out = p.evaluate()
    assert len(out.findings) == 2
    assert not p.observe_snapshot("n1", [])  # nothing parsed is not "healthy"
    sample = Sample(metric="gpu_temperature_celsius", value=40.0, observed_at=None,
                    node=NodeName("n1"), entity=EntityId("GPU-1"))
    assert p.observe_snapshot("n1", [sample])
    out = p.evaluate()
    assert out.findings == []
    assert sorted(a.state.value for a in out.alerts) == ["resolved", "resolved"]
    assert [pg.state for pg in pager.sent] == [AlertState.FIRING, AlertState.RESOLVED]
    assert {a.step.value for a in out.actions} == {"resume"}  # budget freed


def test_node_facts_apply_per_node():
    clock = FakeClock(now=0)
    p = make(clock, notifiers=[], node_facts={"quiet-node": {"quiet": "yes"}})
    p.observe([xid("79", node="quiet-node"), xid("79", node="loud-node")])
    out = p.evaluate()
    assert {(f.node, f.severity) for f in out.findings} == {
        ("quiet-node", Severity.INFO), ("loud-node", Severity.CRITICAL)}
    assert [a.labels["node"] for a in out.alerts] == ["loud-node"]
    p.set_node_facts("loud-node", {"quiet": "yes"})
    out = p.evaluate()
    assert [a.state for a in out.alerts] == [AlertState.RESOLVED]


def test_outbox_is_durable_across_pipelines(tmp_path):
    clock = FakeClock(now=0)
    down = RecordingNotifier(name="hook")
    from core.errors import NotifierUnavailable
    down.inject_error(NotifierUnavailable("down"), times=None)
    path = str(tmp_path / "outbox.sqlite")
    p = make(clock, notifiers=[down], outbox_path=path)
    p.observe([xid("79")])
    p.evaluate()
    assert p.outbox_depths() == {"hook": 1}
    up = RecordingNotifier(name="hook")
    again = make(clock, notifiers=[up], outbox_path=path)
    assert again.flush() == 0
    assert [a.labels["code"] for a in up.sent] == ["79"]


def test_outbox_depths_for_the_metric():
    p = make(FakeClock(), notifiers=[RecordingNotifier(name="hook")],
             page_notifiers=[RecordingNotifier(name="pd")])
    assert p.outbox_depths() == {}
    assert p.outbox_depths(every_notifier=True) == {"hook": 0, "page:pd": 0}


def test_predictions_alert_and_clear():
    from core.records import Prediction

    def pred(p):
        return Prediction(node=NodeName("n7"), entity=EntityId("GPU-3"), probability=p,
                          horizon_seconds=86400, top_features={"ecc_rate": 0.8, "temp": 0.1},
                          predicted_at=5.0)

    clock = FakeClock(now=0)
    rec, pager = RecordingNotifier(), RecordingNotifier(name="pd")
    p = make(clock, notifiers=[rec], page_notifiers=[pager])
    p.observe_predictions([pred(0.3)])
    assert p.evaluate().alerts == []
    p.observe_predictions([pred(0.6)])
    (alert,) = p.evaluate().alerts
    assert (alert.labels["alertname"], alert.labels["severity"]) == ("GpuPredictionFailure",
                                                                     "warning")
    assert pager.sent == []  # a warning is a ticket
    p.observe_predictions([pred(0.95)])
    p.evaluate()
    assert [pg.labels["severity"] for pg in pager.sent] == ["major"]
    p.observe_predictions([pred(0.1)])
    out = p.evaluate()
    assert [a.state for a in out.alerts] == [AlertState.RESOLVED]
