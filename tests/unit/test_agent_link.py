"""The agent's outbox and the controller's agents' API, end to end on loopback.

The controller is the real :class:`gpuhealth.controller.Controller` (aiohttp) on a free
port with a SQLite state store; the agent side is the real outbox and sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core.records import Action, Evidence, Finding, Severity
from gpuhealth.config import load_settings
from gpuhealth.controller import Controller
from storage.agent_outbox import AgentOutbox, FindingForwarder, OutboxSender
from tests.servers import eventually, free_port

TOKENS = "gpu-01 tok-one-0123456789abcdef\ngpu-02 tok-two-0123456789abcdef\n"


def _finding(node: str = "gpu-02", occurrences: int = 1) -> Finding:
    return Finding(node=node, entity="0000:b1:00.0", kind="xid", code="79",  # type: ignore[arg-type]
                   severity=Severity.CRITICAL, action=Action.REBOOT_NODE,
                   summary="Xid 79: GPU has fallen off the bus",
                   evidence=(Evidence(file="/var/log/kern.log", line=7,
                                      text="NVRM: Xid (PCI:0000:b1:00): 79, pid=1234"),),
                   source="xid.gpu_driver_rule", occurrences=occurrences,
                   first_seen_at=100.0, last_seen_at=100.0 + occurrences)


@contextlib.contextmanager
def running_controller(tmp_path: Path, extra: str = "") -> Iterator[Controller]:
    """A real controller (SQLite state) serving on a free loopback port in a thread."""
    (tmp_path / "tokens").write_text(TOKENS)
    config = tmp_path / "ctl.toml"
    config.write_text(f"""
