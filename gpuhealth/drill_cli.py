"""``gpuhealth drill``: a labelled synthetic fault through the real path, every stage timed.

::

    gpuhealth drill --config F [--node N ...] [--kind xid79|xid48|nvlink] [--live]
                    [--slo detect=5s ...] [--timeout 10m] [--id ID] [--json]
    gpuhealth drill --config F --scheduled     # the [drill] schedule, in the foreground
    gpuhealth drill --config CONTROLLER_F --fleet --controller URL --node N
                    (--inject-via CMD | --agent-data-dir DIR) [--kind xid79|xid48] ...
    gpuhealth drill --config AGENT_F --inject-only [--kind K] [--id ID]   # on the node
    gpuhealth drill --config F --clear ID [--live]   # a drill's leftover state

Each drill builds the pipeline ``gpuhealth run`` builds from the same file (the same
fault model, alert policy, remediation guards, scheduler adapter, validation and
bundles), injects the fault (:data:`remediation.drill.FAULTS`) marked as a drill, drives
evaluation and remediation as the service does, and prints one row per stage (seconds
from injection, the SLO, the verdict). Without ``--live`` (and ``[drill] live``) the
steps go to the dry-run adapter: nothing changes on the node. With it they go to the
``[remediation] scheduler``: the node is really cordoned, drained, rebooted or reset,
validated and resumed, with ``gpuhealth: drill <id>:`` reasons; a hand-off to hardware
service is never made (it fails the drill instead).

A drill keeps its own state in ``<data_dir>/drills/<id>/`` (action store, audit log,
outbox, ``result.json``), never the service's, and writes one incident into the incident
history marked ``drill``, so the weekly report lists it under drills, not failures.

A drilled node's probation is the shorter of ``[drill] probation_seconds`` (5 s) and
``[remediation] probation_seconds``. A running drill holds ``drill.lock`` in its folder
(``flock``); SIGTERM, SIGINT or the timeout end its own incident (live: the node is
resumed only while it shows the drill's own reason, :func:`resume_own`), and a folder
whose lock nobody holds is leftover state, cleared by the next drill (logged) or by
``--clear ID``. ``--kind nvlink`` without ``[inventory] nvlink = "expected"`` is
refused, and a drill whose alert led to no step fails: it tested nothing.

Before it starts, a drill is refused (exit 3) when the node opted out
(``[remediation] opt_out_nodes``, or the scheduler shows the opt-out label), when a human
or gpuhealth already took the node out of service, or when the nodes gpuhealth holds out
of service already fill the disruption budget. Exit status: 0 every stage happened
within its SLO; 1 a stage missed its SLO or never happened; 3 refused; 78 a bad
configuration.

Through the fleet (``--fleet``): the drill goes through the deployed path instead of a
pipeline of its own. The marked line is dropped into node ``N``'s running agent's drill
inbox (``<data_dir>/drill-inbox/<id>.line``, :mod:`collectors.drill_inbox`): by
``--inject-via CMD`` (``{node}``, ``{id}``, ``{kind}`` filled in; the command runs
``gpuhealth drill --inject-only`` on the node, over ssh or ``kubectl exec``) or, when the
agent's data folder is writable from here, ``--agent-data-dir DIR``. The agent parses it
with the real kernel-log parser and sends the finding to the controller, which alerts
(``drill=<id>``), remediates (steps marked, no hand-off: :class:`remediation.drill.
FleetDrillAdapter`) and records it as a drill. The stages are timed from the
controller's ``GET /api/v1/alerts`` and ``GET /api/v1/actions``; ``--config`` is the
controller's file (opt-out, budget, scheduler, SLOs); the mode is the controller's. The
same table, ``result.json`` and exit statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from core.errors import ConfigError, GpuHealthError
from remediation.drill import held_from_actions, resume_own

logger = logging.getLogger(__name__)

EXIT_FAILED, EXIT_REFUSED, EXIT_CONFIG = 1, 3, 78

DRILLS_FOLDER = "drills"
"""Folder of the drills' own state inside ``[node] data_dir``."""

LOCK_FILE = "drill.lock"
"""In a drill's folder: locked (``flock``) by the running drill's process, its pid inside.
A folder whose lock nobody holds is a drill's leftover state (:func:`drill_running`)."""

