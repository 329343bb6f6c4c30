"""Fault-model rules for GPU driver events: Xids, GPU loss, recovery actions, SXids.

The rules follow ``docs/fault-model.md`` ("Severity and action rules") and the Xid
table of ``docs/ecosystem-reference.md`` §9 (NVIDIA Xid catalog resolution buckets,
as NVSentinel's ``xiderrorsmapping.csv`` treats them: RESET_GPU and RESTART_BM are
fatal, RESTART_APP and IGNORE are app-level or benign). SXids follow the NVIDIA
Fabric Manager user guide (fatal, non-fatal that stall NVLink traffic, other
non-fatal). Root cause over symptoms: Xid 45, NVML "Unknown Error" and "No devices
were found", CUDA "busy or unavailable", a PMU-halt notice and GSP RPC timeouts are
folded into the evidence of the root finding on the same GPU (or, when the symptom
names no GPU, the worst root finding on the node); alone they stand as their own,
milder findings. Repeated messages of one kind on one GPU are one finding whose
``occurrences`` counts them and whose ``last_seen_at`` moves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from analytics.fault_model.common import attr, uuid_map, year_note
from analytics.fault_model.engine import Context, EventGroup, Observations, Rule, keep_evidence
from core.records import NODE_ENTITY, Action, EntityId, Evidence, Finding, NodeName, Severity

logger = logging.getLogger(__name__)

CATALOG = "NVIDIA Xid catalog (ecosystem-reference §9)"
FAULT_MODEL = "docs/fault-model.md"

APP_LEVEL_XIDS = frozenset({13, 31, 32, 68, 69})
"""RESTART_APP-bucket Xids that are application faults (fault-model: info, restart_app)."""

RESET_GPU_XIDS = frozenset({62, 64, 74, 95, 109, 119, 120, 140, 143})
"""Xids in the catalog's RESET_GPU bucket (NVSentinel: FATAL)."""

NVLINK5_XIDS = frozenset(range(144, 151))
"""Blackwell NVLink5 Xids, decoded per the catalog's NVLink5 sub-table."""

BENIGN_XIDS = frozenset({92, 121})
"""IGNORE-bucket Xids with no action (92: SBE rate, trend it; 121: corrected C2C errors)."""

XID_NAMES = {
    13: "Graphics engine exception",
    31: "GPU memory page fault (MMU)",
    32: "invalid or corrupted push buffer stream",
    43: "GPU stopped processing (app fault)",
    45: "preemptive cleanup",
    48: "double-bit (uncorrectable) ECC error",
    61: "PMU breakpoint",
    62: "PMU halt (internal micro-controller)",
    63: "row remap / page retirement recorded",
    64: "row remap / page retirement failure",
    68: "NVDEC0 exception",
    69: "Graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC rate",
    94: "contained memory error",
    95: "uncontained memory error",
    109: "context-switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "corrected C2C errors",
    140: "uncorrectable ECC escaped containment",
    143: "GPU initialization error",
    144: "NVLink SAW error",
    145: "NVLink RLW error",
    146: "NVLink TLW error",
    147: "NVLink TREX error",
    148: "NVLink NVLPW control error",
    149: "NVLink NETIR error",
    150: "NVLink MSE error",
    154: "GPU recovery action changed",
}

RECOVERY_ACTIONS: dict[str, tuple[Severity, Action]] = {
    "none": (Severity.INFO, Action.NONE),
    "gpu reset required": (Severity.CRITICAL, Action.RESET_GPU),
    "drain and reset": (Severity.CRITICAL, Action.RESET_GPU),
    "node reboot required": (Severity.CRITICAL, Action.REBOOT_NODE),
    "drain p2p": (Severity.MAJOR, Action.RESET_GPU),
    "bus reset required": (Severity.CRITICAL, Action.RESET_GPU),
    "bus reset": (Severity.CRITICAL, Action.RESET_GPU),
    "system reboot required": (Severity.CRITICAL, Action.REBOOT_NODE),
    "system reboot": (Severity.CRITICAL, Action.REBOOT_NODE),
    "recover imex domain": (Severity.MAJOR, Action.CHECK_NETWORK),
}
"""Xid 154 / NVML recovery action to (severity, action), fault-model.md."""

