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
machine; :class:`ValidationEndpoint` serves them on a node agent as
``POST /api/v1/gpu-validate`` (signed as the GPU reset is), and
:class:`NodeAgentValidator` is the controller's side of that endpoint. The engine
(:class:`remediation.engine.RemediationEngine`, ``validator``) starts a validation when
a fix step succeeded, keeps the node out of service until it passed, and hands the node
to hardware service with the evidence when it failed.
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from collectors.nvml import NvmlCollector
from core.ids import normalize_pci_bus_id
from core.records import Event, Sample

logger = logging.getLogger(__name__)

VALIDATE_PATH = "/api/v1/gpu-validate"
"""Path of the node agent's validation endpoint."""

DEFAULT_VALIDATE_URL_TEMPLATE = "https://{node}:9836" + VALIDATE_PATH
"""Where the controller reaches a node agent's validation (``{node}``: node name)."""

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
