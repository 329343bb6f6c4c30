"""Slurm scheduler adapter (entry point ``slurm``): drain, requeue, reboot, resume on Slurm.

Carries out remediation steps with the Slurm client commands ``scontrol``, ``sinfo``,
``squeue`` and ``scancel`` (Slurm 22.05 manual pages, https://slurm.schedmd.com/),
run as asyncio subprocesses with a timeout per command; the command's stderr is in
every error. Nodes and jobs are read with ``sinfo --json`` / ``squeue --json``
(OpenAPI plugin ``v0.0.38`` in 22.05, detected at the first read) or, where the
client has no ``--json``, with ``scontrol show node -o`` and ``squeue -O``.
``docs/slurm.md`` has the full table; in short:

* ``cordon``: ``scontrol update NodeName=N State=DRAIN Reason="gpuhealth: ..."``. A node
  already drained by someone else keeps its reason (a human's drain is never claimed).
* ``drain``/``migrate`` with ``mode=evict``: cordon, then every job running on the node
  gets ``checkpoint_signal`` (``scancel --signal=USR1 --batch``: the batch shell, which
  traps it, as ``sbatch --signal=B:USR1@...`` does), and ``grace_seconds`` later the
  jobs still running there are requeued (``scontrol requeue``); a job that died of the
  signal (a script without a trap) is requeued too, as Slurm's ``PreemptMode=REQUEUE``
  does. Jobs that cannot be requeued are left running (or cancelled with
  ``cancel_unrequeueable``). Jobs are signalled and requeued the highest job priority
  first (``squeue`` ``priority``), so critical work is back in the queue first.
  Succeeded when no job runs on the node.
  ``mode=allow_completion``: cordon only, succeeded once the jobs ended on their own.
* ``reboot``: ``scontrol reboot ASAP nextstate=<reboot_nextstate> reason=... N``;
  succeeded when ``BootTime`` changed and the REBOOT flags are gone; failed when
  Slurm reports "reboot timed out" or the node went DOWN.
* ``resume``: ``scontrol update NodeName=N State=RESUME``, only when the node's reason
  starts with ``gpuhealth:``; otherwise the status is ``failed`` and says why.
* ``hand_off``: keeps the node drained with reason
  ``gpuhealth: hand-off to hardware service: ...``. ``restart``: requeue the jobs on
  the node (or ``attrs["job_id"]``). ``notify``: nothing. ``reset_gpu``: not a Slurm
  operation (:class:`~core.errors.PermanentError`; the engine asks the node agent).

Idempotency: ``submit`` returns the same ref for the same ``idempotency_key``, and is
idempotent *in effect* across adapter instances (a new controller after fail-over
re-submits running actions): every decision is taken from what Slurm shows now, and
what gpuhealth did to a job or a node is written into Slurm itself, so a fresh
instance sees it: the job's ``AdminComment`` gets ``gpuhealth:<key hash>:signal@<node>:<epoch>``
before the signal (never signalled twice; the grace period counts from that time) and
``gpuhealth:<key hash>:requeue@<node>:<epoch>`` for ``restart``; a reboot writes the
node's ``Comment`` (only when empty or already gpuhealth's) as
``gpuhealth:<key hash>:reboot:boot=<BootTime>``. Refs carry the step, node, key hash
and baseline (``slurm/reboot/gpu001/3fa2c1d09b7e?boot=1796025310``), so any instance
can answer ``status`` for any ref.

``status`` advances a drain: the requeue after the grace period is made by the first
poll after it ends, so the engine's poll interval adds to the grace period.

Errors: a node Slurm does not know raises :class:`~core.errors.NodeNotFound`; a
controller that cannot be reached (or a command that times out) raises
:class:`~core.errors.SchedulerUnavailable`; a client command that is missing raises
:class:`~core.errors.ConfigError`; other refusals raise :class:`~core.errors.PermanentError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qsl, urlencode

from core.clock import Clock, system_clock
from core.errors import (
    ConfigError,
    GpuHealthError,
    NodeNotFound,
    PermanentError,
    ReturnedToService,
    SchedulerUnavailable,
)
from core.records import (
    OWNER_PREFIX,
    ActionPhase,
    ActionRequest,
    ActionStatus,
    EntityId,
    NodeName,
    NodeState,
    RemediationStep,
    WorkRef,
)
from remediation.priority import WorkItem

logger = logging.getLogger(__name__)

OPT_OUT_FEATURE = "gpuhealth-opt-out"
"""A node with this Slurm feature (``AvailableFeatures`` or ``ActiveFeatures``) opts out."""

HAND_OFF_PREFIX = f"{OWNER_PREFIX} hand-off to hardware service: "
"""The reason a handed-off node keeps."""

ACTIVE_JOB_STATES = frozenset({"RUNNING", "SUSPENDED", "COMPLETING"})
"""Job states that occupy a node (squeue ``-t R,S,CG``)."""

REBOOT_FLAGS = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED", "REBOOT"})
"""Node state flags of a pending reboot (``scontrol reboot``)."""

UNSCHEDULABLE_FLAGS = frozenset({"DRAIN", "FAIL"})
"""Node state flags that keep new jobs off a node."""

UNSCHEDULABLE_STATES = frozenset({"DOWN", "FUTURE"})
"""Base node states in which no job starts."""

SLURM_DOWN_REASONS = ("Not responding", "Node unexpectedly rebooted", "reboot timed out",
                      "Kill task failed", "Prolog error", "Epilog error")
"""Reasons slurmctld itself gives a node it sets DOWN (slurmctld/node_mgr.c, ping_nodes.c)."""

_UNAVAILABLE_MARKERS = (
    "unable to contact slurm controller",
    "socket timed out",
    "zero bytes were transmitted",
    "connection refused",
    "communication connection failure",
    "slurm backup controller in standby mode",
    "resource temporarily unavailable",
    "transport endpoint is not connected",
)
"""Substrings of client stderr that mean slurmctld cannot be reached now (retry)."""

_NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SIGNAL_RE = re.compile(r"^(SIG)?[A-Z][A-Z0-9+-]*$|^[0-9]{1,2}$")
_MARK_RE = re.compile(
    r"gpuhealth:(?P<key>[0-9a-f]{12}):(?P<what>signal|requeue)@(?P<node>[^:;\s]+):"
    r"(?P<at>\d+(?:\.\d+)?)"
)
_REBOOT_MARK_RE = re.compile(r"gpuhealth:(?P<key>[0-9a-f]{12}):reboot:boot=(?P<boot>\d*)")
_KEY_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")
_NODE_TAIL_RE = re.compile(r" (Reason|Comment|Extra)=")
_REASON_SUFFIX_RE = re.compile(r"\s*\[[^\]@]*@[^\]]*\]\s*$")


# --- records read from Slurm ----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmNode:
    """A node as ``sinfo --json`` or ``scontrol show node -o`` shows it.

    Attributes:
        name: ``NodeName``.
        state: Base state, upper case (``IDLE``, ``MIXED``, ``ALLOCATED``, ``DOWN``,
            ``UNKNOWN``, ``FUTURE``).
        flags: State flags, upper case (``DRAIN``, ``REBOOT_REQUESTED``, ``NOT_RESPONDING``).
        reason: ``Reason=`` without its ``[user@time]`` suffix; ``""`` when none.
        features: ``AvailableFeatures``.
        active_features: ``ActiveFeatures``.
        weight: ``Weight`` (lower is preferred by Slurm), ``None`` if not shown.
        boot_time: ``BootTime`` as epoch seconds, ``None`` when unknown.
        comment: The node's ``Comment=``.
    """

    name: str
    state: str
    flags: tuple[str, ...] = ()
    reason: str = ""
    features: tuple[str, ...] = ()
    active_features: tuple[str, ...] = ()
    weight: int | None = None
    boot_time: int | None = None
    comment: str = ""

    @property
    def state_words(self) -> str:
        """State as ``scontrol`` writes it: ``IDLE+DRAIN+NOT_RESPONDING``."""
        return "+".join((self.state, *self.flags))

    @property
    def drained(self) -> bool:
        """Whether the DRAIN flag is set (DRAINING or DRAINED)."""
        return "DRAIN" in self.flags

    @property
    def down(self) -> bool:
        """Whether the base state is DOWN."""
        return self.state == "DOWN"

    @property
    def rebooting(self) -> bool:
        """Whether a reboot is requested or issued and not yet done."""
        return any(flag in REBOOT_FLAGS for flag in self.flags)

    @property
    def schedulable(self) -> bool:
        """Whether new jobs may start: not DRAIN/FAIL, not DOWN/FUTURE."""
        return not (
            self.state in UNSCHEDULABLE_STATES or any(f in UNSCHEDULABLE_FLAGS for f in self.flags)
        )

    @property
    def owned(self) -> bool:
        """Whether gpuhealth took it out of service: unschedulable, reason ``gpuhealth:...``."""
        return not self.schedulable and self.reason.startswith(OWNER_PREFIX)

    @property
    def opted_out(self) -> bool:
        """Whether the node carries the :data:`OPT_OUT_FEATURE` feature."""
        return OPT_OUT_FEATURE in self.features or OPT_OUT_FEATURE in self.active_features


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmJob:
    """A job as ``squeue`` shows it.

    Attributes:
        job_id: The job id as Slurm prints it (``"123"``, or ``"123_4"`` for an array task).
        state: ``RUNNING``, ``SUSPENDED``, ``COMPLETING``, ``PENDING``...
        nodes: The nodes it holds (expanded names).
        requeue: Whether it may be requeued (``--requeue``, ``Requeue=1``).
        batch: Whether it is a batch job (``sbatch``); only those can be requeued.
        restarts: ``Restarts`` / ``restart_cnt``.
        admin_comment: ``AdminComment`` (where gpuhealth marks what it did to the job).
        user: ``UserName`` (``""`` when not shown).
        partition: ``Partition`` (``""`` when not shown).
        priority: The job's priority (``PriorityLong``; 0 when not shown).
        qos: Its QOS (``""`` when not shown).
        started_at: Its ``StartTime``, epoch seconds (``None`` when not shown or pending).
        gpus: GPUs allocated (``gres/gpu`` of its allocated TRES; 0 when not shown).
    """

    job_id: str
    state: str
    nodes: tuple[str, ...] = ()
    requeue: bool = False
    batch: bool = True
    restarts: int = 0
    admin_comment: str = ""
    user: str = ""
    partition: str = ""
    priority: int = 0
    qos: str = ""
    started_at: float | None = None
    gpus: int = 0


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist expression (``gpu[001-003,7],vm``) into node names.

    Follows the hostlist syntax of ``scontrol show hostnames`` (slurm.conf(5),
    "NodeName"): comma-separated names, each with bracketed ranges or lists; the
    width of the lower bound's zero padding is kept. Several bracket groups multiply
    out (``r[1-2]n[1-2]`` gives four names).

    Raises:
        ValueError: Unbalanced brackets or a range that is not ``lo-hi`` with lo <= hi.

    Examples:
        >>> expand_hostlist("gpu[001-003,7],vm")
        ['gpu001', 'gpu002', 'gpu003', 'gpu7', 'vm']
    """
    names: list[str] = []
    depth = 0
    start = 0
    parts: list[str] = []
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {text!r}")
    parts.append(text[start:])
    for part in (p.strip() for p in parts):
        if part:
            names.extend(_expand_one(part, text))
    return names


