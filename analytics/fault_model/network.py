"""Fault-model rules for the network and collectives (``docs/fault-model.md``).

RDMA completions, InfiniBand ports and counters, RoCE QoS, collective timeouts,
nccl-tests results and NVLS set-up failures ("Severity and action rules").

Sources each rule follows:

* rdma-core ``enum ibv_wc_status`` (``libibverbs/verbs.h``, ``ibv_poll_cq(3)``):
  12 ``IBV_WC_RETRY_EXC_ERR`` means the RC transport retried without an ACK until
  the retry count ran out (link, fabric or peer unreachable); 5
  ``IBV_WC_WR_FLUSH_ERR`` is the flush of every outstanding request after a QP has
  entered the error state, a symptom of the first error.
* The IBA PortCounters attribute, the ``perfquery(8)`` and ``ibqueryerrors(8)``
  man pages (default threshold zero: any non-zero error counter is reported) and
  ``Documentation/ABI/stable/sysfs-class-infiniband`` (ecosystem-reference §10.2):
  legacy error counters are 4-16 bits wide and saturate; ``PortXmitWait`` counts
  ticks without credits (congestion, not an error).
* The mlx5 counters documentation (kernel ``mlx5/counters.rst``):
  ``local_ack_timeout_err``, ``out_of_sequence``, ``packet_seq_err`` and
  ``rx_discards_phy`` count loss; ``np_cnp_sent``/``rp_cnp_handled`` count
  congestion notifications; ``rx_prioN_*``/``tx_prioN_*`` split traffic per
  priority, ``*_prioN_pause`` count PFC pauses.
* NCCL documentation (troubleshooting, ``NCCL_IB_*``) and nccl-tests
  ``README``/``doc/PERFORMANCE.md``: ``#wrong`` counts elements that failed the
  result check; PyTorch ``ProcessGroupNCCL`` watchdog timeouts.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from analytics.fault_model.common import group_evidence, group_finding, span
from analytics.fault_model.engine import MAX_EVIDENCE, Context, EventGroup, Observations, Rule
from core.records import (
    NODE_ENTITY,
    Action,
    EntityId,
    Evidence,
    Finding,
    NodeName,
    Sample,
    Severity,
)

logger = logging.getLogger(__name__)

_DOC = "docs/fault-model.md"

FLUSH_STATUS = "5"
"""``IBV_WC_WR_FLUSH_ERR``: a symptom of the error that put the QP in the error state."""


@dataclass(frozen=True, slots=True)
class WcVerdict:
    """Severity, action and meaning of one ``ibv_wc_status`` value."""

    severity: Severity
    action: Action
    meaning: str


WC_STATUS_VERDICTS: dict[str, WcVerdict] = {
    "12": WcVerdict(
        Severity.MAJOR,
        Action.CHECK_NETWORK,
        "transport retry counter exceeded (no ACK from the peer): link down or flapping, "
        "peer unreachable, or a lossy RoCE fabric",
    ),
    "20": WcVerdict(
        Severity.MAJOR, Action.CHECK_NETWORK, "response timeout: no response from the peer"
    ),
    "19": WcVerdict(Severity.MAJOR, Action.CHECK_NETWORK, "fatal error reported by the HCA"),
    "13": WcVerdict(
        Severity.WARNING,
        Action.RESTART_APP,
        "RNR retry counter exceeded: the peer posted no receive buffer in time (slow or dead peer)",
    ),
    **{
        code: WcVerdict(
            Severity.WARNING,
            Action.RESTART_APP,
            "local work request error (application or memory registration, e.g. GPUDirect RDMA)",
        )
        for code in ("1", "2", "4", "6", "8")
    },
    **{
        code: WcVerdict(
            Severity.WARNING,
            Action.RESTART_APP,
            "the remote side rejected the request (remote memory registration or peer state)",
        )
        for code in ("7", "9", "10", "11", "15", "16")
    },
}
"""``ibv_wc_status`` (as a string) to verdict; unknown codes are warnings with action none."""

LOC_PROT_STATUS = "4"
"""``IBV_WC_LOC_PROT_ERR``: the HCA could not access the registered (GPU) memory."""

LOC_PROT_MULTI_NODE = WcVerdict(
    Severity.MAJOR,
    Action.FIX_CONFIG,
    "local protection error on several nodes of the job: with GPUDirect RDMA this is the "
    "classic sign of PCIe ACS or the IOMMU redirecting peer-to-peer traffic from the NIC to "
    "the GPU (disable ACS on the PCIe switches / set the IOMMU to passthrough, per the NCCL "
    "troubleshooting guide; NCCL_NET_GDR_LEVEL=0 confirms it)",
)
"""Status 4 seen by NCCL on two or more nodes, unless the log shows GPUDirect RDMA off: a
platform setting, not the application (NCCL troubleshooting guide, "PCI Access Control
Services (ACS)"; NVIDIA/nccl #928, #214, #1052; openucx/ucx #3564)."""

_OTHER_WC = WcVerdict(Severity.WARNING, Action.NONE, "work completion error")

PHYSICAL_ERROR_METRICS: tuple[str, ...] = (
    "ib_symbol_errors_total",
    "ib_link_error_recovery_total",
    "ib_link_downed_total",
    "ib_port_rcv_errors_total",
    "ib_port_rcv_remote_physical_errors_total",
    "ib_local_link_integrity_errors_total",
    "ib_excessive_buffer_overrun_errors_total",
)
"""Counters of link or physical-layer errors (ecosystem-reference §10.2 "health reading")."""

RECEIVE_ERROR_METRICS: tuple[str, ...] = (
    "ib_port_rcv_errors_total",
    "ib_symbol_errors_total",
    "ib_port_rcv_remote_physical_errors_total",
    "ib_local_link_integrity_errors_total",
)
"""Receive-side errors that, with ``LinkDownedCounter`` > 0, mean a flapping link."""

SIDE_EFFECT_METRICS: tuple[str, ...] = (
    "ib_port_xmit_discards_total",
    "ib_port_xmit_wait_total",
    "ib_port_xmit_constraint_errors_total",
    "ib_port_rcv_constraint_errors_total",
    "ib_port_rcv_switch_relay_errors_total",
    "ib_vl15_dropped_total",
)
"""Counters that alone mean congestion or filtering (``ibqueryerrors -c`` "side effect")."""

ERROR_METRICS = frozenset(PHYSICAL_ERROR_METRICS) | (
    frozenset(SIDE_EFFECT_METRICS) - {"ib_port_xmit_wait_total"}
)
"""IB counters that count errors or drops (not data, packets or wait ticks)."""

ROCE_LOSS_COUNTERS: tuple[str, ...] = (
    "local_ack_timeout_err",
    "out_of_sequence",
    "packet_seq_err",
    "implied_nak_seq_err",
    # bnxt_re (Broadcom) equivalents: ack timeouts, sequence-error NAKs, out-of-order drops.
    "to_retransmits",
    "seq_err_naks_rcvd",
    "missing_resp",
    "res_oos_drop_count",
)
"""RDMA ``hw_counters`` that count lost packets on RC connections (mlx5, bnxt_re)."""

ROCE_CNP_COUNTERS: tuple[str, ...] = (
    "np_cnp_sent",
    "rp_cnp_handled",
    "np_ecn_marked_roce_packets",
    "rx_cnp_pkts",
    "tx_cnp_pkts",
    "rx_ecn_marked_pkts",
    "cnpSent",
    "cnpHandled",
    "RxECNMrkd",
)
"""RDMA ``hw_counters`` that count congestion notifications, ECN/DCQCN (mlx5, bnxt_re, irdma)."""

NIC_LOSS_COUNTERS: tuple[str, ...] = (
    "rx_discards_phy",
    "rx_out_of_buffer",
    "rx_buffer_passed_thres_phy",
)
"""``ethtool -S`` (mlx5) counters of packets dropped for lack of buffers."""

NIC_LOSS_PATTERN = re.compile(r"^rx_prio\d_(?:buf|cong)_discard$")
"""mlx5 per-priority drops: no buffer (``buf_discard``) or congestion (``cong_discard``)."""

NIC_PHY_ERROR_COUNTERS: tuple[str, ...] = (
    "rx_crc_errors_phy",
    "rx_symbol_err_phy",
    # bnxt_en, ice ("rx_crc_errors.nic", suffix dropped), and ip -s link columns.
    "rx_fcs_err_frames",
    "rx_crc_errors",
    "rx_frame_errors",
    "rx_errors",
)
"""Physical-layer receive errors (``ethtool -S`` of mlx5, bnxt_en, ice; ``ip -s link``)."""

NIC_LINK_DOWN_COUNTERS: tuple[str, ...] = ("link_down_events_phy", "link_down_events")
"""Link-down events of an Ethernet port (``ethtool -S`` of mlx5 and bnxt_en)."""

SINGLE_CLASS_SHARE = 0.99
"""Share of bytes in one priority above which all RoCE traffic is judged to share one class."""

SLOW_BUSBW_RATIO = 0.5
"""nccl-tests average bus bandwidth below this fraction of ``expected_busbw_gbps`` is slow."""


# --- helpers -------------------------------------------------------------------------


def _sample_evidence(samples: Iterable[Sample]) -> list[Evidence]:
    out: list[Evidence] = []
    for sample in samples:
        if sample.evidence is not None and sample.evidence not in out:
            out.append(sample.evidence)
    return out[:MAX_EVIDENCE]


def unused_ports(ctx: Context) -> set[str]:
    """Return the ports the inventory marks unused (fact ``ib_unused``, comma-separated).

    Entries are ``device:port`` (``mlx5_1:1``) or a device alone (every port of it).
    """
    value = ctx.fact("ib_unused") or ""
    return {item.strip() for item in value.split(",") if item.strip()}


def _is_unused(entity: str, unused: set[str]) -> bool:
    low = entity.lower()
    return low in unused or low.split(":", 1)[0] in unused


def _network_root_nodes(obs: Observations, ctx: Context) -> set[str]:
    """Nodes with a network or collective fault that a collective timeout would be a symptom of."""
    nodes: set[str] = set()
    for group in obs.events("rdma_transport"):
        if group.code != FLUSH_STATUS:
            nodes.add(group.node)
    unused = unused_ports(ctx)
    for group in obs.events("ib_port_state"):
        if group.code not in {"active", "active_defer"} and not _is_unused(group.entity, unused):
            nodes.add(group.node)
    for group in obs.events("nvls"):
        nodes.add(group.node)
    for group in obs.events("rdma_verbs"):
        nodes.add(group.node)
    for group in obs.events("ofi_completion"):
        nodes.add(group.node)
    for group in obs.events("rdma_async"):
        verdict = async_verdict(group.code)
        if verdict is not None and verdict.severity.rank >= Severity.MAJOR.rank:
            nodes.add(group.node)
    for group in obs.events("collective", "wrong_results"):
        nodes.add(group.node)
    for group in obs.events("shm"):
        nodes.add(group.node)
    return nodes


# --- RDMA completions ------------------------------------------------------------------


def rdma_transport_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Judge RDMA work-completion errors by ``ibv_wc_status``.

    Follows rdma-core ``enum ibv_wc_status`` (``libibverbs/verbs.h``) and
    fault-model.md: status 12 (``IBV_WC_RETRY_EXC_ERR``, also UCX "Transport retry
    count exceeded", mlx5 syndrome 0x15) is major ``check_network``. Flush errors
    (status 5), NCCL ``ncclRemoteError``/``ncclSystemError`` results and unwind lines
    and collective timeouts on the same node are symptoms: they are folded into the
    node's worst root finding as evidence. Alone, a flush error or an NCCL error
    result is a warning with action ``none`` (correlate).
    """
    del ctx
    by_node: dict[str, list[EventGroup]] = defaultdict(list)
    for group in obs.events("rdma_transport"):
        by_node[group.node].append(group)
    nodes = (
        set(by_node)
        | {g.node for g in obs.events("nccl_result")}
        | {g.node for g in obs.events("rdma_verbs")}
        | {g.node for g in obs.events("nccl_socket")}
    )
    prot_nodes = {g.node for g in obs.events("rdma_transport", LOC_PROT_STATUS)}
    gdr_possible = bool(obs.events("nccl_gdr", "enabled")) or not obs.events("nccl_gdr")
    for node in sorted(nodes):
        groups = by_node.get(node, [])
        roots = [g for g in groups if g.code != FLUSH_STATUS]
        symptoms = [g for g in groups if g.code == FLUSH_STATUS]
        results = obs.events("nccl_result", node=node)
        sockets = obs.events("nccl_socket", node=node)
        if not roots and obs.events("shm"):
            continue  # the shared-memory failure is the cause (shm_rule folds these)
        if not roots:
            verbs = obs.events("rdma_verbs", node=node)
            if verbs and _fatal_async(obs, node):
                continue  # verbs calls fail after a device or port error: symptoms
            if verbs:
                yield _verbs_finding(verbs, [*results, *sockets])
                continue
            if sockets and not symptoms:
                yield _socket_finding(sockets, results)
                continue
            yield from _orphan_symptoms(symptoms, results)
            continue
        results = [*results, *sockets]
        timeouts = obs.events("collective_timeout", node=node)
        ranked = sorted(
            roots,
            key=lambda g: -WC_STATUS_VERDICTS.get(g.code, _OTHER_WC).severity.rank,
        )
        for index, group in enumerate(ranked):
            verdict = WC_STATUS_VERDICTS.get(group.code, _OTHER_WC)
            if group.code == LOC_PROT_STATUS and len(prot_nodes) >= 2 and gdr_possible:
                verdict = LOC_PROT_MULTI_NODE
            folded = (symptoms + results + timeouts) if index == 0 else []
            name = next(iter(group.attr_values.get("status_name", {""})), "") or group.code
            peer = ", ".join(sorted(group.attr_values.get("peer", set()))) or "unknown peer"
            device = ", ".join(sorted(group.attr_values.get("device", set())))
            where = f"to {peer}" + (f" via {device}" if device else "")
            extra = f"; {sum(g.count for g in folded)} symptom line(s) folded in" if folded else ""
            yield group_finding(
                [group],
                folded=folded,
                kind="rdma_transport",
                code=group.code,
                severity=verdict.severity,
                action=verdict.action,
                summary=(
                    f"RDMA completion error {name} (status {group.code}) {where}, "
                    f"{group.count} time(s): {verdict.meaning}{extra}"
                ),
                source=(
                    "network.rdma_transport_rule: rdma-core ibv_wc_status (libibverbs/verbs.h); "
                    + _DOC
                ),
            )


def _fatal_async(obs: Observations, node: str) -> bool:
    """True when ``node`` has an RDMA async event judged major or worse."""
    for group in obs.events("rdma_async", node=node):
        verdict = async_verdict(group.code)
        if verdict is not None and verdict.severity.rank >= Severity.MAJOR.rank:
            return True
    return False


def ofi_completion_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Judge libfabric (aws-ofi-nccl, EFA) completion errors.

    aws-ofi-nccl reports ``NET/OFI Request ... completed with error. RC: N`` when
    ``fi_cq_readerr`` returns an error entry: the provider could not deliver the
    operation to the peer (unreachable peer, blocked traffic such as a security
    group without the self-referencing rule, a failed EFA device). Like
    ``IBV_WC_RETRY_EXC_ERR`` it is a fabric-path failure between two nodes: major
    ``check_network`` (fault-model.md, RDMA transport row).
    """
    del ctx
    for group in obs.events("ofi_completion"):
        errors = ", ".join(sorted(group.attr_values.get("error", set()))) or "no text"
        yield group_finding(
            [group],
            kind="rdma_transport",
            code=f"ofi_rc_{group.code}",
            severity=Severity.MAJOR,
            action=Action.CHECK_NETWORK,
            summary=(
                f"libfabric (aws-ofi-nccl) request completed with error RC {group.code} "
                f"({errors}), {group.count} time(s): the provider could not complete the "
                "transfer to the peer; check the fabric path and that traffic between the "
                "instances is allowed (EFA security group)"
            ),
            source="network.ofi_completion_rule: aws-ofi-nccl fi_cq_readerr; " + _DOC,
        )


def _verbs_finding(verbs: Sequence[EventGroup], folded: Sequence[EventGroup]) -> Finding:
    """A verbs call failing (``NCCL WARN Call to ibv_create_qp failed``) at set-up.

    rdma-core returns these when a resource cannot be created: locked-memory limit
    (``ulimit -l``, container ``memlock``), HCA limits on QPs/CQs/MRs, or an RDMA
    device not passed into the container (NCCL troubleshooting, "RDMA over
    Converged Ethernet" and "Docker" sections). No fabric fault is shown: warning,
    ``fix_config``; the NCCL error results that follow are folded in.
    """
    calls = ", ".join(sorted({g.code for g in verbs}))
    count = sum(g.count for g in verbs)
    return group_finding(
        verbs,
        entity=NODE_ENTITY,
        folded=folded,
        kind="rdma_verbs",
        code=sorted({g.code for g in verbs})[0],
        severity=Severity.WARNING,
        action=Action.FIX_CONFIG,
        summary=(
            f"RDMA verbs call(s) {calls} failed {count} time(s) while NCCL set up its "
            "connections: check the locked-memory limit (ulimit -l / container memlock), "
            "HCA resource limits and that the RDMA devices are available to the job"
            + (f"; {sum(g.count for g in folded)} NCCL error line(s) folded in" if folded else "")
        ),
        source="network.rdma_transport_rule: rdma-core verbs, NCCL troubleshooting; " + _DOC,
    )


def _socket_finding(sockets: Sequence[EventGroup], results: Sequence[EventGroup]) -> Finding:
    """NCCL's TCP connection to a peer was closed by the peer (``recv`` returned 0).

    NCCL ``misc/socket.cc``: the remote side closed the socket, which almost always
    means the remote rank exited (crash, OOM kill, another rank's failure); the
    network may also have dropped the connection. Not attributable to this node:
    warning, action ``none`` (correlate with the peer's logs), as fault-model.md
    treats a collective failure without a visible cause.
    """
    peers = sorted({p for g in sockets for p in g.attr_values.get("peer", set())})
    count = sum(g.count for g in sockets)
    return group_finding(
        sockets,
        entity=NODE_ENTITY,
        folded=results,
        kind="nccl",
        code="connection_closed_by_peer",
        severity=Severity.WARNING,
        action=Action.NONE,
        summary=(
            f"NCCL connection closed by the remote peer {', '.join(peers) or '(unnamed)'} "
            f"({count} time(s)): the remote rank most likely exited or the path dropped; "
            "look at that peer's logs first, do not act on this node alone"
        ),
        source="network.rdma_transport_rule: NCCL misc/socket.cc; " + _DOC,
    )


def _orphan_symptoms(
    symptoms: Sequence[EventGroup], results: Sequence[EventGroup]
) -> Iterable[Finding]:
    for group in symptoms:
        yield group_finding(
            [group],
            kind="rdma_transport",
            code=group.code,
            severity=Severity.WARNING,
            action=Action.NONE,
            summary=(
                f"RDMA work requests flushed (IBV_WC_WR_FLUSH_ERR) {group.count} time(s) without "
                "the error that caused them in the input: correlate with the peer's logs"
            ),
            source="network.rdma_transport_rule: rdma-core ibv_wc_status 5; " + _DOC,
        )
    if results and not symptoms:
        names = ", ".join(sorted({g.code for g in results}))
        yield group_finding(
            results,
            entity=NODE_ENTITY,
            kind="nccl",
            code=sorted({g.code for g in results})[0],
            severity=Severity.WARNING,
            action=Action.NONE,
            summary=(
                f"NCCL reported {names} without a visible cause: a network error or a peer "
                "process that exited; correlate with the other ranks' logs"
            ),
            source="network.rdma_transport_rule: NCCL ncclResult_t (nccl.h); " + _DOC,
        )


ASYNC_VERDICTS: tuple[tuple[str, WcVerdict], ...] = (
    (
        "port error",
        WcVerdict(
            Severity.MAJOR,
            Action.CHECK_NETWORK,
            "the port left the Active state (IBV_EVENT_PORT_ERR): link down",
        ),
    ),
    (
        "local catastrophic error",
        WcVerdict(
            Severity.MAJOR,
            Action.REBOOT_NODE,
            "the HCA reported a fatal error (IBV_EVENT_DEVICE_FATAL): the device needs a reset",
        ),
    ),
    (
        "work queue",
        WcVerdict(
            Severity.WARNING,
            Action.RESTART_APP,
            "a queue pair hit an error (IBV_EVENT_QP_*): application or memory registration",
        ),
    ),
    (
        "cq error",
        WcVerdict(
            Severity.WARNING, Action.RESTART_APP, "a completion queue overran (IBV_EVENT_CQ_ERR)"
        ),
    ),
)
"""``ibv_event_type_str`` texts (rdma-core ``libibverbs/enum_strs.c``) to verdicts; other
async events (port active, LID/SM change, reregistration) are benign and give no finding."""


def async_verdict(code: str) -> WcVerdict | None:
    """Return the verdict of an RDMA async event text, or ``None`` when it is benign.

    Examples:
        >>> async_verdict("port error").action.value
        'check_network'
        >>> async_verdict("port active") is None
        True
    """
    for text, verdict in ASYNC_VERDICTS:
        if text in code.lower():
            return verdict
    return None


def rdma_async_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Judge RDMA asynchronous events reported by NCCL (``ibv_get_async_event``).

    Follows rdma-core ``enum ibv_event_type`` (``ibv_get_async_event(3)``):
    ``IBV_EVENT_PORT_ERR`` (a port left Active) is major ``check_network`` like a
    port that is not Active (fault-model.md); ``IBV_EVENT_DEVICE_FATAL`` is major
    ``reboot_node``; queue-pair and CQ errors are application-level warnings.
    """
    del ctx
    for group in obs.events("rdma_async"):
        verdict = async_verdict(group.code)
        if verdict is None:
            continue
        yield group_finding(
            [group],
            kind="rdma_async",
            code=group.code,
            severity=verdict.severity,
            action=verdict.action,
            summary=f"RDMA async event '{group.code}' on {group.entity}: {verdict.meaning}",
            source="network.rdma_async_rule: rdma-core ibv_event_type; " + _DOC,
        )


# --- IB ports --------------------------------------------------------------------------


def ib_port_state_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Flag InfiniBand/RoCE ports that are not Active.

    Follows the IBA PortInfo ``PortState`` (Down, Initialize, Armed, Active) as
    ``ibstat``/sysfs print it and fault-model.md: a port not Active is major
    ``check_network`` unless the inventory fact ``ib_unused`` lists it. A port whose
    latest reading in the input is Active again is a warning (it went down and
    came back).
    """
    unused = unused_ports(ctx)
    for group in obs.events("ib_port_state"):
        if group.code in {"active", "active_defer"}:
            continue
        if _is_unused(group.entity, unused):
            logger.debug("port %s is marked unused; state %s ignored", group.entity, group.code)
            continue
        latest = [
            s for s in obs.samples_of("ib_port_state", node=group.node) if s.entity == group.entity
        ]
        recovered = bool(latest) and latest[-1].value >= 4
        phys = ", ".join(sorted(group.attr_values.get("phys_state", set()))) or "unknown"
        layer = ", ".join(sorted(group.attr_values.get("link_layer", set())))
        what = "RoCE port" if layer == "ethernet" else "InfiniBand port"
        hint = {
            "polling": "no physical link: cable, transceiver or far-end switch port",
            "disabled": "the port is disabled",
            "linkup": "link is up but the subnet manager has not activated the port",
        }.get(phys, "the port carries no traffic")
        if group.code in {"init", "armed"} and phys == "linkup":
            hint = "physical link is up but the subnet manager has not brought the port to Active"
        advice = sorted(group.attr_values.get("recommendation", set()) - {"No issue was observed"})
        if advice:
            hint = f"{hint} (mlxlink: {'; '.join(advice)})"
        yield group_finding(
            [group],
            kind="ib_port",
            code=f"state_{group.code}",
            severity=Severity.WARNING if recovered else Severity.MAJOR,
            action=Action.CHECK_NETWORK,
            summary=(
                f"{what} {group.entity} is {group.code} (physical state {phys})"
                + (", Active again in the latest reading" if recovered else "")
                + f": {hint}; the node is missing this rail"
            ),
            source="network.ib_port_state_rule: IBA PortInfo PortState, ibstat(8), "
            "sysfs-class-infiniband; " + _DOC,
        )


def ib_counter_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Judge one snapshot of IB port counters (per port, latest reading).

    Thresholds, on what a counter says: in a pasted snapshot (no time stamps) its value;
    in a stream (time-stamped readings: ``run``, ``replay``) only its **increase since
    the first reading** of the series (:attr:`Observations.counter_increase`), never a
    lifetime counter's first reading (issue #15: every port warned at start-up):

    * ``LinkDownedCounter`` > 0 together with receive errors (``PortRcvErrors``,
      ``SymbolErrorCounter``, ``PortRcvRemotePhysicalErrors``,
      ``LocalLinkIntegrityErrors``) > 0, none of them saturated: major
      ``check_network`` (a flapping link, bad cable or optic; fault-model.md).
    * Any error counter at its legacy all-ones maximum (IBA PortCounters widths,
      ecosystem-reference §10.2): warning ``check_network``, clear and re-read;
      the value is history, not a rate.
    * Other physical-layer error counters > 0 (``ibqueryerrors(8)`` default
      threshold is zero): warning ``check_network``, clear and re-read to get a
      rate.
    * ``PortXmitWait``, ``PortXmitDiscards``, constraint, relay and VL15 counters
      alone: congestion or filtering, no finding; with the errors above they are
      evidence.
    """
    del ctx
    ports: dict[tuple[str, str], dict[str, Sample]] = defaultdict(dict)
    rises: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    # one metric at a time (ports and rises are read by key, and sorted below)
    for metric, series in obs.by_metric.items():
        if not (metric.startswith("ib_") and metric.endswith("_total")):
            continue
        for key, sample in series.items():
            node, entity = key[0], key[1]
            ports[(node, entity)][metric] = sample
            if sample.observed_at is not None:  # a stream: judge the rise, not the lifetime
                rises[(node, entity)][metric] = obs.counter_increase.get(key, 0.0)
    for (node, entity), metrics in sorted(ports.items()):
        saturated_groups = obs.events("ib_counter_saturated", node=node, entity=entity)
        saturated_groups = [
            g for g in saturated_groups if g.attr_values.get("metric", set()) & ERROR_METRICS
        ]
        saturated = {m for g in saturated_groups for m in g.attr_values["metric"]} & ERROR_METRICS

        def value(metric: str, m: dict[str, Sample] = metrics,
                  rise: dict[str, float] = rises[(node, entity)]) -> float:
            sample = m.get(metric)
            if sample is None:
                return 0.0
            if sample.observed_at is not None:
                return rise.get(metric, 0.0)  # the first reading of a lifetime counter is 0
            return sample.value

        side = [metrics[m] for m in SIDE_EFFECT_METRICS if value(m) > 0]
        rcv = [m for m in RECEIVE_ERROR_METRICS if value(m) > 0]
        streamed = bool(rises[(node, entity)])
        where = "since first seen" if streamed else "in one snapshot"
        downed = value("ib_link_downed_total")
        if downed > 0 and rcv and not ({"ib_link_downed_total", *rcv} & saturated):
            used = [metrics["ib_link_downed_total"], *(metrics[m] for m in rcv), *side]
            yield _counter_finding(
                node,
                entity,
                "LinkDownedCounter",
                Severity.MAJOR,
                f"link went down {downed:.0f} time(s) and receive errors "
                f"({', '.join(_short(m) + '=' + format(value(m), '.0f') for m in rcv)}) {where}"
                ": flapping link, bad cable or optic; reseat or replace, clear "
                "counters and watch the rate",
                _sample_evidence(used),
            )
            continue
        if saturated:
            used = [metrics[m] for m in sorted(saturated) if m in metrics]
            yield _counter_finding(
                node,
                entity,
                "counter_saturated",
                Severity.WARNING,
                "error counters pinned at their maximum ("
                + ", ".join(_short(m) for m in sorted(saturated))
                + "): "
                "legacy counters stop at all-ones, so this is history, not a rate; "
                "clear the counters and re-read",
                _sample_evidence(used) + group_evidence(saturated_groups, 4),
            )
            continue
        errors = [m for m in PHYSICAL_ERROR_METRICS if value(m) > 0]
        if errors:
            used = [metrics[m] for m in errors] + side
            yield _counter_finding(
                node,
                entity,
                "port_errors",
                Severity.WARNING,
                (f"link error counters rose {where} (+" if streamed
                 else f"link error counters above zero {where} (")
                + ", ".join(f"{_short(m)}={value(m):.0f}" for m in errors)
                + ("): watch the rate; reseat or replace the cable if it keeps rising"
                   if streamed else "): clear the counters and re-read to get a rate"),
                _sample_evidence(used),
            )


def _short(metric: str) -> str:
    return metric.removeprefix("ib_").removesuffix("_total")


def _counter_finding(
    node: str,
    entity: str,
    code: str,
    severity: Severity,
    summary: str,
    evidence: list[Evidence],
) -> Finding:
    return Finding(
        node=NodeName(node),
        entity=EntityId(entity),
        kind="ib_port",
        code=code,
        severity=severity,
        action=Action.CHECK_NETWORK,
        summary=f"IB port {entity}: {summary}",
        evidence=tuple(evidence),
        source="network.ib_counter_rule: IBA PortCounters, perfquery(8), ibqueryerrors(8), "
        "sysfs-class-infiniband; " + _DOC,
    )


# --- RoCE ------------------------------------------------------------------------------


def roce_qos_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Flag RoCE traffic without a lossless priority, and loss counters alone.

    Follows the mlx5 counters documentation and fault-model.md ("RoCE traffic
    without a lossless priority (ack timeouts, CNPs)": major ``fix_config``): on a
    node where one interface carries at least :data:`SINGLE_CLASS_SHARE` of its
    bytes in a single priority with no PFC pause frames on it, and the RDMA
    counters show loss (``local_ack_timeout_err``, ``out_of_sequence``,
    ``packet_seq_err``, ``rx_discards_phy`` > 0), PFC/ECN are not applied to the
    RoCE class. With congestion notifications only, the same is a warning. Loss
    counters without priority data are a warning ``check_network``.
    """
    del ctx
    nodes = (
        {s.node for s in obs.samples_of("rdma_hw_counter_total")}
        | {s.node for s in obs.samples_of("net_prio_bytes_total")}
        | {s.node for s in obs.samples_of("net_nic_counter_total")}
    )
    for node in sorted(nodes):
        hw = obs.samples_of("rdma_hw_counter_total", node=node)
        nic = obs.samples_of("net_nic_counter_total", node=node)
        yield from _nic_phy_findings(node, nic)
        loss = [s for s in hw if s.labels.get("counter") in ROCE_LOSS_COUNTERS and s.value > 0]
        loss += [
            s
            for s in nic
            if s.value > 0
            and (
                _nic_counter(s) in NIC_LOSS_COUNTERS
                or NIC_LOSS_PATTERN.match(_nic_counter(s)) is not None
            )
        ]
        cnp = [s for s in hw if s.labels.get("counter") in ROCE_CNP_COUNTERS and s.value > 0]
        single = _single_class_interfaces(obs, node)
        if single and (loss or cnp):
            for iface, prio, prio_evidence in single:
                severity = Severity.MAJOR if loss else Severity.WARNING
                signals = ", ".join(
                    f"{s.labels.get('counter')}={s.value:.0f}" for s in [*loss, *cnp]
                )
                yield Finding(
                    node=NodeName(node),
                    entity=EntityId(iface),
                    kind="roce_qos",
                    code="no_lossless_priority",
                    severity=severity,
                    action=Action.FIX_CONFIG,
                    summary=(
                        f"RoCE on {iface}: all traffic in priority {prio} with no PFC pause "
                        f"frames, and the RDMA counters show {'loss' if loss else 'congestion'} "
                        f"({signals}): PFC/ECN are not applied to the RoCE class; fix the "
                        "DSCP/PFC/ECN configuration"
                    ),
                    evidence=tuple(
                        (prio_evidence + _sample_evidence([*loss, *cnp]))[:MAX_EVIDENCE]
                    ),
                    source="network.roce_qos_rule: mlx5 counters doc (ethtool -S prio, "
                    "hw_counters); " + _DOC,
                )
            continue
        for sample in loss:
            yield Finding(
                node=NodeName(node),
                entity=sample.entity,
                kind="rdma_counters",
                code=str(sample.labels.get("counter")),
                severity=Severity.WARNING,
                action=Action.CHECK_NETWORK,
                summary=(
                    f"{sample.entity}: {sample.labels.get('counter')}={sample.value:.0f} "
                    "(packets lost on the path); clear and re-read to get a rate"
                ),
                evidence=tuple(_sample_evidence([sample])),
                source="network.roce_qos_rule: mlx5 counters doc; " + _DOC,
            )


def _nic_counter(sample: Sample) -> str:
    """Return the counter name of a NIC sample without the ice ``.nic`` suffix."""
    return str(sample.labels.get("counter", "")).removesuffix(".nic")


def _nic_phy_findings(node: str, nic: Sequence[Sample]) -> Iterable[Finding]:
    """Judge physical receive errors and link-down events of Ethernet ports, per interface.

    The Ethernet analogue of the IB counter rule (fault-model.md): link-down events
    together with CRC/symbol errors in one snapshot are a flapping link, major
    ``check_network`` (bad cable or optic); errors alone are a warning (clear and
    re-read); link-down events alone (a switch reboot, a cable move) give nothing.
    Counters are 64-bit in the kernel (``rtnl_link_stats64``, mlx5 PPCNT), never saturated.
    """
    per_if: dict[EntityId, list[Sample]] = defaultdict(list)
    for sample in nic:
        per_if[sample.entity].append(sample)
    for entity, samples in sorted(per_if.items()):
        phy = [s for s in samples if _nic_counter(s) in NIC_PHY_ERROR_COUNTERS and s.value > 0]
        if not phy:
            continue
        downs = [s for s in samples if _nic_counter(s) in NIC_LINK_DOWN_COUNTERS and s.value > 0]
        signals = ", ".join(f"{_nic_counter(s)}={s.value:.0f}" for s in [*phy, *downs])
        if downs:
            severity = Severity.MAJOR
            summary = (
                f"{entity}: link went down and physical receive errors in one snapshot "
                f"({signals}): flapping link, bad cable or optic; reseat or replace, "
                "clear the counters and watch the rate"
            )
        else:
            severity = Severity.WARNING
            summary = (
                f"{entity}: physical receive errors ({signals}); check cable and optic, "
                "clear and re-read to get a rate"
            )
        yield Finding(
            node=NodeName(node),
            entity=entity,
            kind="nic_port",
            code=_nic_counter(phy[0]),
            severity=severity,
            action=Action.CHECK_NETWORK,
            summary=summary,
            evidence=tuple(_sample_evidence([*phy, *downs])),
            source="network.roce_qos_rule: mlx5 counters doc (ethtool -S *_phy), "
            "rtnl_link_stats64; " + _DOC,
        )


def _single_class_interfaces(obs: Observations, node: str) -> list[tuple[str, str, list[Evidence]]]:
    """Return ``(interface, priority, evidence)`` of interfaces with all traffic in one priority."""
    per_if: dict[str, dict[str, list[Sample]]] = defaultdict(lambda: defaultdict(list))
    for sample in obs.samples_of("net_prio_bytes_total", node=node):
        per_if[sample.labels.get("interface", "")][sample.labels.get("priority", "")].append(sample)
    pauses: dict[tuple[str, str], float] = defaultdict(float)
    for sample in obs.samples_of("net_prio_pause_frames_total", node=node):
        key = (sample.labels.get("interface", ""), sample.labels.get("priority", ""))
        pauses[key] += sample.value
    out: list[tuple[str, str, list[Evidence]]] = []
    for iface, prios in sorted(per_if.items()):
        totals = {p: sum(s.value for s in samples) for p, samples in prios.items()}
        total = sum(totals.values())
        if total <= 0 or len(totals) < 2:
            continue
        prio, top = max(totals.items(), key=lambda item: item[1])
        if top / total < SINGLE_CLASS_SHARE or pauses.get((iface, prio), 0.0) > 0:
            continue
        quiet = [s for p, samples in sorted(prios.items()) if p != prio for s in samples][:2]
        out.append((iface, prio, _sample_evidence([*prios[prio], *quiet])))
    return out


# --- ibdiagnet ------------------------------------------------------------------------

IBDIAGNET_FABRIC_STAGES = frozenset(
    {
        "discovery",
        "lids_check",
        "links_check",
        "subnet_manager",
        "port_counters",
        "speed_width_checks",
        "routing",
        "nodes_information",
        "partition_keys",
        "temperature_sensing",
    }
)
"""ibdiagnet stages whose errors describe the fabric (links, counters, SM, routing)."""


def ibdiagnet_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Report ibdiagnet stages that finished with errors.

    ibdiagnet's summary counts, per stage, the checks that failed (``Errors``) and
    those worth a look (``Warnings``); the details are in ``ibdiagnet2.log``. A
    stage with errors is a warning ``check_network`` (read the log: bad links,
    counters over threshold, SM or routing problems); warnings alone are common
    (duplicate node descriptions, unsupported MADs) and give no finding.
    """
    del ctx
    by_node: dict[str, list[EventGroup]] = defaultdict(list)
    for group in obs.events("ibdiagnet_stage"):
        errors = max(int(v) for v in group.attr_values.get("errors", {"0"}))
        if errors > 0:
            by_node[group.node].append(group)
    for node, groups in sorted(by_node.items()):
        stages = [
            f"{next(iter(g.attr_values.get('stage', {g.code})))}: "
            f"{max(int(v) for v in g.attr_values.get('errors', {'0'}))} error(s)"
            for g in groups
        ]
        yield Finding(
            node=NodeName(node),
            entity=EntityId("fabric"),
            kind="ib_fabric",
            code="ibdiagnet_errors",
            severity=Severity.WARNING,
            action=Action.CHECK_NETWORK,
            summary=(
                "ibdiagnet finished with errors ("
                + "; ".join(stages)
                + "): read ibdiagnet2.log for the ports and links involved"
            ),
            evidence=tuple(group_evidence(groups)),
            source="network.ibdiagnet_rule: ibdiagnet(1) summary; " + _DOC,
        )


# --- collectives -----------------------------------------------------------------------


# --- netdev counters --------------------------------------------------------------------

NETDEV_ERROR_COUNTERS = frozenset(
    {
        "rx_errors",
        "tx_errors",
        "rx_crc_errors",
        "rx_frame_errors",
        "rx_length_errors",
        "tx_carrier_errors",
        "tx_aborted_errors",
        "tx_heartbeat_errors",
        "tx_window_errors",
    }
)
"""``statistics/`` counters of frames lost to errors on the wire or the port."""

NETDEV_DROP_COUNTERS = frozenset(
    {"rx_dropped", "tx_dropped", "rx_missed_errors", "rx_fifo_errors", "tx_fifo_errors",
     "rx_over_errors"}
)
"""``statistics/`` counters of packets dropped by the host or the NIC's rings (no wire fault)."""

_NETDEV_SOURCE = (
    "network.netdev_counter_rule: Documentation/ABI/testing/sysfs-class-net-statistics, "
    "rtnl_link_stats64 (include/uapi/linux/if_link.h); "
)


def netdev_counter_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Judge Linux netdev counters the same way in ``diagnose`` and in ``run``.

    ``rtnl_link_stats64`` (``include/uapi/linux/if_link.h``) and
    ``sysfs-class-net-statistics``: ``rx_errors``/``tx_errors`` and the detailed error
    counters count frames lost to the wire or the port; ``rx_dropped``, ``rx_missed_errors``,
    ``rx_fifo_errors`` count packets the host or the NIC ring had no room for (or, for
    ``rx_dropped``, did not want: unknown protocols), not a link fault.

    * An error counter that rose between two readings (``netdev_counter_rise``: two readings
      in one file, or two collections in ``run``): major ``check_network``, the link is losing
      frames now (cable, optic, switch port).
    * Only drops rose: warning ``check_network`` (host or ring buffers cannot keep up).
    * One pasted snapshot (no time, no earlier reading) with ``rx_errors``/``tx_errors`` > 0:
      warning ``check_network``, clear and re-read to get a rate, as the single-snapshot
      counters of fault-model.md; drops alone in a snapshot are no finding. In ``run`` samples
      carry their time and only rises are judged, so old errors do not alert forever.
    """
    del ctx
    rises: dict[tuple[str, str], list[EventGroup]] = defaultdict(list)
    for group in obs.events("netdev_counter_rise"):
        rises[(group.node, group.entity)].append(group)
    for (_node, entity), groups in sorted(rises.items()):
        errors = [g for g in groups if g.code in NETDEV_ERROR_COUNTERS]
        drops = [g for g in groups if g.code not in NETDEV_ERROR_COUNTERS]
        used = errors or drops
        signals = ", ".join(
            f"{g.code} +{max(int(v) for v in g.attr_values.get('delta', {'0'}))}"
            for g in [*errors, *drops]
        )
        if errors:
            severity = Severity.MAJOR
            summary = (
                f"{entity}: error counters rose between readings ({signals}): the link is "
                "losing frames now; check cable, optic and switch port"
            )
        else:
            severity = Severity.WARNING
            summary = (
                f"{entity}: drop counters rose between readings ({signals}) without errors: "
                "the host or the NIC rings cannot keep up (ring sizes, IRQ affinity), or "
                "unwanted packets; no wire fault seen"
            )
        yield group_finding(
            used,
            folded=drops if errors else [],
            entity=EntityId(entity),
            kind="nic_port",
            code=f"{used[0].code}_rising",
            severity=severity,
            action=Action.CHECK_NETWORK,
            summary=summary,
            source=_NETDEV_SOURCE + _DOC,
        )
    judged = set(rises)
    for (node, entity, _metric, _labels), sample in obs.samples.items():
        if (node, entity) in judged or sample.observed_at is not None:
            continue
        if sample.metric == "net_nic_counter_total" and (
            _nic_counter(sample) in NIC_PHY_ERROR_COUNTERS and sample.value > 0
        ):
            judged.add((node, entity))  # the physical-error rule speaks for this port
    snapshot: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for (node, entity, metric, _labels), sample in sorted(obs.samples.items()):
        if (
            metric in {"net_rx_errors_total", "net_tx_errors_total"}
            and sample.observed_at is None
            and sample.value > 0
            and (node, entity) not in judged
        ):
            snapshot[(node, entity)].append(sample)
    for (node, entity), samples in sorted(snapshot.items()):
        signals = ", ".join(
            f"{s.metric.removeprefix('net_').removesuffix('_total')}={s.value:.0f}"
            for s in samples
        )
        yield Finding(
            node=NodeName(node),
            entity=EntityId(entity),
            kind="nic_port",
            code="errors",
            severity=Severity.WARNING,
            action=Action.CHECK_NETWORK,
            summary=(
                f"{entity}: error counters above zero in one snapshot ({signals}); check "
                "cable and optic, clear and re-read to get a rate"
            ),
            evidence=tuple(_sample_evidence(samples)),
            source=_NETDEV_SOURCE + _DOC,
        )


# --- NIC bonds ---------------------------------------------------------------------------

_BOND_SOURCE = (
    "network.bond_rule: kernel Documentation/networking/bonding.rst, "
    "drivers/net/bonding/bond_procfs.c; "
)


def bond_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Judge NIC bonds from the ``net_bond_*`` samples (``/proc/net/bonding``, diagnose and run).

    Kernel ``bonding.rst`` ("Querying Bonding Configuration", "802.3ad"): a member carries
    traffic when its MII status is up and, in 802.3ad, it is in the active aggregator.

    * The bond's MII status down: major ``check_network`` (the node is off that network).
    * Fewer members active than enslaved (a member down, or outside the active 802.3ad
      aggregator): major ``check_network``: the bond runs without redundancy and with part
      of its bandwidth; name the members.
    * A member whose ``Link Failure Count`` rose between two collections (``run``:
      ``bond_member_flap``) while every member is active now: major ``check_network``, the
      member is flapping.
    * Every member active, but a pasted snapshot shows link failures > 0: warning
      ``check_network``: the count is history of unknown age (since the bond came up),
      clear it by re-reading later; in ``run`` only rises count.
    * A bond with every member active and no failures: no finding.
    """
    del ctx
    bonds = sorted({(s.node, s.entity) for s in obs.samples_of("net_bond_members")})
    for node, entity in bonds:
        def value(metric: str, n: str = node, e: str = entity) -> Sample | None:
            return next((s for s in obs.samples_of(metric, node=n) if s.entity == e), None)

        members = value("net_bond_members")
        active = value("net_bond_members_active")
        up = value("net_bond_up")
        member_up = [s for s in obs.samples_of("net_bond_member_up", node=node)
                     if s.entity == entity]
        failures = [s for s in obs.samples_of("net_bond_member_link_failures_total", node=node)
                    if s.entity == entity and s.value > 0]
        flaps = obs.events("bond_member_flap", node=node, entity=entity)
        down = sorted(s.labels.get("interface", "?") for s in member_up if s.value < 1)
        history = ", ".join(
            f"{s.labels.get('interface', '?')} {s.value:.0f}" for s in failures
        )
        evidence = _sample_evidence([x for x in (up, members, active) if x is not None])
        evidence += _sample_evidence([s for s in member_up if s.value < 1] + failures)
        n_members = int(members.value) if members is not None else 0
        n_active = int(active.value) if active is not None else n_members
        if up is not None and up.value < 1:
            severity, code = Severity.MAJOR, "bond_down"
            summary = (
                f"bond {entity} is down (MII status down, {n_active} of {n_members} members "
                "active): the node is off that network; check the members' links and switch "
                "ports"
            )
        elif n_active < n_members:
            severity, code = Severity.MAJOR, "members_down"
            summary = (
                f"bond {entity} runs on {n_active} of {n_members} members (not carrying "
                f"traffic: {', '.join(down) or '?'}; compared: members enslaved against "
                "members with MII up in the active aggregator): no redundancy and part of "
                "the bandwidth lost; check the member's link, cable and switch port (LACP)"
                + (f"; link failure counts: {history}" if history else "")
            )
        elif flaps:
            severity, code = Severity.MAJOR, "member_flapping"
            names = ", ".join(sorted(g.code for g in flaps))
            summary = (
                f"bond {entity}: member(s) {names} went down and came back between readings "
                f"(link failure count rose): a flapping link; check cable, optic and switch port"
            )
            evidence += group_evidence(flaps, 4)
        elif failures and all(s.observed_at is None for s in failures):
            severity, code = Severity.WARNING, "member_link_failures"
            summary = (
                f"bond {entity}: all {n_members} members active, but link failures were "
                f"counted ({history}) since the bond came up: history of unknown age; "
                "re-read later to see whether it still rises"
            )
        else:
            continue
        yield Finding(
            node=NodeName(node),
            entity=EntityId(entity),
            kind="bond",
            code=code,
            severity=severity,
            action=Action.CHECK_NETWORK,
            summary=summary,
            evidence=tuple(evidence[:MAX_EVIDENCE]),
            source=_BOND_SOURCE + _DOC,
        )


# --- shared memory ---------------------------------------------------------------------

SHM_MEANING: dict[str, str] = {
    "permission_denied": "NCCL may not create files in /dev/shm (permissions of /dev/shm or "
    "the container's IPC namespace): fix the mode of /dev/shm (1777) or the runtime's IPC "
    "settings",
    "no_space": "/dev/shm is full or too small for the segments (a container's default "
    "64 MB shm): raise the container's shm size (--shm-size, --ipc=host, a memory-backed "
    "emptyDir on /dev/shm) or remove stale segments",
    "segment_missing": "a peer's NCCL segment in /dev/shm is not visible to this process "
    "(ranks in different IPC namespaces or containers, systemd RemoveIPC, or an NCCL version "
    "issue): share the IPC namespace (--ipc=host) or change the NCCL version",
    "failed": "NCCL could not set up its shared-memory transport: check /dev/shm (size, mode, "
    "mount) and the container's IPC settings",
}
"""``shm`` event code to what it means and the configuration to change."""


def shm_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """NCCL shared-memory set-up failures: a node or container configuration fault.

    NCCL prints the cause on the lines before its error (``Call to shm_open failed :
    Permission denied``, ``failed to extend /dev/shm/nccl-X to N bytes``, ``Call to
    posix_fallocate failed : No space left on device``, ``Error while creating|attaching
    to shared memory segment``); the ``ncclSystemError`` ("unhandled system error"),
    nccl-tests ``Test NCCL failure`` and PyTorch summary lines that follow are symptoms and
    are folded in. Verdict: major ``fix_config`` (NCCL troubleshooting guide, "Shared
    memory": Docker's default 64 MB ``/dev/shm`` is too small, use ``--shm-size`` or
    ``--ipc=host``; NVIDIA/nccl #328, #525, nccl-tests #166).
    """
    del ctx
    groups = obs.events("shm")
    if not groups:
        return
    results = [*obs.events("nccl_result"), *obs.events("nccl_socket")]
    by_node: dict[str, list[EventGroup]] = defaultdict(list)
    for group in groups:
        by_node[group.node].append(group)
    for index, (_node, node_groups) in enumerate(sorted(by_node.items())):
        code = next(
            (c for c in SHM_MEANING if any(g.code == c for g in node_groups)), "failed"
        )
        segments = sorted({v for g in node_groups for v in g.attr_values.get("segment", set())})
        sizes = sorted({v for g in node_groups for v in g.attr_values.get("size_bytes", set())})
        errors = sorted({v for g in node_groups for v in g.attr_values.get("error", set())})
        who = "PyTorch DataLoader" if any(
            "DataLoader" in g.attr_values.get("src", set()) for g in node_groups
        ) else "NCCL"
        what = (
            f"{who} shared-memory failure ({'; '.join(errors) or code}"
            + (f"; segment {segments[0]}" if segments else "")
            + (f", {max(int(x) for x in sizes)} bytes" if sizes else "")
            + ")"
        )
        folded = results if index == 0 else []
        extra = f"; {sum(g.count for g in folded)} NCCL error line(s) folded in" if folded else ""
        yield group_finding(
            node_groups,
            folded=folded,
            entity=NODE_ENTITY,
            kind="shm",
            code=code,
            severity=Severity.MAJOR,
            action=Action.FIX_CONFIG,
            summary=(
                f"{what}: a node or container configuration fault, not a GPU or network "
                f"fault: {SHM_MEANING[code]}{extra}"
            ),
            source=(
                "network.shm_rule: NCCL troubleshooting guide (Shared memory); "
                "NVIDIA/nccl #328, #525; " + _DOC
            ),
        )


def collective_timeout_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Report collective timeouts alone as a warning with action ``none``.

    Follows fault-model.md ("a collective timeout alone: warning, none; correlate,
    never cordon on it alone") and PyTorch ``ProcessGroupNCCL`` watchdog semantics
    (the collective did not complete within ``Timeout(ms)`` on the reporting
    ranks; the cause may be any rank). On a node with a network or collective
    root fault the timeouts are symptoms and give no finding of their own.
    """
    roots = _network_root_nodes(obs, ctx)
    by_node: dict[str, list[EventGroup]] = defaultdict(list)
    for group in obs.events("collective_timeout"):
        by_node[group.node].append(group)
    for node, groups in sorted(by_node.items()):
        if node in roots:
            continue
        first, last = span(groups)
        described = []
        for group in groups[:4]:
            op = next(iter(group.attr_values.get("op", {"collective"})))
            ranks = ",".join(sorted(group.attr_values.get("ranks", set()))) or "?"
            described.append(f"{op} SeqNum={group.code} (ranks {ranks})")
        years = any(g.attr_values.get("year_assumed") for g in groups)
        yield Finding(
            node=NodeName(node),
            entity=NODE_ENTITY,
            kind="collective",
            code="timeout",
            severity=Severity.WARNING,
            action=Action.NONE,
            summary=(
                "collective timeout: "
                + "; ".join(described)
                + ". Job-level failure, cause not visible here: correlate with Xid/SXid, NCCL "
                "WARN lines and IB counters of every rank's node; do not cordon on this alone"
                + (" (year of the time stamps assumed)" if years else "")
            ),
            evidence=tuple(group_evidence(groups)),
            source="network.collective_timeout_rule: PyTorch ProcessGroupNCCL watchdog; " + _DOC,
            first_seen_at=first,
            last_seen_at=last,
            occurrences=len(groups),
        )


def collective_results_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Judge nccl-tests results: ``#wrong`` > 0 is critical data corruption.

    Follows nccl-tests (``#wrong`` counts result elements that failed the check,
    ``# Out of bounds values : N FAILED``) and fault-model.md ("nccl-tests #wrong >
    0: critical, service_hardware or check_network"): a run across several nodes
    gets ``check_network`` (the inter-node path is the first suspect), a one-node
    run ``service_hardware``. Every node of the run gets the finding. With the
    fact ``expected_busbw_gbps``, an average bus bandwidth below
    :data:`SLOW_BUSBW_RATIO` of it is a warning ``check_network``.
    """
    for group in obs.events("collective", "wrong_results"):
        nodes = sorted({n for v in group.attr_values.get("nodes", set()) for n in v.split(",")})
        multi = len(nodes) > 1
        sizes = max(int(v) for v in group.attr_values.get("rows_wrong", {"0"}))
        worst_wrong = max(int(v) for v in group.attr_values.get("max_wrong", {"0"}))
        oob = max((int(v) for v in group.attr_values.get("out_of_bounds", set())), default=0)
        what = f"{sizes} size(s), up to {worst_wrong} wrong elements"
        if oob:
            what += f"; {oob} out-of-bounds value(s)"
        yield group_finding(
            [group],
            kind="collective",
            code="wrong_results",
            severity=Severity.CRITICAL,
            action=Action.CHECK_NETWORK if multi else Action.SERVICE_HARDWARE,
            summary=(
                f"nccl-tests reported wrong results ({what}) in a run over "
                f"{', '.join(nodes) or group.node}: data corruption; take "
                "the nodes out of service and bisect with single-node and pairwise runs"
            ),
            source="network.collective_results_rule: nccl-tests #wrong; " + _DOC,
        )
    expected_text = ctx.fact("expected_busbw_gbps")
    if not expected_text:
        return
    try:
        expected = float(expected_text)
    except ValueError:
        logger.warning("fact expected_busbw_gbps=%r is not a number", expected_text)
        return
    for group in obs.events("collective", "avg_busbw"):
        measured = min(float(v) for v in group.attr_values.get("busbw_gigabytes_per_second", {"0"}))
        if expected > 0 and measured < SLOW_BUSBW_RATIO * expected:
            yield Finding(
                node=group.node,
                entity=group.entity,
                kind="collective",
                code="slow_busbw",
                severity=Severity.WARNING,
                action=Action.CHECK_NETWORK,
                summary=(
                    f"nccl-tests average bus bandwidth {measured:g} GB/s is below "
                    f"{SLOW_BUSBW_RATIO:.0%} of the expected {expected:g} GB/s"
                ),
                evidence=tuple(group_evidence([group])),
                source="network.collective_results_rule: nccl-tests doc/PERFORMANCE.md; " + _DOC,
            )


def nvls_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Report NVLink SHARP (NVLS) or multicast set-up failures in NCCL.

    Follows fault-model.md ("NVLS or multicast set-up failures in NCCL (they imply
    an NVSwitch fabric): major, reset_gpu") and NCCL's NVLS documentation
    (``NCCL_NVLS_ENABLE``; NVLS needs the NVSwitch fabric and CUDA multicast).
    """
    del ctx
    for group in obs.events("nvls"):
        devs = ",".join(sorted(group.attr_values.get("cuda_dev", set())))
        yield group_finding(
            [group],
            kind="nvls",
            code=group.code,
            severity=Severity.MAJOR,
            action=Action.RESET_GPU,
            summary=(
                f"NCCL NVLink SHARP / multicast set-up failed ({group.count} time(s)"
                + (f", CUDA device(s) {devs}" if devs else "")
                + "): reset the GPUs (and check the NVSwitch fabric / Fabric Manager)"
            ),
            source="network.nvls_rule: NCCL NVLS; " + _DOC,
        )


RULES: tuple[Rule, ...] = (
    rdma_transport_rule,
    ofi_completion_rule,
    rdma_async_rule,
    ib_port_state_rule,
    ib_counter_rule,
    roce_qos_rule,
    ibdiagnet_rule,
    netdev_counter_rule,
    bond_rule,
    shm_rule,
    collective_timeout_rule,
    collective_results_rule,
    nvls_rule,
)
"""The network rules, in evaluation order."""
