"""Peer comparison: a GPU against the other GPUs of its node and of its model fleet-wide.

A cross-section (one value per GPU at one time) is compared with robust statistics: the robust
z-score ``(x - median) / (1.4826 MAD)`` (Rousseeuw & Croux, JASA 1993; Iglewicz & Hoaglin's
modified z-score). Two comparisons, both vectorised over the whole fleet with pandas group-bys:

* **within the node**: against the median of the node's GPUs, scaled by their MAD (never less
  than the median within-node MAD of the model fleet, as eight GPUs give a noisy MAD), so a
  node whose cooling or inlet air heats every GPU together flags no single GPU;
* **the node against the fleet**: the node's median against the medians of the nodes of the
  same GPU model, so the whole-node shift is reported once, for ``entity="node"``.

A covariate turns a comparison into "at equal load": for temperature at equal power (or power
at equal utilisation) the value is first replaced by its residual from a robust straight-line
fit of value on covariate across the model fleet (least squares, then refit without points
beyond 3 robust z, as in iteratively trimmed regression). A GPU 8 °C hotter than its peers at
the same power is suspicious; one 8 °C hotter because it draws 200 W more is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analytics.windowing import BoolArray, FloatArray, IntArray
from core.records import Anomaly, EntityId, FeatureVector, NodeName

_MAD_SCALE = 1.4826

_SMALL = 64
"""Up to this many GPUs in one group, the fits and medians run on Python floats: numpy's
per-call overhead (``polyfit`` ~60 us, ``median`` ~15 us) dwarfs the arithmetic of a
node's eight GPUs, compared every second on every agent."""


