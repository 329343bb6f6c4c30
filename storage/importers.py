"""Importers that turn published failure records into incident history (parsing and mapping only).

Two sources (their ``SOURCE.md`` files in the shared data folder describe them):

* **Titan GPU lifetimes** (ORNL/OLCF; Ostrouchov et al., "GPU Lifetimes on Titan
  Supercomputer: Survival Analysis and Reliability", SC20, doi:10.1109/SC41405.2020.00045):
  ``gc_full.csv`` has one row per (GPU serial, location) residency with ``insert``,
  ``remove``, ``duration``, ``out`` and ``event`` (``DBE`` double-bit ECC error, ``OTB``
  off the bus, empty: no failure). Each row becomes an :class:`InventoryRecord`
  (entity = serial, node = slot = the Cray cname, model ``Tesla K20X``); each row with an
  event also becomes an :class:`IncidentRecord` detected at ``remove``: a DBE is Xid 48
  (``memory``), an OTB Xid 79 (``gpu_lost``), the two Xids the K20X driver logs for them.
  ``back_in_service_at`` is the next ``insert`` of a GPU into the same slot (the slot's
  repair time; the source does not record when the node itself returned). The batch
  (``old`` original boards, ``new`` 2017 replacements) comes from ``gc_summary_loc.csv``
  when it is beside ``gc_full.csv``; slots listed in ``titan.service.txt`` (service
  nodes) are skipped and counted. The stamps are Oak Ridge local time: read as
  ``America/New_York`` they reproduce the ``duration`` column to the second (as UTC, 16,944
  rows are an hour off). A failure event is the end of a residency, as the source's
  authors count GPU lives: the 1,158 failure rows without an ``insert`` time are further
  reports of a failure logged before the board was pulled (one GPU has 106 DBE rows within
  69 minutes), so each folds into the residency of the same serial and slot whose
  ``[insert, remove]`` it falls in (its incident's ``reports`` attribute counts them;
  1,048 of them) and is neither an incident nor a residency of its own; the 110 that fall
  in no residency stay incidents (with ``first_seen_at=None``: no operating time).
* **LANL failure data 1996-2005** (LA-UR-05-7318; Schroeder & Gibson, "A large-scale study
  of failures in high-performance computing systems", DSN 2006): one row per node
  interruption with its root-cause category (``Facilities``, ``Hardware``, ``Human Error``,
  ``Network``, ``Undetermined``, ``Software``; the sub-cause is the text in that column).
  Each row becomes an incident on node ``lanl-s<System>-n<nodenumz>`` (entity ``node``,
  model ``system-<System>``), kind = the category in snake case (``unrecorded`` for the
  453 rows that name none), code = the sub-cause, detected at ``Prob Started``, back in
  service at ``Prob Fixed``. The inventory has every node of every system (``nodes``
  column; the nodes seen when it is empty), observed from the system's first to its last
  record: the log's own observation window, the one the source's "span / records" MTBF
  uses. Stamps are Los Alamos local time (``America/Denver``). System 17's 126 rows name
  no node (nor node count): they are kept on a node ``lanl-s17`` standing for the whole
  system, counted under ``skipped["node_unknown_kept_as_system"]`` though not dropped.

Malformed rows raise :class:`core.errors.ArtifactError` naming the file and line, or, with
``strict=False``, are skipped and counted in :attr:`ImportResult.skipped` with the first
problems kept in :attr:`ImportResult.problems`.
"""

from __future__ import annotations

import bisect
import csv
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from core.errors import ArtifactError
from storage.history import IncidentRecord, InventoryRecord, cause_of

logger = logging.getLogger(__name__)

TITAN_MODEL = "Tesla K20X"
"""Titan's GPU (Cray XK7: one NVIDIA K20X per node)."""

TITAN_TIMEZONE = "America/New_York"
"""Oak Ridge local time, in which ``gc_full.csv`` is written (see the module docstring)."""

