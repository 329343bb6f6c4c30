"""VictoriaMetrics and Prometheus for storage tests, started from PATH on free loopback ports.

Data lives in a temporary folder; readiness is polled (``/health``, ``/-/ready``); the
server is stopped by its PID. A missing binary skips, unless
``GPUHEALTH_TEST_SERVERS=required`` (CI), where it fails (``docs/infra.md`` §1, §3, §8).
Debian packages: ``victoria-metrics``, ``prometheus``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

READY_TIMEOUT_SECONDS = 30.0


def _required() -> bool:
    return os.environ.get("GPUHEALTH_TEST_SERVERS", "").strip().lower() == "required"


def _binary(name: str, package: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} not on PATH (apt-get install {package})"
    if _required():
        pytest.fail(f"GPUHEALTH_TEST_SERVERS=required but {message}")
    pytest.skip(message)
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


@dataclass
class Server:
    """One running server; ``restart`` keeps its data and port (for the outage test)."""

    name: str
    argv: list[str]
    url: str
    ready_path: str
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.folder / f"{self.name}.log", "ab")  # noqa: SIM115 - closed by stop
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.log()}")
            try:
                _get(self.url + self.ready_path, timeout=1.0)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
            else:
                return
        raise RuntimeError(f"{self.name} not ready: {self.log()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def log(self) -> str:
        path = self.folder / f"{self.name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def flush(self) -> None:
        """Make written samples searchable now (VictoriaMetrics only)."""
        _get(self.url + "/internal/force_flush", timeout=5.0)


def start_victoria_metrics(folder: Path, *extra: str, cpus: set[int] | None = None) -> Server:
    """Start VictoriaMetrics; with ``cpus``, pinned to them (``taskset``) with as many Go
    threads (``GOMAXPROCS``), as ``benchmarks/store_ingest.py`` runs it."""
    binary = _binary("victoria-metrics", "victoria-metrics")
    port = _free_port()
    pin: list[str] = []
    if cpus:
        taskset = shutil.which("taskset")
        if taskset is None:
            raise RuntimeError("cpus given but taskset is not on PATH (util-linux)")
        pin = [taskset, "-c", ",".join(map(str, sorted(cpus))), "env",
               f"GOMAXPROCS={len(cpus)}"]  # each execs the next: the PID stays the server's
    server = Server(
        name="victoria-metrics",
        argv=[*pin, binary, f"-httpListenAddr=127.0.0.1:{port}",
              f"-storageDataPath={folder / 'vm'}",
              "-retentionPeriod=100y", "-search.latencyOffset=0s", "-search.disableCache",
              *extra],
        url=f"http://127.0.0.1:{port}", ready_path="/health", folder=folder)
    server.start()
    return server


@pytest.fixture(scope="session")
def victoria_metrics() -> Iterator[Server]:
    """A VictoriaMetrics with deduplication, so a batch sent twice is stored once."""
    with tempfile.TemporaryDirectory(prefix="gpuhealth-vm-") as tmp:
        server = start_victoria_metrics(Path(tmp), "-dedup.minScrapeInterval=1ms")
        try:
            yield server
        finally:
            server.stop()


EXPOSITION = (
    "# TYPE DCGM_FI_DEV_POWER_USAGE gauge\n"
    'DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-prom",Hostname="dgx9",modelName="H100"} 250.5\n'
    "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"
    'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",uuid="GPU-prom",hostname="dgx9"} 5000\n'
    "# TYPE gpu_temperature_celsius gauge\n"
    'gpu_temperature_celsius{node="dgx9",entity="GPU-prom"} 61\n'
)
"""What the fake exporter serves: dcgm-exporter series (released-tag and main label case)
and one gpuhealth series, as in ecosystem-reference.md §2.3."""


class _Exporter(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = EXPOSITION.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def prometheus() -> Iterator[Server]:
    """A Prometheus scraping a fake dcgm-exporter on loopback every second."""
    binary = _binary("prometheus", "prometheus")
    exporter = ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    thread = threading.Thread(target=exporter.serve_forever, daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory(prefix="gpuhealth-prom-") as tmp:
        folder = Path(tmp)
        config = folder / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n  - job_name: dcgm\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{exporter.server_port}']\n")
        port = _free_port()
        server = Server(
            name="prometheus",
            argv=[binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                  f"--web.listen-address=127.0.0.1:{port}"],
            url=f"http://127.0.0.1:{port}", ready_path="/-/ready", folder=folder)
        server.start()
        try:
            yield server
        finally:
            server.stop()
            exporter.shutdown()
            exporter.server_close()
