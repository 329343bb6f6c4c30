"""The remediation stage's Prometheus metrics, as a prometheus-client custom collector.

Read at each scrape from the engine, its policy and the action store, so the figures are
the engine's own, not copies the service keeps in step:

- ``gpuhealth_remediation_actions_total{step,phase,dry_run}``: engine transitions since
  start (``dry_run="true"``: recorded only, nothing was done to the node);
- ``gpuhealth_remediation_held_total{reason}``: steps held back (breaker, rate limit,
  approval, human, opt-out, budget);
- ``gpuhealth_remediation_failures_total{step,classification}``: failed attempts of a
  step: ``transient`` (tried again), ``exhausted`` (its attempt budget spent),
  ``permanent`` (the adapter refused or reported failure), ``timeout``;
- ``gpuhealth_remediation_breaker_open``, ``gpuhealth_remediation_leader`` (0/1);
- ``gpuhealth_time_to_remediate_seconds_total``: seconds from an incident's first request
  to its node out of service, summed (MTTR's numerator; dry-run steps add nothing);
- ``gpuhealth_open_incidents{severity,phase}``, ``gpuhealth_node_reliability_ratio{node}``;
- ``gpuhealth_disrupted_nodes`` (none in dry run), ``gpuhealth_disruption_budget_nodes``;
- ``gpuhealth_state_write_failures_total{store}`` (``audit``, ``actions``): failed writes
  of the remediation stage's stores since start, and ``gpuhealth_state_store_writable{store}``
  (0 while the last write failed).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

from core.exposition import family
from core.records import Severity
from remediation.stage import RemediationStage


class RemediationCollector:
    """prometheus-client collector over one engine (module docstring).

    Args:
        stage: The remediation stage (its engine's ``stats``, ``policy`` and ``store``, its
            write failures).
        is_leader: Whether this controller leads now.
    """

    def __init__(self, stage: RemediationStage, *, is_leader: Callable[[], bool]) -> None:
        self.stage = stage
        self.engine = stage.engine
        self.is_leader = is_leader
        self._incidents: collections.Counter[tuple[str, str]] = collections.Counter()
        self._breaker = False

    def refresh(self) -> None:
        """Read what lives in the action store (open incidents, the breaker) for scrapes.

        Called after each remediation tick, so a scrape never waits for the store (a
        controller's PostgreSQL may be away: the last figures stay).

        Raises:
            TemporaryError: The store cannot be read now (the last figures stay).
        """
        engine = self.engine
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for (severity, state), n in engine.store.incident_counts(
                states=("open", "probation")).items():
            counts[(severity or "none", state)] += n
        self._incidents = counts
        self._breaker = engine.breaker_open

    def describe(self) -> list[Any]:
        """Nothing up front (the registry then calls :meth:`collect` on every scrape)."""
        return []

    def collect(self) -> Iterator[Any]:
        """Yield the families (module docstring)."""
        engine, stats = self.engine, self.engine.stats
        policy = engine.policy
        yield family("gpuhealth_remediation_actions_total",
                     [({"step": s, "phase": p, "dry_run": d}, n)
                      for (s, p, d), n in stats.transitions.items()])
        yield family("gpuhealth_remediation_held_total",
                     [({"reason": r}, n) for r, n in stats.held.items()])
        yield family("gpuhealth_remediation_failures_total",
                     [({"step": s, "classification": c}, n)
                      for (s, c), n in stats.failures.items()])
        yield family("gpuhealth_remediation_breaker_open", [({}, float(self._breaker))])
        yield family("gpuhealth_remediation_leader", [({}, float(self.is_leader()))])
        yield family("gpuhealth_time_to_remediate_seconds_total",
                     [({}, sum(stats.remediate_seconds))])
        counts = self._incidents
        yield family("gpuhealth_open_incidents",
                     [({"severity": s.value, "phase": p}, counts.get((s.value, p), 0))
                      for s in Severity for p in ("open", "probation")])
        yield family("gpuhealth_node_reliability_ratio",
                     [({"node": n}, v) for n, v in stats.reliability.items()])
        out = frozenset() if policy.dry_run else policy.out_of_service
        yield family("gpuhealth_disrupted_nodes", [({}, len(out))])
        yield family("gpuhealth_disruption_budget_nodes", [({}, policy.disruption_limit)])
        failing = self.stage.failing_store()
        yield family("gpuhealth_state_write_failures_total",
                     [({"store": k}, n) for k, n in self.stage.write_failures.items()])
        yield family("gpuhealth_state_store_writable",
                     [({"store": k}, float(k not in failing)) for k in self.stage.write_failures])
