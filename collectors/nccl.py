"""Artifact parsers for collective-communication logs: NCCL, UCX, PyTorch, nccl-tests.

One session understands every line form below, so that a job log that mixes
them (an MPI job printing UCX and NCCL lines, nccl-tests printing NCCL ``INFO``
lines inside its result table) stays one section with its state:

* NCCL debug lines ``host:pid:tid [dev] [file:line] NCCL WARN|INFO ...``
  (NCCL ``debug.cc``). ``NET/IB : Got completion from peer P with status=N ...
  vendor err V`` and the older ``Got completion [from peer P] with error N,
  opcode O, len L, vendor err V`` become ``rdma_transport`` events whose code is
  the rdma-core ``ibv_wc_status`` value (``libibverbs/verbs.h``: 5
  ``IBV_WC_WR_FLUSH_ERR``, 12 ``IBV_WC_RETRY_EXC_ERR``...). The
  ``file.cc:N -> R`` unwind lines that follow from the same thread are kept as
  evidence of that event. NVLink SHARP (NVLS) and multicast set-up failures become
  ``nvls`` events; ``ncclRemoteError``/``ncclSystemError``/``ncclInternalError``
  summary lines and orphan unwind lines become ``nccl_result`` events.
* UCX lines ``[host:pid:tid:x] ib_mlx5_log.c:N <reason> on mlx5_0:1/IB (synd S
  vend V hw_synd A/B)`` (UCX ``uct/ib/mlx5/ib_mlx5_log.c``); the mlx5 CQE syndrome
  maps to the ``ibv_wc_status`` the rdma-core mlx5 provider reports for it
  (``providers/mlx5/cq.c``, ``mlx5_handle_error_cqe``). The following ``DCI QP``/
  ``RC QP`` line naming ``rlid`` is evidence and names the peer.
* PyTorch ``ProcessGroupNCCL`` watchdog lines: one ``collective_timeout`` event per
  collective (SeqNum), with the ranks that reported it.
* Open MPI openib BTL ``handle_wc`` errors (``error polling LP CQ with status RETRY
  EXCEEDED ERROR status number 12``), also when wrapped over several lines:
  ``rdma_transport`` events by status number or text.
* aws-ofi-nccl ``NET/OFI Request ... completed with error. RC: N`` (``ofi_completion``);
  ``Call to ibv_* failed`` and ``NET/OFI Couldn't open ...`` (``rdma_verbs``);
  ``socketProgress``/``NET/Socket``: ``Connection closed by remote peer`` (``nccl_socket``);
  CUDA errors that point at the GPU (uncorrectable ECC, device busy) as ``cuda_error``.
* Line prefixes: ISO time stamps, Ray ``(name pid=N)``, mpirun ``[1,3]<stdout>:``,
  torchrun ``[default0]:``, srun ``0:``; UCX >= 1.10 ``[epoch] [host:pid:tid] ... UCX
  ERROR`` lines.
* nccl-tests result tables (``all_reduce_perf``...; ``src/common.cu``): a
  ``#wrong`` column above zero at any size, or ``# Out of bounds values : N
  FAILED``, becomes one ``collective`` event ``wrong_results`` per node of the run
  (nodes from the ``Init COMPLETE`` and ``#  Rank N ... on host`` lines). The
  ``# Avg bus bandwidth`` line becomes a ``collective`` event ``avg_busbw``.
"""

from __future__ import annotations

import calendar
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.textparse import Session, line_evidence
from core.records import NODE_ENTITY, EntityId, Event, Evidence, NodeName, Record

logger = logging.getLogger(__name__)

IBV_WC_STATUS: dict[int, str] = {
    0: "IBV_WC_SUCCESS",
    1: "IBV_WC_LOC_LEN_ERR",
    2: "IBV_WC_LOC_QP_OP_ERR",
    3: "IBV_WC_LOC_EEC_OP_ERR",
    4: "IBV_WC_LOC_PROT_ERR",
    5: "IBV_WC_WR_FLUSH_ERR",
    6: "IBV_WC_MW_BIND_ERR",
    7: "IBV_WC_BAD_RESP_ERR",
    8: "IBV_WC_LOC_ACCESS_ERR",
    9: "IBV_WC_REM_INV_REQ_ERR",
    10: "IBV_WC_REM_ACCESS_ERR",
    11: "IBV_WC_REM_OP_ERR",
    12: "IBV_WC_RETRY_EXC_ERR",
    13: "IBV_WC_RNR_RETRY_EXC_ERR",
    14: "IBV_WC_LOC_RDD_VIOL_ERR",
    15: "IBV_WC_REM_INV_RD_REQ_ERR",
    16: "IBV_WC_REM_ABORT_ERR",
    17: "IBV_WC_INV_EECN_ERR",
    18: "IBV_WC_INV_EEC_STATE_ERR",
    19: "IBV_WC_FATAL_ERR",
    20: "IBV_WC_RESP_TIMEOUT_ERR",
    21: "IBV_WC_GENERAL_ERR",
    22: "IBV_WC_TM_ERR",
    23: "IBV_WC_TM_RNDV_INCOMPLETE",
}
"""rdma-core ``enum ibv_wc_status`` (``libibverbs/verbs.h``): value to name."""

MLX5_SYNDROME_TO_WC_STATUS: dict[int, int] = {
    0x01: 1,
    0x02: 2,
    0x04: 4,
    0x05: 5,
    0x06: 6,
    0x10: 7,
    0x11: 8,
    0x12: 9,
    0x13: 10,
    0x14: 11,
    0x15: 12,
    0x16: 13,
    0x22: 16,
}
"""mlx5 CQE error syndrome to ``ibv_wc_status`` (rdma-core ``providers/mlx5/cq.c``)."""

_UCX_REASON_TO_WC_STATUS: tuple[tuple[str, int], ...] = (
    ("transport retry", 12),
    ("receive-not-ready", 13),
    ("rnr retry", 13),
    ("flushed", 5),
    ("remote access", 10),
    ("remote qp", 11),
    ("remote operation", 11),
    ("invalid request", 9),
    ("remote side aborted", 16),
    ("local length", 1),
    ("local qp", 2),
    ("local protection", 4),
    ("local access", 8),
    ("memory window", 6),
    ("bad response", 7),
)
"""UCX ``ib_mlx5_log.c`` reason texts, used when the syndrome is not printed."""

NCCL_RESULT: dict[int, str] = {
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
}
"""NCCL ``ncclResult_t`` values (``nccl.h``) that signal a failure; 7 (in progress) is not one."""

MAX_PENDING_COLLECTIVES = 256
"""Collectives held back at most while their ranks' watchdog lines are gathered."""

MAX_UNWIND_EVIDENCE = 8
"""Unwind lines (``file.cc:N -> R``) kept as evidence of one completion error."""

MAX_WRONG_EVIDENCE = 8
"""Result-table rows kept as evidence of a ``wrong_results`` event."""

