"""Alerting benchmarks: evaluation at 1,000 to 100,000 active findings; time to Alertmanager.

1. **Evaluation at scale** (#18 item 4). For each size N (default 1,000, 10,000 and
   100,000): a :class:`~gpuhealth.pipeline.Pipeline` whose one rule returns N current
   findings (N/8 nodes x 8 GPUs; a mix of critical, major and warning), with 20 active
   silences, the default inhibition rules, page grouping per node, and two notifiers
   (one taking batches, one single alerts) behind the outbox, evaluated as the
   controller evaluates (``aevaluate`` on one event loop, the remediation engine
   advancing in its own thread, not inside the evaluation). Between evaluations 1 % of
   the findings change (their occurrences grow, so they are re-sent) and 0.1 % are
   replaced by new faults (the old ones resolve). It prints, per size, the first (cold)
   evaluation, the median steady evaluation and the mean of its stages (fault model,
   alert lifecycle, remediation decisions, routing, delivery), findings evaluated per
   second (N / evaluation time), the growth exponent (the log-log slope of the evaluation time over
   N) and, with ``--baseline REV``, the same figures of that commit measured in the same
   run (a ``git archive`` of it in a temporary folder, in a subprocess) and the ratio.
   Goal at 100,000: one evaluation under 1 s, >= 100,000 findings evaluated per second.
   By default the pipeline is a replica that notifies but does not decide remediation
   (``is_leader`` false, ``notify_as_standby``), so the figures are the alerting path's;
   ``--leader`` makes it the leader, which also decides remediation for what changed.
   The fault-model rules themselves are not run (the one rule returns the findings).
2. **Latency.** With ``prometheus-alertmanager`` (or ``alertmanager``) on PATH, it
   starts one on loopback and measures, for first-occurrence critical findings with
   no pending period, the time from ``Pipeline.evaluate()`` to the alert's
   appearance in ``GET /api/v2/alerts`` (goal: under 1 s). ``--alertmanager URL``
   uses a running one instead.

Usage::

    nice .venv/bin/python benchmarks/alerting_throughput.py [--sizes 1000,10000,100000]
        [--evaluations 5] [--baseline 3159430 [--baseline-max 10000]] [--leader]
        [--alertmanager http://127.0.0.1:9093] [--no-latency]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
TREE = Path(os.environ.get("GPUHEALTH_BENCH_TREE") or ROOT)
"""The source tree measured: this one, or a baseline's ``git archive`` (``--baseline``)."""
if str(TREE) not in sys.path:
    sys.path.insert(0, str(TREE))

from alerting.alertmanager import AlertmanagerNotifier  # noqa: E402
from alerting.silences import SilenceStore, parse_matchers  # noqa: E402
from core.clock import FakeClock  # noqa: E402
from core.records import (  # noqa: E402
    Action,
    Alert,
    EntityId,
    Event,
    Finding,
    NodeName,
    Severity,
)
from gpuhealth.pipeline import Pipeline  # noqa: E402

GOAL_EVALUATION_SECONDS = 1.0
GOAL_FINDINGS_PER_SECOND = 100_000
GOAL_AT = 100_000
GOAL_LATENCY_SECONDS = 1.0

KINDS = [
    ("xid", "79", Severity.CRITICAL, Action.REBOOT_NODE),
    ("row_remap", "pending", Severity.WARNING, Action.RESET_GPU),
    ("nvlink", "link_down", Severity.MAJOR, Action.RESET_GPU),
    ("ecc", "dram_uncorrectable", Severity.WARNING, Action.RESET_GPU),
    ("xid", "94", Severity.WARNING, Action.RESET_GPU),
    ("throttle", "thermal", Severity.WARNING, Action.SERVICE_HARDWARE),
    ("xid", "45", Severity.WARNING, Action.NONE),
    ("recovery_action", "gpu_reset", Severity.CRITICAL, Action.RESET_GPU),
]


