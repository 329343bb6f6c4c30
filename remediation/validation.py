"""Validation of a node before it returns to service, and the GPU state checks it uses.

An idle node that looks healthy after a reboot can fail again under load (NVSentinel
#695), so after a fix (GPU reset, reboot) and before the node is resumed, a
configurable sequence of checks runs on the node; each has its own timeout:

1. ``nvml``: the NVML state of every GPU is clean (:class:`NvmlStateCheck`): the GPU
   answers, its recovery action (field 230) is ``NONE``, no row remap is pending or has
   failed, NVML does not say a reset is required; and no Xid for it in the kernel log
   since the fix.
2. ``dcgm_diag``: ``dcgmi diag -r <level>`` where ``dcgmi`` is installed.
3. ``load``: a short load and memory test (a command; by default none: sites name
   their burn-in tool, e.g. ``gpu-burn 60`` or DCGM's targeted stress).
4. ``nccl``: ``all_reduce_perf -b 8 -e 256M -f 2 -g <gpus>`` (nccl-tests) where installed,
   a loopback all-reduce over the node's GPUs.

A check whose tool is not installed is ``skipped`` (recorded, not a failure). The first
failing check ends the validation (``failed``, with the evidence: the command, its exit
status, the tail of its output). :class:`ValidationRunner` runs the checks on the node
itself; :class:`LocalValidator` runs them in a thread for ``gpuhealth run`` on one
machine; :class:`ValidationService` serves them on a node agent through the signed
GPU-reset endpoint (``POST /api/v1/gpu-reset`` with ``"op": "validate"``), and
:class:`NodeAgentValidator` is the controller's side of it. The engine
(:class:`remediation.engine.RemediationEngine`, ``validator``) starts a validation when
a fix step succeeded, keeps the node out of service until it passed, and hands the node
to hardware service with the evidence when it failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from alerting.webhook import _ssl_context, sign
from collectors.nvml import NvmlCollector
from core.clock import Clock, system_clock
from core.errors import ConfigError, GpuHealthError, PermanentError
from core.ids import normalize_pci_bus_id
from core.records import ActionPhase, Event, Sample
from remediation.webhook import node_agent_key

logger = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 2000
"""Longest command output kept in a check's evidence."""

RECOVERY_ACTION_NAMES = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p",
                         4: "drain_and_reset", 5: "recover_imex_domain", 6: "bus_reset",
                         7: "system_reboot"}
"""NVML_GPU_RECOVERY_ACTION_* values (field 230, ecosystem-reference §1.5)."""

_XID_BUS = re.compile(r"Xid \(PCI:([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})")


# --------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandResult:
    """What one command did: exit status (``None`` when it timed out or could not start)."""

    returncode: int | None
    stdout: str = ""
    stderr: str = ""


class CommandRunner(Protocol):
    """Runs ``argv`` with a timeout, seconds; never raises for the command's failure."""

    def __call__(self, argv: Sequence[str], timeout_seconds: float) -> CommandResult:
        """Run ``argv`` and return its result."""
        ...


def run_command(argv: Sequence[str], timeout_seconds: float) -> CommandResult:
    """Run ``argv`` without a shell, capturing its output (the default runner)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True,
                              timeout=timeout_seconds, check=False)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        return CommandResult(returncode=None,
                             stderr=f"timed out after {timeout_seconds:g} s. {err}".strip())
    except OSError as exc:
        return CommandResult(returncode=None, stderr=f"cannot run {argv[0]}: {exc}")
    return CommandResult(returncode=done.returncode, stdout=done.stdout, stderr=done.stderr)


def tail(text: str, chars: int = MAX_OUTPUT_CHARS) -> str:
    """Return the last ``chars`` characters of ``text``, stripped."""
    return text.strip()[-chars:]


def same_gpu(a: str, b: str) -> bool:
    """Whether two PCI bus ids name the same GPU (any domain width or case).

    Examples:
        >>> same_gpu("00000000:B1:00.0", "0000:b1:00.0")
        True
    """
    return (normalize_pci_bus_id(a) or a.lower()) == (normalize_pci_bus_id(b) or b.lower())


# --------------------------------------------------------------------------- GPU state


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuState:
    """What NVML says about one GPU after a fix.

    Attributes:
        gpu: PCI bus id (``0000:b1:00.0``), or the UUID when NVML gives no bus id.
        problems: Why it is not clean (empty: clean).
    """

    gpu: str
    problems: tuple[str, ...] = ()


class GpuStateCheck(Protocol):
    """Reads the GPUs' state; ``gpus`` empty means every GPU of the node."""

    def __call__(self, gpus: Sequence[str], since_at: float | None) -> list[GpuState]:
        """Return one state per GPU found (a GPU asked for but not found is a problem).

        Raises:
            GpuHealthError: The state could not be read at all (no driver).
        """
        ...


