"""The labelled synthetic stream as an evaluation: its sizes, its seeds and its truth.

``gpuhealth evaluate stream`` (:func:`gpuhealth.evaluate.evaluate_stream`) draws the stream of
:mod:`analytics.synthetic` at :func:`stream_config`'s size, writes it as line protocol, replays
it through :func:`gpuhealth.replay.replay` (the code ``gpuhealth run`` runs: the online
detectors, the prediction stage, the fault model) and scores what came out against
:func:`plan_truth` with :mod:`analytics.replay_score`. ``benchmarks/replay_eval.py --project``
scores the same stream from a ``gpuhealth replay`` child process.

Scores are reported on :data:`REPORTING_SEED`, chosen before any scoring and never used while
developing (development used seeds 1, 2 and 3).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from analytics import synthetic
from analytics.replay_score import AliasMap, Label, Truth, inventory_aliases, normalise

REPORTING_SEED = 61_708_293
"""Seed of the reported scores: picked 2026-11-30 before anything was scored, never run in
development (development seeds: 1, 2, 3)."""


def stream_config(*, small: bool = False, gpus: int | None = None,
                  days: float | None = None) -> synthetic.StreamConfig:
    """The stream's parameters: :data:`~analytics.synthetic.FULL` or ``SMALL``, resized.

    A shorter stream keeps its first third quiet (no failure) for the detectors to calibrate
    when that is less than the configuration's quiet days.

    Examples:
        >>> c = stream_config(small=True, gpus=8, days=1.5)
        >>> (c.gpus, c.days, c.quiet_days, c.acceleration == synthetic.SMALL.acceleration)
        (8, 1.5, 0.5, True)

    Raises:
        ValueError: ``gpus`` is not a multiple of the GPUs per node, or ``days`` not > 0.
    """
    config = synthetic.SMALL if small else synthetic.FULL
    if gpus:
        config = dataclasses.replace(config, gpus=gpus)
    if days:
        config = dataclasses.replace(config, days=days,
                                     quiet_days=min(config.quiet_days, days / 3))
    return config


def plan_truth(plan: synthetic.Plan, lp_path: Path | None = None) -> Truth:
    """The truth of a plan for :func:`analytics.replay_score.score`.

    Labels ``P001``... in the plan's order, a failure's onset only where it has a numeric
    precursor; with ``lp_path`` (the plan written by
    :func:`~analytics.synthetic.write_line_protocol`), the GPUs' other names from the
    recording's ``gpu_info`` inventory (:func:`~analytics.replay_score.inventory_aliases`).
    """
    aliases = AliasMap()
    labels = []
    for i, f in enumerate(plan.failures):
        key = normalise(f.entity)
        kind = "port" if f.kind == "link_down" else "gpu"
        aliases.add(f.node, [f.entity], key, kind)
        labels.append(Label(id=f"P{i + 1:03d}", kind=f.kind, node=f.node, entity=key,
                            at=float(f.at),
                            onset=float(f.precursor_onset)
                            if f.precursor and f.precursor_onset is not None else None,
                            recovered_at=None if f.recovered_at is None
                            else float(f.recovered_at)))
    if lp_path is not None:
        inventory_aliases(lp_path, aliases)
    config = plan.config
    start = float(config.start)
    return Truth(labels=labels, aliases=aliases, start=start,
                 end=start + config.days * 86400.0, gpu_days=plan.gpu_days, gpus=config.gpus)