# Optional prefixes in front of a log line: ISO time stamps (kubectl --timestamps,
# journald short-iso, NCCL_DEBUG_TIMESTAMP_FORMAT), torchrun "[default0]:", srun "0: ".
_PREFIX = re.compile(
    r"^\s*(?:"
    # ISO time stamps (kubectl --timestamps, journald, CloudWatch, NCCL_DEBUG_TIMESTAMP_FORMAT)
    r"\[?(?P<iso>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)\]?:?\s+"
    # Ray "(name pid=N)", mpirun --tag-output "[1,3]<stdout>:", torchrun "[default0]:"
    r"|\([\w.-]+ pid=\d+(?:, ip=[\w.:]+)?\)\s*"
    r"|\[\d+,\d+\]<(?:stdout|stderr)>:\s*"
    r"|\[default\d+\]:\s*"
    # Markdown quotes of pasted logs ("> host:pid:tid [0] NCCL ...")
    r"|>[ \t]?"
    # srun --label "0: ", mpirun -l "[0] " (only before an NCCL host:pid:tid)
    r"|\d+:\s+(?=\S)"
    r"|\[\d+\]\s+(?=[\w.-]+:\d+:\d+ \[)"
    r")*"
)
_NCCL = re.compile(
    r"(?P<host>[\w.-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>[^\]\s]+)\]\s+"
    r"(?:(?P<src>[\w./-]+:\d+)\s+)?NCCL (?P<level>WARN|INFO|ERROR|ABORT|TRACE)\b\s*(?P<msg>.*)$"
)
# NCCL lines whose "host:pid:tid" was cut by the paste ("[3] include/shm.h:28 NCCL WARN ...").
_NCCL_BARE = re.compile(
    r"^\[(?P<dev>\d+)\]\s+(?:[\w./-]+:\d+\s+)?NCCL (?:WARN|INFO|ERROR|ABORT|TRACE)\b"
)
# Shared-memory failures (NCCL include/shm.h before 2.12, misc/shmutils.cc after; NCCL
# troubleshooting guide, "Shared memory"): the cause NCCL prints before ncclSystemError.
_SHM_CALL = re.compile(
    r"Call to (?P<call>shm_open|shm_unlink|posix_fallocate|fallocate|ftruncate|mmap|open)"
    r" failed\s*:\s*(?P<err>[^(\n]*?)\s*(?:\(\d+\))?\s*$"
)
_SHM_EXTEND = re.compile(
    r"failed to extend (?P<seg>/dev/shm/\S+) to (?P<size>\d+) bytes(?:, error: (?P<err>[^(]*))?"
)
_SHM_SEGMENT = re.compile(
    r"Error while (?P<op>creating|attaching to|mapping|opening) shared memory segment "
    r"(?P<seg>\S*)\s*\(size (?P<size>\d+)\)(?:, error: (?P<err>[^(]*))?"
)
SHM_ERRORS: tuple[tuple[str, str], ...] = (
    ("permission denied", "permission_denied"),
    ("operation not permitted", "permission_denied"),
    ("no space left", "no_space"),
    ("cannot allocate memory", "no_space"),
    ("no such file", "segment_missing"),
)
"""``strerror`` texts of a shared-memory failure to the ``shm`` event code; others are
``failed``."""
_GDR_ON = re.compile(
    r"/GDRDMA\b|\bGDR 1\b|GPU ?Direct RDMA\b[^.]*?\benabled|DMA-BUF is available",
    re.IGNORECASE,
)
_GDR_OFF = re.compile(
    r"GPU ?Direct RDMA\b[^.]*?\bDisabled|\bGDR 0\b"
    r"|NCCL_NET_GDR_LEVEL set by environment to (?:0|LOC)\b",
    re.IGNORECASE,
)
# PyTorch DataLoader (torch/utils/data/_utils/signal_handling.py): a worker killed by SIGBUS
# on a full /dev/shm; the same container shm-size fault as NCCL's.
_TORCH_SHM = re.compile(
    r"insufficient shared memory \(shm\)|workers are out of shared memory", re.IGNORECASE
)
_UNWIND = re.compile(r"^(?P<src>[\w./-]+\.(?:cc|c|cu|h|cpp):\d+) -> (?P<code>\d+)\b")
_COMPLETION = re.compile(
    r"Got completion(?: from peer(?:\s+(?P<peer>(?!with\b)\S+?))?)?,?\s+with\s+"
    r"(?:status\s*=\s*|error\s+)(?:(?P<status>\d+)|(?P<name>IBV_WC_[A-Z_]+)(?:\((?P<num>\d+)\))?"
    r"|(?P<text>[a-z][a-z ]+?)\s*\((?P<num2>\d+)\))",
    re.IGNORECASE,
)
_OPCODE = re.compile(r"opcode[=\s]\s*(?:\w+\()?(?P<v>\d+)")
_VENDOR = re.compile(r"vendor[ _]err[=\s]\s*(?P<v>\d+)")
_ASYNC = re.compile(
    r"(?:(?P<dev>[a-z][\w-]*\d+):(?P<port>\d+)\s+)?(?:Got\s+)?async\s+(?:fatal\s+)?event"
    r"(?:\s+on\s+\w+)?\s*:\s*(?P<what>.+?)\s*$",
    re.IGNORECASE,
)
_DIRECTION = re.compile(r"\((?P<v>Recv|Send|Write|Read|Flush)\)")
_HCA = re.compile(r"\b(?:hca|dev(?:ice)?)\s+(?P<v>[a-z][\w-]*\d+)(?::(?P<port>\d+))?")
_LOCAL_GID = re.compile(r"localGid\s*(?P<v>[0-9a-fA-F:.]+)")
_REMOTE_GID = re.compile(r"remoteGids?\s*(?P<v>[0-9a-fA-F:.]+)")
_RESULT_NAME = re.compile(
    r"\b(?P<name>ncclRemoteError|ncclSystemError|ncclInternalError|ncclUnhandledCudaError)\b"
)
_NVLS = re.compile(r"\bNVLS\b|NVLink SHARP|[Mm]ulticast|cuMulticast|nvls", re.IGNORECASE)
_NVLS_FAIL = re.compile(
    r"fail|error|unable|cannot|could not|not supported|invalid|not permitted", re.IGNORECASE
)
_NVLS_SUMMARY = re.compile(r"NVLink SHARP|\bNVLS\b.*[Mm]ulticast|[Mm]ulticast.*\bNVLS\b")
_CUDA_FAILURE = re.compile(
    r"Cuda failure (?:(?P<num>\d+) )?'(?P<what>[^']+)'|CUDA error: (?P<what2>[^.\n]+?)\s*$"
)
CUDA_GPU_FAULTS: dict[str, str] = {
    "uncorrectable ecc error encountered": "uncorrectable_ecc",
    "cuda-capable device(s) is/are busy or unavailable": "busy_or_unavailable",
}
"""CUDA error texts (``cudaGetErrorString``) that point at the GPU, not the application, to
the ``cuda_error`` event code the GPU rules read; other CUDA failures (out of memory,
invalid argument) give no event of their own."""
_SOCKET_CLOSED = re.compile(
    r"(?:socketProgress|NET/Socket|Net)\s*:\s*Connection closed by remote peer"
    r"(?:\s+(?P<peer>[^\s,;]+))?",
    re.IGNORECASE,
)
_VERBS_CALL = re.compile(
    r"\bCall to (?P<call>ibv_\w+|mlx5dv_\w+|rdma_\w+) failed"
    r"|NET/OFI Couldn't (?P<ofi>open \w+|insert remote address|create \w+)"
)
# aws-ofi-nccl (nccl_ofi_net.c / nccl_ofi_rdma.c): "NET/OFI Request 0x.. completed with error.
# RC: 20. Error: unknown error. Completed length: 0, ...".
_OFI_COMPLETION = re.compile(
    r"NET/OFI Request (?:0x[0-9a-fA-F]+ )?completed with error\. RC: (?P<rc>-?\d+)\.?"
    r"(?:\s*Error: (?P<what>[^.]*))?"
)
_JOB_SUMMARY = re.compile(
    r"^(?:torch\.distributed\.)?(?:DistBackendError|DistNetworkError|DistStoreError)\b|"
    r"^nccl(?:RemoteError|SystemError|InternalError|UnhandledCudaError|InvalidUsage):|"
    r"ChildFailedError|torch/distributed/elastic/|^Root Cause \(first observed failure\)"
)
# Open MPI openib BTL (btl_openib_component.c handle_wc):
# "[[j,1],r][btl_openib_component.c:N:handle_wc] from HOST to: PEER error polling LP CQ
#  with status RETRY EXCEEDED ERROR status number 12 for wr_id W opcode O  vendor error V qp_idx Q"
_OPENIB_START = re.compile(r"handle_wc\]|error polling [LH]P CQ with status")
_OPENIB = re.compile(
    r"(?:from (?P<host>[\w.-]+) to: (?P<peer>[\w.-]+) )?error polling [LH]P CQ with status "
    r"(?P<name>[A-Z][A-Z ]*?ERROR)\b(?: status number (?P<num>\d+))?"
)
_OPENIB_VENDOR = re.compile(r"vendor error (?P<v>\d+)")
OPENIB_STATUS_TEXT: dict[str, int] = {
    "LOCAL LENGTH ERROR": 1,
    "LOCAL QP OPERATION ERROR": 2,
    "LOCAL EEC OPERATION ERROR": 3,
    "LOCAL PROTOCOL ERROR": 4,
    "WORK REQUEST FLUSHED ERROR": 5,
    "MEMORY WINDOW BIND ERROR": 6,
    "BAD RESPONSE ERROR": 7,
    "LOCAL ACCESS ERROR": 8,
    "INVALID REQUEST ERROR": 9,
    "REMOTE ACCESS ERROR": 10,
    "REMOTE OPERATION ERROR": 11,
    "RETRY EXCEEDED ERROR": 12,
    "RECEIVER NOT READY RETRY EXCEEDED ERROR": 13,
    "REMOTE ABORT ERROR": 16,
    "FATAL ERROR": 19,
    "RESPONSE TIMEOUT ERROR": 20,
    "GENERAL ERROR": 21,
}
"""Open MPI openib ``handle_wc`` status texts (``btl_openib_component.c``) to ``ibv_wc_status``."""

