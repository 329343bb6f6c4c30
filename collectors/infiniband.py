"""Artifact parsers for InfiniBand and RoCE tools.

Covers ibstat, ibstatus, ibv_devinfo, perfquery, ibqueryerrors, ``ethtool -S``,
``grep "" /sys/class/infiniband/...`` dumps, ``rdma statistic``, ``ip -s link``,
``mlxlink`` and the ibdiagnet summary table. Kinds: ``ib_port_state`` (ibstat,
ibstatus, ibv_devinfo, sysfs, ``rdma link``, mlxlink), ``ib_counter_saturated``,
``ibdiagnet_stage`` (code: the stage, attrs ``warnings``/``errors``); counters are
samples (``ib_*``, ``rdma_hw_counter_total``, ``net_prio_*``, ``net_nic_counter_total``).
A Markdown quote (``> ``) in front of every line of a pasted block is removed first.

Sources followed:

* ``ibstat``/``ibstatus`` (infiniband-diags): per CA and port ``State``,
  ``Physical state``, ``Rate`` (Gb/s), ``Link layer`` (``Ethernet`` means RoCE).
* ``perfquery`` (infiniband-diags man page): ``# Port counters: Lid L port P
  (CapMask: ...)`` or ``# Port extended counters: ...`` (the header may wrap onto
  a second line), then ``Name:.....value`` lines. ``PortXmitData``/``PortRcvData``
  count 4-octet words (multiplied by 4 here).
* ``ibqueryerrors`` (man page): ``GUID 0x... port N|ALL: [Counter == value
  (pretty)] ...``, with ``-c``/``-s`` variants.
* The IBA PortCounters attribute (and ``Documentation/ABI/stable/sysfs-class-infiniband``,
  ecosystem-reference §10.2): legacy error counters are 4, 8 or 16 bits wide and
  stop at all-ones; a value at that maximum is recorded as an
  ``ib_counter_saturated`` event beside its sample.
* ``ethtool -S`` of mlx5 (kernel ``Documentation/networking/device_drivers/ethernet/
  mellanox/mlx5/counters.rst``): ``rx_prioN_bytes``/``packets``/``pause``; other
  non-queue counters go to ``net_nic_counter_total``.
* RDMA ``hw_counters`` (mlx5 counters doc): ``<path>:<value>`` lines as printed by
  ``grep ""``; the device and port come from the path, ``lifespan`` is skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.textparse import Session, line_evidence
from core.records import EntityId, Event, Evidence, NodeName, Record, Sample

logger = logging.getLogger(__name__)

PMA_COUNTERS: dict[str, tuple[str, int]] = {
    "SymbolErrorCounter": ("ib_symbol_errors_total", 16),
    "LinkErrorRecoveryCounter": ("ib_link_error_recovery_total", 8),
    "LinkDownedCounter": ("ib_link_downed_total", 8),
    "PortRcvErrors": ("ib_port_rcv_errors_total", 16),
    "PortRcvRemotePhysicalErrors": ("ib_port_rcv_remote_physical_errors_total", 16),
    "PortRcvSwitchRelayErrors": ("ib_port_rcv_switch_relay_errors_total", 16),
    "PortXmitDiscards": ("ib_port_xmit_discards_total", 16),
    "PortXmitConstraintErrors": ("ib_port_xmit_constraint_errors_total", 8),
    "PortRcvConstraintErrors": ("ib_port_rcv_constraint_errors_total", 8),
    "LocalLinkIntegrityErrors": ("ib_local_link_integrity_errors_total", 4),
    "ExcessiveBufferOverrunErrors": ("ib_excessive_buffer_overrun_errors_total", 4),
    "VL15Dropped": ("ib_vl15_dropped_total", 16),
    "PortXmitWait": ("ib_port_xmit_wait_total", 32),
    "PortXmitData": ("ib_port_xmit_bytes_total", 32),
    "PortRcvData": ("ib_port_rcv_bytes_total", 32),
    "PortXmitPkts": ("ib_port_xmit_packets_total", 32),
    "PortRcvPkts": ("ib_port_rcv_packets_total", 32),
}
"""IBA PortCounters field name to (catalog metric, legacy bit width)."""

PMA_ALIASES: dict[str, str] = {
    "SymbolErrors": "SymbolErrorCounter",
    "LinkRecovers": "LinkErrorRecoveryCounter",
    "LinkDowned": "LinkDownedCounter",
    "RcvErrors": "PortRcvErrors",
    "RcvRemotePhysErrors": "PortRcvRemotePhysicalErrors",
    "RcvSwRelayErrors": "PortRcvSwitchRelayErrors",
    "XmtDiscards": "PortXmitDiscards",
    "XmtConstraintErrors": "PortXmitConstraintErrors",
    "RcvConstraintErrors": "PortRcvConstraintErrors",
    "LinkIntegrityErrors": "LocalLinkIntegrityErrors",
    "ExcBufOverrunErrors": "ExcessiveBufferOverrunErrors",
    "XmtWait": "PortXmitWait",
    "XmtData": "PortXmitData",
    "RcvData": "PortRcvData",
    "XmtPkts": "PortXmitPkts",
    "RcvPkts": "PortRcvPkts",
    "PortXmitPackets": "PortXmitPkts",
    "PortRcvPackets": "PortRcvPkts",
}
"""Short names (ibqueryerrors ``-s`` lists, old ibcheckerrors) to PortCounters names."""

SYSFS_COUNTERS: dict[str, str] = {
    "symbol_error": "SymbolErrorCounter",
    "link_error_recovery": "LinkErrorRecoveryCounter",
    "link_downed": "LinkDownedCounter",
    "port_rcv_errors": "PortRcvErrors",
    "port_rcv_remote_physical_errors": "PortRcvRemotePhysicalErrors",
    "port_rcv_switch_relay_errors": "PortRcvSwitchRelayErrors",
    "port_xmit_discards": "PortXmitDiscards",
    "port_xmit_constraint_errors": "PortXmitConstraintErrors",
    "port_rcv_constraint_errors": "PortRcvConstraintErrors",
    "port_rcv_contraint_errors": "PortRcvConstraintErrors",
    "local_link_integrity_errors": "LocalLinkIntegrityErrors",
    "excessive_buffer_overrun_errors": "ExcessiveBufferOverrunErrors",
    "VL15_dropped": "VL15Dropped",
    "port_xmit_wait": "PortXmitWait",
    "port_xmit_data": "PortXmitData",
    "port_rcv_data": "PortRcvData",
    "port_xmit_packets": "PortXmitPkts",
    "port_rcv_packets": "PortRcvPkts",
}
"""``/sys/class/infiniband/<dev>/ports/<n>/counters/`` file to PortCounters name
(sysfs-class-infiniband ABI; the ABI text misspells ``port_rcv_contraint_errors``)."""

ERROR_COUNTERS = frozenset(
    name
    for name in PMA_COUNTERS
    if name not in {"PortXmitWait", "PortXmitData", "PortRcvData", "PortXmitPkts", "PortRcvPkts"}
)
"""PortCounters fields that count errors (their legacy widths are 4-16 bits)."""

PORT_STATES: dict[str, tuple[str, int]] = {
    "down": ("down", 1),
    "init": ("init", 2),
    "initializing": ("init", 2),
    "initialize": ("init", 2),
    "armed": ("armed", 3),
    "active": ("active", 4),
    "active_defer": ("active_defer", 5),
    "activedefer": ("active_defer", 5),
}
"""Logical port state spellings (ibstat, ibstatus, sysfs) to (code, IBA value)."""

PHYS_STATES: dict[str, int] = {
    "sleep": 1,
    "polling": 2,
    "disabled": 3,
    "portconfigurationtraining": 4,
    "linkup": 5,
    "linkerrorrecovery": 6,
    "phytest": 7,
}
"""Physical port state names to IBA PortPhysicalState values."""


def port_entity(device: str, port: str | int) -> EntityId:
    """Return the entity of an HCA port (``mlx5_0:1``) or a GUID port (``0x...:ALL``).

    Examples:
        >>> port_entity("mlx5_0", 1)
        'mlx5_0:1'
    """
    return EntityId(f"{device}:{port}")


def _port_sample(
    node: NodeName, metric: str, value: float, device: str, port: str, evidence: Evidence | None
) -> Sample:
    """Return one reading of an IB port (state, physical state, rate), labelled device and port."""
    return Sample(
        metric=metric,
        value=value,
        observed_at=None,
        node=node,
        entity=port_entity(device, port),
        labels={"device": device, "port": port},
        evidence=evidence,
    )


def _state_word(text: str) -> str:
    """Normalise ``4: ACTIVE``, ``PORT_ACTIVE (4)``, ``LINK_UP (5)``, ``Active`` to one word.

    Examples:
        >>> _state_word("PORT_ACTIVE (4)"), _state_word("5: LinkUp"), _state_word("LINK_UP (5)")
        ('active', 'linkup', 'linkup')
    """
    word = re.sub(r"^\s*\d+\s*:\s*|\s*\(\d+\)\s*$", "", text).strip().lower()
    word = word.removeprefix("port_")
    return word.replace(" ", "").replace("_", "")


def parse_port_state(text: str) -> tuple[str, int] | None:
    """Return ``(code, value)`` for a logical state written by ibstat, ibstatus or sysfs.

    Examples:
        >>> parse_port_state("4: ACTIVE")
        ('active', 4)
        >>> parse_port_state("Initializing")
        ('init', 2)
        >>> parse_port_state("bogus") is None
        True
    """
    return PORT_STATES.get(_state_word(text))


def parse_phys_state(text: str) -> tuple[str, int] | None:
    """Return ``(name, value)`` for a physical state (``Polling``, ``5: LinkUp``).

    Examples:
        >>> parse_phys_state("5: LinkUp")
        ('linkup', 5)
    """
    word = _state_word(text)
    value = PHYS_STATES.get(word)
    return None if value is None else (word, value)


def parse_rate_bits(text: str) -> float | None:
    """Return a port rate in bits per second from ``400``, ``100 Gb/sec (4X EDR)``.

    Examples:
        >>> parse_rate_bits("100 Gb/sec (4X EDR)")
        100000000000.0
        >>> parse_rate_bits("2.5")
        2500000000.0
    """
    match = re.match(r"\s*(\d+(?:\.\d+)?)", text)
    return float(match.group(1)) * 1e9 if match else None


def counter_samples(
    *,
    name: str,
    value: int,
    node: NodeName,
    device: str,
    port: str,
    evidence: Evidence | None,
    observed_at: float | None,
    legacy: bool,
    source: str,
) -> list[Record]:
    """Return the sample of one PortCounters field, plus a saturation event if pinned.

    Args:
        name: PortCounters field name (``LinkDownedCounter``); unknown names give nothing.
        value: Raw counter value (4-octet words for data counters).
        node: Node of the port.
        device: HCA name or port GUID.
        port: Port number or ``ALL``.
        evidence: Raw line the value was read from.
        observed_at: Epoch seconds or ``None``.
        legacy: True when every field is the 32-bit-or-narrower PortCounters
            layout (``perfquery`` without ``-x``); error counters are always
            checked at their legacy width.
        source: Source name for the event.
    """
    name = PMA_ALIASES.get(name, name)
    known = PMA_COUNTERS.get(name)
    if known is None:
        return []
    metric, width = known
    entity = port_entity(device, port)
    labels = {"device": device, "port": str(port)}
    scaled = value * 4 if name in {"PortXmitData", "PortRcvData"} else value
    out: list[Record] = [
        Sample(
            metric=metric,
            value=float(scaled),
            observed_at=observed_at,
            node=node,
            entity=entity,
            labels=labels,
            evidence=evidence,
        )
    ]
    if (name in ERROR_COUNTERS or legacy) and value == (1 << width) - 1:
        out.append(
            Event(
                kind="ib_counter_saturated",
                code=name,
                node=node,
                entity=entity,
                observed_at=observed_at,
                message=f"{name} is at its {width}-bit maximum {value}",
                attrs={"width_bits": str(width), "value": str(value), "metric": metric},
                evidence=(evidence,) if evidence else (),
                source=source,
            )
        )
    return out


def _int(text: str) -> int | None:
    text = text.strip()
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return None


_QUOTE = re.compile(r"^\s*>[ \t]?")


def unquote(lines: Sequence[Line]) -> Sequence[Line]:
    """Strip the Markdown quote marks of a pasted block (``> CA 'mlx5_0'``).

    Only when most non-blank lines carry one, so that a ``>`` inside a value is kept.

    Examples:
        >>> [x.text for x in unquote([Line(1, "> CA 'mlx5_0'"), Line(2, ">     Port 1:")])]
        ["CA 'mlx5_0'", '    Port 1:']
    """
    filled = [line for line in lines if line.text.strip()]
    quoted = sum(1 for line in filled if _QUOTE.match(line.text))
    if not filled or quoted * 2 < len(filled):
        return lines
    return [Line(line.number, _QUOTE.sub("", line.text, count=1)) for line in lines]


# --- ibstat / ibstatus -----------------------------------------------------------

_CA = re.compile(r"^\s*CA '(?P<ca>[^']+)'\s*$")
_IBSTAT_PORT = re.compile(r"^\s*Port (?P<port>\d+):\s*$")
_IBSTATUS_PORT = re.compile(r"^\s*Infiniband device '(?P<ca>[^']+)' port (?P<port>\d+) status:\s*$")
# ibv_devinfo: "hca_id:\tmlx5_0" then "\t\tport:\t1" and "state: PORT_ACTIVE (4)".
_HCA_ID = re.compile(r"^\s*hca_id:\s*(?P<ca>\S+)\s*$")
_DEVINFO_PORT = re.compile(r"^\s*port:\s*(?P<port>\d+)\s*$")
_KEYVAL = re.compile(r"^\s*(?P<key>[A-Za-z][\w /]*?):\s*(?P<value>.*?)\s*$")


@dataclass(slots=True)
class _Port:
    device: str
    port: str
    fields: dict[str, str] = field(default_factory=dict)
    evidence: list[Evidence] = field(default_factory=list)


class IbstatSession(Session):
    """Parse ``ibstat`` or ``ibstatus`` output: one record set per port."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._ca: str | None = None
        self._ca_ev: Evidence | None = None
        self._port: _Port | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; records of a port are returned when the port ends."""
        lines = unquote(lines)
        out: list[Record] = []
        for line in lines:
            text = line.text
            ca = _CA.match(text) or _HCA_ID.match(text)
            if ca:
                self._finish(out)
                self._ca, self._ca_ev = ca["ca"], line_evidence(self.ctx, line)
                continue
            status = _IBSTATUS_PORT.match(text)
            if status:
                self._finish(out)
                self._ca, self._ca_ev = status["ca"], None
                self._port = _Port(device=status["ca"], port=status["port"])
                self._port.evidence.append(line_evidence(self.ctx, line))
                continue
            port = _IBSTAT_PORT.match(text) or _DEVINFO_PORT.match(text)
            if port:
                self._finish(out)
                if self._ca is None:
                    self.issue(line.number, "ibstat port before any CA line")
                    continue
                self._port = _Port(device=self._ca, port=port["port"])
                if self._ca_ev:
                    self._port.evidence.append(self._ca_ev)
                self._port.evidence.append(line_evidence(self.ctx, line))
                continue
            kv = _KEYVAL.match(text)
            if kv and self._port is not None:
                key = kv["key"].strip().lower().replace("_", " ")
                self._port.fields[key] = kv["value"]
                if key in {"state", "physical state", "phys state", "rate", "link layer"}:
                    self._port.evidence.append(line_evidence(self.ctx, line))
                continue
            if kv or not text.strip():
                continue  # CA-level fields (CA type, Firmware version...)
            self.issue(line.number, f"unexpected ibstat line: {text.strip()[:80]!r}")
        return out

    def close(self) -> list[Record]:
        """Return the records of the last port."""
        out: list[Record] = []
        self._finish(out)
        return out

    def _finish(self, out: list[Record]) -> None:
        port, self._port = self._port, None
        if port is None:
            return
        node = self.ctx.node
        entity = port_entity(port.device, port.port)
        state_text = port.fields.get("state")
        phys_text = port.fields.get("physical state") or port.fields.get("phys state")
        rate_text = port.fields.get("rate")
        link_layer = port.fields.get("link layer", "")
        state = parse_port_state(state_text) if state_text else None
        phys = parse_phys_state(phys_text) if phys_text else None
        rate = parse_rate_bits(rate_text) if rate_text else None
        ev = port.evidence[-1] if port.evidence else None
        for metric, value in (
            ("ib_port_state", float(state[1]) if state is not None else None),
            ("ib_port_physical_state", float(phys[1]) if phys is not None else None),
            ("ib_port_rate_bits_per_second", rate),
        ):
            if value is not None:
                out.append(_port_sample(node, metric, value, port.device, port.port, ev))
        if state is None:
            self.issue(
                ev.line if ev else None, f"port {entity}: no readable State ({state_text!r})"
            )
            return
        attrs = {"device": port.device, "port": port.port, "state": state[0]}
        if phys is not None:
            attrs["phys_state"] = phys[0]
        if rate is not None:
            attrs["rate_bits_per_second"] = f"{rate:g}"
        if link_layer:
            attrs["link_layer"] = link_layer.lower()
        out.append(
            Event(
                kind="ib_port_state",
                code=state[0],
                node=node,
                entity=entity,
                observed_at=None,
                message=f"{entity} state {state_text}, physical state {phys_text or '?'}",
                attrs=attrs,
                evidence=tuple(port.evidence),
                source="ibstat",
            )
        )


class IbstatParser:
    """``ibstat`` (and ``ibstatus``) output."""

    kind = "ibstat"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 when CA/port headers and ``State:`` lines are present."""
        lines = unquote(lines)
        del command
        heads = states = 0
        for line in lines[:400]:
            text = line.text
            if (
                _CA.match(text)
                or _IBSTATUS_PORT.match(text)
                or _IBSTAT_PORT.match(text)
                or _HCA_ID.match(text)
            ):
                heads += 1
            elif re.match(r"^\s*(?:State|Physical state|state|phys[ _]state):", text):
                states += 1
        if heads and states:
            return 90
        return 30 if heads else 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return IbstatSession(ctx)


