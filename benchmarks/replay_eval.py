"""Score ``gpuhealth replay FILE.lp --json`` against a labelled fleet recording (issue #15).

Runs the replay as a user would (a child process of the ``gpuhealth`` console script),
measures its wall time, peak RSS (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``: the
replay is this process's only child) and samples per second, then scores the JSON's
warnings against the labels with :mod:`analytics.replay_score` (its docstring has the
scoring rules; ``gpuhealth evaluate stream`` scores an in-process replay the same way).

Usage::

    .venv/bin/python benchmarks/replay_eval.py --heldout DIR [--json OUT]
    .venv/bin/python benchmarks/replay_eval.py --project GPUS DAYS SEED [--json OUT]
    .venv/bin/python benchmarks/replay_eval.py --heldout DIR --replay-json REPLAY.json

``--heldout DIR`` reads ``DIR/fleet.lp`` and ``DIR/labels.json`` written by
``benchmarks/heldout_fleet.py``; ``--project`` generates the project's own stream
(``analytics.synthetic.plan`` with ``SMALL``'s settings at that size, and
``write_line_protocol``) into a temporary folder and takes the labels from
``plan.failures``. ``--replay-json`` scores a replay JSON already made (no child run).

Goals (issue #15): per kind precision >= 0.85 at recall >= 0.5, median lead >= 1 h on
failures with precursors, <= 5 false episodes per 1,000 GPU-days.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from analytics.replay_score import (  # noqa: E402
    RULES,
    Truth,
    evaluate,
    fmt,
    heldout_truth,
    render_scores,
    replay_summary,
    truth_summary,
)


def project_truth(gpus: int, days: float, seed: int, out_dir: Path) -> tuple[Truth, Path]:
    """Generate the project's stream (``analytics.synthetic``) and its truth."""
    from analytics import stream_eval, synthetic

    plan = synthetic.plan(stream_eval.stream_config(small=True, gpus=gpus, days=days), seed=seed)
    path = out_dir / "fleet.lp"
    synthetic.write_line_protocol(plan, path)
    return stream_eval.plan_truth(plan, path), path


# --- the replay ----------------------------------------------------------------------------


def replay_command(lp: Path, source_tree: Path | None = None) -> list[str]:
    """``gpuhealth replay LP --json``: the console script beside this Python, else the CLI.

    With ``source_tree`` (another checkout or ``git archive`` of the project), this Python
    runs that tree's CLI instead (``PYTHONPATH`` set by :func:`run_replay`).
    """
    cli = [sys.executable, "-c", "from gpuhealth.cli import main; main()", "replay", str(lp),
           "--json"]
    if source_tree is not None:
        return cli
    script = Path(sys.executable).with_name("gpuhealth")
    if script.exists():
        return [str(script), "replay", str(lp), "--json"]
    found = shutil.which("gpuhealth")
    if found:
        return [found, "replay", str(lp), "--json"]
    return cli


def run_replay(lp: Path, out_json: Path, *, timeout: float | None = None,
               source_tree: Path | None = None) -> dict[str, Any]:
    """Run the replay as a child; return wall seconds, peak RSS (MB), exit status, stderr tail.

    Exit statuses 0-3 are the worst finding's severity (a normal end); the JSON goes to
    ``out_json``.
    """
    cmd = replay_command(lp, source_tree)
    env = dict(os.environ)
    tree = str((source_tree or ROOT).resolve())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH", "")) if p)
    err_path = out_json.with_suffix(".stderr")
    started = time.perf_counter()
    with open(out_json, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=out_json.parent, env=env)
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    tail = err_path.read_text(encoding="utf-8", errors="replace")[-2000:]
    return {"command": cmd, "source_tree": tree, "wall_seconds": wall,
            "peak_rss_mb": usage.ru_maxrss / 1024.0, "exit_status": status,
            "stderr_tail": tail}




# --- report --------------------------------------------------------------------------------



def render(result: Mapping[str, Any]) -> str:
    """The replay's figures, the input, then every source's table (``render_scores``)."""
    lines = []
    r = result.get("replay") or {}
    if r:
        lines.append(f"replay: {fmt(r.get('wall_seconds'), 1)} s wall, peak RSS "
                     f"{fmt(r.get('peak_rss_mb'), 0)} MB, {r.get('samples') or 0:,} samples "
                     f"({fmt(r.get('samples_per_second'), 0)} samples/s), exit "
                     f"{r.get('exit_status')}; predictions made {r.get('predictions_made')}, "
                     f"withheld {r.get('withheld')}, positives learned "
                     f"{r.get('positives_learned')}, listed >= 0.5: "
                     f"{r.get('predictions_listed')}")
    inp = result["input"]
    lines.append(f"input: {inp['source']} {inp['path']}: {inp['failures']} failures "
                 f"{inp['by_kind']}, {inp['gpu_days']:g} GPU-days")
    lines += ["", render_scores(result)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run (or read) the replay, score it, print the tables, write ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--heldout", type=Path, help="folder with fleet.lp and labels.json")
    source.add_argument("--project", nargs=3, metavar=("GPUS", "DAYS", "SEED"),
                        help="generate analytics.synthetic's stream of this size")
    parser.add_argument("--replay-json", type=Path, help="score this replay JSON, run nothing")
    parser.add_argument("--keep", type=Path, help="keep the recording and replay JSON here")
    parser.add_argument("--timeout", type=float, default=None, help="replay time limit, s")
    parser.add_argument("--source-tree", type=Path, default=None,
                        help="replay with this tree's gpuhealth (e.g. a git archive of HEAD)")
    parser.add_argument("--json", dest="json_out", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="replay_eval_"))
    work.mkdir(parents=True, exist_ok=True)
    labels_json: Mapping[str, Any] | None = None
    if args.heldout is not None:
        labels_json = json.loads((args.heldout / "labels.json").read_text(encoding="utf-8"))
        truth = heldout_truth(labels_json)
        lp = args.heldout / "fleet.lp"
        source_name = "heldout"
    else:
        gpus, days, seed = int(args.project[0]), float(args.project[1]), int(args.project[2])
        started = time.perf_counter()
        truth, lp = project_truth(gpus, days, seed, work)
        print(f"project stream: {gpus} GPUs x {days:g} days seed {seed} written in "
              f"{time.perf_counter() - started:.1f} s: {lp}", flush=True)
        source_name = "project"
    replay_info: dict[str, Any] = {}
    if args.replay_json is not None:
        replay_path = args.replay_json
    else:
        replay_path = work / "replay.json"
        print(f"replaying {lp} ({lp.stat().st_size / 1e6:.0f} MB) ...", flush=True)
        replay_info = run_replay(lp, replay_path, timeout=args.timeout,
                                 source_tree=args.source_tree)
    try:
        replay = json.loads(replay_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"error: no replay JSON ({exc}); {replay_info.get('stderr_tail', '')}",
              file=sys.stderr)
        return 1
    summary = replay_summary(replay)
    if replay_info:
        replay_info.update(samples=summary["samples"],
                           samples_per_second=summary["samples"] / replay_info["wall_seconds"]
                           if replay_info["wall_seconds"] else None)
    replay_info.update({k: v for k, v in summary.items() if k != "samples"})
    result: dict[str, Any] = {
        "input": {"source": source_name, "path": str(lp), **truth_summary(truth)},
        "replay": replay_info,
        "rules": RULES,
        **evaluate(replay, truth, labels_json),
    }
    print(render(result), end="")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
