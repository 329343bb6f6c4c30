"""InfiniBand port counters scraped from Prometheus exporters (node_exporter, infiniband-exporter).

node_exporter's ``infiniband`` collector (``collector/infiniband_linux.go``, reading the same
``/sys/class/infiniband/<dev>/ports/<n>/counters`` files) and guilbaults/infiniband-exporter
(``perfquery`` per switch port) print the PortCounters as ``node_infiniband_<name>_total
{device="mlx5_0",port="1"} <value>`` or ``infiniband_<name>_total{guid=...,port=...}``. Each
value becomes the sample the sysfs and ``perfquery`` parsers give
(:func:`collectors.infiniband.counter_samples`), including the ``ib_counter_saturated`` event
of a legacy error counter pinned at all-ones for its width, so that one rule judges them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.infiniband import counter_samples
from collectors.textparse import Session, line_evidence
from core.records import Record

_SERIES = re.compile(
    r"^(?P<name>(?:node_)?infiniband_[a-z0-9_]+)\{(?P<labels>[^}]*)\}\s+(?P<value>[0-9.eE+]+)"
    r"(?:\s+\d+)?\s*$"
)
_LABEL = re.compile(r'(?P<k>\w+)="(?P<v>[^"]*)"')
EXPORTER_COUNTERS: tuple[tuple[str, str], ...] = (
    ("symbolerror", "SymbolErrorCounter"),
    ("linkerrorrecovery", "LinkErrorRecoveryCounter"),
    ("linkdowned", "LinkDownedCounter"),
    ("remotephysical", "PortRcvRemotePhysicalErrors"),
    ("switchrelay", "PortRcvSwitchRelayErrors"),
    ("constrainterrorstransmitted", "PortXmitConstraintErrors"),
    ("xmitconstraint", "PortXmitConstraintErrors"),
    ("constrainterrorsreceived", "PortRcvConstraintErrors"),
    ("rcvconstraint", "PortRcvConstraintErrors"),
    ("discardstransmitted", "PortXmitDiscards"),
    ("xmitdiscards", "PortXmitDiscards"),
    ("errorsreceived", "PortRcvErrors"),
    ("receiveerrors", "PortRcvErrors"),
    ("rcverrors", "PortRcvErrors"),
    ("locallinkintegrity", "LocalLinkIntegrityErrors"),
    ("excessivebufferoverrun", "ExcessiveBufferOverrunErrors"),
    ("vl15dropped", "VL15Dropped"),
    ("transmitwait", "PortXmitWait"),
    ("xmitwait", "PortXmitWait"),
)
"""Exporter metric name (underscores removed) fragment to PortCounters field; first match."""


def portcounter_of(metric: str) -> str | None:
    """Return the PortCounters field an exporter metric counts, or ``None``.

    Examples:
        >>> portcounter_of("node_infiniband_symbol_error_total")
        'SymbolErrorCounter'
        >>> portcounter_of("node_infiniband_port_data_received_bytes_total") is None
        True
    """
    flat = metric.replace("_", "").lower()
    return next((field for frag, field in EXPORTER_COUNTERS if frag in flat), None)


class IbExporterSession(Session):
    """Parse exporter series lines; each gives its sample (and saturation event) at once."""

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines."""
        out: list[Record] = []
        for line in lines:
            m = _SERIES.match(line.text.strip())
            if m is None:
                continue
            field = portcounter_of(m["name"])
            if field is None:
                continue
            labels = dict(_LABEL.findall(m["labels"]))
            device = labels.get("device") or labels.get("guid") or labels.get("hca") or "ib"
            port = labels.get("port", "1")
            try:
                value = int(float(m["value"]))
            except ValueError:
                self.issue(line.number, f"not a counter value: {m['value']!r}")
                continue
            out.extend(
                counter_samples(
                    name=field,
                    value=value,
                    node=self.ctx.node,
                    device=device,
                    port=port,
                    evidence=line_evidence(self.ctx, line),
                    observed_at=None,
                    legacy=False,
                    source="ib_exporter",
                )
            )
        return out


class IbExporterParser:
    """Prometheus text of InfiniBand exporters (``node_infiniband_*``, ``infiniband_*``)."""

    kind = "ib_exporter"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 90 when InfiniBand exporter series are most of the block."""
        del command
        sample = [ln for ln in lines[:400] if ln.text.strip()]
        series = sum(1 for ln in sample if _SERIES.match(ln.text.strip()))
        comments = sum(1 for ln in sample if ln.text.lstrip().startswith("#"))
        if series and (series + comments) * 2 >= len(sample):
            return 90
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        return IbExporterSession(ctx)


PARSERS: tuple[ArtifactParser, ...] = (IbExporterParser(),)
"""The artifact parsers of this module (read by ``collectors.parsers``)."""

__all__ = ["EXPORTER_COUNTERS", "PARSERS", "IbExporterParser", "portcounter_of"]
