"""Issue #15: one identity per GPU and port, and which findings label the predictor."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from analytics.fault_model import Context, Observations, evaluate
from analytics.identity import EntityResolver, port_identity
from analytics.prediction_stage import PredictionStage
from collectors.artifact import ParseContext
from collectors.kernel_log import parse_kernel_lines
from core.records import EntityId, Event, Finding, NodeName, Prediction, Record, Sample, Severity

NODE = NodeName("gpu-a")
UUIDS = [f"GPU-1111111{i}-2222-3333-4444-555555555555" for i in range(4)]
BUSES = ["0000:17:00.0", "0000:b1:00.0", "0000:ca:00.0", "0000:db:00.0"]
FAILING = 1  # the GPU at PCI 0000:b1:00 (Xid lines: PCI:0000:b1:00)
XID48 = ("Dec  2 11:38:47 gpu-a kernel: [  219.470994] NVRM: Xid (PCI:0000:b1:00): 48, "
         "pid=1482211, name=python, An uncorrectable double bit error (DBE) has been detected "
         "on GPU in the framebuffer at physAddr 0x1f3a6c2480 partition 3, subpartition 0.")


def _xid_event(line: str) -> Event:
    [event] = [e for e in parse_kernel_lines([line], ParseContext(file="kern.log", node=NODE,
                                                                  default_year=2026))
               if e.kind == "xid"]
    return event


def _critical_findings(records: list[Record], at: float) -> list[Finding]:
    obs = Observations()
    for r in records:
        obs.add(r)
    return [f for f in evaluate(obs, Context(now=at)) if f.severity is Severity.CRITICAL]


def _nvml_minute(at: float, start: float) -> Iterator[Sample]:
    """NVML's samples of one minute, keyed by UUID; the failing GPU's corrected errors rise."""
    for i, uuid in enumerate(UUIDS):
        entity = EntityId(uuid)
        if at == start:  # the inventory: what NVML's slow group sends
            yield Sample(metric="gpu_info", value=1.0, observed_at=at, node=NODE, entity=entity,
                         labels={"uuid": uuid, "pci_bus_id": BUSES[i], "index": str(i),
                                 "serial": f"16549000000{i}", "model": "NVIDIA H100"})
        minutes = (at - start) / 60.0
        ce = minutes * (5.0 if i == FAILING else 0.1)
        yield Sample(metric="gpu_ecc_errors_total", value=float(int(ce)), observed_at=at,
                     node=NODE, entity=entity,
                     labels={"type": "corrected", "scope": "volatile", "location": "dram"})
        yield Sample(metric="gpu_temperature_celsius", value=60.0 + i, observed_at=at, node=NODE,
                     entity=entity)


def test_nvml_samples_and_kernel_log_xids_meet_on_one_gpu_identity() -> None:
    """NVML keys samples by UUID, the kernel log keys the Xid by PCI bus id: one GPU."""
    event = _xid_event(XID48)
    assert event.entity == "0000:b1:00.0"
    failed_at = event.observed_at
    assert failed_at is not None
    [finding] = _critical_findings([event], failed_at)
    assert finding.entity == "0000:b1:00.0"  # the fault model keys the Xid by PCI bus id
    stage = PredictionStage(checkpoint_path=None, horizon_seconds=3600.0, min_positives=0,
                            interval_seconds=60.0)
    start = failed_at - 2 * 3600.0
    predictions: list[Prediction] = []
    at = start
    while at <= failed_at + 3700.0:
        stage.observe(list(_nvml_minute(at, start)))
        if at >= failed_at and finding is not None:
            stage.observe_findings([finding])
            finding_seen, finding = finding, None
        predictions += stage.step(at)
        at += 60.0
    uuid = UUIDS[FAILING]
    assert stage.predictor.learned_positive > 0  # the label met the GPU's vectors
    assert {p.entity for p in predictions} == set(UUIDS)  # features and predictions ...
    assert stage.identity.finding(finding_seen) == uuid  # ... and findings: one entity
    assert stage.identity.gpu(NODE, "gpu:1") == uuid
    assert stage.identity.gpu(NODE, "PCI:0000:b1:00") == uuid
    assert stage.identity.gpu(NODE, "serial:165490000001") == uuid


def test_resolver_learns_from_gpu_identity_events_too() -> None:
    resolver = EntityResolver()
    resolver.learn(Event(kind="gpu_identity", code="uuid", node=NODE,
                         entity=EntityId("0000:b1:00.0"), observed_at=1.0,
                         attrs={"uuid": UUIDS[1], "index": "1"}))
    assert resolver.gpu(NODE, "0000:B1:00.0") == UUIDS[1]
    assert resolver.gpu(NodeName("other"), "0000:b1:00.0") == "0000:b1:00.0"  # per node


def _port_minute(at: float, start: float, down: bool) -> list[Sample]:
    minutes = (at - start) / 60.0
    labels = {"device": "mlx5_0", "port": "1"}
    out = []
    for port in ("1", "2"):
        entity = EntityId(f"mlx5_0:{port}")
        rate = 40.0 if port == "1" else 0.5
        out.append(Sample(metric="ib_symbol_errors_total", value=float(int(minutes * rate)),
                          observed_at=at, node=NODE, entity=entity,
                          labels={**labels, "port": port}))
        out.append(Sample(metric="ib_link_downed_total", value=1.0 if down and port == "1"
                          else 0.0, observed_at=at, node=NODE, entity=entity,
                          labels={**labels, "port": port}))
    return out


def test_a_port_that_goes_down_labels_its_own_vectors() -> None:
    """Port-down is major (not critical) and the rule names ``mlx5_0:1``: it still labels."""
    down_at = 1_800_000_000.0
    event = Event(kind="ib_port_state", code="down", node=NODE, entity=EntityId("mlx5_0:1"),
                  observed_at=down_at, message="mlx5_0 port 1 state Down",
                  attrs={"device": "mlx5_0", "port": "1", "phys_state": "polling"})
    obs = Observations()
    obs.add(event)
    [finding] = [f for f in evaluate(obs, Context(now=down_at)) if f.kind == "ib_port"]
    assert finding.severity is Severity.MAJOR
    assert finding.entity == "mlx5_0:1"
    stage = PredictionStage(checkpoint_path=None, horizon_seconds=3600.0, min_positives=0)
    start = down_at - 2 * 3600.0
    entities: set[str] = set()
    at = start
    while at <= down_at + 3700.0:
        stage.observe(_port_minute(at, start, at >= down_at))
        if at == down_at:
            stage.observe_findings([finding])
        entities |= {p.entity for p in stage.step(at)}
        at += 60.0
    assert entities == {"mlx5_0:1", "mlx5_0:2"}
    assert stage.predictor.learned_positive > 0


def test_port_identity_is_one_spelling() -> None:
    assert port_identity("mlx5_0/1") == port_identity("node", {"device": "mlx5_0", "port": "1"})
    assert port_identity("mlx5_0/1") == "mlx5_0:1"


def test_gpu_off_the_bus_is_no_positive_window_and_is_counted_apart() -> None:
    """An Xid 79 has no numeric precursor: the day before it is not labelled positive."""
    line = XID48.replace("): 48, pid=1482211, name=python, An uncorrectable double bit error "
                         "(DBE) has been detected on GPU in the framebuffer at physAddr "
                         "0x1f3a6c2480 partition 3, subpartition 0.",
                         "): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    event = _xid_event(line)
    assert event.code == "79"
    assert event.observed_at is not None
    failed_at = event.observed_at
    findings = _critical_findings([event], failed_at)
    assert findings, "Xid 79 is a critical finding"
    stage = PredictionStage(checkpoint_path=None, horizon_seconds=3600.0, min_positives=0)
    start = failed_at - 2 * 3600.0
    at = start
    while at <= failed_at + 3700.0:
        stage.observe(list(_nvml_minute(at, start)))
        if at >= failed_at and findings:
            stage.observe_findings(findings)
            stage.observe_findings(findings)  # seen again at the next evaluation
            findings = []
        stage.step(at)
        at += 60.0
    assert stage.predictor.learned_positive == 0
    assert stage.predictor.unpredictable == {"xid/79": 1}


def _port_counters(at: float, symbol: float, downed: float = 0.0) -> list[Sample]:
    labels = {"device": "mlx5_0", "port": "1"}
    entity = EntityId("mlx5_0:1")
    return [Sample(metric="ib_symbol_errors_total", value=symbol, observed_at=at, node=NODE,
                   entity=entity, labels=labels),
            Sample(metric="ib_link_downed_total", value=downed, observed_at=at, node=NODE,
                   entity=entity, labels=labels)]


def _port_findings(readings: list[list[Sample]]) -> list[Finding]:
    obs = Observations()
    for reading in readings:
        obs.extend(reading)
    return [f for f in evaluate(obs, Context(now=1e9)) if f.kind == "ib_port"]


def test_port_errors_judge_the_rise_not_a_lifetime_counters_first_reading() -> None:
    """A port whose lifetime symbol-error counter is 4,000 at start-up is not warned."""
    t0 = 1_800_000_000.0
    assert _port_findings([_port_counters(t0, 4000.0, downed=3.0)]) == []
    assert _port_findings([_port_counters(t0, 4000.0, 3.0),
                           _port_counters(t0 + 60, 4000.0, 3.0)]) == []
    [rising] = _port_findings([_port_counters(t0, 4000.0), _port_counters(t0 + 60, 4012.0)])
    assert rising.code == "port_errors"
    assert "symbol_errors=12" in rising.summary
    [flap] = _port_findings([_port_counters(t0, 4000.0, 3.0),
                             _port_counters(t0 + 60, 4012.0, 4.0)])
    assert flap.code == "LinkDownedCounter"
    assert flap.severity is Severity.MAJOR


def test_a_gpu_always_warmer_than_its_peers_is_not_reported_again_and_again() -> None:
    """Issue #15 item 8: one GPU sits ~5 degC (z ~ 5) above its peers for three days,
    another creeps away from them on day 3: at most one report for the first, one for the
    second (the old code reported the first each time it crossed z = 5 again)."""
    import numpy as np

    from analytics.online import OnlineAnalytics

    now = [0.0]
    online = OnlineAnalytics(clock=lambda: now[0], detector_by_metric={
        "gpu_temperature_celsius": "none", "gpu_power_watts": "none"})
    rng = np.random.default_rng(7)
    reports: dict[str, int] = {}
    step, days = 60.0, 3
    for k in range(int(days * 86_400 / step)):
        at = k * step
        now[0] = at
        batch = []
        for g in range(8):
            watts = 400.0 + 60.0 * np.sin(at / 3600.0 + g)
            temp = 60.0 + 0.07 * (watts - 400.0) + rng.normal(0.0, 0.7)
            if g == 2:
                temp += 5.0  # always a few degrees warmer
            if g == 5 and at > 2 * 86_400:
                temp += 12.0 * min(1.0, (at - 2 * 86_400) / 43_200)  # creeping away
            entity = EntityId(f"GPU-{g}")
            batch += [Sample(metric="gpu_temperature_celsius", value=float(temp),
                             observed_at=at, node=NODE, entity=entity),
                      Sample(metric="gpu_power_watts", value=float(watts), observed_at=at,
                             node=NODE, entity=entity)]
        for r in online.observe(batch):
            if r.kind == "peer":
                reports[r.anomaly.entity] = reports.get(r.anomaly.entity, 0) + 1
    assert reports.get("GPU-2", 0) <= 1
    assert reports.get("GPU-5", 0) == 1
    assert set(reports) <= {"GPU-2", "GPU-5"}


def _thermal(temp: float, *, slowdown: float = 90.0, shutdown: float = 98.0,
             max_operating: float = 87.0, throttling: bool = False) -> list[Finding]:
    at = 1_800_000_000.0
    entity = EntityId(UUIDS[0])
    obs = Observations()
    obs.add(Sample(metric="gpu_temperature_celsius", value=temp, observed_at=at, node=NODE,
                   entity=entity))
    for name, value in (("slowdown", slowdown), ("shutdown", shutdown),
                        ("max_operating", max_operating)):
        obs.add(Sample(metric="gpu_temperature_threshold_celsius", value=value, observed_at=at,
                       node=NODE, entity=entity, labels={"threshold": name}))
    obs.add(Sample(metric="gpu_clock_event_active", value=1.0 if throttling else 0.0,
                   observed_at=at, node=NODE, entity=entity, labels={"reason": "hw_thermal"}))
    return [f for f in evaluate(obs, Context(now=at)) if f.kind == "thermal"]


def test_temperature_is_judged_against_the_gpus_own_thresholds() -> None:
    """A GPU held at 91 degC (slowdown at 90) is a major thermal finding, and a label."""
    from analytics.identity import failure_kind

    [hot] = _thermal(91.0)
    assert (hot.code, hot.severity) == ("at_slowdown_temperature", Severity.MAJOR)
    assert failure_kind(hot) == "predictable"
    assert _thermal(91.0, slowdown=97.0, shutdown=102.0, max_operating=95.0) == []  # V100-like
    [near] = _thermal(94.0)
    assert (near.code, near.severity) == ("near_shutdown", Severity.CRITICAL)
    [warm] = _thermal(88.0)
    assert (warm.code, warm.severity) == ("above_max_operating", Severity.WARNING)
    assert failure_kind(warm) is None
    [slow] = _thermal(88.0, throttling=True)
    assert slow.severity is Severity.MAJOR
    assert _thermal(70.0) == []


def test_rates_over_hours_see_errors_that_come_more_often() -> None:
    """Issue #15 item 7: each reading counts one error either way; only how often changes."""
    import pytest

    from analytics.features import FeatureBuilder

    fb = FeatureBuilder(interval_seconds=60.0)
    ce = {"type": "corrected", "scope": "volatile", "location": "dram"}
    counts = {"GPU-A": 0, "GPU-B": 0}
    start = 1_800_000_000.0 - 1_800_000_000.0 % 3600.0
    for minute in range(24 * 60 + 1):
        at = start + minute * 60.0
        if minute and (minute % 180 == 0 if minute <= 18 * 60 else minute % 20 == 0):
            counts["GPU-A"] += 1  # every 3 h for 18 h, then every 20 min
        if minute and minute % 60 == 0:
            counts["GPU-B"] += 1  # one an hour, all day
        fb.observe(Sample(metric="gpu_ecc_errors_total", value=float(v), observed_at=at,
                          node=NODE, entity=EntityId(e), labels=ce) for e, v in counts.items())
    vecs = {v.entity: v.values for v in fb.vectors(start + 24 * 3600.0)}
    a, b = vecs["GPU-A"], vecs["GPU-B"]
    assert a["dram_ce_rate_6h"] == pytest.approx(3.0, abs=0.3)
    assert a["dram_ce_rate_24h"] == pytest.approx(1.0, abs=0.1)
    assert a["dram_ce_rate_trend"] > 1.5
    assert b["dram_ce_rate_24h"] == pytest.approx(1.0, abs=0.1)
    assert abs(b["dram_ce_rate_trend"]) < 0.3


