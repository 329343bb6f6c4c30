"""One analytics code path for ``run``, ``agent`` and ``replay`` (issue #15 item 5).

``analytics.stage.AnalyticsStage`` turns detector results into findings and closed gaps,
steps the predictor, and passes each failure to it once per episode; ``run`` (the service)
and ``replay`` both build it with ``gpuhealth.compose.analytics_stage`` and hand its output
to the pipeline with ``Pipeline.observe_analytics``. Before, the replay kept the detectors'
anomalies and gaps in its report only: a replayed recording raised no gap alert where
``run`` on the same samples did.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from analytics.online import GAP_CODE
from analytics.stage import AnalyticsStage
from core.clock import FakeClock
from core.records import Action, EntityId, Finding, NodeName, Sample, Severity
from gpuhealth.compose import analytics_stage
from gpuhealth.config import AnalyticsSettings
from gpuhealth.replay import replay
from storage import LineEncoder

T0 = 1_767_225_600.0
NODE = NodeName("n1")


def _power(gpus: int, minutes: range, silent: str | None = None) -> list[Sample]:
    return [Sample(metric="gpu_power_watts", value=300.0 + g, observed_at=T0 + 60.0 * m,
                   node=NODE, entity=EntityId(f"GPU-{g}"))
            for m in minutes for g in range(gpus) if f"GPU-{g}" != silent or m < 30]


def _stage(clock: FakeClock, predictor: bool = False) -> AnalyticsStage:
    settings = AnalyticsSettings(detector="ewma_z", detector_by_metric={}, warmup_samples=20,
                                 predictor=predictor, gap_seconds=120.0)
    return analytics_stage(settings, role="replay", checkpoint_path=None, clock=clock)


def test_a_gap_is_a_finding_and_its_end_clears_it() -> None:
    clock = FakeClock(now=T0)
    stage = _stage(clock)
    opened, cleared = [], []
    samples = _power(4, range(40), silent="GPU-3") + [
        s for s in _power(4, range(40, 41)) if s.entity == "GPU-3"]
    by_minute: dict[float, list[Sample]] = {}
    for s in samples:
        by_minute.setdefault(s.observed_at or 0.0, []).append(s)
    for at, batch in sorted(by_minute.items()):
        clock.now = at
        out = stage.observe(batch, at)
        opened += [f for f in out.findings if f.kind == "telemetry_gap"]
        cleared += out.cleared
    assert [(f.entity, f.code, f.severity) for f in opened] == [
        ("GPU-3", GAP_CODE, Severity.WARNING)]
    assert cleared == [opened[0].key]


def test_a_failure_reaches_the_predictor_once_however_many_evaluations_see_it() -> None:
    stage = _stage(FakeClock(now=T0), predictor=True)
    assert stage.prediction is not None
    seen: list[Finding] = []
    stage.prediction.observe_findings = seen.extend  # type: ignore[method-assign]
    dbe = Finding(node=NODE, entity=EntityId("GPU-0"), kind="ecc", code="dbe",
                  severity=Severity.CRITICAL, action=Action.RESET_GPU, summary="DBE",
                  evidence=(), source="test", first_seen_at=T0, last_seen_at=T0)
    warning = Finding(node=NODE, entity=EntityId("GPU-1"), kind="anomaly",
                      code="gpu_power_watts", severity=Severity.WARNING, action=Action.NONE,
                      summary="x", evidence=(), source="test", first_seen_at=T0,
                      last_seen_at=T0)
    for _ in range(5):  # the service passes every evaluation's findings
        stage.observe_findings([dbe, warning])
    again = dataclasses.replace(dbe, first_seen_at=T0 + 7200.0)
    stage.observe_findings([again])  # a new episode of the same fault
    assert [f.first_seen_at for f in seen] == [T0, T0 + 7200.0]


def test_step_seconds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="step_seconds"):
        AnalyticsStage(None, None, step_seconds=0.0)


def test_a_replayed_gap_alerts_as_in_run(tmp_path: Path) -> None:
    """The pipeline of a replay takes the detectors' findings: the gap of a GPU that went
    silent is among the replay's findings and alerts, in the recording's time."""
    lp = tmp_path / "n1.lp"
    lines = LineEncoder().samples(_power(4, range(60), silent="GPU-3"))
    lp.write_text("\n".join(sorted(lines, key=lambda x: int(x.rsplit(" ", 1)[1]))) + "\n")
    settings = AnalyticsSettings(detector="ewma_z", detector_by_metric={}, warmup_samples=20,
                                 predictor=False, gap_seconds=120.0)
    report = replay([str(lp)], clock=FakeClock(now=1_900_000_000.0), analytics=settings,
                    evaluate_seconds=60.0)
    [node] = report.nodes
    gaps = [f for f in node.findings_seen if f.kind == "telemetry_gap"]
    assert [f.entity for f in gaps] == ["GPU-3"]
    assert T0 + 30 * 60 <= (gaps[0].first_seen_at or 0.0) <= T0 + 40 * 60
    assert any(a.labels.get("entity") == "GPU-3" and a.labels.get("code") == GAP_CODE
               for a in node.alerts)