MAX_OPENIB_WRAP = 4
"""Lines an Open MPI openib error may be wrapped over (mail archives, narrow terminals)."""

_UCX = re.compile(
    # "[host:pid:tid:x] file.c:N msg" (fatal errors) or, UCX >= 1.10 logging,
    # "[epoch] [host:pid:thread] file.c:N UCX  LEVEL msg"; the first "[" is
    # sometimes lost when the paste starts mid-line.
    r"^(?:\[\d+\.\d+\]\s+)?\[?(?P<host>[\w.-]+):(?P<pid>\d+)(?::(?P<tid>\d+))?(?::(?P<x>\d+))?\]\s+"
    r"(?P<src>[\w./-]+\.(?:c|cc|h|cpp|inl):\d+)\s+(?:UCX\s+(?P<level>[A-Z]+)\s+)?(?P<msg>.*)$"
)
_UCX_ERROR = re.compile(
    r"^(?P<reason>[A-Za-z][\w \-]*?)(?: error)? on (?P<dev>[\w-]+):(?P<port>\d+)/(?P<ll>\w+)"
    r"(?:\s*\((?:synd 0x(?P<synd>[0-9a-fA-F]+))?(?:\s*vend 0x(?P<vend>[0-9a-fA-F]+))?)?"
)
_UCX_QP = re.compile(
    r"\bQP 0x[0-9a-fA-F]+\b.*?(?:\b[rd]lid[= ](?P<rlid>\d+)|\bdgid[= ](?P<gid>[0-9a-fA-F:.]+))"
)
WC_STATUS_TEXT: dict[str, int] = {
    "local length error": 1,
    "local qp operation error": 2,
    "local protection error": 4,
    "work request flushed error": 5,
    "bad response error": 7,
    "local access error": 8,
    "remote invalid request error": 9,
    "remote access error": 10,
    "remote operation error": 11,
    "transport retry counter exceeded": 12,
    "rnr retry counter exceeded": 13,
    "fatal error": 19,
    "response timeout error": 20,
}
"""rdma-core ``ibv_wc_status_str()`` texts (``libibverbs/enum_strs.c``) to status values."""

_TORCH_TIME = re.compile(
    r"\[[IWEF](?P<mon>\d{1,2}?)(?P<day>\d{2}) (?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})"
)
_WATCHDOG = re.compile(
    # PyTorch >= 1.10 "WorkNCCL(SeqNum=N, OpType=X, ...)"; 1.8/1.9 "WorkNCCL(OpType=X, ...)".
    r"Watchdog caught collective operation timeout: WorkNCCL\((?:SeqNum=(?P<seq>\d+), )?"
    r"OpType=(?P<op>\w+)(?P<rest>.*?)\)\s*ran for (?P<ran>\d+) milliseconds"
)
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(?P<v>\d+)")
_WORK = re.compile(
    r"(?:detected by watchdog at work|Timeout at NCCL work): (?P<seq>\d+), "
    r"last enqueued NCCL work: (?P<enq>-?\d+), last completed NCCL work: (?P<done>-?\d+)"
)
_RANK = re.compile(r"\[(?:PG [^\]]*?)?Rank (?P<r>\d+)\]|\[rank(?P<r2>\d+)\]")
_PG = re.compile(r"\[PG (?:ID )?(?P<pg>\d+)")

