"""``gpuhealth actions``: list, show, approve, cancel and undo remediation actions.

Works on the action store of the configured data folder (``[remediation] action_store``)
while ``gpuhealth run`` is running: the engine picks approvals, cancellations and
undos up at its next tick. Every human decision is also appended to the audit log
(``actor`` = who).
"""

from __future__ import annotations

import getpass
import json
import sys
import time
from typing import Any

import click

from core.errors import ConfigError, GpuHealthError
from core.records import ActionPhase, AuditRecord, NodeName
from remediation.actions import ActionStore, StoredAction
from remediation.audit import AuditLog, AuditStore, audit_to_json
from remediation.engine import BREAKER, approve, cancel, summarize, undo
from storage.sql import is_postgres

EXIT_CONFIG = 78
_config_option = click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), default=None,
    envvar="GPUHEALTH_CONFIG", help="TOML settings file (names the data folder).")
_by_option = click.option("--by", "who", default=None, help="Who decides (default: $USER).")


def _open(config_path: str | None) -> tuple[ActionStore, AuditLog | AuditStore]:
    from gpuhealth.config import load_settings

    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    if is_postgres(settings.controller.state):  # a controller pair's shared state
        dsn = str(settings.controller.state)
        try:
            return ActionStore(dsn), AuditStore(dsn)
        except GpuHealthError as exc:
            click.echo(f"error: [controller] state: {exc}", err=True)
            sys.exit(1)
    path = settings.action_store_path
    if not path.exists():
        click.echo(f"error: no action store at {path} (has `gpuhealth run` run with this "
                   "configuration?)", err=True)
        sys.exit(1)
    return ActionStore(path), AuditLog(path=str(settings.audit_log_path))


def _line(a: StoredAction) -> str:
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.created_at))
    dry = " (dry-run)" if a.dry_run else ""
    return (f"{a.id:>5}  {when}  {a.phase.value:<17} {a.step.value:<9} {a.node:<20} "
            f"{a.entity:<14} {a.message[:60]}{dry}")


@click.group()
def actions() -> None:
    """List, approve, cancel and undo remediation actions (shared with `run`)."""


@actions.command("list")
@click.option("--phase", type=click.Choice([p.value for p in ActionPhase]), default=None,
              help="Only actions in this phase.")
