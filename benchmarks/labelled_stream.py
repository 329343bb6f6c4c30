"""Replay the labelled synthetic GPU/link stream through ``gpuhealth replay``'s code; score it.

The evaluation itself is :func:`gpuhealth.evaluate.evaluate_stream` (also ``gpuhealth evaluate
stream``: the stream written as line protocol, replayed in process through the code ``gpuhealth
run`` uses, scored with :mod:`analytics.replay_score`); this script parses the same options,
prints the same table and can instead write the stream as line protocol for ``gpuhealth
replay``.

Usage::

    .venv/bin/python benchmarks/labelled_stream.py [--small] [--gpus N] [--days D]
        [--seed S] [--json OUT] [--write-lp FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from analytics import stream_eval, synthetic  # noqa: E402
from gpuhealth.evaluate import evaluate_stream, render  # noqa: E402

__all__ = ["evaluate_stream", "main", "render"]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write JSON / line protocol on request)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="64 GPUs x 3 days (CI)")
    parser.add_argument("--gpus", type=int, help="GPUs (and ports), a multiple of 8")
    parser.add_argument("--days", type=float, help="days of stream")
    parser.add_argument(
        "--seed",
        type=int,
        default=stream_eval.REPORTING_SEED,
        help=f"stream seed (default: the reporting seed {stream_eval.REPORTING_SEED})",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument(
        "--write-lp",
        help="write the stream as line protocol here (and "
        "its labels as <file>.labels.json), then exit",
    )
    args = parser.parse_args(argv)
    config = stream_eval.stream_config(small=args.small, gpus=args.gpus, days=args.days)
    if args.write_lp:
        plan = synthetic.plan(config, seed=args.seed)
        path = Path(args.write_lp)
        lines, failures = synthetic.write_line_protocol(plan, path)
        Path(f"{path}.labels.json").write_text(
            json.dumps(synthetic.labels_json(plan), indent=1) + "\n"
        )
        print(f"wrote {lines} lines and {failures} labels to {path}")
        return 0
    result = evaluate_stream(config, args.seed)
    print(render(result), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
