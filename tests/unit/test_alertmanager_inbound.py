"""Alertmanager webhook payloads (version 4) in: the mapping to findings, errors, the route.

The payload shapes follow Alertmanager's ``<webhook_config>`` documentation
(ecosystem-reference §3.5) and the sample Alertmanager 0.25 sent in ``docs/infra.md``
§3. The last test drives a real Alertmanager (Debian ``prometheus-alertmanager``)
whose webhook posts, with a bearer token, to gpuhealth's real API server.
"""

from __future__ import annotations

import copy
import json
import subprocess
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from alerting.inbound import (
    EXTERNAL_CONFIDENCE,
    GPUHEALTH_CONFIDENCE,
    KNOWN_FAULT_CONFIDENCE,
    InboundBatch,
    InboundError,
    parse_alertmanager,
    parse_alertmanager_body,
)
from alerting.silences import SilenceStore
from core.clock import FakeClock
from core.records import Action, Severity
from gpuhealth.api import AlertingApi, ApiServer
from gpuhealth.pipeline import Pipeline
from tests.servers import eventually, free_port, need_binary, post_json, stop, wait_ready

NOW = 1_800_000_000.0

INFRA_SAMPLE: dict[str, Any] = {
    "receiver": "pyhook",
    "status": "firing",
    "alerts": [
        {
            "status": "firing",
            "labels": {"alertname": "GpuTooHot", "gpu": "1", "instance": "127.0.0.1:9400",
                       "job": "fakegpu", "severity": "critical"},
            "annotations": {"summary": "GPU 1 on 127.0.0.1:9400 is 95C"},
            "startsAt": "2026-11-30T04:09:56.321Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://vm:9090/graph?g0.expr=fake_gpu_temperature_celsius+%3E+80"
                            "&g0.tab=1",
            "fingerprint": "16cca5a09e00ec95",
        }
    ],
    "groupLabels": {"alertname": "GpuTooHot"},
    "commonLabels": {"alertname": "GpuTooHot", "gpu": "1", "instance": "127.0.0.1:9400",
                     "job": "fakegpu", "severity": "critical"},
    "commonAnnotations": {"summary": "GPU 1 on 127.0.0.1:9400 is 95C"},
    "externalURL": "http://vm:9093",
    "version": "4",
    "groupKey": "{}:{alertname=\"GpuTooHot\"}",
    "truncatedAlerts": 0,
}
"""The firing payload of ``docs/infra.md`` §3, exactly as Alertmanager 0.25 sent it."""


def payload(*alerts: dict[str, Any], status: str = "firing") -> dict[str, Any]:
    body = copy.deepcopy(INFRA_SAMPLE)
    body["status"] = status
    body["alerts"] = list(alerts)
    return body


def alert(labels: dict[str, str], *, annotations: dict[str, str] | None = None,
          expr: str = "", status: str = "firing", fingerprint: str = "f1") -> dict[str, Any]:
    generator = f"http://vm:9090/graph?g0.expr={urllib.parse.quote_plus(expr)}&g0.tab=1"
    return {"status": status, "labels": labels, "annotations": annotations or {},
            "startsAt": "2026-11-30T04:09:56.321Z",
            "endsAt": "0001-01-01T00:00:00Z" if status == "firing"
            else "2026-11-30T04:10:09.321Z",
            "generatorURL": generator if expr else "", "fingerprint": fingerprint}


def only(body: dict[str, Any]):
    batch = parse_alertmanager(body, received_at=NOW)
    assert len(batch.firing) == 1, batch
    return batch.firing[0].finding


def test_the_real_alertmanager_sample_is_an_external_finding():
    batch = parse_alertmanager(INFRA_SAMPLE, received_at=NOW)
    assert (batch.receiver, batch.status, batch.external_url) == ("pyhook", "firing",
                                                                  "http://vm:9093")
    assert batch.resolved == ()
    assert batch.ignored == ()
    [inbound] = batch.firing
    assert inbound.fingerprint == "16cca5a09e00ec95"
    f = inbound.finding
    assert (f.node, f.entity, f.kind, f.code) == ("127.0.0.1", "gpu:1", "external", "GpuTooHot")
    assert (f.severity, f.action, f.confidence) == (Severity.CRITICAL, Action.NONE,
                                                    EXTERNAL_CONFIDENCE)
    assert f.summary == "GPU 1 on 127.0.0.1:9400 is 95C"
    assert f.evidence[0].text == "summary: GPU 1 on 127.0.0.1:9400 is 95C"
    assert f.evidence[0].file == "alertmanager:pyhook"
    assert f.first_seen_at == pytest.approx(1796011796.321)
    assert f.last_seen_at == NOW