def _rising_minute(at: float, start: float, rise_from_hours: float) -> Iterator[Sample]:
    """NVML samples keyed by UUID; every GPU has a few corrected errors, GPU 3 a noisy
    steady many (a static offset), and the failing GPU's rate doubles every hour from
    ``rise_from_hours``."""
    hours = (at - start) / 3600.0
    for i, uuid in enumerate(UUIDS):
        entity = EntityId(uuid)
        if at == start:
            yield Sample(metric="gpu_info", value=1.0, observed_at=at, node=NODE, entity=entity,
                         labels={"uuid": uuid, "pci_bus_id": BUSES[i], "index": str(i),
                                 "serial": f"16549000000{i}", "model": "NVIDIA H100"})
        ce = hours * (300.0 if i == 3 else 0.5)
        if i == FAILING and hours > rise_from_hours:
            ce += 0.5 * (2.0 ** (hours - rise_from_hours) - 1.0) / math.log(2.0)
        yield Sample(metric="gpu_ecc_errors_total", value=float(int(ce)), observed_at=at,
                     node=NODE, entity=entity,
                     labels={"type": "corrected", "scope": "volatile", "location": "dram"})
        yield Sample(metric="gpu_temperature_celsius", value=60.0 + i, observed_at=at, node=NODE,
                     entity=entity)


