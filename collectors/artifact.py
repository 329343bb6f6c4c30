"""Reading pasted artifacts: split a file into sections and parse each by its detected kind.

Operators paste the output of several commands into one file (shell prompts,
headers, elisions such as ``[...]``). :func:`read_artifact` streams the file line by
line, cuts it into blocks at shell prompts and blank lines, asks every registered
:class:`ArtifactParser` how sure it is that a block is its kind (content, not the
file name, decides), and feeds consecutive blocks of one kind to one parser
session so that multi-line messages and documents stay whole. Memory stays
bounded: a block holds at most :data:`MAX_BLOCK_LINES` lines.

Every problem is reported as a :class:`ParseIssue` naming the file and line;
nothing raises for bad input.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import logging
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol, cast, runtime_checkable

from core.records import NodeName, Record

logger = logging.getLogger(__name__)

MAX_BLOCK_LINES = 2000
"""Blocks are cut at this many lines so that a 1 GB log is parsed in bounded memory."""

MIN_SCORE = 20
"""A block whose best detection score is below this is not recognised."""

_BINARY_PROBE_BYTES = 8192


@dataclass(frozen=True, slots=True)
class Line:
    """One input line: 1-based ``number`` and ``text`` without the newline."""

    number: int
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ParseIssue:
    """A part of an input that could not be parsed (the ``errors`` of diagnose --json)."""

    file: str
    line: int | None
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ParseContext:
    """What a parser knows besides the lines.

    Attributes:
        file: Input path as given (used in evidence and issues).
        node: Node the records belong to unless a line names its host.
        default_year: Year assumed for time stamps without one (syslog,
            journal); ``None`` lets the parser infer it from the file.
        command: The shell command that produced the section, if it was pasted.
    """

    file: str
    node: NodeName
    default_year: int | None = None
    command: str | None = None


@dataclass(slots=True, kw_only=True)
class Block:
    """Consecutive lines between shell prompts or blank lines."""

    lines: list[Line]
    command: str | None = None
    new_command: bool = False


@runtime_checkable
class ParserSession(Protocol):
    """One parse of one section; fed block by block, closed at the section's end."""

    issues: list[ParseIssue]

    def feed(self, lines: Sequence[Line]) -> Iterable[Record]:
        """Parse more lines of the section; return the records completed so far."""
        ...

    def close(self) -> Iterable[Record]:
        """Finish the section; return the records still held back (joined messages)."""
        ...


@runtime_checkable
class UnreadLines(Protocol):
    """A session that finds, once closed, that lines it was fed could not be read at all.

    ``unread_lines`` of them do not count as parsed: an ``nvidia-smi -q -x`` document cut
    before its first complete element is unreadable (``diagnose`` exit 4), not a document
    without findings.
    """

    unread_lines: int


