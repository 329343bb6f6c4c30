# ruff: noqa: E501  (real tool output lines are long)
from __future__ import annotations

import pytest

from collectors.artifact import ArtifactResult, Line, ParseContext, parse_lines
from collectors.nccl import PARSERS, CollectiveLogSession, NcclLogParser, UcxLogParser
from collectors.parsers import artifact_parsers
from core.records import Event, NodeName, Record
from tests.conftest import cases_dir


def lines(text: str) -> list[Line]:
    return [Line(i, t) for i, t in enumerate(text.splitlines(), start=1)]


def parse(
    text: str, *, node: str = "here", year: int | None = 2025
) -> tuple[list[Record], ArtifactResult]:
    result = ArtifactResult()
    ctx = ParseContext(file="f.log", node=NodeName(node), default_year=year)
    records = list(parse_lines(lines(text), ctx, artifact_parsers(), result))
    return records, result


def events(records: list[Record], kind: str | None = None) -> list[Event]:
    return [r for r in records if isinstance(r, Event) and (kind is None or r.kind == kind)]


def test_parsers_exported():
    kinds = {p.kind for p in PARSERS}
    assert kinds == {"nccl", "ucx"}


def test_new_wording_status_12_with_unwind_lines_as_evidence():
    text = (
        "gpu-7:11:22 [3] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer 10.0.0.9<4242> "
        "with status=12 opcode=0 len=0 vendor err 129 (Send) localGid ::ffff:10.0.0.8 remoteGids::ffff:10.0.0.9 hca mlx5_3\n"
        "gpu-7:11:22 [3] NCCL INFO transport/net.cc:1302 -> 6\n"
        "gpu-7:11:22 [3] NCCL INFO proxy.cc:698 -> 6\n"
    )
    records, result = parse(text)
    (event,) = events(records, "rdma_transport")
    assert event.code == "12"
    assert event.node == "gpu-7"
    assert event.entity == "gpu-7<->10.0.0.9"
    assert event.attrs["peer"] == "10.0.0.9"
    assert event.attrs["vendor_err"] == "129"
    assert event.attrs["device"] == "mlx5_3"
    assert event.attrs["direction"] == "Send"
    assert [e.line for e in event.evidence] == [1, 2, 3]
    assert result.issues == []
    assert not events(records, "nccl_result")


@pytest.mark.parametrize(
    "line",
    [
        "n1:1:2 [0] NCCL WARN NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129",
        "n1:1:2 [0] NCCL WARN NET/IB : Got completion from peer 10.1.1.2<46262> with error 12, "
        "opcode 1, len 32768, vendor err 129 (Recv)",
        "2024-05-01T10:00:00.000Z n1:1:2 [0] NCCL WARN NET/IB : Got completion with error 12, "
        "opcode 0, len 0, vendor err 129",
        "[default0]:n1:1:2 [0] NCCL WARN NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129",
    ],
)
def test_older_and_prefixed_wordings(line):
    records, _ = parse(line)
    (event,) = events(records, "rdma_transport")
    assert event.code == "12"
    assert event.node == "n1"
    assert event.attrs["vendor_err"] == "129"
    assert event.attrs["status_name"] == "IBV_WC_RETRY_EXC_ERR"


def test_iso_prefix_gives_time():
    records, _ = parse(
        "2024-05-01T10:00:00Z n1:1:2 [0] NCCL WARN NET/IB : Got completion with error 5, opcode 0, len 0, vendor err 249"
    )
    (event,) = events(records, "rdma_transport")
    assert event.observed_at == 1714557600.0
    assert event.code == "5"


def test_summary_lines_and_orphan_unwind():
    text = (
        "n1:1:2 [0] NCCL INFO transport/net.cc:1302 -> 6\n"
        "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1275, remote process exited or there was a "
        "network error, NCCL version 2.18.1\n"
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.\n"
    )
    records, _ = parse(text)
    results = events(records, "nccl_result")
    assert {e.code for e in results} == {"ncclRemoteError"}
    assert len(results) == 2


def test_last_error_summary_with_completion():
    text = (
        "n1:1:2 [0] NCCL INFO misc/socket.cc:1 -> 2\n"
        "torch.distributed.DistBackendError: NCCL error ncclRemoteError: A call failed. Last error:\n"
        "NET/IB : Got completion from peer 10.0.0.2<1234> with error 12, opcode 0, len 0, vendor err 129 (Recv)\n"
    )
    records, _ = parse(text, node="n9")
    (event,) = events(records, "rdma_transport")
    assert event.entity == "n9<->10.0.0.2"