# --- perfquery ---------------------------------------------------------------------

_PQ_HEADER = re.compile(
    r"^#\s*Port (?P<ext>extended )?counters:\s*Lid (?P<lid>\d+) port (?P<port>\d+)", re.IGNORECASE
)
_PQ_FIELD = re.compile(r"^(?P<name>[A-Za-z][\w]*):\.*\s*(?P<value>\S+)\s*$")
_PQ_WRAP = re.compile(r"^\s*(?:0x[0-9a-fA-F]+\s*)?\)\s*$")
_PQ_CMD = re.compile(r"-C\s+(?P<ca>\S+)|-P\s+(?P<port>\d+)")


class PerfquerySession(Session):
    """Parse ``perfquery`` (legacy or ``-x`` extended) output."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._device: str | None = None
        self._port: str | None = None
        self._legacy = True
        self._cmd_ca, self._cmd_port = self._from_command(ctx.command)

    @staticmethod
    def _from_command(command: str | None) -> tuple[str | None, str | None]:
        ca = port = None
        for m in _PQ_CMD.finditer(command or ""):
            ca = m["ca"] or ca
            port = m["port"] or port
        return ca, port

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each counter line gives its sample at once."""
        lines = unquote(lines)
        out: list[Record] = []
        for line in lines:
            text = line.text.strip()
            header = _PQ_HEADER.match(text)
            if header:
                self._legacy = header["ext"] is None
                self._device = self._cmd_ca or f"lid-{header['lid']}"
                self._port = self._cmd_port or header["port"]
                continue
            if _PQ_WRAP.match(text) or text.startswith("#") or not text:
                continue
            m = _PQ_FIELD.match(text)
            if m is None:
                self.issue(line.number, f"not a perfquery line: {text[:80]!r}")
                continue
            name = m["name"]
            value = _int(m["value"])
            if value is None:
                self.issue(line.number, f"{name}: not a number")
                continue
            if name == "PortSelect" and self._port is None:
                self._port = str(value)
                continue
            if name not in PMA_COUNTERS:
                continue
            device = self._device or self._cmd_ca or "unknown"
            port = self._port or self._cmd_port or "ALL"
            out.extend(
                counter_samples(
                    name=name,
                    value=value,
                    node=self.ctx.node,
                    device=device,
                    port="ALL" if port == "255" else port,
                    evidence=line_evidence(self.ctx, line),
                    observed_at=None,
                    legacy=self._legacy,
                    source="perfquery",
                )
            )
        return out


