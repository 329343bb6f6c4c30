"""Open the store a configuration names, behind the durable spool when it is remote.

The service calls :func:`open_store` instead of building the plugin itself, so that
``gpuhealth run`` writes to whichever backend ``[storage] type`` names with no other
change, and every remote backend gets the :class:`~storage.spool.SpoolingStore`.
:func:`store_stats` reads the counters the service exports on ``/metrics``, and whether
the store takes writes (``/healthz``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import plugins
from core.protocols import Store
from storage.spool import SpoolingStore

LOCAL_STORES = frozenset({"sqlite"})
"""Store types that are files on this machine and need no spool."""

READ_ONLY_STORES = frozenset({"promql"})
"""Store types that only read (``gpuhealth run`` writes nothing to them; no spool)."""


def open_store(
    kind: str,
    options: Mapping[str, Any],
    *,
    spool_path: str | Path | None = None,
    spool_max_bytes: int = 256 * 1024 * 1024,
) -> Store:
    """Build the store plugin ``kind`` and wrap a remote one in a spool.

    Args:
        kind: Entry-point name in ``gpuhealth.stores`` (``sqlite``, ``influxdb``, ``promql``).
        options: Constructor keyword arguments of that store.
        spool_path: Spool folder for remote stores; ``None`` writes to them directly.
        spool_max_bytes: Bound of the spool on disk.

    Raises:
        PluginError: No such store, or it does not implement the Store protocol.
    """
    store = plugins.build("gpuhealth.stores", kind, options, expect=Store)
    if kind in LOCAL_STORES or kind in READ_ONLY_STORES or spool_path is None:
        return store
    return SpoolingStore(store=store, path=spool_path, max_bytes=spool_max_bytes)


@dataclass
class StoreStats:
    """Counters of a store for ``/metrics``.

    Attributes:
        spool_depth: Records waiting in the spool (``gpuhealth_spool_depth``).
        spool_dropped: Samples the full spool dropped (``gpuhealth_spool_dropped_total``).
        rejected: Reason → records rejected or converted
            (``gpuhealth_store_rejected_total{reason}``), spool and store together.
        failing: Why the store takes no writes now (the spool is holding batches for it),
            or ``None`` (``/healthz``).
    """

    spool_depth: int = 0
    spool_dropped: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    failing: str | None = None


def store_stats(store: Store) -> StoreStats:
    """Read the spool and rejection counters of ``store`` (zeros for stores without them)."""
    stats = StoreStats()
    inner: object = store
    if isinstance(store, SpoolingStore):
        stats.spool_depth = store.depth
        stats.spool_dropped = store.dropped_samples
        stats.failing = store.failing
        stats.rejected.update(store.rejected)
        inner = store.store
    rejected = getattr(inner, "rejected", None)
    if isinstance(rejected, Counter):
        stats.rejected.update(rejected)
    return stats