_RECOVERY_CODES = {
    "0": "none",
    "1": "gpu reset required",
    "2": "node reboot required",
    "3": "drain p2p",
    "4": "drain and reset",
    "5": "recover imex domain",
    "6": "bus reset required",
    "7": "system reboot required",
}

STALLING_NONFATAL_SXIDS = frozenset({11004, 12028, 19084})
"""Non-fatal SXids that stall NVLink traffic per the Fabric Manager guide (D.4).

11004 ingress invalid ACL and 12028 egress non-posted PRIV error: "NVLink traffic will
be stalled, and subsequent GPU access will hang ... abort CUDA jobs with Xid 45";
19084 AN1 heartbeat timeout: "usually accompanied by a fatal SXid", recovery "reset all
GPUs and all NVSwitches".
"""

BENIGN_NONFATAL_SXIDS = frozenset(
    {11012, 11021, 11022, 11023, 12021, 12023, 15008, 15011, 19049, 19055, 19057, 19059}
    | {19062, 19065, 19068, 19071, 24001, 24002, 24003, 20001, 20012, 22013}
)
"""Non-fatal SXids with no job impact per the Fabric Manager guide (D.4): single-bit ECC
corrected by the switch, TX replays (throughput only), a broken connection confined to
one GPU, Minion DLREQ ("can be safely ignored"). Judged info even when a report line
lacks its Fatal/Non-fatal word."""

CONFIG_INIT_FAILURES = frozenset({"unsupported_gpu", "firmware_missing"})
"""Init failures whose fix is the driver install, not the hardware (catalog UPDATE_SWFW)."""

NVLINK_IGNORABLE_BITS = {
    0: (1 << 0) | (1 << 23) | (1 << 30),
    4: (1 << 20) | (1 << 23) | (1 << 26) | (1 << 29),
}
"""Xid 74 register bits with no action per the catalog's WORKFLOW_NVLINK_ERR, by register.

First register: bits 0, 23, 30 "can be safely ignored"; fifth register: bits 20, 23,
26, 29 are an ECC threshold with no uncorrectable error ("continue operation").
"""

LOST_KINDS = frozenset({"gpu_lost", "gpu_init_failure"})

FOLD_WINDOW_SECONDS = 3600.0
"""Symptoms (Xid 43, 45, driver and CUDA errors) fold into a root fault of their GPU only
when they are this close in time to it (both times known)."""
_ROOT_PRIORITY = (
    "unsupported_gpu",
    "firmware_missing",
    "power_cables",
    "fallen_off_bus",
    "gpu_is_lost",
    "nvml_gpu_is_lost",
    "rm_init_adapter",
    "gsp_init_failure",
    "probe_failed",
    "heartbeat_timeout",
    "memsys_error",
    "rpc_timeout",
)


