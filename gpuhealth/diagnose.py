"""Offline triage: parse pasted artifacts and judge them with the fault model.

The output follows the ``gpuhealth diagnose --json`` contract of
``docs/fault-model.md`` (schema in ``gpuhealth/diagnose.schema.json``). Archives (tar,
tar.gz, tar.xz, tar.bz2, zip: a sosreport, a must-gather) are opened and each member is
diagnosed on its own (:mod:`collectors.archive`); a gzip of text stays a text file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from analytics.fault_model import Context, Observations, evaluate, worst
from collectors.archive import archive_kind, read_archive, strip_archive_suffix
from collectors.artifact import (
    ArtifactParser,
    ArtifactResult,
    ParseContext,
    ParseIssue,
    read_artifact,
)
from collectors.folder import Member, WalkReport, open_tail, walk
from collectors.parsers import artifact_parsers
from core.codec import finding_to_json
from core.records import Action, Finding, NodeName, Record, Severity
from storage.lineprotocol import DecodeReport, head_is_line_protocol, read_records

SCHEMA_VERSION = 1

EXIT_FOR_SEVERITY = {Severity.INFO: 0, Severity.WARNING: 1, Severity.MAJOR: 2, Severity.CRITICAL: 3}
"""Exit status of ``diagnose`` for the worst severity (fault-model.md)."""

EXIT_UNPARSEABLE = 4
"""Exit status when nothing in the input could be parsed."""


@dataclass(slots=True, kw_only=True)
class Diagnosis:
    """The result of one ``diagnose`` call over all its paths."""

    findings: list[Finding]
    issues: list[ParseIssue]
    parsed_anything: bool
    kinds: list[str] = field(default_factory=list)
    walk: WalkReport = field(default_factory=WalkReport)
    """What the walk of the folders given skipped or read from the tail only."""

    @property
    def worst_severity(self) -> Severity:
        """The highest severity among the findings, ``info`` when there are none."""
        return worst(self.findings)[0]

    @property
    def worst_actions(self) -> list[Action]:
        """Sorted unique actions of the findings that carry the worst severity."""
        return worst(self.findings)[1]

    @property
    def exit_status(self) -> int:
        """0-3 by worst severity, 4 when nothing could be parsed."""
        if not self.parsed_anything:
            return EXIT_UNPARSEABLE
        return EXIT_FOR_SEVERITY[self.worst_severity]

    def to_json(self) -> dict[str, Any]:
        """Return the contract's JSON object."""
        return {
            "schema_version": SCHEMA_VERSION,
            "worst_severity": self.worst_severity.value,
            "worst_actions": [a.value for a in self.worst_actions],
            "findings": [finding_to_json(f) for f in self.findings],
            "errors": [{"file": i.file, "line": i.line, "reason": i.reason} for i in self.issues],
        }


def expand_paths(paths: Sequence[str], report: WalkReport | None = None) -> Iterator[str]:
    """Yield the files named by ``paths``; folders are walked with the bounds of a walk.

    :func:`collectors.folder.walk` (hidden and code folders, links, binary and non-log
    files skipped, at most :data:`~collectors.folder.MAX_FILES` files), members whole:
    ``replay`` reads recordings in full. ``report`` receives what was skipped.
    """
    for member in walk(paths, report, tail_large=False):
        yield member.path


def _file_node(path: str) -> str:
    """Return the node a file of a folder stands for: its name without the extension."""
    name = os.path.basename(path)
    stripped = strip_archive_suffix(name)
    if stripped != name:
        return stripped
    for suffix in (".gz",):
        name = name.removesuffix(suffix)
    return os.path.splitext(name)[0] or name


LINE_PROTOCOL_SUFFIXES = (".lp", ".influx", ".line")
"""File endings read as InfluxDB line protocol (``gpuhealth export`` writes ``.lp``)."""
BINARY_PROBE_BYTES = 8192
"""How much of a line-protocol file is searched for NUL bytes before it is parsed."""