class DrillInterrupted(Exception):
    """A signal (SIGTERM, SIGINT) stopped the drill; it ends its own incidents first."""


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into :class:`DrillInterrupted`.

    Once: a second signal is ignored while the drill cleans up. Off the main thread (a
    scheduled drill) signals are left as they are.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[str] = []

    def handler(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if fired:
            logger.warning("drill: %s ignored, the drill is ending its incidents", name)
            return
        fired.append(name)
        raise DrillInterrupted(name)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def _lock(folder: Path) -> int:
    """Lock ``folder``'s :data:`LOCK_FILE` for this process (pid written); return the fd.

    Raises:
        ConfigError: Another process holds it (a drill of the same id runs).
    """
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"drill {folder.name} is running already ({folder / LOCK_FILE} "
                          "is locked)") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def drill_running(folder: Path) -> bool:
    """Whether a process still runs the drill of ``folder``: it holds :data:`LOCK_FILE`.

    A folder without the file (a drill killed before it made it, or by an older version)
    or whose lock nobody holds is leftover state.
    """
    path = folder / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock taken here
    return False


def clear_leftover(folder: Path, *, why: str) -> list[str]:
    """Close the open incidents of the drill in ``folder``; return the nodes they held.

    For a drill whose process no longer runs (:func:`drill_running`): nothing real is
    undone here (a live drill's node, if still out of service, is for
    ``gpuhealth drill --clear ID --live`` or a person).
    """
    from remediation.actions import INCIDENT_OPEN, INCIDENT_PROBATION, ActionStore
    from remediation.drill import end_incidents

    path = folder / "actions.db"
    if not path.exists():
        return []
    store = ActionStore(str(path))
    try:
        nodes = sorted({str(i.node) for i in store.incidents(
            states=(INCIDENT_OPEN, INCIDENT_PROBATION)) if i.out_of_service_at is not None})
        end_incidents(store, time.time())
    finally:
        store.close()
    if nodes:
        logger.warning("drill %s: leftover state of a process that no longer runs (%s not "
                       "held), %s: its incidents are closed, %s no longer held out of "
                       "service by it", folder.name, LOCK_FILE, why, ", ".join(nodes))
    return nodes


@dataclass(slots=True, kw_only=True)
class DrillOutcome:
    """What one drill did.

    Attributes:
        drill_id: The drill.
        node: The drilled node.
        kind: The fault (``xid79``).
        live: Whether the steps went to the real scheduler adapter.
        refused: Why the drill did not start (opt-out, budget), else ``""``.
        results: One :class:`~remediation.drill.StageResult` per stage, then ``total``.
        problems: What went wrong on the way (a step held back, failed, a hand-off).
        passed: Every stage happened within its SLO and nothing went wrong.
        folder: The drill's own state.
        handed_off: Hand-offs to hardware service the drill did not make.
        interrupted: The signal that stopped the drill (``SIGTERM``), else ``""``.
    """

    drill_id: str
    node: str
    kind: str
    live: bool
    refused: str = ""
    results: list[Any] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    passed: bool = False
    folder: str = ""
    handed_off: int = 0
    interrupted: str = ""

    def to_json(self) -> dict[str, Any]:
        """The outcome as JSON (``result.json``, ``--json``)."""
        from remediation.drill import results_to_json

        return {"drill": self.drill_id, "node": self.node, "kind": self.kind,
                "mode": "live" if self.live else "dry-run", "refused": self.refused or None,
                "passed": self.passed, "stages": results_to_json(self.results),
                "problems": self.problems, "handed_off_not_made": self.handed_off,
                "folder": self.folder, "interrupted": self.interrupted or None}


def _open_store(settings: Any) -> Any:
    """The service's action store (read for the budget), or ``None`` when it has none yet."""
    from remediation.actions import ActionStore
    from storage.sql import is_postgres

    state = settings.controller.state
    if state and is_postgres(str(state)):
        return ActionStore(str(state))
    path = Path(settings.action_store_path)
    return ActionStore(str(path)) if path.exists() else None


def out_of_service(settings: Any) -> dict[str, str]:
    """Nodes gpuhealth holds out of service now (open incidents taken out), by incident.

    Read from the service's action store (``run``'s ``actions.db`` or the controller
    pair's PostgreSQL) and from the drills still running (one whose store cannot be read
    is skipped, with a warning). A drill folder whose :data:`LOCK_FILE` no process holds
    is leftover state: its incidents are closed (:func:`clear_leftover`, logged) and
    hold nothing.

    Raises:
        GpuHealthError, OSError, sqlite3.Error: The service's action store cannot be read
            (a drill is then refused: the budget cannot be known).
    """
    from remediation.actions import ActionStore
    from remediation.drill import held_out_of_service

    held: dict[str, str] = {}
    store = _open_store(settings)
    if store is not None:
        try:
            held_out_of_service(store, held)
        finally:
            store.close()
    folder = Path(settings.node.data_dir) / DRILLS_FOLDER
    for path in sorted(folder.glob("*/actions.db")) if folder.is_dir() else []:
        if not drill_running(path.parent):
            try:
                clear_leftover(path.parent, why="found by a later drill")
            except (GpuHealthError, OSError, sqlite3.Error) as exc:
                logger.warning("cannot clear the leftover drill store %s: %s", path, exc)
            continue
        try:
            drill_store = ActionStore(str(path))
        except (GpuHealthError, OSError, sqlite3.Error) as exc:
            logger.warning("cannot read the drill store %s: %s", path, exc)
            continue
        try:
            held_out_of_service(drill_store, held)
        except (GpuHealthError, OSError, sqlite3.Error) as exc:
            logger.warning("cannot read the drill store %s: %s", path, exc)
        finally:
            drill_store.close()
    return held


