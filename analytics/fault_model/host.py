"""Fault-model rules for host hardware seen in the kernel log: DRAM (EDAC/MCE/APEI) and PCIe.

Host versus GPU (``docs/fault-model.md``): host DRAM errors and PCIe AER on
non-GPU endpoints are node findings, never GPU findings; uncorrectable AER on a
GPU's link takes the GPU off the bus (Linux ``Documentation/PCI/pcieaer-howto.rst``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from analytics.fault_model.common import attr, group_finding, uuid_map, year_note
from analytics.fault_model.engine import Context, EventGroup, Observations, Rule
from core.records import NODE_ENTITY, Action, EntityId, Finding, Severity

logger = logging.getLogger(__name__)

FAULT_MODEL = "docs/fault-model.md"

HOST_CE_WARNING_COUNT = 100
"""Corrected host-DRAM errors in one input above which a DIMM is flagged (warning).

Corrected errors are fixed by ECC; a DIMM is worth replacing when they keep coming.
Server vendors' predictive-failure policies (and rasdaemon's default page-offline
threshold of 50 CEs per 24 h per page) act in the tens to hundreds per day; one
input rarely spans more than a day, so 100 is a conservative single-snapshot line.
"""

AER_CORRECTED_FLOOD = 100
"""Corrected AER messages from one device in one input that count as a flood."""

NVIDIA_VENDOR_ID = "10de"

_GPU_KINDS = frozenset({"xid", "gpu_lost", "gpu_init_failure", "gpu_identity", "reset_required"})


def _finding(
    g: EventGroup,
    entity: EntityId,
    kind: str,
    code: str,
    sev: Severity,
    act: Action,
    summary: str,
    source: str,
) -> Finding:
    years = attr(g, "year_assumed")
    return group_finding(
        [g],
        entity=entity,
        kind=kind,
        code=code,
        severity=sev,
        action=act,
        summary=summary + year_note(min(years) if years else None),
        source=source,
    )


def host_memory_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Host DRAM errors (EDAC ``N UE|CE``, MCE uncorrected memory errors, APEI memory sections).

    Source: Linux EDAC documentation (UE = uncorrectable, CE = corrected);
    fault-model.md: host DRAM uncorrectable is critical, service_hardware, a node finding.
    CE: warning past :data:`HOST_CE_WARNING_COUNT` in the input, else info.
    """
    del ctx
    for g in obs.events("host_memory"):
        total = 0
        for value in g.events:
            try:
                total += int(value.attrs.get("count", "1"))
            except ValueError:
                total += 1
        total = max(total, g.count)
        if g.code == "UE":
            code, sev, act = "UE", Severity.CRITICAL, Action.SERVICE_HARDWARE
            text = (
                f"host DRAM uncorrectable error ({total} reported): drain the node and "
                "replace the DIMM named in the evidence"
            )
            doc = "Linux EDAC / MCE"
        elif total >= HOST_CE_WARNING_COUNT:
            code, sev, act = "CE", Severity.WARNING, Action.SERVICE_HARDWARE
            text = (
                f"host DRAM corrected errors: {total} in this input (>= "
                f"{HOST_CE_WARNING_COUNT}): schedule a DIMM replacement"
            )
            doc = "Linux EDAC"
        else:
            code, sev, act = "CE", Severity.INFO, Action.NONE
            text = f"host DRAM corrected errors: {total} in this input; watch the rate"
            doc = "Linux EDAC"
        yield _finding(
            g,
            NODE_ENTITY,
            "host_memory",
            code,
            sev,
            act,
            text,
            f"host.host_memory_rule: {doc}; {FAULT_MODEL}",
        )


