"""``benchmarks/warning_sweep.py``: a replay's raw predictions scored per sustain window."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOUR = 3600.0


def _sweep_module():
    spec = importlib.util.spec_from_file_location("warning_sweep",
                                                  ROOT / "benchmarks" / "warning_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["warning_sweep"] = module
    spec.loader.exec_module(module)
    return module


def _labels() -> dict:
    gpus = [{"node": "n1", "uuid": f"GPU-{g}", "aliases": [f"GPU-{g}"], "valid_from": 0.0,
             "valid_to": None} for g in "ab"]
    return {"start": 0.0, "end": 48 * HOUR, "gpu_days": 4.0, "gpus": 2,
            "entities": {"gpus": gpus, "ports": []},
            "failures": [{"id": "f1", "kind": "dbe", "node": "n1", "entity": "GPU-a",
                          "failure_at": 40 * HOUR, "precursor_onset_at": 30 * HOUR,
                          "recovered_at": None}]}


def test_a_burst_is_false_without_a_window_and_gone_with_one(tmp_path: Path) -> None:
    """GPU-b: 20 minutes at 0.9 (a burst, no failure); GPU-a: 0.9 from 10 h before its
    failure. Without a window: one true, one false; with 30 minutes: one true only."""
    lines = []
    for i in range(int(48 * HOUR // 300)):
        at = i * 300.0
        for gpu, p in (("a", 0.9 if 30 * HOUR <= at < 40 * HOUR else 0.01),
                       ("b", 0.9 if 10 * HOUR <= at < 10 * HOUR + 1200 else 0.01)):
            lines.append(json.dumps({"type": "prediction", "at": at, "node": "n1",
                                     "entity": f"GPU-{gpu}", "aliases": [], "probability": p,
                                     "horizon_seconds": 86400.0, "predicted_at": at,
                                     "top_features": {"corrected_ecc_evidence": 30.0}},
                                    separators=(",", ":")))
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join(lines) + "\n", encoding="utf-8")
    sweep = _sweep_module()
    rows = sweep.sweep(sweep.read_predictions(events), _labels(), [0.0, 1800.0], 0.5)
    assert [(r["true_episodes"], r["false_episodes"]) for r in rows] == [(1, 1), (1, 0)]
    assert rows[1]["median_lead_hours"] == 10.0 - 0.5 + 300 / HOUR