async def preflight(settings: Any, node: str, *, adapter: Any, disruption_limit: int) -> str:
    """Why drilling ``node`` now is refused, or ``""`` (:func:`remediation.drill.refusal`)."""
    from remediation.drill import refusal

    if node in settings.remediation.opt_out_nodes:
        return (f"node {node} opted out of automatic remediation ([remediation] "
                "opt_out_nodes): no drill")
    try:
        held = out_of_service(settings)
    except (GpuHealthError, OSError, sqlite3.Error) as exc:
        return (f"the nodes gpuhealth holds out of service cannot be read ({exc}): the "
                "disruption budget is unknown, no drill")
    return await refusal(node, held=held, disruption_limit=disruption_limit, adapter=adapter)


def run_drill(settings: Any, *, node: str, kind: str, live: bool,
              slos: dict[str, float], drill_id: str | None = None,
              timeout_seconds: float | None = None,
              echo: Callable[[str], None] = lambda _: None) -> DrillOutcome:
    """Run one drill on ``node`` (see the module docstring) and return what it did.

    Raises:
        ConfigError: The pipeline or the scheduler adapter cannot be built.
    """
    from gpuhealth.compose import build_notifiers, build_schedulers, guards
    from gpuhealth.config import Settings
    from remediation.drill import (
        FAULTS,
        check_drill_id,
        drill_adapter,
        new_drill_id,
        not_acted_on,
    )
    from remediation.dry_run import DryRunScheduler

    fault = FAULTS[kind]
    drill_id = check_drill_id(drill_id or new_drill_id())
    d = settings.drill
    folder = Path(settings.node.data_dir) / DRILLS_FOLDER / drill_id
    outcome = DrillOutcome(drill_id=drill_id, node=node, kind=kind, live=live,
                           folder=str(folder))
    if live and settings.remediation.scheduler == "dry_run":
        raise ConfigError(f"{settings.source}: a live drill needs a [remediation] scheduler "
                          '("slurm", "kubernetes" or "webhook"); the dry-run adapter changes '
                          "nothing")
    wait = d.timeout_seconds if timeout_seconds is None else timeout_seconds
    probation = min(settings.remediation.probation_seconds, d.probation_seconds)
    if probation >= wait:
        raise ConfigError(f"{settings.source}: the drill's probation ({probation:g} s, the "
                          "shorter of [drill] probation_seconds and [remediation] "
                          f"probation_seconds) is not shorter than its timeout ({wait:g} s): "
                          "its resume stage could never happen; lower [drill] "
                          "probation_seconds or raise the timeout")
    outcome.refused = not_acted_on(fault, settings.inventory)
    if outcome.refused:
        return outcome
    guard = guards(settings, dry_run=not live)
    scheduler, node_agent = build_schedulers(settings, live=live)
    adapter = drill_adapter(scheduler if scheduler is not None else DryRunScheduler(),
                            drill_id)
    agent = drill_adapter(node_agent, drill_id) if node_agent is not None else None
    loop = asyncio.new_event_loop()
    try:
        outcome.refused = loop.run_until_complete(preflight(
            settings, node, adapter=adapter if live else None,
            disruption_limit=guard.disruption_limit))
        if outcome.refused:
            return outcome
        notifiers, pagers = (build_notifiers(settings) if d.notify
                             else build_notifiers(Settings(node=settings.node)))
        folder.mkdir(parents=True, exist_ok=True)
        fd = _lock(folder)
        try:
            with _interruptible():
                return _drive(settings, outcome, loop=loop, fault=fault, guard=guard,
                              adapter=adapter, agent=agent, notifiers=notifiers,
                              pagers=pagers, slos={**d.slo, **slos}, folder=folder,
                              echo=echo, timeout_seconds=wait, probation_seconds=probation)
        finally:
            _unlock(fd)
    finally:
        loop.close()


