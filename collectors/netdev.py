"""Artifact parsers for Linux netdev counters: ``ifconfig``, ``/proc/net/dev`` and sysfs stats.

Each gives the samples the live :class:`collectors.network.NetworkCollector` gives for the same
interface, so that one rule judges both (``analytics.fault_model.network.netdev_counter_rule``):
``rx_bytes``, ``rx_packets``, ``rx_errors``, ``rx_dropped`` and their ``tx_`` twins as the
catalog's ``net_*_total`` metrics (:data:`collectors.infiniband.NETDEV_STATS`), every other
``rtnl_link_stats64`` field as ``net_nic_counter_total{interface, counter}`` named as its
``/sys/class/net/<if>/statistics/`` file (``rx_crc_errors``, ``rx_frame_errors``...).

When one file holds two readings of the same interface (``ifconfig`` run twice, a ``watch``
loop), an error or drop counter that went up between them gives a ``netdev_counter_rise``
event (code: the counter, attrs ``before``/``after``/``delta``), as the live collector does
between two collections.

Sources followed:

* net-tools ``ifconfig`` (``lib/interface.c``, ``ife_print_long``): 2.x prints ``RX errors
  E  dropped D  overruns O  frame F`` and ``TX errors E  dropped D overruns O  carrier C
  collisions N``; 1.60 prints ``RX packets:P errors:E dropped:D overruns:O frame:F``.
  ``overruns`` is ``rx_fifo_errors``/``tx_fifo_errors``.
* ``/proc/net/dev`` (``net/core/net-procfs.c``, ``dev_seq_printf_stats``): receive ``bytes
  packets errs drop fifo frame compressed multicast``, transmit ``bytes packets errs drop
  fifo colls carrier compressed``.
* iproute2 ``ip -j -s link`` (``print_link_stats64``): ``stats64.rx``/``stats64.tx`` keys.
* ``Documentation/ABI/testing/sysfs-class-net-statistics``: one file per counter, as printed
  by ``for f in /sys/class/net/<if>/statistics/*; do echo "$(basename $f): $(cat $f)"``,
  ``head`` (``==> path <==`` then the value) or ``grep -H``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.infiniband import NETDEV_STATS, unquote
from collectors.textparse import Session, line_evidence
from core.records import EntityId, Event, Evidence, Record, Sample

logger = logging.getLogger(__name__)

SYSFS_NET_STATISTICS = frozenset(
    {
        "collisions",
        "multicast",
        "rx_bytes",
        "rx_compressed",
        "rx_crc_errors",
        "rx_dropped",
        "rx_errors",
        "rx_fifo_errors",
        "rx_frame_errors",
        "rx_length_errors",
        "rx_missed_errors",
        "rx_nohandler",
        "rx_over_errors",
        "rx_packets",
        "tx_aborted_errors",
        "tx_bytes",
        "tx_carrier_errors",
        "tx_compressed",
        "tx_dropped",
        "tx_errors",
        "tx_fifo_errors",
        "tx_heartbeat_errors",
        "tx_packets",
        "tx_window_errors",
    }
)
"""The files of ``/sys/class/net/<if>/statistics/`` (``sysfs-class-net-statistics``)."""

RISE_COUNTERS = frozenset(
    name
    for name in SYSFS_NET_STATISTICS
    if name.endswith(("_errors", "_dropped")) and name != "rx_nohandler"
)
"""Counters whose increase between two readings is judged (errors and drops)."""

PROC_NET_DEV_COLUMNS: tuple[str, ...] = (
    "rx_bytes",
    "rx_packets",
    "rx_errors",
    "rx_dropped",
    "rx_fifo_errors",
    "rx_frame_errors",
    "rx_compressed",
    "multicast",
    "tx_bytes",
    "tx_packets",
    "tx_errors",
    "tx_dropped",
    "tx_fifo_errors",
    "collisions",
    "tx_carrier_errors",
    "tx_compressed",
)
"""``/proc/net/dev`` columns after the interface name, as ``statistics/`` file names."""

IFCONFIG_FIELDS: dict[tuple[str, str], str] = {
    ("rx", "packets"): "rx_packets",
    ("rx", "bytes"): "rx_bytes",
    ("rx", "errors"): "rx_errors",
    ("rx", "dropped"): "rx_dropped",
    ("rx", "overruns"): "rx_fifo_errors",
    ("rx", "frame"): "rx_frame_errors",
    ("tx", "packets"): "tx_packets",
    ("tx", "bytes"): "tx_bytes",
    ("tx", "errors"): "tx_errors",
    ("tx", "dropped"): "tx_dropped",
    ("tx", "overruns"): "tx_fifo_errors",
    ("tx", "carrier"): "tx_carrier_errors",
    ("tx", "collisions"): "collisions",
    ("", "collisions"): "collisions",
}
"""``ifconfig`` (direction, word) to the ``statistics/`` file it prints (net-tools)."""


def netdev_sample(
    ctx: ParseContext, iface: str, counter: str, value: int, evidence: Evidence
) -> Sample:
    """Return the sample the live collector gives for ``counter`` of ``iface``.

    Examples:
        >>> from collectors.artifact import ParseContext
        >>> from core.records import Evidence, NodeName
        >>> ctx = ParseContext(file="f", node=NodeName("n"))
        >>> ev = Evidence(file="f", line=1, text="")
        >>> netdev_sample(ctx, "eth0", "rx_errors", 3, ev).metric
        'net_rx_errors_total'
        >>> netdev_sample(ctx, "eth0", "rx_crc_errors", 3, ev).labels["counter"]
        'rx_crc_errors'
    """
    metric = NETDEV_STATS.get(counter)
    labels = {"interface": iface}
    if metric is None:
        metric = "net_nic_counter_total"
        labels["counter"] = counter
    return Sample(
        metric=metric,
        value=float(value),
        observed_at=None,
        node=ctx.node,
        entity=EntityId(iface),
        labels=labels,
        evidence=evidence,
    )


MAX_TRACKED_FILES = 64
"""Files whose last counter readings are kept (the oldest is forgotten first)."""

_Readings = dict[tuple[str, str, str], tuple[int, Evidence]]
_READINGS: dict[str, tuple[int, _Readings]] = {}
"""Per input file: the last line read and the last reading of every ``(node, if, counter)``.

