"""Online failure predictor: delayed labels from critical findings, top features, checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analytics.predictor import OnlineFailurePredictor
from core.records import (
    Action,
    EntityId,
    FeatureVector,
    Finding,
    NodeName,
    Prediction,
    Severity,
)

STEP, HORIZON = 60.0, 3600.0


def _finding(gpu: int, at: float, severity: Severity = Severity.CRITICAL) -> Finding:
    return Finding(
        node=NodeName(f"n{gpu // 8}"),
        entity=EntityId(f"gpu{gpu}"),
        kind="ecc",
        code="dbe",
        severity=severity,
        action=next(iter(Action)),
        summary="double-bit ECC error",
        evidence=(),
        source="test",
        first_seen_at=at,
    )


def _stream(seed: int, gpus: int = 32, steps: int = 400):
    """Vectors every minute; failing GPUs show a rising corrected-error rate for an hour first."""
    rng = np.random.default_rng(seed)
    fail_step = {g: int(rng.integers(90, steps)) for g in range(0, gpus, 3)}
    for step in range(steps):
        t = step * STEP
        vectors, findings = [], []
        for g in range(gpus):
            ecc = rng.exponential(0.2)
            if g in fail_step and 0 <= fail_step[g] - step <= 60:
                ecc += 3.0 * (1.0 - (fail_step[g] - step) / 60.0) + 0.5
            vectors.append(
                FeatureVector(
                    node=NodeName(f"n{g // 8}"),
                    entity=EntityId(f"gpu{g}"),
                    values={
                        "ecc_corrected_rate": float(ecc),
                        "temperature_peer_z": float(rng.normal()),
                        "power_watts": float(300 + rng.normal(0, 20)),
                    },
                    window_end_at=t,
                )
            )
            if fail_step.get(g) == step:
                findings.append(_finding(g, t))
        yield t, vectors, findings, fail_step


def _run(predictor: OnlineFailurePredictor, seed: int) -> list[tuple[int, Prediction, bool]]:
    out = []
    for _, vectors, findings, fail_step in _stream(seed):
        for finding in findings:
            predictor.observe_finding(finding)
        for x in vectors:
            g = int(x.entity[3:])
            step = int(x.window_end_at // STEP)
            soon = g in fail_step and 0 <= fail_step[g] - step <= 60
            out.append((step, predictor.predict(x), soon))
    return out


def test_learns_precursors_from_later_critical_findings() -> None:
    predictor = OnlineFailurePredictor(horizon_seconds=HORIZON, seed=1)
    results = _run(predictor, seed=3)
    assert predictor.learned_positive > 100
    late = [(p.probability, soon) for step, p, soon in results if step >= 250]
    before_failure = np.mean([p for p, soon in late if soon])
    healthy = np.mean([p for p, soon in late if not soon])
    assert before_failure > 3 * healthy
    # The feature that drove the high predictions is the corrected-error rate.
    top = [p for step, p, soon in results if step >= 250 and soon and p.probability > 0.5]
    assert top
    assert all(next(iter(p.top_features)) == "ecc_corrected_rate" for p in top)
    assert all(p.horizon_seconds == HORIZON for _, p, _ in results[:5])


def test_non_critical_findings_are_not_labels() -> None:
    predictor = OnlineFailurePredictor(horizon_seconds=HORIZON, negative_rate=1.0, seed=1)
    x = FeatureVector(
        node=NodeName("n0"), entity=EntityId("gpu0"), values={"a": 1.0}, window_end_at=0.0
    )
    predictor.predict(x)
    predictor.observe_finding(_finding(0, 10.0, Severity.MAJOR))
    predictor.settle(HORIZON + 1)
    assert (predictor.learned_positive, predictor.learned_negative) == (0, 1)


def test_checkpoint_restores_a_warm_identical_predictor(tmp_path: Path) -> None:
    path = tmp_path / "state" / "predictor.pkl"
    a = OnlineFailurePredictor(horizon_seconds=HORIZON, seed=5)
    stream = list(_stream(seed=4, gpus=8, steps=200))
    for _, vectors, findings, _ in stream[:120]:
        for f in findings:
            a.observe_finding(f)
        for x in vectors:
            a.predict(x)
    a.save(path)
    b = OnlineFailurePredictor.restore(path)
    assert b.pending() == a.pending()
    for _, vectors, findings, _ in stream[120:]:
        for f in findings:
            a.observe_finding(f)
            b.observe_finding(f)
        for x in vectors:
            assert a.predict(x) == b.predict(x)


def test_restore_rejects_other_files(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "x.pkl"
    path.write_bytes(pickle.dumps({"version": 99}))
    with pytest.raises(ValueError, match="checkpoint"):
        OnlineFailurePredictor.restore(path)


@pytest.mark.parametrize(
    "kwargs",
    [{"horizon_seconds": 0.0}, {"negative_rate": 0.0}, {"top_features": 0}, {"learning_rate": 0}],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        OnlineFailurePredictor(**kwargs)  # type: ignore[arg-type]