@dataclass(slots=True)
class _Root:
    node: NodeName
    entity: EntityId
    kind: str
    code: str
    severity: Severity
    action: Action
    summary: str
    source: str
    evidence: list[Evidence] = field(default_factory=list)
    first: float | None = None
    last: float | None = None
    occurrences: int = 0
    confidence: float = 1.0
    year: str | None = None
    boots: set[str] = field(default_factory=set)
    codes: set[str] = field(default_factory=set)

    def take(self, group: EventGroup) -> None:
        self.codes.add(group.code)
        keep_evidence(self.evidence, group.evidence)
        self.first = _min(self.first, group.first_seen_at)
        self.last = _max(self.last, group.last_seen_at)
        self.occurrences += group.count
        self.boots |= group.attr_values.get("boot", set())
        years = group.attr_values.get("year_assumed")
        if years and self.year is None:
            self.year = min(years)

    def near(self, group: EventGroup, window: float = FOLD_WINDOW_SECONDS) -> bool:
        """Whether ``group`` happened within ``window`` of this root (unknown times: yes).

        A symptom folds into a root only when they belong to one incident: an application's
        Xid 43 a day and a half before a double-bit error is not part of it, and folding it
        put the double-bit error's first time 36 h early (issue #15: its label with it).
        """
        if self.first is None or self.last is None:
            return True
        first, last = group.first_seen_at, group.last_seen_at
        if first is None or last is None:
            return True
        return first <= self.last + window and last >= self.first - window

    def finding(self) -> Finding:
        return Finding(
            node=self.node,
            entity=self.entity,
            kind=self.kind,
            code=self.code,
            severity=self.severity,
            action=self.action,
            summary=self.summary + year_note(self.year),
            evidence=tuple(self.evidence),
            source=self.source,
            first_seen_at=self.first,
            last_seen_at=self.last,
            occurrences=max(self.occurrences, 1),
            confidence=self.confidence,
        )


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _xid_verdict(n: int, group: EventGroup) -> tuple[Severity, Action, str, float]:
    """Severity, action, summary text and confidence for one Xid group (not 45, 79, 154)."""
    name = XID_NAMES.get(n, "")
    label = f"Xid {n}" + (f" ({name})" if name else "")
    if n in APP_LEVEL_XIDS:
        procs = {p for p in attr(group, "process") if p and p != "<unknown>"}
        if len(procs) >= 2:
            return (
                Severity.WARNING,
                Action.RESTART_APP,
                f"{label} repeated under {len(procs)} process names: suspect the GPU, "
                "run DCGM diag",
                1.0,
            )
        return (
            Severity.INFO,
            Action.RESTART_APP,
            f"{label}: application-level fault, restart the job",
            1.0,
        )
    if n == 43:
        return Severity.INFO, Action.NONE, f"{label}: the GPU stays healthy", 1.0
    if n in BENIGN_XIDS:
        return Severity.INFO, Action.NONE, f"{label}: no action (trend it)", 1.0
    if n in (63, 94):
        return (
            Severity.WARNING,
            Action.RESET_GPU,
            f"{label}: reset the GPU at the next opportunity",
            1.0,
        )
    if n == 79:
        return Severity.CRITICAL, Action.REBOOT_NODE, f"{label}: GPU lost, reboot the node", 1.0
    if n == 48:
        return Severity.CRITICAL, Action.RESET_GPU, f"{label}: reset the GPU before reuse", 1.0
    if n == 74 and _xid74_benign(group):
        return (
            Severity.INFO,
            Action.NONE,
            f"{label}: only register bits the catalog says can be safely ignored",
            1.0,
        )
    if n == 64:
        return (
            Severity.CRITICAL,
            Action.RESET_GPU,
            f"{label}: catalog RESET_GPU; an RMA candidate if it recurs after the reset",
            1.0,
        )
    if n in RESET_GPU_XIDS:
        return (
            Severity.CRITICAL,
            Action.RESET_GPU,
            f"{label}: catalog RESET_GPU, reset before reuse",
            1.0,
        )
    if n in NVLINK5_XIDS:
        return _nvlink5(n, group, label)
    if n == 61:
        return Severity.MAJOR, Action.SERVICE_HARDWARE, f"{label}: catalog CONTACT_SUPPORT", 1.0
    return (
        Severity.WARNING,
        Action.RESET_GPU,
        f"Xid {n}: not in gpuhealth's Xid table; defaulting to warning, reset the GPU at the next "
        "opportunity and look it up in NVIDIA's Xid catalog",
        0.5,
    )


def _nvlink5_fatal(n: int, unit: str, status: str, word: str) -> bool | None:
    """Decode one NVLink5 Xid per the catalog's NVLink5 sub-table; ``None`` when undecodable."""
    if n in (147, 148):
        return False
    if n == 150:
        return True
    if n == 146 and status:
        if int(status, 16) == 0x4:
            return True
        if int(status, 16) in (0x1, 0x2, 0x80000000):
            return False
    if n == 145 and "RLW_RXPIPE" in unit and status and int(status, 16) == 0x8:
        return False
    if n == 149 and "BER" in unit:
        return False
    if word:
        return word == "yes"
    return None