@runtime_checkable
class ArtifactParser(Protocol):
    """Parses one artifact kind (a kernel log, ``nvidia-smi -q``, ``ibstat``...)."""

    kind: str

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 0-100: how sure the parser is that ``lines`` are its kind.

        Args:
            lines: The first block of a candidate section (at most
                :data:`MAX_BLOCK_LINES` lines, elision markers removed).
            command: The shell command pasted before the block, if any.
        """
        ...

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        ...


# A prompt: "$ cmd", "root@host:~# cmd", "user@host:/path$ cmd", "[root@host ~]# cmd".
_PROMPT = re.compile(
    r"^\s*(?:\$|[\w.-]+@[\w.-]+:[^\s#$]*\s*[#$]|\[[\w.-]+@[\w.-]+ [^\]]*\][#$])"
    r"(?:\s+(?P<cmd>\S.*?))?\s*$"
)
# A bare command line pasted without a prompt ("nvidia-smi nvlink -s").
_BARE_COMMAND = re.compile(
    r"^\s*(?:sudo\s+)?(?:nvidia-smi|dcgmi|ibstat|ibstatus|perfquery|ibqueryerrors|ethtool|dmesg|"
    r"journalctl|lspci|kubectl|nvidia-bug-report\.sh)(?:\s+[-\w=,./|'\" ]*)?\s*$"
)
_ELISION = re.compile(r"^\s*(?:\[\s*\.\.\.\s*\]|\.{3,}|…)\s*$")


_COMMAND_NAMES = frozenset(
    [
        "nvidia-smi",
        "dcgmi",
        "ibstat",
        "ibstatus",
        "perfquery",
        "ibqueryerrors",
        "ethtool",
        "dmesg",
        "journalctl",
        "lspci",
        "kubectl",
        "nvidia-bug-report.sh",
        "sudo",
    ]
)


def command_of(text: str) -> tuple[bool, str | None]:
    """Return ``(is_prompt_line, command)`` for one line.

    Cheap checks come first: most lines of a large log are neither prompts nor
    commands, and this runs on every line.

    Examples:
        >>> command_of("root@node-a:~# dmesg -T | grep NVRM")
        (True, 'dmesg -T | grep NVRM')
        >>> command_of("$ nvidia-smi")
        (True, 'nvidia-smi')
        >>> command_of("nvidia-smi nvlink -s")
        (True, 'nvidia-smi nvlink -s')
        >>> command_of("root@node-a:~# ")
        (True, None)
        >>> command_of("[ 12.3] NVRM: Xid")
        (False, None)
    """
    stripped = text.lstrip()
    if not stripped:
        return False, None
    first = stripped[0]
    if first == "$" or ("@" in stripped and ("#" in stripped or "$" in stripped)):
        match = _PROMPT.match(text)
        if match:
            return True, match["cmd"]
    if stripped.split(" ", 1)[0] in _COMMAND_NAMES and _BARE_COMMAND.match(text):
        return True, stripped.rstrip()
    return False, None


def iter_blocks(lines: Iterable[Line]) -> Iterator[Block]:
    """Cut lines into blocks at prompts and blank lines; drop elision markers.

    A block carries the last command seen; ``new_command`` is true for the first
    block after a prompt line.
    """
    command: str | None = None
    new_command = False
    current: list[Line] = []
    for line in lines:
        text = line.text
        is_prompt, cmd = command_of(text)
        if is_prompt:
            if current:
                yield Block(lines=current, command=command, new_command=new_command)
                current = []
            command, new_command = cmd, True
            continue
        if not text.strip():
            if current:
                yield Block(lines=current, command=command, new_command=new_command)
                current, new_command = [], False
            continue
        if ("..." in text or "…" in text) and _ELISION.match(text):
            continue
        current.append(line)
        if len(current) >= MAX_BLOCK_LINES:
            yield Block(lines=current, command=command, new_command=new_command)
            current, new_command = [], False
    if current:
        yield Block(lines=current, command=command, new_command=new_command)


MAX_ISSUES = 200
"""Issues kept per file; past it they are counted and summarised in one last issue."""


@dataclass(slots=True, kw_only=True)
class ArtifactResult:
    """Issues found while reading one file, and the kinds of sections recognised.

    Attributes:
        issues: Up to :data:`MAX_ISSUES` problems, in input order.
        kinds: Kinds of the sections recognised, in order.
        parsed_lines: Lines handed to a parser.
        suppressed_issues: Problems past :data:`MAX_ISSUES`, counted only.
        skipped_sections: Sections no parser recognised.
        first_skipped: Line and description of the first of them.
    """

    issues: list[ParseIssue] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    parsed_lines: int = 0
    suppressed_issues: int = 0
    skipped_sections: int = 0
    first_skipped: tuple[int, str] | None = None

    def add_issues(self, issues: Iterable[ParseIssue]) -> None:
        """Keep ``issues`` up to :data:`MAX_ISSUES`; count the rest."""
        for issue in issues:
            if len(self.issues) < MAX_ISSUES:
                self.issues.append(issue)
            else:
                self.suppressed_issues += 1

    def skip(self, file: str, block: Block) -> None:
        """Note a section no parser recognised (shell noise such as ``lsmod``, ``uname``).

        Skipped sections are logged, not reported as errors, unless nothing in the
        file is recognised at all (see :meth:`summarise`).
        """
        first = block.lines[0]
        note = (
            f"line {first.number}: {len(block.lines)} lines, command "
            f"{block.command or 'unknown'}: {first.text.strip()[:80]!r}"
        )
        logger.info("%s: skipped a section no parser recognises (%s)", file, note)
        if self.first_skipped is None:
            self.first_skipped = (first.number, note)
        self.skipped_sections += 1

    def summarise(self, file: str) -> None:
        """Close the file's report: one issue when nothing in it was recognised.

        Also appends one issue saying how many problems were left out, if any.
        """
        if self.parsed_lines == 0 and not self.issues and self.first_skipped is not None:
            line, note = self.first_skipped
            self.issues.append(
                ParseIssue(
                    file=file,
                    line=line,
                    reason=f"no known artifact kind in this input ({self.skipped_sections} "
                    f"section(s) not recognised; first at {note})",
                )
            )
        if self.suppressed_issues:
            self.issues.append(
                ParseIssue(
                    file=file,
                    line=None,
                    reason=f"{self.suppressed_issues} more problems in this file not listed",
                )
            )
            self.suppressed_issues = 0


MAX_LINE_CHARS = 65536
"""Longer lines are cut (and the cut reported), so one huge line cannot exhaust memory."""

_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
         (codecs.BOM_UTF16_BE, "utf-16"))
_GZIP_MAGIC = b"\x1f\x8b"


def _read_lines(path: str, result: ArtifactResult,
                stream: BinaryIO | None = None) -> Iterator[Line]:
    """Yield the lines of ``path`` (``-`` is standard input) from one open handle.

    With ``stream`` (an archive's member, :mod:`collectors.archive`), the lines are read
    from it and ``path`` only names it.

    The file is opened once, so pipes and process substitutions work. gzip files
    (rotated ``kern.log.2.gz``) are decompressed; a UTF-8 or UTF-16 byte-order mark
    picks the encoding; other text is read as UTF-8 with undecodable bytes replaced.
    Binary data, empty input and unreadable files become issues; runs of NUL bytes in
    text (a syslog's padding after a crash) are removed, with one issue saying so.
    """
    with contextlib.ExitStack() as stack:
        try:
            if stream is not None:
                raw: BinaryIO = stream
            elif path == "-":
                raw = sys.stdin.buffer
            else:
                raw = stack.enter_context(open(path, "rb"))
            buffered: io.BufferedReader = (
                raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(cast(Any, raw))
            )
            head = buffered.peek(_BINARY_PROBE_BYTES)[:_BINARY_PROBE_BYTES]
            if head.startswith(_GZIP_MAGIC):
                unzipped = stack.enter_context(gzip.GzipFile(fileobj=buffered, mode="rb"))
                buffered = io.BufferedReader(cast(Any, unzipped))
                head = buffered.peek(_BINARY_PROBE_BYTES)[:_BINARY_PROBE_BYTES]
        except (OSError, EOFError) as exc:
            reason = f"cannot read: {getattr(exc, 'strerror', None) or exc}"
            result.issues.append(ParseIssue(file=path, line=None, reason=reason))
            return
        if not head:
            reason = "empty file" if path != "-" else "empty standard input"
            result.issues.append(ParseIssue(file=path, line=None, reason=reason))
            return
        encoding = next((enc for bom, enc in _BOMS if head.startswith(bom)), "utf-8")
        if encoding == "utf-8" and b"\x00" in head:
            # A syslog after a hard crash or power cycle holds runs of NUL padding between
            # lines of text: keep the text. Binary data has control bytes besides NULs.
            without_nul = head.replace(b"\x00", b"")
            control = sum(1 for b in without_nul if b < 32 and b not in (9, 10, 13))
            if control > 0.02 * len(without_nul):
                reason = "binary file (NUL bytes), not text"
                if path.endswith((".gz", ".tgz")) and not head.startswith(_GZIP_MAGIC):
                    reason = "not a gzip file though its name says so (binary, not text)"
                result.issues.append(ParseIssue(file=path, line=None, reason=reason))
                return
        text = io.TextIOWrapper(buffered, encoding=encoding, errors="replace", newline=None)
        number = 0
        nul_noted = False
        try:
            while chunk := text.readline(MAX_LINE_CHARS):
                number += 1
                if "\x00" in chunk:
                    chunk = chunk.replace("\x00", "")
                    if not nul_noted:
                        nul_noted = True
                        result.add_issues([ParseIssue(
                            file=path, line=number,
                            reason="NUL bytes removed (padding left by a crash or power cycle)")])
                if len(chunk) >= MAX_LINE_CHARS and not chunk.endswith("\n"):
                    while (rest := text.readline(MAX_LINE_CHARS)) and not rest.endswith("\n"):
                        pass
                    reason = f"line longer than {MAX_LINE_CHARS} characters: cut"
                    result.add_issues([ParseIssue(file=path, line=number, reason=reason)])
                yield Line(number, chunk.rstrip("\n"))
        except (OSError, EOFError) as exc:
            reason = f"cannot read past line {number}: {exc}"
            result.issues.append(ParseIssue(file=path, line=number + 1, reason=reason))


def parse_lines(
    lines: Iterable[Line],
    ctx: ParseContext,
    parsers: Sequence[ArtifactParser],
    result: ArtifactResult,
) -> Iterator[Record]:
    """Parse an iterable of lines into records, detecting each section's kind.

    Issues (unrecognised sections, malformed lines) go to ``result.issues``.
    """
    session: ParserSession | None = None
    session_kind: str | None = None
    session_command: str | None = None

    def finish() -> Iterator[Record]:
        nonlocal session
        if session is not None:
            yield from session.close()
            if isinstance(session, UnreadLines):
                result.parsed_lines -= session.unread_lines
            result.add_issues(session.issues)
            session.issues.clear()
            session = None

    for block in iter_blocks(lines):
        same_section = session is not None and not block.new_command
        if same_section and session_kind is not None:
            keep = next(p for p in parsers if p.kind == session_kind)
            if keep.detect(block.lines, block.command) >= MIN_SCORE or not _recognised(
                parsers, block, exclude=session_kind
            ):
                assert session is not None
                yield from session.feed(block.lines)
                result.parsed_lines += len(block.lines)
                continue
        best, score = _best(parsers, block)
        if best is None or score < MIN_SCORE:
            yield from finish()
            session_kind = None
            result.skip(ctx.file, block)
            continue
        if session is not None and best.kind == session_kind and block.command == session_command:
            yield from session.feed(block.lines)
            result.parsed_lines += len(block.lines)
            continue
        yield from finish()
        session_kind, session_command = best.kind, block.command
        session = best.open(
            ParseContext(
                file=ctx.file, node=ctx.node, default_year=ctx.default_year, command=block.command
            )
        )
        result.kinds.append(best.kind)
        yield from session.feed(block.lines)
        result.parsed_lines += len(block.lines)
    yield from finish()


def _best(parsers: Sequence[ArtifactParser], block: Block) -> tuple[ArtifactParser | None, int]:
    best: ArtifactParser | None = None
    score = 0
    for parser in parsers:
        s = parser.detect(block.lines, block.command)
        if s > score:
            best, score = parser, s
    return best, score


def _recognised(parsers: Sequence[ArtifactParser], block: Block, *, exclude: str) -> bool:
    return any(
        p.detect(block.lines, block.command) >= MIN_SCORE for p in parsers if p.kind != exclude
    )


def read_artifact(
    path: str, ctx: ParseContext, parsers: Sequence[ArtifactParser], result: ArtifactResult,
    *, stream: BinaryIO | None = None,
) -> Iterator[Record]:
    """Stream the records of the file at ``path``; issues go to ``result.issues``.

    ``stream``: read the bytes from it instead (an archive member named ``path``).
    """
    yield from parse_lines(_read_lines(path, result, stream), ctx, parsers, result)
    result.summarise(path)
