"""The fast path of `storage.read_records` gives exactly what the full decoder gives.

`read_records` decodes a common line (numeric fields, a time in range, no escape or quote, a
series part seen before) without `decode_line` and `check_samples`; every other line takes the
full path. Both must yield the same records and report the same counts and lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.clock import FakeClock
from core.records import Record, Sample
from storage import lineprotocol
from storage.lineprotocol import DecodeReport, read_lines, read_records

NOW = 1_700_000_000.0
AT = 1_700_000_000 * 1_000_000_000

TRICKY = [
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=41.5,power_watts=300 {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=41.5,power_watts=300 {AT + 60 * 10**9}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=nan {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=inf {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=-Infinity {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=true {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=12i {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=1_0 {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=1,temperature_celsius=2 {AT}",
    f'gpu,entity=GPU-a,node=n1 temperature_celsius="hot" {AT}',
    f"gpu,entity=GPU-a,node=n1 temperature_celsius= {AT}",
    f"gpu,entity=GPU-a,node=n1 =3 {AT}",
    "gpu,entity=GPU-a,node=n1 temperature_celsius=3",
    "gpu,entity=GPU-a,node=n1 temperature_celsius=3 4102444800000000000",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=3 {AT // 10**6}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=3 12x{AT}",
    f"\tgpu,entity=GPU-a,node=n1 temperature_celsius=3 {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=3 {AT}\t",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=3 {AT}\r",
    f"gpu,entity=GPU-a,node=n1  temperature_celsius=3 {AT}",
    f"gpu,entity=GPU\\ a,node=n1 temperature_celsius=3 {AT}",
    f"gpu,host=h1,entity=GPU-a temperature_celsius=3 {AT}",
    f"gpu,host=h1,node=n1,uuid=GPU-u temperature_celsius=3 {AT}",
    f"gpu,node=n1 temperature_celsius=3 {AT}",
    f"gpu,entity=GPU-a,node=n1,__bad=x temperature_celsius=3 {AT}",
    f"gpu,entity=GPU-a,node=n1,empty= temperature_celsius=3 {AT}",
    f"gpu,entity=GPU-a,node=n1,type=corrected,scope=volatile ecc_errors_total=0.0 {AT}",
    f"gpu,entity=GPU-a,node=n1,broken temperature_celsius=3 {AT}",
    f"9gpu,entity=GPU-a,node=n1 temperature_celsius=3 {AT}",
    f"gpu,entity=GPU-a,node=n1 value=3 {AT}",
    f",entity=GPU-a,node=n1 value=3 {AT}",
    "# a comment",
    "",
    "   ",
    f'gpuhealth_event,code=48,entity=GPU-a,kind=xid,node=n1,source=t count=1.0,message="Xid 48"'
    f',attrs="{{}}",evidence="[]" {AT}',
    f"gpuhealth_event,code=48,entity=GPU-a,kind=xid,node=n1 count=1.0 {AT}",
    f"gpu,entity=GPU-a,node=n1 temperature_celsius=3 {AT} extra",
]


def _read(path: Path, *, fast: bool, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[list[Record], DecodeReport]:
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(lineprotocol._FastLines, "decode", lambda self, line, low, high: None)
        report = DecodeReport()
        records = list(read_records([path], report=report, clock=FakeClock(now=NOW)))
    return records, report


def _same(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Record]:
    fast, fast_report = _read(path, fast=True, monkeypatch=monkeypatch)
    full, full_report = _read(path, fast=False, monkeypatch=monkeypatch)
    assert fast == full
    assert fast_report.skipped == full_report.skipped
    assert fast_report.problems == full_report.problems
    return fast


@pytest.mark.parametrize("cut", [False, True], ids=["newline", "cut-off"])
def test_tricky_lines_decode_as_the_full_decoder_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: bool) -> None:
    path = tmp_path / "mixed.lp"
    text = "\n".join(TRICKY * 2)  # the second round meets every series part again
    path.write_text(text if cut else text + "\n")
    records = _same(path, monkeypatch)
    assert len(records) > 20


def test_each_tricky_line_alone_and_as_the_last_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = TRICKY[0]
    for i, line in enumerate(TRICKY):
        for text in (f"{good}\n{line}\n", f"{good}\n{line}", f"{line}\n{good}\n{line}\n"):
            path = tmp_path / f"line{i}.lp"
            path.write_text(text)
            _same(path, monkeypatch)


def test_common_lines_take_the_fast_path_and_come_together(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_path(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode_line was called")

    monkeypatch.setattr(lineprotocol, "decode_line", full_path)
    path = tmp_path / "a.lp"
    path.write_text("\n".join(TRICKY[:2]) + "\n")
    lines = list(read_lines([path], clock=FakeClock(now=NOW)))
    assert [len(records) for records in lines] == [2, 2]
    first, second = lines[0]
    assert isinstance(first, Sample)
    assert isinstance(second, Sample)
    assert first.labels == second.labels == {}
    assert (first.metric, first.value, first.observed_at) == (
        "gpu_temperature_celsius", 41.5, NOW)


_token = st.sampled_from(["gpu", "ib", "x", "node=n1", "entity=GPU-a", "type=c", "a=", "=",
                          ",", " ", "\\", '"', "1", "1.5", "nan", "t", "12i", "-3e2",
                          str(AT), "4102444800000000000", "\t", "#", "power_watts=", "__x=1"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_token, max_size=12).map("".join), max_size=8), st.booleans())
def test_any_lines_decode_as_the_full_decoder_does(lines: list[str], newline: bool) -> None:
    import tempfile

    text = "\n".join([TRICKY[0], *lines, *lines]) + ("\n" if newline else "")
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        path = Path(folder) / "any.lp"
        path.write_text(text)
        _same(path, patch)
