"""Artifact parsers for DCGM's command-line tool ``dcgmi``.

Kinds handled here (DCGM user guide, "dcgmi" chapters):

* ``dcgmi_diag``: ``dcgmi diag -r N`` box tables (sections such as Metadata,
  Deployment, Integration, Hardware, Stress; rows ``| GPU Memory | Pass - GPUs: 1, 2 |``
  with extra status rows ``| | Fail - GPU: 0 |``; Warning/Error/Info rows whose
  text DCGM wraps at a fixed width, even mid-word, rejoined here) and ``dcgmi diag -j``.
* ``dcgmi_health``: ``dcgmi health -c`` table (the DCGM 1.x ``GPU ID: N`` layout and
  the 2.x+ ``-> N`` / ``-> Errors`` / ``-> PCIe system`` layout, messages rejoined
  like diag cells) and ``-j`` JSON. A "Healthy" verdict is recorded as an event; it
  never clears anything by itself.
* ``dcgmi_dmon``: ``dcgmi dmon`` columns named by DCGM field short names
  (``XIDER`` is field 230 ``DCGM_FI_DEV_XID_ERRORS``, the *last* Xid, a pointer).
  Blank and not-supported values are omitted.
* ``dcgmi_nvlink``: ``dcgmi nvlink --link-status`` (``U``/``D``/``X``/``_`` per link,
  per GPU; the NvSwitches list).

Events and samples written (read by ``analytics.fault_model.gpu``):

* ``dcgm_diag`` events, code the test (``gpu_memory``, ``pcie``...), attrs
  ``result`` (``fail``/``warn``), ``category``, ``test``, ``nvlink_only`` (``yes``
  when every message behind the result is an NVLink-down report), ``message``.
  Entity the GPU, or ``node`` for "Fail - All".
* ``dcgm_diag_error`` events for diag and health messages with a known meaning
  (``dcgm_errors.h`` texts: ``row_remap_pending``, ``row_remap_failure``,
  ``retired_pages_pending``); attr ``category`` (the diag section, or ``health``).
* ``thermal_violation`` events (DCGM's thermal-violation warnings, and health's
  "clock throttling due to thermal violation").
* ``xid`` events for "Detected XID n for GPU m" and the uncontained-error (Xid 95)
  message; ``gpu_ecc_errors_total`` samples for "Detected n volatile double-bit ECC
  error(s) in GPU m".
* ``dcgm_diag_perf`` events: per-GPU throughput figures (``value``, ``unit``).
* ``dcgm_health`` events, code the verdict (``healthy``, ``warning``, ``failure``),
  entity the GPU or ``node`` (the overall verdict); attrs ``message``,
  ``nvlink_only`` (``yes`` when only NVLink-down reports are behind it) and
  ``explained`` (``yes`` when every message became one of the records above).
* ``nvswitch_inventory`` events, code ``present`` or ``absent``.
* Samples ``gpu_nvlink_state{link}`` (NVLink status and NVLink-down warnings) and the
  catalogued metrics behind ``dmon`` columns.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from collectors.artifact import ArtifactParser, Line, ParseContext
from collectors.nvidia_smi import is_missing, make_sample, norm_key
from collectors.textparse import Session, line_evidence
from core.ids import gpu_index_entity
from core.records import NODE_ENTITY, EntityId, Event, Record

logger = logging.getLogger(__name__)

INT64_BLANK = 0x7FFFFFFFFFFFFFF0
"""``DCGM_INT64_BLANK``: this value and the few above it mean "no value" (dcgm_structs.h)."""

INT32_BLANK = 0x7FFFFFF0
"""``DCGM_INT32_BLANK``: this value and the few above it mean "no value"."""

FP64_BLANK = 140737488355328.0
"""``DCGM_FP64_BLANK`` (2**47): this value and the few above it mean "no value"."""


def is_blank(value: float) -> bool:
    """Return True for DCGM blank / not-found / not-supported / not-permissioned sentinels.

    Examples:
        >>> is_blank(9223372036854775794), is_blank(140737488355328.0), is_blank(120)
        (True, True, False)
        >>> is_blank(9.999999e37)
        True
    """
    if value != value:  # NaN
        return True
    if abs(value) >= 9.0e37:
        return True
    if value >= 9.2233720368547e18:
        return True
    if FP64_BLANK <= value <= FP64_BLANK + 16:
        return True
    return INT32_BLANK <= value <= INT32_BLANK + 15 and float(value).is_integer()


def _gpu(index: str | int) -> EntityId:
    return EntityId(gpu_index_entity(int(index)))


# ----------------------------------------------------------------------- box tables

_BORDER = re.compile(r"^\s*\+[-=+]+\+?\s*$")
_SECTION = re.compile(r"^\s*[|+]-{2,}\s+(?P<name>[A-Za-z][\w ]*?)\s+-+\+?[-+|]*\s*$")
_ROW = re.compile(r"^\s*\|(?P<name>[^|]*)\|(?P<value>[^|]*)(?P<close>\|)?\s*$")
_FULLROW = re.compile(r"^\s*\|(?P<text>[^|]*)\|\s*$")
_STATUS = re.compile(
    r"^(?P<status>Pass|Fail|Warn|Warning|Skip|Skipped)\b\s*(?:-\s*(?P<who>.*))?$", re.I
)


@dataclass(slots=True)
class _Cell:
    """One named row of a box table and its continuation rows."""

    category: str
    name: str
    pieces: list[tuple[str, Line]] = field(default_factory=list)
    width: int = 0

    def lines(self) -> list[Line]:
        return [ln for _p, ln in self.pieces]

    def joined(self) -> tuple[str, list[tuple[int, Line]]]:
        """Rejoin wrapped text; return it with the offset where each line's piece starts.

        DCGM cuts long cell text every ``width`` characters, even mid-word; a piece
        that fills the cell continues without a space, a shorter one ended at a space.
        """
        width = self.width or max((len(p) for p, _l in self.pieces), default=0)
        text = ""
        offsets: list[tuple[int, Line]] = []
        previous_full = False
        for piece, line in self.pieces:
            part = piece if not text or previous_full else " " + piece.lstrip()
            offsets.append((len(text), line))
            text += part
            previous_full = len(piece) >= width
        return text.strip(), offsets


def _table_rows(lines: Sequence[Line]) -> Iterator[tuple[str, Line, re.Match[str] | None]]:
    for line in lines:
        if _BORDER.match(line.text):
            yield "border", line, None
            continue
        section = _SECTION.match(line.text)
        if section is not None:
            yield "section", line, section
            continue
        row = _ROW.match(line.text)
        if row is not None:
            yield "row", line, row
            continue
        full = _FULLROW.match(line.text)
        if full is not None:
            yield "title", line, full
            continue
        yield "other", line, None


_GPU_NAME = re.compile(r"^GPU\s*(\d+)\s*:?$", re.I)
_GPU_STATUS = re.compile(r"^GPU\s*(?P<gpu>\d+)\s*:\s*(?P<status>Pass|Fail|Warn|Skip)\b", re.I)
_NVLINK_DOWN = re.compile(
    r"GPU\s*(?P<gpu>\d+)(?:'s)?\s+NvLink link (?P<link>\d+) is (?:currently )?down", re.I
)
_THERMAL = re.compile(
    r"(?:GPU\s*(?P<gpu>\d+)\s+)?Thermal violations totaling (?P<sec>[\d.]+) ?seconds?"
    r"(?:.*?for GPU\s*(?P<gpu2>\d+))?",
    re.I,
)
_DEPLOY = (
    (
        re.compile(
            r"GPU\s*(\d+) (?:has|had) (?:uncorrectable )?memory errors and row remappings "
            r"are pending",
            re.I,
        ),
        "row_remap_pending",
    ),
    (
        re.compile(r"GPU\s*(\d+) (?:has|had) (?:a )?row remap(?:ping)? failure", re.I),
        "row_remap_failure",
    ),
    (
        re.compile(r"GPU\s*(\d+)\b(?:(?!GPU\s*\d).)*?row remapping failed", re.I),
        "row_remap_failure",
    ),
    (
        re.compile(r"GPU\s*(\d+) has (?:pending page retirements|retired pages pending)", re.I),
        "retired_pages_pending",
    ),
    (re.compile(r"Page retirement pending.*?GPU\s*(\d+)", re.I), "retired_pages_pending"),
)
_PERF = re.compile(
    r"GPU\s*(?P<gpu>\d+)(?P<what>[^.,;\d]*?)(?P<value>\d+(?:\.\d+)?)\s*"
    r"(?P<unit>gigaflops|GFLOPS|GB/s|GB/sec)",
    re.I,
)


def _gpus_of(who: str | None) -> list[str] | None:
    """``"GPUs: 1, 2"`` -> ``["1", "2"]``; ``"All"`` -> ``None`` (all GPUs)."""
    if who is None:
        return []
    if re.match(r"^\s*all\b", who, re.I):
        return None
    return re.findall(r"\d+", who)


class DcgmDiagParser:
    """``dcgmi diag`` table and ``-j`` JSON (DCGM user guide, "Diagnostics").

    Plugins: Deployment checks, Integration (PCIe), Hardware (GPU Memory,
    Diagnostic, Memtest...), Stress (Targeted Stress/Power, SM Stress, Memory
    Bandwidth). Results per GPU: Pass, Fail, Warn, Skip.
    """

    kind = "dcgmi_diag"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score diag tables (sections, ``Pass - GPUs`` rows) or diag JSON."""
        text = "\n".join(ln.text for ln in lines[:300])
        if '"DCGM GPU Diagnostic"' in text or '"test_categories"' in text:
            return 95
        if "Health Monitor Report" in text or "Overall Health" in text:
            return 0
        score = 0
        if re.search(r"\|\s*Diagnostic\s*\|\s*Result\s*\|", text):
            score += 60
        if re.search(
            r"[|+]-+\s+(Metadata|Deployment|Integration|Hardware|Stress|Plugin)\s+-", text
        ):
            score += 50
        if re.search(r"\|\s*(Pass|Fail|Skip|Warn)\b(\s*-\s*(GPUs?:|All))?", text):
            score += 30
        if re.search(r"^\|\s*(Warning|Error|Info)\s*\|", text, re.M):
            score += 20
        if command and "dcgmi" in command and "diag" in command:
            score += 40
        return min(95, score)

    def open(self, ctx: ParseContext) -> _DiagSession:
        """Start parsing a diag section."""
        return _DiagSession(ctx)


