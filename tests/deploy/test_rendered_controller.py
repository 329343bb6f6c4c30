"""A real `gpuhealth controller` process on the chart's rendered controller settings.

The ConfigMap's TOML and the Deployment's environment are used as rendered. Only what a
pod gets from its node is replaced:

- the mounted files (TLS, tokens) become files made here;
- the listener is kept on loopback (nothing here listens beyond it);
- ``in_cluster = true`` becomes the Kubernetes API stand-in's URL.

The stand-in refuses with 403 what the rendered RBAC does not grant the controller's
ServiceAccount, as in test_rendered_k8s.py. [controller] state is a real PostgreSQL. The
replica must come up over TLS, win the Lease, answer /-/ready as leader, accept an
agent's batch with the agent's token, and give the Lease up when stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.conftest import objects
from tests.deploy.test_rendered_k8s import authorizer, enforce
from tests.k8s_api import K8sApi, running_k8s_api
from tests.pg_server import Postgres, postgres  # noqa: F401 (fixture)
from tests.servers import eventually, free_port

POD = "gpuhealth-controller-7d9f8-abcde"


@pytest.fixture
def api() -> Iterator[K8sApi]:
    with running_k8s_api() as server:
        yield server


def certificates(folder: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 (what cert-manager would write)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is missing")

    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr

    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *curve, "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", str(folder / "ca.key"), "-out", str(folder / "ca.crt"))
    run("req", *curve, "-subj", "/CN=gpuhealth-controller", "-keyout", str(folder / "tls.key"),
        "-out", str(folder / "tls.csr"))
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,"
                                    "DNS:gpuhealth-controller.gpuhealth.svc\n")
    run("x509", "-req", "-in", str(folder / "tls.csr"), "-CA", str(folder / "ca.crt"),
        "-CAkey", str(folder / "ca.key"), "-CAcreateserial", "-days", "1",
        "-extfile", str(folder / "san.ext"), "-out", str(folder / "tls.crt"))


def pod_env(container: dict[str, Any], secret: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (fieldRefs, secretKeyRefs, $())."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            value = item["value"]
            for name, known in env.items():
                value = value.replace(f"$({name})", known)
            env[item["name"]] = value
        elif "fieldRef" in item["valueFrom"]:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[item["name"]] = POD
        else:
            env[item["name"]] = secret[item["valueFrom"]["secretKeyRef"]["key"]]
    return env


def test_rendered_controller_starts_leads_and_takes_batches(
        tmp_path: Path, api: K8sApi, postgres: Postgres) -> None:  # noqa: F811
    import psycopg

    db = f"deploy_it_{os.getpid()}"
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {db}")
        conn.execute(f"CREATE DATABASE {db}")
    secret = {"state-dsn": f"host=127.0.0.1 port={postgres.port} user=postgres dbname={db}",
              "api-token": "api-token-" + "z" * 24,
              "agent-tokens": "gpu-001 token-gpu-001-" + "x" * 24 + "\n"}
    certificates(tmp_path)
    (tmp_path / "agent-tokens").write_text(secret["agent-tokens"])

    (cm,) = (c for n, c in objects(None, "ConfigMap").items() if n == "gpuhealth-controller")
    text = cm["data"]["gpuhealth.toml"]
    assert text.count("in_cluster = true") == 2  # the Lease and the scheduler
    port = free_port()
    text = (text.replace("in_cluster = true", f'host = "{api.url}"')
            .replace('listen_address = "0.0.0.0"', 'listen_address = "127.0.0.1"')
            .replace("port = 9837", f"port = {port}")
            .replace('"/etc/gpuhealth/tls/', f'"{tmp_path}/')
            .replace('"/etc/gpuhealth/agent-tokens/agent-tokens"',
                     f'"{tmp_path / "agent-tokens"}"')
            .replace('"/var/lib/gpuhealth"', f'"{tmp_path / "data"}"'))
    wired = tomllib.loads(text)
    config = tmp_path / "controller.toml"
    config.write_text(text)
    (deploy,) = objects(None, "Deployment").values()
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {**os.environ, **pod_env(container, secret), "PYTHONUNBUFFERED": "1"}
    refused = enforce(api, authorizer(None, "gpuhealth-controller"))
    lease_key = (wired["remediation"]["election_options"]["namespace"],
                 wired["remediation"]["election_options"]["name"])

    exe = Path(sys.executable).with_name("gpuhealth")
    log = tmp_path / "controller.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(exe), *container["args"][:2], str(config)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=context, timeout=5.0) as http:
            def ready() -> Any:
                assert proc.poll() is None, log.read_text()
                try:
                    answer = http.get(f"{url}/-/ready")
                except httpx.HTTPError:
                    return None
                return answer.json() if answer.status_code == 200 and answer.json()[
                    "leader"] else None

            eventually(ready, timeout=60)
            lease = api.leases[lease_key]
            assert lease["spec"]["holderIdentity"] == POD
            now = time.time()
            batch = {"node": "gpu-001", "agent_version": "0.1.0", "sent_at": now,
                     "heartbeat": {"at": now, "gpus": [], "facts": {}}, "records": []}
            refused_token = http.post(f"{url}/api/v1/agents/gpu-001/batch", json=batch,
                                      headers={"Authorization": "Bearer wrong"})
            assert refused_token.status_code == 401
            accepted = http.post(f"{url}/api/v1/agents/gpu-001/batch", json=batch,
                                 headers={"Authorization": "Bearer token-gpu-001-"
                                          + "x" * 24})
            assert accepted.status_code == 200, accepted.text
            agents = http.get(f"{url}/api/v1/agents").json()
            assert "gpu-001" in json.dumps(agents)
            assert http.get(f"{url}/metrics").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    assert refused == [], log.read_text()
    assert proc.returncode == 0, log.read_text()
    assert not api.leases[lease_key]["spec"].get("holderIdentity"), "released on SIGTERM"