A file is cut into one section per command, each parsed by its own session, so the readings
of ``ifconfig`` run twice live here rather than in a session. A read of the file that starts
again at an earlier line is a new read and starts afresh."""


def _readings(file: str, line: int, *, first: bool) -> _Readings:
    """Return the last readings of ``file``.

    A session whose first line is not past the last line seen starts a new read of the file:
    the old readings are forgotten.
    """
    entry = _READINGS.get(file)
    if entry is None or line < entry[0] or (first and line <= entry[0]):
        if entry is None and len(_READINGS) >= MAX_TRACKED_FILES:
            del _READINGS[next(iter(_READINGS))]
        entry = (line, {})
    _READINGS[file] = (line, entry[1])
    return entry[1]


class NetdevSession(Session):
    """Shared behaviour: samples, and rises between two readings of one file."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._started = False

    def counter(
        self, iface: str, counter: str, value: int, line: Line, out: list[Record]
    ) -> None:
        """Emit the sample of one counter, and a rise event when it went up since last read."""
        evidence = line_evidence(self.ctx, line)
        out.append(netdev_sample(self.ctx, iface, counter, value, evidence))
        last = _readings(self.ctx.file, line.number, first=not self._started)
        self._started = True
        key = (str(self.ctx.node), iface, counter)
        previous = last.get(key)
        last[key] = (value, evidence)
        if previous is None or counter not in RISE_COUNTERS or value <= previous[0]:
            return
        out.append(
            Event(
                kind="netdev_counter_rise",
                code=counter,
                node=self.ctx.node,
                entity=EntityId(iface),
                observed_at=None,
                message=f"{iface} {counter} rose from {previous[0]} to {value}",
                attrs={
                    "interface": iface,
                    "before": str(previous[0]),
                    "after": str(value),
                    "delta": str(value - previous[0]),
                },
                evidence=(previous[1], evidence),
                source="netdev",
            )
        )


# --- ifconfig ----------------------------------------------------------------------------

_IFC_HEAD_NEW = re.compile(r"^(?P<if>[\w.:@-]+): flags=\d+<[^>]*>")
_IFC_HEAD_OLD = re.compile(r"^(?P<if>[\w.:@-]+)\s+Link encap:")
_IFC_STATS = re.compile(
    r"^\s+(?:(?P<dir>RX|TX)\s+)?(?P<rest>(?:packets|errors|bytes|collisions)\b.*)$"
)
_IFC_PAIR = re.compile(r"(?:(?P<dir>RX|TX)\s+)?(?P<word>[a-z]+)[:\s]\s*(?P<value>\d+)\b")


