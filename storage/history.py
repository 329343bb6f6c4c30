"""The incident history: failures, the GPU/node population and predictions.

One SQLite file for ``gpuhealth run`` (``<data_dir>/history.sqlite``), or the controller
pair's shared PostgreSQL (:mod:`storage.sql`), where the leader records it. Both the
remediation engine (``run`` and the controller's leader write every incident it opens
and closes) and the weekly reliability report (``gpuhealth report``) use it; the
real-data importers (:mod:`storage.importers`) fill it from the Titan and LANL records.

Schema (times are float UTC epoch seconds, ``NULL`` where unknown)::

    history_incidents(incident_id PK, source, node, entity, kind, code, severity, cause,
              detected_at, out_of_service_at, back_in_service_at, resolved_at,
              model, driver_version, vbios_version, slot, batch, predicted_at,
              actions JSON list, attrs JSON object)
    history_inventory(key PK, source, entity, node, model, driver_version, vbios_version,
              slot, batch, first_seen_at, last_seen_at, removed_at, attrs JSON object)
    history_predictions(entity, node, at, probability, horizon_seconds, top_features JSON,
                PK (entity, node, at))

One inventory row is one *residency*: an entity (a GPU serial or UUID, or ``"node"`` for a
whole node) in one place (node and slot) from ``first_seen_at`` to ``last_seen_at``. A GPU
moved to another slot has two rows; a GPU still installed has ``removed_at`` NULL and
``last_seen_at`` the last time it was seen. ``first_seen_at`` may be NULL when the source
lost the install time (Titan, 1,158 rows): such a residency contributes no operating time.

Writes are upserts (``INSERT ... ON CONFLICT DO UPDATE``: the last write of a key wins,
and writing the same record again changes nothing) in one transaction per call, with
``executemany``: 37,343 Titan residencies plus 6,367 incidents insert in well under a
second on SQLite. WAL mode lets any number of readers (the report, another process) read
while the one writer (the service) writes; a locked or busy database, or an unreachable
PostgreSQL, becomes :class:`core.errors.TemporaryError`.

Reads return pandas DataFrames with one column per record field (``actions`` a tuple,
``attrs`` and ``top_features`` dicts, shared between rows with equal values: treat them as
read-only), sorted by time, with an empty frame of the same columns when nothing matches.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from core.errors import TemporaryError

if TYPE_CHECKING:
    import pandas as pd  # the report's reads only: the service that records never loads it
from storage.sql import Database, open_database

CAUSES = (
    "xid", "memory", "nvlink", "network", "host", "thermal", "power", "gpu_lost", "other",
)
"""The failure causes the report groups by, in display order."""

_MEMORY_XIDS = frozenset({31, 48, 63, 64, 92, 94, 95, 140})
"""Xids of the memory subsystem (NVIDIA Xid catalog: 48 DBE, 63/64 row remap, 92 high SBE
rate, 94/95 contained/uncontained ECC, 140 unrecovered ECC; 31 MMU fault is the usual
symptom of a bad page)."""
_NVLINK_XIDS = frozenset({74, 144, 145, 146, 147, 148, 149, 150})
_LOST_XIDS = frozenset({79, 119, 120, 154})
_POWER_XIDS = frozenset({54, 56})

_KIND_CAUSE: Mapping[str, str] = MappingProxyType({
    "ecc": "memory", "row_remap": "memory", "retired_pages": "memory", "memory": "memory",
    "dbe": "memory",
    "nvlink": "nvlink", "fabric": "nvlink", "fabric_manager": "nvlink", "nvls": "nvlink",
    "sxid": "nvlink",
    "network": "network", "ib_port": "network", "ib_fabric": "network", "nic_port": "network",
    "rdma_transport": "network", "rdma_verbs": "network", "rdma_counters": "network",
    "rdma_async": "network", "roce_qos": "network", "nccl": "network",
    "collective": "network",
    "gpu_lost": "gpu_lost", "otb": "gpu_lost",
    "throttle": "thermal", "thermal": "thermal",
    "power": "power", "facilities": "power",
    "host": "host", "pcie": "host", "kernel": "host", "hardware": "host", "software": "host",
    "human_error": "other", "undetermined": "other",
})

_LANL_CODE_CAUSE: Mapping[str, str] = MappingProxyType({
    "memory dimm": "memory", "memory": "memory",
    "chillers": "thermal", "environment": "thermal", "fan": "thermal", "fans": "thermal",
    "power outage": "power", "ups": "power", "power spike": "power", "power supply": "power",
    "interconnect interface": "network", "network": "network",
})


def cause_of(kind: str, code: str) -> str:
    """Map a fault ``(kind, code)`` to one of :data:`CAUSES`.

    Rules, in order: an ``xid`` event goes by its number (NVIDIA's Xid catalog, as in
    ``analytics/fault_model/xid.py``): memory Xids (31, 48, 63, 64, 92, 94, 95, 140) ->
    ``memory``, NVLink (74, 144-150) -> ``nvlink``, fallen off the bus (79, 119, 120, 154)
    -> ``gpu_lost``, power (54, 56) -> ``power``, any other -> ``xid``. A sub-cause code
    that names a component (LANL's ``Memory Dimm``, ``Power Supply``, ``Chillers``) wins over
    the kind; otherwise the kind decides (fault-model kinds ``ecc``/``row_remap`` ->
    ``memory``, ``ib_port``/``nccl`` -> ``network``, ``throttle`` -> ``thermal``, LANL root
    cause categories ``hardware``/``software`` -> ``host``, ``facilities`` -> ``power``).
    Unknown kinds are ``other``.

    Args:
        kind: Fault family (``xid``, ``ecc``, ``gpu_lost``, ``hardware``...), any case.
        code: Fault code within the family (an Xid number, ``DBE``, ``Memory Dimm``).

    Returns:
        One of :data:`CAUSES`.

    Examples:
        >>> cause_of("xid", "48"), cause_of("xid", "79"), cause_of("xid", "13")
        ('memory', 'gpu_lost', 'xid')
        >>> cause_of("hardware", "Memory Dimm"), cause_of("hardware", "CPU")
        ('memory', 'host')
    """
    k = kind.strip().lower().replace(" ", "_")
    c = code.strip().lower()
    if k == "xid":
        try:
            number = int(c)
        except ValueError:
            return "xid"
        if number in _MEMORY_XIDS:
            return "memory"
        if number in _NVLINK_XIDS:
            return "nvlink"
        if number in _LOST_XIDS:
            return "gpu_lost"
        if number in _POWER_XIDS:
            return "power"
        return "xid"
    if c in _LANL_CODE_CAUSE:
        return _LANL_CODE_CAUSE[c]
    if k in _KIND_CAUSE:
        return _KIND_CAUSE[k]
    return "other"


_EMPTY: Mapping[str, str] = MappingProxyType({})
_EMPTY_F: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class IncidentRecord:
    """One failure of one entity, from detection to resolution.

    Attributes:
        incident_id: Unique id; an upsert of the same id replaces the row.
        node: Node name (Titan: the cname; LANL: ``lanl-s<system>-n<node>``).
        entity: GPU UUID or serial, or ``"node"`` for a node-level failure.
        kind: Fault family (``xid``, ``ecc``, ``gpu_lost``; LANL: root-cause category).
        code: Code within the family (Xid number, ``DBE``; LANL: the sub-cause).
        severity: ``info``/``warning``/``critical`` (``core.records.Severity`` values).
        cause: One of :data:`CAUSES`; see :func:`cause_of`.
        detected_at: When the failure was detected (epoch s).
        out_of_service_at: When the entity was taken out of service, if it was.
        back_in_service_at: When it (or its replacement in the same slot) served again.
        resolved_at: When the incident was closed.
        model: GPU or node model (``Tesla K20X``).
        driver_version: Driver version at detection.
        vbios_version: VBIOS/firmware version at detection.
        slot: Physical location (Titan ``c0-0c0s0n0``, PCI bus id...).
        batch: Manufacturing batch or board revision (Titan ``old``/``new``).
        source: Where the record came from: ``gpuhealth``, ``titan``, ``lanl``...
        predicted_at: First prediction that flagged this entity before detection.
        actions: Remediation steps taken, in order (``drain``, ``reset``, ``replace``).
        attrs: Free-form strings (approvals, budget/circuit-breaker notes, source fields).
    """

    incident_id: str
    node: str
    entity: str
    kind: str
    code: str
    severity: str
    cause: str
    detected_at: float
    out_of_service_at: float | None
    back_in_service_at: float | None
    resolved_at: float | None
    model: str = ""
    driver_version: str = ""
    vbios_version: str = ""
    slot: str = ""
    batch: str = ""
    source: str = "gpuhealth"
    predicted_at: float | None = None
    actions: tuple[str, ...] = ()
    attrs: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"incident {self.incident_id}: cause {self.cause!r} is not one "
                             f"of {', '.join(CAUSES)}")
        if not math.isfinite(self.detected_at):
            raise ValueError(f"incident {self.incident_id}: detected_at must be finite")


@dataclass(frozen=True, slots=True, kw_only=True)
class InventoryRecord:
    """One residency of a GPU or node in the population (see the module docstring).

    Attributes:
        entity: GPU UUID/serial, or ``"node"``.
        node: Node name.
        model: GPU or node model.
        driver_version: Driver version during the residency.
        vbios_version: VBIOS/firmware version during the residency.
        slot: Physical location.
        first_seen_at: Start of the residency (epoch s), ``None`` if the source lost it.
        last_seen_at: End of the residency, or the last time it was seen installed.
        removed_at: When it was removed from the system for good (``None``: not removed).
        source: ``gpuhealth``, ``titan``, ``lanl``...
        batch: Manufacturing batch or board revision.
        residency_id: Tells apart residencies that agree on every other key field.
        attrs: Free-form strings.
    """

    entity: str
    node: str
    model: str
    driver_version: str
    vbios_version: str
    slot: str
    first_seen_at: float | None
    last_seen_at: float
    removed_at: float | None
    source: str = "gpuhealth"
    batch: str = ""
    residency_id: str = ""
    attrs: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    @property
    def key(self) -> str:
        """Return the upsert key: source, entity, node, slot, start, end and residency id.

        The end is part of the key because a residency whose start was lost is told apart
        from another of the same GPU in the same slot only by it; ``residency_id`` tells
        apart rows that repeat all of these (Titan has three such duplicate rows, kept
        because the source counts them).
        """
        start = "" if self.first_seen_at is None else repr(float(self.first_seen_at))
        end = "" if self.first_seen_at is not None else repr(float(self.last_seen_at))
        return "\x1f".join((self.source, self.entity, self.node, self.slot, start, end,
                            self.residency_id))


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictionRecord:
    """One failure prediction for an entity.

    Attributes:
        entity: GPU UUID/serial or ``"node"``.
        node: Node name.
        at: When the prediction was made (epoch s).
        probability: Predicted failure probability within the horizon, 0-1.
        horizon_seconds: How far ahead the prediction looks (s, > 0).
        top_features: Feature name -> contribution, the model's explanation.
    """

    entity: str
    node: str
    at: float
    probability: float
    horizon_seconds: float
    top_features: Mapping[str, float] = field(default_factory=lambda: _EMPTY_F)

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"prediction {self.node}/{self.entity}: probability "
                             f"{self.probability} is outside 0-1")
        if not self.horizon_seconds > 0:
            raise ValueError(f"prediction {self.node}/{self.entity}: horizon_seconds must be "
                             f"> 0, got {self.horizon_seconds}")


INCIDENT_COLUMNS = (
    "incident_id", "source", "node", "entity", "kind", "code", "severity", "cause",
    "detected_at", "out_of_service_at", "back_in_service_at", "resolved_at", "model",
    "driver_version", "vbios_version", "slot", "batch", "predicted_at", "actions", "attrs",
)
"""Columns of :meth:`IncidentHistory.incidents` frames."""

INVENTORY_COLUMNS = (
    "source", "entity", "node", "model", "driver_version", "vbios_version", "slot", "batch",
    "first_seen_at", "last_seen_at", "removed_at", "attrs",
)
"""Columns of :meth:`IncidentHistory.inventory` frames."""

PREDICTION_COLUMNS = ("entity", "node", "at", "probability", "horizon_seconds", "top_features")
"""Columns of :meth:`IncidentHistory.predictions` frames."""

WRITER_LOCK = "history"
"""PostgreSQL advisory transaction lock that every write to the history takes."""

_POOL_SIZE = 2
"""PostgreSQL connections per history (the recorder and the report are its callers)."""


def _upsert(table: str, key: tuple[str, ...], columns: tuple[str, ...]) -> str:
    """A portable ``INSERT ... ON CONFLICT (key) DO UPDATE`` of every other column."""
    others = [c for c in columns if c not in key]
    return (f"INSERT INTO {table} ({', '.join(columns)}) "
            f"VALUES ({', '.join('?' * len(columns))}) "
            f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET "
            + ", ".join(f"{c} = excluded.{c}" for c in others))


_UPSERT_INCIDENTS = _upsert("history_incidents", ("incident_id",), INCIDENT_COLUMNS)
_UPSERT_INVENTORY = _upsert("history_inventory", ("key",), ("key", *INVENTORY_COLUMNS))
_UPSERT_PREDICTIONS = _upsert("history_predictions", ("entity", "node", "at"),
                              PREDICTION_COLUMNS)


@contextlib.contextmanager
def _mapped_errors(path: str) -> Iterator[None]:
    """Translate a locked or busy SQLite database into :class:`TemporaryError`.

    PostgreSQL's lost connections are :class:`TemporaryError` already
    (:mod:`storage.sql`).
    """
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc).lower()
        if "locked" in text or "busy" in text:
            raise TemporaryError(f"{path}: {exc}", retry_after_seconds=1.0) from exc
        raise


def _json(value: Mapping[str, Any] | tuple[str, ...]) -> str:
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return json.dumps(dict(value), sort_keys=True)


class IncidentHistory:
    """The incident history (see the module docstring for the schema).

    On SQLite (``gpuhealth run``, imports, tests) or on the controller pair's shared
    PostgreSQL (:mod:`storage.sql`): the schema is ``storage/migrations/sqlite/
    NNNN_history.sql`` or the shared ``storage/migrations/postgres``, applied once at
    open (a history file of an earlier release is adopted: its tables are renamed to
    ``history_*``). Writes are upserts in one transaction per call; on PostgreSQL they
    take the advisory transaction lock ``history``, so a leader and the replica that
    takes over from it never interleave one batch.

    Args:
        path: SQLite file, created with its folder if missing; ``":memory:"`` for tests;
            or a PostgreSQL DSN (``postgresql://...`` or libpq keywords).
        timeout_seconds: How long a write waits for another writer's lock (SQLite) or
            for a connection (PostgreSQL) before :class:`TemporaryError` (s).

    Raises:
        OSError: The folder cannot be created.
        sqlite3.DatabaseError: The file is not a database.
        PluginError: A PostgreSQL DSN without the controller's extra.
        TemporaryError: The database is locked, or the PostgreSQL server cannot be
            reached.
    """

    def __init__(self, path: str | Path, *, timeout_seconds: float = 5.0) -> None:
        self.path = path
        self.timeout_seconds = timeout_seconds
        name = str(path)
        self._lock = threading.Lock()
        with _mapped_errors(name):
            self.db: Database = open_database(
                None if name == ":memory:" else path, pool_size=_POOL_SIZE,
                timeout_seconds=timeout_seconds, sqlite_synchronous="NORMAL",
                sqlite_timeout_seconds=timeout_seconds)
            try:
                self.db.migrate("history")
            except BaseException:
                self.db.close()
                raise
        self.where = self.db.where
        """The file or ``host:port/dbname`` for messages (never a password)."""

    def _write(self, sql: str, rows: list[tuple[Any, ...]]) -> int:
        if not rows:
            return 0
        with self._lock, _mapped_errors(self.where), \
                self.db.transaction(lock=WRITER_LOCK) as db:
            db.executemany(sql, rows)
        return len(rows)

    def upsert_incidents(self, records: Iterable[IncidentRecord]) -> int:
        """Insert or replace incidents by ``incident_id``, in one transaction.

        Returns:
            The number of records written.

        Raises:
            TemporaryError: Another writer holds the database lock for over ``timeout_seconds``.
        """
        rows = [(r.incident_id, r.source, r.node, r.entity, r.kind, r.code, r.severity,
                 r.cause, r.detected_at, r.out_of_service_at, r.back_in_service_at,
                 r.resolved_at, r.model, r.driver_version, r.vbios_version, r.slot, r.batch,
                 r.predicted_at, _json(r.actions), _json(r.attrs)) for r in records]
        return self._write(_UPSERT_INCIDENTS, rows)

    def upsert_inventory(self, records: Iterable[InventoryRecord]) -> int:
        """Insert or replace residencies by :attr:`InventoryRecord.key`, in one transaction.

        Returns:
            The number of records written.

        Raises:
            TemporaryError: Another writer holds the database lock for over ``timeout_seconds``.
        """
        rows = [(r.key, r.source, r.entity, r.node, r.model, r.driver_version,
                 r.vbios_version, r.slot, r.batch, r.first_seen_at, r.last_seen_at,
                 r.removed_at, _json(r.attrs)) for r in records]
        return self._write(_UPSERT_INVENTORY, rows)

    def record_predictions(self, records: Iterable[PredictionRecord]) -> int:
        """Insert or replace predictions by ``(entity, node, at)``, in one transaction.

        Returns:
            The number of records written.

        Raises:
            TemporaryError: Another writer holds the database lock for over ``timeout_seconds``.
        """
        rows = [(r.entity, r.node, r.at, r.probability, r.horizon_seconds,
                 _json(r.top_features)) for r in records]
        return self._write(_UPSERT_PREDICTIONS, rows)

    def _frame(self, sql: str, params: list[Any], columns: tuple[str, ...],
               json_columns: Mapping[str, str]) -> pd.DataFrame:
        import pandas as pd

        with self._lock, _mapped_errors(self.where):
            rows = self.db.execute(sql, params)
        frame = pd.DataFrame.from_records(rows, columns=list(columns))
        for name, kind in json_columns.items():
            # Most rows repeat a handful of attribute sets: decode each distinct text once
            # (the rows then share one read-only value).
            cache: dict[str, Any] = {}
            values = []
            for text in frame[name]:
                value = cache.get(text)
                if value is None:
                    decoded = json.loads(text)
                    value = cache[text] = tuple(decoded) if kind == "tuple" else decoded
                values.append(value)
            frame[name] = pd.Series(values, index=frame.index, dtype=object)
        return frame

    def incidents(self, since: float | None = None, until: float | None = None,
                  source: str | None = None) -> pd.DataFrame:
        """Return incidents detected in ``[since, until)`` (epoch s; ``None``: unbounded).

        Args:
            since: Earliest ``detected_at`` included.
            until: ``detected_at`` bound, excluded.
            source: Only this source (``titan``, ``lanl``, ``gpuhealth``); ``None``: all.

        Returns:
            One row per incident, columns :data:`INCIDENT_COLUMNS`, by ``detected_at``.
        """
        where, params = self._where("detected_at", since, until, source)
        return self._frame(
            f"SELECT {', '.join(INCIDENT_COLUMNS)} FROM history_incidents{where} "
            "ORDER BY detected_at, incident_id", params, INCIDENT_COLUMNS,
            {"actions": "tuple", "attrs": "dict"})

    def inventory(self, since: float | None = None, until: float | None = None,
                  source: str | None = None) -> pd.DataFrame:
        """Return residencies that overlap ``[since, until)`` (epoch s; ``None``: unbounded).

        A residency overlaps when it started before ``until`` (or its start is unknown) and
        was last seen at or after ``since``.

        Returns:
            One row per residency, columns :data:`INVENTORY_COLUMNS`, by ``first_seen_at``.
        """
        clauses: list[str] = []
        params: list[Any] = []
        if since is not None:
            clauses.append("last_seen_at >= ?")
            params.append(since)
        if until is not None:
            clauses.append("(first_seen_at IS NULL OR first_seen_at < ?)")
            params.append(until)
        if source is not None:
            clauses.append("source = ?")
            params.append(source)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        return self._frame(
            f"SELECT {', '.join(INVENTORY_COLUMNS)} FROM history_inventory{where} "
            "ORDER BY first_seen_at, key", params, INVENTORY_COLUMNS, {"attrs": "dict"})

    def predictions(self, since: float | None = None,
                    until: float | None = None) -> pd.DataFrame:
        """Return predictions made in ``[since, until)`` (epoch s; ``None``: unbounded).

        Returns:
            One row per prediction, columns :data:`PREDICTION_COLUMNS`, by ``at``.
        """
        where, params = self._where("at", since, until, None)
        return self._frame(
            f"SELECT {', '.join(PREDICTION_COLUMNS)} FROM history_predictions{where} "
            "ORDER BY at, node, entity", params, PREDICTION_COLUMNS, {"top_features": "dict"})

    def sources(self) -> list[str]:
        """Return the sources present in the incidents or inventory, sorted."""
        with self._lock, _mapped_errors(self.where):
            rows = self.db.execute("SELECT source FROM history_incidents "
                                   "UNION SELECT source FROM history_inventory")
        return sorted(str(r[0]) for r in rows)

    @staticmethod
    def _where(column: str, since: float | None, until: float | None,
               source: str | None) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        if since is not None:
            clauses.append(f"{column} >= ?")
            params.append(since)
        if until is not None:
            clauses.append(f"{column} < ?")
            params.append(until)
        if source is not None:
            clauses.append("source = ?")
            params.append(source)
        return (f" WHERE {' AND '.join(clauses)}" if clauses else ""), params

    def close(self) -> None:
        """Close the database connection; the object must not be used afterwards."""
        with self._lock:
            self.db.close()

    def __enter__(self) -> IncidentHistory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"IncidentHistory(where={self.where!r})"
