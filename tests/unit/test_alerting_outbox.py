"""The durable, bounded outbox: ordering, backoff, coalescing, bounds, restarts."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from alerting.alerts import alert_for
from alerting.outbox import Outbox
from alerting.testing import RecordingNotifier
from core.clock import FakeClock
from core.errors import NotifierUnavailable, PermanentError
from core.records import AlertState
from tests.unit.test_alerts import make_finding


def alerts(n):
    return [alert_for(make_finding(entity=f"GPU-{i}"), starts_at=1.0) for i in range(n)]


def deliver(box, *notifiers, force=False):
    return asyncio.run(box.deliver({n.name: n for n in notifiers}, force=force))


def test_delivers_in_order_and_empties():
    box = Outbox(clock=FakeClock())
    rec = RecordingNotifier()
    box.enqueue(rec.name, alerts(3))
    stats = deliver(box, rec)
    assert stats.sent == {"recording": 3}
    assert [a.labels["entity"] for a in rec.sent] == ["GPU-0", "GPU-1", "GPU-2"]
    assert box.depths() == {}


def test_outage_backs_off_and_delays_nobody_else():
    clock = FakeClock(now=0)
    box = Outbox(clock=clock, jitter=lambda: 1.0)
    down, up = RecordingNotifier(name="down"), RecordingNotifier(name="up")
    down.inject_error(NotifierUnavailable("503"), times=None)
    for n in (down, up):
        box.enqueue(n.name, alerts(2))
    stats = deliver(box, down, up)
    assert stats.sent == {"up": 2}
    assert stats.failed == {"down": 1}
    assert box.next_attempt_at("down") == 1.0
    deliver(box, down)  # not due: no attempt
    assert down.attempts == 1
    for expected in (3.0, 7.0, 15.0):  # 1, 2, 4, 8 s ...
        clock.now = box.next_attempt_at("down")
        deliver(box, down)
        assert box.next_attempt_at("down") == expected
    down.clear_error()
    clock.now = 3600
    deliver(box, down)
    assert [a.labels["entity"] for a in down.sent] == ["GPU-0", "GPU-1"]


def test_retry_after_is_honoured():
    clock = FakeClock(now=0)
    box = Outbox(clock=clock, jitter=lambda: 1.0)
    rec = RecordingNotifier()
    rec.inject_error(NotifierUnavailable("429", retry_after_seconds=90))
    box.enqueue(rec.name, alerts(1))
    deliver(box, rec)
    assert box.next_attempt_at(rec.name) == 90


def test_permanent_error_drops_only_that_alert():
    box = Outbox(clock=FakeClock())
    rec = RecordingNotifier()
    rec.inject_error(PermanentError("400"))
    box.enqueue(rec.name, alerts(2))
    stats = deliver(box, rec)
    assert stats.dropped == {"recording": 1}
    assert [a.labels["entity"] for a in rec.sent] == ["GPU-1"]


def test_resends_coalesce_but_state_changes_are_kept():
    box = Outbox(clock=FakeClock())
    (a,) = alerts(1)
    box.enqueue("n", [a])
    box.enqueue("n", [replace(a, annotations={**a.annotations, "occurrences": "2"})])
    assert box.depths() == {"n": 1}
    assert box.queued("n")[0].annotations["occurrences"] == "2"
    resolved = replace(a, state=AlertState.RESOLVED, ends_at=5.0)
    box.enqueue("n", [resolved])
    box.enqueue("n", [a])  # fires again after resolving: a third entry
    assert [x.state for x in box.queued("n")] == [AlertState.FIRING, AlertState.RESOLVED,
                                                 AlertState.FIRING]



def test_a_burst_written_together_coalesces_like_one_by_one():
    # several alerts at once take the batched path (one read, one round trip each for
    # updates and inserts): the queue must be what enqueueing them one by one gives
    together, alone = Outbox(clock=FakeClock()), Outbox(clock=FakeClock())
    a, b, c = alerts(3)
    rounds = [[a, b],
              [replace(a, annotations={**a.annotations, "occurrences": "2"}),
               replace(b, state=AlertState.RESOLVED, ends_at=5.0), c],
              [b, replace(c, annotations={**c.annotations, "occurrences": "3"})]]
    for batch in rounds:
        together.enqueue("n", batch)
        for alert in batch:
            alone.enqueue("n", [alert])
    got = [(x.labels["entity"], x.state, x.annotations["occurrences"])
           for x in together.queued("n")]
    assert got == [(x.labels["entity"], x.state, x.annotations["occurrences"])
                   for x in alone.queued("n")]
    assert got == [("GPU-0", AlertState.FIRING, "2"), ("GPU-1", AlertState.FIRING, "1"),
                   ("GPU-1", AlertState.RESOLVED, "1"), ("GPU-2", AlertState.FIRING, "3"),
                   ("GPU-1", AlertState.FIRING, "1")]

def test_bound_drops_oldest_and_counts(caplog):
    box = Outbox(clock=FakeClock(), max_per_notifier=3)
    assert box.enqueue("n", alerts(5)) == 2
    assert [a.labels["entity"] for a in box.queued("n")] == ["GPU-2", "GPU-3", "GPU-4"]
    assert box.dropped == {"n": 2}
    assert "full" in caplog.text


def test_survives_a_restart(tmp_path):
    path = str(tmp_path / "outbox.sqlite")
    box = Outbox(path=path, clock=FakeClock())
    box.enqueue("n", alerts(2))
    box.close()
    again = Outbox(path=path, clock=FakeClock())
    rec = RecordingNotifier(name="n")
    deliver(again, rec)
    assert len(rec.sent) == 2
    assert again.depths() == {}


class Many:
    name = "many"

    def __init__(self):
        self.batches = []

    async def send(self, alert):
        raise AssertionError("send_many is preferred")

    async def send_many(self, batch):
        self.batches.append(len(batch))


def test_batches_for_send_many_and_force():
    clock = FakeClock(now=0)
    box = Outbox(clock=clock, batch_size=2)
    many = Many()
    box.enqueue(many.name, alerts(5))
    deliver(box, many)
    assert many.batches == [2, 2, 1]
    rec = RecordingNotifier()
    rec.inject_error(NotifierUnavailable("down"))
    box.enqueue(rec.name, alerts(1))
    deliver(box, rec)
    deliver(box, rec, force=True)  # ignores the backoff
    assert len(rec.sent) == 1


class PickyMany:
    name = "picky"

    def __init__(self):
        self.got = []

    async def send(self, alert):
        if alert.labels["entity"] == "GPU-1":
            raise PermanentError("400 bad label")
        self.got.append(alert.labels["entity"])

    async def send_many(self, batch):
        if any(a.labels["entity"] == "GPU-1" for a in batch):
            raise PermanentError("400 bad label")
        self.got.extend(a.labels["entity"] for a in batch)


def test_a_refused_batch_is_retried_one_by_one_and_only_the_bad_alert_dropped():
    box = Outbox(clock=FakeClock())
    picky = PickyMany()
    box.enqueue(picky.name, alerts(4))
    stats = deliver(box, picky)
    assert picky.got == ["GPU-0", "GPU-2", "GPU-3"]
    assert stats.dropped == {"picky": 1}
    assert box.depths() == {}


def test_while_the_database_is_away_notifications_wait_in_memory_in_order(monkeypatch, caplog):
    from contextlib import contextmanager

    from core.errors import TemporaryError

    box = Outbox(clock=FakeClock(), max_per_notifier=4)
    real = box.db.transaction
    down = [True]

    @contextmanager
    def flaky(**kw):
        if down[0]:
            raise TemporaryError("PostgreSQL db:5432/fleet: connection refused")
        with real(**kw) as db:
            yield db

    monkeypatch.setattr(box.db, "transaction", flaky)
    batch = alerts(6)
    assert box.enqueue("n", batch[:3]) == 0
    assert box.enqueue("n", batch[3:]) == 2  # the bound holds in memory too
    assert box.unsaved() == 4
    assert caplog.text.count("wait in memory") == 1  # logged once
    rec = RecordingNotifier(name="n")
    assert deliver(box, rec).sent == {}
    down[0] = False
    assert deliver(box, rec).sent == {"n": 4}
    assert [a.labels["entity"] for a in rec.sent] == ["GPU-2", "GPU-3", "GPU-4", "GPU-5"]
    assert box.unsaved() == 0
    assert "reachable again" in caplog.text
    box.close()


def test_a_backlog_gives_the_loop_back_between_batches():
    # A controller delivers on its consumer's loop: a backlog (3,500 alerts after a
    # fail-over) must let other tasks run between its batches, whatever the notifier.
    from alerting.log import LogNotifier

    box = Outbox(clock=FakeClock(), batch_size=10)
    log = LogNotifier()
    box.enqueue(log.name, alerts(50))
    depths: list[int] = []

    async def beside() -> None:
        while True:
            depths.append(box.depths().get(log.name, 0))
            await asyncio.sleep(0)

    async def main() -> None:
        other = asyncio.create_task(beside())
        await asyncio.sleep(0)
        await box.deliver({log.name: log})
        other.cancel()

    asyncio.run(main())
    assert box.depths() == {}
    assert {40, 30, 20, 10} <= set(depths)  # the other task ran between the batches
