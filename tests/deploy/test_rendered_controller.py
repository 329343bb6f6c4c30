"""A real `gpuhealth controller` process on the chart's rendered controller settings.

The ConfigMap's TOML and the Deployment's environment are used as rendered. Only what a
pod gets from its node is replaced:

- the Secret volumes (TLS, agent tokens, the PostgreSQL password) become folders laid out
  as kubelet lays them out (``..data`` symlinks), at the paths the TOML and the
  environment name, moved here;
- the listener is kept on loopback (nothing here listens beyond it);
- ``in_cluster = true`` becomes the Kubernetes API stand-in's URL.

The stand-in refuses with 403 what the rendered RBAC does not grant the controller's
ServiceAccount, as in test_rendered_k8s.py. [controller] state is a real PostgreSQL that
asks the controller's role for a SCRAM password: the DSN in the Secret has none, so the
controller logs in with the mounted password file
(``GPUHEALTH_CONTROLLER__STATE_PASSWORD_FILE``). The replica must come up over TLS, win
the Lease, answer /-/ready as leader, accept an agent's batch with the agent's token, go
on taking batches after the password is rotated (``ALTER ROLE``, the Secret updated,
every session of the role ended) without a restart, and give the Lease up when stopped.
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
from tests.rotation_helpers import SecretVolume
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


def secret_volumes(pod: dict[str, Any], container: dict[str, Any],
                   secrets: dict[str, dict[str, str]], folder: Path
                   ) -> dict[str, SecretVolume]:
    """The container's Secret volumes as kubelet mounts them: mountPath -> a folder here.

    Each folder holds the volume's ``items`` (every key when it names none) of the Secret
    ``secrets[secretName]``, laid out and updatable as kubelet does (:class:`SecretVolume`).
    """
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    out: dict[str, SecretVolume] = {}
    for mount in container["volumeMounts"]:
        if mount["name"] not in volumes:
            continue
        assert "subPath" not in mount, "kubelet never updates a subPath mount"
        volume = volumes[mount["name"]]
        data = secrets[volume["secretName"]]
        items = volume.get("items") or [{"key": k, "path": k} for k in data]
        root = folder / "volumes" / mount["name"]
        out[mount["mountPath"]] = SecretVolume(root, {i["path"]: data[i["key"]].encode()
                                                      for i in items})
    return out


def moved(text: str, mounts: dict[str, SecretVolume]) -> str:
    """``text`` with each mounted folder's path replaced by its folder here."""
    for path, volume in mounts.items():
        text = text.replace(f"{path}/", f"{volume.root}/")
    return text


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


HBA_LINE = "host all {role} 127.0.0.1/32 scram-sha-256\n"
"""Put first in the shared server's pg_hba.conf (restored after): the controller's role
alone must give a password; every other role keeps trust."""


def _terminate(admin: Any, role: str) -> int:
    """End every session of ``role`` (a database fail-over); return how many."""
    rows = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE usename = %s", (role,)).fetchall()
    return len(rows)


def _sessions(admin: Any, role: str) -> int:
    (count,) = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s",
                             (role,)).fetchone()
    return int(count)


def test_rendered_controller_starts_leads_and_takes_batches(
        tmp_path: Path, api: K8sApi, postgres: Postgres) -> None:  # noqa: F811
    import psycopg
    from psycopg import sql

    db = f"deploy_it_{os.getpid()}"
    role = f"gpuhealth_deploy_{os.getpid()}"
    old_password, new_password = "first:pass\\word", "second pass'word"
    hba = postgres.data / "pg_hba.conf"
    shared_hba = hba.read_text()
    admin = psycopg.connect(postgres.dsn, autocommit=True)
    admin.execute(f"DROP DATABASE IF EXISTS {db}")
    admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
        sql.Identifier(role), sql.Literal(old_password)))
    admin.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
        sql.Identifier(db), sql.Identifier(role)))
    try:
        hba.write_text(HBA_LINE.format(role=role) + shared_hba)
        admin.execute("SELECT pg_reload_conf()")
        # the role needs its password (what the test is about)
        with pytest.raises(psycopg.OperationalError, match="password authentication"):
            psycopg.connect(f"host=127.0.0.1 port={postgres.port} user={role} dbname={db} "
                            "password=wrong", connect_timeout=5).close()
        _run_controller(tmp_path, api, postgres, admin, db, role, old_password,
                        new_password)
    finally:
        hba.write_text(shared_hba)
        admin.execute("SELECT pg_reload_conf()")
        _terminate(admin, role)
        admin.close()


