"""Alerting: findings to alerts, the alert lifecycle, routing and notifiers.

:mod:`alerting.alerts` turns findings into labelled, fingerprinted alerts and
keeps their lifecycle (:class:`AlertTracker`: pending, firing, resolved, with a
policy per fault class); :mod:`alerting.router` mutes alerts by inhibition and
groups them into pages; :mod:`alerting.silences` keeps silences with
Alertmanager-style matchers; :mod:`alerting.outbox` is the durable, bounded
outbox every notification goes through; :mod:`alerting.log`,
:mod:`alerting.webhook`, :mod:`alerting.alertmanager` and
:mod:`alerting.pagerduty` deliver them (entry-point group ``gpuhealth.notifiers``);
:mod:`alerting.promrules` exports the same alerts as a Prometheus rule file.
"""

from __future__ import annotations

from alerting.alertmanager import AlertmanagerNotifier
from alerting.alerts import (
    FIRST_SIGHT,
    AlertPolicy,
    AlertTracker,
    alert_annotations,
    alert_for,
    alert_from_json,
    alert_labels,
    alert_name,
    alert_to_json,
    finding_from_prediction,
    fingerprint,
    policy_for,
)
from alerting.log import LogNotifier
from alerting.outbox import Outbox
from alerting.pagerduty import PagerDutyNotifier
from alerting.promrules import render_rules
from alerting.router import (
    DEFAULT_INHIBIT_RULES,
    Inhibitor,
    InhibitRule,
    PageGrouper,
    inhibited,
)
from alerting.silences import Matcher, Silence, SilenceStore, parse_matcher, parse_matchers
from alerting.webhook import WebhookNotifier, WebhookVerifier

__all__ = [
    "DEFAULT_INHIBIT_RULES",
    "FIRST_SIGHT",
    "AlertPolicy",
    "AlertTracker",
    "AlertmanagerNotifier",
    "InhibitRule",
    "Inhibitor",
    "LogNotifier",
    "Matcher",
    "Outbox",
    "PageGrouper",
    "PagerDutyNotifier",
    "Silence",
    "SilenceStore",
    "WebhookNotifier",
    "WebhookVerifier",
    "alert_annotations",
    "alert_for",
    "alert_from_json",
    "alert_labels",
    "alert_name",
    "alert_to_json",
    "finding_from_prediction",
    "fingerprint",
    "inhibited",
    "parse_matcher",
    "parse_matchers",
    "policy_for",
    "render_rules",
]
