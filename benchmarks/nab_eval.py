"""Score gpuhealth's detectors on the Numenta Anomaly Benchmark beside the published scoreboard.

Checks the scorer first (windowedGaussian's published results must come out at 39.65 standard),
then runs each detector over the corpus (all 58 files, or ``--files`` of them), sweeps the
threshold per profile as NAB does, normalises (null 0, perfect 100) and prints the table with
the scoreboard of ``nab_scoreboard_final_results.json``, and the goals: standard >= 70, and
reward_low_FP above every scoreboard entry.

The data folder is ``--data``, else ``$GPUHEALTH_TEST_DATA/nab``, else ``../shared/data/nab``.

Usage::

    .venv/bin/python benchmarks/nab_eval.py [--data DIR] [--files N] [--cooldown 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from analytics import nab  # noqa: E402

GOAL_STANDARD = 70.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="NAB folder (data/, labels/, config/, results/)")
    parser.add_argument(
        "--files", type=int, default=0, help="only N files spread over the corpus (0: all)"
    )
    parser.add_argument("--cooldown", type=int, default=200, help="debounce rows (0: none)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    root = nab.data_root(args.data) if args.data else ROOT.parent / "shared" / "data" / "nab"
    if not args.data and os.environ.get("GPUHEALTH_TEST_DATA"):
        root = nab.data_root()
    if not nab.is_nab_folder(root):
        print(f"no NAB data in {root}", file=sys.stderr)
        return 2

    files = nab.load_corpus(root)
    check = nab.score_corpus(
        files, nab.load_results(root, "windowedGaussian", files), nab.load_profiles(root)
    )
    print(
        "scorer check: windowedGaussian standard "
        f"{check['standard'].normalised:.2f} (published 39.65), "
        f"reward_low_FP {check['reward_low_FP_rate'].normalised:.2f} (20.87), "
        f"reward_low_FN {check['reward_low_FN_rate'].normalised:.2f} (47.41)"
    )
    keys = nab.spread_keys([f.key for f in files], args.files) if args.files else None
    started = time.perf_counter()
    results = nab.evaluate(root, keys=keys, cooldown_rows=args.cooldown)
    elapsed = time.perf_counter() - started
    board = nab.load_scoreboard(root)
    print()
    print(nab.format_table(results, board))
    print()
    best_low_fp = max(
        (s["reward_low_FP_rate"], d) for d, s in board.items() if "reward_low_FP_rate" in s
    )
    for name, scores in results.items():
        standard = scores["standard"].normalised
        low_fp = scores["reward_low_FP_rate"].normalised
        print(
            f"{name}: standard {standard:.2f} (goal >= {GOAL_STANDARD:.0f}: "
            f"{'met' if standard >= GOAL_STANDARD else 'NOT met'}); reward_low_FP {low_fp:.2f} "
            f"(goal > {best_low_fp[0]:.2f} of {best_low_fp[1]}: "
            f"{'met' if low_fp > best_low_fp[0] else 'NOT met'})"
        )
    scope = f"{len(keys)} files" if keys else "all 58 files"
    print(f"\n{scope}, {len(results)} detectors in {elapsed:.1f} s, cooldown {args.cooldown} rows")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    d: {p: {"score": s.normalised, "threshold": s.threshold} for p, s in r.items()}
                    for d, r in results.items()
                },
                indent=2,
                sort_keys=True,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