def test_nvls_failure():
    text = (
        "n1:5:6 [2] transport/nvls.cc:160 NCCL WARN Cuda failure 1 'invalid argument' during NVLS multicast setup\n"
        "n1:5:6 [2] NCCL INFO NVLS multicast support is not available on dev 2\n"
    )
    records, _ = parse(text)
    (event,) = events(records, "nvls")
    assert event.attrs["cuda_dev"] == "2"
    assert event.evidence[0].line == 1


def test_ucx_retry_exceeded_with_qp_line():
    text = (
        "[h2:100:0:100] ib_mlx5_log.c:171  Transport retry count exceeded on mlx5_2:1/RoCE "
        "(synd 0x15 vend 0x81 hw_synd 0/0)\n"
        "[h2:100:0:100] ib_mlx5_log.c:171  RC QP 0x1a wqe[3]: RDMA_WRITE s-e [rqpn 0x3 rlid 12] [va 0x0 len 8]\n"
        "[h2:101:0:101] ib_mlx5_log.c:171  Remote access on mlx5_2:1/RoCE (synd 0x13 vend 0x88 hw_synd 0/0)\n"
    )
    records, result = parse(text)
    found = events(records, "rdma_transport")
    assert [(e.code, e.node) for e in found] == [("12", "h2"), ("10", "h2")]
    assert found[0].entity == "h2<->lid:12"
    assert [e.line for e in found[0].evidence] == [1, 2]
    assert found[0].attrs["device"] == "mlx5_2:1"
    assert found[1].entity == "mlx5_2:1"
    assert result.kinds == ["ucx"]


def test_torch_watchdog_one_event_per_collective():
    text = (
        "[I1102 10:00:00.000 ProcessGroupNCCL.cpp:1] [PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=1800000) ran for 1800123 milliseconds before timing out.\n"
        "[E1102 10:00:01.000 ProcessGroupNCCL.cpp:2] [PG ID 0 PG GUID 0(default_pg) Rank 5] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=1, NumelOut=1, "
        "Timeout(ms)=1800000) ran for 1800200 milliseconds before timing out.\n"
        "[E1102 10:00:02.000 ProcessGroupNCCL.cpp:2] [Rank 5] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=8, OpType=ALLGATHER, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800300 "
        "milliseconds before timing out.\n"
    )
    records, _ = parse(text, year=2024)
    found = events(records, "collective_timeout")
    assert [(e.code, e.attrs["op"], e.attrs["ranks"]) for e in found] == [
        ("7", "BROADCAST", "3,5"),
        ("8", "ALLGATHER", "5"),
    ]
    assert found[0].attrs["timeout_seconds"] == "1800"
    assert found[0].observed_at == 1730541600.0
    assert found[0].attrs["year_assumed"] == "true"


NCCL_TESTS = """\
# nThread 1 nGpus 1 minBytes 8 maxBytes 128 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   1001 on     alpha device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   2002 on      beta device  0 [0x18] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    36.05    0.00    0.00      {w1}    35.24    0.00    0.00      0
          16             4     float     sum      -1    36.05    0.00    0.00      0    35.24    0.00    0.00      {w2}
# Out of bounds values : {oob}
# Avg bus bandwidth    : 0.0012
#
"""


def test_nccl_tests_wrong_names_every_node():
    records, result = parse(NCCL_TESTS.format(w1=3, w2=0, oob="0 OK"))
    found = events(records, "collective")
    wrong = [e for e in found if e.code == "wrong_results"]
    assert sorted(e.node for e in wrong) == ["alpha", "beta"]
    assert wrong[0].attrs["nodes"] == "alpha,beta"
    assert wrong[0].attrs["max_wrong"] == "3"
    assert any(e.code == "avg_busbw" for e in found)
    assert result.issues == []


def test_nccl_tests_in_place_column_and_oob():
    records, _ = parse(NCCL_TESTS.format(w1=0, w2=5, oob="2 FAILED"))
    wrong = [e for e in events(records, "collective") if e.code == "wrong_results"]
    assert len(wrong) == 2
    assert wrong[0].attrs["out_of_bounds"] == "2"


