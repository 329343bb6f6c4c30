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
    assert report.skipped == Counter({"string_field": 1, "syntax": 1})
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