def _run_controller(tmp_path: Path, api: K8sApi, postgres: Postgres,  # noqa: F811
                    admin: Any, db: str, role: str, old_password: str,
                    new_password: str) -> None:
    from psycopg import sql

    (secret_object,) = (s for n, s in objects(None, "Secret").items()
                        if n == "gpuhealth-controller")
    assert "password" not in secret_object["stringData"]["state-dsn"]
    assert set(secret_object["stringData"]) == {"agent-tokens", "state-dsn", "api-token",
                                                "state-password"}
    secret = {"state-dsn": f"host=127.0.0.1 port={postgres.port} user={role} dbname={db}",
              "state-password": old_password + "\n",  # `echo ... | kubectl create secret`
              "api-token": "api-token-" + "z" * 24,
              "agent-tokens": "gpu-001 token-gpu-001-" + "x" * 24 + "\n"}
    certificates(tmp_path)
    tls = {k: (tmp_path / k).read_text() for k in ("tls.crt", "tls.key", "ca.crt")}

    (cm,) = (c for n, c in objects(None, "ConfigMap").items() if n == "gpuhealth-controller")
    (deploy,) = objects(None, "Deployment").values()
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = secret_volumes(pod, container, {"gpuhealth-controller": secret,
                                             "gpuhealth-controller-tls": tls}, tmp_path)
    assert set(mounts) == {"/etc/gpuhealth/agent-tokens", "/etc/gpuhealth/tls",
                           "/etc/gpuhealth/state-password"}
    text = cm["data"]["gpuhealth.toml"]
    assert text.count("in_cluster = true") == 2  # the Lease and the scheduler
    port = free_port()
    text = moved(text.replace("in_cluster = true", f'host = "{api.url}"')
                 .replace('listen_address = "0.0.0.0"', 'listen_address = "127.0.0.1"')
                 .replace("port = 9837", f"port = {port}")
                 .replace('"/var/lib/gpuhealth"', f'"{tmp_path / "data"}"'), mounts)
    assert "/etc/gpuhealth/" not in text
    wired = tomllib.loads(text)
    config = tmp_path / "controller.toml"
    config.write_text(text)
    rendered_env = {k: moved(v, mounts) for k, v in pod_env(container, secret).items()}
    password_file = Path(rendered_env["GPUHEALTH_CONTROLLER__STATE_PASSWORD_FILE"])
    assert password_file.read_text() == old_password + "\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "GPUHEALTH_"))}
    env |= {**rendered_env, "PYTHONUNBUFFERED": "1"}
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
    token = {"Authorization": "Bearer token-gpu-001-" + "x" * 24}

    def batch() -> dict[str, Any]:
        now = time.time()
        return {"node": "gpu-001", "agent_version": "0.1.0", "sent_at": now,
                "heartbeat": {"at": now, "gpus": [], "facts": {}}, "records": []}

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
            assert _sessions(admin, role) > 0, "logged in with the mounted password"
            refused_token = http.post(f"{url}/api/v1/agents/gpu-001/batch", json=batch(),
                                      headers={"Authorization": "Bearer wrong"})
            assert refused_token.status_code == 401
            accepted = http.post(f"{url}/api/v1/agents/gpu-001/batch", json=batch(),
                                 headers=token)
            assert accepted.status_code == 200, accepted.text
            agents = http.get(f"{url}/api/v1/agents").json()
            assert "gpu-001" in json.dumps(agents)
            assert http.get(f"{url}/metrics").status_code == 200

            # the rotation: ALTER ROLE, kubelet swaps the Secret, then every session of
            # the role ends; new sessions log in with the new password, no restart
            admin.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(new_password)))
            mounts["/etc/gpuhealth/state-password"].write(
                {"state-password": new_password.encode()})
            eventually(lambda: b"connections use the new password" in log.read_bytes()
                       or None, timeout=20)
            assert _terminate(admin, role) > 0

            def taken() -> bool | None:
                answer = http.post(f"{url}/api/v1/agents/gpu-001/batch", json=batch(),
                                   headers=token)
                assert answer.status_code in (200, 503), answer.text
                return answer.status_code == 200 or None

            eventually(taken, timeout=30)
            assert _sessions(admin, role) > 0, "logged in again with the new password"
            assert proc.poll() is None, "the same process throughout"
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
    assert old_password not in log.read_text(), "the password is never logged"
    assert new_password not in log.read_text()
