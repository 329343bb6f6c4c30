"""The exported Prometheus rule file against real ``promtool`` and Prometheus (Debian 2.42).

``promtool check rules`` must accept the file; a real Prometheus loads it, scrapes a
loopback endpoint serving gpuhealth-style and dcgm-exporter-style series, and fires
the same alert names, severities and labels gpuhealth's own alerts carry.
"""

from __future__ import annotations

import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from alerting.alerts import alert_name
from alerting.promrules import export_rules, prometheus_rules, render_rules
from tests.servers import eventually, free_port, need_binary, start_prometheus

EXPOSITION = b"""\
# TYPE gpu_row_remap_pending gauge
gpu_row_remap_pending{node="p1",entity="GPU-1"} 1
gpu_row_remap_pending{node="p1",entity="GPU-4"} 0
# TYPE gpu_recovery_action gauge
gpu_recovery_action{node="p1",entity="GPU-3"} 1
# TYPE ib_port_state gauge
ib_port_state{node="p1",entity="mlx5_0:1",device="mlx5_0",port="1"} 1
ib_port_state{node="p1",entity="mlx5_1:1",device="mlx5_1",port="1"} 4
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-2",Hostname="p2"} 79
DCGM_FI_DEV_XID_ERRORS{gpu="1",UUID="GPU-5",hostname="p3"} 0
"""


def test_promtool_accepts_the_exported_rules(tmp_path):
    promtool = need_binary("promtool")
    path = tmp_path / "gpuhealth-rules.yml"
    count = export_rules(str(path), extra_labels={"cluster": "c1"})
    assert count == sum(len(g.rules) for g in prometheus_rules())
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {count} rules found" in result.stdout


def test_rule_names_match_gpuhealth_alert_names():
    for group in prometheus_rules():
        for rule in group.rules:
            assert rule.alert == alert_name(rule.kind, rule.code)
            assert rule.severity in ("critical", "major", "warning")


@pytest.fixture
def exporter():
    port = free_port()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(EXPOSITION)))
            self.end_headers()
            self.wfile.write(EXPOSITION)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def test_prometheus_fires_the_same_alerts(tmp_path, exporter):
    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules())
    with start_prometheus(rules_file=rules, scrape_target=exporter) as prom:
        def firing():
            found = {(a["labels"]["alertname"], a["labels"].get("node"),
                      a["labels"].get("entity")): a
                     for a in prom.alerts() if a["state"] == "firing"}
            return found if len(found) >= 4 else None

        alerts = eventually(firing, timeout=30, interval=0.2)
    assert set(alerts) == {
        ("GpuRowRemapPending", "p1", "GPU-1"),
        ("GpuRecoveryActionGpuReset", "p1", "GPU-3"),
        ("NetIbPortStateDown", "p1", "mlx5_0:1"),
        ("GpuXid79", "p2", "GPU-2"),
    }
    xid79 = alerts[("GpuXid79", "p2", "GPU-2")]["labels"]
    assert (xid79["severity"], xid79["kind"], xid79["code"], xid79["exporter"]) == (
        "critical", "xid", "79", "dcgm-exporter")
    remap = alerts[("GpuRowRemapPending", "p1", "GPU-1")]
    assert remap["labels"]["severity"] == "warning"
    assert remap["annotations"]["runbook_url"] == "docs/runbooks/row_remap.md"


def test_the_first_xid_of_a_gpu_fires(tmp_path):
    """The Xid counter's series is born at 1: its first Xid must fire, and stop firing later.

    The exported rule's expression is checked with `promtool test rules` (Prometheus' own
    evaluator): it returns the series 1 minute after the first Xid, nothing 15 minutes on.
    """
    import json

    promtool = need_binary("promtool")
    (expr,) = [r.expr for g in prometheus_rules() for r in g.rules
               if r.alert == "GpuXid79" and "gpu_xid_events_total" in r.expr]
    series = 'gpu_xid_events_total{xid="79",node="n1",entity="0000:b1:00.0"}'
    test = tmp_path / "test.yml"
    test.write_text(
        "rule_files: []\n"
        "evaluation_interval: 1m\n"
        "tests:\n"
        "  - interval: 1m\n"
        "    input_series:\n"
        f"      - series: {json.dumps(series)}\n"
        "        values: '_ _ 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'\n"
        "    promql_expr_test:\n"
        f"      - expr: {json.dumps(expr)}\n"
        "        eval_time: 3m\n"
        "        exp_samples:\n"
        f"          - labels: {json.dumps(series)}\n"
        "            value: 1\n"
        f"      - expr: {json.dumps(expr)}\n"
        "        eval_time: 16m\n"
        "        exp_samples: []\n"
    )
    result = subprocess.run([promtool, "test", "rules", str(test)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