[node]
name = "ctl-a"
data_dir = "{tmp_path / 'ctl'}"
[report]
enabled = false
[analytics]
evaluate_interval_seconds = 0.2
[controller]
port = {free_port()}
agent_tokens_file = "{tmp_path / 'tokens'}"
{extra}""")
    settings = load_settings(config, env={})
    settings.node.data_dir.mkdir(parents=True)
    ctl = Controller(settings)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(ctl.serve(stop),))
    thread.start()
    try:
        assert ctl.ready.wait(10)
        yield ctl
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(15)
        loop.close()


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Controller]:
    with running_controller(tmp_path) as ctl:
        yield ctl


def _url(ctl: Controller) -> str:
    return f"http://127.0.0.1:{ctl.port}"


def test_outbox_survives_a_restart_and_drops_the_oldest_beyond_its_bound(tmp_path: Path) -> None:
    box = AgentOutbox(tmp_path / "o.sqlite", node="gpu-02", max_records=3)
    keys = [box.put("finding", {"n": i}, at=float(i)) for i in range(5)]
    box.close()
    again = AgentOutbox(tmp_path / "o.sqlite", node="gpu-02", max_records=3)
    kept = again.peek(10)
    assert [r.key for r in kept] == keys[2:]  # the newest three, in order
    assert box.dropped == 2
    again.ack([kept[0].id])
    assert [r.body["n"] for r in again.peek(10)] == [3, 4]
    again.close()


def test_forwarder_sends_new_and_changed_findings_and_their_clearing() -> None:
    box = AgentOutbox(None, node="gpu-02")
    fwd = FindingForwarder(box, node="gpu-02")
    assert fwd.observe([_finding()], now=1.0) == 1
    assert fwd.observe([_finding()], now=2.0) == 0  # unchanged: nothing again
    assert fwd.observe([_finding(occurrences=2)], now=3.0) == 1
    assert fwd.observe([_finding(node="gpu-09")], now=4.0) == 1  # only the clearing
    kinds = [r.kind for r in box.peek(10)]
    assert kinds == ["finding", "finding", "finding_cleared"]


def test_a_finding_reaches_the_controller_once_though_sent_twice(
        controller: Controller) -> None:
    box = AgentOutbox(None, node="gpu-02")
    FindingForwarder(box, node="gpu-02").observe([_finding()], now=time.time())
    sender = OutboxSender(box, controllers=["http://127.0.0.1:9", _url(controller)],
                          token="tok-two-0123456789abcdef", version="test")
    pending = box.peek(10)
    result = sender.send_once()  # the first replica is down: the second takes it
    assert (result.sent, result.duplicates, result.controller) == (1, 0, _url(controller))
    box.ack([])
    for r in pending:  # the answer was "lost": the same records again
        box._db.execute("INSERT INTO outbox (key, kind, at, body) VALUES (?,?,?,?)",
                        (r.key, r.kind, r.at, '{"node": "gpu-02", "entity": "x", '
                         '"kind": "xid", "code": "79", "severity": "critical", '
                         '"action": "reboot_node"}'))
    assert sender.send_once().duplicates == 1
    alerts = eventually(lambda: httpx.get(f"{_url(controller)}/api/v1/alerts").json())
    assert [a["labels"]["alertname"] for a in alerts] == ["GpuXid79"]
    assert "NVRM: Xid (PCI:0000:b1:00): 79" in alerts[0]["annotations"]["evidence"]
    assert alerts[0]["annotations"]["occurrences"] == "1"  # counted once
    agents = httpx.get(f"{_url(controller)}/api/v1/agents").json()
    assert [(a["node"], a["silent"]) for a in agents] == [("gpu-02", False)]
    sender.close()


@pytest.mark.parametrize(("token", "node", "body_node", "status"), [
    ("", "gpu-02", "gpu-02", 401),
    ("wrong-token", "gpu-02", "gpu-02", 401),
    ("tok-one-0123456789abcdef", "gpu-02", "gpu-02", 403),  # gpu-01's token
    ("tok-two-0123456789abcdef", "gpu-02", "gpu-01", 403),  # a finding about another node
    ("tok-two-0123456789abcdef", "gpu-02", "gpu-02", 200),
])
def test_agents_are_authenticated_and_report_only_for_themselves(
        controller: Controller, token: str, node: str, body_node: str, status: int) -> None:
    finding = {"node": body_node, "entity": "node", "kind": "xid", "code": "79",
               "severity": "critical", "action": "reboot_node", "summary": "s",
               "evidence": [], "source": "t"}
    batch = {"node": node, "records": [{"key": f"{node}:abc", "kind": "finding",
                                        "at": time.time(),
                                        "body": finding}]}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    answer = httpx.post(f"{_url(controller)}/api/v1/agents/{node}/batch", json=batch,
                        headers=headers)
    assert answer.status_code == status, answer.text
    stored = controller.store.read_after(0)
    assert len(stored) == (1 if status == 200 else 0)


@pytest.mark.parametrize(("batch", "names"), [
    ({"node": "gpu-02", "records": {}}, "records"),
    ({"node": "gpu-02", "records": [{"key": "gpu-01:x", "kind": "finding", "at": 1,
                                     "body": {}}]}, "records[0].key"),
    ({"node": "gpu-02", "records": [{"key": "gpu-02:x", "kind": "nonsense", "at": 1,
                                     "body": {}}]}, "records[0].kind"),
    ({"node": "gpu-02", "records": [{"key": "gpu-02:x", "kind": "finding", "at": 1.8e9,
                                     "body": {"node": "gpu-02", "severity": "bad"}}]},
     "records[0].body"),
])
def test_a_malformed_batch_is_400_naming_the_key(controller: Controller, batch: dict,
                                                 names: str) -> None:
    answer = httpx.post(f"{_url(controller)}/api/v1/agents/gpu-02/batch", json=batch,
                        headers={"Authorization": "Bearer tok-two-0123456789abcdef"})
    assert answer.status_code == 400
    assert names in answer.json()["error"]
    assert controller.store.read_after(0) == []


def test_controller_metrics_are_served(controller: Controller) -> None:
    text = httpx.get(f"{_url(controller)}/metrics").text
    assert "gpuhealth_remediation_leader 1.0" in text


def test_nodes_under_one_switch_open_the_breaker_instead_of_n_drains(
        controller: Controller) -> None:
    tokens = dict(line.split() for line in TOKENS.splitlines())
    controller.tokens.path.write_text(TOKENS + "gpu-03 tok-three-0123456789abcdef\n")
    tokens["gpu-03"] = "tok-three-0123456789abcdef"
    for node in ("gpu-01", "gpu-02", "gpu-03"):
        box = AgentOutbox(None, node=node)
        FindingForwarder(box, node=node).observe([_finding(node)], now=time.time())
        sender = OutboxSender(box, controllers=[_url(controller)], token=tokens[node],
                              version="test", facts={"switch": "leaf-7"})
        assert sender.send_once().sent == 1
        sender.close()
    alerts = eventually(lambda: [a for a in httpx.get(f"{_url(controller)}/api/v1/alerts")
                                 .json() if a["labels"]["node"] == "fleet"])
    assert alerts[0]["labels"]["entity"] == "switch:leaf-7"
    assert "3 nodes under switch leaf-7" in alerts[0]["annotations"]["summary"]
    assert eventually(lambda: controller.pipeline.engine.breaker_open)


def test_the_controller_serves_agents_over_tls(tmp_path: Path) -> None:
    """A self-signed certificate (openssl); the agent verifies it with [agent] ca_file."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    tls = f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\n'
    with running_controller(tmp_path, tls) as ctl:
        box = AgentOutbox(None, node="gpu-02")
        FindingForwarder(box, node="gpu-02").observe([_finding()], now=time.time())
        url = f"https://127.0.0.1:{ctl.port}"
        sender = OutboxSender(box, controllers=[url], token="tok-two-0123456789abcdef",
                              version="test", verify=str(cert))
        assert sender.send_once().sent == 1
        sender.close()
        untrusting = OutboxSender(box, controllers=[url], token="tok-two-0123456789abcdef",
                                  version="test")  # the system CAs do not know it
        result = untrusting.send_once()
        assert result.controller is None
        assert "SSL" in result.error or "certificate" in result.error.lower()
        untrusting.close()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{ctl.port}/-/ready", timeout=2)  # no plain HTTP


