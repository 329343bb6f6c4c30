"""GPU-state rules of the fault model (analytics.fault_model.gpu)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from analytics.fault_model.engine import Context, Observations, evaluate
from analytics.fault_model.gpu import RULES
from core.records import (
    Action,
    EntityId,
    Event,
    Evidence,
    Finding,
    NodeName,
    Record,
    Sample,
    Severity,
)

N = NodeName("node-a")
G0 = EntityId("0000:1a:00.0")
G1 = EntityId("0000:40:00.0")
G2 = EntityId("0000:53:00.0")


def s(metric: str, value: float, entity: str = G0, **labels: str) -> Sample:
    return Sample(
        metric=metric,
        value=value,
        observed_at=None,
        node=N,
        entity=EntityId(entity),
        labels=labels,
        evidence=Evidence(file="f", line=1, text=f"{metric} {value}"),
    )


def e(kind: str, code: str, entity: str = G0, line: int = 1, **attrs: str) -> Event:
    return Event(
        kind=kind,
        code=code,
        node=N,
        entity=EntityId(entity),
        observed_at=None,
        attrs=attrs,
        evidence=(Evidence(file="f", line=line, text=f"{kind} {code}"),),
    )


def run(records: Sequence[Record], facts: Mapping[str, str] | None = None) -> list[Finding]:
    obs = Observations()
    obs.extend(records)
    return evaluate(obs, Context(facts=dict(facts or {})), RULES)


def worst(findings: Sequence[Finding]) -> tuple[Severity, set[Action]]:
    if not findings:
        return Severity.INFO, {Action.NONE}
    top = max(f.severity.rank for f in findings)
    sev = next(f.severity for f in findings if f.severity.rank == top)
    return sev, {f.action for f in findings if f.severity == sev}


def ecc(value: float, location: str, scope: str = "volatile", entity: str = G0) -> Sample:
    return s(
        "gpu_ecc_errors_total", value, entity, type="uncorrected", scope=scope, location=location
    )


# ------------------------------------------------------------------------------- ECC


def test_sram_volatile_ue_is_critical_reset() -> None:
    found = run([ecc(1, "sram_parity"), ecc(0, "dram")])
    assert worst(found) == (Severity.CRITICAL, {Action.RESET_GPU})
    assert all(f.evidence for f in found)


def test_sram_threshold_exceeded_is_service_hardware() -> None:
    found = run([ecc(1, "sram"), s("gpu_sram_threshold_exceeded", 1)])
    assert worst(found) == (Severity.CRITICAL, {Action.SERVICE_HARDWARE})
    assert [f.code for f in found] == ["sram_threshold_exceeded"]


def test_dram_or_unknown_volatile_ue_is_warning_reset() -> None:
    assert worst(run([ecc(2, "total")])) == (Severity.WARNING, {Action.RESET_GPU})
    assert worst(run([ecc(2, "dram")])) == (Severity.WARNING, {Action.RESET_GPU})
    assert run([ecc(0, "total"), ecc(5, "dram", scope="aggregate")]) == []


def test_remap_failure_is_the_root_cause() -> None:
    found = run([ecc(2, "dram"), s("gpu_row_remap_failure", 1), s("gpu_row_remap_pending", 1)])
    assert worst(found) == (Severity.CRITICAL, {Action.SERVICE_HARDWARE})
    assert [(f.kind, f.code) for f in found] == [("row_remap", "failure")]


def test_pending_remap_and_diag_deployment_error_are_warning_reset() -> None:
    assert worst(run([s("gpu_row_remap_pending", 1)])) == (Severity.WARNING, {Action.RESET_GPU})
    found = run([e("dcgm_diag_error", "row_remap_pending", "gpu:3")])
    assert worst(found) == (Severity.WARNING, {Action.RESET_GPU})
    assert found[0].entity == "gpu:3"
    assert run([s("gpu_row_remap_pending", 0), s("gpu_row_remap_failure", 0)]) == []


def test_retired_pages_pending_is_warning_reset() -> None:
    found = run([s("gpu_retired_pages_pending", 1), s("gpu_retired_pages", 3, cause="dbe")])
    assert worst(found) == (Severity.WARNING, {Action.RESET_GPU})
    assert len(found[0].evidence) == 2


# ------------------------------------------------------------------- recovery action


@pytest.mark.parametrize(
    ("value", "severity", "action"),
    [
        (1, Severity.CRITICAL, Action.RESET_GPU),
        (2, Severity.CRITICAL, Action.REBOOT_NODE),
        (3, Severity.MAJOR, Action.RESET_GPU),
        (4, Severity.CRITICAL, Action.RESET_GPU),
    ],
)
def test_recovery_action(value: int, severity: Severity, action: Action) -> None:
    assert worst(run([s("gpu_recovery_action", value)])) == (severity, {action})


def test_recovery_none_is_nothing_and_healthy_never_overrides() -> None:
    assert run([s("gpu_recovery_action", 0)]) == []
    found = run(
        [
            s("gpu_recovery_action", 1, "gpu:1"),
            s("gpu_last_xid", 120, "gpu:1"),
            e("dcgm_health", "healthy", "node", line=30),
        ]
    )
    assert worst(found) == (Severity.CRITICAL, {Action.RESET_GPU})
    (finding,) = found
    assert "last Xid 120" in finding.summary
    assert "Healthy" in finding.summary
    assert len(finding.evidence) == 3


def test_last_xid_alone_is_a_pointer() -> None:
    found = run([s("gpu_last_xid", 120, "gpu:1"), s("gpu_last_xid", 0, "gpu:0")])
    assert [(f.kind, f.code, f.severity) for f in found] == [("xid", "120", Severity.INFO)]


# ------------------------------------------------------------------------- throttle


def reasons(entity: str = G0, **active: int) -> list[Sample]:
    return [s("gpu_clock_event_active", v, entity, reason=r) for r, v in active.items()]


def test_clock_events() -> None:
    assert worst(run(reasons(power_cap=1, gpu_idle=0))) == (Severity.INFO, {Action.NONE})
    assert worst(run(reasons(power_cap=1, hw_power_brake=1, sw_thermal=1))) == (
        Severity.MAJOR,
        {Action.FIX_CONFIG},
    )
    assert worst(run(reasons(hw_thermal=1, hw_slowdown=1))) == (
        Severity.WARNING,
        {Action.SERVICE_HARDWARE},
    )
    assert worst(run(reasons(hw_slowdown=1))) == (Severity.WARNING, {Action.SERVICE_HARDWARE})
    assert run(reasons(gpu_idle=1, power_cap=0)) == []
    thermal = run([e("thermal_violation", "dcgm_diag", "gpu:0", seconds="13.3")])
    assert worst(thermal) == (Severity.WARNING, {Action.SERVICE_HARDWARE})
    assert "13.3" in thermal[0].summary


# --------------------------------------------------------------------------- NVLink


def links(entity: str, states: Sequence[int]) -> list[Sample]:
    return [s("gpu_nvlink_state", v, entity, link=str(i)) for i, v in enumerate(states)]


def test_nvlink_all_down_on_nvswitch_system_is_critical() -> None:
    found = run([*links("gpu:0", [0] * 18), e("nvswitch_inventory", "present", "node")])
    assert worst(found) == (Severity.CRITICAL, {Action.RESET_GPU})


def test_nvlink_all_down_bridged_with_context() -> None:
    records: list[Record] = [*links("gpu:0", [0] * 18), e("nvswitch_inventory", "absent", "node")]
    assert worst(run(records, {"nvlink": "expected"})) == (Severity.MAJOR, {Action.RESET_GPU})
    assert worst(run(records, {"nvlink": "absent"})) == (Severity.INFO, {Action.NONE})
    assert worst(run(records)) == (Severity.WARNING, {Action.NONE})


def test_nvlink_some_down_on_sxm_board_is_major() -> None:
    records = [
        *links("gpu:3", [1, 1, 1, 0, 1, 0]),
        s("gpu_info", 1, "gpu:3", model="Tesla V100-SXM2-32GB"),
    ]
    found = run(records)
    assert worst(found) == (Severity.MAJOR, {Action.RESET_GPU})
    assert "3, 5" in found[0].summary
    assert run(links("gpu:3", [1, 1])) == []


def test_diag_failure_resting_on_nvlink_down_follows_nvlink() -> None:
    records: list[Record] = [
        *links("gpu:0", [0, 0, 0]),
        e(
            "dcgm_diag",
            "pcie",
            "node",
            result="fail",
            category="integration",
            test="PCIe",
            nvlink_only="yes",
        ),
    ]
    assert worst(run(records, {"nvlink": "absent"})) == (Severity.INFO, {Action.NONE})
    assert worst(run(records, {"nvlink": "expected"}))[0] == Severity.MAJOR


# ------------------------------------------------------------------------ diagnostics


def test_diag_memory_failure_is_critical_service() -> None:
    found = run(
        [
            e(
                "dcgm_diag",
                "gpu_memory",
                "gpu:0",
                result="fail",
                category="",
                test="GPU Memory",
                nvlink_only="no",
            )
        ]
    )
    assert worst(found) == (Severity.CRITICAL, {Action.SERVICE_HARDWARE})


def test_diag_peer_throughput() -> None:
    records = [
        e("dcgm_diag_perf", "diagnostic", f"gpu:{i}", value=str(v), unit="gigaflops")
        for i, v in enumerate([15000, 14900, 15100, 6000])
    ]
    found = run(records)
    assert [(f.entity, f.severity, f.action) for f in found] == [
        ("gpu:3", Severity.MAJOR, Action.SERVICE_HARDWARE)
    ]


def test_dcgm_health_verdicts() -> None:
    assert run([e("dcgm_health", "healthy", "node")]) == []
    assert worst(run([e("dcgm_health", "warning", "gpu:0", message="PCIe")]))[0] == (
        Severity.WARNING
    )


# --------------------------------------------------------------------- fabric, PCIe


def test_fabric() -> None:
    bad = e("fabric", "completed", G0, status="Failure")
    assert worst(run([bad])) == (Severity.CRITICAL, {Action.CHECK_NETWORK})
    degraded = e("fabric", "completed", G0, status="Success", health_summary="Unhealthy")
    assert worst(run([degraded])) == (Severity.MAJOR, {Action.CHECK_NETWORK})
    assert run([e("fabric", "completed", G0, status="Success", health_summary="N/A")]) == []


def width(entity: str, current: int, cap: int = 16) -> list[Sample]:
    return [
        s("gpu_pcie_link_width", current, entity, bound="current"),
        s("gpu_pcie_link_width", cap, entity, bound="max"),
    ]


def test_pcie_downtrained_below_peers_is_major() -> None:
    found = run(width(G0, 8) + width(G1, 16) + width(G2, 16))
    assert worst(found) == (Severity.MAJOR, {Action.SERVICE_HARDWARE})
    assert found[0].entity == G0


def test_pcie_narrow_width_is_a_fault_even_like_its_peers() -> None:
    # a link does not narrow at idle: x8 of x16 everywhere is still at least a warning
    found = run(width(G0, 8) + width(G1, 8) + width(G2, 8))
    assert worst(found) == (Severity.WARNING, {Action.SERVICE_HARDWARE})
    alone = run(width(G0, 4))
    assert worst(alone) == (Severity.WARNING, {Action.SERVICE_HARDWARE})


def test_pcie_generation_platform_limit_is_info() -> None:
    found = run(gen(G0, 4) + gen(G1, 4) + gen(G2, 4))
    assert worst(found) == (Severity.INFO, {Action.NONE})
    assert "like its peers" in found[0].summary


def test_pcie_idle_generation_below_faster_peers_does_not_say_like_its_peers() -> None:
    found = run(gen(G0, 1) + gen(G1, 5) + gen(G2, 5))
    assert worst(found) == (Severity.INFO, {Action.NONE})
    assert "like its peers" not in found[0].summary
    assert "peers run faster" in found[0].summary


def limited(entity: str, by: str, cap: str = "32.0 GT/s PCIe x16 link") -> Event:
    return e(
        "pcie_bandwidth_limited",
        "limited",
        entity,
        limited_by=by,
        capable="504.112 Gb/s",
        capable_link=cap,
    )


def test_pcie_limited_by_narrow_link_next_to_full_peers_is_major() -> None:
    found = run(
        [
            limited(G0, "8.0 GT/s PCIe x4 link"),
            e("pcie_bandwidth", "full", G1, link="32.0 GT/s PCIe x16 link"),
            e("pcie_bandwidth", "full", G2, link="32.0 GT/s PCIe x16 link"),
        ]
    )
    assert worst(found) == (Severity.MAJOR, {Action.SERVICE_HARDWARE})
    assert found[0].entity == G0
    assert "platform limit" in found[0].summary
    assert "not a platform limit" in found[0].summary


def test_pcie_limited_alike_is_left_to_the_host_rule() -> None:
    by = "16.0 GT/s PCIe x16 link"
    assert run([limited(G0, by), limited(G1, by), limited(G2, by)]) == []
    narrow = run([limited(G0, "16.0 GT/s PCIe x8 link")])
    assert worst(narrow) == (Severity.WARNING, {Action.SERVICE_HARDWARE})
    slower = run(
        [limited(G0, "8.0 GT/s PCIe x16 link"), limited(G1, by), limited(G2, "32.0 GT/s x16")]
    )
    assert worst(slower) == (Severity.INFO, {Action.NONE})
    assert "not a platform limit" in slower[0].summary


# ----------------------------------------------------------------------------- ERR!


def test_single_err_is_info_and_escalates() -> None:
    assert worst(run([e("nvidia_smi_err", "fan", G0)])) == (Severity.INFO, {Action.NONE})
    repeated = [e("nvidia_smi_err", "fan", G0, line=1), e("nvidia_smi_err", "fan", G0, line=9)]
    assert worst(run(repeated)) == (Severity.WARNING, {Action.NONE})
    with_xid = [e("nvidia_smi_err", "fan", G0), e("xid", "79", G0)]
    assert Severity.WARNING in {f.severity for f in run(with_xid)}
    with_action: list[Record] = [e("nvidia_smi_err", "fan", G0), s("gpu_recovery_action", 1)]
    err = [f for f in run(with_action) if f.kind == "nvidia_smi_err"]
    assert err[0].severity == Severity.WARNING


def test_whole_row_err_is_gpu_lost() -> None:
    found = run([e("nvidia_smi_err", "row", G0)])
    assert worst(found) == (Severity.CRITICAL, {Action.REBOOT_NODE})
    assert found[0].kind == "gpu_lost"


def test_rules_cite_sources() -> None:
    for rule in RULES:
        assert rule.__doc__
        assert (
            "NVIDIA" in rule.__doc__
            or "NVML" in rule.__doc__
            or "DCGM" in rule.__doc__
            or "fault-model" in rule.__doc__
        )


def gen(entity: str, current: int, cap: int = 5) -> list[Sample]:
    return [
        s("gpu_pcie_link_generation", current, entity, bound="current"),
        s("gpu_pcie_link_generation", cap, entity, bound="max"),
    ]


def test_pcie_generation_drop_counts_only_when_busy() -> None:
    idle = [*gen(G0, 1), *gen(G1, 5), *gen(G2, 5)]
    assert worst(run(idle)) == (Severity.INFO, {Action.NONE})
    busy = [*idle, s("gpu_utilization_ratio", 0.9, G0)]
    assert worst(run(busy)) == (Severity.MAJOR, {Action.SERVICE_HARDWARE})


def test_diag_failure_because_gpu_unusable_is_reset() -> None:
    msg = "GPU 0 Unable to create CUDA context: 'CUDA-capable device(s) is/are busy or unavailable'"
    found = run(
        [
            e(
                "dcgm_diag",
                "gpu_memory",
                "gpu:0",
                result="fail",
                category="hardware",
                test="GPU Memory",
                nvlink_only="no",
                message=msg,
            )
        ]
    )
    assert worst(found) == (Severity.CRITICAL, {Action.RESET_GPU})


@pytest.mark.parametrize(
    ("model", "severity"),
    [
        ("NVIDIA H100 80GB HBM3", Severity.CRITICAL),
        ("NVIDIA A100-SXM4-80GB", Severity.CRITICAL),
        ("NVIDIA H200 NVL", Severity.MAJOR),
        ("NVIDIA H100 NVL", Severity.MAJOR),
        ("NVIDIA A100 80GB PCIe", Severity.WARNING),
    ],
)
def test_nvlink_all_down_by_board(model: str, severity: Severity) -> None:
    records: list[Record] = [*links("gpu:0", [0] * 4), s("gpu_info", 1, "gpu:0", model=model)]
    assert worst(run(records))[0] == severity


# ------------------------------------------------------- variants of real artifacts


def test_nvlink_all_links_label_does_not_crash_and_pcie_card_is_info() -> None:
    # nvidia-smi nvlink -s: "NVML: Unable to retrieve NVLink information as all links
    # are inActive" becomes one sample with link="all"
    down = s("gpu_nvlink_state", 0, G0, link="all")
    l40s = s("gpu_info", 1, G0, model="NVIDIA L40S")
    assert worst(run([down, l40s])) == (Severity.INFO, {Action.NONE})
    b200 = s("gpu_info", 1, G0, model="NVIDIA B200")
    assert worst(run([down, b200])) == (Severity.CRITICAL, {Action.RESET_GPU})


def test_truncated_h100_sxm_name_counts_as_nvswitch_board() -> None:
    truncated = s("gpu_info", 1, G0, model="NVIDIA H100 80G...")
    assert worst(run([*links(G0, [0] * 18), truncated])) == (
        Severity.CRITICAL,
        {Action.RESET_GPU},
    )


def test_health_overall_verdict_folds_into_gpu_verdicts() -> None:
    overall = e("dcgm_health", "failure", "node")
    nvlink_only = e("dcgm_health", "failure", "gpu:0", message="NVLINK", nvlink_only="yes")
    down = s("gpu_nvlink_state", 0, "gpu:0", link="0")
    found = run([overall, nvlink_only, down], {"nvlink": "absent"})
    assert worst(found) == (Severity.INFO, {Action.NONE})
    explained = e("dcgm_health", "failure", "gpu:2", message="row remap", explained="yes")
    remap = e("dcgm_diag_error", "row_remap_failure", "gpu:2")
    assert worst(run([overall, explained, remap])) == (
        Severity.CRITICAL,
        {Action.SERVICE_HARDWARE},
    )


def test_diag_cuda_context_failure_is_unusable_not_faulty() -> None:
    fail = e(
        "dcgm_diag",
        "pcie",
        "gpu:5",
        result="fail",
        category="integration",
        message="GPU 5 failed to create a CUDA context: cuCtxCreate returned 46",
    )
    assert worst(run([fail])) == (Severity.CRITICAL, {Action.RESET_GPU})
