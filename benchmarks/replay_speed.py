"""How fast ``gpuhealth replay`` goes through a recorded fleet, on one core (issue #15 item 6).

Writes a labelled synthetic recording (``analytics.synthetic.plan`` of ``SMALL`` with the
given GPUs and days, ``write_line_protocol``; cached in a temporary folder), then in this
process, pinned to one CPU:

1. the baseline: the bare line-protocol read of the same file (``storage.read_records``,
   the decoder and the import checks, nothing else), samples per second;
2. the replay as ``gpuhealth replay FILE.lp`` runs it (``gpuhealth.replay.replay`` with the
   default ``[analytics]``: every detector and the failure predictor), samples per second
   and its ratio to the baseline;

(CPU seconds of this process, so that other work on the machine does not count), and
prints the peak RSS after each (``ru_maxrss``; the recording is written by a child
process, so its memory is not counted) and the projected time of the goal's 60 million
samples (a month of a 256-GPU fleet at one sample per minute) against 10 minutes.

Usage::

    .venv/bin/python benchmarks/replay_speed.py [--gpus 32] [--days 1] [--seed 1]
        [--cache DIR] [--events FILE] [--profile OUT.prof] [--no-analysis | --no-predictor]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core: no BLAS threads either

import argparse  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL_SAMPLES = 60_000_000
"""A month of a 256-GPU fleet at one sample per minute (the issue's figure)."""

GOAL_SECONDS = 600.0
"""The goal: ten minutes on one core."""

GOAL_RSS_MB = 1024.0
"""The goal: under 1 GB."""

_WRITE = """
import dataclasses, pathlib, sys
from analytics import synthetic
gpus, days, seed, out = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
config = dataclasses.replace(synthetic.SMALL, gpus=gpus, days=days,
                             quiet_days=min(synthetic.SMALL.quiet_days, days / 3))
synthetic.write_line_protocol(synthetic.plan(config, seed=seed), pathlib.Path(out))
"""


def recording(gpus: int, days: float, seed: int, cache: Path) -> Path:
    """Return the cached recording of ``gpus`` x ``days``, writing it first if needed."""
    path = cache / f"fleet-g{gpus}-d{days:g}-s{seed}.lp"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", _WRITE, str(gpus), str(days), str(seed),
                        str(partial)], check=True, cwd=ROOT)
        partial.rename(path)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in "
              f"{time.perf_counter() - started:.0f} s")
    return path


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def decode_rate(path: Path) -> tuple[int, float]:
    """Samples of the file and seconds to read them with ``storage.read_records``."""
    from core.records import Sample
    from storage import read_records

    started = time.process_time()
    samples = sum(1 for r in read_records([path]) if isinstance(r, Sample))
    return samples, time.process_time() - started


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=32, help="GPUs (and ports), a multiple of 8")
    parser.add_argument("--days", type=float, default=1.0, help="days of recording")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "gpuhealth-replay-speed",
                        help="where the recordings are kept between runs")
    parser.add_argument("--events", help="also stream the events to this file (replay --events)")
    parser.add_argument("--profile", help="write a cProfile of the replay to this file")
    parser.add_argument("--no-analysis", action="store_true",
                        help="the fault model only (replay(analyse=False))")
    parser.add_argument("--no-predictor", action="store_true",
                        help="the fault model and the detectors, no failure predictor")
    args = parser.parse_args(argv)

    path = recording(args.gpus, args.days, args.seed, args.cache)
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        print(f"pinned to CPU {cpu}")

    samples, decode_seconds = decode_rate(path)
    decode_per_second = samples / decode_seconds
    print(f"baseline, read_records alone: {samples:,} samples in {decode_seconds:.1f} s of CPU = "
          f"{decode_per_second:,.0f} samples/s; peak RSS {peak_rss_mb():.0f} MB")

    from gpuhealth.config import AnalyticsSettings
    from gpuhealth.replay import replay

    settings = AnalyticsSettings(predictor=False) if args.no_predictor else None

    events = open(args.events, "w", encoding="utf-8") if args.events else None  # noqa: SIM115
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
            report = profiler.runcall(replay, [str(path)], analyse=not args.no_analysis,
                                      analytics=settings, events=events)
            profiler.dump_stats(args.profile)
        else:
            report = replay([str(path)], analyse=not args.no_analysis, analytics=settings,
                            events=events)
    finally:
        if events is not None:
            events.close()
    wall = time.perf_counter() - started
    seconds = time.process_time() - cpu_started
    rss = peak_rss_mb()
    analysed = report.analysis.samples if report.analysis is not None else samples
    rate = analysed / seconds
    projected = GOAL_SAMPLES / rate
    what = ("fault model only" if args.no_analysis else "fault model and detectors"
            if args.no_predictor else "every detector and the predictor")
    print(f"replay ({what}): {analysed:,} samples in {seconds:.1f} s of CPU ({wall:.1f} s wall) "
          f"= {rate:,.0f} samples/s "
          f"({rate / decode_per_second:.2f} x the bare read); peak RSS {rss:.0f} MB")
    if report.analysis is not None:
        a = report.analysis
        print(f"  {sum(a.anomalies.values())} anomalies, {a.predictions_made:,} predictions "
              f"({len(a.predictions):,} at or above {a.threshold:g}), "
              f"{sum(len(n.findings_seen) for n in report.nodes)} finding episodes")
    verdict = "meets" if projected <= GOAL_SECONDS else "misses"
    print(f"projected for {GOAL_SAMPLES / 1e6:.0f} M samples: {projected / 60:.1f} min "
          f"({verdict} the {GOAL_SECONDS / 60:.0f}-minute goal; "
          f"{rate / (GOAL_SAMPLES / GOAL_SECONDS):.2f} x the rate it needs); "
          f"memory goal {GOAL_RSS_MB:.0f} MB (peak here {rss:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
