"""dcgm-exporter ``/metrics``: an artifact parser and a live collector.

Both read the Prometheus text exposition format with ``prometheus_client``'s
parser and map ``DCGM_FI_*`` series to catalogued names through
:data:`core.catalog.BY_DCGM` and ``dcgm_scale`` (ecosystem-reference §2, §11),
plus :data:`EXTRA_SERIES` for series that share a catalogued metric with another
(``DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS`` beside the uncorrectable one...).

* The GPU entity comes from the ``pci_bus_id`` label, else ``UUID``/``uuid``,
  else ``gpu`` (``gpu:<index>``); the node from ``Hostname``/``hostname``.
* ``DCGM_FI_DEV_XID_ERRORS`` is the *last* Xid (a pointer, not a count): it becomes
  ``gpu_last_xid``, never an Xid count.
* DCGM blank sentinels (int64 ``0x7ffffffffffffff0`` and up, int32
  ``0x7ffffff0`` and up, FP64 ``2**47`` and up, ~1e38 float blanks), NaN and
  infinities are omitted.
* Clock-event bitmasks (``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` /
  ``..._CLOCKS_EVENT_REASONS``) become one ``gpu_clock_event_active{reason}`` per bit;
  the windowed ``DCGM_EXP_XID_ERRORS_COUNT{xid}`` (a real count over the last
  window) becomes an ``xid`` event when above 0, and ``DCGM_EXP_CLOCK_EVENTS_COUNT``
  a ``gpu_clock_event_active`` sample.
* dcgm-exporter 1.x ``dcgm_*`` names are translated (:data:`LEGACY_NAMES`).
* Series copied from the Prometheus UI (``{a="1", b="2"}<tab>v``) parse like a
  scrape; a Prometheus HTTP API answer (``/api/v1/query`` JSON, vector or matrix)
  is turned into exposition lines first (:func:`query_result_lines`).
* Series that are not catalogued are skipped (counted at debug level).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from collectors.artifact import ArtifactParser, Line, ParseContext
from collectors.dcgm import is_blank
from collectors.nvidia_smi import CLOCK_EVENT_BITS, gpu_entity
from collectors.textparse import Session
from core.catalog import BY_DCGM, BY_NAME
from core.errors import CollectorUnavailable
from core.records import EntityId, Event, Evidence, NodeName, Record, Sample

logger = logging.getLogger(__name__)

_Mapped = tuple[str, float, dict[str, str]]


def _ecc(type_: str, scope: str, location: str) -> _Mapped:
    return ("gpu_ecc_errors_total", 1.0, {"type": type_, "scope": scope, "location": location})


def _nvlink(type_: str) -> _Mapped:
    return ("gpu_nvlink_errors_total", 1.0, {"link": "total", "type": type_})


EXTRA_SERIES: dict[str, _Mapped] = {
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": (
        "gpu_remapped_rows",
        1.0,
        {"type": "uncorrectable"},
    ),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("gpu_remapped_rows", 1.0, {"type": "correctable"}),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("gpu_row_remap_pending", 1.0, {}),
    "DCGM_FI_DEV_RETIRED_SBE": ("gpu_retired_pages", 1.0, {"cause": "multiple_sbe"}),
    "DCGM_FI_DEV_RETIRED_DBE": ("gpu_retired_pages", 1.0, {"cause": "dbe"}),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": _ecc("corrected", "volatile", "total"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": _ecc("uncorrected", "volatile", "total"),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": _ecc("corrected", "aggregate", "total"),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": _ecc("uncorrected", "aggregate", "total"),
    "DCGM_FI_DEV_ECC_DBE_VOL_DEV": _ecc("uncorrected", "volatile", "dram"),
    "DCGM_FI_DEV_ECC_DBE_VOL_SRM": _ecc("uncorrected", "volatile", "sram"),
    "DCGM_FI_DEV_ECC_DBE_AGG_DEV": _ecc("uncorrected", "aggregate", "dram"),
    "DCGM_FI_DEV_ECC_DBE_AGG_SRM": _ecc("uncorrected", "aggregate", "sram"),
    "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION": ("gpu_recovery_action", 1.0, {}),
    "DCGM_FI_DEV_GPU_RECOVERY_ACTION": ("gpu_recovery_action", 1.0, {}),
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": _nvlink("crc_flit"),
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": _nvlink("crc_data"),
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": _nvlink("replay"),
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": _nvlink("recovery"),
}
"""DCGM series mapped to a catalogued metric with fixed labels: ``(metric, scale, labels)``."""

_HEADER_PREFIXES = ("# HELP ", "# TYPE ", "# UNIT ", "# EOF")


CLOCK_EVENT_SERIES = frozenset(
    {"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"}
)
"""Bitmask series of clock event (throttle) reasons, split into ``gpu_clock_event_active``."""


LEGACY_NAMES: dict[str, str] = {
    "dcgm_memory_clock": "DCGM_FI_DEV_MEM_CLOCK",
    "dcgm_gpu_utilization": "DCGM_FI_DEV_GPU_UTIL",
    "dcgm_mem_copy_utilization": "DCGM_FI_DEV_MEM_COPY_UTIL",
    "dcgm_ecc_sbe_volatile_total": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "dcgm_ecc_dbe_volatile_total": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "dcgm_ecc_sbe_aggregate_total": "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
    "dcgm_ecc_dbe_aggregate_total": "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "dcgm_retired_pages_sbe": "DCGM_FI_DEV_RETIRED_SBE",
    "dcgm_retired_pages_dbe": "DCGM_FI_DEV_RETIRED_DBE",
    "dcgm_retired_pages_pending": "DCGM_FI_DEV_RETIRED_PENDING",
    "dcgm_nvlink_flit_crc_error_count_total": "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "dcgm_nvlink_data_crc_error_count_total": "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "dcgm_nvlink_replay_error_count_total": "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "dcgm_nvlink_recovery_error_count_total": "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    "dcgm_clock_throttle_reasons": "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
}
"""dcgm-exporter 1.x names (``etc/1.x-compatibility-metrics.csv``) whose ``DCGM_FI_*``
name is not their upper-cased suffix; the others (``dcgm_gpu_temp``...) are."""


def canonical_name(name: str) -> str:
    """The ``DCGM_FI_*`` name of a series, translating dcgm-exporter 1.x ``dcgm_*`` names.

    Examples:
        >>> canonical_name("dcgm_ecc_dbe_volatile_total")
        'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL'
        >>> canonical_name("dcgm_gpu_temp"), canonical_name("DCGM_FI_DEV_GPU_TEMP")
        ('DCGM_FI_DEV_GPU_TEMP', 'DCGM_FI_DEV_GPU_TEMP')
    """
    if name.startswith("dcgm_"):
        return LEGACY_NAMES.get(name) or "DCGM_FI_DEV_" + name[len("dcgm_") :].upper()
    return name


def _mapping(name: str) -> tuple[str, float, dict[str, str]] | None:
    name = canonical_name(name)
    extra = EXTRA_SERIES.get(name)
    if extra is not None:
        return extra
    spec = BY_DCGM.get(name)
    if spec is None:
        return None
    return spec.name, spec.dcgm_scale, {}


@dataclass(slots=True)
class ScrapeResult:
    """What one exposition text held: records, malformed lines, skipped series."""

    records: list[Record] = field(default_factory=list)
    bad_lines: list[tuple[int, str]] = field(default_factory=list)
    skipped: int = 0


def parse_exposition(
    lines: Iterable[Line],
    *,
    file: str,
    node: NodeName,
    observed_at: float | None,
    with_line_numbers: bool = True,
) -> ScrapeResult:
    """Parse dcgm-exporter exposition lines into catalogued samples.

    Each sample line is parsed on its own with ``prometheus_client``'s text
    parser, so that a malformed line names its line number and the rest still
    parses.

    Args:
        lines: The exposition, one :class:`Line` per text line.
        file: Evidence file name (a path, or the scrape URL for live scrapes).
        node: Node used when a series has no ``Hostname``/``hostname`` label.
        observed_at: Epoch seconds of the scrape, ``None`` for a pasted file.
        with_line_numbers: Put line numbers in evidence (``False`` for live scrapes).

    Returns:
        Samples (base units), malformed lines ``(line number, reason)`` and the
        count of series skipped because they are not catalogued.
    """
    result = ScrapeResult()
    for line in lines:
        text = line.text.strip()
        if not text or text.startswith("#"):
            continue
        try:
            families = list(text_string_to_metric_families(text + "\n"))
        except Exception as exc:
            result.bad_lines.append((line.number, f"malformed exposition line: {exc}"))
            continue
        for family in families:
            for sample in family.samples:
                name = canonical_name(sample.name)
                if name in CLOCK_EVENT_SERIES:
                    result.records.extend(
                        _clock_events(
                            dict(sample.labels),
                            float(sample.value),
                            line,
                            file=file,
                            node=node,
                            observed_at=observed_at,
                            with_line_numbers=with_line_numbers,
                        )
                    )
                    continue
                if name in {"DCGM_EXP_XID_ERRORS_COUNT", "DCGM_EXP_CLOCK_EVENTS_COUNT"}:
                    counted = _windowed_count(
                        name,
                        dict(sample.labels),
                        float(sample.value),
                        line,
                        file=file,
                        node=node,
                        observed_at=observed_at,
                        with_line_numbers=with_line_numbers,
                    )
                    if counted is not None:
                        result.records.append(counted)
                    continue
                record = _record(
                    sample.name,
                    dict(sample.labels),
                    float(sample.value),
                    line,
                    file=file,
                    node=node,
                    observed_at=observed_at,
                    with_line_numbers=with_line_numbers,
                )
                if record is None:
                    result.skipped += 1
                else:
                    result.records.append(record)
    return result


def _windowed_count(
    name: str,
    labels: dict[str, str],
    value: float,
    line: Line,
    *,
    file: str,
    node: NodeName,
    observed_at: float | None,
    with_line_numbers: bool,
) -> Record | None:
    """Turn dcgm-exporter's windowed counters into records.

    ``DCGM_EXP_XID_ERRORS_COUNT{xid}`` counts Xids in the last window (default
    5 min): a count above 0 becomes one ``xid`` event for the Xid rules.
    ``DCGM_EXP_CLOCK_EVENTS_COUNT{clock_event}`` becomes
    ``gpu_clock_event_active{reason}`` (1 when the event occurred in the window).
    """
    if not math.isfinite(value) or is_blank(value) or value < 0:
        return None
    if name == "DCGM_EXP_CLOCK_EVENTS_COUNT":
        reason = labels.get("clock_event", "")
        if reason not in CLOCK_EVENT_BITS.values():
            return None
        return _record(
            "gpu_clock_event_active",
            labels,
            1.0 if value > 0 else 0.0,
            line,
            file=file,
            node=node,
            observed_at=observed_at,
            with_line_numbers=with_line_numbers,
            extra_labels={"reason": reason},
        )
    xid = labels.get("xid", "")
    if value <= 0 or not xid.isdigit():
        return None
    entity = _series_gpu(labels)
    if entity is None:
        return None
    window = labels.get("window_size_in_ms", "")
    return Event(
        kind="xid",
        code=str(int(xid)),
        node=_series_node(labels, node),
        entity=entity,
        observed_at=observed_at,
        message=f"dcgm-exporter counted {value:g} Xid {int(xid)} in its window",
        attrs={"count": f"{value:g}", "window_ms": window, "xid": str(int(xid))},
        evidence=(_evidence(file, line, with_line_numbers),),
        source="dcgm_exporter",
    )


def _clock_events(
    labels: dict[str, str],
    value: float,
    line: Line,
    *,
    file: str,
    node: NodeName,
    observed_at: float | None,
    with_line_numbers: bool,
) -> list[Record]:
    """Split a clock-event bitmask into one ``gpu_clock_event_active`` sample per reason."""
    if not math.isfinite(value) or is_blank(value) or value < 0:
        return []
    mask = int(value)
    out: list[Record] = []
    for bit, reason in CLOCK_EVENT_BITS.items():
        record = _record(
            "gpu_clock_event_active",
            labels,
            1.0 if mask & bit else 0.0,
            line,
            file=file,
            node=node,
            observed_at=observed_at,
            with_line_numbers=with_line_numbers,
            extra_labels={"reason": reason},
        )
        if record is not None:
            out.append(record)
    return out


def _record(
    name: str,
    labels: dict[str, str],
    value: float,
    line: Line,
    *,
    file: str,
    node: NodeName,
    observed_at: float | None,
    with_line_numbers: bool,
    extra_labels: dict[str, str] | None = None,
) -> Record | None:
    mapping = (name, 1.0, dict(extra_labels or {})) if name in BY_NAME else _mapping(name)
    if mapping is None:
        return None
    if not math.isfinite(value) or is_blank(value):
        return None
    metric, scale, fixed = mapping
    if metric not in BY_NAME:
        return None
    entity = _series_gpu(labels)
    if entity is None:
        return None
    return Sample(
        metric=metric,
        value=value * scale,
        observed_at=observed_at,
        node=_series_node(labels, node),
        entity=EntityId(entity),
        labels=dict(fixed),
        evidence=_evidence(file, line, with_line_numbers),
    )


def _series_gpu(labels: dict[str, str]) -> EntityId | None:
    """Return the GPU a series is about: its ``pci_bus_id``, ``UUID`` or ``gpu`` index label."""
    return gpu_entity(
        bus_id=labels.get("pci_bus_id") or None,
        uuid=labels.get("UUID") or labels.get("uuid"),
        index=labels.get("gpu"),
    )


def _series_node(labels: dict[str, str], node: NodeName) -> NodeName:
    """Return the node a series names in its ``Hostname`` label, else ``node``."""
    host = labels.get("Hostname") or labels.get("hostname")
    return NodeName(host) if host else node


def _evidence(file: str, line: Line, with_line_numbers: bool) -> Evidence:
    return Evidence(file=file, line=line.number if with_line_numbers else None, text=line.text)


class DcgmExporterParser:
    """A pasted dcgm-exporter ``/metrics`` scrape (kind ``dcgm_exporter``)."""

    kind = "dcgm_exporter"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score ``DCGM_FI_*`` series lines and their HELP/TYPE comments."""
        head = "\n".join(ln.text for ln in lines[:200])
        if '"__name__"' in head and _QUERY_SERIES.search(head):
            return 85  # a Prometheus query API answer about DCGM series
        series = 0
        for line in lines[:200]:
            text = line.text.lstrip()
            if text.startswith(("DCGM_FI_", "DCGM_EXP_", "# HELP DCGM_", "# TYPE DCGM_")) or (
                text.startswith("dcgm_") and "{" in text
            ):
                series += 1
        if series == 0:
            return 0
        return min(95, 50 + 10 * series)

    def open(self, ctx: ParseContext) -> _ExporterSession:
        """Start parsing a scrape."""
        return _ExporterSession(ctx)