class NvmlStateCheck:
    """The GPUs' state through NVML (:class:`collectors.nvml.NvmlCollector`) and the kernel log.

    One collection reads every GPU's recovery action (field 230, or the reset-status
    fields 226/227 it replaced), the row-remap pending and failure flags (fields 144,
    145); a GPU NVML reports lost or needing a reset is not clean either. Xids logged
    for the GPU since ``since_at`` (``journalctl -k``) make it not clean: the fault came
    back.

    Args:
        node: This node's name (labels of the collected samples).
        nvml: The ``pynvml`` module or a stand-in (:class:`collectors.testing.FakeNvml`).
        kernel_log: The command printing the kernel log since a time (``{since}`` is
            replaced by epoch seconds); empty: no kernel-log check.
        runner: Runs the kernel-log command.
        timeout_seconds: Timeout of the kernel-log command, seconds.
    """

    def __init__(
        self,
        *,
        node: str = "localhost",
        nvml: Any = None,
        kernel_log: Sequence[str] = ("journalctl", "-k", "--no-pager", "-o", "short-iso",
                                     "--since", "@{since}"),
        runner: CommandRunner = run_command,
        timeout_seconds: float = 30.0,
    ) -> None:
        self.node = node
        self.nvml = nvml
        self.kernel_log = tuple(kernel_log)
        self.runner = runner
        self.timeout_seconds = timeout_seconds

    def __call__(self, gpus: Sequence[str], since_at: float | None) -> list[GpuState]:
        """Return each GPU's state (see the class docstring)."""
        collector = NvmlCollector(node=self.node, events=False, nvml=self.nvml,
                                  deadline_seconds=max(self.timeout_seconds, 1.0))
        try:
            records = list(collector.collect())
        finally:
            collector.close()
        states = judge_records(records)
        if since_at is not None and self.kernel_log:
            argv = [a.replace("{since}", str(int(since_at))) for a in self.kernel_log]
            done = self.runner(argv, self.timeout_seconds)
            if done.returncode == 0:
                xids = xids_by_gpu(done.stdout.splitlines())
                states = [GpuState(gpu=s.gpu, problems=s.problems + tuple(
                    f"Xid {code} logged since the fix" for code in xids.get(
                        normalize_pci_bus_id(s.gpu) or s.gpu, ())))
                          for s in states]
            else:
                logger.info("kernel log not read (%s): Xid check skipped",
                            tail(done.stderr, 200))
        wanted = [normalize_pci_bus_id(g) or g for g in gpus]
        if not wanted:
            return states
        found = {s.gpu: s for s in states}
        return [found.get(g, GpuState(gpu=g, problems=("not found by NVML",))) for g in wanted]


