from __future__ import annotations

import pytest

from analytics.fault_model import Context, Observations, evaluate
from analytics.fault_model import host as host_rules
from analytics.fault_model import xid as xid_rules
from collectors.artifact import ParseContext
from collectors.kernel_log import parse_kernel_lines
from core.records import Action, Finding, NodeName, Severity

RULES = xid_rules.RULES + host_rules.RULES


def judge(lines: list[str], facts: dict[str, str] | None = None) -> list[Finding]:
    obs = Observations()
    obs.extend(parse_kernel_lines(lines, ParseContext(file="k.log", node=NodeName("n1"))))
    return evaluate(obs, Context(facts=facts or {}), RULES)


def top(findings: list[Finding]) -> tuple[Severity, Action]:
    assert findings
    return findings[0].severity, findings[0].action


def xid(
    code: int, msg: str = "msg", pci: str = "0000:3b:00", up: float = 100.0, name: str = "python3"
) -> str:
    return f"[{up:12.6f}] NVRM: Xid (PCI:{pci}): {code}, pid=42, name={name}, {msg}"


def test_xid79_with_symptoms_is_one_finding() -> None:
    found = judge(
        [
            "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error",
            xid(79, "GPU has fallen off the bus."),
            "[  100.000001] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        ]
    )
    assert len(found) == 1
    (f,) = found
    assert (f.kind, f.code, f.entity) == ("xid", "79", "0000:3b:00.0")
    assert (f.severity, f.action) == (Severity.CRITICAL, Action.REBOOT_NODE)
    assert len(f.evidence) == 3
    assert f.occurrences == 3


def test_gpu_lost_after_reboot_needs_service() -> None:
    found = judge([xid(79, up=500.0), "[    0.000000] Linux version 6.8", xid(79, up=40.0)])
    assert top(found) == (Severity.CRITICAL, Action.SERVICE_HARDWARE)
    assert "recurred after a reboot" in found[0].summary


def test_fallen_off_bus_without_xid_and_probe_failure() -> None:
    found = judge(
        [
            "[ 1843.308145] NVRM: The NVIDIA GPU 0000:c4:00.0",
            "               NVRM: fallen off the bus and is not responding to commands.",
            "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).",
        ]
    )
    assert len(found) == 1
    assert (found[0].kind, found[0].entity) == ("gpu_lost", "0000:c4:00.0")
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)


@pytest.mark.parametrize(
    ("code", "severity", "action"),
    [
        (13, Severity.INFO, Action.RESTART_APP),
        (31, Severity.INFO, Action.RESTART_APP),
        (43, Severity.INFO, Action.NONE),
        (45, Severity.INFO, Action.NONE),
        (48, Severity.CRITICAL, Action.RESET_GPU),
        (62, Severity.CRITICAL, Action.RESET_GPU),
        (63, Severity.WARNING, Action.RESET_GPU),
        (64, Severity.CRITICAL, Action.RESET_GPU),
        (74, Severity.CRITICAL, Action.RESET_GPU),
        (92, Severity.INFO, Action.NONE),
        (94, Severity.WARNING, Action.RESET_GPU),
        (95, Severity.CRITICAL, Action.RESET_GPU),
        (109, Severity.CRITICAL, Action.RESET_GPU),
        (119, Severity.CRITICAL, Action.RESET_GPU),
        (120, Severity.CRITICAL, Action.RESET_GPU),
        (121, Severity.INFO, Action.NONE),
        (140, Severity.CRITICAL, Action.RESET_GPU),
        (143, Severity.CRITICAL, Action.RESET_GPU),
    ],
)
def test_xid_table(code: int, severity: Severity, action: Action) -> None:
    found = judge([xid(code)])
    assert top(found) == (severity, action)
    assert found[0].code == str(code)
    assert "Xid" in found[0].source or "xid" in found[0].source


