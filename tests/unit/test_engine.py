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


def test_symptoms_fold_into_their_root_on_the_same_gpu_only_when_the_root_covers_them() -> None:
    from dataclasses import replace

    from analytics.fault_model.engine import fold_symptoms

    root = finding(Severity.CRITICAL, Action.RESET_GPU, "62", at=100.0, line=1)
    summary_154 = replace(finding(Severity.CRITICAL, Action.RESET_GPU, "154", at=100.0, line=2))
    late_154 = replace(summary_154, first_seen_at=10_000.0, last_seen_at=10_000.0)
    reboot_154 = replace(summary_154, action=Action.REBOOT_NODE)
    other_gpu = replace(summary_154, entity=EntityId("0000:07:00.0"))

    folded = fold_symptoms([root, summary_154])
    assert [f.code for f in folded] == ["62"]
    assert [e.line for e in folded[0].evidence] == [1, 2]
    assert folded[0].last_seen_at == 100.0
    # too late, a stronger action, another GPU: nothing is hidden
    assert len(fold_symptoms([root, late_154])) == 2
    assert len(fold_symptoms([root, reboot_154])) == 2
    assert len(fold_symptoms([root, other_gpu])) == 2


def test_a_pending_remap_absorbs_the_xid_63_that_announced_it() -> None:
    from dataclasses import replace

    from analytics.fault_model.engine import fold_symptoms

    xid63 = finding(Severity.WARNING, Action.RESET_GPU, "63", at=None, line=1)
    pending = replace(xid63, kind="row_remap", code="pending",
                      evidence=(Evidence(file="f", line=9, text="Pending : Yes"),))
    (only,) = fold_symptoms([xid63, pending])
    assert (only.kind, only.code) == ("row_remap", "pending")
    assert {e.line for e in only.evidence} == {1, 9}


def test_events_not_seen_again_expire_but_snapshots_never_do() -> None:
    obs = Observations()
    obs.add(Event(kind="xid", code="79", node=N, entity=E, observed_at=100.0))
    obs.add(Event(kind="xid", code="94", node=N, entity=E, observed_at=900.0))
    obs.add(Event(kind="row_remap", code="pending", node=N, entity=E, observed_at=None))
    assert obs.expire(before_at=500.0) == 1
    assert sorted(g.code for g in obs.groups.values()) == ["94", "pending"]


def test_an_old_line_received_now_stays_open_a_window_from_now() -> None:
    obs = Observations()
    obs.add(Event(kind="xid", code="79", node=N, entity=E, observed_at=100.0), received_at=5000.0)
    assert obs.expire(before_at=4000.0) == 0
    assert obs.expire(before_at=6000.0) == 1
