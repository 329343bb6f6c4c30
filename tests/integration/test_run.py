"""``gpuhealth run`` end to end: a real process, real /metrics, a real SQLite file."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.records import EntityId, NodeName, Sample
from gpuhealth.config import Settings, load_settings
from gpuhealth.service import Service, run

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy
_RUN = ("import sys; from gpuhealth.config import load_settings; "
        "from gpuhealth.service import run; sys.exit(run(load_settings(sys.argv[1])))")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def peer() -> Iterator[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"127.0.0.1:{server.getsockname()[1]}"


def _config(tmp_path: Path, port: int, peer: str, kern_log: Path) -> Path:
    kern_log.write_text("")
    path = tmp_path / "gpuhealth.toml"
    path.write_text(f"""
[node]
name = "test-node"
data_dir = "{tmp_path / 'data'}"

[metrics]
port = {port}

[collectors.kernel_log]
source = "file"
path = "{kern_log}"

[collectors.network]
interval_seconds = "1s"

[collectors.probe]
peers = ["{peer}"]
method = "tcp"
count = 1
interval_seconds = "1s"

[storage]
flush_interval_seconds = "200ms"

[analytics]
evaluate_interval_seconds = "1s"
""")
    return path


def _scrape(port: int) -> str | None:
    try:
        with _OPENER.open(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return str(resp.read().decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def _sample_count(db: Path) -> int:
    if not db.exists():
        return 0
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0])
    except sqlite3.OperationalError:
        return 0
    finally:
        conn.close()


def test_run_serves_metrics_stores_samples_and_stops_cleanly(tmp_path: Path, peer: str) -> None:
    port = _free_port()
    config = _config(tmp_path, port, peer, tmp_path / "kern.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEALTH_")}
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", _RUN, str(config)], cwd=tmp_path,
                                env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        assert _wait_for(lambda: "gpuhealth_samples_written_total" in (_scrape(port) or ""),
                         30), stderr_path.read_text()
        wanted = ("probe_loss_ratio{", 'collector="nvml",reason="unavailable"',
                  "net_rx_bytes_total{")  # real counters of this machine (NetworkCollector)
        _wait_for(lambda: all(w in (_scrape(port) or "") for w in wanted), 20)
        body = _scrape(port) or ""
        assert 'probe_loss_ratio{entity="node",method="tcp",node="test-node"' in body
        assert 'gpuhealth_collector_errors_total{collector="nvml",reason="unavailable"}' in body
        assert "# TYPE net_rx_bytes_total counter" in body
        assert 'net_rx_bytes_total{entity="' in body
        db = tmp_path / "data" / "gpuhealth.sqlite"
        assert _wait_for(lambda: _sample_count(db) > 0, 15)
        with open(tmp_path / "kern.log", "a") as log:  # the kernel log collector follows it
            log.write("[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:b1:00): 79, "
                      "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n")
        assert _wait_for(lambda: 'gpu_xid_events_total{entity="0000:b1:00.0"' in (
            _scrape(port) or ""), 15)
        # ... and the pipeline turns it into a finding (evaluated every second here)
        assert _wait_for(lambda: 'gpuhealth_findings_total{severity="critical"}' in (
            _scrape(port) or ""), 15)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    stderr_text = stderr_path.read_text()
    assert rc == 0, stderr_text
    assert "NVML unavailable" in stderr_text
    assert "Traceback" not in stderr_text
    assert _sample_count(tmp_path / "data" / "gpuhealth.sqlite") > 0
    conn = sqlite3.connect(tmp_path / "data" / "gpuhealth.sqlite")
    kinds = {row[0] for row in conn.execute("SELECT kind || ':' || code FROM events")}
    conn.close()
    assert "xid:79" in kinds
    audit = (tmp_path / "data" / "audit.jsonl").read_text()
    assert '"dry_run":true' in audit


def test_deleted_kernel_log_does_not_stop_the_service(tmp_path: Path, peer: str) -> None:
    port = _free_port()
    kern_log = tmp_path / "kern.log"
    settings = load_settings(_config(tmp_path, port, peer, kern_log), env={})
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run(settings, stop=stop)))
    thread.start()
    try:
        assert _wait_for(lambda: "probe_loss_ratio{" in (_scrape(port) or ""), 30)
        kern_log.unlink()
        written = _written(port)
        assert _wait_for(lambda: _written(port) > written, 15)
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(timeout=20)
    assert not thread.is_alive()
    assert result == [0]
    assert _sample_count(tmp_path / "data" / "gpuhealth.sqlite") > 0


def _written(port: int) -> float:
    for line in (_scrape(port) or "").splitlines():
        if line.startswith("gpuhealth_samples_written_total "):
            return float(line.split()[1])
    return -1.0


class _Good:
    name = "good"

    def __init__(self) -> None:
        self.calls = 0

    def collect(self) -> list[Sample]:
        self.calls += 1
        return [Sample(metric="gpu_power_watts", value=float(self.calls), observed_at=time.time(),
                       node=NodeName("n1"), entity=EntityId("GPU-a"))]


class _Broken:
    name = "broken"

    def collect(self) -> list[Sample]:
        raise RuntimeError("boom")


class _Burst:
    """Yields many samples once, then nothing."""

    name = "burst"

    def __init__(self, n: int) -> None:
        self.n = n
        self.done = threading.Event()

    def collect(self) -> list[Sample]:
        if self.done.is_set():
            return []
        self.done.set()
        now = time.time()
        return [Sample(metric="gpu_temperature_celsius", value=float(i), observed_at=now - i,
                       node=NodeName("n1"), entity=EntityId("GPU-b")) for i in range(self.n)]


def _quiet_settings(tmp_path: Path, flush: str) -> Settings:
    path = tmp_path / "quiet.toml"
    path.write_text(f"""