def test_unknown_xid_falls_back_and_says_so() -> None:
    (f,) = judge([xid(999)])
    assert (f.severity, f.action) == (Severity.WARNING, Action.RESET_GPU)
    assert "not in gpuhealth's Xid table" in f.summary
    assert f.confidence < 1.0


def test_repeating_xid_is_one_finding_with_moving_last_seen() -> None:
    lines = [
        f"Mar  1 10:{i:02d}:{(i * 45) % 60:02d} host kernel: NVRM: Xid (PCI:0000:3b:00): 119, "
        "pid=1, name=a, Timeout waiting for RPC from GSP"
        for i in range(20)
    ]
    (f,) = judge(lines)
    assert f.occurrences == 20
    assert f.first_seen_at is not None
    assert f.last_seen_at is not None
    assert f.last_seen_at > f.first_seen_at
    assert "year" in f.summary
    assert "assumed" in f.summary


def test_app_xid_escalates_under_different_processes_but_43_never() -> None:
    found = judge([xid(13, name="a"), xid(13, name="b", up=200.0)])
    assert top(found) == (Severity.WARNING, Action.RESTART_APP)
    found = judge([xid(43, name="a"), xid(43, name="b", up=200.0)])
    assert top(found) == (Severity.INFO, Action.NONE)
    found = judge([xid(13, name="a"), xid(13, name="a", up=200.0)])
    assert top(found) == (Severity.INFO, Action.RESTART_APP)


def test_xid45_folded_or_standing_for_its_cause() -> None:
    found = judge([xid(62), xid(45, "channel 0x2")])
    assert [f.code for f in found] == ["62"]
    assert len(found[0].evidence) == 2
    found = judge([xid(45, "caused by previous Xid 79")])
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)
    assert found[0].code == "79"


@pytest.mark.parametrize(
    ("to", "severity", "action"),
    [
        ("0x1 (GPU Reset Required)", Severity.CRITICAL, Action.RESET_GPU),
        ("0x2 (Node Reboot Required)", Severity.CRITICAL, Action.REBOOT_NODE),
        ("0x3 (Drain P2P)", Severity.MAJOR, Action.RESET_GPU),
        ("0x4 (Drain and Reset)", Severity.CRITICAL, Action.RESET_GPU),
        ("0x0 (None)", Severity.INFO, Action.NONE),
        ("0x5 (Recover IMEX Domain)", Severity.MAJOR, Action.CHECK_NETWORK),
        ("0x6 (Bus Reset Required)", Severity.CRITICAL, Action.RESET_GPU),
        ("0x7 (System Reboot Required)", Severity.CRITICAL, Action.REBOOT_NODE),
        ("0x6 (Some Future Wording)", Severity.CRITICAL, Action.RESET_GPU),
        ("0x2", Severity.CRITICAL, Action.REBOOT_NODE),
    ],
)
def test_xid154_recovery_actions(to: str, severity: Severity, action: Action) -> None:
    found = judge([xid(154, f"GPU recovery action changed from 0x0 (None) to {to}")])
    assert top(found) == (severity, action)


def test_gsp_rpc_timeouts_fold_into_xid154() -> None:
    stamp = "192.0.2.1: kern: warning: [2026-04-22T21:30:51.5Z]:"
    found = judge(
        [
            f"{stamp} NVRM: nvAssertFailedNoLog: Assertion failed: Back to back GSP RPC timeout "
            "detected! GPU marked for reset @ kernel_gsp.c:2387",
            f"{stamp} NVRM: _issueRpcAndWait: rpcRecvPoll timedout for fn 76 sequence 4129!",
            f"{stamp} NVRM: Xid (PCI:0000:0b:00): 154, GPU recovery action changed from 0x0 (None) "
            "to 0x1 (GPU Reset Required)",
        ]
    )
    assert len(found) == 1
    assert (found[0].code, found[0].entity) == ("154", "0000:0b:00.0")
    assert len(found[0].evidence) == 3


