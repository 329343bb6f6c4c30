"""The small-group path of the peer comparison (Python floats) agrees with the numpy one."""

from __future__ import annotations

import numpy as np
import pytest

import analytics.peers as peers


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_small_groups_match_the_numpy_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    comparison = peers.PeerComparison(z_threshold=5.0, min_scale=1.0)
    cases = []
    for trial in range(400):
        n = int(rng.integers(1, 12))
        power = rng.uniform(50, 700, n).round(int(rng.integers(0, 3)))
        if trial % 7 == 0:
            power[:] = power[0]  # no spread of the covariate: no line is fitted
        temp = (30 + 0.05 * power + rng.normal(0, 2, n)).round(int(rng.integers(0, 2)))
        if trial % 5 == 0 and n > 2:
            temp[0] += 20.0
        cases.append((temp, power, np.zeros(n, dtype=np.int64)))
    fast = [(peers.robust_residuals(t, p, g), comparison.compare(t, node=g, group=g, covariate=p))
            for t, p, g in cases]
    monkeypatch.setattr(peers, "_SMALL", 0)
    for (t, p, g), (resid, verdict) in zip(cases, fast, strict=True):
        slow = comparison.compare(t, node=g, group=g, covariate=p)
        np.testing.assert_allclose(resid, peers.robust_residuals(t, p, g), atol=1e-9)
        np.testing.assert_allclose(verdict.z_node, slow.z_node, atol=1e-9)
        assert verdict.flagged.tolist() == slow.flagged.tolist()