def _drive(settings: Any, outcome: DrillOutcome, *, loop: asyncio.AbstractEventLoop,
           fault: Any, guard: Any, adapter: Any, agent: Any, notifiers: Sequence[Any],
           pagers: Sequence[Any], slos: dict[str, float], folder: Path,
           echo: Callable[[str], None], timeout_seconds: float,
           probation_seconds: float) -> DrillOutcome:
    from gpuhealth.compose import build_attribution, build_pipeline
    from remediation.drill import (
        DRILL,
        DrillAuditLog,
        DrillTimeline,
        check_acted_on,
        drive,
        end_incidents,
        judge,
        passed,
    )

    drill_id, node = outcome.drill_id, outcome.node
    audit_path = folder / "audit.jsonl"
    pipeline = build_pipeline(
        settings, guard=guard, identity=f"drill:{drill_id}",
        scheduler=adapter.inner if outcome.live else None,
        node_agent=agent.inner if agent is not None else None, notifiers=notifiers,
        pagers=pagers, is_leader=lambda: True,
        facts={"node": settings.node.name, **settings.inventory},
        audit_log_path=str(audit_path), action_store_path=str(folder / "actions.db"),
        outbox_path=str(folder / "outbox.sqlite"),
        event_window_seconds=settings.analytics.event_window_seconds,
        labels={DRILL: drill_id})
    pipeline.remediation.audit = DrillAuditLog(path=str(audit_path), drill_id=drill_id)
    pipeline.engine.scheduler = adapter  # every step marked, no hand-off made
    pipeline.engine.probation_seconds = probation_seconds  # the drill's, not the site's
    if agent is not None:
        pipeline.engine.node_agent = agent
    pipeline.attribution = build_attribution(settings, adapter.inner if outcome.live
                                             else None)
    pipeline.boot_window_seconds = 0.0  # the drill's fault is no boot-time transient
    validating = pipeline.engine.validator is not None
    injected_at = time.time()
    batches = fault.inject(node=node, drill_id=drill_id, folder=folder,
                           bus=settings.drill.pci_bus_id, now=injected_at)
    timeline = DrillTimeline(drill_id=drill_id, node=node, fault=fault,
                             injected_at=injected_at, validating=validating)
    echo(f"drill {drill_id}: {fault.name} on {node} "
         f"({'LIVE' if outcome.live else 'dry-run'}), injected")
    deadline = time.monotonic() + timeout_seconds
    try:
        try:
            drive(pipeline, timeline, batches, loop=loop,
                  evaluate_seconds=settings.drill.evaluate_seconds, deadline=deadline)
        except DrillInterrupted as exc:
            outcome.interrupted = str(exc)
            echo(f"drill {drill_id}: interrupted ({exc}), ending its incident")
        timeline.saw_actions(pipeline.actions.actions())
        stopped = outcome.interrupted or ("" if timeline.finished() else "timed out")
        if outcome.live and stopped and not adapter.handed_off and (
                timeline.notes.get("validate") != "failed"):
            # put back what the drill itself took out; a hand-off's node stays for a person
            echo(loop.run_until_complete(resume_own(
                adapter, node=node, drill_id=drill_id, why=stopped,
                audit=pipeline.remediation.audit)))
        end_incidents(pipeline.actions, time.time())
    finally:
        loop.run_until_complete(pipeline.aclose())
        pipeline.close()
    if not outcome.interrupted:
        check_acted_on(timeline)  # a fault nothing acts on tested nothing: no pass
    results = judge(timeline, slos)
    outcome.results = results
    outcome.problems = list(timeline.problems)
    if outcome.interrupted:
        outcome.problems.append(f"interrupted by {outcome.interrupted}; the drill's "
                                "incident is ended")
    elif time.monotonic() >= deadline and not timeline.finished():
        outcome.problems.append(f"not finished within {timeout_seconds:g} s")
    outcome.passed = passed(results, timeline) and not outcome.problems
    outcome.handed_off = len(adapter.handed_off) if adapter is not None else 0
    (folder / "result.json").write_text(json.dumps(outcome.to_json(), indent=2) + "\n",
                                        encoding="utf-8")
    _record_history(settings, timeline, outcome)
    return outcome


# ------------------------------------------------------------------ through the fleet
FLEET_POLL_SECONDS = 0.2
"""How often ``--fleet`` reads the controller's alerts and actions."""

FLEET_SETTLE_SECONDS = 10.0
"""After the drill's alert fired, how long ``--fleet`` waits for its first step."""


def _inject(inject_via: str | None, agent_data_dir: str | None, *, node: str, kind: str,
            drill_id: str, line: str) -> str:
    """Drop the drill's line into ``node``'s agent inbox; return how (for the log).

    Raises:
        ConfigError: Neither way given, or the injection failed (its output said).
    """
    import shlex
    import subprocess

    from remediation.drill import write_inbox

    fields = {"node": node, "id": drill_id, "kind": kind}
    if agent_data_dir is not None:
        path = write_inbox(Path(agent_data_dir.format(**fields)), line=line,
                           drill_id=drill_id)
        return f"written to {path}"
    if inject_via is None:
        raise ConfigError("--fleet needs --inject-via CMD (e.g. \"ssh {node} gpuhealth drill "
                          "--inject-only --id {id} --kind {kind}\") or --agent-data-dir DIR "
                          "(the agent's [node] data_dir, writable from here)")
    argv = [part.format(**fields) for part in shlex.split(inject_via)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"--inject-via {argv[0]}: {exc}") from exc
    if done.returncode != 0:
        raise ConfigError(f"--inject-via: {shlex.join(argv)} exited {done.returncode}: "
                          f"{(done.stderr or done.stdout).strip()[-500:]}")
    return f"injected by {shlex.join(argv)}"