def test_gsp_rpc_timeout_alone_is_reset() -> None:
    found = judge(["[ 5000.0] NVRM: _issueRpcAndWait: rpcRecvPoll timedout for fn 76 sequence 1!"])
    assert top(found) == (Severity.CRITICAL, Action.RESET_GPU)


def test_boot_time_gsp_failure_is_gpu_lost() -> None:
    found = judge(
        [
            "[   24.302465] NVRM: GPU6 _kgspIsHeartbeatTimedOut: Heartbeat timed out, diff 6070",
            "[   84.300480] NVRM: GPU6 kgmmuCheckMemSubsysError_IMPL: "
            "Memory Subsystem Error detected.",
        ]
    )
    assert len(found) == 1
    assert (found[0].kind, found[0].entity) == ("gpu_lost", "gpu:6")
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)


def test_reset_required_with_cuda_symptom() -> None:
    found = judge(
        [
            "'CUDA-capable device(s) is/are busy or unavailable'",
            "[Sun Jan 11 09:52:01 2026] NVRM: nvAssertOkFailedNoLog: Assertion failed: "
            "Reset required "
            "[NV_ERR_RESET_REQUIRED] (0x00000062) returned from status @ kernel_channel.c:2874",
        ]
    )
    assert len(found) == 1
    assert top(found) == (Severity.CRITICAL, Action.RESET_GPU)
    assert len(found[0].evidence) == 2


def test_symptoms_alone() -> None:
    assert top(judge(["'CUDA-capable device(s) is/are busy or unavailable'"])) == (
        Severity.WARNING,
        Action.RESET_GPU,
    )
    assert (
        top(judge(["Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error"]))[0]
        is Severity.CRITICAL
    )
    assert top(
        judge(["Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost."])
    ) == (Severity.CRITICAL, Action.REBOOT_NODE)


@pytest.mark.parametrize(
    ("line", "severity", "action"),
    [
        (
            "149, NETIR_LINK_EVT Fatal XC0 i0 Link 12 (0x00000004 0x00000020 0x0 0x0)",
            Severity.CRITICAL,
            Action.RESET_GPU,
        ),
        (
            "149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 12 (0x00000004 0x00000020 0x0 0x0)",
            Severity.INFO,
            Action.NONE,
        ),
        (
            "145, RLW_RXPIPE Nonfatal XC0 i0 Link 02 (0x0004b500 0x00000008 0x0 0x0)",
            Severity.INFO,
            Action.NONE,
        ),
        (
            "146, TLW_RX Nonfatal XC0 i0 Link 02 (0x0 0x00000004 0x0 0x0)",
            Severity.CRITICAL,
            Action.RESET_GPU,
        ),
        ("147, TREX Fatal XC0 i0 Link 02 (0x0 0x00000004 0x0 0x0)", Severity.INFO, Action.NONE),
        ("144, something the parser cannot decode", Severity.CRITICAL, Action.RESET_GPU),
        (
            "150, MSE_WATCHDOG Nonfatal XC0 i0 Link 02 (0x0 0x1 0x0 0x0)",
            Severity.CRITICAL,
            Action.RESET_GPU,
        ),
    ],
)
def test_nvlink5_decode(line: str, severity: Severity, action: Action) -> None:
    found = judge([f"[ 10.0] NVRM: Xid (PCI:0018:01:00): {line}"])
    assert top(found) == (severity, action)


def test_xid48_with_64_after_reboot_is_rma() -> None:
    found = judge(
        [xid(48, up=500.0), xid(64, up=500.1), "[    0.000000] Linux version 6.8", xid(48, up=50.0)]
    )
    assert top(found) == (Severity.CRITICAL, Action.SERVICE_HARDWARE)
    found = judge([xid(48), xid(64)])
    assert top(found) == (Severity.CRITICAL, Action.RESET_GPU)


