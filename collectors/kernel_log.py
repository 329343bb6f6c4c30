"""Kernel logs: NVIDIA driver (NVRM) messages, Xids, SXids, PCIe AER, APEI, EDAC.

Two artifact parsers and one live collector share one line parser
(:class:`KernelLogSession`):

* :class:`KernelLogParser` (kind ``kernel_log``) reads ``dmesg`` (uptime stamps,
  ``-T``/``--ctime``), journal and syslog lines (``Mon DD HH:MM:SS [host] kernel:``,
  with or without the uptime stamp after ``kernel:``), ``journalctl -o short-iso``,
  remote syslog with RFC 3339 stamps (``IP: kern: warning: [2026-...Z]: NVRM: ...``),
  container logs with an RFC 3339 prefix (the k8s-device-plugin's
  ``XidCriticalError: Xid=94 on Device=GPU-...``) and bare lines (``NVRM: Xid ...``).
* :class:`NvidiaSmiErrorParser` (kind ``nvidia_smi_error``) reads the NVML and CUDA
  error text tools print when a GPU is gone (``Unable to determine the device handle
  for GPU0000:B1:00.0: Unknown Error``, ``No devices were found``, ``CUDA-capable
  device(s) is/are busy or unavailable``).
* :class:`KernelLogCollector` reads this boot's backlog, then follows: ``journalctl -k -b
  -f``, ``/dev/kmsg`` or a file; with ``state_dir`` it resumes where it stopped.

When lines name their host (syslog ``host kernel:``, RFC 5424, remote syslog,
``journalctl -o json`` ``_HOSTNAME``, pdsh/clush ``host: ``) and the input holds two or
more hosts, each event's node is its line's host; with one host, ``ctx.node``.

Event kinds emitted (``Event.kind`` / ``Event.code``):

* ``xid`` / Xid number: attrs ``pid``, ``process``, ``message``; Xid 74 adds ``link`` and
  ``registers`` (the seven words, comma-separated); Xid 154 adds
  ``recovery_action`` (``GPU Reset Required``...), ``recovery_action_code``; NVLink5
  Xids 144-150 add ``unit``, ``fatal`` (``yes``/``no``), ``link``, ``intrinfo``,
  ``status``; Xid 45 adds ``caused_by`` when its message names the Xid behind it.
  Xid lines of one code on one GPU within a second (a multi-line Xid 13 report) are
  one event holding all the lines (attr ``lines``).
* ``gpu_lost`` / ``fallen_off_bus`` | ``gpu_is_lost`` (NV_ERR_GPU_IS_LOST) | ``nvml_gpu_is_lost``.
* ``gpu_init_failure`` / ``rm_init_adapter`` | ``probe_failed`` | ``gsp_init_failure`` |
  ``power_cables`` | ``unsupported_gpu`` (driver branch does not support the GPU, or it
  needs the open modules) | ``firmware_missing`` (GSP firmware file not found).
* ``driver_mismatch`` / ``api_mismatch`` (``NVRM: API mismatch``) |
  ``nvml_version_mismatch`` (``Failed to initialize NVML: Driver/library version mismatch``).
* ``reboot_required`` / ``uvm_fatal`` (UVM global fatal error "requiring os reboot").
* ``gsp_error`` / ``heartbeat_timeout`` | ``memsys_error`` | ``pmu_halted`` (attr ``at_boot``).
* ``gsp_rpc_timeout`` / ``back_to_back`` | ``rpc_recv_poll`` | ``rpc_timeout`` (RPC
  history tables joined into the event).
* ``reset_required`` / ``NV_ERR_RESET_REQUIRED``.
* ``sxid`` / SXid number (attr ``fatal``), from the kernel or the Fabric Manager log.
* ``fabric_manager`` / ``start_failed`` | ``no_nvswitch`` | ``not_supported`` |
  ``topology_mismatch`` (NVSwitch count does not match the board: an NVSwitch system).
* ``pcie_aer`` / ``corrected`` | ``uncorrected_nonfatal`` | ``uncorrected_fatal`` (attrs
  ``vendor_id``, ``device_id``, ``driver``, ``source`` = ``aer`` or ``apei``).
* ``host_memory`` / ``UE`` | ``CE`` (attr ``count``), from EDAC, MCE and APEI.
* ``pcie_bandwidth_limited`` / ``limited`` (attrs ``limited_by``, ``capable``,
  ``capable_link``, ``limited_at``); ``pcie_bandwidth`` / ``full`` (attr ``link``: a
  device at its full bandwidth); ``driver_load`` / driver version;
  ``gpu_identity`` / ``uuid`` (attr ``uuid``); ``peermem`` / ``note``;
  ``kernel_boot`` / ``boot``.
* ``nvml_error`` / ``unknown_error`` | ``no_devices`` | ``driver_not_loaded`` |
  ``init_failed`` | other; ``cuda_error`` / ``busy_or_unavailable``.

Lines are read in every common paste shape: indented as a whole (a continuation line
is one indented deeper than its message, without a stamp of its own), rsyslog ``#012``
escapes, journald ``-- Reboot --`` markers (a new boot), AER bus-error reports without
their header (DPC, cut pastes), Fabric Manager stamps with fractions of a second.

Every event carries attr ``boot`` (how many reboots the input showed before it,
``"0"`` first) so that rules can tell a fault that recurs after a reboot. Times:
``observed_at`` is epoch seconds read as UTC (kernel wall-clock stamps carry no zone),
``None`` for uptime stamps and unstamped lines. Year-less stamps take the year of
``ParseContext.default_year``, else of another stamp in the file, else the current
year; then the event has attr ``year_assumed``.

Sources: NVIDIA Xid catalog (message formats, Xid 154 recovery actions), NVIDIA
Fabric Manager user guide (SXid), Linux ``Documentation/PCI/pcieaer-howto.rst`` (AER),
Linux EDAC and APEI/GHES (``drivers/acpi/apei/ghes.c``, ``drivers/firmware/efi/cper.c``).
"""

from __future__ import annotations

import calendar
import errno
import json
import logging
import os
import re
import select
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from collectors.artifact import ArtifactParser, Line, ParseContext, ParseIssue, ParserSession
from core.clock import Clock, system_clock
from core.errors import CollectorUnavailable
from core.ids import gpu_index_entity, normalize_pci_bus_id
from core.records import NODE_ENTITY, EntityId, Event, Evidence, NodeName, Record

logger = logging.getLogger(__name__)

SOURCE = "kernel_log"
"""``Event.source`` of every event this module emits."""

MAX_EVENT_LINES = 64
"""Raw lines kept per joined multi-line event (RPC history tables can be long)."""

MAX_YEAR_PENDING = 10_000
"""Year-less events held back while the year is unknown; past this the current year is assumed."""

_DETECT_LINES = 64

# Cheap pre-filter: a line without any of these words cannot yield an event. Flat
# alternation of literals, most starting with an upper-case letter: Python's regex
# engine skips most positions of ordinary log text quickly on those.
_KEYWORDS = re.compile(
    r"NVRM|NVIDIA|NVSwitch|NVML|No devices were found|Xid|XID |GPU_IS_LOST|EDAC|AER|Hardware Error|"
    r"PCIe Bus Error|PCIe bandwidth|Uncorrected hardware|Memory failure|Unable to determine|"
    r"fallen off the bus|"
    r"GPU is lost|CUDA-capable|Linux version|FabricManager|Fabric Manager|-peermem|"
    r"-fabricmanager|/mask=|nvidia[-: ]|Corrected error\(s\)|Uncorrected error\(s\)|"
    r"-- Reboot --|-- Boot "
)

_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_MON = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_ISO = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_UP = r"\[\s*(?P<{0}>\d+\.\d+)\]"

_PREFIX = re.compile(
    r"^(?:<\d+>)?(?:"
    # Talos / remote syslog: "192.0.2.119: kern: warning: [2026-04-22T21:30:51.5Z]: msg"
    r"(?P<rhost>[\w.:-]+):\s+kern:\s+\w+\s*:\s+\[(?P<riso>" + _ISO + r")\]:?\s*"
    # RFC 5424: "<4>1 2025-03-14T02:11:09.12+00:00 host kernel - - - msg"
    r"|1 (?P<r5iso>" + _ISO + r") (?P<r5host>[\w.:-]+) kernel \S+ \S+ (?:-|\[[^\]]*\])\s?"
    # dmesg -T / --ctime
    r"|\[(?P<ctime>(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) " + _MON + r" [ \d]\d \d\d:\d\d:\d\d \d{4})\]\s?"
    # dmesg (uptime)
    r"|" + _UP.format("up") + r"\s?"
    # journalctl -o short-iso / short-full / RFC 3339 container prefix / dmesg --time-format iso
    r"|(?:"
    + _DAY
    + r" )?(?P<iso>"
    + _ISO
    + r")(?: [A-Z]{2,5}(?= ))?\s+(?:(?:stdout|stderr) [FP] )?(?:(?P<ihost>[\w.-]+)\s+(?=kernel))?"
    r"(?:kernel(?:\[\d+\])?:\s*(?:" + _UP.format("up2") + r"\s?)?)?"
    # syslog / journal without year
    r"|(?P<bsd>"
    + _MON
    + r" [ \d]\d \d\d:\d\d:\d\d)(?:\.\d+)?\s+(?:(?P<bhost>[\w.-]+)\s+(?=kernel))?"
    r"(?:kernel(?:\[\d+\])?:\s*(?:" + _UP.format("up3") + r"\s?)?)?"
    # dmesg -x facility prefix
    r"|kern\s*:\s*\w+\s*:\s*(?:" + _UP.format("up4") + r"\s?)?"
    # Fabric Manager log: "[Mar 27 2024 17:40:36] [ERROR] [tid 1234] msg"
    r"|\[(?P<fm>" + _MON + r" [ \d]?\d \d{4} \d\d:\d\d:\d\d)(?:\.\d+)?\] "
    r"\[\w+\](?: \[tid \d+\])?\s*"
    # dmesg --reltime / -e: no absolute time
    r"|\[(?:" + _MON + r"\d\d \d\d:\d\d|\s*\+\d+\.\d+)\]\s?"
    r")?"
)
_CALLER = re.compile(r"\[\s*[TC]\d+\]\s*")
_MONTHS = {m: i for i, m in enumerate(calendar.month_abbr) if m}