def _nvlink5(n: int, group: EventGroup, label: str) -> tuple[Severity, Action, str, float]:
    fatal = False
    undecoded = False
    for ev in group.events:
        verdict = _nvlink5_fatal(
            n, ev.attrs.get("unit", ""), ev.attrs.get("status", ""), ev.attrs.get("fatal", "")
        )
        if verdict is None:
            undecoded = True
            fatal = True
        elif verdict:
            fatal = True
    if fatal:
        why = (
            "no decode available, counted as fatal"
            if undecoded
            else "link fatal per the NVLink5 decode"
        )
        return Severity.CRITICAL, Action.RESET_GPU, f"{label}: {why}; reset the GPU", 1.0
    return Severity.INFO, Action.NONE, f"{label}: non-fatal per the NVLink5 decode (counted)", 1.0


def _recovery(group: EventGroup) -> tuple[Severity, Action, str]:
    worst_sev, worst_act, worst_name = Severity.INFO, Action.NONE, "None"
    names = set(attr(group, "recovery_action"))
    if not names:
        names = {_RECOVERY_CODES.get(c, c) for c in attr(group, "recovery_action_code")}
    codes = attr(group, "recovery_action_code")
    for name in names:
        sev_act = RECOVERY_ACTIONS.get(name.strip().lower()) or _recovery_by_words(name)
        if sev_act is None:
            known = [RECOVERY_ACTIONS[_RECOVERY_CODES[c]] for c in codes if c in _RECOVERY_CODES]
            sev_act = (
                max(known, key=lambda sa: sa[0].rank)
                if known
                else (Severity.WARNING, Action.RESET_GPU)
            )
        if sev_act[0].rank > worst_sev.rank:
            worst_sev, worst_act, worst_name = sev_act[0], sev_act[1], name
    return worst_sev, worst_act, worst_name


def _recovery_by_words(name: str) -> tuple[Severity, Action] | None:
    """Judge a recovery-action name this table lacks by its words (newer drivers add some)."""
    low = name.lower()
    if "imex" in low:
        return RECOVERY_ACTIONS["recover imex domain"]
    if "reboot" in low:
        return Severity.CRITICAL, Action.REBOOT_NODE
    if "p2p" in low:
        return RECOVERY_ACTIONS["drain p2p"]
    if "reset" in low:
        return Severity.CRITICAL, Action.RESET_GPU
    if low.strip() in ("", "none", "no action"):
        return Severity.INFO, Action.NONE
    return None


def _xid74_benign(group: EventGroup) -> bool:
    """Whether every Xid 74 of the group sets only the register bits the catalog ignores.

    Source: NVIDIA Xid catalog, WORKFLOW_NVLINK_ERR (:data:`NVLINK_IGNORABLE_BITS`);
    any other bit, or no decodable register, counts as fatal.
    """
    for ev in group.events:
        regs = ev.attrs.get("registers", "")
        if not regs:
            return False
        try:
            values = [int(x, 16) for x in regs.split(",")]
        except ValueError:
            return False
        if not any(values):
            return False
        for i, value in enumerate(values):
            if value & ~NVLINK_IGNORABLE_BITS.get(i, 0):
                return False
    return bool(group.events)


def _worst(roots: Sequence[_Root]) -> _Root | None:
    if not roots:
        return None
    return min(
        roots, key=lambda r: (-r.severity.rank, r.first if r.first is not None else float("inf"))
    )


