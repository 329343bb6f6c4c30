"""Plugin Protocols (style.md C.2): structural, runtime-checkable, one method where possible.

Plugins do not inherit from gpuhealth classes; they depend only on ``core.records``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from core.records import ActionRequest, ActionStatus, Alert, Anomaly, Event, FeatureVector, Sample

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
