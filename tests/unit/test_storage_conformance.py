"""Every store that can run here passes the same checks (style.md C.3.16a).

The influxdb and promql stores run the same scenario against real servers in
tests/integration/test_victoriametrics.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from core.clock import FakeClock
from core.protocols import Store
from core.records import EntityId, EntityRef, Event, NodeName, Sample
from storage.spool import SpoolingStore
from storage.sqlite import SqliteStore

T0 = 1_700_000_000.0


@pytest.fixture(params=["sqlite", "spool-over-sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    clock = FakeClock(now=T0 + 3600)
    inner = SqliteStore(path=tmp_path / "db.sqlite", clock=clock)
    made: Store = inner
    if request.param == "spool-over-sqlite":
        made = SpoolingStore(store=inner, path=tmp_path / "spool", clock=clock)
    yield made
    made.close()  # type: ignore[attr-defined]


def _s(value: float, at: float, entity: str = "GPU-a", **labels: str) -> Sample:
    return Sample(metric="gpu_power_watts", value=value, observed_at=at, node=NodeName("n 1"),
                  entity=EntityId(entity), labels=labels)


def test_protocol_roundtrip_and_bad_data(store: Store) -> None:
    assert isinstance(store, Store)
    store.write([_s(float(i), T0 + i) for i in range(10)]
                + [_s(1.0, T0, entity="GPU,b", type='a "b"'), _s(float("nan"), T0 + 1),
                   _s(1.0, T0 + 86400)],
                [Event(kind="xid", code="79", node=NodeName("n 1"), entity=EntityId("GPU-a"),
                       observed_at=T0)])
    frame = store.read("gpu_power_watts", [EntityRef(node=NodeName("n 1"),
                                                     entity=EntityId("GPU-a"))], T0, T0 + 100)
    assert frame["value"].tolist() == [float(i) for i in range(10)]
    assert frame["observed_at"].tolist() == [T0 + i for i in range(10)]
    odd = store.read("gpu_power_watts", [EntityRef(node=NodeName("n 1"),
                                                   entity=EntityId("GPU,b"))], T0, T0 + 100)
    assert odd["type"].tolist() == ['a "b"']
    stepped = store.read("gpu_power_watts", None, T0, T0 + 9, step_seconds=5)
    assert len(stepped) == 3
    assert {(e.node, e.entity) for e in store.entities()} == {("n 1", "GPU-a"), ("n 1", "GPU,b")}
    rejected = getattr(store, "rejected", None)
    assert rejected is not None
    assert rejected["nan"] == 1
    assert rejected["future"] == 1