def _median(values: list[float]) -> float:
    """Return the median of finite ``values`` as ``np.median`` does (mean of the middle two)."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2.0


def _small_residuals(x: list[float], y: list[float]) -> list[float]:
    """:func:`robust_residuals` of one small group on Python floats (closed-form least squares)."""
    keep = [True] * len(x)
    slope, intercept = 0.0, _median(y)
    for _ in range(2):
        kx = [xi for xi, k in zip(x, keep, strict=True) if k]
        if len(kx) >= 3 and max(kx) - min(kx) > 0:
            ky = [yi for yi, k in zip(y, keep, strict=True) if k]
            mx, my = sum(kx) / len(kx), sum(ky) / len(ky)
            sxx = sum((xi - mx) * (xi - mx) for xi in kx)
            sxy = sum((xi - mx) * (yi - my) for xi, yi in zip(kx, ky, strict=True))
            slope = sxy / sxx
            intercept = my - slope * mx
        resid = [yi - (slope * xi + intercept) for xi, yi in zip(x, y, strict=True)]
        centre = _median(resid)
        bound = 3.0 * max(_median([abs(r - centre) for r in resid]) * _MAD_SCALE, 1e-9)
        keep = [abs(r - centre) <= bound for r in resid]
    return [yi - (slope * xi + intercept) for xi, yi in zip(x, y, strict=True)]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerVerdict:
    """Result of one peer comparison, aligned with the input rows.

    Attributes:
        value: The compared value (the residual at equal covariate when one was given).
        z_node: Robust z-score of each GPU against the other GPUs of its node (0 without peers).
        z_fleet: Robust z-score of each GPU's node median against the other nodes of its model.
        flagged: GPU deviates from its node peers: ``|z_node| > z_threshold`` (upper only
            when ``upper_only``).
        node_flagged: The GPU's whole node deviates from its model fleet.
    """

    value: FloatArray
    z_node: FloatArray
    z_fleet: FloatArray
    flagged: BoolArray
    node_flagged: BoolArray


def robust_residuals(value: FloatArray, covariate: FloatArray, group: IntArray) -> FloatArray:
    """Residual of ``value`` from a trimmed least-squares line on ``covariate``, per group.

    Examples:
        >>> power = np.array([100.0, 200.0, 300.0, 400.0, 250.0])
        >>> temp = 30.0 + 0.1 * power + np.array([0.0, 0.0, 0.0, 0.0, 8.0])
        >>> robust_residuals(temp, power, np.zeros(5, dtype=np.int64)).round(1).tolist()
        [0.0, 0.0, 0.0, 0.0, 8.0]
    """
    if (0 < value.size <= _SMALL and np.all(group == group[0])
            and np.isfinite(value).all() and np.isfinite(covariate).all()):
        return np.array(_small_residuals(covariate.tolist(), value.tolist()), dtype=np.float64)
    out = np.zeros_like(value)
    for g in np.unique(group):
        rows = np.flatnonzero(group == g)
        x, y = covariate[rows], value[rows]
        keep = np.ones(rows.size, dtype=bool)
        slope, intercept = 0.0, float(np.median(y))
        for _ in range(2):
            if keep.sum() >= 3 and np.ptp(x[keep]) > 0:
                slope, intercept = np.polyfit(x[keep], y[keep], 1)
            resid = y - (slope * x + intercept)
            centre = np.median(resid)
            mad = np.median(np.abs(resid - centre)) * _MAD_SCALE
            keep = np.abs(resid - centre) <= 3.0 * max(mad, 1e-9)
        out[rows] = y - (slope * x + intercept)
    return out


class PeerComparison:
    """Robust peer comparison of one metric across the fleet, node-shift aware.

    Args:
        z_threshold: Robust z beyond which a GPU (or node) deviates; > 0.
        min_peers: Fewest other GPUs in the node (or other nodes of the model) to compare
            with; >= 2. With fewer, the z-score is 0 (no verdict).
        min_scale: Floor on the robust scale, in the metric's unit, so identical peers do not
            turn tiny differences into huge z-scores (e.g. 1.0 for °C); >= 0.
        upper_only: Flag only values above the peers (hot, high error rate).

    Raises:
        ValueError: An argument is out of range.

    Examples:
        >>> peers = PeerComparison(min_scale=0.5)
        >>> node = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
        >>> temp = np.array([60, 61, 60, 75, 70, 71, 70, 71, 60, 61, 61, 60], dtype=float)
        >>> v = peers.compare(temp, node=node, group=np.zeros(12, dtype=np.int64))
        >>> v.flagged.nonzero()[0].tolist()  # GPU 3 only; node 1 is hot as a whole
        [3]
    """

    def __init__(
        self,
        *,
        z_threshold: float = 5.0,
        min_peers: int = 3,
        min_scale: float = 0.0,
        upper_only: bool = True,
    ) -> None:
        if z_threshold <= 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold!r}")
        if min_peers < 2:
            raise ValueError(f"min_peers must be >= 2, got {min_peers}")
        if min_scale < 0:
            raise ValueError(f"min_scale must be >= 0, got {min_scale!r}")
        self.z_threshold = z_threshold
        self.min_peers = min_peers
        self.min_scale = min_scale
        self.upper_only = upper_only

    def _exceeds(self, z: FloatArray) -> BoolArray:
        if self.upper_only:
            return z > self.z_threshold
        return np.abs(z) > self.z_threshold

    def compare(
        self,
        value: FloatArray,
        *,
        node: IntArray,
        group: IntArray,
        covariate: FloatArray | None = None,
    ) -> PeerVerdict:
        """Compare each GPU with its node peers, and each node with its model fleet.

        Args:
            value: One value per GPU, shape ``(n,)``, in the metric's unit.
            node: Node code of each GPU, shape ``(n,)``.
            group: GPU-model code of each GPU, shape ``(n,)`` (compare like with like).
            covariate: Optional load per GPU (e.g. watts), shape ``(n,)``; compares at equal load.

        Returns:
            A :class:`PeerVerdict` aligned with the rows.
        """
        v = robust_residuals(value, covariate, group) if covariate is not None else value
        if v.size and np.all(node == node[0]) and np.all(group == group[0]):
            return self._one_node(np.asarray(v, dtype=np.float64))
        return self._grouped(v, node, group)

    def _grouped(self, v: FloatArray, node: IntArray, group: IntArray) -> PeerVerdict:
        import pandas as pd  # at first use: an agent without peers never loads it

        frame = pd.DataFrame({"v": v, "node": node, "group": group})
        by_node = frame.groupby(["group", "node"])["v"]
        count = by_node.transform("size").to_numpy()
        median = by_node.transform("median").to_numpy()
        frame["dev"] = np.abs(v - median)
        frame["mad"] = frame.groupby(["group", "node"])["dev"].transform("median")
        # Eight GPUs give a noisy MAD: never use less than the model's typical within-node MAD.
        node_mads = frame.groupby(["group", "node"], as_index=False)["mad"].first()
        node_mads["pooled"] = node_mads.groupby("group")["mad"].transform("median")
        pooled = (
            frame[["group", "node"]]
            .merge(node_mads[["group", "node", "pooled"]], on=["group", "node"], how="left")[
                "pooled"
            ]
            .to_numpy()
        )
        mad = np.maximum(frame["mad"].to_numpy(), pooled)
        scale = np.maximum(_MAD_SCALE * mad, self.min_scale)
        scale = np.where(scale > 0, scale, np.inf)
        z_node = np.where(count - 1 >= self.min_peers, (v - median) / scale, 0.0)
        # Node medians against the other nodes of the same model.
        nodes = frame.assign(m=median).groupby(["group", "node"], as_index=False)["m"].first()
        per_group = nodes.groupby("group")["m"]
        n_nodes = per_group.transform("size").to_numpy()
        fleet_median = per_group.transform("median").to_numpy()
        nodes["dev"] = np.abs(nodes["m"].to_numpy() - fleet_median)
        fleet_mad = nodes.groupby("group")["dev"].transform("median").to_numpy()
        fleet_scale = np.maximum(_MAD_SCALE * fleet_mad, self.min_scale)
        fleet_scale = np.where(fleet_scale > 0, fleet_scale, np.inf)
        nodes["z"] = np.where(
            n_nodes - 1 >= self.min_peers, (nodes["m"].to_numpy() - fleet_median) / fleet_scale, 0.0
        )
        z_fleet = (
            frame[["group", "node"]]
            .merge(nodes[["group", "node", "z"]], on=["group", "node"], how="left")["z"]
            .to_numpy()
        )
        return PeerVerdict(
            value=np.asarray(v, dtype=np.float64),
            z_node=z_node,
            z_fleet=z_fleet,
            flagged=self._exceeds(z_node),
            node_flagged=self._exceeds(z_fleet),
        )

    def _one_node(self, v: FloatArray) -> PeerVerdict:
        """Compare the GPUs of one node of one model, in numpy.

        This is what ``gpuhealth run`` asks per node, where the pandas group-bys cost about
        70 ms a call. The pooled MAD of one node is its own, and a node has no other node to
        be compared with (``z_fleet`` 0), so the verdict is the general one's.
        """
        if v.size <= _SMALL and np.isfinite(v).all():
            values = v.tolist()
            median = _median(values)
            mad = _median([abs(x - median) for x in values])
        else:
            median = float(np.median(v))
            mad = float(np.median(np.abs(v - median)))
        scale = max(_MAD_SCALE * mad, self.min_scale)
        z_node = (v - median) / scale if scale > 0 else np.zeros_like(v)
        if v.size - 1 < self.min_peers:
            z_node = np.zeros_like(v)
        z_fleet = np.zeros_like(v)
        return PeerVerdict(
            value=v,
            z_node=z_node,
            z_fleet=z_fleet,
            flagged=self._exceeds(z_node),
            node_flagged=self._exceeds(z_fleet),
        )


class PeerDetector:
    """``Detector`` adapter: compares each arriving feature vector with its peers' latest ones.

    Keeps the latest feature vector of every entity (dropping those older than
    ``max_age_seconds``), and on each :meth:`observe` compares every feature of the entity
    with the same feature of the other entities through :class:`PeerComparison` (all entities
    form one model group; give each GPU model its own detector). Peer comparison has no model
    to train, so there is nothing to learn from flagged points; the warm-up is ``min_peers``.
    For a whole fleet per tick, call :meth:`PeerComparison.compare` on the columns instead
    (``observe`` is O(fleet) per call).

    Args:
        z_threshold: See :class:`PeerComparison`.
        min_peers: See :class:`PeerComparison`.
        min_scale: See :class:`PeerComparison`.
        max_age_seconds: Peer vectors older than this are ignored; > 0.

    Raises:
        ValueError: An argument is out of range.
    """

    name = "peers"

    def __init__(
        self,
        *,
        z_threshold: float = 5.0,
        min_peers: int = 3,
        min_scale: float = 0.0,
        max_age_seconds: float = 120.0,
    ) -> None:
        if max_age_seconds <= 0:
            raise ValueError(f"max_age_seconds must be > 0, got {max_age_seconds!r}")
        self.z_threshold = z_threshold
        self.min_peers = min_peers
        self.min_scale = min_scale
        self.max_age_seconds = max_age_seconds
        self._compare = PeerComparison(
            z_threshold=z_threshold, min_peers=min_peers, min_scale=min_scale
        )
        self._latest: dict[tuple[NodeName, EntityId], FeatureVector] = {}

    def observe(self, x: FeatureVector) -> Anomaly | None:
        """Store ``x`` as its entity's latest vector; return its worst peer deviation, if any."""
        self._latest[(x.node, x.entity)] = x
        now = x.window_end_at
        fresh = [v for v in self._latest.values() if now - v.window_end_at <= self.max_age_seconds]
        nodes: dict[NodeName, int] = {}
        worst: Anomaly | None = None
        for feature in sorted(x.values):
            rows = [v for v in fresh if feature in v.values]
            if len(rows) <= self.min_peers:
                continue
            me = next(i for i, v in enumerate(rows) if (v.node, v.entity) == (x.node, x.entity))
            verdict = self._compare.compare(
                np.array([v.values[feature] for v in rows]),
                node=np.array([nodes.setdefault(v.node, len(nodes)) for v in rows]),
                group=np.zeros(len(rows), dtype=np.int64),
            )
            if verdict.flagged[me]:
                z = float(verdict.z_node[me])
                if worst is None or z > worst.score:
                    worst = Anomaly(
                        detector=self.name,
                        node=x.node,
                        entity=x.entity,
                        score=z,
                        threshold=self.z_threshold,
                        observed_at=now,
                    )
        return worst


