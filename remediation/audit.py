"""The append-only audit log of remediation decisions (JSON Lines).

Each line is one JSON object, one :class:`~core.records.AuditRecord`, with the
keys ``at`` (epoch seconds), ``actor``, ``decision`` (``requested``, ``held``,
``duplicate``, ``resolved``), ``step`` (a remediation step or ``null``), ``node``,
``entity``, ``reason``, ``idempotency_key``, ``dry_run`` and ``details`` (a
string-to-string object). Lines are only ever appended; each write is flushed
and ``fsync``'d before :meth:`AuditLog.append` returns, so a decision that was
logged survives a crash. A missing folder is created.

:class:`AuditStore` keeps the same records in a table of a :mod:`storage.sql` database
instead (the JSON line per row), so that a controller pair on two machines shares one
trail in PostgreSQL; :func:`open_audit` picks the one a target names. Both are
:class:`AuditSink`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from core.records import AuditRecord, EntityId, NodeName, RemediationStep
from storage.sql import Database, PostgresDatabase, SqliteDatabase, is_postgres, open_database

logger = logging.getLogger(__name__)

COMPONENT = "audit"
"""The schema component of :class:`AuditStore` (``storage/migrations/*/NNNN_audit.sql``)."""

WRITER_LOCK = "audit"
"""PostgreSQL advisory transaction lock that every :class:`AuditStore` write takes."""

_POOL_SIZE = 2
"""PostgreSQL connections per :class:`AuditStore`."""


def audit_to_json(record: AuditRecord) -> dict[str, Any]:
    """Return ``record`` as its audit-log JSON object."""
    return {
        "at": record.at,
        "actor": record.actor,
        "decision": record.decision,
        "step": record.step.value if record.step is not None else None,
        "node": record.node,
        "entity": record.entity,
        "reason": record.reason,
        "idempotency_key": record.idempotency_key,
        "dry_run": record.dry_run,
        "details": dict(record.details),
    }


def audit_from_json(obj: dict[str, Any]) -> AuditRecord:
    """Return the record of one audit-log JSON object.

    Raises:
        KeyError: A required key is missing.
        ValueError: ``step`` is not a remediation step.
    """
    step = obj.get("step")
    return AuditRecord(
        at=float(obj["at"]),
        actor=str(obj["actor"]),
        decision=str(obj["decision"]),
        step=RemediationStep(step) if step is not None else None,
        node=NodeName(str(obj["node"])),
        entity=EntityId(str(obj["entity"])),
        reason=str(obj["reason"]),
        idempotency_key=str(obj["idempotency_key"]),
        dry_run=bool(obj["dry_run"]),
        details={str(k): str(v) for k, v in dict(obj.get("details") or {}).items()},
    )


class AuditLog:
    """An append-only JSONL file of :class:`~core.records.AuditRecord`.

    Args:
        path: The file; created (with its folder) on the first append.

    Raises:
        ValueError: ``path`` is empty.
    """

    def __init__(self, *, path: str) -> None:
        if not path:
            raise ValueError("audit log path must not be empty")
        self.path = path

    def create(self) -> None:
        """Create the log (and its folder) if it does not exist yet; never truncate it.

        Raises:
            OSError: The folder or file cannot be created.
        """
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(self.path, "a", encoding="utf-8"):
            pass

    def append(self, record: AuditRecord) -> None:
        """Append one record and ``fsync`` it.

        Raises:
            OSError: The file cannot be written.
        """
        self.extend((record,))

    def extend(self, records: Iterable[AuditRecord]) -> None:
        """Append records in order, one line each, and ``fsync`` once they are all written.

        All or nothing: when the write fails (``ENOSPC``, ``EIO``), what it wrote of them is
        cut off again before the error is raised.

        Raises:
            OSError: The file cannot be written (none of ``records`` is in it).
        """
        lines = [
            json.dumps(audit_to_json(r), sort_keys=True, separators=(",", ":")) + "\n"
            for r in records
        ]
        if not lines:
            return
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        data = "".join(lines).encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:  # unbuffered: nothing is left to be flushed after an error
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                # A full disk may have taken part of the lines: cut them off, so the
                # next append starts on a line of its own and nothing is half-recorded.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def read(self) -> list[AuditRecord]:
        """Return every record in the file, oldest first (empty when there is no file).

        A line that is not a valid record (a write cut short by a crash) is
        skipped with a warning.
        """
        return read_audit_log(self.path)


MAX_RECORD_BYTES = 1 << 20
"""A line of the audit log longer than this (1 MiB; a record is a few hundred bytes) is not
a record: it is skipped with a warning instead of being read whole into memory."""


def read_audit_log(path: str) -> list[AuditRecord]:
    """Return every record of the audit log at ``path``, oldest first; ``[]`` when it is absent.

    A line that is not a valid record (a write cut short by a crash) or is longer than
    :data:`MAX_RECORD_BYTES` is skipped with a warning naming its line.

    Raises:
        ValueError: ``path`` is not a regular file (a device such as ``/dev/full`` reads
            without end).
        OSError: It cannot be read.
    """
    if not os.path.exists(path):
        return []
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path}: the audit log must be a regular file")
    records: list[AuditRecord] = []
    with open(path, "rb") as handle:
        number = 0
        while line := handle.readline(MAX_RECORD_BYTES + 1):
            number += 1
            if len(line) > MAX_RECORD_BYTES:
                while line and not line.endswith(b"\n"):  # the rest of the long line
                    line = handle.readline(MAX_RECORD_BYTES)
                logger.warning("%s:%d: skipping a line of over %d bytes: not an audit record",
                               path, number, MAX_RECORD_BYTES)
                continue
            if not line.strip():
                continue
            try:
                records.append(audit_from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("%s:%d: skipping unreadable audit record: %s", path, number, exc)
    return records


class AuditSink(Protocol):
    """Where audit records go: the JSONL :class:`AuditLog` or the shared :class:`AuditStore`."""

    def create(self) -> None:
        """Make sure the log exists (never truncate it)."""

    def extend(self, records: Iterable[AuditRecord]) -> None:
        """Append records in order, durably, before returning."""

    def read(self) -> list[AuditRecord]:
        """Return every record, oldest first."""


class AuditStore:
    """The audit trail in a table of a :mod:`storage.sql` database, append-only.

    Table ``audit_records`` (``id`` in append order, ``written_at`` epoch seconds,
    ``record`` the JSON line :class:`AuditLog` would write); rows are only inserted. A
    write commits before :meth:`extend` returns, so a decision that was recorded
    survives the controller. On PostgreSQL a controller pair on two machines shares one
    trail: every write takes the advisory transaction lock :data:`WRITER_LOCK` first, so
    ids are committed in order and a reader never sees a later record without the
    earlier ones; the standby that takes over rebuilds the budget and idempotency state
    from the same trail (:meth:`RemediationPolicy.restore`). On SQLite the table lives in
    the file (``BEGIN IMMEDIATE`` gives the same order).

    Args:
        target: A PostgreSQL DSN (``[controller] state``), a SQLite file, ``None`` (SQLite
            in memory), or an open database from :func:`~storage.sql.open_database`
            (shared with other stores), which stays the caller's to close.

    Raises:
        OSError: The SQLite folder cannot be created.
        sqlite3.DatabaseError: The file is not a database.
        PluginError: A PostgreSQL DSN without the controller's extra.
        TemporaryError: The PostgreSQL server cannot be reached.
    """

    def __init__(self, target: str | Path | SqliteDatabase | PostgresDatabase | None) -> None:
        self.db: Database
        if isinstance(target, SqliteDatabase | PostgresDatabase):
            self.path: str | None = None
            self.db, self._owns_db = target, False
        else:
            self.path = None if target is None else str(target)
            self.db, self._owns_db = open_database(target, pool_size=_POOL_SIZE), True
        try:
            self.db.migrate(COMPONENT)
        except BaseException:
            self.close()
            raise

    def create(self) -> None:
        """Nothing to do: the table exists from the migrations (see :class:`AuditSink`)."""

    def append(self, record: AuditRecord) -> None:
        """Append one record.

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached (nothing was written).
        """
        self.extend((record,))

    def extend(self, records: Iterable[AuditRecord]) -> None:
        """Append records in order in one transaction.

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached (nothing was written).
        """
        lines = [json.dumps(audit_to_json(r), sort_keys=True, separators=(",", ":"))
                 for r in records]
        if not lines:
            return
        with self.db.transaction(lock=WRITER_LOCK) as db:
            now = time.time()
            db.executemany("INSERT INTO audit_records (written_at, record) VALUES (?, ?)",
                           [(now, line) for line in lines])

    def read(self) -> list[AuditRecord]:
        """Return every record, oldest first (an unreadable row is skipped with a warning).

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached.
        """
        return self.read_after(0)[0]

    def read_after(self, after: int) -> tuple[list[AuditRecord], int]:
        """Return the records appended after id ``after``, oldest first, and the last id.

        Ids commit in order (see the class), so a reader that passes back the id it got
        sees every record exactly once (a standby keeping its policy warm).

        Returns:
            ``(records, last id read)``; the id is ``after`` when there are none.

        Raises:
            TemporaryError: The PostgreSQL server cannot be reached.
        """
        out: list[AuditRecord] = []
        last = after
        for row_id, text in self.db.execute(
                "SELECT id, record FROM audit_records WHERE id > ? ORDER BY id", (after,)):
            last = int(row_id)
            try:
                out.append(audit_from_json(json.loads(text)))
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("audit_records id %s: skipping unreadable record: %s",
                               row_id, exc)
        return out, last

    def close(self) -> None:
        """Release the connections (unless the database was passed in)."""
        if self._owns_db:
            self.db.close()


SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
"""File name endings that :func:`open_audit` opens as an :class:`AuditStore` in SQLite."""


def open_audit(target: str | Path) -> AuditLog | AuditStore:
    """The audit trail at ``target``.

    Args:
        target: A PostgreSQL DSN (:class:`AuditStore`, shared by a controller pair); a
            SQLite file ending in one of :data:`SQLITE_SUFFIXES` (:class:`AuditStore`);
            any other path, such as ``audit.jsonl``, is the JSONL :class:`AuditLog`.

    Raises:
        ValueError: ``target`` is empty.
        PluginError: A PostgreSQL DSN without the controller's extra.
        TemporaryError: The PostgreSQL server cannot be reached.

    Examples:
        >>> type(open_audit("/var/lib/gpuhealth/audit.jsonl")).__name__
        'AuditLog'
    """
    if is_postgres(target) or str(target).endswith(SQLITE_SUFFIXES):
        return AuditStore(target)
    return AuditLog(path=str(target))