[node]
data_dir = "{tmp_path / 'data'}"
[metrics]
enabled = false
[storage]
flush_interval_seconds = "{flush}"
flush_max_records = 1000000
[collectors.good]
type = "probe"
interval_seconds = "50ms"
[collectors.broken]
type = "probe"
interval_seconds = "50ms"
""")
    return load_settings(path, env={})


def test_failing_collector_is_counted_and_never_stops_the_others(tmp_path: Path) -> None:
    settings = _quiet_settings(tmp_path, "100ms")
    good = _Good()
    service = Service(settings, collectors={"good": good, "broken": _Broken()})
    service.start()
    try:
        assert _wait_for(lambda: good.calls >= 5, 10)
        errors = service.exporter.value("gpuhealth_collector_errors_total",
                                        {"collector": "broken", "reason": "RuntimeError"})
        assert errors is not None
        assert errors >= 2
    finally:
        service.shutdown()
    assert _sample_count(tmp_path / "data" / "gpuhealth.sqlite") >= 5


def test_shutdown_writes_everything_buffered(tmp_path: Path) -> None:
    settings = _quiet_settings(tmp_path, "1h")  # nothing is flushed before the stop
    burst = _Burst(5000)
    service = Service(settings, collectors={"good": burst})
    service.start()
    assert burst.done.wait(10)
    assert _wait_for(lambda: len(service.buffer) == 5000, 10)
    service.shutdown()
    assert _sample_count(tmp_path / "data" / "gpuhealth.sqlite") == 5000


def test_a_read_only_store_writes_nothing_keeps_nothing_and_stops(tmp_path: Path) -> None:
    # [storage] type = "promql": Prometheus scrapes /metrics; the service writes no samples,
    # keeps none in memory, and stops at once (it used to spin at shutdown)
    path = tmp_path / "promql.toml"
    path.write_text(f"""
[node]
data_dir = "{tmp_path / 'data'}"
[metrics]
enabled = false
[storage]
type = "promql"
url = "http://127.0.0.1:9"
flush_interval_seconds = "50ms"
[collectors.good]
type = "probe"
interval_seconds = "50ms"
""")
    burst = _Burst(500)
    service = Service(load_settings(path, env={}), collectors={"good": burst})
    service.start()
    assert service.store is None
    assert burst.done.wait(10)
    assert _wait_for(lambda: len(service.buffer) == 0, 10)
    started = time.monotonic()
    service.shutdown()
    assert time.monotonic() - started < 5
    assert not service._unwritten
    assert not (tmp_path / "data" / "gpuhealth.sqlite").exists()
