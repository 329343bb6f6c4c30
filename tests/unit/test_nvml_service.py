"""The NVML collector inside the service: polled, its errors exported, its state diagnosed."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from collectors.nvml import NvmlCollector
from collectors.testing import FakeNvml, given_for_dump
from gpuhealth.config import load_settings
from gpuhealth.service import Service

DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


def _wait_for(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_service_polls_nvml_and_exports_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "gpuhealth.toml"
    path.write_text(f"""
[node]
name = "n1"
data_dir = "{tmp_path / "data"}"
[metrics]
enabled = false
[storage]
flush_interval_seconds = "100ms"
[collectors.nvml]
fast_interval_seconds = "100ms"
""")
    settings = load_settings(path, env={})
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt", **given_for_dump())
    collector = NvmlCollector(node="n1", nvml=fake, fast_interval_seconds=0.1, event_wait_ms=20)
    service = Service(settings, collectors={"nvml": collector})
    service.start()
    try:
        assert _wait_for(lambda: fake.calls["nvmlDeviceGetPowerUsage"] >= 3, 10)
        uuid = str(fake.gpus[0].facts["uuid"])
        assert _wait_for(
            lambda: (
                service.exporter.value("gpu_power_watts", {"node": "n1", "entity": uuid})
                is not None
            ),
            10,
        )
        assert service.exporter.value("gpu_power_watts", {"node": "n1", "entity": uuid}) == (43.89)
        assert _wait_for(
            lambda: (
                (
                    service.exporter.value(
                        "gpuhealth_collector_errors_total",
                        {"collector": "nvml", "reason": "not_supported"},
                    )
                    or 0
                )
                > 0
            ),
            10,
        )
        # the GPU counts among the healthy ones once an evaluation ran (evaluate every 5 s)
        def gpus() -> float:
            return sum(service.exporter.value("gpuhealth_gpus", {"state": state}) or 0
                       for state in ("healthy", "warning", "major", "critical",
                                     "out_of_service"))

        assert _wait_for(lambda: gpus() == 1, 10), [
            (st, service.exporter.value("gpuhealth_gpus", {"state": st}))
            for st in ("healthy", "warning", "major", "critical", "out_of_service")]
        assert service.exporter.value("gpuhealth_open_incidents",
                                      {"severity": "critical", "phase": "open"}) == 0
    finally:
        service.shutdown()
    assert not fake.gaps
    assert fake.initialised == 0  # the service closed the collector
