"""Site policy rules over findings: ``[[policy.rule]]`` (per code, count and window, overrides).

The fault model says what a finding means; a site decides what it does about it. The EKS
node monitoring agent's users asked for "Xid 43 three times in 10 minutes" (its issue
#272), NHC sites keep per-check thresholds, and every fleet has a code it has learned to
ignore on one hardware generation. A :class:`SiteRule` matches findings by kind, code,
an entity pattern and a node pattern (``fnmatch``), and then does one of:

- ``ignore``: the finding is dropped (neither alerted nor remediated; it stays in
  ``diagnose``, which does not apply site rules);
- ``count`` within ``window_seconds``: the finding is held back until it has occurred
  that many times within the window (its occurrences counted at their last-seen times);
- ``severity`` / ``action``: override the fault model's;
- ``sticky``: once it passed, the finding stays open after its evidence is gone, until
  a person clears it (``gpuhealth mark-healthy``) — for faults that must never clear on
  a quiet log.

The first rule that matches a finding applies (file order). A finding a rule changed
says so in its ``source`` (``policy rule 'xid43-repeat': severity major -> critical``),
and remediation names the rule in its audit record.
"""

from __future__ import annotations

import fnmatch
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from core.records import Action, Finding, Severity

RULE_NOTE = "policy rule "
"""How a rule's note starts in a finding's ``source`` (``; policy rule 'name': ...``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SiteRule:
    """One ``[[policy.rule]]`` (module docstring).

    Attributes:
        name: Unique name, shown in findings and audit records.
        kind: Finding kind to match (``xid``), or ``None`` for any.
        code: Code to match (``43``), or ``None`` for any.
        entity: ``fnmatch`` pattern of the entity (``GPU-*``, ``mlx5_*``).
        nodes: ``fnmatch`` pattern of the node (``gpu-a*``).
        count: Occurrences needed within ``window_seconds`` before the finding counts, >= 1.
        window_seconds: The window of ``count``, seconds (``None``: ever).
        severity: Severity override, or ``None``.
        action: Action override, or ``None``.
        sticky: Keep the finding open until a person clears it.
        ignore: Drop matching findings.
    """

    name: str
    kind: str | None = None
    code: str | None = None
    entity: str = "*"
    nodes: str = "*"
    count: int = 1
    window_seconds: float | None = None
    severity: Severity | None = None
    action: Action | None = None
    sticky: bool = False
    ignore: bool = False

    def matches(self, finding: Finding) -> bool:
        """Whether the rule applies to ``finding``."""
        return ((self.kind is None or finding.kind == self.kind)
                and (self.code is None or finding.code == self.code)
                and fnmatch.fnmatchcase(finding.entity, self.entity)
                and fnmatch.fnmatchcase(finding.node, self.nodes))


def pattern_problem(pattern: str) -> str:
    """Why the ``fnmatch`` pattern ``pattern`` can match no node or entity, or ``""``.

    An empty pattern matches only an empty name, and a ``[`` without its ``]``
    (``gpu-[a``) is taken literally by ``fnmatch``: both are typing mistakes.

    Examples:
        >>> pattern_problem("gpu-[a-c]*")
        ''
        >>> pattern_problem("gpu-[a")
        "unclosed '[' in pattern 'gpu-[a'"
    """
    if not pattern.strip():
        return "empty pattern (write '*' for any)"
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                return f"unclosed '[' in pattern {pattern!r}"
            i = j
        i += 1
    return ""


Key = tuple[str, str, str, str]


class SiteRules:
    """Apply site rules to each evaluation's findings (stateful: counts, sticky findings).

    Args:
        rules: The rules, in file order (the first match applies).
    """

    def __init__(self, rules: Sequence[SiteRule]) -> None:
        self.rules = tuple(rules)
        self._seen: dict[Key, tuple[int, deque[float]]] = {}
        self._sticky: dict[Key, Finding] = {}

    def __bool__(self) -> bool:
        return bool(self.rules)

    def apply(self, findings: Iterable[Finding], *, now: float) -> list[Finding]:
        """Return the findings as the site's rules want them (module docstring).

        Args:
            findings: The current findings, after the fault model.
            now: Epoch seconds (an occurrence without a time counts now).
        """
        out: list[Finding] = []
        current: set[Key] = set()
        for f in findings:
            rule = next((r for r in self.rules if r.matches(f)), None)
            if rule is None:
                out.append(f)
                continue
            current.add(f.key)
            if rule.ignore:
                continue
            if rule.count > 1 and not self._counted(rule, f, now):
                continue
            changed = self._override(rule, f)
            if rule.sticky:
                self._sticky[f.key] = changed
            out.append(changed)
        self._seen = {k: v for k, v in self._seen.items() if k in current}
        out.extend(f for k, f in self._sticky.items() if k not in current)
        return out

    def clear(self, keys: Iterable[Key]) -> list[Key]:
        """Forget sticky findings (a person marked them healthy); return the keys cleared."""
        return [k for k in keys if self._sticky.pop(k, None) is not None]

    @property
    def sticky(self) -> list[Finding]:
        """The sticky findings held open now."""
        return list(self._sticky.values())

    def _counted(self, rule: SiteRule, f: Finding, now: float) -> bool:
        seen, times = self._seen.get(f.key, (0, deque()))
        at = f.last_seen_at if f.last_seen_at is not None else now
        for _ in range(max(0, f.occurrences - seen)):
            times.append(at)
        if rule.window_seconds is not None:
            while times and times[0] < at - rule.window_seconds:
                times.popleft()
        self._seen[f.key] = (max(seen, f.occurrences), times)
        return len(times) >= rule.count

    @staticmethod
    def _override(rule: SiteRule, f: Finding) -> Finding:
        notes: list[str] = []
        severity, action = f.severity, f.action
        if rule.severity is not None and rule.severity != f.severity:
            notes.append(f"severity {f.severity.value} -> {rule.severity.value}")
            severity = rule.severity
        if rule.action is not None and rule.action != f.action:
            notes.append(f"action {f.action.value} -> {rule.action.value}")
            action = rule.action
        if rule.count > 1:
            window = (f" within {rule.window_seconds:.0f} s" if rule.window_seconds is not None
                      else "")
            notes.append(f"{rule.count} occurrences{window}")
        if rule.sticky:
            notes.append("sticky until marked healthy")
        note = f"{RULE_NOTE}{rule.name!r}: {', '.join(notes) or 'matched'}"
        return replace(f, severity=severity, action=action, source=f"{f.source}; {note}")


def rule_notes(finding: Finding) -> list[str]:
    """The site-rule notes in a finding's ``source`` (what changed it, for the audit record)."""
    return [part for part in finding.source.split("; ") if part.startswith(RULE_NOTE)]
