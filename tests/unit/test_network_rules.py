# ruff: noqa: E501  (real tool output lines are long)
from __future__ import annotations

from analytics.fault_model.engine import Context, Observations, evaluate, worst
from analytics.fault_model.network import RULES
from collectors.artifact import ArtifactResult, Line, ParseContext, parse_lines
from collectors.parsers import artifact_parsers
from core.records import Action, EntityId, Event, Finding, NodeName, Severity


def lines(text: str) -> list[Line]:
    return [Line(i, t) for i, t in enumerate(text.splitlines(), start=1)]


def judge(
    text: str, facts: dict[str, str] | None = None, extra: list[Event] | None = None
) -> list[Finding]:
    obs = Observations()
    ctx = ParseContext(file="in.txt", node=NodeName("n1"), default_year=2025)
    obs.extend(parse_lines(lines(text), ctx, artifact_parsers(), ArtifactResult()))
    obs.extend(extra or [])
    return evaluate(obs, Context(facts=facts or {}), RULES)


def verdict(findings: list[Finding]) -> tuple[str, list[str]]:
    severity, actions = worst(findings)
    return severity.value, [a.value for a in actions]


RETRY = "n1:1:2 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=12 opcode=0 len=0 vendor err 129 (Recv)"
FLUSH = "n1:1:2 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.2<1> with status=5 opcode=0 len=0 vendor err 249 (Recv)"
TIMEOUT = "[E321 02:07:08.408 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600060 milliseconds before timing out."


def test_retry_exceeded_is_root_and_flush_is_evidence():
    timeout_event = Event(
        kind="collective_timeout",
        code="9",
        node=NodeName("n1"),
        entity=EntityId("node"),
        observed_at=None,
    )
    text = "\n".join(
        [
            RETRY,
            "n1:1:2 [0] NCCL INFO transport/net.cc:1302 -> 6",
            FLUSH,
            FLUSH,
            "n1:1:2 [0] NCCL WARN ncclRemoteError detected",
        ]
    )
    findings = judge(text, extra=[timeout_event])
    assert len(findings) == 1
    (finding,) = findings
    assert (finding.kind, finding.code, finding.severity, finding.action) == (
        "rdma_transport",
        "12",
        Severity.MAJOR,
        Action.CHECK_NETWORK,
    )
    assert finding.entity == "n1<->10.0.0.2"
    texts = [e.text for e in finding.evidence]
    assert RETRY in texts
    assert FLUSH in texts
    assert "ibv_wc_status" in finding.source


def test_flush_alone_is_warning_none():
    assert verdict(judge(FLUSH)) == ("warning", ["none"])


def test_nccl_error_alone_is_warning_none():
    assert verdict(judge("n1:1:2 [0] NCCL INFO transport/net.cc:1302 -> 6")) == (
        "warning",
        ["none"],
    )


def test_rnr_is_app_level():
    text = RETRY.replace("status=12", "status=13")
    assert verdict(judge(text)) == ("warning", ["restart_app"])


def test_ucx_retry_exceeded():
    text = "[h:1:0:1] ib_mlx5_log.c:139  Transport retry count exceeded on mlx5_0:1/IB (synd 0x15 vend 0x81 hw_synd 0/0)"
    assert verdict(judge(text)) == ("major", ["check_network"])


IBSTAT_DOWN = """\
CA 'mlx5_3'
\tCA type: MT4123
\tPort 1:
\t\tState: Down
\t\tPhysical state: Polling
\t\tRate: 10
\t\tLink layer: InfiniBand
CA 'mlx5_4'
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 200
\t\tLink layer: InfiniBand
"""


def test_port_down_is_major():
    findings = judge(IBSTAT_DOWN)
    assert verdict(findings) == ("major", ["check_network"])
    (finding,) = findings
    assert finding.entity == "mlx5_3:1"
    assert any("Polling" in e.text for e in finding.evidence)


def test_port_down_but_unused():
    assert judge(IBSTAT_DOWN, {"ib_unused": "mlx5_3:1"}) == []
    assert judge(IBSTAT_DOWN, {"ib_unused": "MLX5_3, mlx5_9:2"}) == []
    assert judge(IBSTAT_DOWN, {"ib_unused": "mlx5_3:2"}) != []


def test_port_down_then_active_is_warning():
    later = (
        IBSTAT_DOWN
        + "\n$ ibstat\n"
        + IBSTAT_DOWN.replace("State: Down", "State: Active").replace("Polling", "LinkUp")
    )
    assert verdict(judge(later)) == ("warning", ["check_network"])


def iqe(counters: str) -> str:
    return f" GUID 0x0200c0fffe00b2a1 port 1: {counters}"


def test_linkdowned_with_receive_errors_is_major():
    findings = judge(
        iqe(
            "[LinkDownedCounter == 25] [PortRcvErrors == 26] [PortXmitDiscards == 3] [PortXmitWait == 999]"
        )
    )
    assert verdict(findings) == ("major", ["check_network"])
    assert findings[0].entity == "0x0200c0fffe00b2a1:1"