@click.option("--node", default=None, help="Only actions on this node.")
@click.option("--limit", type=int, default=50, show_default=True, help="Newest N actions.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_config_option
def actions_list(phase: str | None, node: str | None, limit: int, as_json: bool,
                 config_path: str | None) -> None:
    """List actions, oldest first (the newest LIMIT)."""
    store, _ = _open(config_path)
    found = store.actions(phases=[ActionPhase(phase)] if phase else None, node=node,
                          limit=limit)
    if as_json:
        click.echo(json.dumps([a.to_json() for a in found], indent=2))
        return
    click.echo(f"{'ID':>5}  {'CREATED':<20}  {'PHASE':<17} {'STEP':<9} {'NODE':<20} "
               f"{'ENTITY':<14} MESSAGE")
    for a in found:
        click.echo(_line(a))
    counts = summarize(found)
    click.echo(", ".join(f"{n} {p}" for p, n in sorted(counts.items())) or "no actions")
    breaker = store.control(BREAKER)
    if breaker is not None and breaker[0] == "open":
        click.echo(f"CIRCUIT BREAKER OPEN: {breaker[3]} (reset: gpuhealth actions breaker "
                   "reset)")


@actions.command("show")
@click.argument("action_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_config_option
def actions_show(action_id: int, as_json: bool, config_path: str | None) -> None:
    """Show one action and its incident."""
    store, _ = _open(config_path)
    action = store.get(action_id)
    if action is None:
        click.echo(f"error: no action {action_id}", err=True)
        sys.exit(1)
    incident = store.incident(action.incident)
    body: dict[str, Any] = action.to_json()
    if incident is not None:
        body["incident_state"] = incident.state
        body["incident_note"] = incident.note
        body["probation_until"] = incident.probation_until
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    for key, value in body.items():
        click.echo(f"{key:>16}: {value}")


@actions.command("audit")
@click.option("--node", default=None, help="Only records about this node.")
@click.option("--decision", default=None,
              help="Only this decision (requested, held, duplicate, resolved, submitted, "
                   "succeeded, failed, escalated, marked_healthy...).")
@click.option("--limit", type=int, default=50, show_default=True, help="Newest N records.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@_config_option
def actions_audit(node: str | None, decision: str | None, limit: int, as_json: bool,
                  config_path: str | None) -> None:
    """Show the audit trail: every decision taken or held back, and why (oldest first).

    Reads the JSONL audit log of `run`, or a controller pair's trail in PostgreSQL
    (`[controller] state`).
    """
    _, audit = _open(config_path)
    records = [r for r in audit.read()
               if (node is None or r.node == node)
               and (decision is None or r.decision == decision)]
    records = records[-limit:] if limit > 0 else records
    for r in records:
        if as_json:
            click.echo(json.dumps(audit_to_json(r), sort_keys=True))
            continue
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.at))
        step = r.step.value if r.step is not None else "-"
        dry = " (dry-run)" if r.dry_run else ""
        click.echo(f"{when}  {r.decision:<15} {step:<9} {r.node:<20} {r.entity:<14} "
                   f"{r.actor}: {r.reason[:90]}{dry}")
    if not records and not as_json:
        click.echo("no audit records")


def _decide(config_path: str | None, action_id: int, who: str | None, verb: str) -> None:
    store, audit = _open(config_path)
    who = who or getpass.getuser()
    now = time.time()
    fn = {"approve": approve, "cancel": cancel, "undo": undo}[verb]
    try:
        done = fn(store, action_id, who=who, now=now)
    except KeyError as exc:
        click.echo(f"error: {exc.args[0]}", err=True)
        sys.exit(1)
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    audit.append(AuditRecord(
        at=now, actor=who, decision=f"human_{verb}", step=done.step, node=done.node,
        entity=done.request().entity, reason=f"{verb} of action {action_id} by {who}",
        idempotency_key=done.key, dry_run=done.dry_run,
        details={"action_id": str(action_id), "incident": done.incident},
    ))
    click.echo(_line(done))
    if verb in ("approve", "undo"):
        click.echo("recorded: the controller (`gpuhealth run`, the leader) carries it out at "
                   "its next tick; nothing happens while none runs", err=True)


@actions.command("approve")
@click.argument("action_id", type=int)
@_by_option
@_config_option
def actions_approve(action_id: int, who: str | None, config_path: str | None) -> None:
    """Approve an action that waits for approval."""
    _decide(config_path, action_id, who, "approve")


@actions.command("cancel")
@click.argument("action_id", type=int)
@_by_option
@_config_option
def actions_cancel(action_id: int, who: str | None, config_path: str | None) -> None:
    """Cancel an action not yet started (the incident's later steps are cancelled too)."""
    _decide(config_path, action_id, who, "cancel")


@actions.command("undo")
@click.argument("action_id", type=int)
@_by_option
@_config_option
def actions_undo(action_id: int, who: str | None, config_path: str | None) -> None:
    """Undo a succeeded cordon, drain or hand-off: resume the node (only what gpuhealth did)."""
    _decide(config_path, action_id, who, "undo")


@actions.command("breaker")
@click.argument("what", type=click.Choice(["status", "reset"]), default="status")
@_by_option
@_config_option
def actions_breaker(what: str, who: str | None, config_path: str | None) -> None:
    """Show or reset the circuit breaker."""
    store, audit = _open(config_path)
    state = store.control(BREAKER)
    if what == "status":
        if state is None:
            click.echo("closed (never opened)")
        else:
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state[1]))
            click.echo(f"{state[0]} since {since} by {state[2]}: {state[3]}")
        return
    who = who or getpass.getuser()
    now = time.time()
    store.set_control(BREAKER, "closed", at=now, who=who, why=f"reset by {who}")
    audit.append(AuditRecord(
        at=now, actor=who, decision="breaker_reset", step=None, node=NodeName("*"),
        entity="node",  # type: ignore[arg-type]
        reason=f"circuit breaker reset by {who}", idempotency_key=f"breaker/{now:.3f}",
        dry_run=False,
    ))
    click.echo(f"circuit breaker closed by {who}")
