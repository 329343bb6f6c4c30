"""GPU reset on the node itself, requested by the controller through a signed endpoint.

Node side: :class:`GpuResetter` resets one GPU with ``nvidia-smi -r -i <gpu>`` once
``nvidia-smi --query-compute-apps=pid --format=csv,noheader -i <gpu>`` shows no process
on it (nvidia-smi(1): a reset needs the GPU free of every process; it runs as root),
one reset at a time per node. :class:`GpuResetEndpoint` is what ``gpuhealth run``'s
API serves as ``POST /api/v1/gpu-reset``: it checks the request's Standard-Webhooks
signature (HMAC-SHA256 of ``"{webhook-id}.{webhook-timestamp}.{body}"`` under a shared
secret, :class:`alerting.webhook.WebhookVerifier`: a timestamp more than 5 minutes
off is refused, and so is a ``webhook-id`` already seen, so a captured request
cannot be replayed) before anything runs.

Controller side: :class:`NodeAgentResetter` (scheduler adapter ``node_agent``,
``reset_gpu`` steps only) signs and POSTs ``{"node", "gpu", "idempotency_key",
"reason"}`` to ``https://<node>:9836/api/v1/gpu-reset`` (template configurable) and
maps the answer to :class:`~core.records.ActionStatus`. A busy GPU (or a node agent
that cannot be reached) keeps the action ``running`` and is retried every
``retry_interval_seconds`` until ``deadline_seconds`` after submission, then fails.

Answers of the endpoint (JSON ``{"outcome", "gpu", "pids", "message", "stderr"}``):

====== ===================================================================
200    ``ok``: reset done (or already done for this idempotency key)
409    ``busy``: processes hold the GPU (``pids``), or another reset runs
422    ``failed``: the query or the reset failed (``stderr``); not retried
400    malformed body or GPU id; 401 bad or missing signature, stale
       timestamp, replayed id; 404 the node serves no GPU reset; 409 also
       when the request names another node
====== ===================================================================

See ``docs/remediation-webhook.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import httpx

from alerting.webhook import (
    DEFAULT_TOLERANCE_SECONDS,
    SignatureError,
    WebhookVerifier,
    _ssl_context,
    sign,
)
from core.clock import Clock, system_clock
from core.errors import ConfigError, GpuHealthError, PermanentError
from core.ids import normalize_pci_bus_id
from core.records import ActionPhase, ActionRequest, ActionStatus, RemediationStep
from remediation.bundle import BundleCollector
from remediation.validation import (
    CommandResult,
    CommandRunner,
    GpuStateCheck,
    NvmlStateCheck,
    ValidationService,
    run_command,
    tail,
)
from remediation.webhook import node_agent_key

logger = logging.getLogger(__name__)

RESET_PATH = "/api/v1/gpu-reset"
"""Path of the node agent's reset endpoint."""

DEFAULT_URL_TEMPLATE = "https://{node}:9836" + RESET_PATH
"""Where the controller reaches a node's agent (``{node}`` is the node name)."""

_BUS_ID = re.compile(r"^(?:[0-9a-f]{4}|[0-9a-f]{8}):[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", re.I)
_GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
                       re.I)
_IN_USE = re.compile(r"in use|being used|busy", re.I)
MAX_STDERR_CHARS = 2000
"""Longest stderr kept in a result."""

__all__ = [
    "CommandResult",
    "CommandRunner",
    "GpuResetEndpoint",
    "GpuResetter",
    "NodeAgentResetter",
    "QuiescibleCollector",
    "ResetOutcome",
    "ResetResult",
    "ResetStep",
    "fallback_of",
    "quiesce_all",
    "run_command",
    "steps_summary",
    "validate_gpu",
]


def validate_gpu(gpu: str) -> str:
    """Return the GPU id ``nvidia-smi -i`` is given: a canonical PCI bus id, or a GPU UUID.

    A PCI bus id is ``domain:bus:device.function`` in hex with a 4- or 8-digit domain
    (``0000:b1:00.0``, nvidia-smi's ``00000000:B1:00.0``), case-insensitive; it is
    returned as ``0000:b1:00.0``. A GPU UUID is ``GPU-`` and 32 hex digits in 8-4-4-4-12
    groups, returned as given (nvidia-smi(1), ``-i``: index, serial, UUID or PCI bus id;
    indexes are refused because they change across reboots). NVML's
    ``nvmlDeviceGetHandleByPciBusId_v2``, behind ``-i``, parses the bus id as
    ``%x:%x:%x.%x``, so the 4-digit domain is accepted as well as nvidia-smi's 8-digit one.

    Raises:
        ValueError: Anything else, naming the value.

    Examples:
        >>> validate_gpu("00000000:B1:00.0")
        '0000:b1:00.0'
        >>> validate_gpu("0")
        Traceback (most recent call last):
        ...
        ValueError: gpu: expected a PCI bus id like 0000:b1:00.0 or a GPU UUID, got '0'
    """
    text = gpu.strip()
    if _BUS_ID.match(text):
        canonical = normalize_pci_bus_id(text)
        if canonical is not None:
            return canonical
    if _GPU_UUID.match(text):
        return text
    raise ValueError(f"gpu: expected a PCI bus id like 0000:b1:00.0 or a GPU UUID, got {gpu!r}")


# --------------------------------------------------------------------------- node side


class ResetOutcome(StrEnum):
    """How a reset request ended."""

    OK = "ok"
    BUSY = "busy"
    FAILED = "failed"