def test_nccl_tests_clean_run_has_no_wrong_event():
    records, _ = parse(NCCL_TESTS.format(w1=0, w2=0, oob="0 OK"))
    assert not [e for e in events(records) if e.code == "wrong_results"]


def test_nccl_tests_na_wrong_column_is_not_wrong():
    records, _ = parse(NCCL_TESTS.format(w1="N/A", w2="N/A", oob="0 OK"))
    assert not [e for e in events(records) if e.code == "wrong_results"]


def test_case_041_fixture_names_both_nodes():
    path = next(cases_dir().glob("041-*"))
    records, _ = parse(path.read_text())
    wrong = [e for e in events(records) if e.code == "wrong_results"]
    assert sorted(e.node for e in wrong) == ["node-a", "node-b"]


def test_detect_scores():
    nccl, ucx = NcclLogParser(), UcxLogParser()
    assert nccl.detect(lines("h:1:2 [0] NCCL INFO Bootstrap : Using eth0"), None) >= 80
    assert ucx.detect(lines("[h:1:2:3] ib_mlx5_log.c:1 whatever"), None) >= 80
    plain = lines("[  12.3] NVRM: Xid (PCI:0000:b1:00): 79, GPU has fallen off the bus.")
    assert nccl.detect(plain, None) == 0
    assert ucx.detect(plain, None) == 0
    assert nccl.detect([], None) == 0


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\x00\x01garbage\xff",
        "h:1:2 [0] NCCL WARN NET/IB : Got completion from peer",
        "h:1:2 [0] NCCL WARN NET/IB : Got completion with error abc",
        "[E999 99:99:99.0 ProcessGroupNCCL.cpp:1] [Rank x] Watchdog caught collective operation timeout: WorkNCCL(",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong\n 8 2 float sum",
        "           8             2     float     sum      -1    36.05",
    ],
)
def test_bad_input_never_raises(text):
    session = CollectiveLogSession(ParseContext(file="bad", node=NodeName("n")), source="t")
    out = list(session.feed(lines(text)))
    out += list(session.close())
    assert not [e for e in events(out) if e.kind in {"rdma_transport", "collective"}]


def test_truncated_table_row_is_an_issue():
    text = NCCL_TESTS.format(w1=0, w2=0, oob="0 OK").replace(
        "          16             4     float     sum      -1    36.05    0.00    0.00      0    35.24    0.00    0.00      0",
        "          16             4     float     sum      -1    36.05    0.00",
    )
    _, result = parse(text)
    assert [i.line for i in result.issues] == [11]


@pytest.mark.parametrize(
    ("line", "code", "entity"),
    [
        (
            "[2026-09-09 10:46:33] u2:3:4 [1] transport/net_ib/p2p.cc:648 NCCL WARN NET/IB: Got completion from peer 10.1.2.3<40554> with status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_RECV_RDMA_WITH_IMM(129) vendor_err=129 localGid ::ffff:1.1.2.2 remoteGids::ffff:1.1.1.4 hca mlx5_1",
            "12",
            "u2<->10.1.2.3",
        ),
        (
            "h:1:2 [0] NCCL WARN NET/IB: Got completion from peer with status=IBV_WC_REM_ACCESS_ERR(10)",
            "10",
            "node",
        ),
        (
            "h:1:2 [0] NCCL WARN NET/IB: Got completion from peer with status=IBV_WC_WR_FLUSH_ERR",
            "5",
            "node",
        ),
        (
            "h:1:2 [0] NCCL WARN NET/IB/GIN: Got completion from peer 10.0.0.1<1> with status=12 opcode=0 len=0 vendor err 129 (Recv) hca mlx5_7",
            "12",
            "h<->10.0.0.1",
        ),
    ],
)
def test_newest_wordings(line, code, entity):
    records, _ = parse(line)
    (event,) = events(records, "rdma_transport")
    assert (event.code, event.entity) == (code, entity)


def test_async_events():
    text = (
        "h:1:2 [0] NCCL WARN NET/IB : mlx5_0:1 Got async event : port error\n"
        "h:1:2 [0] NCCL WARN NET/IB: ibp19s0:1 async fatal event on QP: local access violation work queue error\n"
    )
    records, _ = parse(text)
    found = events(records, "rdma_async")
    assert [(e.entity, e.code) for e in found] == [
        ("mlx5_0:1", "port error"),
        ("ibp19s0:1", "local access violation work queue error"),
    ]