def make_findings(count: int, start: int = 0) -> list[Finding]:
    out = []
    for i in range(start, start + count):
        kind, code, severity, action = KINDS[i % len(KINDS)]
        node, gpu = divmod(i, 8)
        out.append(Finding(
            node=NodeName(f"gpu-{node:05d}"), entity=EntityId(f"GPU-{node:05d}-{gpu}"),
            kind=kind, code=code, severity=severity, action=action,
            summary=f"{kind} {code} on GPU {gpu}", evidence=(), source="benchmark",
            first_seen_at=1.0, last_seen_at=1.0, occurrences=1,
        ))
    return out


class NullBatch:
    name = "alertmanager-like"
    resend_interval_seconds = 60.0

    def __init__(self) -> None:
        self.count = 0

    async def send(self, alert: Alert) -> None:
        self.count += 1

    async def send_many(self, alerts: Sequence[Alert]) -> None:
        self.count += len(alerts)


class NullSingle:
    name = "pager-like"

    def __init__(self) -> None:
        self.count = 0

    async def send(self, alert: Alert) -> None:
        self.count += 1


class _Stages:
    """Seconds spent in each stage of the evaluations, by wrapping the pipeline's parts."""

    NAMES: ClassVar[dict[str, str]] = {"_judge": "fault model", "update": "alert lifecycle",
                                       "decide": "remediation decisions", "route": "routing",
                                       "deliver": "delivery"}

    def __init__(self, pipeline: Pipeline) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(self.NAMES.values(), 0.0)
        for owner, name in ((pipeline, "_judge"), (pipeline._tracker, "update"),
                            (pipeline._stage, "decide"), (pipeline._router, "route")):
            setattr(owner, name, self._timed(getattr(owner, name), self.NAMES[name]))
        deliver = pipeline.deliver
        seconds = self.seconds

        async def timed_deliver(*, force: bool = False) -> int:
            started = time.perf_counter()
            try:
                return await deliver(force=force)
            finally:
                seconds["delivery"] += time.perf_counter() - started

        pipeline.deliver = timed_deliver  # type: ignore[method-assign]

    def _timed(self, function: Callable[..., Any], stage: str) -> Callable[..., Any]:
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[stage] += time.perf_counter() - started
        return timed


def measure(size: int, evaluations: int, *, leader: bool) -> dict[str, Any]:
    """Evaluate ``size`` active findings as the controller does; return the figures."""
    return asyncio.run(_measure(size, evaluations, leader=leader))


