"""/healthz reflects real health (issue #14 item 5b): 503 naming what fails.

The store is a LOCAL STAND-IN for the InfluxDB v2 / VictoriaMetrics write API (a tiny HTTP
server answering POST /api/v2/write with 404, as a wrong URL does, then 204).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from core.clock import FakeClock
from core.records import EntityId, NodeName, Sample
from gpuhealth.config import load_settings
from gpuhealth.health import Health
from gpuhealth.metrics import MetricsExporter, MetricsServer
from gpuhealth.service import Service
from storage.factory import store_stats
from storage.influxdb import InfluxDbStore
from storage.spool import SpoolingStore


class _Write(BaseHTTPRequestHandler):
    status: ClassVar[int] = 404

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b"404 page not found\n" if type(self).status == 404 else b""
        self.send_response(type(self).status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def tsdb() -> Iterator[str]:
    _Write.status = 404
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Write)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:  # loopback only
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait_for(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_a_failure_fails_its_stage_until_it_stops_repeating() -> None:
    clock = FakeClock(now=1000.0)
    health = Health(stale_seconds=30, clock=clock)
    assert health.answer() == (200, b"gpuhealth: ok\n")
    health.fail("evaluate", "pipeline.evaluate failed: boom")
    clock.advance(20)
    health.fail("evaluate", "pipeline.evaluate failed: boom")
    status, body = health.answer()
    assert status == 503
    assert b"evaluate: pipeline.evaluate failed: boom (for 20 s)" in body
    clock.advance(31)
    assert health.answer()[0] == 200

    def broken() -> str | None:
        raise RuntimeError("no store")

    health.check("store", broken)
    assert health.failing() == {"store": "health check failed: no store"}


def test_the_spool_says_why_the_store_takes_no_writes(tsdb: str, tmp_path: Path) -> None:
    clock = FakeClock(now=1_700_000_100.0)
    store = InfluxDbStore(url=tsdb, org="o", bucket="b", token="t", max_retries=0,
                          overlap_min_samples=0, clock=clock)
    spool = SpoolingStore(store=store, path=tmp_path, clock=clock)
    sample = Sample(metric="gpu_power_watts", value=1.0, observed_at=1_700_000_000.0,
                    node=NodeName("n1"), entity=EntityId("GPU-0"))
    assert store_stats(spool).failing is None
    spool.write([sample], [])
    failing = store_stats(spool).failing
    assert failing is not None
    assert tsdb in failing
    assert "HTTP 404" in failing
    assert "1 record(s) spooled" in failing
    _Write.status = 204
    clock.advance(60)
    spool.write([sample], [])
    assert spool.depth == 0
    assert store_stats(spool).failing is None
    spool.close()


def test_the_metrics_server_answers_what_health_says() -> None:
    health = Health()
    server = MetricsServer(exporter=MetricsExporter(), port=0, health=health)
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert _get(f"{base}/healthz") == (200, "gpuhealth: ok\n")
        health.check("store", lambda: "http://tsdb: HTTP 404 Not Found")
        assert _get(f"{base}/healthz") == (
            503, "gpuhealth: failing\nstore: http://tsdb: HTTP 404 Not Found\n")
        assert _get(base + "/")[0] == 200  # the process is up; /healthz says how it does
    finally:
        server.stop()


class _OneSample:
    name = "one"

    def collect(self) -> list[Sample]:
        return [Sample(metric="gpu_power_watts", value=float(time.time() % 100),
                       observed_at=time.time(), node=NodeName("n1"),
                       entity=EntityId("GPU-0"))]


def test_healthz_of_a_service_whose_store_answers_404(tsdb: str, tmp_path: Path) -> None:
    path = tmp_path / "gpuhealth.toml"
    path.write_text(f"""
[node]
name = "n1"
data_dir = "{tmp_path / "data"}"
[metrics]
port = 0
[alerting]
api_enabled = false
[storage]
type = "influxdb"
url = "{tsdb}"
flush_interval_seconds = "100ms"
""")
    service = Service(load_settings(path, env={}), collectors={"one": _OneSample()})
    service.start()
    try:
        assert service.server is not None
        healthz = f"http://127.0.0.1:{service.server.port}/healthz"
        assert _wait_for(lambda: _get(healthz)[0] == 503, 15)
        status, body = _get(healthz)
        assert status == 503
        assert body.startswith("gpuhealth: failing\nstore: ")
        assert tsdb in body
        assert "HTTP 404" in body
        _Write.status = 204  # the URL is fixed: the spool delivers, /healthz is ok again
        assert _wait_for(lambda: _get(healthz) == (200, "gpuhealth: ok\n"), 20), _get(healthz)
    finally:
        service.shutdown()