def test_ucx_dgid_peer_and_verbs_text():
    text = (
        "[h3:7:0:7] ib_mlx5_log.c:177  Transport retry count exceeded on mlx5_1:1/RoCE (synd 0x15 vend 0x81 hw_synd 0/0)\n"
        "[h3:7:0:7] ib_mlx5_log.c:177  RC QP 0x2b0c2 wqe[0]: SEND s-e [rqpn 0x22c7d dgid fe80::1] [va 0x7f len 8]\n"
        "[h3:8:0:8] ib_iface.c:700  send completion with error: remote access error\n"
    )
    records, _ = parse(text)
    found = events(records, "rdma_transport")
    assert [(e.code, e.entity) for e in found] == [("12", "h3<->gid:fe80::1"), ("10", "node")]


def test_malformed_lines_become_issues():
    text = (
        "h:1:2 [0] NCCL WARN NET/IB : Got completion from peer 10.0.0.1<1> with status=\n"
        "[E321 02:07:08.4 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(\n"
    )
    records, result = parse(text)
    assert not events(records, "rdma_transport")
    assert [i.line for i in result.issues] == [1, 2]


# --- robustness to other versions' wording and log prefixes ---------------------------


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "[1,3]<stdout>:",
        "2019-06-02T16:13:44.884Z: [1,12]<stdout>:",
        "(train_rft pid=2657296) 2024-05-11 14:10:52.224 ",
        "[2025-07-21 19:05:29] ",
        "[0] ",
        "0: ",
    ],
)
def test_prefixes_in_front_of_nccl_lines(prefix: str) -> None:
    text = (
        f"{prefix}gpu-7:11:22 [3] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer "
        "10.0.0.9<4242> with status=12 opcode=0 len=0 vendor err 129 (Recv)\n"
    )
    records, _ = parse(text)
    (event,) = events(records, "rdma_transport")
    assert event.code == "12"
    assert event.node == "gpu-7"


def test_ucx_timestamped_log_form_and_dlid_equals() -> None:
    text = (
        "[1704960000.123456] [gpu-2:2330856:0]   ib_mlx5_log.c:177  UCX  ERROR Transport retry count exceeded on mlx5_2:1/IB (synd 0x15 vend 0x81 hw_synd 0/0)\n"
        "[1704960000.123470] [gpu-2:2330856:0]   ib_mlx5_log.c:177  UCX  ERROR RC QP 0x2e1 wqe[12]: SEND s-e [rqpn 0x3c1 dlid=221 sl=0] [inl len 61]\n"
    )
    records, result = parse(text)
    (event,) = events(records, "rdma_transport")
    assert event.code == "12"
    assert event.entity == "gpu-2<->lid:221"
    assert result.kinds == ["ucx"]


def test_openmpi_openib_retry_exceeded_single_and_wrapped() -> None:
    single = (
        "[[51298,1],2][btl_openib_component.c:3496:handle_wc] from gpu-1 to: gpu-2 error polling LP CQ "
        "with status RETRY EXCEEDED ERROR status number 12 for wr_id 217ce00 opcode 0  vendor error 129 qp_idx 0\n"
    )
    wrapped = (
        "[[1176,1],0][btl_openib_component.c:2905:handle_wc] from gpu-1.example.org\n"
        "to: gpu-2 error polling LP CQ with status RETRY EXCEEDED ERROR status\n"
        "number 12 for wr_id 38996224 opcode 0 qp_idx 0\n"
    )
    for text in (single, wrapped):
        records, result = parse(text)
        (event,) = events(records, "rdma_transport")
        assert event.code == "12"
        assert event.attrs["peer"] == "gpu-2"
        assert not result.issues


def test_openmpi_status_text_without_number() -> None:
    text = "[[1,1],0][btl_openib_component.c:1:handle_wc] from a to: b error polling HP CQ with status RECEIVER NOT READY RETRY EXCEEDED ERROR for wr_id 1\n"
    records, _ = parse(text)
    (event,) = events(records, "rdma_transport")
    assert event.code == "13"


