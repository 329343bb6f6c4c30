"""Reliability statistics on hand-made histories whose answers are worked out by hand."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from scipy import stats  # type: ignore[import-untyped,unused-ignore]

from analytics import reliability as rel
from storage.history import IncidentHistory, IncidentRecord, InventoryRecord, PredictionRecord

H = 3600.0


def inc(incident_id: str, node: str, entity: str, detected: float, *, back: float | None = None,
        cause: str = "memory", kind: str = "xid", code: str = "48", slot: str = "",
        driver: str = "", predicted_at: float | None = None,
        actions: tuple[str, ...] = ()) -> IncidentRecord:
    return IncidentRecord(
        incident_id=incident_id, node=node, entity=entity, kind=kind, code=code,
        severity="critical", cause=cause, detected_at=detected, out_of_service_at=detected,
        back_in_service_at=back, resolved_at=back, slot=slot, driver_version=driver,
        predicted_at=predicted_at, actions=actions)


def res(entity: str, node: str, first: float | None, last: float, *, model: str = "H100",
        driver: str = "550", batch: str = "", slot: str = "") -> InventoryRecord:
    return InventoryRecord(entity=entity, node=node, model=model, driver_version=driver,
                           vbios_version="", slot=slot or node, first_seen_at=first,
                           last_seen_at=last, removed_at=None, batch=batch)


def frames(incidents: list[IncidentRecord], inventory: list[InventoryRecord],
           predictions: list[PredictionRecord] | tuple[()] = ()
           ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    store = IncidentHistory(":memory:")
    store.upsert_incidents(incidents)
    store.upsert_inventory(inventory)
    store.record_predictions(predictions)
    out = store.incidents(), store.inventory(), store.predictions()
    store.close()
    return out


# A week-long window, 4 GPUs on 2 nodes, each in service the whole week (168 h) but g4,
# which arrived after 68 h (100 h in the window).
WEEK = rel.Window(start=0.0, end=168 * H)
INVENTORY = [
    res("g1", "n1", -100 * H, 500 * H, model="H100", driver="550"),
    res("g2", "n1", 0.0, 168 * H, model="H100", driver="550"),
    res("g3", "n2", 0.0, 168 * H, model="A100", driver="535"),
    res("g4", "n2", 68 * H, 400 * H, model="A100", driver="535"),
]
INCIDENTS = [
    inc("a", "n1", "g1", 10 * H, back=12 * H),                       # 2 h out
    inc("b", "n1", "g1", 50 * H, back=56 * H, cause="gpu_lost", code="79"),  # 6 h out
    inc("c", "n2", "g3", 100 * H, back=None, cause="nvlink", code="74"),  # open: 68 h out
    inc("old", "n2", "g3", -50 * H, back=-40 * H),                   # before the window
]


def test_window_checks_and_previous() -> None:
    with pytest.raises(ValueError, match="after its start"):
        rel.Window(start=10.0, end=10.0)
    assert WEEK.previous() == rel.Window(start=-168 * H, end=0.0)
    assert WEEK.hours == 168


def test_exposure_clips_to_the_window_and_ignores_unknown_starts() -> None:
    _, inventory, _ = frames([], [*INVENTORY, res("g5", "n3", None, 100 * H)])
    hours = rel.exposure_hours(inventory, WEEK)
    by_entity = dict(zip(inventory["entity"], hours, strict=True))
    assert by_entity == {"g1": 168.0, "g2": 168.0, "g3": 168.0, "g4": 100.0, "g5": 0.0}


def test_mtbf_interval_matches_the_chi_square_formula() -> None:
    point, lower, upper = rel.mtbf_interval(604.0, 3, confidence=0.90)
    assert point == pytest.approx(604.0 / 3)
    assert lower == pytest.approx(2 * 604.0 / stats.chi2.ppf(0.95, 8))
    assert upper == pytest.approx(2 * 604.0 / stats.chi2.ppf(0.05, 6))
    # Worked value: chi2(0.95; 8) = 15.5073, chi2(0.05; 6) = 1.63538 (tables).
    assert lower == pytest.approx(77.90, abs=0.01)
    assert upper == pytest.approx(738.66, abs=0.01)
    none_point, none_lower, none_upper = rel.mtbf_interval(1000.0, 0, confidence=0.95)
    assert none_point is None
    assert none_upper is None
    assert none_lower == pytest.approx(2000.0 / 7.3778, rel=1e-4)  # chi2(0.975; 2)
    assert rel.mtbf_interval(0.0, 2) == (None, None, None)
    with pytest.raises(ValueError, match="confidence"):
        rel.mtbf_interval(1.0, 1, confidence=1.0)


def test_fleet_summary_known_answers() -> None:
    incidents, inventory, _ = frames(INCIDENTS, INVENTORY)
    fleet = rel.fleet_summary(inventory, incidents, WEEK)
    assert fleet["units"] == 4
    assert fleet["nodes"] == 2
    assert fleet["exposure_hours"] == pytest.approx(604.0)
    assert fleet["failures"] == 3
    assert fleet["mtbf_hours"] == pytest.approx(604.0 / 3)
    assert fleet["system_mtbf_hours"] == pytest.approx(168.0 / 3)
    # Node hours: n1 and n2 each span the whole week.
    assert fleet["node_mtbf_hours"] == pytest.approx(336.0 / 3)


def test_mtbf_by_model_and_driver() -> None:
    incidents, inventory, _ = frames(INCIDENTS, INVENTORY)
    by_model = rel.mtbf_by(inventory, incidents, "model", WEEK).set_index("group")
    assert by_model.loc["H100", "failures"] == 2
    assert by_model.loc["H100", "exposure_hours"] == pytest.approx(336.0)
    assert by_model.loc["H100", "mtbf_hours"] == pytest.approx(168.0)
    # The incident carries no model: it is taken from g3's residency (A100).
    assert by_model.loc["A100", "failures"] == 1
    assert by_model.loc["A100", "mtbf_hours"] == pytest.approx(268.0)
    assert by_model.loc["A100", "units"] == 2
    assert list(rel.mtbf_by(inventory, incidents, "model", WEEK)["group"]) == ["H100", "A100"]
    by_driver = rel.mtbf_by(inventory, incidents, "driver_version", WEEK).set_index("group")
    assert by_driver.loc["550", "failures"] == 2
    lower = by_driver.loc["550", "mtbf_lower_hours"]
    assert lower == pytest.approx(2 * 336.0 / stats.chi2.ppf(0.95, 6))


def test_availability_lost_hours_and_peak() -> None:
    incidents, inventory, _ = frames(INCIDENTS, INVENTORY)
    avail = rel.availability(inventory, incidents, WEEK)
    assert avail["lost_hours"] == pytest.approx(2 + 6 + 68)
    assert avail["availability"] == pytest.approx(1 - 76 / 604)
    assert avail["open_at_end"] == 1
    assert avail["incidents_out_of_service"] == 3
    assert rel.peak_concurrent_out(incidents, WEEK) == 1
    overlapping = frames([inc("x", "n1", "g1", 0.0, back=10 * H),
                          inc("y", "n1", "g2", 5 * H, back=7 * H),
                          inc("z", "n2", "g3", 10 * H, back=11 * H)], INVENTORY)[0]
    assert rel.peak_concurrent_out(overlapping, WEEK) == 2  # z starts when x ends


def test_availability_ignores_nodes_outside_the_fleet() -> None:
    incidents, inventory, _ = frames([inc("gone", "retired-node", "gx", 1 * H)], INVENTORY)
    assert rel.availability(inventory, incidents, WEEK)["lost_hours"] == 0.0


def test_mttr_known_answers() -> None:
    incidents, _, _ = frames(INCIDENTS, INVENTORY)
    in_week = incidents[incidents["detected_at"] >= 0]
    result = rel.mttr(in_week)
    assert result["repaired"] == 2
    assert result["unrepaired"] == 1
    assert result["mean_hours"] == pytest.approx(4.0)
    assert result["median_hours"] == pytest.approx(4.0)
    assert result["max_hours"] == pytest.approx(6.0)
    assert rel.mttr(in_week.iloc[0:0])["mean_hours"] is None


def test_failures_by_cause_and_period() -> None:
    incidents, _, _ = frames(INCIDENTS, INVENTORY)
    result = rel.failures_by_cause(incidents)
    assert result["by_cause"]["memory"] == 2
    assert result["by_cause"]["gpu_lost"] == 1
    assert result["by_cause"]["network"] == 0
    assert list(result["by_cause"]) == list(rel.CAUSE_ORDER)
    assert result["top_codes"][0] == {"kind": "xid", "code": "48", "failures": 2}
    days = rel.failures_by_period(incidents, "day")
    assert days.loc["1970-01-01", "memory"] == 1
    assert days.loc["1969-12-29", "memory"] == 1
    # Cut in another zone, an event near midnight lands on another day: b is at 02:00 UTC
    # on 3 January, 21:00 on the 2nd in New York.
    assert days.loc["1970-01-03", "gpu_lost"] == 1
    shifted = rel.failures_by_period(incidents, "day", tz="America/New_York")
    assert shifted.loc["1970-01-02", "gpu_lost"] == 1
    assert "1970-01-03" not in shifted.index
    with pytest.raises(ValueError, match="freq"):
        rel.failures_by_period(incidents, "fortnight")


def test_repeat_offenders_and_lemon_slots() -> None:
    history = [
        inc("1", "n1", "gA", 1 * H, slot="s1"), inc("2", "n1", "gA", 2 * H, slot="s1"),
        inc("3", "n1", "gB", 3 * H, slot="s1"), inc("4", "n2", "gC", 4 * H, slot="s2"),
        inc("5", "n2", "gC", 5 * H, slot="s2"), inc("6", "n2", "gC", 6 * H, slot="s2"),
        inc("7", "n3", "node", 7 * H, slot="s3"),
    ]
    incidents, _, _ = frames(history, INVENTORY)
    offenders = rel.repeat_offenders(incidents, k=2)
    assert list(offenders["key"]) == ["n2/gC", "n1/gA"]
    assert list(offenders["failures"]) == [3, 2]
    nodes = rel.repeat_offenders(incidents, k=3, by="node")
    assert list(nodes["key"]) == ["n1", "n2"]
    lemons = rel.lemon_slots(incidents, k=2, min_entities=2)
    # s1: gA failed twice, then its replacement gB failed; s2 is one bad GPU, not the slot.
    assert list(lemons["slot"]) == ["s1"]
    assert lemons.iloc[0]["entities"] == 2
    assert lemons.iloc[0]["failures"] == 3


def test_cohort_comparison_rate_ratio_matches_exact_conditional_interval() -> None:
    inventory = [res(f"old{i}", f"o{i}", 0.0, 1000 * H, driver="535") for i in range(10)]
    inventory += [res(f"new{i}", f"n{i}", 500 * H, 1000 * H, driver="550") for i in range(10)]
    incidents = [inc(f"o{i}", f"o{i}", f"old{i}", 600 * H + i) for i in range(4)]
    incidents += [inc(f"n{i}", f"n{i % 10}", f"new{i % 10}", 700 * H + i) for i in range(12)]
    inc_frame, inv_frame, _ = frames(incidents, inventory)
    window = rel.Window(start=0.0, end=1000 * H)
    result = rel.cohort_comparison(inv_frame, inc_frame, "driver_version", window,
                                   confidence=0.95)
    assert result is not None
    assert (result["candidate"], result["baseline"]) == ("550", "535")  # newest vs largest
    new, old = result["cohorts"]["550"], result["cohorts"]["535"]
    assert (new["failures"], new["exposure_hours"]) == (12, 5000.0)
    assert (old["failures"], old["exposure_hours"]) == (4, 10000.0)
    assert result["rate_ratio"] == pytest.approx((12 / 5000) / (4 / 10000))
    ci = stats.binomtest(12, 16).proportion_ci(confidence_level=0.95, method="exact")
    scale = 10000.0 / 5000.0
    assert result["ratio_lower"] == pytest.approx(ci.low / (1 - ci.low) * scale)
    assert result["ratio_upper"] == pytest.approx(ci.high / (1 - ci.high) * scale)
    assert result["p_value"] == pytest.approx(stats.binomtest(12, 16, 1 / 3).pvalue)
    assert result["ratio_lower"] > 1
    assert "550 fails more often than 535" in result["verdict"]
    garwood = stats.chi2.ppf(0.975, 26) / 2 / 5000 * 1e6
    assert new["rate_upper"] == pytest.approx(garwood)


def test_cohort_comparison_needs_two_cohorts_and_says_no_difference() -> None:
    inc_frame, inv_frame, _ = frames(INCIDENTS, INVENTORY[:2])
    assert rel.cohort_comparison(inv_frame, inc_frame, "driver_version", WEEK) is None
    inventory = [res("a", "n1", 0.0, 100 * H, driver="1"), res("b", "n2", 0.0, 100 * H,
                                                                 driver="2")]
    incidents = [inc("x", "n1", "a", 10 * H), inc("y", "n2", "b", 20 * H)]
    inc_frame, inv_frame, _ = frames(incidents, inventory)
    result = rel.cohort_comparison(inv_frame, inc_frame, "driver_version",
                                   rel.Window(start=0.0, end=100 * H), baseline="1",
                                   candidate="2")
    assert result is not None
    assert result["rate_ratio"] == pytest.approx(1.0)
    assert "no significant difference" in result["verdict"]
    with pytest.raises(ValueError, match="cohort '9'"):
        rel.cohort_comparison(inv_frame, inc_frame, "driver_version",
                              rel.Window(start=0.0, end=100 * H), baseline="9")


def test_prediction_quality_precision_recall_lead_time() -> None:
    predictions = [
        # Hit: g1 fails at 10 h, predicted at 4 h with a 12 h horizon (lead 6 h).
        PredictionRecord(entity="g1", node="n1", at=4 * H, probability=0.9,
                         horizon_seconds=12 * H),
        # False alarm: g2 never fails.
        PredictionRecord(entity="g2", node="n1", at=5 * H, probability=0.8,
                         horizon_seconds=12 * H),
        # Below the threshold: ignored.
        PredictionRecord(entity="g3", node="n2", at=90 * H, probability=0.2,
                         horizon_seconds=24 * H),
        # Node-level prediction covering g3's failure at 100 h (lead 4 h).
        PredictionRecord(entity="node", node="n2", at=96 * H, probability=0.7,
                         horizon_seconds=24 * H),
    ]
    incidents, _, preds = frames(INCIDENTS, INVENTORY, predictions)
    result = rel.prediction_quality(preds, incidents, WEEK, threshold=0.5)
    assert result["predictions"] == 3
    assert result["hits"] == 2
    assert result["precision"] == pytest.approx(2 / 3)
    assert result["incidents"] == 3  # a, b, c in the window
    assert result["caught"] == 2     # a (by g1's) and c (by n2's); b at 50 h is past horizon
    assert result["recall"] == pytest.approx(2 / 3)
    assert result["lead_time_median_hours"] == pytest.approx(5.0)
    assert result["lead_time_min_hours"] == pytest.approx(4.0)


def test_prediction_quality_uses_predicted_at_and_handles_no_predictions() -> None:
    incidents, _, preds = frames(
        [inc("p", "n1", "g1", 10 * H, predicted_at=2 * H)], INVENTORY)
    result = rel.prediction_quality(preds, incidents, WEEK)
    assert result["predictions"] == 0
    assert result["precision"] is None
    assert result["recall"] == 1.0
    assert result["lead_time_median_hours"] == pytest.approx(8.0)


def test_young_and_daly_worked_examples() -> None:
    # C = 5 min, M = 24 h: sqrt(2 * 300 * 86400) = 7200 s exactly.
    assert rel.young_interval(300.0, 86400.0) == pytest.approx(7200.0)
    # Daly: x = C / 2M = 1/576, sqrt(x) = 1/24:
    # 7200 * (1 + 1/72 + 1/5184) - 300 = 7200 + 100 + 1.3889 - 300 = 7001.3889 s.
    assert rel.daly_interval(300.0, 86400.0) == pytest.approx(7001.3889, abs=1e-3)
    # C = 1 h, M = 2 h: x = 1/4: sqrt(4 h^2) = 2 h; 7200 * (1 + 1/6 + 1/36) - 3600 = 5000 s.
    assert rel.daly_interval(3600.0, 7200.0) == pytest.approx(5000.0)
    # C >= 2M: checkpointing cannot pay off; Daly says interval = M.
    assert rel.daly_interval(3600.0, 1000.0) == 1000.0
    with pytest.raises(ValueError, match="> 0"):
        rel.young_interval(0.0, 10.0)


def test_checkpoint_table_divides_node_mtbf_by_job_size() -> None:
    rows = rel.checkpoint_table(24.0 * 512, [1, 512], 300.0)
    assert rows[1]["job_mtbf_hours"] == pytest.approx(24.0)
    assert rows[1]["young_minutes"] == pytest.approx(120.0)
    assert rows[1]["daly_minutes"] == pytest.approx(7001.3889 / 60, abs=1e-4)
    assert rows[0]["young_minutes"] == pytest.approx(120.0 * math.sqrt(512))
    assert rel.checkpoint_table(None, [1], 300.0) == []
    with pytest.raises(ValueError, match="job size"):
        rel.checkpoint_table(10.0, [0], 300.0)


def test_spare_capacity_verdict() -> None:
    avail = {"exposure_hours": 1000.0, "lost_hours": 50.0}
    fits = rel.spare_capacity(avail, peak_out=1, units=10, spare_fraction=0.15)
    assert fits["mean_unavailable_fraction"] == pytest.approx(0.05)
    assert fits["peak_unavailable_fraction"] == pytest.approx(0.1)
    assert fits["fits"] is True
    assert fits["headroom_fraction"] == pytest.approx(0.05)
    assert rel.spare_capacity(avail, peak_out=2, units=10, spare_fraction=0.15)["fits"] is False
    assert rel.spare_capacity(avail, peak_out=0, units=0, spare_fraction=0.2)["fits"] is None
    with pytest.raises(ValueError, match="spare_fraction"):
        rel.spare_capacity(avail, 0, 1, 1.5)


def test_week_over_week() -> None:
    rows = rel.week_over_week({"failures": 6, "availability": None}, {"failures": 4,
                              "availability": 0.99}, ["failures", "availability"])
    assert rows[0] == {"figure": "failures", "previous": 4, "current": 6, "change": 2.0,
                       "change_ratio": 0.5}
    assert rows[1]["change"] is None


def test_data_window_includes_the_last_event() -> None:
    incidents, inventory, _ = frames(INCIDENTS, INVENTORY)
    window = rel.data_window(inventory, incidents)
    assert window is not None
    assert window.start == -100 * H
    assert window.end == 500 * H + 1
    empty = pd.DataFrame(columns=incidents.columns)
    assert rel.data_window(inventory.iloc[0:0], empty) is None