def test_a_new_fleet_starts_from_the_shipped_prior(tmp_path) -> None:
    """Issue #15 item 6: not blind until the fleet's own failures. From the shipped prior,
    with no failure learned, a GPU whose corrected errors rise over hours reaches the warning
    level, and neither the healthy GPUs nor one with a steady high error count do (the old
    prior ranked GPUs by raw rates: the steady noisy GPU first)."""
    from analytics.prior import PRIOR_PATH, load

    assert PRIOR_PATH.stat().st_size < 20_000  # a small file in the package
    assert load(PRIOR_PATH) is not None
    assert load(PRIOR_PATH, horizon_seconds=3600.0) is None  # trained for another horizon
    stage = PredictionStage(checkpoint_path=tmp_path / "p.pkl", prior=PRIOR_PATH,
                            interval_seconds=300.0, refit=False)
    assert stage.ready  # min_positives 5, none learned: ready from the prior
    start = 1_800_000_000.0
    peak: dict[str, float] = {}
    for step in range(0, 22 * 12 + 1):
        at = start + step * 300.0
        stage.observe(list(_rising_minute(at, start, rise_from_hours=15.0)))
        for p in stage.step(at):
            peak[p.entity] = max(peak.get(p.entity, 0.0), p.probability)
    failing = peak.pop(UUIDS[FAILING])
    assert failing >= 0.5
    assert max(peak.values()) < 0.05
    [warning] = stage.take_warnings()  # one warning, for the failing GPU
    assert warning.entity == UUIDS[FAILING]
    assert next(iter(warning.top_features)) == "corrected_ecc_evidence"
    stage.save()
    again = PredictionStage(checkpoint_path=tmp_path / "p.pkl", prior=PRIOR_PATH)
    assert again.predictor.from_prior  # the checkpoint, not a fresh copy of the prior
    assert again.predictor.pending()  # the restored state
    blind = PredictionStage(checkpoint_path=None)
    assert not blind.ready  # without a prior, as before


