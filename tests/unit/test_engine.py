from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given
from hypothesis import strategies as st

from analytics.fault_model import Context, Observations, evaluate, merge_findings, worst
from analytics.fault_model.engine import MAX_EVIDENCE
from core.records import Action, EntityId, Event, Evidence, Finding, NodeName, Severity

N, E = NodeName("n1"), EntityId("0000:b1:00.0")


def finding(sev: Severity, action: Action, code: str = "79", at: float | None = 1.0,
            line: int = 1) -> Finding:
    return Finding(node=N, entity=E, kind="xid", code=code, severity=sev, action=action,
                   summary="s", evidence=(Evidence(file="f", line=line, text=f"l{line}"),),
                   source="test", first_seen_at=at, last_seen_at=at)


def test_worst_of_nothing_is_info_none() -> None:
    assert worst([]) == (Severity.INFO, [Action.NONE])


def test_worst_actions_are_sorted_unique_and_only_of_the_worst_severity() -> None:
    findings = [
        finding(Severity.CRITICAL, Action.RESET_GPU, "62"),
        finding(Severity.CRITICAL, Action.REBOOT_NODE, "79"),
        finding(Severity.CRITICAL, Action.RESET_GPU, "120"),
        finding(Severity.WARNING, Action.SERVICE_HARDWARE, "63"),
    ]
    assert worst(findings) == (Severity.CRITICAL, [Action.REBOOT_NODE, Action.RESET_GPU])


def test_same_fault_merges_into_one_finding_spanning_both_times() -> None:
    merged = merge_findings([
        finding(Severity.WARNING, Action.RESET_GPU, at=10.0, line=1),
        finding(Severity.CRITICAL, Action.RESET_GPU, at=5.0, line=2),
    ])
    assert len(merged) == 1
    only = merged[0]
    assert only.severity is Severity.CRITICAL
    assert (only.first_seen_at, only.last_seen_at, only.occurrences) == (5.0, 10.0, 2)
    assert [e.line for e in only.evidence] == [1, 2]


@given(st.lists(st.integers(1, 10_000), max_size=200))
def test_event_groups_count_exactly_and_keep_bounded_evidence(lines: list[int]) -> None:
    obs = Observations()
    for i, line in enumerate(lines):
        obs.add(Event(kind="xid", code="119", node=N, entity=E, observed_at=float(i),
                      evidence=(Evidence(file="f", line=line, text="x"),)))
    groups = obs.events("xid", "119")
    if not lines:
        assert groups == []
        return
    (group,) = groups
    assert group.count == len(lines)
    assert group.first_seen_at == 0.0
    assert group.last_seen_at == float(len(lines) - 1)
    assert len(group.evidence) <= MAX_EVIDENCE
    assert group.evidence[0].line == lines[0]


def test_evaluate_runs_given_rules_and_sorts_worst_first() -> None:
    def rule(obs: Observations, ctx: Context) -> Iterable[Finding]:
        yield finding(Severity.WARNING, Action.RESET_GPU, "94")
        if ctx.fact("nvlink") == "expected":
            yield finding(Severity.MAJOR, Action.RESET_GPU, "nvlink")

    out = evaluate(Observations(), Context(facts={"nvlink": "Expected "}), rules=[rule])
    assert [f.code for f in out] == ["nvlink", "94"]