def test_the_controller_serves_silences_and_actions(controller: Controller) -> None:
    silence = {"matchers": [{"name": "node", "value": "gpu-02", "isRegex": False}],
               "startsAt": "2026-01-01T00:00:00Z", "endsAt": "2099-01-01T00:00:00Z",
               "createdBy": "alice", "comment": "rack maintenance"}
    made = httpx.post(f"{_url(controller)}/api/v2/silences", json=silence)
    assert made.status_code == 200, made.text
    listed = httpx.get(f"{_url(controller)}/api/v2/silences").json()
    assert [s["id"] for s in listed] == [made.json()["silenceID"]]
    assert httpx.get(f"{_url(controller)}/api/v2/silence/nope").status_code == 404
    assert httpx.get(f"{_url(controller)}/api/v1/actions").json() == []
    assert httpx.get(f"{_url(controller)}/api/v1/actions?limit=x").status_code == 400
    assert httpx.get(f"{_url(controller)}/api/v1/pages").json() == []


def test_a_record_refused_for_its_content_is_set_aside_alone() -> None:
    """The controller answers 422 for a batch holding a record its store refuses.

    A local transport answers as the controller documents (200 with accepted/duplicates,
    422 naming the refusal); the agent isolates the record and delivers the others.
    """
    seen: list[list[str]] = []

    def controller(request: httpx.Request) -> httpx.Response:
        keys = [r["key"] for r in json.loads(request.content)["records"]]
        seen.append(keys)
        bad = [k for k in keys if k.endswith(":bad")]
        if bad:
            return httpx.Response(422, json={"error": "the state store refused the batch"})
        return httpx.Response(200, json={"accepted": len(keys), "duplicates": 0})

    box = AgentOutbox(None, node="gpu-02")
    for n in range(3):
        box.put("inventory", {"n": n}, at=1.0)
    box._db.execute("UPDATE outbox SET key = 'gpu-02:bad' WHERE id = 2")
    keys = [r.key for r in box.peek(10)]
    sender = OutboxSender(box, controllers=["http://ctl"], token="t", version="test",
                          transport=httpx.MockTransport(controller))
    for _ in range(6):
        sender.send_once()
    assert len(box) == 0
    assert sender.refused_total == 1
    assert sender.up is True  # the controller answered: it is not down
    assert len(seen[0]) == 3  # the whole batch first, refused; then one record at a time
    assert seen[1:4] == [[k] for k in keys]  # each delivered or set aside on its own
    assert seen[4:] == [[], []]  # then only heartbeats


def test_each_replica_tried_gets_the_time_its_try_left() -> None:
    """``sent_at`` is stamped again for each replica tried: a first replica that held the
    request for a whole timeout must not show as the agent's clock skew on the second.
    A local transport stands in for both replicas (the first times out, as httpx raises)."""
    clock = [1000.0]
    stamps: dict[str, float] = {}

    def replicas(request: httpx.Request) -> httpx.Response:
        stamps[request.url.host] = json.loads(request.content)["sent_at"]
        if request.url.host == "ctl-a":
            clock[0] += 10.0  # the timeout spent on the first replica
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json={"accepted": 1, "duplicates": 0})

    box = AgentOutbox(None, node="gpu-02")
    box.put("inventory", {"n": 1}, at=1.0)
    sender = OutboxSender(box, controllers=["http://ctl-a", "http://ctl-b"], token="t",
                          version="test", clock=lambda: clock[0],
                          transport=httpx.MockTransport(replicas))
    sender.send_once()
    assert len(box) == 0
    assert stamps == {"ctl-a": 1000.0, "ctl-b": 1010.0}


