"""``lspci -vv`` as a tree: the links between NVIDIA GPUs and the bridges above them.

The flat ``lspci`` parser (:class:`collectors.nvidia_smi.LspciParser`) reads each GPU's own
``LnkCap``/``LnkSta``; this one runs it unchanged and adds, once the section is complete,
one ``pcie_link`` event per PCIe link on the path from each NVIDIA GPU to its root port.

A PCIe link has two ends: a downstream-facing port (a root port or a switch downstream
port, the bridge whose ``Bus: ... secondary=`` is the device's bus) and the device below
it (an endpoint such as the GPU, or a switch upstream port). Each end's ``LnkCap`` is what
it can do, its ``LnkSta`` what the link trained to (PCI Express Base Specification, Link
Capabilities and Link Status registers, as ``lspci`` prints them). The link can do no more
than the lesser end, so the event carries both ends' capability and the trained status:

* ``code``: ``gpu`` for the GPU's own link, ``path`` for a link above it;
* attrs ``port``/``device`` (bus ids), ``gpus`` (the GPUs below), ``cap_width``/
  ``cap_speed`` (the lesser end's capability, lanes and GT/s), ``sta_width``/``sta_speed``
  (trained), ``port_cap_width``, ``device_cap_width``, ``port_cap_speed``,
  ``device_cap_speed``.

A switch's internal bus (upstream port to its downstream ports) is not a link and gives no
event.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.nvidia_smi import LspciParser
from collectors.textparse import Session, line_evidence
from core.ids import normalize_pci_bus_id
from core.records import EntityId, Event, Evidence, Record

_DEV = re.compile(
    r"^(?P<addr>(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+(?P<cls>[^:]+):\s*"
    r"(?P<desc>.*)$"
)
_BUS = re.compile(r"^\s+Bus: primary=(?P<p>[0-9a-fA-F]+), secondary=(?P<s>[0-9a-fA-F]+), "
                  r"subordinate=(?P<sub>[0-9a-fA-F]+)")
_EXPRESS = re.compile(r"^\s+Capabilities: \[[0-9a-f]+\] Express \([^)]*\) (?P<type>[A-Za-z ]+?)"
                      r"(?: \(Slot[+-]\))?, ")
_LNK = re.compile(
    r"^\s*Lnk(?P<which>Cap|Sta):.*?Speed\s+(?P<speed>[\d.]+)GT/s[^,]*,\s*Width\s+x(?P<width>\d+)"
)
_DOWNSTREAM_TYPES = ("Root Port", "Downstream Port")


@dataclass(slots=True)
class _Device:
    addr: str
    domain: str
    bus: int
    gpu: bool
    bridge: bool
    port_type: str = ""
    secondary: int | None = None
    subordinate: int | None = None
    cap: tuple[float, int] | None = None
    sta: tuple[float, int] | None = None
    evidence: list[Evidence] = field(default_factory=list)


class LspciTreeSession(Session):
    """Run the flat ``lspci`` session and collect the tree for :meth:`close`."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._flat = LspciParser().open(ctx)
        self._devices: list[_Device] = []
        self._current: _Device | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; the GPU samples come at once, the link events at close."""
        out = list(self._flat.feed(lines))
        self.issues.extend(self._flat.issues)
        self._flat.issues.clear()
        for line in lines:
            self._line(line)
        return out

    def _line(self, line: Line) -> None:
        text = line.text
        dev = _DEV.match(text)
        if dev is not None:
            addr = dev["addr"] if dev["addr"].count(":") == 2 else "0000:" + dev["addr"]
            canonical = normalize_pci_bus_id(addr) or addr.lower()
            cls, desc = dev["cls"].lower(), dev["desc"].lower()
            nvidia = "nvidia" in desc or "[10de:" in desc
            gpu = nvidia and any(
                w in cls for w in ("3d controller", "vga compatible", "display controller")
            )
            domain, bus = canonical.split(":")[0], int(canonical.split(":")[1], 16)
            self._current = _Device(addr=canonical, domain=domain, bus=bus, gpu=gpu,
                                    bridge="bridge" in cls)
            self._devices.append(self._current)
            return
        cur = self._current
        if cur is None:
            return
        bridge_bus = _BUS.match(text)
        if bridge_bus is not None:
            cur.secondary = int(bridge_bus["s"], 16)
            cur.subordinate = int(bridge_bus["sub"], 16)
            return
        express = _EXPRESS.match(text)
        if express is not None:
            cur.port_type = express["type"].strip()
            return
        lnk = _LNK.match(text)
        if lnk is not None:
            value = (float(lnk["speed"]), int(lnk["width"]))
            if lnk["which"] == "Cap":
                cur.cap = value
            else:
                cur.sta = value
            cur.evidence.append(line_evidence(self.ctx, line))

    def close(self) -> list[Record]:
        """Return the flat session's last records and one ``pcie_link`` event per link."""
        out = list(self._flat.close())
        self.issues.extend(self._flat.issues)
        ports = {
            (d.domain, d.secondary): d
            for d in self._devices
            if d.bridge and d.secondary is not None
        }
        seen: set[tuple[str, str]] = set()
        for gpu in (d for d in self._devices if d.gpu):
            device: _Device | None = gpu
            below = [gpu.addr]
            while device is not None:
                port = ports.get((device.domain, device.bus))
                if port is None or port is device:
                    break
                internal = device.port_type == "Downstream Port" and not device.gpu
                if not internal and (port.addr, device.addr) not in seen:
                    seen.add((port.addr, device.addr))
                    event = self._link_event(port, device, gpu, below)
                    if event is not None:
                        out.append(event)
                device = port
        return out

    def _link_event(
        self, port: _Device, device: _Device, gpu: _Device, below: list[str]
    ) -> Event | None:
        if port.cap is None or device.cap is None or (port.sta is None and device.sta is None):
            return None
        stas = [s for s in (device.sta, port.sta) if s is not None]
        sta_speed = min(s[0] for s in stas)
        sta_width = min(s[1] for s in stas)
        cap_speed = min(port.cap[0], device.cap[0])
        cap_width = min(port.cap[1], device.cap[1])
        attrs = {
            "port": port.addr,
            "device": device.addr,
            "gpus": ",".join(below),
            "port_type": port.port_type,
            "device_type": device.port_type,
            "cap_width": str(cap_width),
            "cap_speed": f"{cap_speed:g}",
            "sta_width": str(sta_width),
            "sta_speed": f"{sta_speed:g}",
            "port_cap_width": str(port.cap[1]),
            "device_cap_width": str(device.cap[1]),
            "port_cap_speed": f"{port.cap[0]:g}",
            "device_cap_speed": f"{device.cap[0]:g}",
        }
        return Event(
            kind="pcie_link",
            code="gpu" if device is gpu else "path",
            node=self.ctx.node,
            entity=EntityId(device.addr),
            observed_at=None,
            message=(
                f"link {port.addr} -> {device.addr}: trained {sta_speed:g} GT/s x{sta_width}, "
                f"ends capable of {port.cap[0]:g} GT/s x{port.cap[1]} and "
                f"{device.cap[0]:g} GT/s x{device.cap[1]}"
            ),
            attrs=attrs,
            evidence=tuple((port.evidence + device.evidence)[:8]),
            source="lspci",
        )


class LspciTreeParser:
    """``lspci -vv``: the flat GPU link samples plus the links above each GPU."""

    kind = "lspci_tree"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """One above the flat ``lspci`` parser's score, so that this one reads the section."""
        score = LspciParser().detect(lines, command)
        return min(100, score + 1) if score else 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return LspciTreeSession(ctx)


PARSERS: tuple[ArtifactParser, ...] = (LspciTreeParser(),)
"""The artifact parsers of this module (read by ``collectors.parsers``)."""

__all__ = ["PARSERS", "LspciTreeParser"]