def test_uuid_mapped_to_bus_id() -> None:
    found = judge(
        [
            "[ 1.0] NVRM: GPU at PCI:0000:07:00: GPU-91b3d5e7-2a4c-4f18-b6e0-3c7d9a1f5e28",
            "2024-08-09T13:32:51.873588972Z I0809 health.go:185] XidCriticalError: Xid=94 on "
            "Device=GPU-91b3d5e7-2a4c-4f18-b6e0-3c7d9a1f5e28; marking device as unhealthy.",
        ]
    )
    assert [(f.entity, f.code) for f in found] == [("0000:07:00.0", "94")]


@pytest.mark.parametrize(
    ("line", "severity", "action"),
    [
        (
            "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
            Severity.CRITICAL,
            Action.REBOOT_NODE,
        ),
        (
            "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 11004, Non-fatal, Link 30 Ingress ACL",
            Severity.MAJOR,
            Action.REBOOT_NODE,
        ),
        (
            "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress PRIV",
            Severity.MAJOR,
            Action.REBOOT_NODE,
        ),
        (
            "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link "
            "DLREQ interrupt",
            Severity.INFO,
            Action.NONE,
        ),
        (
            "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 11012, Data {0x0000002b, 0x00000000}",
            Severity.INFO,
            Action.NONE,
        ),
        (
            "nvidia-nvswitch0: SXid (PCI:0000:a9:00.0): 19084, Non-fatal, Link 12 AN1 Heartbeat "
            "Timeout Error",
            Severity.MAJOR,
            Action.REBOOT_NODE,
        ),
    ],
)
def test_sxid(line: str, severity: Severity, action: Action) -> None:
    assert top(judge([f"[ 10.0] {line}"])) == (severity, action)


def test_fabric_manager_failure_without_nvswitch_is_info() -> None:
    found = judge(["Mar 27 17:40:36 host nv-fabricmanager[123]: fabric manager failed to start"])
    assert top(found) == (Severity.INFO, Action.NONE)


def test_peermem_note_is_info() -> None:
    found = judge(
        [
            "[Fri Aug 30 11:11:22 2024] nvidia-peermem nv_get_p2p_free_callback:127 ERROR "
            "detected invalid context, skipping further processing"
        ]
    )
    assert top(found) == (Severity.INFO, Action.NONE)


# ---------------------------------------------------------------- host rules


def test_host_dram_ue_is_node_finding() -> None:
    (f,) = judge(["[11189.97] EDAC MC3: 1 UE memory read error on CPU_SrcID#1_MC#1_Chan#2_DIMM#0"])
    assert (f.entity, f.kind, f.severity, f.action) == (
        "node",
        "host_memory",
        Severity.CRITICAL,
        Action.SERVICE_HARDWARE,
    )


def test_host_dram_ce_rate() -> None:
    assert top(judge(["[1.0] EDAC MC0: 3 CE memory read error on DIMM#0"])) == (
        Severity.INFO,
        Action.NONE,
    )
    assert top(judge(["[1.0] EDAC MC0: 150 CE memory read error on DIMM#0"])) == (
        Severity.WARNING,
        Action.SERVICE_HARDWARE,
    )


def test_aer_on_gpu_vs_other_endpoint() -> None:
    gpu = [
        "[ 104.0] pcieport 0000:00:01.0: AER: Uncorrected (Non-Fatal) error received: 0000:01:00.0",
        "[ 104.1] nvidia 0000:01:00.0:   device [10de:2330] error status/mask=00004000/00000000",
    ]
    (f,) = judge(gpu)
    assert (f.entity, f.severity, f.action) == (
        "0000:01:00.0",
        Severity.CRITICAL,
        Action.REBOOT_NODE,
    )
    nvme = [
        "[ 104.0] pcieport 0000:80:01.0: AER: Uncorrected (Non-Fatal) error received: 0000:81:00.0",
        "[ 104.1] nvme 0000:81:00.0:   device [144d:a808] error status/mask=00004000/00000000",
    ]
    (f,) = judge(nvme)
    assert (f.entity, f.severity, f.action) == ("node", Severity.WARNING, Action.SERVICE_HARDWARE)
    corrected = ["[ 1.0] pcieport 0000:80:01.0: AER: Corrected error received: 0000:81:00.0"]
    assert top(judge(corrected)) == (Severity.INFO, Action.NONE)


