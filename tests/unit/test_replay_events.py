"""`gpuhealth replay` of a line-protocol recording: everything in the recording's own time.

Issue #15 item 5: a state finding (a counter that rose, no event behind it) carries the
recording's first and last times, alerts start and end in the recording's time (not the wall
clock of the replay), the JSON lists every anomaly (not the first 1,000), and ``--events``
streams every prediction, anomaly, finding, alert and warning as JSON lines.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from click.testing import CliRunner

from core.clock import FakeClock
from core.records import EntityId, Event, NodeName, Prediction, Sample
from gpuhealth.cli import main
from gpuhealth.config import AnalyticsSettings
from gpuhealth.replay import (
    EVENT_TYPES,
    RecordClock,
    analysis_to_json,
    replay,
    to_json,
    write_json,
)
from storage import LineEncoder
from storage.spill import SpillList

T0 = 1_767_225_600.0  # 2026-01-01, the recording's start
WALL = 1_900_000_000.0  # the replay's own clock: far from every recorded time
NODE = NodeName("n1")
PORT = EntityId("mlx5_0:1")


def _write(path: Path, samples: list[Sample], events: list[Event] = ()) -> Path:  # type: ignore[assignment]
    encoder = LineEncoder()
    lines = encoder.samples(samples) + encoder.events(list(events))
    stamped = sorted(lines, key=lambda line: int(line.rsplit(" ", 1)[1]))
    path.write_text("\n".join(stamped) + "\n")
    return path


def _port_recording(path: Path, minutes: int = 40) -> Path:
    """A port whose symbol errors rise from minute 10, and whose link goes down at 20."""
    samples = []
    for m in range(minutes):
        at = T0 + 60.0 * m
        symbol = float(max(0, m - 9) * 3)
        downed = 1.0 if m >= 20 else 0.0
        for metric, value in (("ib_symbol_errors_total", symbol),
                              ("ib_link_downed_total", downed),
                              ("ib_port_state", 4.0)):
            samples.append(Sample(metric=metric, value=value, observed_at=at, node=NODE,
                                  entity=PORT))
    return _write(path, samples)


def test_state_findings_carry_the_recordings_times(tmp_path: Path) -> None:
    lp = _port_recording(tmp_path / "n1.lp")
    report = replay([str(lp)], clock=FakeClock(now=WALL), analyse=False)
    node = report.node("n1")
    assert node is not None
    end = T0 + 60.0 * 39
    (downed,) = [f for f in node.findings if f.code == "LinkDownedCounter"]
    # no event behind it: the first evaluation that saw it (every 300 s of record time)
    assert downed.first_seen_at == T0 + 1200.0
    assert downed.last_seen_at == end
    seen = {f.code: f for f in node.findings_seen}
    assert seen["port_errors"].first_seen_at == T0 + 600.0  # rose at minute 10
    assert seen["port_errors"].last_seen_at == T0 + 900.0  # the flap replaced it at 20
    doc = to_json(report)
    (jnode,) = doc["nodes"]
    assert all(f["first_seen_at"] is not None and f["last_seen_at"] is not None
               for f in jnode["findings"] + jnode["findings_seen"])


def test_alerts_start_and_end_in_the_recordings_time(tmp_path: Path) -> None:
    lp = _port_recording(tmp_path / "n1.lp")
    report = replay([str(lp)], clock=FakeClock(now=WALL), analyse=False)
    node = report.node("n1")
    assert node is not None
    end = T0 + 60.0 * 39
    assert node.alerts
    for alert in node.alerts:
        assert T0 <= alert.starts_at <= end, alert
        assert alert.ends_at is None or T0 <= alert.ends_at <= end, alert
    resolved = [a for a in node.alerts if a.ends_at is not None]
    assert [a.labels["code"] for a in resolved] == ["port_errors"]
    assert resolved[0].ends_at == T0 + 1200.0
    assert all(a["starts_at"] < WALL for a in to_json(report)["nodes"][0]["alerts"])


def test_the_evaluation_interval_is_the_finding_times_resolution(tmp_path: Path) -> None:
    lp = _port_recording(tmp_path / "n1.lp")
    report = replay([str(lp)], clock=FakeClock(now=WALL), analyse=False, evaluate_seconds=60.0)
    node = report.node("n1")
    assert node is not None
    seen = {f.code: f for f in node.findings_seen}
    assert seen["port_errors"].first_seen_at == T0 + 600.0
    assert seen["port_errors"].last_seen_at == T0 + 1140.0
    assert seen["LinkDownedCounter"].first_seen_at == T0 + 1200.0


def test_every_anomaly_is_listed_not_the_first_thousand(tmp_path: Path) -> None:
    # 60 GPUs on 8-GPU nodes: after 30 steady readings, every other reading spikes
    samples = []
    for m in range(70):
        for g in range(60):
            value = 900.0 if m >= 30 and m % 2 else 300.0 + (g + m) % 3
            samples.append(Sample(metric="gpu_power_watts", value=value,
                                  observed_at=T0 + 60.0 * m,
                                  node=NodeName(f"n{g // 8}"), entity=EntityId(f"GPU-{g}")))
    lp = _write(tmp_path / "fleet.lp", samples)
    settings = AnalyticsSettings(detector="ewma_z", detector_by_metric={}, warmup_samples=20,
                                 predictor=False)
    events = io.StringIO()
    report = replay([str(lp)], clock=FakeClock(now=WALL), analytics=settings, events=events)
    analysis = report.analysis
    assert analysis is not None
    total = sum(analysis.anomalies.values())
    assert total > 1000
    assert len(analysis.listed) == total
    assert len(analysis_to_json(analysis)["anomalies_listed"]) == total
    lines = [json.loads(line) for line in events.getvalue().splitlines()]
    assert sum(1 for line in lines if line["type"] == "anomaly") == total
    # the long lists wait on disk past their first items, and the JSON written from them
    # is the document's, byte for byte
    analysis.listed = SpillList(analysis.listed, memory_items=100, block_items=64)
    assert "on disk" in repr(analysis.listed)
    written = io.StringIO()
    write_json(report, written)
    assert written.getvalue() == json.dumps(to_json(report), indent=2) + "\n"
    assert len(json.loads(written.getvalue())["analytics"]["anomalies_listed"]) == total


def test_events_stream_every_prediction_anomaly_finding_and_alert(tmp_path: Path) -> None:
    from dataclasses import replace

    from analytics import synthetic

    config = replace(synthetic.SMALL, gpus=8, days=0.6, quiet_days=0.1, acceleration=8000.0,
                     chunk_ticks=200)
    lp = tmp_path / "stream.lp"
    synthetic.write_line_protocol(synthetic.plan(config, seed=7), lp)
    settings = tmp_path / "gpuhealth.toml"
    settings.write_text(
        '[analytics]\npredictor_horizon_seconds = "30m"\npredictor_min_positives = 1\n')
    events = tmp_path / "events.jsonl"
    result = CliRunner().invoke(
        main, ["replay", str(lp), "--json", "--config", str(settings), "--events", str(events)],
        catch_exceptions=False)
    doc = json.loads(result.stdout)  # the log (a 30 min horizon has no prior) is on stderr
    analysis = doc["analytics"]
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert lines
    assert {line["type"] for line in lines} <= set(EVENT_TYPES)
    for line in lines:
        assert {"type", "at", "node", "entity"} <= line.keys()
        if line["type"] != "warning":
            assert config.start <= line["at"] <= config.start + config.days * 86400 + 60, line
    predictions = [line for line in lines if line["type"] == "prediction"]
    assert len(predictions) == analysis["predictions_made"] > 0
    assert all(p["at"] == p["predicted_at"] and {"probability", "top_features", "aliases",
                                                 "horizon_seconds"} <= p.keys()
               for p in predictions)
    high = [p for p in predictions if p["probability"] >= 0.5]
    assert [(p["entity"], p["predicted_at"]) for p in high] == [
        (p["entity"], p["predicted_at"]) for p in analysis["predictions"]]
    anomalies = [line for line in lines if line["type"] == "anomaly"]
    assert len(anomalies) == len(analysis["anomalies_listed"]) == sum(
        analysis["anomalies"].values())
    findings = [line for line in lines if line["type"] == "finding"]
    final = [f for n in doc["nodes"] for f in n["findings"]]
    opened = {(f["node"], f["entity"], f["kind"], f["code"])
              for f in findings if f["state"] == "open"}
    assert {(f["node"], f["entity"], f["kind"], f["code"]) for f in final} <= opened
    assert all(f["first_seen_at"] is not None for f in findings)
    alerts = [line for line in lines if line["type"] == "alert"]
    assert len(alerts) == sum(len(n["alerts"]) for n in doc["nodes"])
    assert all(a["starts_at"] <= a["at"] for a in alerts)


def test_predictions_carry_the_inventorys_aliases(tmp_path: Path) -> None:
    pci, uuid = "00000000:18:00.0", "GPU-5f2c0d6e-1111-2222-3333-444455556666"
    samples = [Sample(metric="gpu_info", value=1.0, observed_at=T0, node=NODE,
                      entity=EntityId(pci),
                      labels={"uuid": uuid, "pci_bus_id": pci, "serial": "1650921000123",
                              "index": "0"})]
    samples += [Sample(metric="gpu_temperature_celsius", value=50.0, observed_at=T0 + 60.0 * m,
                       node=NODE, entity=EntityId(pci)) for m in range(1, 5)]
    lp = _write(tmp_path / "n1.lp", samples)
    report = replay([str(lp)], clock=FakeClock(now=WALL))
    analysis = report.analysis
    assert analysis is not None
    # the recording's spelling and the canonical one of the PCI address, the index, the serial
    names = [pci, "0000:18:00.0", "gpu:0", "serial:1650921000123"]
    assert analysis.aliases == {("n1", uuid): names}
    analysis.predictions.append(Prediction(node=NODE, entity=EntityId(uuid), probability=0.7,
                                           horizon_seconds=86400.0, top_features={},
                                           predicted_at=T0 + 240.0))
    (listed,) = analysis_to_json(analysis)["predictions"]
    assert listed["aliases"] == names
    assert listed["entity"] == uuid


def test_the_record_clock_runs_on_after_the_recording() -> None:
    clock = RecordClock(FakeClock(now=WALL))
    assert clock() == WALL
    clock.follow(T0)
    clock.release()
    assert T0 <= clock() < T0 + 60.0
    clock.leave()
    assert clock() == WALL


def test_records_older_than_the_replays_clock_are_reported(tmp_path) -> None:
    """Fresh-user finding: two overlapping recordings (one per node) replayed together, or a
    line stamped far ahead in the middle of a file, silently ruined the replay (gaps, half
    the predictions): the replay only goes forward. Now it says so, naming the file."""

    def recording(path, node: str) -> None:
        lines = LineEncoder().samples([
            Sample(metric="gpu_temperature_celsius", value=60.0,
                   observed_at=1_700_000_000.0 + 60 * i, node=NodeName(node),
                   entity=EntityId("GPU-0"), labels={}) for i in range(30)])
        path.write_text("\n".join(lines) + "\n")

    first, second = tmp_path / "h01.lp", tmp_path / "h02.lp"
    recording(first, "h01")
    recording(second, "h02")
    report = replay([str(first), str(second)], analyse=False)
    [issue] = [i for i in report.issues if "older than the replay's clock" in i.reason]
    assert issue.file == str(second)
    assert "28 time steps" in issue.reason  # more than 60 s behind
    alone = replay([str(first)], analyse=False)
    assert not [i for i in alone.issues if "older than" in i.reason]


def test_a_missing_recording_is_an_input_error_not_a_traceback(tmp_path) -> None:
    """Fresh-user finding: `gpuhealth replay missing.lp` printed a FileNotFoundError
    traceback and exited 1 (which also means "worst finding: warning"); a missing log file
    already said "cannot read" and exited 4."""
    result = CliRunner().invoke(main, ["replay", str(tmp_path / "missing.lp")])
    assert result.exit_code == 4
    assert "missing.lp: cannot read: No such file or directory" in result.output
    assert "Traceback" not in result.output


def test_an_unwritable_events_file_is_a_usage_error(tmp_path) -> None:
    """Fresh-user finding: `--events /no/such/dir/x.jsonl` printed a traceback."""
    lp = _port_recording(tmp_path / "n1.lp", minutes=5)
    target = tmp_path / "no-such-dir" / "events.jsonl"
    result = CliRunner().invoke(main, ["replay", str(lp), "--events", str(target)])
    assert result.exit_code == 64, result.output
    assert f"--events {target}: cannot write: No such file or directory" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_seconds_timestamps_get_a_precision_hint_and_replay_with_it(tmp_path) -> None:
    """Fresh-user finding: a recording stamped in seconds was rejected line by line as
    `past` without a word on why; the replay now says to give --precision, and takes it."""
    ns = _port_recording(tmp_path / "ns.lp", minutes=30)
    seconds = tmp_path / "n1.lp"
    seconds.write_text("".join(
        f"{line.rsplit(' ', 1)[0]} {int(line.rsplit(' ', 1)[1]) // 10**9}\n"
        for line in ns.read_text().splitlines()))
    wrong = replay([str(seconds)], clock=FakeClock(now=WALL), analyse=False)
    assert any("--precision ns the unit of the file's timestamps?" in i.reason
               for i in wrong.issues)
    assert not wrong.nodes or not any(n.findings_seen for n in wrong.nodes)
    right = CliRunner().invoke(main, ["replay", str(seconds), "--precision", "s", "--json"])
    data = json.loads(right.output)
    assert data["errors"] == []
    assert right.exit_code in (1, 2, 3)  # the link went down: a finding, not an input error
