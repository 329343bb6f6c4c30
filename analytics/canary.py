"""Driver and firmware canaries: does the new version fail more often than the fleet?

A new driver or firmware is rolled out to a subset of nodes first; the question that
stops a bad roll-out is whether that cohort fails significantly more often than the
rest. :class:`CanaryWatch` answers it continuously on the controller, from what it
already has: each agent's ``[inventory]`` facts (``driver_version``, or any attribute:
``vbios``, ``firmware``), its GPUs and when it was first seen (the exposure, GPU-hours in
the window) and the findings of ``major`` or worse on GPUs (the failures, each counted
once). The newest version (the one first seen most recently) is the candidate, every
other version together the baseline; their rate ratio has an exact interval and p-value
(:func:`analytics.reliability.rate_ratio`, Breslow & Day 1987).

Verdicts: **no-go** when the lower limit of the ratio's interval is above 1 (the canary
fails significantly more often); it is a fleet finding (kind ``driver_regression``,
node ``fleet``, ``major``, action none: it alerts and pages, never a step) naming the
version, the ratio, its interval and the counts, for as long as it holds. **go** when
the candidate has at least ``min_hours`` of exposure and is not worse; **wait** before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from core.records import NODE_ENTITY, Action, EntityId, Evidence, Finding, NodeName, Severity

CANARY_KIND = "driver_regression"
IGNORED = frozenset({"fleet", "agent", "gpuhealth", "prediction", "anomaly", CANARY_KIND})


@dataclass(frozen=True, slots=True, kw_only=True)
class CanaryVerdict:
    """One comparison of the candidate version with the rest of the fleet.

    Attributes:
        attribute: The fact compared (``driver_version``).
        candidate: The newest version.
        verdict: ``no-go``, ``go`` or ``wait``.
        failures: ``(candidate, baseline)`` failures in the window.
        gpu_hours: ``(candidate, baseline)`` exposure in the window.
        ratio, lower, upper, p_value: The rate ratio and its exact interval and p-value
            (``None`` where undefined).
    """

    attribute: str
    candidate: str
    verdict: str
    failures: tuple[int, int]
    gpu_hours: tuple[float, float]
    ratio: float | None
    lower: float | None
    upper: float | None
    p_value: float | None


class CanaryWatch:
    """Compare the newest version's failure rate with the rest's (module docstring).

    Args:
        attribute: The fact that names the version.
        window_seconds: The comparison window, seconds (a week by default).
        confidence: Level of the ratio's interval, in (0, 1).
        min_hours: Candidate GPU-hours before a ``go`` is said.

    Raises:
        ValueError: A window or confidence out of range.
    """

    def __init__(self, *, attribute: str = "driver_version", window_seconds: float = 7 * 86400,
                 confidence: float = 0.95, min_hours: float = 1000.0) -> None:
        if window_seconds <= 0 or not 0 < confidence < 1:
            raise ValueError("window_seconds must be > 0 and confidence in (0, 1)")
        self.attribute = attribute
        self.window_seconds = window_seconds
        self.confidence = confidence
        self.min_hours = min_hours
        self._failures: dict[tuple[str, str, str, str], tuple[str, float]] = {}

    def update(self, *, facts: Mapping[str, Mapping[str, str]], gpus: Mapping[str, int],
               first_seen: Mapping[str, float], findings: Iterable[Finding],
               now: float) -> tuple[CanaryVerdict | None, Finding | None]:
        """Account for the fleet now; return the verdict and the no-go finding, if any.

        Args:
            facts: Per node, its agent's facts.
            gpus: Per node, its number of GPUs.
            first_seen: Per node, when its agent was first seen (epoch seconds).
            findings: The controller's current findings.
            now: Epoch seconds.
        """
        start = now - self.window_seconds
        for f in findings:
            if (f.severity.rank >= Severity.MAJOR.rank and f.kind not in IGNORED
                    and f.entity != NODE_ENTITY):
                self._failures.setdefault(f.key, (str(f.node), now))
        self._failures = {k: v for k, v in self._failures.items() if v[1] >= start}
        version = {n: f.get(self.attribute, "") for n, f in facts.items()}
        hours: dict[str, float] = {}
        newest: dict[str, float] = {}
        for node, v in version.items():
            if not v:
                continue
            since = max(first_seen.get(node, now), start)
            hours[v] = hours.get(v, 0.0) + gpus.get(node, 0) * max(0.0, now - since) / 3600
            newest[v] = min(newest.get(v, float("inf")), first_seen.get(node, now))
        if len(hours) < 2:
            return None, None
        candidate = max(newest, key=lambda v: newest[v])
        t1 = hours[candidate]
        t2 = sum(h for v, h in hours.items() if v != candidate)
        counts = [version.get(node, "") for node, _ in self._failures.values()]
        r1 = sum(1 for v in counts if v == candidate)
        r2 = sum(1 for v in counts if v and v != candidate)
        if t1 <= 0 or t2 <= 0:
            return None, None
        from analytics.reliability import rate_ratio  # scipy: on the controller only

        ratio, lower, upper, p_value = rate_ratio(r1, t1, r2, t2, self.confidence)
        if lower is not None and lower > 1:
            verdict = "no-go"
        elif t1 >= self.min_hours:
            verdict = "go"
        else:
            verdict = "wait"
        result = CanaryVerdict(attribute=self.attribute, candidate=candidate, verdict=verdict,
                               failures=(r1, r2), gpu_hours=(t1, t2), ratio=ratio,
                               lower=lower, upper=upper, p_value=p_value)
        return result, self._finding(result, now) if verdict == "no-go" else None

    def _finding(self, v: CanaryVerdict, now: float) -> Finding:
        level = round(self.confidence * 100)
        upper = f"{v.upper:.1f}" if v.upper is not None else "inf"
        ratio = f"{v.ratio:.1f}x" if v.ratio is not None else "more (none elsewhere)"
        summary = (f"{self.attribute} {v.candidate} fails {ratio} as often as the rest of "
                   f"the fleet ({level}% interval {v.lower:.1f}-{upper}, p={v.p_value:.2g}; "
                   f"{v.failures[0]} failures in {v.gpu_hours[0]:.0f} GPU-hours against "
                   f"{v.failures[1]} in {v.gpu_hours[1]:.0f}): no-go, stop the roll-out")
        return Finding(
            node=NodeName("fleet"), entity=EntityId(f"{self.attribute}:{v.candidate}"),
            kind=CANARY_KIND, code=self.attribute, severity=Severity.MAJOR,
            action=Action.NONE, summary=summary,
            evidence=(Evidence(file="controller", line=None, text=summary),),
            source="analytics.canary: exact conditional rate ratio (Breslow & Day 1987)",
            first_seen_at=now, last_seen_at=now)