class _DiagSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.category = ""
        self.cells: list[_Cell] = []
        self.width = 0
        self.json_lines: list[Line] = []
        self.is_json = False

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        if not self.cells and (self.is_json or (lines and lines[0].text.lstrip().startswith("{"))):
            self.is_json = True
            self.json_lines.extend(lines)
            return []
        for kind, line, match in _table_rows(lines):
            if kind == "section" and match is not None:
                self.category = norm_key(match["name"])
            elif kind == "row" and match is not None:
                name = match["name"].strip()
                raw = match["value"]
                if match["close"]:
                    self.width = max(self.width, len(raw) - 3)
                piece = raw[1:] if raw.startswith(" ") else raw
                piece = piece.rstrip()
                if name:
                    self.cells.append(_Cell(category=self.category, name=name))
                if not self.cells:
                    continue
                if piece.strip():
                    self.cells[-1].pieces.append((piece, line))
            elif kind == "other" and line.text.strip() and self.cells:
                text = line.text.strip()
                if not text.startswith(("Successfully", "Error:", "Running")):
                    self.issue(line.number, f"not a dcgmi diag table line: {text[:80]!r}")
        return []

    def close(self) -> list[Record]:
        if self.is_json:
            return self._json()
        out: list[Record] = []
        current: tuple[_Cell, list[tuple[str, list[str] | None, Line]]] | None = None
        messages: list[_Cell] = []

        def flush() -> None:
            if current is not None:
                out.extend(self._test(current[0], current[1], messages))
            messages.clear()

        for cell in self.cells:
            cell.width = self.width
            lname = cell.name.lower()
            if lname.startswith(("warning", "error", "info")):
                if cell.category == "deployment" or current is None:
                    out.extend(self._messages(cell, None))
                else:
                    messages.append(cell)
                continue
            if cell.category == "metadata" or not cell.pieces:
                continue
            per_gpu = _GPU_NAME.match(cell.name)
            if per_gpu is not None and current is not None:
                st = _STATUS.match(cell.pieces[0][0].strip())
                if st is not None:
                    current[1].append((st["status"].lower()[:4], [per_gpu[1]], cell.pieces[0][1]))
                continue
            flush()
            statuses: list[tuple[str, list[str] | None, Line]] = []
            for piece, line in cell.pieces:
                st = _STATUS.match(piece.strip())
                if st is not None:
                    statuses.append((st["status"].lower()[:4], _gpus_of(st["who"]), line))
                    continue
                gst = _GPU_STATUS.match(piece.strip())
                if gst is not None:
                    statuses.append((gst["status"].lower()[:4], [gst["gpu"]], line))
            current = (cell, statuses)
        flush()
        return out

    def _test(
        self,
        cell: _Cell,
        statuses: list[tuple[str, list[str] | None, Line]],
        messages: list[_Cell],
    ) -> list[Record]:
        ctx = self.ctx
        out: list[Record] = []
        texts: list[str] = []
        msg_lines: list[Line] = []
        only_nvlink = bool(messages)
        for msg in messages:
            out.extend(self._messages(msg, cell))
            text, _offsets = msg.joined()
            texts.append(text)
            msg_lines.extend(msg.lines())
            if msg.name.lower().startswith("info"):
                continue
            rest = _NVLINK_DOWN.sub("", text)
            rest = re.sub(r"Run a field diagnostic on the GPU\.?|GPU\s*\d+|[,.\s]", "", rest)
            if rest:
                only_nvlink = False
        test = norm_key(cell.name)
        if any(gpus for _s, gpus, _l in statuses):
            # per-GPU results given: the test-level summary adds nothing
            statuses = [st for st in statuses if st[1] != []]
        for status, gpus, line in statuses:
            if status not in {"fail", "warn"}:
                continue
            entities = [NODE_ENTITY] if gpus is None else [_gpu(g) for g in gpus] or [NODE_ENTITY]
            for entity in entities:
                out.append(
                    Event(
                        kind="dcgm_diag",
                        code=test,
                        node=ctx.node,
                        entity=entity,
                        observed_at=None,
                        message=f"DCGM diagnostic {cell.name}: {status}",
                        attrs={
                            "result": status,
                            "category": cell.category,
                            "test": cell.name,
                            "nvlink_only": "yes" if only_nvlink else "no",
                            "message": " | ".join(texts)[:500],
                        },
                        evidence=tuple(line_evidence(ctx, ln) for ln in [line, *msg_lines][:12]),
                        source="dcgmi_diag",
                    )
                )
        return out

    def _messages(self, cell: _Cell, test: _Cell | None) -> list[Record]:
        """Records for the known messages inside a Warning/Error/Info cell."""
        ctx = self.ctx
        text, offsets = cell.joined()
        out: list[Record] = []

        def line_at(pos: int) -> Line:
            found = offsets[0][1]
            for start, line in offsets:
                if start <= pos:
                    found = line
            return found

        for match in _NVLINK_DOWN.finditer(text):
            s = make_sample(
                ctx,
                "gpu_nvlink_state",
                0.0,
                _gpu(match["gpu"]),
                line_at(match.start()),
                {"link": match["link"]},
            )
            if s is not None:
                out.append(s)
        for match in _THERMAL.finditer(text):
            gpu = match["gpu"] or match["gpu2"]
            if gpu is None:
                continue
            out.append(
                Event(
                    kind="thermal_violation",
                    code="dcgm_diag",
                    node=ctx.node,
                    entity=_gpu(gpu),
                    observed_at=None,
                    message=match[0],
                    attrs={"seconds": match["sec"], "test": test.name if test else ""},
                    evidence=tuple(line_evidence(ctx, ln) for ln in cell.lines()[:12]),
                    source="dcgmi_diag",
                )
            )
        out.extend(
            known_messages(ctx, text, NODE_ENTITY, cell.lines(), cell.category, source="dcgmi_diag")
        )
        if test is not None:
            for match in _PERF.finditer(text):
                out.append(
                    Event(
                        kind="dcgm_diag_perf",
                        code=norm_key(test.name),
                        node=ctx.node,
                        entity=_gpu(match["gpu"]),
                        observed_at=None,
                        message=match[0],
                        attrs={
                            "value": match["value"],
                            "unit": match["unit"].lower(),
                            "metric": norm_key(match["what"]) or "throughput",
                        },
                        evidence=(line_evidence(ctx, line_at(match.start())),),
                        source="dcgmi_diag",
                    )
                )
        return out

    # -- JSON ---------------------------------------------------------------------

    def _json(self) -> list[Record]:
        lines = self.json_lines
        doc = _load_json(self, lines, "dcgmi diag -j")
        if doc is None:
            return []
        out: list[Record] = []
        for category, test, result in _walk_diag(doc):
            status = str(result.get("status", "")).lower()[:4]
            warnings = _texts(
                result.get("warnings")
                or result.get("warning")
                or result.get("errors")
                or result.get("error")
                or []
            )
            infos = _texts(result.get("info") or [])
            gpu_ids = result.get("gpu_ids", result.get("gpu_id", result.get("entity_id")))
            gpus: list[str] | None
            if gpu_ids is None:
                gpus = []
            elif isinstance(gpu_ids, int):
                gpus = [str(gpu_ids)]
            else:
                gpus = _gpus_of(str(gpu_ids))
            cell = _Cell(category=norm_key(category), name=test)
            anchor = _find_line(lines, warnings[0][:40] if warnings else test) or lines[0]
            msg_cells: list[_Cell] = []
            for w in warnings:
                msg_cells.append(
                    _Cell(
                        category=cell.category,
                        name="Warning",
                        pieces=[(w, _find_line(lines, w[:40]) or anchor)],
                        width=10**6,
                    )
                )
            for info in infos:
                msg_cells.append(
                    _Cell(
                        category=cell.category,
                        name="Info",
                        pieces=[(info, _find_line(lines, info[:40]) or anchor)],
                        width=10**6,
                    )
                )
            if cell.category == "deployment":
                for m in msg_cells:
                    out.extend(self._messages(m, None))
                msg_cells = []
            status_line = _find_line(lines, f'"{result.get("status", "")}"') or anchor
            out.extend(self._test(cell, [(status, gpus, status_line)], msg_cells))
        return out


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, dict):
        for key in ("warning", "message", "msg", "info"):
            if isinstance(value.get(key), str):
                return [value[key]]
        return []
    if isinstance(value, list):
        return [t for item in value for t in _texts(item)]
    return []


