"""The exporter's own render writes what ``generate_latest`` writes, byte for byte."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.registry import Collector

from core.exposition import family
from core.records import EntityId, Event, NodeName, Sample
from gpuhealth.metrics import MetricsExporter


def _s(metric: str, value: float, entity: str = "GPU-a", **labels: str) -> Sample:
    return Sample(metric=metric, value=value, observed_at=1.0, node=NodeName("n1"),
                  entity=EntityId(entity), labels=labels)


class _Stage(Collector):
    def __init__(self) -> None:
        self.depth = 3.0

    def collect(self) -> Iterable[object]:  # type: ignore[override]
        yield family("gpuhealth_agent_outbox_depth", [({}, self.depth)])


def _reference(exporter: MetricsExporter) -> bytes:
    """What the exporter rendered before it formatted its own lines."""
    return bytes(generate_latest(exporter._registry))


def test_render_matches_generate_latest() -> None:
    exporter = MetricsExporter()
    stage = _Stage()
    exporter.register(stage)
    exporter.update([
        _s("gpu_temperature_celsius", 42.0), _s("gpu_temperature_celsius", 50.5, "GPU-b"),
        _s("gpu_power_watts", 1e21), _s("gpu_power_watts", -0.0, "GPU-b"),
        _s("gpu_power_watts", 1234567.0, "GPU-c"), _s("gpu_power_watts", math.inf, "GPU-d"),
        _s("gpu_power_watts", -math.inf, "GPU-e"), _s("gpu_power_watts", 3e-9, "GPU-f"),
        _s("gpu_clock_event_active", 1.0, reason="hw_slowdown"),
        _s("gpu_clock_event_active", 0.0, 'GPU-"q"\\back\nline', reason="sw_power_cap"),
        _s("gpu_energy_joules_total", 5000.0),
        _s("gpu_ecc_errors_total", 7.0, type="corrected", scope="volatile"),
    ])
    exporter.update([Event(kind="xid", code="79", node=NodeName("n1"),
                           entity=EntityId("0000:b1:00.0"), observed_at=1.0)])
    exporter.inc("gpuhealth_findings_total", {"severity": "critical"})
    exporter.inc("gpuhealth_samples_written_total", amount=10)
    exporter.set("gpuhealth_collector_errors_total", 3,
                 {"collector": "nvml", "reason": "not_supported"})
    body = exporter.render()
    assert body == _reference(exporter)
    assert exporter.body() == body
    assert b'entity="GPU-\\"q\\"\\\\back\\nline"' in body
    # Values change and series appear between renders: the cached prefixes stay right.
    stage.depth = 9.0
    exporter.update([_s("gpu_temperature_celsius", 43.0), _s("gpu_temperature_celsius", 1.0,
                                                              "GPU-new")])
    exporter.inc("gpuhealth_findings_total", {"severity": "warning"})
    again = exporter.render()
    assert again == _reference(exporter)
    assert b"gpuhealth_agent_outbox_depth 9.0\n" in again


def test_empty_exporter_renders_nothing() -> None:
    exporter = MetricsExporter()
    assert exporter.render() == b"" == _reference(exporter)


def test_render_after_random_changes_matches_generate_latest() -> None:
    """Values that repeat, flip between 0.0 and -0.0, go NaN, and new series, in any order."""
    rng = random.Random(7)
    exporter = MetricsExporter()
    exporter.register(_Stage())
    choices = [0.0, -0.0, 1.0, 2.5, math.nan, math.inf, 1e22, 300.0]
    metrics = ["gpu_power_watts", "gpu_temperature_celsius", "gpu_energy_joules_total"]
    for _ in range(300):
        for _ in range(rng.randrange(1, 6)):
            exporter.update([_s(rng.choice(metrics), rng.choice(choices),
                                f"GPU-{rng.randrange(4)}")])
        if rng.random() < 0.3:
            exporter.set("gpuhealth_spool_depth", rng.choice(choices))
        if rng.random() < 0.2:
            exporter.inc("gpuhealth_findings_total", {"severity": "warning"},
                         amount=rng.choice([0.0, 1.0]))
        if rng.random() < 0.5:
            assert exporter.render() == _reference(exporter)