DEFAULT_SERVICES: tuple[str, ...] = (
    "nvidia-imex", "dcgm-exporter", "nvidia-dcgm", "dcgm", "nvidia-fabricmanager",
    "nvidia-persistenced",
)
"""systemd services gpuhealth may stop for a reset, in stop order (started in reverse):
IMEX, dcgm-exporter and the DCGM host engine (``nv-hostengine``, unit ``nvidia-dcgm``
or ``dcgm``) hold the GPUs through NVML, Fabric Manager the NVSwitches, and
nvidia-persistenced every GPU (NVSentinel #1690, gpu-operator #118)."""

FABRIC_SERVICES: tuple[str, ...] = ("nvidia-imex", "nvidia-fabricmanager")
"""Stopped (when active) for a reset on an NVSwitch system even if they hold no GPU file."""

DOMAIN_RESET_MODES = ("auto", "gpu", "domain")
"""``gpu``: reset the one GPU; ``domain``: reset all GPUs of the node together
(``nvidia-smi -r`` without ``-i``), as NVSwitch systems whose driver resets an NVLink
domain together require; ``auto``: ``domain`` when NVSwitch devices exist."""

_UNIT = re.compile(r"/([A-Za-z0-9_.@:-]+)\.service(?:/|$)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetStep:
    """One step of a reset, audited with its output.

    Attributes:
        name: What the step did (``identify``, ``stop nvidia-dcgm``, ``reset``...).
        ok: Whether it succeeded.
        command: The command line run (empty for steps without one).
        output: The command's output (or the step's finding), at most 2000 characters.
        at: When the step started, epoch seconds.
    """

    name: str
    ok: bool
    command: str = ""
    output: str = ""
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """Return the step as JSON."""
        return {"name": self.name, "ok": self.ok, "command": self.command,
                "output": self.output, "at": self.at}


@dataclass(frozen=True, slots=True, kw_only=True)
class Holder:
    """A process holding one of the GPU's device files."""

    pid: int
    process: str
    unit: str | None
    device: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetResult:
    """The answer of one reset request.

    Attributes:
        outcome: ``ok``, ``busy`` or ``failed``.
        gpu: The GPU as passed to ``nvidia-smi -i``.
        pids: Processes holding the GPU (``busy``).
        message: One line for people.
        stderr: The failing command's standard error, at most 2000 characters.
        steps: Every step taken, in order, with its output.
        fallback: ``reboot`` when the reset failed and the node must be rebooted
            instead (the controller carries it out); empty otherwise.
        gpus: The GPUs reset (more than one for an NVLink-domain reset).
        bundle: Path of the diagnostic bundle collected before the reset, if any.
    """

    outcome: ResetOutcome
    gpu: str
    pids: tuple[int, ...] = ()
    message: str = ""
    stderr: str = ""
    steps: tuple[ResetStep, ...] = ()
    fallback: str = ""
    gpus: tuple[str, ...] = ()
    bundle: str = ""

    def to_json(self) -> dict[str, Any]:
        """Return the result as the endpoint's JSON answer."""
        return {"outcome": self.outcome.value, "gpu": self.gpu, "pids": list(self.pids),
                "message": self.message, "stderr": self.stderr,
                "steps": [s.to_json() for s in self.steps], "fallback": self.fallback,
                "gpus": list(self.gpus), "bundle": self.bundle}


class BundleHook(Protocol):
    """Collects a diagnostic bundle before a destructive step; returns its path or ``""``."""

    def __call__(self, *, reason: str, gpus: Sequence[str], key: str) -> str:
        """Collect the bundle (bounded in time and size); never raises."""
        ...


class _Abort(Exception):
    """A step failed: stop, restore, report ``outcome``."""

    def __init__(self, outcome: ResetOutcome, message: str, stderr: str = "",
                 pids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.stderr = stderr
        self.pids = pids


@dataclass(slots=True)
class _Run:
    """State of one reset while it runs (what must be restored)."""

    gpu: str
    steps: list[ResetStep] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    persistence_off: list[str] = field(default_factory=list)
    targets: tuple[str, ...] = ()
    bundle: str = ""
    quiesced: AbstractContextManager[object] | None = None


class GpuResetter:
    """Resets a GPU of this node the way NVIDIA's guidance does, or says to reboot.

    The steps (each audited, before it runs and with its output after):

    1. ``identify``: ``nvidia-smi --query-gpu=pci.bus_id,persistence_mode`` for the GPU
       (all GPUs for an NVLink-domain reset, see ``domain_reset``).
    2. ``processes``: ``nvidia-smi --query-compute-apps=pid``; any compute process
       (a job): ``busy``, nothing changed.
    3. ``holders``: every process holding the GPU's device file (``/dev/nvidia<minor>``,
       the minor from ``/proc/driver/nvidia/gpus/<bus id>/information``; on NVSwitch
       systems also ``/dev/nvidia-nvswitch*``), from ``/proc/<pid>/fd``, with its
       systemd unit from ``/proc/<pid>/cgroup``. A holder that is not one of
       ``services``: ``busy`` with its PID, nothing changed.
    4. ``stop <unit>`` (``systemctl stop``) for each of ``services`` holding the GPU,
       and on an NVSwitch system each active one of ``fabric_services``.
    5. ``persistence off`` (``nvidia-smi -pm 0 -i``) where persistence mode is on.
    6. ``holders again``: nobody may hold the GPU now.
    7. ``diagnostic bundle`` (when ``bundle`` is given), before the destructive step.
    8. ``reset``: ``nvidia-smi -r -i <gpu>`` (``nvidia-smi -r`` for a domain reset).
    9. ``verify``: ``state_check`` (NVML through :class:`remediation.validation.NvmlStateCheck`
       by default): every reset GPU answers, recovery action ``none``, no row remap
       pending, no Xid since the reset; tried ``verify_attempts`` times
       ``verify_interval_seconds`` apart (a GPU takes seconds to come back).
    10. ``restore``: persistence mode back on and the stopped services started again
        (reverse order), whatever happened before.

    Any failing step (or restore) makes the result ``failed`` with ``fallback =
    "reboot"`` (unless ``fallback="none"``): the controller then reboots the node.

    Args:
        nvidia_smi: The ``nvidia-smi`` command (looked up on ``PATH``).
        runner: Runs commands (injectable for tests).
        query_timeout_seconds: Timeout of each query, seconds.
        reset_timeout_seconds: Timeout of ``nvidia-smi -r``, seconds (a reset takes
            seconds; a hung one is reported failed).
        remembered_keys: Idempotency keys of successful resets kept, so that a
            repeated request (the controller retrying after a lost answer) does not
            reset twice.
        systemctl: The ``systemctl`` command.
        services: Units gpuhealth may stop, in stop order.
        fabric_services: Units stopped on NVSwitch systems when active.
        service_timeout_seconds: Timeout of each ``systemctl`` call, seconds.
        proc_root: Where ``/proc`` is (tests use a fake tree).
        dev_root: Where ``/dev`` is (NVSwitch device files are looked up there).
        domain_reset: ``auto``, ``gpu`` or ``domain`` (:data:`DOMAIN_RESET_MODES`).
        state_check: Checks the GPUs after the reset; default NVML.
        verify_attempts: Tries of the check, >= 1.
        verify_interval_seconds: Wait between tries, seconds.
        fallback: ``reboot`` (say so when the reset fails) or ``none``.
        bundle: Collects a diagnostic bundle before the reset (item of the incident).
        audit: Called with each step before it runs (``ok=False``, no output yet) and
            after (its result); default: logged.
        quiesce: Makes this gpuhealth process let go of the GPU (its own NVML
            collector holds ``/dev/nvidia<minor>``) for as long as the returned context
            is entered: from the services' stop to the restore. Without it, this process
            holding the GPU makes the reset ``busy``.
        clock: Returns now, epoch seconds.
        sleep: Waits, seconds (tests pass a fake).

    Raises:
        ConfigError: A timeout <= 0, an unknown ``domain_reset`` or ``fallback``.
    """

    def __init__(
        self,
        *,
        nvidia_smi: str = "nvidia-smi",
        runner: CommandRunner = run_command,
        query_timeout_seconds: float = 30.0,
        reset_timeout_seconds: float = 120.0,
        remembered_keys: int = 1000,
        systemctl: str = "systemctl",
        services: Sequence[str] = DEFAULT_SERVICES,
        fabric_services: Sequence[str] = FABRIC_SERVICES,
        service_timeout_seconds: float = 90.0,
        proc_root: str = "/proc",
        dev_root: str = "/dev",
        domain_reset: str = "auto",
        state_check: GpuStateCheck | None = None,
        verify_attempts: int = 3,
        verify_interval_seconds: float = 5.0,
        fallback: str = "reboot",
        bundle: BundleHook | None = None,
        audit: Callable[[str, ResetStep], None] | None = None,
        quiesce: Callable[[], AbstractContextManager[object]] | None = None,
        clock: Clock = system_clock,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if min(query_timeout_seconds, reset_timeout_seconds, service_timeout_seconds) <= 0:
            raise ConfigError("GPU reset timeouts must be > 0")
        if domain_reset not in DOMAIN_RESET_MODES:
            raise ConfigError(f"domain_reset must be one of {', '.join(DOMAIN_RESET_MODES)}, "
                              f"got {domain_reset!r}")
        if fallback not in ("reboot", "none"):
            raise ConfigError(f"fallback must be 'reboot' or 'none', got {fallback!r}")
        if verify_attempts < 1 or verify_interval_seconds < 0:
            raise ConfigError("verify_attempts must be >= 1 and verify_interval_seconds >= 0")
        self.nvidia_smi = nvidia_smi
        self.runner = runner
        self.query_timeout_seconds = query_timeout_seconds
        self.reset_timeout_seconds = reset_timeout_seconds
        self.remembered_keys = remembered_keys
        self.systemctl = systemctl
        self.services = tuple(services)
        self.fabric_services = tuple(fabric_services)
        self.service_timeout_seconds = service_timeout_seconds
        self.proc_root = proc_root
        self.dev_root = dev_root
        self.domain_reset = domain_reset
        self.state_check = state_check
        self.verify_attempts = verify_attempts
        self.verify_interval_seconds = verify_interval_seconds
        self.fallback = fallback
        self.bundle = bundle
        self.audit = audit
        self.quiesce = quiesce
        self.clock = clock
        self.sleep = sleep
        self._running = threading.Lock()
        self._done: OrderedDict[str, ResetResult] = OrderedDict()
        self._done_lock = threading.Lock()

    def reset(self, gpu: str, *, idempotency_key: str = "", reason: str = "") -> ResetResult:
        """Reset ``gpu`` unless a process holds it or another reset is running.

        Args:
            gpu: PCI bus id (``0000:b1:00.0``, any case, 4- or 8-digit domain) or GPU UUID.
            idempotency_key: The controller's key; a key that already reset returns
                that result again without resetting.
            reason: Why (recorded in the diagnostic bundle).

        Returns:
            ``ok``; ``busy`` with the PIDs (nothing was changed); or ``failed`` with
            stderr, the steps and ``fallback`` (``reboot``).

        Raises:
            ValueError: ``gpu`` is not a PCI bus id or GPU UUID.
        """
        target = validate_gpu(gpu)
        if idempotency_key:
            with self._done_lock:
                earlier = self._done.get(idempotency_key)
            if earlier is not None:
                return earlier
        if not self._running.acquire(blocking=False):
            return ResetResult(outcome=ResetOutcome.BUSY, gpu=target,
                               message="another GPU reset is running on this node")
        try:
            result = self._reset(target, key=idempotency_key, reason=reason)
        finally:
            self._running.release()
        if result.outcome is ResetOutcome.OK and idempotency_key:
            with self._done_lock:
                self._done[idempotency_key] = result
                while len(self._done) > self.remembered_keys:
                    self._done.popitem(last=False)
        return result

    # -- the procedure -------------------------------------------------------------

    def _reset(self, gpu: str, *, key: str, reason: str) -> ResetResult:
        run = _Run(gpu=gpu)
        outcome, message, stderr = ResetOutcome.OK, "", ""
        pids: tuple[int, ...] = ()
        try:
            message = self._procedure(run, key=key, reason=reason)
        except _Abort as abort:
            outcome, message, stderr, pids = (abort.outcome, abort.message, abort.stderr,
                                              abort.pids)
        restored = self._restore(run)
        if not restored and outcome is ResetOutcome.OK:
            outcome, message = ResetOutcome.FAILED, "GPU reset, but the restore failed"
            stderr = next((s.output for s in reversed(run.steps) if not s.ok), "")
        fallback = ""
        if outcome is ResetOutcome.FAILED and self.fallback == "reboot":
            fallback = "reboot"
            message = f"{message}; falls back to a node reboot"
            self._record(run, ResetStep(name="fallback", ok=True, at=self.clock(),
                                        output="node reboot: the reset did not bring the GPU "
                                               "back clean"))
        log = logger.warning if outcome is not ResetOutcome.FAILED else logger.error
        log("gpu-reset %s: %s %s", gpu, outcome.value, message)
        return ResetResult(outcome=outcome, gpu=gpu, pids=pids, message=message,
                           stderr=tail(stderr), steps=tuple(run.steps), fallback=fallback,
                           gpus=run.targets, bundle=run.bundle)

    def _procedure(self, run: _Run, *, key: str, reason: str) -> str:
        gpu = run.gpu
        nvswitch = self._nvswitch_devices()
        domain = self.domain_reset == "domain" or (self.domain_reset == "auto"
                                                    and bool(nvswitch))
        scope = [] if domain else ["-i", gpu]
        # 1. identify
        done = self._run(run, "identify", [self.nvidia_smi,
                                           "--query-gpu=pci.bus_id,persistence_mode",
                                           "--format=csv,noheader", *scope],
                         self.query_timeout_seconds)
        if done.returncode != 0:
            raise _Abort(ResetOutcome.FAILED, "could not query the GPU; not reset",
                         done.stderr or done.stdout)
        persistence: dict[str, bool] = {}
        for line in done.stdout.splitlines():
            parts = [p.strip() for p in line.split(",")]
            bus = normalize_pci_bus_id(parts[0]) if parts and parts[0] else None
            if bus is not None:
                persistence[bus] = len(parts) > 1 and parts[1].lower() == "enabled"
        if not domain and gpu in persistence:
            persistence = {gpu: persistence[gpu]}
        if not persistence or (not domain and len(persistence) > 1):
            raise _Abort(ResetOutcome.FAILED, "nvidia-smi did not name the GPU; not reset",
                         done.stdout)
        run.targets = tuple(sorted(persistence))
        # 2. compute processes
        query = self._run(run, "processes", [self.nvidia_smi, "--query-compute-apps=pid",
                                             "--format=csv,noheader", *scope],
                          self.query_timeout_seconds)
        if query.returncode != 0:
            raise _Abort(ResetOutcome.FAILED,
                         "could not list the processes on the GPU; not reset",
                         query.stderr or query.stdout)
        pids: set[int] = set()
        for line in query.stdout.splitlines():
            word = line.strip()
            if word.isdigit():
                pids.add(int(word))
            elif word and not word.lower().startswith("no running"):
                raise _Abort(ResetOutcome.FAILED,
                             f"unexpected process list line {word!r}; not reset", query.stderr)
        if pids:
            raise _Abort(ResetOutcome.BUSY, f"{len(pids)} process(es) hold the GPU",
                         pids=tuple(sorted(pids)))
        # 3. holders of the device files
        devices = self._device_files(run.targets) + (nvswitch if domain else [])
        holders = self._holders(run, "holders", devices)
        own = os.getpid()
        strangers = [h for h in holders if h.unit not in self.services
                     and not (h.pid == own and self.quiesce is not None)]
        if strangers:
            raise _Abort(ResetOutcome.BUSY, "held by " + ", ".join(
                f"pid {h.pid} ({h.process}{', ' + h.unit if h.unit else ''})"
                for h in strangers) + ": not a service gpuhealth may stop",
                pids=tuple(sorted({h.pid for h in strangers})))
        units = {h.unit for h in holders if h.unit}
        if nvswitch:
            for unit in self.fabric_services:
                if unit not in units and self._active(run, unit):
                    units.add(unit)
        if self.quiesce is not None and any(h.pid == own for h in holders):
            at = self.clock()
            self._audit("quiesce", ResetStep(name="quiesce", ok=False, at=at))
            run.quiesced = self.quiesce()
            run.quiesced.__enter__()
            self._record(run, ResetStep(name="quiesce", ok=True, at=at,
                                        output=f"gpuhealth (pid {own}) let go of the GPU"))
        # 4. stop the services
        for unit in [u for u in self.services if u in units]:
            done = self._run(run, f"stop {unit}", [self.systemctl, "stop", unit],
                             self.service_timeout_seconds)
            if done.returncode != 0:
                raise _Abort(ResetOutcome.FAILED, f"could not stop {unit}",
                             done.stderr or done.stdout)
            run.stopped.append(unit)
        # 5. persistence mode off
        for bus in run.targets:
            if not persistence[bus]:
                continue
            done = self._run(run, f"persistence off {bus}",
                             [self.nvidia_smi, "-pm", "0", "-i", bus],
                             self.query_timeout_seconds)
            if done.returncode != 0:
                raise _Abort(ResetOutcome.FAILED, f"could not turn persistence mode off on "
                             f"{bus}", done.stderr or done.stdout)
            run.persistence_off.append(bus)
        # 6. nobody may hold it now
        if (run.stopped or run.quiesced is not None) and devices:
            left = self._holders(run, "holders again", devices)
            if left:
                raise _Abort(ResetOutcome.FAILED, "still held after stopping the services: "
                             + ", ".join(f"pid {h.pid} ({h.process})" for h in left),
                             pids=tuple(sorted({h.pid for h in left})))
        # 7. the diagnostic bundle, before the destructive step
        if self.bundle is not None:
            at = self.clock()
            self._audit("diagnostic bundle", ResetStep(name="diagnostic bundle", ok=False,
                                                       at=at))
            run.bundle = self.bundle(reason=reason or f"reset of {gpu}", gpus=run.targets,
                                     key=key)
            self._record(run, ResetStep(name="diagnostic bundle", ok=bool(run.bundle), at=at,
                                        output=run.bundle or "no bundle collected"))
        # 8. reset
        started = self.clock()
        argv = [self.nvidia_smi, "-r", *scope]
        logger.warning("resetting GPU %s (%s)", gpu, " ".join(argv))
        done = self._run(run, "reset", argv, self.reset_timeout_seconds)
        text = done.stderr or done.stdout
        if done.returncode != 0:
            if done.returncode is not None and _IN_USE.search(text):
                raise _Abort(ResetOutcome.BUSY, "nvidia-smi says the GPU is in use", text)
            raise _Abort(ResetOutcome.FAILED,
                         f"nvidia-smi -r failed (exit {done.returncode})", text)
        said = done.stdout.strip()[:500] or "GPU reset"
        # 9. verify
        self._verify(run, started)
        return said

    def _verify(self, run: _Run, since_at: float) -> None:
        check = self.state_check
        if check is None:
            check = NvmlStateCheck(runner=self.runner)
        problems: list[str] = []
        for attempt in range(1, self.verify_attempts + 1):
            at = self.clock()
            self._audit("verify", ResetStep(name="verify", ok=False, at=at))
            try:
                states = check(run.targets, since_at)
            except (GpuHealthError, OSError) as exc:
                problems = [f"GPU state not readable: {exc}"]
            else:
                problems = [f"{s.gpu}: {p}" for s in states for p in s.problems]
            self._record(run, ResetStep(name="verify", ok=not problems, at=at,
                                        output="; ".join(problems) or "clean: recovery action "
                                        "none, no remap pending, no Xid since the reset"))
            if not problems:
                return
            if attempt < self.verify_attempts:
                self.sleep(self.verify_interval_seconds)
        raise _Abort(ResetOutcome.FAILED, "the GPU did not come back clean after the reset",
                     "; ".join(problems))

    def _restore(self, run: _Run) -> bool:
        ok = True
        if run.quiesced is not None:
            run.quiesced.__exit__(None, None, None)
            self._record(run, ResetStep(name="restore gpuhealth", ok=True, at=self.clock(),
                                        output="gpuhealth reads the GPU again"))
        for bus in run.persistence_off:
            done = self._run(run, f"restore persistence {bus}",
                             [self.nvidia_smi, "-pm", "1", "-i", bus],
                             self.query_timeout_seconds)
            ok = ok and done.returncode == 0
        for unit in reversed(run.stopped):
            done = self._run(run, f"restore {unit}", [self.systemctl, "start", unit],
                             self.service_timeout_seconds)
            ok = ok and done.returncode == 0
        return ok

    # -- helpers -------------------------------------------------------------------

    def _run(self, run: _Run, name: str, argv: Sequence[str], timeout: float) -> CommandResult:
        """Audit the step, run it, record it with its output."""
        at = self.clock()
        command = " ".join(argv)
        self._audit(name, ResetStep(name=name, ok=False, command=command, at=at))
        done = self.runner(argv, timeout)
        output = "\n".join(t for t in (done.stdout.strip(), done.stderr.strip()) if t)
        self._record(run, ResetStep(name=name, ok=done.returncode == 0, command=command,
                                    output=tail(output), at=at))
        return done

    def _record(self, run: _Run, step: ResetStep) -> None:
        run.steps.append(step)
        self._audit(step.name, step, after=True)

    def _audit(self, name: str, step: ResetStep, *, after: bool = False) -> None:
        if self.audit is not None:
            self.audit("done" if after else "about to", step)
        elif after:
            logger.info("gpu-reset step %s: %s %s%s", name, "ok" if step.ok else "FAILED",
                        step.command, f": {step.output[:300]}" if step.output else "")
        else:
            logger.info("gpu-reset step %s: about to run %s", name, step.command)

    def _active(self, run: _Run, unit: str) -> bool:
        done = self._run(run, f"is-active {unit}", [self.systemctl, "is-active", unit],
                         self.service_timeout_seconds)
        return done.returncode == 0

    def _nvswitch_devices(self) -> list[str]:
        try:
            names = os.listdir(self.dev_root)
        except OSError:
            return []
        return sorted(os.path.join("/dev", n) for n in names if n.startswith("nvidia-nvswitch"))

    def _device_files(self, targets: Sequence[str]) -> list[str]:
        out: list[str] = []
        for bus in targets:
            info = os.path.join(self.proc_root, "driver", "nvidia", "gpus", bus, "information")
            try:
                with open(info, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except OSError:
                continue
            match = re.search(r"^Device Minor:\s*(\d+)", text, re.M)
            if match:
                out.append(f"/dev/nvidia{match.group(1)}")
        return out

    def _holders(self, run: _Run, name: str, devices: Sequence[str]) -> list[Holder]:
        """Every process with one of ``devices`` open (``/proc/<pid>/fd``)."""
        at = self.clock()
        wanted = set(devices)
        found: list[Holder] = []
        if wanted:
            try:
                pids = [int(p) for p in os.listdir(self.proc_root) if p.isdigit()]
            except OSError:
                pids = []
            for pid in sorted(pids):
                base = os.path.join(self.proc_root, str(pid))
                try:
                    fds = os.listdir(os.path.join(base, "fd"))
                except OSError:
                    continue
                held = set()
                for fd in fds:
                    try:
                        target = os.readlink(os.path.join(base, "fd", fd))
                    except OSError:
                        continue
                    if target in wanted:
                        held.add(target)
                if not held:
                    continue
                process = _read(os.path.join(base, "comm")).strip() or "?"
                match = _UNIT.search(_read(os.path.join(base, "cgroup")))
                unit = match.group(1) if match else None
                found.extend(Holder(pid=pid, process=process, unit=unit, device=d)
                             for d in sorted(held))
        output = ("; ".join(f"pid {h.pid} {h.process} ({h.unit or 'no unit'}) {h.device}"
                            for h in found) or "none") if wanted else \
            "device files unknown (no /proc/driver/nvidia entry): not looked up"
        self._record(run, ResetStep(name=name, ok=True, at=at, output=tail(output)))
        return found


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


class QuiescibleCollector:
    """Wraps an in-process collector that holds the GPUs (NVML) so a reset can pause it.

    While :meth:`quiesced` is entered, :meth:`collect` returns nothing and the wrapped
    collector is closed (``close()``: NVML shut down, its device files released); it
    reopens on the first collection after. Everything else is the wrapped collector's.

    Args:
        inner: The collector (``name``, ``collect()``, optionally ``close()``).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self._lock = threading.Lock()
        self._paused = False

    def collect(self) -> Any:
        """Collect through the wrapped collector, or nothing while paused."""
        with self._lock:
            if self._paused:
                return []
            return self.inner.collect()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextmanager
    def quiesced(self) -> Iterator[None]:
        """Pause and close the wrapped collector (waits for a collection in flight)."""
        with self._lock:
            self._paused = True
            close = getattr(self.inner, "close", None)
            if callable(close):
                close()
        try:
            yield
        finally:
            with self._lock:
                self._paused = False


def quiesce_all(collectors: Sequence[QuiescibleCollector]
                ) -> Callable[[], AbstractContextManager[object]]:
    """Return a ``quiesce`` hook for :class:`GpuResetter` pausing every one of ``collectors``."""

    @contextmanager
    def quiesce() -> Iterator[object]:
        with ExitStack() as stack:
            for collector in collectors:
                stack.enter_context(collector.quiesced())
            yield None

    return quiesce


_STATUS_OF = {ResetOutcome.OK: 200, ResetOutcome.BUSY: 409, ResetOutcome.FAILED: 422}


class GpuResetEndpoint:
    """The node agent's ``POST /api/v1/gpu-reset``: verify, then reset.

    Args:
        resetter: Does the reset.
        secrets: Shared secrets (``whsec_<base64>``, or plain); a signature by any of
            them is accepted (key rotation).
        node: This node's name; a request naming another node is refused (409), so a
            misrouted request never resets the wrong machine. ``None`` skips the check.
        tolerance_seconds: Largest accepted clock difference (and replay window), seconds.
        clock: Returns now, epoch seconds.
        validation: Serves ``{"op": "validate"}`` requests (validation of the node before
            it returns to service, :mod:`remediation.validation`); ``None``: 404.
        bundle: Serves ``{"op": "bundle"}`` requests (a diagnostic bundle before a
            reboot or hand-off, :mod:`remediation.bundle`); ``None``: 404.

    Raises:
        ValueError: No secret, or a malformed one.
    """

    def __init__(
        self,
        *,
        resetter: GpuResetter,
        secrets: tuple[str, ...],
        node: str | None = None,
        tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
        clock: Clock = system_clock,
        validation: ValidationService | None = None,
        bundle: BundleCollector | None = None,
    ) -> None:
        self.resetter = resetter
        self.node = node
        self.validation = validation
        self.bundle = bundle
        self.verifier = WebhookVerifier(secrets=secrets, tolerance_seconds=tolerance_seconds,
                                        clock=clock)

    def __repr__(self) -> str:
        """Return a representation that never shows the secrets."""
        return f"GpuResetEndpoint(node={self.node!r}, {self.verifier!r})"

    def handle(self, headers: Mapping[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """Answer one request: ``(HTTP status, JSON answer)``; never raises for bad input."""
        try:
            self.verifier.verify(headers, body)
        except SignatureError as exc:
            logger.warning("gpu-reset request refused: %s", exc)
            return 401, {"error": f"signature: {exc}"}
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return 400, {"error": "body: not JSON"}
        if not isinstance(data, dict):
            return 400, {"error": "body: expected a JSON object"}
        gpu, key, node = data.get("gpu"), data.get("idempotency_key", ""), data.get("node")
        reason = data.get("reason", "")
        if node is not None and not isinstance(node, str):
            return 400, {"error": "node: expected a string"}
        if self.node is not None and node is not None and node != self.node:
            return 409, {"error": f"node: this is {self.node!r}, the request is for {node!r}"}
        op = data.get("op", "reset")
        if op == "validate":
            if self.validation is None:
                return 404, {"error": "this node serves no validation"}
            return self.validation.handle(data)
        if op == "bundle":
            return self._bundle(data)
        if op != "reset":
            return 400, {"error": f"op: expected 'reset', 'validate' or 'bundle', got {op!r}"}
        if not isinstance(gpu, str):
            return 400, {"error": "gpu: required string"}
        if not isinstance(key, str):
            return 400, {"error": "idempotency_key: expected a string"}
        try:
            result = self.resetter.reset(gpu, idempotency_key=key,
                                         reason=reason if isinstance(reason, str) else "")
        except ValueError as exc:
            return 400, {"error": str(exc)}
        logger.info("gpu-reset %s for %r: %s %s", result.gpu, key, result.outcome.value,
                    result.message)
        return _STATUS_OF[result.outcome], result.to_json()

    def _bundle(self, data: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Collect a diagnostic bundle now (bounded by the collector's timeout)."""
        if self.bundle is None:
            return 404, {"error": "this node collects no diagnostic bundle"}
        key, reason = data.get("idempotency_key", ""), data.get("reason", "")
        gpus, evidence = data.get("gpus", []), data.get("evidence", [])
        if not isinstance(key, str) or not isinstance(reason, str):
            return 400, {"error": "idempotency_key, reason: expected strings"}
        if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
            return 400, {"error": "gpus: expected a list of strings"}
        if not isinstance(evidence, list) or not all(isinstance(e, str) for e in evidence):
            return 400, {"error": "evidence: expected a list of strings"}
        result = self.bundle.collect(reason=reason, gpus=gpus, key=key, evidence=evidence)
        return 200, {"outcome": "ok" if result.path else "failed", **result.to_json()}


# --------------------------------------------------------------------------- controller

FALLBACK_MARK = "; fallback: "
"""Ends a failed reset's status message that names its fallback (``; fallback: reboot``);
the engine reads it (:func:`fallback_of`)."""


def fallback_of(message: str) -> str:
    """Return the fallback a failed reset's status message names, or ``""``.

    Examples:
        >>> fallback_of("GPU 0000:b1:00.0 reset failed: ...; fallback: reboot")
        'reboot'
        >>> fallback_of("GPU 0000:b1:00.0 reset failed")
        ''
    """
    _, mark, word = message.rpartition(FALLBACK_MARK)
    return word.strip() if mark and word.strip().isidentifier() else ""


def steps_summary(steps: Any) -> str:
    """One line naming each step of a node's answer and whether it succeeded.

    Examples:
        >>> steps_summary([{"name": "identify", "ok": True}, {"name": "reset", "ok": False}])
        '; steps: identify ok, reset FAILED'
    """
    if not isinstance(steps, list) or not steps:
        return ""
    words = [f"{s.get('name')} {'ok' if s.get('ok') else 'FAILED'}" for s in steps
             if isinstance(s, dict) and not str(s.get("name", "")).startswith("is-active")]
    return "; steps: " + ", ".join(words)



@dataclass(slots=True)
class _Reset:
    request: ActionRequest
    gpu: str
    deadline_at: float
    phase: ActionPhase = ActionPhase.RUNNING
    message: str = "requested"
    next_at: float = 0.0
    attempts: int = 0
    thread: threading.Thread | None = field(default=None, repr=False)


class NodeAgentResetter:
    """Scheduler adapter ``node_agent``: asks a node's gpuhealth to reset one of its GPUs.

    Each try runs on its own daemon thread (a reset takes seconds to minutes), so
    :meth:`status` never blocks and the adapter works whatever event loop, or loops,
    the caller polls from (``gpuhealth run`` uses one ``asyncio.run`` per tick).

    Args:
        secret: The shared secret the node agents verify (``whsec_<base64>`` or plain).
        secret_env: Or the environment variable holding it (for configuration files).
        secret_file: Or the file whose first line holds it.
        url_template: Endpoint per node; ``{node}`` is replaced by the node name.
        timeout_seconds: Whole-request timeout, seconds: longer than the node's query
            and reset timeouts together.
        retry_interval_seconds: Wait between tries while the GPU is busy or the node
            agent unreachable, seconds.
        deadline_seconds: After this long from submission a GPU still busy (or an
            agent still unreachable) fails the action, seconds.
        verify: TLS verification: ``True`` (system CAs), a CA bundle path, or ``False``.
        clock: Returns now, epoch seconds.
        id_factory: Returns a fresh ``webhook-id`` per attempt (the node's replay guard
            refuses a repeated one).
        transport: An ``httpx`` transport (tests).

    Raises:
        ConfigError: A template without ``{node}``, bad timings, no secret (or more than
            one source of it) or a malformed one.
    """

    name = "node_agent"

    def __init__(
        self,
        *,
        secret: str | None = None,
        secret_env: str | None = None,
        secret_file: str | None = None,
        url_template: str = DEFAULT_URL_TEMPLATE,
        timeout_seconds: float = 180.0,
        retry_interval_seconds: float = 30.0,
        deadline_seconds: float = 3600.0,
        verify: bool | str = True,
        clock: Clock = system_clock,
        id_factory: Callable[[], str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if min(timeout_seconds, retry_interval_seconds, deadline_seconds) <= 0:
            raise ConfigError("node agent timeouts, retry interval and deadline must be > 0")
        self._key = node_agent_key(url_template, secret=secret, secret_env=secret_env,
                                   secret_file=secret_file, what="node_agent")
        self.url_template = url_template
        self.timeout_seconds = timeout_seconds
        self.retry_interval_seconds = retry_interval_seconds
        self.deadline_seconds = deadline_seconds
        self.verify = verify
        self.clock = clock
        self.id_factory = id_factory or (lambda: f"reset_{uuid.uuid4().hex}")
        self._transport = transport
        self._resets: dict[str, _Reset] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        """Return a representation that never shows the secret."""
        return f"NodeAgentResetter(url_template={self.url_template!r})"

    async def submit(self, request: ActionRequest) -> str:
        """Start resetting the request's GPU; idempotent on ``idempotency_key``.

        Returns:
            The ref (``node-agent-<key>``) to poll with :meth:`status`.

        Raises:
            PermanentError: Not a ``reset_gpu`` step, or its entity is not a PCI bus
                id or GPU UUID (a node-wide reset is not a node-agent request).
        """
        ref = f"node-agent-{request.idempotency_key}"
        if request.step is not RemediationStep.RESET_GPU:
            raise PermanentError(f"node_agent carries out reset_gpu only, not {request.step}")
        try:
            gpu = validate_gpu(request.entity)
        except ValueError as exc:
            raise PermanentError(f"node_agent cannot reset {request.node}/{request.entity}: "
                                 f"{exc}") from None
        with self._lock:
            if ref in self._resets:
                return ref
            state = _Reset(request=request, gpu=gpu,
                           deadline_at=self.clock() + self.deadline_seconds)
            self._resets[ref] = state
            if request.dry_run:
                state.phase, state.message = ActionPhase.SUCCEEDED, "dry run: not sent"
                return ref
            self._start(state)
        return ref

    async def status(self, ref: str) -> ActionStatus:
        """Report the reset; start the next try when the last one found the GPU busy.

        Raises:
            PermanentError: ``ref`` was never returned by :meth:`submit`.
        """
        with self._lock:
            state = self._resets.get(ref)
            if state is None:
                raise PermanentError(f"unknown node_agent ref {ref!r}")
            if (state.phase is ActionPhase.RUNNING and state.thread is None
                    and self.clock() >= state.next_at):
                self._start(state)
            return ActionStatus(ref=ref, phase=state.phase, message=state.message)

    async def wait(self, ref: str) -> ActionStatus:
        """Wait for the try in flight (if any) to end, then return :meth:`status`."""
        with self._lock:
            state = self._resets.get(ref)
            thread = state.thread if state is not None else None
        if thread is not None:
            await asyncio.to_thread(thread.join)
        return await self.status(ref)

    def _start(self, state: _Reset) -> None:
        """Start one try on a daemon thread (the caller holds the lock)."""
        state.thread = threading.Thread(target=self._try, args=(state,), daemon=True,
                                        name=f"gpu-reset-{state.request.node}")
        state.thread.start()

    def _try(self, state: _Reset) -> None:
        try:
            phase, message, retry = self._post(state)
        except Exception as exc:  # a bug must not leave the action running for ever
            logger.exception("node_agent reset of %s failed", state.gpu)
            phase, message, retry = ActionPhase.FAILED, f"{type(exc).__name__}: {exc}", False
        now = self.clock()
        if retry and now + self.retry_interval_seconds > state.deadline_at:
            phase = ActionPhase.FAILED
            message = f"gave up at the deadline ({self.deadline_seconds:g} s): {message}"
        elif retry:
            message = f"{message}; retry in {self.retry_interval_seconds:g} s"
        with self._lock:
            state.attempts += 1
            state.next_at = now + self.retry_interval_seconds
            state.phase, state.message = phase, message
            state.thread = None
        log = logger.info if phase is not ActionPhase.FAILED else logger.error
        log("node_agent reset %s/%s: %s %s", state.request.node, state.gpu, phase.value, message)

    def _post(self, state: _Reset) -> tuple[ActionPhase, str, bool]:
        """One try: ``(phase, message, retry later)``."""
        request = state.request
        url = self.url_template.format(node=request.node)
        body = json.dumps({"node": request.node, "gpu": state.gpu,
                           "idempotency_key": request.idempotency_key,
                           "reason": request.reason}, sort_keys=True).encode()
        msg_id = self.id_factory()
        timestamp = int(self.clock())
        headers = {"content-type": "application/json", "webhook-id": msg_id,
                   "webhook-timestamp": str(timestamp),
                   "webhook-signature": sign(self._key, msg_id, timestamp, body)}
        verify: Any = _ssl_context() if self.verify is True else self.verify
        try:
            with httpx.Client(timeout=self.timeout_seconds, verify=verify,
                              transport=self._transport) as client:
                response = client.post(url, content=body, headers=headers)
        except httpx.TransportError as exc:
            return (ActionPhase.RUNNING,
                    f"node agent {url} unreachable: {type(exc).__name__}: {exc}", True)
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        outcome = answer.get("outcome")
        status = response.status_code
        if status == 200 and outcome == ResetOutcome.OK.value:
            return (ActionPhase.SUCCEEDED,
                    f"GPU {state.gpu} reset: {answer.get('message', '')}"
                    f"{steps_summary(answer.get('steps'))}", False)
        if status == 409 and outcome == ResetOutcome.BUSY.value:
            pids = ", ".join(str(p) for p in answer.get("pids") or [])
            why = f"pids {pids}" if pids else str(answer.get("message", "busy"))
            return ActionPhase.RUNNING, f"GPU {state.gpu} busy ({why})", True
        if status == 422 and outcome == ResetOutcome.FAILED.value:
            fallback = answer.get("fallback") or ""
            return (ActionPhase.FAILED, f"GPU {state.gpu} reset failed: "
                    f"{answer.get('message')}; stderr: {answer.get('stderr', '')}"
                    f"{steps_summary(answer.get('steps'))}"
                    f"{FALLBACK_MARK + str(fallback) if fallback else ''}", False)
        if status == 429 or status >= 500:
            return ActionPhase.RUNNING, f"node agent answered {status}", True
        detail = answer.get("error") or response.text[:200]
        return ActionPhase.FAILED, f"node agent refused the request ({status}): {detail}", False