def test_saturated_counters_are_warning():
    findings = judge(iqe("[LinkDownedCounter == 255] [PortRcvErrors == 26]"))
    assert verdict(findings) == ("warning", ["check_network"])
    assert findings[0].code == "counter_saturated"


def test_congestion_alone_is_not_an_error():
    assert judge(iqe("[PortXmitWait == 14681376621 (13.673G)] [PortXmitDiscards == 2846]")) == []


def test_symbol_errors_alone_are_warning():
    findings = judge(iqe("[SymbolErrorCounter == 12]"))
    assert verdict(findings) == ("warning", ["check_network"])


def test_clean_perfquery_has_no_findings():
    text = "# Port counters: Lid 3 port 1 (CapMask: 0x1600)\nPortSelect:......................1\nSymbolErrorCounter:..............0\nLinkDownedCounter:...............0\nPortRcvErrors:...................0\n"
    assert judge(text) == []


def prio_text(busy: int, pause: int = 0) -> str:
    out = ["$ ethtool -S ens1f0"]
    for p in range(8):
        value = 1000 if p == busy else 0
        out += [f"     rx_prio{p}_bytes: {value}", f"     tx_prio{p}_bytes: {value}"]
    out.append(f"     rx_prio{busy}_pause: {pause}")
    return "\n".join(out) + "\n"


HW = "\n$ grep '' /sys/class/infiniband/mlx5_0/ports/1/hw_counters/*\n/sys/class/infiniband/mlx5_0/ports/1/hw_counters/{name}:{value}\n"


def test_roce_single_class_with_ack_timeouts_is_fix_config():
    findings = judge(prio_text(0) + HW.format(name="local_ack_timeout_err", value=2705))
    assert verdict(findings) == ("major", ["fix_config"])
    assert findings[0].entity == "ens1f0"


def test_roce_single_class_with_out_of_sequence_other_priority():
    findings = judge(prio_text(3) + HW.format(name="out_of_sequence", value=4))
    assert verdict(findings) == ("major", ["fix_config"])


def test_roce_with_pfc_pauses_is_not_qos_misconfig():
    findings = judge(prio_text(3, pause=50) + HW.format(name="local_ack_timeout_err", value=5))
    assert verdict(findings) == ("warning", ["check_network"])


def test_roce_cnp_only_is_warning():
    findings = judge(prio_text(0) + HW.format(name="np_cnp_sent", value=5))
    assert verdict(findings) == ("warning", ["fix_config"])


def test_roce_clean_counters():
    assert judge(prio_text(0) + HW.format(name="local_ack_timeout_err", value=0)) == []


def test_collective_timeout_alone_is_warning_none():
    findings = judge(TIMEOUT)
    assert verdict(findings) == ("warning", ["none"])
    assert findings[0].kind == "collective"


def test_collective_timeout_with_network_root_is_folded():
    findings = judge(TIMEOUT + "\n" + RETRY)
    assert [f.kind for f in findings] == ["rdma_transport"]


def nccl_tests_run(nodes: list[str], wrong: int) -> str:
    header = [
        f"#  Rank {i} Group  0 Pid  1 on {n} device  0 [0x18] NVIDIA H100"
        for i, n in enumerate(nodes)
    ]
    return "\n".join(
        [
            *header,
            "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
            f"           8             2     float     sum      -1    36.05    0.00    0.00      {wrong}    35.24    0.00    0.00      0",
            "# Avg bus bandwidth    : 10.5",
        ]
    )


def test_wrong_results_multi_node_is_critical_on_every_node():
    findings = judge(nccl_tests_run(["a", "b"], 4))
    assert verdict(findings) == ("critical", ["check_network"])
    assert sorted(f.node for f in findings) == ["a", "b"]


def test_wrong_results_single_node_is_service_hardware():
    assert verdict(judge(nccl_tests_run(["a"], 1))) == ("critical", ["service_hardware"])


def test_clean_run_and_busbw_expectation():
    assert judge(nccl_tests_run(["a"], 0)) == []
    assert judge(nccl_tests_run(["a"], 0), {"expected_busbw_gbps": "15"}) == []
    assert verdict(judge(nccl_tests_run(["a"], 0), {"expected_busbw_gbps": "100"})) == (
        "warning",
        ["check_network"],
    )
    assert judge(nccl_tests_run(["a"], 0), {"expected_busbw_gbps": "fast"}) == []


def test_nvls_failure_is_major_reset_gpu():
    text = "n1:5:6 [2] transport/nvls.cc:160 NCCL WARN Cuda failure 'operation not permitted' in cuMulticastCreate"
    assert verdict(judge(text)) == ("major", ["reset_gpu"])


def test_every_finding_has_evidence_and_source():
    text = "\n\n".join([RETRY, IBSTAT_DOWN, iqe("[SymbolErrorCounter == 12]"), TIMEOUT])
    findings = judge(text)
    assert findings
    for finding in findings:
        assert finding.evidence
        assert "fault-model.md" in finding.source