def _expand_one(part: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", part)
    if match is None:
        return [part]
    head, tail = part[: match.start()], part[match.end() :]
    out: list[str] = []
    for item in match.group(1).split(","):
        lo, sep, hi = item.partition("-")
        if not sep:
            values = [lo]
        else:
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"bad range {item!r} in hostlist {whole!r}")
            values = [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
        for value in values:
            out.extend(_expand_one(head + value + tail, whole))
    return out


# --- parsers (pure functions, tested on recorded output) ------------------------------


def _features(value: str) -> tuple[str, ...]:
    if value in ("", "(null)"):
        return ()
    return tuple(f.strip() for f in value.split(",") if f.strip())


def _split_state(words: str) -> tuple[str, tuple[str, ...]]:
    parts = [p.strip().upper() for p in words.split("+") if p.strip()]
    if not parts:
        return "UNKNOWN", ()
    base = parts[0].rstrip("*~#!%$@^-")
    return base, tuple(parts[1:])


def _epoch_from_iso(value: str) -> int | None:
    """``2026-11-30T05:26:03`` (local time, as scontrol prints it) to epoch seconds."""
    if value in ("", "None", "Unknown", "N/A", "(null)"):
        return None
    try:
        return int(time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def _key_values(text: str) -> dict[str, str]:
    """``Key=value`` pairs of an ``-o`` line whose values hold no ``Key=``-like text."""
    matches = list(_KEY_RE.finditer(text))
    out: dict[str, str] = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out.setdefault(match.group(1), text[match.end() : end].strip())
    return out


def parse_scontrol_node(text: str, *, source: str = "scontrol show node -o") -> SlurmNode:
    """Parse one ``scontrol show node -o`` line (Slurm 20.11-23.x field layout).

    The free-text fields come last in this order: ``Reason=<text> [user@time]``,
    ``Comment=``, ``Extra=`` (``src/api/node_info.c``); they are cut off first, so a
    reason may contain spaces and ``=``. ``OS=`` may contain spaces.

    Args:
        text: The output; the first non-empty line is used.
        source: Names the command in errors.

    Raises:
        PermanentError: No ``NodeName=`` or ``State=`` in the line.
    """
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    tails: dict[str, str] = {}
    first_tail = _NODE_TAIL_RE.search(line)
    head = line
    if first_tail is not None:
        head, rest = line[: first_tail.start()], line[first_tail.start() :]
        pieces = list(_NODE_TAIL_RE.finditer(rest))
        for i, match in enumerate(pieces):
            end = pieces[i + 1].start() if i + 1 < len(pieces) else len(rest)
            tails[match.group(1)] = rest[match.end() : end].strip()
    values = _key_values(head)
    if "NodeName" not in values or "State" not in values:
        raise PermanentError(f"{source}: cannot parse node line {line[:200]!r}")
    base, flags = _split_state(values["State"])
    weight = values.get("Weight", "")
    return SlurmNode(
        name=values["NodeName"],
        state=base,
        flags=flags,
        reason=_REASON_SUFFIX_RE.sub("", tails.get("Reason", "")),
        features=_features(values.get("AvailableFeatures", "")),
        active_features=_features(values.get("ActiveFeatures", "")),
        weight=int(weight) if weight.isdigit() else None,
        boot_time=_epoch_from_iso(values.get("BootTime", "")),
        comment=tails.get("Comment", ""),
    )


def _load_json(text: str, source: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PermanentError(f"{source}: output is not JSON (line {exc.lineno}: {exc.msg})") \
            from exc
    if not isinstance(data, dict):
        raise PermanentError(f"{source}: expected a JSON object, got {type(data).__name__}")
    errors = data.get("errors") or []
    if errors:
        described = "; ".join(
            f"{e.get('source', '?')}: {e.get('description', '')} ({e.get('error', '')})"
            if isinstance(e, dict) else str(e) for e in errors
        )
        raise SchedulerUnavailable(f"{source} reported errors: {described}")
    return data


def parse_sinfo_json(text: str, *, source: str = "sinfo --json") -> dict[str, SlurmNode]:
    """Parse ``sinfo --json`` (OpenAPI ``v0.0.37``-``v0.0.39`` node objects) by node name.

    Raises:
        PermanentError: Not JSON, or no ``nodes`` list.
        SchedulerUnavailable: The output's ``errors`` list is not empty (``sinfo`` exits 0
            with ``errors`` when it cannot reach slurmctld).
    """
    data = _load_json(text, source)
    nodes = data.get("nodes")
    if not isinstance(nodes, list):
        raise PermanentError(f"{source}: no 'nodes' list in the output")
    out: dict[str, SlurmNode] = {}
    for item in nodes:
        name = str(item.get("name") or item.get("hostname") or "")
        if not name:
            continue
        state = item.get("state", "unknown")
        if isinstance(state, list):  # v0.0.39+: state is a list of words
            words = [str(s).upper() for s in state]
            base, flags = (words[0], tuple(words[1:])) if words else ("UNKNOWN", ())
        else:
            base = str(state).upper()
            flags = tuple(str(f).upper() for f in item.get("state_flags", []) or [])
        boot = item.get("boot_time")
        if isinstance(boot, dict):  # v0.0.39+: {"set": true, "number": N}
            boot = boot.get("number") if boot.get("set", True) else None
        weight = item.get("weight")
        out[name] = SlurmNode(
            name=name,
            state=base,
            flags=flags,
            reason=str(item.get("reason") or ""),
            features=_features(str(item.get("features") or "")),
            active_features=_features(str(item.get("active_features") or "")),
            weight=int(weight) if isinstance(weight, int) else None,
            boot_time=int(boot) if isinstance(boot, int) and boot > 0 else None,
            comment=str(item.get("comment") or ""),
        )
    return out


def _number(value: Any) -> float | None:
    """An OpenAPI number: plain (v0.0.38) or ``{"set": true, "number": n}`` (v0.0.39+)."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def gpus_of_tres(text: str) -> int:
    """GPUs in a TRES string (``cpu=4,mem=8G,node=1,gres/gpu=2``; typed ones summed if alone).

    Examples:
        >>> gpus_of_tres("cpu=4,node=1,gres/gpu=2,gres/gpu:a100=2")
        2
        >>> gpus_of_tres("cpu=1,gres/gpu:a100=1,gres/gpu:h100=3"), gpus_of_tres("")
        (4, 0)
    """
    plain: int | None = None
    typed = 0
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if not value.isdigit():
            continue
        if key == "gres/gpu":
            plain = int(value)
        elif key.startswith("gres/gpu:"):
            typed += int(value)
    return plain if plain is not None else typed


def gpus_of_gres(text: str) -> int:
    """GPUs in a GRES list (``gres:gpu:2``, ``gres/gpu:a100:2``, ``gpu:2(IDX:0-1)``).

    What a job asked per node (``tres_per_node``) or was given (``gres_detail``); the
    allocated TRES (:func:`gpus_of_tres`) names GPUs only where accounting tracks
    ``gres/gpu``.

    Examples:
        >>> gpus_of_gres("gres:gpu:2"), gpus_of_gres("gres/gpu:a100:4,gres/nic:1")
        (2, 4)
        >>> gpus_of_gres("gpu:h100:2(IDX:0-1),gpu:1(IDX:3)"), gpus_of_gres("gres:gpu")
        (3, 1)
    """
    total = 0
    for part in text.split(","):
        name = re.sub(r"\(.*\)$", "", part.strip())
        words = name.replace("/", ":").split(":")
        if words and words[0] == "gres":
            words = words[1:]
        if not words or words[0] != "gpu":
            continue
        count = words[-1] if len(words) > 1 else "1"
        total += int(count) if count.isdigit() else 1
    return total


def _job_gpus(tres_alloc: str, gres_detail: Any, per_node: str, nodes: int) -> int:
    """A job's GPUs: allocated TRES, else the per-node GRES detail, else its request."""
    from_tres = gpus_of_tres(tres_alloc)
    if from_tres:
        return from_tres
    if isinstance(gres_detail, list) and gres_detail:
        return sum(gpus_of_gres(str(d)) for d in gres_detail)
    return gpus_of_gres(per_node) * max(1, nodes)


def parse_squeue_json(text: str, *, source: str = "squeue --json") -> list[SlurmJob]:
    """Parse ``squeue --json`` (OpenAPI ``v0.0.37``-``v0.0.39`` job objects).

    ``squeue --json`` ignores ``-w``/``-t`` in 22.05, so it lists every job; the
    nodes come from ``job_resources.allocated_nodes[].nodename`` or the ``nodes``
    hostlist.

    Raises:
        PermanentError: Not JSON, or no ``jobs`` list.
        SchedulerUnavailable: The output's ``errors`` list is not empty.
    """
    data = _load_json(text, source)
    jobs = data.get("jobs")
    if not isinstance(jobs, list):
        raise PermanentError(f"{source}: no 'jobs' list in the output")
    out: list[SlurmJob] = []
    for item in jobs:
        state = item.get("job_state", "")
        if isinstance(state, list):
            state = state[0] if state else ""
        resources = item.get("job_resources") or {}
        allocated = resources.get("allocated_nodes") or []
        names: list[str] = []
        if isinstance(allocated, list):
            names = [str(a["nodename"]) for a in allocated
                     if isinstance(a, dict) and a.get("nodename")]
        elif isinstance(allocated, dict):
            names = [str(a["nodename"]) for a in allocated.values()
                     if isinstance(a, dict) and a.get("nodename")]
        if not names and item.get("nodes"):
            try:
                names = expand_hostlist(str(item["nodes"]))
            except ValueError:
                names = [str(item["nodes"])]
        job_id = item.get("job_id")
        array_task = item.get("array_task_id")
        if isinstance(array_task, dict):
            array_task = array_task.get("number") if array_task.get("set") else None
        out.append(SlurmJob(
            job_id=str(job_id),
            state=str(state).upper(),
            nodes=tuple(names),
            requeue=bool(item.get("requeue", False)),
            batch=bool(item.get("batch_flag", True)),
            restarts=int(item.get("restart_cnt") or 0),
            admin_comment=str(item.get("admin_comment") or ""),
            user=str(item.get("user_name") or ""),
            partition=str(item.get("partition") or ""),
            priority=int(_number(item.get("priority")) or 0),
            qos=str(item.get("qos") or ""),
            started_at=(_number(item.get("start_time")) or None)
            if str(state).upper() != "PENDING" else None,
            gpus=_job_gpus(str(item.get("tres_alloc_str") or ""), item.get("gres_detail"),
                           str(item.get("tres_per_node") or ""), len(names)),
        ))
    return out


SQUEUE_TEXT_FORMAT = ("JobID:40|,State:20|,Requeue:4|,BatchFlag:4|,RestartCnt:8|,"
                      "UserName:40|,Partition:40|,PriorityLong:20|,QOS:40|,StartTime:20|,"
                      "tres-alloc:200|,tres-per-node:100|")
"""``squeue -O`` fields of the text fall-back, ``|``-separated."""


def parse_squeue_text(text: str, node: str, *, source: str = "squeue -O") -> list[SlurmJob]:
    """Parse ``squeue -h -w <node> -O`` :data:`SQUEUE_TEXT_FORMAT` output (jobs on ``node``).

    Raises:
        PermanentError: A line without the five fields, naming the line number.
    """
    out: list[SlurmJob] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 5:
            raise PermanentError(f"{source} line {number}: expected 5 '|'-separated fields, "
                                 f"got {line!r}")
        job_id, state, requeue, batch, restarts = fields[:5]
        user, partition = (fields[5], fields[6]) if len(fields) >= 7 else ("", "")
        priority, qos, start, tres = (fields[7:11] if len(fields) >= 11
                                      else ("", "", "", ""))
        per_node = fields[11] if len(fields) >= 12 else ""
        started = _epoch_from_iso(start) if state.upper() != "PENDING" else None
        out.append(SlurmJob(
            job_id=job_id, state=state.upper(), nodes=(node,), requeue=requeue == "1",
            batch=batch != "0", restarts=int(restarts) if restarts.isdigit() else 0,
            user=user, partition=partition, priority=int(priority) if priority.isdigit() else 0,
            qos="" if qos in ("(null)", "N/A") else qos,
            started_at=None if started is None else float(started),
            gpus=_job_gpus(tres, None, "" if per_node in ("N/A", "(null)") else per_node, 1),
        ))
    return out


def admin_comment_of(text: str) -> str:
    """The ``AdminComment=`` value of a ``scontrol show job -o`` line, ``""`` if absent."""
    match = re.search(r"(?:^|\s)AdminComment=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_/:]*=|\s*$)", text)
    return match.group(1).strip() if match else ""


def job_marks(comment: str, key_hash: str, what: str, node: str) -> list[float]:
    """Times gpuhealth marked a job with ``what`` (``signal``/``requeue``) for this key and node."""
    return [float(m.group("at")) for m in _MARK_RE.finditer(comment)
            if m.group("key") == key_hash and m.group("what") == what
            and m.group("node") == node]


def key_hash(idempotency_key: str) -> str:
    """First 12 hex digits of the SHA-256 of an idempotency key (what Slurm marks carry)."""
    return hashlib.sha256(idempotency_key.encode()).hexdigest()[:12]


def reliability_weight(score: float, *, best: int = 1, worst: int = 100) -> int:
    """Map a reliability score to a Slurm node ``Weight``.

    Slurm allocates the nodes with the lowest weight first among those that satisfy a
    job (slurm.conf(5), "Weight"), so the most reliable node gets ``best``:
    ``weight = best + round((1 - score) * (worst - best))``; 1.0 -> 1, 0.0 -> 100 with
    the defaults.

    Raises:
        ValueError: ``score`` is not a number in [0, 1].

    Examples:
        >>> reliability_weight(1.0), reliability_weight(0.0), reliability_weight(0.5)
        (1, 100, 51)
    """
    if not isinstance(score, int | float) or math.isnan(score) or not 0.0 <= score <= 1.0:
        raise ValueError(f"reliability score must be in [0, 1], got {score!r}")
    return best + round((1.0 - float(score)) * (worst - best))


# --- the adapter ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def command(self) -> str:
        return " ".join(self.argv)


@dataclass(slots=True)
class _Ref:
    step: RemediationStep
    node: str
    key: str
    extras: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        tail = f"?{urlencode(sorted(self.extras.items()))}" if self.extras else ""
        return f"slurm/{self.step.value}/{self.node}/{self.key}{tail}"

    @classmethod
    def parse(cls, ref: str) -> _Ref:
        body, _, query = ref.partition("?")
        parts = body.split("/")
        if len(parts) != 4 or parts[0] != "slurm":
            raise PermanentError(f"not a Slurm adapter ref: {ref!r}")
        try:
            step = RemediationStep(parts[1])
        except ValueError as exc:
            raise PermanentError(f"unknown step in Slurm ref {ref!r}") from exc
        return cls(step=step, node=parts[2], key=parts[3], extras=dict(parse_qsl(query)))


@dataclass(slots=True)
class _LoopState:
    semaphore: asyncio.Semaphore
    key_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    inflight: dict[str, tuple[float, asyncio.Future[_Result]]] = field(default_factory=dict)


_SIGNAL_TARGETS = {"batch": ("--batch",), "full": ("--full",), "steps": ()}
_NEXTSTATES = ("RESUME", "DOWN")


class SlurmScheduler:
    """Scheduler adapter for Slurm through its client commands (see the module docstring).

    Implements :class:`~core.protocols.SchedulerAdapter`,
    :class:`~core.protocols.NodeInspector` and
    :class:`~core.protocols.ReliabilityPublisher`. The commands run as the user of
    the gpuhealth process, which must be a Slurm operator/administrator (or root)
    for ``scontrol update``, ``requeue`` and ``reboot``.

    Args:
        scontrol_path: ``scontrol`` binary (name on PATH or path).
        sinfo_path: ``sinfo`` binary.
        squeue_path: ``squeue`` binary.
        scancel_path: ``scancel`` binary.
        env: Extra environment for every command (``SLURM_CONF``...), on top of ours.
        checkpoint_signal: Signal sent to running jobs before they are requeued
            (``USR1``, ``SIGUSR1`` or a number); ``None`` or ``""`` requeues at once.
        signal_target: Who gets the signal: ``batch`` (``scancel --batch``: the batch
            shell only, the ``sbatch --signal=B:...`` convention; the default),
            ``full`` (``--full``: batch shell, its children and steps) or ``steps``
            (the job steps only, as plain ``scancel --signal`` does).
        grace_seconds: Seconds between the signal and the requeue, >= 0 (default 30).
        command_timeout_seconds: Limit per command, > 0; a command past it is killed
            and :class:`~core.errors.SchedulerUnavailable` raised (default 15: the
            clients retry an unreachable controller for about 9 s before failing).
        reboot_nextstate: ``RESUME`` (default: the node returns to service once it
            rebooted) or ``DOWN`` (it stays out, reason kept, until ``resume``).
        cancel_unrequeueable: Cancel (``scancel``) jobs that cannot be requeued when
            evicting; default ``False`` leaves them running and says so in the status.
        json_output: Read with ``sinfo --json``/``squeue --json`` (``True``), with
            ``scontrol show node -o``/``squeue -O`` (``False``), or detect (``None``).
        max_concurrent_commands: At most this many client commands run at once (>= 1).
        weight_best: Node ``Weight`` for reliability 1.0 (>= 1).
        weight_worst: Node ``Weight`` for reliability 0.0 (> ``weight_best``, < 2**32 - 1).
        clock: Epoch seconds; the grace period is measured with it.

    Raises:
        ValueError: An option out of range.
    """

    name = "slurm"
    gpu_level_drain = False
    """Slurm cannot take one GPU of a running node out cleanly: GPU faults drain the node."""

    def __init__(
        self,
        *,
        scontrol_path: str = "scontrol",
        sinfo_path: str = "sinfo",
        squeue_path: str = "squeue",
        scancel_path: str = "scancel",
        env: Mapping[str, str] | None = None,
        checkpoint_signal: str | None = "USR1",
        signal_target: str = "batch",
        grace_seconds: float = 30.0,
        command_timeout_seconds: float = 15.0,
        reboot_nextstate: str = "RESUME",
        cancel_unrequeueable: bool = False,
        json_output: bool | None = None,
        max_concurrent_commands: int = 8,
        weight_best: int = 1,
        weight_worst: int = 100,
        clock: Clock = system_clock,
    ) -> None:
        if checkpoint_signal and not _SIGNAL_RE.match(checkpoint_signal):
            raise ValueError(f"checkpoint_signal: not a signal name or number: "
                             f"{checkpoint_signal!r}")
        if signal_target not in _SIGNAL_TARGETS:
            raise ValueError(f"signal_target must be one of {sorted(_SIGNAL_TARGETS)}, "
                             f"got {signal_target!r}")
        if not grace_seconds >= 0:
            raise ValueError(f"grace_seconds must be >= 0, got {grace_seconds!r}")
        if not command_timeout_seconds > 0:
            raise ValueError(f"command_timeout_seconds must be > 0, got "
                             f"{command_timeout_seconds!r}")
        if reboot_nextstate.upper() not in _NEXTSTATES:
            raise ValueError(f"reboot_nextstate must be RESUME or DOWN (scontrol reboot), got "
                             f"{reboot_nextstate!r}")
        if max_concurrent_commands < 1:
            raise ValueError(f"max_concurrent_commands must be >= 1, got "
                             f"{max_concurrent_commands!r}")
        if not 1 <= weight_best < weight_worst < 2**32 - 1:
            raise ValueError(f"need 1 <= weight_best < weight_worst < 2**32-1, got "
                             f"{weight_best!r}, {weight_worst!r}")
        self.scontrol_path = scontrol_path
        self.sinfo_path = sinfo_path
        self.squeue_path = squeue_path
        self.scancel_path = scancel_path
        self.env = dict(env or {})
        self.checkpoint_signal = checkpoint_signal
        self.signal_target = signal_target
        self.grace_seconds = float(grace_seconds)
        self.command_timeout_seconds = float(command_timeout_seconds)
        self.reboot_nextstate = reboot_nextstate
        self.cancel_unrequeueable = cancel_unrequeueable
        self.json_output = json_output
        self.max_concurrent_commands = max_concurrent_commands
        self.weight_best = weight_best
        self.weight_worst = weight_worst
        self.clock = clock
        self._json = json_output
        self._signal_name = checkpoint_signal or None
        self._nextstate = reboot_nextstate.upper()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary())
        self._refs: dict[str, str] = {}
        self._notes: dict[str, str] = {}
        self._final: dict[str, ActionStatus] = {}
        self.commands: deque[str] = deque(maxlen=10_000)
        """The latest state-changing commands run, in order (for logs and tests)."""

    def __repr__(self) -> str:
        return (f"SlurmScheduler(scontrol_path={self.scontrol_path!r}, env={self.env!r}, "
                f"checkpoint_signal={self.checkpoint_signal!r}, grace_seconds="
                f"{self.grace_seconds!r}, reboot_nextstate={self.reboot_nextstate!r})")

    # --- commands --------------------------------------------------------------------

    async def _run(self, *argv: str, check: bool = True, mutating: bool = False) -> _Result:
        """Run one client command; raise for an unreachable controller always, else if ``check``."""
        env = {**os.environ, **self.env}
        async with self._loop_state().semaphore:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env=env,
                )
            except (FileNotFoundError, PermissionError) as exc:
                raise ConfigError(f"Slurm client {argv[0]!r} cannot be run ({exc}); set the "
                                  "adapter's *_path options or PATH") from exc
            try:
                out, err = await asyncio.wait_for(proc.communicate(),
                                                  self.command_timeout_seconds)
            except BaseException as exc:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                if not isinstance(exc, TimeoutError):
                    raise
                raise SchedulerUnavailable(
                    f"`{' '.join(argv)}` timed out after {self.command_timeout_seconds:g} s "
                    "(slurmctld not answering?)", retry_after_seconds=5.0) from exc
        result = _Result(tuple(argv), proc.returncode or 0, out.decode(errors="replace"),
                         err.decode(errors="replace").strip())
        if mutating:
            self.commands.append(result.command)
        logger.debug("slurm: %s -> %s", result.command, result.returncode)
        if result.returncode != 0:
            lowered = (result.stderr + result.stdout).lower()
            if any(marker in lowered for marker in _UNAVAILABLE_MARKERS):
                raise SchedulerUnavailable(
                    f"`{result.command}` failed: {result.stderr or result.stdout}",
                    retry_after_seconds=5.0)
            if check:
                raise self._error(result)
        return result

    def _loop_state(self) -> _LoopState:
        """The semaphore and key locks of the running event loop.

        asyncio primitives are bound to one loop; the adapter may be driven from
        several, one after another (``asyncio.run`` per call in scripts and tests).
        """
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            state = self._loops[loop] = _LoopState(
                semaphore=asyncio.Semaphore(self.max_concurrent_commands))
        return state

    @staticmethod
    def _error(result: _Result) -> GpuHealthError:
        text = result.stderr or result.stdout.strip()
        if re.search(r"node \S+ not found|invalid node name", text, re.IGNORECASE):
            return NodeNotFound(f"`{result.command}`: {text}")
        return PermanentError(f"`{result.command}` failed (exit {result.returncode}): {text}")

    async def _fresh(self, *argv: str) -> _Result:
        """Run a read-only listing, sharing it with concurrent callers (single flight).

        A caller joins a run of the same command that started after it asked, or waits
        for the one in flight and shares the next: answers are never older than the
        request, and a burst of N submits costs a few ``sinfo --json`` runs, not N.
        """
        state = self._loop_state()
        key = " ".join(argv)
        asked = time.monotonic()
        while True:
            current = state.inflight.get(key)
            if current is None:
                task: asyncio.Future[_Result] = asyncio.ensure_future(self._run(*argv))
                state.inflight[key] = (time.monotonic(), task)

                def forget(done: asyncio.Future[_Result], key: str = key) -> None:
                    if state.inflight.get(key, (0.0, None))[1] is done:
                        del state.inflight[key]
                    if not done.cancelled():
                        done.exception()  # retrieved: joiners re-raise it themselves

                task.add_done_callback(forget)
                return await asyncio.shield(task)
            started, task = current
            if started >= asked:
                return await asyncio.shield(task)
            if task.done():
                # Finished before we asked, its ``forget`` callback not run yet: awaiting
                # a done future does not yield, so waiting on it here would spin forever.
                del state.inflight[key]
                continue
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def _use_json(self) -> bool:
        if self._json is None:
            result = await self._run(self.sinfo_path, "--json", check=False)
            if result.returncode == 0 and result.stdout.lstrip().startswith("{"):
                self._json = True
            else:
                logger.info("slurm: %s --json unavailable (%s); using text output",
                            self.sinfo_path, result.stderr[:200])
                self._json = False
        return self._json

    # --- reading ---------------------------------------------------------------------

    @staticmethod
    def _check_node_name(node: str) -> str:
        if not _NODE_NAME_RE.match(node):
            raise PermanentError(f"refusing node name {node!r}: one plain Slurm node name is "
                                 "expected (no hostlist expression, comma or space)")
        return node

    async def read_node(self, node: str) -> SlurmNode:
        """Read one node from Slurm.

        Raises:
            NodeNotFound: Slurm does not know ``node``.
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        self._check_node_name(node)
        if await self._use_json():
            result = await self._fresh(self.sinfo_path, "--json")
            nodes = parse_sinfo_json(result.stdout)
            if node not in nodes:
                raise NodeNotFound(f"Slurm does not know node {node!r} (sinfo --json)")
            return nodes[node]
        result = await self._run(self.scontrol_path, "show", "node", "-o", node)
        return parse_scontrol_node(result.stdout)

    async def jobs_on(self, node: str,
                      states: frozenset[str] = ACTIVE_JOB_STATES) -> list[SlurmJob]:
        """Jobs on ``node`` in ``states`` (default: running, suspended, completing).

        Finished jobs are listed while slurmctld keeps them (``MinJobAge``).

        Raises:
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        self._check_node_name(node)
        if await self._use_json():
            result = await self._fresh(self.squeue_path, "--json")
            return [job for job in parse_squeue_json(result.stdout)
                    if node in job.nodes and job.state in states]
        result = await self._run(self.squeue_path, "-h", "-w", node, "-t",
                                 ",".join(sorted(states)), "-O", SQUEUE_TEXT_FORMAT)
        jobs = [j for j in parse_squeue_text(result.stdout, node) if j.state in states]
        out: list[SlurmJob] = []
        for job in jobs:
            shown = await self._run(self.scontrol_path, "show", "job", "-o", job.job_id,
                                    check=False)
            comment = admin_comment_of(shown.stdout) if shown.returncode == 0 else ""
            out.append(replace(job, admin_comment=comment))
        return out

    async def work_on(self, node: NodeName, entity: EntityId | None = None) -> list[WorkRef]:
        """The jobs running on ``node`` now (:class:`~core.protocols.WorkLocator`).

        Node-level: a fault on one GPU names every job on its node (Slurm's GRES index of a
        job is not read here).

        Raises:
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        del entity
        return [WorkRef(kind="slurm_job", id=j.job_id, owner=j.user, group=j.partition)
                for j in await self.jobs_on(node, frozenset({"RUNNING", "SUSPENDED"}))]

    # --- PriorityScheduler (remediation.priority) ---
    @staticmethod
    def _item(job: SlurmJob, node: str) -> WorkItem:
        return WorkItem(kind="slurm_job", id=job.job_id, node=node, gpus=job.gpus,
                        started_at=job.started_at, priority=job.priority,
                        priority_class=job.qos, owner=job.user,
                        state="pending" if job.state == "PENDING" else "running")

    async def work_detail(self, node: NodeName,
                          entity: EntityId | None = None) -> list[WorkItem]:
        """The jobs running on ``node`` with priority, QOS, GPUs and start time.

        Node-level, as :meth:`work_on`; a job's GPUs are its whole allocation (a fault
        on one node of a multi-node job interrupts all of it).

        Raises:
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        del entity
        return [self._item(j, node)
                for j in await self.jobs_on(node, frozenset({"RUNNING", "SUSPENDED"}))]

    async def _all_jobs(self) -> list[SlurmJob]:
        if await self._use_json():
            return parse_squeue_json((await self._fresh(self.squeue_path, "--json")).stdout)
        result = await self._run(self.squeue_path, "-h", "-t", "RUNNING,PENDING", "-O",
                                 "NodeList:200|," + SQUEUE_TEXT_FORMAT)
        out: list[SlurmJob] = []
        for line in result.stdout.splitlines():
            hosts, _, rest = line.partition("|")
            names = expand_hostlist(hosts.strip()) if hosts.strip() and \
                not hosts.strip().startswith("(") else []
            fields = rest.split("|")
            for job in parse_squeue_text(rest, "", source="squeue -O"):
                per_node = len(fields) > 10 and not gpus_of_tres(fields[10].strip())
                gpus = job.gpus * max(1, len(names)) if per_node else job.gpus
                out.append(replace(job, nodes=tuple(names), gpus=gpus))
        return out

    async def running_work(self) -> list[WorkItem]:
        """Every running job, once per node it holds (preemption candidates).

        Raises:
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        return [self._item(job, node) for job in await self._all_jobs()
                if job.state == "RUNNING" for node in job.nodes]

    async def pending_of(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        """Of ``items``, the jobs pending now (a requeued job keeps its id).

        Raises:
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        wanted = {i.id for i in items if i.kind == "slurm_job"}
        if not wanted:
            return []
        return [self._item(job, "") for job in await self._all_jobs()
                if job.job_id in wanted and job.state == "PENDING"]

    async def preempt(self, item: WorkItem, *, reason: str) -> str:
        """Requeue the running job ``item`` (``scontrol requeue``) to free its GPUs.

        Its GPUs go to the critical job's recovery (the reason is in gpuhealth's audit log).

        Raises:
            PermanentError: Slurm refused (the job cannot be requeued, or is gone).
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        if item.kind != "slurm_job":
            raise PermanentError(f"slurm: cannot preempt {item.kind} {item.id}")
        result = await self._run(self.scontrol_path, "requeue", item.id, check=False,
                                 mutating=True)
        if result.returncode != 0:
            raise self._error(result)
        return f"requeued job {item.id} (priority {item.priority}) to make room: {reason}"

    async def node_state(self, node: NodeName, *, workload: bool = True) -> NodeState:
        """Return the node as Slurm shows it now (:class:`~core.records.NodeState`).

        ``schedulable``: not taken out of service by anybody: no DRAIN/FAIL flag, and not
        DOWN/FUTURE with a person's reason (Slurm's own DOWN, :data:`SLURM_DOWN_REASONS`,
        counts as schedulable here, so that gpuhealth still drains such a node); ``owned``:
        taken out with a reason starting ``gpuhealth:``; ``opted_out``: feature
        :data:`OPT_OUT_FEATURE`; ``running``: jobs running, suspended or completing on
        it (0 without ``squeue`` when ``workload=False``); ``boot_id``: ``BootTime`` as
        epoch seconds (``""`` if unknown); ``state``: ``IDLE+DRAIN``-style words. A node
        Slurm does not know gives ``exists=False``.

        Raises:
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        try:
            found = await self.read_node(node)
        except NodeNotFound:
            return NodeState(node=node, exists=False, schedulable=False, state="")
        jobs = await self.jobs_on(node) if workload else []
        # Out of service *by someone*: a DRAIN/FAIL flag, or DOWN with a person's reason.
        # Slurm's own DOWN ("Not responding", no reason) is not a decision anybody made:
        # gpuhealth still drains such a node so it does not return to service by itself.
        by_slurm = found.state in UNSCHEDULABLE_STATES and (
            not found.reason or found.reason.startswith(SLURM_DOWN_REASONS))
        taken_out = not found.schedulable and not by_slurm
        return NodeState(
            node=node,
            exists=True,
            schedulable=not taken_out,
            reason=found.reason,
            owned=taken_out and found.reason.startswith(OWNER_PREFIX),
            opted_out=found.opted_out,
            running=len(jobs),
            boot_id=str(found.boot_time) if found.boot_time else "",
            state=found.state_words,
        )

    # --- reliability -------------------------------------------------------------------

    async def set_reliability(self, node: NodeName, score: float) -> None:
        """Set the node's ``Weight`` from ``score`` in [0, 1] (:func:`reliability_weight`).

        Idempotent: nothing is run when the weight is already right. A weight set with
        ``scontrol`` lasts until slurmctld restarts without state (``-R`` keeps it) or
        ``scontrol reconfig`` (slurm.conf wins then), so gpuhealth publishes it again
        periodically.

        Raises:
            ValueError: ``score`` outside [0, 1].
            NodeNotFound: Slurm does not know ``node``.
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        weight = reliability_weight(score, best=self.weight_best, worst=self.weight_worst)
        found = await self.read_node(node)
        if found.weight == weight:
            return
        await self._run(self.scontrol_path, "update", f"NodeName={node}", f"Weight={weight}",
                        mutating=True)

    # --- submit / status ---------------------------------------------------------------

    async def submit(self, request: ActionRequest) -> str:
        """Start the step (see the module docstring); return a ref for :meth:`status`.

        Idempotent on ``request.idempotency_key`` within this instance (the same ref
        comes back, nothing runs), and in effect across instances (decisions are taken
        from Slurm's state and gpuhealth's marks in it). A ``dry_run`` request checks
        that the node exists and changes nothing.

        Raises:
            PermanentError: ``reset_gpu`` (not a Slurm operation), a reason that does not
                start with ``gpuhealth:``, a bad node name, or a command Slurm refused.
            NodeNotFound: Slurm does not know the node.
            SchedulerUnavailable: slurmctld cannot be reached (retry later).
        """
        locks = self._loop_state().key_locks
        lock = locks.setdefault(request.idempotency_key, asyncio.Lock())
        async with lock:
            known = self._refs.get(request.idempotency_key)
            if known is not None:
                return known
            ref = await self._submit(request)
            self._refs[request.idempotency_key] = ref
            return ref

    async def _submit(self, request: ActionRequest) -> str:
        step = request.step
        node = self._check_node_name(request.node)
        if step == RemediationStep.RESET_GPU:
            raise PermanentError(
                "reset_gpu is not a Slurm operation: the GPU reset runs on the node itself "
                "(nvidia-smi -r through the node agent); the Slurm adapter only drains the node")
        writes_reason = step in (RemediationStep.CORDON, RemediationStep.DRAIN,
                                 RemediationStep.MIGRATE, RemediationStep.REBOOT,
                                 RemediationStep.HAND_OFF)
        if writes_reason and not request.reason.startswith(OWNER_PREFIX):
            raise PermanentError(f"reason {request.reason!r} must start with {OWNER_PREFIX!r} "
                                 "(ownership: gpuhealth only undoes what it marked)")
        ref = _Ref(step=step, node=node, key=key_hash(request.idempotency_key))
        if request.dry_run:
            found = await self.read_node(node)
            ref.extras["dry"] = "1"
            text = str(ref)
            self._final[text] = ActionStatus(
                ref=text, phase=ActionPhase.SUCCEEDED,
                message=f"dry run: would {step.value} {node} (now {found.state_words})")
            return text
        if step == RemediationStep.NOTIFY:
            text = str(ref)
            self._final[text] = ActionStatus(
                ref=text, phase=ActionPhase.SUCCEEDED,
                message="nothing to do on Slurm: the alert carries the notification")
            return text
        if step == RemediationStep.CORDON:
            found = self._still_out(request, await self.read_node(node))
            self._notes[str(ref)] = await self._cordon(found, request.reason)
        elif step in (RemediationStep.DRAIN, RemediationStep.MIGRATE):
            mode, note = self._drain_mode(request)
            ref.extras["mode"] = mode
            found = self._still_out(request, await self.read_node(node))
            cordon = await self._cordon(found, request.reason)
            if mode == "evict":
                await self._evict(node, ref.key)
            self._notes[str(ref)] = "; ".join(x for x in (cordon, note) if x)
        elif step == RemediationStep.REBOOT:
            await self._submit_reboot(request, ref)
        elif step == RemediationStep.RESUME:
            await self._submit_resume(ref)
        elif step == RemediationStep.HAND_OFF:
            await self._submit_hand_off(request, ref)
        elif step == RemediationStep.RESTART:
            await self._submit_restart(request, ref)
        else:  # pragma: no cover - every RemediationStep is handled above
            raise PermanentError(f"step {step.value!r} is not supported by the Slurm adapter")
        return str(ref)

    async def status(self, ref: str) -> ActionStatus:
        """Report how far the step of ``ref`` got, from what Slurm shows now.

        Works for a ref from any instance. Terminal answers (succeeded, failed,
        cancelled) are remembered and repeated. For an evicting drain this also
        requeues the jobs whose grace period ended.

        Raises:
            PermanentError: ``ref`` is not a Slurm adapter ref.
            NodeNotFound: The node disappeared from Slurm.
            SchedulerUnavailable: slurmctld cannot be reached.
        """
        final = self._final.get(ref)
        if final is not None:
            return final
        parsed = _Ref.parse(ref)
        if parsed.extras.get("dry") == "1" or parsed.step == RemediationStep.NOTIFY:
            phase, message = ActionPhase.SUCCEEDED, "dry run" if parsed.extras.get("dry") \
                else "nothing to do on Slurm"
        elif parsed.step in (RemediationStep.CORDON, RemediationStep.HAND_OFF):
            phase, message = await self._status_drained(parsed)
        elif parsed.step in (RemediationStep.DRAIN, RemediationStep.MIGRATE):
            phase, message = await self._status_drain(parsed)
        elif parsed.step == RemediationStep.REBOOT:
            phase, message = await self._status_reboot(parsed)
        elif parsed.step == RemediationStep.RESUME:
            phase, message = await self._status_resume(parsed)
        elif parsed.step == RemediationStep.RESTART:
            phase, message = self._status_restart(parsed)
        else:
            raise PermanentError(f"step {parsed.step.value!r} has no Slurm status ({ref!r})")
        note = self._notes.get(ref)
        if note and note not in message:
            message = f"{message} ({note})"
        result = ActionStatus(ref=ref, phase=phase, message=message)
        if phase in (ActionPhase.SUCCEEDED, ActionPhase.FAILED, ActionPhase.CANCELLED):
            self._final[ref] = result
        return result

    # --- cordon / hand-off ------------------------------------------------------------

    @staticmethod
    def _still_out(request: ActionRequest, node: SlurmNode) -> SlurmNode:
        """Return ``node``; raise if this incident drained it and someone resumed it since.

        Raises:
            ReturnedToService: ``taken_out`` in ``request.attrs`` and no DRAIN flag (nor a
                pending reboot) on the node: draining it again would undo a person's
                ``scontrol update State=RESUME``.
        """
        if request.attrs.get("taken_out") == "yes" and not node.drained and not node.rebooting:
            raise ReturnedToService(f"{node.name} is {node.state_words} (reason "
                                    f"{node.reason!r}): no longer drained")
        return node

    async def _cordon(self, node: SlurmNode, reason: str) -> str:
        """DRAIN ``node`` with ``reason`` unless it is already drained; say what happened."""
        if node.drained:
            if node.reason.startswith(OWNER_PREFIX):
                return f"already drained by gpuhealth ({node.reason!r})"
            return (f"already drained by someone else ({node.reason!r}): their reason is "
                    "kept and gpuhealth does not claim the node")
        await self._run(self.scontrol_path, "update", f"NodeName={node.name}", "State=DRAIN",
                        f"Reason={reason}", mutating=True)
        return ""

    async def _status_drained(self, ref: _Ref) -> tuple[ActionPhase, str]:
        node = await self.read_node(ref.node)
        if node.drained:
            return ActionPhase.SUCCEEDED, f"{node.name} is {node.state_words}: {node.reason!r}"
        return ActionPhase.CANCELLED, (f"{node.name} is no longer drained ({node.state_words}): "
                                       "someone returned it to service")

    async def _submit_hand_off(self, request: ActionRequest, ref: _Ref) -> None:
        text = request.reason[len(OWNER_PREFIX):].strip()
        reason = HAND_OFF_PREFIX + text if not text.startswith("hand-off") else request.reason
        node = self._still_out(request, await self.read_node(ref.node))
        if node.drained and not node.reason.startswith(OWNER_PREFIX):
            self._notes[str(ref)] = (f"drained by someone else ({node.reason!r}); their "
                                     "reason is kept")
            return
        if node.drained and node.reason == reason:
            return
        await self._run(self.scontrol_path, "update", f"NodeName={node.name}", "State=DRAIN",
                        f"Reason={reason}", mutating=True)

    # --- drain -----------------------------------------------------------------------

    @staticmethod
    def _drain_mode(request: ActionRequest) -> tuple[str, str]:
        attrs = request.attrs
        mode = attrs.get("mode") or ("evict" if attrs.get("when", "now") == "now"
                                     else "allow_completion")
        if mode not in ("evict", "allow_completion"):
            raise PermanentError(f"drain mode {mode!r}: expected 'evict' or 'allow_completion'")
        scope = attrs.get("scope", "node")
        note = ""
        if scope == "gpu":
            note = "Slurm cannot drain one GPU of a running node: the whole node is drained"
        elif scope == "multi_node_jobs":
            note = ("Slurm cannot keep a node out of multi-node jobs only: the node is "
                    "drained for all jobs")
        return mode, note

    async def _evict(self, node: str, key: str) -> tuple[list[SlurmJob], str]:
        """Signal, then requeue after the grace period, the jobs on ``node``.

        Returns the jobs still on the node afterwards and a summary.
        """
        jobs = sorted(await self.jobs_on(node), key=lambda j: (-j.priority, j.job_id))
        now = self.clock()
        said: list[str] = []
        waiting: list[str] = []
        acted = False
        if self._signal_name:
            # a batch script that does not trap the signal dies of it (FAILED, exit 0:10
            # for USR1): requeue it all the same, as Slurm's own preemption does
            for job in await self.jobs_on(node, frozenset({"FAILED"})):
                if job.requeue and job.batch and job_marks(job.admin_comment, key, "signal",
                                                           node):
                    result = await self._run(self.scontrol_path, "requeue", job.job_id,
                                             check=False, mutating=True)
                    if result.returncode == 0:
                        said.append(f"requeued job {job.job_id} (it ended after the signal)")
        for job in jobs:
            if job.state == "COMPLETING":
                continue
            if self._signal_name and job.state == "RUNNING":
                marks = job_marks(job.admin_comment, key, "signal", node)
                if marks:
                    signalled_at = max(marks)
                else:
                    # mark first: a job that dies of the signal at once can still be marked
                    # (and so requeued), and no instance ever signals it twice
                    if await self._mark(job, key, "signal", node, now):
                        await self._signal(job)
                        said.append(f"signalled {self._signal_name} to job {job.job_id}")
                    signalled_at = now
                if now < signalled_at + self.grace_seconds:
                    waiting.append(f"{job.job_id} (requeue in "
                                   f"{signalled_at + self.grace_seconds - now:.1f} s)")
                    continue
            acted = True
            if job.requeue and job.batch:
                result = await self._run(self.scontrol_path, "requeue", job.job_id, check=False,
                                         mutating=True)
                if result.returncode == 0 or "pending" in result.stderr.lower():
                    said.append(f"requeued job {job.job_id}")
                    continue
                why = result.stderr or f"exit {result.returncode}"
            else:
                why = "it cannot be requeued (--no-requeue or not a batch job)"
            if self.cancel_unrequeueable:
                await self._run(self.scancel_path, job.job_id, mutating=True)
                said.append(f"cancelled job {job.job_id} ({why})")
            else:
                said.append(f"left job {job.job_id} running: {why}")
        if acted:
            jobs = await self.jobs_on(node)
        if waiting:
            said.append("waiting for the grace period of jobs " + ", ".join(waiting))
        return jobs, "; ".join(said)

    async def _signal(self, job: SlurmJob) -> None:
        target = _SIGNAL_TARGETS[self.signal_target]
        if self.signal_target == "batch" and not job.batch:
            target = ()  # an interactive job has no batch shell: signal its steps
        result = await self._run(self.scancel_path, f"--signal={self._signal_name}",
                                 *target, job.job_id, check=False, mutating=True)
        if result.returncode != 0:
            logger.info("slurm: signalling job %s failed (it may have just ended): %s",
                        job.job_id, result.stderr)

    async def _mark(self, job: SlurmJob, key: str, what: str, node: str, at: float) -> bool:
        """Append gpuhealth's mark to the job's AdminComment; return whether it was written."""
        mark = f"gpuhealth:{key}:{what}@{node}:{at:.3f}"
        comment = f"{job.admin_comment}; {mark}" if job.admin_comment else mark
        result = await self._run(self.scontrol_path, "update", f"JobId={job.job_id}",
                                 f"AdminComment={comment}", check=False, mutating=True)
        if result.returncode != 0:
            logger.warning("slurm: cannot mark job %s (%s): %s", job.job_id, mark, result.stderr)
            return False
        return True

    async def _status_drain(self, ref: _Ref) -> tuple[ActionPhase, str]:
        node = await self.read_node(ref.node)
        if not node.drained:
            return ActionPhase.CANCELLED, (f"{node.name} is no longer drained "
                                           f"({node.state_words}): someone returned it to "
                                           "service")
        if ref.extras.get("mode") == "evict":
            jobs, said = await self._evict(ref.node, ref.key)
        else:
            jobs, said = await self.jobs_on(ref.node), ""
        if not jobs:
            done = f"no job runs on {node.name}; it is drained ({node.reason!r})"
            return ActionPhase.SUCCEEDED, f"{said}; {done}" if said else done
        ids = ", ".join(j.job_id for j in jobs)
        waiting = f"{len(jobs)} job(s) still on {node.name}: {ids}"
        if ref.extras.get("mode") != "evict":
            waiting += " (left to finish on their own)"
        return ActionPhase.RUNNING, f"{said}; {waiting}" if said else waiting

    # --- reboot ----------------------------------------------------------------------

    async def _submit_reboot(self, request: ActionRequest, ref: _Ref) -> None:
        node = self._still_out(request, await self.read_node(ref.node))
        marked = [m for m in _REBOOT_MARK_RE.finditer(node.comment) if m.group("key") == ref.key]
        if marked:
            baseline = marked[-1].group("boot")
            self._notes[str(ref)] = "reboot already requested for this key; not requested again"
        elif node.rebooting:
            baseline = str(node.boot_time or "")
            self._notes[str(ref)] = (f"a reboot was already pending ({node.state_words}); "
                                     "not requested again")
        else:
            baseline = str(node.boot_time or "")
            await self._run(self.scontrol_path, "reboot", "ASAP",
                            f"nextstate={self._nextstate}", f"reason={request.reason}",
                            node.name, mutating=True)
            if not node.comment or node.comment.startswith(OWNER_PREFIX):
                await self._run(self.scontrol_path, "update", f"NodeName={node.name}",
                                f"Comment=gpuhealth:{ref.key}:reboot:boot={baseline}",
                                check=False, mutating=True)
        ref.extras["boot"] = baseline

    async def _status_reboot(self, ref: _Ref) -> tuple[ActionPhase, str]:
        node = await self.read_node(ref.node)
        baseline = ref.extras.get("boot", "")
        boot = str(node.boot_time or "")
        if "reboot timed out" in node.reason.lower():
            return ActionPhase.FAILED, (f"Slurm reports the reboot of {node.name} timed out "
                                        f"({node.state_words}: {node.reason!r})")
        if node.rebooting:
            issued = "REBOOT_ISSUED" in node.flags
            return ActionPhase.RUNNING, (
                f"reboot {'issued, waiting for slurmd to register' if issued else 'requested, waiting for the node to become idle'}"  # noqa: E501
                f" ({node.state_words})")
        if boot and boot != baseline:
            if node.down and "reboot complete" not in node.reason.lower():
                return ActionPhase.FAILED, (f"{node.name} rebooted but Slurm set it DOWN: "
                                            f"{node.reason!r}")
            return ActionPhase.SUCCEEDED, (f"{node.name} rebooted (BootTime {boot}, was "
                                           f"{baseline or 'unknown'}); now {node.state_words}")
        if node.down:
            return ActionPhase.FAILED, (f"{node.name} went DOWN without rebooting "
                                        f"({node.reason!r})")
        return ActionPhase.CANCELLED, (f"no reboot pending on {node.name} and BootTime "
                                       f"unchanged: the reboot was cancelled "
                                       f"({node.state_words})")

    # --- resume ----------------------------------------------------------------------

    async def _submit_resume(self, ref: _Ref) -> None:
        node = await self.read_node(ref.node)
        text = str(ref)
        if node.schedulable:
            self._final[text] = ActionStatus(
                ref=text, phase=ActionPhase.SUCCEEDED,
                message=f"{node.name} is already in service ({node.state_words}); nothing to do")
            return
        if not node.reason.startswith(OWNER_PREFIX):
            self._final[text] = ActionStatus(ref=text, phase=ActionPhase.FAILED,
                                             message=self._not_owned(node))
            return
        result = await self._run(self.scontrol_path, "update", f"NodeName={node.name}",
                                 "State=RESUME", check=False, mutating=True)
        if result.returncode != 0:
            after = await self.read_node(ref.node)
            if "invalid node state" in result.stderr.lower() and not after.drained:
                # 22.05 answers so for a node whose slurmd never registered (UNKNOWN) but
                # clears DRAIN and the reason all the same.
                self._notes[text] = f"scontrol said {result.stderr!r} but DRAIN was cleared"
                return
            raise self._error(result)

    @staticmethod
    def _not_owned(node: SlurmNode) -> str:
        return (f"not resumed: {node.name} is out of service ({node.state_words}) with reason "
                f"{node.reason!r}, which gpuhealth did not set; a human's or another tool's "
                "drain is never undone")

    async def _status_resume(self, ref: _Ref) -> tuple[ActionPhase, str]:
        node = await self.read_node(ref.node)
        if node.schedulable:
            return ActionPhase.SUCCEEDED, f"{node.name} is in service ({node.state_words})"
        if not node.reason.startswith(OWNER_PREFIX):
            return ActionPhase.FAILED, self._not_owned(node)
        return ActionPhase.RUNNING, f"resume requested; {node.name} is {node.state_words}"

    # --- restart ---------------------------------------------------------------------

    async def _submit_restart(self, request: ActionRequest, ref: _Ref) -> None:
        wanted = request.attrs.get("job_id", "").strip()
        jobs = await self.jobs_on(ref.node)
        targets = [j for j in jobs if j.state in ("RUNNING", "SUSPENDED")
                   and (not wanted or j.job_id == wanted)]
        requeued: list[str] = []
        left: list[str] = []
        for job in targets:
            if job_marks(job.admin_comment, ref.key, "requeue", ref.node):
                requeued.append(job.job_id)  # a previous controller did it
                continue
            if not (job.requeue and job.batch):
                left.append(job.job_id)
                continue
            result = await self._run(self.scontrol_path, "requeue", job.job_id, check=False,
                                     mutating=True)
            if result.returncode == 0 or "pending" in result.stderr.lower():
                await self._mark(job, ref.key, "requeue", ref.node, self.clock())
                requeued.append(job.job_id)
            else:
                left.append(job.job_id)
        ref.extras["requeued"] = ",".join(requeued)
        ref.extras["left"] = ",".join(left)
        if wanted and not targets:
            self._notes[str(ref)] = f"job {wanted} is not running on {ref.node}"

    @staticmethod
    def _status_restart(ref: _Ref) -> tuple[ActionPhase, str]:
        requeued = ref.extras.get("requeued", "")
        left = ref.extras.get("left", "")
        if left:
            return ActionPhase.FAILED, (f"jobs {left} on {ref.node} cannot be requeued "
                                        f"(--no-requeue or interactive); requeued: "
                                        f"{requeued or 'none'}")
        if requeued:
            return ActionPhase.SUCCEEDED, f"requeued jobs {requeued} of {ref.node}"
        return ActionPhase.SUCCEEDED, f"no job to restart on {ref.node}"

