"""The labelled synthetic GPU/link stream: determinism, proportions, labels, encoding, scoring."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from analytics import synthetic
from analytics.synthetic import Alarm, FailureLabel, score_alarms
from core.catalog import BY_NAME
from core.records import EntityId, Event, NodeName, Sample
from storage.lineprotocol import read_records

TINY = replace(synthetic.SMALL, gpus=16, days=1.5, quiet_days=0.5, acceleration=3000.0,
               chunk_ticks=200)
"""16 GPUs and ports, 36 h, failures sped up so that a dozen or more happen."""


def _render(plan: synthetic.Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Event]]:
    parts = list(synthetic.chunks(plan))
    return (np.concatenate([c.times for c in parts]),
            np.concatenate([c.values for c in parts]),
            np.concatenate([c.present for c in parts]),
            [e for c in parts for e in c.events])


@pytest.fixture(scope="module")
def tiny() -> tuple[synthetic.Plan, np.ndarray, np.ndarray, np.ndarray, list[Event]]:
    plan = synthetic.plan(TINY, seed=2)
    return (plan, *_render(plan))


def _column(plan: synthetic.Plan, metric: str, where: tuple[str, str], **labels: str) -> int:
    want = tuple(sorted(labels.items()))
    for index, spec in enumerate(plan.series):
        if spec.metric == metric and (spec.node, spec.entity) == where and (
                not labels or set(want) <= set(spec.labels)):
            return index
    raise AssertionError(f"no series {metric} {where} {labels}")


def test_deterministic_per_seed() -> None:
    a, b, c = (synthetic.plan(TINY, seed=s) for s in (5, 5, 6))
    assert a.failures == b.failures
    assert a.confounders == b.confounders
    assert a.failures != c.failures
    _, va, pa, ea = _render(a)
    _, vb, pb, eb = _render(b)
    np.testing.assert_array_equal(va, vb)
    np.testing.assert_array_equal(pa, pb)
    assert ea == eb
    _, vc, _, _ = _render(c)
    assert not np.array_equal(va, vc)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        synthetic.StreamConfig(gpus=12)
    with pytest.raises(ValueError, match="p_otb_precursor"):
        synthetic.StreamConfig(p_otb_precursor=1.5)
    with pytest.raises(ValueError, match="quiet_days"):
        synthetic.StreamConfig(days=1.0, quiet_days=2.0)


def test_proportions_and_confounders() -> None:
    plans = [synthetic.plan(synthetic.FULL, seed=s) for s in (11, 12, 13)]
    failures = [f for p in plans for f in p.failures]
    kinds = Counter(f.kind for f in failures)
    assert len(failures) > 200
    assert synthetic.no_precursor_fraction(failures) >= 0.30
    assert set(kinds) == {"dbe", "otb", "link_down"}
    # Titan's DBE share among GPU failures (0.753), within sampling error
    assert 0.65 < kinds["dbe"] / (kinds["dbe"] + kinds["otb"]) < 0.85
    # some OTBs have the PCIe replay precursor, most do not
    otb = [f for f in failures if f.kind == "otb"]
    assert 0 < sum(f.precursor for f in otb) < 0.5 * len(otb)
    confounders = Counter(c.kind for p in plans for c in p.confounders)
    assert set(confounders) >= {"collector_gap", "collector_outage", "driver_reload",
                                "counter_reset", "cooling", "symbol_burst", "noisy_sbe",
                                "noisy_replay", "workload"}
    for f in failures:
        assert f.recovered_at > f.at
        if f.precursor:
            assert f.precursor_onset is not None
            assert f.at - f.precursor_onset >= synthetic.FULL.lead_min_hours * 3600
        else:
            assert f.precursor_onset is None


def test_metric_names_come_from_the_catalog(tiny: tuple) -> None:
    plan = tiny[0]
    assert {s.metric for s in plan.series} <= set(BY_NAME)
    assert len(plan.series) == 10 * TINY.gpus


def test_labels_match_the_stream(tiny: tuple) -> None:
    plan, times, values, present, events = tiny
    dt = TINY.interval_seconds
    assert len(plan.failures) >= 5
    by_time = {(e.node, e.entity, e.observed_at): e for e in events}
    for f in plan.failures:
        first = int(np.searchsorted(times, f.at))
        if f.kind == "link_down":
            state = _column(plan, "ib_port_state", (f.node, f.entity))
            down = (times >= f.at) & (times < f.recovered_at) & present[:, state]
            assert (values[down, state] == 1.0).all()
            assert by_time[(f.node, f.entity, f.at)].code == "down"
            counter = _column(plan, "ib_symbol_errors_total", (f.node, f.entity))
        else:
            assert by_time[(f.node, f.entity, f.at)].code == ("48" if f.kind == "dbe" else "79")
            temp = _column(plan, "gpu_temperature_celsius", (f.node, f.entity))
            gone = (times >= f.at + (1800 if f.kind == "dbe" else 0)) & (times < f.recovered_at)
            assert not present[gone, temp].any()  # an OTB's series stop at the failure
            counter = _column(plan, "gpu_ecc_errors_total", (f.node, f.entity), type="corrected")
            if f.kind == "otb":
                counter = _column(plan, "gpu_pcie_replays_total", (f.node, f.entity))
            if f.kind == "dbe" and first < len(times):
                unc = _column(plan, "gpu_ecc_errors_total", (f.node, f.entity), type="uncorrected")
                assert values[first, unc] - (values[first - 1, unc] if first else 0) >= 1
        # precursor: the error counter climbs much faster in the last hour than before onset
        hour = int(3600 / dt)
        if first >= hour + 2 and first < len(times):
            last_hour = values[first - 1, counter] - values[first - hour, counter]
            if f.precursor:
                assert last_hour > 20, (f, last_hour)
            elif f.kind == "otb":
                # nothing numeric before a GPU falls off the bus (replays stay at their trickle
                # unless this GPU is one of the noisy-riser confounders)
                noisy = {c.entity for c in plan.confounders if c.kind == "noisy_replay"}
                if f.entity not in noisy:
                    assert last_hour <= 10, (f, last_hour)


def test_counter_resets_and_collector_gaps_are_in_the_stream() -> None:
    config = replace(TINY, days=3.0)
    for seed in (21, 22, 23, 24):
        plan = synthetic.plan(config, seed=seed)
        gaps = [c for c in plan.confounders if c.kind in ("collector_gap", "driver_reload")]
        resets = [c for c in plan.confounders if c.kind == "counter_reset"]
        if gaps and resets:
            break
    else:
        pytest.fail("no seed gave both a gap and a counter reset")
    times, values, present, _ = _render(plan)
    gap = gaps[0]
    inside = (times >= gap.start) & (times < gap.end)
    node_cols = [i for i, s in enumerate(plan.series) if s.node == gap.node]
    assert inside.any()
    assert not present[np.ix_(inside, node_cols)].any()
    reset = resets[0]
    col = _column(plan, "ib_symbol_errors_total", (reset.node, reset.entity))
    k = int(np.searchsorted(times, reset.start))
    if 0 < k < len(times) and present[k, col] and present[k - 1, col]:
        assert values[k, col] <= values[k - 1, col] or values[k - 1, col] == 0


def test_line_protocol_round_trip(tmp_path: Path) -> None:
    plan = synthetic.plan(replace(TINY, days=0.75, quiet_days=0.25), seed=3)
    path = tmp_path / "stream.lp"
    lines, labelled = synthetic.write_line_protocol(plan, path)
    assert labelled == len(plan.failures)
    records = list(read_records([path]))
    samples = [r for r in records if isinstance(r, Sample)]
    events = [r for r in records if isinstance(r, Event)]
    _, _, present, chunk_events = _render(plan)
    assert len(samples) == int(present.sum())
    assert len(events) == len(chunk_events)
    assert {s.metric for s in samples} <= set(BY_NAME)
    assert lines < len(samples)  # one line per GPU reading: fields merged
    assert {(e.kind, e.code) for e in events} <= {("xid", "48"), ("xid", "79"),
                                                   ("ib_port_state", "down"),
                                                   ("ib_port_state", "active")}
    assert len(synthetic.labels_json(plan)) == len(plan.failures)


def _failure(entity: str, at: float, *, precursor: bool = True, node: str = "n1",
             recovered: float | None = None) -> FailureLabel:
    return FailureLabel(node=NodeName(node), entity=EntityId(entity), kind="dbe", at=at,
                        precursor=precursor, precursor_onset=at - 7200 if precursor else None,
                        recovered_at=recovered if recovered is not None else at + 7200)


def test_score_alarms_on_a_hand_made_example() -> None:
    h = 3600.0
    failures = [
        _failure("g0", 100 * h),                    # caught 3 h early
        _failure("g1", 100 * h, precursor=False),   # caught by a gap 5 min after: lead 0
        _failure("g2", 100 * h),                    # missed: the alarm is 30 h before
        _failure("g3", 50 * h),                     # missed: no alarm
    ]
    alarms = [
        Alarm("n1", "g0", 97 * h), Alarm("n1", "g0", 97 * h + 600),  # one episode, true
        Alarm("n1", "g0", 99 * h),                                    # second episode, true
        Alarm("n1", "g1", 100 * h + 300),                             # true (grace)
        Alarm("n1", "g2", 70 * h),                                    # false: too early
        Alarm("n1", "g0", 101 * h),                                   # ignored: repair
        Alarm("n1", "g5", 10 * h),                                    # false: healthy GPU
        Alarm("n1", "node", 100 * h),                                 # node-level: apart
        Alarm("n2", "g0", 99 * h),                                    # false: other node
    ]
    s = score_alarms(alarms, failures, gpu_days=10.0)
    assert (s.true_episodes, s.false_episodes, s.ignored_episodes) == (3, 3, 1)
    assert s.alarms == 7
    assert s.node_alarms == 1
    assert s.precision == pytest.approx(3 / 6)
    assert (s.detected, s.failures) == (2, 4)
    assert s.recall == pytest.approx(0.5)
    assert (s.precursor_detected, s.precursor_failures) == (1, 3)
    assert s.leads == {0: pytest.approx(3 * h), 1: 0.0}
    assert s.median_lead_seconds == pytest.approx(3 * h)
    assert s.early_detected == 1
    assert s.false_alarms_per_1000_gpu_days == pytest.approx(300.0)
    # a wider horizon turns the 30 h alarm into a detection
    wide = score_alarms(alarms, failures, gpu_days=10.0, horizon_seconds=40 * h)
    assert wide.detected == 3
    assert wide.leads[2] == pytest.approx(30 * h)
    none = score_alarms([], failures, gpu_days=10.0)
    assert none.recall == 0.0
    assert np.isnan(none.precision)
    with pytest.raises(ValueError, match="gpu_days"):
        score_alarms(alarms, failures, gpu_days=0.0)
