"""Import plus reliability report, end to end: wall time and peak memory (RSS).

Two scenarios, each run in a fresh Python process so that its peak RSS is its own:

* ``titan``: the whole Titan GPU history (``$GPUHEALTH_TEST_DATA/titan-gpu-lifetimes``,
  or ``--data``): 37,343 residencies of 30,207 GPUs and 6,367 failures over six years.
  Goal: under 30 s and 1 GB.
* ``synthetic``: a history ten times larger in Titan's own file format (186,880 slots,
  about 370,000 residencies and 60,000 failures over the same six years), generated with a
  seeded generator before the clock starts. Goal: under 60 s and 2 GB.

Timed steps: the importer (CSV parsing and mapping), the bulk insert into a fresh
``IncidentHistory``, reading it back and computing every figure (``build_report``), and
rendering the HTML (with plots), Markdown and JSON reports.

Usage::

    python benchmarks/report_end_to_end.py [--data DIR] [--scenario titan|synthetic|all]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboards.report import ReportOptions, build_report, render
from storage.history import IncidentHistory
from storage.importers import import_titan

GOALS = {"titan": (30.0, 1024.0), "synthetic": (60.0, 2048.0)}
"""Scenario -> (seconds, MiB) from issue #8."""

TITAN_SLOTS = 18_688
TITAN_EVENTS = 6_367
SWAP_RATIO = (37_343 - 18_688 - 6_367) / 6_367
"""Non-failure removals (moves, swaps) per failure on Titan: rows beyond one per slot."""
START = datetime(2013, 11, 19, 18, 35, 15)
END = datetime(2019, 8, 1, 20, 7, 33)


def make_synthetic(folder: Path, *, scale: int = 10, seed: int = 20261130) -> dict[str, int]:
    """Write gc_full.csv and gc_summary_loc.csv for ``scale`` times Titan's slots.

    Each slot starts with a GPU at START; failures arrive as a Poisson process at Titan's
    mean rate, and non-failure removals (swaps) at :data:`SWAP_RATIO` times that rate, so
    that rows, failures and slots are each about ``scale`` times Titan's. A failed GPU
    leaves (DBE 75 %, OTB 25 %) and a new one is inserted after an exponential repair delay
    (mean 30 days); a swapped one is replaced a day later. GPUs installed from 2017 on are
    batch ``new``.
    """
    rng = np.random.default_rng(seed)
    span = (END - START).total_seconds()
    slots = TITAN_SLOTS * scale
    rate = TITAN_EVENTS * scale / (slots * span)  # failures per slot-second
    cutoff = datetime(2017, 1, 1)
    fmt = "%Y-%m-%d %H:%M:%S"
    rows = 0
    events = 0
    serial = 0
    with (folder / "gc_full.csv").open("w") as full, \
            (folder / "gc_summary_loc.csv").open("w") as summary:
        full.write("SN,location,insert,remove,duration,out,event\n")
        summary.write("SN,batch\n")
        for index in range(slots):
            col, rest = divmod(index, 8 * 3 * 8 * 4)
            row, rest = divmod(rest, 3 * 8 * 4)
            cage, rest = divmod(rest, 8 * 4)
            slot, node = divmod(rest, 4)
            location = f"c{col}-{row}c{cage}s{slot}n{node}"
            at = 0.0
            while at < span:
                serial += 1
                sn = f"{serial:013d}"
                inserted = START + timedelta(seconds=at)
                life = rng.exponential(1.0 / rate)
                swap = rng.exponential(1.0 / (SWAP_RATIO * rate))
                failed = at + life < span and life < swap
                swapped = not failed and at + swap < span
                removed_at = min(at + (life if failed else swap), span)
                removed = START + timedelta(seconds=removed_at)
                event = ("DBE" if rng.random() < 0.75 else "OTB") if failed else ""
                out = "TRUE" if failed else "FALSE"
                full.write(f"{sn},{location},{inserted.strftime(fmt)},{removed.strftime(fmt)},"
                           f"{int(removed_at - at)},{out},{event}\n")
                summary.write(f"{sn},{'new' if inserted >= cutoff else 'old'}\n")
                rows += 1
                events += bool(failed)
                if failed:
                    at = removed_at + rng.exponential(30 * 86400.0)
                elif swapped:
                    at = removed_at + 86400.0
                else:
                    at = span
    return {"rows": rows, "events": events, "gpus": serial, "slots": slots}