class PerfqueryParser:
    """``perfquery`` output (dotted ``Name:....value`` lines)."""

    kind = "perfquery"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 95 on the ``# Port counters`` header, 70 for mostly dotted PMA lines."""
        lines = unquote(lines)
        sample = lines[:200]
        if any(_PQ_HEADER.match(line.text.strip()) for line in sample[:5]):
            return 95
        dotted = sum(
            1
            for line in sample
            if (m := _PQ_FIELD.match(line.text.strip()))
            and ":.." in line.text
            and (m["name"] in PMA_COUNTERS or m["name"].startswith(("Port", "Counter")))
        )
        if dotted and dotted * 2 >= len(sample):
            return 70 if not command or "perfquery" in command else 60
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return PerfquerySession(ctx)


# --- ibqueryerrors -------------------------------------------------------------------

_IQE_PORT = re.compile(r"^\s*GUID (?P<guid>0x[0-9a-fA-F]+) port (?P<port>\d+|ALL):\s*(?P<rest>.*)$")
_IQE_COUNTER = re.compile(r"\[(?P<name>\w+) == (?P<value>\d+)(?:\s*\([^)]*\))?\]")
_IQE_ERRORS_FOR = re.compile(r'^\s*Errors for (?P<guid>0x[0-9a-fA-F]+)\s*"(?P<desc>[^"]*)"')
_IQE_OK = re.compile(
    r"^\s*(?:#|(?:Summary|Suppressing|Link info|Errors for|\d+ (?:nodes|ports)|"
    r"Node|Switch|CA|Router)\b)",
    re.IGNORECASE,
)


