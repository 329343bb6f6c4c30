"""NVML events: a thread waiting on an NVML event set, and Xid deduplication.

:class:`NvmlEventWatcher` registers every GPU for the events the health model needs
(ecosystem-reference §1.8): Xid critical errors (``nvmlEventTypeXidCriticalError``),
single- and double-bit ECC errors and the GPU recovery action
(``nvmlEventTypeGpuRecoveryAction``, the event behind Xid 154), masked by what each GPU
supports (``nvmlDeviceGetSupportedEventTypes``). One daemon thread waits on the set
(``nvmlEventSetWait_v2`` with a short timeout, so that :meth:`NvmlEventWatcher.stop`
is prompt) and turns each event into the records the kernel-log parser would emit for
the same fault (``collectors.kernel_log``; ``analytics.fault_model.xid``):

* Xid ``N``: ``Event(kind="xid", code="N")`` on the canonical PCI bus id of the GPU;
* a double-bit ECC event: Xid 48 (the driver logs a DBE as Xid 48);
* a recovery-action event: Xid 154 with ``recovery_action_code`` and, for the values
  the fault model names, ``recovery_action`` (``GPU Reset Required``...), plus a
  ``gpu_recovery_action`` sample so the state rule sees it at once;
* a single-bit ECC event: ``Event(kind="ecc_event", code="single_bit")``, at most one
  per GPU per :data:`SBE_EVENT_MIN_INTERVAL_SECONDS` (the counters carry the count).

Events are only delivered while the process is registered, so Xids from before the
start are missed: the kernel log stays the other source, and :class:`XidDedup` pairs
the copies of one Xid seen by two sources (or by two NVML event types) into one event.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from core.clock import Clock, system_clock
from core.records import EntityId, Event, Evidence, NodeName, Record, Sample

logger = logging.getLogger(__name__)

EVENT_XID = 0x0008
"""``nvmlEventTypeXidCriticalError``."""
EVENT_SBE = 0x0001
"""``nvmlEventTypeSingleBitEccError``."""
EVENT_DBE = 0x0002
"""``nvmlEventTypeDoubleBitEccError``."""
EVENT_RECOVERY = 0x8000
"""``nvmlEventTypeGpuRecoveryAction``."""
WANTED_EVENTS = EVENT_XID | EVENT_SBE | EVENT_DBE | EVENT_RECOVERY
"""Event types registered when the GPU supports them."""

SBE_EVENT_MIN_INTERVAL_SECONDS = 60.0
"""Single-bit ECC events are reported at most this often per GPU (a storm is one event)."""

DBE_XID = "48"
RECOVERY_XID = "154"
FIELD_RECOVERY_ACTION = 230
"""``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``."""

RECOVERY_ACTION_NAMES = {
    0: "None",
    1: "GPU Reset Required",
    2: "Node Reboot Required",
    3: "Drain P2P",
    4: "Drain and Reset",
}
"""NVML ``NVML_GPU_RECOVERY_ACTION_*`` values with the names the driver prints in Xid 154
(and that ``analytics.fault_model.xid.RECOVERY_ACTIONS`` reads)."""

_NO_INSTANCE = 0xFFFFFFFF
_ERR_TIMEOUT = 10
_ERR_GPU_IS_LOST = 15


@dataclass(frozen=True, slots=True)
class WatchedGpu:
    """What the watcher needs to know about one GPU.

    Attributes:
        index: NVML index.
        handle: The NVML device handle.
        pci_bus_id: Canonical PCI bus id (``0000:b1:00.0``); the entity of events.
        sample_entity: The entity the collector's samples use (UUID, else PCI bus id).
        uuid: GPU UUID, or ``""``.
    """

    index: int
    handle: Any
    pci_bus_id: EntityId
    sample_entity: EntityId
    uuid: str = ""


def handle_key(handle: Any) -> Any:
    """Return a hashable key that is equal for two handles of the same device.

    The binding returns a new ``ctypes`` pointer object for the same device each time
    (``c_nvmlEventData_t.device``), so handles are compared by the address they hold;
    anything else (a test double) is keyed by itself.
    """
    try:
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)
    except (TypeError, ctypes.ArgumentError):
        return ("obj", handle)


class XidDedup:
    """Pairs copies of one fault event seen by different sources into one event.

    An NVML event and the kernel-log line for the same Xid, or NVML's Xid event and
    its double-bit-ECC (Xid 48) or recovery-action (Xid 154) event, arrive within
    seconds of each other. The first copy is admitted; a copy from a *different*
    source of the same ``(node, entity, kind, code)`` that arrives within
    ``window_seconds`` of an unpaired admitted copy is dropped and pairs with it. Repeats
    from the same source are all admitted (an Xid 13 burst stays countable), and each
    admitted copy pairs at most once.

    The kernel-log copy is the richer one (process name and pid, the driver's message);
    with ``hold_seconds`` > 0, :meth:`filter` holds copies from ``hold_sources`` (NVML)
    that long, and a copy from another source that pairs with a held one replaces it.
    Held copies are released by later :meth:`filter` calls (or :meth:`flush`).

    Args:
        window_seconds: How far apart (by arrival) two copies may be.
        clock: Arrival time, seconds (monotonic by default).
        max_keys: Bound on remembered keys; the oldest are forgotten first.
        kinds: Event kinds to pair; other records pass untouched.
        hold_seconds: How long :meth:`filter` holds a copy from ``hold_sources`` for a
            richer copy to replace it; 0 admits the first copy at once.
        hold_sources: Sources whose copies are held (``event.source``).

    Attributes:
        suppressed: Copies dropped so far.
    """

    def __init__(
        self,
        *,
        window_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 4096,
        kinds: Iterable[str] = ("xid", "gpu_lost"),
        hold_seconds: float = 0.0,
        hold_sources: Iterable[str] = ("nvml",),
    ) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be positive")
        if not 0 <= hold_seconds < window_seconds:
            raise ValueError("hold_seconds must be >= 0 and shorter than window_seconds")
        self.window_seconds = window_seconds
        self.clock = clock
        self.max_keys = max_keys
        self.kinds = frozenset(kinds)
        self.suppressed = 0
        self.hold_seconds = hold_seconds
        self.hold_sources = frozenset(hold_sources)
        self._held: list[tuple[float, Event]] = []
        self._open: collections.OrderedDict[
            tuple[str, str, str, str], collections.deque[tuple[float, str]]
        ] = collections.OrderedDict()
        self._lock = threading.Lock()

    def admit(self, event: Event, source: str | None = None) -> bool:
        """Return True when ``event`` is new, False when it is another source's copy.

        Args:
            event: The event.
            source: The stream it came from; ``event.source`` when ``None``.
        """
        if event.kind not in self.kinds:
            return True
        key = (str(event.node), str(event.entity), event.kind, event.code)
        origin = source if source is not None else event.source
        now = self.clock()
        with self._lock:
            open_ = self._open.get(key)
            if open_ is None:
                open_ = self._open[key] = collections.deque()
                while len(self._open) > self.max_keys:
                    self._open.popitem(last=False)
            else:
                self._open.move_to_end(key)
            while open_ and now - open_[0][0] > self.window_seconds:
                open_.popleft()
            for i, (_at, seen) in enumerate(open_):
                if seen != origin:
                    del open_[i]
                    self.suppressed += 1
                    return False
            open_.append((now, origin))
            return True

    def filter(self, records: Iterable[Record]) -> list[Record]:
        """Return ``records`` without the copies :meth:`admit` rejects (samples pass).

        With ``hold_seconds`` > 0, also returns the held copies whose time is up, and
        keeps new copies from ``hold_sources`` back (see the class docstring).
        """
        if not self.hold_seconds:
            return [r for r in records if not isinstance(r, Event) or self.admit(r)]
        out: list[Record] = []
        for record in records:
            if not isinstance(record, Event) or record.kind not in self.kinds:
                out.append(record)
            elif record.source in self.hold_sources:
                if self.admit(record):
                    with self._lock:
                        self._held.append((self.clock(), record))
            elif self._replace_held(record) or self.admit(record):
                out.append(record)
        out.extend(self._release(self.clock() - self.hold_seconds))
        return out

    def flush(self) -> list[Event]:
        """Return every held copy now (at shutdown)."""
        return self._release(float("inf"))

    def _replace_held(self, event: Event) -> bool:
        """Drop a held copy of ``event`` from another source; True when there was one."""
        key = (str(event.node), str(event.entity), event.kind, event.code)
        with self._lock:
            for i, (_at, held) in enumerate(self._held):
                if (str(held.node), str(held.entity), held.kind, held.code) != key:
                    continue
                if held.source == event.source:
                    continue
                del self._held[i]
                open_ = self._open.get(key)
                if open_ is not None:  # the held copy's pairing slot is spent
                    for j, (_t, seen) in enumerate(open_):
                        if seen == held.source:
                            del open_[j]
                            break
                self.suppressed += 1
                return True
        return False

    def _release(self, before: float) -> list[Event]:
        with self._lock:
            due = [event for at, event in self._held if at <= before]
            self._held = [(at, event) for at, event in self._held if at > before]
        return due


class NvmlEventWatcher:
    """Waits on one NVML event set in a daemon thread and buffers the records.

    Args:
        lib: The ``pynvml`` module (or the fake).
        gpus: The GPUs to register.
        node: Node name for the records.
        clock: Epoch seconds stamped on the records.
        wait_ms: Timeout of each ``nvmlEventSetWait_v2``, milliseconds: the longest
            :meth:`stop` waits for the thread.
        read_recovery_action: Reads field 230 of a GPU (for Xid 154 received as an Xid
            event); returns ``None`` when it cannot.
        on_error: Called with ``(reason)`` for every failure, for the collector's counts.

    Attributes:
        registered: Indices of the GPUs registered, with their event masks.
    """

    def __init__(
        self,
        lib: Any,
        gpus: Sequence[WatchedGpu],
        *,
        node: str,
        clock: Clock = system_clock,
        wait_ms: int = 500,
        read_recovery_action: Callable[[WatchedGpu], int | None] | None = None,
        on_error: Callable[[str], None] | None = None,
        max_buffered: int = 10_000,
    ) -> None:
        self.lib = lib
        self.node = NodeName(node)
        self.clock = clock
        self.wait_ms = wait_ms
        self.read_recovery_action = read_recovery_action
        self.on_error = on_error or (lambda reason: None)
        self.registered: dict[int, int] = {}
        self._by_handle = {handle_key(g.handle): g for g in gpus}
        self._gpus = list(gpus)
        self._set: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._buffer: collections.deque[Record] = collections.deque(maxlen=max_buffered)
        self._lock = threading.Lock()
        self._dedup = XidDedup(window_seconds=10.0, clock=time.monotonic)
        self._sbe_at: dict[int, float] = {}
        self._sbe_suppressed: collections.Counter[int] = collections.Counter()
        self._logged: set[str] = set()

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> bool:
        """Create the event set, register every GPU that supports an event, start the thread.

        Returns:
            True when at least one GPU is registered and the thread runs.
        """
        lib = self.lib
        try:
            self._set = lib.nvmlEventSetCreate()
        except lib.NVMLError as exc:
            self._fail("event_set", "NVML events unavailable (nvmlEventSetCreate: %s)", exc)
            return False
        for gpu in self._gpus:
            try:
                supported = int(lib.nvmlDeviceGetSupportedEventTypes(gpu.handle))
                mask = supported & WANTED_EVENTS
                if mask:
                    lib.nvmlDeviceRegisterEvents(gpu.handle, mask, self._set)
                    self.registered[gpu.index] = mask
                else:
                    self.on_error("not_supported")
            except lib.NVMLError as exc:
                self._fail(
                    f"event_register:{gpu.index}",
                    "GPU %s: NVML events not registered: %s",
                    gpu.pci_bus_id,
                    exc,
                )
        if not self.registered:
            self._free()
            return False
        self._thread = threading.Thread(target=self._run, name="gpuhealth-nvml-events", daemon=True)
        self._thread.start()
        logger.info("NVML events: watching %d GPU(s)", len(self.registered))
        return True

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread (within one wait timeout) and free the event set."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout if timeout is not None else self.wait_ms / 1000.0 + 1.0)
            if thread.is_alive():
                logger.warning("NVML event thread did not stop; leaving it (daemon)")
                return
        self._free()

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def drain(self) -> list[Record]:
        """Return and forget the records buffered since the last call."""
        with self._lock:
            out = list(self._buffer)
            self._buffer.clear()
        return out

    def _free(self) -> None:
        event_set, self._set = self._set, None
        if event_set is None:
            return
        try:
            self.lib.nvmlEventSetFree(event_set)
        except self.lib.NVMLError as exc:
            logger.debug("nvmlEventSetFree failed: %s", exc)

    def _fail(self, key: str, msg: str, *args: object) -> None:
        self.on_error(key.split(":", 1)[0])
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(msg, *args)

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        lib = self.lib
        failures = 0
        while not self._stop.is_set():
            try:
                data = lib.nvmlEventSetWait_v2(self._set, self.wait_ms)
            except lib.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == _ERR_TIMEOUT:
                    failures = 0
                    continue
                failures += 1
                reason = (
                    "event_wait_gpu_is_lost" if code == _ERR_GPU_IS_LOST else f"event_wait_{code}"
                )
                self._fail(
                    reason, "NVML event wait failed: %s (the poller keeps reading the GPUs)", exc
                )
                # back off so a broken event set cannot spin; the poller reports lost GPUs
                self._stop.wait(min(30.0, max(self.wait_ms, 10) / 1000.0 * 2 ** min(failures, 12)))
                continue
            except Exception as exc:
                self._fail("event_thread", "NVML event thread failed: %s", exc)
                logger.debug("NVML event thread failed", exc_info=True)
                self._stop.wait(5.0)
                continue
            failures = 0
            try:
                records = self.records_for(data)
            except Exception as exc:
                self._fail("event_decode", "cannot decode an NVML event: %s", exc)
                continue
            if records:
                with self._lock:
                    self._buffer.extend(records)

    def records_for(self, data: Any) -> list[Record]:
        """Turn one ``nvmlEventSetWait_v2`` result into records (see the module docstring)."""
        gpu = self._by_handle.get(handle_key(data.device))
        if gpu is None:
            self.on_error("unknown_device")
            return []
        now = self.clock()
        kind = int(data.eventType)
        value = int(data.eventData)
        attrs: dict[str, str] = {}
        gi, ci = (
            int(getattr(data, "gpuInstanceId", _NO_INSTANCE)),
            int(getattr(data, "computeInstanceId", _NO_INSTANCE)),
        )
        if gi != _NO_INSTANCE:
            attrs["gpu_instance_id"] = str(gi)
        if ci != _NO_INSTANCE:
            attrs["compute_instance_id"] = str(ci)
        out: list[Record] = []
        if kind & EVENT_XID:
            xid = str(value)
            tag = "nvml:xid"
            if xid == RECOVERY_XID and self.read_recovery_action is not None:
                action = self.read_recovery_action(gpu)
                if action is not None:
                    self._recovery_attrs(attrs, action)
                    out.append(self._recovery_sample(gpu, action, now))
            text = f"NVML XidCriticalError event: Xid {xid} on GPU {gpu.pci_bus_id}"
        elif kind & EVENT_DBE:
            xid, tag = DBE_XID, "nvml:dbe"
            attrs["nvml_event"] = "double_bit_ecc"
            text = f"NVML DoubleBitEccError event on GPU {gpu.pci_bus_id} (Xid 48 class)"
        elif kind & EVENT_RECOVERY:
            xid, tag = RECOVERY_XID, "nvml:recovery"
            self._recovery_attrs(attrs, value)
            out.append(self._recovery_sample(gpu, value, now))
            text = (
                f"NVML GpuRecoveryAction event on GPU {gpu.pci_bus_id}: recovery action "
                f"{value} ({RECOVERY_ACTION_NAMES.get(value, 'unknown')})"
            )
        elif kind & EVENT_SBE:
            return self._sbe(gpu, now, attrs)
        else:
            self.on_error("unexpected_event")
            return []
        if gpu.uuid:
            attrs["uuid"] = gpu.uuid
            text += f" ({gpu.uuid})"
        attrs["message"] = text
        event = nvml_event(
            kind="xid",
            code=xid,
            node=self.node,
            entity=gpu.pci_bus_id,
            observed_at=now,
            text=text,
            attrs=attrs,
        )
        if not self._dedup.admit(event, tag):
            return out
        out.append(event)
        return out

    @staticmethod
    def _recovery_attrs(attrs: dict[str, str], action: int) -> None:
        attrs["recovery_action_code"] = str(action)
        name = RECOVERY_ACTION_NAMES.get(action)
        if name is not None:
            attrs["recovery_action"] = name

    def _recovery_sample(self, gpu: WatchedGpu, action: int, now: float) -> Sample:
        text = f"NVML recovery action {action} on GPU {gpu.pci_bus_id}"
        return Sample(
            metric="gpu_recovery_action",
            value=float(action),
            observed_at=now,
            node=self.node,
            entity=gpu.sample_entity,
            evidence=Evidence(file="nvml", line=None, text=text),
        )

    def _sbe(self, gpu: WatchedGpu, now: float, attrs: dict[str, str]) -> list[Record]:
        last = self._sbe_at.get(gpu.index)
        if last is not None and now - last < SBE_EVENT_MIN_INTERVAL_SECONDS:
            self._sbe_suppressed[gpu.index] += 1
            return []
        self._sbe_at[gpu.index] = now
        folded = self._sbe_suppressed.pop(gpu.index, 0)
        if folded:
            attrs["folded"] = str(folded)
        text = f"NVML SingleBitEccError event on GPU {gpu.pci_bus_id} (corrected)"
        attrs["message"] = text
        return [
            nvml_event(
                kind="ecc_event",
                code="single_bit",
                node=self.node,
                entity=gpu.pci_bus_id,
                observed_at=now,
                text=text,
                attrs=attrs,
            )
        ]


def nvml_event(*, kind: str, code: str, node: NodeName, entity: EntityId, observed_at: float,
               text: str, attrs: dict[str, str]) -> Event:
    """Return an NVML :class:`Event` whose message and evidence are ``text``."""
    return Event(
        kind=kind,
        code=code,
        node=node,
        entity=entity,
        observed_at=observed_at,
        message=text,
        attrs=attrs,
        evidence=(Evidence(file="nvml", line=None, text=text),),
        source="nvml",
    )


__all__ = [
    "RECOVERY_ACTION_NAMES",
    "WANTED_EVENTS",
    "NvmlEventWatcher",
    "WatchedGpu",
    "XidDedup",
    "handle_key",
    "nvml_event",
]
