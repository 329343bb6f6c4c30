"""Cost of the NVML collector, per GPU and tick of each group, against the bare NVML calls.

On the fake NVML (8 x H100 80GB HBM3 built from ``tests/fixtures/nvidia-smi``), and on the
real driver with ``--real``, it measures:

- CPU microseconds per GPU per tick of the fast group and of the slow group, through
  ``NvmlCollector.collect()`` (worker threads with a deadline, the default; and inline);
- the bare ``pynvml`` calls of the same tick, recorded from that tick and replayed on
  the same library in the same run, and our code's share beside them
  (goal on the fake: ours <= 1x the calls' own cost);
- the speed-up of one batched ``nvmlDeviceGetFieldValues`` over one call per field for
  the slow group's fields;
- the resident memory and CPU of a ``gpuhealth`` service process collecting only NVML
  at 1 Hz (goal: under 150 MiB, dcgm-exporter's footprint);
- with ``--real``: the fast group for 8 GPUs at 1 Hz as a share of one core (goal < 1 %),
  and a check that every metric is catalogued with a plausible value, and that
  temperature, memory size and power limit agree with ``nvidia-smi --query-gpu``.

Usage::

    .venv/bin/python benchmarks/nvml_collect.py [--ticks 300] [--rss-seconds 5] [--real]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from collectors.nvml import NvmlCollector  # noqa: E402
from collectors.testing import FakeNvml, given_for_dump  # noqa: E402
from core.catalog import BY_NAME  # noqa: E402
from core.clock import FakeClock  # noqa: E402
from core.records import Sample  # noqa: E402

DUMP = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h100-80gb-hbm3-x8-q.txt"
GOAL_OVERHEAD_RATIO = 1.0
GOAL_RSS_MIB = 150.0
GOAL_CORE_PERCENT_8_GPUS = 1.0
SLOW_FIELDS = (3, 4, 5, 6, 29, 30, 31, 94, 142, 143, 144, 145)


def make_fake() -> FakeNvml:
    return FakeNvml.from_dump(
        DUMP, **given_for_dump(energy_mj=123_456_789, nvlink_states=[1] * 18, supported_events=0)
    )


class Recorder:
    """Wraps an NVML module; records the ``nvml*`` calls made while ``recording``."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.log: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.recording = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._lib, name)
        if not name.startswith("nvml") or not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            if self.recording:
                self.log.append((name, args, kw))
            return attr(*args, **kw)

        return call


