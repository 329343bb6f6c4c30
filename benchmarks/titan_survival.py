"""Titan GPU survival: concordance of a Cox model on a time split, and repeat-failure slots.

Fits a Cox model on landmarks before 2017-01-01 (location, serial prefix, age, time in slot,
past failures of the slot, the GPU and the cabinet) and a baseline Cox model on location alone,
tests both on the GPUs in service on 2017-01-01 over what happened after it, and prints
Harrell's concordance index of each beside the goals of issue 5 (>= 0.70 and >= 0.05 above the
baseline). Then lists the locations whose successive GPUs failed more often than chance before
the split (one-sided Poisson, p <= 1e-3) and how many of them failed again after it.
See ``analytics/survival.py`` for the method and its sources.

The data folder is ``--data``, else ``$GPUHEALTH_TEST_DATA/titan-gpu-lifetimes``, else
``../shared/data/titan-gpu-lifetimes``.

Usage::

    .venv/bin/python benchmarks/titan_survival.py [--data DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from analytics import survival  # noqa: E402

render = survival.render


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation and print it; 2 when the data are missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="folder holding gc_full.csv")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    root = survival.data_dir(args.data)
    if not (root / "gc_full.csv").is_file():
        print(f"no Titan data (gc_full.csv) in {root}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = survival.evaluate_titan(root)
    print(render(result), end="")
    print(f"({time.perf_counter() - started:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
