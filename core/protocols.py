"""Plugin Protocols (style.md C.2): structural, runtime-checkable, one method where possible.

Plugins do not inherit from gpuhealth classes; they depend only on ``core.records``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from core.records import (
    ActionRequest,
    ActionStatus,
    Alert,
    Anomaly,
    EntityId,
    Event,
    FeatureVector,
    NodeName,
    NodeState,
    Sample,
    WorkRef,
)

if TYPE_CHECKING:
    import pandas as pd

    from core.records import EntityRef


@runtime_checkable
class Collector(Protocol):
    """Reads one source on the local node (entry-point group ``gpuhealth.collectors``)."""

    name: str

    def collect(self) -> Iterable[Sample | Event]:
        """Return the samples and events available now.

        Fields the device does not support are omitted, never filled.

        Raises:
            CollectorUnavailable: The source cannot be read at all.
        """
        ...


@runtime_checkable
class StreamingCollector(Collector, Protocol):
    """A collector whose source pushes events (kernel log, NVML events); run in its own thread."""

    def stream(self) -> Iterator[Event]:
        """Yield events as they arrive; return when :meth:`close` is called."""
        ...

    def close(self) -> None:
        """Ask :meth:`stream` to return soon."""
        ...


@runtime_checkable
class Store(Protocol):
    """A time-series store (entry-point group ``gpuhealth.stores``)."""

    def write(self, samples: Sequence[Sample], events: Sequence[Event]) -> None:
        """Persist a batch.

        Raises:
            TemporaryError: Transient I/O failure; the batch was not written.
        """
        ...

    def read(
        self,
        metric: str,
        entities: Sequence[EntityRef] | None,
        since_at: float,
        until_at: float,
        step_seconds: float | None = None,
    ) -> pd.DataFrame:
        """Read a window back: columns ``observed_at, node, entity, value`` (plus labels)."""
        ...

    def entities(self) -> Sequence[EntityRef]:
        """List the entities with stored samples."""
        ...


Batch = tuple[Sequence[Sample], Sequence[Event]]
"""One ``Store.write`` call's arguments: (samples, events)."""


@runtime_checkable
class StreamingStore(Store, Protocol):
    """A store that writes a run of batches faster than one ``write`` call after another.

    For bulk writes (``gpuhealth import``, a spool's backlog): a remote store encodes the
    next batch while the one before is on the wire. Use :func:`write_batches`, which falls
    back to ``write`` for stores without it.
    """

    def write_stream(self, batches: Iterable[Batch], *,
                     on_written: Callable[[int], None] | None = None) -> int:
        """Write ``batches`` in order; return how many were written.

        ``on_written(n)`` is called once the first ``n`` batches are written.

        Raises:
            TemporaryError: A batch failed; the ones before it were written, it and the
                later ones were not.
        """
        ...


def write_batches(store: Store, batches: Iterable[Batch]) -> int:
    """Write ``batches`` in order through ``store``; return how many were written.

    Through :meth:`StreamingStore.write_stream` where the store has it, else one
    ``write`` after another. Errors are the store's; the batches before the failing one
    were written.
    """
    if isinstance(store, StreamingStore):
        return store.write_stream(batches)
    count = 0
    for samples, events in batches:
        store.write(samples, events)
        count += 1
    return count


@runtime_checkable
class Detector(Protocol):
    """Scores feature vectors (entry-point group ``gpuhealth.detectors``); CPU only, no I/O."""

    name: str

    def observe(self, x: FeatureVector) -> Anomaly | None:
        """Score ``x`` then learn from it unless it is anomalous."""
        ...


@runtime_checkable
class Notifier(Protocol):
    """Delivers alerts (entry-point group ``gpuhealth.notifiers``)."""

    name: str

    async def send(self, alert: Alert) -> None:
        """Deliver one alert.

        Raises:
            NotifierUnavailable: Temporary failure; the caller retries.
            PermanentError: The alert can never be delivered as it is.
        """
        ...


@runtime_checkable
class SchedulerAdapter(Protocol):
    """Carries out remediation steps (entry-point group ``gpuhealth.schedulers``)."""

    name: str

    async def submit(self, request: ActionRequest) -> str:
        """Start the step; idempotent on ``request.idempotency_key``. Returns a ref to poll."""
        ...

    async def status(self, ref: str) -> ActionStatus:
        """Report how far the step got."""
        ...


