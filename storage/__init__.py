"""gpuhealth storage package: time-series stores (entry-point group ``gpuhealth.stores``).

``InfluxDbStore`` is imported on first use, so that ``influxdb-client`` is needed only by
sites that write to InfluxDB or VictoriaMetrics.
"""

from __future__ import annotations

from typing import Any

from storage.factory import StoreStats, open_store, store_stats
from storage.lineprotocol import LineEncoder, export, import_lines, parse_when, read_records
from storage.promql import PromqlStore
from storage.spool import SpoolingStore
from storage.sqlite import SqliteStore

__all__ = [
    "InfluxDbStore",
    "LineEncoder",
    "PromqlStore",
    "SpoolingStore",
    "SqliteStore",
    "StoreStats",
    "export",
    "import_lines",
    "open_store",
    "parse_when",
    "read_records",
    "store_stats",
]


def __getattr__(name: str) -> Any:
    if name == "InfluxDbStore":
        from storage.influxdb import InfluxDbStore

        return InfluxDbStore
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
