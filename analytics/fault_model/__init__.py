"""The fault model (``docs/fault-model.md``) as rules over observed records.

Records stream into :class:`Observations`, which keeps memory bounded: events are
grouped per ``(node, entity, kind, code)`` with a count, first and last time, the
first few and the last few evidence lines; samples keep their latest value per
series. Rules are pure functions ``(Observations, Context) -> Iterable[Finding]``;
each module under this package exports its rules in a ``RULES`` tuple and cites
its sources. :func:`evaluate` runs all rules, merges findings about the same
ongoing fault (one incident per fault) and sorts them worst first.
"""

from __future__ import annotations

from analytics.fault_model.engine import (
    KNOWN_FACTS,
    Context,
    EventGroup,
    FaultRuleDetector,
    Observations,
    Rule,
    all_rules,
    check_facts,
    evaluate,
    merge_findings,
    worst,
)

__all__ = [
    "KNOWN_FACTS",
    "Context",
    "EventGroup",
    "FaultRuleDetector",
    "Observations",
    "Rule",
    "all_rules",
    "check_facts",
    "evaluate",
    "merge_findings",
    "worst",
]