def test_gpuhealth_rules_keep_their_kind_code_and_action():
    labels = {"alertname": "GpuRowRemapFailure", "node": "gpu-001", "entity": "GPU-aaaa",
              "kind": "row_remap", "code": "failure", "severity": "critical",
              "exporter": "gpuhealth"}
    f = only(payload(alert(labels, annotations={"summary": "row remap failed",
                                                "action": "service_hardware"})))
    assert (f.node, f.entity, f.kind, f.code) == ("gpu-001", "GPU-aaaa", "row_remap", "failure")
    assert (f.severity, f.action, f.confidence) == (Severity.CRITICAL, Action.SERVICE_HARDWARE,
                                                    GPUHEALTH_CONFIDENCE)
    assert f.summary == "row remap failed"


def test_gpuhealth_xid_labels_without_an_action_take_the_xid_table():
    labels = {"alertname": "GpuXid119", "node": "gpu-001", "entity": "GPU-aaaa", "kind": "xid",
              "code": "119"}
    f = only(payload(alert(labels)))
    assert (f.kind, f.code, f.severity, f.action) == ("xid", "119", Severity.CRITICAL,
                                                      Action.RESET_GPU)
    assert f.confidence == GPUHEALTH_CONFIDENCE


def test_action_and_confidence_labels_win():
    labels = {"alertname": "SiteRule", "node": "gpu-002", "severity": "warning",
              "action": "reboot_node", "confidence": "0.75"}
    f = only(payload(alert(labels)))
    assert (f.kind, f.code, f.action, f.confidence) == ("external", "SiteRule",
                                                        Action.REBOOT_NODE, 0.75)


def test_dcgm_xid_alert_is_judged_by_the_xid_table():
    labels = {"alertname": "GpuFellOffBus", "Hostname": "gpu-007",
              "UUID": "GPU-0a1b2c3d-0000-0000-0000-000000000000", "gpu": "3",
              "severity": "critical"}
    f = only(payload(alert(labels, expr="DCGM_FI_DEV_XID_ERRORS == 79")))
    assert (f.node, f.entity, f.kind, f.code) == ("gpu-007",
                                                  "GPU-0a1b2c3d-0000-0000-0000-000000000000",
                                                  "xid", "79")
    assert (f.severity, f.action) == (Severity.CRITICAL, Action.REBOOT_NODE)
    assert f.confidence == KNOWN_FAULT_CONFIDENCE
    assert "Xid" in f.source
    assert "fault-model" in f.source


@pytest.mark.parametrize(("labels", "annotations", "expr", "code", "action"), [
    ({"xid": "48"}, {}, "DCGM_FI_DEV_XID_ERRORS > 0", "48", Action.RESET_GPU),
    ({}, {"value": "94"}, "DCGM_FI_DEV_XID_ERRORS > 0", "94", Action.RESET_GPU),
    ({}, {"value": "6.2e+01"}, "DCGM_FI_DEV_XID_ERRORS != 0", "62", Action.RESET_GPU),
    ({"__name__": "DCGM_FI_DEV_XID_ERRORS"}, {}, "", None, None),
    ({"xid": "119"}, {"value": "2"}, "DCGM_EXP_XID_ERRORS_COUNT > 0", "119", Action.RESET_GPU),
])
def test_the_xid_number_comes_from_label_value_or_expression(labels, annotations, expr, code,
                                                             action):
    base = {"alertname": "XidSeen", "Hostname": "gpu-1", "pci_bus_id": "00000000:B1:00.0"}
    f = only(payload(alert({**base, **labels}, annotations=annotations, expr=expr)))
    if code is None:  # no Xid number anywhere: nothing to judge
        assert (f.kind, f.code) == ("external", "XidSeen")
    else:
        assert (f.kind, f.code, f.action, f.entity) == ("xid", code, action, "0000:b1:00.0")


@pytest.mark.parametrize(("expr", "kind", "code", "severity", "action"), [
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE > 0", "row_remap", "failure", Severity.CRITICAL,
     Action.SERVICE_HARDWARE),
    ("increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL[5m]) > 0", "ecc", "dram_uncorrectable",
     Severity.WARNING, Action.RESET_GPU),
    ("dcgm_ecc_dbe_volatile_total > 0", "ecc", "dram_uncorrectable", Severity.WARNING,
     Action.RESET_GPU),
])
def test_dcgm_memory_alerts_are_judged_by_the_fault_model(expr, kind, code, severity, action):
    labels = {"alertname": "GpuMemory", "instance": "gpu-9.example:9400",
              "pci_bus_id": "00000000:1A:00.0"}
    f = only(payload(alert(labels, expr=expr)))
    assert (f.node, f.entity, f.kind, f.code) == ("gpu-9.example", "0000:1a:00.0", kind, code)
    assert (f.severity, f.action) == (severity, action)  # no severity label: the model's


