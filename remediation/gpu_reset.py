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
import re
import subprocess
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import httpx

from alerting.webhook import (
    DEFAULT_TOLERANCE_SECONDS,
    SignatureError,
    WebhookVerifier,
    _ssl_context,
    secret_key,
    sign,
)
from core.clock import Clock, system_clock
from core.errors import ConfigError, PermanentError
from core.ids import normalize_pci_bus_id
from core.records import ActionPhase, ActionRequest, ActionStatus, RemediationStep
from remediation.webhook import resolve_secret

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


class ResetOutcome(StrEnum):
    """How a reset request ended."""

    OK = "ok"
    BUSY = "busy"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetResult:
    """The answer of one reset request.

    Attributes:
        outcome: ``ok``, ``busy`` or ``failed``.
        gpu: The GPU as passed to ``nvidia-smi -i``.
        pids: Processes holding the GPU (``busy``).
        message: One line for people.
        stderr: The failing command's standard error, at most 2000 characters.
    """

    outcome: ResetOutcome
    gpu: str
    pids: tuple[int, ...] = ()
    message: str = ""
    stderr: str = ""

    def to_json(self) -> dict[str, Any]:
        """Return the result as the endpoint's JSON answer."""
        return {"outcome": self.outcome.value, "gpu": self.gpu, "pids": list(self.pids),
                "message": self.message, "stderr": self.stderr}


