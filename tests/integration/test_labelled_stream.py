"""The labelled-stream evaluation end to end on a tiny stream, from Python, the CLI and the
benchmark script, and its replay by `gpuhealth replay`.

No server is involved: the stream is generated in memory, the detectors run in process, and the
line-protocol file goes through the same :func:`gpuhealth.replay.replay` the CLI calls.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from analytics import stream_eval, synthetic
from core.records import Sample
from gpuhealth.cli import main
from gpuhealth.replay import replay

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import labelled_stream  # noqa: E402

TINY = replace(
    synthetic.SMALL, gpus=16, days=1.5, quiet_days=0.5, acceleration=3000.0, chunk_ticks=200
)


def test_small_benchmark_runs_in_seconds() -> None:
    started = time.perf_counter()
    result = stream_eval.evaluate(TINY, seed=2, only=("dspot/err", "gaps", "predictor"))
    assert time.perf_counter() - started < 15.0
    assert result["failures"] >= 5
    for name in ("dspot/err", "gaps", "predictor"):
        s = result["scores"][name]
        assert s["true_episodes"] + s["false_episodes"] + s["ignored_episodes"] == s["episodes"]
        assert 0.0 <= s["recall"] <= 1.0
        assert s["detected"] <= s["failures"] == result["failures"]
    table = stream_eval.render(result)
    assert "development seed" in table
    assert "goals: precision >= 0.85" in table
    # the benchmark script is the same evaluation
    assert labelled_stream.evaluate is stream_eval.evaluate


def test_per_signal_scores_add_up_to_the_detectors_alarms() -> None:
    result = stream_eval.evaluate(TINY, seed=2, only=("spot",))
    per = result["family_scores"]["spot"]
    assert set(per) == {stream_eval.family(s) for s in synthetic.plan(TINY, seed=2).series}
    total = result["scores"]["spot"]
    # an entity's alarm of a tick counts once overall but once per signal that fired
    assert sum(s["alarms"] for s in per.values()) >= total["alarms"] > 0
    assert max(s["detected"] for s in per.values()) <= total["detected"]


def test_gaps_detect_gpus_falling_off_the_bus_at_lead_zero() -> None:
    plan = synthetic.plan(TINY, seed=2)
    otb = [i for i, f in enumerate(plan.failures) if f.kind == "otb"]
    assert otb
    harness = stream_eval.Harness(plan, only=("gaps",), seed=2)
    harness.run()
    score = harness.score("gaps")
    for i in otb:
        assert score.leads.get(i) == 0.0, plan.failures[i]
    # a DBE's drained GPU goes silent after the grace: its gap is ignored, not a detection
    dbe = [i for i, f in enumerate(plan.failures) if f.kind == "dbe"]
    assert not any(i in score.leads for i in dbe)


def test_unknown_detector_is_rejected() -> None:
    plan = synthetic.plan(TINY, seed=2)
    with pytest.raises(ValueError, match="unknown detectors"):
        stream_eval.Harness(plan, only=("nope",))


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


def test_evaluate_stream_command(tmp_path: Path) -> None:
    """`gpuhealth evaluate stream --small`: every detector and predictor on the CI slice."""
    out = tmp_path / "stream.json"
    result = CliRunner().invoke(
        main,
        ["evaluate", "stream", "--small", "--seed", "1", "--json", str(out)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "64 GPUs + 64 IB ports x 3 days" in result.output
    assert "per signal" in result.output
    data = json.loads(out.read_text())
    assert set(data["scores"]) == set(stream_eval.ALL)
    assert data["failures"] > 0
    for s in data["scores"].values():
        assert s["true_episodes"] + s["false_episodes"] + s["ignored_episodes"] == s["episodes"]


def test_a_short_stream_keeps_a_third_quiet() -> None:
    # --days below the default quiet day used to fail ("need quiet_days < days")
    result = CliRunner().invoke(main, ["evaluate", "stream", "--small", "--gpus", "8",
                                       "--days", "1", "--only", "spot"])
    assert result.exit_code == 0, result.output
    assert "x 1 days" in result.output or "x 1.0 days" in result.output, result.output


def test_evaluate_stream_command_rejects_bad_options() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["evaluate", "stream", "--small", "--only", "nope"])
    assert result.exit_code != 0
    assert "unknown detectors" in result.output
    result = runner.invoke(main, ["evaluate", "stream", "--gpus", "12", "--days", "1"])
    assert result.exit_code != 0
    assert "multiple of gpus_per_node" in result.output


def test_evaluate_stream_checks_the_json_path_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the run started before the --json path was checked")

    monkeypatch.setattr(stream_eval, "evaluate", never)
    runner = CliRunner()
    missing = tmp_path / "nope" / "x.json"
    result = runner.invoke(main, ["evaluate", "stream", "--small", "--only", "gaps",
                                  "--json", str(missing)])
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "--json" in result.output
    assert "does not exist" in result.output
    assert "Traceback" not in result.output


def test_benchmark_script_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    config_args = ["--gpus", "16", "--days", "1.2", "--seed", "2", "--only", "gaps"]
    assert labelled_stream.main(config_args) == 0
    assert "gaps" in capsys.readouterr().out


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


def test_replay_runs_the_detectors_and_the_predictor_in_record_time(tmp_path: Path) -> None:
    """`gpuhealth replay FILE.lp`: predictions with entity, probability, time and features."""
    config = replace(TINY, gpus=8, days=0.6, quiet_days=0.1, acceleration=8000.0)
    plan = synthetic.plan(config, seed=7)
    path = tmp_path / "stream.lp"
    synthetic.write_line_protocol(plan, path)
    settings = tmp_path / "gpuhealth.toml"
    # a 0.6-day stream: a 30-min horizon lets the predictor learn (vectors are learned once
    # their horizon has passed) and publish after its first positive
    settings.write_text(
        '[analytics]\npredictor_horizon_seconds = "30m"\npredictor_min_positives = 1\n'
    )
    result = CliRunner().invoke(
        main, ["replay", str(path), "--json", "--config", str(settings)], catch_exceptions=False
    )
    # GPUs of the stream fell off the bus: critical findings, exit 3 as diagnose has it
    assert result.exit_code == 3, result.output[-2000:]
    doc = json.loads(result.output)
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
        assert p["horizon_seconds"] == 1800.0
    # a GPU that fell off the bus: its series stop, the gap detector says so
    assert any(k.startswith("telemetry_gap gaps") for k in analysis["anomalies"])
    otb = {f.entity for f in plan.failures if f.kind == "otb"}
    gaps = {a["entity"] for a in analysis["anomalies_listed"] if a["kind"] == "telemetry_gap"}
    assert otb <= gaps
    text = (
        CliRunner()
        .invoke(main, ["replay", str(path), "--config", str(settings)], catch_exceptions=False)
        .output
    )
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


def test_a_refit_variant_serves_the_adopted_batch_model() -> None:
    # a 12 h horizon: the refit trains only on rows a horizon older than its holdout, and a
    # 24 h one leaves too little of this 3-day stream to beat the online model (issue #15)
    variants = {
        "online": {"horizon_seconds": 43_200.0, "alarm": 0.5, "persist": 1},
        "refit": {
            "horizon_seconds": 43_200.0,
            "alarm": 0.5,
            "persist": 1,
            "refit_seconds": 21_600.0,
        },
    }
    config = replace(synthetic.SMALL, gpus=32, days=3.0, quiet_days=0.5, acceleration=3000.0)
    harness = stream_eval.Harness(
        synthetic.plan(config, seed=2), only=tuple(variants), seed=2, predictors=variants
    )
    harness.run()
    assert harness._batch["refit"]["gpu"] is not None  # adopted: it beat the online model
    assert "online" not in harness._batch
    online, refit = harness.score("online"), harness.score("refit")
    # the same online learning underneath; only the served probabilities differ
    assert harness.predictors["online"]["gpu"].learned_positive == (
        harness.predictors["refit"]["gpu"].learned_positive
    )
    assert (online.true_episodes, online.false_episodes) != (
        refit.true_episodes,
        refit.false_episodes,
    )