def pcie_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """PCIe AER and APEI PCIe errors, and PCIe bandwidth "limited by" notes.

    Sources: Linux ``Documentation/PCI/pcieaer-howto.rst`` (corrected errors are
    recovered by hardware; uncorrected ones on a GPU's link take the GPU off the bus),
    fault-model.md (uncorrectable AER on a GPU's link: critical, reboot_node; AER on a
    non-GPU endpoint: warning, service_hardware, node finding; bandwidth limited by
    the platform: info).
    """
    del ctx
    to_pci = uuid_map(obs)
    gpus: dict[str, set[str]] = {}
    unreachable: dict[str, set[str]] = {}
    for g in obs.groups.values():
        if g.kind in _GPU_KINDS and g.entity != NODE_ENTITY:
            gpus.setdefault(g.node, set()).add(to_pci.get(g.entity, g.entity))
        if g.kind in ("gpu_lost", "nvml_error") or (g.kind == "xid" and g.code == "79"):
            unreachable.setdefault(g.node, set()).add(to_pci.get(g.entity, g.entity))
    for g in obs.events("pcie_aer"):
        vendor = attr(g, "vendor_id")
        driver = attr(g, "driver")
        on_gpu = (
            NVIDIA_VENDOR_ID in vendor
            or "nvidia" in driver
            or bool(attr(g, "gpu_below"))  # the report names a GPU below the port
            or g.entity in gpus.get(g.node, set())
        )
        where = g.entity if g.entity != NODE_ENTITY else "an unnamed device"
        below = attr(g, "gpu_below") - {g.entity}
        if below:
            where = f"{min(below)} (reported by port {where})"
        src = f"host.pcie_rule: Linux pcieaer-howto; {FAULT_MODEL}"
        if on_gpu:
            if g.code != "corrected":
                sev, act = Severity.CRITICAL, Action.REBOOT_NODE
                text = (
                    f"uncorrectable PCIe error ({g.code.replace('_', ' ')}) on GPU {where}'s "
                    "link: reboot; inspect the slot, riser and cable if it recurs"
                )
            elif g.count >= AER_CORRECTED_FLOOD and g.entity in unreachable.get(g.node, set()):
                sev, act = Severity.CRITICAL, Action.REBOOT_NODE
                text = (
                    f"flood of corrected PCIe errors ({g.count}) on GPU {where} with the GPU "
                    "unreachable"
                )
            else:
                sev = Severity.WARNING if g.count >= AER_CORRECTED_FLOOD else Severity.INFO
                act = Action.SERVICE_HARDWARE if sev is Severity.WARNING else Action.NONE
                text = (
                    f"corrected PCIe errors ({g.count}) on GPU {where}'s link: recovered by "
                    "hardware, watch the rate"
                )
            yield _finding(g, g.entity, "pcie", g.code, sev, act, text, src)
            continue
        if g.code == "corrected" and g.count < AER_CORRECTED_FLOOD:
            sev, act = Severity.INFO, Action.NONE
            text = "recovered by hardware; watch the rate"
        else:
            sev, act = Severity.WARNING, Action.SERVICE_HARDWARE
            text = "service the device or its slot"
        vend = f" (vendor {min(vendor)})" if vendor else ""
        yield _finding(
            g,
            NODE_ENTITY,
            "pcie",
            f"{g.code}:{g.entity}",
            sev,
            act,
            f"PCIe {g.code.replace('_', ' ')} error on non-GPU endpoint {where}{vend}: {text}",
            src,
        )
    for g in obs.events("pcie_bandwidth_limited"):
        by = min(attr(g, "limited_by")) if attr(g, "limited_by") else "the platform"
        yield _finding(
            g,
            g.entity,
            "pcie",
            "bandwidth_limited",
            Severity.INFO,
            Action.NONE,
            f"PCIe bandwidth of {g.entity} limited by {by} (kernel notice at probe): a platform "
            "limit unless its peers get a wider or faster link",
            f"host.pcie_rule: Linux PCI core bandwidth notice; {FAULT_MODEL}",
        )


# --- conditions and taints other tools set on the Kubernetes node ------------------------