_TESTS_HEADER = re.compile(r"^#\s+size\s+count\s+type\b.*#wrong")
_TESTS_RANK = re.compile(
    r"^#\s+Rank\s+(?P<rank>\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(?P<host>[\w.-]+)\s+device"
)
_INIT_COMPLETE = re.compile(r"\brank (?P<rank>\d+) nranks (?P<n>\d+)\b.*Init COMPLETE")
_TESTS_ROW = re.compile(r"^\s*\d+\s+\d+\s+[a-z][\w]*\s+[a-z]+\s+-?\d+\s+[\d.]+\s")
_TESTS_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(?P<n>\d+)\s*(?P<verdict>\w+)?")
_TESTS_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(?P<v>[\d.]+)")
# nccl-tests common.cu: "host: Test NCCL failure common.cu:958 'internal error - ...'",
# "Test CUDA failure common.cu:891 'out of memory'".
_TESTS_FAILURE = re.compile(r"Test (?P<what>NCCL|CUDA) failure \S+:\d+ '(?P<text>[^']*)'")
NCCL_RESULT_TEXT: tuple[tuple[str, str], ...] = (
    ("unhandled cuda error", "ncclUnhandledCudaError"),
    ("unhandled system error", "ncclSystemError"),
    ("internal error", "ncclInternalError"),
    ("remote process exited", "ncclRemoteError"),
    ("network error", "ncclRemoteError"),
    ("invalid usage", "ncclInvalidUsage"),
    ("invalid argument", "ncclInvalidArgument"),
)
"""``ncclGetErrorString`` texts (``src/misc/utils.cc``) to ``ncclResult_t`` names."""
_TESTS_META = re.compile(r"^#\s*(?:nThread|Using devices|\s*Rank\s+\d+|Collective test)")
_TESTS_STRONG = (_TESTS_HEADER, _TESTS_AVG, _TESTS_OOB, _TESTS_RANK)
_PERF_BINARY = re.compile(r"\b(?P<op>[a-z_]+)_perf(?:_mpi)?\b")


_STATUS_BY_NAME = {name: code for code, name in IBV_WC_STATUS.items()}


def _status_of(completion: re.Match[str]) -> int:
    """Return the status number of a completion match (``12`` or ``IBV_WC_..(12)``)."""
    if completion["status"]:
        return int(completion["status"])
    if completion["num"]:
        return int(completion["num"])
    if completion["num2"]:
        return int(completion["num2"])
    return _STATUS_BY_NAME.get(completion["name"].upper(), -1)


