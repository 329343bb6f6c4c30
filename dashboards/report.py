"""The weekly reliability report: figures from the incident history as HTML, Markdown or JSON.

:func:`build_report` reads an :class:`storage.history.IncidentHistory` for a window and
computes every figure with :mod:`analytics.reliability`; :func:`render` turns the result
into one of three formats:

* ``json``: the full figures, with stable keys (``schema`` = :data:`SCHEMA`), for machines;
* ``md``: Markdown tables for chat and tickets;
* ``html``: one self-contained page (inline CSS, plots as inline PNG data URIs drawn by
  matplotlib's ``Agg`` backend, no external resource, no JavaScript).

The sections are those of issue #8, in its order (:data:`SECTIONS`), followed by the inputs
and the caveats. A figure that cannot be computed is never invented: its section carries a
``note`` that says why ("no predictions recorded in this window"). ``docs/report.md``
explains each section and formula.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pandas as pd

from analytics import reliability as rel
from storage.history import IncidentHistory

logger = logging.getLogger(__name__)

SCHEMA = "gpuhealth.report/1"
"""The JSON report's schema name; bumped when a key changes meaning or disappears."""

SECTIONS = (
    ("availability", "Availability and GPU-hours lost"),
    ("work", "Jobs and pods hit by failures"),
    ("mtbf", "MTBF by GPU model, node and driver version"),
    ("mttr", "MTTR: detection to back in service"),
    ("causes", "Failures by cause"),
    ("repeat_offenders", "Repeat offenders and slots that fail again and again"),
    ("cohorts", "Driver and firmware cohort comparison"),
    ("predictions", "Prediction quality"),
    ("remediation", "Remediation"),
    ("checkpointing", "Recommended checkpoint interval per job size"),
    ("spare_capacity", "Spare capacity"),
    ("week_over_week", "Change from the previous window"),
    ("drills", "Drills (synthetic faults, never counted as failures)"),
)
"""Section keys and titles, in the order issue #8 lists them (with the work hit, issue
#16, after availability, and the drills of issue #18 last)."""

DRILL_ATTR = "drill"
"""``IncidentRecord.attrs`` key of a drill's incident (``gpuhealth drill``: its id). Such
an incident is left out of every failure figure and listed under ``drills``; its other
attrs (``drill_kind``, ``drill_mode``, ``drill_result``, ``drill_stages`` as JSON,
``drill_missed``, ``drill_problems``) are written by ``remediation.drill.history_attrs``."""

WORK_ATTR = "work"
"""``IncidentRecord.attrs`` key: JSON list of the jobs or pods on the node when the incident
opened (``kind``, ``id``, ``gpus``, ``started_at``, ``priority``, ``priority_class``...),
as ``remediation.priority.history_attrs`` writes it."""
PRIORITY_CLASS_ATTR = "priority_class"
"""``IncidentRecord.attrs`` key: the class of the highest-priority work the incident hit
(Slurm QOS or Kubernetes PriorityClass; ``none``: no work on the node)."""

Format = Literal["html", "md", "json"]

_WOW_KEYS = ("failures", "exposure_hours", "lost_hours", "availability", "mtbf_hours",
             "mttr_median_hours")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportOptions:
    """What to report on and how.

    Attributes:
        since: Window start (epoch s); ``None``: the start of the data.
        until: Window end (epoch s, excluded); ``None``: now if ``since`` is set, else the
            end of the data.
        source: Only this source (``gpuhealth``, ``titan``, ``lanl``); ``None``: all.
        spare_fraction: Spare capacity as a fraction of the fleet (0-1).
        confidence: Two-sided confidence level of every interval (0-1).
        job_sizes: Job sizes (nodes) for the checkpoint table.
        checkpoint_seconds: Time to write one checkpoint (s).
        prediction_threshold: Probability at or above which a prediction is positive.
        timezone: IANA zone for calendar periods and printed times.
        top: Rows shown in the long tables of the HTML/Markdown report.
        repeat_k: Failures that make a repeat offender.
        lemon_k: Failures that make a lemon slot (spread over at least two GPUs).
        cohort_columns: Inventory columns compared as cohorts, in order.
    """

    since: float | None = None
    until: float | None = None
    source: str | None = None
    spare_fraction: float = 0.15
    confidence: float = 0.90
    job_sizes: tuple[int, ...] = (1, 8, 64, 512, 4096)
    checkpoint_seconds: float = 300.0
    prediction_threshold: float = 0.5
    timezone: str = "UTC"
    top: int = 10
    repeat_k: int = 2
    lemon_k: int = 2
    cohort_columns: tuple[str, ...] = ("driver_version", "vbios_version", "batch")

    def __post_init__(self) -> None:
        if not 0.0 <= self.spare_fraction <= 1.0:
            raise ValueError(f"spare_fraction must be within 0-1, got {self.spare_fraction}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must be within (0, 1), got {self.confidence}")
        if self.checkpoint_seconds <= 0:
            raise ValueError("checkpoint_seconds must be > 0")
        if any(n < 1 for n in self.job_sizes):
            raise ValueError("job sizes must be >= 1 node")
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {self.timezone!r} (use an IANA name like "
                             "UTC or America/New_York)") from None


@dataclass(slots=True)
class _Caveats:
    items: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        if text not in self.items:
            self.items.append(text)


def _iso(at: float | None, tz: str = "UTC") -> str | None:
    if at is None:
        return None
    return pd.Timestamp(round(at), unit="s", tz="UTC").tz_convert(tz).isoformat()


def _clean(value: Any) -> Any:
    """Turn numpy scalars and NaN into JSON values (NaN -> None)."""
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [_clean(row) for row in frame.astype(object).where(frame.notna(), None)
            .to_dict("records")]


def _window(options: ReportOptions, inventory: pd.DataFrame, incidents: pd.DataFrame,
            now: float) -> rel.Window:
    if options.since is not None:
        until = options.until if options.until is not None else now
        return rel.Window(start=options.since, end=until)
    data = rel.data_window(inventory, incidents)
    if data is None:
        end = options.until if options.until is not None else now
        return rel.Window(start=end - 7 * 86400.0, end=end)
    end = options.until if options.until is not None else data.end
    return rel.Window(start=min(data.start, end - 1.0), end=end)


def _period(window: rel.Window) -> str:
    days = window.hours / 24.0
    if days <= 14:
        return "day"
    if days <= 120:
        return "week"
    if days <= 3 * 366:
        return "month"
    return "year"