def test_aer_on_bus_id_tied_to_gpu_by_the_log() -> None:
    found = judge(
        [
            xid(13, pci="0000:01:00"),
            "[ 104.0] pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0",
        ]
    )
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)


def test_bandwidth_limited_is_info() -> None:
    found = judge(
        [
            "[   10.735323] pci 0000:04:00.0: 252.048 Gb/s available PCIe bandwidth, "
            "limited by 16.0 GT/s PCIe x16 link at 0000:01:00.0 "
            "(capable of 504.112 Gb/s with 32.0 GT/s PCIe x16 link)"
        ]
    )
    assert top(found) == (Severity.INFO, Action.NONE)


def test_nothing_in_nothing_out() -> None:
    assert judge([]) == []
    assert judge(["[ 1.0] usb 1-1: new device", "garbage"]) == []


def test_newer_kernel_aer_wording() -> None:
    found = judge(
        [
            "[ 5.0] pcieport 0000:00:01.1: AER: Uncorrectable (Fatal) error message received from "
            "0000:01:00.0",
            "[ 5.1] nvidia 0000:01:00.0: PCIe Bus Error: severity=Uncorrectable (Fatal), "
            "type=Transaction Layer, (Receiver ID)",
        ]
    )
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)
    found = judge(
        ["[ 5.0] pcieport 0000:00:01.1: AER: Correctable error message received from 0000:41:00.0"]
    )
    assert top(found) == (Severity.INFO, Action.NONE)
    assert found[0].code.startswith("corrected")


def test_multiline_xid13_burst_is_one_event() -> None:
    stamp = "[Fri Aug 30 11:43:09 2024]"
    found = judge(
        [
            f"{stamp} NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM "
            "Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
            f"{stamp} NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM "
            "Global Exception on (GPC 7, TPC 7, SM 0): Multiple Warp Errors",
            f"{stamp} NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics "
            "Exception: ESR 0x57c730=0xc04000b",
        ]
    )
    (f,) = found
    assert (f.code, f.severity, f.action, f.occurrences) == (
        "13",
        Severity.INFO,
        Action.RESTART_APP,
        1,
    )
    assert len(f.evidence) == 3


def test_other_driver_wordings_of_gpu_loss() -> None:
    found = judge(
        [
            "[ 900.0] NVRM: nvCheckOkFailedNoLog: Check failed: GPU lost from the bus "
            "[NV_ERR_GPU_IS_LOST] (0x0000000F) returned from x",
        ]
    )
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)
    found = judge(["[ 5.2] NVRM: GPU0 kgspInitRm_IMPL: cannot bootstrap riscv/gsp: 0x62"])
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)
    found = judge(
        ["[ 9.0] NVRM: GPU 0000:3c:00.0: GPU does not have the necessary power cables connected."]
    )
    assert top(found) == (Severity.CRITICAL, Action.SERVICE_HARDWARE)


def test_xid119_gsp_timeout_report_is_one_event() -> None:
    found = judge(
        [
            xid(119, "Timeout after 6s of waiting for RPC response from GPU1 GSP!", up=5000.0),
            "[ 5000.1] NVRM: GPU1 _kgspLogXid119: ************** GSP Timeout **************",
            "[ 5000.2] NVRM: GPU1 _kgspLogXid119: Note: Please also check logs above.",
            "[ 5000.3] NVRM: GPU1 GPU Board Serial Number: 1234",
            "[ 5000.4] NVRM: GPU1 RPC history (CPU -> GSP):",
            "[ 5000.5] NVRM:     entry function  sequence",
        ]
    )
    assert [(f.code, f.severity, f.action) for f in found] == [
        ("119", Severity.CRITICAL, Action.RESET_GPU)
    ]
    assert len(found[0].evidence) == 6


