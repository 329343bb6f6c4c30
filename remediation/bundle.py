"""A diagnostic bundle, collected before a destructive step (reset, reboot, hand-off).

What a vendor asks for when a GPU is sent back, gathered while the evidence is still
there (a reboot clears the driver's state and the kernel ring buffer):

* ``nvidia-bug-report.log.gz`` from ``nvidia-bug-report.sh`` where it is installed;
* ``nvidia-smi-q.txt``: ``nvidia-smi -q``;
* ``kernel.log``: the kernel log of the last ``kernel_window_seconds``
  (``journalctl -k``, else ``dmesg``);
* ``evidence.txt``: gpuhealth's own evidence (the finding, the incident, the raw lines);
* ``manifest.json``: what was asked, each item's command, exit status, time and size.

The bundle is one ``.tar.gz`` under ``directory``, bounded: every item is cut to what
is left of ``max_bytes`` (uncompressed), and at most ``keep`` bundles are kept (oldest
removed first). The whole collection has one deadline (``timeout_seconds``): each
command gets what is left of it, so the step waits no longer than configured.

:class:`BundleCollector` collects on this machine (the GPU reset agent calls it before
``nvidia-smi -r``; the node agent's endpoint serves ``{"op": "bundle"}``).
:class:`LocalBundler` and :class:`NodeAgentBundler` are what the engine uses before a
reboot or a hand-off: started, then polled, never waited on past their timeout.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from alerting.webhook import _ssl_context, sign
from core.clock import Clock, system_clock
from core.errors import ConfigError
from remediation.validation import CommandRunner, run_command, tail
from remediation.webhook import node_agent_key

logger = logging.getLogger(__name__)

_SLUG = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True, slots=True, kw_only=True)
class BundleItem:
    """One file of a bundle.

    Attributes:
        name: The file name in the archive.
        command: The command that produced it (empty for gpuhealth's own files).
        returncode: Its exit status (``None``: timed out, not installed or not run).
        seconds: How long it took.
        size_bytes: Bytes stored (after any cut).
        truncated: Whether it was cut to fit ``max_bytes``.
        note: Why it is missing or cut.
    """

    name: str
    command: str = ""
    returncode: int | None = 0
    seconds: float = 0.0
    size_bytes: int = 0
    truncated: bool = False
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """Return the item as JSON."""
        return {"name": self.name, "command": self.command, "returncode": self.returncode,
                "seconds": round(self.seconds, 3), "size_bytes": self.size_bytes,
                "truncated": self.truncated, "note": self.note}


@dataclass(frozen=True, slots=True, kw_only=True)
class BundleResult:
    """A collected bundle.

    Attributes:
        path: The archive (``""`` when none could be written).
        items: What it holds.
        seconds: How long the collection took.
        size_bytes: Size of the archive.
        message: One line for people (and the audit log).
    """

    path: str
    items: tuple[BundleItem, ...] = ()
    seconds: float = 0.0
    size_bytes: int = 0
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        """Return the result as JSON (the node agent's answer)."""
        return {"path": self.path, "items": [i.to_json() for i in self.items],
                "seconds": round(self.seconds, 3), "size_bytes": self.size_bytes,
                "message": self.message}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BundleResult:
        """Read a result written by :meth:`to_json` (item details are not kept)."""
        return cls(path=str(data.get("path", "")), seconds=float(data.get("seconds", 0.0)),
                   size_bytes=int(data.get("size_bytes", 0)),
                   message=str(data.get("message", "")))


class BundleCollector:
    """Collects a bounded diagnostic bundle on this machine.

    Args:
        directory: Where bundles are written (created if missing).
        node: This node's name (in the file name and the manifest).
        max_bytes: Most bytes of content per bundle (uncompressed), > 0.
        timeout_seconds: Deadline of the whole collection, seconds, > 0.
        keep: Bundles kept in ``directory`` (oldest removed), >= 1.
        kernel_window_seconds: How much kernel log to take, seconds.
        nvidia_bug_report: The ``nvidia-bug-report.sh`` command ("": never run).
        nvidia_smi: The ``nvidia-smi`` command ("": never run).
        journalctl: The ``journalctl`` command (``dmesg`` when it is missing).
        runner: Runs commands.
        which: Finds a command on ``PATH``.
        clock: Returns now, epoch seconds.

    Raises:
        ConfigError: A bound out of range.
    """

    def __init__(
        self,
        *,
        directory: str,
        node: str = "localhost",
        max_bytes: int = 64 * 1024 * 1024,
        timeout_seconds: float = 180.0,
        keep: int = 20,
        kernel_window_seconds: float = 3600.0,
        nvidia_bug_report: str = "nvidia-bug-report.sh",
        nvidia_smi: str = "nvidia-smi",
        journalctl: str = "journalctl",
        runner: CommandRunner = run_command,
        which: Callable[[str], str | None] = shutil.which,
        clock: Clock = system_clock,
    ) -> None:
        if max_bytes <= 0 or timeout_seconds <= 0 or keep < 1 or kernel_window_seconds <= 0:
            raise ConfigError("bundle: max_bytes, timeout_seconds and kernel_window_seconds "
                              "must be > 0 and keep >= 1")
        self.directory = directory
        self.node = node
        self.max_bytes = max_bytes
        self.timeout_seconds = timeout_seconds
        self.keep = keep
        self.kernel_window_seconds = kernel_window_seconds
        self.nvidia_bug_report = nvidia_bug_report
        self.nvidia_smi = nvidia_smi
        self.journalctl = journalctl
        self.runner = runner
        self.which = which
        self.clock = clock
        self._lock = threading.Lock()

    def __call__(self, *, reason: str, gpus: Sequence[str], key: str) -> str:
        """Collect a bundle (the GPU reset's hook); return its path or ``""``."""
        return self.collect(reason=reason, gpus=gpus, key=key).path

    def collect(self, *, reason: str, gpus: Sequence[str] = (), key: str = "",
                evidence: Sequence[str] = ()) -> BundleResult:
        """Collect the bundle within ``timeout_seconds`` and ``max_bytes``; never raises.

        Args:
            reason: Why (the step and the finding).
            gpus: The GPUs concerned (PCI bus ids).
            key: The action's idempotency key (in the file name).
            evidence: gpuhealth's evidence lines (finding, raw log lines).
        """
        started = time.monotonic()
        deadline = started + self.timeout_seconds
        created = self.clock()
        with self._lock, tempfile.TemporaryDirectory(prefix="gpuhealth-bundle-") as work:
            files: list[tuple[BundleItem, bytes]] = []
            text = "\n".join([f"reason: {reason}", f"node: {self.node}",
                              f"gpus: {', '.join(gpus) or 'all'}", f"key: {key}", "",
                              *evidence]) + "\n"
            files.append((BundleItem(name="evidence.txt"), text.encode()))
            if self.nvidia_smi:
                files.append(self._command("nvidia-smi-q.txt", [self.nvidia_smi, "-q"],
                                           deadline))
            files.append(self._kernel_log(deadline))
            if self.nvidia_bug_report:
                files.append(self._bug_report(work, deadline))
            result = self._write(files, reason=reason, gpus=gpus, key=key, created=created,
                                 started=started)
        log = logger.info if result.path else logger.warning
        log("diagnostic bundle for %s: %s", key or reason, result.message)
        return result

    # -- items ---------------------------------------------------------------------

    def _left(self, deadline: float) -> float:
        return deadline - time.monotonic()

    def _command(self, name: str, argv: Sequence[str], deadline: float) -> tuple[BundleItem,
                                                                               bytes]:
        command = " ".join(argv)
        if self.which(argv[0]) is None:
            return BundleItem(name=name, command=command, returncode=None,
                              note=f"{argv[0]} is not installed"), b""
        left = self._left(deadline)
        if left <= 0.5:
            return BundleItem(name=name, command=command, returncode=None,
                              note="not run: the bundle's deadline passed"), b""
        at = time.monotonic()
        done = self.runner(argv, left)
        data = done.stdout.encode(errors="replace")
        if done.returncode != 0 and done.stderr:
            data += b"\n--- stderr ---\n" + done.stderr.encode(errors="replace")
        return BundleItem(name=name, command=command, returncode=done.returncode,
                          seconds=time.monotonic() - at,
                          note="" if done.returncode == 0 else tail(done.stderr, 300)), data

    def _kernel_log(self, deadline: float) -> tuple[BundleItem, bytes]:
        since = int(self.clock() - self.kernel_window_seconds)
        if self.journalctl and self.which(self.journalctl) is not None:
            return self._command("kernel.log", [self.journalctl, "-k", "--no-pager", "-o",
                                                "short-iso", "--since", f"@{since}"], deadline)
        return self._command("kernel.log", ["dmesg", "--time-format", "iso"], deadline)

    def _bug_report(self, work: str, deadline: float) -> tuple[BundleItem, bytes]:
        out = os.path.join(work, "nvidia-bug-report.log")
        item, _ = self._command("nvidia-bug-report.log.gz",
                                [self.nvidia_bug_report, "--output-file", out], deadline)
        data = b""
        for candidate in (out + ".gz", out):
            try:
                with open(candidate, "rb") as fh:
                    data = fh.read(self.max_bytes + 1)
                break
            except OSError:
                continue
        if not data and item.returncode == 0:
            item = BundleItem(name=item.name, command=item.command, returncode=item.returncode,
                              seconds=item.seconds, note="ran, but wrote no report")
        return item, data

    # -- the archive ---------------------------------------------------------------

    def _write(self, files: list[tuple[BundleItem, bytes]], *, reason: str,
               gpus: Sequence[str], key: str, created: float, started: float) -> BundleResult:
        budget = self.max_bytes
        kept: list[tuple[BundleItem, bytes]] = []
        for item, data in files:
            cut = len(data) > budget
            if cut:
                data = data[-budget:] if item.name.endswith((".log", ".txt")) else b""
            budget -= len(data)
            note = item.note
            if cut:
                note = (f"{note}; " if note else "") + f"cut to the bundle's {self.max_bytes} bytes"
            kept.append((BundleItem(
                name=item.name, command=item.command, returncode=item.returncode,
                seconds=item.seconds, size_bytes=len(data), truncated=cut, note=note), data))
        items = tuple(i for i, _ in kept)
        manifest = {"node": self.node, "reason": reason, "key": key, "gpus": list(gpus),
                    "created_at": created, "max_bytes": self.max_bytes,
                    "timeout_seconds": self.timeout_seconds,
                    "items": [i.to_json() for i in items]}
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(created))
        slug = _SLUG.sub("_", key)[-80:] or "bundle"
        name = f"{_SLUG.sub('_', self.node)}-{stamp}-{slug}.tar.gz"
        try:
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, name)
            partial = path + ".partial"
            with tarfile.open(partial, "w:gz") as tar:
                for member, data in [(BundleItem(name="manifest.json"),
                                      json.dumps(manifest, indent=2, sort_keys=True).encode()),
                                     *kept]:
                    if member.name != "manifest.json" and not data:
                        continue
                    info = tarfile.TarInfo(member.name)
                    info.size, info.mtime, info.mode = len(data), int(created), 0o600
                    tar.addfile(info, io.BytesIO(data))
            os.replace(partial, path)
            size = os.path.getsize(path)
        except OSError as exc:
            return BundleResult(path="", items=items, seconds=time.monotonic() - started,
                                message=f"could not write the bundle: {exc}")
        self._prune()
        missing = [i.name for i in items if i.size_bytes == 0]
        message = (f"{path} ({size} bytes, {len(items) - len(missing)} of {len(items)} items"
                   + (f"; missing {', '.join(missing)}" if missing else "") + ")")
        return BundleResult(path=path, items=items, seconds=time.monotonic() - started,
                            size_bytes=size, message=message)

    def _prune(self) -> None:
        try:
            bundles = sorted((e for e in os.scandir(self.directory)
                              if e.name.endswith(".tar.gz") and e.is_file()),
                             key=lambda e: (e.stat().st_mtime, e.name))
        except OSError:
            return
        for entry in bundles[:-self.keep]:
            try:
                os.remove(entry.path)
            except OSError:
                logger.warning("cannot remove the old bundle %s", entry.path)


