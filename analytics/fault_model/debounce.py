"""Debounce: a polled state becomes a finding only when it holds for N of M readings.

A link that reads down once and up at the next poll is noise on a busy fleet (a retrain,
a firmware poll racing a reset); remediating it would drain nodes for nothing. So for the
kinds that are *states read by polling* (:data:`SIGNALS`: NVLink state, PCIe link width
and generation, InfiniBand port state, bond members), a finding of that kind on an
entity stands only when at least ``n`` of that entity's last ``m`` readings showed the
state bad. A reading is one poll: the samples of the state's metrics with one
``observed_at`` (all links of one GPU read in one poll are one reading). Readings are
counted as they arrive, whatever the evaluation cadence, so ``run``, ``agent`` and
``replay`` of a recording count the same polls.

Once a finding stands it stays while the rule still yields it (the debounce gates only
*becoming* a finding; a finding clears as its rule says). What is not debounced:

* events (an Xid, an AER error, a lost GPU): each is a fact, never a reading;
* readings without a time (a pasted ``nvidia-smi -q``): a snapshot is not a poll
  history, so it is judged as ``diagnose`` judges it;
* findings of an entity with no timed reading of the state (the state came from an
  artifact event, or from another source than the polled metrics).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from core.records import Finding, Record, Sample

SeriesValues = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Latest value per ``(metric, labels)`` of one entity's state."""


def _nvlink_bad(values: SeriesValues) -> bool:
    return any(v < 1 for (metric, _), v in values.items() if metric == "gpu_nvlink_state")


def _below_max(metric: str) -> Callable[[SeriesValues], bool]:
    def bad(values: SeriesValues) -> bool:
        bounds = {dict(labels).get("bound", ""): v for (m, labels), v in values.items()
                  if m == metric}
        cur, cap = bounds.get("current"), bounds.get("max")
        return cur is not None and cap is not None and cur < cap
    return bad


def _ib_port_bad(values: SeriesValues) -> bool:
    # IBA PortInfo PortState: 4 = Active (5 = ActiveDefer); anything below carries no traffic.
    return any(v < 4 for (metric, _), v in values.items() if metric == "ib_port_state")


def _bond_bad(values: SeriesValues) -> bool:
    by = {metric: v for (metric, _), v in values.items()}
    up, members, active = by.get("net_bond_up"), by.get("net_bond_members"), by.get(
        "net_bond_members_active")
    return (up is not None and up < 1) or (
        members is not None and active is not None and active < members)


@dataclass(frozen=True, slots=True)
class Signal:
    """A polled state behind findings of one kind (and some of its codes).

    Attributes:
        name: Name of the signal (its readings are counted per node, entity and name).
        kind: Finding kind it gates; the configuration key.
        codes: Finding codes it gates (``None``: every code of the kind).
        code_prefix: Or the codes starting with this (``state_`` of ``ib_port``).
        metrics: The sample metrics that are its readings.
        bad: Whether the latest values of those metrics (one entity) show the state bad.
    """

    name: str
    kind: str
    codes: frozenset[str] | None
    code_prefix: str | None
    metrics: frozenset[str]
    bad: Callable[[SeriesValues], bool]

    def gates(self, kind: str, code: str) -> bool:
        """True when findings of ``kind`` and ``code`` are ones this signal debounces."""
        if kind != self.kind:
            return False
        if self.code_prefix is not None:
            return code.startswith(self.code_prefix)
        return self.codes is None or code in self.codes


SIGNALS: tuple[Signal, ...] = (
    Signal("nvlink", "nvlink", None, None, frozenset({"gpu_nvlink_state"}), _nvlink_bad),
    Signal("pcie_width", "pcie", frozenset({"link_width"}), None,
           frozenset({"gpu_pcie_link_width"}), _below_max("gpu_pcie_link_width")),
    Signal("pcie_generation", "pcie", frozenset({"link_generation"}), None,
           frozenset({"gpu_pcie_link_generation"}), _below_max("gpu_pcie_link_generation")),
    Signal("ib_port", "ib_port", None, "state_", frozenset({"ib_port_state"}), _ib_port_bad),
    Signal("bond", "bond", frozenset({"bond_down", "members_down"}), None,
           frozenset({"net_bond_up", "net_bond_members", "net_bond_members_active"}),
           _bond_bad),
)
"""Every polled state that can be debounced. Not ``gpu_lost``: NVML reports a lost GPU
once (an event, as the kernel's Xid 79 is), and a GPU that cannot be read is not a
reading of a bad state but the absence of readings (``telemetry_gap``)."""

DEBOUNCED_KINDS = frozenset(s.kind for s in SIGNALS)
"""Finding kinds that may be debounced (the ``[analytics.debounce]`` keys)."""

DEFAULT_DEBOUNCE: Mapping[str, tuple[int, int]] = {
    "nvlink": (2, 3),
    "pcie": (2, 3),
    "ib_port": (2, 3),
    "bond": (2, 3),
}
"""Default ``(n, m)`` per kind: two of the last three readings. With NVML's 30 s slow poll
an NVLink or PCIe fault is a finding after 30-60 s, an IB port or a bond (10 s polls)
after 10-20 s; one bad reading between good ones raises nothing."""

MAX_WINDOW = 100
"""Largest ``m``: the bits are kept per entity and signal."""


