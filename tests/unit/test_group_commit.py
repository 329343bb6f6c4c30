"""storage.fleet.GroupCommit: agents' batches that arrive together share one transaction.

On SQLite in memory through the real FleetStore; what the group writes on PostgreSQL is
tests/unit/test_state_conformance.py's (accept_batches on both engines).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from core.errors import TemporaryError
from storage.fleet import AcceptResult, AgentBatch, FleetRecord, GroupCommit, SqliteFleetStore


def rec(node: str, n: int, body: dict[str, Any] | None = None) -> FleetRecord:
    return FleetRecord(key=f"{node}:{n:04d}", node=node, kind="finding", at=1000.0 + n,
                       body=body if body is not None else {"n": n})


class Counting:
    """The store's accept_batches, counting the transactions and holding the first one."""

    def __init__(self, store: SqliteFleetStore) -> None:
        self.store = store
        self.groups: list[int] = []
        self.release = threading.Event()
        self.fail: BaseException | None = None

    def __call__(self, batches: list[AgentBatch]) -> list[AcceptResult]:
        if not self.groups:
            self.release.wait(5.0)  # the others arrive while the first is being written
        self.groups.append(len(batches))
        if self.fail is not None:
            raise self.fail
        return self.store.accept_batches(batches)


async def accept_all(commit: GroupCommit, write: Counting, batches: list[AgentBatch]
                     ) -> list[Any]:
    tasks = [asyncio.create_task(commit.accept(batches[0]))]
    await asyncio.sleep(0.05)  # its transaction is being written (held)
    tasks += [asyncio.create_task(commit.accept(b)) for b in batches[1:]]
    await asyncio.sleep(0.05)  # every other batch waits for it now
    write.release.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


def run(write: Counting, batches: list[AgentBatch]) -> list[Any]:
    pool = ThreadPoolExecutor(max_workers=2)

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        commit = GroupCommit(write, lambda fn, arg: loop.run_in_executor(pool, fn, arg))
        return await accept_all(commit, write, batches)

    try:
        return asyncio.run(main())
    finally:
        pool.shutdown()


def test_batches_that_arrive_meanwhile_share_the_next_transaction() -> None:
    store = SqliteFleetStore(None)
    write = Counting(store)
    batches = [AgentBatch(node=f"gpu-{i:02d}", records=[rec(f"gpu-{i:02d}", 0)],
                          heartbeat_at=10.0) for i in range(20)]
    results = run(write, batches)
    assert results == [AcceptResult(1, 0)] * 20
    assert write.groups == [1, 19]  # the first alone (the store was idle), then the rest
    assert len(store.read_after(0)) == 20
    assert len(store.agents()) == 20


def test_a_batch_the_store_refuses_fails_alone() -> None:
    store = SqliteFleetStore(None)
    write = Counting(store)
    bad = AgentBatch(node="gpu-09", records=[rec("gpu-09", 0, body={"x": object()})])
    batches = [AgentBatch(node="gpu-00", records=[rec("gpu-00", 0)]), bad,
               *[AgentBatch(node=f"gpu-{i:02d}", records=[rec(f"gpu-{i:02d}", 0)])
                 for i in range(1, 4)]]
    results = run(write, batches)
    assert isinstance(results[1], TypeError)
    assert [r for i, r in enumerate(results) if i != 1] == [AcceptResult(1, 0)] * 4
    assert sorted(r.node for r in store.read_after(0)) == ["gpu-00", "gpu-01", "gpu-02",
                                                           "gpu-03"]


def test_a_store_away_fails_the_whole_group_and_stores_nothing() -> None:
    store = SqliteFleetStore(None)
    write = Counting(store)
    write.fail = TemporaryError("the PostgreSQL server is away")
    results = run(write, [AgentBatch(node=f"gpu-{i:02d}", records=[rec(f"gpu-{i:02d}", 0)])
                          for i in range(5)])
    assert all(isinstance(r, TemporaryError) for r in results)
    assert write.groups == [1, 4]  # no retry one by one: every agent resends
    assert store.read_after(0) == []


def test_max_batches_bounds_a_transaction() -> None:
    with pytest.raises(ValueError, match="max_batches"):
        GroupCommit(lambda b: [], lambda fn, arg: asyncio.sleep(0), max_batches=0)
