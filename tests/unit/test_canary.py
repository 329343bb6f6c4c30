"""Driver canaries (#16 item 11): the newest version against the rest, continuously."""

from __future__ import annotations

from analytics.canary import CANARY_KIND, CanaryWatch
from core.records import Action, EntityId, Finding, NodeName, Severity

DAY = 86400.0


def dbe(node: str, gpu: int) -> Finding:
    return Finding(node=NodeName(node), entity=EntityId(f"GPU-{gpu}"), kind="xid", code="48",
                   severity=Severity.CRITICAL, action=Action.SERVICE_HARDWARE,
                   summary="DBE", evidence=(), source="t")


def fleet(canary_nodes: int, rest: int) -> tuple[dict, dict, dict]:  # type: ignore[type-arg]
    facts = {f"old-{i}": {"driver_version": "550.54.15"} for i in range(rest)}
    facts |= {f"new-{i}": {"driver_version": "570.86.10"} for i in range(canary_nodes)}
    first = {n: 0.0 if n.startswith("old") else 3 * DAY for n in facts}
    return facts, dict.fromkeys(facts, 8), first


def test_a_canary_that_fails_far_more_often_is_a_no_go_finding() -> None:
    facts, gpus, first = fleet(canary_nodes=10, rest=90)
    watch = CanaryWatch(window_seconds=7 * DAY)
    failures = [dbe(f"new-{i}", 0) for i in range(6)] + [dbe("old-1", 0), dbe("old-2", 3)]
    verdict, finding = watch.update(facts=facts, gpus=gpus, first_seen=first,
                                    findings=failures, now=7 * DAY)
    assert verdict is not None
    assert (verdict.candidate, verdict.verdict, verdict.failures) == ("570.86.10", "no-go",
                                                                      (6, 2))
    assert verdict.lower is not None
    assert verdict.lower > 1
    assert finding is not None
    assert (finding.kind, finding.entity, finding.severity, finding.action) == (
        CANARY_KIND, "driver_version:570.86.10", Severity.MAJOR, Action.NONE)
    assert "no-go" in finding.summary


def test_a_canary_failing_like_the_rest_is_a_go_and_a_young_one_waits() -> None:
    facts, gpus, first = fleet(canary_nodes=10, rest=90)
    watch = CanaryWatch(window_seconds=7 * DAY, min_hours=1000.0)
    failures = [dbe("new-1", 0)] + [dbe(f"old-{i}", 0) for i in range(20)]
    verdict, finding = watch.update(facts=facts, gpus=gpus, first_seen=first,
                                    findings=failures, now=7 * DAY)
    assert verdict is not None
    assert verdict.verdict == "go"
    assert finding is None
    young = CanaryWatch(window_seconds=7 * DAY, min_hours=10_000.0)
    v2, _ = young.update(facts=facts, gpus=gpus, first_seen=first, findings=[], now=7 * DAY)
    assert v2 is not None
    assert v2.verdict == "wait"


def test_one_version_only_is_no_comparison_and_node_findings_do_not_count() -> None:
    watch = CanaryWatch()
    one = {"a": {"driver_version": "550"}, "b": {"driver_version": "550"}}
    assert watch.update(facts=one, gpus={"a": 8, "b": 8}, first_seen={"a": 0.0, "b": 0.0},
                        findings=[dbe("a", 0)], now=DAY) == (None, None)
