"""Kubernetes node conditions and taints that other GPU health tools set.

``kubectl describe node`` (the ``Conditions:`` table and the ``Taints:`` lines) and
``kubectl get node -o yaml|json`` (``status.conditions``, ``spec.taints``). The tools and
what their conditions name:

* NVSentinel (``docs/INTEGRATION.md``, "Standard Condition Types"): ``SysLogsXIDError``
  whose message is ``ErrorCode:<xid> PCI:<bus> GPU_UUID:<uuid> kernel: ... NVRM: Xid ...
  Recommended Action=<action>;`` (one entry per Xid, ``;``-separated),
  ``SysLogsSXIDError``, ``SysLogsGPUFallenOff``, ``NVSwitchFatalError``, the DCGM watches
  ``GpuMemWatch``... with ``[DCGM_FR_*] ... - RecommendedAction: <action>`` and ``DCGMError``;
  taints such as ``nvidia.com/gpu-xid-error``.
* The GKE GPU device plugin (GoogleCloudPlatform/container-engine-accelerators #497):
  ``XidCriticalError`` whose reason is a JSON map ``{"<xid>":true}``.
* The EKS node monitoring agent: ``AcceleratedHardwareReady=False`` with reason
  ``NvidiaXID<n>Error``.
* node-problem-detector custom plugins: any condition whose reason or message names an Xid.

A condition that names an Xid becomes the ``xid`` event the kernel-log parser would emit
for it (code: the Xid, entity: the GPU it names), so the Xid rules judge it as they judge the
Xid itself (``analytics.fault_model.xid``); fallen-off-bus becomes ``gpu_lost``, an SXid an
``sxid`` event. Every other fault condition is a ``kube_condition`` event (code: the type;
attrs ``status``, ``reason``, ``message``, ``recommended_action``), every taint a
``kube_taint`` event (code: the key), judged by ``analytics.fault_model.host``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.kernel_log import KernelLogSession
from collectors.textparse import Session, line_evidence
from core.ids import normalize_pci_bus_id
from core.records import NODE_ENTITY, EntityId, Event, Evidence, NodeName, Record

KUBELET_CONDITIONS = frozenset(
    {"Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"}
)
"""The kubelet's own conditions: not GPU health, never events here."""

READY_SUFFIX = "Ready"
"""Conditions named ``...Ready`` are healthy when True (``AcceleratedHardwareReady``)."""

_STAMP = r"(?:\w{3}, \d{1,2} \w{3} \d{4} \d{2}:\d{2}:\d{2} [+-]\d{4}|\d{4}-\d\d-\d\dT[\d:.]+Z?)"
_ROW = re.compile(
    rf"^\s+(?P<type>[A-Z][A-Za-z0-9]+)\s+(?P<status>True|False|Unknown)\s+"
    rf"(?:{_STAMP}\s+){{0,2}}(?P<reason>\S+)?(?:\s+(?P<message>.*?))?\s*$"
)
_TABLE_HEAD = re.compile(r"^\s+Type\s+Status\s+LastHeartbeatTime")
_TAINT = re.compile(
    r"^(?:Taints:)?\s+(?P<key>[\w./-]+)(?:=(?P<value>[^:\s]*))?:(?P<effect>NoSchedule|"
    r"PreferNoSchedule|NoExecute)\s*$"
)
_KEY_VALUE = re.compile(
    r"^\s*(?P<dash>-\s+)?\"?(?P<key>lastHeartbeatTime|lastTransitionTime|message|reason|status|"
    r"type|key|value|effect|timeAdded)\"?\s*:\s*(?P<value>.*?)\s*,?\s*$"
)
_LOG_CONDITION = re.compile(
    r"\{Type:(?P<type>\w+) Status:(?P<status>True|False|Unknown) .*?Reason:(?P<reason>\S*) "
    r"Message:(?P<message>.*)\}"
)

# What a condition names: Xids and the GPU they were on.
_ERROR_CODE = re.compile(
    r"ErrorCode:(?P<xid>\d+)(?:\s+PCI:(?P<pci>[0-9a-fA-F:.]+))?(?:\s+GPU_UUID:(?P<uuid>GPU-[\w-]+))?"
)
_XID_IN_TEXT = re.compile(
    r"\bXID[ _]?(?P<a>\d{1,3})\b"
    r"|\bXid\s*(?:\((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\))?:?\s*(?P<b>\d{1,3})\b"
    r"|NvidiaXID(?P<c>\d{1,3})(?:Error|Warning)|\bXid=(?P<d>\d{1,3})\b",
    re.IGNORECASE,
)
_JSON_XIDS = re.compile(
    r"^\{\s*\"\d+\"\s*:\s*(?:true|false)(?:\s*,\s*\"\d+\"\s*:\s*(?:true|false))*\s*\}$"
)
_RECOMMENDED = re.compile(r"Recommended ?Action\s*[=:]\s*(?P<v>[A-Z_]+)", re.IGNORECASE)
_PROCESS = re.compile(r"\bname=(?P<v>[^,]+),")
_SXID = re.compile(r"SXid[^:]*:\s*(?P<code>\d{5})|ErrorCode:(?P<code2>\d{5})")
_FALLEN = re.compile(r"fallen off the bus|GPUFallenOff", re.IGNORECASE)


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        inner = value[1:-1]
        if value[0] == '"':
            try:
                loaded = json.loads(value)
            except ValueError:
                return inner
            return loaded if isinstance(loaded, str) else inner
        return inner.replace("''", "'")
    return value


