"""Alerting benchmarks: evaluations per second with 10,000 active alerts, and time to Alertmanager.

1. **Throughput.** A :class:`~gpuhealth.pipeline.Pipeline` whose one rule returns
   10,000 current findings (1,250 nodes x 8 GPUs; a mix of critical, major and
   warning), with 20 active silences, the default inhibition rules, page grouping
   per node, and two notifiers (one taking batches, one single alerts) behind the
   outbox. Each evaluation runs the whole alerting stage over all 10,000 alerts
   (lifecycle, inhibition, silences, grouping, outbox); 1 % of the findings change
   between evaluations (their occurrences grow, so they are re-sent). It prints
   alert evaluations per second (alerts x evaluations / seconds) beside the goal,
   >= 10,000/s. The fault-model rules are not part of this stage and are not run.
2. **Latency.** With ``prometheus-alertmanager`` (or ``alertmanager``) on PATH, it
   starts one on loopback and measures, for first-occurrence critical findings with
   no pending period, the time from ``Pipeline.evaluate()`` to the alert's
   appearance in ``GET /api/v2/alerts`` (goal: under 1 s). ``--alertmanager URL``
   uses a running one instead.

Usage::

    .venv/bin/python benchmarks/alerting_throughput.py [--alerts 10000] [--evaluations 20]
        [--alertmanager http://127.0.0.1:9093] [--no-latency]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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

GOAL_EVALUATIONS_PER_SECOND = 10_000
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


def make_findings(count: int) -> list[Finding]:
    out = []
    for i in range(count):
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


def throughput(alerts: int, evaluations: int) -> float:
    clock = FakeClock(now=1_800_000_000.0)
    findings = make_findings(alerts)
    current = {"findings": findings}

    def rule(obs, ctx):
        return current["findings"]

    silences = SilenceStore(clock=clock)
    for i in range(20):
        silences.add(parse_matchers([f'node=~"gpu-{i * 50:05d}"', 'severity="warning"']),
                     duration_seconds=86400, created_by="bench", comment="maintenance")
    batch, single = NullBatch(), NullSingle()
    pipeline = Pipeline(facts={}, notifiers=[batch], page_notifiers=[single],
                        audit_log_path=None, clock=clock, rules=[rule], silences=silences,
                        cluster_size=alerts // 8)
    pipeline.observe([Event(kind="x", code="x", node=NodeName("gpu-00000"),
                            entity=EntityId("x"), observed_at=None)])
    started = time.perf_counter()
    out = pipeline.evaluate()
    cold = time.perf_counter() - started
    print(f"cold evaluation (10k new alerts, remediation decided for each): {cold:.2f} s; "
          f"{len(out.notified)} notified, {len(out.pages)} pages, {len(out.muted)} muted")
    changed_per_eval = max(1, alerts // 100)
    elapsed = 0.0
    for n in range(evaluations):
        clock.advance(5.0)
        lo = (n * changed_per_eval) % alerts
        fs = list(current["findings"])
        for j in range(lo, min(alerts, lo + changed_per_eval)):
            fs[j] = replace(fs[j], occurrences=fs[j].occurrences + 1)
        current["findings"] = fs
        started = time.perf_counter()
        pipeline.evaluate()
        elapsed += time.perf_counter() - started
    rate = alerts * evaluations / elapsed
    print(f"steady state: {evaluations} evaluations x {alerts} active alerts in {elapsed:.2f} s "
          f"({elapsed / evaluations * 1000:.0f} ms each), {changed_per_eval} changed per "
          f"evaluation; delivered {batch.count} + {single.count}")
    verdict = "OK" if rate >= GOAL_EVALUATIONS_PER_SECOND else "BELOW GOAL"
    print(f"alert evaluations per second: {rate:,.0f} (goal >= "
          f"{GOAL_EVALUATIONS_PER_SECOND:,}) {verdict}")
    return rate


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
    parser.add_argument("--alerts", type=int, default=10_000)
    parser.add_argument("--evaluations", type=int, default=20)
    parser.add_argument("--alertmanager", default=None)
    parser.add_argument("--no-latency", action="store_true")
    args = parser.parse_args()
    rate = throughput(args.alerts, args.evaluations)
    ok = rate >= GOAL_EVALUATIONS_PER_SECOND
    if not args.no_latency:
        with alertmanager(args.alertmanager) as url:
            if url:
                ok = latency(url) < GOAL_LATENCY_SECONDS and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