def test_an_unjudged_dcgm_series_is_external():
    labels = {"alertname": "Hot", "Hostname": "gpu-3", "gpu": "0", "severity": "warning"}
    f = only(payload(alert(labels, annotations={"value": "91"},
                           expr="DCGM_FI_DEV_GPU_TEMP > 90")))
    assert (f.kind, f.code, f.action, f.severity) == ("external", "Hot", Action.NONE,
                                                      Severity.WARNING)


@pytest.mark.parametrize(("word", "severity"), [
    ("critical", Severity.CRITICAL), ("page", Severity.CRITICAL), ("CRIT", Severity.CRITICAL),
    ("major", Severity.MAJOR), ("error", Severity.MAJOR), ("warning", Severity.WARNING),
    ("info", Severity.INFO), ("none", Severity.INFO), ("sev-3", Severity.WARNING),
])
def test_severity_words(word, severity):
    f = only(payload(alert({"alertname": "A", "node": "n1", "severity": word})))
    assert f.severity is severity


def test_missing_severity_is_warning_for_an_external_alert():
    assert only(payload(alert({"alertname": "A", "node": "n1"}))).severity is Severity.WARNING


@pytest.mark.parametrize(("labels", "node"), [
    ({"node": "gpu-1", "Hostname": "other", "instance": "x:1"}, "gpu-1"),
    ({"Hostname": "gpu-2", "instance": "x:1"}, "gpu-2"),
    ({"hostname": "gpu-3"}, "gpu-3"),
    ({"instance": "gpu-4.dc1:9400"}, "gpu-4.dc1"),
    ({"instance": "10.0.0.7:9100"}, "10.0.0.7"),
    ({"instance": "[fd00::7]:9100"}, "fd00::7"),
    ({"instance": "gpu-5"}, "gpu-5"),
])
def test_node_labels(labels, node):
    assert only(payload(alert({"alertname": "A", **labels}))).node == node


def test_alerts_without_a_node_are_ignored_with_a_reason_and_resolved_are_listed():
    body = payload(
        alert({"alertname": "ClusterWide"}, fingerprint="c1"),
        alert({"alertname": "A", "node": "n1"}, fingerprint="a1"),
        alert({"alertname": "B", "node": "n2"}, status="resolved", fingerprint="b1"),
    )
    batch = parse_alertmanager(body, received_at=NOW)
    assert [a.fingerprint for a in batch.firing] == ["a1"]
    assert batch.resolved == ("b1",)
    assert [(i.fingerprint, i.alertname) for i in batch.ignored] == [("c1", "ClusterWide")]
    assert "no node label" in batch.ignored[0].reason


def _broken(path: str, value: Any) -> dict[str, Any]:
    body = payload(alert({"alertname": "A", "node": "n1"}),
                   alert({"alertname": "B", "node": "n2"}, fingerprint="f2"))
    target: Any = body
    keys = path.split(".")
    for key in keys[:-1]:
        target = target[int(key)] if key.isdigit() else target[key]
    if value is _DELETE:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return body


_DELETE = object()


@pytest.mark.parametrize(("path", "value", "field"), [
    ("version", "3", "version"),
    ("version", _DELETE, "version"),
    ("status", "pending", "status"),
    ("alerts", {}, "alerts"),
    ("truncatedAlerts", -1, "truncatedAlerts"),
    ("alerts.1.status", "weird", "alerts[1].status"),
    ("alerts.1.labels", ["a"], "alerts[1].labels"),
    ("alerts.1.labels.gpu", 3, "alerts[1].labels.gpu"),
    ("alerts.1.annotations.summary", None, "alerts[1].annotations.summary"),
    ("alerts.1.startsAt", "yesterday", "alerts[1].startsAt"),
    ("alerts.1.startsAt", "2026-11-30T04:09:56", "alerts[1].startsAt"),
    ("alerts.1.endsAt", 5, "alerts[1].endsAt"),
    ("alerts.1.fingerprint", "", "alerts[1].fingerprint"),
    ("alerts.1.labels.action", "explode", "alerts[1].labels.action"),
    ("alerts.1.labels.confidence", "1.5", "alerts[1].labels.confidence"),
])
def test_bad_payloads_name_the_field(path, value, field):
    with pytest.raises(InboundError) as err:
        parse_alertmanager(_broken(path, value), received_at=NOW)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize("raw", [b"", b"not json", b"\xff\xfe", b"[]", b"null"])
def test_bad_bodies(raw):
    with pytest.raises(InboundError) as err:
        parse_alertmanager_body(raw, received_at=NOW)
    assert err.value.field == "body"


# --------------------------------------------------------------------------- the route


def make_api(callback=None, token: str | None = "s3cret") -> AlertingApi:
    clock = FakeClock(now=NOW)
    store = SilenceStore(clock=clock)
    pipeline = Pipeline(facts={}, notifiers=[], page_notifiers=[], audit_log_path=None,
                        clock=clock, silences=store, cluster_size=10)
    return AlertingApi(pipeline=pipeline, silences=store, token=token,
                       on_alertmanager=callback)