@dataclass(slots=True)
class _Episode:
    baseline: float
    last_at: float
    above_since: float | None = None
    below_since: float | None = None
    open: bool = False


class PeerEpisodes:
    """One report per episode of a GPU drifting away from its peers, with hysteresis.

    A robust z against the peers says how far a GPU is from them now; a GPU that is always
    a few degrees warmer (its slot, its paste) sits near the threshold and crossed it again
    and again (issue #15: 18,084 reports for 138 GPUs). Here each GPU keeps its own usual z
    (``baseline``, an exponential average with time constant ``baseline_seconds``, starting
    at 0: like its peers) and an episode **opens** when the z is above ``open_z`` *and*
    above the baseline by more than ``growth_z``, continuously for ``persist_seconds``; it
    **closes** when the z stays below ``close_z``, or the excess below half of ``growth_z``,
    for ``close_seconds`` (a noisy z dipping under the threshold ends nothing).
    :meth:`update` returns ``True`` once, when an episode opens. A GPU warmer from the start
    is reported once at most; as its baseline learns its offset it is not reported again
    unless its deviation grows.

    Args:
        open_z: Robust z an episode needs, > ``close_z``.
        close_z: Robust z below which it ends.
        growth_z: Excess over the GPU's own baseline an episode needs, > 0.
        persist_seconds: How long both must hold before it opens, >= 0.
        baseline_seconds: Time constant of the baseline, > 0.
        close_seconds: How long the deviation must be gone before an episode ends, >= 0.

    Raises:
        ValueError: An argument out of range.
    """

    def __init__(self, *, open_z: float = 5.0, close_z: float = 3.0, growth_z: float = 3.0,
                 persist_seconds: float = 120.0, baseline_seconds: float = 86_400.0,
                 close_seconds: float = 3600.0) -> None:
        if (not open_z > close_z or growth_z <= 0 or persist_seconds < 0
                or baseline_seconds <= 0 or close_seconds < 0):
            raise ValueError("need open_z > close_z, growth_z > 0, persist_seconds >= 0, "
                             "baseline_seconds > 0 and close_seconds >= 0")
        self.close_seconds = close_seconds
        self.open_z = open_z
        self.close_z = close_z
        self.growth_z = growth_z
        self.persist_seconds = persist_seconds
        self.baseline_seconds = baseline_seconds
        self._state: dict[tuple[NodeName, EntityId], _Episode] = {}

    def is_open(self, key: tuple[NodeName, EntityId]) -> bool:
        """Whether ``key`` is in an episode now."""
        state = self._state.get(key)
        return state is not None and state.open

    def update(self, key: tuple[NodeName, EntityId], z: float, at: float) -> bool:
        """Take the GPU's robust z at ``at``; return ``True`` when an episode opens now."""
        state = self._state.get(key)
        if state is None:
            state = self._state[key] = _Episode(baseline=0.0, last_at=at)
        if not math.isfinite(z):
            return False
        excess = z - max(state.baseline, 0.0)
        alpha = min(1.0, max(0.0, at - state.last_at) / self.baseline_seconds)
        state.baseline += alpha * (z - state.baseline)
        state.last_at = max(state.last_at, at)
        if state.open:
            if z < self.close_z or excess < self.growth_z / 2.0:
                if state.below_since is None:
                    state.below_since = at
                if at - state.below_since >= self.close_seconds:
                    state.open = False
                    state.below_since = None
            else:
                state.below_since = None
            return False
        if z > self.open_z and excess > self.growth_z:
            if state.above_since is None:
                state.above_since = at
            if at - state.above_since >= self.persist_seconds:
                state.open = True
                state.above_since = None
                return True
        else:
            state.above_since = None
        return False