KUBE_RECOMMENDED_ACTIONS: dict[str, tuple[Severity, Action]] = {
    "COMPONENT_RESET": (Severity.CRITICAL, Action.RESET_GPU),
    "RESET_GPU": (Severity.CRITICAL, Action.RESET_GPU),
    "GPU_RESET": (Severity.CRITICAL, Action.RESET_GPU),
    "RESTART_VM": (Severity.CRITICAL, Action.REBOOT_NODE),
    "RESTART_BM": (Severity.CRITICAL, Action.REBOOT_NODE),
    "REBOOT_NODE": (Severity.CRITICAL, Action.REBOOT_NODE),
    "CONTACT_SUPPORT": (Severity.CRITICAL, Action.SERVICE_HARDWARE),
    "REPLACE_VM": (Severity.CRITICAL, Action.SERVICE_HARDWARE),
    "NONE": (Severity.INFO, Action.NONE),
}
"""NVSentinel ``RecommendedAction`` names (its health-event protobuf, as printed in condition
messages) to the fault model's severity and action: NVSentinel sets a condition only for a
fatal health event (``docs/INTEGRATION.md``, "Condition vs Event Behavior")."""

DCGM_FR_VERDICTS: dict[str, tuple[Severity, Action]] = {
    "DCGM_FR_FAULTY_MEMORY": (Severity.CRITICAL, Action.SERVICE_HARDWARE),
    "DCGM_FR_ROW_REMAP_FAILURE": (Severity.CRITICAL, Action.SERVICE_HARDWARE),
    "DCGM_FR_SRAM_THRESHOLD": (Severity.CRITICAL, Action.SERVICE_HARDWARE),
    "DCGM_FR_VOLATILE_DBE_DETECTED": (Severity.CRITICAL, Action.RESET_GPU),
    "DCGM_FR_VOLATILE_SBE_DETECTED": (Severity.INFO, Action.NONE),
    "DCGM_FR_PENDING_ROW_REMAP": (Severity.WARNING, Action.RESET_GPU),
    "DCGM_FR_PENDING_PAGE_RETIREMENTS": (Severity.WARNING, Action.RESET_GPU),
    "DCGM_FR_NVLINK_DOWN": (Severity.MAJOR, Action.RESET_GPU),
    "DCGM_FR_CLOCK_THROTTLE_THERMAL": (Severity.WARNING, Action.SERVICE_HARDWARE),
    "DCGM_FR_TEMP_VIOLATION": (Severity.WARNING, Action.SERVICE_HARDWARE),
}
"""DCGM failure codes (``dcgm_errors.h``) a condition message names, judged as the
fault-model rows for the same state (row remap, DBE, NVLink, thermal); they take precedence
over the tool's recommended action."""

_DCGM_FR = re.compile(r"\bDCGM_FR_[A-Z_]+")

MONITORING_CONDITIONS = frozenset({"DCGMError", "DcgmError", "GpuDcgmConnectivityFailure"})
"""Conditions that say the monitoring agent lost its DCGM host engine: no GPU fault."""

_KUBE_SOURCE = "host.kube_node_rule: NVSentinel docs/INTEGRATION.md; "