def test_async_port_error_is_major_and_benign_events_are_not_findings():
    assert verdict(judge("h:1:2 [0] NCCL WARN NET/IB : mlx5_0:1 Got async event : port error")) == (
        "major",
        ["check_network"],
    )
    assert judge("h:1:2 [0] NCCL WARN NET/IB : mlx5_0:1 Got async event : port active") == []
    qp = "h:1:2 [0] NCCL WARN NET/IB: ibp1:1 async fatal event on QP: local access violation work queue error"
    assert verdict(judge(qp)) == ("warning", ["restart_app"])


def test_roce_on_broadcom_counters():
    text = "\n".join(
        ["$ ethtool -S ens2", *(f"     rx_bytes_pri{p}: {1000 if p == 0 else 0}" for p in range(8))]
    )
    hw = "\n$ grep '' /sys/class/infiniband/bnxt_re0/ports/1/hw_counters/*\n/sys/class/infiniband/bnxt_re0/ports/1/hw_counters/to_retransmits:77\n"
    assert verdict(judge(text + "\n" + hw)) == ("major", ["fix_config"])


def test_saturated_data_counters_are_not_error_findings():
    text = "# Port counters: Lid 3 port 1 (CapMask: 0x1600)\nPortXmitData:....................4294967295\nPortXmitWait:....................4294967295\nSymbolErrorCounter:..............0\n"
    assert judge(text) == []


# --- Ethernet physical errors, verbs failures, sockets, libfabric, ibdiagnet ----------


def test_ethernet_link_down_events_with_crc_errors_is_major() -> None:
    text = (
        "$ ethtool -S ens3np0\n"
        "     rx_crc_errors_phy: 18236\n"
        "     rx_symbol_err_phy: 412\n"
        "     link_down_events_phy: 14\n"
    )
    assert verdict(judge(text)) == ("major", ["check_network"])


def test_ethernet_crc_errors_alone_warn_and_link_downs_alone_are_silent() -> None:
    crc = "$ ethtool -S ens3np0\n     rx_crc_errors_phy: 12\n     link_down_events_phy: 0\n"
    downs = "$ ethtool -S ens3np0\n     rx_crc_errors_phy: 0\n     link_down_events_phy: 3\n"
    assert verdict(judge(crc)) == ("warning", ["check_network"])
    assert verdict(judge(downs)) == ("info", ["none"])


def test_per_priority_buffer_discards_are_loss() -> None:
    text = (
        "$ ethtool -S ens1f1np1\n     rx_prio3_buf_discard: 73311\n     rx_prio3_cong_discard: 0\n"
    )
    assert verdict(judge(text)) == ("warning", ["check_network"])


def test_verbs_call_failure_is_config_and_folds_nccl_results() -> None:
    text = (
        "n1:1:2 [4] ibvwrap.c:130 NCCL WARN Call to ibv_create_qp failed\n"
        "n1:1:2 [4] NCCL INFO ib_plugin.c:196 -> 2\n"
    )
    findings = judge(text)
    assert verdict(findings) == ("warning", ["fix_config"])
    assert [f.kind for f in findings] == ["rdma_verbs"]


def test_verbs_failure_after_catastrophic_async_event_is_a_symptom() -> None:
    text = (
        "n1:815:864 [0] transport/net_ib.cu:80 NCCL WARN NET/IB : Got async event : local catastrophic error\n"
        "n1:815:864 [0] misc/ibvwrap.cu:220 NCCL WARN Call to ibv_get_async_event failed\n"
    )
    findings = judge(text)
    assert [f.kind for f in findings] == ["rdma_async"]


def test_socket_closed_by_peer_is_a_warning_naming_the_peer() -> None:
    text = (
        "n1:2:3 [3] misc/socket.cc:49 NCCL WARN socketProgress: Connection closed by remote peer n2<55693>\n"
        "n1:2:3 [3] NCCL INFO misc/socket.cc:749 -> 6\n"
    )
    (finding,) = judge(text)
    assert (finding.severity, finding.action) == (Severity.WARNING, Action.NONE)
    assert "n2" in finding.summary


def test_ofi_completion_error_is_a_fabric_fault() -> None:
    text = "n1:35:89 [5] ofi_process_cq:1039 NCCL WARN NET/OFI Request 0x7f completed with error. RC: 20. Error: unknown error. Completed length: 0\n"
    assert verdict(judge(text)) == ("major", ["check_network"])


def test_ibdiagnet_errors_warn_and_warnings_alone_do_not() -> None:
    head = "Summary\n-I- Stage                     Warnings   Errors     Comment\n"
    bad = head + "-I- Links Check               0          2\n"
    fine = head + "-I- Discovery                 3          0\n"
    assert verdict(judge(bad)) == ("warning", ["check_network"])
    assert verdict(judge(fine)) == ("info", ["none"])


def test_mlxlink_recommendation_in_port_state_summary() -> None:
    text = (
        "$ mlxlink -d mlx5_4\n"
        "Operational Info\n----------------\n"
        "State                           : Polling\n\n"
        "Troubleshooting Info\n--------------------\n"
        "Status Opcode                   : 1024\n"
        "Recommendation                  : Cable is unplugged\n"
    )
    (finding,) = judge(text)
    assert (finding.severity, finding.action) == (Severity.MAJOR, Action.CHECK_NETWORK)
    assert "Cable is unplugged" in finding.summary
