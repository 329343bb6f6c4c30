"""`gpuhealth evaluate stream` end to end on a small stream through the CLI and the benchmark
script, the synthetic scorer, and the stream's replay by `gpuhealth replay`.

No server is involved: the stream is generated in memory and written as line protocol, and
`evaluate stream` replays it through the same :func:`gpuhealth.replay.replay` the `replay`
command calls; its figures are checked against `gpuhealth replay FILE.lp --json` of the same
recording, scored with :mod:`analytics.replay_score`.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import gpuhealth.evaluate
from analytics import replay_score, stream_eval, synthetic
from core.records import Sample
from gpuhealth.cli import main
from gpuhealth.config import AnalyticsSettings
from gpuhealth.replay import replay

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import labelled_stream  # noqa: E402

TINY = replace(
    synthetic.SMALL, gpus=16, days=1.5, quiet_days=0.5, acceleration=3000.0, chunk_ticks=200
)
STREAM = ["--small", "--gpus", "8", "--days", "1.5", "--seed", "20"]
"""8 GPUs x 1.5 days of the --small stream, development seed 20: 8 failures of three kinds
(DBE, OTB, link down), 4 with a precursor, and predictions >= 0.5 (about 10 s to replay)."""


Recording = tuple[synthetic.Plan, Path, int, dict[str, Any], int]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    """:data:`STREAM`'s plan written as line protocol and its `gpuhealth replay FILE.lp --json`
    (plan, path, lines, the JSON, the exit status)."""
    plan = synthetic.plan(stream_eval.stream_config(small=True, gpus=8, days=1.5), seed=20)
    lp = tmp_path_factory.mktemp("stream") / "fleet.lp"
    lines, _ = synthetic.write_line_protocol(plan, lp)
    replayed = CliRunner().invoke(main, ["replay", str(lp), "--json"], catch_exceptions=False)
    return plan, lp, lines, json.loads(replayed.stdout), replayed.exit_code


def test_evaluate_stream_scores_what_replay_of_the_same_recording_gives(
    tmp_path: Path, recording: Recording
) -> None:
    """`evaluate stream --small ...`: the predictions, anomalies, findings and alerts it scores
    are those `gpuhealth replay FILE.lp --json` gives for the same recording."""
    out = tmp_path / "stream.json"
    result = CliRunner().invoke(main, ["evaluate", "stream", *STREAM, "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    plan, lp, lines, doc, exit_code = recording
    analysis = doc["analytics"]
    assert analysis["predictions_made"] > 0
    assert {f.kind for f in plan.failures} == {"dbe", "otb", "link_down"}
    assert data["stream"]["lines"] == lines
    assert data["input"]["failures"] == len(plan.failures)
    r = data["replay"]
    assert (r["samples"], r["predictions_made"], r["predictions_listed"], r["anomalies_total"],
            r["positives_learned"], r["exit_status"]) == (
        analysis["samples"], analysis["predictions_made"], len(analysis["predictions"]),
        sum(analysis["anomalies"].values()), analysis["positives_learned"], exit_code)
    expected = replay_score.evaluate(doc, stream_eval.plan_truth(plan, lp))
    assert data["scores"] == json.loads(json.dumps(expected["scores"]))
    assert {"predictions>=0.5", "predictions>=0.9", "findings>=critical", "alerts"} <= set(
        data["scores"])
    assert any(name.startswith("anomaly:") for name in data["scores"])
    # the printed table: the stream, the replay's figures, every source per kind and overall
    text = result.output
    assert "8 GPUs + 8 IB ports x 1.5 days at 60 s, seed 20 (development seed)" in text
    assert f"listed >= 0.5: {len(analysis['predictions'])};" in text
    for name, s in data["scores"].items():
        o = s["overall"]
        row = next(line for line in text.splitlines()
                   if line.startswith(f"{name} ") and line.split()[-11] == "all")
        assert row.split()[-10:-7] == [str(o["failures"]), str(sum(
            k["with_precursor"] for k in s["per_kind"].values())), str(o["detected"])], row
        for kind in s["per_kind"]:
            assert any(line.startswith(f"{name} ") and f" {kind} " in line
                       for line in text.splitlines())
    assert "goals per kind: precision >= 0.85" in text


def test_evaluate_stream_command_rejects_bad_options() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["evaluate", "stream", "--gpus", "12", "--days", "1"])
    assert result.exit_code != 0
    assert "multiple of gpus_per_node" in result.output
    # one code path: the detectors are [analytics] of --config, no --only any more
    result = runner.invoke(main, ["evaluate", "stream", "--small", "--only", "spot"])
    assert result.exit_code != 0
    assert "No such option '--only'" in result.output


def test_evaluate_stream_checks_the_json_path_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the run started before the --json path was checked")

    monkeypatch.setattr(gpuhealth.evaluate, "evaluate_stream", never)
    missing = tmp_path / "nope" / "x.json"
    result = CliRunner().invoke(main, ["evaluate", "stream", "--small", "--json", str(missing)])
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "--json" in result.output
    assert "does not exist" in result.output
    assert "Traceback" not in result.output


def test_evaluate_stream_takes_the_replays_analytics_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, object] = {}

    def record(config: synthetic.StreamConfig, seed: int, **kwargs: object) -> None:
        seen.update(config=config, seed=seed, **kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(gpuhealth.evaluate, "evaluate_stream", record)
    settings = tmp_path / "gpuhealth.toml"
    settings.write_text('[analytics]\ndetector = "spot"\nvector_detector = true\n')
    result = CliRunner().invoke(main, ["evaluate", "stream", "--small", "--gpus", "8", "--days",
                                       "1", "--config", str(settings)])
    assert result.exit_code == 0, result.output
    assert seen["seed"] == stream_eval.REPORTING_SEED
    config = seen["config"]
    assert isinstance(config, synthetic.StreamConfig)
    # a short stream keeps its first third quiet ("need quiet_days < days" before)
    assert (config.gpus, config.days) == (8, 1.0)
    assert config.quiet_days == pytest.approx(1 / 3)
    analytics = seen["analytics"]
    assert isinstance(analytics, AnalyticsSettings)
    assert (analytics.detector, analytics.vector_detector) == ("spot", True)


def test_benchmark_script_is_the_same_evaluation(tmp_path: Path) -> None:
    assert labelled_stream.evaluate_stream is gpuhealth.evaluate.evaluate_stream
    path = tmp_path / "s.lp"
    assert labelled_stream.main(["--gpus", "8", "--days", "0.5", "--seed", "2",
                                 "--write-lp", str(path)]) == 0
    labels = json.loads(Path(f"{path}.labels.json").read_text())
    plan = synthetic.plan(stream_eval.stream_config(gpus=8, days=0.5), seed=2)
    assert len(labels) == len(plan.failures)
    assert path.stat().st_size > 0


def _reference_score(
    alarms: list[synthetic.Alarm], failures: tuple[synthetic.FailureLabel, ...], gpu_days: float
) -> tuple[int, int, int, int, dict[int, float]]:
    """score_alarms's rules written out plainly over the whole list (the pre-streaming code)."""
    horizon, grace, merge, settle = 86_400.0, 900.0, 3600.0, 3600.0
    counts = {"true": 0, "false": 0, "ignored": 0}
    earliest: dict[int, float] = {}
    kept = 0
    last: dict[tuple[str, str], float] = {}
    for a in sorted(
        (a for a in alarms if a.entity != "node"), key=lambda a: (a.node, a.entity, a.at)
    ):
        matches = [
            i
            for i, f in enumerate(failures)
            if (f.node, f.entity) == (a.node, a.entity) and f.at - horizon <= a.at <= f.at + grace
        ]
        if matches:
            kind, found = "true", min(matches, key=lambda i: failures[i].at)
            earliest[found] = min(earliest.get(found, np.inf), a.at)
        elif any(
            (f.node, f.entity) == (a.node, a.entity)
            and f.at + grace < a.at <= f.recovered_at + settle
            for f in failures
        ):
            kind = "ignored"
        else:
            kind = "false"
        kept += kind != "ignored"
        previous = last.get((a.node, a.entity))
        last[(a.node, a.entity)] = a.at
        if previous is None or a.at - previous >= merge:
            counts[kind] += 1
    leads = {i: max(0.0, failures[i].at - t) for i, t in earliest.items()}
    return kept, counts["true"], counts["false"], counts["ignored"], leads


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streaming_scorer_matches_the_whole_list_rules(seed: int) -> None:
    plan = synthetic.plan(TINY, seed=2)
    rng = np.random.default_rng(seed)
    entities = [*plan.gpus, *plan.links, (plan.nodes[0], "node")]
    start, end = plan.config.start, plan.config.start + plan.config.days * 86_400.0
    alarms = [
        synthetic.Alarm(
            *entities[int(rng.integers(len(entities)))],
            float(rng.choice(np.arange(start, end, 60.0))),
        )
        for _ in range(3000)
    ]
    # and bursts around each failure: before, at, after, and after recovery
    for f in plan.failures:
        for offset in (-90_000.0, -3600.0, -60.0, 0.0, 600.0, 1200.0):
            alarms.append(synthetic.Alarm(f.node, f.entity, f.at + offset))
        alarms.append(synthetic.Alarm(f.node, f.entity, f.recovered_at + 4000.0))
    score = synthetic.score_alarms(alarms, plan.failures, gpu_days=plan.gpu_days)
    kept, true, false, ignored, leads = _reference_score(alarms, plan.failures, plan.gpu_days)
    assert (score.alarms, score.true_episodes, score.false_episodes, score.ignored_episodes) == (
        kept,
        true,
        false,
        ignored,
    )
    assert score.leads == leads
    assert score.node_alarms == sum(a.entity == "node" for a in alarms)


