"""Injectable clocks, so that tests never sleep (style.md C.3.16e)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Returns the current time in epoch seconds (UTC)."""

    def __call__(self) -> float:
        """Return now, epoch seconds."""
        ...


def system_clock() -> float:
    """Return the wall-clock time, epoch seconds."""
    return time.time()


class FakeClock:
    """A clock that moves only when told to.

    Examples:
        >>> clock = FakeClock(now=100.0)
        >>> clock.advance(5)
        >>> clock()
        105.0
    """

    def __init__(self, *, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        """Return the fake now."""
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds
