"""Real servers for integration tests: Alertmanager, Prometheus, promtool, a webhook receiver.

Each server is started from a binary on PATH, bound to a free loopback port with its
data in a temporary folder, polled until ready, and stopped by its PID at the end
(``docs/infra.md`` §3, §8). A missing binary skips the test, unless
``GPUHEALTH_TEST_SERVERS=required`` (as ``.ci/run`` sets), in which case it fails:
CI can never pass by silently skipping the real backends.

Debian packages: ``prometheus`` (``prometheus``, ``promtool``) and
``prometheus-alertmanager`` (``prometheus-alertmanager``, ``amtool``); upstream
tarballs name the Alertmanager binary ``alertmanager``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

READY_TIMEOUT_SECONDS = 30.0


def servers_required() -> bool:
    return os.environ.get("GPUHEALTH_TEST_SERVERS", "").strip().lower() == "required"


def need_binary(*names: str) -> str:
    """Return the path of the first of ``names`` on PATH; skip, or fail when required."""
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    message = (f"{' or '.join(names)} not on PATH "
               "(apt-get install prometheus prometheus-alertmanager)")
    if servers_required():
        pytest.fail(f"GPUHEALTH_TEST_SERVERS=required but {message}")
    pytest.skip(message)
    raise AssertionError("unreachable")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path,
               timeout: float = READY_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout} s:\n"
                       f"{log.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server we started, by its PID: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def post_json(url: str, body: Any, method: str = "POST") -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def eventually(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns a truthy value; return it (fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"condition not met within {timeout} s (last value {last!r})")


# --- a webhook receiver ---------------------------------------------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class WebhookReceiver:
    """A loopback HTTP server that records every POST and answers with ``respond``."""

    url: str
    received: list[Received] = field(default_factory=list)
    respond: Callable[[str, dict[str, str], bytes], int] = lambda path, headers, body: 200
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]

    def clear(self) -> None:
        with self.lock:
            self.received.clear()


@contextlib.contextmanager
def webhook_receiver() -> Iterator[WebhookReceiver]:
    port = free_port()
    receiver = WebhookReceiver(url=f"http://127.0.0.1:{port}")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            headers = {k.lower(): v for k, v in self.headers.items()}
            status = receiver.respond(self.path, headers, body)
            with receiver.lock:
                receiver.received.append(Received(self.path, headers, body, status))
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --- Alertmanager ---------------------------------------------------------------------


@dataclass
class Alertmanager:
    url: str
    receiver: WebhookReceiver
    proc: subprocess.Popen[bytes]

    def alerts(self, **filters: str) -> list[dict[str, Any]]:
        query = "&".join(f"filter={urllib.request.quote(f'{k}={json.dumps(v)}')}"
                         for k, v in filters.items())
        return list(get_json(f"{self.url}/api/v2/alerts" + (f"?{query}" if query else "")))

    def groups(self) -> list[dict[str, Any]]:
        return list(get_json(f"{self.url}/api/v2/alerts/groups"))


ALERTMANAGER_CONFIG = """
route:
  receiver: hook
  group_by: ['cluster', 'node']
  group_wait: 100ms
  group_interval: 500ms
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: '{hook}/alertmanager'
        send_resolved: true
"""


@contextlib.contextmanager
def start_alertmanager(port: int | None = None) -> Iterator[Alertmanager]:
    binary = need_binary("prometheus-alertmanager", "alertmanager")
    with tempfile.TemporaryDirectory(prefix="gpuhealth-am-") as tmp, webhook_receiver() as hook:
        folder = Path(tmp)
        config = folder / "alertmanager.yml"
        config.write_text(ALERTMANAGER_CONFIG.format(hook=hook.url))
        port = port or free_port()
        log = folder / "am.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                 "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(f"{url}/-/ready", proc, log)
            yield Alertmanager(url=url, receiver=hook, proc=proc)
        finally:
            stop(proc)


# --- Prometheus -------------------------------------------------------------------------


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]

    def alerts(self) -> list[dict[str, Any]]:
        return list(get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"])


@contextlib.contextmanager
def start_prometheus(*, rules_file: Path, scrape_target: str,
                     alertmanager: str | None = None) -> Iterator[Prometheus]:
    binary = need_binary("prometheus")
    with tempfile.TemporaryDirectory(prefix="gpuhealth-prom-") as tmp:
        folder = Path(tmp)
        config = folder / "prometheus.yml"
        alerting = ""
        if alertmanager:
            target = alertmanager.removeprefix("http://")
            alerting = ("alerting:\n  alertmanagers:\n    - static_configs:\n"
                        f"        - targets: ['{target}']\n")
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            + alerting
            + f"rule_files:\n  - {rules_file}\n"
            + f"scrape_configs:\n  - job_name: gpuhealth\n    static_configs:\n"
            f"      - targets: ['{scrape_target}']\n"
        )
        port = free_port()
        log = folder / "prom.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(f"{url}/-/ready", proc, log)
            yield Prometheus(url=url, proc=proc)
        finally:
            stop(proc)


@pytest.fixture(scope="session")
def alertmanager() -> Iterator[Alertmanager]:
    with start_alertmanager() as am:
        yield am


@pytest.fixture(scope="session")
def promtool() -> str:
    return need_binary("promtool")
