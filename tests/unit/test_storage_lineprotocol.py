from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

from core.clock import FakeClock
from core.records import EntityId, Event, Evidence, NodeName, Sample
from storage.lineprotocol import (
    LineEncoder,
    decode_line,
    export,
    import_lines,
    read_records,
    split_metric,
)
from storage.sanitize import check_samples
from storage.sqlite import SqliteStore

T0 = 1.7e9


def _s(value, at=T0, **labels) -> Sample:
    return Sample(metric="gpu_power_watts", value=value, observed_at=at,
                  node=NodeName("node 01"), entity=EntityId("GPU-a,b=c"), labels=labels)


def test_escapes_and_roundtrip() -> None:
    sample = _s(312.5, reason='hw "slow", x=1')
    line = LineEncoder().samples([sample])[0]
    assert line == ('gpu,entity=GPU-a\\,b\\=c,node=node\\ 01,reason=hw\\ "slow"\\,\\ x\\=1 '
                    'power_watts=312.5 1700000000000000000')
    assert decode_line(line) == [sample]
    event = Event(kind="xid", code="79", node=NodeName("n 1"), entity=EntityId("GPU-a"),
                  observed_at=T0, message='a "quoted", \\ message\nline 2', attrs={"pid": "7"},
                  evidence=(Evidence(file="k.log", line=3, text="NVRM: Xid"),), source="kernel")
    assert decode_line(LineEncoder().events([event])[0]) == [event]


def test_bad_data_is_counted() -> None:
    counts: Counter[str] = Counter()
    good = check_samples(
        [_s(float("nan")), _s(float("inf")), _s("hot"), _s(True), _s("41.5"), _s(3),
         _s(1.0, at=T0 + 86400), _s(1.0, at=1.7e12), _s(1.0, at=5.0),
         Sample(metric="bad name", value=1.0, observed_at=T0, node=NodeName("n"),
                entity=EntityId("e")),
         _s(1.0, reason="a\nb", empty="")],
        now=T0, counts=counts)
    assert [s.value for s in good] == [1.0, 41.5, 3.0, 1.0]
    assert good[-1].labels == {"reason": "a b"}
    assert dict(counts) == {"nan": 2, "type": 1, "converted_type": 3, "future": 2,
                            "past": 1, "name": 1, "label_value": 1}


def test_decoder_reads_foreign_lines_and_counts_the_rest() -> None:
    from storage.lineprotocol import DecodeReport

    report = DecodeReport()
    records = decode_line('nvidia_smi,host=h1,uuid=GPU-x temperature_gpu=41i,name="H100",'
                          'ok=true 1700000000', precision="s", report=report)
    assert {(r.metric, r.value) for r in records} == {("nvidia_smi_temperature_gpu", 41.0),
                                                       ("nvidia_smi_ok", 1.0)}
    assert records[0].node == "h1"
    assert records[0].entity == "GPU-x"
    assert decode_line("garbage", report=report) == []
    assert report.skipped == Counter({"string_field": 1, "syntax": 1, "converted_type": 1})
    assert split_metric("gpu_value") == ("gpu_value", "value")


def test_export_import_between_sqlite_stores(tmp_path: Path) -> None:
    clock = FakeClock(now=T0 + 1000)
    source = SqliteStore(path=tmp_path / "a.sqlite", clock=clock)
    source.write([_s(float(i), at=T0 + i, link="0") for i in range(100)],
                 [Event(kind="xid", code="13", node=NodeName("n"), entity=EntityId("g"),
                        observed_at=T0 + 5, message="graphics exception")])
    out = io.StringIO()
    report = export(source, out, since_at=T0, until_at=T0 + 1000)
    assert (report.samples, report.events) == (100, 1)
    path = tmp_path / "history.lp"
    path.write_text(out.getvalue() + "not line protocol\n")
    assert len(list(read_records([path]))) == 101
    target = SqliteStore(path=tmp_path / "b.sqlite", clock=clock)
    imported = import_lines(target, [path], clock=clock, batch_size=30)
    assert (imported.samples, imported.events) == (100, 1)
    assert imported.rejected == Counter({"syntax": 1})
    a = source.read("gpu_power_watts", None, 0, 2e9)
    b = target.read("gpu_power_watts", None, 0, 2e9)
    assert a.equals(b)
    assert target.read_events(0, 2e9) == source.read_events(0, 2e9)


