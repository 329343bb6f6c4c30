"""Alerting: findings to alerts, the alert lifecycle, and notifiers.

:mod:`alerting.alerts` turns findings into labelled, fingerprinted alerts and
keeps their lifecycle (:class:`AlertTracker`); :mod:`alerting.log` and
:mod:`alerting.webhook` deliver them (entry-point group ``gpuhealth.notifiers``).
"""

from __future__ import annotations

from alerting.alerts import (
    AlertTracker,
    alert_annotations,
    alert_for,
    alert_labels,
    alert_name,
    alert_to_json,
    fingerprint,
)
from alerting.log import LogNotifier
from alerting.webhook import WebhookNotifier

__all__ = [
    "AlertTracker",
    "LogNotifier",
    "WebhookNotifier",
    "alert_annotations",
    "alert_for",
    "alert_labels",
    "alert_name",
    "alert_to_json",
    "fingerprint",
]
