"""The alerting HTTP API: silences as Alertmanager's API v2 shapes them, alerts, ingest, auth."""

from __future__ import annotations

import json
import urllib.request

import pytest

from alerting.silences import SilenceStore
from alerting.testing import RecordingNotifier
from core.clock import FakeClock
from gpuhealth.api import AlertingApi, ApiServer, start_api
from gpuhealth.config import load_settings
from gpuhealth.pipeline import Pipeline
from tests.conftest import cases_dir

CASE = "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"
HEALTHY = "027-nvidia-smi-q-clocks-event-reasons-sw-power-cap-active.txt"


@pytest.fixture
def setup():
    clock = FakeClock(now=1_800_000_000.0)
    store = SilenceStore(clock=clock)
    pager = RecordingNotifier(name="pd")
    pipeline = Pipeline(facts={}, notifiers=[], page_notifiers=[pager], audit_log_path=None,
                        clock=clock, silences=store, cluster_size=10)
    return AlertingApi(pipeline=pipeline, silences=store, token="s3cret"), pipeline, pager, clock


AUTH = {"authorization": "Bearer s3cret"}


def test_silence_crud_in_alertmanager_shape(setup):
    api, _, _, _ = setup
    body = {"matchers": [{"name": "node", "value": "gpu-0.*", "isRegex": True}],
            "startsAt": "2027-01-15T08:00:00Z", "endsAt": "2027-01-15T10:00:00Z",
            "createdBy": "alice", "comment": "RMA"}
    status, answer = api.handle("POST", "/api/v2/silences", AUTH, json.dumps(body).encode())
    assert status == 200
    sid = answer["silenceID"]
    status, got = api.handle("GET", f"/api/v2/silence/{sid}", {}, b"")
    assert status == 200
    assert got["matchers"] == [{"name": "node", "value": "gpu-0.*", "isRegex": True,
                                "isEqual": True}]
    assert got["status"]["state"] == "active"
    assert got["endsAt"] == "2027-01-15T10:00:00.000Z"
    status, listed = api.handle("GET", "/api/v2/silences", {}, b"")
    assert [s["id"] for s in listed] == [sid]
    assert api.handle("DELETE", f"/api/v2/silence/{sid}", AUTH, b"")[0] == 200
    assert api.handle("GET", f"/api/v2/silence/{sid}", {}, b"")[1]["status"]["state"] == "expired"
    assert api.handle("DELETE", "/api/v2/silence/nope", AUTH, b"")[0] == 404


@pytest.mark.parametrize(("body", "status"), [
    (b"not json", 400),
    (b'{"matchers": [], "endsAt": "2027-01-15T10:00:00Z", "createdBy": "a", "comment": "b"}', 400),
    (b'{"matchers": [{"name": "node", "value": "a"}], "createdBy": "a", "comment": "b"}', 400),
    (b'{"matchers": [{"name": "node", "value": "a"}], "endsAt": "soon", "createdBy": "a"}', 400),
    (b'{"id": "x", "matchers": [{"name": "node", "value": "a"}], "endsAt": '
     b'"2027-01-15T10:00:00Z", "createdBy": "a", "comment": "b"}', 404),
])
def test_bad_silences(setup, body, status):
    api = setup[0]
    assert api.handle("POST", "/api/v2/silences", AUTH, body)[0] == status


def test_changes_need_the_token(setup):
    api = setup[0]
    assert api.handle("POST", "/api/v2/silences", {}, b"{}")[0] == 401
    assert api.handle("POST", "/api/v2/silences", {"authorization": "Bearer no"}, b"{}")[0] == 401
    assert api.handle("DELETE", "/api/v2/silence/x", {}, b"")[0] == 401
    assert api.handle("PUT", "/api/v2/silences", AUTH, b"")[0] == 405
    assert api.handle("GET", "/nope", {}, b"")[0] == 404
    assert "s3cret" not in repr(api)


def test_ingest_pages_then_a_healthy_snapshot_resolves(setup):
    api, pipeline, pager, clock = setup
    text = (cases_dir() / CASE).read_bytes()
    status, answer = api.handle("POST", f"/api/v1/ingest?node=n1&file={CASE}", AUTH, text)
    assert status == 200
    assert answer["records"] > 0
    assert answer["healthy"] is False
    pipeline.evaluate()
    assert [p.labels["severity"] for p in pager.sent] == ["critical"]
    status, alerts = api.handle("GET", "/api/v1/alerts", {}, b"")
    assert {a["labels"]["alertname"] for a in alerts} >= {"GpuXid79"}
    assert api.handle("GET", "/api/v1/pages", {}, b"")[1][0]["labels"]["node"] == "n1"
    healthy = (cases_dir() / HEALTHY).read_bytes()
    answer = api.handle("POST", "/api/v1/ingest?node=n1", AUTH, healthy)[1]
    assert answer["healthy"] is True
    clock.advance(5)
    pipeline.evaluate()
    assert [p.state.value for p in pager.sent] == ["firing", "resolved"]
    assert api.handle("GET", "/api/v1/pages", {}, b"")[1] == []
    assert api.handle("GET", "/api/v1/outbox", {}, b"")[1] == {"depths": {}, "dropped": {}}