# --------------------------------------------------------------------------- the engine's side


@dataclass(frozen=True, slots=True, kw_only=True)
class BundleRequest:
    """What the engine asks for before a destructive step."""

    node: str
    key: str
    reason: str
    gpus: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()


class Bundler(Protocol):
    """Collects a bundle in the background: :meth:`start`, then :meth:`result`."""

    name: str
    timeout_seconds: float

    def start(self, request: BundleRequest) -> None:
        """Start collecting (returns at once; a key started before is not started again)."""
        ...

    def result(self, key: str) -> BundleResult | None:
        """The bundle, once collected; ``None`` while it is being collected."""
        ...


@dataclass(slots=True)
class _Job:
    thread: threading.Thread
    done: list[BundleResult] = field(default_factory=list)


class _Threaded:
    """One daemon thread per key; results kept for the last 1,000 keys."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def _spawn(self, key: str, work: Callable[[], BundleResult]) -> None:
        with self._lock:
            if key in self._jobs:
                return
            job = _Job(thread=threading.Thread(daemon=True, name="gpuhealth-bundle",
                                               target=lambda: job.done.append(self._safe(work))))
            self._jobs[key] = job
            while len(self._jobs) > 1000:
                self._jobs.pop(next(iter(self._jobs)))
        job.thread.start()

    @staticmethod
    def _safe(work: Callable[[], BundleResult]) -> BundleResult:
        try:
            return work()
        except Exception as exc:  # a bug must not hold the step
            logger.exception("diagnostic bundle failed")
            return BundleResult(path="", message=f"{type(exc).__name__}: {exc}")

    def result(self, key: str) -> BundleResult | None:
        """The bundle of ``key`` once collected."""
        with self._lock:
            job = self._jobs.get(key)
        if job is None or not job.done:
            return None
        return job.done[0]

    def wait(self, key: str, timeout_seconds: float = 30.0) -> None:
        """Block until the bundle of ``key`` is collected (tests)."""
        with self._lock:
            job = self._jobs.get(key)
        if job is not None:
            job.thread.join(timeout_seconds)


class LocalBundler(_Threaded):
    """Collects on this machine (``gpuhealth run`` on the GPU node itself).

    Args:
        collector: The collector.
    """

    name = "local"

    def __init__(self, *, collector: BundleCollector) -> None:
        super().__init__()
        self.collector = collector
        self.timeout_seconds = collector.timeout_seconds

    def start(self, request: BundleRequest) -> None:
        """Start collecting in a thread."""
        self._spawn(request.key, lambda: self.collector.collect(
            reason=request.reason, gpus=request.gpus, key=request.key,
            evidence=request.evidence))


class NodeAgentBundler(_Threaded):
    """Asks the node's agent for a bundle on the signed GPU-reset endpoint (``op=bundle``).

    The bundle stays on the node (its path is reported, ``node:<path>``).

    Args:
        secret, secret_env, secret_file: The shared secret (exactly one).
        url_template: The node agent's endpoint; ``{node}`` is replaced by the node name.
        timeout_seconds: How long the engine waits for it, seconds (the node's own
            collection timeout should be shorter).
        verify: TLS verification.
        clock: Returns now, epoch seconds.
        transport: An ``httpx`` transport (tests).

    Raises:
        ConfigError: A bad template, timeout or secret.
    """

    name = "node_agent"

    def __init__(
        self,
        *,
        secret: str | None = None,
        secret_env: str | None = None,
        secret_file: str | None = None,
        url_template: str = "https://{node}:9836/api/v1/gpu-reset",
        timeout_seconds: float = 240.0,
        verify: bool | str = True,
        clock: Clock = system_clock,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__()
        if timeout_seconds <= 0:
            raise ConfigError("bundle timeout_seconds must be > 0")
        self._key = node_agent_key(url_template, secret=secret, secret_env=secret_env,
                                   secret_file=secret_file, what="node agent bundle")
        self.url_template = url_template
        self.timeout_seconds = timeout_seconds
        self.verify = verify
        self.clock = clock
        self._transport = transport

    def __repr__(self) -> str:
        """Return a representation that never shows the secret."""
        return f"NodeAgentBundler(url_template={self.url_template!r})"

    def start(self, request: BundleRequest) -> None:
        """POST the request in a thread."""
        self._spawn(request.key, lambda: self._post(request))

    def _post(self, request: BundleRequest) -> BundleResult:
        url = self.url_template.format(node=request.node)
        body = json.dumps({"op": "bundle", "node": request.node,
                           "idempotency_key": request.key, "reason": request.reason,
                           "gpus": list(request.gpus), "evidence": list(request.evidence)},
                          sort_keys=True).encode()
        msg_id = f"bundle_{uuid.uuid4().hex}"
        timestamp = int(self.clock())
        headers = {"content-type": "application/json", "webhook-id": msg_id,
                   "webhook-timestamp": str(timestamp),
                   "webhook-signature": sign(self._key, msg_id, timestamp, body)}
        verify: Any = _ssl_context() if self.verify is True else self.verify
        try:
            with httpx.Client(timeout=self.timeout_seconds, verify=verify,
                              transport=self._transport) as client:
                response = client.post(url, content=body, headers=headers)
            answer = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            return BundleResult(path="", message=f"node agent {url}: {type(exc).__name__}: "
                                                 f"{exc}")
        if response.status_code != 200 or not isinstance(answer, dict):
            return BundleResult(path="", message=f"node agent answered "
                                                 f"{response.status_code}: {str(answer)[:200]}")
        got = BundleResult.from_json(answer)
        return BundleResult(path=f"{request.node}:{got.path}" if got.path else "",
                            seconds=got.seconds, size_bytes=got.size_bytes,
                            message=f"on {request.node}: {got.message}")
