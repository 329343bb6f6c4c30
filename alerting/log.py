"""A notifier that writes one log line per alert (entry point ``log``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from core.records import Alert, AlertState

logger = logging.getLogger(__name__)


class LogNotifier:
    """Logs each alert as one line: WARNING while firing, INFO when resolved.

    Useful as the default notifier of ``gpuhealth run`` and ``replay``; it never
    fails.
    """

    name = "log"

    def __init__(self) -> None:
        pass

    async def send(self, alert: Alert) -> None:
        """Log ``alert`` as one line."""
        labels = alert.labels
        level = logging.INFO if alert.state == AlertState.RESOLVED else logging.WARNING
        logger.log(
            level,
            "alert %s %s %s node=%s entity=%s action=%s fingerprint=%s: %s",
            alert.state.value,
            labels.get("alertname", "?"),
            labels.get("severity", "?"),
            labels.get("node", "?"),
            labels.get("entity", "?"),
            alert.annotations.get("action", "?"),
            alert.fingerprint,
            alert.annotations.get("summary", ""),
        )

    async def send_many(self, alerts: Sequence[Alert]) -> None:
        """Log each of ``alerts`` as one line (the outbox hands a batch in one round)."""
        for alert in alerts:
            await self.send(alert)