def _iso_to_epoch(text: str) -> float | None:
    stamp = text.replace(",", ".").replace(" ", "T", 1)
    if stamp.endswith("Z"):
        stamp = stamp[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def wc_status_name(status: int) -> str:
    """Return the rdma-core name of an ``ibv_wc_status`` value.

    Examples:
        >>> wc_status_name(12)
        'IBV_WC_RETRY_EXC_ERR'
        >>> wc_status_name(99)
        'ibv_wc_status 99'
    """
    return IBV_WC_STATUS.get(status, f"ibv_wc_status {status}")


def link_entity(node: str, peer: str) -> EntityId:
    """Return the entity of the link between ``node`` and ``peer``.

    Examples:
        >>> link_entity("node-a", "192.0.2.20")
        'node-a<->192.0.2.20'
    """
    return EntityId(f"{node}<->{peer}")


def _strip_peer(peer: str) -> str:
    """Drop NCCL's ``<port>`` suffix (``192.0.2.20<54862>``) and brackets."""
    peer = re.sub(r"<\d+>$", "", peer.rstrip(",;"))
    return peer.strip("[]")


@dataclass(slots=True)
class _Pending:
    """An event whose continuation lines (unwind, QP) may still come."""

    event: Event
    thread: str
    extra: list[Evidence] = field(default_factory=list)


@dataclass(slots=True)
class _Collective:
    """Watchdog lines of one timed-out collective."""

    node: NodeName
    seq: str
    op: str = ""
    ranks: set[str] = field(default_factory=set)
    pg: str = ""
    timeout_ms: str = ""
    ran_ms: int = 0
    observed_at: float | None = None
    year_assumed: bool = False
    enqueued: str = ""
    completed: str = ""
    evidence: list[Evidence] = field(default_factory=list)


@dataclass(slots=True)
class _TestRun:
    """State of one nccl-tests run."""

    nodes: dict[str, set[str]] = field(default_factory=dict)
    wrong_cols: list[int] = field(default_factory=list)
    ncols: int = 0
    header: Evidence | None = None
    wrong_rows: int = 0
    max_wrong: int = 0
    sizes: list[str] = field(default_factory=list)
    oob_failed: int = 0
    evidence: list[Evidence] = field(default_factory=list)
    node_evidence: list[Evidence] = field(default_factory=list)
    rows: int = 0


class CollectiveLogSession(Session):
    """Parse one section of NCCL, UCX, PyTorch or nccl-tests output (see module doc)."""

    def __init__(self, ctx: ParseContext, *, source: str) -> None:
        super().__init__(ctx)
        self._source = source
        self._pending: _Pending | None = None
        self._collectives: dict[tuple[str, str], _Collective] = {}
        self._run = _TestRun()
        self._op = self._op_from_command(ctx.command)
        self._openib: tuple[Line, str, int] | None = None
        self._gdr_seen: set[tuple[str, str]] = set()

    @staticmethod
    def _op_from_command(command: str | None) -> str:
        if command:
            match = _PERF_BINARY.search(command)
            if match:
                return match["op"]
        return ""

    # --- feeding -----------------------------------------------------------

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; return the records completed so far."""
        out: list[Record] = []
        for line in lines:
            try:
                self._line(line, out)
            except (ValueError, IndexError) as exc:  # defensive: never raise on bad input
                self.issue(line.number, f"unparsable line: {exc}")
        return out

    def close(self) -> list[Record]:
        """Flush held-back events, timed-out collectives and the nccl-tests verdict."""
        out: list[Record] = []
        self._flush_pending(out)
        self._flush_openib(out, final=True)
        for coll in self._collectives.values():
            out.append(self._collective_event(coll))
        self._collectives.clear()
        self._finish_run(out)
        return out

    def _line(self, line: Line, out: list[Record]) -> None:
        text = line.text
        prefix = _PREFIX.match(text)
        at: float | None = None
        body = text
        if prefix:
            if prefix["iso"]:
                at = _iso_to_epoch(prefix["iso"])
            body = text[prefix.end() :]
        if self._openib is not None or _OPENIB_START.search(body):
            self._openib_line(line, body, out)
            return
        if body.startswith("[") and _NCCL_BARE.match(body):
            body = f"{self.ctx.node}:0:0 {body}"
        nccl = _NCCL.match(body)
        if nccl:
            self._nccl_line(line, nccl, at, out)
            return
        ucx = _UCX.match(body)
        if ucx:
            self._ucx_line(line, ucx, at, out)
            return
        self._flush_pending(out)
        if "ProcessGroupNCCL" in body or "WorkNCCL" in body or "NCCL work" in body:
            self._torch_line(line, body, at, out)
            return
        if body.lstrip().startswith("#") or _TESTS_ROW.match(body):
            self._tests_line(line, body.strip(), out)
            return
        if _RESULT_NAME.search(body) or _COMPLETION.search(body):
            self._summary_line(line, body, self.ctx.node, at, out)
            return
        failure = _TESTS_FAILURE.search(body)
        if failure:
            self._tests_failure(line, failure, at, out)
            return
        closed = _SOCKET_CLOSED.search(body)
        if closed:
            out.append(self._socket_event(self.ctx.node, closed, line, at))
            return
        if _NVLS_SUMMARY.search(body) and _NVLS_FAIL.search(body):
            out.append(self._nvls_event(self.ctx.node, body, line, at, {}))
            return
        cuda = _CUDA_FAILURE.search(body)
        if cuda:
            self._append(out, self._cuda_event(self.ctx.node, cuda, line, at, {}))
            return
        if _TORCH_SHM.search(body):
            out.append(
                Event(
                    kind="shm",
                    code="no_space",
                    node=self.ctx.node,
                    entity=NODE_ENTITY,
                    observed_at=at,
                    message=body.strip()[:300],
                    attrs={"error": "insufficient shared memory (shm)", "src": "DataLoader"},
                    evidence=(line_evidence(self.ctx, line),),
                    source=self._source,
                )
            )

    @staticmethod
    def _append(out: list[Record], event: Event | None) -> None:
        if event is not None:
            out.append(event)

    # --- NCCL --------------------------------------------------------------

    def _nccl_line(self, line: Line, m: re.Match[str], at: float | None, out: list[Record]) -> None:
        node = NodeName(m["host"])
        thread = f"{m['host']}:{m['pid']}:{m['tid']}"
        msg = m["msg"]
        level = m["level"]
        unwind = _UNWIND.match(msg)
        if unwind:
            code = int(unwind["code"])
            pending = self._pending
            if pending is not None and pending.thread == thread:
                if len(pending.extra) < MAX_UNWIND_EVIDENCE:
                    pending.extra.append(line_evidence(self.ctx, line))
                return
            if code in NCCL_RESULT:
                self._flush_pending(out)
                out.append(self._result_event(node, NCCL_RESULT[code], line, at, m["pid"]))
            return
        self._flush_pending(out)
        init = _INIT_COMPLETE.search(msg)
        if init:
            self._run.nodes.setdefault(m["host"], set()).add(init["rank"])
            self._keep_node_evidence(line)
            return
        if "GDR" in msg or "GPU Direct" in msg or "GPUDirect" in msg:
            self._gdr_line(node, msg, line, at, out)
        src = m["src"] or ""
        if level != "INFO" and ("shm" in msg or "shared memory" in msg or "shm" in src):
            shm = self._shm_event(node, msg, src, line, at)
            if shm is not None:
                out.append(shm)
                return
        completion = _COMPLETION.search(msg)
        if completion is None and "Got completion" in msg:
            self.issue(line.number, "NCCL completion line without a status")
            return
        if completion:
            event = self._completion_event(node, completion, msg, line, at, m)
            self._pending = _Pending(event=event, thread=thread)
            return
        async_event = _ASYNC.search(msg)
        if async_event and level != "INFO":
            device = f"{async_event['dev']}:{async_event['port']}" if async_event["dev"] else ""
            what = async_event["what"].strip().rstrip(".").lower()
            out.append(
                Event(
                    kind="rdma_async",
                    code=what[:64],
                    node=node,
                    entity=EntityId(device) if device else NODE_ENTITY,
                    observed_at=at,
                    message=msg.strip(),
                    attrs={"device": device, "pid": m["pid"]} if device else {"pid": m["pid"]},
                    evidence=(line_evidence(self.ctx, line),),
                    source=self._source,
                )
            )
            return
        src = m["src"] or ""
        warn = level in {"WARN", "ERROR", "ABORT"}
        if (
            warn
            and (_NVLS.search(msg) or "nvls" in src.lower() or "multicast" in src.lower())
            and _NVLS_FAIL.search(msg)
        ):
            attrs = {"cuda_dev": m["dev"], "pid": m["pid"], "src": src}
            out.append(self._nvls_event(node, msg, line, at, attrs))
            return
        closed = _SOCKET_CLOSED.search(msg)
        if closed and warn:
            out.append(self._socket_event(node, closed, line, at))
            return
        ofi = _OFI_COMPLETION.search(msg)
        if ofi and warn:
            attrs = {"rc": ofi["rc"], "pid": m["pid"], "cuda_dev": m["dev"]}
            if ofi["what"]:
                attrs["error"] = ofi["what"].strip()
            out.append(
                Event(
                    kind="ofi_completion",
                    code=ofi["rc"],
                    node=node,
                    entity=NODE_ENTITY,
                    observed_at=at,
                    message=msg.strip(),
                    attrs=attrs,
                    evidence=(line_evidence(self.ctx, line),),
                    source=self._source,
                )
            )
            return
        verbs = _VERBS_CALL.search(msg)
        if verbs and warn:
            call = verbs["call"] or "fi_" + verbs["ofi"].lower().replace(" ", "_")
            out.append(
                Event(
                    kind="rdma_verbs",
                    code=call,
                    node=node,
                    entity=NODE_ENTITY,
                    observed_at=at,
                    message=msg.strip(),
                    attrs={"cuda_dev": m["dev"], "pid": m["pid"], "src": src},
                    evidence=(line_evidence(self.ctx, line),),
                    source=self._source,
                )
            )
            return
        cuda = _CUDA_FAILURE.search(msg)
        if cuda and warn:
            attrs = {"cuda_dev": m["dev"], "src": src}
            self._append(out, self._cuda_event(node, cuda, line, at, attrs))
            return
        result = _RESULT_NAME.search(msg)
        if result and level != "INFO":
            out.append(self._result_event(node, result["name"], line, at, m["pid"]))

    def _shm_event(
        self, node: NodeName, msg: str, src: str, line: Line, at: float | None
    ) -> Event | None:
        """A shared-memory failure NCCL prints before its ``ncclSystemError`` (see ``_SHM_*``)."""
        attrs: dict[str, str] = {"src": src} if src else {}
        err = ""
        call = _SHM_CALL.search(msg)
        extend = _SHM_EXTEND.search(msg)
        segment = _SHM_SEGMENT.search(msg)
        if call and ("shm" in src.lower() or call["call"].startswith("shm")):
            attrs["call"] = call["call"]
            err = call["err"]
        elif extend:
            attrs.update(segment=extend["seg"], size_bytes=extend["size"], operation="extend")
            err = extend["err"] or "No space left on device"
        elif segment:
            attrs.update(segment=segment["seg"], size_bytes=segment["size"],
                         operation=segment["op"].split()[0])
            err = segment["err"] or ""
        else:
            return None
        err = err.strip().rstrip(",.")
        if err:
            attrs["error"] = err
        low = err.lower()
        code = next((c for text, c in SHM_ERRORS if text in low), "failed")
        return Event(
            kind="shm",
            code=code,
            node=node,
            entity=NODE_ENTITY,
            observed_at=at,
            message=msg.strip(),
            attrs=attrs,
            evidence=(line_evidence(self.ctx, line),),
            source=self._source,
        )

    def _gdr_line(
        self, node: NodeName, msg: str, line: Line, at: float | None, out: list[Record]
    ) -> None:
        """Note once per node whether NCCL uses GPUDirect RDMA (``via NET/IB/0/GDRDMA``)."""
        state = "enabled" if _GDR_ON.search(msg) else "disabled" if _GDR_OFF.search(msg) else ""
        if not state or (node, state) in self._gdr_seen:
            return
        self._gdr_seen.add((node, state))
        out.append(
            Event(
                kind="nccl_gdr",
                code=state,
                node=node,
                entity=NODE_ENTITY,
                observed_at=at,
                message=msg.strip(),
                attrs={},
                evidence=(line_evidence(self.ctx, line),),
                source=self._source,
            )
        )

    def _completion_event(
        self,
        node: NodeName,
        completion: re.Match[str],
        msg: str,
        line: Line,
        at: float | None,
        m: re.Match[str] | None,
    ) -> Event:
        status = _status_of(completion)
        attrs: dict[str, str] = {"status_name": wc_status_name(status)}
        tail = msg[completion.end() :]
        for key, pattern in (
            ("opcode", _OPCODE),
            ("vendor_err", _VENDOR),
            ("direction", _DIRECTION),
            ("local_gid", _LOCAL_GID),
            ("remote_gid", _REMOTE_GID),
        ):
            found = pattern.search(tail)
            if found:
                attrs[key] = found["v"]
        hca = _HCA.search(tail)
        if hca:
            attrs["device"] = hca["v"] + (f":{hca['port']}" if hca["port"] else "")
        entity: EntityId = NODE_ENTITY
        if completion["peer"]:
            peer = _strip_peer(completion["peer"])
            attrs["peer"] = peer
            entity = link_entity(node, peer)
        elif "device" in attrs:
            entity = EntityId(attrs["device"])
        if m is not None:
            attrs["pid"] = m["pid"]
            attrs["cuda_dev"] = m["dev"]
        return Event(
            kind="rdma_transport",
            code=str(status),
            node=node,
            entity=entity,
            observed_at=at,
            message=msg.strip(),
            attrs=attrs,
            evidence=(line_evidence(self.ctx, line),),
            source=self._source,
        )

    def _tests_failure(
        self, line: Line, failure: re.Match[str], at: float | None, out: list[Record]
    ) -> None:
        """An nccl-tests ``Test NCCL|CUDA failure`` line: the test aborted."""
        text = failure["text"].lower()
        if failure["what"] == "CUDA":
            cuda = _CUDA_FAILURE.search(f"Cuda failure '{failure['text']}'")
            if cuda:
                self._append(out, self._cuda_event(self.ctx.node, cuda, line, at, {}))
            return
        for needle, name in NCCL_RESULT_TEXT:
            if needle in text:
                out.append(self._result_event(self.ctx.node, name, line, at, ""))
                return

    def _socket_event(
        self, node: NodeName, closed: re.Match[str], line: Line, at: float | None
    ) -> Event:
        attrs = {"peer": _strip_peer(closed["peer"])} if closed["peer"] else {}
        return Event(
            kind="nccl_socket",
            code="closed_by_peer",
            node=node,
            entity=NODE_ENTITY,
            observed_at=at,
            message=line.text.strip(),
            attrs=attrs,
            evidence=(line_evidence(self.ctx, line),),
            source=self._source,
        )

    def _nvls_event(
        self, node: NodeName, msg: str, line: Line, at: float | None, attrs: dict[str, str]
    ) -> Event:
        return Event(
            kind="nvls",
            code="setup_failed",
            node=node,
            entity=NODE_ENTITY,
            observed_at=at,
            message=msg.strip(),
            attrs=attrs,
            evidence=(line_evidence(self.ctx, line),),
            source=self._source,
        )

    def _cuda_event(
        self,
        node: NodeName,
        cuda: re.Match[str],
        line: Line,
        at: float | None,
        attrs: dict[str, str],
    ) -> Event | None:
        """A CUDA failure seen by NCCL or PyTorch (``Cuda failure 'x'``, ``CUDA error: x``).

        Only the errors of :data:`CUDA_GPU_FAULTS` give an event; the collective
        log only carries them, what they mean for the GPU is judged by the GPU rules.
        """
        what = (cuda["what"] or cuda["what2"] or "").strip()
        code = CUDA_GPU_FAULTS.get(what.lower())
        if code is None:
            return None
        full = dict(attrs, cuda_error_text=what)
        if cuda["num"]:
            full["cuda_error"] = cuda["num"]
        return Event(
            kind="cuda_error",
            code=code,
            node=node,
            entity=NODE_ENTITY,
            observed_at=at,
            message=line.text.strip(),
            attrs=full,
            evidence=(line_evidence(self.ctx, line),),
            source=self._source,
        )

    # --- Open MPI openib -------------------------------------------------------

    def _openib_line(self, line: Line, body: str, out: list[Record]) -> None:
        """Gather an openib ``handle_wc`` error, possibly wrapped over several lines."""
        self._flush_pending(out)
        if self._openib is None:
            self._openib = (line, body.strip(), 1)
        else:
            first, text, n = self._openib
            self._openib = (first, f"{text} {body.strip()}", n + 1)
        first, text, n = self._openib
        m = _OPENIB.search(text)
        if m and m["num"]:
            self._openib_event(m, text, first, out)
        elif n >= MAX_OPENIB_WRAP:
            self._flush_openib(out, final=True)

    def _flush_openib(self, out: list[Record], *, final: bool) -> None:
        if self._openib is None:
            return
        first, text, _n = self._openib
        self._openib = None
        m = _OPENIB.search(text)
        if m:
            self._openib_event(m, text, first, out)
        elif final:
            self.issue(first.number, "Open MPI openib error without a status")

    def _openib_event(self, m: re.Match[str], text: str, first: Line, out: list[Record]) -> None:
        self._openib = None
        status = (
            int(m["num"]) if m["num"] else OPENIB_STATUS_TEXT.get(" ".join(m["name"].split()), -1)
        )
        node = NodeName(m["host"]) if m["host"] else self.ctx.node
        attrs = {"status_name": wc_status_name(status), "openib_status": m["name"]}
        entity: EntityId = NODE_ENTITY
        if m["peer"]:
            attrs["peer"] = m["peer"]
            entity = link_entity(node, m["peer"])
        vendor = _OPENIB_VENDOR.search(text)
        if vendor:
            attrs["vendor_err"] = vendor["v"]
        out.append(
            Event(
                kind="rdma_transport",
                code=str(status),
                node=node,
                entity=entity,
                observed_at=None,
                message=text[:300],
                attrs=attrs,
                evidence=(line_evidence(self.ctx, first),),
                source=self._source,
            )
        )

    def _result_event(
        self, node: NodeName, name: str, line: Line, at: float | None, pid: str
    ) -> Event:
        return Event(
            kind="nccl_result",
            code=name,
            node=node,
            entity=NODE_ENTITY,
            observed_at=at,
            message=line.text.strip(),
            attrs={"pid": pid} if pid else {},
            evidence=(line_evidence(self.ctx, line),),
            source=self._source,
        )

    def _summary_line(
        self, line: Line, body: str, node: NodeName, at: float | None, out: list[Record]
    ) -> None:
        """An exception or summary line (``ncclRemoteError ... Last error: ...``)."""
        completion = _COMPLETION.search(body)
        if completion:
            out.append(self._completion_event(node, completion, body, line, at, None))
            return
        result = _RESULT_NAME.search(body)
        if result:
            out.append(self._result_event(node, result["name"], line, at, ""))

    def _flush_pending(self, out: list[Record]) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        event = pending.event
        if pending.extra:
            event = Event(
                kind=event.kind,
                code=event.code,
                node=event.node,
                entity=event.entity,
                observed_at=event.observed_at,
                message=event.message,
                attrs=event.attrs,
                evidence=event.evidence + tuple(pending.extra),
                source=event.source,
            )
        out.append(event)

    # --- UCX ---------------------------------------------------------------

    def _ucx_line(self, line: Line, m: re.Match[str], at: float | None, out: list[Record]) -> None:
        msg = m["msg"].strip()
        thread = f"{m['host']}:{m['pid']}:{m['tid'] or ''}"
        pending = self._pending
        qp = _UCX_QP.search(msg)
        if qp and pending is not None and pending.thread == thread:
            peer = f"lid:{qp['rlid']}" if qp["rlid"] else f"gid:{qp['gid']}"
            old = pending.event
            attrs = dict(old.attrs)
            attrs["peer"] = peer
            if qp["rlid"]:
                attrs["rlid"] = qp["rlid"]
            pending.event = Event(
                kind=old.kind,
                code=old.code,
                node=old.node,
                entity=link_entity(old.node, peer),
                observed_at=old.observed_at,
                message=old.message,
                attrs=attrs,
                evidence=(*old.evidence, line_evidence(self.ctx, line)),
                source=old.source,
            )
            self._flush_pending(out)
            return
        self._flush_pending(out)
        err = _UCX_ERROR.match(msg)
        if not err:
            self._ucx_verbs_line(line, m, msg, at, out)
            return
        status = self._ucx_status(err)
        if status is None:
            return
        node = NodeName(m["host"])
        device = f"{err['dev']}:{err['port']}"
        attrs = {
            "status_name": wc_status_name(status),
            "device": device,
            "link_layer": err["ll"],
            "pid": m["pid"],
        }
        if err["synd"]:
            attrs["syndrome"] = f"0x{err['synd'].lower()}"
        if err["vend"]:
            attrs["vendor_err"] = str(int(err["vend"], 16))
        event = Event(
            kind="rdma_transport",
            code=str(status),
            node=node,
            entity=EntityId(device),
            observed_at=at,
            message=msg,
            attrs=attrs,
            evidence=(line_evidence(self.ctx, line),),
            source=self._source,
        )
        self._pending = _Pending(event=event, thread=thread)

    def _ucx_verbs_line(
        self, line: Line, m: re.Match[str], msg: str, at: float | None, out: list[Record]
    ) -> None:
        """A UCX verbs-transport line naming an ``ibv_wc_status_str()`` text."""
        low = msg.lower()
        if "error" not in low and "exceeded" not in low:
            return
        for text, status in WC_STATUS_TEXT.items():
            if text in low:
                out.append(
                    Event(
                        kind="rdma_transport",
                        code=str(status),
                        node=NodeName(m["host"]),
                        entity=NODE_ENTITY,
                        observed_at=at,
                        message=msg,
                        attrs={"status_name": wc_status_name(status), "pid": m["pid"]},
                        evidence=(line_evidence(self.ctx, line),),
                        source=self._source,
                    )
                )
                return

    @staticmethod
    def _ucx_status(err: re.Match[str]) -> int | None:
        if err["synd"]:
            status = MLX5_SYNDROME_TO_WC_STATUS.get(int(err["synd"], 16))
            if status is not None:
                return status
        reason = err["reason"].lower()
        for text, status in _UCX_REASON_TO_WC_STATUS:
            if text in reason:
                return status
        return None

    # --- PyTorch -----------------------------------------------------------

    def _torch_time(self, body: str, at: float | None) -> tuple[float | None, bool]:
        if at is not None:
            return at, False
        stamp = _TORCH_TIME.search(body)
        if stamp is None:
            return None, False
        year = self.ctx.default_year
        assumed = True
        if year is None:
            year = datetime.now(UTC).year
        try:
            when = datetime(
                year,
                int(stamp["mon"]),
                int(stamp["day"]),
                int(stamp["h"]),
                int(stamp["m"]),
                int(stamp["s"]),
                tzinfo=UTC,
            )
        except ValueError:
            return None, False
        return float(calendar.timegm(when.timetuple())), assumed

    def _torch_line(self, line: Line, body: str, at: float | None, out: list[Record]) -> None:
        rank_m = _RANK.search(body)
        rank = (rank_m["r"] or rank_m["r2"]) if rank_m else ""
        pg_m = _PG.search(body)
        watchdog = _WATCHDOG.search(body)
        work = _WORK.search(body)
        seq = (
            (watchdog["seq"] or f"{watchdog['op']}-unnumbered")
            if watchdog
            else work["seq"]
            if work
            else None
        )
        if seq is None:
            cuda = _CUDA_FAILURE.search(body)
            if cuda:
                attrs = {"rank": rank} if rank else {}
                self._append(out, self._cuda_event(self.ctx.node, cuda, line, at, attrs))
                return
            if "Watchdog caught" in body:
                self.issue(line.number, "watchdog timeout line without SeqNum/OpType")
            return
        node = self.ctx.node
        key = (node, seq)
        coll = self._collectives.get(key)
        if coll is None:
            if len(self._collectives) >= MAX_PENDING_COLLECTIVES:
                oldest = next(iter(self._collectives))
                out.append(self._collective_event(self._collectives.pop(oldest)))
            coll = self._collectives[key] = _Collective(node=node, seq=seq)
        when, assumed = self._torch_time(body, at)
        if when is not None and (coll.observed_at is None or when < coll.observed_at):
            coll.observed_at, coll.year_assumed = when, assumed
        if rank:
            coll.ranks.add(rank)
        if pg_m and not coll.pg:
            coll.pg = pg_m["pg"]
        if watchdog:
            coll.op = watchdog["op"]
            coll.ran_ms = max(coll.ran_ms, int(watchdog["ran"]))
            timeout = _TIMEOUT_MS.search(watchdog["rest"])
            if timeout:
                coll.timeout_ms = timeout["v"]
        if work:
            coll.enqueued, coll.completed = work["enq"], work["done"]
        if len(coll.evidence) < 8:
            coll.evidence.append(line_evidence(self.ctx, line))

    def _collective_event(self, coll: _Collective) -> Event:
        attrs = {"seq": coll.seq, "ranks": ",".join(sorted(coll.ranks, key=int))}
        if coll.op:
            attrs["op"] = coll.op
        if coll.pg:
            attrs["pg"] = coll.pg
        if coll.timeout_ms:
            attrs["timeout_seconds"] = f"{int(coll.timeout_ms) / 1000:g}"
        if coll.ran_ms:
            attrs["ran_seconds"] = f"{coll.ran_ms / 1000:g}"
        if coll.enqueued:
            attrs["last_enqueued"] = coll.enqueued
            attrs["last_completed"] = coll.completed
        if coll.year_assumed:
            attrs["year_assumed"] = "true"
        op = coll.op or "collective"
        return Event(
            kind="collective_timeout",
            code=coll.seq,
            node=coll.node,
            entity=NODE_ENTITY,
            observed_at=coll.observed_at,
            message=f"{op} SeqNum={coll.seq} timed out on ranks {attrs['ranks'] or '?'}",
            attrs=attrs,
            evidence=tuple(coll.evidence),
            source=self._source,
        )

    # --- nccl-tests ----------------------------------------------------------

    def _keep_node_evidence(self, line: Line) -> None:
        if len(self._run.node_evidence) < 4:
            self._run.node_evidence.append(line_evidence(self.ctx, line))

    def _tests_line(self, line: Line, body: str, out: list[Record]) -> None:
        run = self._run
        if _TESTS_HEADER.match(body):
            tokens = body.lstrip("#").split()
            run.wrong_cols = [i for i, tok in enumerate(tokens) if tok == "#wrong"]
            run.ncols = len(tokens)
            run.header = line_evidence(self.ctx, line)
            return
        rank = _TESTS_RANK.match(body)
        if rank:
            run.nodes.setdefault(rank["host"], set()).add(rank["rank"])
            self._keep_node_evidence(line)
            return
        oob = _TESTS_OOB.match(body)
        if oob:
            if int(oob["n"]) > 0 or (oob["verdict"] or "").upper() == "FAILED":
                run.oob_failed = max(run.oob_failed, int(oob["n"]))
                run.evidence.append(line_evidence(self.ctx, line))
            return
        avg = _TESTS_AVG.match(body)
        if avg:
            self._avg_event(line, float(avg["v"]), out)
            self._finish_run(out)
            return
        if body.startswith("#"):
            return
        self._tests_row(line, body)

    def _tests_row(self, line: Line, body: str) -> None:
        run = self._run
        tokens = body.split()
        cols = run.wrong_cols
        if not cols or len(tokens) != run.ncols:
            # Without a header: the standard 13-column layout of nccl-tests >= 2.0.
            if len(tokens) == 13:
                cols = [8, 12]
            elif len(tokens) == 12 and not cols:
                cols = [7, 11]  # tables without the root column (older versions)
            else:
                self.issue(
                    line.number,
                    f"nccl-tests row with {len(tokens)} columns, expected {run.ncols or 13}",
                )
                return
        run.rows += 1
        wrong = 0
        for col in cols:
            if col < len(tokens) and tokens[col].isdigit():
                wrong = max(wrong, int(tokens[col]))
        if wrong > 0:
            run.wrong_rows += 1
            run.max_wrong = max(run.max_wrong, wrong)
            if len(run.sizes) < 64:
                run.sizes.append(tokens[0])
            if len(run.evidence) < MAX_WRONG_EVIDENCE:
                run.evidence.append(line_evidence(self.ctx, line))

    def _avg_event(self, line: Line, busbw: float, out: list[Record]) -> None:
        attrs = {"busbw_gigabytes_per_second": f"{busbw:g}"}
        if self._op:
            attrs["op"] = self._op
        out.append(
            Event(
                kind="collective",
                code="avg_busbw",
                node=self.ctx.node,
                entity=NODE_ENTITY,
                observed_at=None,
                message=f"nccl-tests average bus bandwidth {busbw:g} GB/s",
                attrs=attrs,
                evidence=(line_evidence(self.ctx, line),),
                source=self._source,
            )
        )

    def _finish_run(self, out: list[Record]) -> None:
        run = self._run
        self._run = _TestRun()
        if run.wrong_rows == 0 and run.oob_failed == 0:
            # Keep nodes named by Init lines for a table that follows later.
            self._run.nodes = run.nodes if run.rows == 0 else {}
            self._run.node_evidence = run.node_evidence if run.rows == 0 else []
            self._run.wrong_cols, self._run.ncols = run.wrong_cols, run.ncols
            self._run.header = run.header
            return
        nodes = sorted(run.nodes) or [str(self.ctx.node)]
        ranks = sorted({r for rs in run.nodes.values() for r in rs}, key=int)
        evidence = tuple(([run.header] if run.header else []) + run.node_evidence + run.evidence)
        attrs = {
            "nodes": ",".join(nodes),
            "ranks": ",".join(ranks),
            "rows_wrong": str(run.wrong_rows),
            "max_wrong": str(run.max_wrong),
            "sizes_bytes": ",".join(run.sizes),
        }
        if run.oob_failed:
            attrs["out_of_bounds"] = str(run.oob_failed)
        if self._op:
            attrs["op"] = self._op
        for node in nodes:
            out.append(
                Event(
                    kind="collective",
                    code="wrong_results",
                    node=NodeName(node),
                    entity=NODE_ENTITY,
                    observed_at=None,
                    message=(
                        f"nccl-tests {self._op or 'collective'}: wrong results in "
                        f"{run.wrong_rows} sizes (max #wrong {run.max_wrong}) "
                        f"on {len(nodes)} node(s)"
                    ),
                    attrs=attrs,
                    evidence=evidence,
                    source=self._source,
                )
            )


class _CollectiveParser:
    """Base of the parsers that share :class:`CollectiveLogSession`."""

    kind = ""
    source = ""

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return CollectiveLogSession(ctx, source=self.source)


def _body(text: str) -> str:
    prefix = _PREFIX.match(text)
    return text[prefix.end() :] if prefix else text


class NcclLogParser(_CollectiveParser):
    """NCCL debug logs, PyTorch ProcessGroupNCCL logs and nccl-tests output."""

    kind = "nccl"
    source = "nccl_log"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 0-100 from the share of NCCL, watchdog and nccl-tests lines."""
        hits = 0
        strong = False
        for line in lines[:200]:
            body = _body(line.text)
            stripped = body.strip()
            if (
                _NCCL.match(body)
                or _NCCL_BARE.match(body)
                or "ProcessGroupNCCL" in body
                or "WorkNCCL(" in body
                or any(p.match(stripped) for p in _TESTS_STRONG)
                or _JOB_SUMMARY.search(stripped)
                or _TESTS_FAILURE.search(body)
                or _OPENIB_START.search(body)
                or _TORCH_SHM.search(body)
            ):
                hits += 1
                strong = True
            elif _TESTS_ROW.match(body):
                hits += 1
        if hits == 0:
            return 0
        if strong:
            return 90
        if command and _PERF_BINARY.search(command):
            return 80
        share = hits / max(1, min(len(lines), 200))
        return 40 if share > 0.5 else 0


class UcxLogParser(_CollectiveParser):
    """UCX logs (``[host:pid:tid:x] file.c:N message``)."""

    kind = "ucx"
    source = "ucx_log"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 0-100 from the share of UCX-prefixed lines."""
        del command
        sample = lines[:200]
        hits = sum(1 for line in sample if _UCX.match(_body(line.text)))
        if hits == 0:
            return 0
        return 85 if hits * 2 >= len(sample) else 50


PARSERS: tuple[ArtifactParser, ...] = (NcclLogParser(), UcxLogParser())
"""The artifact parsers of this module (read by ``collectors.parsers``)."""

__all__ = [
    "IBV_WC_STATUS",
    "MLX5_SYNDROME_TO_WC_STATUS",
    "NCCL_RESULT",
    "PARSERS",
    "CollectiveLogSession",
    "NcclLogParser",
    "UcxLogParser",
    "link_entity",
    "wc_status_name",
]