# --- message patterns (bodies, continuation lines joined) ---
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): (?P<code>\d+),\s*(?P<rest>.*)", re.S
)
_PIDNAME = re.compile(r"pid=(?P<pid>'[^']*'|[^,\s]+),\s*name=(?P<name>[^,]*),\s*(?P<msg>.*)", re.S)
_PIDONLY = re.compile(r"pid=(?P<pid>'[^']*'|[^,\s]+),\s*(?P<msg>.*)", re.S)
_GPUD_XID = re.compile(
    r"\bXID (?P<code>\d+)(?:\.\d+)?\b.{0,200}?detected on (?:GPU )?PCI:(?P<pci>[0-9a-fA-F:.]+)"
)
_JOURNAL_BOOT = re.compile(r"-- (?:Reboot|Boot [0-9a-f]+) --")
_KLOG_XID = re.compile(
    r"Xid\s*=\s*(?P<code>\d+)\s+on\s+Device\s*=\s*(?P<dev>GPU-[0-9a-fA-F-]+|\S+?)[;,\s]"
)
_RECOVERY = re.compile(
    r"recovery action changed (?:from 0x(?P<f>[0-9a-fA-F]+) \((?P<fname>[^)]*)\) )?to "
    r"0x(?P<t>[0-9a-fA-F]+)(?: \((?P<tname>[^)]*)\))?"
)
_NVLINK5 = re.compile(
    r"(?P<unit>[A-Z][A-Z0-9_]+)\s+(?P<fatal>Fatal|Non-?fatal)\s+XC\d+\s+i\d+\s+Link\s+(?P<link>-?\d+)"
    r"\s*\((?P<intr>0x[0-9a-fA-F]+)\s+(?P<status>0x[0-9a-fA-F]+)",
    re.I,
)
_GSP_INIT = re.compile(
    r"kgspInitRm|GSP init|kgspWaitForRmInitDone|"
    r"(?:failed to|cannot|unable to) (?:boot|bootstrap|load|initiali[sz]e)\b.{0,30}GSP|"
    r"GSP.{0,40}(?:boot|bootstrap|init)\w* failed",
    re.I,
)
_NVLINK_REGS = re.compile(
    r"link\s*(?P<link>\d+)\s*\((?P<regs>0x[0-9a-fA-F]+(?:,\s*0x[0-9a-fA-F]+)*)\)", re.I
)
_UNSUPPORTED = re.compile(
    r"installed in this system (?:is not supported by|is supported through|requires use of)",
    re.I,
)
_PROBE_FAILED = re.compile(
    r"nvidia\S*: probe of (?P<a>\S+) failed|"
    r"(?:nvidia\S*) (?P<b>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): "
    r"probe with driver nvidia\S* failed"
)
_FW_MISSING = re.compile(
    r"(?:\S+ (?P<dev>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): )?"
    r"Direct firmware load for nvidia/\S+ failed"
)
_MCE_STATUS = re.compile(r"_STATUS\[(?P<flags>[^\]]*)\]")
_RAS_MC = re.compile(
    r"(?P<count>\d+) (?P<kind>Corrected|Uncorrected|Fatal|Deferred) error\(s\): "
    r"(?P<msg>(?:memory|.{0,40}DRAM|.{0,40}ECC).*)",
    re.I,
)
_EDAC_BARE = re.compile(r"EDAC (?:\w+ )?MC(?P<mc>\d+): (?P<kind>UE|CE)\b(?P<msg>.*)")
_CAUSED_BY = re.compile(r"caused by (?:previous |prior )?Xid\s*(\d+)", re.I)
_PCI_ANY = re.compile(r"(?:PCI:)?\b([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\b")
_GPU_N = re.compile(r"^GPU(\d+) ")
_GPU_AT = re.compile(r"NVRM: GPU at PCI:(?P<pci>[0-9a-fA-F:.]+): (?P<uuid>GPU-[0-9a-fA-F-]+)")
_DRIVER = re.compile(
    r"NVRM: loading NVIDIA UNIX.*?Kernel Module(?: for \S+)?\s+(?P<ver>\d+(?:\.\d+)+)"
)
_SXID = re.compile(
    r"(?P<dev>nvidia-nvswitch\d*):\s*SXid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\):\s*(?P<code>\d+),"
    r"\s*(?:(?P<sev>Fatal|Non-?fatal)\s*,?)?\s*(?P<msg>.*)",
    re.I,
)
_FM_SXID = re.compile(
    r"NVSwitch (?P<sev>fatal|non-?fatal) error (?P<code>\d+)\b.*?"
    r"pci bus id (?P<pci>[0-9a-fA-F:.]+)",
    re.I,
)
_FM_FAIL = re.compile(
    r"(?:fabric ?manager|nv-fabricmanager).*?(?:fail|error|n't support|not support|unsupported)|"
    r"(?:\bno|find any|zero) NVSwitch|NVSwitch.*not (?:found|present)|"
    r"NVSwitch\w* (?:don't|do not|doesn't) match",
    re.I,
)
_FM_TOPOLOGY = re.compile(
    r"NVSwitch\w* (?:don't|do not|doesn't) match|supported system topology", re.I
)
_AER = re.compile(
    r"(?:(?P<port>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): )?AER: (?:Multiple )?"
    r"(?P<sev>Correct(?:ed|able)|Uncorrect(?:ed|able)(?: \((?:Non-Fatal|Fatal)\))?) error "
    r"(?:message )?received"
    r"(?::| from)?\s*(?:id=\w+|(?P<dev>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]))?",
    re.I,
)
_DEV_PREFIX = re.compile(
    r"(?P<drv>[\w-]+) (?P<dev>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]):"
)
_VENDOR_DEV = re.compile(r"device \[(?P<v>[0-9a-fA-F]{4}):(?P<d>[0-9a-fA-F]{4})\]")
_PCIE_SEV = re.compile(r"severity=(?P<sev>Corrected|Uncorrected \((?:Non-Fatal|Fatal)\)|\w+)", re.I)
_APEI = re.compile(r"^\{(?P<n>\d+)\}\[Hardware Error\]:\s*(?P<msg>.*)")
_EDAC = re.compile(r"EDAC (?:\w+ )?MC(?P<mc>\d+): (?P<count>\d+) (?P<kind>UE|CE) (?P<msg>.*)")
_MCE_UE = re.compile(
    r"Uncorrected hardware memory error|Memory failure: .*(?:recovery action|Recovered)", re.I
)
_LIMITED = re.compile(
    r"(?P<dev>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): (?P<avail>[\d.]+ Gb/s) "
    r"available PCIe "
    r"bandwidth, limited by (?P<by>[^,]+?)(?: at (?P<at>[0-9a-fA-F:.]+))?"
    r" \(capable of (?P<cap>[\d.]+ Gb/s)(?: with (?P<caplink>[^)]*?))?\)"
)
_FULL_BW = re.compile(
    r"(?P<dev>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): (?P<avail>[\d.]+ Gb/s) "
    r"available PCIe bandwidth \((?P<link>[^)]*? link)\)"
)
_NVML_HANDLE = re.compile(
    r"Unable to determine the device handle for (?:GPU\s*)?(?P<pci>[0-9a-fA-F:.]+):\s*(?P<err>.*)"
)


@dataclass(slots=True)
class _Stamp:
    observed_at: float | None = None
    uptime: float | None = None
    bsd: tuple[int, int, int, int, int] | None = None  # month, day, h, m, s (year-less)


@dataclass(slots=True)
class _Draft:
    """A message being assembled from one or more lines."""

    stamp: _Stamp
    parts: list[str]
    evidence: list[Evidence]
    first_body: str
    channel: str  # "nvrm", "apei", "aer"
    key: str = ""
    boot: int = 0
    indent: int = 0

    def add(self, body: str, ev: Evidence) -> None:
        if len(self.evidence) < MAX_EVENT_LINES:
            self.parts.append(body)
            self.evidence.append(ev)


@dataclass(slots=True)
class _Burst:
    """Consecutive Xid lines of one code on one GPU within a second: one event."""

    entity: EntityId
    code: str
    stamp: _Stamp
    evidence: list[Evidence]
    messages: list[str]
    attrs: dict[str, str]
    boot: int


def _close_in_time(a: _Stamp, b: _Stamp) -> bool:
    """Whether two stamps are at most a second apart (both unstamped counts as close)."""
    for x, y in ((a.observed_at, b.observed_at), (a.uptime, b.uptime)):
        if x is not None and y is not None:
            return abs(x - y) <= 1.0
    if a.bsd is not None and b.bsd is not None:
        return a.bsd == b.bsd
    return (
        a.observed_at is None
        and a.uptime is None
        and a.bsd is None
        and (b.observed_at is None and b.uptime is None and b.bsd is None)
    )


@dataclass(slots=True)
class _Pending:
    event: Event
    bsd: tuple[int, int, int, int, int]


