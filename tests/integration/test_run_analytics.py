"""``gpuhealth run`` with the online detectors: a jump and a silent GPU become alerts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from analytics.online import DEFAULT_DETECTOR_BY_METRIC, GAP_CODE
from core.records import EntityId, NodeName, Sample
from gpuhealth.config import Settings, load_settings
from gpuhealth.service import Service


class _Gpus:
    """Two GPUs at a steady power; GPU-0 jumps after ``jump_after`` calls, GPU-1 goes silent
    after ``stop_after`` calls (``None``: never)."""

    name = "gpus"

    def __init__(self, *, jump_after: int | None = None, stop_after: int | None = None) -> None:
        self.jump_after = jump_after
        self.stop_after = stop_after
        self.calls = 0
        self.lock = threading.Lock()

    def collect(self) -> list[Sample]:
        with self.lock:
            self.calls += 1
            calls = self.calls
        now = time.time()
        power = 300.0 + (calls * 7 % 5) * 0.5
        if self.jump_after is not None and calls > self.jump_after:
            power = 700.0
        out = [Sample(metric="gpu_power_watts", value=power, observed_at=now,
                      node=NodeName("n1"), entity=EntityId("GPU-0"))]
        if self.stop_after is None or calls <= self.stop_after:
            out.append(Sample(metric="gpu_power_watts", value=300.0 + (calls % 3) * 0.5,
                              observed_at=now, node=NodeName("n1"), entity=EntityId("GPU-1")))
        return out


def _settings(tmp_path: Path, extra: str = "") -> Settings:
    path = tmp_path / "analytics.toml"
    path.write_text(f"""
[node]
data_dir = "{tmp_path / 'data'}"
[metrics]
enabled = false
[storage]
flush_interval_seconds = "50ms"
[analytics]
evaluate_interval_seconds = "100ms"
warmup_samples = 30
{extra}
[collectors.gpus]
type = "probe"
interval_seconds = "20ms"
""")
    return load_settings(path, env={})


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _alerts(service: Service) -> set[tuple[str, str, str]]:
    assert service.pipeline is not None
    return {(a.labels["entity"], a.labels["kind"], a.labels["code"])
            for a in service.pipeline.active_alerts()}


def test_a_series_that_jumps_alerts_as_an_anomaly_warning(tmp_path: Path) -> None:
    gpus = _Gpus(jump_after=80)
    service = Service(_settings(tmp_path), collectors={"gpus": gpus})
    service.start()
    try:
        assert _wait_for(
            lambda: ("GPU-0", "anomaly", "gpu_power_watts") in _alerts(service), 20)
        assert service.pipeline is not None
        severities = {a.labels["severity"] for a in service.pipeline.active_alerts()}
        assert severities == {"warning"}
        assert not service.pipeline.policy.out_of_service  # an outlier never cordons
        assert ("GPU-1", "anomaly", "gpu_power_watts") not in _alerts(service)
        detector = DEFAULT_DETECTOR_BY_METRIC["gpu_power_watts"]  # the per-signal default
        count = service.exporter.value("gpuhealth_anomalies_total", {"detector": detector})
        assert count is not None
        assert count >= 1
    finally:
        service.shutdown()


def test_a_gpu_whose_samples_stop_alerts_as_a_telemetry_gap(tmp_path: Path) -> None:
    gpus = _Gpus(stop_after=30)
    service = Service(_settings(tmp_path, 'gap_seconds = "500ms"'), collectors={"gpus": gpus})
    service.start()
    try:
        assert _wait_for(
            lambda: ("GPU-1", "telemetry_gap", GAP_CODE) in _alerts(service), 20)
        assert ("GPU-0", "telemetry_gap", GAP_CODE) not in _alerts(service)
    finally:
        service.shutdown()


def test_detectors_can_be_turned_off(tmp_path: Path) -> None:
    service = Service(_settings(tmp_path, "detectors = false"),
                      collectors={"gpus": _Gpus(stop_after=5)})
    assert service.online is None