def kube_node_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Judge node conditions and taints set by other tools by what they name.

    A condition naming an Xid, an SXid or a GPU fallen off the bus was already turned into
    that event by ``collectors.kube_node``, so the Xid rules judge it as the Xid itself. The
    rest (``kube_condition`` events):

    * an NVSentinel ``RecommendedAction`` (:data:`KUBE_RECOMMENDED_ACTIONS`): its severity
      and action (a condition is only set for a fatal health event);
    * a DCGM connectivity condition (``DCGMError``): the monitoring agent lost its host
      engine, warning ``fix_config`` (no GPU finding);
    * anything else a tool reports as failing: warning ``none`` (correlate: the condition
      names no cause this input shows).

    A taint (``kube_taint``, e.g. ``nvidia.com/gpu-xid-error``) on a node whose conditions in
    the same input name the cause adds nothing; alone it is a warning ``none``: another tool
    quarantined the node, the cause is in its condition or the kernel log.
    """
    del ctx
    explained: set[str] = set()
    for group in obs.events("kube_condition"):
        explained.add(group.node)
        ctype = group.code
        recommended = sorted(attr(group, "recommended_action"))
        verdict = next(
            (KUBE_RECOMMENDED_ACTIONS[a] for a in recommended if a in KUBE_RECOMMENDED_ACTIONS),
            None,
        )
        reason = ", ".join(sorted(v for v in attr(group, "reason") if v))
        message = next(iter(sorted(attr(group, "message"))), "")
        codes = [c for c in _DCGM_FR.findall(message) if c in DCGM_FR_VERDICTS]
        if ctype in MONITORING_CONDITIONS or "host engine" in message.lower():
            severity, action = Severity.WARNING, Action.FIX_CONFIG
            meaning = (
                "the health agent cannot reach its DCGM host engine: a monitoring fault, "
                "not a GPU fault; restart nv-hostengine / the DCGM pod, and meanwhile the "
                "GPUs are not watched"
            )
        elif codes:
            severity, action = max(
                (DCGM_FR_VERDICTS[c] for c in codes), key=lambda v: v[0].rank
            )
            meaning = f"judged as the state {', '.join(codes)} names"
        elif verdict is not None:
            severity, action = verdict
            meaning = f"the tool recommends {recommended[0]}"
        else:
            severity, action = Severity.WARNING, Action.NONE
            meaning = "the condition names no cause this input shows; correlate"
        yield group_finding(
            [group],
            entity=NODE_ENTITY,
            kind="kube_condition",
            code=ctype,
            severity=severity,
            action=action,
            summary=(
                f"node condition {ctype}={next(iter(attr(group, 'status')), '?')}"
                + (f" ({reason})" if reason else "")
                + (f": {message[:160]}" if message else "")
                + f" — {meaning}"
            ),
            source=_KUBE_SOURCE + FAULT_MODEL,
        )
    named = {g.node for g in obs.events() if g.kind in _GPU_KINDS | {"sxid"}}
    for group in obs.events("kube_taint"):
        if group.node in explained or group.node in named:
            continue
        effect = ", ".join(sorted(attr(group, "effect")))
        yield group_finding(
            [group],
            entity=NODE_ENTITY,
            kind="kube_taint",
            code=group.code,
            severity=Severity.WARNING,
            action=Action.NONE,
            summary=(
                f"node tainted {group.code} ({effect}) by another health tool: it names a "
                "fault class but not the fault; read the tool's node condition or the kernel "
                "log before acting"
            ),
            source=_KUBE_SOURCE + FAULT_MODEL,
        )


def monitoring_agent_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """A monitoring agent that cannot reach its DCGM host engine: a monitoring fault.

    DCGM returns ``DCGM_ST_CONNECTION_NOT_VALID`` ("Host engine connection
    invalid/disconnected", ``dcgm_structs.h``) when ``nv-hostengine`` is down, not started or
    not reachable from the agent (dcgm-exporter ``DCGM_REMOTE_HOSTENGINE_INFO``, NVIDIA/
    gpu-operator #414, NVIDIA/DCGM #43): the GPUs are not being watched, which says nothing
    about their health. Verdict: warning ``fix_config`` (start or restart nv-hostengine / the
    DCGM pod, fix the agent's host-engine address or socket mount), a node finding, never a
    GPU finding; faults the input shows elsewhere are judged on their own.
    """
    del ctx
    groups = obs.events("monitoring_agent", "hostengine_unreachable")
    by_node: dict[str, list[EventGroup]] = {}
    for group in groups:
        by_node.setdefault(group.node, []).append(group)
    for _node, node_groups in sorted(by_node.items()):
        agents = sorted({a for g in node_groups for a in attr(g, "agent") if a != "unknown"})
        engines = sorted({h for g in node_groups for h in attr(g, "hostengine")})
        yield group_finding(
            node_groups,
            entity=NODE_ENTITY,
            kind="telemetry",
            code="hostengine_unreachable",
            severity=Severity.WARNING,
            action=Action.FIX_CONFIG,
            summary=(
                f"monitoring agent{' ' + ', '.join(agents) if agents else ''} cannot reach its "
                f"DCGM host engine{' at ' + ', '.join(engines) if engines else ''} "
                f"({sum(g.count for g in node_groups)} line(s)): a monitoring fault, not a GPU "
                "fault; start or restart nv-hostengine (or the DCGM pod) and check the agent's "
                "host-engine address; until then the GPUs are not watched"
            ),
            source="host.monitoring_agent_rule: DCGM dcgm_structs.h DCGM_ST_CONNECTION_NOT_VALID; "
            + FAULT_MODEL,
        )


RULES: tuple[Rule, ...] = (host_memory_rule, pcie_rule, kube_node_rule, monitoring_agent_rule)