@dataclass(slots=True)
class KernelLogSession:
    """Parses kernel-log lines into events; keeps state across :meth:`feed` calls.

    Attributes:
        ctx: File, node and default year.
        issues: Malformed lines, as ``ParseIssue`` (never raised).
    """

    ctx: ParseContext
    issues: list[ParseIssue] = field(default_factory=list)
    _nvrm: _Draft | None = None
    _apei: _Draft | None = None
    _aer: _Draft | None = None
    _year: int | None = None
    _year_from_file: bool = False
    _pending: list[_Pending] = field(default_factory=list)
    _last_month: int = 0
    _boot: int = 0
    _last_uptime: float | None = None
    _seen_stamp: bool = False
    _bumped: bool = False
    _driver_loaded_up: float | None = None
    _driver_loaded_at: float | None = None
    _ctime_cache: dict[str, float] = field(default_factory=dict)
    _burst: _Burst | None = None
    _mce_sev: str = ""
    split_hosts: bool = True
    _hosts: set[str] = field(default_factory=set)
    _line_host: str | None = None
    _last_host: str | None = None
    _held: list[Record] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._year = self.ctx.default_year

    def _see_host(self, host: str) -> None:
        self._line_host = host
        if len(self._hosts) < 2:
            self._hosts.add(host)

    def _by_host(self, out: list[Record]) -> list[Record]:
        """Name each event's node after its line's host once two hosts were seen.

        While at most one host is known, events of host-naming lines are held back
        (a single host keeps ``ctx.node``, so a pasted file folds as one node).
        """
        if not self.split_hosts or not (self._hosts or self._held):
            return out
        if len(self._hosts) < 2:
            self._held.extend(out)
            return []
        held, self._held = self._held, []
        return [_relabel(r) for r in (*held, *out)]

    # ------------------------------------------------------------------ API
    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines; return the events completed so far."""
        out: list[Record] = []
        search = _KEYWORDS.search
        for line in lines:
            text = line.text
            if search(text) is None:
                if self._nvrm is not None and not text[:1].isspace():
                    self._flush_nvrm(out)
                continue
            if text[:3] == "-- " and _JOURNAL_BOOT.match(text):
                self.flush_into(out)
                self._boot += 1  # journalctl marks each new boot
                continue
            try:
                self._line(line, out)
            except (
                ValueError,
                OverflowError,
                IndexError,
                KeyError,
            ) as exc:  # never raise on bad input
                self.issues.append(
                    ParseIssue(
                        file=self.ctx.file, line=line.number, reason=f"malformed line: {exc}"
                    )
                )
        return self._by_host(out) if self._hosts else out

    def flush(self) -> list[Record]:
        """Finish the multi-line messages being joined (live sources call this when idle)."""
        out: list[Record] = []
        self.flush_into(out)
        return self._by_host(out)

    def flush_into(self, out: list[Record]) -> None:
        """Finish the multi-line messages being joined, appending their events to ``out``."""
        self._flush_nvrm(out)
        self._flush_burst(out)
        self._flush_apei(out)
        self._flush_aer(out)

    def close(self) -> list[Record]:
        """Flush joined messages and events held back (year-less, or waiting on hosts)."""
        out: list[Record] = []
        self.flush_into(out)
        if self._pending:
            if self._year is None:
                self._year = _assumed_year(self._pending[0].bsd)
            self._release_pending(out)
        out = self._by_host(out)
        held, self._held = self._held, []
        return held + out

    # ------------------------------------------------------------ stamps
    def _split(self, text: str) -> tuple[_Stamp, str]:
        m = _PREFIX.match(text)
        stamp = _Stamp()
        if m is None or m.end() == 0:
            return stamp, text.strip()
        body = text[m.end() :].strip()
        if body[:1] == "[":  # printk caller id ("[ T1234] ", CONFIG_PRINTK_CALLER)
            c = _CALLER.match(body)
            if c is not None:
                body = body[c.end() :]
        g = m.groupdict()
        host = g["rhost"] or g["ihost"] or g["bhost"] or g["r5host"]
        if host is not None:
            self._see_host(host)
        up = g["up"] or g["up2"] or g["up3"] or g["up4"]
        if up is not None:
            stamp.uptime = float(up)
        if g["ctime"]:
            stamp.observed_at = self._ctime(g["ctime"])
        elif g["riso"] or g["iso"] or g["r5iso"]:
            stamp.observed_at = _iso(g["riso"] or g["iso"] or g["r5iso"])
        elif g["fm"]:
            stamp.observed_at = self._ctime(g["fm"], "%b %d %Y %H:%M:%S")
        elif g["bsd"]:
            b = g["bsd"]
            month = _MONTHS[b[:3]]
            day = int(b[4:6])
            hh, mm, ss = (int(x) for x in b[7:15].split(":"))
            stamp.bsd = (month, day, hh, mm, ss)
        if stamp.observed_at is not None and not self._year_from_file:
            self._learn_year(datetime.fromtimestamp(stamp.observed_at, UTC).year)
        self._bumped = False
        if stamp.uptime is not None:
            if self._last_uptime is not None and stamp.uptime + 1.0 < self._last_uptime:
                self._boot += 1  # uptime went back: the machine rebooted
                self._bumped = True
            self._last_uptime = stamp.uptime
        return stamp, body

    def _ctime(self, text: str, fmt: str = "%a %b %d %H:%M:%S %Y") -> float:
        cached = self._ctime_cache.get(text)
        if cached is None:
            dt = datetime.strptime(" ".join(text.split()), fmt)
            cached = dt.replace(tzinfo=UTC).timestamp()
            if len(self._ctime_cache) > 4096:
                self._ctime_cache.clear()
            self._ctime_cache[text] = cached
        return cached

    def _learn_year(self, year: int) -> None:
        self._year_from_file = True
        if self._year is None:
            self._year = year

    def _bsd_time(self, bsd: tuple[int, int, int, int, int], year: int) -> float:
        month, day, hh, mm, ss = bsd
        return float(calendar.timegm((year, month, day, hh, mm, ss, 0, 0, 0)))

    # ------------------------------------------------------------- lines
    def _line(self, line: Line, out: list[Record]) -> None:
        text = line.text
        ev = Evidence(file=self.ctx.file, line=line.number, text=text)
        indent = len(text) - len(text.lstrip()) if text[:1].isspace() else 0
        if "#01" in text:  # rsyslog escapes newlines and tabs (#012, #011)
            text = text.replace("#012", " ").replace("#011", " ")
        c0 = text[:1]
        if c0 == "{" or (c0.isalnum() and ": " in text[:80]):
            host, text = _unwrap(text)  # journalctl -o json, pdsh/clush "host: " prefix
            if host is not None:
                self._see_host(host)
        stamp, body = self._split(text)
        host = self._line_host
        self._line_host = None
        if host != self._last_host:
            if self._last_host is not None and host is not None:
                self.flush_into(out)  # interleaved hosts (pdsh): never join across them
            if host is not None:
                self._last_host = host
        if not body:
            return
        # A continuation line is indented deeper than the line that opened the
        # message and carries no stamp of its own (dmesg and journald wrap that
        # way); a paste indented as a whole is not one long message.
        draft0 = self._nvrm
        continuation = (
            indent > 0
            and draft0 is not None
            and indent > draft0.indent
            and stamp.observed_at is None
            and stamp.uptime is None
            and stamp.bsd is None
        )
        if body.startswith("Linux version") and (self._seen_stamp
                                                 or stamp.observed_at is not None):
            # After earlier stamped lines it is a reboot (the next boot's lines count
            # apart); the first line of a log that starts at a stamped boot is that boot,
            # whose time the boot window needs.
            if self._seen_stamp and not self._bumped:
                self._boot += 1
            self._emit(out, "kernel_boot", "boot", NODE_ENTITY, stamp, body, [ev], {})
            return
        if stamp.observed_at is not None or stamp.uptime is not None or stamp.bsd is not None:
            self._seen_stamp = True

        apei = _APEI.match(body)
        if apei is not None:
            self._apei_line(apei, stamp, body, ev, out)
            return

        if not body.startswith("NVRM:"):
            at = body.find("NVRM:")
            if at > 0 and "Xid=" not in body:  # an unknown prefix before the driver message
                body = body[at:]
        if body.startswith("NVRM:"):
            rest = body[5:]
            draft = self._nvrm
            if draft is not None and (
                continuation
                or rest.startswith("  ")
                or (draft.key == "rpc_timeout" and _is_rpc_history(rest, draft.parts[0]))
                or _continues(draft, stamp, rest)
            ):
                draft.add(rest.strip(), ev)
                return
            self._flush_nvrm(out)
            self._nvrm = _Draft(
                stamp=stamp,
                parts=[rest.strip()],
                evidence=[ev],
                first_body=body,
                channel="nvrm",
                boot=self._boot,
                key="rpc_timeout" if "GSP Timeout" in rest or "RPC history" in rest else "",
                indent=indent,
            )
            return

        if self._nvrm is not None:
            self._flush_nvrm(out)

        bus_error = "PCIe Bus Error" in body
        draft = self._aer
        if draft is not None and (
            (bus_error and draft.key != "bus") or (not bus_error and "error status/mask" in body)
        ):
            draft.add(body, ev)
            if bus_error:
                draft.key = "bus"
            return
        if bus_error and "severity=" in body:
            # A bus-error report without its "AER: ... error received" header: a
            # second report of a "Multiple" message, DPC, or a paste cut above it.
            self._flush_aer(out)
            self._aer = _Draft(
                stamp=stamp,
                parts=[body],
                evidence=[ev],
                first_body=body,
                channel="aer",
                boot=self._boot,
                key="bus",
            )
            return
        aer = _AER.search(body)
        if aer is not None:
            self._flush_aer(out)
            self._aer = _Draft(
                stamp=stamp,
                parts=[body],
                evidence=[ev],
                first_body=body,
                channel="aer",
                boot=self._boot,
            )
            return
        if draft is not None and "AER:" in body:
            # recovery lines of the same report ("nvidia 0000:3b:00.0: AER: can't recover",
            # "AER: device recovery failed"): they name the devices below the port
            draft.add(body, ev)
            return
        self._single(stamp, body, ev, out)

    def _single(self, stamp: _Stamp, body: str, ev: Evidence, out: list[Record]) -> None:
        m = _KLOG_XID.search(body + " ")
        if m is not None:
            entity = _gpu_entity(m["dev"])
            self._emit(
                out,
                "xid",
                m["code"],
                entity,
                stamp,
                body,
                [ev],
                {"source": "device_plugin", "message": body},
            )
            return
        if "XID " in body:
            m = _GPUD_XID.search(body)
            if m is not None:
                self._emit(
                    out,
                    "xid",
                    m["code"],
                    _pci_entity(m["pci"]),
                    stamp,
                    body,
                    [ev],
                    {"source": "gpud", "message": body[:500]},
                )
                return
        if "marked unhealthy" in body or "Processing event" in body:
            return  # the device plugin's echo of the same NVML event
        if "fallen off the bus" in body:
            # a health checker's echo of a lost GPU without the driver's own line
            # (Slurm NHC "nvidia-smi reports GPU ... has fallen off the bus", a
            # Kubernetes node condition or event, a scontrol Reason=)
            self._emit(
                out,
                "gpu_lost",
                "fallen_off_bus",
                _entity_of(body),
                stamp,
                body,
                [ev],
                {"message": body[:500]},
            )
            return
        m = _SXID.search(body)
        if m is not None:
            fatal = (
                "no" if (m["sev"] or "").lower().startswith("non") else "yes" if m["sev"] else ""
            )
            attrs = {"message": m["msg"].strip(), "switch": m["dev"]}
            if fatal:
                attrs["fatal"] = fatal
            lm = re.search(r"Link (\d+)", m["msg"])
            if lm:
                attrs["link"] = lm[1]
            self._emit(out, "sxid", m["code"], _pci_entity(m["pci"]), stamp, body, [ev], attrs)
            return
        m = _FM_SXID.search(body)
        if m is not None:
            fatal = "no" if m["sev"].lower().startswith("non") else "yes"
            self._emit(
                out,
                "sxid",
                m["code"],
                _pci_entity(m["pci"]),
                stamp,
                body,
                [ev],
                {"fatal": fatal, "message": body, "switch": "fabric_manager"},
            )
            return
        m = _EDAC.search(body)
        if m is not None:
            self._emit(
                out,
                "host_memory",
                m["kind"],
                NODE_ENTITY,
                stamp,
                body,
                [ev],
                {"count": m["count"], "mc": m["mc"], "location": m["msg"][:200]},
            )
            return
        if _MCE_UE.search(body):
            self._emit(
                out,
                "host_memory",
                "UE",
                NODE_ENTITY,
                stamp,
                body,
                [ev],
                {"count": "1", "location": body[:200]},
            )
            return
        m = _LIMITED.search(body)
        if m is not None:
            attrs = {"available": m["avail"], "limited_by": m["by"].strip(), "capable": m["cap"]}
            if m["at"]:
                attrs["limited_at"] = m["at"]
            if m["caplink"]:
                attrs["capable_link"] = m["caplink"].strip()
            self._emit(
                out,
                "pcie_bandwidth_limited",
                "limited",
                _pci_entity(m["dev"]),
                stamp,
                body,
                [ev],
                attrs,
            )
            return
        if "available PCIe bandwidth (" in body:
            m = _FULL_BW.search(body)
            if m is not None:  # a device at its full link bandwidth (the peers of a limited one)
                attrs = {"available": m["avail"], "link": m["link"].strip()}
                self._emit(
                    out, "pcie_bandwidth", "full", _pci_entity(m["dev"]), stamp, body, [ev], attrs
                )
                return
        if "[Hardware Error]" in body and self._amd_mce(stamp, body, ev, out):
            return
        if "rror(s): " in body:
            m = _RAS_MC.search(body)
            if m is not None:  # rasdaemon / ras-mc-ctl --errors
                kind = "CE" if m["kind"].lower() == "corrected" else "UE"
                self._emit(
                    out,
                    "host_memory",
                    kind,
                    NODE_ENTITY,
                    stamp,
                    body,
                    [ev],
                    {"count": m["count"], "source": "rasdaemon", "location": m["msg"][:200]},
                )
                return
        m = _EDAC_BARE.search(body)
        if m is not None:
            self._emit(
                out,
                "host_memory",
                m["kind"],
                NODE_ENTITY,
                stamp,
                body,
                [ev],
                {"count": "1", "mc": m["mc"], "location": m["msg"][:200]},
            )
            return
        m = _FW_MISSING.search(body)
        if m is not None:
            entity = _pci_entity(m["dev"]) if m["dev"] else NODE_ENTITY
            self._emit(
                out,
                "gpu_init_failure",
                "firmware_missing",
                entity,
                stamp,
                body,
                [ev],
                {"message": body},
            )
            return
        if "nvidia-peermem" in body:
            self._emit(out, "peermem", "note", NODE_ENTITY, stamp, body, [ev], {"message": body})
            return
        m = _NVML_HANDLE.search(body)
        if m is not None:
            err = m["err"].strip()
            entity = _pci_entity(m["pci"])
            if "GPU is lost" in err:
                self._emit(
                    out, "gpu_lost", "nvml_gpu_is_lost", entity, stamp, body, [ev], {"message": err}
                )
            else:
                self._emit(
                    out,
                    "nvml_error",
                    _slug(err.split(".")[0]),
                    entity,
                    stamp,
                    body,
                    [ev],
                    {"message": err},
                )
            return
        if "No devices were found" in body:
            self._emit(out, "nvml_error", "no_devices", NODE_ENTITY, stamp, body, [ev], {})
            return
        if "NVIDIA-SMI has failed" in body:
            self._emit(out, "nvml_error", "driver_not_loaded", NODE_ENTITY, stamp, body, [ev], {})
            return
        if "Failed to initialize NVML" in body and "mismatch" not in body:
            self._emit(
                out, "nvml_error", "init_failed", NODE_ENTITY, stamp, body, [ev], {"message": body}
            )
            return
        if "busy or unavailable" in body:
            self._emit(out, "cuda_error", "busy_or_unavailable", NODE_ENTITY, stamp, body, [ev], {})
            return
        if "GPU is lost" in body or "GPU_IS_LOST" in body:
            self._emit(out, "gpu_lost", "nvml_gpu_is_lost", _entity_of(body), stamp, body, [ev], {})
            return
        m = _PROBE_FAILED.search(body)
        if m is not None:
            self._emit(
                out,
                "gpu_init_failure",
                "probe_failed",
                _pci_entity(m["a"] or m["b"]),
                stamp,
                body,
                [ev],
                {},
            )
            return
        if "mismatch" in body and "nvml" in body.lower():
            self._emit(
                out,
                "driver_mismatch",
                "nvml_version_mismatch",
                NODE_ENTITY,
                stamp,
                body,
                [ev],
                {"message": body},
            )
            return
        if _FM_FAIL.search(body):
            low = body.lower()
            if _FM_TOPOLOGY.search(body):
                code = "topology_mismatch"
            elif "support" in low and "nvswitch" not in low:
                code = "not_supported"
            else:
                code = "no_nvswitch" if "nvswitch" in low else "start_failed"
            self._emit(
                out, "fabric_manager", code, NODE_ENTITY, stamp, body, [ev], {"message": body}
            )
            return

    def _amd_mce(self, stamp: _Stamp, body: str, ev: Evidence, out: list[Record]) -> bool:
        """AMD MCE decoder lines (``[Hardware Error]: ... MC17_STATUS[...|UECC|...]``).

        The severity comes from the status line (or the "Corrected error" /
        "Uncorrected" summary line); a following "DRAM ECC error" line makes it a host
        memory error. Only uncorrected ones are emitted: the EDAC driver reports
        corrected ones itself (``EDAC MCn: 1 CE ...``).
        """
        m = _MCE_STATUS.search(body)
        if m is not None:
            flags = set(m["flags"].split("|"))
            self._mce_sev = "UE" if flags & {"UE", "UECC", "PCC"} else "CE"
            return True
        if "Corrected error, no action required" in body:
            self._mce_sev = "CE"
            return True
        if "Uncorrected," in body or "Uncorrected error" in body:
            self._mce_sev = "UE"
            return True
        if "DRAM ECC error" in body:
            if self._mce_sev == "UE":
                self._emit(
                    out,
                    "host_memory",
                    "UE",
                    NODE_ENTITY,
                    stamp,
                    body,
                    [ev],
                    {"count": "1", "source": "mce", "location": body[:200]},
                )
            self._mce_sev = ""
            return True
        return False

    @contextmanager
    def _logged_in(self, boot: int) -> Iterator[None]:
        """Emit under ``boot``, the boot a held-back message was logged in, then restore."""
        now_boot, self._boot = self._boot, boot
        try:
            yield
        finally:
            self._boot = now_boot

    # ------------------------------------------------------------- NVRM
    def _flush_nvrm(self, out: list[Record]) -> None:
        draft = self._nvrm
        self._nvrm = None
        if draft is None:
            return
        msg = " ".join(p for p in draft.parts if p)
        with self._logged_in(draft.boot):
            self._classify_nvrm(draft, msg, out)

    def _classify_nvrm(self, d: _Draft, msg: str, out: list[Record]) -> None:
        body = d.first_body
        stamp = d.stamp
        evidence = d.evidence
        m = _XID.match(body)
        if m is not None:
            rest = m["rest"] + ("" if len(d.parts) == 1 else " " + " ".join(d.parts[1:]))
            self._xid(m["pci"], m["code"], rest, stamp, evidence, out)
            return
        if body.startswith("NVRM: Xid"):
            first = evidence[0]
            self.issues.append(
                ParseIssue(file=first.file, line=first.line, reason="malformed Xid line")
            )
            return
        m = _GPU_AT.search(body)
        if m is not None:
            self._emit(
                out,
                "gpu_identity",
                "uuid",
                _pci_entity(m["pci"]),
                stamp,
                msg,
                evidence,
                {"uuid": m["uuid"]},
            )
            return
        m = _DRIVER.search(body)
        if m is not None:
            self._driver_loaded_up = stamp.uptime
            self._driver_loaded_at = stamp.observed_at
            self._emit(
                out,
                "driver_load",
                m["ver"],
                NODE_ENTITY,
                stamp,
                msg,
                evidence,
                {"driver_version": m["ver"]},
            )
            return
        entity = _entity_of(msg)
        low = msg.lower()
        if "api mismatch" in low:
            self._emit(
                out,
                "driver_mismatch",
                "api_mismatch",
                NODE_ENTITY,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif _UNSUPPORTED.search(msg):
            self._emit(
                out,
                "gpu_init_failure",
                "unsupported_gpu",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "no firmware image found" in low:
            self._emit(
                out,
                "gpu_init_failure",
                "firmware_missing",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "requiring os reboot" in low or "global fatal error" in low:
            self._emit(
                out,
                "reboot_required",
                "uvm_fatal",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "nv_err_gpu_is_lost" in low or "gpu lost from the bus" in low:
            self._emit(
                out, "gpu_lost", "gpu_is_lost", entity, stamp, msg, evidence, {"message": msg}
            )
        elif "power cables" in low or "power connector" in low:
            self._emit(
                out,
                "gpu_init_failure",
                "power_cables",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "fallen off the bus" in low:
            self._emit(
                out, "gpu_lost", "fallen_off_bus", entity, stamp, msg, evidence, {"message": msg}
            )
        elif "rminitadapter failed" in low or "rm_init_adapter failed" in low:
            self._emit(
                out,
                "gpu_init_failure",
                "rm_init_adapter",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "probe routine failed" in low or ("probe" in low and "failed" in low):
            self._emit(
                out,
                "gpu_init_failure",
                "probe_failed",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "nv_err_reset_required" in low or (
            "gsprmalloc failed" in low and "status=0x00000062" in low
        ):
            self._emit(
                out,
                "reset_required",
                "NV_ERR_RESET_REQUIRED",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "back to back gsp rpc timeout" in low:
            self._emit(
                out,
                "gsp_rpc_timeout",
                "back_to_back",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "rpcrecvpoll timedout" in low or "rpcrecvpoll timed out" in low:
            self._emit(
                out,
                "gsp_rpc_timeout",
                "rpc_recv_poll",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "gsp timeout" in low or d.key == "rpc_timeout" or "likely needs to be reset" in low:
            self._emit(
                out,
                "gsp_rpc_timeout",
                "rpc_timeout",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg, "at_boot": self._at_boot(stamp)},
            )
        elif "heartbeat timed out" in low or "heartbeat timeout" in low:
            self._emit(
                out,
                "gsp_error",
                "heartbeat_timeout",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg, "at_boot": self._at_boot(stamp)},
            )
        elif "memory subsystem error" in low:
            self._emit(
                out,
                "gsp_error",
                "memsys_error",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg, "at_boot": self._at_boot(stamp)},
            )
        elif _GSP_INIT.search(msg):
            self._emit(
                out,
                "gpu_init_failure",
                "gsp_init_failure",
                entity,
                stamp,
                msg,
                evidence,
                {"message": msg},
            )
        elif "pmuhalted" in low or "pmu has halted" in low:
            self._emit(
                out, "gsp_error", "pmu_halted", entity, stamp, msg, evidence, {"message": msg}
            )

    def _at_boot(self, stamp: _Stamp) -> str:
        """Whether a GSP failure happened while the driver was bringing the GPU up.

        Judged from uptime stamps (within 600 s of boot), or from a driver load
        line of the same log within the 300 s before (uptime or wall-clock stamps).
        """
        if stamp.uptime is not None:
            if stamp.uptime < 600.0:
                return "yes"
            loaded = self._driver_loaded_up
            if loaded is not None and 0 <= stamp.uptime - loaded < 300.0:
                return "yes"
            return "no"
        loaded_at = self._driver_loaded_at
        if stamp.observed_at is not None and loaded_at is not None:
            return "yes" if 0 <= stamp.observed_at - loaded_at < 300.0 else "no"
        return "unknown"

    def _xid(
        self,
        pci: str,
        code: str,
        rest: str,
        stamp: _Stamp,
        evidence: list[Evidence],
        out: list[Record],
    ) -> None:
        attrs: dict[str, str] = {}
        m = _PIDNAME.match(rest)
        if m is not None:
            attrs["pid"] = m["pid"].strip("'")
            attrs["process"] = m["name"].strip()
            msg = m["msg"].strip()
        else:
            m2 = _PIDONLY.match(rest)
            if m2 is not None:
                attrs["pid"] = m2["pid"].strip("'")
                msg = m2["msg"].strip()
            else:
                msg = rest.strip()
        attrs["message"] = msg[:500]
        n = int(code)
        if n == 154:
            r = _RECOVERY.search(msg)
            if r is not None:
                if r["tname"]:
                    attrs["recovery_action"] = r["tname"].strip()
                attrs["recovery_action_code"] = str(int(r["t"], 16))
                if r["fname"]:
                    attrs["recovery_action_from"] = r["fname"].strip()
        elif 144 <= n <= 150:
            r2 = _NVLINK5.search(msg)
            if r2 is not None:
                attrs["unit"] = r2["unit"]
                attrs["fatal"] = "no" if r2["fatal"].lower().startswith("non") else "yes"
                attrs["link"] = r2["link"]
                attrs["intrinfo"] = r2["intr"].lower()
                attrs["status"] = r2["status"].lower()
        elif n == 74:
            r4 = _NVLINK_REGS.search(msg)
            if r4 is not None:
                attrs["link"] = r4["link"]
                attrs["registers"] = ",".join(x.strip().lower() for x in r4["regs"].split(","))
        elif n == 45:
            r3 = _CAUSED_BY.search(msg)
            if r3 is not None:
                attrs["caused_by"] = r3[1]
        entity = _pci_entity(pci)
        burst = self._burst
        if (
            burst is not None
            and burst.entity == entity
            and burst.code == str(n)
            and _close_in_time(burst.stamp, stamp)
            and len(burst.evidence) < MAX_EVENT_LINES
        ):
            burst.evidence.extend(evidence)
            burst.messages.append(msg)
            return
        self._flush_burst(out)
        self._burst = _Burst(
            entity=entity,
            code=str(n),
            stamp=stamp,
            evidence=list(evidence),
            messages=[msg],
            attrs=attrs,
            boot=self._boot,
        )

    def _flush_burst(self, out: list[Record]) -> None:
        """Emit the Xid burst held back: Xid lines of one code and GPU within a second."""
        b = self._burst
        self._burst = None
        if b is None:
            return
        message = " | ".join(b.messages)
        if len(b.messages) > 1:
            b.attrs["message"] = message[:500]
            b.attrs["lines"] = str(len(b.messages))
        with self._logged_in(b.boot):
            self._emit(out, "xid", b.code, b.entity, b.stamp, message, b.evidence, b.attrs)

    # ------------------------------------------------------------- APEI / AER
    def _apei_line(
        self, m: re.Match[str], stamp: _Stamp, body: str, ev: Evidence, out: list[Record]
    ) -> None:
        draft = self._apei
        if draft is not None and draft.key == m["n"] and "Hardware error from APEI" not in body:
            draft.add(m["msg"], ev)
            return
        self._flush_apei(out)
        self._apei = _Draft(
            stamp=stamp,
            parts=[m["msg"]],
            evidence=[ev],
            first_body=body,
            channel="apei",
            boot=self._boot,
            key=m["n"],
        )

    def _flush_apei(self, out: list[Record]) -> None:
        d, self._apei = self._apei, None
        if d is not None:
            with self._logged_in(d.boot):
                self._flush_apei_draft(d, out)

    def _flush_apei_draft(self, d: _Draft, out: list[Record]) -> None:
        fields: dict[str, str] = {}
        for part in d.parts:
            for piece in part.split(", "):
                k, sep, v = piece.partition(":")
                if sep:
                    key = k.strip().lower()
                    if key == "device_id" and "device_id" in fields:
                        key = "pci_device_id"
                    fields.setdefault(key, v.strip())
        section = fields.get("section_type", "").lower()
        sev = fields.get("event severity", fields.get("severity", "")).lower()
        msg = "; ".join(d.parts)
        if "pcie" in section:
            code = {"corrected": "corrected", "fatal": "uncorrected_fatal"}.get(
                sev, "uncorrected_nonfatal"
            )
            dev = fields.get("device_id", "")
            attrs = {"source": "apei", "severity": sev, "message": msg[:500]}
            vendor = fields.get("vendor_id", "")
            if vendor:
                attrs["vendor_id"] = vendor.lower().removeprefix("0x").zfill(4)
            if "pci_device_id" in fields:
                attrs["device_id"] = fields["pci_device_id"].lower().removeprefix("0x")
            if "slot" in fields:
                attrs["slot"] = fields["slot"]
            attrs["port_type"] = fields.get("port_type", "")
            self._emit(out, "pcie_aer", code, _pci_entity(dev), d.stamp, msg, d.evidence, attrs)
        elif "memory" in section:
            code = "CE" if sev == "corrected" else "UE"
            self._emit(
                out,
                "host_memory",
                code,
                NODE_ENTITY,
                d.stamp,
                msg,
                d.evidence,
                {"count": "1", "source": "apei", "location": msg[:200]},
            )

    def _flush_aer(self, out: list[Record]) -> None:
        d, self._aer = self._aer, None
        if d is not None:
            with self._logged_in(d.boot):
                self._flush_aer_draft(d, out)

    def _flush_aer_draft(self, d: _Draft, out: list[Record]) -> None:
        msg = " ".join(d.parts)
        m = _AER.search(d.parts[0])
        attrs: dict[str, str] = {"source": "aer", "message": msg[:500]}
        dev: str | None
        if m is not None:
            sev = m["sev"].lower()
            dev = m["dev"]
            if m["port"]:
                attrs["port"] = m["port"]
        else:  # a bus-error report without its header
            s0 = _PCIE_SEV.search(d.parts[0])
            if s0 is None:
                return
            sev = s0["sev"].lower()
            p0 = _DEV_PREFIX.search(d.parts[0])
            dev = p0["dev"] if p0 is not None else None
        code = (
            "corrected"
            if sev.startswith("correct")
            else "uncorrected_fatal"
            if "(fatal)" in sev
            else "uncorrected_nonfatal"
        )
        for part in d.parts[0 if m is None else 1 :]:
            p = _DEV_PREFIX.match(part)
            if p is not None:
                dev = dev or p["dev"]
                if p["dev"].lower() == (dev or "").lower():
                    attrs.setdefault("driver", p["drv"])
                elif p["drv"].startswith("nvidia"):
                    attrs["gpu_below"] = p["dev"].lower()
            v = _VENDOR_DEV.search(part)
            if v is not None:
                attrs["vendor_id"] = v["v"].lower()
                attrs["device_id"] = v["d"].lower()
            s = _PCIE_SEV.search(part)
            if s is not None:
                attrs.setdefault(
                    "type", part.split("type=")[-1].split(",")[0] if "type=" in part else ""
                )
        entity = _pci_entity(dev) if dev else NODE_ENTITY
        self._emit(out, "pcie_aer", code, entity, d.stamp, msg, d.evidence, attrs)

    # ------------------------------------------------------------- emit
    def _emit(
        self,
        out: list[Record],
        kind: str,
        code: str,
        entity: EntityId,
        stamp: _Stamp,
        message: str,
        evidence: Sequence[Evidence],
        attrs: dict[str, str],
        boot: int | None = None,
    ) -> None:
        attrs["boot"] = str(self._boot if boot is None else boot)
        if stamp.uptime is not None:
            attrs.setdefault("uptime_seconds", f"{stamp.uptime:.6f}")
        event = Event(
            kind=kind,
            code=code,
            node=self.ctx.node,
            entity=entity,
            observed_at=stamp.observed_at,
            message=message[:1000],
            attrs=attrs,
            evidence=tuple(evidence),
            source=SOURCE,
        )
        if stamp.bsd is None:
            out.append(event)
            return
        if self._year is not None and not self._pending:
            out.append(self._dated(event, stamp.bsd))
            return
        self._pending.append(_Pending(event=event, bsd=stamp.bsd))
        if self._year is not None:
            self._release_pending(out)
        elif len(self._pending) >= MAX_YEAR_PENDING:
            self._year = _assumed_year(self._pending[0].bsd)
            self._release_pending(out)

    def _dated(self, event: Event, bsd: tuple[int, int, int, int, int]) -> Event:
        year = self._year
        assert year is not None
        if self._last_month and bsd[0] + 6 < self._last_month:  # December -> January
            year += 1
            self._year = year
        self._last_month = bsd[0]
        attrs = dict(event.attrs)
        if self.ctx.default_year is None and not self._year_from_file:
            attrs["year_assumed"] = str(year)
        try:
            at = self._bsd_time(bsd, year)
        except (ValueError, OverflowError):
            at = None
        return replace(event, observed_at=at, attrs=attrs)

    def _release_pending(self, out: list[Record]) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            out.append(self._dated(p.event, p.bsd))


def _assumed_year(bsd: tuple[int, int, int, int, int]) -> int:
    """The current year, or the one before when the stamp would lie in the future.

    Examples:
        >>> _assumed_year((1, 1, 0, 0, 0)) == datetime.now(UTC).year
        True
    """
    now = datetime.now(UTC)
    month, day = bsd[0], bsd[1]
    if (month, day) > (now.month, now.day + 1):
        return now.year - 1
    return now.year


def _continues(draft: _Draft, stamp: _Stamp, rest: str) -> bool:
    """Whether an unindented NVRM line goes on the message before it (journald splits them).

    True when both lines carry the same stamp, the previous part does not end a
    sentence and this one starts in lower case or with ``(``.
    """
    if (stamp.observed_at, stamp.uptime, stamp.bsd) != (
        draft.stamp.observed_at,
        draft.stamp.uptime,
        draft.stamp.bsd,
    ):
        return False
    if stamp.observed_at is None and stamp.uptime is None and stamp.bsd is None:
        return False
    text = rest.lstrip()
    last = draft.parts[-1].rstrip()
    return bool(text) and (text[0].islower() or text[0] == "(") and last[-1:] not in (".", "!", ":")


_FUNC = re.compile(r"^\s*(?:GPU\d+ )?(\w+):")


def _is_rpc_history(rest: str, banner: str) -> bool:
    """Whether an NVRM line belongs to the GSP-timeout report opened by ``banner``."""
    if "RPC history" in rest or "RPC event history" in rest or "Serial Number" in rest:
        return True
    a, b = _FUNC.match(rest), _FUNC.match(banner)
    return a is not None and b is not None and a[1] == b[1]


def _iso(text: str) -> float | None:
    t = text.replace(",", ".").replace(" ", "T", 1)
    if t.endswith("Z"):
        t = t[:-1] + "+00:00"
    m = re.match(r"(.*?T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", t)
    if m is None:
        return None
    frac = (m[2] or "")[:7]
    tz = m[3]
    if re.fullmatch(r"[+-]\d{4}", tz):
        tz = tz[:3] + ":" + tz[3:]
    try:
        dt = datetime.fromisoformat(m[1] + frac + tz)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _pci_entity(text: str) -> EntityId:
    pci = normalize_pci_bus_id(text)
    return EntityId(pci) if pci is not None else NODE_ENTITY


def _gpu_entity(text: str) -> EntityId:
    if text.startswith("GPU-"):
        return EntityId(text)
    return _pci_entity(text)


def _entity_of(msg: str) -> EntityId:
    """Return the GPU a driver message names: PCI id, else ``GPU<n>`` index, else the node."""
    m = _PCI_ANY.search(msg)
    if m is not None:
        pci = normalize_pci_bus_id(m[1])
        if pci is not None:
            return EntityId(pci)
    m2 = _GPU_N.match(msg)
    if m2 is not None:
        return EntityId(gpu_index_entity(m2[1]))
    return NODE_ENTITY


_PDSH = re.compile(
    r"(?P<host>[A-Za-z0-9][\w.-]*): (?=\[\s*\d|\[" + _DAY + " |" + _MON + r" [ \d]\d |"
    r"\d{4}-\d\d-\d\d|NVRM: |kernel: )"
)
_NOT_HOSTS = frozenset({"NVRM", "kernel", "kern", "nvidia", "Xid", "SXid"})


def _unwrap(text: str) -> tuple[str | None, str]:
    """Return the host a line names outside the kernel-log prefix, and the line to parse.

    Handles ``journalctl -o json`` (``_HOSTNAME``, ``__REALTIME_TIMESTAMP``,
    ``MESSAGE``) and the ``host: `` prefix of pdsh and clush.

    Examples:
        >>> _unwrap("gpu-017: [ 5.0] NVRM: Xid (PCI:0000:01:00): 79, x")
        ('gpu-017', '[ 5.0] NVRM: Xid (PCI:0000:01:00): 79, x')
        >>> _unwrap('{"MESSAGE":"NVRM: x","_HOSTNAME":"n1","__REALTIME_TIMESTAMP":"1000000"}')
        ('n1', '1970-01-01T00:00:01.000000+00:00 n1 kernel: NVRM: x')
    """
    if text[:1] == "{":
        if '"MESSAGE"' not in text:
            return None, text
        try:
            obj = json.loads(text)
        except ValueError:
            return None, text
        if not isinstance(obj, dict) or not isinstance(obj.get("MESSAGE"), str):
            return None, text
        msg = obj["MESSAGE"]
        host = obj.get("_HOSTNAME")
        host = host if isinstance(host, str) and host else None
        stamp = obj.get("__REALTIME_TIMESTAMP")
        if isinstance(stamp, str) and stamp.isdigit():
            usec = int(stamp)
            iso = datetime.fromtimestamp(usec // 1_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            where = f"{host} kernel" if host else "kernel"
            return host, f"{iso}.{usec % 1_000_000:06d}+00:00 {where}: {msg}"
        return host, msg
    m = _PDSH.match(text)
    if m is None or m["host"] in _NOT_HOSTS:
        return None, text
    return m["host"], text[m.end() :]


def _host_of(text: str) -> str | None:
    """The host a raw kernel-log line names, if any."""
    host, rest = _unwrap(text) if text[:1] == "{" or text[:1].isalnum() else (None, text)
    if host is not None:
        return host
    m = _PREFIX.match(rest)
    if m is None:
        return None
    return m["rhost"] or m["ihost"] or m["bhost"] or m["r5host"]


def _relabel(record: Record) -> Record:
    """An event with its node set to the host its first line names."""
    if not isinstance(record, Event) or not record.evidence:
        return record
    host = _host_of(record.evidence[0].text.replace("#012", " ").replace("#011", " "))
    return record if host is None else replace(record, node=NodeName(host))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:40] or "error"


# ---------------------------------------------------------------------- detect
_STAMPED = re.compile(
    # uptime stamps have at most 9 integer digits (30 years); 10 is an epoch (UCX, others)
    r"^(?:<\d+>)?(?:\[\s*\d{1,9}\.\d+\]|\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) "
    + _MON
    + r" |"
    + _MON
    + r" [ \d]\d \d\d:\d\d:\d\d \S+(?: kernel)?|"
    + _ISO
    + r"\s+\S+\s+kernel|"
    r"[\w.:-]+:\s+kern:|kern\s*:|\["
    + _MON
    + r" [ \d]?\d \d{4} [\d:]{8}(?:\.\d+)?\] \[|"
    + _DAY
    + r" "
    + _ISO
    + r")"
)
_DRIVER_WORDS = re.compile(
    r"NVRM:|\bXid\b|XidCriticalError|SXid|EDAC |AER: |\[Hardware Error\]|PCIe Bus Error|"
    r"XID \d|GPU_IS_LOST|Corrected error\(s\): memory|Uncorrected error\(s\): memory"
)


class KernelLogParser:
    """Artifact parser for kernel logs in every common stamp format (kind ``kernel_log``)."""

    kind = "kernel_log"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score 0-100 from the first lines' stamps and driver messages; the command is a hint."""
        head = lines[:_DETECT_LINES]
        if not head:
            return 0
        stamped = driver = 0
        for line in head:
            text = line.text
            if _STAMPED.match(text):
                stamped += 1
            if _DRIVER_WORDS.search(text):
                driver += 1
        if driver:
            score = 90
        elif stamped * 2 >= len(head):
            score = 60
        elif any(_DRIVER_WORDS.search(line.text) for line in lines[_DETECT_LINES:]):
            # Driver messages deep in an unstamped block (``journalctl -o cat``, a
            # container log): claim it only when no other parser does.
            score = 40
        elif stamped:
            score = 25
        else:
            score = 0
        if score and command and ("dmesg" in command or "journalctl" in command):
            score = min(100, score + 10)
        return score

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start a session for one section."""
        return KernelLogSession(ctx=ctx)


_SMI_ERROR = re.compile(
    r"Unable to determine the device handle|GPU is lost|No devices were found|"
    r"NVIDIA-SMI has failed|Failed to initialize NVML|"
    r"CUDA-capable device\(s\) is/are busy or unavailable|fallen off the bus"
)


class NvidiaSmiErrorParser:
    """Artifact parser for NVML/CUDA error text printed when GPUs are gone.

    Kind ``nvidia_smi_error``; it shares the kernel-log line parser.
    """

    kind = "nvidia_smi_error"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 70 when the block holds NVML or CUDA device-loss messages, else 0."""
        del command
        for line in lines[:_DETECT_LINES]:
            if _SMI_ERROR.search(line.text):
                return 70
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start a session (the same line parser as the kernel log)."""
        return KernelLogSession(ctx=ctx)


PARSERS: tuple[ArtifactParser, ...] = (KernelLogParser(), NvidiaSmiErrorParser())


def parse_kernel_lines(texts: Iterable[str], ctx: ParseContext) -> Iterator[Event]:
    """Parse raw kernel-log lines (numbered from 1) into events; for callers and tests."""
    session = KernelLogSession(ctx=ctx)
    for number, text in enumerate(texts, start=1):
        for record in session.feed([Line(number, text)]):
            if isinstance(record, Event):
                yield record
    for record in session.close():
        if isinstance(record, Event):
            yield record


# ---------------------------------------------------------------------- live collector
JOURNAL_DIRS: tuple[str, ...] = ("/var/log/journal", "/run/log/journal")
"""Where journald keeps its files; ``auto`` picks the journal only when it has entries."""

KMSG_PATH = "/dev/kmsg"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
STATE_FILE = "kernel_log.state.json"
"""Name of the position file the collector keeps in ``state_dir``."""


def _dir_has_files(path: str) -> bool:
    """Whether ``path`` holds at least one file (journald keeps them one level down)."""
    try:
        for _root, _dirs, files in os.walk(path):
            if files:
                return True
    except OSError:
        return False
    return False


def _read_boot_id() -> str:
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


class KernelLogCollector:
    """Live kernel-log collector: follows the journal, ``/dev/kmsg`` or a file.

    At start it reads the current boot's backlog (faults logged at boot or while
    the service was down), then follows: ``/dev/kmsg`` from the start of its ring
    buffer, ``journalctl -k -b`` from the first entry of this boot, a file from
    its beginning (with ``state_dir``) or from ``from_start``. With ``state_dir``
    the position read so far (kmsg sequence number and boot id, journal cursor,
    file inode and offset) is kept in :data:`STATE_FILE` there, so a restart goes on
    where the last run stopped instead of replaying the boot.

    Args:
        node: Name of this node, put on every event.
        path: File to follow (``source="file"``, or the fallback of ``"auto"``).
        source: ``"auto"`` (the journal when it holds entries, else ``/dev/kmsg``
            when readable, else ``path``), ``"journal"``, ``"kmsg"`` or ``"file"``.
        clock: Returns epoch seconds; stamps events whose line carries no absolute time.
        poll_interval_seconds: How long the file follower waits between reads when
            there is nothing new, seconds.
        sleep: The wait function (injectable so tests never sleep).
        from_start: Without ``state_dir``: read a followed file from its beginning
            instead of its end (the journal and ``/dev/kmsg`` always start at the boot).
        state_dir: Folder for the position file; ``None`` keeps no state (each start
            reads the whole current-boot backlog).

    Attributes:
        chosen_source: After :meth:`stream` started: ``"journal"``, ``"kmsg"`` or
            ``"file"`` (why is logged once at INFO).

    Raises:
        ValueError: Unknown ``source`` or a non-positive poll interval.
    """

    name = "kernel_log"

    def __init__(
        self,
        *,
        node: str,
        path: str | None = None,
        source: str = "auto",
        clock: Clock = system_clock,
        poll_interval_seconds: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
        from_start: bool = False,
        state_dir: str | None = None,
    ) -> None:
        if source not in ("auto", "journal", "kmsg", "file"):
            raise ValueError(f"unknown kernel log source {source!r}: auto, journal, kmsg or file")
        if poll_interval_seconds <= 0:
            raise ValueError("poll_interval_seconds must be positive")
        self.node = node
        self.path = path
        self.source = source
        self.clock = clock
        self.poll_interval_seconds = poll_interval_seconds
        self.sleep = sleep
        self.from_start = from_start
        self.state_dir = state_dir
        self._closed = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._chosen: str | None = None
        self._why = ""
        self._state: dict[str, object] = {}
        self._saved: dict[str, object] = {}
        self._monotonic: Callable[[], float] = time.monotonic

    @property
    def chosen_source(self) -> str | None:
        """The source :meth:`stream` reads (``None`` before it starts)."""
        return self._chosen

    @property
    def chosen_reason(self) -> str:
        """Why that source was chosen (empty before :meth:`stream` starts)."""
        return self._why

    def collect(self) -> list[Record]:
        """Return nothing: this collector streams (see :meth:`stream`)."""
        return []

    def close(self) -> None:
        """Ask :meth:`stream` to return soon."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()

    # ------------------------------------------------------------ choice
    def _probe_journal(self) -> tuple[bool, str]:
        if shutil.which("journalctl") is None:
            return False, "journalctl is not installed"
        try:
            probe = subprocess.run(
                ["journalctl", "-k", "-b", "-n", "1", "-q", "--no-pager"],
                capture_output=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return False, f"journalctl -k failed to run ({exc})"
        if probe.returncode != 0:
            return False, f"journalctl -k -b exited with status {probe.returncode}"
        if probe.stdout.strip():
            return True, "journalctl -k -b returned kernel messages of this boot"
        for folder in JOURNAL_DIRS:
            if _dir_has_files(folder):
                return True, f"journal files found in {folder}"
        return False, (
            "journalctl -k -b returned nothing and "
            + " and ".join(JOURNAL_DIRS)
            + " hold no journal files"
        )

    def _choose(self) -> str:
        if self.source != "auto":
            if self.source == "file" and not self.path:
                raise CollectorUnavailable("kernel_log source 'file' needs a path")
            return self._chose(self.source, "configured")
        ok, why = self._probe_journal()
        if ok:
            return self._chose("journal", why)
        reasons = [why]
        if os.access(KMSG_PATH, os.R_OK):
            return self._chose("kmsg", f"{why}; {KMSG_PATH} is readable")
        reasons.append(f"{KMSG_PATH} is not readable")
        if self.path:
            return self._chose("file", "; ".join(reasons) + f"; following {self.path}")
        raise CollectorUnavailable(
            "no readable kernel log: " + "; ".join(reasons) + " and no path was given"
        )

    def _chose(self, kind: str, why: str) -> str:
        self._chosen, self._why = kind, why
        logger.info("kernel_log: reading %s (%s)", self._source_name(kind), why)
        return kind

    def _source_name(self, kind: str) -> str:
        if kind == "journal":
            return "journal"
        if kind == "kmsg":
            return KMSG_PATH
        return self.path or ""

    # ------------------------------------------------------------ state
    def _state_path(self) -> str | None:
        return None if self.state_dir is None else os.path.join(self.state_dir, STATE_FILE)

    def _load_state(self, kind: str) -> dict[str, object]:
        path = self._state_path()
        if path is None:
            return {}
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            logger.warning("kernel_log: unreadable state file %s: starting over", path)
            return {}
        if not isinstance(data, dict) or data.get("source") != kind:
            return {}
        return data

    def _save_state(self) -> None:
        path = self._state_path()
        if path is None or not self._state or self._state == self._saved:
            return
        tmp = f"{path}.tmp"
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self._state, fh)
            os.replace(tmp, path)
            self._saved = dict(self._state)
        except OSError as exc:
            logger.warning("kernel_log: cannot write state file %s: %s", path, exc)

    # ------------------------------------------------------------ stream
    def stream(self) -> Iterator[Event]:
        """Yield events as kernel-log lines arrive, until :meth:`close` is called.

        Multi-line messages are finished when the source goes quiet for one poll
        interval, so an event is never held back waiting for a next line. The
        position is saved (with ``state_dir``) when the source goes quiet and at the end.

        Raises:
            CollectorUnavailable: No source can be read.
        """
        kind = self._choose()
        saved = self._load_state(kind)
        self._state = dict(saved)
        self._saved = dict(saved)
        if kind == "journal":
            lines: Iterator[str | None] = self._journal(saved)
        elif kind == "kmsg":
            lines = self._kmsg(saved)
        else:
            assert self.path is not None
            lines = self._follow(self.path, saved)
        # A live line without a year (classic syslog, kern.log) is from this year: it must
        # not wait for a stamp that carries one, or the event is held back indefinitely.
        this_year = time.gmtime(self.clock()).tm_year
        session = KernelLogSession(
            ctx=ParseContext(
                file=self._source_name(kind), node=NodeName(self.node), default_year=this_year
            ),
            split_hosts=False,
        )
        number = 0
        for text in lines:
            if text is None:  # idle
                yield from self._live(session.flush(), kind)
                self._save_state()
            else:
                number += 1
                yield from self._live(session.feed([Line(number, text)]), kind)
            if self._closed:
                break
        yield from self._live(session.close(), kind)
        self._save_state()  # not when the consumer stops early: replay beats loss

    def _live(self, records: Iterable[Record], kind: str) -> Iterator[Event]:
        """Stamp events without a time; journal and kmsg lines have no number.

        A ``/dev/kmsg`` event is dated from its uptime stamp (the backlog of the boot
        is not "now"); others without a time take the clock.
        """
        for record in records:
            if not isinstance(record, Event):
                continue
            evidence = record.evidence
            if kind != "file":
                evidence = tuple(replace(e, line=None) for e in evidence)
            at = record.observed_at
            if at is None:
                at = self.clock()
                up = record.attrs.get("uptime_seconds")
                if kind == "kmsg" and up is not None:
                    at -= max(0.0, self._monotonic() - float(up))
            yield replace(record, observed_at=at, evidence=evidence)

    def _fd_lines(self, fd: int, *, records: bool) -> Iterator[str | None]:
        """Read lines from a pipe or ``/dev/kmsg``; yield ``None`` after an idle poll interval."""
        buffer = b""
        while not self._closed:
            ready, _, _ = select.select([fd], [], [], self.poll_interval_seconds)
            if not ready:
                yield None
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # /dev/kmsg: records overwritten, go on
                    continue
                raise CollectorUnavailable(f"kernel log read failed: {exc.strerror}") from exc
            if not chunk:
                if buffer:
                    yield buffer.decode("utf-8", errors="replace")
                return
            if records:  # /dev/kmsg: one record per read
                yield chunk.decode("utf-8", errors="replace").rstrip("\n")
                continue
            buffer += chunk
            *complete, rest = buffer.split(b"\n")
            buffer = rest
            for raw in complete:
                yield raw.decode("utf-8", errors="replace")

    def _journal_command(self, cursor: str | None) -> list[str]:
        cmd = ["journalctl", "-k", "-b", "-f", "-o", "json", "--no-pager"]
        if cursor:
            cmd.append(f"--after-cursor={cursor}")
        else:
            cmd += ["-n", "all"]
        return cmd

    def _journal(self, saved: dict[str, object]) -> Iterator[str | None]:
        """``journalctl -k -b -f -o json``: this boot's backlog (after the saved cursor), then new.

        JSON output carries each entry's cursor, which is saved as the position.
        """
        cursor = saved.get("cursor")
        cursor = cursor if isinstance(cursor, str) and cursor else None
        while True:
            try:
                proc = subprocess.Popen(
                    self._journal_command(cursor),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            except OSError as exc:
                raise CollectorUnavailable(f"cannot run journalctl: {exc}") from exc
            self._proc = proc
            assert proc.stdout is not None
            got = False
            try:
                for text in self._fd_lines(proc.stdout.fileno(), records=False):
                    if text is None:
                        yield None
                        continue
                    got = True
                    line = self._journal_line(text)
                    if line is not None:
                        yield line
            finally:
                if proc.poll() is None:
                    proc.terminate()
                proc.stdout.close()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                self._proc = None
            if self._closed or got or cursor is None or proc.returncode == 0:
                return
            # the saved cursor is gone (journal vacuumed or rotated away): read the boot
            logger.info("kernel_log: saved journal cursor not found; reading the whole boot")
            cursor = None
            self._state.pop("cursor", None)

    def _journal_line(self, text: str) -> str | None:
        """One ``journalctl -o json`` entry as a short-iso line (plain lines pass through)."""
        if text[:1] != "{":
            return text
        try:
            obj = json.loads(text)
        except ValueError:
            return text
        if not isinstance(obj, dict):
            return text
        cur = obj.get("__CURSOR")
        if isinstance(cur, str):
            self._state = {"source": "journal", "cursor": cur}
        msg = obj.get("MESSAGE")
        if not isinstance(msg, str):
            return None
        stamp = obj.get("__REALTIME_TIMESTAMP")
        if isinstance(stamp, str) and stamp.isdigit():
            usec = int(stamp)
            iso = datetime.fromtimestamp(usec // 1_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            return f"{iso}.{usec % 1_000_000:06d}+00:00 kernel: {msg}"
        return msg

    def _kmsg(self, saved: dict[str, object]) -> Iterator[str | None]:
        """``/dev/kmsg`` from the start of its ring buffer (this boot), skipping what was read."""
        try:
            fd = os.open(KMSG_PATH, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise CollectorUnavailable(f"cannot read {KMSG_PATH}: {exc.strerror}") from exc
        boot_id = _read_boot_id()
        last = saved.get("seq")
        skip_to = last if isinstance(last, int) and saved.get("boot_id") == boot_id else -1
        try:
            for record in self._fd_lines(fd, records=True):
                if record is None:
                    yield None
                    continue
                m = _KMSG.match(record)
                if m is None:
                    continue
                seq = int(m["seq"])
                if seq <= skip_to:
                    continue
                self._state = {"source": "kmsg", "boot_id": boot_id, "seq": seq}
                line = kmsg_to_dmesg(record)
                if line is not None:
                    yield line
        finally:
            os.close(fd)

    def _follow(self, path: str, saved: dict[str, object]) -> Iterator[str | None]:
        """Follow ``path`` like ``tail -F``: survive rotation and truncation; wait while gone.

        The first open starts at the saved offset when the inode is the same and the
        file not shorter, else at the beginning (with ``state_dir``), else at
        ``from_start``'s choice.
        """
        handle = None
        inode: int | None = None
        buffer = b""
        first = True
        idle = False
        try:
            while not self._closed:
                if handle is None:
                    try:
                        handle = open(path, "rb")  # noqa: SIM115
                    except OSError:
                        first = False
                        yield None
                        self.sleep(self.poll_interval_seconds)
                        continue
                    st0 = os.fstat(handle.fileno())
                    inode = st0.st_ino
                    if first:
                        handle.seek(self._file_start(saved, st0))
                    first = False
                    buffer = b""
                raw = handle.read(65536)
                if raw:
                    idle = False
                    buffer += raw
                    *complete, buffer = buffer.split(b"\n")
                    self._state = {
                        "source": "file",
                        "path": path,
                        "inode": inode,
                        "offset": handle.tell() - len(buffer),
                    }
                    for one in complete:
                        yield one.decode("utf-8", errors="replace")
                    continue
                try:
                    st: os.stat_result | None = os.stat(path)
                except OSError:
                    st = None
                if st is None or st.st_ino != inode:  # rotated or removed: drained, reopen
                    handle.close()
                    handle = None
                    if buffer:
                        yield buffer.decode("utf-8", errors="replace")
                        buffer = b""
                    continue
                if st.st_size < handle.tell():  # truncated in place
                    handle.seek(0)
                    buffer = b""
                    continue
                if not idle:
                    idle = True
                    yield None
                self.sleep(self.poll_interval_seconds)
        finally:
            if handle is not None:
                handle.close()

    def _file_start(self, saved: dict[str, object], st: os.stat_result) -> int:
        if self.state_dir is None:
            return 0 if self.from_start else st.st_size
        off = saved.get("offset")
        if (
            saved.get("inode") == st.st_ino
            and saved.get("path") == self.path
            and isinstance(off, int)
            and 0 <= off <= st.st_size
        ):
            return off
        return 0


_KMSG = re.compile(r"^(?P<pri>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;(?P<msg>.*)$")


def kmsg_to_dmesg(record: str) -> str | None:
    """Turn one ``/dev/kmsg`` record into a ``dmesg`` line; ``None`` for its ``KEY=value`` lines.

    Examples:
        >>> kmsg_to_dmesg("4,1234,1843308145,-;NVRM: Xid (PCI:0000:b1:00): 79, pid=1")
        '[ 1843.308145] NVRM: Xid (PCI:0000:b1:00): 79, pid=1'
        >>> kmsg_to_dmesg(" SUBSYSTEM=pci") is None
        True
    """
    m = _KMSG.match(record)
    if m is None:
        return None
    usec = int(m["usec"])
    return f"[{usec // 1_000_000:5d}.{usec % 1_000_000:06d}] {m['msg']}"


def boot_event(node: str, proc_stat: str = "/proc/stat") -> Event | None:
    """This machine's latest boot as a ``kernel_boot`` event (``btime`` of ``/proc/stat``).

    The live service follows the kernel log from where it is now, so the ``Linux
    version`` line of the current boot is usually behind it; the boot window
    (:mod:`analytics.fault_model.boot`) needs the boot time all the same. ``None`` when
    ``/proc/stat`` cannot be read (not Linux).
    """
    try:
        with open(proc_stat, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("btime "):
                    at = float(line.split()[1])
                    return Event(kind="kernel_boot", code="boot", node=NodeName(node),
                                 entity=NODE_ENTITY, observed_at=at,
                                 attrs={"source": proc_stat})
    except (OSError, ValueError, IndexError):
        return None
    return None