def _walk_diag(doc: Any) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Yield ``(category, test name, result)`` from any known diag JSON layout."""
    if isinstance(doc, dict):
        cats = doc.get("test_categories")
        if isinstance(cats, list):
            for cat in cats:
                if not isinstance(cat, dict):
                    continue
                for test in cat.get("tests", []) or []:
                    if not isinstance(test, dict):
                        continue
                    for result in test.get("results", []) or []:
                        if isinstance(result, dict):
                            yield str(cat.get("category", "")), str(test.get("name", "")), result
            return
        for value in doc.values():
            yield from _walk_diag(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from _walk_diag(item)


def _find_line(lines: Sequence[Line], needle: str) -> Line | None:
    needle = needle.strip()
    if not needle:
        return None
    for line in lines:
        if needle in line.text:
            return line
    return None


def _load_json(session: Session, lines: Sequence[Line], what: str) -> Any:
    text = "\n".join(ln.text for ln in lines)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        index = max(1, min(exc.lineno, len(lines)))
        session.issue(
            lines[index - 1].number if lines else None, f"{what}: invalid JSON ({exc.msg})"
        )
        return None


# --------------------------------------------------------------------------- health


class DcgmHealthParser:
    """``dcgmi health -c`` table or ``-j`` JSON (DCGM user guide, "Health and Diagnostics").

    The overall and per-GPU verdicts (Healthy, Warning, Failure) are recorded as
    ``dcgm_health`` events; a Healthy verdict never overrides other evidence.
    """

    kind = "dcgmi_health"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score the health report title or its JSON keys; or the pasted command."""
        text = "\n".join(ln.text for ln in lines[:200])
        if "Health Monitor Report" in text or '"Overall Health"' in text:
            return 90
        if command and "dcgmi" in command and "health" in command:
            return 60
        return 0

    def open(self, ctx: ParseContext) -> _HealthSession:
        """Start parsing a health section."""
        return _HealthSession(ctx)