LANL_TIMEZONE = "America/Denver"
"""Los Alamos local time."""

_TITAN_EVENTS = {"DBE": ("48", "memory"), "OTB": ("79", "gpu_lost")}
_TITAN_COLUMNS = ("SN", "location", "insert", "remove", "duration", "out", "event")
_LANL_CATEGORIES = ("Facilities", "Hardware", "Human Error", "Network", "Undetermined",
                    "Software")
_LANL_LAST_RECORD = 1_167_609_600.0
"""2007-01-01 UTC: the LANL records end in 2005 (LA-UR-05-7318); later stamps are errors."""

_LANL_COLUMNS = ("System", "machine type", "nodes", "nodenumz", "Prob Started", "Prob Fixed",
                 "Down Time", *_LANL_CATEGORIES)
_MAX_PROBLEMS = 20


@dataclass(slots=True)
class ImportResult:
    """What an importer produced.

    Attributes:
        source: ``titan`` or ``lanl``.
        incidents: The failures.
        inventory: The population (residencies).
        rows: Data rows read (header excluded).
        skipped: Reason -> number of rows skipped.
        problems: The first problems met (``file:line: reason``), at most 20.
    """

    source: str
    incidents: list[IncidentRecord] = field(default_factory=list)
    inventory: list[InventoryRecord] = field(default_factory=list)
    rows: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        """Return counts for printing: rows, incidents, inventory, skipped by reason."""
        return {"source": self.source, "rows": self.rows, "incidents": len(self.incidents),
                "inventory": len(self.inventory), "skipped": dict(sorted(self.skipped.items())),
                "problems": list(self.problems)}


class _Rows:
    """Read a CSV file with a header, yielding ``(line, row)`` and checking columns."""

    def __init__(self, path: Path, required: tuple[str, ...], result: ImportResult,
                 strict: bool) -> None:
        self.path = path
        self.required = required
        self.result = result
        self.strict = strict

    def __iter__(self) -> Iterator[tuple[int, dict[str, str]]]:
        try:
            handle = self.path.open(newline="", encoding="utf-8")
        except OSError as exc:
            raise ArtifactError(str(self.path), None, f"cannot read: {exc.strerror}") from exc
        with handle:
            reader = csv.reader(handle)
            try:
                header = next(reader)
            except StopIteration:
                raise ArtifactError(str(self.path), None, "empty file (no header)") from None
            header = [h.strip() for h in header]
            missing = [c for c in self.required if c not in header]
            if missing:
                raise ArtifactError(str(self.path), 1,
                                    f"missing column(s) {', '.join(missing)} in the header")
            width = len(header)
            for values in reader:
                line = reader.line_num
                if not values or all(not v.strip() for v in values):
                    continue
                self.result.rows += 1
                if len(values) != width:
                    self.problem(line, "bad_columns",
                                 f"{len(values)} fields where the header has {width}")
                    continue
                yield line, dict(zip(header, values, strict=True))

    def problem(self, line: int, reason: str, text: str) -> None:
        """Raise (strict) or count a malformed row."""
        if self.strict:
            raise ArtifactError(str(self.path), line, text)
        self.result.skipped[reason] += 1
        if len(self.result.problems) < _MAX_PROBLEMS:
            self.result.problems.append(f"{self.path}:{line}: {text}")


def _stamp(text: str, zone: ZoneInfo, fmt: str | None = None) -> float:
    value = datetime.strptime(text, fmt) if fmt else datetime.fromisoformat(text)
    if value.tzinfo is None:
        value = value.replace(tzinfo=zone)
    return value.timestamp()


def _titan_files(path: Path) -> tuple[Path, Path | None, Path | None]:
    if path.is_dir():
        full = path / "gc_full.csv"
        folder = path
    else:
        full = path
        folder = path.parent
    if not full.is_file():
        raise ArtifactError(str(full), None, "no such file (give gc_full.csv or its folder)")
    summary = folder / "gc_summary_loc.csv"
    service = folder / "titan.service.txt"
    return full, summary if summary.is_file() else None, service if service.is_file() else None