def test_ingest_context_sets_node_facts(setup):
    api, pipeline, _pager, _ = setup
    name = "010-dcgmi-diag-r2-pcie-fail-nvlink-down-on-non-nvlink-system.txt"
    text = (cases_dir() / name).read_bytes()
    query = "/api/v1/ingest?node=n10&context=nvlink=absent"
    assert api.handle("POST", query, AUTH, text)[0] == 200
    out = pipeline.evaluate()
    assert all(f.severity.value == "info" for f in out.findings)
    assert api.handle("POST", "/api/v1/ingest?context=x", AUTH, b"")[0] == 400
    assert api.handle("POST", "/api/v1/ingest?node=a&context=x", AUTH, b"")[0] == 400


def test_served_over_http(tmp_path):
    path = tmp_path / "g.toml"
    path.write_text(f'[node]\nname = "n"\ndata_dir = "{tmp_path}"\n[alerting]\napi_port = 0\n')
    settings = load_settings(str(path), {})
    pipeline = Pipeline(facts={}, notifiers=[], audit_log_path=None,
                        silences=SilenceStore(path=tmp_path / "silences.json"))
    server = start_api(settings, pipeline)
    assert isinstance(server, ApiServer)
    try:
        with urllib.request.urlopen(f"{server.url}/-/ready", timeout=5) as response:
            assert json.loads(response.read()) == {"status": "ready"}
        request = urllib.request.Request(
            f"{server.url}/api/v2/silences", method="POST",
            data=json.dumps({"matchers": [{"name": "node", "value": "n"}],
                             "endsAt": "2099-01-01T00:00:00Z", "createdBy": "a",
                             "comment": "b"}).encode())
        with urllib.request.urlopen(request, timeout=5) as response:
            sid = json.loads(response.read())["silenceID"]
        # the CLI's view of the same file sees it
        assert SilenceStore(path=tmp_path / "silences.json").get(sid) is not None
    finally:
        server.stop()


def test_beyond_loopback_needs_a_token(tmp_path):
    from core.errors import ConfigError

    path = tmp_path / "g.toml"
    path.write_text('[alerting]\napi_listen_address = "0.0.0.0"\n')
    with pytest.raises(ConfigError, match="api_token_env"):
        load_settings(str(path), {})


@pytest.mark.parametrize(("body", "reason"), [
    (bytes(range(256)) * 16, "binary"),
    (b"&O\x83$%j\nx\x82\xeb\xc0\x7f\xdb\xe7\x85\xf6\xba\x0cd\x1c\xb1\xd0\xbcL" * 8, "binary"),
    (b"", "empty"),
    (b"cpu,host=a usage=0.5 1700000000000000000\nmem,host=a used=3i 1700000000000000000\n",
     "line protocol"),
    # a recorded Xid event: the kernel-log parser would see "Xid 48" and find nothing
    (b'gpuhealth_event,code=48,entity=00000000:18:00.0,kind=xid,node=node-0000,'
     b'source=synthetic count=1.0,message="Xid 48: double-bit ECC error",attrs="{}",'
     b'evidence="[]" 1767226800000000000\n', "line protocol"),
])
def test_ingest_refuses_what_diagnose_refuses(setup, caplog, body, reason):
    api, pipeline, _pager, _ = setup
    caplog.set_level("INFO")
    query = "/api/v1/ingest?node=n1&file=bin.log&context=nvlink=absent"
    status, answer = api.handle("POST", query, AUTH, body)
    assert status == 400
    assert answer["records"] == 0
    assert [e["file"] for e in answer["errors"]] == ["bin.log"]
    assert reason in answer["errors"][0]["reason"]
    assert reason in answer["error"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert logged.isascii()  # a short repr, never the raw bytes
    assert len(logged) < 1000
    assert "n1" not in pipeline._node_facts  # a refused body changes nothing


def test_ingest_keeps_nul_padded_text_as_diagnose_does(setup):
    api = setup[0]
    text = (cases_dir() / CASE).read_bytes()
    status, answer = api.handle("POST", "/api/v1/ingest?node=n1", AUTH,
                                b"\x00" * 300 + b"\n" + text)
    assert status == 200
    assert answer["records"] > 0
    assert any("NUL" in e["reason"] for e in answer["errors"])