_HEALTH_WORDS = re.compile(r"^(Healthy|Warning|Failure|Fail|Unknown)\b", re.I)


class _HealthSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.lines: list[Line] = []

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        self.lines.extend(lines)
        return []

    def close(self) -> list[Record]:
        lines = [ln for ln in self.lines if ln.text.strip()]
        if not lines:
            return []
        if lines[0].text.lstrip().startswith(("{", "[")):
            doc = _load_json(self, lines, "dcgmi health -j")
            if doc is None:
                return []
            return list(self._json(doc, lines))
        if not any("Health" in ln.text or ln.text.lstrip().startswith("|") for ln in lines):
            return []  # e.g. "Health monitor systems set successfully."
        return list(self._table(lines))

    def _event(self, entity: EntityId, verdict: str, message: str, lines: Sequence[Line]) -> Event:
        return Event(
            kind="dcgm_health",
            code=norm_key(verdict),
            node=self.ctx.node,
            entity=entity,
            observed_at=None,
            message=message or f"DCGM health {verdict}",
            attrs={"verdict": verdict, "message": message[:500]},
            evidence=tuple(line_evidence(self.ctx, ln) for ln in lines[:12]),
            source="dcgmi_health",
        )

    def _json(self, doc: Any, lines: Sequence[Line]) -> Iterator[Record]:
        body = doc.get("body", doc) if isinstance(doc, dict) else {}
        if not isinstance(body, dict):
            return
        for key, value in body.items():
            verdict = value.get("value") if isinstance(value, dict) else value
            if not isinstance(verdict, str):
                continue
            gpu = re.search(r"GPU(?: ID)?:?\s*(\d+)", key)
            entity = _gpu(gpu[1]) if gpu else NODE_ENTITY
            details = " ".join(
                _texts_deep(value.get("children") if isinstance(value, dict) else None)
            )
            anchor = _find_line(lines, f'"{key}"') or lines[0]
            verdict_line = _find_line(lines, f'"{verdict}"') or anchor
            yield self._event(entity, verdict, details, [anchor, verdict_line])
        # per-GPU verdicts nested under "GPU" -> "children" -> "<id>" (DCGM 2.x and later)
        for gpu_id, node in _health_json_gpus(body):
            verdict = node.get("value")
            if not isinstance(verdict, str) or not _HEALTH_WORDS.match(verdict):
                continue
            details = " ".join(
                t for t in _texts_deep(node.get("children")) if not _HEALTH_WORDS.fullmatch(t)
            )
            anchor = _find_line(lines, f'"{gpu_id}"') or lines[0]
            used = [anchor] + [
                ln for t in _texts_deep(node.get("children")) if (ln := _find_line(lines, t[:40]))
            ]
            entity = _gpu(gpu_id)
            event = self._event(entity, verdict, details, used)
            texts = [t for t in _texts_deep(node.get("children")) if not _HEALTH_WORDS.fullmatch(t)]
            found = [list(known_messages(self.ctx, t, entity, used, "health")) for t in texts]
            if texts and all(found):
                event = dataclasses.replace(event, attrs={**event.attrs, "explained": "yes"})
            yield event
            for records in found:
                yield from records

    def _table(self, lines: Sequence[Line]) -> Iterator[Record]:
        """Both table layouts.

        DCGM 1.x: ``| GPU ID: 0 | Warning |`` then message rows
        (``PCIe system: Warning - ...``). DCGM 2.x and later: ``| Overall Health |
        Warning |``, ``| GPU |``, ``| -> 0 | Warning |``, ``|    -> Errors |``,
        ``|       -> PCIe system | Warning |`` then the wrapped message. One event per
        GPU (its verdict, the subsystems and messages) and one node event for the
        overall verdict. Messages are rejoined like diag cells (DCGM cuts them at the
        cell width, even mid-word).
        """
        overall: tuple[str, list[Line]] | None = None
        entries: list[_HealthEntry] = []
        current: _HealthEntry | None = None
        in_gpus = False
        width = 0
        for kind, line, match in _table_rows(lines):
            if kind != "row" or match is None:
                continue
            cell_name = match["name"].strip()
            raw = match["value"]
            value = raw.strip()
            if match["close"]:
                width = max(width, len(raw) - 2)  # one space each side; text fills the rest
            if not cell_name:
                if current is not None and value:
                    if not current.cells:
                        current.cells.append(_Cell(category="health", name=""))
                    piece = (raw[1:] if raw.startswith(" ") else raw).rstrip()
                    current.cells[-1].pieces.append((piece, line))
                    current.lines.append(line)
                continue
            label = re.sub(r"^(?:->\s*)+", "", cell_name).strip()
            arrow = cell_name.startswith("->")
            over = re.search(r"Overall Health\s*:?\s*(\w+)?", f"{cell_name} {value}", re.I)
            if over is not None:
                word = _HEALTH_WORDS.match(over[1] or value)
                if word:
                    overall = (word[1], [line])
                continue
            gpu = re.match(r"^(?:GPU(?:\s*ID)?\s*:?\s*)?(\d+)$", label, re.I)
            if gpu is not None and (arrow or label.upper().startswith("GPU") or in_gpus):
                word = _HEALTH_WORDS.match(value)
                current = _HealthEntry(entity=_gpu(gpu[1]), verdict=word[1] if word else "")
                current.lines.append(line)
                if value and not word:
                    current.cells.append(_Cell(category="health", name="", pieces=[(value, line)]))
                entries.append(current)
                continue
            if label.lower() in {"gpu", "gpus"}:
                in_gpus = True
                continue
            if label.lower() in {"errors", "incidents", "warnings"}:
                continue
            # a subsystem ("PCIe system", "Memory system"...) or another entity kind
            if current is None:
                current = _HealthEntry(entity=NODE_ENTITY, verdict="")
                entries.append(current)
            word = _HEALTH_WORDS.match(value)
            current.cells.append(
                _Cell(category="health", name=f"{label}: {value}" if value else label)
            )
            current.lines.append(line)
            current.subsystems.append(label)
            if word and not current.verdict:
                current.verdict = word[1]
        if overall is not None:
            yield self._event(NODE_ENTITY, overall[0], "", overall[1])
        for entry in entries:
            if not entry.verdict:
                continue
            parts: list[str] = []
            known: list[Record] = []
            unexplained = 0
            for cell in entry.cells:
                cell.width = width
                text = cell.joined()[0] if cell.pieces else ""
                parts.append(" ".join(p for p in (cell.name, text) if p))
                found = list(
                    known_messages(
                        self.ctx, text, entry.entity, cell.lines() or entry.lines, "health"
                    )
                )
                known.extend(found)
                if text and not found:
                    unexplained += 1
            message = re.sub(r"\s+", " ", " ".join(parts)).strip()
            event = self._event(entry.entity, entry.verdict, message, entry.lines)
            if known and not unexplained:
                # every message has a specific record: the rules for those judge it
                event = dataclasses.replace(event, attrs={**event.attrs, "explained": "yes"})
            down = list(_NVLINK_DOWN.finditer(message))
            if down and entry.subsystems and all("nvlink" in x.lower() for x in entry.subsystems):
                event = dataclasses.replace(event, attrs={**event.attrs, "nvlink_only": "yes"})
            yield event
            for match in down:
                s = make_sample(
                    self.ctx,
                    "gpu_nvlink_state",
                    0.0,
                    _gpu(match["gpu"]),
                    entry.lines[-1] if entry.lines else None,
                    {"link": match["link"]},
                )
                if s is not None:
                    yield s
            yield from known