def test_gsp_heartbeat_after_driver_load_in_journal_is_boot_failure() -> None:
    day = "2024-03-27T17:40"
    boot = judge(
        [
            f"{day}:00+0000 h kernel: NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.86.15",
            f"{day}:20+0000 h kernel: NVRM: GPU2 _kgspIsHeartbeatTimedOut: Heartbeat timed out",
        ]
    )
    assert (boot[0].kind, top(boot)) == ("gpu_lost", (Severity.CRITICAL, Action.REBOOT_NODE))
    runtime = judge(
        [
            f"{day}:20+0000 h kernel: NVRM: GPU2 _kgspIsHeartbeatTimedOut: timed out "
            "Heartbeat timed out"
        ]
    )
    assert (runtime[0].kind, top(runtime)) == ("gsp_error", (Severity.CRITICAL, Action.RESET_GPU))


@pytest.mark.parametrize(
    ("registers", "severity", "action"),
    [
        ("0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0", Severity.CRITICAL, Action.RESET_GPU),
        ("0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0", Severity.CRITICAL, Action.RESET_GPU),
        ("0x1, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0", Severity.INFO, Action.NONE),
        ("0x40800001, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0", Severity.INFO, Action.NONE),
        ("0x1, 0x0, 0x0, 0x4, 0x0, 0x0, 0x0", Severity.CRITICAL, Action.RESET_GPU),
        ("0x0, 0x0, 0x0, 0x0, 0x100000, 0x0, 0x0", Severity.INFO, Action.NONE),
        ("0x0, 0x0, 0x0, 0x0, 0x2000000, 0x0, 0x0", Severity.CRITICAL, Action.RESET_GPU),
        ("0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0", Severity.CRITICAL, Action.RESET_GPU),
    ],
)
def test_xid74_register_decode(registers: str, severity: Severity, action: Action) -> None:
    line = xid(74, f"NVLink: fatal error detected on link 3({registers})")
    assert top(judge([line])) == (severity, action)


def test_xid74_without_registers_is_fatal() -> None:
    assert top(judge([xid(74, "NVLink error")])) == (Severity.CRITICAL, Action.RESET_GPU)


def test_driver_mismatch_is_major_fix_config() -> None:
    found = judge(
        [
            "[ 7386.259769] NVRM: API mismatch: the client has the version 515.48.07, but",
            "               NVRM: this kernel module has the version 510.73.05.  Please",
        ]
    )
    assert top(found) == (Severity.MAJOR, Action.FIX_CONFIG)
    assert found[0].kind == "driver_mismatch"
    found = judge(["Failed to initialize NVML: Driver/library version mismatch"])
    assert top(found) == (Severity.MAJOR, Action.FIX_CONFIG)


def test_unsupported_gpu_and_missing_firmware_are_config() -> None:
    found = judge(
        [
            "[ 6.5] NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1b80)",
            "       NVRM: installed in this system is not supported by the",
            "       NVRM: NVIDIA 535.183.01 driver release.",
            "[ 6.6] nvidia: probe of 0000:01:00.0 failed with error -1",
        ]
    )
    assert top(found) == (Severity.CRITICAL, Action.FIX_CONFIG)
    assert len(found) == 1
    found = judge(
        [
            "[ 23.9] nvidia 0000:07:00.0: Direct firmware load for nvidia/570.144/gsp_ga10x.bin "
            "failed with error -2",
            "[ 23.9] NVRM: GPU 0000:07:00.0: RmInitAdapter failed! (0x61:0x56:1770)",
        ]
    )
    assert top(found) == (Severity.CRITICAL, Action.FIX_CONFIG)
    assert len(found) == 1


def test_uvm_global_fatal_error_needs_reboot() -> None:
    line = (
        "[ 9.1] NVRM: nvGpuOpsReportFatalError: uvm encountered global fatal error 0x60, "
        "requiring os reboot to recover."
    )
    assert top(judge([line])) == (Severity.CRITICAL, Action.REBOOT_NODE)


