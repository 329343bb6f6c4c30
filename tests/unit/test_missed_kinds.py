"""Fault kinds that were missed (issue #14 item 7) diagnose as an expert would.

Each file in ``tests/fixtures/artifacts/missed`` is a real artifact from a public
issue tracker (``README.md`` there names the source); ``expected.json`` beside them
gives the verdict in the format of ``../shared/cases/expected.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuhealth.diagnose import diagnose

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "artifacts" / "missed"
EXPECTED: dict[str, dict[str, object]] = json.loads((FIXTURES / "expected.json").read_text())


def _diagnose(path: Path, context: dict[str, str] | None = None) -> dict[str, object]:
    result = diagnose([str(path)], context or {})
    assert result.exit_status != 4
    out: dict[str, object] = result.to_json()
    return out


def test_every_fixture_has_a_verdict() -> None:
    meta = {"expected.json", "README.md"}
    files = {p.name for p in FIXTURES.iterdir() if p.is_file() and p.name not in meta}
    assert files == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_missed_kind(name: str) -> None:
    expected = EXPECTED[name]
    context = expected.get("context", {})
    assert isinstance(context, dict)
    out = _diagnose(FIXTURES / name, context)
    detail = json.dumps({"findings": out["findings"], "errors": out["errors"]}, indent=1)[:4000]
    assert out["worst_severity"] == expected["worst_severity"], detail
    acceptable = expected["acceptable_actions"]
    assert isinstance(acceptable, list)
    assert set(out["worst_actions"]) <= set(acceptable), detail  # type: ignore[arg-type]


def test_shm_failure_folds_the_system_error() -> None:
    out = _diagnose(FIXTURES / "nccl-2.4-shm-open-permission-denied-unhandled-system-error.log")
    findings = out["findings"]
    assert isinstance(findings, list)
    assert [f["kind"] for f in findings] == ["shm"]
    assert "Permission denied" in findings[0]["summary"]


def test_local_protection_error_on_one_node_stays_a_warning(tmp_path: Path) -> None:
    text = (FIXTURES / "nccl-2.x-two-nodes-vm-error-4-local-protection-gdr.log").read_text()
    one = tmp_path / "one.log"
    one.write_text("\n".join(ln for ln in text.splitlines() if ln.startswith("node-b")) + "\n")
    out = _diagnose(one)
    assert out["worst_severity"] == "warning"
    assert out["worst_actions"] == ["restart_app"]


def test_local_protection_error_without_gdr_stays_a_warning(tmp_path: Path) -> None:
    text = (FIXTURES / "nccl-2.x-two-nodes-vm-error-4-local-protection-gdr.log").read_text()
    off = tmp_path / "off.log"
    off.write_text(
        "node-a:58934:58934 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 0\n" + text
    )
    out = _diagnose(off)
    assert out["worst_severity"] == "warning"


# --- netdev counters: ifconfig, /proc/net/dev, sysfs statistics ---------------------------


def _second_reading(path: Path, tmp_path: Path, old: str, new: str) -> Path:
    """Two readings of one real artifact, the second with ``old`` replaced by ``new``."""
    text = path.read_text()
    assert old in text
    both = tmp_path / path.name
    both.write_text(text + "\n$ ifconfig eth0\n" + text.replace(old, new))
    return both


def test_ifconfig_errors_rising_between_readings_are_major(tmp_path: Path) -> None:
    both = _second_reading(
        FIXTURES / "ifconfig-1.60-eth0-rx-dropped-7183-no-errors.txt",
        tmp_path,
        "errors:0 dropped:7183",
        "errors:41 dropped:7190",
    )
    out = _diagnose(both)
    assert (out["worst_severity"], out["worst_actions"]) == ("major", ["check_network"])
    findings = out["findings"]
    assert isinstance(findings, list)
    assert "rx_errors +41" in findings[0]["summary"]
    # the same file read again is a new read, not a third reading
    assert _diagnose(both)["worst_severity"] == "major"


def test_ifconfig_drops_rising_alone_are_a_warning(tmp_path: Path) -> None:
    both = _second_reading(
        FIXTURES / "ifconfig-2.x-rx-dropped-3310-no-errors.txt",
        tmp_path,
        "dropped 3310",
        "dropped 3999",
    )
    out = _diagnose(both)
    assert (out["worst_severity"], out["worst_actions"]) == ("warning", ["check_network"])


def test_ifconfig_errors_in_one_snapshot_are_a_warning(tmp_path: Path) -> None:
    one = tmp_path / "one.txt"
    text = (FIXTURES / "ifconfig-2.x-rx-dropped-3310-no-errors.txt").read_text()
    one.write_text(text.replace("RX errors 0", "RX errors 17"))
    out = _diagnose(one)
    assert (out["worst_severity"], out["worst_actions"]) == ("warning", ["check_network"])


def test_sysfs_statistics_loop_is_read(tmp_path: Path) -> None:
    dump = tmp_path / "sysfs.txt"
    names = ["rx_bytes", "rx_crc_errors", "rx_dropped", "rx_errors", "tx_errors", "tx_dropped"]
    lines = [f"{n}: {7183 if n == 'rx_dropped' else 0}" for n in names]
    dump.write_text(
        "$ for t in /sys/class/net/eth0/statistics/{rx,tx}_*; do "
        'echo "$(basename $t): $(<$t)"; done\n'
        + "\n".join(lines)
        + "\n"
    )
    assert _diagnose(dump)["worst_severity"] == "info"
    dump.write_text(dump.read_text().replace("rx_crc_errors: 0", "rx_crc_errors: 9"))
    out = _diagnose(dump)
    findings = out["findings"]
    assert isinstance(findings, list)
    assert (out["worst_severity"], findings[0]["entity"]) == ("warning", "eth0")


def test_network_collector_reports_rises_that_the_same_rule_judges(tmp_path: Path) -> None:
    from analytics.fault_model import Context, Observations, evaluate
    from collectors.network import NetworkCollector
    from core.clock import FakeClock

    stats = tmp_path / "sys" / "class" / "net" / "eth0" / "statistics"
    stats.mkdir(parents=True)
    (tmp_path / "proc").mkdir()
    for name, value in (("rx_errors", 5), ("rx_dropped", 10), ("rx_bytes", 100)):
        (stats / name).write_text(f"{value}\n")
    clock = FakeClock(now=100.0)
    coll = NetworkCollector(
        node="n1", proc_root=str(tmp_path / "proc"), sys_root=str(tmp_path / "sys"), clock=clock
    )
    obs = Observations()
    obs.extend(coll.collect())
    assert evaluate(obs, Context()) == []  # old errors alone do not alert in run
    clock.now = 130.0
    (stats / "rx_errors").write_text("9\n")
    obs.extend(coll.collect())
    findings = evaluate(obs, Context())
    assert [(f.kind, f.code, f.severity.value) for f in findings] == [
        ("nic_port", "rx_errors_rising", "major")
    ]


# --- NIC bonds ----------------------------------------------------------------------------


def test_bond_with_link_failures_in_a_snapshot_is_a_warning(tmp_path: Path) -> None:
    text = (FIXTURES / "proc-net-bonding-active-backup-two-members-healthy.txt").read_text()
    one = tmp_path / "bond.txt"
    one.write_text(text.replace("Link Failure Count: 0", "Link Failure Count: 3", 1))
    out = _diagnose(one)
    assert (out["worst_severity"], out["worst_actions"]) == ("warning", ["check_network"])
    findings = out["findings"]
    assert isinstance(findings, list)
    assert findings[0]["entity"] == "bond0"


def test_network_collector_reads_bonds_that_the_same_rule_judges(tmp_path: Path) -> None:
    from analytics.fault_model import Context, Observations, evaluate
    from collectors.network import NetworkCollector
    from core.catalog import BY_NAME
    from core.clock import FakeClock
    from core.records import Sample

    healthy = "\n".join(
        (FIXTURES / "proc-net-bonding-active-backup-two-members-healthy.txt")
        .read_text()
        .splitlines()[1:]
    )
    bonding = tmp_path / "proc" / "net" / "bonding"
    bonding.mkdir(parents=True)
    (bonding / "bond0").write_text(healthy)
    clock = FakeClock(now=100.0)
    coll = NetworkCollector(
        node="n1", proc_root=str(tmp_path / "proc"), sys_root=str(tmp_path / "sys"), clock=clock
    )
    first = coll.collect()
    metrics = {r.metric for r in first if isinstance(r, Sample)}
    assert {"net_bond_members", "net_bond_members_active", "net_bond_member_up"} <= metrics
    assert metrics <= set(BY_NAME)
    obs = Observations()
    obs.extend(first)
    assert evaluate(obs, Context()) == []
    # eth1 went down and came back between two collections: flapping
    eth1 = "Link Failure Count: 0\nPermanent HW addr: 02:00:5e:10:00:56"
    (bonding / "bond0").write_text(healthy.replace(eth1, eth1.replace(": 0", ": 1")))
    clock.now = 130.0
    obs.extend(coll.collect())
    found = evaluate(obs, Context())
    assert [(f.kind, f.code, f.severity.value) for f in found] == [
        ("bond", "member_flapping", "major")
    ]
    # eth1 is down now: the bond runs on one member
    (bonding / "bond0").write_text(
        healthy.replace("eth1\nMII Status: up", "eth1\nMII Status: down")
    )
    clock.now = 160.0
    obs.extend(coll.collect())
    found = evaluate(obs, Context())
    assert ("bond", "members_down", "major") in [(f.kind, f.code, f.severity.value) for f in found]


# --- Kubernetes node conditions and taints -------------------------------------------------


def test_nvsentinel_dcgm_condition_is_judged_by_the_state_it_names(tmp_path: Path) -> None:
    # The condition example of NVSentinel docs/INTEGRATION.md ("Condition Message Format").
    doc = tmp_path / "node.yaml"
    doc.write_text(
        "conditions:\n"
        "  - type: GpuMemoryError\n"
        '    status: "True"\n'
        "    reason: HardwareFailure\n"
        '    message: "[DCGM_FR_FAULTY_MEMORY] GPU memory failure detected on GPU 0 - '
        'RecommendedAction: RESTART_VM"\n'
        '    lastTransitionTime: "2025-11-06T10:00:00Z"\n'
    )
    out = _diagnose(doc)
    assert (out["worst_severity"], out["worst_actions"]) == ("critical", ["service_hardware"])


def test_taint_alone_names_no_fault(tmp_path: Path) -> None:
    # The taint of NVSentinel docs/INTEGRATION.md ("Default Taint Examples").
    doc = tmp_path / "describe.txt"
    doc.write_text(
        "$ kubectl describe node node-a\n"
        "Taints:             nvidia.com/gpu-xid-error=true:NoSchedule\n"
        "                    node.kubernetes.io/unschedulable:NoSchedule\n"
        "Unschedulable:      true\n"
    )
    out = _diagnose(doc)
    assert (out["worst_severity"], out["worst_actions"]) == ("warning", ["none"])


def test_condition_naming_a_fatal_xid_is_judged_as_that_xid(tmp_path: Path) -> None:
    gke = FIXTURES / "kubectl-describe-node-gke-device-plugin-xidcriticalerror-31.txt"
    text = gke.read_text()
    doc = tmp_path / "describe.txt"
    doc.write_text(text.replace('{"31":true}', '{"48":true}'))
    out = _diagnose(doc)
    assert (out["worst_severity"], out["worst_actions"]) == ("critical", ["reset_gpu"])


# --- monitoring agents without their DCGM host engine --------------------------------------


def test_host_engine_unreachable_is_no_gpu_finding() -> None:
    out = _diagnose(FIXTURES / "dcgm-exporter-2.1-stale-metrics-host-engine-connection-invalid.log")
    findings = out["findings"]
    assert isinstance(findings, list)
    assert [(f["kind"], f["entity"]) for f in findings] == [("telemetry", "node")]


# --- lspci -vv: the links above a GPU -----------------------------------------------------
# Built in lspci -vv's own layout (header, Bus:, Express, LnkCap/LnkSta lines) with the
# values of a PLX PEX 8747 switch under a Sky Lake-E root port and a V100 PCIe below it.

_ROOT = (
    "15:00.0 PCI bridge: Intel Corporation Sky Lake-E PCI Express Root Port A (rev 04)\n"
    "\tBus: primary=00, secondary=16, subordinate=19, sec-latency=0\n"
    "\tCapabilities: [90] Express (v2) Root Port (Slot+), MSI 00\n"
    "\t\tLnkCap:\tPort #5, Speed 8GT/s, Width x{root_cap}, ASPM L1, Exit Latency L1 <16us\n"
    "\t\tLnkSta:\tSpeed 8GT/s, Width x{up_sta}\n\n"
)
_SWITCH = (
    "16:00.0 PCI bridge: PLX Technology, Inc. PEX 8747 48-Lane, 5-Port PCI Express Gen 3 "
    "(8.0 GT/s) Switch (rev ca)\n"
    "\tBus: primary=15, secondary=17, subordinate=19, sec-latency=0\n"
    "\tCapabilities: [68] Express (v2) Upstream Port, MSI 00\n"
    "\t\tLnkCap:\tPort #0, Speed 8GT/s, Width x{up_cap}, ASPM L1, Exit Latency L1 <4us\n"
    "\t\tLnkSta:\tSpeed 8GT/s, Width x{up_sta}\n\n"
    "17:08.0 PCI bridge: PLX Technology, Inc. PEX 8747 48-Lane, 5-Port PCI Express Gen 3 "
    "(8.0 GT/s) Switch (rev ca)\n"
    "\tBus: primary=17, secondary=18, subordinate=18, sec-latency=0\n"
    "\tCapabilities: [68] Express (v2) Downstream Port (Slot+), MSI 00\n"
    "\t\tLnkCap:\tPort #8, Speed 8GT/s, Width x{dp_cap}, ASPM L1, Exit Latency L1 <4us\n"
    "\t\tLnkSta:\tSpeed 2.5GT/s (downgraded), Width x{gpu_sta}\n\n"
    "18:00.0 3D controller: NVIDIA Corporation GV100GL [Tesla V100 PCIe 32GB] (rev a1)\n"
    "\tCapabilities: [68] Express (v2) Endpoint, MSI 00\n"
    "\t\tLnkCap:\tPort #0, Speed 8GT/s, Width x{gpu_cap}, ASPM not supported\n"
    "\t\tLnkSta:\tSpeed 2.5GT/s (downgraded), Width x{gpu_sta}\n"
)


def _lspci(tmp_path: Path, **widths: int) -> dict[str, object]:
    values = {"root_cap": 16, "up_cap": 16, "up_sta": 16, "dp_cap": 16, "gpu_cap": 16,
              "gpu_sta": 16}
    values.update(widths)
    path = tmp_path / "lspci.txt"
    path.write_text("$ sudo lspci -vv\n" + (_ROOT + _SWITCH).format(**values))
    return _diagnose(path)


def test_lspci_bridge_link_that_lost_lanes_is_major(tmp_path: Path) -> None:
    out = _lspci(tmp_path, up_sta=8)
    assert (out["worst_severity"], out["worst_actions"]) == ("major", ["service_hardware"])
    findings = out["findings"]
    assert isinstance(findings, list)
    summary = findings[0]["summary"]
    assert "0000:15:00.0" in summary
    assert "trained at 8 GT/s x8" in summary


def test_lspci_bridge_at_its_devices_lower_capability_is_normal(tmp_path: Path) -> None:
    # the root port can do x16, the switch's upstream port only x8: x8 is all the link can do
    out = _lspci(tmp_path, up_cap=8, up_sta=8)
    assert out["worst_severity"] == "info"
    out = _lspci(tmp_path, gpu_cap=8, gpu_sta=8)  # the same for the GPU below its port
    assert out["worst_severity"] == "info"


def test_lspci_gpu_at_its_ports_lower_capability_is_normal(tmp_path: Path) -> None:
    out = _lspci(tmp_path, dp_cap=8, gpu_sta=8)
    assert out["worst_severity"] == "info"


def test_lspci_speed_drop_at_idle_is_info(tmp_path: Path) -> None:
    out = _lspci(tmp_path)
    assert out["worst_severity"] == "info"


# --- peers in one artifact: benchmark stragglers, saturated IB counters ---------------------


def test_gpu_burn_straggler_is_major(tmp_path: Path) -> None:
    # gpu-burn's progress line: one "count (rate Gflop/s)" pair per GPU, GPU order.
    burn = tmp_path / "burn.txt"
    burn.write_text(
        "$ ./gpu_burn 60\n"
        "50.0%  proc'd: 1160 (17583 Gflop/s) - 1161 (17601 Gflop/s) - 410 (6102 Gflop/s)"
        " - 1158 (17560 Gflop/s)   errors: 0 - 0 - 0 - 0   temps: 61 C - 60 C - 59 C - 62 C\n"
        "100.0%  proc'd: 2334 (17590 Gflop/s) - 2330 (17588 Gflop/s) - 820 (6090 Gflop/s)"
        " - 2331 (17570 Gflop/s)   errors: 0 - 0 - 0 - 0   temps: 63 C - 62 C - 60 C - 64 C\n"
    )
    out = _diagnose(burn)
    assert (out["worst_severity"], out["worst_actions"]) == ("major", ["service_hardware"])
    findings = out["findings"]
    assert isinstance(findings, list)
    assert findings[0]["entity"] == "gpu:2"


def test_benchmark_without_straggler_is_info(tmp_path: Path) -> None:
    text = (FIXTURES / "ubergemm-a100-adapter0-third-of-peers-gflops.txt").read_text()
    healthy = tmp_path / "ubergemm.txt"
    healthy.write_text(text.replace("6698.442948608", "19201.44"))
    assert _diagnose(healthy)["worst_severity"] == "info"


_EXPORTER = (
    "# TYPE {p}symbol_error_total counter\n"
    '{p}symbol_error_total{{device="mlx5_0",port="1"}} {sym}\n'
    "# TYPE {p}link_downed_total counter\n"
    '{p}link_downed_total{{device="mlx5_0",port="1"}} {down}\n'
    "# TYPE {p}link_error_recovery_total counter\n"
    '{p}link_error_recovery_total{{device="mlx5_0",port="1"}} {rec}\n'
)


def test_ib_exporter_saturated_counters_are_history(tmp_path: Path) -> None:
    # node_exporter's infiniband collector series (collector/infiniband_linux.go names)
    scrape = tmp_path / "metrics.prom"
    scrape.write_text(_EXPORTER.format(p="node_infiniband_", sym=65535, down=255, rec=255))
    out = _diagnose(scrape)
    assert (out["worst_severity"], out["worst_actions"]) == ("warning", ["check_network"])
    findings = out["findings"]
    assert isinstance(findings, list)
    assert "history, not a rate" in findings[0]["summary"]
    scrape.write_text(_EXPORTER.format(p="node_infiniband_", sym=0, down=0, rec=0))
    assert _diagnose(scrape)["worst_severity"] == "info"


def test_infiniband_exporter_names_are_read(tmp_path: Path) -> None:
    # guilbaults/infiniband-exporter: infiniband_<perfquery name lower-cased>_total
    scrape = tmp_path / "metrics.prom"
    scrape.write_text(
        'infiniband_symbolerrorcounter_total{guid="0x0002c903001234",port="7"} 65535\n'
        'infiniband_linkdownedcounter_total{guid="0x0002c903001234",port="7"} 255\n'
    )
    out = _diagnose(scrape)
    assert (out["worst_severity"], out["worst_actions"]) == ("warning", ["check_network"])


def test_torch_dataloader_out_of_shm_is_the_same_config_fault(tmp_path: Path) -> None:
    # torch/utils/data/_utils/signal_handling.py and dataloader.py messages
    log = tmp_path / "train.log"
    log.write_text(
        "ERROR: Unexpected bus error encountered in worker. This might be caused by "
        "insufficient shared memory (shm).\n"
        "RuntimeError: DataLoader worker (pid 1234) is killed by signal: Bus error. It is "
        "possible that dataloader's workers are out of shared memory. Please try to raise "
        "your shared memory limit.\n"
    )
    out = _diagnose(log)
    assert (out["worst_severity"], out["worst_actions"]) == ("major", ["fix_config"])


def test_local_protection_error_with_peermem_gdr_on_two_nodes(tmp_path: Path) -> None:
    # NCCL >= 2.1x wording ("with status=4 opcode=..."), GDR announced by the IB plugin
    log = tmp_path / "nccl.log"
    log.write_text(
        "node-a:100:100 [0] NCCL INFO NET/IB : GPU Direct RDMA (nvidia-peermem) enabled for "
        "HCA 0 'mlx5_0'\n"
        "node-a:100:110 [0] transport/net_ib.cc:1192 NCCL WARN NET/IB : Got completion from "
        "peer 192.0.2.12<60054> with status=4 opcode=0 len=0 vendor err 81 (Send)\n"
        "node-b:200:210 [0] transport/net_ib.cc:1192 NCCL WARN NET/IB : Got completion from "
        "peer 192.0.2.11<60055> with status=4 opcode=0 len=0 vendor err 81 (Recv)\n"
    )
    out = _diagnose(log)
    assert (out["worst_severity"], out["worst_actions"]) == ("major", ["fix_config"])


def test_ip_json_link_statistics_are_read(tmp_path: Path) -> None:
    # iproute2 `ip -j -s link` layout (print_link_stats64 keys)
    doc = tmp_path / "ip.json"
    link = (
        '[{"ifindex":2,"ifname":"eth0","flags":["UP","LOWER_UP"],"mtu":1500,'
        '"operstate":"UP","stats64":{"rx":{"bytes":123456789,"packets":987654,"errors":%d,'
        '"dropped":0,"over_errors":0,"multicast":1234},"tx":{"bytes":987654321,'
        '"packets":123456,"errors":0,"dropped":0,"carrier_errors":0,"collisions":0}}}]\n'
    )
    doc.write_text("$ ip -j -s link show eth0\n" + link % 0)
    assert _diagnose(doc)["worst_severity"] == "info"
    doc.write_text("$ ip -j -s link show eth0\n" + link % 7)
    out = _diagnose(doc)
    assert (out["worst_severity"], out["worst_actions"]) == ("warning", ["check_network"])
