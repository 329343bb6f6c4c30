from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

from collectors.artifact import (
    MAX_BLOCK_LINES,
    MAX_LINE_CHARS,
    ArtifactResult,
    Line,
    ParseContext,
    ParseIssue,
    iter_blocks,
    parse_lines,
    read_artifact,
)
from core.records import Event, NodeName, Record


def lines(text: str) -> list[Line]:
    return [Line(i, t) for i, t in enumerate(text.splitlines(), start=1)]


class _Session:
    def __init__(self, kind: str, ctx: ParseContext, log: list[tuple[str, list[int]]]) -> None:
        self.kind, self.ctx, self.log = kind, ctx, log
        self.issues: list[ParseIssue] = []

    def feed(self, block: Sequence[Line]) -> Iterable[Record]:
        self.log.append((self.kind, [ln.number for ln in block]))
        return []

    def close(self) -> Iterable[Record]:
        return [
            Event(
                kind=self.kind,
                code="closed",
                node=self.ctx.node,
                entity="node",  # type: ignore[arg-type]
                observed_at=None,
            )
        ]


class _Parser:
    def __init__(self, kind: str, marker: str, log: list[tuple[str, list[int]]]) -> None:
        self.kind, self.marker, self.log = kind, marker, log

    def detect(self, block: Sequence[Line], command: str | None) -> int:
        return 90 if any(self.marker in ln.text for ln in block) else 0

    def open(self, ctx: ParseContext) -> _Session:
        return _Session(self.kind, ctx, self.log)


def test_blocks_split_at_prompts_and_blank_lines_and_drop_elisions() -> None:
    text = "root@node-a:~# nvidia-smi\nA\n[...]\nB\n\nC\n$ dmesg -T\nD\nroot@node-a:~# \n"
    blocks = list(iter_blocks(lines(text)))
    assert [[ln.text for ln in b.lines] for b in blocks] == [["A", "B"], ["C"], ["D"]]
    assert [b.command for b in blocks] == ["nvidia-smi", "nvidia-smi", "dmesg -T"]
    assert [b.new_command for b in blocks] == [True, False, True]


def test_long_blocks_are_cut_to_bound_memory() -> None:
    blocks = list(iter_blocks(Line(i, "x") for i in range(1, 2 * MAX_BLOCK_LINES + 2)))
    assert [len(b.lines) for b in blocks] == [MAX_BLOCK_LINES, MAX_BLOCK_LINES, 1]


def test_sections_of_one_kind_share_a_session_and_kinds_change_by_content() -> None:
    log: list[tuple[str, list[int]]] = []
    parsers = [_Parser("alpha", "AAA", log), _Parser("beta", "BBB", log)]
    text = "AAA 1\n\nAAA 2\nplain\n\nBBB 3\n\nnothing known here\n"
    result = ArtifactResult()
    ctx = ParseContext(file="f.txt", node=NodeName("n1"))
    records = list(parse_lines(lines(text), ctx, parsers, result))
    assert log == [("alpha", [1]), ("alpha", [3, 4]), ("beta", [6]), ("beta", [8])]
    assert [r.kind for r in records if isinstance(r, Event)] == ["alpha", "beta"]
    assert result.kinds == ["alpha", "beta"]


def test_unrecognised_sections_are_skipped_quietly_beside_recognised_ones() -> None:
    log: list[tuple[str, list[int]]] = []
    result = ArtifactResult()
    ctx = ParseContext(file="f.txt", node=NodeName("n1"))
    list(parse_lines(lines("hello\nworld\n\nAAA\n"), ctx, [_Parser("alpha", "AAA", log)], result))
    result.summarise("f.txt")
    assert result.issues == []
    assert result.skipped_sections == 1


def test_input_with_nothing_recognised_is_one_issue_naming_file_and_line() -> None:
    log: list[tuple[str, list[int]]] = []
    result = ArtifactResult()
    ctx = ParseContext(file="f.txt", node=NodeName("n1"))
    list(
        parse_lines(lines("\nhello\nworld\n\nmore\n"), ctx, [_Parser("alpha", "AAA", log)], result)
    )
    result.summarise("f.txt")
    (issue,) = result.issues
    assert (issue.file, issue.line) == ("f.txt", 2)
    assert "no known artifact" in issue.reason
    assert "2 section(s)" in issue.reason