def _is_line_protocol(path: str) -> bool:
    """Whether the file at ``path`` holds line protocol, whatever its name.

    A recording saved as ``.log`` must not reach the kernel-log parser, which would see
    "Xid 48" in an event's message and find nothing.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(BINARY_PROBE_BYTES)
    except OSError:
        return False  # the artifact reader reports it
    return head_is_line_protocol(head, cut=len(head) == BINARY_PROBE_BYTES)


def _line_protocol(path: str, result: ArtifactResult, *, now: float) -> Iterator[Record]:
    """Stream the records of a line-protocol file; rejected lines go to ``result.issues``.

    Records keep their own nodes and times. ``now`` (epoch seconds, 0 = the system clock)
    is the clock that far-future times are judged against. The records are streamed into
    the observations, never held: a recording of a fleet is gigabytes.
    """
    report = DecodeReport()
    records = 0
    try:
        with open(path, "rb") as fh:
            if b"\x00" in fh.read(BINARY_PROBE_BYTES):
                result.issues.append(ParseIssue(file=path, line=None,
                                                reason="binary file (NUL bytes), not text"))
                return
        for record in read_records([path], report=report,
                                   clock=(lambda: now) if now else time.time):
            records += 1
            yield record
    except OSError as exc:
        result.issues.append(ParseIssue(file=path, line=None, reason=f"cannot read: {exc}"))
        return
    for problem in report.problems:
        shown = "".join(c if c.isprintable() else "?" for c in problem.text)
        result.issues.append(ParseIssue(file=problem.file, line=problem.line,
                                        reason=f"{problem.reason}: {shown}"))
    if records:
        result.parsed_lines += records
        result.kinds.append("line_protocol")
    elif not report.problems:
        result.issues.append(ParseIssue(file=path, line=None, reason="no records"))


def diagnose(
    paths: Sequence[str],
    facts: Mapping[str, str] | None = None,
    *,
    now: float = 0.0,
    default_year: int | None = None,
) -> Diagnosis:
    """Parse ``paths`` and return the diagnosis.

    Args:
        paths: Files or folders of artifacts.
        facts: Machine facts (``nvlink=absent``, ``node=gpu-017``).
        now: Epoch seconds used as "now" by rules.
        default_year: Year for time stamps that carry none; ``None`` lets each
            parser infer it from the file, else the year of ``now``.
    """
    facts = dict(facts or {})
    node = NodeName(facts.get("node", "localhost"))
    folders = [os.path.normpath(p) for p in paths if os.path.isdir(p)]
    parsers = artifact_parsers()
    observations = Observations()
    issues: list[ParseIssue] = []
    kinds: list[str] = []
    parsed_anything = False
    walked = WalkReport()
    for member in walk(paths, walked):
        path = member.path
        result = ArtifactResult()
        # Files named one by one are one machine's artifacts; the files of a folder are a
        # collection (a case folder, a fleet's logs): each is its own node unless
        # --context node=... says otherwise, so one file's facts never leak into another.
        in_folder = "node" not in facts and any(
            os.path.normpath(path).startswith(folder + os.sep) for folder in folders
        )
        file_node = NodeName(_file_node(path)) if in_folder else node
        if archive_kind(path):
            # A bundle (sosreport, must-gather, tar of /var/log): each member on its own,
            # named archive:member in evidence and issues, read in bounded memory.
            ctx = ParseContext(file=path, node=file_node, default_year=default_year)
            observations.extend(read_archive(path, ctx, parsers, result))
        elif path.endswith(LINE_PROTOCOL_SUFFIXES) or _is_line_protocol(path):
            # Recorded telemetry (`gpuhealth export`): its events and samples, read with the
            # checks of `gpuhealth import` (a rejected line is an issue with its number).
            if member.offset:
                result.issues.append(ParseIssue(
                    file=path, line=None, reason=f"a line-protocol recording over "
                    f"{walked.max_file_bytes // 2**20} MiB in a folder: not read (give it by name, "
                    "or replay it, to read it whole)"))
            else:
                observations.extend(_line_protocol(path, result, now=now))
        else:
            ctx = ParseContext(file=path, node=file_node, default_year=default_year)
            _read_member(member, ctx, parsers, result, observations)
        issues.extend(result.issues)
        kinds.extend(result.kinds)
        parsed_anything = parsed_anything or result.parsed_lines > 0
    findings = evaluate(observations, Context(facts=facts, now=now))
    return Diagnosis(findings=findings, issues=issues, parsed_anything=parsed_anything,
                     kinds=kinds, walk=walked)


def _read_member(member: Member, ctx: ParseContext, parsers: Sequence[ArtifactParser],
                 result: ArtifactResult, observations: Observations) -> None:
    """Stream one file into ``observations``; a folder member over the cap from its tail."""
    if not member.offset:
        observations.extend(read_artifact(member.path, ctx, parsers, result))
        return
    try:
        with open_tail(member) as tail:
            observations.extend(read_artifact(member.path, ctx, parsers, result, stream=tail))
    except OSError as exc:
        result.issues.append(ParseIssue(file=member.path, line=None,
                                        reason=f"cannot read: {exc.strerror or exc}"))