_QUERY_SERIES = re.compile(r'"__name__"\s*:\s*"(?:DCGM_(?:FI|EXP)_\w+|dcgm_\w+)"')


def query_result_lines(doc: Any, lines: Sequence[Line]) -> list[Line]:
    """Exposition lines for a Prometheus HTTP API answer (``/api/v1/query``).

    Each vector sample (``{"metric": {"__name__": ..., labels}, "value": [t, "v"]}``)
    or the newest point of a matrix series (``"values"``) becomes one
    ``name{labels} v`` line, numbered with the input line that names the series.
    """
    data = doc.get("data", doc) if isinstance(doc, dict) else doc
    results = data.get("result", []) if isinstance(data, dict) else data
    out: list[Line] = []
    if not isinstance(results, list):
        return out
    for item in results:
        if not isinstance(item, dict) or not isinstance(item.get("metric"), dict):
            continue
        labels = {str(k): str(v) for k, v in item["metric"].items()}
        name = labels.pop("__name__", "")
        point = item.get("value")
        if point is None and isinstance(item.get("values"), list) and item["values"]:
            point = item["values"][-1]
        if not name or not isinstance(point, list) or len(point) != 2:
            continue
        rendered = ",".join(
            f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
            for k, v in labels.items()
        )
        number = next((ln.number for ln in lines if f'"{name}"' in ln.text), lines[0].number)
        out.append(Line(number, f"{name}{{{rendered}}} {point[1]}"))
    return out