def gpu_driver_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Xids, GPU loss, init failures, reset-required and GSP faults, with symptoms folded.

    Sources: NVIDIA Xid catalog resolution buckets (ecosystem-reference §9),
    NVIDIA NVML recovery actions (Xid 154), ``docs/fault-model.md`` severity table.
    """
    del ctx
    to_pci = uuid_map(obs)

    def ent(g: EventGroup) -> EntityId:
        return EntityId(to_pci.get(g.entity, g.entity))

    roots: dict[tuple[str, str], list[_Root]] = {}
    lost: dict[tuple[str, str], _Root] = {}
    symptoms: list[tuple[EventGroup, EntityId]] = []

    def add_root(root: _Root) -> _Root:
        roots.setdefault((root.node, root.entity), []).append(root)
        return root

    def take_as_root(g: EventGroup, entity: EntityId, severity: Severity, action: Action,
                     summary: str, source: str, *, code: str | None = None,
                     confidence: float = 1.0) -> None:
        """Start a root fault with ``g`` (its kind, and its code unless ``code`` is given)."""
        add_root(_Root(node=g.node, entity=entity, kind=g.kind,
                       code=g.code if code is None else code, severity=severity, action=action,
                       summary=summary, source=source, confidence=confidence)).take(g)

    # --- GPU lost: Xid 79, fallen off the bus, NVML GPU_IS_LOST, init failures, GSP at boot
    lost_groups: list[EventGroup] = []
    for g in obs.groups.values():
        at_boot = "yes" in attr(g, "at_boot")
        if (
            (g.kind == "xid" and g.code == "79")
            or g.kind in LOST_KINDS
            or (g.kind in ("gsp_error", "gsp_rpc_timeout") and at_boot)
        ):
            lost_groups.append(g)
    lost_groups.sort(key=lambda g: (g.entity == NODE_ENTITY, _priority(g)))
    for g in lost_groups:
        entity = ent(g)
        key = (g.node, entity)
        root = lost.get(key)
        if root is None and entity == NODE_ENTITY:
            same_node = [r for (n, _e), r in lost.items() if n == g.node]
            root = same_node[0] if same_node else None
        if root is None:
            xid79 = g.kind == "xid"
            root = lost[key] = add_root(
                _Root(
                    node=g.node,
                    entity=entity,
                    kind="xid" if xid79 else "gpu_lost",
                    code="79" if xid79 else g.code,
                    severity=Severity.CRITICAL,
                    action=Action.REBOOT_NODE,
                    summary=_lost_summary(g, entity),
                    source=f"xid.gpu_driver_rule: GPU lost ({FAULT_MODEL}; "
                    f"{CATALOG}: Xid 79 RESTART_BM)",
                )
            )
        root.take(g)
    for root in lost.values():
        if root.codes & CONFIG_INIT_FAILURES:
            root.action = Action.FIX_CONFIG
            root.summary += (
                ": install a driver branch (and its GSP firmware) that supports this GPU "
                "(catalog UPDATE_SWFW)"
            )
        elif root.code == "power_cables":
            root.action = Action.SERVICE_HARDWARE
            root.summary += (
                ": connect or re-seat the GPU's power cables (catalog CHECK_MECHANICALS)"
            )
        elif len(root.boots) >= 2:
            root.action = Action.SERVICE_HARDWARE
            root.summary += (
                "; it recurred after a reboot: hardware service (PCIe link, riser, power, RMA)"
            )
        else:
            root.summary += ": drain, collect nvidia-bug-report, reboot or power-cycle the node"

    # --- other Xids
    xid45: list[EventGroup] = []
    xid43: list[EventGroup] = []
    for g in obs.events("xid"):
        if g.code == "79":
            continue
        if g.code == "45":
            xid45.append(g)
            continue
        if g.code == "43":
            xid43.append(g)
            continue
        entity = ent(g)
        if g.code == "154":
            sev, act, name = _recovery(g)
            take_as_root(
                g, entity, sev, act,
                f"Xid 154: GPU recovery action is now {name!r} on {entity}",
                f"xid.gpu_driver_rule: Xid 154 recovery action ({CATALOG}; "
                "NVML recovery action; "
                f"{FAULT_MODEL})",
            )
            continue
        try:
            n = int(g.code)
        except ValueError:
            continue
        sev, act, text, conf = _xid_verdict(n, g)
        if conf < 1.0:
            logger.info(
                "Xid %s on %s is not in the Xid table; using the default verdict", n, entity
            )
        take_as_root(
            g, entity, sev, act,
            f"{text} on {entity}",
            f"xid.gpu_driver_rule: {CATALOG}; {FAULT_MODEL}",
            confidence=conf,
        )

    # Xid 48 with 64 recurring after a reboot: the memory is failing (fault-model Xid 48 row)
    for rs in roots.values():
        codes = {r.code: r for r in rs if r.kind == "xid"}
        if "48" in codes and "64" in codes:
            boots = codes["48"].boots | codes["64"].boots
            if len(boots) >= 2:
                for code in ("48", "64"):
                    codes[code].action = Action.SERVICE_HARDWARE
                    codes[code].summary += "; with Xid 64 after a reboot: RMA candidate"

    # --- reset required, GSP errors at run time
    for g in obs.groups.values():
        entity = ent(g)
        if g.kind == "reboot_required":
            take_as_root(
                g, entity, Severity.CRITICAL, Action.REBOOT_NODE,
                "the driver reports a global fatal error that needs an OS reboot "
                f"({_gpu_words(entity)}): drain and reboot the node",
                f"xid.gpu_driver_rule: recovery action Node Reboot Required ({FAULT_MODEL})",
            )
        elif g.kind == "driver_mismatch":
            take_as_root(
                g, entity, Severity.MAJOR, Action.FIX_CONFIG,
                "NVIDIA user-space driver and kernel module versions differ: CUDA "
                "and NVML clients fail until they match (reload the module or reboot "
                "after the driver upgrade)",
                "xid.gpu_driver_rule: driver version mismatch, catalog UPDATE_SWFW "
                f"({FAULT_MODEL}: fix_config)",
            )
        elif g.kind == "reset_required":
            take_as_root(
                g, entity, Severity.CRITICAL, Action.RESET_GPU,
                f"NV_ERR_RESET_REQUIRED on {_gpu_words(entity)}: "
                "the GPU needs a reset before reuse",
                f"xid.gpu_driver_rule: recovery action GPU Reset Required ({FAULT_MODEL})",
            )
        elif (
            g.kind == "gsp_error"
            and g.code in ("heartbeat_timeout", "memsys_error")
            and ("yes" not in attr(g, "at_boot"))
        ):
            take_as_root(
                g, entity, Severity.CRITICAL, Action.RESET_GPU,
                f"GSP {g.code.replace('_', ' ')} on {_gpu_words(entity)} "
                "(Xid 119/120 class): reset the GPU",
                f"xid.gpu_driver_rule: {CATALOG} Xid 119/120 RESET_GPU; {FAULT_MODEL}",
            )
        elif g.kind in ("gsp_rpc_timeout", "nvml_error", "cuda_error") or (
            g.kind == "gsp_error" and g.code == "pmu_halted"
        ):
            if g.kind == "gsp_rpc_timeout" and "yes" in attr(g, "at_boot"):
                continue
            symptoms.append((g, entity))

    # --- Xid 43 (the channel the app broke was reset; the GPU stays healthy): folded
    # into another fault on the same GPU, else its own info finding
    for g in xid43:
        entity = ent(g)
        target = _worst([r for r in roots.get((g.node, entity), [])
                         if r.code not in ("43", "45") and r.near(g)])
        if target is not None:
            target.take(g)
            continue
        sev, act, text, conf = _xid_verdict(43, g)
        take_as_root(
            g, entity, sev, act,
            f"{text} on {entity}",
            f"xid.gpu_driver_rule: {CATALOG}; {FAULT_MODEL}",
            confidence=conf,
        )

    # --- Xid 45: folded, or standing for the Xid it names
    for g in xid45:
        entity = ent(g)
        caused = sorted(attr(g, "caused_by"))
        target = _worst([r for r in roots.get((g.node, entity), [])
                         if r.code != "45" and r.near(g)])
        if target is not None:
            target.take(g)
            continue
        if caused:
            n = int(caused[0])
            sev, act, text, conf = _xid_verdict(n, g)
            take_as_root(
                g, entity, sev, act,
                f"{text} on {entity} (named by Xid 45, whose cause line is missing)",
                f"xid.gpu_driver_rule: Xid 45 names its cause; {CATALOG}",
                code=str(n), confidence=conf,
            )
            continue
        take_as_root(
            g, entity, Severity.INFO, Action.NONE,
            f"Xid 45 (preemptive cleanup) alone on {entity}: "
            "a job was stopped; no action",
            f"xid.gpu_driver_rule: {CATALOG} Xid 45; {FAULT_MODEL}",
        )

    # --- symptoms
    for g, entity in symptoms:
        target = _worst([r for r in roots.get((g.node, entity), []) if r.near(g)])
        if target is None and (entity == NODE_ENTITY or entity.startswith("gpu:")):
            target = _worst(
                [
                    r
                    for (n, _e), rs in roots.items()
                    if n == g.node
                    for r in rs
                    if r.severity.rank >= Severity.MAJOR.rank and r.near(g)
                ]
            )
        if target is not None and target.severity.rank >= Severity.WARNING.rank:
            target.take(g)
            continue
        root = add_root(_symptom_alone(g, entity))
        root.take(g)

    return [r.finding() for rs in roots.values() for r in rs]


def _priority(g: EventGroup) -> int:
    if g.kind == "xid":
        return -1
    try:
        return _ROOT_PRIORITY.index(g.code)
    except ValueError:
        return len(_ROOT_PRIORITY)


def _gpu_words(entity: str) -> str:
    return "a GPU the log does not name" if entity == NODE_ENTITY else entity


def _lost_summary(g: EventGroup, entity: str) -> str:
    what = {
        "79": "Xid 79: GPU has fallen off the bus",
        "fallen_off_bus": "GPU has fallen off the bus (no Xid)",
        "nvml_gpu_is_lost": "NVML reports GPU_IS_LOST",
        "gpu_is_lost": "the driver reports NV_ERR_GPU_IS_LOST",
        "power_cables": "the GPU lacks its power cables",
        "unsupported_gpu": "the installed driver does not support this GPU",
        "firmware_missing": "the driver's GSP firmware file is missing",
        "rm_init_adapter": "the driver cannot initialise the GPU (RmInitAdapter failed)",
        "probe_failed": "the NVIDIA probe routine failed",
        "gsp_init_failure": "GSP firmware failed to initialise",
        "heartbeat_timeout": "GSP heartbeat timed out while the GPU was brought up",
        "memsys_error": "memory subsystem error while the GPU was brought up",
        "rpc_timeout": "GSP RPC timeout while the GPU was brought up",
    }.get(g.code, f"GPU lost ({g.code})")
    return f"{what} on {_gpu_words(entity)}: GPU lost"


_GSP_SYMPTOMS: dict[str, tuple[str, int]] = {
    "gsp_rpc_timeout": ("GSP RPC timeouts", 119),
    "gsp_error": ("GSP reports the PMU halted", 62),
}
"""GSP faults at run time, alone in the input: what happened and the Xid class they belong to
(catalog RESET_GPU: critical, reset the GPU)."""

_NVML_SYMPTOMS: dict[str, tuple[Action, str]] = {
    "init_failed": (
        Action.FIX_CONFIG,
        "NVML failed to initialise (driver/library mismatch or container set-up)",
    ),
    "driver_not_loaded": (
        Action.FIX_CONFIG,
        "nvidia-smi cannot reach the NVIDIA driver: driver not loaded",
    ),
    "no_devices": (
        Action.REBOOT_NODE,
        "NVML finds no GPUs on this node: check the kernel log for Xid 79 / init failures",
    ),
}
"""NVML errors that name no GPU, alone in the input: warning, confidence 0.5, this action."""


def _symptom_alone(g: EventGroup, entity: EntityId) -> _Root:
    src = f"xid.gpu_driver_rule: symptom without a root cause in the input ({FAULT_MODEL})"
    where = _gpu_words(entity)
    if g.kind in _GSP_SYMPTOMS:
        what, xid = _GSP_SYMPTOMS[g.kind]
        return _Root(
            node=g.node,
            entity=entity,
            kind=g.kind,
            code=g.code,
            severity=Severity.CRITICAL,
            action=Action.RESET_GPU,
            summary=f"{what} on {where} (Xid {xid} class): reset the GPU",
            source=f"xid.gpu_driver_rule: {CATALOG} Xid {xid} RESET_GPU; {FAULT_MODEL}",
        )
    if g.kind == "cuda_error":
        return _Root(
            node=g.node,
            entity=entity,
            kind="cuda_error",
            code=g.code,
            severity=Severity.WARNING,
            action=Action.RESET_GPU,
            confidence=0.5,
            summary=(
                "CUDA reports an uncorrectable ECC error with no Xid in the input: a contained "
                "memory error; reset the GPU at the next opportunity (applies a pending row remap)"
                if g.code == "uncorrectable_ecc"
                else "CUDA reports a device busy or unavailable with no Xid in the input: a GPU "
                "may need a reset (or is held in an exclusive compute mode)"
            ),
            source=src,
        )
    if g.code in _NVML_SYMPTOMS:
        action, summary = _NVML_SYMPTOMS[g.code]
        return _Root(
            node=g.node,
            entity=entity,
            kind="nvml_error",
            code=g.code,
            severity=Severity.WARNING,
            action=action,
            confidence=0.5,
            summary=summary,
            source=src,
        )
    return _Root(
        node=g.node,
        entity=entity,
        kind="nvml_error",
        code=g.code,
        severity=Severity.CRITICAL,
        action=Action.REBOOT_NODE,
        confidence=0.7,
        summary=f"NVML cannot get a handle for {where} ({g.code.replace('_', ' ')}): "
        "the GPU is unreachable, as when it has fallen off the bus",
        source=src,
    )


def sxid_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """NVSwitch SXids (kernel ``nvidia-nvswitch`` lines and Fabric Manager log).

    Source: NVIDIA Fabric Manager user guide (fatal SXids need GPUs and NVSwitches
    reset, in practice a node reboot; the non-fatal :data:`STALLING_NONFATAL_SXIDS`
    stall NVLink traffic; other non-fatal SXids such as single-bit ECC are corrected by
    hardware, :data:`BENIGN_NONFATAL_SXIDS` even when the line lacks its severity word),
    fault-model.md.
    """
    del ctx
    for g in obs.events("sxid"):
        fatal = attr(g, "fatal")
        code = int(g.code) if g.code.isdigit() else -1
        if "yes" in fatal:
            sev, act, text = (
                Severity.CRITICAL,
                Action.REBOOT_NODE,
                "fatal: reset GPUs and NVSwitches (reboot)",
            )
        elif code in STALLING_NONFATAL_SXIDS:
            sev, act, text = (
                Severity.MAJOR,
                Action.REBOOT_NODE,
                "non-fatal but stalls NVLink traffic",
            )
        elif "no" in fatal or code in BENIGN_NONFATAL_SXIDS:
            sev, act, text = Severity.INFO, Action.NONE, "non-fatal, corrected or counted"
        else:
            sev, act, text = (
                Severity.WARNING,
                Action.NONE,
                "fatality not stated; check the FM guide",
            )
        root = _Root(
            node=g.node,
            entity=g.entity,
            kind="sxid",
            code=g.code,
            severity=sev,
            action=act,
            summary=f"NVSwitch SXid {g.code} on {g.entity}: {text}",
            source="xid.sxid_rule: NVIDIA Fabric Manager user guide (SXid); " + FAULT_MODEL,
        )
        root.take(g)
        yield root.finding()


def notes_rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
    """Informational kernel notes: nvidia-peermem messages, Fabric Manager start failures.

    Source: fault-model.md ("Fabric Manager failing to start on a system without
    NVSwitches: info, none"); ecosystem-reference §9b (FM runs only on NVSwitch systems).
    """
    nvswitch_nodes = {g.node for g in obs.events("sxid")}
    for g in obs.events("peermem"):
        root = _Root(
            node=g.node,
            entity=g.entity,
            kind="peermem",
            code=g.code,
            severity=Severity.INFO,
            action=Action.NONE,
            summary="nvidia-peermem note (GPUDirect RDMA); informational",
            source="xid.notes_rule: " + FAULT_MODEL,
        )
        root.take(g)
        yield root.finding()
    for g in obs.events("fabric_manager"):
        switch_system = (
            g.node in nvswitch_nodes
            or g.code == "topology_mismatch"
            or ctx.fact("nvswitch") in ("present", "expected", "yes")
        )
        if switch_system:
            sev, act = Severity.MAJOR, Action.CHECK_NETWORK
            text = "Fabric Manager failed on an NVSwitch system: the NVLink fabric is not set up"
        else:
            sev, act = Severity.INFO, Action.NONE
            text = "Fabric Manager failed to start; expected on a system without NVSwitches"
        root = _Root(
            node=g.node,
            entity=g.entity,
            kind="fabric_manager",
            code=g.code,
            severity=sev,
            action=act,
            summary=text,
            source="xid.notes_rule: NVIDIA Fabric Manager user guide; " + FAULT_MODEL,
        )
        root.take(g)
        yield root.finding()


RULES: tuple[Rule, ...] = (gpu_driver_rule, sxid_rule, notes_rule)