class IbqueryerrorsSession(Session):
    """Parse ``ibqueryerrors`` port lines."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._desc: dict[str, str] = {}

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each port line gives its samples at once."""
        lines = unquote(lines)
        out: list[Record] = []
        for line in lines:
            text = line.text
            errors_for = _IQE_ERRORS_FOR.match(text)
            if errors_for:
                self._desc[errors_for["guid"].lower()] = errors_for["desc"]
                continue
            m = _IQE_PORT.match(text)
            if m is None:
                if text.strip() and not _IQE_OK.match(text):
                    self.issue(line.number, f"not an ibqueryerrors line: {text.strip()[:80]!r}")
                continue
            counters = list(_IQE_COUNTER.finditer(m["rest"]))
            if not counters and m["rest"].strip():
                self.issue(line.number, "ibqueryerrors port line without counters")
                continue
            guid = m["guid"].lower()
            for c in counters:
                out.extend(
                    counter_samples(
                        name=c["name"],
                        value=int(c["value"]),
                        node=self.ctx.node,
                        device=guid,
                        port=m["port"],
                        evidence=line_evidence(self.ctx, line),
                        observed_at=None,
                        legacy=False,
                        source="ibqueryerrors",
                    )
                )
        return out


class IbqueryerrorsParser:
    """``ibqueryerrors`` output."""

    kind = "ibqueryerrors"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 when ``GUID 0x... port N: [Counter == value]`` lines are present."""
        lines = unquote(lines)
        del command
        for line in lines[:200]:
            m = _IQE_PORT.match(line.text)
            if m and (_IQE_COUNTER.search(m["rest"]) or not m["rest"].strip()):
                return 90
            if _IQE_ERRORS_FOR.match(line.text):
                return 60
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return IbqueryerrorsSession(ctx)


# --- ethtool -S ------------------------------------------------------------------------

_ETH_LINE = re.compile(r"^\s*(?P<name>[A-Za-z0-9_.\-\[\]]+):\s*(?P<value>-?\d+)\s*$")
_ETH_PRIO = re.compile(
    # mlx5 "rx_prio3_bytes", "tx_prio3_pause"; bnxt_en "rx_bytes_pri3",
    # "rx_pfc_ena_frames_pri3"; ice "rx_priority_3_xoff" (PFC pause frames).
    r"^(?P<dir>rx|tx)_(?:prio(?P<prio>\d)_(?P<what>bytes|packets|pause)"
    r"|(?P<what2>bytes|packets|pfc_ena_frames)_pri(?P<prio2>\d)"
    r"|priority_(?P<prio3>\d)_xoff)(?:\.nic)?$"
)
_PRIO_METRIC = {
    "bytes": "net_prio_bytes_total",
    "packets": "net_prio_packets_total",
    "pause": "net_prio_pause_frames_total",
    "pfc_ena_frames": "net_prio_pause_frames_total",
}
_ETH_QUEUE = re.compile(r"^(?:(?:rx|tx|ch|ptp|xdp|rq|sq)\d+_|(?:rx|tx)_queue_\d+|queue_\d+)")
_ETH_CMD = re.compile(r"ethtool\s+(?:-S|--statistics)\s+(?:--\S+\s+)*(?P<if>[\w.:@-]+)")
_ETH_TITLE = re.compile(r"^\s*NIC statistics:\s*$")


class EthtoolStatsSession(Session):
    """Parse ``ethtool -S <if>`` output."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        m = _ETH_CMD.search(ctx.command or "")
        self._interface = m["if"] if m else "unknown"

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each counter line gives its sample at once."""
        lines = unquote(lines)
        out: list[Record] = []
        for line in lines:
            if _ETH_TITLE.match(line.text) or not line.text.strip():
                continue
            m = _ETH_LINE.match(line.text)
            if m is None:
                self.issue(line.number, f"not an ethtool -S line: {line.text.strip()[:80]!r}")
                continue
            name, value = m["name"], int(m["value"])
            if value < 0:
                self.issue(line.number, f"{name}: negative counter")
                continue
            record = self._sample(name, value, line_evidence(self.ctx, line))
            if record is not None:
                out.append(record)
        return out

    def _sample(self, name: str, value: int, evidence: Evidence) -> Sample | None:
        iface = self._interface
        prio = _ETH_PRIO.match(name)
        if prio:
            metric = _PRIO_METRIC[prio["what"] or prio["what2"] or "pause"]
            priority = prio["prio"] or prio["prio2"] or prio["prio3"]
            labels = {"interface": iface, "direction": prio["dir"], "priority": priority}
        elif _ETH_QUEUE.match(name):
            return None
        else:
            metric = "net_nic_counter_total"
            labels = {"interface": iface, "counter": name}
        return Sample(
            metric=metric,
            value=float(value),
            observed_at=None,
            node=self.ctx.node,
            entity=EntityId(iface),
            labels=labels,
            evidence=evidence,
        )


class EthtoolStatsParser:
    """``ethtool -S <interface>`` output."""

    kind = "ethtool_stats"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 with the title or the command, 60 for mostly ``rx_/tx_`` counter lines."""
        lines = unquote(lines)
        sample = lines[:200]
        if any(_ETH_TITLE.match(line.text) for line in sample[:3]):
            return 90
        matches = [m for line in sample if (m := _ETH_LINE.match(line.text))]
        if not matches or len(matches) * 10 < len(sample) * 9:
            return 0
        if command and _ETH_CMD.search(command):
            return 90
        nic = sum(1 for m in matches if m["name"].startswith(("rx_", "tx_")))
        return 60 if nic * 2 >= len(matches) else 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return EthtoolStatsSession(ctx)