def judge_records(records: Iterable[Sample | Event]) -> list[GpuState]:
    """Turn one NVML collection into per-GPU states, keyed by PCI bus id where known."""
    bus_of: dict[str, str] = {}
    values: dict[tuple[str, str], float] = {}
    problems: dict[str, list[str]] = {}
    for record in records:
        if isinstance(record, Sample):
            if record.metric == "gpu_info":
                bus = normalize_pci_bus_id(record.labels.get("pci_bus_id", ""))
                if bus is not None:
                    bus_of[record.entity] = bus
                problems.setdefault(record.entity, [])
            values[(record.entity, record.metric)] = record.value
        elif record.kind in ("gpu_lost", "reset_required"):
            problems.setdefault(record.entity, []).append(
                f"NVML: {record.kind.replace('_', ' ')}")
    for (entity, metric), value in sorted(values.items()):
        if metric == "gpu_recovery_action" and value != 0:
            name = RECOVERY_ACTION_NAMES.get(int(value), str(int(value)))
            problems.setdefault(entity, []).append(f"recovery action {name}")
        elif metric == "gpu_row_remap_pending" and value:
            problems.setdefault(entity, []).append("row remap pending")
        elif metric == "gpu_row_remap_failure" and value:
            problems.setdefault(entity, []).append("row remap failure")
    merged: dict[str, list[str]] = {}
    for entity, found in problems.items():
        key = bus_of.get(entity) or normalize_pci_bus_id(entity) or entity
        merged.setdefault(key, []).extend(found)
    return [GpuState(gpu=gpu, problems=tuple(dict.fromkeys(found)))
            for gpu, found in sorted(merged.items())]


def xids_by_gpu(lines: Iterable[str]) -> dict[str, list[str]]:
    """Xid numbers per GPU (canonical bus id) in kernel-log lines.

    Examples:
        >>> xids_by_gpu(["NVRM: Xid (PCI:0000:b1:00): 79, pid=0, GPU has fallen off the bus."])
        {'0000:b1:00.0': ['79']}
    """
    out: dict[str, list[str]] = {}
    for line in lines:
        match = _XID_BUS.search(line)
        if match is None:
            continue
        rest = line[match.end():].lstrip("): ")
        code = rest.split(",", 1)[0].strip()
        bus = normalize_pci_bus_id(match.group(1) + ".0")
        if bus is not None and code.isdigit():
            out.setdefault(bus, []).append(code)
    return out


# --------------------------------------------------------------------------- the checks

CHECKS = ("nvml", "dcgm_diag", "load", "nccl")
"""The checks a validation may run, in the order they run."""

PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"
NOT_RUN = "not_run"