def check_policy(kind: str, n: int, m: int) -> str | None:
    """Return what is wrong with one ``kind = {n, m}`` (``None`` when it is fine)."""
    if kind not in DEBOUNCED_KINDS:
        return ("not a polled state (events such as an Xid are never debounced); "
                f"debounced kinds: {', '.join(sorted(DEBOUNCED_KINDS))}")
    if not 1 <= n <= m:
        return f"needs 1 <= n <= m, got n = {n}, m = {m}"
    if m > MAX_WINDOW:
        return f"m = {m} is more than {MAX_WINDOW} readings"
    return None


@dataclass(slots=True)
class _State:
    """Readings of one signal on one entity."""

    values: SeriesValues = field(default_factory=dict)
    bits: deque[bool] = field(default_factory=deque)
    pending: float | None = None
    """Time of the reading still being gathered (its samples may come in several batches)."""
    closed: float | None = None
    """Time of the latest reading counted."""


class Debouncer:
    """Counts readings of polled states and holds back findings until N of M were bad.

    Args:
        policies: ``(n, m)`` per finding kind of :data:`DEBOUNCED_KINDS`; a kind not
            given, or given ``(1, 1)``, is not debounced.

    Raises:
        ValueError: A policy is invalid (:func:`check_policy`).
    """

    def __init__(self, policies: Mapping[str, tuple[int, int]] = DEFAULT_DEBOUNCE) -> None:
        for kind, (n, m) in policies.items():
            problem = check_policy(kind, n, m)
            if problem is not None:
                raise ValueError(f"debounce {kind}: {problem}")
        self.policies = {k: (n, m) for k, (n, m) in policies.items() if (n, m) != (1, 1)}
        self.signals = tuple(s for s in SIGNALS if s.kind in self.policies)
        self.metrics: frozenset[str] = frozenset().union(*(s.metrics for s in self.signals))
        """Every metric whose readings are counted (the service passes them unchanged too)."""
        self._of_metric: dict[str, list[Signal]] = {}
        for signal in self.signals:
            for metric in signal.metrics:
                self._of_metric.setdefault(metric, []).append(signal)
        self._states: dict[tuple[str, str, str], _State] = {}
        self._admitted: set[tuple[str, str, str, str]] = set()
        self.held: list[Finding] = []
        """Findings held back at the latest :meth:`apply` (for logs and tests)."""

    def __bool__(self) -> bool:
        return bool(self.signals)

    def observe(self, records: Iterable[Record]) -> None:
        """Count the readings among ``records`` (samples of :attr:`metrics` with a time)."""
        if not self._of_metric:
            return
        for record in records:
            if not isinstance(record, Sample) or record.observed_at is None:
                continue
            signals = self._of_metric.get(record.metric)
            if signals is None:
                continue
            labels = tuple(sorted(record.labels.items())) if record.labels else ()
            at = record.observed_at
            for signal in signals:
                key = (str(record.node), str(record.entity), signal.name)
                state = self._states.get(key)
                if state is None:
                    state = self._states[key] = _State(
                        bits=deque(maxlen=self.policies[signal.kind][1]))
                if state.closed is not None and at <= state.closed:
                    continue  # a late sample of a reading already counted (or an older one)
                if state.pending is not None and at != state.pending:
                    self._close(signal, state)  # a newer poll: the previous one is complete
                    if state.closed is not None and at <= state.closed:
                        continue
                state.pending = at
                state.values[(record.metric, labels)] = record.value

    def _close(self, signal: Signal, state: _State) -> None:
        if state.pending is None:
            return
        state.bits.append(signal.bad(state.values))
        state.closed, state.pending = state.pending, None

    def counts(self, node: str, entity: str, kind: str, code: str) -> tuple[int, int] | None:
        """Return ``(bad, readings)`` of the signal behind that finding, or ``None``."""
        for signal in self.signals:
            if signal.gates(kind, code):
                state = self._states.get((node, entity, signal.name))
                if state is None:
                    return None
                self._close(signal, state)
                return sum(state.bits), len(state.bits)
        return None

    def apply(self, findings: Sequence[Finding]) -> list[Finding]:
        """Return the findings that stand; keep the held-back ones in :attr:`held`.

        The readings gathered so far count as complete (an evaluation closes them).
        """
        if not self.signals:
            self.held = []
            return list(findings)
        by_name = {s.name: s for s in self.signals}
        for (_node, _entity, name), state in self._states.items():
            if state.pending is not None:
                self._close(by_name[name], state)
        standing: list[Finding] = []
        held: list[Finding] = []
        admitted: set[tuple[str, str, str, str]] = set()
        for finding in findings:
            signal = next((s for s in self.signals if s.gates(finding.kind, finding.code)), None)
            if signal is None:
                standing.append(finding)
                continue
            known = self._states.get((finding.node, finding.entity, signal.name))
            if known is None or not known.bits:
                standing.append(finding)  # no timed reading: a snapshot, not a poll history
                continue
            n = self.policies[signal.kind][0]
            if finding.key in self._admitted or sum(known.bits) >= n:
                admitted.add(finding.key)
                standing.append(finding)
            else:
                held.append(finding)
        self._admitted = admitted
        self.held = held
        return standing

    def summary(self) -> str:
        """``nvlink 2/3, pcie 2/3`` (the policies in force), or ``off``."""
        return ", ".join(f"{k} {n}/{m}" for k, (n, m) in sorted(self.policies.items())) or "off"