def _titan_batches(path: Path, result: ImportResult, strict: bool) -> dict[str, str]:
    batches: dict[str, str] = {}
    reader = _Rows(path, ("SN", "batch"), ImportResult(source="titan"), strict)
    for line, row in reader:
        sn = row["SN"].strip()
        if not sn:
            reader.problem(line, "bad_summary", "empty SN")
            continue
        batches[sn] = row["batch"].strip()
    result.skipped.update(reader.result.skipped)
    result.problems.extend(reader.result.problems[: _MAX_PROBLEMS - len(result.problems)])
    return batches


def _titan_service_slots(path: Path) -> set[str]:
    slots: set[str] = set()
    with path.open(encoding="utf-8") as handle:
        for number, text in enumerate(handle, 1):
            parts = text.split()
            if not parts:
                continue
            if len(parts) < 4:
                raise ArtifactError(str(path), number,
                                    "expected 'nid hex cname type state role' columns")
            if parts[3] == "service":
                slots.add(parts[2])
    return slots


def import_titan(path: str | Path, *, strict: bool = True,
                 timezone: str = TITAN_TIMEZONE) -> ImportResult:
    """Read the Titan GPU lifetimes into inventory and incidents (see the module docstring).

    Args:
        path: ``gc_full.csv`` or the folder holding it (with ``gc_summary_loc.csv`` and
            ``titan.service.txt`` when present).
        strict: Raise on the first malformed row (True) or skip and count it (False).
        timezone: IANA zone of the stamps.

    Returns:
        37,343 residencies and 6,367 incidents for the published files.

    Raises:
        ArtifactError: A missing file or column, or (strict) a malformed row, with the file
            and line.
    """
    full, summary, service = _titan_files(Path(path))
    zone = ZoneInfo(timezone)
    result = ImportResult(source="titan")
    batches = _titan_batches(summary, result, strict) if summary else {}
    service_slots = _titan_service_slots(service) if service else set()
    reader = _Rows(full, _TITAN_COLUMNS, result, strict)
    parsed: list[tuple[str, str, float | None, float, str, str]] = []
    for line, row in reader:
        sn = row["SN"].strip()
        slot = row["location"].strip()
        event = row["event"].strip().upper()
        out = row["out"].strip().upper()
        if not sn or not slot:
            reader.problem(line, "bad_row", "empty SN or location")
            continue
        if event and event not in _TITAN_EVENTS:
            reader.problem(line, "bad_event", f"unknown event {row['event']!r} (DBE, OTB or "
                                              "empty)")
            continue
        if out not in ("TRUE", "FALSE", "", "NA"):
            reader.problem(line, "bad_out", f"out must be TRUE or FALSE, got {row['out']!r}")
            continue
        try:
            removed = _stamp(row["remove"].strip(), zone)
            inserted = _stamp(row["insert"].strip(), zone) if row["insert"].strip() else None
        except ValueError as exc:
            reader.problem(line, "bad_time", f"bad insert/remove time: {exc}")
            continue
        if inserted is not None and inserted > removed:
            reader.problem(line, "bad_time", "insert is after remove")
            continue
        if slot in service_slots:
            result.skipped["service_slot"] += 1
            continue
        parsed.append((sn, slot, inserted, removed, event, out))
    inserts_by_slot: dict[str, list[float]] = defaultdict(list)
    for _sn, slot, inserted, _removed, _event, _out in parsed:
        if inserted is not None:
            inserts_by_slot[slot].append(inserted)
    for times in inserts_by_slot.values():
        times.sort()
    # A failure event is the end of a residency (a row with an insert time and an event,
    # as Ostrouchov et al. count GPU lives); rows without an insert time are further
    # reports of that failure logged before the board was pulled (one GPU has 106 DBE
    # rows within 69 minutes): they fold into the residency they fall in.
    residencies: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for sn, slot, inserted, removed, event, _out in parsed:
        if inserted is not None and event:
            residencies[sn, slot].append((inserted, removed))
    reports: Counter[tuple[str, str, float]] = Counter()
    for sn, slot, inserted, removed, event, _out in parsed:
        if inserted is not None or not event:
            continue
        home = next((end for start, end in sorted(residencies.get((sn, slot), []))
                     if start <= removed <= end), None)
        if home is not None:
            reports[sn, slot, home] += 1
    occurrences: Counter[tuple[str, str, float | None, float]] = Counter()
    incident_repeats: Counter[tuple[str, str, float]] = Counter()
    for sn, slot, inserted, removed, event, out in parsed:
        batch = batches.get(sn, "")
        if inserted is None and event and any(
                start <= removed <= end for start, end in residencies.get((sn, slot), [])):
            result.skipped["repeat_report"] += 1  # folded into its residency's failure
            continue
        occurrences[sn, slot, inserted, removed] += 1
        repeat = occurrences[sn, slot, inserted, removed]
        suffix = f":{repeat}" if repeat > 1 else ""
        result.inventory.append(InventoryRecord(
            entity=sn, node=slot, model=TITAN_MODEL, driver_version="", vbios_version="",
            slot=slot, first_seen_at=inserted, last_seen_at=removed,
            removed_at=removed if out == "TRUE" else None, source="titan", batch=batch,
            residency_id=suffix.lstrip(":"), attrs={"event": event, "out": out}))
        if not event:
            continue
        code, cause = _TITAN_EVENTS[event]
        incident_repeats[sn, slot, removed] += 1
        repeat = incident_repeats[sn, slot, removed]
        suffix = f":{repeat}" if repeat > 1 else ""
        back = _next_after(inserts_by_slot.get(slot, []), removed)
        result.incidents.append(IncidentRecord(
            incident_id=f"titan:{sn}:{slot}:{int(removed)}{suffix}", node=slot, entity=sn,
            kind="xid", code=code, severity="critical", cause=cause, detected_at=removed,
            out_of_service_at=removed, back_in_service_at=back, resolved_at=back,
            model=TITAN_MODEL, slot=slot, batch=batch, source="titan",
            attrs={"event": event, "removed_from_system": out.lower(),
                   "reports": str(1 + reports.get((sn, slot, removed), 0))}))
    logger.info("titan import of %s: %d rows, %d residencies, %d incidents, skipped %s",
                full, result.rows, len(result.inventory), len(result.incidents),
                dict(result.skipped))
    return result