def _core_figures(inventory: pd.DataFrame, incidents: pd.DataFrame, window: rel.Window,
                  confidence: float) -> dict[str, Any]:
    fleet = rel.fleet_summary(inventory, incidents, window, confidence)
    avail = rel.availability(inventory, incidents, window)
    in_window = incidents[(incidents["detected_at"] >= window.start)
                          & (incidents["detected_at"] < window.end)]
    repair = rel.mttr(in_window)
    return {"failures": fleet["failures"], "exposure_hours": fleet["exposure_hours"],
            "lost_hours": avail["lost_hours"], "availability": avail["availability"],
            "mtbf_hours": fleet["mtbf_hours"], "mttr_median_hours": repair["median_hours"]}


def build_report(history: IncidentHistory, options: ReportOptions | None = None, *,
                 now: Callable[[], float] = time.time,
                 history_path: str | None = None) -> dict[str, Any]:
    """Compute every figure of the report.

    Args:
        history: The incident history to read.
        options: Window, source and parameters (:class:`ReportOptions`).
        now: Clock (epoch s) for ``generated_at`` and an open-ended window.
        history_path: Shown in the inputs.

    Returns:
        A JSON-ready dict: ``schema``, ``generated_at``, ``title``, ``inputs``,
        ``sections`` (keyed as :data:`SECTIONS`) and ``caveats`` (list of sentences).
    """
    opts = options or ReportOptions()
    generated = now()
    inventory = history.inventory(source=opts.source)
    incidents_all = history.incidents(source=opts.source)
    incidents_all, drills_all = _split_drills(incidents_all)
    predictions = history.predictions()
    if opts.source is not None and len(predictions):
        nodes = set(inventory["node"]) | set(incidents_all["node"])
        predictions = predictions[predictions["node"].isin(nodes)]
    window = _window(opts, inventory, incidents_all, generated)
    in_window = incidents_all[(incidents_all["detected_at"] >= window.start)
                              & (incidents_all["detected_at"] < window.end)]
    caveats = _Caveats()
    fleet = rel.fleet_summary(inventory, incidents_all, window, opts.confidence)
    if fleet["exposure_hours"] == 0:
        caveats.add("No GPU or node was in the inventory during this window: exposure-based "
                    "figures (availability, MTBF, failure rates) are not available.")
    missing_start = int(pd.to_numeric(inventory["first_seen_at"], errors="coerce").isna().sum())
    if missing_start:
        caveats.add(f"{missing_start:,} residencies have no start time and contribute no "
                    "operating time (as in the source's own GPU-years).")
    sections: dict[str, Any] = {
        "availability": _availability(inventory, incidents_all, window, fleet),
        "work": _work(in_window, opts, window, caveats),
        "mtbf": _mtbf(inventory, incidents_all, window, opts, fleet, caveats),
        "mttr": _mttr(in_window, caveats),
        "causes": _causes(in_window, opts, window),
        "repeat_offenders": _repeat(in_window, opts),
        "cohorts": _cohorts(inventory, incidents_all, window, opts, caveats),
        "predictions": _predictions(predictions, incidents_all, window, opts, caveats),
        "remediation": _remediation(in_window, caveats),
        "checkpointing": _checkpointing(fleet, opts, caveats),
        "spare_capacity": _spare(inventory, incidents_all, window, fleet, opts),
        "week_over_week": _wow(inventory, incidents_all, window, opts),
        "drills": _drills(drills_all, window),
    }
    sources = sorted(set(inventory["source"]) | set(incidents_all["source"]))
    if "titan" in sources:
        caveats.add("Titan: back in service is the time the next GPU was inserted into the "
                    "same slot (the data set does not record node repairs), so MTTR and "
                    "GPU-hours lost are slot-level figures.")
    if "lanl" in sources:
        caveats.add("LANL: every record is a node interruption with its root cause; the "
                    "population is each system's declared node count over the system's "
                    "logging span.")
    inputs = {
        "window_start": _iso(window.start), "window_end": _iso(window.end),
        "window_hours": window.hours, "source": opts.source or "all",
        "sources_present": sources, "history": history_path,
        "incidents_in_window": len(in_window), "incidents_total": len(incidents_all),
        "drills_total": len(drills_all),
        "inventory_residencies": len(inventory), "predictions_total": len(predictions),
        "options": _clean(asdict(opts)),
    }
    title = "GPU fleet reliability report"
    result: dict[str, Any] = _clean({
        "schema": SCHEMA, "title": title, "generated_at": _iso(generated),
        "inputs": inputs, "sections": sections, "caveats": caveats.items,
    })
    return result


def _is_drill(attrs: Any) -> bool:
    return isinstance(attrs, Mapping) and bool(attrs.get(DRILL_ATTR))