class _ExporterSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.json_lines: list[Line] = []

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        if self.json_lines or (lines and lines[0].text.lstrip().startswith(("{", "["))):
            self.json_lines.extend(lines)
            return []
        return self._parse(lines)

    def _parse(self, lines: Sequence[Line]) -> list[Record]:
        result = parse_exposition(lines, file=self.ctx.file, node=self.ctx.node, observed_at=None)
        for number, reason in result.bad_lines:
            self.issue(number, reason)
        if result.skipped:
            logger.debug("%s: %d uncatalogued series skipped", self.ctx.file, result.skipped)
        return result.records

    def close(self) -> list[Record]:
        lines, self.json_lines = self.json_lines, []
        if not lines:
            return []
        try:
            doc = json.loads("\n".join(ln.text for ln in lines))
        except json.JSONDecodeError as exc:
            index = max(1, min(exc.lineno, len(lines)))
            self.issue(
                lines[index - 1].number, f"Prometheus query answer: invalid JSON ({exc.msg})"
            )
            return []
        return self._parse(query_result_lines(doc, lines))


class DcgmExporterCollector:
    """Scrape a dcgm-exporter endpoint (default ``http://localhost:9400/metrics``).

    Args:
        node: Node name for series without a hostname label.
        url: The ``/metrics`` URL.
        timeout_seconds: HTTP timeout, seconds (> 0).

    Raises:
        ValueError: ``timeout_seconds`` is not positive or ``url`` is empty.
    """

    name = "dcgm_exporter"

    def __init__(self, *, node: str, url: str, timeout_seconds: float = 5.0) -> None:
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
        if not url:
            raise ValueError("url must not be empty")
        self.node = node
        self.url = url
        self.timeout_seconds = timeout_seconds
        self._clock: Callable[[], float] = time.time
        self.malformed_lines = 0
        self._logged_malformed = False

    def collect(self) -> list[Sample | Event]:
        """Fetch and parse one scrape.

        Returns:
            Catalogued samples (and windowed Xid events) in base units; malformed
            lines are logged once at INFO, then only counted in
            :attr:`malformed_lines`, never raised.

        Raises:
            CollectorUnavailable: The endpoint cannot be fetched (connection, timeout,
                HTTP status >= 400).
        """
        try:
            response = httpx.get(self.url, timeout=self.timeout_seconds)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise CollectorUnavailable(f"dcgm-exporter {self.url}: {exc}") from exc
        now = self._clock()
        lines = [Line(i, text) for i, text in enumerate(response.text.splitlines(), start=1)]
        result = parse_exposition(
            lines,
            file=self.url,
            node=NodeName(self.node),
            observed_at=now,
            with_line_numbers=True,
        )
        if result.bad_lines:
            self.malformed_lines += len(result.bad_lines)
            log = logger.debug if self._logged_malformed else logger.info
            self._logged_malformed = True
            log(
                "dcgm-exporter %s: %d malformed line(s), first at line %d: %s",
                self.url,
                len(result.bad_lines),
                result.bad_lines[0][0],
                result.bad_lines[0][1],
            )
        return [r for r in result.records if isinstance(r, Sample | Event)]


PARSERS: tuple[ArtifactParser, ...] = (DcgmExporterParser(),)
"""The dcgm-exporter artifact parser."""
