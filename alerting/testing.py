"""Fakes for notifier users and plugin authors (style.md C.3.16b).

:class:`RecordingNotifier` records every alert it is sent and fails on demand:
``inject_error(exc, times=n)`` makes the next ``n`` sends raise ``exc`` (a
:class:`~core.errors.NotifierUnavailable` for an outage, a
:class:`~core.errors.PermanentError` for a rejection); ``times=None`` fails until
:meth:`RecordingNotifier.clear_error`.
"""

from __future__ import annotations

from core.records import Alert


class RecordingNotifier:
    """A notifier that keeps what it is sent and fails when told to.

    Args:
        name: The notifier name (outbox queues are per name).
    """

    def __init__(self, *, name: str = "recording") -> None:
        self.name = name
        self.sent: list[Alert] = []
        self.attempts = 0
        self._error: Exception | None = None
        self._times: int | None = None

    def inject_error(self, exc: Exception, *, times: int | None = 1) -> None:
        """Make the next ``times`` sends raise ``exc`` (every send when ``None``)."""
        self._error = exc
        self._times = times

    def clear_error(self) -> None:
        """Stop failing."""
        self._error = None
        self._times = None

    async def send(self, alert: Alert) -> None:
        """Record ``alert``, or raise the injected error."""
        self.attempts += 1
        if self._error is not None:
            error = self._error
            if self._times is not None:
                self._times -= 1
                if self._times <= 0:
                    self.clear_error()
            raise error
        self.sent.append(alert)