def test_a_failure_state_seen_at_every_evaluation_keeps_few_label_times() -> None:
    """A thermal state re-observed every second for a day labels as one, at bounded cost."""
    from analytics.predictor import OnlineFailurePredictor

    [hot] = _thermal(91.0)
    predictor = OnlineFailurePredictor(seed=0)
    at = hot.last_seen_at or 0.0
    for second in range(0, 86_400, 1):
        predictor.observe_finding(dataclasses.replace(hot, first_seen_at=at + second,
                                                      last_seen_at=at + second))
    kept = sum(len(v) for v in predictor._failed_at.values())
    assert 0 < kept <= 24 * 6 + 1


def test_an_application_xid_long_before_a_double_bit_error_keeps_its_own_time() -> None:
    """An Xid 43 (an application's channel reset) 36 h before an Xid 48 folded into it and
    gave the double-bit error the Xid 43's first time: its label came 36 h early. Folded
    only within an hour of the fault; a 43 a minute after still folds."""
    xid48 = _xid_event(XID48)
    assert xid48.observed_at is not None
    old43 = dataclasses.replace(
        _xid_event("Nov 30 23:38:47 gpu-a kernel: [  100.000000] NVRM: Xid (PCI:0000:b1:00): "
                   "43, pid=1482211, name=python, Ch 00000010"))
    assert old43.observed_at == xid48.observed_at - 36 * 3600.0
    [dbe] = _critical_findings([old43, xid48], xid48.observed_at)
    assert dbe.code == "48"
    assert dbe.first_seen_at == xid48.observed_at
    near43 = dataclasses.replace(old43, observed_at=xid48.observed_at + 60.0)
    [folded] = _critical_findings([xid48, near43], xid48.observed_at + 60.0)
    assert folded.first_seen_at == xid48.observed_at
    assert folded.occurrences == 2
