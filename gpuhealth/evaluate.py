"""``gpuhealth evaluate stream``: the labelled synthetic stream through ``gpuhealth replay``.

:func:`evaluate_stream` draws the stream (:func:`analytics.synthetic.plan`), writes it as line
protocol (:func:`analytics.synthetic.write_line_protocol`) into a temporary folder, replays
that recording in process with :func:`gpuhealth.replay.replay` called as ``gpuhealth replay
FILE.lp`` calls it (dry-run, the same defaults, analysis on, ``[analytics]`` settings from
``--config`` or the defaults), so the detectors, feature vectors, predictor and fault model
are the ones ``gpuhealth run`` and the agent use (:class:`~analytics.online.OnlineAnalytics`,
:class:`~analytics.prediction_stage.PredictionStage`, the pipeline's fault model), and scores
the replay's JSON (:func:`gpuhealth.replay.to_json`, what ``replay --json`` prints) against
the plan's failures with :mod:`analytics.replay_score`.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

from analytics import replay_score, stream_eval, synthetic
from gpuhealth.config import AnalyticsSettings
from gpuhealth.replay import replay, to_json


def evaluate_stream(config: synthetic.StreamConfig, seed: int, *,
                    analytics: AnalyticsSettings | None = None) -> dict[str, Any]:
    """Replay the labelled stream of ``(config, seed)`` and score what came out.

    Args:
        config: Stream parameters (:func:`analytics.stream_eval.stream_config`).
        seed: Stream seed.
        analytics: ``[analytics]`` settings of the replay (``None``: replay's defaults, as
            ``gpuhealth replay`` without ``--config``).

    Returns:
        ``stream`` (config, seed, lines written), ``input``
        (:func:`analytics.replay_score.truth_summary`), ``replay`` (the analysis in figures,
        exit status, wall seconds), ``seconds`` (per phase), ``rules``, and ``scores``,
        ``goals``, ``notes`` of :func:`analytics.replay_score.evaluate`.
    """
    started = time.perf_counter()
    plan = synthetic.plan(config, seed=seed)
    with tempfile.TemporaryDirectory(prefix="gpuhealth-evaluate-") as folder:
        path = Path(folder) / "fleet.lp"
        lines, _ = synthetic.write_line_protocol(plan, path)
        truth = stream_eval.plan_truth(plan, path)
        written = time.perf_counter()
        # gpuhealth replay FILE.lp's call (cli.replay), with its defaults spelled out
        report = replay([str(path)], max_disrupted_fraction=0.10, cluster_size=None,
                        wait_seconds=0.0, analytics=analytics)
        replayed = time.perf_counter()
    doc = to_json(report)
    evaluated = replay_score.evaluate(doc, truth)
    scored = time.perf_counter()
    summary = replay_score.replay_summary(doc)
    replay_seconds = replayed - written
    return {
        "stream": {"config": dataclasses.asdict(config), "seed": seed,
                   "reporting_seed": seed == stream_eval.REPORTING_SEED, "lines": lines,
                   "no_precursor_fraction": synthetic.no_precursor_fraction(plan.failures)},
        "input": replay_score.truth_summary(truth),
        "replay": {**summary, "parsed_lines": report.parsed_lines,
                   "issues": len(report.issues), "exit_status": report.exit_status,
                   "wall_seconds": replay_seconds,
                   "samples_per_second": summary["samples"] / replay_seconds
                   if replay_seconds > 0 else None},
        "seconds": {"plan_and_write": written - started, "replay": replay_seconds,
                    "score": scored - replayed, "total": scored - started},
        "rules": replay_score.RULES,
        **evaluated,
    }


def render(result: dict[str, Any]) -> str:
    """The printed report of :func:`evaluate_stream`: the stream, the replay, the table."""
    c, s = result["stream"]["config"], result["stream"]
    inp, r, t = result["input"], result["replay"], result["seconds"]
    seed_kind = "REPORTING seed" if s["reporting_seed"] else "development seed"
    lines = [
        f"labelled stream: {c['gpus']} GPUs + {c['gpus']} IB ports x {c['days']:g} days at "
        f"{c['interval_seconds']:g} s, seed {s['seed']} ({seed_kind})",
        f"failures {inp['failures']} {inp['by_kind']}, {inp['with_precursor']} with a "
        f"precursor; {inp['gpu_days']:g} GPU-days; {s['lines']:,} lines written in "
        f"{t['plan_and_write']:.1f} s",
        f"replayed as `gpuhealth replay FILE.lp` (the run pipeline) in {t['replay']:.1f} s: "
        f"{r['samples']:,} samples, predictions made {r['predictions_made']}, withheld "
        f"{r['withheld']}, positives learned {r['positives_learned']}, listed >= 0.5: "
        f"{r['predictions_listed']}; anomalies {r['anomalies_total']}; exit status "
        f"{r['exit_status']}",
        "",
        replay_score.render_scores(result),
    ]
    return "\n".join(lines)