async def _measure(size: int, evaluations: int, *, leader: bool) -> dict[str, Any]:
    clock = FakeClock(now=1_800_000_000.0)
    current = {"findings": make_findings(size)}

    def rule(obs: object, ctx: object) -> list[Finding]:
        return current["findings"]

    silences = SilenceStore(clock=clock)
    for i in range(20):
        silences.add(parse_matchers([f'node=~"gpu-{i * 50:05d}"', 'severity="warning"']),
                     duration_seconds=86400, created_by="bench", comment="maintenance")
    batch, single = NullBatch(), NullSingle()
    pipeline = Pipeline(facts={}, notifiers=[batch], page_notifiers=[single],
                        audit_log_path=None, clock=clock, rules=[rule], silences=silences,
                        cluster_size=max(1, size // 8), tick_inline=False,
                        is_leader=lambda: leader, notify_as_standby=True)
    pipeline.observe([Event(kind="x", code="x", node=NodeName("gpu-00000"),
                            entity=EntityId("x"), observed_at=None)])
    started = time.perf_counter()
    out = await pipeline.aevaluate()
    cold = time.perf_counter() - started
    cold_counts = (len(out.notified), len(out.pages), len(out.muted))
    stages = _Stages(pipeline)
    changed_per_eval = max(1, size // 100)
    replaced_per_eval = max(1, size // 1000)
    fresh = size
    times = []
    for n in range(evaluations):
        clock.advance(5.0)
        fs = list(current["findings"])
        lo = (n * changed_per_eval) % size
        for j in range(lo, min(size, lo + changed_per_eval)):
            fs[j] = replace(fs[j], occurrences=fs[j].occurrences + 1)
        at = (n * 7919 * replaced_per_eval) % size  # new faults in place of old ones
        fs[at:at + replaced_per_eval] = make_findings(replaced_per_eval, fresh)
        fresh += replaced_per_eval
        current["findings"] = fs
        started = time.perf_counter()
        await pipeline.aevaluate()
        times.append(time.perf_counter() - started)
    pipeline.close()
    per_eval = statistics.median(times)
    return {
        "size": size, "evaluations": evaluations, "cold_s": cold, "eval_s": per_eval,
        "max_eval_s": max(times), "mean_eval_s": statistics.fmean(times),
        "findings_per_s": size / per_eval,
        "stages_s": {k: v / evaluations for k, v in stages.seconds.items()},
        "changed_per_eval": changed_per_eval, "replaced_per_eval": replaced_per_eval,
        "cold_notified": cold_counts[0], "cold_pages": cold_counts[1],
        "cold_muted": cold_counts[2], "delivered": batch.count + single.count,
        "leader": leader,
    }


def growth_exponent(results: Sequence[dict[str, Any]]) -> float | None:
    """The least-squares slope of log(evaluation time) over log(N); ``None`` below two sizes."""
    points = [(math.log(r["size"]), math.log(r["eval_s"])) for r in results]
    if len(points) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None


def baseline(rev: str, sizes: Sequence[int], evaluations: int, *, leader: bool
             ) -> list[dict[str, Any]]:
    """Measure commit ``rev`` the same way, in a subprocess on a ``git archive`` of it."""
    if not sizes:
        return []
    with tempfile.TemporaryDirectory(prefix="gpuhealth-baseline-") as tree:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--sizes",
                   ",".join(map(str, sizes)), "--evaluations", str(evaluations)]
        if leader:
            command.append("--leader")
        done = subprocess.run(command, env={**os.environ, "GPUHEALTH_BENCH_TREE": tree},
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"baseline {rev} failed: {done.stderr[-2000:]}")
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def report(results: Sequence[dict[str, Any]], label: str, *, rows: bool = True,
           growth: bool = True) -> None:
    for r in results if rows else ():
        stages = ", ".join(f"{k} {v * 1000:.0f}" for k, v in r["stages_s"].items())
        print(f"{label} N={r['size']:>7,}: cold {r['cold_s']:.2f} s; evaluation "
              f"{r['eval_s'] * 1000:.0f} ms (median; max {r['max_eval_s'] * 1000:.0f}), "
              f"{r['findings_per_s']:,.0f} findings/s; stages ms: {stages}")
    slope = growth_exponent(results) if growth else None
    if slope is not None:
        steps = ", ".join(
            f"{a['size']:,}->{b['size']:,}: "
            f"{math.log(b['eval_s'] / a['eval_s']) / math.log(b['size'] / a['size']):.2f}"
            for a, b in itertools.pairwise(results))
        print(f"{label} growth exponent (log-log slope of evaluation time over N): "
              f"{slope:.2f} ({steps})")


@contextlib.contextmanager
def alertmanager(url: str | None) -> Iterator[str | None]:
    if url:
        yield url
        return
    try:
        from tests.servers import start_alertmanager
        with start_alertmanager() as am:
            yield am.url
    except BaseException as exc:  # pytest.skip raises a BaseException subclass
        if isinstance(exc, KeyboardInterrupt):
            raise
        print(f"latency: no Alertmanager ({type(exc).__name__}: {exc}); skipped")
        yield None


def latency(url: str, rounds: int = 20) -> float:
    def rule(obs, ctx):
        for g in obs.events("xid"):
            yield Finding(node=g.node, entity=g.entity, kind="xid", code=g.code,
                          severity=Severity.CRITICAL, action=Action.REBOOT_NODE,
                          summary="GPU has fallen off the bus", evidence=(), source="bench")

    pipeline = Pipeline(facts={}, notifiers=[AlertmanagerNotifier(url=url)],
                        audit_log_path=None, rules=[rule], cluster_size=1000)
    run = int(time.time())
    times = []
    for i in range(rounds):
        node = f"lat-{run}-{i}"
        pipeline.observe([Event(kind="xid", code="79", node=NodeName(node),
                                entity=EntityId("GPU-0"), observed_at=time.time())])
        started = time.perf_counter()
        pipeline.evaluate()
        query = urllib.parse.quote(f'node="{node}"')
        while True:
            with urllib.request.urlopen(f"{url}/api/v2/alerts?filter={query}",
                                        timeout=5) as response:
                if json.loads(response.read()):
                    break
            if time.perf_counter() - started > 10:
                raise RuntimeError(f"alert for {node} did not arrive in 10 s")
            time.sleep(0.002)
        times.append(time.perf_counter() - started)
    worst = max(times)
    verdict = "OK" if worst < GOAL_LATENCY_SECONDS else "ABOVE GOAL"
    print(f"finding -> GET /api/v2/alerts: median {statistics.median(times) * 1000:.1f} ms, "
          f"max {worst * 1000:.1f} ms over {rounds} (goal < {GOAL_LATENCY_SECONDS:.0f} s) "
          f"{verdict}")
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000",
                        help="active findings per run, comma-separated")
    parser.add_argument("--alerts", type=int, default=None, help="one size (older option)")
    parser.add_argument("--evaluations", type=int, default=5)
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also measure this commit, in the same run")
    parser.add_argument("--baseline-max", type=int, default=10_000,
                        help="largest size the baseline is measured at (it grows faster)")
    parser.add_argument("--leader", action="store_true",
                        help="the leader: remediation is decided in each evaluation too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--alertmanager", default=None)
    parser.add_argument("--no-latency", action="store_true")
    args = parser.parse_args()
    sizes = [args.alerts] if args.alerts else [int(s) for s in args.sizes.split(",") if s]
    if args.worker:
        for size in sizes:
            print(json.dumps(measure(size, args.evaluations, leader=args.leader)), flush=True)
        return 0
    role = "leader (remediation decided)" if args.leader else "replica (alerts, no remediation)"
    print(f"tree {TREE}; {role}; {args.evaluations} evaluations per size")
    results = []
    for size in sizes:
        results.append(measure(size, args.evaluations, leader=args.leader))
        report(results[-1:], "now", growth=False)
    report(results, "now", rows=False)
    if args.baseline:
        old_sizes = [s for s in sizes if s <= args.baseline_max]
        old = baseline(args.baseline, old_sizes, args.evaluations, leader=args.leader)
        report(old, f"baseline {args.baseline}")
        for o in old:
            new = next(r for r in results if r["size"] == o["size"])
            print(f"N={o['size']:>7,}: baseline {o['eval_s'] * 1000:.0f} ms -> now "
                  f"{new['eval_s'] * 1000:.0f} ms per evaluation, "
                  f"{o['eval_s'] / new['eval_s']:.1f}x")
        skipped = [s for s in sizes if s > args.baseline_max]
        if skipped:
            print(f"baseline not measured at {', '.join(f'{s:,}' for s in skipped)} "
                  f"(--baseline-max {args.baseline_max:,})")
    ok = True
    at_goal = [r for r in results if r["size"] == GOAL_AT]
    for r in at_goal:
        ok = (r["eval_s"] < GOAL_EVALUATION_SECONDS
              and r["findings_per_s"] >= GOAL_FINDINGS_PER_SECOND)
        print(f"goal at {GOAL_AT:,}: evaluation {r['eval_s']:.2f} s (< "
              f"{GOAL_EVALUATION_SECONDS:.0f} s), {r['findings_per_s']:,.0f} findings/s "
              f"(>= {GOAL_FINDINGS_PER_SECOND:,}) {'OK' if ok else 'NOT MET'}")
    if not args.no_latency:
        with alertmanager(args.alertmanager) as url:
            if url:
                ok = latency(url) < GOAL_LATENCY_SECONDS and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
