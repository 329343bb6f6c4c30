"""Start-up of the ``gpuhealth`` console script (issue #14 item 6).

Times, in the same run and each ``--repeat`` times (the median is printed, and the best):

* ``python -c pass``: the interpreter alone, the floor;
* ``gpuhealth --version`` (goal <= 0.3 s);
* ``gpuhealth diagnose`` of a small case, ``tests/fixtures/cases/001-xid79-fallen-off-bus-
  dmesg-T-nvidia-smi-unknown-error.log`` (20 lines; goal <= 1 s);
* ``gpuhealth run`` to its first sample: from starting the process until its ``/metrics``
  shows a collected sample (any line not starting with ``gpuhealth_`` or ``#``); the
  configuration has a temporary data folder, free ports, the kernel-log collector on an
  empty file and the default network collector (``/proc/net/dev``), so it runs on a
  machine without a GPU. Reported, no goal.

For ``--version`` it also lists which of scipy, pandas, scikit-learn, river and numpy the
process imported (a ``python -c`` that imports ``gpuhealth.cli``, calls ``main`` with
``--version`` and prints ``sys.modules``).

It exits 0 (a measurement); ``--check`` exits 1 when a goal is missed.

Usage::

    .venv/bin/python benchmarks/cli_startup.py [--repeat 5] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
CASE = ROOT / "tests" / "fixtures" / "cases" / (
    "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log")
HEAVY = ("scipy", "pandas", "sklearn", "river", "numpy")

GOAL_VERSION_SECONDS = 0.3
GOAL_DIAGNOSE_SECONDS = 1.0

_MODULES = """
import json, sys
sys.path.insert(0, sys.argv[1])
from gpuhealth.cli import main
try:
    main(["--version"])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def timed(argv: list[str]) -> float:
    """Seconds to run ``argv`` to its exit (output discarded)."""
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                   cwd=ROOT)
    return time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_to_first_sample(folder: Path) -> float:
    """Seconds from starting ``gpuhealth run`` until ``/metrics`` shows a collected sample."""
    port, api = free_port(), free_port()
    (folder / "kern.log").write_text("")
    config = folder / "run.toml"
    config.write_text(f"""
[node]
name = "bench"
data_dir = "{folder / 'data'}"
[metrics]
port = {port}
[alerting]
api_port = {api}
[report]
enabled = false
[collectors.kernel_log]
source = "file"
path = "{folder / 'kern.log'}"
""")
    url = f"http://127.0.0.1:{port}/metrics"
    started = time.perf_counter()
    proc = subprocess.Popen([GPUHEALTH, "run", "--config", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, cwd=ROOT)
    try:
        while time.perf_counter() - started < 60:
            if proc.poll() is not None:
                raise RuntimeError(f"gpuhealth run exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    body = resp.read().decode()
                if re.search(r"(?m)^(?!gpuhealth_|#)\w+", body):
                    return time.perf_counter() - started
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.01)
        raise RuntimeError("no sample on /metrics within 60 s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def series(fn: Callable[[], float], repeat: int) -> tuple[float, float]:
    """(median, best) of ``repeat`` calls of ``fn``, after one warm-up call."""
    fn()
    values = [fn() for _ in range(repeat)]
    return statistics.median(values), min(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each (default 5)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)

    env_note = f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    print(f"gpuhealth start-up, median (best) of {args.repeat} runs after one warm-up; "
          f"{env_note}")
    floor = series(lambda: timed([sys.executable, "-c", "pass"]), args.repeat)
    version = series(lambda: timed([GPUHEALTH, "--version"]), args.repeat)
    diagnose = series(lambda: timed([GPUHEALTH, "diagnose", str(CASE)]), args.repeat)
    with tempfile.TemporaryDirectory(prefix="gh-cli-startup-") as tmp:
        first = series(lambda: run_to_first_sample(Path(tmp)), max(1, args.repeat // 2))
    out = subprocess.run([sys.executable, "-c", _MODULES, str(ROOT)], capture_output=True,
                         text=True, check=True, cwd=ROOT)
    modules = set(json.loads(out.stdout.strip().splitlines()[-1]))
    heavy = [m for m in HEAVY if m in modules]

    rows = [
        ("python -c pass", floor, None),
        ("gpuhealth --version", version, GOAL_VERSION_SECONDS),
        (f"gpuhealth diagnose {CASE.name[:24]}... ({len(CASE.read_text().splitlines())} lines)",
         diagnose, GOAL_DIAGNOSE_SECONDS),
        ("gpuhealth run, to first sample", first, None),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'command':<{width}}  {'median s':>9}  {'best s':>7}  {'goal':>7}  met")
    missed = []
    for name, (median, best), goal in rows:
        met = "-" if goal is None else ("yes" if median <= goal else "no")
        if met == "no":
            missed.append(name)
        print(f"{name:<{width}}  {median:9.3f}  {best:7.3f}  "
              f"{'-' if goal is None else f'<= {goal:g}':>7}  {met}")
    print(f"\n--version imported {len(modules)} modules; of {', '.join(HEAVY)}: "
          f"{', '.join(heavy) or 'none'}")
    print("\nall goals met" if not missed else f"\ngoals missed: {', '.join(missed)}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
