"""What ``gpuhealth run`` accepted survives a restart: SIGTERM and ``kill -9`` (#14 item 2).

A real process: a real case (Xid 79, GPU fallen off the bus) is posted to
``/api/v1/ingest``; the alert fires. The process is stopped with SIGTERM and started
again, then killed with SIGKILL and started again: each time the alert is back from the
input journal, and remediation requests nothing twice (the audit trail has each step
once). The old code had ``alerts: []`` after any restart.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from remediation.audit import read_audit_log

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "cases"
CASE = CASES / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_RUN = ("import sys; from gpuhealth.config import load_settings; "
        "from gpuhealth.service import run; sys.exit(run(load_settings(sys.argv[1])))")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp_path: Path, api: int, metrics: int) -> Path:
    (tmp_path / "kern.log").write_text("")
    path = tmp_path / "gpuhealth.toml"
    path.write_text(f"""
[node]
name = "ctl"
data_dir = "{tmp_path / 'data'}"

[metrics]
port = {metrics}

[alerting]
api_port = {api}

[collectors.kernel_log]
source = "file"
path = "{tmp_path / 'kern.log'}"

[collectors.nvml]
enabled = false

[collectors.network]
enabled = false

[analytics]
evaluate_interval_seconds = "200ms"

[remediation]
cluster_size = 10
max_disrupted_fraction = 1.0
""")
    return path


def _get(port: int, path: str) -> object | None:
    try:
        with _OPENER.open(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None


def _alerts(port: int) -> list[str]:
    answer = _get(port, "/api/v1/alerts")
    if not isinstance(answer, list):
        return []
    return sorted(f"{a['labels']['node']}/{a['labels']['alertname']}" for a in answer)


def _wait(predicate, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())


def _start(config: Path, tmp_path: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEALTH_")}
    with open(tmp_path / "stderr.txt", "ab") as stderr:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-c", _RUN, str(config)], cwd=tmp_path,
                                env=env, stdout=subprocess.DEVNULL, stderr=stderr)


def test_ingested_findings_come_back_after_sigterm_and_kill_9(tmp_path: Path) -> None:
    api, metrics = _free_port(), _free_port()
    config = _config(tmp_path, api, metrics)
    proc = _start(config, tmp_path)
    try:
        assert _wait(lambda: _get(api, "/api/v1/alerts") is not None), (
            tmp_path / "stderr.txt").read_text()[-3000:]
        request = urllib.request.Request(
            f"http://127.0.0.1:{api}/api/v1/ingest?node=gpu-07&file={CASE.name}",
            data=CASE.read_bytes(), method="POST")
        with _OPENER.open(request, timeout=10) as resp:
            assert resp.status == 200
        assert _wait(lambda: "gpu-07/GpuXid79" in _alerts(api))
        firing = _alerts(api)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        proc = _start(config, tmp_path)
        assert _wait(lambda: "gpu-07/GpuXid79" in _alerts(api)), (
            tmp_path / "stderr.txt").read_text()[-3000:]
        assert _alerts(api) == firing
        proc.kill()  # kill -9: nothing flushed on the way out
        proc.wait(timeout=30)
        proc = _start(config, tmp_path)
        assert _wait(lambda: "gpu-07/GpuXid79" in _alerts(api))
        assert _alerts(api) == firing
    finally:
        proc.kill()
        proc.wait(timeout=30)
    requested = [r.idempotency_key for r in read_audit_log(str(tmp_path / "data" / "audit.jsonl"))
                 if r.decision == "requested"]
    assert requested
    assert len(requested) == len(set(requested))  # no step requested twice across restarts