AUTH = {"authorization": "Bearer s3cret"}


def test_route_hands_the_batch_over():
    got: list[InboundBatch] = []
    api = make_api(got.append)
    body = json.dumps(payload(alert({"alertname": "A", "node": "n1"}),
                              alert({"alertname": "Z"}, fingerprint="z"))).encode()
    status, answer = api.handle("POST", "/api/v1/alertmanager", AUTH, body)
    assert status == 200
    assert answer == {"firing": 1, "resolved": 0, "ignored": [
        {"fingerprint": "z", "alertname": "Z",
         "reason": "no node label (node, Hostname, hostname or instance)"}]}
    assert [a.finding.node for a in got[0].firing] == ["n1"]
    assert got[0].received_at == NOW


def test_route_errors_and_nothing_partially_applied():
    got: list[InboundBatch] = []
    api = make_api(got.append)
    good = json.dumps(payload(alert({"alertname": "A", "node": "n1"}))).encode()
    bad = json.dumps(_broken("alerts.1.startsAt", "soon")).encode()
    status, answer = api.handle("POST", "/api/v1/alertmanager", AUTH, bad)
    assert (status, answer) == (400, {"error": "alerts[1].startsAt: not an RFC 3339 time: "
                                               "'soon'"})
    assert api.handle("POST", "/api/v1/alertmanager", {}, good)[0] == 401
    assert api.handle("POST", "/api/v1/alertmanager",
                      {"authorization": "Bearer nope"}, good)[0] == 401
    assert got == []
    assert make_api(None).handle("POST", "/api/v1/alertmanager", AUTH, good)[0] == 404

    def broken(batch: InboundBatch) -> None:
        raise RuntimeError("database locked")

    status, answer = make_api(broken).handle("POST", "/api/v1/alertmanager", AUTH, good)
    assert status == 503
    assert "retry" in answer["error"]


# --------------------------------------------------------------------------- real Alertmanager


AM_CONFIG = """
route:
  receiver: gpuhealth
  group_by: ['node']
  group_wait: 100ms
  group_interval: 500ms
  repeat_interval: 1h
receivers:
  - name: gpuhealth
    webhook_configs:
      - url: '{url}/api/v1/alertmanager'
        send_resolved: true
        http_config:
          authorization:
            type: Bearer
            credentials: s3cret
"""


def test_a_real_alertmanager_drives_the_route():
    """Alertmanager 0.25 posts version-4 payloads, with the bearer token, to the real API."""
    binary = need_binary("prometheus-alertmanager", "alertmanager")
    got: list[InboundBatch] = []
    lock = threading.Lock()

    def take(batch: InboundBatch) -> None:
        with lock:
            got.append(batch)

    server = ApiServer(api=make_api(take), port=0)
    server.start()
    try:
        with tempfile.TemporaryDirectory(prefix="gpuhealth-am-in-") as tmp:
            folder = Path(tmp)
            config = folder / "alertmanager.yml"
            config.write_text(AM_CONFIG.format(url=server.url))
            port = free_port()
            log = folder / "am.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--storage.path={folder / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                     "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT)
            try:
                am = f"http://127.0.0.1:{port}"
                wait_ready(f"{am}/-/ready", proc, log)
                labels = {"alertname": "GpuFellOffBus", "Hostname": "gpu-042",
                          "pci_bus_id": "00000000:B1:00.0", "severity": "critical"}
                gen = ("http://prom:9090/graph?g0.expr="
                       + urllib.parse.quote_plus("DCGM_FI_DEV_XID_ERRORS == 79"))
                post_json(f"{am}/api/v2/alerts", [{"labels": labels, "generatorURL": gen,
                                                   "annotations": {"summary": "Xid 79"}}])

                def firing() -> list[InboundBatch]:
                    with lock:
                        return [b for b in got if b.firing]

                [batch] = eventually(firing, timeout=20)
                f = batch.firing[0].finding
                assert (f.node, f.entity, f.kind, f.code) == ("gpu-042", "0000:b1:00.0",
                                                              "xid", "79")
                assert (f.severity, f.action) == (Severity.CRITICAL, Action.REBOOT_NODE)
                fingerprint = batch.firing[0].fingerprint
                post_json(f"{am}/api/v2/alerts", [{
                    "labels": labels, "generatorURL": gen,
                    "annotations": {"summary": "Xid 79"},
                    "startsAt": "2026-01-01T00:00:00Z", "endsAt": "2026-01-01T00:00:01Z"}])

                def resolved() -> list[str]:
                    with lock:
                        return [fp for b in got for fp in b.resolved]

                assert eventually(resolved, timeout=20) == [fingerprint]
            finally:
                stop(proc)
    finally:
        server.stop()