def test_nvls_failure_named_by_source_file_only() -> None:
    text = "gpu-3:27907:27907 [1] transport/nvls.cc:254 NCCL WARN Cuda failure 401 'the operation cannot be performed in the present state'\n"
    records, _ = parse(text)
    assert [e.kind for e in events(records)] == ["nvls"]


def test_nvls_failure_in_distbackenderror_summary() -> None:
    text = (
        "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, unhandled cuda error, NCCL version 2.29.7\n"
        "ncclUnhandledCudaError: Call to CUDA function failed.\n"
        "Failed to bind NVLink SHARP (NVLS) Multicast memory of size 2097152 : CUDA error 2 'out of memory'.\n"
    )
    records, result = parse(text)
    assert {e.kind for e in events(records)} == {"nvls", "nccl_result"}
    assert result.kinds == ["nccl"]


def test_cuda_errors_only_gpu_faults_become_cuda_error_events() -> None:
    text = (
        "[rank12]:[E817 17:40:34.227531918 ProcessGroupNCCL.cpp:1515] [PG 0 (default_pg) Rank 12] Process group watchdog thread terminated with exception: CUDA error: uncorrectable ECC error encountered\n"
        "gpu-3:1:2 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'\n"
    )
    records, _ = parse(text)
    (event,) = events(records, "cuda_error")
    assert event.code == "uncorrectable_ecc"


def test_socket_closed_verbs_and_ofi_lines() -> None:
    text = (
        "gpu-4:2:3 [3] misc/socket.cc:49 NCCL WARN socketProgress: Connection closed by remote peer gpu-5.example<55693>\n"
        "gpu-4:2:3 [4] ibvwrap.c:130 NCCL WARN Call to ibv_create_qp failed\n"
        "gpu-4:2:3 [5] nccl_ofi_ofiutils_init_connection:274 NCCL WARN NET/OFI Couldn't open CQ. RC: -22, ERROR: Invalid argument\n"
        "gpu-4:2:3 [5] ofi_process_cq:1039 NCCL WARN NET/OFI Request 0x7fbb944701b8 completed with error. RC: 20. Error: unknown error. Completed length: 0\n"
    )
    records, _ = parse(text)
    got = [(e.kind, e.code) for e in events(records)]
    assert got == [
        ("nccl_socket", "closed_by_peer"),
        ("rdma_verbs", "ibv_create_qp"),
        ("rdma_verbs", "fi_open_cq"),
        ("ofi_completion", "20"),
    ]
    assert events(records, "nccl_socket")[0].attrs["peer"] == "gpu-5.example"


def test_async_event_without_device_name() -> None:
    text = "gpu-6:34050:34121 [0] transport/net_ib.cc:93 NCCL WARN NET/IB : Got async event : port error\n"
    records, _ = parse(text)
    (event,) = events(records, "rdma_async")
    assert (event.code, event.entity) == ("port error", "node")


def test_torchrun_summary_is_recognised_without_events() -> None:
    text = (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "Root Cause (first observed failure):\n"
        "  exitcode  : -6 (pid: 970611)\n"
    )
    records, result = parse(text)
    assert result.parsed_lines == 3
    assert not events(records)


def test_watchdog_without_seqnum_old_pytorch() -> None:
    text = "[E ProcessGroupNCCL.cpp:566] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(OpType=BROADCAST, TensorShape=[1], Timeout(ms)=1800000) ran for 1803373 milliseconds before timing out.\n"
    records, result = parse(text)
    (event,) = events(records, "collective_timeout")
    assert event.attrs["op"] == "BROADCAST"
    assert not result.issues


def test_nccl_tests_failure_line_maps_to_result() -> None:
    text = "node-a: Test NCCL failure common.cu:958 'internal error - please report this issue to the NCCL developers / '\n"
    records, result = parse(text)
    (event,) = events(records, "nccl_result")
    assert event.code == "ncclInternalError"
    assert result.kinds == ["nccl"]


def test_status_written_as_text_with_number_and_markdown_quote() -> None:
    text = "> gpu-7:11:22 [3] NCCL WARN NET/IB : Got completion from peer 10.0.0.9<4242> with status=transport retry counter exceeded(12) opcode=0 len=0 vendor err 129 (Recv)\n"
    records, _ = parse(text)
    (event,) = events(records, "rdma_transport")
    assert event.code == "12"