def bad_condition(ctype: str, status: str) -> bool:
    """True when condition ``ctype`` at ``status`` reports a fault.

    Examples:
        >>> bad_condition("SysLogsXIDError", "True"), bad_condition("Ready", "False")
        (True, False)
        >>> bad_condition("AcceleratedHardwareReady", "False")
        True
    """
    if ctype in KUBELET_CONDITIONS:
        return False
    if ctype.endswith(READY_SUFFIX):
        return status == "False"
    return status == "True"


class KubeNodeSession(Session):
    """Parse ``kubectl describe node`` / ``get node -o yaml|json`` text (module doc)."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._item: dict[str, str] = {}
        self._item_lines: list[Evidence] = []
        self._in_conditions = False
        self._in_taints = False
        self._in_events = False
        self._kernel: KernelLogSession | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each condition or taint gives its events when complete."""
        out: list[Record] = []
        for line in lines:
            self._line(line, out)
        return out

    def close(self) -> list[Record]:
        """Flush the last YAML/JSON item and the events' kernel messages."""
        out: list[Record] = []
        self._flush(out)
        if self._kernel is not None:
            out.extend(self._kernel.close())
            self.issues.extend(self._kernel.issues)
        return out

    def _line(self, line: Line, out: list[Record]) -> None:
        text = line.text.rstrip()
        stripped = text.strip()
        ev = line_evidence(self.ctx, line)
        logged = _LOG_CONDITION.search(text)
        if logged:
            self._condition(logged["type"], logged["status"], logged["reason"],
                            logged["message"], [ev], out)
            return
        if stripped.startswith("Events:"):
            self._in_conditions = self._in_taints = False
            self._in_events = True
            return
        if self._in_events and text.startswith((" ", "\t")):
            # node-problem-detector events quote the kernel line ("NVRM: Xid ..."): read it
            # as the kernel log is read.
            if "NVRM" in text or "Xid" in text or "xid" in text:
                if self._kernel is None:
                    self._kernel = KernelLogSession(ctx=self.ctx)
                out.extend(self._kernel.feed([line]))
            return
        self._in_events = False
        if stripped.startswith("Conditions:"):
            self._in_conditions, self._in_taints = True, False
            return
        if stripped.startswith("Taints:"):
            self._in_conditions, self._in_taints = False, True
            if stripped in {"Taints:", "Taints:  <none>"} or stripped.endswith("<none>"):
                return
        if self._in_taints:
            taint = _TAINT.match(text)
            if taint:
                self._taint(taint["key"], taint["value"] or "", taint["effect"], [ev], out)
                return
            if not text.startswith((" ", "\t")) and not stripped.startswith("Taints:"):
                self._in_taints = False
        if self._in_conditions:
            if _TABLE_HEAD.match(text) or set(stripped) <= {"-", " "}:
                return
            row = _ROW.match(text)
            if row and not text.startswith(("  -", "    -")):
                self._condition(row["type"], row["status"], row["reason"] or "",
                                row["message"] or "", [ev], out)
                return
            if text and not text.startswith((" ", "\t")):
                self._in_conditions = False
        kv = _KEY_VALUE.match(text)
        if kv:
            key = kv["key"]
            if kv["dash"] or key in self._item or stripped.startswith("{"):
                self._flush(out)
            self._item[key] = _unquote(kv["value"])
            self._item_lines.append(ev)
            return
        if stripped.startswith(("{", "}", "-")) or stripped.endswith(":"):
            self._flush(out)

    def _flush(self, out: list[Record]) -> None:
        item, lines = self._item, self._item_lines
        self._item, self._item_lines = {}, []
        if "type" in item and "status" in item:
            self._condition(item["type"], item["status"], item.get("reason", ""),
                            item.get("message", ""), lines, out)
        elif "key" in item and "effect" in item:
            self._taint(item["key"], item.get("value", ""), item["effect"], lines, out)

    def _event(
        self, kind: str, code: str, entity: EntityId, message: str, attrs: dict[str, str],
        evidence: list[Evidence],
    ) -> Event:
        return Event(
            kind=kind,
            code=code,
            node=NodeName(self.ctx.node),
            entity=entity,
            observed_at=None,
            message=message[:500],
            attrs=attrs,
            evidence=tuple(evidence[:8]),
            source="kube_node",
        )

    def _taint(
        self, key: str, value: str, effect: str, evidence: list[Evidence], out: list[Record]
    ) -> None:
        if key.startswith("node.kubernetes.io/"):
            return  # the kubelet's own taints (unschedulable, not-ready)
        attrs = {"value": value, "effect": effect}
        out.append(self._event("kube_taint", key, NODE_ENTITY, f"taint {key}={value}:{effect}",
                               attrs, evidence))

    def _condition(
        self, ctype: str, status: str, reason: str, message: str, evidence: list[Evidence],
        out: list[Record],
    ) -> None:
        if not bad_condition(ctype, status):
            return
        reason, message = _unquote(reason), _unquote(message)
        base = {"condition": ctype, "status": status, "reason": reason}
        named = self._named_faults(ctype, reason, message, base, evidence)
        if named:
            out.extend(named)
            return
        attrs = dict(base, message=message[:300])
        action = _RECOMMENDED.search(message) or _RECOMMENDED.search(reason)
        if action:
            attrs["recommended_action"] = action["v"].upper()
        out.append(self._event("kube_condition", ctype, NODE_ENTITY,
                               f"{ctype}={status} {reason} {message}".strip(), attrs, evidence))

    def _named_faults(
        self, ctype: str, reason: str, message: str, base: dict[str, str],
        evidence: list[Evidence],
    ) -> list[Event]:
        """The Xid, SXid or lost-GPU events a condition names (empty when it names none)."""
        out: list[Event] = []
        text = f"{reason} {message}"
        if "SXID" in ctype or "SXid" in ctype or "NVSwitch" in ctype:
            for m in _SXID.finditer(text):
                code = m["code"] or m["code2"]
                attrs = dict(base, message=message[:300], switch="kube_condition")
                if "Fatal" in ctype and "NonFatal" not in ctype:
                    attrs["fatal"] = "yes"
                out.append(self._event("sxid", code, NODE_ENTITY, message, attrs, evidence))
            return out
        seen: set[tuple[str, str]] = set()
        for part in [p for p in message.split(";") if p.strip()] or [message]:
            code_m = _ERROR_CODE.search(part)
            xid, pci, uuid = "", "", ""
            if code_m:
                xid, pci, uuid = code_m["xid"], code_m["pci"] or "", code_m["uuid"] or ""
            else:
                found = _XID_IN_TEXT.search(part) or _XID_IN_TEXT.search(reason)
                if found:
                    xid = found["a"] or found["b"] or found["c"] or found["d"] or ""
                    pci = found["pci"] or ""
            if xid:
                self._xid(xid, pci, uuid, part, base, evidence, seen, out)
        if not out and _JSON_XIDS.match(reason.strip()):
            for key, value in json.loads(reason).items():
                if value is True:
                    self._xid(str(int(key)), None, None, message, base, evidence, seen, out)
        if not out and (_FALLEN.search(ctype) or _FALLEN.search(message)):
            where = _ERROR_CODE.search(message)
            entity = _entity(where["pci"] if where else None, where["uuid"] if where else None)
            out.append(self._event("gpu_lost", "fallen_off_bus", entity, message,
                                   dict(base, message=message[:300]), evidence))
        return out

    def _xid(
        self, xid: str, pci: str | None, uuid: str | None, text: str, base: dict[str, str],
        evidence: list[Evidence], seen: set[tuple[str, str]], out: list[Event],
    ) -> None:
        entity = _entity(pci, uuid)
        code = str(int(xid))
        if (code, entity) in seen:
            return
        seen.add((code, entity))
        nvrm = text[text.find("NVRM:"):] if "NVRM:" in text else text
        attrs = dict(base, xid=code, message=nvrm.strip()[:300])
        process = _PROCESS.search(text)
        if process:
            attrs["process"] = process["v"].strip()
        if uuid:
            attrs["uuid"] = uuid
        action = _RECOMMENDED.search(text)
        if action:
            attrs["recommended_action"] = action["v"].upper()
        out.append(self._event("xid", code, entity, nvrm, attrs, evidence))