# --- sysfs dumps (grep "" /sys/class/infiniband/...) --------------------------------------

_SYSFS_IB = re.compile(
    # /sys/class/infiniband/... or the device path /sys/devices/pci.../infiniband/...
    r"^/sys/(?:class|devices/\S*?)/infiniband/(?P<dev>[^/\s]+)/(?:ports/(?P<port>\d+)/)?"
    r"(?:(?P<dir>hw_counters|counters)/)?(?P<name>[\w.-]+):(?P<value>.*)$"
)
_SYSFS_NET = re.compile(
    r"^/sys/class/net/(?P<if>[^/\s]+)/(?:statistics/)?(?P<name>[\w.-]+):(?P<value>.*)$"
)
NETDEV_STATS: dict[str, str] = {
    "rx_bytes": "net_rx_bytes_total",
    "tx_bytes": "net_tx_bytes_total",
    "rx_packets": "net_rx_packets_total",
    "tx_packets": "net_tx_packets_total",
    "rx_errors": "net_rx_errors_total",
    "tx_errors": "net_tx_errors_total",
    "rx_dropped": "net_rx_dropped_total",
    "tx_dropped": "net_tx_dropped_total",
    "carrier_changes": "net_carrier_changes_total",
}
"""``/sys/class/net/<if>/statistics`` file (and ``carrier_changes``) to catalog metric."""


class SysfsDumpSession(Session):
    """Parse ``path:value`` lines of InfiniBand and netdev sysfs files."""

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each line gives its record at once."""
        lines = unquote(lines)
        out: list[Record] = []
        for line in lines:
            ev = line_evidence(self.ctx, line)
            ib = _SYSFS_IB.match(line.text.strip())
            if ib:
                out.extend(self._ib(ib, ev, line))
                continue
            net = _SYSFS_NET.match(line.text.strip())
            if net:
                metric = NETDEV_STATS.get(net["name"])
                value = _int(net["value"])
                if metric and value is not None:
                    out.append(
                        Sample(
                            metric=metric,
                            value=float(value),
                            observed_at=None,
                            node=self.ctx.node,
                            entity=EntityId(net["if"]),
                            labels={"interface": net["if"]},
                            evidence=ev,
                        )
                    )
                continue
            if line.text.strip() and not line.text.lstrip().startswith("#"):
                self.issue(line.number, f"not a sysfs path:value line: {line.text.strip()[:80]!r}")
        return out

    def _ib(self, m: re.Match[str], ev: Evidence, line: Line) -> list[Record]:
        dev, port, folder, name, raw = m["dev"], m["port"], m["dir"], m["name"], m["value"]
        if raw.strip().upper().startswith("N/A"):
            return []  # "N/A (no PMA)": the driver has no PortCounters (iWARP, i40iw, irdma)
        node = self.ctx.node
        if folder == "hw_counters":
            if name == "lifespan":
                return []
            value = _int(raw)
            if value is None:
                self.issue(line.number, f"{name}: not a number")
                return []
            entity = port_entity(dev, port) if port else EntityId(dev)
            return [
                Sample(
                    metric="rdma_hw_counter_total",
                    value=float(value),
                    observed_at=None,
                    node=node,
                    entity=entity,
                    labels={"device": dev, "port": port or "", "counter": name},
                    evidence=ev,
                )
            ]
        if folder == "counters" and port:
            value = _int(raw)
            pma = SYSFS_COUNTERS.get(name)
            if value is None or pma is None:
                if value is None:
                    self.issue(line.number, f"{name}: not a number")
                return []
            return counter_samples(
                name=pma,
                value=value,
                node=node,
                device=dev,
                port=port,
                evidence=ev,
                observed_at=None,
                legacy=False,
                source="sysfs",
            )
        if port and name in {"state", "phys_state", "rate"}:
            return self._port_attr(dev, port, name, raw, ev)
        return []

    def _port_attr(self, dev: str, port: str, name: str, raw: str, ev: Evidence) -> list[Record]:
        node = self.ctx.node
        entity = port_entity(dev, port)
        if name == "rate":
            rate = parse_rate_bits(raw)
            if rate is None:
                return []
            return [_port_sample(node, "ib_port_rate_bits_per_second", rate, dev, port, ev)]
        if name == "phys_state":
            phys = parse_phys_state(raw)
            if phys is None:
                return []
            return [_port_sample(node, "ib_port_physical_state", float(phys[1]), dev, port, ev)]
        state = parse_port_state(raw)
        if state is None:
            return []
        return [
            _port_sample(node, "ib_port_state", float(state[1]), dev, port, ev),
            Event(
                kind="ib_port_state",
                code=state[0],
                node=node,
                entity=entity,
                observed_at=None,
                message=f"{entity} state {raw.strip()}",
                attrs={"device": dev, "port": port, "state": state[0]},
                evidence=(ev,),
                source="sysfs",
            ),
        ]


class SysfsDumpParser:
    """``grep "" /sys/class/infiniband/<dev>/ports/<n>/...`` style dumps."""

    kind = "sysfs_dump"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 when most lines are ``/sys/class/{infiniband,net}/...:value``."""
        lines = unquote(lines)
        del command
        sample = lines[:200]
        hits = sum(
            1
            for line in sample
            if _SYSFS_IB.match(line.text.strip()) or _SYSFS_NET.match(line.text.strip())
        )
        return 90 if hits and hits * 2 >= len(sample) else 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return SysfsDumpSession(ctx)