_DCGM_FAIL = re.compile(r"\|\s*Fail\b|\bFAIL\b")
_NCCL_BUSBW = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.]+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One check of a validation.

    Attributes:
        name: One of :data:`CHECKS`.
        outcome: ``passed``, ``failed``, ``skipped`` (tool not installed or not
            configured) or ``not_run`` (an earlier check failed).
        command: The command line (empty for the NVML check).
        output: The evidence: problems found, or the tail of the command's output.
        seconds: How long it took.
    """

    name: str
    outcome: str
    command: str = ""
    output: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """Return the check as JSON."""
        return {"name": self.name, "outcome": self.outcome, "command": self.command,
                "output": self.output, "seconds": round(self.seconds, 3)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckResult:
        """Read a check written by :meth:`to_json`."""
        return cls(name=str(data.get("name", "")), outcome=str(data.get("outcome", "")),
                   command=str(data.get("command", "")), output=str(data.get("output", "")),
                   seconds=float(data.get("seconds", 0.0)))


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationReport:
    """The result of one validation: part of the incident and of the report.

    Attributes:
        outcome: ``passed`` or ``failed``.
        node: The node validated.
        checks: Each check, in order.
        started_at, finished_at: Epoch seconds.
    """

    outcome: str
    node: str
    checks: tuple[CheckResult, ...] = ()
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def passed(self) -> bool:
        """Whether every check passed or was skipped."""
        return self.outcome == PASSED

    def summary(self) -> str:
        """One line: each check and its outcome, then the first failure's evidence.

        Examples:
            >>> ValidationReport(outcome="failed", node="n1", checks=(
            ...     CheckResult(name="nvml", outcome="passed"),
            ...     CheckResult(name="dcgm_diag", outcome="failed", output="Memory: Fail"),
            ... )).summary()
            'validation failed: nvml passed, dcgm_diag failed (Memory: Fail)'
        """
        words = ", ".join(f"{c.name} {c.outcome}" for c in self.checks)
        failed = next((c for c in self.checks if c.outcome == FAILED), None)
        why = f" ({failed.output[-300:]})" if failed is not None and failed.output else ""
        return f"validation {self.outcome}: {words}{why}"

    def to_json(self) -> dict[str, Any]:
        """Return the report as JSON."""
        return {"outcome": self.outcome, "node": self.node,
                "checks": [c.to_json() for c in self.checks],
                "started_at": self.started_at, "finished_at": self.finished_at}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ValidationReport:
        """Read a report written by :meth:`to_json`."""
        checks = data.get("checks") or []
        return cls(outcome=str(data.get("outcome", FAILED)), node=str(data.get("node", "")),
                   checks=tuple(CheckResult.from_json(c) for c in checks
                                if isinstance(c, Mapping)),
                   started_at=float(data.get("started_at", 0.0)),
                   finished_at=float(data.get("finished_at", 0.0)))


class ValidationRunner:
    """Runs the configured checks on this node, each with its timeout.

    Args:
        node: This node's name.
        checks: Which of :data:`CHECKS` run (in :data:`CHECKS` order).
        state_check: The NVML check; default :class:`NvmlStateCheck`.
        dcgmi: The ``dcgmi`` command; a check whose command is not installed is skipped.
        dcgm_level: ``dcgmi diag -r`` level (1 quick, 2 medium ~2 min, 3 long, 4 extended).
        dcgm_timeout_seconds: Timeout of the DCGM diagnostic, seconds.
        load_command: The load and memory test (argv; ``{gpus}`` is replaced by the
            comma-separated GPU list); empty: skipped.
        load_timeout_seconds: Its timeout, seconds.
        nccl_command: nccl-tests' ``all_reduce_perf`` (argv[0]); ``-g <number of GPUs>``
            is appended.
        nccl_args: Its arguments before ``-g``.
        nccl_min_bus_gbps: Lowest acceptable "Avg bus bandwidth" (GB/s); ``None``: any.
        nccl_timeout_seconds: Its timeout, seconds.
        runner: Runs commands.
        which: Finds a command on ``PATH`` (``shutil.which``).
        clock: Returns now, epoch seconds.

    Raises:
        ConfigError: An unknown check, a timeout <= 0, a DCGM level outside 1-4.
    """

    def __init__(
        self,
        *,
        node: str = "localhost",
        checks: Sequence[str] = CHECKS,
        state_check: GpuStateCheck | None = None,
        dcgmi: str = "dcgmi",
        dcgm_level: int = 2,
        dcgm_timeout_seconds: float = 900.0,
        load_command: Sequence[str] = (),
        load_timeout_seconds: float = 600.0,
        nccl_command: str = "all_reduce_perf",
        nccl_args: Sequence[str] = ("-b", "8", "-e", "256M", "-f", "2"),
        nccl_min_bus_gbps: float | None = None,
        nccl_timeout_seconds: float = 600.0,
        runner: CommandRunner = run_command,
        which: Callable[[str], str | None] = shutil.which,
        clock: Clock = system_clock,
    ) -> None:
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise ConfigError(f"unknown validation check(s) {unknown}; known: {list(CHECKS)}")
        if min(dcgm_timeout_seconds, load_timeout_seconds, nccl_timeout_seconds) <= 0:
            raise ConfigError("validation timeouts must be > 0")
        if not 1 <= dcgm_level <= 4:
            raise ConfigError(f"dcgm_level must be 1-4, got {dcgm_level}")
        self.node = node
        self.checks = tuple(c for c in CHECKS if c in checks)
        self.state_check = state_check
        self.dcgmi = dcgmi
        self.dcgm_level = dcgm_level
        self.dcgm_timeout_seconds = dcgm_timeout_seconds
        self.load_command = tuple(load_command)
        self.load_timeout_seconds = load_timeout_seconds
        self.nccl_command = nccl_command
        self.nccl_args = tuple(nccl_args)
        self.nccl_min_bus_gbps = nccl_min_bus_gbps
        self.nccl_timeout_seconds = nccl_timeout_seconds
        self.runner = runner
        self.which = which
        self.clock = clock

    def run(self, gpus: Sequence[str] = (), *, since_at: float | None = None) -> ValidationReport:
        """Run the checks; the first failure stops the rest.

        Args:
            gpus: PCI bus ids to check; empty: every GPU of the node.
            since_at: When the fix happened (Xids logged since then fail the NVML check).
        """
        started = self.clock()
        results: list[CheckResult] = []
        failed = False
        count = len(gpus)
        for name in self.checks:
            if failed:
                results.append(CheckResult(name=name, outcome=NOT_RUN))
                continue
            at = time.monotonic()
            logger.info("validation of %s: %s", self.node, name)
            if name == "nvml":
                result, count = self._nvml(gpus, since_at)
            elif name == "dcgm_diag":
                result = self._command(name, [self.dcgmi, "diag", "-r", str(self.dcgm_level)],
                                       self.dcgm_timeout_seconds, fail=_DCGM_FAIL)
            elif name == "load":
                argv = [a.replace("{gpus}", ",".join(gpus)) for a in self.load_command]
                result = (self._command(name, argv, self.load_timeout_seconds) if argv
                          else CheckResult(name=name, outcome=SKIPPED,
                                           output="no load test configured (load_command)"))
            else:
                result = self._nccl(count)
            result = CheckResult(name=result.name, outcome=result.outcome,
                                 command=result.command, output=result.output,
                                 seconds=time.monotonic() - at)
            results.append(result)
            failed = result.outcome == FAILED
            log = logger.warning if failed else logger.info
            log("validation of %s: %s %s %s", self.node, name, result.outcome,
                result.output[-300:])
        return ValidationReport(outcome=FAILED if failed else PASSED, node=self.node,
                                checks=tuple(results), started_at=started,
                                finished_at=self.clock())

    def _nvml(self, gpus: Sequence[str], since_at: float | None) -> tuple[CheckResult, int]:
        check = self.state_check or NvmlStateCheck(node=self.node, runner=self.runner)
        try:
            states = check(gpus, since_at)
        except (GpuHealthError, OSError) as exc:
            return CheckResult(name="nvml", outcome=FAILED,
                               output=f"GPU state not readable: {exc}"), len(gpus)
        problems = [f"{s.gpu}: {p}" for s in states for p in s.problems]
        if not states:
            problems = ["NVML finds no GPU"]
        return (CheckResult(name="nvml", outcome=FAILED if problems else PASSED,
                            output="; ".join(problems) or f"{len(states)} GPU(s) clean"),
                len(states))

    def _command(self, name: str, argv: Sequence[str], timeout: float, *,
                 fail: re.Pattern[str] | None = None) -> CheckResult:
        command = " ".join(argv)
        if self.which(argv[0]) is None:
            return CheckResult(name=name, outcome=SKIPPED, command=command,
                               output=f"{argv[0]} is not installed")
        done = self.runner(argv, timeout)
        output = tail("\n".join(t for t in (done.stdout.strip(), done.stderr.strip()) if t))
        bad = done.returncode != 0 or (fail is not None and fail.search(done.stdout))
        if done.returncode is None:
            output = output or f"timed out after {timeout:g} s"
        return CheckResult(name=name, outcome=FAILED if bad else PASSED, command=command,
                           output=output)

    def _nccl(self, gpus: int) -> CheckResult:
        argv = [self.nccl_command, *self.nccl_args, "-g", str(max(1, gpus))]
        result = self._command("nccl", argv, self.nccl_timeout_seconds)
        if result.outcome != PASSED:
            return result
        match = _NCCL_BUSBW.search(result.output)
        if self.nccl_min_bus_gbps is not None:
            if match is None:
                return CheckResult(name="nccl", outcome=FAILED, command=result.command,
                                   output=f"no 'Avg bus bandwidth' line. {result.output}")
            busbw = float(match.group(1))
            if busbw < self.nccl_min_bus_gbps:
                return CheckResult(name="nccl", outcome=FAILED, command=result.command,
                                   output=f"Avg bus bandwidth {busbw:g} GB/s < "
                                          f"{self.nccl_min_bus_gbps:g}. {result.output}")
        return result


# --------------------------------------------------------------------------- the validators


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationRequest:
    """What the engine asks a validator: validate ``node`` after its fix.

    Attributes:
        node: The node.
        idempotency_key: ``<incident>/validate``; asking again returns the same validation.
        reason: Why (the incident's reason).
        gpus: PCI bus ids; empty: every GPU of the node.
        since_at: When the fix finished, epoch seconds.
        dry_run: Record only: nothing runs, the validation passes.
    """

    node: str
    idempotency_key: str
    reason: str = ""
    gpus: tuple[str, ...] = ()
    since_at: float | None = None
    dry_run: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationStatus:
    """Where a validation stands: ``running``, ``succeeded`` (passed) or ``failed``."""

    ref: str
    phase: ActionPhase
    message: str = ""
    report: ValidationReport | None = None


class NodeValidator(Protocol):
    """Validates a node after a fix, fire and poll (as a scheduler adapter does)."""

    name: str

    async def submit(self, request: ValidationRequest) -> str:
        """Start the validation (idempotent on the key); return a ref to poll."""
        ...

    async def status(self, ref: str) -> ValidationStatus:
        """Report the validation.

        Raises:
            TemporaryError: The validator cannot be asked now (tried again).
            PermanentError: ``ref`` is unknown or the validator refused.
        """
        ...


def _status_of(ref: str, report: ValidationReport) -> ValidationStatus:
    phase = ActionPhase.SUCCEEDED if report.passed else ActionPhase.FAILED
    return ValidationStatus(ref=ref, phase=phase, message=report.summary(), report=report)


class LocalValidator:
    """Runs validations on this machine, each in its own thread (``gpuhealth run`` alone).

    Args:
        runner: The checks.
    """

    name = "local"

    def __init__(self, *, runner: ValidationRunner) -> None:
        self.runner = runner
        self._jobs: dict[str, tuple[threading.Thread | None, list[ValidationReport]]] = {}
        self._lock = threading.Lock()

    async def submit(self, request: ValidationRequest) -> str:
        """Start validating (a dry run passes without running anything)."""
        ref = f"validate-{request.idempotency_key}"
        with self._lock:
            if ref in self._jobs:
                return ref
            done: list[ValidationReport] = []
            if request.dry_run:
                done.append(ValidationReport(outcome=PASSED, node=request.node))
                self._jobs[ref] = (None, done)
                return ref
            thread = threading.Thread(
                target=lambda: done.append(self.runner.run(request.gpus,
                                                           since_at=request.since_at)),
                daemon=True, name=f"validate-{request.node}")
            self._jobs[ref] = (thread, done)
            thread.start()
        return ref

    async def status(self, ref: str) -> ValidationStatus:
        """Report the validation."""
        with self._lock:
            job = self._jobs.get(ref)
        if job is None:
            raise PermanentError(f"unknown validation {ref!r}")
        thread, done = job
        if not done:
            if thread is not None and not thread.is_alive():
                return ValidationStatus(ref=ref, phase=ActionPhase.FAILED,
                                        message="the validation crashed (see the log)")
            return ValidationStatus(ref=ref, phase=ActionPhase.RUNNING, message="validating")
        return _status_of(ref, done[0])

    def wait(self, ref: str, timeout_seconds: float = 30.0) -> None:
        """Block until the validation's thread ended (tests)."""
        job = self._jobs.get(ref)
        if job is not None and job[0] is not None:
            job[0].join(timeout_seconds)


class ValidationService:
    """The node side: one validation per key, run in a thread; answers what it knows.

    :class:`remediation.gpu_reset.GpuResetEndpoint` (given ``validation``) serves it on
    the signed ``POST /api/v1/gpu-reset`` with ``"op": "validate"``.

    Args:
        runner: The checks.
        remembered_keys: Finished validations kept (a repeated key answers the same).
    """

    def __init__(self, *, runner: ValidationRunner, remembered_keys: int = 1000) -> None:
        self.runner = runner
        self.remembered_keys = remembered_keys
        self._jobs: OrderedDict[str, list[ValidationReport]] = OrderedDict()
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def handle(self, data: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Start or report the validation of ``data`` (checked JSON body).

        Returns:
            202 ``{"outcome": "running"}``, or 200 ``{"outcome": "passed"|"failed",
            "report": ...}``; 400 for a malformed body.
        """
        key = data.get("idempotency_key")
        gpus = data.get("gpus", [])
        since = data.get("since_at")
        if not isinstance(key, str) or not key:
            return 400, {"error": "idempotency_key: required string"}
        if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
            return 400, {"error": "gpus: expected a list of PCI bus ids"}
        if since is not None and not isinstance(since, int | float):
            return 400, {"error": "since_at: expected epoch seconds"}
        with self._lock:
            done = self._jobs.get(key)
            if done is None:
                done = []
                self._jobs[key] = done
                thread = threading.Thread(
                    target=self._run, args=(key, tuple(gpus), since, done), daemon=True,
                    name="gpu-validate")
                self._threads[key] = thread
                thread.start()
                while len(self._jobs) > self.remembered_keys:
                    old, _ = self._jobs.popitem(last=False)
                    self._threads.pop(old, None)
        if not done:
            alive = self._threads.get(key)
            if alive is not None and not alive.is_alive():
                return 200, {"outcome": FAILED, "report": None,
                             "message": "the validation crashed (see the node's log)"}
            return 202, {"outcome": "running"}
        report = done[0]
        return 200, {"outcome": report.outcome, "report": report.to_json(),
                     "message": report.summary()}

    def _run(self, key: str, gpus: tuple[str, ...], since: float | None,
             done: list[ValidationReport]) -> None:
        done.append(self.runner.run(gpus, since_at=since))

    def wait(self, key: str, timeout_seconds: float = 30.0) -> None:
        """Block until the validation of ``key`` ended (tests)."""
        thread = self._threads.get(key)
        if thread is not None:
            thread.join(timeout_seconds)


class NodeAgentValidator:
    """Asks a node's gpuhealth to validate it, on the signed endpoint the GPU reset uses.

    Each :meth:`status` POSTs ``{"op": "validate", "node", "idempotency_key", "gpus",
    "since_at"}`` (signed with a fresh ``webhook-id``); the node starts the validation
    on the first and answers ``running`` until it finished. An unreachable agent or a
    5xx is retried on the next poll until ``deadline_seconds`` after submission.

    Args:
        secret, secret_env, secret_file: The shared secret (exactly one).
        url_template: The node agent's endpoint; ``{node}`` is replaced by the node name.
        timeout_seconds: Timeout of one request, seconds (the node answers at once).
        deadline_seconds: A validation not finished this long after submission fails.
        poll_interval_seconds: Least time between two requests for one validation,
            seconds (the engine ticks every few seconds; a DCGM diagnostic takes minutes).
        verify: TLS verification: ``True``, a CA bundle path, or ``False``.
        clock: Returns now, epoch seconds.
        transport: An ``httpx`` transport (tests).

    Raises:
        ConfigError: A template without ``{node}``, bad timings, no or a bad secret.
    """

    name = "node_agent_validation"

    def __init__(
        self,
        *,
        secret: str | None = None,
        secret_env: str | None = None,
        secret_file: str | None = None,
        url_template: str = "https://{node}:9836/api/v1/gpu-reset",
        timeout_seconds: float = 30.0,
        deadline_seconds: float = 7200.0,
        poll_interval_seconds: float = 15.0,
        verify: bool | str = True,
        clock: Clock = system_clock,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if min(timeout_seconds, deadline_seconds) <= 0 or poll_interval_seconds < 0:
            raise ConfigError("validation timeout and deadline must be > 0, "
                              "poll_interval_seconds >= 0")
        self.poll_interval_seconds = poll_interval_seconds
        self._asked: dict[str, tuple[float, ValidationStatus]] = {}
        self._key = node_agent_key(url_template, secret=secret, secret_env=secret_env,
                                   secret_file=secret_file, what="node agent validation")
        self.url_template = url_template
        self.timeout_seconds = timeout_seconds
        self.deadline_seconds = deadline_seconds
        self.verify = verify
        self.clock = clock
        self._transport = transport
        self._requests: dict[str, tuple[ValidationRequest, float]] = {}
        self._done: dict[str, ValidationStatus] = {}

    def __repr__(self) -> str:
        """Return a representation that never shows the secret."""
        return f"NodeAgentValidator(url_template={self.url_template!r})"

    async def submit(self, request: ValidationRequest) -> str:
        """Record the validation; the first :meth:`status` starts it on the node."""
        ref = f"validate-{request.idempotency_key}"
        if ref not in self._requests:
            self._requests[ref] = (request, self.clock())
            if request.dry_run:
                self._done[ref] = ValidationStatus(ref=ref, phase=ActionPhase.SUCCEEDED,
                                                   message="dry run: not sent")
        return ref

    async def status(self, ref: str) -> ValidationStatus:
        """Ask the node (start or report)."""
        if ref in self._done:
            return self._done[ref]
        entry = self._requests.get(ref)
        if entry is None:
            raise PermanentError(f"unknown validation {ref!r}")
        request, submitted = entry
        asked = self._asked.get(ref)
        now = self.clock()
        if asked is not None and now - asked[0] < self.poll_interval_seconds:
            return asked[1]
        status = await asyncio.to_thread(self._post, ref, request)
        self._asked[ref] = (now, status)
        if status.phase is ActionPhase.RUNNING and \
                self.clock() - submitted > self.deadline_seconds:
            status = ValidationStatus(ref=ref, phase=ActionPhase.FAILED,
                                      message=f"gave up at the deadline "
                                              f"({self.deadline_seconds:g} s): {status.message}")
        if status.phase is not ActionPhase.RUNNING:
            self._done[ref] = status
            self._asked.pop(ref, None)
        return status

    def _post(self, ref: str, request: ValidationRequest) -> ValidationStatus:
        url = self.url_template.format(node=request.node)
        body = json.dumps({"op": "validate", "node": request.node,
                           "idempotency_key": request.idempotency_key,
                           "gpus": list(request.gpus), "since_at": request.since_at,
                           "reason": request.reason}, sort_keys=True).encode()
        msg_id = f"validate_{uuid.uuid4().hex}"
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
            return ValidationStatus(ref=ref, phase=ActionPhase.RUNNING,
                                    message=f"node agent {url} unreachable: {exc}")
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        code = response.status_code
        if code == 202:
            return ValidationStatus(ref=ref, phase=ActionPhase.RUNNING, message="validating")
        if code == 200 and answer.get("outcome") in (PASSED, FAILED):
            raw = answer.get("report")
            report = ValidationReport.from_json(raw) if isinstance(raw, dict) else None
            phase = ActionPhase.SUCCEEDED if answer["outcome"] == PASSED else ActionPhase.FAILED
            return ValidationStatus(ref=ref, phase=phase, report=report,
                                    message=str(answer.get("message", answer["outcome"])))
        if code == 429 or code >= 500:
            return ValidationStatus(ref=ref, phase=ActionPhase.RUNNING,
                                    message=f"node agent answered {code}")
        detail = answer.get("error") or response.text[:200]
        return ValidationStatus(ref=ref, phase=ActionPhase.FAILED,
                                message=f"node agent refused the validation ({code}): {detail}")