def known_messages(
    ctx: ParseContext,
    text: str,
    entity: EntityId,
    lines: Sequence[Line],
    category: str,
    *,
    source: str = "dcgmi_health",
) -> Iterator[Record]:
    """Records for DCGM messages with a known meaning (``dcgm_errors.h`` texts).

    Row-remap and page-retirement states become ``dcgm_diag_error`` events (judged
    by the row-remap and retired-page rules); ``Detected XID n for GPU m`` and the
    uncontained-error message become ``xid`` events; volatile DBE counts become ECC
    samples; thermal clock throttling becomes a ``thermal_violation`` event.
    ``entity`` is the GPU the message is filed under, for messages naming none.
    """
    text = re.sub(r"\s+", " ", text)
    ev = tuple(line_evidence(ctx, ln) for ln in lines[:12])
    for pattern, code in (*_DEPLOY, *_HEALTH_KNOWN):
        for match in pattern.finditer(text):
            yield Event(
                kind="dcgm_diag_error",
                code=code,
                node=ctx.node,
                entity=_gpu(match[1]),
                observed_at=None,
                message=match[0],
                attrs={"category": category},
                evidence=ev,
                source=source,
            )
    for match in _XID_MSG.finditer(text):
        gpu = match["gpu"]
        xid = str(int(match["xid"] or match["xid2"]))
        yield Event(
            kind="xid",
            code=xid,
            node=ctx.node,
            entity=_gpu(gpu) if gpu is not None else entity,
            observed_at=None,
            message=match[0],
            attrs={"xid": xid, "message": match[0]},
            evidence=ev,
            source=source,
        )
    for match in _VOLATILE_DBE.finditer(text):
        s = make_sample(
            ctx,
            "gpu_ecc_errors_total",
            float(match["count"]),
            _gpu(match["gpu"]),
            lines[-1] if lines else None,
            {"type": "uncorrected", "scope": "volatile", "location": "total"},
        )
        if s is not None:
            yield s
    for match in _THERMAL_THROTTLE.finditer(text):
        yield Event(
            kind="thermal_violation",
            code=source,
            node=ctx.node,
            entity=_gpu(match[1]),
            observed_at=None,
            message=match[0],
            attrs={"test": category},
            evidence=ev,
            source=source,
        )