# --- rdma statistic (iproute2) ------------------------------------------------------------

_RDMA_STAT = re.compile(r"^\s*link (?P<dev>[\w.-]+)/(?P<port>\d+)\s+(?P<rest>\S.*?)\s*$")
# rdma link [show]: "link mlx5_0/1 state ACTIVE physical_state LINK_UP netdev ens7f0np0",
# also "link mlx5_0/1: state ..." and "8/1: mlx5_bond_0/1: state ..." (index first).
_RDMA_LINK = re.compile(
    r"^\s*(?:\d+/\d+:\s*)?(?:link\s+)?(?P<dev>[\w.-]+)/(?P<port>\d+):?\s+state\s+(?P<state>\w+)"
    r"(?:\s+physical_state\s+(?P<phys>\w+))?(?:\s+netdev\s+(?P<netdev>\S+))?"
)
_SECTION_TITLE = re.compile(r"^\s*(?:#.*|=+ .* =+)\s*$")
# ibdev2netdev: "mlx5_0 port 1 ==> ens7f0np0 (Down)": the state is the netdev's
# operstate (IPoIB interfaces are often down while the IB port is Active), so it
# is recorded as evidence of the mapping only, never as a port state.
_IBDEV2NETDEV = re.compile(
    r"^\s*(?P<dev>[\w.-]+) port (?P<port>\d+) ==> (?P<netdev>\S+) \((?P<st>\w+)\)"
)
_RDMA_PAIR = re.compile(r"(?P<name>[A-Za-z_][\w]*)\s+(?P<value>\d+)\b")


class RdmaStatisticSession(Session):
    """Parse ``rdma statistic show [link DEV/PORT]`` (iproute2 ``rdma-statistic(8)``).

    Each line is ``link DEV/PORT name value name value ...``; the names are the
    driver's ``hw_counters`` (mlx5 ``out_of_sequence``, ``local_ack_timeout_err``...)
    and become ``rdma_hw_counter_total`` samples like a sysfs dump.
    """

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each line gives its samples at once."""
        lines = unquote(lines)
        out: list[Record] = []
        for line in lines:
            link = _RDMA_LINK.match(line.text)
            if link:
                out.extend(self._link(link, line))
                continue
            if _IBDEV2NETDEV.match(line.text) or _SECTION_TITLE.match(line.text):
                continue
            m = _RDMA_STAT.match(line.text)
            if m is None:
                if line.text.strip():
                    self.issue(line.number, f"not an rdma statistic line: {line.text[:80]!r}")
                continue
            dev, port = m["dev"], m["port"]
            ev = line_evidence(self.ctx, line)
            for pair in _RDMA_PAIR.finditer(m["rest"]):
                if pair["name"] == "lifespan":
                    continue
                out.append(
                    Sample(
                        metric="rdma_hw_counter_total",
                        value=float(int(pair["value"])),
                        observed_at=None,
                        node=self.ctx.node,
                        entity=port_entity(dev, port),
                        labels={"device": dev, "port": port, "counter": pair["name"]},
                        evidence=ev,
                    )
                )
        return out

    def _link(self, m: re.Match[str], line: Line) -> list[Record]:
        """One ``rdma link`` line: the port's logical and physical state."""
        state = parse_port_state(m["state"])
        if state is None:
            self.issue(line.number, f"rdma link: unknown state {m['state']!r}")
            return []
        dev, port = m["dev"], m["port"]
        entity = port_entity(dev, port)
        ev = line_evidence(self.ctx, line)
        attrs = {"device": dev, "port": port, "state": state[0]}
        phys = parse_phys_state(m["phys"]) if m["phys"] else None
        if phys is not None:
            attrs["phys_state"] = phys[0]
        if m["netdev"]:
            attrs["netdev"] = m["netdev"]
            # IPoIB netdevs are ib*; any other netdev means an Ethernet (RoCE) port.
            attrs["link_layer"] = "infiniband" if m["netdev"].startswith("ib") else "ethernet"
        return [
            _port_sample(self.ctx.node, "ib_port_state", float(state[1]), dev, port, ev),
            Event(
                kind="ib_port_state",
                code=state[0],
                node=self.ctx.node,
                entity=entity,
                observed_at=None,
                message=f"{entity} state {m['state']}",
                attrs=attrs,
                evidence=(ev,),
                source="rdma link",
            ),
        ]


