"""Incremental alert evaluation (#18 item 4): the same results as the stateless path, and
work in proportion to what changed, counted (match calls, findings folded, alerts built),
never timed."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import alerting.alerts as alerts_module
import analytics.fault_model.engine as engine
from alerting.alerts import AlertTracker, fingerprint
from alerting.router import DEFAULT_INHIBIT_RULES, Inhibitor, PageGrouper, inhibited
from core.clock import FakeClock
from core.records import (
    Action,
    Alert,
    AlertState,
    EntityId,
    Evidence,
    Finding,
    NodeName,
    Severity,
)

# Kinds and codes that exercise every fold (symptoms and roots on the same GPU).
_KINDS = [
    ("xid", "154", Severity.WARNING, Action.RESET_GPU),
    ("xid", "79", Severity.CRITICAL, Action.REBOOT_NODE),
    ("xid", "63", Severity.WARNING, Action.RESET_GPU),
    ("row_remap", "pending", Severity.MAJOR, Action.RESET_GPU),
    ("row_remap", "failure", Severity.CRITICAL, Action.SERVICE_HARDWARE),
    ("ecc", "dram_uncorrectable", Severity.WARNING, Action.RESET_GPU),
    ("xid", "94", Severity.MAJOR, Action.RESET_GPU),
    ("xid", "48", Severity.CRITICAL, Action.RESET_GPU),
    ("xid", "64", Severity.WARNING, Action.RESET_GPU),
    ("gpu_lost", "fallen_off_bus", Severity.CRITICAL, Action.REBOOT_NODE),
    ("throttle", "thermal", Severity.INFO, Action.NONE),
]


def _finding(rng: random.Random, nodes: int, gpus: int) -> Finding:
    kind, code, severity, action = rng.choice(_KINDS)
    if rng.random() < 0.2:
        severity = rng.choice(list(Severity))
    first = rng.choice([None, 100.0, 150.0, 200.0, 400.0])
    return Finding(
        node=NodeName(f"n{rng.randrange(nodes)}"), entity=EntityId(f"GPU-{rng.randrange(gpus)}"),
        kind=kind, code=code, severity=severity, action=action, summary=f"{kind} {code}",
        evidence=(Evidence(file="kern.log", line=rng.randrange(5), text=f"{kind} {code}"),),
        source="test", first_seen_at=first,
        last_seen_at=None if first is None else first + rng.randrange(100),
        occurrences=rng.randrange(1, 4),
    )


def _reference(found: list[Finding]) -> list[Finding]:
    return engine.merge_findings(engine.fold_symptoms(engine.merge_findings(found)))


@pytest.mark.parametrize("chunk", [2, 256])
def test_folder_matches_the_stateless_path_on_random_sequences(
        chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine._SortedFindings, "CHUNK", chunk)  # 2: chunks split and empty
    rng = random.Random(20261202)
    for trial in range(60):
        nodes, gpus = rng.randrange(1, 30), rng.randrange(1, 4)
        folder = engine.FindingFolder()
        size = rng.randrange(0, 40) if trial % 2 else rng.randrange(100, 300)
        found = [_finding(rng, nodes, gpus) for _ in range(size)]
        for step in range(12):
            if trial % 3 == 0:  # one finding per fault: the identity comparison is used
                found = list({f.key: f for f in found}.values())
            assert folder.fold(found) == _reference(found), (trial, step)
            found = list(found)
            for _ in range(rng.randrange(0, 6)):  # change, add, remove, duplicate
                roll = rng.random()
                if roll < 0.3 and found:
                    i = rng.randrange(len(found))
                    found[i] = replace(found[i], occurrences=found[i].occurrences + 1,
                                       severity=rng.choice(list(Severity)))
                elif roll < 0.6:
                    found.insert(rng.randrange(len(found) + 1), _finding(rng, nodes, gpus))
                elif roll < 0.8 and found:
                    del found[rng.randrange(len(found))]
                elif found:
                    found.append(rng.choice(found))
            if rng.random() < 0.3:  # fresh but equal objects, as rules make them
                found = [replace(f) for f in found]


def test_many_changes_at_once_match_too() -> None:
    rng = random.Random(7)
    folder = engine.FindingFolder()
    found = [_finding(rng, 40, 8) for _ in range(600)]
    for _ in range(5):
        assert folder.fold(found) == _reference(found)
        found = [replace(f, occurrences=f.occurrences + 1) if rng.random() < 0.4 else f
                 for f in found if rng.random() < 0.95] + [_finding(rng, 40, 8)
                                                            for _ in range(50)]
    assert folder.moved > len(found) // 4  # the re-sort path ran


def _fleet(count: int) -> list[Finding]:
    out = []
    for i in range(count):
        kind, code, severity, action = _KINDS[i % 9]
        node, gpu = divmod(i, 8)
        out.append(Finding(
            node=NodeName(f"gpu-{node:05d}"), entity=EntityId(f"GPU-{gpu}"), kind=kind,
            code=code, severity=severity, action=action, summary="s", evidence=(),
            source="test", first_seen_at=1.0, last_seen_at=1.0))
    return out


def test_one_changed_finding_among_10000_folds_only_its_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    matches = engine._matches

    def counting(finding: Finding, kind: str, code: str | None) -> bool:
        nonlocal calls
        calls += 1
        return matches(finding, kind, code)

    monkeypatch.setattr(engine, "_matches", counting)
    found = _fleet(10_000)
    folder = engine.FindingFolder()
    first = folder.fold(found)
    cold = calls
    assert cold >= 10_000 * len(engine.FOLDS)  # every finding is tried against every fold
    changed = list(found)
    changed[5_001] = replace(changed[5_001], occurrences=2)
    calls = 0
    again = folder.fold(changed)
    incremental = calls
    assert folder.folded == 1  # GPU-1 of gpu-00625 has one finding: only it is folded again
    assert incremental <= 2 * len(engine.FOLDS)  # against >= 50,000 when folded whole
    assert folder.moved == 2  # its old self out of the sorted result, its new self in
    calls = 0
    assert folder.fold(changed) == again
    assert calls == 0
    assert folder.folded == 0
    assert again == _reference(changed)
    assert len(first) == len(again)


def test_evaluate_keeps_a_folder_per_observations() -> None:
    found = _fleet(100)
    obs = engine.Observations()
    ctx = engine.Context()
    assert engine.evaluate(obs, ctx, [lambda o, c: found]) == _reference(found)
    found[3] = replace(found[3], severity=Severity.CRITICAL)
    assert engine.evaluate(obs, ctx, [lambda o, c: found]) == _reference(found)
    assert engine._FOLDERS[obs].folded == 1


def test_tracker_touches_only_the_changed_finding_among_10000(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built = 0
    annotations = alerts_module.alert_annotations

    def counting(finding: Finding, **kw: str) -> dict[str, str]:
        nonlocal built
        built += 1
        return annotations(finding, **kw)

    monkeypatch.setattr(alerts_module, "alert_annotations", counting)
    clock = FakeClock(now=1000.0)
    tracker = AlertTracker(clock=clock, resend_interval_seconds=3600.0)
    found = [f for f in _fleet(10_000) if f.severity is not Severity.INFO]
    assert len(tracker.update(found)) == len(found)
    assert tracker.touched == len(found)
    clock.advance(5.0)
    changed = list(found)
    changed[4_000] = replace(changed[4_000], occurrences=3)
    built = 0
    sent = tracker.update([replace(f) for f in changed])  # equal objects, as rules make them
    assert [a.fingerprint for a in sent] == [tracker.active()[4_000].fingerprint]
    assert tracker.touched == 1
    assert built == 1
    clock.advance(5.0)
    gone = changed[:7_000] + changed[7_001:]
    sent = tracker.update(gone)
    assert [a.state.value for a in sent] == ["resolved"]
    assert tracker.touched == 1
    clock.advance(3600.0)  # the re-send interval passed: every alert is due again
    assert len(tracker.update(gone)) == len(gone)
    assert tracker.touched == len(gone)


_ALERT_KINDS = [("xid", "79"), ("xid", "13"), ("xid", "45"), ("gpu_lost", "x"),
                ("node_down", "x"), ("ecc", "y")]


def _alert(rng: random.Random) -> Alert:
    kind, code = rng.choice(_ALERT_KINDS)
    labels = {"alertname": kind + code,
              "severity": rng.choice(["warning", "major", "critical", "info"]),
              "node": f"n{rng.randrange(5)}", "entity": rng.choice(["node", "G0", "G1"]),
              "kind": kind, "code": code}
    if rng.random() < 0.3:
        labels["cluster"] = rng.choice(["a", "b"])
    state = rng.choice([AlertState.FIRING] * 8 + [AlertState.PENDING, AlertState.RESOLVED])
    return Alert(fingerprint=fingerprint(labels), labels=labels,
                 annotations={"summary": str(rng.random())}, state=state,
                 starts_at=rng.choice([1.0, 2.0, 3.0]))


def test_inhibitor_and_grouper_match_the_full_path_on_random_sequences() -> None:
    rng = random.Random(3)
    for trial in range(150):
        clock = FakeClock(now=0.0)
        inhibitor = Inhibitor(DEFAULT_INHIBIT_RULES)
        severity = rng.choice([Severity.MAJOR, Severity.WARNING])
        grouper = PageGrouper(clock=clock, page_severity=severity)
        full = PageGrouper(clock=clock, page_severity=severity)
        alerts = [_alert(rng) for _ in range(rng.randrange(0, 25))]
        for step in range(20):
            if rng.random() < 0.05 and alerts:
                alerts = [*alerts, alerts[0]]  # one alert given twice
            firing = [a for a in alerts if a.state is AlertState.FIRING]
            want = inhibited(firing, DEFAULT_INHIBIT_RULES)
            assert list(inhibitor.muted(alerts).items()) == list(want.items()), (trial, step)
            fps = [a.fingerprint for a in alerts]
            silenced = {fp for fp in fps if rng.random() < 0.2}
            blocked = set(want) if rng.random() < 0.8 else {fp for fp in fps
                                                             if rng.random() < 0.2}
            pages = grouper.update(alerts, silenced=silenced, inhibited=blocked)
            assert pages == full._update_all(alerts, silenced=silenced, inhibited=blocked)
            assert grouper.open_pages() == full.open_pages()
            clock.advance(1.0)
            alerts = list({a.fingerprint: a for a in alerts}.values())
            for _ in range(rng.randrange(4)):
                roll = rng.random()
                if roll < 0.3 and alerts:
                    i = rng.randrange(len(alerts))
                    alerts[i] = replace(alerts[i], annotations={"summary": "new"})
                elif roll < 0.6:
                    alerts.insert(rng.randrange(len(alerts) + 1), _alert(rng))
                elif roll < 0.7:
                    rng.shuffle(alerts)
                elif alerts:
                    del alerts[rng.randrange(len(alerts))]


def test_one_new_alert_among_10000_is_the_only_one_judged() -> None:
    clock = FakeClock(now=0.0)
    tracker = AlertTracker(clock=clock)
    tracker.update([f for f in _fleet(10_000) if f.severity is not Severity.INFO])
    active = tracker.active()
    inhibitor = Inhibitor(DEFAULT_INHIBIT_RULES)
    grouper = PageGrouper(clock=clock)
    inhibitor.muted(active)
    grouper.update(active)
    assert inhibitor.touched == len(active)
    lost = Finding(node=NodeName("gpu-00001"), entity=EntityId("GPU-3"), kind="gpu_lost",
                   code="fallen_off_bus", severity=Severity.CRITICAL,
                   action=Action.REBOOT_NODE, summary="s", evidence=(), source="test")
    tracker.update([*(f for f in _fleet(10_000) if f.severity is not Severity.INFO), lost])
    active = tracker.active()
    muted = inhibitor.muted(active)
    assert muted == inhibited(active, DEFAULT_INHIBIT_RULES)
    assert inhibitor.touched <= 2  # the new source, and the one alert of that GPU it mutes
    pages = grouper.update(active, inhibited=set(muted))
    assert grouper.touched <= 2
    assert pages == []  # gpu-00001 already paged critical (its Xid 79)
