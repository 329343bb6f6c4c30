from __future__ import annotations

from pathlib import Path

import pytest

import storage
from core.protocols import Store
from storage.factory import open_store, store_stats
from storage.spool import SpoolingStore
from storage.sqlite import SqliteStore


def test_all_is_sorted_and_resolves() -> None:
    names = storage.__all__
    assert names == sorted(names, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper()
                                                 else 2, n))
    for name in names:
        assert getattr(storage, name) is not None


def test_sqlite_is_opened_without_a_spool(tmp_path: Path) -> None:
    store = open_store("sqlite", {"path": str(tmp_path / "db.sqlite")},
                       spool_path=tmp_path / "spool")
    assert isinstance(store, SqliteStore)
    assert store_stats(store).spool_depth == 0
    store.close()


def test_remote_stores_get_the_spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from core import plugins
    from storage.influxdb import InfluxDbStore

    def build(group, name, options, *, expect):
        assert (group, name) == ("gpuhealth.stores", "influxdb")
        return InfluxDbStore(**options)

    monkeypatch.setattr(plugins, "build", build)
    store = open_store("influxdb", {"url": "http://127.0.0.1:9", "org": "o", "bucket": "b",
                                    "token": "t"}, spool_path=tmp_path / "spool")
    assert isinstance(store, SpoolingStore)
    assert isinstance(store, Store)
    stats = store_stats(store)
    assert (stats.spool_depth, stats.spool_dropped, dict(stats.rejected)) == (0, 0, {})
    store.store.close()  # type: ignore[attr-defined]