class RdmaStatisticParser:
    """``rdma statistic show`` and ``rdma link`` output (iproute2), ``ibdev2netdev``."""

    kind = "rdma_statistic"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 when most lines are ``rdma statistic``/``rdma link``/ibdev2netdev lines."""
        lines = unquote(lines)
        del command
        sample = lines[:200]
        hits = sum(
            1
            for line in sample
            if ((m := _RDMA_STAT.match(line.text)) and _RDMA_PAIR.search(m["rest"]))
            or _RDMA_LINK.match(line.text)
            or _IBDEV2NETDEV.match(line.text)
        )
        return 90 if hits and hits * 2 >= len(sample) else 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return RdmaStatisticSession(ctx)


# --- ip -s link (iproute2) -----------------------------------------------------------------

_IP_LINK = re.compile(
    r"^\s*\d+:\s+(?P<if>[\w.:-]+)(?:@[\w.-]+)?:\s+<(?P<flags>[^>]*)>.*?"
    r"(?:\bstate (?P<state>[A-Z]+))?(?:\s|$)"
)
_IP_HEADER = re.compile(r"^\s*(?P<dir>RX|TX)(?P<errs> errors)?:\s+(?P<cols>[a-z][a-z_ ]*?)\s*$")
_IP_VALUES = re.compile(r"^\s*\d+(?:\s+\d+)*\s*$")
IP_LINK_COLUMNS: dict[str, str] = {
    "errors": "errors",
    "dropped": "dropped",
    "missed": "missed_errors",
    "overrun": "over_errors",
    "carrier": "carrier_errors",
    "collsns": "collisions",
    "length": "length_errors",
    "crc": "crc_errors",
    "frame": "frame_errors",
    "fifo": "fifo_errors",
    "aborted": "aborted_errors",
    "window": "window_errors",
    "heartbeat": "heartbeat_errors",
    "transns": "carrier_changes",
    "nohandler": "nohandler",
    "otherhost": "otherhost",
}
"""``ip -s [-s] link`` column to the ``rtnl_link_stats64`` field it prints (iproute2
``ipstats``/``iplink``), named as ``net_nic_counter_total`` counters ``rx_<field>``/``tx_<field>``;
bytes, packets and multicast are traffic, not counted here."""


class IpLinkStatsSession(Session):
    """Parse ``ip -s link`` / ``ip -s -s link`` output (one interface block after another)."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._if: str | None = None
        self._cols: tuple[str, list[str]] | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each value line gives its samples at once."""
        lines = unquote(lines)
        out: list[Record] = []
        for line in lines:
            text = line.text
            head = _IP_LINK.match(text)
            if head:
                self._if, self._cols = head["if"], None
                continue
            cols = _IP_HEADER.match(text)
            if cols:
                self._cols = (cols["dir"].lower(), cols["cols"].split())
                continue
            if _IP_VALUES.match(text) and self._cols is not None and self._if is not None:
                direction, names = self._cols
                values = text.split()
                if len(values) != len(names):
                    self.issue(line.number, "ip -s link: column count differs")
                self._cols = None
                for name, value in zip(names, values, strict=False):
                    field_name = IP_LINK_COLUMNS.get(name)
                    if field_name is None:
                        continue
                    counter = f"{direction}_{field_name}"
                    out.append(
                        Sample(
                            metric="net_nic_counter_total",
                            value=float(int(value)),
                            observed_at=None,
                            node=self.ctx.node,
                            entity=EntityId(self._if),
                            labels={"interface": self._if, "counter": counter},
                            evidence=line_evidence(self.ctx, line),
                        )
                    )
        return out


class IpLinkStatsParser:
    """``ip -s link`` output (iproute2)."""

    kind = "ip_link_stats"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 with interface headers and ``RX:``/``TX:`` column lines."""
        lines = unquote(lines)
        del command
        sample = lines[:400]
        heads = sum(1 for line in sample if _IP_LINK.match(line.text))
        cols = sum(1 for line in sample if _IP_HEADER.match(line.text))
        if heads and cols:
            return 90
        return 40 if cols >= 2 else 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return IpLinkStatsSession(ctx)


# --- mlxlink (NVIDIA MFT) ----------------------------------------------------------------------

_MLX_KV = re.compile(r"^\s*(?P<key>[A-Z][\w ./()\[\]-]*?)\s*:\s*(?P<value>.*?)\s*$")
_MLX_TITLE = re.compile(
    r"^\s*(?:Operational Info|Supported Info|Troubleshooting Info|Physical Counters and BER Info|"
    r"Module Info|Test Mode Info|PCIe Operational \(Enabled\) Info)\s*$"
)
_MLX_RULE = re.compile(r"^\s*-{4,}\s*$")
_MLX_CMD = re.compile(r"-d\s+(?P<dev>\S+)|(?:-p|--port)\s+(?P<port>\d+)")
MLXLINK_STATES: dict[str, tuple[str, str]] = {
    "active": ("active", "linkup"),
    "polling": ("down", "polling"),
    "disable": ("down", "disabled"),
    "disabled": ("down", "disabled"),
    "down": ("down", "unknown"),
    "close_port": ("down", "disabled"),
    "sleep": ("down", "sleep"),
    "linkup": ("init", "linkup"),
}
"""mlxlink ``State`` values (PAOS/PDDR) to (port state code, physical state)."""

MLXLINK_COUNTERS: dict[str, str] = {
    "Effective Physical Errors": "SymbolErrorCounter",
    "Link Down Counter": "LinkDownedCounter",
    "Link Error Recovery Counter": "LinkErrorRecoveryCounter",
}
"""mlxlink ``-c`` counters to the PortCounters field with the same meaning (post-FEC symbol
errors, link downs, recoveries); mlxlink reports them 64-bit, never saturated."""


