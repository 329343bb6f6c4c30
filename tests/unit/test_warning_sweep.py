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
    rows = sweep.sweep(sweep.read_predictions(events), sweep.heldout_truth(_labels()),
                       [0.0, 1800.0], 0.5)
    assert [(r["true_episodes"], r["false_episodes"]) for r in rows] == [(1, 1), (1, 0)]
    assert rows[1]["median_lead_hours"] == 10.0 - 0.5 + 300 / HOUR


def test_bad_input_is_named_not_a_traceback(tmp_path: Path, capsys) -> None:
    """A broken events line names its file and line; a missing labels file or bad windows
    is a usage error; a prediction spelled with spaces (``json.dumps`` defaults) is read."""
    import pytest

    sweep = _sweep_module()
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_text(json.dumps({"type": "prediction", "node": "n1", "entity": "GPU-a",
                                  "probability": 0.7, "horizon_seconds": 86400.0,
                                  "predicted_at": 5.0}) + "\n"
                      + json.dumps({"type": "anomaly", "note": "prediction"}) + "\n",
                      encoding="utf-8")
    assert [p.probability for p, _, _ in sweep.read_predictions(spaced)] == [0.7]
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b'{"type": "prediction", "node": "n1"}\n'
                       b'{"type": "prediction", "node": "n1", "entity"\n')
    with pytest.raises(SystemExit, match=r"broken.jsonl:1: missing key 'entity'"):
        sweep.read_predictions(broken)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'\xff\xfe"prediction"\n')
    with pytest.raises(SystemExit, match=r"binary.jsonl:1: not UTF-8"):
        sweep.read_predictions(binary)
    with pytest.raises(SystemExit, match="cannot read"):
        sweep.read_predictions(tmp_path / "absent.jsonl")
    for argv in (["--heldout", str(tmp_path), "--events", str(spaced)],
                 ["--heldout", str(tmp_path), "--events", str(spaced), "--windows", "x"]):
        if argv[-1] == "x":
            (tmp_path / "labels.json").write_text(json.dumps(_labels()), encoding="utf-8")
        with pytest.raises(SystemExit) as exited:
            sweep.main(argv)
        assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "labels.json" in err
    assert "--windows 'x'" in err


def test_wrong_shapes_and_unusable_files_are_named_not_tracebacks(tmp_path, capsys):
    """Labels of the wrong shape, a non-object ``top_features``, a file that is no events
    stream (empty, binary) and a ``--json`` that cannot be written: each named, no traceback
    (left from the fresh-user trial of 2026-12-04)."""
    import pytest

    sweep = _sweep_module()
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"type": "prediction", "node": "n1", "entity": "GPU-a",
                                  "probability": 0.7, "horizon_seconds": 86400.0,
                                  "predicted_at": 5.0}) + "\n", encoding="utf-8")
    for labels in ({}, []):
        (tmp_path / "labels.json").write_text(json.dumps(labels), encoding="utf-8")
        with pytest.raises(SystemExit) as exited:
            sweep.main(["--heldout", str(tmp_path), "--events", str(events)])
        assert exited.value.code == 2
        assert "not a labels file of benchmarks/heldout_fleet.py" in capsys.readouterr().err
    listed = tmp_path / "listed.jsonl"
    listed.write_text(json.dumps({"type": "prediction", "node": "n1", "entity": "GPU-a",
                                  "probability": 0.7, "horizon_seconds": 86400.0,
                                  "predicted_at": 5.0, "top_features": [1]}) + "\n")
    with pytest.raises(SystemExit, match=r"listed.jsonl:1: top_features is not an object"):
        sweep.read_predictions(listed)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit, match="no events"):
        sweep.read_predictions(empty)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(1, 256)) * 8)
    with pytest.raises(SystemExit, match=r"garbage.bin:1: not an event line"):
        sweep.read_predictions(garbage)
    (tmp_path / "labels.json").write_text(json.dumps(_labels()), encoding="utf-8")
    assert sweep.main(["--heldout", str(tmp_path), "--events", str(events),
                       "--json", str(tmp_path)]) == 74
    assert f"--json {tmp_path}: cannot write" in capsys.readouterr().err