def test_fabric_manager_topology_mismatch_means_an_nvswitch_system() -> None:
    found = judge(
        [
            "[Jan 12 2025 06:10:33] [ERROR] [tid 2811] detected number of NVSwitches don't "
            "match with any supported system topology, aborting fabric manager"
        ]
    )
    assert top(found) == (Severity.MAJOR, Action.CHECK_NETWORK)


def test_amd_mce_dram_ue_is_host_memory() -> None:
    found = judge(
        [
            "[1.0] [Hardware Error]: Uncorrected, software restartable error.",
            "[1.0] [Hardware Error]: CPU:2 (19:1:1) MC18_STATUS[-|UE|MiscV|AddrV|-|-|-|UECC|-|"
            "Poison|Scrub]: 0xbc2000000000011b",
            "[1.0] [Hardware Error]: Unified Memory Controller Ext. Error Code: 0, DRAM ECC error.",
        ]
    )
    assert top(found) == (Severity.CRITICAL, Action.SERVICE_HARDWARE)
    assert found[0].entity == "node"
    corrected = judge(
        [
            "[1.0] [Hardware Error]: Corrected error, no action required.",
            "[1.0] [Hardware Error]: CPU:0 (19:1:1) MC17_STATUS[Over|CE|MiscV|AddrV|-|-|SyndV|"
            "CECC|-|-|-]: 0xdc2040000400011b",
            "[1.0] [Hardware Error]: Unified Memory Controller Ext. Error Code: 0, DRAM ECC error.",
        ]
    )
    assert corrected == []


def test_bus_error_without_aer_header_on_gpu() -> None:
    found = judge(
        [
            "[ 4.2] nvidia 0000:41:00.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), "
            "type=Transaction Layer, (Requester ID)",
            "[ 4.2] nvidia 0000:41:00.0:   device [10de:20b5] error status/mask=00004000/00000000",
        ]
    )
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)
    assert found[0].entity == "0000:41:00.0"


def test_gpu_needing_open_kernel_modules_is_config() -> None:
    found = judge(
        [
            "[ 6.5] NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:2b85)",
            "       NVRM: installed in this system requires use of the NVIDIA open kernel modules.",
            "[ 6.6] NVRM: GPU 0000:01:00.0: RmInitAdapter failed! (0x22:0x56:667)",
        ]
    )
    assert top(found) == (Severity.CRITICAL, Action.FIX_CONFIG)


def test_feature_not_supported_by_driver_is_not_an_unsupported_gpu() -> None:
    found = judge(["[ 6.5] NVRM: GPU 0000:01:00.0: this feature is not supported by the driver"])
    assert found == []


def test_xid43_folds_into_the_app_fault_it_follows() -> None:
    found = judge([xid(13, "Graphics Exception"), xid(43, "Ch 00000008", up=100.5)])
    assert [(f.code, f.severity, f.action) for f in found] == [
        ("13", Severity.INFO, Action.RESTART_APP)
    ]
    assert found[0].occurrences == 2
    assert top(judge([xid(43, "Ch 00000008")])) == (Severity.INFO, Action.NONE)


def test_aer_on_root_port_naming_a_gpu_below_is_the_gpus_link() -> None:
    lines = [
        "[ 9.1] pcieport 0000:00:01.1: AER: Uncorrected (Fatal) error received: 0000:00:01.1",
        "[ 9.1] pcieport 0000:00:01.1: PCIe Bus Error: severity=Uncorrected (Fatal), "
        "type=Transaction Layer, (Receiver ID)",
        "[ 9.1] pcieport 0000:00:01.1:   device [1022:1483] error status/mask=00000020/04400000",
        "[ 9.1] nvidia 0000:01:00.0: AER: can't recover (no error_detected callback)",
    ]
    found = judge(lines)
    assert top(found) == (Severity.CRITICAL, Action.REBOOT_NODE)
    assert "0000:01:00.0" in found[0].summary
    assert top(judge(lines[:3])) == (Severity.WARNING, Action.SERVICE_HARDWARE)
