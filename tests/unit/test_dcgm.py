"""dcgmi parsers (diag, health, dmon, nvlink) and dcgm-exporter (parser and collector)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from collectors import dcgm, dcgm_exporter, nvidia_smi
from collectors.artifact import ArtifactResult, Line, ParseContext, parse_lines
from collectors.dcgm import is_blank
from collectors.dcgm_exporter import DcgmExporterCollector
from core.errors import CollectorUnavailable
from core.records import EntityId, Event, NodeName, Record, Sample
from tests.conftest import cases_dir

PARSERS = nvidia_smi.PARSERS + dcgm.PARSERS + dcgm_exporter.PARSERS


def parse(text: str) -> tuple[list[Record], ArtifactResult]:
    lines = [Line(i, t) for i, t in enumerate(text.splitlines(), start=1)]
    result = ArtifactResult()
    ctx = ParseContext(file="input.txt", node=NodeName("node-a"))
    return list(parse_lines(lines, ctx, PARSERS, result)), result


def case_text(prefix: str) -> str:
    return next(cases_dir().glob(f"{prefix}-*")).read_text(encoding="utf-8")


def samples(records: Sequence[Record], metric: str) -> list[Sample]:
    return [r for r in records if isinstance(r, Sample) and r.metric == metric]


def events(records: Sequence[Record], kind: str) -> list[Event]:
    return [r for r in records if isinstance(r, Event) and r.kind == kind]


# ----------------------------------------------------------------------------- diag


def test_diag_nvlink_down_warnings_rejoined_mid_word() -> None:
    records, result = parse(case_text("010"))
    assert result.kinds == ["dcgmi_diag"]
    links = sorted(int(s.labels["link"]) for s in samples(records, "gpu_nvlink_state"))
    assert links == [0, 1, 2, 3, 4]
    assert all(s.entity == "gpu:0" and s.value == 0 for s in samples(records, "gpu_nvlink_state"))
    (fail,) = events(records, "dcgm_diag")
    assert fail.code == "pcie"
    assert fail.entity == "node"
    assert fail.attrs["nvlink_only"] == "yes"
    assert fail.attrs["result"] == "fail"
    assert "Run a field diagnostic on the GPU." in fail.attrs["message"]
    assert "fie ld" not in fail.attrs["message"]


def test_diag_memory_fail_with_thermal_violation() -> None:
    records, _ = parse(case_text("023"))
    (fail,) = events(records, "dcgm_diag")
    assert (fail.code, fail.entity, fail.attrs["result"]) == ("gpu_memory", "gpu:0", "fail")
    assert fail.attrs["nvlink_only"] == "no"
    assert "13.3 seconds started" in fail.attrs["message"]
    (thermal,) = events(records, "thermal_violation")
    assert thermal.entity == "gpu:0"
    assert thermal.attrs["seconds"] == "13.3"


def test_diag_deployment_error_row_remap_pending() -> None:
    records, _ = parse(case_text("024"))
    (error,) = events(records, "dcgm_diag_error")
    assert (error.code, error.entity) == ("row_remap_pending", "gpu:3")
    assert "row remappings are pending" in error.message
    assert [e.line for e in error.evidence] == [5, 6]


def test_diag_per_gpu_rows_and_perf() -> None:
    text = (
        "+---------------------------+------------------------------------------------+\n"
        "| Diagnostic                | Result                                         |\n"
        "+===========================+================================================+\n"
        "+-----  Stress  ------------+------------------------------------------------+\n"
        "| Diagnostic                | Fail                                           |\n"
        "| GPU0                      | Pass                                           |\n"
        "| GPU1                      | Fail                                           |\n"
        "| Info                      | GPU 0 calculated at approximately 15000.00 gig |\n"
        "|                           | aflops during this test                        |\n"
    )
    records, _ = parse(text)
    (fail,) = events(records, "dcgm_diag")
    assert (fail.code, fail.entity) == ("diagnostic", "gpu:1")
    (perf,) = events(records, "dcgm_diag_perf")
    assert perf.entity == "gpu:0"
    assert perf.attrs["value"] == "15000.00"


def test_diag_json() -> None:
    text = """$ dcgmi diag -r 3 -j
{
  "DCGM GPU Diagnostic": {
    "test_categories": [
      {"category": "Deployment", "tests": [{"name": "Denylist", "results": [{"status": "Pass"}]}]},
      {"category": "Hardware", "tests": [{"name": "GPU Memory", "results": [
        {"gpu_ids": "0", "status": "Pass"},
        {"gpu_ids": "1", "status": "Fail",
         "warnings": [{"warning": "GPU 1 has a DBE in memory", "error_id": 1}]}
      ]}]}
    ]
  }
}
"""
    records, result = parse(text)
    assert result.kinds == ["dcgmi_diag"]
    (fail,) = events(records, "dcgm_diag")
    assert (fail.code, fail.entity, fail.attrs["category"]) == ("gpu_memory", "gpu:1", "hardware")
    assert any("DBE" in e.text for e in fail.evidence)


def test_diag_json_invalid_is_an_issue() -> None:
    records, result = parse('$ dcgmi diag -r 1 -j\n{"DCGM GPU Diagnostic": {"test_categories": [\n')
    assert records == []
    assert any("invalid JSON" in i.reason for i in result.issues)


# --------------------------------------------------------------------------- health


def test_health_json_healthy_is_recorded() -> None:
    records, result = parse(case_text("008"))
    (health,) = events(records, "dcgm_health")
    assert (health.code, health.entity) == ("healthy", "node")
    assert result.issues == []


def test_health_table_warning() -> None:
    text = (
        "$ dcgmi health -c\n"
        "+---------------------------+----------------------------------------------------------+\n"
        "| Health Monitor Report                                                                |\n"
        "+===========================+==========================================================+\n"
        "| Overall Health            | Warning                                                  |\n"
        "| GPU ID: 0                 | Warning                                                  |\n"
        "|                           | PCIe system: Warning - Detected more than 8 PCIe         |\n"
        "|                           | replays per minute for GPU 0 : 13                        |\n"
        "+---------------------------+----------------------------------------------------------+\n"
    )
    records, _ = parse(text)
    got = {(e.entity, e.code) for e in events(records, "dcgm_health")}
    assert got == {("node", "warning"), ("gpu:0", "warning")}
    gpu = next(e for e in events(records, "dcgm_health") if e.entity == "gpu:0")
    assert "PCIe replays" in gpu.attrs["message"]


# ----------------------------------------------------------------------------- dmon


def test_dmon_last_xid_and_blanks() -> None:
    text = (
        "$ dcgmi dmon -c 1 -e 230,155,150\n"
        "#Entity   XIDER   POWER   TMPTR\n"
        "ID\n"
        "GPU 0     0       N/A     35\n"
        "GPU 1     120     9223372036854775794   36\n"
    )
    records, _ = parse(text)
    xid = {s.entity: s.value for s in samples(records, "gpu_last_xid")}
    assert xid == {"gpu:0": 0, "gpu:1": 120}
    assert samples(records, "gpu_power_watts") == []
    assert len(samples(records, "gpu_temperature_celsius")) == 2


def test_blank_sentinels() -> None:
    assert is_blank(0x7FFFFFFFFFFFFFF0)
    assert is_blank(0x7FFFFFF2)
    assert is_blank(float("nan"))
    assert not is_blank(0)
    assert not is_blank(2_500_000_000.0)


# ---------------------------------------------------------------------------- nvlink


def test_nvlink_link_status_all_down_no_switches() -> None:
    records, _ = parse(case_text("009"))
    states = samples(records, "gpu_nvlink_state")
    assert len(states) == 36
    assert all(s.value == 0 for s in states)
    assert [e.code for e in events(records, "nvswitch_inventory")] == ["absent"]


def test_nvlink_link_status_switches_and_disabled() -> None:
    text = (
        "$ dcgmi nvlink -s\n"
        "+----------------------+\n"
        "|  NvLink Link Status  |\n"
        "+----------------------+\n"
        "GPUs:\n"
        "    gpuId 0:\n"
        "        U U X _ D\n"
        "NvSwitches:\n"
        "    physicalId 8:\n"
        "        U U U U\n"
    )
    records, _ = parse(text)
    states = {s.labels["link"]: s.value for s in samples(records, "gpu_nvlink_state")}
    assert states == {"0": 1, "1": 1, "4": 0}
    assert [e.code for e in events(records, "nvswitch_inventory")] == ["present"]


# ------------------------------------------------------------------------ exporter


def test_exporter_scrape_case() -> None:
    records, result = parse(case_text("033"))
    assert result.kinds == ["dcgm_exporter"]
    assert result.issues == []
    sm = samples(records, "gpu_sm_clock_hertz")
    assert [s.value for s in sm] == [135e6, 135e6]
    assert sm[0].entity == "GPU-0a1b2c3d-1111-4e2f-8a01-5c6d7e8f9a01"
    assert sm[0].node == "node-a"
    assert len(samples(records, "gpu_pcie_replays_total")) == 4


SCRAPE = """# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{gpu="1",UUID="GPU-aaaa",pci_bus_id="00000000:3B:00.0",hostname="gpu-7"} 79
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-aaaa",pci_bus_id="00000000:3B:00.0",hostname="gpu-7"} 4
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{gpu="1",UUID="GPU-aaaa",pci_bus_id=""} 2
DCGM_FI_DEV_ROW_REMAP_FAILURE{gpu="1",uuid="GPU-bbbb"} 9223372036854775794
DCGM_FI_DEV_GPU_TEMP{gpu="1" broken
DCGM_FI_DEV_GPU_UTIL{gpu="2"} 55
DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="2"} 0.5
"""


def test_exporter_mapping_sentinels_and_bad_line() -> None:
    records, result = parse(SCRAPE)
    xid = samples(records, "gpu_last_xid")[0]
    assert (xid.entity, xid.node, xid.value) == ("0000:3b:00.0", "gpu-7", 79)
    assert samples(records, "gpu_memory_used_bytes")[0].value == 4 * 1024 * 1024
    rows = samples(records, "gpu_remapped_rows")[0]
    assert rows.entity == "GPU-aaaa"
    assert rows.labels == {"type": "uncorrectable"}
    assert samples(records, "gpu_row_remap_failure") == []
    assert samples(records, "gpu_utilization_ratio")[0].entity == "gpu:2"
    assert [i.line for i in result.issues] == [7]


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        del format, args


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.body = (
        Path(cases_dir()) / next(p.name for p in cases_dir().glob("033-*"))
    ).read_bytes() + SCRAPE.encode()
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_collector_scrapes_and_counts_bad_lines(server: str) -> None:
    collector = DcgmExporterCollector(node="node-z", url=f"{server}/metrics", timeout_seconds=2)
    records = collector.collect()
    assert collector.name == "dcgm_exporter"
    metrics = {r.metric for r in records if isinstance(r, Sample)}
    assert {"gpu_sm_clock_hertz", "gpu_last_xid", "gpu_pcie_replays_total"} <= metrics
    assert all(isinstance(r, Sample) and r.observed_at is not None for r in records)
    assert collector.malformed_lines == 1


def test_collector_unavailable(server: str) -> None:
    with pytest.raises(CollectorUnavailable):
        DcgmExporterCollector(node="n", url=f"{server}/nope", timeout_seconds=2).collect()
    with pytest.raises(CollectorUnavailable):
        DcgmExporterCollector(
            node="n", url="http://127.0.0.1:9/metrics", timeout_seconds=1
        ).collect()


def test_collector_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_seconds"):
        DcgmExporterCollector(node="n", url="http://x/metrics", timeout_seconds=0)


@pytest.mark.parametrize("text", ["", "{", "| Warning | x\n|   | y", "#Entity XIDER\nGPU x 1"])
def test_garbage_never_raises(text: str) -> None:
    parse(text)


def test_exporter_clock_event_bitmask_and_old_names() -> None:
    text = (
        'DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:3B:00.0"}'
        " 136\n"
        'dcgm_gpu_temp{gpu="0",uuid="GPU-bbbb"} 40\n'
    )
    records, _ = parse(text)
    active = {s.labels["reason"] for s in samples(records, "gpu_clock_event_active") if s.value}
    assert active == {"hw_slowdown", "hw_power_brake"}
    temp = samples(records, "gpu_temperature_celsius")[0]
    assert (temp.entity, temp.value) == ("GPU-bbbb", 40)


def test_hostengine_log_health_incidents() -> None:
    text = (
        "2025-12-22 10:00:01.123 ERROR [1514002:1514004] [[Health]] Detected a WARNING in health "
        "system Thermal: 'Detected clocks event due to thermal violation in GPU 2. Verify that "
        "the cooling on this machine is functional.' [/builds/dcgm/modules/health/Health.cpp:99]\n"
        "2025-12-22 10:00:02.123 ERROR [1514002:1514004] [[Health]] Detected a FAILURE in health "
        "system Memory: 'A DBE has occurred on GPU 1.' [/builds/dcgm/Health.cpp:99]\n"
        "2025-12-22 10:00:03.000 DEBUG [1514002:1514004] [[Health]] nothing to see\n"
    )
    records, result = parse(text)
    assert result.kinds == ["dcgm_log"]
    (thermal,) = events(records, "thermal_violation")
    assert thermal.entity == "gpu:2"
    (health,) = events(records, "dcgm_health")
    assert (health.entity, health.code) == ("gpu:1", "failure")


def test_exporter_windowed_counts() -> None:
    text = (
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="0",UUID="GPU-aaaa",xid="79",window_size_in_ms="300000"} 2\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="1",UUID="GPU-bbbb",xid="13",window_size_in_ms="300000"} 0\n'
        'DCGM_EXP_CLOCK_EVENTS_COUNT{gpu="0",UUID="GPU-aaaa",clock_event="hw_thermal"} 3\n'
    )
    records, _ = parse(text)
    (xid,) = events(records, "xid")
    assert (xid.entity, xid.code, xid.attrs["count"]) == ("GPU-aaaa", "79", "2")
    (thermal,) = samples(records, "gpu_clock_event_active")
    assert (thermal.labels["reason"], thermal.value) == ("hw_thermal", 1)


# ------------------------------------------------------- variants of real artifacts


HEALTH_V2 = (
    "+---------------------------+----------------------------------------------------------+\n"
    "| Health Monitor Report                                                                |\n"
    "+===========================+==========================================================+\n"
    "| Overall Health            | Warning                                                  |\n"
    "| GPU                       |                                                          |\n"
    "| -> 0                      | Warning                                                  |\n"
    "|    -> Errors              |                                                          |\n"
    "|       -> PCIe system      | Warning                                                  |\n"
    "|                           | Detected more than 8 PCIe replays per minute for GPU 0   |\n"
    "|                           | : 13 Reconnect PCIe card. Run system side PCIE diagnosti |\n"
    "|                           | c utilities to verify hops off the GPU board If issue is |\n"
    "|                           |  on the board, run the field diagnostic.                 |\n"
    "| -> 3                      | Failure                                                  |\n"
    "|    -> Errors              |                                                          |\n"
    "|       -> Memory system    | Failure                                                  |\n"
    "|                           | GPU 3 had uncorrectable memory errors and row remapping  |\n"
    "|                           | failed.                                                  |\n"
    "+---------------------------+----------------------------------------------------------+\n"
)


def test_health_table_dcgm2_layout_per_gpu_and_known_messages() -> None:
    records, result = parse(HEALTH_V2)
    got = {(e.entity, e.code) for e in events(records, "dcgm_health")}
    assert got == {("node", "warning"), ("gpu:0", "warning"), ("gpu:3", "failure")}
    gpu0 = next(e for e in events(records, "dcgm_health") if e.entity == "gpu:0")
    # wrapped mid-word at the cell width and rejoined
    assert "PCIE diagnostic utilities" in gpu0.attrs["message"]
    assert "issue is on the board" in gpu0.attrs["message"]
    (remap,) = events(records, "dcgm_diag_error")
    assert (remap.code, remap.entity) == ("row_remap_failure", "gpu:3")
    gpu3 = next(e for e in events(records, "dcgm_health") if e.entity == "gpu:3")
    assert gpu3.attrs.get("explained") == "yes"
    assert result.issues == []


def test_known_dcgm_messages() -> None:
    ctx = ParseContext(file="f", node=NodeName("n"))
    line = Line(1, "x")
    text = (
        "Detected XID 79 for GPU 3. Detected 2 volatile double-bit ECC error(s) in GPU 1. "
        "A pending retired page has been detected in GPU 2. "
        "Detected clock throttling due to thermal violation in GPU 0. "
        "GPU 4 had memory errors and row remappings are pending"
    )
    records = list(dcgm.known_messages(ctx, text, EntityId("node"), [line], "health"))
    kinds = {
        (type(r).__name__, getattr(r, "kind", getattr(r, "metric", "")), r.entity) for r in records
    }
    assert ("Event", "xid", "gpu:3") in kinds
    assert ("Sample", "gpu_ecc_errors_total", "gpu:1") in kinds
    assert ("Event", "dcgm_diag_error", "gpu:2") in kinds
    assert ("Event", "thermal_violation", "gpu:0") in kinds
    assert ("Event", "dcgm_diag_error", "gpu:4") in kinds


def test_exporter_legacy_names_and_bitmask() -> None:
    text = (
        'dcgm_ecc_dbe_volatile_total{gpu="1",uuid="GPU-99999999-0000-0000-0000-000000000001"} 3\n'
        'dcgm_retired_pages_pending{gpu="1",uuid="GPU-99999999-0000-0000-0000-000000000001"} 1\n'
        'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0",UUID="GPU-d0000000-0000-0000-0000-000000000000"}'
        " 136\n"
    )
    records, result = parse(text)
    (ecc,) = samples(records, "gpu_ecc_errors_total")
    assert ecc.value == 3
    assert ecc.labels["scope"] == "volatile"
    assert samples(records, "gpu_retired_pages_pending")[0].value == 1
    active = {r.labels["reason"] for r in samples(records, "gpu_clock_event_active") if r.value}
    assert active == {"hw_slowdown", "hw_power_brake"}
    assert result.issues == []
