"""How the sustain window of the published probability trades precision for recall (issue #15).

Reads the ``prediction`` lines of a ``gpuhealth replay FILE.lp --events EVENTS`` stream made
with ``[analytics] predictor_sustain_seconds = 0`` (every probability as the model gave it),
passes them through :class:`analytics.prediction_stage.SustainedProbability` for each window
asked, and scores the predictions at or above 0.5 as ``benchmarks/replay_eval.py`` does
(:func:`analytics.replay_score.score` against the held-out labels). The model does not learn
from what is published, so one replay serves every window: the figures are those a replay
with that window would give.

Usage::

    .venv/bin/python benchmarks/warning_sweep.py --heldout DIR --events EVENTS.jsonl
        [--windows 0,900,1800,3600,7200] [--threshold 0.5] [--json OUT]

``DIR`` holds ``labels.json`` (``benchmarks/heldout_fleet.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from analytics.prediction_stage import SustainedProbability  # noqa: E402
from analytics.replay_score import (  # noqa: E402
    Truth,
    Warning,
    fmt,
    heldout_truth,
    hint_of,
    score,
)
from core.records import EntityId, NodeName, Prediction  # noqa: E402


def read_predictions(path: Path) -> list[tuple[Prediction, tuple[str, ...], str]]:
    """The stream's predictions in order: each with its aliases and the hint of its driver.

    Raises:
        SystemExit: The file cannot be read, its first line is not an event (an empty,
            binary or other file), or a line is not JSON or is a ``prediction`` without
            its keys (the message names the file and line).
    """
    out = []
    try:
        handle = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise SystemExit(f"error: --events {path}: cannot read: {exc.strerror or exc}") from None
    first = True
    with handle:
        for number, raw in enumerate(handle, 1):
            if first and raw.strip():  # one look at the start: is it an events stream?
                first = False
                _check_event(path, number, raw)
            if b'"prediction"' not in raw:
                continue  # other kinds (anomaly, alert, finding...) are not scored here
            try:
                read = _prediction(json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError as exc:
                raise SystemExit(f"error: {path}:{number}: not UTF-8 ({exc.reason})") from None
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
                raise SystemExit(f"error: {path}:{number}: {what}") from None
            if read is not None:
                out.append(read)
    if first:
        raise SystemExit(f"error: --events {path}: no events (an empty file): give the file "
                         "`gpuhealth replay --events` wrote")
    return out


def _check_event(path: Path, number: int, raw: bytes) -> None:
    """Refuse a file whose first line is not an event line of ``gpuhealth replay --events``."""
    try:
        event = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SystemExit(f"error: {path}:{number}: not UTF-8 ({exc.reason})") from None
    except ValueError:
        event = None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise SystemExit(f"error: {path}:{number}: not an event line of `gpuhealth replay "
                         "--events` (a JSON object with a \"type\")")


def _prediction(e: Any) -> tuple[Prediction, tuple[str, ...], str] | None:
    """One event line's prediction, or ``None`` for another kind of line."""
    if not isinstance(e, dict):
        raise TypeError("not a JSON object")
    if e.get("type") != "prediction":
        return None
    features = e.get("top_features") or {}
    if not isinstance(features, dict):
        raise TypeError(f"top_features is not an object of numbers: {features!r}")
    top = max(features, key=lambda k: abs(float(features[k])), default="")
    prediction = Prediction(
        node=NodeName(str(e["node"])), entity=EntityId(str(e["entity"])),
        probability=float(e["probability"]), horizon_seconds=float(e["horizon_seconds"]),
        top_features={}, predicted_at=float(e["predicted_at"]))
    return prediction, tuple(e.get("aliases") or ()), hint_of(top)


def sweep(predictions: list[tuple[Prediction, tuple[str, ...], str]], truth: Truth,
          windows: list[float], threshold: float) -> list[dict[str, Any]]:
    """Score the predictions published with each window against ``truth``
    (:func:`analytics.replay_score.heldout_truth` of the labels JSON)."""
    rows = []
    for window in windows:
        sustain = SustainedProbability(window_seconds=window)
        warnings = []
        for p, aliases, hint in predictions:
            published = sustain.update(p)
            if published.probability >= threshold:
                warnings.append(Warning(node=p.node, names=(p.entity, *aliases),
                                        at=p.predicted_at, hint=hint))
        result = score(warnings, truth)
        o = result["overall"]
        rows.append({"window_seconds": window, **{k: o[k] for k in (
            "true_episodes", "false_episodes", "precision", "recall", "recall_with_precursor",
            "median_lead_hours", "false_per_1000_gpu_days")},
            "per_kind": {k: {"precision": v["precision"], "recall": v["recall"]}
                         for k, v in result["per_kind"].items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Read, sweep, print a table (and ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout", type=Path, required=True, help="folder with labels.json")
    parser.add_argument("--events", type=Path, required=True, help="replay --events output")
    parser.add_argument("--windows", default="0,900,1800,3600,7200",
                        help="seconds, comma-separated")
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    labels_path = args.heldout / "labels.json"
    try:
        labels = json.loads(labels_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        parser.error(f"--heldout {labels_path}: {getattr(exc, 'strerror', None) or exc}")
    try:
        windows = [float(w) for w in args.windows.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--windows {args.windows!r}: not comma-separated seconds")
    if not windows or any(not 0 <= w <= 86400 for w in windows):
        parser.error(f"--windows {args.windows!r}: each window 0..86400 seconds")
    try:
        truth = heldout_truth(labels)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        parser.error(f"--heldout {labels_path}: not a labels file of "
                     f"benchmarks/heldout_fleet.py ({what})")
    predictions = read_predictions(args.events)
    rows = sweep(predictions, truth, windows, args.threshold)
    print(f"{len(predictions):,} predictions; published >= {args.threshold:g}, by sustain window")
    print("window s | true | false | precision | recall | with precursor | median lead h | "
          "false/1k GPU-days | per kind precision/recall")
    for r in rows:
        kinds = " ".join(f"{k} {fmt(v['precision'])}/{fmt(v['recall'])}"
                         for k, v in r["per_kind"].items())
        print(f"{r['window_seconds']:8.0f} | {r['true_episodes']:4d} | {r['false_episodes']:5d} | "
              f"{fmt(r['precision']):>9} | {fmt(r['recall']):>6} | "
              f"{fmt(r['recall_with_precursor']):>14} | {fmt(r['median_lead_hours']):>13} | "
              f"{fmt(r['false_per_1000_gpu_days']):>17} | {kinds}")
    if args.json_out is not None:
        try:
            args.json_out.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"error: --json {args.json_out}: cannot write: {exc.strerror or exc}",
                  file=sys.stderr)
            return 74  # EX_IOERR, as gpuhealth's commands
    return 0


if __name__ == "__main__":
    sys.exit(main())