class IfconfigSession(NetdevSession):
    """Parse ``ifconfig`` output of net-tools 1.60 and 2.x (see module doc)."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._if: str | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each statistics line gives its samples at once."""
        out: list[Record] = []
        for line in unquote(lines):
            text = line.text.rstrip()
            head = _IFC_HEAD_NEW.match(text) or _IFC_HEAD_OLD.match(text)
            if head:
                self._if = head["if"].rstrip(":")
                continue
            stats = _IFC_STATS.match(text)
            if stats is None or self._if is None:
                continue
            direction = (stats["dir"] or "").lower()
            for pair in _IFC_PAIR.finditer(stats["rest"]):
                pair_dir = (pair["dir"] or "").lower() or direction
                name = IFCONFIG_FIELDS.get((pair_dir, pair["word"]))
                if name is None:
                    continue
                self.counter(self._if, name, int(pair["value"]), line, out)
        return out


class IfconfigParser:
    """``ifconfig`` output (net-tools)."""

    kind = "ifconfig"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 with an interface header and an ``RX``/``TX`` statistics line."""
        del command
        sample = unquote(lines)[:200]
        heads = sum(
            1 for ln in sample if _IFC_HEAD_NEW.match(ln.text) or _IFC_HEAD_OLD.match(ln.text)
        )
        stats = sum(
            1
            for ln in sample
            if (m := _IFC_STATS.match(ln.text)) and (m["dir"] or "collisions" in m["rest"])
        )
        if heads and stats:
            return 90
        return 40 if stats >= 2 else 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return IfconfigSession(ctx)


# --- /proc/net/dev -------------------------------------------------------------------------

_PROC_HEADER = re.compile(r"^\s*(?:Inter-\|\s+Receive|face \|bytes)")
_PROC_ROW = re.compile(r"^\s*(?P<if>[\w.@-]+):\s*(?P<values>\d+(?:\s+\d+){15})\s*$")


class ProcNetDevSession(NetdevSession):
    """Parse ``/proc/net/dev``: one interface a line, 16 counters."""

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each row gives its samples at once."""
        out: list[Record] = []
        for line in unquote(lines):
            row = _PROC_ROW.match(line.text)
            if row is None:
                if line.text.strip() and not _PROC_HEADER.match(line.text):
                    self.issue(line.number, "not a /proc/net/dev row")
                continue
            for name, value in zip(PROC_NET_DEV_COLUMNS, row["values"].split(), strict=True):
                self.counter(row["if"], name, int(value), line, out)
        return out


