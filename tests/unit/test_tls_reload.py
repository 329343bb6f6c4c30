"""Rotating the controller's TLS certificate and an agent's token while an agent keeps sending.

The controller is the real :class:`gpuhealth.controller.Controller` (aiohttp, SQLite
state) on a free loopback port; the agent is the real outbox and sender
(:class:`tests.rotation_helpers.KeepSending`). Secrets are rotated as Kubernetes does for
a mounted Secret (:class:`~tests.rotation_helpers.SecretVolume`: a new ``..<timestamp>``
folder and an atomic rename of the ``..data`` symlink) and as an operator does by hand
(each file rewritten in place, one after the other). Certificates are made with
``openssl``.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest

from core.errors import ConfigError
from gpuhealth._serving import ReloadingTLS
from gpuhealth.controller import Controller
from gpuhealth.tokens import TokenFile
from storage.agent_outbox import AgentOutbox, OutboxSender
from tests.rotation_helpers import KeepSending, SecretVolume, running_controller
from tests.servers import eventually

OLD, NEW = "tok-two-old-0123456789abcdef", "tok-two-new-0123456789abcdef"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """Three self-signed pairs for 127.0.0.1 (``a`` and ``b`` RSA, ``c`` EC) and a bundle."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    folder = tmp_path_factory.mktemp("certs")
    out: dict[str, dict[str, bytes]] = {}
    for name, key in (("a", ["-newkey", "rsa:2048"]), ("b", ["-newkey", "rsa:2048"]),
                      ("c", ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"])):
        crt, pem = folder / f"{name}.crt", folder / f"{name}.key"
        subprocess.run(["openssl", "req", "-x509", *key, "-nodes", "-days", "2",
                        "-keyout", str(pem), "-out", str(crt), "-subj", f"/CN=ctl-{name}",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                       capture_output=True)
        out[name] = {"tls.crt": crt.read_bytes(), "tls.key": pem.read_bytes()}
    bundle = folder / "bundle.pem"
    bundle.write_bytes(b"".join(out[n]["tls.crt"] for n in ("a", "b", "c")))
    out["bundle"] = {"path": str(bundle).encode()}
    return out


def _fingerprint(pem: bytes) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.decode())).hexdigest()


def _client_context(bundle: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=bundle)


def _served(port: int, bundle: str) -> str:
    """The certificate a new TLS handshake gets (SHA-256 of its DER), verified."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            _client_context(bundle).wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return hashlib.sha256(der).hexdigest()


def _tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"gpu-01 tok-one-0123456789abcdef\ngpu-02 {OLD}\n")
    return path


def _stored_keys(ctl: Controller, node: str) -> list[str]:
    return [r.key for r in ctl.store.read_after(0, limit=1_000_000)
            if r.node == node and r.kind == "inventory"]


def _assert_nothing_lost(ctl: Controller, agent: KeepSending) -> None:
    stored = _stored_keys(ctl, agent.outbox.node)
    assert len(stored) == len(set(stored))
    assert set(stored) == set(agent.keys)
    assert len(agent.keys) >= 8


def _tls_config(cert: Path, key: Path) -> str:
    return f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\n'


def test_a_swapped_secret_serves_the_new_certificate_without_dropping_connections(
        tmp_path: Path, certs: dict[str, dict[str, bytes]],
        caplog: pytest.LogCaptureFixture) -> None:
    """Kubernetes' ``..data`` swap: new handshakes get the new pair, open connections stay."""
    caplog.set_level(logging.INFO, logger="gpuhealth._serving")
    bundle = certs["bundle"]["path"].decode()
    volume = SecretVolume(tmp_path / "tls", certs["a"])
    config = _tls_config(volume.root / "tls.crt", volume.root / "tls.key")
    with running_controller(tmp_path, _tokens(tmp_path), config) as ctl:
        assert ctl.port is not None
        assert ctl.tls is not None
        url = f"https://127.0.0.1:{ctl.port}"
        agent = KeepSending(url, "gpu-02", OLD, verify=bundle).start()
        open_conn = http.client.HTTPSConnection("127.0.0.1", ctl.port,
                                                context=_client_context(bundle), timeout=5)
        open_conn.request("GET", "/-/ready")
        assert open_conn.getresponse().read()
        sock = open_conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        first = sock.getpeercert(binary_form=True)
        assert first is not None
        assert hashlib.sha256(first).hexdigest() == _fingerprint(
            certs["a"]["tls.crt"])
        assert _served(ctl.port, bundle) == _fingerprint(certs["a"]["tls.crt"])
        eventually(lambda: agent.taken_since(0) >= 3, timeout=10)

        swapped_at = time.monotonic()
        volume.write(certs["b"])
        eventually(lambda: _served(ctl.port, bundle) == _fingerprint(certs["b"]["tls.crt"]),
                   timeout=10)
        assert ctl.tls.reloads == 1
        assert ctl.tls.problem == ""
        assert ctl.tls.fingerprint == _fingerprint(certs["b"]["tls.crt"])
        # the connection opened before the swap is the same one and still answers
        open_conn.request("GET", "/-/ready")
        response = open_conn.getresponse()
        assert response.status == 200
        assert response.read()
        assert open_conn.sock is sock
        # a new agent connection handshakes with the new certificate and is taken
        fresh = OutboxSender(AgentOutbox(None, node="gpu-02"), controllers=[url], token=OLD,
                             version="test", verify=bundle)
        assert fresh.send_once().controller == url
        fresh.close()
        eventually(lambda: agent.taken_since(swapped_at) >= 5, timeout=10)
        agent.finish()
        open_conn.close()
        _assert_nothing_lost(ctl, agent)
        assert set(agent.statuses) == {200}
        assert not agent.errors
    assert any("TLS certificate re-read" in r.getMessage() for r in caplog.records)


def test_a_pair_rewritten_in_place_is_taken_whole_and_a_bad_one_refused(
        tmp_path: Path, certs: dict[str, dict[str, bytes]],
        caplog: pytest.LogCaptureFixture) -> None:
    """The certificate rewritten before its key: refused (naming the key) until both match."""
    bundle = certs["bundle"]["path"].decode()
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(certs["a"]["tls.crt"])
    key.write_bytes(certs["a"]["tls.key"])
    with running_controller(tmp_path, _tokens(tmp_path), _tls_config(cert, key)) as ctl:
        assert ctl.port is not None
        assert ctl.tls is not None
        tls = ctl.tls
        agent = KeepSending(f"https://127.0.0.1:{ctl.port}", "gpu-02", OLD,
                            verify=bundle).start()
        a, c = _fingerprint(certs["a"]["tls.crt"]), _fingerprint(certs["c"]["tls.crt"])

        def still_sending() -> None:  # the agent's batches are taken at every step
            since = time.monotonic()
            eventually(lambda: agent.taken_since(since) >= 2, timeout=10)

        cert.write_bytes(certs["c"]["tls.crt"])  # an EC certificate, the RSA key still
        eventually(lambda: "is not the key of" in tls.problem, timeout=10)
        assert str(key) in tls.problem
        assert str(cert) in tls.problem
        assert _served(ctl.port, bundle) == a  # the pair in use stays
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any(f"tls_key_file {key} is not the key of" in m and "stays" in m
                   for m in errors), errors
        still_sending()

        key.write_bytes(certs["c"]["tls.key"])
        eventually(lambda: _served(ctl.port, bundle) == c, timeout=10)
        assert tls.problem == ""
        still_sending()

        half = certs["b"]["tls.crt"][: len(certs["b"]["tls.crt"]) // 2]
        cert.write_bytes(half)  # a copy cut short
        eventually(lambda: "not a complete PEM certificate" in tls.problem, timeout=10)
        assert f"tls_cert_file {cert}" in tls.problem
        assert _served(ctl.port, bundle) == c
        still_sending()

        key.unlink()  # a file gone for a moment
        eventually(lambda: f"tls_key_file {key}: no such file" in tls.problem, timeout=10)
        assert _served(ctl.port, bundle) == c
        still_sending()

        key.write_bytes(certs["b"]["tls.key"])
        cert.write_bytes(certs["b"]["tls.crt"])
        eventually(lambda: _served(ctl.port, bundle) == _fingerprint(certs["b"]["tls.crt"]),
                   timeout=10)
        still_sending()
        agent.finish()
        _assert_nothing_lost(ctl, agent)
        assert set(agent.statuses) == {200}
        assert not agent.errors


def test_a_pair_that_does_not_load_at_start_names_the_file(
        tmp_path: Path, certs: dict[str, dict[str, bytes]]) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(certs["a"]["tls.crt"])
    key.write_bytes(certs["b"]["tls.key"])
    with pytest.raises(ConfigError, match=f"tls_key_file {key} is not the key of "
                                          f"tls_cert_file {cert}"):
        ReloadingTLS(cert, key)
    with pytest.raises(ConfigError, match=f"tls_cert_file {tmp_path / 'nope.crt'}: no such"):
        ReloadingTLS(tmp_path / "nope.crt", key)
    key.write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n")
    with pytest.raises(ConfigError, match=f"tls_key_file {key}: not a complete PEM"):
        ReloadingTLS(cert, key)
    tls = ReloadingTLS(cert, _write(tmp_path / "a.key", certs["a"]["tls.key"]))
    assert tls.reload() is False  # nothing changed
    assert tls.fingerprint == _fingerprint(certs["a"]["tls.crt"])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_an_agent_token_rotated_while_the_agent_keeps_sending_loses_nothing(
        tmp_path: Path) -> None:
    """Both Secrets rotated (the controller's list first): refused meanwhile, queued, resent."""
    controller_secret = SecretVolume(tmp_path / "ctl-secret", {
        "tokens": f"gpu-01 tok-one-0123456789abcdef\ngpu-02 {OLD}\n".encode()})
    agent_secret = SecretVolume(tmp_path / "agent-secret", {"token": f"{OLD}\n".encode()})
    with running_controller(tmp_path, controller_secret.root / "tokens") as ctl:
        url = f"http://127.0.0.1:{ctl.port}"
        agent = KeepSending(url, "gpu-02", TokenFile(agent_secret.root / "token")).start()
        eventually(lambda: agent.taken_since(0) >= 3, timeout=10)

        controller_secret.write({
            "tokens": f"gpu-01 tok-one-0123456789abcdef\ngpu-02 {NEW}\n".encode()})
        eventually(lambda: agent.statuses[401] >= 3, timeout=10)  # the agent's is old yet
        rotated_at = time.monotonic()
        agent_secret.write({"token": f"{NEW}\n".encode()})
        eventually(lambda: agent.taken_since(rotated_at) >= 5, timeout=10)

        old = OutboxSender(AgentOutbox(None, node="gpu-02"), controllers=[url], token=OLD,
                           version="test")
        assert old.send_once().statuses == {url: 401}
        old.close()
        agent.finish()
        _assert_nothing_lost(ctl, agent)
        assert set(agent.statuses) == {200, 401}
        assert not agent.errors


def test_a_token_file_keeps_its_token_through_a_bad_edit(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"{OLD}\n")
    token = TokenFile(path)
    assert token() == OLD
    path.write_text("")  # half-written
    assert token() == OLD
    path.unlink()
    assert token() == OLD
    path.write_text(f"{NEW}\n# a comment line\n")
    assert token() == NEW
    path.write_text("")
    with pytest.raises(ConfigError, match="token_file"):
        TokenFile(path)


def test_a_rollover_with_two_tokens_refuses_no_batch(tmp_path: Path) -> None:
    """``node token next`` while the agents' Secret changes: taken before, during and after."""
    others = "gpu-01 tok-one-0123456789abcdef\n"
    controller_secret = SecretVolume(tmp_path / "ctl-secret",
                                     {"tokens": f"{others}gpu-02 {OLD}\n".encode()})
    agent_secret = SecretVolume(tmp_path / "agent-secret", {"token": f"{OLD}\n".encode()})
    with running_controller(tmp_path, controller_secret.root / "tokens") as ctl:
        url = f"http://127.0.0.1:{ctl.port}"
        agent = KeepSending(url, "gpu-02", TokenFile(agent_secret.root / "token")).start()
        eventually(lambda: agent.taken_since(0) >= 3, timeout=10)
        for step in ({"tokens": f"{others}gpu-02 {OLD} {NEW}  # rotating\n".encode()},
                     {"token": f"{NEW}\n".encode()},
                     {"tokens": f"{others}gpu-02 {NEW}\n".encode()}):
            (agent_secret if "token" in step else controller_secret).write(step)
            since = time.monotonic()
            eventually(lambda since=since: agent.taken_since(since) >= 3, timeout=10)
            time.sleep(0.3)  # past the controller's next look at its file

        for token, status in ((OLD, 401), (NEW, 200)):
            sender = OutboxSender(AgentOutbox(None, node="gpu-02"), controllers=[url],
                                  token=token, version="test")
            assert sender.send_once().statuses == {url: status}
            sender.close()
        other = OutboxSender(AgentOutbox(None, node="gpu-01"), controllers=[url], token=NEW,
                             version="test")
        assert other.send_once().statuses == {url: 403}  # another node's token
        other.close()
        agent.finish()
        _assert_nothing_lost(ctl, agent)
        assert set(agent.statuses) == {200}
        assert not agent.errors


def test_a_tokens_line_has_one_token_or_two(tmp_path: Path) -> None:
    from gpuhealth.tokens import token_file_problems

    path = tmp_path / "tokens"
    path.write_text("gpu-01 a b c\n")
    assert token_file_problems(path) == [
        f"{path}:1: expected 'node token' (or 'node token next' during a rotation), got 4 "
        "words"]
    path.write_text('{"gpu-01": ["a", "b", "c"]}')
    assert "[token, next]" in token_file_problems(path)[0]
    path.write_text('{"gpu-01": ["a", "b"], "gpu-02": "c"}')
    assert token_file_problems(path) == []


def test_a_controller_whose_pair_does_not_load_does_not_start(
        tmp_path: Path, certs: dict[str, dict[str, bytes]],
        caplog: pytest.LogCaptureFixture) -> None:
    from gpuhealth.config import load_settings
    from gpuhealth.controller import run_controller
    from gpuhealth.service import EXIT_CONFIG
    from tests.servers import free_port

    cert = _write(tmp_path / "tls.crt", certs["a"]["tls.crt"])
    key = _write(tmp_path / "tls.key", certs["b"]["tls.key"])
    config = tmp_path / "ctl.toml"
    config.write_text(f"""
[node]
data_dir = "{tmp_path / 'ctl'}"
[report]
enabled = false
[controller]
port = {free_port()}
agent_tokens_file = "{_tokens(tmp_path)}"
{_tls_config(cert, key)}""")
    assert run_controller(load_settings(config, env={})) == EXIT_CONFIG
    assert f"tls_key_file {key} is not the key of tls_cert_file {cert}" in caplog.text