@dataclass(slots=True)
class _HealthEntry:
    """One GPU (or the node) in a health table: its verdict, subsystems and message cells."""

    entity: EntityId
    verdict: str
    cells: list[_Cell] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    subsystems: list[str] = field(default_factory=list)


_HEALTH_KNOWN = (
    (
        re.compile(
            r"GPU\s*(\d+) had uncorrectable memory errors and (?:\d+ )?pages? "
            r"(?:were|was|are|is) pending retirement",
            re.I,
        ),
        "retired_pages_pending",
    ),
    (
        re.compile(r"pending retired page has been detected (?:in|on|for) GPU\s*(\d+)", re.I),
        "retired_pages_pending",
    ),
    (
        re.compile(
            r"Pending page retirements together with a DBE were detected on GPU\s*(\d+)", re.I
        ),
        "retired_pages_pending",
    ),
)
"""DCGM messages (``DCGM_FR_PENDING_PAGE_RETIREMENTS``, ``..._DBE_PENDING_PAGE_...``)
beyond the deployment ones in ``_DEPLOY``."""

_VOLATILE_DBE = re.compile(
    r"Detected (?P<count>\d+) volatile double-bit ECC error\(?s?\)? in GPU\s*(?P<gpu>\d+)", re.I
)
"""``DCGM_FR_VOLATILE_DBE_DETECTED``: a volatile uncorrectable ECC count."""