class ProcNetDevParser:
    """``cat /proc/net/dev``."""

    kind = "proc_net_dev"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 with the two header lines or a command reading the file and rows."""
        sample = unquote(lines)[:200]
        rows = sum(1 for ln in sample if _PROC_ROW.match(ln.text))
        header = any(_PROC_HEADER.match(ln.text) for ln in sample[:3])
        if rows and (header or (command is not None and "/proc/net/dev" in command)):
            return 90
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return ProcNetDevSession(ctx)


# --- /sys/class/net/<if>/statistics -----------------------------------------------------------

_SYS_IF = re.compile(r"/sys/class/net/(?P<if>[\w.@:-]+)/")
_SYS_NAME_VALUE = re.compile(
    r"^\s*(?:(?:/sys/class/net/(?P<if>[\w.@:-]+)/statistics/)?(?P<name>[a-z_]+))"
    r"\s*[:=]?\s+(?P<value>\d+)\s*$"
)
_SYS_GREP = re.compile(
    r"^\s*/sys/class/net/(?P<if>[\w.@:-]+)/statistics/(?P<name>[a-z_]+):(?P<value>\d+)\s*$"
)
_SYS_HEAD = re.compile(
    r"^==> (?:/sys/class/net/(?P<if>[\w.@:-]+)/statistics/)?(?P<name>[a-z_]+) <==$"
)
_SYS_VALUE = re.compile(r"^\s*(?P<value>\d+)\s*$")


class SysfsNetStatsSession(NetdevSession):
    """Parse ``name: value`` lines of ``/sys/class/net/<if>/statistics`` files (module doc)."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        found = _SYS_IF.search(ctx.command or "")
        self._if = found["if"] if found and "$" not in found["if"] else "netdev"
        self._pending: tuple[str, str] | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; each value gives its sample at once."""
        out: list[Record] = []
        for line in unquote(lines):
            text = line.text.strip()
            head = _SYS_HEAD.match(text)
            if head:
                self._pending = (head["if"] or self._if, head["name"])
                continue
            value = _SYS_VALUE.match(text)
            if value and self._pending is not None:
                iface, name = self._pending
                self._pending = None
                if name in SYSFS_NET_STATISTICS:
                    self.counter(iface, name, int(value["value"]), line, out)
                continue
            pair = _SYS_GREP.match(text) or _SYS_NAME_VALUE.match(text)
            if pair and pair["name"] in SYSFS_NET_STATISTICS:
                self.counter(pair["if"] or self._if, pair["name"], int(pair["value"]), line, out)
        return out


class SysfsNetStatsParser:
    """``/sys/class/net/<if>/statistics/*`` printed one counter a line."""

    kind = "sysfs_net_stats"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 80 when most lines are statistics files with their values."""
        sample = unquote(lines)[:200]
        hits = 0
        for ln in sample:
            text = ln.text
            pair = _SYS_NAME_VALUE.match(text) if not text.startswith((" ", "\t")) else None
            head = _SYS_HEAD.match(text.strip())
            if (pair and pair["name"] in SYSFS_NET_STATISTICS) or (
                head and head["name"] in SYSFS_NET_STATISTICS
            ):
                hits += 1
        if hits >= 2 and hits * 2 >= len(sample):
            return 80
        if hits and command is not None and "/sys/class/net/" in command:
            return 80
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return SysfsNetStatsSession(ctx)


# --- ip -j -s link (iproute2 JSON) ---------------------------------------------------------

IP_JSON_FIELDS: dict[str, dict[str, str]] = {
    "rx": {
        "bytes": "rx_bytes", "packets": "rx_packets", "errors": "rx_errors",
        "dropped": "rx_dropped", "over_errors": "rx_over_errors", "multicast": "multicast",
        "missed": "rx_missed_errors", "length_errors": "rx_length_errors",
        "crc_errors": "rx_crc_errors", "frame_errors": "rx_frame_errors",
        "fifo_errors": "rx_fifo_errors", "missed_errors": "rx_missed_errors",
        "nohandler": "rx_nohandler", "compressed": "rx_compressed",
    },
    "tx": {
        "bytes": "tx_bytes", "packets": "tx_packets", "errors": "tx_errors",
        "dropped": "tx_dropped", "carrier_errors": "tx_carrier_errors",
        "collisions": "collisions", "aborted_errors": "tx_aborted_errors",
        "fifo_errors": "tx_fifo_errors", "window_errors": "tx_window_errors",
        "heartbeat_errors": "tx_heartbeat_errors", "compressed": "tx_compressed",
    },
}
"""``ip -j -s link`` ``stats64.rx``/``stats64.tx`` keys (iproute2 ``ipstats``/``iplink``
``print_link_stats64``) to ``statistics/`` file names."""


class IpJsonSession(NetdevSession):
    """Parse ``ip -j [-p] -s link`` output: the JSON array is read when the section ends."""

    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self._lines: list[Line] = []

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Keep the lines (bounded by the reader's block size)."""
        if len(self._lines) < 20000:
            self._lines.extend(lines)
        return []

    def close(self) -> list[Record]:
        """Return the samples of every interface with statistics."""
        out: list[Record] = []
        if not self._lines:
            return out
        try:
            doc = json.loads("\n".join(ln.text for ln in self._lines))
        except ValueError as exc:
            self.issue(self._lines[0].number, f"ip -j link: not JSON ({exc})")
            return out
        if not isinstance(doc, list):
            return out
        first = self._lines[0]
        for link in doc:
            if not isinstance(link, dict) or not isinstance(link.get("ifname"), str):
                continue
            stats = link.get("stats64") or link.get("stats")
            if not isinstance(stats, dict):
                continue
            line = next((ln for ln in self._lines if f'"{link["ifname"]}"' in ln.text), first)
            for direction, names in IP_JSON_FIELDS.items():
                block = stats.get(direction)
                if not isinstance(block, dict):
                    continue
                for key, name in names.items():
                    value = block.get(key)
                    if isinstance(value, int) and not isinstance(value, bool):
                        self.counter(link["ifname"], name, value, line, out)
        return out


class IpJsonParser:
    """``ip -j -s link`` (iproute2 JSON)."""

    kind = "ip_link_json"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 on a JSON array of links with ``stats64``."""
        head = " ".join(ln.text for ln in lines[:50])
        if '"ifname"' in head and ('"stats64"' in head or '"stats"' in head):
            return 90
        if command is not None and re.search(r"\bip\b.*-j", command) and '"ifname"' in head:
            return 90
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return IpJsonSession(ctx)


PARSERS: tuple[ArtifactParser, ...] = (
    IfconfigParser(),
    ProcNetDevParser(),
    SysfsNetStatsParser(),
    IpJsonParser(),
)
"""The artifact parsers of this module (read by ``collectors.parsers``)."""

__all__ = [
    "IFCONFIG_FIELDS",
    "PARSERS",
    "PROC_NET_DEV_COLUMNS",
    "RISE_COUNTERS",
    "SYSFS_NET_STATISTICS",
    "IfconfigParser",
    "ProcNetDevParser",
    "SysfsNetStatsParser",
    "netdev_sample",
]