def test_streaming_scorer_refuses_alarms_out_of_order() -> None:
    scorer = synthetic.EpisodeScorer([], gpu_days=1.0)
    scorer.add("n", "g", 100.0)
    with pytest.raises(ValueError, match="time order"):
        scorer.add("n", "g", 50.0)


def test_stream_replays_through_gpuhealth_replay(tmp_path: Path) -> None:
    config = replace(TINY, gpus=8, days=0.6, quiet_days=0.1, acceleration=8000.0)
    plan = synthetic.plan(config, seed=7)
    gpu_failures = [f for f in plan.failures if f.kind in ("dbe", "otb")]
    assert gpu_failures
    path = tmp_path / "stream.lp"
    synthetic.write_line_protocol(plan, path)
    report = replay([str(path)])
    assert report.parsed_lines > 0
    findings = [f for n in report.nodes for f in n.findings]
    critical = {(f.entity, f.code) for f in findings if f.severity.value == "critical"}
    for f in gpu_failures:
        assert (f.entity, "48" if f.kind == "dbe" else "79") in critical


def test_replay_runs_the_detectors_and_the_predictor_in_record_time(
    recording: Recording,
) -> None:
    """`gpuhealth replay FILE.lp`: predictions with entity, probability, time and features."""
    plan, path, _, doc, exit_code = recording
    # GPUs of the stream fell off the bus: critical findings, exit 3 as diagnose has it
    assert exit_code == 3
    analysis = doc["analytics"]
    samples = sum(1 for tick in synthetic.samples(plan) for r in tick if isinstance(r, Sample))
    assert analysis["samples"] == samples
    times = {t for chunk in synthetic.chunks(plan) for t in chunk.times.tolist()}
    entities = {e for _, e in (*plan.gpus, *plan.links)}
    predictions = analysis["predictions"]
    assert predictions, analysis
    assert analysis["positives_learned"] >= 1
    for p in predictions:
        assert p["probability"] >= analysis["threshold"] == 0.5
        assert p["predicted_at"] in times  # the recording's own time stamps
        assert p["entity"] in entities
        assert p["top_features"]
        assert p["horizon_seconds"] == 86_400.0
    # a GPU that fell off the bus: its series stop, the gap detector says so
    assert any(k.startswith("telemetry_gap gaps") for k in analysis["anomalies"])
    otb = {f.entity for f in plan.failures if f.kind == "otb"}
    gaps = {a["entity"] for a in analysis["anomalies_listed"] if a["kind"] == "telemetry_gap"}
    assert otb <= gaps
    text = CliRunner().invoke(main, ["replay", str(path)], catch_exceptions=False).stdout
    assert "predictions:" in text
    # one line per entity: its first crossing, its highest probability, how many
    first = predictions[0]
    mine = [p for p in predictions
            if (p["node"], p["entity"]) == (first["node"], first["entity"])]
    top = max(p["probability"] for p in mine)
    assert (f"{first['node']}/{first['entity']}: first "
            f"{dt.datetime.fromtimestamp(first['predicted_at'], dt.UTC):%Y-%m-%dT%H:%M:%SZ} "
            f"p={first['probability']:.3f}, highest p={top:.3f}") in text
    assert f"{len(mine)} prediction(s)" in text


def test_replay_without_analytics_reports_none(tmp_path: Path) -> None:
    config = replace(TINY, gpus=8, days=0.2, quiet_days=0.1, acceleration=8000.0)
    path = tmp_path / "stream.lp"
    synthetic.write_line_protocol(synthetic.plan(config, seed=7), path)
    assert replay([str(path)], analyse=False).analysis is None
