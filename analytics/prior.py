"""The failure predictor's prior: a model shipped with the package, so a new fleet is not blind.

Until the online predictor has learned ``predictor_min_positives`` failures of its own
fleet its predictions were withheld (issue #15: ready only on day 3.4 of a fleet
recording). The prior is the same model (running scaler and logistic regression over
:mod:`analytics.features`' vectors), trained by :func:`train` on streams the project
generates (:mod:`analytics.synthetic`: failure rates and precursors from Titan and LANL,
see ``docs/analytics.md``), labelled as in ``run``
(:func:`analytics.identity.failure_kind`: Xid 48 critical, port Down, Xid 79 counted
apart). It lives in ``analytics/prior_model.json`` (a few KB, with how it was made); the
prediction stage starts from it when it has no checkpoint and the online model adapts
from there.

Regenerate (one core, minutes)::

    python -m analytics.prior [--gpus 64] [--days 8] [--acceleration 90] [--seed S] [--out F]

The seed is none of the reporting seed of ``gpuhealth evaluate stream`` or the
development seeds 1-3 of ``docs/analytics.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from analytics.predictor import OnlineFailurePredictor, RunningStandardScaler, SgdLogisticRegression
from core.records import Action, Event, Finding, Severity

PRIOR_PATH = Path(__file__).with_name("prior_model.json")
"""The prior shipped in the package."""

PRIOR_SEED = 20_261_202
"""Seed of the synthetic fleet the shipped prior was trained on."""

_FORMAT = 1
_SCALER_COUNT_CAP = 1000
"""Counts of the prior's scaler are capped at load, so the fleet's own data moves the
means and variances within a day rather than never."""


def event_finding(event: Event) -> Finding | None:
    """The finding ``run``'s fault model makes of a synthetic failure event, or ``None``."""
    if event.kind == "xid" and event.code in ("48", "79"):
        kind, code, severity = "xid", event.code, Severity.CRITICAL
    elif event.kind == "ib_port_state" and event.code == "down":
        kind, code, severity = "ib_port", "state_down", Severity.MAJOR
    else:
        return None
    return Finding(node=event.node, entity=event.entity, kind=kind, code=code,
                   severity=severity, action=Action.NONE, summary=event.message, evidence=(),
                   source="synthetic", first_seen_at=event.observed_at,
                   last_seen_at=event.observed_at)


def train(*, gpus: int = 64, days: float = 8.0, seed: int = PRIOR_SEED, acceleration: float = 90.0,
          horizon_seconds: float = 86_400.0, interval_seconds: float = 60.0) -> dict[str, Any]:
    """Train the prior on a synthetic fleet; return its JSON document.

    ``acceleration`` (failures per GPU-day over the real rates, :mod:`analytics.synthetic`)
    above the stream's default 30 gives more failures to learn from in less time; the
    intercept is then shifted by ``-log(acceleration / 30)`` so that the prior's odds are
    those of the default stream's failure rate.
    """
    from analytics.prediction_stage import PredictionStage
    from analytics.synthetic import StreamConfig, plan, samples

    started = time.perf_counter()
    config = StreamConfig(gpus=gpus, days=days, acceleration=acceleration)
    stage = PredictionStage(checkpoint_path=None, horizon_seconds=horizon_seconds,
                            interval_seconds=interval_seconds, min_positives=0, seed=seed,
                            refit_seconds=math.inf, prior=None)
    stepped: float | None = None
    for tick in samples(plan(config, seed=seed)):
        stage.observe(tick)
        findings = [f for r in tick if isinstance(r, Event) for f in [event_finding(r)] if f]
        if findings:
            stage.observe_findings(findings)
        at = next((r.observed_at for r in tick if r.observed_at is not None), None)
        if at is not None and (stepped is None or at - stepped >= interval_seconds):
            stepped = at
            stage.step(at)
    predictor = stage.predictor
    if stepped is not None:
        predictor.settle(stepped + horizon_seconds)
    shift = -math.log(acceleration / StreamConfig().acceleration)
    predictor.model_state()[1].intercept += shift
    return to_json(predictor, made={
        "how": "python -m analytics.prior",
        "stream": f"analytics.synthetic StreamConfig(gpus={gpus}, days={days}, "
        f"acceleration={acceleration}), seed {seed}",
        "intercept_shift": round(shift, 4),
        "horizon_seconds": horizon_seconds,
        "interval_seconds": interval_seconds,
        "positives": predictor.learned_positive,
        "negatives": predictor.learned_negative,
        "unpredictable": dict(predictor.unpredictable),
        "seconds": round(time.perf_counter() - started, 1),
    })


def to_json(predictor: OnlineFailurePredictor, *, made: dict[str, Any]) -> dict[str, Any]:
    """Return the document of ``predictor``'s scaler and model."""
    scaler, model = predictor.model_state()
    return {
        "format": _FORMAT,
        "made": made,
        "learning_rate": model.learning_rate,
        "intercept": model.intercept,
        "weights": dict(sorted(model.weights.items())),
        "scaler": {f: [scaler.counts[f], scaler.means[f], scaler.vars[f]]
                   for f in sorted(scaler.counts)},
    }


def load(path: Path = PRIOR_PATH, *, horizon_seconds: float | None = None
         ) -> tuple[RunningStandardScaler, SgdLogisticRegression] | None:
    """Return the prior's scaler and model, or ``None`` when there is none.

    ``None`` too when it is unreadable or was trained for another ``horizon_seconds``
    (its probabilities would mean another thing). Raises nothing: a missing or malformed
    prior means starting blind, as before.
    """
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != _FORMAT:
            return None
        trained_for = float(doc["made"]["horizon_seconds"])
        if horizon_seconds is not None and trained_for != horizon_seconds:
            return None
        scaler = RunningStandardScaler()
        for feature, (count, mean, var) in doc["scaler"].items():
            scaler.counts[feature] = min(int(count), _SCALER_COUNT_CAP)
            scaler.means[feature] = float(mean)
            scaler.vars[feature] = float(var)
        model = SgdLogisticRegression(learning_rate=float(doc["learning_rate"]))
        model.weights = {str(k): float(v) for k, v in doc["weights"].items()}
        model.intercept = float(doc["intercept"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return scaler, model


def main(argv: list[str] | None = None) -> int:
    """Train the prior and write it (``python -m analytics.prior``)."""
    parser = argparse.ArgumentParser(prog="python -m analytics.prior", description=__doc__)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--days", type=float, default=8.0)
    parser.add_argument("--acceleration", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=PRIOR_SEED)
    parser.add_argument("--out", type=Path, default=PRIOR_PATH)
    args = parser.parse_args(argv)
    doc = train(gpus=args.gpus, days=args.days, seed=args.seed, acceleration=args.acceleration)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: {doc['made']}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