def _entity(pci: str | None, uuid: str | None) -> EntityId:
    if pci:
        bus = normalize_pci_bus_id(pci)
        if bus is not None:
            return EntityId(bus)
    if uuid:
        return EntityId(uuid)
    return NODE_ENTITY


class KubeNodeParser:
    """``kubectl describe node`` and ``kubectl get node -o yaml|json``."""

    kind = "kube_node"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 on a conditions table, condition items or a ``Taints:`` line."""
        sample = lines[:400]
        texts = [ln.text for ln in sample]
        # Above the kernel-log parser's 90: a condition message quotes the Xid line.
        if any(_TABLE_HEAD.match(t) for t in texts):
            return 95
        if any(_LOG_CONDITION.search(t) for t in texts):
            return 95
        keys = [m["key"] for t in texts if (m := _KEY_VALUE.match(t))]
        if "type" in keys and "status" in keys and (
            "lastTransitionTime" in keys or "lastHeartbeatTime" in keys
        ):
            return 95
        if any(t.startswith("Taints:") for t in texts) or any(
            t.strip().startswith("Conditions:") for t in texts
        ):
            return 60
        if command is not None and "kubectl" in command and "node" in command and keys:
            return 50
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return KubeNodeSession(ctx)


PARSERS: tuple[ArtifactParser, ...] = (KubeNodeParser(),)
"""The artifact parsers of this module (read by ``collectors.parsers``)."""

__all__ = ["KUBELET_CONDITIONS", "PARSERS", "KubeNodeParser", "bad_condition"]
