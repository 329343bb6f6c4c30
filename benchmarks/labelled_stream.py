"""Score every detector and the failure predictor on the labelled synthetic GPU/link stream.

The evaluation itself is :mod:`analytics.stream_eval` (also ``gpuhealth evaluate stream``); this
script parses the same options, prints the table and can write the stream as line protocol for
``gpuhealth replay``.

Usage::

    .venv/bin/python benchmarks/labelled_stream.py [--small] [--gpus N] [--days D]
        [--seed S] [--only NAMES] [--json OUT] [--write-lp FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from analytics import synthetic  # noqa: E402
from analytics.stream_eval import (  # noqa: E402
    ALL,
    DEV_SEEDS,
    ERROR_ONLY,
    PREDICTORS,
    REPORTING_SEED,
    RIVER_DETECTORS,
    VECTOR_DETECTORS,
    Harness,
    evaluate,
    render,
)

__all__ = [
    "ALL",
    "DEV_SEEDS",
    "ERROR_ONLY",
    "PREDICTORS",
    "REPORTING_SEED",
    "RIVER_DETECTORS",
    "VECTOR_DETECTORS",
    "Harness",
    "evaluate",
    "main",
    "render",
]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write JSON / line protocol on request)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="64 GPUs x 3 days (CI)")
    parser.add_argument("--gpus", type=int, help="GPUs (and ports), a multiple of 8")
    parser.add_argument("--days", type=float, help="days of stream")
    parser.add_argument(
        "--seed",
        type=int,
        default=REPORTING_SEED,
        help=f"stream seed (default: the reporting seed {REPORTING_SEED})",
    )
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument(
        "--write-lp",
        help="write the stream as line protocol here (and "
        "its labels as <file>.labels.json), then exit",
    )
    args = parser.parse_args(argv)
    config = synthetic.SMALL if args.small else synthetic.FULL
    if args.gpus:
        config = replace(config, gpus=args.gpus)
    if args.days:
        config = replace(config, days=args.days)
    if args.write_lp:
        plan = synthetic.plan(config, seed=args.seed)
        path = Path(args.write_lp)
        lines, failures = synthetic.write_line_protocol(plan, path)
        Path(f"{path}.labels.json").write_text(
            json.dumps(synthetic.labels_json(plan), indent=1) + "\n"
        )
        print(f"wrote {lines} lines and {failures} labels to {path}")
        return 0
    only = tuple(args.only.split(",")) if args.only else ALL
    result = evaluate(config, args.seed, only=only)
    print(render(result), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
