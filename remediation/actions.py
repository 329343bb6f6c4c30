"""The durable action store: every remediation action, its phase and its incident's state.

One database shared by the controller that acts, its standby (which resumes from it
after a fail-over) and ``gpuhealth actions``: a SQLite file (WAL) for ``run``, PostgreSQL
for a controller pair on two machines (:mod:`storage.sql`) (which lists, approves, cancels
and undoes actions in it while ``gpuhealth run`` is running). Rows are keyed by the
action's idempotency key, so adding the same request twice stores it once.

Tables:

* ``actions``: one row per :class:`~core.records.ActionRequest` with its
  :class:`~core.records.ActionPhase`, the adapter's ref, timestamps (epoch seconds)
  and the last status message;
* ``incidents``: one row per incident prefix (``<fingerprint>`` or
  ``<fingerprint>.<n>``): node, severity, whether gpuhealth holds the node out of
  service, the probation deadline after a fix, and how it ended;
* ``control``: the circuit breaker (open or closed, why, who reset it).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from core.records import ActionPhase, ActionRequest, EntityId, NodeName, RemediationStep
from storage.sql import Connection, Database, open_database

TERMINAL = frozenset({ActionPhase.SUCCEEDED, ActionPhase.FAILED, ActionPhase.CANCELLED})
"""Phases an action never leaves."""

LIVE_PHASES = (ActionPhase.PENDING, ActionPhase.RUNNING, ActionPhase.AWAITING_APPROVAL)
"""Phases of an action the engine still works on (every other phase is :data:`TERMINAL`)."""

WRITER_LOCK = "actions"
"""PostgreSQL advisory transaction lock that every write to the store takes."""

_POOL_SIZE = 2
"""PostgreSQL connections per store (the engine and the API are its only callers)."""

INCIDENT_OPEN = "open"
"""Steps are being carried out (or wait for approval, the budget, the breaker)."""
INCIDENT_PROBATION = "probation"
"""The fix succeeded; the node is watched for a recurrence until ``probation_until``."""
INCIDENT_CLOSED = "closed"
"""Resumed after probation, resolved, or handed off and later resolved."""
INCIDENT_HUMAN = "human"
"""A human changed the node meanwhile; gpuhealth stopped and undoes nothing."""

WORK_PREFIX = "work:"
"""``control`` row names of the work each incident's node held (:meth:`ActionStore.set_work`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredAction:
    """One row of ``actions``.

    Attributes:
        id: Row id, what ``gpuhealth actions show|approve|cancel|undo`` take.
        key: The idempotency key (``<incident>/<step>``).
        incident: The incident prefix (``<fingerprint>`` or ``<fingerprint>.<n>``).
        phase: Where the action stands; terminal phases are in :data:`TERMINAL`.
        ref: The adapter's handle once submitted, else ``""``.
        adapter: Name of the adapter that carries it out.
        message: The last status or the reason it waits, failed or was cancelled.
        created_at, started_at, finished_at, updated_at: Epoch seconds.
        epoch: Identity of the controller that submitted it (a new leader re-submits).
    """

    id: int
    key: str
    incident: str
    fingerprint: str
    node: NodeName
    entity: str
    step: RemediationStep
    reason: str
    attrs: dict[str, str]
    dry_run: bool
    severity: str
    phase: ActionPhase
    ref: str = ""
    adapter: str = ""
    message: str = ""
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    updated_at: float = 0.0
    not_before: float | None = None
    decided_by: str = ""
    epoch: str = ""

    def request(self) -> ActionRequest:
        """Return the :class:`ActionRequest` this row stores."""
        return ActionRequest(
            step=self.step,
            node=self.node,
            entity=EntityId(self.entity),
            reason=self.reason,
            idempotency_key=self.key,
            dry_run=self.dry_run,
            not_before_at=self.not_before,
            attrs=dict(self.attrs),
        )

    def to_json(self) -> dict[str, object]:
        """Return the row as plain JSON values (``gpuhealth actions list --json``)."""
        return {
            "id": self.id,
            "key": self.key,
            "incident": self.incident,
            "node": self.node,
            "entity": self.entity,
            "step": self.step.value,
            "phase": self.phase.value,
            "severity": self.severity,
            "dry_run": self.dry_run,
            "reason": self.reason,
            "attrs": self.attrs,
            "ref": self.ref,
            "adapter": self.adapter,
            "message": self.message,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "decided_by": self.decided_by,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredIncident:
    """One row of ``incidents`` (see the module docstring)."""

    incident: str
    fingerprint: str
    node: NodeName
    entity: str
    kind: str
    code: str
    severity: str
    state: str
    opened_at: float
    out_of_service_at: float | None = None
    fixed_at: float | None = None
    probation_until: float | None = None
    closed_at: float | None = None
    claimed: bool = True
    note: str = ""
    extra: dict[str, str] = field(default_factory=dict)


class IncidentMark(NamedTuple):
    """What placement weighs of an incident (:func:`remediation.placement.reliability_scores`)."""

    node: str
    severity: str
    opened_at: float
    """Epoch seconds."""


_ACTION_COLUMNS = (
    "id, key, incident, fingerprint, node, entity, step, reason, attrs, dry_run, severity, "
    "phase, ref, adapter, message, created_at, started_at, finished_at, updated_at, "
    "not_before, decided_by, epoch"
)
_INCIDENT_COLUMNS = (
    "incident, fingerprint, node, entity, kind, code, severity, state, opened_at, "
    "out_of_service_at, fixed_at, probation_until, closed_at, claimed, note"
)
_INSERT_ACTION = (
    "INSERT INTO actions (key, incident, fingerprint, node, entity, step, reason, attrs, "
    "dry_run, severity, phase, message, created_at, updated_at, not_before) "
    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (key) DO NOTHING"
)


@dataclass(frozen=True, slots=True)
class NewAction:
    """One request to store with :meth:`ActionStore.add_many` (the arguments of ``add``)."""

    request: ActionRequest
    incident: str
    fingerprint: str
    severity: str
    phase: ActionPhase
    message: str = ""


_PER_READ = 500
"""Names per ``IN (...)`` read (SQLite and PostgreSQL bound the parameters of one)."""

_UPDATABLE = frozenset({"ref", "adapter", "message", "started_at", "finished_at",
                        "decided_by", "epoch"})


def _update_statement(now: float, phase: ActionPhase | None,
                      expect: Sequence[ActionPhase] | None, fields: Mapping[str, object]
                      ) -> tuple[str, list[object], list[object]]:
    """``UPDATE ... WHERE id = ?``: the SQL, the arguments before the id and after it."""
    bad = set(fields) - _UPDATABLE
    if bad:
        raise ValueError(f"cannot update action columns {sorted(bad)}")
    sets = ["updated_at = ?"]
    head: list[object] = [now]
    if phase is not None:
        sets.append("phase = ?")
        head.append(phase.value)
    for name, value in fields.items():
        sets.append(f"{name} = ?")
        head.append(value)
    sql = f"UPDATE actions SET {', '.join(sets)} WHERE id = ?"
    tail: list[object] = []
    if expect is not None:
        sql += f" AND phase IN ({','.join('?' * len(expect))})"
        tail.extend(p.value for p in expect)
    return sql, head, tail


def _action_args(request: ActionRequest, incident: str, fingerprint: str, severity: str,
                 phase: ActionPhase, now: float, message: str) -> tuple[object, ...]:
    return (request.idempotency_key, incident, fingerprint, request.node, request.entity,
            request.step.value, request.reason, json.dumps(dict(request.attrs), sort_keys=True),
            int(request.dry_run), severity, phase.value, message, now, now,
            request.not_before_at)


def _action(row: Any) -> StoredAction:
    (id_, key, incident, fp, node, entity, step, reason, attrs, dry_run, severity, phase,
     ref, adapter, message, created, started, finished, updated, not_before, decided_by,
     epoch) = tuple(row)
    return StoredAction(
        id=int(id_),
        key=str(key),
        incident=str(incident),
        fingerprint=str(fp),
        node=NodeName(str(node)),
        entity=str(entity),
        step=RemediationStep(str(step)),
        reason=str(reason),
        attrs=json.loads(str(attrs)),
        dry_run=bool(dry_run),
        severity=str(severity),
        phase=ActionPhase(str(phase)),
        ref=str(ref),
        adapter=str(adapter),
        message=str(message),
        created_at=float(created),
        started_at=None if started is None else float(started),
        finished_at=None if finished is None else float(finished),
        updated_at=float(updated),
        not_before=None if not_before is None else float(not_before),
        decided_by=str(decided_by),
        epoch=str(epoch),
    )


def _incident(row: Any) -> StoredIncident:
    (incident, fp, node, entity, kind, code, severity, state, opened, oos, fixed, probation,
     closed, claimed, note) = tuple(row)

    def opt(v: Any) -> float | None:
        return None if v is None else float(v)

    return StoredIncident(
        incident=str(incident),
        fingerprint=str(fp),
        node=NodeName(str(node)),
        entity=str(entity),
        kind=str(kind),
        code=str(code),
        severity=str(severity),
        state=str(state),
        opened_at=float(opened),
        out_of_service_at=opt(oos),
        fixed_at=opt(fixed),
        probation_until=opt(probation),
        closed_at=opt(closed),
        claimed=bool(claimed),
        note=str(note),
    )


class ActionStore:
    """The action store (see the module docstring) on SQLite or PostgreSQL.

    The schema is ``storage/migrations/sqlite/NNNN_actions.sql`` or the shared
    ``storage/migrations/postgres`` (:mod:`storage.sql`), applied once at open. Writes
    are one transaction each with one writer at a time, across every process sharing
    the store: ``BEGIN IMMEDIATE`` on SQLite, the advisory transaction lock ``actions``
    on PostgreSQL. The single-row guarantees also hold row by row on PostgreSQL:
    :meth:`add` is ``INSERT ... ON CONFLICT (key) DO NOTHING`` on the unique key, and
    :meth:`update` with ``expect`` is one ``UPDATE ... WHERE phase IN (...)``, whose
    condition PostgreSQL re-checks on the locked row after a concurrent writer commits,
    so of a human's cancel and the engine's submit exactly one wins.

    Args:
        path: The SQLite file (created with its folder), ``None`` for an in-memory store
            (tests, replay), or a PostgreSQL DSN (``postgresql://...`` or libpq keywords;
            a controller pair and ``gpuhealth actions`` share it).

    Raises:
        OSError: The folder cannot be created.
        sqlite3.DatabaseError: The file is not an action store.
        PluginError: A PostgreSQL DSN without the controller's extra.
        TemporaryError: The PostgreSQL server cannot be reached.
    """

    def __init__(self, path: str | Path | None) -> None:
        self.db: Database = open_database(path, pool_size=_POOL_SIZE,
                                          sqlite_synchronous="NORMAL")
        self.path: Path | None = (
            Path(path) if self.db.dialect == "sqlite" and path is not None else None)
        try:
            self.db.migrate("actions")
        except BaseException:
            self.db.close()
            raise
        self._lock = threading.RLock()
        self._open = threading.local()

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self.db.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """Run statements in one write transaction (one writer at a time, all processes).

        Nested in another transaction of this store on the same thread, it joins it: the
        engine stores a burst of decisions (an incident and an action each) in one
        commit, not two round trips to PostgreSQL per decision.
        """
        current: Connection | None = getattr(self._open, "db", None)
        if current is not None:
            yield current
            return
        with self._lock, self.db.transaction(lock=WRITER_LOCK) as db:
            self._open.db = db
            try:
                yield db
            finally:
                self._open.db = None

    def _rows(self, sql: str, args: Sequence[object] = ()) -> list[Any]:
        current: Connection | None = getattr(self._open, "db", None)
        with self._lock:
            if current is not None:  # inside a transaction: see its own writes
                return list(current.execute(sql, args).fetchall())
            return self.db.execute(sql, args)

    def _row(self, sql: str, args: Sequence[object] = ()) -> Any:
        rows = self._rows(sql, args)
        return rows[0] if rows else None

    # -- actions -------------------------------------------------------------------

    def add(
        self,
        request: ActionRequest,
        *,
        incident: str,
        fingerprint: str,
        severity: str,
        phase: ActionPhase,
        now: float,
        message: str = "",
    ) -> StoredAction | None:
        """Store ``request`` unless its key is stored already; return the new row or ``None``."""
        with self.transaction() as db:
            row = db.execute(
                _INSERT_ACTION + f" RETURNING {_ACTION_COLUMNS}",
                _action_args(request, incident, fingerprint, severity, phase, now, message),
            ).fetchone()
        return None if row is None else _action(row)

    def add_many(self, actions: Sequence[NewAction], *, now: float) -> int:
        """Store each request unless its key is stored already (one round trip for all).

        For a burst of decisions whose rows the caller does not need back (:meth:`add`
        returns the row).

        Returns:
            How many were stored.
        """
        if not actions:
            return 0
        with self.transaction() as db:
            return db.executemany(_INSERT_ACTION, [
                _action_args(a.request, a.incident, a.fingerprint, a.severity, a.phase, now,
                             a.message) for a in actions])

    def get(self, action_id: int) -> StoredAction | None:
        """Return the action with row id ``action_id``, or ``None``."""
        row = self._row(f"SELECT {_ACTION_COLUMNS} FROM actions WHERE id = ?", (action_id,))
        return None if row is None else _action(row)

    def by_key(self, key: str) -> StoredAction | None:
        """Return the action with idempotency key ``key``, or ``None``."""
        row = self._row(f"SELECT {_ACTION_COLUMNS} FROM actions WHERE key = ?", (key,))
        return None if row is None else _action(row)

    def actions(
        self,
        *,
        phases: Sequence[ActionPhase] | None = None,
        incident: str | None = None,
        node: str | None = None,
        limit: int | None = None,
        incident_states: Sequence[str] | None = None,
        incident_phases: Sequence[ActionPhase] | None = None,
    ) -> list[StoredAction]:
        """Return actions in the order they were stored, filtered by phase, incident, node.

        ``incident_states`` keeps the actions of incidents in those states, and
        ``incident_phases`` those of incidents with an action in one of those phases (one
        query for every open incident's actions, not one per incident).
        """
        where: list[str] = []
        args: list[object] = []
        if incident_phases is not None:
            where.append("incident IN (SELECT incident FROM actions WHERE phase IN "
                         f"({','.join('?' * len(incident_phases))}))")
            args.extend(p.value for p in incident_phases)
        if incident_states is not None:
            where.append("incident IN (SELECT incident FROM incidents WHERE state IN "
                         f"({','.join('?' * len(incident_states))}))")
            args.extend(incident_states)
        if phases is not None:
            where.append(f"phase IN ({','.join('?' * len(phases))})")
            args.extend(p.value for p in phases)
        if incident is not None:
            where.append("incident = ?")
            args.append(incident)
        if node is not None:
            where.append("node = ?")
            args.append(node)
        sql = f"SELECT {_ACTION_COLUMNS} FROM actions"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id"
        out = [_action(r) for r in self._rows(sql, args)]
        return out[-limit:] if limit is not None and limit > 0 else out

    def actions_of(self, incidents: Sequence[str]) -> dict[str, list[StoredAction]]:
        """Every action of each of ``incidents``, in stored order (a read per 500 named)."""
        out: dict[str, list[StoredAction]] = {}
        keys = list(dict.fromkeys(incidents))
        for at in range(0, len(keys), _PER_READ):
            part = keys[at:at + _PER_READ]
            for row in self._rows(f"SELECT {_ACTION_COLUMNS} FROM actions WHERE incident IN "
                                  f"({','.join('?' * len(part))}) ORDER BY id", part):
                action = _action(row)
                out.setdefault(action.incident, []).append(action)
        return out

    def update(
        self,
        action_id: int,
        *,
        now: float,
        phase: ActionPhase | None = None,
        expect: Sequence[ActionPhase] | None = None,
        **fields: object,
    ) -> bool:
        """Change an action's phase and fields; return whether it changed.

        Args:
            action_id: The action's row id.
            now: Epoch seconds, stored as ``updated_at``.
            phase: The new phase, or ``None`` to keep it.
            expect: Change only if the action is in one of these phases now (compare
                and set: a human's cancel and the engine's submit cannot both win).
            fields: Columns to set (``ref``, ``adapter``, ``message``, ``started_at``,
                ``finished_at``, ``decided_by``, ``epoch``).
        """
        sql, head, tail = _update_statement(now, phase, expect, fields)
        with self.transaction() as db:
            return db.execute(sql, [*head, action_id, *tail]).rowcount > 0

    def update_many(
        self,
        action_ids: Sequence[int],
        *,
        now: float,
        phase: ActionPhase | None = None,
        expect: Sequence[ActionPhase] | None = None,
        **fields: object,
    ) -> int:
        """:meth:`update` each of ``action_ids`` alike, in one round trip.

        A burst's ``notify`` steps succeed together. Returns how many changed.

        Raises:
            ValueError: A column in ``fields`` cannot be updated.
        """
        sql, head, tail = _update_statement(now, phase, expect, fields)
        if not action_ids:
            return 0
        with self.transaction() as db:
            return db.executemany(sql, [(*head, i, *tail) for i in action_ids])

    # -- incidents -----------------------------------------------------------------

    def open_incident(self, incident: StoredIncident) -> bool:
        """Store a new incident; return ``False`` if it is stored already."""
        return self.open_incidents([incident]) > 0

    def open_incidents(self, incidents: Sequence[StoredIncident]) -> int:
        """Store the new ones of ``incidents`` (one round trip); return how many were new."""
        if not incidents:
            return 0
        with self.transaction() as db:
            return db.executemany(
                f"INSERT INTO incidents ({_INCIDENT_COLUMNS}) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (incident) DO NOTHING",
                [(i.incident, i.fingerprint, i.node, i.entity, i.kind, i.code, i.severity,
                  i.state, i.opened_at, i.out_of_service_at, i.fixed_at, i.probation_until,
                  i.closed_at, int(i.claimed), i.note) for i in incidents])

    def incident(self, incident: str) -> StoredIncident | None:
        """Return the incident ``incident``, or ``None``."""
        row = self._row(f"SELECT {_INCIDENT_COLUMNS} FROM incidents WHERE incident = ?",
                        (incident,))
        return None if row is None else _incident(row)

    def incidents(self, *, states: Sequence[str] | None = None) -> list[StoredIncident]:
        """Return incidents in the order they opened, filtered by state."""
        sql = f"SELECT {_INCIDENT_COLUMNS} FROM incidents"
        args: list[object] = []
        if states is not None:
            sql += f" WHERE state IN ({','.join('?' * len(states))})"
            args.extend(states)
        return [_incident(r) for r in self._rows(sql + " ORDER BY opened_at, incident", args)]

    def incident_marks(self) -> list[IncidentMark]:
        """Node, severity and opening time of every incident (placement's whole input).

        Three columns instead of :meth:`incidents`' fifteen: a fleet's history is 10^5
        incidents, read every placement interval.
        """
        return [IncidentMark(str(r[0]), str(r[1]), float(r[2]))
                for r in self._rows("SELECT node, severity, opened_at FROM incidents")]

    def incident_counts(self, *, states: Sequence[str]) -> dict[tuple[str, str], int]:
        """How many incidents are in each of ``states``: ``{(severity, state): count}``.

        One aggregate read (the metrics' open incidents; a fleet has thousands).
        """
        rows = self._rows("SELECT severity, state, count(*) FROM incidents WHERE state IN "
                          f"({','.join('?' * len(states))}) GROUP BY severity, state",
                          list(states))
        return {(str(r[0]), str(r[1])): int(r[2]) for r in rows}

    def incidents_named(self, incidents: Sequence[str]) -> list[StoredIncident]:
        """The stored ones of ``incidents`` (a read per 500 named), in no set order."""
        keys = list(dict.fromkeys(incidents))
        out: list[StoredIncident] = []
        for at in range(0, len(keys), _PER_READ):
            part = keys[at:at + _PER_READ]
            out.extend(_incident(r) for r in self._rows(
                f"SELECT {_INCIDENT_COLUMNS} FROM incidents WHERE incident IN "
                f"({','.join('?' * len(part))})", part))
        return out

    def update_incident(self, incident: str, **fields: object) -> None:
        """Set columns of an incident.

        Columns: ``state``, ``out_of_service_at``, ``fixed_at``, ``probation_until``,
        ``closed_at``, ``claimed``, ``note``.

        Raises:
            ValueError: Another column is named.
        """
        self.update_incidents([incident], **fields)

    def update_incidents(self, incidents: Sequence[str], **fields: object) -> None:
        """Set the same columns of each of ``incidents`` (one round trip; see above)."""
        allowed = {
            "state", "out_of_service_at", "fixed_at", "probation_until", "closed_at",
            "claimed", "note",
        }
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update incident columns {sorted(bad)}")
        if not fields or not incidents:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction() as db:
            db.executemany(f"UPDATE incidents SET {sets} WHERE incident = ?",
                           [(*fields.values(), i) for i in incidents])

    # -- work held by an incident's node ------------------------------------------------

    def set_work(self, incident: str, work: str, *, at: float, who: str) -> None:
        """Keep the work that held ``incident``'s node when it opened (JSON list).

        ``work`` is :func:`remediation.priority.work_to_json`'s output. Kept in the
        ``control`` table under ``work:<incident>`` (one row per incident; written again,
        it replaces), so no schema change is needed.
        """
        self.set_control(f"{WORK_PREFIX}{incident}", work, at=at, who=who,
                         why="work on the node when the incident opened")

    def work(self, incident: str) -> str | None:
        """The work :meth:`set_work` kept for ``incident`` (JSON), or ``None`` if not asked."""
        state = self.control(f"{WORK_PREFIX}{incident}")
        return None if state is None else state[0]

    def works(self) -> dict[str, str]:
        """Every incident's work :meth:`set_work` kept: ``{incident: JSON}``, in one read."""
        return {name[len(WORK_PREFIX):]: value
                for name, value, _, _, _ in self.controls(WORK_PREFIX)}

    # -- control -------------------------------------------------------------------

    def control(self, name: str) -> tuple[str, float, str, str] | None:
        """Return ``(value, at, who, why)`` of a control flag, or ``None``."""
        row = self._row("SELECT value, at, who, why FROM control WHERE name = ?", (name,))
        return None if row is None else (str(row[0]), float(row[1]), str(row[2]), str(row[3]))

    def controls(self, prefix: str) -> list[tuple[str, str, float, str, str]]:
        """Return ``(name, value, at, who, why)`` of the control rows named ``prefix...``."""
        rows = self._rows("SELECT name, value, at, who, why FROM control "
                          "WHERE substr(name, 1, ?) = ? ORDER BY at, name",
                          (len(prefix), prefix))
        return [(str(r[0]), str(r[1]), float(r[2]), str(r[3]), str(r[4])) for r in rows]

    def set_control(self, name: str, value: str, *, at: float, who: str, why: str) -> None:
        """Set a control flag (the circuit breaker: ``breaker`` = ``open`` | ``closed``)."""
        with self.transaction() as db:
            db.execute(
                "INSERT INTO control (name, value, at, who, why) VALUES (?,?,?,?,?) "
                "ON CONFLICT(name) DO UPDATE SET value=excluded.value, at=excluded.at, "
                "who=excluded.who, why=excluded.why",
                (name, value, at, who, why),
            )
