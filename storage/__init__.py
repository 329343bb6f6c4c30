"""gpuhealth storage package: time-series stores (entry-point group ``gpuhealth.stores``)."""

from __future__ import annotations

from storage.sqlite import SqliteStore

__all__ = ["SqliteStore"]