def replay(lib: Any, log: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> None:
    for name, args, kw in log:
        try:  # noqa: SIM105 (suppress() would add its own cost to the bare timing)
            getattr(lib, name)(*args, **kw)
        except lib.NVMLError:
            pass


def cpu_us(fn: Callable[[], None], repeat: int) -> float:
    start = time.process_time_ns()
    for _ in range(repeat):
        fn()
    return (time.process_time_ns() - start) / 1e3 / repeat


def group_cost(
    lib: Any,
    gpus: int,
    group: str,
    ticks: int,
    deadline: float | None,
) -> tuple[float, float, int]:
    """Return (collector µs, bare calls µs) per GPU per tick of ``group``, and samples/tick."""
    rec = Recorder(lib)
    clock = FakeClock(now=0.0)
    fast, slow = (1.0, 1e9) if group == "fast" else (1e9, 1.0)
    c = NvmlCollector(
        node="bench",
        nvml=rec,
        clock=clock,
        fast_interval_seconds=fast,
        slow_interval_seconds=slow,
        deadline_seconds=deadline,
        events=False,
    )
    try:
        c.collect()  # the first tick reads both groups and settles the field batches
        clock.advance(1.0)
        c.collect()
        clock.advance(1.0)
        rec.recording = True
        produced = len([r for r in c.collect() if isinstance(r, Sample)])
        rec.recording = False

        def tick() -> None:
            clock.advance(1.0)
            c.collect()

        ours = cpu_us(tick, ticks) / gpus
        bare = cpu_us(lambda: replay(lib, rec.log), ticks) / gpus
    finally:
        c.close()
    return ours, bare, produced // gpus


def field_batching(lib: Any, handle: Any, repeat: int) -> tuple[float, float]:
    """µs for the slow group's fields in one batched call, and one call per field."""
    ids = list(SLOW_FIELDS)

    def batched() -> None:
        lib.nvmlDeviceGetFieldValues(handle, ids)

    def one_by_one() -> None:
        for fid in ids:
            lib.nvmlDeviceGetFieldValues(handle, [fid])

    return cpu_us(batched, repeat), cpu_us(one_by_one, repeat)


_CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from gpuhealth.config import load_settings
from gpuhealth.service import Service
from collectors.nvml import NvmlCollector
settings = load_settings(sys.argv[2])
nvml = None
if sys.argv[4] == "fake":
    from collectors.testing import FakeNvml, given_for_dump
    nvml = FakeNvml.from_dump(sys.argv[5], **given_for_dump(
        energy_mj=1, nvlink_states=[1] * 18, supported_events=0))
collector = NvmlCollector(node="bench", nvml=nvml)
service = Service(settings, collectors={"nvml": collector})
service.start()
cpu0, wall0 = time.process_time(), time.monotonic()
time.sleep(float(sys.argv[3]))
cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
service.stop.set()
service.shutdown()
print(json.dumps({"rss_kib": int(status["VmRSS"].split()[0]),
                  "hwm_kib": int(status["VmHWM"].split()[0]),
                  "core_percent": 100.0 * cpu / wall,
                  "errors": dict(collector.errors_total)}))
"""


def service_footprint(seconds: float, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gpuhealth.toml"
        config.write_text(
            f'[node]\nname = "bench"\ndata_dir = "{tmp}"\n\n[metrics]\nport = 0\n', encoding="utf-8"
        )
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(ROOT), str(config), str(seconds), mode, str(DUMP)],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=False,
        )
    if out.returncode != 0:
        raise RuntimeError(f"service child failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def report_groups(lib: Any, gpus: int, ticks: int, label: str) -> dict[str, float]:
    print(f"\n{label}: {gpus} GPU(s), {ticks} ticks per group; CPU µs per GPU per tick")
    print(
        f"{'group':<6} {'mode':<8} {'collector':>10} {'bare calls':>11} {'ours':>9} "
        f"{'ours/bare':>10} {'samples':>8}"
    )
    figures: dict[str, float] = {}
    for group in ("fast", "slow"):
        for mode, deadline in (("threads", None), ("inline", 0.0)):
            total, bare, produced = group_cost(lib, gpus, group, ticks, deadline)
            ours = max(0.0, total - bare)
            ratio = ours / bare if bare else float("inf")
            figures[f"{group}_{mode}"] = total
            figures[f"{group}_{mode}_ratio"] = ratio
            print(
                f"{group:<6} {mode:<8} {total:>10.1f} {bare:>11.1f} {ours:>9.1f} "
                f"{ratio:>9.2f}x {produced:>8}"
            )
    print(f"goal on the fake: ours/bare <= {GOAL_OVERHEAD_RATIO:.1f}x")
    return figures


def real_check(lib: Any) -> int:
    """Collect on the real driver; check catalogue, plausibility and nvidia-smi agreement."""
    c = NvmlCollector(node="check", deadline_seconds=5.0, event_wait_ms=100)
    try:
        records = list(c.collect())
    finally:
        c.close()
    samples = [r for r in records if isinstance(r, Sample)]
    problems: list[str] = []
    names = sorted({s.metric for s in samples})
    print(f"\nreal NVML: {len(samples)} samples, {len(names)} metrics: {', '.join(names)}")
    print(f"omitted/failed by reason: {dict(c.errors_total)}")
    for s in samples:
        if s.metric not in BY_NAME:
            problems.append(f"uncatalogued {s.metric}")
        ok = {
            "gpu_temperature_celsius": 0 < s.value < 120,
            "gpu_memory_temperature_celsius": 0 < s.value < 130,
            "gpu_power_watts": 0 < s.value < 2000,
            "gpu_power_limit_watts": 0 < s.value < 2000,
        }.get(s.metric, True)
        if s.metric.endswith("_ratio"):
            ok = 0.0 <= s.value <= 1.0
        if s.metric.endswith("_hertz"):
            ok = 0.0 <= s.value < 1e10
        if not ok:
            problems.append(f"implausible {s.metric}{dict(s.labels)} = {s.value}")
    if shutil.which("nvidia-smi"):
        query = "uuid,temperature.gpu,memory.total,power.limit,clocks.sm,pcie.link.gen.max"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
        for line in out.strip().splitlines():
            uuid, temp, mem, limit, _sm, gen = (x.strip() for x in line.split(","))
            got = {
                (s.metric, tuple(sorted(s.labels.items()))): s.value
                for s in samples
                if s.entity == uuid
            }
            for (metric, labels), want, tol in (
                (("gpu_temperature_celsius", ()), float(temp), 3.0),
                (("gpu_memory_total_bytes", ()), float(mem) * 1024 * 1024, 0.01),
                (("gpu_power_limit_watts", ()), float(limit), 0.01),
                (("gpu_pcie_link_generation", (("bound", "max"),)), float(gen), 0.0),
            ):
                value = got.get((metric, labels))
                if value is None:
                    problems.append(f"{uuid}: {metric} missing")
                    continue
                limit_ok = abs(value - want) <= (tol if tol >= 1 or tol == 0 else tol * want)
                print(
                    f"{uuid} {metric}: nvml {value:g} vs nvidia-smi {want:g} "
                    f"{'ok' if limit_ok else 'MISMATCH'}"
                )
                if not limit_ok:
                    problems.append(f"{uuid}: {metric} {value} vs nvidia-smi {want}")
    for p in problems:
        print(f"PROBLEM: {p}")
    print("real-GPU check:", "passed" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--rss-seconds", type=float, default=5.0)
    parser.add_argument("--real", action="store_true", help="also run on the real driver")
    args = parser.parse_args(argv)

    fake = make_fake()
    fig = report_groups(fake, len(fake.gpus), args.ticks, f"fake NVML ({DUMP.name})")
    core = fig["fast_threads"] * 8 / 1e6 * 100.0
    print(
        f"fast group, 8 GPUs at 1 Hz on the fake: {core:.3f} % of one core "
        f"(goal on a real GPU < {GOAL_CORE_PERCENT_8_GPUS:.0f} %)"
    )
    one, many = field_batching(fake, fake.handles[0], args.ticks)
    print(
        f"\nslow-group fields ({len(SLOW_FIELDS)}) on the fake: one batched call {one:.1f} µs, "
        f"one call per field {many:.1f} µs: speed-up {many / one:.2f}x "
        "(Python only; the driver round trip per call is what batching saves on a GPU)"
    )
    mem = service_footprint(args.rss_seconds, "fake")
    print(
        f"\ngpuhealth service collecting only NVML (fake, 8 GPUs, 1 Hz, "
        f"{args.rss_seconds:g} s): RSS {mem['rss_kib'] / 1024:.1f} MiB, peak "
        f"{mem['hwm_kib'] / 1024:.1f} MiB (goal < {GOAL_RSS_MIB:.0f} MiB); "
        f"{mem['core_percent']:.2f} % of one core for the whole process"
    )
    status = 0
    if fig["fast_threads_ratio"] > GOAL_OVERHEAD_RATIO:
        print(
            f"NOTE: fast-group overhead {fig['fast_threads_ratio']:.3f}x is above the "
            f"{GOAL_OVERHEAD_RATIO:.1f}x goal on the fake"
        )
    if args.real:
        import pynvml

        pynvml.nvmlInit()
        try:
            gpus = pynvml.nvmlDeviceGetCount()
            real = report_groups(pynvml, gpus, max(30, args.ticks // 5), "real NVML")
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            one, many = field_batching(pynvml, handle, max(30, args.ticks // 5))
            print(
                f"\nslow-group fields on the real driver: batched {one:.1f} µs, one call "
                f"per field {many:.1f} µs: speed-up {many / one:.2f}x"
            )
        finally:
            pynvml.nvmlShutdown()
        core = real["fast_threads"] * 8 / 1e6 * 100.0
        print(
            f"fast group, 8 GPUs at 1 Hz (projected from {gpus}): {core:.3f} % of one core "
            f"(goal < {GOAL_CORE_PERCENT_8_GPUS:.0f} %)"
        )
        mem = service_footprint(args.rss_seconds, "real")
        print(
            f"gpuhealth service collecting only NVML (real, {gpus} GPU(s), 1 Hz): RSS "
            f"{mem['rss_kib'] / 1024:.1f} MiB, {mem['core_percent']:.2f} % of one core"
        )
        status = real_check(pynvml)
    return status


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
