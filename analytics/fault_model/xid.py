"""Fault-model rules: xid (filled in by its owner)."""

from __future__ import annotations

from analytics.fault_model.engine import Rule

RULES: tuple[Rule, ...] = ()