def run_scenario(name: str, data: Path) -> dict[str, object]:
    """Run one scenario in this process and return its figures."""
    work = Path(tempfile.mkdtemp(prefix=f"gpuhealth-bench-{name}-"))
    generated: dict[str, float] = {}
    if name == "synthetic":
        started = time.perf_counter()
        generated = dict(make_synthetic(work))
        generated["generate_seconds"] = round(time.perf_counter() - started, 1)
        source = work
    else:
        source = data
    steps: dict[str, float] = {}
    t0 = time.perf_counter()
    result = import_titan(source)
    steps["parse"] = time.perf_counter() - t0
    t = time.perf_counter()
    with IncidentHistory(work / "history.sqlite") as store:
        store.upsert_inventory(result.inventory)
        store.upsert_incidents(result.incidents)
        counts = {"residencies": len(result.inventory), "incidents": len(result.incidents)}
        del result
        steps["insert"] = time.perf_counter() - t
        t = time.perf_counter()
        figures = build_report(store, ReportOptions(source="titan"))
    steps["report"] = time.perf_counter() - t
    t = time.perf_counter()
    sizes = {fmt: len(render(figures, fmt)) for fmt in ("html", "md", "json")}
    steps["render"] = time.perf_counter() - t
    total = time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return {"scenario": name, "seconds": round(total, 2), "peak_rss_mib": round(peak_mib),
            "steps": {k: round(v, 2) for k, v in steps.items()}, "counts": counts,
            "bytes": sizes, "generated": generated,
            "failures_in_report": figures["sections"]["mtbf"]["fleet"]["failures"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None,
                        help="titan-gpu-lifetimes folder (default $GPUHEALTH_TEST_DATA/...)")
    parser.add_argument("--scenario", choices=["titan", "synthetic", "all"], default="all")
    parser.add_argument("--json", action="store_true", help="(internal) one scenario, JSON")
    args = parser.parse_args()
    data = args.data or Path(os.environ.get("GPUHEALTH_TEST_DATA", "/work/shared/data")) \
        / "titan-gpu-lifetimes"
    if args.json:
        print(json.dumps(run_scenario(args.scenario, data)))
        return 0
    names = ["titan", "synthetic"] if args.scenario == "all" else [args.scenario]
    results = []
    for name in names:
        if name == "titan" and not (data / "gc_full.csv").is_file():
            print(f"titan: skipped, no gc_full.csv under {data} (set GPUHEALTH_TEST_DATA)")
            continue
        out = subprocess.run([sys.executable, __file__, "--scenario", name, "--json",
                              "--data", str(data)], check=True, capture_output=True, text=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'scenario':<10} {'rows':>8} {'failures':>9} {'time s':>8} {'goal s':>7} "
          f"{'ratio':>6} {'peak MiB':>9} {'goal MiB':>9} {'ratio':>6}  steps (s)")
    ok = True
    for r in results:
        goal_s, goal_mib = GOALS[str(r["scenario"])]
        seconds, mib = float(r["seconds"]), float(r["peak_rss_mib"])
        ok &= seconds < goal_s and mib < goal_mib
        counts = r["counts"]
        print(f"{r['scenario']:<10} {counts['residencies']:>8,} {counts['incidents']:>9,} "
              f"{seconds:>8.1f} {goal_s:>7.0f} {seconds / goal_s:>6.2f} {mib:>9.0f} "
              f"{goal_mib:>9.0f} {mib / goal_mib:>6.2f}  {r['steps']}")
    if len(results) == 2:
        a, b = results
        print(f"synthetic / titan: {float(b['seconds']) / float(a['seconds']):.1f}x time, "
              f"{float(b['peak_rss_mib']) / float(a['peak_rss_mib']):.1f}x memory for "
              f"{b['counts']['residencies'] / a['counts']['residencies']:.1f}x rows")
    print("all goals met" if ok else "GOAL MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
