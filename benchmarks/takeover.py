"""Take-over: seconds from a standby becoming leader to its remediation ticking freely (#18).

A controller pair in one process: two run pipelines sharing one SQLite audit trail and
action store (as a pair shares PostgreSQL), a scheduler whose node updates take
``--update-ms`` each (a PATCH to the Kubernetes API server; the ``tests/fake_scheduler.py``
cluster behind it). The leader holds two warnings on each of ``--nodes`` nodes (corrected
ECC: notify-only incidents, the background of a fleet) and a few Xid 79s; then the standby
takes over. Measured: its take-over evaluation (the policy rebuilt, every active alert
decided, the first tick) and its next ticks, until every node's reliability score is
published. The baseline is the same code with the score publication as it was before
(every changed score in one tick, one at a time: ``PUBLISH_PER_TICK`` unbounded,
``concurrency`` 1), measured in the same run; the ratio is baseline / now.

The 10,000-node fail-over of ``benchmarks/fleet_sim.py`` saw the new leader's first ticks
take 20-26 s; this isolates that cost (no agents, no PostgreSQL, no HTTP).

Usage::

    .venv/bin/python benchmarks/takeover.py --nodes 10000 [--update-ms 2] [--postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.clock import FakeClock
from core.records import Action, EntityId, Evidence, Finding, NodeName, Severity
from gpuhealth.pipeline import Pipeline
from remediation import engine as engine_module
from tests.fake_scheduler import FakeCluster, FakeNode, FakeScheduler


class SlowScheduler(FakeScheduler):
    """A fake scheduler whose node label updates take ``update_seconds`` each."""

    update_seconds = 0.002

    async def set_reliability(self, node: NodeName, score: float) -> None:
        await asyncio.sleep(self.update_seconds)
        await super().set_reliability(node, score)


def finding(node: str, entity: str, *, critical: bool = False) -> Finding:
    return Finding(
        node=NodeName(node), entity=EntityId(entity),
        kind="xid" if critical else "ecc", code="79" if critical else "sbe_rate",
        severity=Severity.CRITICAL if critical else Severity.WARNING,
        action=Action.REBOOT_NODE if critical else Action.NONE,
        summary="GPU has fallen off the bus" if critical else "corrected ECC errors rising",
        evidence=(Evidence(file="kern.log" if critical else "nvml", line=1, text="x"),),
        source="benchmark", occurrences=1, last_seen_at=1000.0)


def pipeline(folder: Path, cluster: FakeCluster, clock: FakeClock, leader: dict[str, str],
             who: str, dsn: str | None) -> Pipeline:
    return Pipeline(
        facts={}, notifiers=[], audit_log_path=dsn or str(folder / "audit.sqlite"),
        dry_run=False, scheduler=SlowScheduler(cluster), clock=clock, rules=[],
        cluster_size=len(cluster.nodes), max_disrupted_fraction=1.0,
        action_store_path=dsn or str(folder / "actions.db"),
        engine_options={"probation_seconds": 600.0}, is_leader=lambda: leader["who"] == who)


def take_over(nodes: int, *, baseline: bool, postgres: bool) -> tuple[float, float, int]:
    """Seconds of the take-over evaluation, seconds until every score is out, ticks."""
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        dsn = None
        if postgres:  # a fresh server per run: the pair's shared state, as in production
            from tests.pg_server import start_postgres

            dsn = stack.enter_context(start_postgres()).dsn
        clock = FakeClock(now=1000.0)
        cluster = FakeCluster(nodes={f"n{i:05d}": FakeNode() for i in range(nodes)})
        leader = {"who": "a"}
        a = pipeline(folder, cluster, clock, leader, "a", dsn)
        b = pipeline(folder, cluster, clock, leader, "b", dsn)
        names = sorted(cluster.nodes)
        held = ([finding(n, "GPU-0") for n in names] + [finding(n, "GPU-1") for n in names]
                + [finding(n, "GPU-2", critical=True) for n in names[:5]])
        for p in (a, b):
            p.observe_findings(held, hold_seconds=1e6)
        a.evaluate()
        b.evaluate()  # the standby tracks the alerts and keeps its policy warm
        if baseline:
            b.engine.concurrency = 1
        leader["who"] = "b"
        start = time.perf_counter()
        b.evaluate()  # takes over: rebuilds, decides every active alert, ticks once
        evaluated = time.perf_counter() - start
        ticks = 1
        while len(b.engine.scheduler.weights) < nodes and ticks < 10_000:  # type: ignore[attr-defined]
            asyncio.run(b.atick())
            clock.advance(1.0)
            ticks += 1
        published = time.perf_counter() - start
        for p in (a, b):
            p.close()
        return evaluated, published, ticks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--update-ms", type=float, default=2.0,
                        help="milliseconds per node label update")
    parser.add_argument("--postgres", action="store_true",
                        help="the shared state on a real PostgreSQL (tests/pg_server.py) "
                        "instead of SQLite files")
    args = parser.parse_args(argv)
    SlowScheduler.update_seconds = args.update_ms / 1000.0
    per_tick = engine_module.PUBLISH_PER_TICK
    now = take_over(args.nodes, baseline=False, postgres=args.postgres)
    engine_module.PUBLISH_PER_TICK = 10**9
    try:
        before = take_over(args.nodes, baseline=True, postgres=args.postgres)
    finally:
        engine_module.PUBLISH_PER_TICK = per_tick
    print(f"take-over at {args.nodes:,} nodes ({2 * args.nodes:,} warnings, "
          f"{args.update_ms:g} ms a node update, state on "
          f"{'PostgreSQL' if args.postgres else 'SQLite'})")
    print("             | take-over evaluation (first tick) | all scores published | ticks")
    for name, (evaluated, published, ticks) in (("now", now), ("baseline", before)):
        print(f"{name:12} | {evaluated:30.2f} s | {published:18.2f} s | {ticks:5d}")
    print(f"ratio (baseline / now), take-over evaluation: {before[0] / now[0]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
