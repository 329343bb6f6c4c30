"""The journal of accepted inputs: what the service was told survives a restart.

The fault model's own inputs come back by themselves after a restart (NVML is polled
again, the kernel log is read again); what was *given* to the service does not: an
artifact posted to ``/api/v1/ingest``, a finding of an online detector, an alert of the
site's Alertmanager. Each is written here before it is applied, and
:meth:`InputJournal.ingests` / :meth:`InputJournal.held` give it back at start, so a
SIGTERM, a ``kill -9`` or a standby taking over on the same store loses nothing accepted.

- ``journal_ingests``: each accepted artifact as it came (node, file name, facts, raw
  bytes), read again at start with its original acceptance time, so its events expire
  from the event window as they would have; pruned once older than the window, and
  bounded to :data:`MAX_INGEST_BYTES` in all (the oldest go first, logged).
- ``journal_held``: the open held findings (``(node, entity, kind, code)``, until when,
  where from), deleted when they clear.

SQLite in the data folder for ``run`` (``journal.sqlite``), the shared PostgreSQL for a
controller pair (:mod:`storage.sql`; schema ``storage/migrations/*/NNNN_journal.sql``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.codec import CodecError, finding_from_json, finding_to_json
from core.records import Finding
from storage.sql import Database, open_database

logger = logging.getLogger(__name__)

COMPONENT = "journal"
"""The schema component (``storage/migrations/sqlite/NNNN_journal.sql``)."""

MAX_INGEST_BYTES = 256 * 1024 * 1024
"""Artifact bytes kept in all; beyond, the oldest are dropped (and logged)."""

Key = tuple[str, str, str, str]
"""A finding's ``(node, entity, kind, code)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalIngest:
    """One accepted artifact.

    Attributes:
        accepted_at: When it was accepted, epoch seconds.
        node: The node it is about.
        file: Its name (for evidence).
        facts: The facts it came with.
        body: Its raw bytes.
    """

    accepted_at: float
    node: str
    file: str
    facts: Mapping[str, str]
    body: bytes


class InputJournal:
    """Accepted inputs, written before they are applied (module docstring).

    Args:
        target: A SQLite file, ``None`` (memory, tests), or a PostgreSQL DSN.

    Raises:
        OSError: The SQLite folder cannot be created.
        sqlite3.DatabaseError: The file is not a database.
        TemporaryError: The PostgreSQL server cannot be reached.
    """

    def __init__(self, target: str | Path | None) -> None:
        self.target = target
        self.db: Database = open_database(target, pool_size=2, sqlite_synchronous="FULL")
        try:
            self.db.migrate(COMPONENT)
        except BaseException:
            self.db.close()
            raise

    def add_ingest(self, ingest: JournalIngest) -> None:
        """Write one accepted artifact (durably, before it is applied).

        Raises:
            OSError, sqlite3.Error: The file cannot be written (a full disk).
            TemporaryError: PostgreSQL is away.
        """
        with self.db.transaction(lock=COMPONENT) as db:
            db.execute("INSERT INTO journal_ingests (accepted_at, node, file, facts, body) "
                       "VALUES (?, ?, ?, ?, ?)",
                       (ingest.accepted_at, ingest.node, ingest.file,
                        json.dumps(dict(ingest.facts), sort_keys=True), ingest.body))

    def ingests(self, *, since: float) -> list[JournalIngest]:
        """Return the artifacts accepted at or after ``since``, oldest first."""
        rows = self.db.execute(
            "SELECT accepted_at, node, file, facts, body FROM journal_ingests "
            "WHERE accepted_at >= ? ORDER BY id", (since,))
        out: list[JournalIngest] = []
        for at, node, file, facts, body in rows:
            try:
                parsed = {str(k): str(v) for k, v in dict(json.loads(facts)).items()}
            except (ValueError, TypeError):
                parsed = {}
            out.append(JournalIngest(accepted_at=float(at), node=str(node), file=str(file),
                                     facts=parsed, body=bytes(body)))
        return out

    def hold(self, findings: Sequence[tuple[Finding, float]], *, at: float,
             source: str = "") -> None:
        """Write held findings, each open until its time (epoch seconds); newer replace older.

        Raises:
            OSError, sqlite3.Error, TemporaryError: As :meth:`add_ingest`.
        """
        if not findings:
            return
        rows = [(*f.key, at, until, source, json.dumps(finding_to_json(f), sort_keys=True))
                for f, until in findings]
        with self.db.transaction(lock=COMPONENT) as db:
            db.executemany(
                "INSERT INTO journal_held (node, entity, kind, code, held_at, hold_until, "
                "source, finding) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (node, entity, kind, code) DO UPDATE SET "
                "held_at = excluded.held_at, hold_until = excluded.hold_until, "
                "source = excluded.source, finding = excluded.finding", rows)

    def clear(self, keys: Iterable[Key]) -> None:
        """Delete the held findings of ``keys`` (they closed).

        Raises:
            OSError, sqlite3.Error, TemporaryError: As :meth:`add_ingest`.
        """
        rows = [tuple(k) for k in keys]
        if not rows:
            return
        with self.db.transaction(lock=COMPONENT) as db:
            db.executemany("DELETE FROM journal_held WHERE node = ? AND entity = ? AND "
                           "kind = ? AND code = ?", rows)

    def held(self, *, now: float) -> list[tuple[Finding, float, str]]:
        """Return the held findings still open at ``now``: ``(finding, until, source)``.

        A row this version cannot read is skipped with a warning naming its key.
        """
        out: list[tuple[Finding, float, str]] = []
        rows = self.db.execute(
            "SELECT node, entity, kind, code, hold_until, source, finding FROM journal_held "
            "WHERE hold_until > ? ORDER BY held_at", (now,))
        for node, entity, kind, code, until, source, text in rows:
            try:
                out.append((finding_from_json(json.loads(text)), float(until), str(source)))
            except (ValueError, CodecError) as exc:
                logger.warning("journal_held %s/%s %s %s: skipped, unreadable: %s", node,
                               entity, kind, code, exc)
        return out

    def prune(self, *, before: float, max_bytes: int = MAX_INGEST_BYTES) -> int:
        """Delete what is too old or too much; return how many artifacts were deleted.

        Artifacts accepted before ``before``, then the oldest beyond ``max_bytes``, and the
        held findings that expired before ``before``.
        """
        with self.db.transaction(lock=COMPONENT) as db:
            gone = len(db.execute("DELETE FROM journal_ingests WHERE accepted_at < ? "
                                  "RETURNING id", (before,)).fetchall())
            db.execute("DELETE FROM journal_held WHERE hold_until <= ?", (before,))
            sizes = db.execute("SELECT id, length(body) FROM journal_ingests "
                               "ORDER BY id DESC").fetchall()
            total, cut = 0, None
            for row_id, size in sizes:
                total += int(size)
                if total > max_bytes:
                    cut = int(row_id)
                    break
            if cut is not None:
                over = len(db.execute("DELETE FROM journal_ingests WHERE id <= ? RETURNING id",
                                      (cut,)).fetchall())
                logger.warning("ingest journal over %d bytes: %d oldest artifact(s) dropped",
                               max_bytes, over)
                gone += over
        return gone

    def close(self) -> None:
        """Close the database."""
        self.db.close()