def test_parse_batch_refuses_malformed_batches_with_400() -> None:
    from storage.fleet import BatchError, parse_batch, without_nul

    good = {"key": "gpu-02:a", "kind": "inventory", "at": time.time(), "body": {}}
    cases = [
        ({}, "node"),
        ({"node": "gpu-02", "records": [{**good, "at": float("nan")}]}, "records[0].at"),
        ({"node": "gpu-02", "records": [{**good, "at": 1e300}]}, "records[0].at"),
        ({"node": "gpu-02", "heartbeat": {"gpus": [{"x": "y" * 2000}]}}, "heartbeat.gpus"),
        ({"node": "gpu-02", "heartbeat": {"facts": {str(i): "v" for i in range(100)}}},
         "heartbeat.facts"),
    ]
    for batch, key in cases:
        with pytest.raises(BatchError, match=re.escape(key)) as caught:
            parse_batch("gpu-02", batch)
        assert caught.value.status == 400
    assert without_nul({"t": ["a\x00b"]}) == {"t": ["a\ufffdb"]}


def test_a_nul_padded_line_and_deep_nesting_do_not_block_the_agent(
        controller: Controller) -> None:
    body = {"node": "gpu-02", "entity": "node", "kind": "xid", "code": "79",
            "severity": "critical", "action": "reboot_node", "summary": "s\x00\x00",
            "evidence": [{"file": "kern.log", "line": 1, "text": "NVRM: Xid 79\x00"}],
            "source": "t"}
    batch = {"node": "gpu-02", "records": [{"key": "gpu-02:nul", "kind": "finding",
                                            "at": time.time(), "body": body}]}
    headers = {"Authorization": "Bearer tok-two-0123456789abcdef"}
    url = f"{_url(controller)}/api/v1/agents/gpu-02/batch"
    assert httpx.post(url, json=batch, headers=headers).status_code == 200
    (stored,) = controller.store.read_after(0)
    assert stored.body["evidence"][0]["text"] == "NVRM: Xid 79\ufffd"
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    answer = httpx.post(url, content=deep, headers={**headers,
                                                    "Content-Type": "application/json"})
    assert answer.status_code == 400


def test_config_check_knows_what_each_role_needs(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gpuhealth.cli import main

    bare = tmp_path / "bare.toml"
    bare.write_text(f'[node]\ndata_dir = "{tmp_path}"\n')
    runner = CliRunner()
    assert runner.invoke(main, ["config", "check", str(bare)]).exit_code == 0
    agent = runner.invoke(main, ["config", "check", "--role", "agent", str(bare)])
    assert agent.exit_code == 1
    assert "[agent] controllers" in agent.output
    ctl = runner.invoke(main, ["config", "check", "--role", "controller", str(bare)])
    assert ctl.exit_code == 1
    assert "[controller] agent_tokens_file" in ctl.output
    broken = tmp_path / "broken.toml"
    broken.write_text(f'[controller]\nagent_tokens_file = "{tmp_path / "tokens"}"\n')
    (tmp_path / "tokens").write_text("gpu-01 tok # a comment\ngpu-02\n")
    out = runner.invoke(main, ["config", "check", "--role", "controller", str(broken)])
    assert out.exit_code == 1
    assert "tokens:2: expected 'node token'" in out.output


def test_agent_tokens_are_checked_at_most_once_within_the_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuhealth import tokens as tokens_module
    from gpuhealth.tokens import AgentTokens

    now = [100.0]
    monkeypatch.setattr(tokens_module.time, "monotonic", lambda: now[0])
    path = tmp_path / "tokens"
    path.write_text("gpu-01 tok-one-0123456789abcdef\n")
    tokens = AgentTokens(path)
    path.write_text("gpu-01 tok-one-0123456789abcdef\ngpu-02 tok-two-0123456789abcdef\n")
    now[0] += 0.1
    tokens.reload(unless_checked_within=0.25)  # checked 0.1 s ago: the file is not read
    assert tokens.check("gpu-02", "tok-two-0123456789abcdef") == 401
    now[0] += 0.2
    tokens.reload(unless_checked_within=0.25)
    assert tokens.check("gpu-02", "tok-two-0123456789abcdef") == 200
    path.write_text("gpu-01 tok-new-0123456789abcdef\n")
    tokens.reload()  # no interval: a refused batch re-reads at once
    assert tokens.check("gpu-01", "tok-new-0123456789abcdef") == 200
    assert tokens.check("gpu-02", "tok-two-0123456789abcdef") == 401