_XID_MSG = re.compile(
    r"Detected XID (?P<xid>\d+) (?:for|on) GPU\s*(?P<gpu>\d+)"
    r"|uncontained error \(XID (?P<xid2>95)\)",
    re.I,
)
"""``DCGM_FR_XID_ERROR`` ("Detected XID 79 for GPU 3") and ``DCGM_FR_UNCONTAINED_ERROR``."""

_THERMAL_THROTTLE = re.compile(r"clock throttling due to thermal violation in GPU\s*(\d+)", re.I)
"""``DCGM_FR_CLOCK_THROTTLE_THERMAL``: thermal slowdown (a cooling problem)."""


def _health_json_gpus(value: Any, under_gpu: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(gpu id, node)`` for each GPU of a ``dcgmi health -j`` document.

    A GPU is a numeric key below a ``GPU`` key, whatever the nesting (``children``
    levels) in between.
    """
    if not isinstance(value, dict):
        return
    for key, child in value.items():
        if not isinstance(child, dict):
            continue
        if under_gpu and str(key).strip().isdigit():
            yield str(key).strip(), child
            continue
        yield from _health_json_gpus(child, under_gpu or str(key).strip().upper() == "GPU")


def _texts_deep(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts_deep(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts_deep(v)]
    return []


# ----------------------------------------------------------------------------- dmon

DMON_FIELDS: dict[str, tuple[str, float]] = {
    "XIDER": ("gpu_last_xid", 1.0),
    "POWER": ("gpu_power_watts", 1.0),
    "TMPTR": ("gpu_temperature_celsius", 1.0),
    "MMTMP": ("gpu_memory_temperature_celsius", 1.0),
    "GPUTL": ("gpu_utilization_ratio", 0.01),
    "MCUTL": ("gpu_memory_utilization_ratio", 0.01),
    "SMCLK": ("gpu_sm_clock_hertz", 1e6),
    "MMCLK": ("gpu_memory_clock_hertz", 1e6),
    "FBUSD": ("gpu_memory_used_bytes", 1024.0 * 1024.0),
    "TOTEC": ("gpu_energy_joules_total", 1e-3),
    "PCIRP": ("gpu_pcie_replays_total", 1.0),
    "TVLTN": ("gpu_thermal_violation_seconds_total", 1e-9),
    "PVLTN": ("gpu_power_violation_seconds_total", 1e-9),
}
"""``dcgmi dmon`` column short names (DCGM field short names) to catalog metric and scale.
``XIDER`` is field 230 ``DCGM_FI_DEV_XID_ERRORS``: the last Xid, a pointer, not a count."""

_DMON_HEADER = re.compile(r"^\s*#\s*Entity\s+(?P<cols>.*)$", re.I)
_DMON_ROW = re.compile(
    r"^\s*(?P<type>GPU|GPU-I|GPU-CI|Switch|Link|CPU)\s+(?P<id>\d+)\s+(?P<vals>.*)$"
)


class DcgmDmonParser:
    """``dcgmi dmon -e <fields>``: one row per entity per sample (DCGM user guide, "dmon")."""

    kind = "dcgmi_dmon"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score the ``#Entity`` header and ``GPU N value...`` rows."""
        head = any(_DMON_HEADER.match(ln.text) for ln in lines[:20])
        rows = sum(1 for ln in lines[:200] if _DMON_ROW.match(ln.text))
        if head:
            return 90
        if rows and command and "dmon" in command:
            return 80
        return 0

    def open(self, ctx: ParseContext) -> _DmonSession:
        """Start parsing dmon output."""
        return _DmonSession(ctx)


class _DmonSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.columns: list[str] | None = None

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        out: list[Record] = []
        for line in lines:
            head = _DMON_HEADER.match(line.text)
            if head is not None:
                self.columns = head["cols"].split()
                continue
            row = _DMON_ROW.match(line.text)
            if row is None:
                text = line.text.strip()
                if text and not re.match(r"^(ID\b|#)", text):
                    self.issue(line.number, f"not a dcgmi dmon row: {text[:80]!r}")
                continue
            if self.columns is None:
                self.issue(line.number, "dcgmi dmon row before its #Entity header")
                continue
            if row["type"] != "GPU":
                continue
            values = row["vals"].split()
            if len(values) != len(self.columns):
                self.issue(
                    line.number, f"expected {len(self.columns)} dmon values, got {len(values)}"
                )
            entity = _gpu(row["id"])
            for column, raw in zip(self.columns, values, strict=False):
                spec = DMON_FIELDS.get(column.upper())
                if spec is None or is_missing(raw):
                    continue
                try:
                    value = float(raw)
                except ValueError:
                    continue
                if is_blank(value):
                    continue
                s = make_sample(self.ctx, spec[0], value * spec[1], entity, line)
                if s is not None:
                    out.append(s)
        return out


# ------------------------------------------------------------------- nvlink status

_NVL_GPU = re.compile(r"^\s*gpuId\s+(?P<id>\d+):\s*$")
_NVL_SWITCH = re.compile(r"^\s*physicalId\s+(?P<id>\d+):\s*$")
_NVL_STATES = re.compile(r"^\s*(?:[UDX_]\s*)+$")


class DcgmNvlinkParser:
    """Parse ``dcgmi nvlink --link-status`` (``-s``).

    Per-link state U (up), D (down), X (disabled), _ (not supported), for GPUs
    and NvSwitches.
    """

    kind = "dcgmi_nvlink"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score the title, ``gpuId N:`` headers and state lines."""
        text = "\n".join(ln.text for ln in lines[:200])
        if "NvLink Link Status" in text or re.search(r"^\s*gpuId\s+\d+:", text, re.M):
            return 90
        if "Key: Up=U, Down=D" in text:
            return 60
        return 0

    def open(self, ctx: ParseContext) -> _NvlinkSession:
        """Start parsing link status."""
        return _NvlinkSession(ctx)


class _NvlinkSession(Session):
    def __init__(self, ctx: ParseContext) -> None:
        super().__init__(ctx)
        self.entity: EntityId | None = None
        self.switch = False

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        out: list[Record] = []
        ctx = self.ctx
        for line in lines:
            text = line.text.strip()
            gpu = _NVL_GPU.match(line.text)
            if gpu is not None:
                self.entity, self.switch = _gpu(gpu["id"]), False
                continue
            if _NVL_SWITCH.match(line.text) is not None:
                self.entity, self.switch = None, True
                out.append(self._inventory("present", line))
                continue
            if text.startswith("No NvSwitches found"):
                out.append(self._inventory("absent", line))
                continue
            if _NVL_STATES.match(line.text) and text:
                if self.switch or self.entity is None:
                    continue
                for link, state in enumerate(text.split()):
                    value = {"U": 1.0, "D": 0.0}.get(state)
                    if value is None:
                        continue  # X disabled, _ not supported: not a reading
                    s = make_sample(
                        ctx, "gpu_nvlink_state", value, self.entity, line, {"link": str(link)}
                    )
                    if s is not None:
                        out.append(s)
        return out

    def _inventory(self, code: str, line: Line) -> Event:
        return Event(
            kind="nvswitch_inventory",
            code=code,
            node=self.ctx.node,
            entity=NODE_ENTITY,
            observed_at=None,
            message=line.text.strip(),
            evidence=(line_evidence(self.ctx, line),),
            source="dcgmi_nvlink",
        )


# ------------------------------------------------------------------ hostengine log

_LOG_LINE = re.compile(
    r"^(?:\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:\.\d+)?\s+)?"
    r"(?P<level>DEBUG|INFO|WARN|WARNING|ERROR|CRITICAL)\s+\[\d+:\d+\]\s+(?P<msg>.*)$"
)
_LOG_HEALTH = re.compile(
    r"Detected an? (?P<verdict>WARNING|FAILURE|FAIL) in health system (?P<system>[\w ]+?):\s*"
    r"'?(?P<text>.*?)'?\s*(?:\[/|$)",
    re.I,
)


class DcgmLogParser:
    """DCGM's own log (``nv-hostengine.log``, ``nvvs.log``): health-watch incidents.

    Lines such as ``ERROR [pid:tid] [[Health]] Detected a WARNING in health system
    Thermal: 'Detected clocks event due to thermal violation in GPU 2...'`` become
    ``dcgm_health`` events (``thermal_violation`` for the thermal system), on the
    GPU the message names (DCGM user guide, "Health monitoring"). Other lines are
    read and skipped.
    """

    kind = "dcgm_log"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Score DCGM log lines (``LEVEL [pid:tid] ...`` with DCGM markers)."""
        hits = 0
        for line in lines[:200]:
            match = _LOG_LINE.match(line.text.strip())
            if match and ("[[" in match["msg"] or "/dcgm" in match["msg"] or "nvvs" in line.text):
                hits += 1
        return min(85, 30 + 10 * hits) if hits else 0

    def open(self, ctx: ParseContext) -> _LogSession:
        """Start parsing a DCGM log."""
        return _LogSession(ctx)


class _LogSession(Session):
    def feed(self, lines: Sequence[Line]) -> list[Record]:
        out: list[Record] = []
        for line in lines:
            match = _LOG_LINE.match(line.text.strip())
            if match is None:
                continue
            health = _LOG_HEALTH.search(match["msg"])
            if health is None:
                continue
            gpu = re.search(r"\bGPU\s*(\d+)", health["text"])
            entity = _gpu(gpu[1]) if gpu else NODE_ENTITY
            system = norm_key(health["system"])
            verdict = "failure" if health["verdict"].lower().startswith("fail") else "warning"
            if system == "thermal" and gpu:
                out.append(
                    Event(
                        kind="thermal_violation",
                        code="dcgm_health",
                        node=self.ctx.node,
                        entity=entity,
                        observed_at=None,
                        message=health["text"][:500],
                        attrs={"system": system},
                        evidence=(line_evidence(self.ctx, line),),
                        source="dcgm_log",
                    )
                )
                continue
            out.append(
                Event(
                    kind="dcgm_health",
                    code=verdict,
                    node=self.ctx.node,
                    entity=entity,
                    observed_at=None,
                    message=health["text"][:500],
                    attrs={"verdict": verdict, "system": system, "message": health["text"][:500]},
                    evidence=(line_evidence(self.ctx, line),),
                    source="dcgm_log",
                )
            )
        return out


PARSERS: tuple[ArtifactParser, ...] = (
    DcgmDiagParser(),
    DcgmHealthParser(),
    DcgmDmonParser(),
    DcgmNvlinkParser(),
    DcgmLogParser(),
)
"""The ``dcgmi`` artifact parsers."""
