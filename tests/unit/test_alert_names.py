"""Alert names have no doubled prefix; the old names are aliases for one release
(issue #14 item 5a)."""

from __future__ import annotations

import pytest

from alerting.alerts import alert_name, alert_names, legacy_alert_name
from alerting.promrules import prometheus_rules, render_rules, rules_to_json
from alerting.silences import Matcher, MatchOp, parse_matcher

LOST = {"alertname": "GpuLostRmInitAdapter", "kind": "gpu_lost", "code": "rm_init_adapter",
        "node": "n1", "entity": "GPU-0", "severity": "critical"}


@pytest.mark.parametrize(("kind", "code", "name", "old"), [
    ("gpu_lost", "rm_init_adapter", "GpuLostRmInitAdapter", "GpuGpuLostRmInitAdapter"),
    ("gpu_lost", "fallen_off_bus", "GpuLostFallenOffBus", "GpuGpuLostFallenOffBus"),
    ("gpuhealth", "notifier_backlog", "GpuhealthNotifierBacklog",
     "GpuGpuhealthNotifierBacklog"),
    ("xid", "79", "GpuXid79", None),
    ("host_memory", "edac_ue", "HostMemoryEdacUe", None),
    ("ib_port", "Down", "NetIbPortDown", None),
])
def test_names_are_clean_and_the_old_one_is_an_alias(kind, code, name, old):
    assert alert_name(kind, code) == name
    assert legacy_alert_name(kind, code) == old


def test_no_exported_rule_doubles_its_prefix():
    for group in prometheus_rules():
        for rule in group.rules:
            assert not rule.alert.startswith(("GpuGpu", "NetNet", "HostHost")), rule.alert
    text = render_rules()
    assert 'alert: "GpuhealthNotifierBacklog"' in text
    assert 'alert: "GpuGpu' not in text
    (self_rule,) = [r for g in rules_to_json(prometheus_rules())["groups"]
                    if g["name"] == "gpuhealth-self" for r in g["rules"]]
    assert self_rule["annotations"]["alias"] == "GpuGpuhealthNotifierBacklog"


def test_a_silence_on_the_old_name_still_selects_the_alert():
    assert alert_names(LOST) == ("GpuLostRmInitAdapter", "GpuGpuLostRmInitAdapter")
    assert parse_matcher('alertname="GpuGpuLostRmInitAdapter"').matches(LOST)
    assert parse_matcher('alertname="GpuLostRmInitAdapter"').matches(LOST)
    assert parse_matcher('alertname=~"GpuGpuLost.*"').matches(LOST)
    assert not parse_matcher('alertname="GpuXid79"').matches(LOST)
    # negative matchers exclude the alert by either of its names
    assert not parse_matcher('alertname!="GpuGpuLostRmInitAdapter"').matches(LOST)
    assert not Matcher(name="alertname", op=MatchOp.NOT_REGEX,
                       value="GpuGpu.*").matches(LOST)
    assert parse_matcher('alertname!="GpuXid79"').matches(LOST)
    # an alert someone else named (no kind label) is matched by its name only
    other = {"alertname": "GpuGpuSomething"}
    assert parse_matcher('alertname="GpuGpuSomething"').matches(other)
    assert not parse_matcher('alertname="GpuSomething"').matches(other)