def _next_after(times: list[float], at: float) -> float | None:
    """Return the first time in sorted ``times`` at or after ``at``, else None."""
    index = bisect.bisect_left(times, at)
    return times[index] if index < len(times) else None


def _lanl_node(system: str, number: int | None) -> str:
    """Name a LANL node; a row without a node number (system 17) names the whole system."""
    return f"lanl-s{system}" if number is None else f"lanl-s{system}-n{number}"


def _lanl_category(row: dict[str, str]) -> tuple[str, str]:
    for category in _LANL_CATEGORIES:
        text = row[category].strip()
        if text:
            return category.lower().replace(" ", "_"), text
    return "unrecorded", ""


def import_lanl(path: str | Path, *, strict: bool = True,
                timezone: str = LANL_TIMEZONE) -> ImportResult:
    """Read the LANL 1996-2005 failure records into node inventory and incidents.

    Args:
        path: ``LA-UR-05-7318-failure-data-1996-2005.csv`` or the folder holding it.
        strict: Raise on the first malformed row (True) or skip and count it (False).
        timezone: IANA zone of the stamps.

    Returns:
        23,739 incidents and one residency per node of each system for the published file.

    Raises:
        ArtifactError: A missing file or column, or (strict) a malformed row, with the file
            and line.
    """
    file = Path(path)
    if file.is_dir():
        found = sorted(file.glob("LA-UR-05-7318*.csv"))
        if not found:
            raise ArtifactError(str(file), None, "no LA-UR-05-7318*.csv in this folder")
        file = found[0]
    zone = ZoneInfo(timezone)
    result = ImportResult(source="lanl")
    reader = _Rows(file, _LANL_COLUMNS, result, strict)
    fmt = "%m/%d/%Y %H:%M"
    systems: dict[str, dict[str, object]] = {}
    nodes_seen: dict[str, set[int | None]] = defaultdict(set)
    for line, row in reader:
        system = row["System"].strip()
        try:
            number_text = row["nodenumz"].strip()
            node_number = int(number_text) if number_text else None
            started = _stamp(row["Prob Started"].strip(), zone, fmt)
            fixed_text = row["Prob Fixed"].strip()
            fixed = _stamp(fixed_text, zone, fmt) if fixed_text else None
            down_text = row["Down Time"].strip()
            down = float(down_text) if down_text else None
        except ValueError as exc:
            reader.problem(line, "bad_value", f"bad nodenumz, time or Down Time: {exc}")
            continue
        if not system.isdigit() or (node_number is not None and node_number < 0):
            reader.problem(line, "bad_value", f"System must be a number, got {system!r}, "
                           "or negative nodenumz")
            continue
        if down is not None and (not math.isfinite(down) or down < 0):
            reader.problem(line, "bad_value", f"negative or non-finite Down Time {down_text!r}")
            continue
        if started > _LANL_LAST_RECORD:
            reader.problem(line, "bad_time", "Prob Started after the data set's end (2006)")
            continue
        if fixed is None and down is not None and math.isfinite(down):
            fixed = started + down * 60.0
        if fixed is not None and fixed < started:
            reader.problem(line, "bad_time", "Prob Fixed is before Prob Started")
            continue
        kind, code = _lanl_category(row)
        node = _lanl_node(system, node_number)
        info = systems.setdefault(system, {"first": started, "last": fixed or started,
                                           "nodes": row["nodes"].strip(),
                                           "type": row["machine type"].strip()})
        info["first"] = min(float(str(info["first"])), started)
        info["last"] = max(float(str(info["last"])), fixed or started)
        nodes_seen[system].add(node_number)
        if node_number is None:
            result.skipped["node_unknown_kept_as_system"] += 1
        attrs = {"system": system, "machine_type": row["machine type"].strip(),
                 "down_time_minutes": down_text}
        if row.get("Same Event", "").strip():
            attrs["same_event"] = row["Same Event"].strip()
        result.incidents.append(IncidentRecord(
            incident_id=f"lanl:{file.name}:{line}", node=node, entity="node", kind=kind,
            code=code, severity="critical", cause=cause_of(kind, code), detected_at=started,
            out_of_service_at=started, back_in_service_at=fixed, resolved_at=fixed,
            model=f"system-{system}", slot=node, source="lanl", attrs=attrs))
    for system, info in sorted(systems.items()):
        declared = info["nodes"]
        seen = nodes_seen[system]
        count = int(str(declared)) if str(declared).isdigit() else 0
        numbers: list[int | None] = sorted(
            (set(range(count)) | seen) - {None}, key=lambda n: n if n is not None else -1)
        if None in seen:
            numbers.append(None)
        for number in numbers:
            node = _lanl_node(system, number)
            result.inventory.append(InventoryRecord(
                entity="node", node=node, model=f"system-{system}", driver_version="",
                vbios_version="", slot=node, first_seen_at=float(str(info["first"])),
                last_seen_at=float(str(info["last"])), removed_at=None, source="lanl",
                attrs={"system": system, "machine_type": str(info["type"])}))
    logger.info("lanl import of %s: %d rows, %d nodes, %d incidents, skipped %s", file,
                result.rows, len(result.inventory), len(result.incidents), dict(result.skipped))
    return result