class MlxlinkSession(Session):
    """Parse ``mlxlink -d DEV [-p N] [-m] [-c]`` text output."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        dev = port = None
        for m in _MLX_CMD.finditer(ctx.command or ""):
            dev = m["dev"] or dev
            port = m["port"] or port
        self._device = (dev or "unknown").rsplit("/", 1)[-1]
        self._port = port or "1"
        self._fields: dict[str, tuple[str, Line]] = {}

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Collect ``Key : value`` fields; records come at :meth:`close`."""
        lines = unquote(lines)
        for line in lines:
            text = line.text
            if _MLX_TITLE.match(text) or _MLX_RULE.match(text) or not text.strip():
                continue
            m = _MLX_KV.match(text)
            if m:
                self._fields.setdefault(m["key"].strip(), (m["value"], line))
        return []

    def close(self) -> list[Record]:
        """Return the port state event and the counters of the section."""
        out: list[Record] = []
        node = self.ctx.node
        entity = port_entity(self._device, self._port)
        labels = {"device": self._device, "port": self._port}
        state = self._fields.get("State")
        opcode = self._fields.get("Status Opcode")
        advice = self._fields.get("Recommendation")
        if state is not None:
            word = state[0].strip().lower().replace(" ", "_")
            code, phys = MLXLINK_STATES.get(word, ("unknown", "unknown"))
            evidence = [line_evidence(self.ctx, state[1])]
            attrs = {"device": self._device, "port": self._port, "state": code}
            attrs["phys_state"] = phys
            physical = self._fields.get("Physical state")
            if physical is not None:
                attrs["mlxlink_physical_state"] = physical[0]
            if opcode is not None:
                attrs["status_opcode"] = opcode[0]
                evidence.append(line_evidence(self.ctx, opcode[1]))
            if advice is not None:
                attrs["recommendation"] = advice[0]
                evidence.append(line_evidence(self.ctx, advice[1]))
            if code != "unknown":
                out.append(
                    Event(
                        kind="ib_port_state",
                        code=code,
                        node=node,
                        entity=entity,
                        observed_at=None,
                        message=f"{entity} mlxlink state {state[0]}",
                        attrs=attrs,
                        evidence=tuple(evidence),
                        source="mlxlink",
                    )
                )
            else:
                self.issue(state[1].number, f"mlxlink: unknown State {state[0]!r}")
        for name, pma in MLXLINK_COUNTERS.items():
            found = self._fields.get(name)
            if found is None:
                continue
            value = _int(found[0])
            if value is None:
                continue
            out.extend(
                counter_samples(
                    name=pma,
                    value=value,
                    node=node,
                    device=self._device,
                    port=self._port,
                    evidence=line_evidence(self.ctx, found[1]),
                    observed_at=None,
                    legacy=False,
                    source="mlxlink",
                )[:1]
            )
        del labels
        self._fields.clear()
        return out


class MlxlinkParser:
    """``mlxlink`` text output (NVIDIA Firmware Tools)."""

    kind = "mlxlink"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 95 on mlxlink section titles, 80 with the command."""
        lines = unquote(lines)
        sample = lines[:100]
        if any(_MLX_TITLE.match(line.text) for line in sample[:3]):
            return 95
        if command and "mlxlink" in command and any(_MLX_KV.match(x.text) for x in sample):
            return 80
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return MlxlinkSession(ctx)


# --- ibdiagnet (ibutils2) ---------------------------------------------------------------------

_IBD_HEADER = re.compile(r"^\s*-I-\s+Stage\s+Warnings\s+Errors\b")
_IBD_STAGE = re.compile(
    r"^\s*-I-\s+(?P<stage>[A-Za-z][A-Za-z0-9 /&_.-]*?)\s+(?P<w>\d+)\s+(?P<e>\d+)"
    r"(?:\s+(?P<c>.*?))?\s*$"
)
_IBD_LINE = re.compile(r"^\s*-[IWE]-\s")
_IBD_FABRIC_KEY = re.compile(
    r"^\s*(?:Total Nodes|IB Switches|IB Channel Adapters|IB Aggregation Nodes|IB Routers)\s*:\s*\d+"
)
_IBD_TITLE = re.compile(r"^\s*(?:Fabric Summary|Summary|-{10,})\s*$")


class IbdiagnetSession(Session):
    """Parse the summary table ibdiagnet prints at the end of a run.

    ``-I- Stage  Warnings  Errors  Comment`` then one ``-I- <stage> W E [comment]``
    row per stage (Discovery, Lids Check, Links Check, Subnet Manager, Port
    Counters, Nodes Information, Speed / Width checks, Partition Keys, Alias
    GUIDs, Temperature Sensing, Routing...). Each row becomes an ``ibdiagnet_stage``
    event; the details are in ``ibdiagnet2.log``, which the summary points to.
    """

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._in_table = False

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each stage row gives its event at once."""
        lines = unquote(lines)
        out: list[Record] = []
        for line in lines:
            text = line.text
            if _IBD_HEADER.match(text):
                self._in_table = True
                continue
            row = _IBD_STAGE.match(text) if self._in_table else None
            if row is None:
                continue
            stage = " ".join(row["stage"].split())
            out.append(
                Event(
                    kind="ibdiagnet_stage",
                    code=stage.lower().replace(" / ", "_").replace(" ", "_"),
                    node=self.ctx.node,
                    entity=EntityId("fabric"),
                    observed_at=None,
                    message=text.strip(),
                    attrs={
                        "stage": stage,
                        "warnings": row["w"],
                        "errors": row["e"],
                        "comment": (row["c"] or "").strip(),
                    },
                    evidence=(line_evidence(self.ctx, line),),
                    source="ibdiagnet",
                )
            )
        return out


class IbdiagnetParser:
    """``ibdiagnet`` console output (summary table)."""

    kind = "ibdiagnet"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 95 on the stage table header, 70 for mostly ``-I-/-W-/-E-`` lines."""
        lines = unquote(lines)
        sample = lines[:200]
        if any(_IBD_HEADER.match(line.text) for line in sample):
            return 95
        tagged = sum(1 for line in sample if _IBD_LINE.match(line.text))
        if tagged and tagged * 2 >= len(sample):
            return 70
        if command and "ibdiagnet" in command:
            return 60
        if any(_IBD_FABRIC_KEY.match(line.text) for line in sample[:3]):
            return 60
        if all(_IBD_TITLE.match(line.text) for line in sample):
            return 30
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return IbdiagnetSession(ctx)


PARSERS: tuple[ArtifactParser, ...] = (
    IbstatParser(),
    PerfqueryParser(),
    IbqueryerrorsParser(),
    EthtoolStatsParser(),
    SysfsDumpParser(),
    RdmaStatisticParser(),
    IpLinkStatsParser(),
    MlxlinkParser(),
    IbdiagnetParser(),
)
"""The artifact parsers of this module (read by ``collectors.parsers``)."""
