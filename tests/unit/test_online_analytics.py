"""``analytics.online``: detectors, counter rates, gaps and peers over batches of samples."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from analytics.online import GAP_CODE, OnlineAnalytics, OnlineResult, to_finding
from core.records import Action, Anomaly, EntityId, NodeName, Sample, Severity
from gpuhealth.pipeline import Pipeline

N1 = NodeName("n1")


def _s(metric: str, value: float, at: float, entity: str = "GPU-0", node: str = "n1") -> Sample:
    return Sample(
        metric=metric, value=value, observed_at=at, node=NodeName(node), entity=EntityId(entity)
    )


@pytest.mark.parametrize("detector", ["dspot", "spot", "ewma_z", "quantile"])
def test_a_gauge_that_jumps_is_an_anomaly_with_its_metric(detector: str) -> None:
    online = OnlineAnalytics(detector=detector, warmup_samples=50, clock=lambda: 0.0)
    found: list[OnlineResult] = []
    for t in range(200):
        found += online.observe([_s("gpu_temperature_celsius", 60.0 + (t * 7 % 5) * 0.2, t)])
    assert found == []
    jump = online.observe([_s("gpu_temperature_celsius", 95.0, 200.0)])
    assert [(r.kind, r.metric, r.anomaly.entity) for r in jump] == [
        ("anomaly", "gpu_temperature_celsius", "GPU-0")
    ]
    assert jump[0].anomaly.detector == online._detector.name


def test_counters_are_scored_as_rates_not_raw_values() -> None:
    online = OnlineAnalytics(detector="ewma_z", warmup_samples=20, clock=lambda: 0.0)
    total, found = 0.0, []
    for t in range(100):  # a steadily growing counter is normal: its rate is flat
        total += 10.0 + (t % 3)
        found += online.observe([_s("gpu_energy_joules_total", total, float(t))])
    assert found == []
    total += 10_000.0
    burst = online.observe([_s("gpu_energy_joules_total", total, 100.0)])
    assert [(r.kind, r.metric) for r in burst] == [("anomaly", "gpu_energy_joules_total")]


def test_unknown_metrics_and_nan_are_skipped() -> None:
    online = OnlineAnalytics(warmup_samples=20, clock=lambda: 0.0)
    assert (
        online.observe([_s("not_catalogued", 1.0, 0.0), _s("gpu_power_watts", float("nan"), 0.0)])
        == []
    )


def test_a_gpu_whose_samples_stop_is_a_telemetry_gap_once_then_closes() -> None:
    now = [0.0]
    online = OnlineAnalytics(gap_seconds=30.0, warmup_samples=20, clock=lambda: now[0])
    for t in range(20):
        now[0] = 10.0 * t
        assert (
            online.observe(
                [
                    _s("gpu_power_watts", 300.0, now[0], "GPU-0"),
                    _s("gpu_power_watts", 300.0, now[0], "GPU-1"),
                ]
            )
            == []
        )
    for t in range(20, 30):  # GPU-1 falls off the bus: only GPU-0 still reports
        now[0] = 10.0 * t
        found = online.observe([_s("gpu_power_watts", 300.0, now[0], "GPU-0")])
        if found:
            break
    assert [(r.kind, r.anomaly.entity) for r in found] == [("telemetry_gap", "GPU-1")]
    now[0] += 10.0
    assert online.observe([_s("gpu_power_watts", 300.0, now[0], "GPU-0")]) == []  # once
    back = online.observe([_s("gpu_power_watts", 300.0, now[0], "GPU-1")])
    assert [(r.kind, r.anomaly.entity) for r in back] == [("gap_closed", "GPU-1")]


def test_gaps_are_found_by_time_passing() -> None:
    online = OnlineAnalytics(gap_seconds=5.0, warmup_samples=20, clock=lambda: 0.0)
    for t in range(12):
        online.observe([_s("gpu_power_watts", 300.0, float(t))])
    assert online.check(12.0) == []
    assert [r.kind for r in online.check(100.0)] == ["telemetry_gap"]


def test_node_metrics_never_make_gpu_gaps() -> None:
    online = OnlineAnalytics(gap_seconds=5.0, warmup_samples=20, clock=lambda: 0.0)
    for t in range(12):
        online.observe([_s("node_load_ratio", 0.5, float(t), entity="node")])
    assert online.check(1000.0) == []


def test_a_gpu_hotter_than_its_peers_at_equal_power_is_reported_once() -> None:
    now = [0.0]
    online = OnlineAnalytics(warmup_samples=500, clock=lambda: now[0])
    # Temperature follows power (0.07 degC/W); GPU-4 runs 15 degC hotter than its power says,
    # while GPU-3 is the hottest only because it draws the most.
    power = [300.0, 450.0, 350.0, 500.0, 400.0, 320.0, 480.0, 410.0]
    temps = [51.3, 61.3, 54.6, 65.0, 72.7, 52.6, 63.7, 58.7]
    batch = [
        s
        for i, (temp, watts) in enumerate(zip(temps, power, strict=True))
        for s in (
            _s("gpu_temperature_celsius", temp, 1.0, f"GPU-{i}"),
            _s("gpu_power_watts", watts, 1.0, f"GPU-{i}"),
        )
    ]
    assert online.observe(batch) == []  # must persist (issue #15 item 8): 2 minutes
    now[0] = 121.0
    later = [dataclasses.replace(s, observed_at=121.0) for s in batch]
    found = online.observe(later)
    assert [(r.kind, r.metric, r.anomaly.entity) for r in found] == [
        ("peer", "gpu_temperature_celsius", "GPU-4")
    ]
    assert online.observe(later) == []


def test_to_finding_is_never_above_warning_and_never_acts() -> None:
    a = Anomaly(
        detector="dspot",
        node=N1,
        entity=EntityId("GPU-0"),
        score=9.0,
        threshold=3.0,
        observed_at=5.0,
    )
    for kind, metric in (
        ("anomaly", "gpu_power_watts"),
        ("peer", "gpu_temperature_celsius"),
        ("telemetry_gap", ""),
    ):
        f = to_finding(OnlineResult(kind=kind, metric=metric, anomaly=a))
        assert f.severity is Severity.WARNING
        assert f.action is Action.NONE
        assert f.first_seen_at == f.last_seen_at == 5.0
    gap = to_finding(OnlineResult(kind="telemetry_gap", metric="", anomaly=a))
    assert (gap.kind, gap.code) == ("telemetry_gap", GAP_CODE)
    closed = to_finding(OnlineResult(kind="gap_closed", metric="", anomaly=a))
    assert closed.key == gap.key
    peer = to_finding(OnlineResult(kind="peer", metric="gpu_temperature_celsius", anomaly=a))
    assert (peer.kind, peer.code) == ("anomaly", "gpu_temperature_celsius")


@pytest.mark.parametrize(
    "kwargs", [{"detector": "bogus"}, {"gap_seconds": 0.0}, {"warmup_samples": 5}]
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        OnlineAnalytics(**kwargs)  # type: ignore[arg-type]


def test_pipeline_holds_and_clears_observed_findings(tmp_path: Path) -> None:
    now = [1000.0]
    pipeline = Pipeline(
        facts={},
        notifiers=[],
        audit_log_path=str(tmp_path / "audit.jsonl"),
        outbox_path=str(tmp_path / "outbox"),
        clock=lambda: now[0],
    )
    a = Anomaly(
        detector="gaps",
        node=N1,
        entity=EntityId("GPU-1"),
        score=6.0,
        threshold=5.0,
        observed_at=1000.0,
    )
    gap = to_finding(OnlineResult(kind="telemetry_gap", metric="", anomaly=a))
    pipeline.observe_findings([gap], hold_seconds=60.0)
    assert [f.key for f in pipeline.evaluate().findings] == [gap.key]
    pipeline.clear_findings([gap.key])
    assert pipeline.evaluate().findings == []
    pipeline.observe_findings([gap], hold_seconds=60.0)
    now[0] += 61.0
    assert pipeline.evaluate().findings == []
    with pytest.raises(ValueError):  # noqa: PT011
        pipeline.observe_findings([gap], hold_seconds=0.0)


def _ecc(kind: str, value: float, at: float) -> Sample:
    return Sample(
        metric="gpu_ecc_errors_total",
        value=value,
        observed_at=at,
        node=N1,
        entity=EntityId("GPU-0"),
        labels={"type": kind, "scope": "volatile", "location": "total"},
    )


def test_each_signal_gets_its_own_detector() -> None:
    online = OnlineAnalytics(
        detector="quantile",
        warmup_samples=20,
        clock=lambda: 0.0,
        detector_by_metric={
            "gpu_temperature_celsius": "ewma_z",
            "gpu_ecc_errors_total{type=corrected}": "none",
            "gpu_ecc_errors_total": "spot",
        },
    )
    corrected = uncorrected = 0.0
    found: list[OnlineResult] = []
    for t in range(100):
        corrected += 5.0 + t % 2
        found += online.observe(
            [
                _s("gpu_temperature_celsius", 60.0 + (t % 3) * 0.1, t),
                _s("gpu_power_watts", 300.0 + t % 4, t),
                _ecc("corrected", corrected, t),
                _ecc("uncorrected", uncorrected, t),
            ]
        )
    assert found == []
    corrected += 5_000.0  # unscored: "none"
    jump = online.observe(
        [
            _s("gpu_temperature_celsius", 95.0, 100.0),
            _s("gpu_power_watts", 900.0, 100.0),
            _ecc("corrected", corrected, 100.0),
            _ecc("uncorrected", uncorrected, 100.0),
        ]
    )
    assert sorted((r.metric, r.anomaly.detector) for r in jump) == [
        ("gpu_power_watts", "quantile"),
        ("gpu_temperature_celsius", "ewma_z"),
    ]


def test_corrected_and_uncorrected_counters_are_two_series() -> None:
    online = OnlineAnalytics(detector="ewma_z", warmup_samples=20, clock=lambda: 0.0)
    corrected, found = 0.0, []
    for t in range(100):  # interleaved, one series would see wild rates
        corrected += 1_000.0
        found += online.observe(
            [_ecc("corrected", corrected, float(t)), _ecc("uncorrected", 0.0, float(t))]
        )
    assert found == []


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"gpu_pwr": "spot"}, "key 'gpu_pwr': not a catalog metric"),
        ({"gpu_power_watts": "hst"}, "key 'gpu_power_watts': detector 'hst' is not one of"),
        ({"gpu_ecc_errors_total{scope=x}": "spot"}, "only a type label"),
    ],
)
def test_bad_detector_by_metric_names_the_key(mapping: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OnlineAnalytics(detector_by_metric=mapping)


def test_detector_by_metric_is_checked_when_settings_load(tmp_path: Path) -> None:
    from core.errors import ConfigError
    from gpuhealth.config import load_settings

    path = tmp_path / "gpuhealth.toml"
    path.write_text('[analytics.detector_by_metric]\ngpu_temp = "spot"\n')
    with pytest.raises((ConfigError, ValueError), match="gpu_temp"):
        load_settings(str(path))
    path.write_text('[analytics.detector_by_metric]\ngpu_temperature_celsius = "spot"\n')
    assert load_settings(str(path)).analytics.detector_by_metric == {
        "gpu_temperature_celsius": "spot"
    }


def test_prometheus_spelling_of_a_type_key_matches_at_run_time() -> None:
    key = 'gpu_ecc_errors_total{ type="corrected" }'
    online = OnlineAnalytics(detector="spot", detector_by_metric={key: "none"})
    assert online.detector_by_metric == {"gpu_ecc_errors_total{type=corrected}": "none"}
    series = "gpu_ecc_errors_total{location=total,scope=volatile,type=corrected}"
    assert online._detector_for(series) == "none"


def test_every_key_that_cannot_match_is_named_once(tmp_path: Path) -> None:
    from core.errors import ConfigError
    from gpuhealth.config import load_settings

    bad = {
        "gpu_ecc_errors_total{type=bogus}": "not one gpu_ecc_errors_total has",
        "gpu_ecc_errors_total{type=Corrected}": "did you mean 'corrected'",
        "gpu_ecc_errors_total{type=corrected,foo=bar}": "only a type label",
        "gpu_temperature_celsius{type=corrected}": "has no type label",
    }
    table = "".join(f'"{key}" = "spot"\n' for key in bad)
    path = tmp_path / "gpuhealth.toml"
    path.write_text(f'[analytics.detector_by_metric]\n{table}'
                    '"gpu_ecc_errors_total{type=\\"uncorrected\\"}" = "quantile"\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(str(path), env={})
    message = str(caught.value)
    assert message.startswith(f"{path}: [analytics] detector_by_metric: key ")
    assert message.count("detector_by_metric") == 1
    for key, why in bad.items():
        assert message.count(repr(key)) == 1
        assert why in message
    assert "uncorrected" not in message.replace("corrected, uncorrected", "")


def test_one_signal_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="the same signal as key"):
        OnlineAnalytics(detector_by_metric={"gpu_ecc_errors_total{type=corrected}": "spot",
                                            'gpu_ecc_errors_total{type="corrected"}': "dspot"})
