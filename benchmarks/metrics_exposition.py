"""Cost of the ``/metrics`` endpoint: rendering through prometheus-client, and a scrape.

For 10,000 and 100,000 series (GPU-like: ``gpu_clock_event_active{node,entity,reason}``
and plain per-GPU gauges and counters) it times

- ``MetricsExporter.render()``: the custom collector plus ``generate_latest`` on a private
  registry, as done once per collection;
- hand-built exposition text of the same series (f-strings, one join), measured in the
  same run, as the floor; and prints the ratio (goal <= 5x);
- a scrape between two collections: an HTTP GET of ``/metrics`` against the running
  ``MetricsServer``, which sends the cached body (goal < 10 ms).

Usage::

    .venv/bin/python benchmarks/metrics_exposition.py [--sizes 10000 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import functools
import gc
import http.client
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.catalog import BY_NAME  # noqa: E402
from core.records import EntityId, NodeName, Sample  # noqa: E402
from gpuhealth.metrics import MetricsExporter, MetricsServer, label_names  # noqa: E402

GOAL_RENDER_RATIO = 5.0
GOAL_SCRAPE_SECONDS = 0.010

_GAUGES = ("gpu_temperature_celsius", "gpu_power_watts", "gpu_utilization_ratio",
           "gpu_memory_used_bytes", "gpu_sm_clock_hertz", "gpu_energy_joules_total",
           "gpu_pcie_replays_total")
_REASONS = ("gpu_idle", "clocks_setting", "power_cap", "hw_slowdown", "sync_boost",
            "sw_thermal", "hw_thermal", "hw_power_brake", "display_clocks")


def make_samples(n: int) -> list[Sample]:
    """Return ``n`` samples of distinct series, 16 per GPU (7 plain + 9 clock reasons)."""
    out: list[Sample] = []
    gpu = 0
    while len(out) < n:
        node = NodeName(f"node-{gpu // 8:05d}")
        entity = EntityId(f"GPU-{gpu:08x}-0000-0000-0000-000000000000")
        for metric in _GAUGES:
            out.append(Sample(metric=metric, value=float(gpu % 97) + 0.5, observed_at=1.0,
                              node=node, entity=entity))
        for reason in _REASONS:
            out.append(Sample(metric="gpu_clock_event_active", value=float(gpu % 2),
                              observed_at=1.0, node=node, entity=entity,
                              labels={"reason": reason}))
        gpu += 1
    return out[:n]


def _float(value: float) -> str:
    return repr(float(value))


def _escape(value: str) -> str:
    """Escape a label value as the text format requires (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def hand_built(samples: list[Sample]) -> bytes:
    """Render the same exposition text by hand: HELP, TYPE, sorted and escaped label pairs.

    This is the floor a correct renderer cannot beat by much: the same lines, with the
    escaping the format requires, and nothing else.
    """
    by_metric: dict[str, list[Sample]] = {}
    for s in samples:
        by_metric.setdefault(s.metric, []).append(s)
    lines: list[str] = []
    for name in sorted(by_metric):
        spec = BY_NAME[name]
        lines.append(f"# HELP {name} {spec.help}")
        lines.append(f"# TYPE {name} {spec.type.value}")
        names = sorted(label_names(spec))
        for s in by_metric[name]:
            values = {"node": s.node, "entity": s.entity, **s.labels}
            pairs = ",".join(f'{k}="{_escape(values[k])}"' for k in names)
            lines.append(f"{name}{{{pairs}}} {_float(s.value)}")
    return ("\n".join(lines) + "\n").encode()


def _best_pair(first: Callable[[], object], second: Callable[[], object],
               repeat: int) -> tuple[float, float]:
    """Best of ``repeat`` runs of each, interleaved and with the GC off (as timeit does)."""
    timings: tuple[list[float], list[float]] = ([], [])
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            for fn, out in ((first, timings[0]), (second, timings[1])):
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return min(timings[0]), min(timings[1])


def _scrape_seconds(server: MetricsServer, repeat: int) -> tuple[float, float, int]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    timings = []
    size = 0
    for _ in range(repeat):
        start = time.perf_counter()
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        size = len(resp.read())
        timings.append(time.perf_counter() - start)
    conn.close()
    return min(timings), statistics.median(timings), size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    ok = True
    for n in args.sizes:
        samples = make_samples(n)
        exporter = MetricsExporter()
        exporter.update(samples)
        render_s, hand_s = _best_pair(exporter.render, functools.partial(hand_built, samples),
                                      args.repeat)
        ratio = render_s / hand_s
        server = MetricsServer(exporter=exporter, listen_address="127.0.0.1", port=0)
        server.start()
        try:
            scrape_best, scrape_median, size = _scrape_seconds(server, max(5, args.repeat * 5))
        finally:
            server.stop()
        print(f"{n:>7} series: render (prometheus-client) {render_s * 1e3:8.1f} ms | "
              f"hand-built {hand_s * 1e3:7.1f} ms | ratio {ratio:4.2f}x (goal <= "
              f"{GOAL_RENDER_RATIO:.0f}x) | scrape best {scrape_best * 1e3:5.2f} ms, median "
              f"{scrape_median * 1e3:5.2f} ms for {size / 1e6:.1f} MB (goal < "
              f"{GOAL_SCRAPE_SECONDS * 1e3:.0f} ms)")
        ok = ok and ratio <= GOAL_RENDER_RATIO and scrape_median < GOAL_SCRAPE_SECONDS
    print("goals met" if ok else "goals NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
