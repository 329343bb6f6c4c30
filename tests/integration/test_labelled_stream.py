"""The labelled-stream benchmark end to end on a tiny stream, and its replay by `gpuhealth replay`.

No server is involved: the stream is generated in memory, the detectors run in process, and the
line-protocol file goes through the same :func:`gpuhealth.replay.replay` the CLI calls.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from analytics import synthetic
from gpuhealth.replay import replay

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import labelled_stream  # noqa: E402

TINY = replace(synthetic.SMALL, gpus=16, days=1.5, quiet_days=0.5, acceleration=3000.0,
               chunk_ticks=200)


def test_small_benchmark_runs_in_seconds() -> None:
    started = time.perf_counter()
    result = labelled_stream.evaluate(TINY, seed=2, only=("dspot/err", "gaps", "predictor"))
    assert time.perf_counter() - started < 15.0
    assert result["failures"] >= 5
    for name in ("dspot/err", "gaps", "predictor"):
        s = result["scores"][name]
        assert s["true_episodes"] + s["false_episodes"] + s["ignored_episodes"] == s["episodes"]
        assert 0.0 <= s["recall"] <= 1.0
        assert s["detected"] <= s["failures"] == result["failures"]
    table = labelled_stream.render(result)
    assert "development seed" in table
    assert "goals: precision >= 0.85" in table


def test_gaps_detect_gpus_falling_off_the_bus_at_lead_zero() -> None:
    plan = synthetic.plan(TINY, seed=2)
    otb = [i for i, f in enumerate(plan.failures) if f.kind == "otb"]
    assert otb
    harness = labelled_stream.Harness(plan, only=("gaps",), seed=2)
    harness.run()
    score = synthetic.score_alarms(harness.alarms("gaps"), plan.failures,
                                   gpu_days=plan.gpu_days)
    for i in otb:
        assert score.leads.get(i) == 0.0, plan.failures[i]
    # a DBE's drained GPU goes silent after the grace: its gap is ignored, not a detection
    dbe = [i for i, f in enumerate(plan.failures) if f.kind == "dbe"]
    assert not any(i in score.leads for i in dbe)


def test_unknown_detector_is_rejected() -> None:
    plan = synthetic.plan(TINY, seed=2)
    with pytest.raises(ValueError, match="unknown detectors"):
        labelled_stream.Harness(plan, only=("nope",))


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
