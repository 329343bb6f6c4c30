"""Reliability-aware placement: a score per node from its incident history and predictions.

The score steers schedulers towards the most stable nodes for critical jobs: it is
exported as ``gpuhealth_node_reliability_ratio{node}``, written as the Kubernetes node
label ``gpuhealth.io/reliability`` and as the Slurm node ``Weight`` (lower weight is
preferred by Slurm's node selection) through
:class:`~core.protocols.ReliabilityPublisher` adapters.

Formula (a documented heuristic, not from a paper)::

    score = (1 - p_fail) * 0.5 ** (sum over incidents of w_severity * 0.5 ** (age / half_life))

with ``w`` = 1 for critical, 0.5 for major, 0.1 for warning (0 for info); ``p_fail`` is
the node's highest current failure probability from the predictor (0 if none). One
fresh critical incident halves the score; it recovers with a half-life of 30 days by
default, so a node that failed last week ranks below one that failed last quarter,
which ranks below one that never failed (MTBF-style ranking without a model fit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from remediation.actions import IncidentMark, StoredIncident

SEVERITY_WEIGHT: Mapping[str, float] = {"critical": 1.0, "major": 0.5, "warning": 0.1}
"""Weight of an incident in the score, by the severity of its finding."""


def reliability_scores(
    incidents: Iterable[StoredIncident | IncidentMark],
    *,
    predictions: Mapping[str, float] | None = None,
    nodes: Iterable[str] = (),
    now: float,
    half_life_seconds: float = 30 * 86400.0,
) -> dict[str, float]:
    """Return a score in [0, 1] per node (1 = most stable); see the module docstring.

    Args:
        incidents: Incident history (any age; older ones weigh less): stored incidents
            or their marks (:meth:`~remediation.actions.ActionStore.incident_marks`).
        predictions: Highest current failure probability per node, in [0, 1].
        nodes: Nodes to score even without incidents or predictions (they score 1).
        now: Epoch seconds.
        half_life_seconds: How fast an incident's weight decays, > 0.

    Raises:
        ValueError: ``half_life_seconds`` <= 0.

    Examples:
        >>> from remediation.actions import IncidentMark, StoredIncident
        >>> inc = StoredIncident(incident="f", fingerprint="f", node="n1", entity="node",
        ...                      kind="xid", code="79", severity="critical", state="closed",
        ...                      opened_at=0.0)
        >>> reliability_scores([inc], nodes=["n2"], now=0.0)
        {'n2': 1.0, 'n1': 0.5}
        >>> reliability_scores([IncidentMark("n1", "warning", 0.0)], now=0.0)
        {'n1': 0.933}
    """
    if half_life_seconds <= 0:
        raise ValueError(f"half_life_seconds must be > 0, got {half_life_seconds}")
    load: dict[str, float] = dict.fromkeys(nodes, 0.0)
    for inc in incidents:
        weight = SEVERITY_WEIGHT.get(inc.severity, 0.0)
        age = max(0.0, now - inc.opened_at)
        load[inc.node] = load.get(inc.node, 0.0) + weight * 0.5 ** (age / half_life_seconds)
    for node in predictions or {}:
        load.setdefault(node, 0.0)
    out: dict[str, float] = {}
    for node, value in load.items():
        p_fail = min(1.0, max(0.0, (predictions or {}).get(node, 0.0)))
        out[node] = round((1.0 - p_fail) * 0.5**value, 4)
    return out
