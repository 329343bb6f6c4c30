"""What ``/healthz`` answers: whether every stage of the running service works now.

``/healthz`` used to answer ``ok`` whatever happened behind it: a store that lost every
batch, an evaluation that failed on every cycle. :class:`Health` holds two kinds of
evidence:

- failures that the service reports as they happen (:meth:`Health.fail`, called with the
  same key and message the service logs once): a stage counts as failing while its last
  failure is younger than ``stale_seconds``, so a stage that works again clears itself
  without having to say so;
- checks asked at request time (:meth:`Health.check`): the store's, for instance, says
  whether the spool is holding batches because the store cannot take them (the spool
  absorbs those failures, so the service never sees them raise).

:meth:`Health.answer` gives 200 ``gpuhealth: ok`` or 503 with one line per failing stage:
its key, what failed, and for how long. A collector that is merely unavailable (no GPU
driver on this host) is not a failure: the service runs without it by design.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from core.clock import Clock, system_clock

Check = Callable[[], str | None]
"""Returns why a stage is failing now, or ``None`` when it works."""


class Health:
    """The health of the stages of one service, for ``/healthz``.

    Args:
        stale_seconds: How long a reported failure keeps its stage failing (a stage that
            fails on every cycle keeps refreshing it). 120 s covers two of the slowest
            default cycles (the 30 s slow collection, the 60 s evaluation back-off).
        clock: Epoch seconds.
    """

    def __init__(self, *, stale_seconds: float = 120.0, clock: Clock = system_clock) -> None:
        if stale_seconds <= 0:
            raise ValueError(f"stale_seconds must be > 0, got {stale_seconds!r}")
        self.stale_seconds = stale_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._failures: dict[str, tuple[str, float, float]] = {}  # reason, since, last
        self._checks: dict[str, Check] = {}

    def fail(self, stage: str, reason: str) -> None:
        """Note that ``stage`` failed now, for ``reason`` (one line)."""
        now = self.clock()
        with self._lock:
            previous = self._failures.get(stage)
            since = previous[1] if previous and now - previous[2] <= self.stale_seconds else now
            self._failures[stage] = (reason, since, now)

    def check(self, stage: str, check: Check) -> None:
        """Ask ``check`` about ``stage`` at every :meth:`failing` (replaces an earlier one)."""
        with self._lock:
            self._checks[stage] = check

    def failing(self) -> dict[str, str]:
        """Return stage → why it fails now, sorted by stage; empty when all is well.

        Examples:
            >>> from core.clock import FakeClock
            >>> clock = FakeClock(now=1000.0)
            >>> health = Health(stale_seconds=60, clock=clock)
            >>> health.fail("evaluate", "pipeline.evaluate failed: boom")
            >>> clock.advance(10)
            >>> health.failing()
            {'evaluate': 'pipeline.evaluate failed: boom (for 10 s)'}
            >>> clock.advance(61)
            >>> health.failing()
            {}
        """
        now = self.clock()
        out: dict[str, str] = {}
        with self._lock:
            for stage, (reason, since, last) in self._failures.items():
                if now - last <= self.stale_seconds:
                    out[stage] = f"{reason} (for {now - since:.0f} s)"
            checks = list(self._checks.items())
        for stage, check in checks:
            try:
                found = check()
            except Exception as exc:  # a broken check is a failing stage, not a crash
                found = f"health check failed: {exc}"
            if found:
                out[stage] = found
        return dict(sorted(out.items()))

    def answer(self) -> tuple[int, bytes]:
        r"""Return the HTTP status and text body of ``/healthz``.

        Examples:
            >>> Health().answer()
            (200, b'gpuhealth: ok\n')
            >>> health = Health()
            >>> health.check("store", lambda: "http://tsdb:8428: HTTP 404 Not Found")
            >>> health.answer()
            (503, b'gpuhealth: failing\nstore: http://tsdb:8428: HTTP 404 Not Found\n')
        """
        failing = self.failing()
        if not failing:
            return 200, b"gpuhealth: ok\n"
        lines = ["gpuhealth: failing", *(f"{stage}: {why}" for stage, why in failing.items())]
        return 503, ("\n".join(" ".join(line.split()) for line in lines) + "\n").encode()