def run_fleet_drill(settings: Any, *, controller: str, node: str, kind: str,
                    slos: dict[str, float], drill_id: str | None = None,
                    timeout_seconds: float | None = None, inject_via: str | None = None,
                    agent_data_dir: str | None = None, ca_file: str | None = None,
                    echo: Callable[[str], None] = lambda _: None) -> DrillOutcome:
    """Run one drill through the deployed fleet (module docstring, "Through the fleet").

    The fault is dropped into ``node``'s running agent's drill inbox; the stages are
    timed from the controller's ``GET /api/v1/alerts`` and ``GET /api/v1/actions``.

    Raises:
        ConfigError: The fault is not a kernel-log fault, no way to inject, the
            injection failed, or the controller does not answer.
    """
    import httpx

    from gpuhealth.compose import build_schedulers, guards
    from remediation.drill import (
        FAULTS,
        DrillTimeline,
        check_drill_id,
        drill_adapter,
        drill_line,
        judge,
        new_drill_id,
        passed,
        refusal,
        saw_action_rows,
        saw_alert_rows,
    )

    fault = FAULTS[kind]
    drill_id = check_drill_id(drill_id or new_drill_id())
    try:
        line = drill_line(fault, drill_id=drill_id, bus=settings.drill.pci_bus_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    d = settings.drill
    folder = Path(settings.node.data_dir) / DRILLS_FOLDER / drill_id
    live = not settings.remediation.dry_run
    outcome = DrillOutcome(drill_id=drill_id, node=node, kind=kind, live=live,
                           folder=str(folder))
    base = controller.rstrip("/")
    client = httpx.Client(timeout=5.0, verify=ca_file or True)

    def get(path: str) -> Any:
        try:
            answer = client.get(base + path)
            answer.raise_for_status()
            return answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ConfigError(f"--controller {controller}: GET {path}: {exc}") from exc

    try:
        if node in settings.remediation.opt_out_nodes:
            outcome.refused = (f"node {node} opted out of automatic remediation "
                               "([remediation] opt_out_nodes): no drill")
            return outcome
        agents = {str(a.get("node")): a for a in get("/api/v1/agents")}
        if node not in agents:
            outcome.refused = f"node {node} has no agent reporting to {controller}: no drill"
            return outcome
        if agents[node].get("silent"):
            outcome.refused = f"the agent of node {node} is silent: no drill"
            return outcome
        adapter = None
        if live and settings.remediation.scheduler != "dry_run":
            scheduler, _ = build_schedulers(settings, live=True)
            adapter = drill_adapter(scheduler, drill_id) if scheduler is not None else None
        guard = guards(settings)
        held = held_from_actions(get("/api/v1/actions?limit=100000"))
        loop = asyncio.new_event_loop()
        try:
            outcome.refused = loop.run_until_complete(refusal(
                node, held=held, disruption_limit=guard.disruption_limit, adapter=adapter))
        finally:
            loop.close()
        if outcome.refused:
            return outcome
        folder.mkdir(parents=True, exist_ok=True)
        injected_at = time.time()
        how = _inject(inject_via, agent_data_dir, node=node, kind=kind, drill_id=drill_id,
                      line=line)
        echo(f"drill {drill_id}: {fault.name} on {node} through {controller} "
             f"({'LIVE' if live else 'dry-run'}), {how}")
        timeline = DrillTimeline(drill_id=drill_id, node=node, fault=fault,
                                 injected_at=injected_at, validating=False)
        timeline.notes["validate"] = "not visible through the controller's API"
        wait = d.timeout_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + wait
        modes: set[bool] = set()
        while True:
            now = time.time()
            saw_alert_rows(timeline, get("/api/v1/alerts"), at=now)
            actions = [a for a in get("/api/v1/actions?limit=100000")
                       if (a.get("attrs") or {}).get("drill") == drill_id]
            saw_action_rows(timeline, actions)
            modes.update(bool(a.get("dry_run")) for a in actions)
            if "alert" in timeline.at and not actions and (
                    now - timeline.at["alert"] > FLEET_SETTLE_SECONDS):
                timeline.problems.append(
                    f"no remediation step stored for the drill's alert within "
                    f"{FLEET_SETTLE_SECONDS:g} s (held back by the controller: opt-out, "
                    "disruption budget, breaker; see its audit trail)")
            if (timeline.finished() and (actions or timeline.problems)) or (
                    time.monotonic() >= deadline):
                break
            time.sleep(FLEET_POLL_SECONDS)
    finally:
        client.close()
    if modes:
        outcome.live = not all(modes)
    results = judge(timeline, slos={**d.slo, **slos})
    outcome.results = results
    outcome.problems = list(timeline.problems)
    if time.monotonic() >= deadline and not timeline.finished():
        outcome.problems.append(f"not finished within {wait:g} s")
    outcome.passed = passed(results, timeline) and not outcome.problems
    (folder / "result.json").write_text(json.dumps(outcome.to_json(), indent=2) + "\n",
                                        encoding="utf-8")
    return outcome


def clear_drill(settings: Any, drill_id: str, *, live: bool) -> tuple[int, str]:
    """``--clear ID``: clear drill ``drill_id``'s leftover state; return (exit status, text).

    Refused (3) while a process runs the drill (:func:`drill_running`) or when there is
    no such drill. Its open incidents are closed; with ``live`` and a scheduler that can
    show nodes, each node they held is resumed if it is still out of service with the
    drill's own reason (:func:`resume_own`; a person's drain is left alone).
    """
    from remediation.drill import DrillAuditLog, check_drill_id, drill_adapter

    try:
        folder = Path(settings.node.data_dir) / DRILLS_FOLDER / check_drill_id(drill_id)
    except ValueError as exc:
        return EXIT_REFUSED, f"error: {exc}"
    if not folder.is_dir():
        return EXIT_REFUSED, f"no drill {drill_id} in {folder.parent}: nothing to clear"
    if drill_running(folder):
        return EXIT_REFUSED, (f"drill {drill_id} is still running ({folder / LOCK_FILE} is "
                              "locked): stop it (SIGTERM) rather than clear it")
    nodes = clear_leftover(folder, why="cleared by --clear")
    lines = [f"drill {drill_id}: leftover state cleared ({len(nodes)} node(s) no longer "
             f"held by it{': ' + ', '.join(nodes) if nodes else ''})"]
    if live and nodes and settings.remediation.scheduler != "dry_run":
        from gpuhealth.compose import build_schedulers

        scheduler, _ = build_schedulers(settings, live=True)
        if scheduler is not None:
            adapter = drill_adapter(scheduler, drill_id)
            audit = DrillAuditLog(path=str(folder / "audit.jsonl"), drill_id=drill_id)
            loop = asyncio.new_event_loop()
            try:
                for node in nodes:
                    lines.append(loop.run_until_complete(resume_own(
                        adapter, node=node, drill_id=drill_id, why="cleared", audit=audit)))
            finally:
                loop.close()
    return 0, "\n".join(lines)


def _inject_only(settings: Any, *, kind: str, drill_id: str | None) -> tuple[str, Path]:
    """Drop a drill's line into this node's agent inbox (``--inject-only``); return it.

    Raises:
        ConfigError: Not a kernel-log fault.
    """
    from remediation.drill import FAULTS, check_drill_id, drill_line, new_drill_id, write_inbox

    drill_id = check_drill_id(drill_id or new_drill_id())
    try:
        line = drill_line(FAULTS[kind], drill_id=drill_id, bus=settings.drill.pci_bus_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return drill_id, write_inbox(settings.node.data_dir, line=line, drill_id=drill_id)


def _record_history(settings: Any, timeline: Any, outcome: DrillOutcome) -> None:
    """Write the drill's incident into the incident history, marked ``drill``."""
    from remediation.drill import history_attrs
    from storage.history import IncidentHistory, IncidentRecord, cause_of
    from storage.sql import is_postgres

    at = timeline.at
    record = IncidentRecord(
        incident_id=f"{outcome.node}/drill-{outcome.drill_id}", node=outcome.node,
        entity="node", kind=timeline.fault.kind, code=timeline.fault.code or "drill",
        severity="info", cause=cause_of(timeline.fault.kind, timeline.fault.code),
        detected_at=at.get("detect", timeline.injected_at),
        out_of_service_at=(min(v for k, v in at.items() if k in ("cordon", "drain"))
                           if outcome.live and {"cordon", "drain"} & set(at) else None),
        back_in_service_at=at.get("resume") if outcome.live else None,
        resolved_at=max(at.values()) if at else None,
        source="gpuhealth",
        actions=tuple(s for s in ("cordon", "drain", "reboot", "reset_gpu", "resume")
                      if s in at),
        attrs=history_attrs(timeline, outcome.results, live=outcome.live))
    state = settings.controller.state
    target = (str(state) if not settings.report.history and state and is_postgres(str(state))
              else settings.history_path)
    try:
        history = IncidentHistory(target)
    except (GpuHealthError, OSError) as exc:
        logger.warning("the drill is not in the incident history: %s", exc)
        return
    try:
        history.upsert_incidents([record])
    except (GpuHealthError, OSError) as exc:
        logger.warning("the drill is not in the incident history: %s", exc)
    finally:
        history.close()


def _print(outcome: DrillOutcome, as_json: bool) -> None:
    from remediation.drill import render_table

    if as_json:
        click.echo(json.dumps(outcome.to_json(), indent=2))
        if not outcome.passed and not outcome.refused:
            click.echo(f"drill {outcome.drill_id} FAILED on {outcome.node}", err=True)
        return
    mode = "LIVE" if outcome.live else "dry-run"
    if outcome.refused:
        click.echo(f"drill {outcome.drill_id} on {outcome.node} refused: {outcome.refused}",
                   err=True)
        return
    click.echo(f"drill {outcome.drill_id}: {outcome.kind} on {outcome.node} ({mode})")
    click.echo(render_table(outcome.results))
    for problem in outcome.problems:
        click.echo(f"problem: {problem}")
    if outcome.handed_off:
        click.echo(f"hand-offs to hardware service not made (a drill): {outcome.handed_off}")
    verdict = "PASSED" if outcome.passed else "FAILED"
    missed = [r.stage for r in outcome.results if not r.ok]
    click.echo(f"drill {outcome.drill_id} {verdict}"
               + (f": {', '.join(missed)} missed or never happened" if missed else ""))
    if not outcome.passed:
        click.echo(f"drill {outcome.drill_id} FAILED on {outcome.node}: see "
                   f"{outcome.folder}/result.json", err=True)


def _exit_code(outcomes: Sequence[DrillOutcome]) -> int:
    if any(not o.refused and not o.passed for o in outcomes):
        return EXIT_FAILED
    return EXIT_REFUSED if any(o.refused for o in outcomes) else 0


def schedule_drills(settings: Any, scheduler: Any, *,
                    run: Callable[[str], DrillOutcome]) -> Any:
    """Add the ``[drill] schedule`` job to an apscheduler 3.x ``scheduler``; return the job.

    Each firing drills the next node of ``[drill] nodes`` in turn (``[node] name`` when
    empty) with ``run(node)``; one drill at a time (``max_instances=1``), a firing missed
    by more than an hour is skipped.

    Raises:
        ConfigError: No ``[drill] schedule``.
    """
    from apscheduler.triggers.cron import CronTrigger

    d = settings.drill
    if d.schedule is None:
        raise ConfigError(f"{settings.source}: [drill] schedule is not set (drills are not "
                          "scheduled by default)")
    nodes = list(d.nodes) or [settings.node.name]
    turn = {"next": 0}

    def fire() -> None:
        node = nodes[turn["next"] % len(nodes)]
        turn["next"] += 1
        outcome = run(node)
        if outcome.refused:
            logger.warning("scheduled drill on %s refused: %s", node, outcome.refused)
        elif outcome.passed:
            logger.info("scheduled drill %s on %s passed", outcome.drill_id, node)
        else:
            logger.error("scheduled drill %s on %s FAILED: %s", outcome.drill_id, node,
                         "; ".join(outcome.problems) or ", ".join(
                             r.stage for r in outcome.results if not r.ok))

    trigger = CronTrigger.from_crontab(d.schedule, timezone=d.timezone)
    return scheduler.add_job(fire, trigger, id="gpuhealth-drill", max_instances=1,
                             coalesce=True, misfire_grace_time=3600)


@click.command("drill")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="GPUHEALTH_CONFIG", help="TOML settings file (the one `run` uses).")
@click.option("--node", "nodes", multiple=True, help="Node to drill (repeatable; default "
              "[drill] nodes, else [node] name).")
@click.option("--kind", type=click.Choice(["xid79", "xid48", "nvlink"]), default=None,
              help="The fault injected (default [drill] kind, xid79).")
@click.option("--live/--dry-run", "live", default=None, help="Through the real scheduler "
              "adapter (the node is really cordoned, drained, rebooted, resumed), or the "
              "dry-run adapter (nothing changes); default [drill] live, false.")
@click.option("--slo", "slos", multiple=True, metavar="STAGE=DURATION",
              help="SLO of a stage (detect, alert, cordon, drain, reboot, reset, validate, "
                   "resume, total), e.g. detect=5s; over [drill.slo].")
@click.option("--timeout", "timeout", default=None, help="Longest wait for the last stage "
              "(default [drill] timeout_seconds).")
@click.option("--id", "drill_id", default=None, help="The drill's id (default generated).")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.option("--scheduled", is_flag=True, help="Run the [drill] schedule in the foreground.")
@click.option("--fleet", is_flag=True, help="Through the deployed fleet: inject on the "
              "node's running agent, time the stages from --controller's API.")
@click.option("--controller", default=None, metavar="URL",
              help="A controller replica's URL (--fleet).")
@click.option("--inject-via", default=None, metavar="CMD", help="--fleet: the command that "
              "runs `gpuhealth drill --inject-only` on the node ({node}, {id}, {kind} "
              "filled in), e.g. \"ssh {node} gpuhealth drill --inject-only --id {id} "
              "--kind {kind}\".")
@click.option("--agent-data-dir", default=None, metavar="DIR", help="--fleet: the agent's "
              "[node] data_dir, writable from here ({node} filled in); instead of "
              "--inject-via.")
@click.option("--ca-file", default=None, type=click.Path(dir_okay=False),
              help="--fleet: CA bundle of the controller's TLS certificate.")
@click.option("--inject-only", is_flag=True, help="On a node: drop the marked line into "
              "this node's agent drill inbox ([node] data_dir of --config) and exit.")
@click.option("--clear", "clear_id", default=None, metavar="ID", help="Clear the leftover "
              "state of drill ID whose process no longer runs (its incidents closed; with "
              "--live, the node it took out is resumed if it still shows the drill's "
              "reason) and exit.")
def drill(config_path: str | None, nodes: tuple[str, ...], kind: str | None,
          live: bool | None, slos: tuple[str, ...], timeout: str | None,
          drill_id: str | None, as_json: bool, scheduled: bool, fleet: bool,
          controller: str | None, inject_via: str | None, agent_data_dir: str | None,
          ca_file: str | None, inject_only: bool, clear_id: str | None) -> None:
    """Inject a labelled synthetic fault and time every stage against its SLO.

    Prints one row per stage (detect, alert, cordon, drain, reboot or reset, validate,
    resume, total): seconds from injection, the SLO, the verdict. Exit status: 0 every
    stage within its SLO; 1 a stage missed its SLO or never happened; 3 refused (opt-out,
    node already out of service, disruption budget full); 78 a bad configuration.
    """
    from gpuhealth.config import load_settings
    from remediation.drill import duration_seconds, parse_slos

    try:
        settings = load_settings(config_path)
        wanted = parse_slos(slos)
        wait = duration_seconds(timeout) if timeout is not None else None
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    d = settings.drill
    kind = kind or d.kind
    is_live = d.live if live is None else live

    def one(node: str, name: str | None = None) -> DrillOutcome:
        if fleet:
            return run_fleet_drill(settings, controller=str(controller), node=node,
                                   kind=kind, slos=wanted, drill_id=name,
                                   timeout_seconds=wait, inject_via=inject_via,
                                   agent_data_dir=agent_data_dir, ca_file=ca_file,
                                   echo=lambda text: click.echo(text, err=True))
        return run_drill(settings, node=node, kind=kind, live=is_live, slos=wanted,
                         drill_id=name, timeout_seconds=wait,
                         echo=lambda text: click.echo(text, err=True))

    if fleet and not controller:
        raise click.BadParameter("--fleet needs --controller URL", param_hint="--controller")
    if fleet and live is not None:
        raise click.BadParameter("--fleet drills go the controller's way (its [remediation] "
                                 "dry_run); leave out --live/--dry-run", param_hint="--live")
    try:
        if clear_id is not None:
            code, text = clear_drill(settings, clear_id, live=bool(is_live))
            click.echo(text, err=code != 0)
            sys.exit(code)
        if inject_only:
            injected, path = _inject_only(settings, kind=kind, drill_id=drill_id)
            click.echo(f"drill {injected}: {kind} line dropped into {path}")
            return
        if scheduled:
            from apscheduler.schedulers.blocking import BlockingScheduler

            blocking = BlockingScheduler()
            job = schedule_drills(settings, blocking, run=one)
            click.echo(f"drills scheduled ({d.schedule}, {d.timezone}); next at "
                       f"{job.trigger.get_next_fire_time(None, _now(d.timezone))}", err=True)
            with contextlib.suppress(KeyboardInterrupt, SystemExit):
                blocking.start()
            return
        targets = list(nodes) or list(d.nodes) or [settings.node.name]
        outcomes = []
        for i, node in enumerate(targets):
            name = drill_id if drill_id is None or len(targets) == 1 else f"{drill_id}-{i}"
            outcome = one(node, name)
            _print(outcome, as_json)
            outcomes.append(outcome)
            if outcome.interrupted:  # a person stopped it: drill no further node
                break
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    sys.exit(_exit_code(outcomes))


def _now(timezone: str) -> Any:
    import datetime as dt
    from zoneinfo import ZoneInfo

    return dt.datetime.now(ZoneInfo(timezone))