class GpuResetter:
    """Resets one GPU of this node with ``nvidia-smi`` once no process holds it.

    Args:
        nvidia_smi: The ``nvidia-smi`` command (looked up on ``PATH``).
        runner: Runs commands (injectable for tests).
        query_timeout_seconds: Timeout of the process query, seconds.
        reset_timeout_seconds: Timeout of ``nvidia-smi -r``, seconds (a reset takes
            seconds; a hung one is reported failed).
        remembered_keys: Idempotency keys of successful resets kept, so that a
            repeated request (the controller retrying after a lost answer) does not
            reset twice.
    """

    def __init__(
        self,
        *,
        nvidia_smi: str = "nvidia-smi",
        runner: CommandRunner = run_command,
        query_timeout_seconds: float = 30.0,
        reset_timeout_seconds: float = 120.0,
        remembered_keys: int = 1000,
    ) -> None:
        if query_timeout_seconds <= 0 or reset_timeout_seconds <= 0:
            raise ConfigError("GPU reset timeouts must be > 0")
        self.nvidia_smi = nvidia_smi
        self.runner = runner
        self.query_timeout_seconds = query_timeout_seconds
        self.reset_timeout_seconds = reset_timeout_seconds
        self.remembered_keys = remembered_keys
        self._running = threading.Lock()
        self._done: OrderedDict[str, ResetResult] = OrderedDict()
        self._done_lock = threading.Lock()

    def reset(self, gpu: str, *, idempotency_key: str = "") -> ResetResult:
        """Reset ``gpu`` unless a process holds it or another reset is running.

        Args:
            gpu: PCI bus id (``0000:b1:00.0``, any case, 4- or 8-digit domain) or GPU UUID.
            idempotency_key: The controller's key; a key that already reset returns
                that result again without resetting.

        Returns:
            ``ok``; ``busy`` with the PIDs (nothing was reset); or ``failed`` with stderr
            (the query failed, so the GPU's state is unknown, or the reset failed).

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
            result = self._reset(target)
        finally:
            self._running.release()
        if result.outcome is ResetOutcome.OK and idempotency_key:
            with self._done_lock:
                self._done[idempotency_key] = result
                while len(self._done) > self.remembered_keys:
                    self._done.popitem(last=False)
        return result

    def _reset(self, gpu: str) -> ResetResult:
        query = self.runner([self.nvidia_smi, "--query-compute-apps=pid",
                             "--format=csv,noheader", "-i", gpu], self.query_timeout_seconds)
        if query.returncode != 0:
            return ResetResult(outcome=ResetOutcome.FAILED, gpu=gpu,
                               message="could not list the processes on the GPU; not reset",
                               stderr=_tail(query.stderr or query.stdout))
        pids: list[int] = []
        for line in query.stdout.splitlines():
            word = line.strip()
            if word.isdigit():
                pids.append(int(word))
            elif word and not word.lower().startswith("no running"):
                return ResetResult(outcome=ResetOutcome.FAILED, gpu=gpu,
                                   message=f"unexpected process list line {word!r}; not reset",
                                   stderr=_tail(query.stderr))
        if pids:
            return ResetResult(outcome=ResetOutcome.BUSY, gpu=gpu, pids=tuple(sorted(set(pids))),
                               message=f"{len(set(pids))} process(es) hold the GPU")
        logger.warning("resetting GPU %s (nvidia-smi -r)", gpu)
        done = self.runner([self.nvidia_smi, "-r", "-i", gpu], self.reset_timeout_seconds)
        if done.returncode == 0:
            logger.warning("GPU %s reset", gpu)
            return ResetResult(outcome=ResetOutcome.OK, gpu=gpu,
                               message=done.stdout.strip()[:500] or "GPU reset")
        text = done.stderr or done.stdout
        if done.returncode is not None and _IN_USE.search(text):
            return ResetResult(outcome=ResetOutcome.BUSY, gpu=gpu,
                               message="nvidia-smi says the GPU is in use", stderr=_tail(text))
        return ResetResult(outcome=ResetOutcome.FAILED, gpu=gpu,
                           message=f"nvidia-smi -r failed (exit {done.returncode})",
                           stderr=_tail(text))


def _tail(text: str) -> str:
    text = text.strip()
    return text[-MAX_STDERR_CHARS:]


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
    ) -> None:
        self.resetter = resetter
        self.node = node
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
        if not isinstance(gpu, str):
            return 400, {"error": "gpu: required string"}
        if not isinstance(key, str):
            return 400, {"error": "idempotency_key: expected a string"}
        if node is not None and not isinstance(node, str):
            return 400, {"error": "node: expected a string"}
        if self.node is not None and node is not None and node != self.node:
            return 409, {"error": f"node: this is {self.node!r}, the request is for {node!r}"}
        try:
            result = self.resetter.reset(gpu, idempotency_key=key)
        except ValueError as exc:
            return 400, {"error": str(exc)}
        logger.info("gpu-reset %s for %r: %s %s", result.gpu, key, result.outcome.value,
                    result.message)
        return _STATUS_OF[result.outcome], result.to_json()


# --------------------------------------------------------------------------- controller


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
        if "{node}" not in url_template or not url_template.startswith(("http://", "https://")):
            raise ConfigError(f"url_template must be an http(s) URL with {{node}}, "
                              f"got {url_template!r}")
        if min(timeout_seconds, retry_interval_seconds, deadline_seconds) <= 0:
            raise ConfigError("node agent timeouts, retry interval and deadline must be > 0")
        secret = resolve_secret(secret=secret, secret_env=secret_env, secret_file=secret_file,
                                what="node_agent")
        try:
            self._key = secret_key(secret)
        except ValueError as exc:
            raise ConfigError(f"node agent secret: {exc}") from None
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
                    f"GPU {state.gpu} reset: {answer.get('message', '')}", False)
        if status == 409 and outcome == ResetOutcome.BUSY.value:
            pids = ", ".join(str(p) for p in answer.get("pids") or [])
            why = f"pids {pids}" if pids else str(answer.get("message", "busy"))
            return ActionPhase.RUNNING, f"GPU {state.gpu} busy ({why})", True
        if status == 422 and outcome == ResetOutcome.FAILED.value:
            return (ActionPhase.FAILED, f"GPU {state.gpu} reset failed: "
                    f"{answer.get('message')}; stderr: {answer.get('stderr', '')}", False)
        if status == 429 or status >= 500:
            return ActionPhase.RUNNING, f"node agent answered {status}", True
        detail = answer.get("error") or response.text[:200]
        return ActionPhase.FAILED, f"node agent refused the request ({status}): {detail}", False