def _split_drills(incidents: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(failures, drills)``: the incidents marked :data:`DRILL_ATTR` are drills."""
    if not len(incidents):
        return incidents, incidents
    drill = incidents["attrs"].map(_is_drill).astype(bool)
    return incidents[~drill], incidents[drill]


def _drills(drills: pd.DataFrame, window: rel.Window) -> dict[str, Any]:
    """The drills of the window: how many, passed or failed, and each one's stages."""
    in_window = drills[(drills["detected_at"] >= window.start)
                       & (drills["detected_at"] < window.end)] if len(drills) else drills
    rows: list[dict[str, Any]] = []
    for record in _records(in_window):
        attrs = record.get("attrs") or {}
        try:
            stages = json.loads(str(attrs.get("drill_stages", "{}")))
        except ValueError:
            stages = {}
        rows.append({
            "drill": str(attrs.get(DRILL_ATTR, "")), "node": record["node"],
            "kind": str(attrs.get("drill_kind", record["kind"])),
            "mode": str(attrs.get("drill_mode", "")),
            "result": str(attrs.get("drill_result", "")),
            "at": record["detected_at"],
            "stages_seconds": {str(k): v for k, v in stages.items()
                               if isinstance(v, int | float)},
            "missed": [x for x in str(attrs.get("drill_missed", "")).split(",") if x],
            "problems": str(attrs.get("drill_problems", "")),
        })
    results = Counter(r["result"] for r in rows)
    out: dict[str, Any] = {"drills": len(rows), "passed": results.get("passed", 0),
                           "failed": results.get("failed", 0), "rows": rows}
    if not rows:
        out["note"] = "no drill in this window (gpuhealth drill)"
    return out


def _availability(inventory: pd.DataFrame, incidents: pd.DataFrame, window: rel.Window,
                  fleet: Mapping[str, Any]) -> dict[str, Any]:
    avail = rel.availability(inventory, incidents, window)
    out = {**avail, "units": fleet["units"], "nodes": fleet["nodes"],
           "retired_after_failure": rel.retired_after_failure(inventory, incidents, window)}
    if avail["availability"] is None:
        out["note"] = "no exposure in this window: availability is not defined"
    return out


def _without_made_up_spans(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` (:func:`rel.mtbf_by`) with no system MTBF where the group has no exposure.

    Without a residency in the window a group has no span; the analytics then divide the
    window's length by the failures, a figure built from nothing: it is n/a.
    """
    if not len(table):
        return table
    return table.assign(system_mtbf_hours=table["system_mtbf_hours"].where(
        table["exposure_hours"] > 0))


def _mtbf(inventory: pd.DataFrame, incidents: pd.DataFrame, window: rel.Window,
          opts: ReportOptions, fleet: Mapping[str, Any], caveats: _Caveats) -> dict[str, Any]:
    fleet_out = dict(fleet)
    if not fleet["exposure_hours"]:
        # no residency in the window: no span to divide; the analytics' window / failures
        # would be the window's length, not a time between failures of a fleet
        fleet_out["system_mtbf_hours"] = None
    out: dict[str, Any] = {"fleet": fleet_out}
    for by in ("model", "driver_version", "vbios_version", "batch"):
        table = rel.mtbf_by(inventory, incidents, by, window, opts.confidence)
        table = _without_made_up_spans(table[table["group"] != ""])
        out[f"by_{by}"] = _records(table)
    by_node = _without_made_up_spans(
        rel.mtbf_by(inventory, incidents, "node", window, opts.confidence))
    out["nodes_total"] = int(fleet["nodes"])  # the nodes of Availability: in the inventory
    outside = by_node[(by_node["exposure_hours"] <= 0) & (by_node["failures"] > 0)]
    out["nodes_not_in_inventory"] = len(outside)
    if len(outside):
        caveats.add(f"{int(outside['failures'].sum()):,} failures of the window are on "
                    f"{len(outside):,} nodes with no inventory in it (no GPU or node "
                    "residency recorded): they count as failures, but the nodes have no "
                    "exposure, so their MTBF and availability are n/a.")
    out["by_node"] = _records(by_node[by_node["failures"] > 0])
    if not out["by_driver_version"]:
        caveats.add("No driver versions are recorded in the inventory: MTBF by driver "
                    "version is not available.")
    if fleet["failures"] == 0:
        out["note"] = ("no failure in this window: MTBF has only a lower bound "
                       f"({round(opts.confidence * 100)}% one-sided interval shown)")
    return out


def _work_rows(attrs: Mapping[str, str]) -> list[dict[str, Any]] | None:
    """The work an incident hit, from its ``attrs`` (``None``: not recorded)."""
    text = attrs.get(WORK_ATTR) if isinstance(attrs, Mapping) else None
    if text is None:
        return None
    try:
        rows = json.loads(text)
    except ValueError:
        return None
    if not isinstance(rows, list):
        return None
    return [r for r in rows if isinstance(r, dict) and r.get("id") is not None]


def _job_hours(row: Mapping[str, Any], hit_at: float) -> float | None:
    """GPUs held x hours from the job's start to the fault (``None``: not known)."""
    try:
        gpus = int(row.get("gpus") or 0)
        started = row.get("started_at")
        start = float(started) if started is not None else None
    except (TypeError, ValueError):
        return None
    if gpus <= 0 or start is None or not math.isfinite(start):
        return None
    return gpus * max(0.0, hit_at - start) / 3600.0


def _work(in_window: pd.DataFrame, opts: ReportOptions, window: rel.Window,
          caveats: _Caveats) -> dict[str, Any]:
    """Jobs and pods hit by the window's failures, and their GPU-hours (docs/report.md).

    A job (or pod) hit by several incidents counts once, at its first one: its GPU-hours
    are GPUs held x (that incident's detection - the job's start) / 3600, the work at
    stake since it started. Split by period and cause (the first incident's), by kind
    (each kind that hit it) and by priority class.
    """
    freq = _period(window)
    formats = {"year": "%Y", "month": "%Y-%m", "week": "%G-W%V", "day": "%Y-%m-%d"}
    first: dict[tuple[str, str], tuple[float, dict[str, Any], str, str]] = {}
    kinds: dict[tuple[str, str], set[str]] = {}
    with_data = without_data = empty = 0
    for detected, cause, kind, attrs in sorted(zip(
            in_window["detected_at"], in_window["cause"], in_window["kind"],
            in_window["attrs"], strict=True), key=lambda x: float(x[0])):
        rows = _work_rows(attrs)
        if rows is None:
            without_data += 1
            continue
        with_data += 1
        if not rows:
            empty += 1
        for row in rows:
            key = (str(row.get("kind", "")), str(row["id"]))
            kinds.setdefault(key, set()).add(str(kind))
            if key not in first:
                first[key] = (float(detected), row, str(cause), str(kind))
    total_hours = 0.0
    unknown_hours = 0
    by_period: dict[str, dict[str, Any]] = {}
    by_cause: dict[str, dict[str, Any]] = {}
    by_class: dict[str, dict[str, Any]] = {}
    by_kind: dict[str, dict[str, Any]] = {}

    def add(table: dict[str, dict[str, Any]], label: str, hours: float | None) -> None:
        row = table.setdefault(label, {"jobs": 0, "gpu_hours": 0.0})
        row["jobs"] += 1
        row["gpu_hours"] += hours or 0.0

    for key, (hit_at, row, cause, _kind) in first.items():
        hours = _job_hours(row, hit_at)
        if hours is None:
            unknown_hours += 1
        else:
            total_hours += hours
        label = pd.Timestamp(hit_at, unit="s", tz="UTC").tz_convert(opts.timezone) \
            .strftime(formats[freq])
        add(by_period, label, hours)
        add(by_cause, cause, hours)
        add(by_class, str(row.get("priority_class") or "default"), hours)
        for kind in sorted(kinds[key]):
            add(by_kind, kind, hours)
    out: dict[str, Any] = {
        "interrupted_jobs": len(first),
        "gpu_hours": total_hours,
        "jobs_without_gpu_hours": unknown_hours,
        "incidents_with_work_data": with_data,
        "incidents_without_work_data": without_data,
        "incidents_on_idle_nodes": empty,
        "period": freq,
        "by_period": dict(sorted(by_period.items())),
        "by_cause": dict(sorted(by_cause.items())),
        "by_kind": dict(sorted(by_kind.items())),
        "by_priority_class": dict(sorted(by_class.items())),
        "definition": "jobs: distinct Slurm jobs or pods on the node (or GPU) when an "
                      "incident opened; GPU-hours: GPUs held x hours from the job's start "
                      "to its first incident in the window",
    }
    if not len(in_window):
        out["note"] = "no failure in this window"
    elif not with_data:
        out["note"] = ("no incident of this window recorded the work on its node (a "
                       "scheduler that shows jobs or pods: Slurm, Kubernetes)")
    if with_data and without_data:
        caveats.add(f"{without_data:,} incident(s) of the window have no record of the work "
                    "on their node: interrupted jobs and their GPU-hours count only the "
                    f"other {with_data:,}.")
    if unknown_hours:
        caveats.add(f"{unknown_hours:,} job(s) hit have no known start time or GPU count: "
                    "counted as interrupted, with no GPU-hours.")
    return out


def _never_out(incidents: pd.DataFrame) -> pd.Series:
    """Incidents that never took a unit out of service (no out-of-service or back time).

    A dry run, or one resolved (its finding cleared, ``gpuhealth mark-healthy``) before
    anything was taken out: there is nothing to repair, so it is neither repaired nor
    "not yet repaired".
    """
    if not len(incidents):
        return pd.Series(False, index=incidents.index, dtype=bool)
    out = pd.to_numeric(incidents["out_of_service_at"], errors="coerce")
    back = pd.to_numeric(incidents["back_in_service_at"], errors="coerce")
    return out.isna() & back.isna()


def _repair_figures(incidents: pd.DataFrame) -> dict[str, Any]:
    """:func:`rel.mttr` with ``unrepaired`` only counting incidents that were taken out."""
    figures = rel.mttr(incidents)
    never = int(_never_out(incidents).sum())
    figures["unrepaired"] = max(int(figures["unrepaired"]) - never, 0)
    figures["not_out_of_service"] = never
    return figures


def _mttr(in_window: pd.DataFrame, caveats: _Caveats) -> dict[str, Any]:
    out = _repair_figures(in_window)
    out["by_cause"] = {
        str(cause): rel.mttr(group)["median_hours"]
        for cause, group in in_window.groupby("cause")} if len(in_window) else {}
    classes = [str(a.get(PRIORITY_CLASS_ATTR, "")) if isinstance(a, Mapping) else ""
               for a in in_window["attrs"]] if len(in_window) else []
    by_class: dict[str, Any] = {}
    if any(classes):
        labelled = in_window.assign(_class=classes)
        for name, group in labelled[labelled["_class"] != ""].groupby("_class"):
            figures = _repair_figures(group)
            by_class[str(name)] = {k: figures[k] for k in
                                   ("repaired", "unrepaired", "not_out_of_service",
                                    "median_hours", "mean_hours", "p90_hours")}
    out["by_priority_class"] = by_class
    if not len(in_window):
        out["note"] = "no failure in this window"
    elif out["repaired"] == 0 and out["unrepaired"] == 0:
        out["note"] = ("no incident of this window took a unit out of service (dry run, or "
                       "resolved before anything was taken out): nothing to repair")
    elif out["repaired"] == 0:
        out["note"] = "no incident of this window is back in service yet"
    if out["unrepaired"]:
        caveats.add(f"{out['unrepaired']:,} incidents of the window have no back-in-service "
                    "time (still out, or not recorded) and are left out of MTTR.")
    if out["not_out_of_service"]:
        caveats.add(f"{out['not_out_of_service']:,} incidents of the window never took a unit "
                    "out of service (dry run, or resolved before anything was taken out) and "
                    "are left out of MTTR.")
    return out


def _causes(in_window: pd.DataFrame, opts: ReportOptions, window: rel.Window) -> dict[str, Any]:
    out = rel.failures_by_cause(in_window)
    freq = _period(window)
    table = rel.failures_by_period(in_window, freq, opts.timezone)
    out["period"] = freq
    out["by_period"] = {str(k): {str(c): int(v) for c, v in row.items()}
                        for k, row in table.iterrows()}
    xid = in_window[in_window["kind"] == "xid"]["code"].value_counts()
    out["by_xid"] = {str(k): int(v) for k, v in xid.items()}
    if not len(in_window):
        out["note"] = "no failure in this window"
    return out


def _repeat(in_window: pd.DataFrame, opts: ReportOptions) -> dict[str, Any]:
    offenders = rel.repeat_offenders(in_window, opts.repeat_k, "entity", limit=None)
    nodes = rel.repeat_offenders(in_window, opts.repeat_k, "node", limit=None)
    lemons = rel.lemon_slots(in_window, opts.lemon_k, 2, limit=0)
    return {"k": opts.repeat_k, "lemon_k": opts.lemon_k,
            "entities": _records(offenders), "nodes": _records(nodes),
            "lemon_slots": _records(lemons),
            "entities_count": len(offenders), "nodes_count": len(nodes),
            "lemon_slots_count": len(lemons)}


def _cohorts(inventory: pd.DataFrame, incidents: pd.DataFrame, window: rel.Window,
             opts: ReportOptions, caveats: _Caveats) -> dict[str, Any]:
    comparisons = []
    for by in opts.cohort_columns:
        result = rel.cohort_comparison(inventory, incidents, by, window,
                                       confidence=opts.confidence)
        if result is not None:
            comparisons.append(result)
    out: dict[str, Any] = {"comparisons": comparisons}
    if not comparisons:
        out["note"] = ("fewer than two driver, firmware or batch cohorts had exposure in "
                       "this window: no comparison")
        caveats.add("No cohort comparison: the inventory records fewer than two driver, "
                    "VBIOS or batch versions in this window.")
    return out


def _predictions(predictions: pd.DataFrame, incidents: pd.DataFrame, window: rel.Window,
                 opts: ReportOptions, caveats: _Caveats) -> dict[str, Any]:
    quality = rel.prediction_quality(predictions, incidents, window,
                                     threshold=opts.prediction_threshold)
    in_window = predictions[(predictions["at"] >= window.start)
                            & (predictions["at"] < window.end)]
    quality["recorded"] = len(in_window)
    if not len(in_window):
        quality["note"] = "no predictions recorded in this window"
        caveats.add("No predictions were recorded in this window: precision, recall and "
                    "lead time are not available.")
    return quality


def _remediation(in_window: pd.DataFrame, caveats: _Caveats) -> dict[str, Any]:
    steps: Counter[str] = Counter()
    dry_steps: Counter[str] = Counter()
    approvals: Counter[str] = Counter()
    budget = breaker = with_actions = with_dry = 0
    for actions, attrs in zip(in_window["actions"], in_window["attrs"], strict=True):
        if actions and attrs.get("dry_run", "").lower() == "true":
            # recorded only: nothing was done to the node (never read as done)
            with_dry += 1
            dry_steps.update(actions)
        elif actions:
            with_actions += 1
            steps.update(actions)
        if attrs.get("approval"):
            approvals[str(attrs["approval"])] += 1
        if attrs.get("budget_blocked", "").lower() == "true":
            budget += 1
        if attrs.get("circuit_breaker"):
            breaker += 1
    out: dict[str, Any] = {
        "incidents_with_actions": with_actions, "actions": dict(sorted(steps.items())),
        "incidents_with_dry_run_actions": with_dry,
        "dry_run_actions": dict(sorted(dry_steps.items())),
        "approvals": dict(sorted(approvals.items())), "budget_blocked": budget,
        "circuit_breaker_events": breaker,
    }
    if with_dry:
        caveats.add(f"{with_dry} incident(s) had dry-run actions only: they were recorded, "
                    "nothing was done to the nodes ([remediation] dry_run).")
    if not with_actions and not with_dry and not approvals and not budget and not breaker:
        out["note"] = "no remediation recorded for the incidents of this window"
    return out


def _checkpointing(fleet: Mapping[str, Any], opts: ReportOptions,
                   caveats: _Caveats) -> dict[str, Any]:
    node_mtbf = fleet.get("node_mtbf_hours")
    rows = rel.checkpoint_table(node_mtbf, opts.job_sizes, opts.checkpoint_seconds)
    out: dict[str, Any] = {
        "node_mtbf_hours": node_mtbf, "checkpoint_seconds": opts.checkpoint_seconds,
        "formulas": {"young": "sqrt(2 C M) (Young 1974)",
                     "daly": "sqrt(2 C M)[1 + sqrt(C/2M)/3 + (C/2M)/9] - C, C < 2M "
                             "(Daly 2006)",
                     "job_mtbf": "M = node MTBF / nodes"},
        "rows": rows,
    }
    if not rows:
        out["note"] = "no node MTBF measured in this window (no failure): no recommendation"
        caveats.add("No failure in the window, so no measured MTBF to size checkpoints by.")
    return out


def _spare(inventory: pd.DataFrame, incidents: pd.DataFrame, window: rel.Window,
           fleet: Mapping[str, Any], opts: ReportOptions) -> dict[str, Any]:
    avail = rel.availability(inventory, incidents, window)
    peak = rel.peak_concurrent_out(rel.fleet_incidents(inventory, incidents, window), window)
    out = rel.spare_capacity(avail, peak, int(fleet["units"]), opts.spare_fraction)
    if out["fits"] is None:
        out["note"] = "no fleet size known in this window"
    return out


def _wow(inventory: pd.DataFrame, incidents: pd.DataFrame, window: rel.Window,
         opts: ReportOptions) -> dict[str, Any]:
    previous = window.previous()
    now = _core_figures(inventory, incidents, window, opts.confidence)
    before = _core_figures(inventory, incidents, previous, opts.confidence)
    out: dict[str, Any] = {
        "previous_start": _iso(previous.start), "previous_end": _iso(previous.end),
        "rows": rel.week_over_week(now, before, _WOW_KEYS),
    }
    if before["exposure_hours"] == 0 and before["failures"] == 0:
        out["note"] = "no data in the previous window: no comparison"
    return out


# ---------------------------------------------------------------------------- formatting

def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:,.{digits}f}"
    return str(value)


def _pct(value: Any, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * 100:.{digits}f}%"


def _when(value: Any, tz: str) -> str:
    if value is None:
        return "n/a"
    return pd.Timestamp(float(value), unit="s", tz="UTC").tz_convert(tz).strftime(
        "%Y-%m-%d %H:%M")


Table = tuple[list[str], list[list[str]]]


def _tables(report: Mapping[str, Any]) -> dict[str, list[tuple[str, Table | str]]]:
    """Return, per section, its blocks: ``(caption, table)`` or ``("", paragraph)``."""
    s = report["sections"]
    opts = report["inputs"]["options"]
    tz = str(opts["timezone"])
    top = int(opts["top"])
    level = round(float(opts["confidence"]) * 100)
    out: dict[str, list[tuple[str, Table | str]]] = {}

    a = s["availability"]
    out["availability"] = [("", (["Figure", "Value"], [
        ["Availability", _pct(a["availability"], 3)],
        ["GPU-hours in service (exposure)", _num(a["exposure_hours"])],
        ["GPU-hours lost to failures", _num(a["lost_hours"])],
        ["GPUs / nodes", f"{_num(a['units'])} / {_num(a['nodes'])}"],
        ["Incidents that took a unit out of service", _num(a["incidents_out_of_service"])],
        ["Still out at the end of the window", _num(a["open_at_end"])],
        ["GPUs retired after a failure", _num(a["retired_after_failure"])],
    ]))]

    wk = s["work"]
    blocks_w: list[tuple[str, Table | str]] = [("", (["Figure", "Value"], [
        ["Interrupted jobs and pods (distinct)", _num(wk["interrupted_jobs"])],
        ["GPU-hours of the jobs hit (start to fault)", _num(wk["gpu_hours"])],
        ["Incidents with the work on the node recorded",
         f"{_num(wk['incidents_with_work_data'])} (of them on idle nodes: "
         f"{_num(wk['incidents_on_idle_nodes'])})"],
        ["Incidents without that record", _num(wk["incidents_without_work_data"])],
    ]))]
    for key, caption in (("by_period", f"By {wk['period']}"), ("by_cause", "By cause"),
                         ("by_kind", "By failure kind"),
                         ("by_priority_class", "By priority class (QOS / PriorityClass)")):
        if wk[key]:
            blocks_w.append((caption, (["Group", "Jobs", "GPU-hours"], [
                [str(name), _num(v["jobs"]), _num(v["gpu_hours"])]
                for name, v in list(wk[key].items())[:top]])))
    blocks_w.append(("", f"Definition: {wk['definition']}."))
    if wk.get("note"):
        blocks_w.append(("", wk["note"]))
    out["work"] = blocks_w

    m = s["mtbf"]
    f = m["fleet"]
    blocks: list[tuple[str, Table | str]] = [("Fleet", (["Figure", "Value"], [
        ["Failures", _num(f["failures"])],
        ["MTBF per GPU (hours)", _num(f["mtbf_hours"])],
        [f"{level}% interval (hours)",
         f"{_num(f['mtbf_lower_hours'])} - {_num(f['mtbf_upper_hours'])}"],
        ["Mean time between failures anywhere in the fleet (hours)",
         _num(f["system_mtbf_hours"], 2)],
        ["MTBF per node (hours)", _num(f["node_mtbf_hours"])],
    ]))]
    head = ["Group", "Units", "GPU-hours", "Failures", "MTBF (h)", f"{level}% interval (h)",
            "Fleet interval (h)"]

    def mtbf_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
        return [[str(r["group"]), _num(r["units"]), _num(r["exposure_hours"]),
                 _num(r["failures"]), _num(r["mtbf_hours"]),
                 f"{_num(r['mtbf_lower_hours'])} - {_num(r['mtbf_upper_hours'])}",
                 _num(r["system_mtbf_hours"], 2)] for r in rows]

    for key, caption in (("by_model", "By model"), ("by_driver_version", "By driver version"),
                         ("by_vbios_version", "By VBIOS version"), ("by_batch", "By batch")):
        if m[key]:
            blocks.append((caption, (head, mtbf_rows(m[key][:top]))))
        elif key == "by_driver_version":
            blocks.append(("", "No driver versions recorded: MTBF by driver version is not "
                               "available."))
    if m["by_node"]:
        outside = m.get("nodes_not_in_inventory", 0)
        blocks.append((f"Worst {min(top, len(m['by_node']))} of {len(m['by_node']):,} nodes "
                       f"with failures ({m['nodes_total']:,} nodes in the inventory"
                       + (f"; {outside:,} with failures not in it" if outside else "") + ")",
                       (head, mtbf_rows(m["by_node"][:top]))))
    if m.get("note"):
        blocks.append(("", m["note"]))
    out["mtbf"] = blocks

    r = s["mttr"]
    blocks = [("", (["Figure", "Value"], [
        ["Repaired incidents", _num(r["repaired"])], ["Not yet repaired", _num(r["unrepaired"])],
        ["Never taken out of service", _num(r.get("not_out_of_service", 0))],
        ["Mean (hours)", _num(r["mean_hours"], 2)], ["Median (hours)", _num(r["median_hours"], 2)],
        ["90th percentile (hours)", _num(r["p90_hours"], 2)],
        ["Longest (hours)", _num(r["max_hours"], 2)],
    ]))]
    if r["by_cause"]:
        blocks.append(("Median by cause", (["Cause", "Median (hours)"], [
            [c, _num(v, 2)] for c, v in r["by_cause"].items()])))
    if r.get("by_priority_class"):
        blocks.append(("By priority class of the work hit (QOS / PriorityClass)", (
            ["Priority class", "Repaired", "Not yet repaired", "Median (hours)",
             "Mean (hours)", "90th percentile (hours)"], [
                [c, _num(v["repaired"]), _num(v["unrepaired"]), _num(v["median_hours"], 2),
                 _num(v["mean_hours"], 2), _num(v["p90_hours"], 2)]
                for c, v in r["by_priority_class"].items()])))
    if r.get("note"):
        blocks.append(("", r["note"]))
    out["mttr"] = blocks

    c = s["causes"]
    blocks = [("By cause", (["Cause", "Failures"], [
        [k, _num(v)] for k, v in c["by_cause"].items()]))]
    if c["top_codes"]:
        blocks.append(("Most frequent kinds and codes", (["Kind", "Code", "Failures"], [
            [t["kind"], t["code"], _num(t["failures"])] for t in c["top_codes"][:top]])))
    if c["by_period"]:
        causes = sorted({k for row in c["by_period"].values() for k in row})
        blocks.append((f"By {c['period']} ({tz})", (["Period", *causes], [
            [p, *[_num(row.get(k, 0)) for k in causes]] for p, row in c["by_period"].items()])))
    if c.get("note"):
        blocks.append(("", c["note"]))
    out["causes"] = blocks

    ro = s["repeat_offenders"]
    blocks = []
    for key, caption, label in (("entities", "GPUs", "GPU (node/entity)"),
                                ("nodes", "Nodes", "Node")):
        rows = ro[key]
        if rows:
            blocks.append((f"{caption} with at least {ro['k']} failures "
                           f"({ro[key + '_count']:,})",
                           ([label, "Failures", "First", "Last", "Causes"], [
                               [x["key"], _num(x["failures"]), _when(x["first_at"], tz),
                                _when(x["last_at"], tz), x["causes"]] for x in rows[:top]])))
    if ro["lemon_slots"]:
        blocks.append((f"Slots where two or more GPUs failed, one after another "
                       f"({ro['lemon_slots_count']:,})",
                       (["Slot", "Failures", "GPUs", "First", "Last"], [
                           [x["slot"], _num(x["failures"]), _num(x["entities"]),
                            _when(x["first_at"], tz), _when(x["last_at"], tz)]
                           for x in ro["lemon_slots"][:top]])))
    if not blocks:
        blocks.append(("", f"No GPU, node or slot failed {ro['k']} times or more in this "
                           "window."))
    out["repeat_offenders"] = blocks

    co = s["cohorts"]
    blocks = []
    for comp in co["comparisons"]:
        rows = [[name, _num(v["failures"]), _num(v["exposure_hours"]),
                 _num(v["rate_per_million_hours"], 3),
                 f"{_num(v['rate_lower'], 3)} - {_num(v['rate_upper'], 3)}",
                 _num(v["hours_per_failure"])] for name, v in comp["cohorts"].items()]
        blocks.append((f"By {comp['by']}: {comp['candidate']} (candidate) against "
                       f"{comp['baseline']} (baseline)",
                       (["Cohort", "Failures", "GPU-hours", "Failures per 1M h",
                         f"{level}% interval", "Hours per failure"], rows)))
        blocks.append(("", f"Rate ratio {_num(comp['rate_ratio'], 3)} ({level}% interval "
                           f"{_num(comp['ratio_lower'], 3)} - {_num(comp['ratio_upper'], 3)},"
                           f" p = {_num(comp['p_value'], 4)}; {comp['method']}): "
                           f"{comp['verdict']}."))
    if co.get("note"):
        blocks.append(("", co["note"]))
    out["cohorts"] = blocks

    p = s["predictions"]
    blocks = [("", (["Figure", "Value"], [
        ["Predictions recorded", _num(p["recorded"])],
        [f"Positive (probability >= {p['threshold']})", _num(p["predictions"])],
        ["Followed by a failure within the horizon", _num(p["hits"])],
        ["Precision", _pct(p["precision"], 1)],
        ["Failures in the window", _num(p["incidents"])],
        ["Failures predicted beforehand", _num(p["caught"])],
        ["Recall", _pct(p["recall"], 1)],
        ["Median lead time (hours)", _num(p["lead_time_median_hours"], 2)],
    ]))]
    if p.get("note"):
        blocks.append(("", p["note"]))
    out["predictions"] = blocks

    rm = s["remediation"]
    blocks = [("", (["Figure", "Value"], [
        ["Incidents with actions", _num(rm["incidents_with_actions"])],
        ["Actions", ", ".join(f"{k} {v}" for k, v in rm["actions"].items()) or "none"],
        ["Dry-run actions (recorded, not carried out)",
         ", ".join(f"{k} {v}" for k, v in rm.get("dry_run_actions", {}).items()) or "none"],
        ["Approvals", ", ".join(f"{k} {v}" for k, v in rm["approvals"].items()) or "none"],
        ["Held back by the disruption budget", _num(rm["budget_blocked"])],
        ["Circuit-breaker events", _num(rm["circuit_breaker_events"])],
    ]))]
    if rm.get("note"):
        blocks.append(("", rm["note"]))
    out["remediation"] = blocks

    ck = s["checkpointing"]
    blocks = [("", f"Inputs: node MTBF {_num(ck['node_mtbf_hours'])} h (measured, this "
                   f"window), checkpoint cost C = {_num(ck['checkpoint_seconds'])} s. "
                   f"Young: {ck['formulas']['young']}; Daly: {ck['formulas']['daly']}; "
                   f"{ck['formulas']['job_mtbf']}.")]
    if ck["rows"]:
        blocks.append(("", (["Job size (nodes)", "Job MTBF (h)", "Young (min)", "Daly (min)"],
                            [[_num(x["nodes"]), _num(x["job_mtbf_hours"], 2),
                              _num(x["young_minutes"], 1), _num(x["daly_minutes"], 1)]
                             for x in ck["rows"]])))
    if ck.get("note"):
        blocks.append(("", ck["note"]))
    out["checkpointing"] = blocks

    sp = s["spare_capacity"]
    verdict = {True: "fits", False: "does NOT fit", None: "cannot be judged"}[sp["fits"]]
    out["spare_capacity"] = [("", (["Figure", "Value"], [
        ["Configured spare capacity", _pct(sp["spare_fraction"], 1)],
        ["Mean unavailable to failures", _pct(sp["mean_unavailable_fraction"], 3)],
        ["Peak out of service at once", f"{_num(sp['peak_out'])} of {_num(sp['units'])} "
                                        f"({_pct(sp['peak_unavailable_fraction'], 2)})"],
        ["Verdict", f"failure-driven unavailability {verdict} the spare capacity"],
    ]))]

    w = s["week_over_week"]
    blocks = [(f"Previous window {w['previous_start']} to {w['previous_end']}",
               (["Figure", "Previous", "This window", "Change"], [
                   [x["figure"], _num(x["previous"], 3), _num(x["current"], 3),
                    "n/a" if x["change_ratio"] is None else f"{x['change_ratio'] * 100:+.1f}%"]
                   for x in w["rows"]]))]
    if w.get("note"):
        blocks.append(("", w["note"]))
    out["week_over_week"] = blocks

    dr = s["drills"]
    blocks = [("", (["Figure", "Value"], [
        ["Drills", _num(dr["drills"])], ["Passed", _num(dr["passed"])],
        ["Failed (a stage missed its SLO or never happened)", _num(dr["failed"])],
    ]))]
    if dr["rows"]:
        blocks.append(("", (["Drill", "Node", "Kind", "Mode", "When", "Result",
                             "Stages (s from injection)", "Missed"], [
            [r["drill"], r["node"], r["kind"], r["mode"], _when(r["at"], tz), r["result"],
             ", ".join(f"{k} {_num(v, 2)}" for k, v in r["stages_seconds"].items()),
             ", ".join(r["missed"]) or "-"]
            for r in dr["rows"][:top]])))
    if dr.get("note"):
        blocks.append(("", dr["note"]))
    out["drills"] = blocks
    return out


def _inputs_rows(report: Mapping[str, Any]) -> list[list[str]]:
    i = report["inputs"]
    o = i["options"]
    return [
        ["Window", f"{i['window_start']} to {i['window_end']} ({_num(i['window_hours'])} h)"],
        ["Source", f"{i['source']} (present: {', '.join(i['sources_present']) or 'none'})"],
        ["History", str(i["history"] or "n/a")],
        ["Incidents in window / in history", f"{i['incidents_in_window']:,} / "
                                             f"{i['incidents_total']:,}"],
        ["Inventory residencies", f"{i['inventory_residencies']:,}"],
        ["Confidence level", _pct(o["confidence"], 0)],
        ["Spare fraction", _pct(o["spare_fraction"], 1)],
        ["Prediction threshold", str(o["prediction_threshold"])],
        ["Time zone", str(o["timezone"])],
    ]


def render_json(report: Mapping[str, Any]) -> str:
    """Return the report as JSON (sorted keys, two-space indent, trailing newline)."""
    return json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Mapping[str, Any]) -> str:
    """Return the report as Markdown (headings, pipe tables, the caveats as a list)."""
    lines = [f"# {report['title']}", "",
             f"Generated {report['generated_at']}; window {report['inputs']['window_start']} "
             f"to {report['inputs']['window_end']}.", ""]
    blocks = _tables(report)
    for key, title in SECTIONS:
        lines += [f"## {title}", ""]
        for caption, body in blocks[key]:
            if caption:
                lines += [f"**{caption}**", ""]
            if isinstance(body, str):
                lines += [body, ""]
                continue
            head, rows = body
            lines.append("| " + " | ".join(_md_cell(h) for h in head) + " |")
            lines.append("|" + "|".join("---" for _ in head) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            lines.append("")
    lines += ["## Inputs", "", "| Input | Value |", "|---|---|"]
    lines += [f"| {_md_cell(a)} | {_md_cell(b)} |" for a, b in _inputs_rows(report)]
    lines += ["", "## Caveats", ""]
    lines += [f"- {c}" for c in report["caveats"]] or ["- none"]
    return "\n".join(lines) + "\n"


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;
color:#1d2330;background:#fff;max-width:1100px}
h1{font-size:24px;margin-bottom:4px}h2{font-size:18px;margin-top:28px;
border-bottom:2px solid #d8dde6;padding-bottom:4px}h3{font-size:14px;margin:14px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #d8dde6;padding:3px 8px;text-align:left}
th{background:#f0f3f8}td.n{text-align:right;font-variant-numeric:tabular-nums}
p.note{color:#6a4d00;background:#fff6db;padding:6px 10px;border-radius:4px}
p.meta{color:#5a6374;margin-top:0}img{max-width:100%;height:auto;display:block;
margin:8px 0}ul.caveats li{margin:4px 0}
"""


def _is_number(text: str) -> bool:
    t = text.replace(",", "").replace("%", "").replace("+", "").replace(" - ", "")
    try:
        float(t)
    except ValueError:
        return False
    return True


def _html_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["<table><thead><tr>", *[f"<th>{html.escape(h)}</th>" for h in head],
           "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>" + "".join(
            f'<td class="n">{html.escape(c)}</td>' if _is_number(c)
            else f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def render_html(report: Mapping[str, Any], *, plots: bool = True) -> str:
    """Return the report as one self-contained HTML page.

    Args:
        report: :func:`build_report`'s result.
        plots: Draw the plots (matplotlib ``Agg``, inline PNG data URIs).

    Returns:
        HTML5 text with inline CSS, no script and no external reference.
    """
    images = _plots(report) if plots else {}
    blocks = _tables(report)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(report['title'])}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(report['title'])}</h1>",
             f'<p class="meta">Generated {html.escape(str(report["generated_at"]))}; window '
             f"{html.escape(str(report['inputs']['window_start']))} to "
             f"{html.escape(str(report['inputs']['window_end']))}; source "
             f"{html.escape(str(report['inputs']['source']))}.</p>"]
    for key, title in SECTIONS:
        parts.append(f'<section id="{key}"><h2>{html.escape(title)}</h2>')
        for caption, body in blocks[key]:
            if caption:
                parts.append(f"<h3>{html.escape(caption)}</h3>")
            if isinstance(body, str):
                css = "note" if body.startswith("no ") or body.startswith("No ") else ""
                parts.append(f'<p class="{css}">{html.escape(body)}</p>' if css
                             else f"<p>{html.escape(body)}</p>")
            else:
                parts.append(_html_table(*body))
        for name, (alt, uri) in images.items():
            if name.split(":", 1)[0] == key:
                parts.append(f'<img src="{uri}" alt="{html.escape(alt)}">')
        parts.append("</section>")
    parts.append('<section id="inputs"><h2>Inputs</h2>')
    parts.append(_html_table(["Input", "Value"], _inputs_rows(report)))
    parts.append('</section><section id="caveats"><h2>Caveats</h2><ul class="caveats">')
    parts += [f"<li>{html.escape(c)}</li>" for c in report["caveats"]] or ["<li>none</li>"]
    parts.append("</ul></section></body></html>")
    return "\n".join(parts) + "\n"


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _plots(report: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Draw the report's plots; return ``section:name -> (alt text, data URI)``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    s = report["sections"]
    out: dict[str, tuple[str, str]] = {}
    causes = s["causes"]
    if causes["by_period"]:
        periods = list(causes["by_period"])
        names = sorted({k for row in causes["by_period"].values() for k in row})
        fig = Figure(figsize=(8, 3.2))
        ax = fig.subplots()
        bottom = [0.0] * len(periods)
        for name in names:
            values = [float(causes["by_period"][p].get(name, 0)) for p in periods]
            ax.bar(periods, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("failures")
        ax.set_title(f"Failures by {causes['period']} and cause")
        ax.legend(fontsize=8)
        if len(periods) > 12:
            ax.tick_params(axis="x", labelrotation=90, labelsize=7)
        out["causes:timeline"] = ("Failures per period, stacked by cause", _png(fig))
    groups = [r for r in s["mtbf"]["by_model"] + s["mtbf"]["by_batch"]
              + s["mtbf"]["by_driver_version"] if r["mtbf_hours"] is not None][:12]
    if groups:
        fig = Figure(figsize=(8, 0.5 + 0.4 * len(groups)))
        ax = fig.subplots()
        labels = [str(r["group"]) for r in groups]
        point = [float(r["mtbf_hours"]) for r in groups]
        lo = [p - float(r["mtbf_lower_hours"]) for p, r in zip(point, groups, strict=True)]
        hi = [float(r["mtbf_upper_hours"]) - p for p, r in zip(point, groups, strict=True)]
        ax.errorbar(point, range(len(groups)), xerr=[lo, hi], fmt="o", capsize=4)
        ax.set_yticks(range(len(groups)), labels)
        ax.set_xscale("log")
        ax.set_xlabel("MTBF per GPU (hours, log scale), with confidence interval")
        out["mtbf:groups"] = ("MTBF by group with confidence intervals", _png(fig))
    comps = s["cohorts"]["comparisons"]
    if comps:
        fig = Figure(figsize=(8, 0.8 + 0.45 * sum(len(c["cohorts"]) for c in comps)))
        ax = fig.subplots()
        labels, point, lo, hi = [], [], [], []
        for comp in comps:
            for name, v in comp["cohorts"].items():
                labels.append(f"{comp['by']}={name}")
                point.append(float(v["rate_per_million_hours"]))
                lo.append(point[-1] - float(v["rate_lower"]))
                hi.append(float(v["rate_upper"]) - point[-1])
        ax.errorbar(point, range(len(labels)), xerr=[lo, hi], fmt="s", capsize=4,
                    color="#b04030")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("failures per million GPU-hours, with exact Poisson interval")
        out["cohorts:rates"] = ("Failure rate by cohort with confidence intervals", _png(fig))
    return out


def render(report: Mapping[str, Any], fmt: Format) -> str:
    """Render ``report`` as ``html``, ``md`` or ``json``.

    Raises:
        ValueError: An unknown format.
    """
    if fmt == "json":
        return render_json(report)
    if fmt == "md":
        return render_markdown(report)
    if fmt == "html":
        return render_html(report)
    raise ValueError(f"unknown report format {fmt!r} (html, md or json)")


def summary(report: Mapping[str, Any]) -> dict[str, Any]:
    """Return the few headline figures (for a webhook or a log line)."""
    s = report["sections"]
    result: dict[str, Any] = _clean({
        "schema": report["schema"], "generated_at": report["generated_at"],
        "window_start": report["inputs"]["window_start"],
        "window_end": report["inputs"]["window_end"],
        "failures": s["mtbf"]["fleet"]["failures"],
        "availability": s["availability"]["availability"],
        "lost_hours": s["availability"]["lost_hours"],
        "mtbf_hours": s["mtbf"]["fleet"]["mtbf_hours"],
        "mttr_median_hours": s["mttr"]["median_hours"],
        "interrupted_jobs": s["work"]["interrupted_jobs"],
        "gpu_hours_of_jobs_hit": s["work"]["gpu_hours"],
        "spare_capacity_fits": s["spare_capacity"]["fits"],
        "drills": s["drills"]["drills"], "drills_failed": s["drills"]["failed"],
        "caveats": len(report["caveats"]),
    })
    return result


def utc_now_iso() -> str:
    """Return the current UTC time, ISO 8601, for file names."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