def test_one_pass_check_and_encode_matches_the_two_passes() -> None:
    batch = [_s(float(i % 5), at=T0 + i // 3) for i in range(30)] + [
        _s(float("nan")), _s(7), _s("x"), _s(1.0, at=None), _s(2.0, at=T0 + 1e6),
        _s(3.0, reason="a b"), _s(4.0, reason="a b", at=T0 + 1)]
    counts_a: Counter[str] = Counter()
    counts_b: Counter[str] = Counter()
    two = LineEncoder(precision="ms").samples(check_samples(batch, now=T0, counts=counts_a))
    one = LineEncoder(precision="ms").checked_samples(batch, now=T0, counts=counts_b)
    assert one == two
    assert counts_a == counts_b == Counter({"nan": 1, "converted_type": 1, "type": 1,
                                            "future": 1})
    # three samples per timestamp share one line: the tags are written once
    assert len(one) < len(batch)
    decoded = [r for line in one for r in decode_line(line, precision="ms")]
    assert len(decoded) == len(batch) - 3


def test_samples_sharing_one_time_object_encode_as_the_two_passes() -> None:
    at = T0 + 0.5  # one collector reading: every sample holds the same float object
    later = T0 + 7.25
    metrics = ["gpu_power_watts", "gpu_temperature_celsius", "gpu_power_watts"]
    batch = [Sample(metric=m, value=v, observed_at=when, node=NodeName(n),
                    entity=EntityId(e), labels={})
             for when in (at, later, at)
             for n, e in (("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a"))
             for m, v in zip(metrics, (1.0, float("nan"), 3), strict=True)]
    counts_a: Counter[str] = Counter()
    counts_b: Counter[str] = Counter()
    two = LineEncoder(precision="ms").samples(check_samples(batch, now=T0, counts=counts_a))
    one = LineEncoder(precision="ms").checked_samples(batch, now=T0, counts=counts_b)
    assert one == two
    assert counts_a == counts_b
    assert counts_b["nan"] == 9
    stamps = [line.rsplit(" ", 1)[1] for line in one]
    assert set(stamps) == {str(round(at * 1000)), str(round(later * 1000))}
    # a duplicate field of one series at one time starts a new line, never overwrites
    assert sum(r.metric == "gpu_power_watts" for line in one
               for r in decode_line(line, precision="ms")) == 18


def test_unstamped_sample_is_not_given_a_time() -> None:
    import pytest

    with pytest.raises(TypeError):
        LineEncoder(precision="ms").samples([_s(1.0, at=None)])


# --- files: the checks read_records applies for both `import` and `replay` -----------------

_HEAD = "gpu,entity=GPU-a,node=n1 temperature_celsius="
_NS = 1_000_000_000


def _lp(tmp_path: Path, text: str, name: str = "h.lp") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_cut_off_last_line_is_truncated_with_its_line_number(tmp_path: Path) -> None:
    from storage.lineprotocol import DecodeReport

    at = int(T0) * _NS
    # no time, no value, a cut-off field list, a timestamp cut short (it reads as 1970)
    for tail in ("3", "", "3 ", f"41.0 {str(at)[:10]}"):
        path = _lp(tmp_path, f"{_HEAD}40.0 {at}\n{_HEAD}{tail}")
        report = DecodeReport()
        records = list(read_records([path], report=report, clock=FakeClock(now=T0)))
        assert [r.value for r in records] == [40.0]  # type: ignore[union-attr]
        assert report.skipped == Counter({"truncated": 1}), tail
        (problem,) = report.problems
        assert (problem.file, problem.line, problem.reason) == (str(path), 2, "truncated")
        assert problem.text.startswith("gpu,entity=GPU-a")
    # a complete last line without its newline is a reading like any other
    path = _lp(tmp_path, f"{_HEAD}40.0 {at}\n{_HEAD}41.0 {at + _NS}")
    assert len(list(read_records([path], clock=FakeClock(now=T0)))) == 2


def test_a_line_without_timestamp_is_rejected_in_files(tmp_path: Path) -> None:
    from storage.lineprotocol import DecodeReport

    at = int(T0) * _NS
    path = _lp(tmp_path, f"{_HEAD}40.0\n{_HEAD}41.0 {at}\n")
    report = DecodeReport()
    records = list(read_records([path], report=report, clock=FakeClock(now=T0)))
    assert [(r.value, r.observed_at) for r in records] == [(41.0, T0)]  # type: ignore[union-attr]
    assert report.skipped == Counter({"no_timestamp": 1})
    assert [(p.line, p.reason) for p in report.problems] == [(1, "no_timestamp")]


def test_file_checks_count_and_list_nan_bool_future_and_huge_times(tmp_path: Path) -> None:
    from storage.lineprotocol import DecodeReport

    at = int(T0) * _NS
    lines = [f"{_HEAD}40.0 {at}", f"{_HEAD}NaN {at}", f"{_HEAD}true {at}",
             f"{_HEAD}41.0 4102444800000000000",  # 2100-01-01
             f"{_HEAD}42.0 99999999999999999999",  # 1e11 s
             f"{_HEAD}43.0 {'9' * 400}",  # beyond any float
             f"{_HEAD}44.0 -5"]
    lines += [f"{_HEAD}NaN {at}"] * 7
    path = _lp(tmp_path, "\n".join(lines) + "\n")
    report = DecodeReport()
    records = list(read_records([path], report=report, clock=FakeClock(now=T0)))
    assert [r.value for r in records] == [40.0, 1.0]  # type: ignore[union-attr]
    assert report.skipped == Counter({"nan": 8, "converted_type": 1, "future": 2, "syntax": 1,
                                      "past": 1})
    listed = [(p.line, p.reason) for p in report.problems]
    assert listed[:2] == [(2, "nan"), (3, "converted_type")]
    assert [n for n, r in listed if r == "future"] == [4, 5]
    assert [n for n, r in listed if r == "nan"] == [2, 8, 9, 10, 11]  # the first five
    (huge,) = [p for p in report.problems if p.reason == "syntax"]
    assert huge.line == 6
    assert len(huge.text) <= 80
    assert huge.text.endswith("9" * 30)  # the end (time) is kept in the excerpt


def test_import_rejects_unstamped_and_truncated_lines_and_keeps_the_line_numbers(
        tmp_path: Path, caplog) -> None:
    clock = FakeClock(now=T0)
    at = int(T0) * _NS
    path = _lp(tmp_path, f"{_HEAD}40.0 {at}\n{_HEAD}true {at + _NS}\n{_HEAD}41.0\n"
                         f"{_HEAD}NaN {at + 2 * _NS}\n{_HEAD}4")
    store = SqliteStore(path=tmp_path / "s.sqlite", clock=clock)
    with caplog.at_level("WARNING", logger="storage.lineprotocol"):
        report = import_lines(store, [path], clock=clock)
    assert report.samples == 2
    assert report.rejected == Counter({"converted_type": 1, "no_timestamp": 1, "nan": 1,
                                       "truncated": 1})
    assert [(p.line, p.reason) for p in report.problems] == [
        (2, "converted_type"), (3, "no_timestamp"), (4, "nan"), (5, "truncated")]
    assert f"{path}:3: no_timestamp: " in caplog.text
    frame = store.read("gpu_temperature_celsius", None, 0, 2e9)
    assert sorted(frame["observed_at"]) == [T0, T0 + 1]


def test_read_records_reports_binary_and_empty_files_once(tmp_path):
    from storage.lineprotocol import DecodeReport, read_records

    binary = tmp_path / "junk.lp"
    binary.write_bytes(b"\x00\xff\x10garbage\nmore\x00\n" * 50)
    empty = tmp_path / "empty.lp"
    empty.write_bytes(b"")
    report = DecodeReport()
    assert list(read_records([binary, empty], report=report)) == []
    assert dict(report.skipped) == {"binary": 1, "empty": 1}
    assert [(p.line, p.reason, p.text) for p in report.problems] == [
        (1, "binary", "binary file (NUL bytes), not text"), (1, "empty", "empty file")]
    # excerpts of bad lines are printable whatever the bytes were
    odd = tmp_path / "odd.lp"
    odd.write_bytes(b"gpu\x1b[31m value\x07=1 1\n")
    report = DecodeReport()
    list(read_records([odd], report=report))
    assert all(p.text.isprintable() for p in report.problems)


def test_import_counts_history_older_than_the_stores_retention(tmp_path: Path) -> None:
    # Moving history into the embedded store: what its retention will not keep as it was
    # is counted, so `gpuhealth import` can say so rather than report it all as imported.
    clock = FakeClock(now=T0)
    day = 86400
    path = _lp(tmp_path, "".join(f"{_HEAD}{40 + i}.0 {(int(T0) - age) * _NS}\n"
                                 for i, age in enumerate((60, 10 * day, 200 * day))))
    store = SqliteStore(path=tmp_path / "s.sqlite", clock=clock, retention_seconds=7 * day,
                        downsample=[(60.0, 90 * day)])
    report = import_lines(store, [path], clock=clock)
    assert (report.samples, report.past_raw_retention, report.past_all_retention) == (3, 2, 1)


def test_export_reaches_past_raw_retention_through_the_aggregates(tmp_path: Path) -> None:
    # SQLite keeps raw samples 7 days, then 1-minute means: an export of the last 30 days
    # brings the older part as those means, counts them, and says so in its header.
    day = 86400
    clock = FakeClock(now=T0)
    store = SqliteStore(path=tmp_path / "s.sqlite", clock=clock, retention_seconds=7 * day,
                        downsample=[(60.0, 90 * day)])
    minute = 60 * (int(T0 - 10 * day) // 60)  # one minute ten days ago, in 6 samples
    old = [_s(float(v), at=minute + 10 * i) for i, v in enumerate((1, 2, 3, 4, 5, 6))]
    recent = [_s(float(v), at=T0 - 3600 + i) for i, v in enumerate((7, 8))]
    store.write(old + recent, [])
    store.compact()
    out = io.StringIO()
    report = export(store, out, since_at=T0 - 30 * day, until_at=T0)
    assert (report.samples, report.aggregated) == (3, 1)
    header, *lines = out.getvalue().splitlines()
    assert "60-second means" in header
    assert header.startswith("# gpuhealth export 20")  # readable UTC times, then epochs
    assert "Z .. " in header
    values = [(r.observed_at, r.value) for line in lines for r in decode_line(line)]
    assert values == [(float(minute), 3.5), (T0 - 3600, 7.0), (T0 - 3599, 8.0)]
    # a window inside the raw retention is exported as it was, with a plain header
    inside = io.StringIO()
    assert export(store, inside, since_at=T0 - day, until_at=T0).aggregated == 0
    assert "means" not in inside.getvalue().splitlines()[0]
