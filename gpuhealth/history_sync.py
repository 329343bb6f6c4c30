"""What ``gpuhealth run`` and a controller's leader write into the incident history.

The weekly report reads it. ``run`` keeps it in ``<data_dir>/history.sqlite``; a
controller pair in its shared PostgreSQL, where only the leader writes (a standby that
takes over writes the same keys again: every write is an upsert, so nothing is doubled).

* **Inventory**: one :class:`~storage.history.InventoryRecord` per GPU seen, from the
  ``gpu_info`` sample's labels (model, driver and VBIOS versions), with first and last
  seen times (``run``), or from the agent registry (a controller: each agent's GPUs at
  its last heartbeat, its ``driver_version`` fact, first seen when the agent first
  reported); written when new or changed, and at least every ``inventory_seconds``.
* **Incidents**: one :class:`~storage.history.IncidentRecord` per incident of the
  remediation engine's action store, upserted while it changes: detected, out of service
  (the first cordon or node drain that succeeded), back in service and resolved (its
  close), the steps carried out, and ``attrs`` the report's remediation section reads:
  ``approval`` (a step waited for a human), ``budget_blocked`` and ``circuit_breaker``
  (a step waited for them), ``dry_run`` (only dry-run steps: the node was never taken
  out, so no out-of-service time and no repair are recorded), ``work`` and
  ``priority_class`` (the jobs or pods on the node when the incident opened, and the
  class of the highest-priority one: the report's interrupted jobs, their GPU-hours and
  MTTR by priority class; :func:`remediation.priority.history_attrs`).
* **Predictions**: every published prediction at or above 0.5 (those that alert).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from core.errors import GpuHealthError
from core.records import ActionPhase, Prediction, Sample
from remediation.actions import INCIDENT_CLOSED, INCIDENT_HUMAN, ActionStore
from remediation.priority import history_attrs
from storage.fleet import AgentRow
from storage.history import (
    IncidentHistory,
    IncidentRecord,
    InventoryRecord,
    PredictionRecord,
    cause_of,
)

logger = logging.getLogger(__name__)


class HistoryRecorder:
    """Keeps the incident history up to date from the service (see the module docstring).

    Args:
        history: The history (a SQLite file, or the controller pair's PostgreSQL).
        inventory_seconds: Re-write every GPU's inventory row at least this often, > 0.
    """

    def __init__(self, history: IncidentHistory, *, inventory_seconds: float = 3600.0) -> None:
        self.history = history
        self.inventory_seconds = inventory_seconds
        self._inventory: dict[tuple[str, str], InventoryRecord] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._inventory_at = float("-inf")
        self._written: dict[str, IncidentRecord] = {}
        self._lock = threading.Lock()

    def observe(self, samples: Iterable[Sample]) -> None:
        """Take samples; ``gpu_info`` ones update the inventory."""
        with self._lock:
            self._observe(samples)

    def _observe(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            if s.metric != "gpu_info" or s.observed_at is None:
                continue
            key = (str(s.node), str(s.entity))
            old = self._inventory.get(key)
            labels = s.labels
            record = InventoryRecord(
                entity=str(s.entity), node=str(s.node), model=labels.get("model", ""),
                driver_version=labels.get("driver_version", ""),
                vbios_version=labels.get("vbios_version", ""),
                slot=labels.get("pci_bus_id", ""),
                first_seen_at=old.first_seen_at if old is not None else s.observed_at,
                last_seen_at=s.observed_at, removed_at=None, source="gpuhealth",
            )
            if old is None or (old.model, old.driver_version, old.vbios_version) != (
                    record.model, record.driver_version, record.vbios_version):
                self._dirty.add(key)
            self._inventory[key] = record

    def observe_agents(self, agents: Iterable[AgentRow]) -> None:
        """Take the agent registry (a controller): each agent's GPUs update the inventory.

        A residency starts when the agent first reported (the registry's, shared by the
        replicas, so a new leader writes the same keys) and lasts to its last heartbeat.
        """
        with self._lock:
            self._observe_agents(agents)

    def _observe_agents(self, agents: Iterable[AgentRow]) -> None:
        for agent in agents:
            for gpu in agent.gpus:
                entity = str(gpu.get("entity", ""))
                if not entity:
                    continue
                key = (str(agent.node), entity)
                old = self._inventory.get(key)
                record = InventoryRecord(
                    entity=entity, node=str(agent.node), model=str(gpu.get("model", "")),
                    driver_version=str(gpu.get("driver_version")
                                       or agent.facts.get("driver_version", "")),
                    vbios_version=str(gpu.get("vbios_version", "")),
                    slot=str(gpu.get("pci_bus_id", "")),
                    first_seen_at=float(agent.first_seen_at),
                    last_seen_at=float(agent.last_heartbeat_at), removed_at=None,
                    source="gpuhealth")
                if old is None or (old.model, old.driver_version, old.vbios_version,
                                   old.first_seen_at) != (
                        record.model, record.driver_version, record.vbios_version,
                        record.first_seen_at):
                    self._dirty.add(key)
                self._inventory[key] = record

    def record_predictions(self, predictions: Iterable[Prediction]) -> None:
        """Write the predictions that alert (probability >= 0.5)."""
        rows = [PredictionRecord(entity=str(p.entity), node=str(p.node), at=p.predicted_at,
                                 probability=p.probability, horizon_seconds=p.horizon_seconds,
                                 top_features=dict(p.top_features))
                for p in predictions if p.probability >= 0.5]
        if rows:
            self._safely(lambda: self.history.record_predictions(rows))

    def sync(self, store: ActionStore, now: float) -> None:
        """Write changed inventory rows and incidents (errors are logged, retried next time)."""
        with self._lock:  # the controller observes on its loop while this runs in a thread
            due = now - self._inventory_at >= self.inventory_seconds
            keys = set(self._inventory) if due else set(self._dirty)
            rows = [self._inventory[k] for k in keys]
        if (keys or due) and self._safely(lambda: self.history.upsert_inventory(rows)):
            with self._lock:
                self._dirty.difference_update(keys)
                self._inventory_at = now
        changed = [r for r in self._incidents(store) if self._written.get(r.incident_id) != r]
        if changed and self._safely(lambda: self.history.upsert_incidents(changed)):
            for record in changed:
                self._written[record.incident_id] = record

    def _incidents(self, store: ActionStore) -> list[IncidentRecord]:
        # A few reads in all, not two per incident (a controller's store holds 10^5), and
        # the actions of an incident written closed are not read again: it cannot change
        # but for its state or note (a human's), which the incidents' read shows.
        incidents = []
        for inc in store.incidents():
            written = self._written.get(f"{inc.node}/{inc.incident}")
            if (written is None or written.resolved_at is None
                    or written.attrs.get("state") != inc.state
                    or written.attrs.get("note", "") != inc.note):
                incidents.append(inc)
        by_incident = store.actions_of([inc.incident for inc in incidents])
        works = store.works()
        out: list[IncidentRecord] = []
        for inc in incidents:
            actions = by_incident.get(inc.incident, [])
            done = tuple(a.step.value for a in actions if a.phase == ActionPhase.SUCCEEDED)
            messages = " ".join(a.message for a in actions)
            attrs: dict[str, str] = {"state": inc.state}
            if any(a.decided_by for a in actions) or "approval" in messages:
                attrs["approval"] = "true"
            if "disruption budget" in messages:
                attrs["budget_blocked"] = "true"
            if "circuit breaker" in messages:
                attrs["circuit_breaker"] = "true"
            if inc.note:
                attrs["note"] = inc.note
            attrs.update(history_attrs(works.get(inc.incident)))
            drill = next((a.attrs["drill"] for a in actions if a.attrs.get("drill")), "")
            if drill:  # a drill's incident (gpuhealth drill --fleet): never a failure
                attrs["drill"] = drill
                attrs["drill_mode"] = "dry-run" if all(a.dry_run for a in actions) else "live"
            closed = inc.state in (INCIDENT_CLOSED, INCIDENT_HUMAN)
            dry = bool(actions) and all(a.dry_run for a in actions)
            if dry:
                # nothing was done to the node: no time out of service, no repair
                attrs["dry_run"] = "true"
            with self._lock:
                gpu = self._inventory.get((inc.node, inc.entity))
            out.append(IncidentRecord(
                incident_id=f"{inc.node}/{inc.incident}", node=inc.node, entity=inc.entity,
                kind=inc.kind, code=inc.code, severity=inc.severity,
                cause=cause_of(inc.kind, inc.code), detected_at=inc.opened_at,
                out_of_service_at=None if dry else inc.out_of_service_at,
                back_in_service_at=(inc.closed_at if closed and inc.out_of_service_at
                                    and not dry else None),
                resolved_at=inc.closed_at if closed else None,
                model=gpu.model if gpu else "", driver_version=gpu.driver_version if gpu else "",
                vbios_version=gpu.vbios_version if gpu else "", slot=gpu.slot if gpu else "",
                actions=done, attrs=attrs,
            ))
        return out

    def _safely(self, write: Callable[[], object]) -> bool:
        try:
            write()
        except (GpuHealthError, OSError) as exc:
            logger.warning("cannot write the incident history %s: %s", self.history.where, exc)
            return False
        return True