@runtime_checkable
class WorkLocator(Protocol):
    """A scheduler adapter that can name the work on a node (jobs, pods), for attribution."""

    async def work_on(self, node: NodeName, entity: EntityId | None = None) -> list[WorkRef]:
        """The work holding ``node`` (or its GPU ``entity``) now.

        Raises:
            TemporaryError: The scheduler cannot be reached.
        """
        ...


@runtime_checkable
class NodeInspector(Protocol):
    """A scheduler adapter that can show a node's state (ownership, opt-out, work on it).

    The remediation engine reads it before every step that changes a node and before
    undoing one, so that a human's change always wins (``docs/remediation.md``).
    """

    async def node_state(self, node: NodeName, *, workload: bool = True) -> NodeState:
        """Return the node as the scheduler shows it now.

        ``workload=False`` skips counting the work on the node (``running`` is then 0): the
        engine's checks before a step need only ownership and opt-out, one call fewer.

        Raises:
            SchedulerUnavailable: The scheduler cannot be reached now.
        """
        ...


@runtime_checkable
class ReliabilityPublisher(Protocol):
    """A scheduler adapter that can steer placement by a node's reliability score."""

    async def set_reliability(self, node: NodeName, score: float) -> None:
        """Publish ``score`` (0 = fails all the time, 1 = most stable) for placement.

        Slurm: node ``Weight`` (lower weight is preferred); Kubernetes: label
        ``gpuhealth.io/reliability``. Idempotent.
        """
        ...


@runtime_checkable
class ReliabilityReader(Protocol):
    """A publisher that can read back, in one call, the scores its nodes show now.

    A new leader (or a restarted controller) knows nothing of what was published before
    it; without this it publishes every scored node again (10,000 node updates after a
    fail-over at 10,000 nodes).
    """

    async def published_reliability(self) -> dict[NodeName, float]:
        """Return ``{node: score}`` for every node that shows one (0-1).

        Raises:
            SchedulerUnavailable: The scheduler cannot be reached now.
        """
        ...


@runtime_checkable
class LeaderElector(Protocol):
    """Only the leader acts (entry-point group ``gpuhealth.electors``).

    A holder keeps leadership by calling :meth:`renew` well within ``ttl_seconds``;
    a standby calls :meth:`try_acquire` periodically and wins once the holder's lease
    has expired or was released.
    """

    identity: str
    ttl_seconds: float

    def try_acquire(self) -> bool:
        """Try to become (or stay) leader; return whether this process is leader now.

        Raises:
            TemporaryError: The backend cannot be reached (the caller is then not leader).
        """
        ...

    def renew(self) -> bool:
        """Extend the lease; return ``False`` if leadership was lost."""
        ...

    def release(self) -> None:
        """Give leadership up at once (clean shut-down)."""
        ...

    def leader(self) -> str | None:
        """Return the current leader's identity, or ``None`` when there is none."""
        ...


# Optional capabilities: a plugin declares them by having the member; the wiring checks
# them with ``isinstance`` against these Protocols instead of probing with ``getattr``.


@runtime_checkable
class Closeable(Protocol):
    """Holds resources (files, sockets, threads) to release at shut-down."""

    def close(self) -> None:
        """Release them; idempotent."""
        ...


@runtime_checkable
class AsyncCloseable(Protocol):
    """Holds resources on an event loop (HTTP clients, running drains)."""

    async def aclose(self) -> None:
        """Release them on the loop that used them; idempotent."""
        ...


@runtime_checkable
class Resending(Protocol):
    """A notifier that wants every firing alert again at an interval (Alertmanager)."""

    resend_interval_seconds: float


@runtime_checkable
class GpuLevelDrainer(Protocol):
    """A scheduler adapter that says whether it can drain one GPU's work, not the node's."""

    gpu_level_drain: bool


@runtime_checkable
class ActionReporter(Protocol):
    """A scheduler adapter whose steps an external automation reports (the webhook)."""

    def report(self, ref: str, phase: Any, message: str = "") -> Any:
        """Take an outcome reported for ``ref``."""
        ...


@runtime_checkable
class ErrorCounting(Protocol):
    """A collector that counts its own errors by reason (``gpuhealth_collector_errors_total``)."""

    errors_total: Mapping[str, int]