def test_stdin_gzip_utf16_and_long_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip
    import io
    import sys

    text = "AAA one\nAAA two\n"
    gz = tmp_path / "kern.log.2.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    u16 = tmp_path / "u16.log"
    u16.write_text(text, encoding="utf-16")
    longf = tmp_path / "long.log"
    longf.write_text("AAA " + "x" * (MAX_LINE_CHARS * 2) + "\nAAA tail\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    for path, lines_expected in ((str(gz), 2), (str(u16), 2), ("-", 2), (str(longf), 2)):
        log: list[tuple[str, list[int]]] = []
        result = ArtifactResult()
        ctx = ParseContext(file=path, node=NodeName("n"))
        list(read_artifact(path, ctx, [_Parser("alpha", "AAA", log)], result))
        assert result.parsed_lines == lines_expected, path
    assert "cut" in result.issues[0].reason
    assert result.issues[0].line == 1


def test_binary_empty_and_missing_files_are_issues(tmp_path: Path) -> None:
    binary = tmp_path / "core.bin"
    binary.write_bytes(b"\x7fELF\x00\x01\x02")
    empty = tmp_path / "empty.log"
    empty.write_text("")
    for path, reason in ((binary, "binary"), (empty, "empty"), (tmp_path / "gone", "cannot read")):
        result = ArtifactResult()
        ctx = ParseContext(file=str(path), node=NodeName("n"))
        assert list(read_artifact(str(path), ctx, [], result)) == []
        assert reason in result.issues[0].reason
        assert result.issues[0].file == str(path)


def test_nul_padding_after_a_crash_keeps_the_text(tmp_path: Path) -> None:
    """A syslog after a power cycle: text, a run of NUL bytes, text. The Xid survives."""
    from gpuhealth.diagnose import diagnose as run_diagnose

    log = tmp_path / "syslog"
    xid = ("Apr  6 10:00:00 n kernel: NVRM: Xid (PCI:0000:b1:00): 79, pid='<unknown>', "
           "name=<unknown>, GPU has fallen off the bus.\n")
    log.write_bytes(xid.encode() + b"\x00" * 4096 + b"Apr  6 10:05:01 n kernel: Linux version\n")
    report = run_diagnose([str(log)])
    assert any(f.code == "79" for f in report.findings)
    assert any("NUL bytes removed" in i.reason for i in report.issues)
    binary = tmp_path / "blob"
    binary.write_bytes(bytes(range(256)) * 16)
    report = run_diagnose([str(binary)])
    assert not report.findings
    assert any("binary file" in i.reason for i in report.issues)


def test_a_named_pipe_in_a_folder_is_skipped(tmp_path: Path) -> None:
    import os

    from gpuhealth.diagnose import expand_paths

    (tmp_path / "kern.log").write_text("hello\n")
    os.mkfifo(tmp_path / "pipe")
    assert list(expand_paths([str(tmp_path)])) == [str(tmp_path / "kern.log")]


def test_diagnose_reads_line_protocol_files_with_the_import_checks(tmp_path: Path) -> None:
    # A recorded fleet's telemetry (`gpuhealth export`) holding an Xid 48 event must give
    # the critical finding, not "no findings"; its bad lines are issues with line numbers;
    # a binary file is refused.
    from gpuhealth.diagnose import diagnose

    good = tmp_path / "fleet.lp"
    good.write_text(
        "gpu,entity=00000000:18:00.0,node=node-0000 temperature_celsius=36.0 "
        "1767225600000000000\n"
        "gpuhealth_event,code=48,entity=00000000:18:00.0,kind=xid,node=node-0000,"
        'source=synthetic count=1.0,message="Xid 48: double-bit ECC error",attrs="{}",'
        'evidence="[]" 1767226800000000000\n'
        "gpu,entity=00000000:18:00.0,node=node-0000 temperature_celsius=99.0 "
        "4102444800000000000\n"
        "gpu,entity=00000000:18:00.0,node=node-0000 temperature_celsius=3"
    )
    result = diagnose([str(good)], now=1767230000.0)
    assert [(f.kind, f.code, f.severity.value) for f in result.findings] == \
        [("xid", "48", "critical")]
    assert [(i.line, i.reason.split(":")[0]) for i in result.issues] == \
        [(3, "future"), (4, "truncated")]
    binary = tmp_path / "junk.lp"
    binary.write_bytes(b"\x00\x01\x02gpu x=1 1\n")
    refused = diagnose([str(binary)])
    assert not refused.parsed_anything
    assert [i.reason for i in refused.issues] == ["binary file (NUL bytes), not text"]
    named_gz = tmp_path / "kern.log.2.gz"  # not gzip inside: said so, not merely "binary"
    named_gz.write_bytes(b"\x00\x01\x02gpu x=1 1\n")
    assert [i.reason for i in diagnose([str(named_gz)]).issues] == \
        ["not a gzip file though its name says so (binary, not text)"]


def test_diagnose_reads_line_protocol_whatever_the_file_is_named(tmp_path: Path) -> None:
    from gpuhealth.diagnose import diagnose

    saved = tmp_path / "fleet.log"
    saved.write_text(
        "gpuhealth_event,code=48,entity=00000000:18:00.0,kind=xid,node=node-0000,"
        'source=synthetic count=1.0,message="Xid 48: double-bit ECC error",attrs="{}",'
        'evidence="[]" 1767226800000000000\n'
    )
    result = diagnose([str(saved)], now=1767230000.0)
    assert [(f.code, f.severity.value) for f in result.findings] == [("48", "critical")]
