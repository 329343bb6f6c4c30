"""The failure predictor's prior: a model shipped with the package, so a new fleet is not blind.

Until the online predictor has learned ``predictor_min_positives`` failures of its own
fleet its predictions were withheld (issue #15: ready only on day 3.4 of a fleet
recording). The prior is the same model the prediction stage runs, an
:class:`~analytics.precursors.EvidenceCalibration` (how often vectors of each precursor
evidence level were followed by a failure within the horizon, per entity kind), filled by
:func:`train` from a stream the project generates (:mod:`analytics.synthetic`: failure
rates and precursors from Titan and LANL, see ``docs/analytics.md``) that went through
:class:`~analytics.prediction_stage.PredictionStage` exactly as in ``run``, labelled as in
``run`` (:func:`analytics.identity.failure_kind`: Xid 48 critical, port Down, Xid 79
counted apart). Because the model reads only unit-free evidence (a rise over the entity's
own past, :mod:`analytics.precursors`), the table carries over to fleets whose rates and
units differ. It lives in ``analytics/prior_model.json`` (a few KB, with how it was made);
the prediction stage starts from it when it has no checkpoint and the fleet's own labels
add to its counts from there.

Regenerate (one core, minutes)::

    python -m analytics.prior [--gpus 96] [--days 8] [--acceleration 300] [--seed S] [--out F]

The seed is none of the reporting seed of ``gpuhealth evaluate stream`` or the
development seeds 1-3 of ``docs/analytics.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analytics.features import MODEL_INPUTS
from analytics.precursors import EVIDENCE_EDGES, EvidenceCalibration
from analytics.predictor import RunningStandardScaler
from core.records import Action, Event, Finding, Severity

PRIOR_PATH = Path(__file__).with_name("prior_model.json")
"""The prior shipped in the package."""

PRIOR_SEED = 20_261_202
"""Seed of the synthetic fleet the shipped prior was trained on."""

_FORMAT = 3
"""Format 3: an evidence calibration table. Formats 1 and 2 (logistic regressions over
raw features) are no longer loaded: a stage given one starts blind."""


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


def train(*, gpus: int = 96, days: float = 8.0, seed: int = PRIOR_SEED, acceleration: float = 300.0,
          horizon_seconds: float = 86_400.0, interval_seconds: float = 60.0) -> dict[str, Any]:
    """Train the prior on a synthetic fleet; return its JSON document.

    The stream goes through :class:`~analytics.prediction_stage.PredictionStage` as in
    ``run`` (features, evidence, delayed labels from the failures' findings, every negative
    counted). ``acceleration`` (failures per GPU-day over the real rates,
    :mod:`analytics.synthetic`) above the stream's default 30 gives more failures to learn
    from in less time; each bin's positive count is then multiplied by ``30 /
    acceleration``, which divides its odds by the same factor (Bayes: posterior odds are the
    likelihood ratio times the prior odds), so the prior's probabilities are those of the
    default stream's failure rate.
    """
    from analytics.prediction_stage import PredictionStage
    from analytics.synthetic import StreamConfig, plan, samples

    started = time.perf_counter()
    config = StreamConfig(gpus=gpus, days=days, acceleration=acceleration)
    stage = PredictionStage(checkpoint_path=None, horizon_seconds=horizon_seconds,
                            interval_seconds=interval_seconds, min_positives=0, seed=seed,
                            refit_seconds=math.inf, prior=None, refit=False)
    predictor = stage.predictor
    predictor.history.clear()
    predictor.history = type(predictor.history)(maxlen=1)  # the refit's history: not needed
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
    if stepped is not None:
        predictor.settle(stepped + horizon_seconds)
    model = predictor.model_state()[1]
    if not isinstance(model, EvidenceCalibration):
        raise TypeError(f"the stage's model is {type(model).__name__}, not EvidenceCalibration")
    factor = StreamConfig().acceleration / acceleration
    for kind in model.KINDS:
        positives, totals = model.positives[kind], model.totals[kind]
        for b, pos in enumerate(positives):
            totals[b] -= pos * (1.0 - factor)
            positives[b] = pos * factor
    return to_json(model, made={
        "how": "python -m analytics.prior",
        "stream": f"analytics.synthetic StreamConfig(gpus={gpus}, days={days}, "
        f"acceleration={acceleration}), seed {seed}",
        "odds_factor": round(factor, 4),
        "horizon_seconds": horizon_seconds,
        "interval_seconds": interval_seconds,
        "positives": predictor.learned_positive,
        "negatives": predictor.learned_negative,
        "unpredictable": dict(predictor.unpredictable),
        "seconds": round(time.perf_counter() - started, 1),
    })


def to_json(model: EvidenceCalibration, *, made: dict[str, Any]) -> dict[str, Any]:
    """Return the document of an evidence calibration (counts, and the table they give)."""
    return {
        "format": _FORMAT,
        "made": made,
        "inputs": list(MODEL_INPUTS),
        "edges": list(EVIDENCE_EDGES),
        "smoothing": model.smoothing,
        "half_life": model.half_life,
        "positives": {k: [round(v, 3) for v in model.positives[k]] for k in model.KINDS},
        "totals": {k: [round(v, 3) for v in model.totals[k]] for k in model.KINDS},
        "table": {k: [round(v, 5) for v in model.table(k)] for k in model.KINDS},
    }


@dataclass(frozen=True, slots=True)
class Prior:
    """A loaded prior: the model and what it reads."""

    scaler: RunningStandardScaler
    model: EvidenceCalibration
    inputs: tuple[str, ...]
    scale: bool = False
    monotone: tuple[str, ...] = ()


def load(path: Path = PRIOR_PATH, *, horizon_seconds: float | None = None) -> Prior | None:
    """Return the prior, or ``None`` when there is none.

    ``None`` too when it is unreadable, of another format, binned on other evidence edges,
    or trained for another ``horizon_seconds`` (its probabilities would mean another
    thing). Raises nothing: a missing or malformed prior means starting blind, as before.
    """
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != _FORMAT or tuple(doc["edges"]) != EVIDENCE_EDGES:
            return None
        trained_for = float(doc["made"]["horizon_seconds"])
        if horizon_seconds is not None and trained_for != horizon_seconds:
            return None
        model = EvidenceCalibration(smoothing=float(doc["smoothing"]),
                                    half_life=float(doc["half_life"]))
        for kind in model.KINDS:
            positives = [float(v) for v in doc["positives"][kind]]
            totals = [float(v) for v in doc["totals"][kind]]
            if len(positives) != len(model.positives[kind]) or len(totals) != len(positives):
                return None
            model.positives[kind], model.totals[kind] = positives, totals
        prior = Prior(scaler=RunningStandardScaler(), model=model,
                      inputs=tuple(str(i) for i in doc["inputs"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return prior


def main(argv: list[str] | None = None) -> int:
    """Train the prior and write it (``python -m analytics.prior``)."""
    parser = argparse.ArgumentParser(prog="python -m analytics.prior", description=__doc__)
    parser.add_argument("--gpus", type=int, default=96)
    parser.add_argument("--days", type=float, default=8.0)
    parser.add_argument("--acceleration", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=PRIOR_SEED)
    parser.add_argument("--out", type=Path, default=PRIOR_PATH)
    args = parser.parse_args(argv)
    doc = train(gpus=args.gpus, days=args.days, seed=args.seed, acceleration=args.acceleration)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: {doc['made']}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
