"""Kubernetes scheduler adapter (entry point ``kubernetes``): cordon, drain, reboot, resume.

Carries out remediation steps through the official ``kubernetes`` Python client
(``CoreV1Api`` for nodes and pods, the ``policy/v1`` Eviction subresource), following
``kubectl cordon|drain|uncordon`` (kubernetes/kubectl ``pkg/drain``) and the Kubernetes
API conventions (https://kubernetes.io/docs/reference/using-api/api-concepts/). The
client is synchronous, so every call runs in a bounded thread pool (its size is also
the urllib3 connection-pool size) and the engine's event loop never blocks.

What each step does (``docs/kubernetes.md`` has the full table):

* ``cordon``: ``spec.unschedulable=true``, taint ``gpuhealth.io/unhealthy=<alertname>:NoSchedule``
  and annotations ``gpuhealth.io/cordoned``, ``gpuhealth.io/reason``,
  ``gpuhealth.io/cordoned-at``, written read-modify-write with the node's
  ``resourceVersion`` (``spec.taints`` has no patch-merge key, so a patch replaces the
  whole list; a 409 re-reads and retries). A node that was already unschedulable
  without gpuhealth's annotation (a human cordoned it) is left as it is and not claimed.
* ``drain``/``migrate`` (``scope=node``): cordon, then evict every pod on the node except
  DaemonSet pods, mirror (static) pods and finished pods, after an optional pre-eviction
  checkpoint hook; 429 (PodDisruptionBudget) is retried until ``drain_timeout_seconds``.
  Pods are evicted the highest ``spec.priority`` first (their PriorityClass's value), so
  critical work is rescheduled first when the eviction rate or capacity is short.
  ``scope=gpu`` evicts only the pods holding that GPU and never cordons.
  ``mode=allow_completion`` cordons and waits for the pods to finish.
* ``reboot``: label ``gpuhealth.io/reboot-required=true`` and annotation
  ``gpuhealth.io/reboot-requested`` for the site's reboot daemon (kured-style);
  succeeded once ``status.nodeInfo.bootID`` changes.
* ``resume``: undoes only what gpuhealth did, only on a node with gpuhealth's
  ``gpuhealth.io/cordoned`` annotation.
* ``hand_off``: label ``gpuhealth.io/hardware-service=requested``. ``restart``: evict the
  entity's pods. ``notify``: nothing. ``reset_gpu``: not a Kubernetes operation
  (:class:`~core.errors.PermanentError`; the engine asks the node agent).

Errors: a node the API does not know raises :class:`~core.errors.NodeNotFound`;
connection failures, 429 and 5xx raise :class:`~core.errors.SchedulerUnavailable`;
401/403 and other 4xx raise :class:`~core.errors.PermanentError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

import httpx
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

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
    OWNER_KEY_PREFIX,
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

T = TypeVar("T")
SEEN_SECONDS = 1.0
"""How long a node read by ``node_state`` may start the next read-modify-write (seconds)."""

CORDONED_ANNOTATION = f"{OWNER_KEY_PREFIX}cordoned"
REASON_ANNOTATION = f"{OWNER_KEY_PREFIX}reason"
CORDONED_AT_ANNOTATION = f"{OWNER_KEY_PREFIX}cordoned-at"
REBOOT_REQUESTED_ANNOTATION = f"{OWNER_KEY_PREFIX}reboot-requested"
REBOOT_BOOT_ID_ANNOTATION = f"{OWNER_KEY_PREFIX}reboot-boot-id"
UNHEALTHY_TAINT = f"{OWNER_KEY_PREFIX}unhealthy"
REBOOT_LABEL = f"{OWNER_KEY_PREFIX}reboot-required"
HARDWARE_LABEL = f"{OWNER_KEY_PREFIX}hardware-service"
RELIABILITY_LABEL = f"{OWNER_KEY_PREFIX}reliability"
LIST_PAGE = 500
"""Nodes per page when listing (``limit``; the API server's own default page is unbounded)."""
OPT_OUT_LABEL = f"{OWNER_KEY_PREFIX}opt-out"
GPU_ANNOTATION = f"{OWNER_KEY_PREFIX}gpus"
GPU_INDEX_ANNOTATION = f"{OWNER_KEY_PREFIX}gpu-index"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
GPU_RESOURCE = "nvidia.com/gpu"

OWNED_ANNOTATIONS = (CORDONED_ANNOTATION, REASON_ANNOTATION, CORDONED_AT_ANNOTATION,
                     REBOOT_REQUESTED_ANNOTATION, REBOOT_BOOT_ID_ANNOTATION)
"""Node annotations gpuhealth writes and ``resume`` removes."""
OWNED_LABELS = (REBOOT_LABEL, HARDWARE_LABEL)
"""Node labels gpuhealth writes and ``resume`` removes (not the reliability label, which
stays for placement, nor the opt-out label, which is a human's)."""

_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def _now_rfc3339(clock: Clock) -> str:
    return datetime.fromtimestamp(clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def label_value(text: str, *, default: str = "unhealthy") -> str:
    """Make ``text`` a valid label or taint value.

    Valid: ``[A-Za-z0-9._-]``, at most 63 characters, starting and ending alphanumeric
    (Kubernetes "Labels and Selectors").

    Examples:
        >>> label_value("GpuXid79")
        'GpuXid79'
        >>> label_value("  bad value!! ")
        'bad_value'
    """
    value = _LABEL_VALUE_BAD.sub("_", text.strip())[:63].strip("._-")
    return value or default


def taint_value(request: ActionRequest) -> str:
    """The value of gpuhealth's taint: the alert name from ``request.reason``.

    ``reason`` reads ``gpuhealth: <alertname> <severity> ...`` (``docs/remediation.md``);
    an ``alertname`` or ``kind`` attribute wins when present.
    """
    explicit = request.attrs.get("alertname") or request.attrs.get("kind")
    if explicit:
        return label_value(explicit)
    words = request.reason.removeprefix("gpuhealth:").split()
    return label_value(words[0] if words else request.step.value)


# --- client construction and error translation ----------------------------------------------


def build_api_client(*, host: str | None = None, kubeconfig: str | None = None,
                     context: str | None = None, in_cluster: bool = False,
                     token: str | None = None, verify_ssl: bool = True,
                     pool_size: int = 16, connect_retries: int = 1) -> client.ApiClient:
    """Build a ``kubernetes`` ``ApiClient`` from one of three sources.

    Args:
        host: Explicit API URL (``https://10.0.0.1:6443``, or a test server); wins.
        kubeconfig: Path of a kubeconfig file (``None``: ``$KUBECONFIG`` or ``~/.kube/config``).
        context: kubeconfig context (``None``: its current context).
        in_cluster: Use the pod's service account (``KUBERNETES_SERVICE_HOST``).
        token: Bearer token for ``host``.
        verify_ssl: Verify the server certificate (``host`` only).
        pool_size: urllib3 connection-pool size; match the worker-thread count, or
            threads wait for a connection (1-1024).
        connect_retries: urllib3 retries of connection errors before failing.

    Raises:
        ConfigError: Bad values, or the kubeconfig/in-cluster configuration cannot be
            loaded (the message names the source).
    """
    if not 1 <= pool_size <= 1024:
        raise ConfigError(f"kubernetes: pool_size must be 1-1024, got {pool_size}")
    cfg = client.Configuration()
    try:
        if host:
            cfg.host = host.rstrip("/")
            cfg.verify_ssl = verify_ssl
            if token:
                cfg.api_key = {"authorization": token}
                cfg.api_key_prefix = {"authorization": "Bearer"}
        elif in_cluster:
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=cfg)
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, context=context, client_configuration=cfg)
    except (config.ConfigException, OSError, ValueError, KeyError) as exc:
        source = host or ("in-cluster service account" if in_cluster
                          else kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config")
        raise ConfigError(f"kubernetes: cannot load configuration from {source}: {exc}") from exc
    cfg.connection_pool_maxsize = pool_size
    cfg.retries = urllib3.Retry(total=connect_retries, connect=connect_retries, read=0,
                                status=0, redirect=0, backoff_factor=0.1)
    return client.ApiClient(cfg)


def _retry_after(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _status_message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body) if exc.body else {}
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return str(message or exc.reason or "")


def translate(exc: Exception, what: str, *, node: str | None = None) -> GpuHealthError:
    """Map a client exception to gpuhealth's error tree (``core.errors``).

    404 on a node read -> :class:`NodeNotFound`; connection failures (status 0), 429 and
    5xx -> :class:`SchedulerUnavailable` (with ``Retry-After`` when the server sent
    one); 401, 403 and other statuses -> :class:`PermanentError`.
    """
    if isinstance(exc, ApiException):
        status = exc.status or 0
        message = f"kubernetes: {what}: HTTP {status} {_status_message(exc)}".rstrip()
        if status == 404 and node is not None:
            return NodeNotFound(f"kubernetes: node {node!r} not found ({what})")
        if status == 0 or status == 429 or status >= 500:
            return SchedulerUnavailable(message, retry_after_seconds=_retry_after(exc))
        return PermanentError(message)
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        return SchedulerUnavailable(f"kubernetes: {what}: cannot reach the API server: {exc}")
    return PermanentError(f"kubernetes: {what}: {exc}")


# --- pods -------------------------------------------------------------------------------


def meta(obj: client.V1Node | client.V1Pod) -> client.V1ObjectMeta:
    """``obj.metadata``, or an empty one when the server sent none."""
    return obj.metadata if obj.metadata is not None else client.V1ObjectMeta()


def annotations_of(obj: client.V1Node | client.V1Pod) -> dict[str, str]:
    """The object's annotations (``{}`` when none)."""
    return dict(meta(obj).annotations or {})


def labels_of(obj: client.V1Node | client.V1Pod) -> dict[str, str]:
    """The object's labels (``{}`` when none)."""
    return dict(meta(obj).labels or {})


def boot_id_of(node: client.V1Node) -> str:
    """``status.nodeInfo.bootID`` (``""`` when unknown)."""
    info = node.status.node_info if node.status is not None else None
    return (info.boot_id or "") if info is not None else ""


def is_unschedulable(node: client.V1Node) -> bool:
    """Whether ``spec.unschedulable`` is set (the node is cordoned)."""
    return bool(node.spec is not None and node.spec.unschedulable)


def taints_of(node: client.V1Node) -> list[dict[str, Any]]:
    """``spec.taints`` as plain JSON dicts (``key``, ``value``, ``effect``, ``timeAdded``)."""
    taints = (node.spec.taints if node.spec is not None else None) or []
    out: list[dict[str, Any]] = []
    for taint in taints:
        item: dict[str, Any] = {"key": taint.key, "effect": taint.effect}
        if taint.value is not None:
            item["value"] = taint.value
        if taint.time_added is not None:
            item["timeAdded"] = taint.time_added.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        out.append(item)
    return out


def pod_name(pod: client.V1Pod) -> tuple[str, str]:
    """``(namespace, name)`` of ``pod``."""
    m = meta(pod)
    return m.namespace or "default", m.name or ""


def pod_key(pod: client.V1Pod) -> str:
    """``namespace/name`` of ``pod``."""
    namespace, name = pod_name(pod)
    return f"{namespace}/{name}"


def is_daemonset_pod(pod: client.V1Pod) -> bool:
    """Whether a DaemonSet controls ``pod`` (kubectl ``daemonSetFilter``)."""
    return any(ref.kind == "DaemonSet" and ref.controller
               for ref in (meta(pod).owner_references or []))


def is_mirror_pod(pod: client.V1Pod) -> bool:
    """Whether ``pod`` is a static pod's mirror (kubectl ``mirrorPodFilter``)."""
    return MIRROR_ANNOTATION in annotations_of(pod)


def is_finished(pod: client.V1Pod) -> bool:
    """Whether ``pod`` has finished (phase ``Succeeded`` or ``Failed``)."""
    return bool(pod.status and pod.status.phase in ("Succeeded", "Failed"))


def is_terminating(pod: client.V1Pod) -> bool:
    """Whether ``pod`` is being deleted already (``metadata.deletionTimestamp`` set)."""
    return meta(pod).deletion_timestamp is not None


def is_workload(pod: client.V1Pod) -> bool:
    """A pod a drain must move: not DaemonSet-owned, not a mirror pod, not finished."""
    return not (is_daemonset_pod(pod) or is_mirror_pod(pod) or is_finished(pod))


def gpu_request(pod: client.V1Pod, resource: str = GPU_RESOURCE) -> int:
    """How many ``resource`` devices ``pod`` asks for.

    Limits, else requests, of all containers and init containers (an extended
    resource's request equals its limit).
    """
    total = 0
    spec = pod.spec
    if spec is None:
        return 0
    for container in list(spec.containers or []) + list(spec.init_containers or []):
        res = container.resources
        if res is None:
            continue
        value = (res.limits or {}).get(resource) or (res.requests or {}).get(resource)
        try:
            total += int(str(value)) if value is not None else 0
        except ValueError:
            continue
    return total


def pod_priority(pod: client.V1Pod) -> int:
    """``spec.priority`` of ``pod`` (its PriorityClass's value; 0 when unset)."""
    value = getattr(pod.spec, "priority", None) if pod.spec is not None else None
    return int(value) if isinstance(value, int) else 0


def controller_uid(pod: client.V1Pod) -> str:
    """The uid of the controller that owns ``pod`` (``""``: none, a bare pod)."""
    for ref in meta(pod).owner_references or []:
        if ref.controller:
            return str(ref.uid or "")
    return ""


def work_item(pod: client.V1Pod, resource: str = GPU_RESOURCE) -> WorkItem:
    """``pod`` as a :class:`~remediation.priority.WorkItem` (priority, class, GPUs, start)."""
    start = pod.status.start_time if pod.status is not None else None
    if isinstance(start, datetime) and start.tzinfo is None:
        start = start.replace(tzinfo=UTC)
    phase = pod.status.phase if pod.status is not None else ""
    return WorkItem(
        kind="pod", id=pod_key(pod), node=str(pod.spec.node_name or "") if pod.spec else "",
        gpus=gpu_request(pod, resource),
        started_at=start.timestamp() if isinstance(start, datetime) else None,
        priority=pod_priority(pod),
        priority_class=str(getattr(pod.spec, "priority_class_name", None) or ""),
        owner=str(meta(pod).namespace or ""), controller=controller_uid(pod),
        state="pending" if phase == "Pending" else "running")


def normalize_gpu_id(value: str) -> str:
    """Canonical form of a GPU id for matching: lower case, PCI domain cut to 4 digits.

    ``00000000:B1:00.0`` (``nvidia-smi``) and ``0000:b1:00.0`` (sysfs) compare equal.

    Examples:
        >>> normalize_gpu_id("00000000:B1:00.0")
        '0000:b1:00.0'
        >>> normalize_gpu_id("GPU-ABC")
        'gpu-abc'
    """
    text = value.strip().lower()
    m = re.fullmatch(r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", text)
    if m:
        return f"{m.group(1)[-4:]}:{m.group(2)}:{m.group(3)}.{m.group(4)}"
    return text


class GpuPodResolver(Protocol):
    """Finds the pods that hold one GPU of a node.

    Returns the pods (a subset of ``pods``), or ``None`` when it cannot tell, in which
    case the adapter falls back to every pod of the node that requests a GPU.
    """

    def __call__(self, node: client.V1Node, pods: Sequence[client.V1Pod],
                 gpu: str) -> list[client.V1Pod] | None:
        """Return ``gpu``'s pods among ``pods`` on ``node``, or ``None``."""
        ...


@dataclass(frozen=True, slots=True)
class AnnotationGpuResolver:
    """Resolves a GPU's pods from a pod annotation the node's agent writes.

    The agent reads the kubelet PodResources API (``List``: per container, the device
    ids allocated for ``nvidia.com/gpu``) and writes them onto the pod as annotation
    ``key``: a comma list of GPU UUIDs, PCI bus ids or indices, as the device plugin
    reports them (the NVIDIA device plugin's ``--device-id-strategy`` is ``uuid`` or
    ``index``). Indices are matched through the node annotation ``index_key``
    (``"0=GPU-uuid,1=GPU-uuid"``, also written by the agent).

    It cannot tell (returns ``None``) when a GPU-requesting pod on the node lacks the
    annotation, or when an index is listed but the node has no index map.

    Attributes:
        key: Pod annotation with the pod's GPU ids (default ``gpuhealth.io/gpus``).
        index_key: Node annotation mapping indices to UUIDs or bus ids.
        resource: The extended resource that marks GPU pods (``nvidia.com/gpu``).
    """

    key: str = GPU_ANNOTATION
    index_key: str = GPU_INDEX_ANNOTATION
    resource: str = GPU_RESOURCE

    def __call__(self, node: client.V1Node, pods: Sequence[client.V1Pod],
                 gpu: str) -> list[client.V1Pod] | None:
        """Return the pods whose annotation names ``gpu``, or ``None`` if unknown."""
        target = normalize_gpu_id(gpu)
        index_map: dict[str, str] = {}
        for item in (annotations_of(node).get(self.index_key) or "").split(","):
            index, sep, ident = item.partition("=")
            if sep:
                index_map[index.strip()] = normalize_gpu_id(ident)
        found: list[client.V1Pod] = []
        for pod in pods:
            raw = annotations_of(pod).get(self.key)
            if raw is None:
                if gpu_request(pod, self.resource) > 0:
                    return None
                continue
            ids = set()
            for item in filter(None, (part.strip() for part in raw.split(","))):
                if item.isdigit():
                    if item not in index_map and item != target:
                        return None
                    ids.add(index_map.get(item, item))
                else:
                    ids.add(normalize_gpu_id(item))
            if target in ids:
                found.append(pod)
        return found


# --- checkpoint hook --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HookResult:
    """What the pre-eviction checkpoint hook did for one pod."""

    ok: bool
    message: str


@dataclass(frozen=True, slots=True)
class CheckpointHook:
    """Runs before each eviction so that stateful work can checkpoint first.

    Exactly one of ``url`` and ``command``:

    * ``url``: HTTP POST of JSON ``{"node", "namespace", "pod", "reason",
      "idempotency_key"}``; a 2xx answer within ``timeout_seconds`` is success. The URL
      may contain ``{node}``, ``{namespace}`` and ``{pod}``.
    * ``command``: argv run without a shell with environment ``GPUHEALTH_NODE``,
      ``GPUHEALTH_NAMESPACE``, ``GPUHEALTH_POD``, ``GPUHEALTH_REASON``; exit status 0
      within ``timeout_seconds`` is success (it is killed at the timeout).

    Attributes:
        url: Endpoint to POST to.
        command: Program and arguments; ``{node}``, ``{namespace}``, ``{pod}`` are
            substituted in each argument.
        timeout_seconds: How long to wait (0 < t <= 3600).
        required: When ``True`` a failed hook keeps the pod from being evicted and
            fails the drain; when ``False`` (default) the pod is evicted anyway and
            the failure is reported in the status message.
    """

    url: str | None = None
    command: tuple[str, ...] | None = None
    timeout_seconds: float = 30.0
    required: bool = False

    def __post_init__(self) -> None:
        """Check the settings.

        Raises:
            ConfigError: Neither or both of ``url`` and ``command``, or a bad timeout.
        """
        if (self.url is None) == (self.command is None):
            raise ConfigError("kubernetes: checkpoint hook needs exactly one of "
                              "checkpoint_url and checkpoint_command")
        if not 0 < self.timeout_seconds <= 3600:
            raise ConfigError(f"kubernetes: checkpoint_timeout_seconds must be in (0, 3600], "
                              f"got {self.timeout_seconds}")

    def run(self, *, node: str, namespace: str, pod: str, request: ActionRequest) -> HookResult:
        """Run the hook for one pod (blocking); never raises for the hook's own failure."""
        fields = {"node": node, "namespace": namespace, "pod": pod}
        started = time.monotonic()
        if self.url is not None:
            url = self.url.format(**fields)
            try:
                response = httpx.post(url, json={**fields, "reason": request.reason,
                                                 "idempotency_key": request.idempotency_key},
                                      timeout=self.timeout_seconds)
            except httpx.TimeoutException:
                return HookResult(False, f"timed out after {self.timeout_seconds:g} s")
            except httpx.HTTPError as exc:
                return HookResult(False, f"POST {url} failed: {exc}")
            took = time.monotonic() - started
            ok = response.is_success
            return HookResult(ok, f"HTTP {response.status_code} in {took:.2f} s")
        assert self.command is not None
        argv = [arg.format(**fields) for arg in self.command]
        env = {**os.environ, "GPUHEALTH_NODE": node, "GPUHEALTH_NAMESPACE": namespace,
               "GPUHEALTH_POD": pod, "GPUHEALTH_REASON": request.reason}
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=self.timeout_seconds, check=False)
        except subprocess.TimeoutExpired:
            return HookResult(False, f"timed out after {self.timeout_seconds:g} s")
        except OSError as exc:
            return HookResult(False, f"cannot run {argv[0]}: {exc}")
        took = time.monotonic() - started
        tail = (done.stdout or done.stderr or "").strip().splitlines()
        note = f": {tail[-1][:120]}" if tail else ""
        return HookResult(done.returncode == 0,
                          f"exit {done.returncode} in {took:.2f} s{note}")


# --- rate limiter -----------------------------------------------------------------------


class AsyncRateLimiter:
    """Spaces calls ``1/rate`` seconds apart on the event loop (no burst).

    The Python ``kubernetes`` client has no client-side rate limiter (client-go's
    default is QPS 5, burst 10), so the eviction rate is ours to set.
    """

    def __init__(self, rate_per_second: float) -> None:
        if not (rate_per_second > 0 and math.isfinite(rate_per_second)):
            raise ConfigError(f"kubernetes: evictions_per_second must be > 0, "
                              f"got {rate_per_second}")
        self.interval = 1.0 / rate_per_second
        self._next = 0.0

    async def acquire(self) -> None:
        """Wait for the next free slot."""
        now = time.monotonic()
        slot = max(now, self._next)
        self._next = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)


# --- actions ----------------------------------------------------------------------------


@dataclass
class _Action:
    ref: str
    request: ActionRequest
    phase: ActionPhase = ActionPhase.RUNNING
    message: str = ""
    boot_id: str = ""
    started: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None
    hooks: dict[str, str] = field(default_factory=dict)


class KubernetesScheduler:
    """Scheduler adapter for Kubernetes: ``SchedulerAdapter``, ``NodeInspector``, publisher.

    It is also a ``ReliabilityPublisher``.

    ``submit`` applies quick steps at once (cordon, reboot request, resume, hand-off)
    and starts drains as background tasks on the running event loop; ``status``
    reports how far each got. Submitting the same ``idempotency_key`` twice returns
    the first ref. A new instance (after a controller fail-over) that is given the
    same request again does not repeat work: pods already terminating or gone are
    never evicted again, and a reboot request that is already on the node is reused.

    Args:
        host, kubeconfig, context, in_cluster, token, verify_ssl: Where the API server
            is (see :func:`build_api_client`).
        workers: Worker threads for blocking client calls, and connection-pool size
            (1-1024, default 16); checkpoint hooks get as many threads of their own.
        evictions_per_second: Rate of eviction requests across all drains (> 0,
            default 50).
        drain_timeout_seconds: A drain that has not emptied the node by then fails
            (> 0, default 600, as a bounded ``kubectl drain --timeout``).
        eviction_retry_seconds: Wait after a 429 before evicting that pod again
            (kubectl: 5 s).
        poll_seconds: How often a drain re-lists the node's pods (default 1 s, as kubectl).
        grace_period_seconds: ``DeleteOptions.gracePeriodSeconds`` of each eviction;
            ``None`` uses each pod's ``terminationGracePeriodSeconds``.
        completion_timeout_seconds: For ``mode=allow_completion``: fail after this long
            (``None``: wait as long as the pods run).
        skip_wait_for_delete_seconds: A pod whose ``deletionTimestamp`` is more than
            this far in the past counts as gone, as ``kubectl drain
            --skip-wait-for-delete-timeout`` (a node whose kubelet died never finishes
            deleting its pods); ``None`` (default) waits for every pod to go.
        reboot_timeout_seconds: A reboot whose bootID has not changed by then fails.
        request_timeout_seconds: Timeout of each API request.
        checkpoint_url, checkpoint_command, checkpoint_timeout_seconds,
        checkpoint_required: The pre-eviction hook (:class:`CheckpointHook`); none by default.
        gpu_annotation: Pod annotation with its GPU ids, for ``scope=gpu`` drains.
        gpu_resource: Extended resource name of GPUs (``nvidia.com/gpu``).
        gpu_resolver: Replaces the annotation resolver (:class:`GpuPodResolver`).
        api_client: A ready ``ApiClient`` (tests); the other connection settings are
            then ignored.
        clock: Epoch-seconds clock for the timestamps written onto nodes.

    Raises:
        ConfigError: A setting is out of range or the configuration cannot be loaded.
    """

    name = "kubernetes"
    gpu_level_drain = True

    def __init__(
        self,
        *,
        host: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        in_cluster: bool = False,
        token: str | None = None,
        verify_ssl: bool = True,
        workers: int = 16,
        evictions_per_second: float = 50.0,
        drain_timeout_seconds: float = 600.0,
        eviction_retry_seconds: float = 5.0,
        poll_seconds: float = 1.0,
        grace_period_seconds: int | None = None,
        completion_timeout_seconds: float | None = None,
        skip_wait_for_delete_seconds: float | None = None,
        reboot_timeout_seconds: float = 1800.0,
        request_timeout_seconds: float = 10.0,
        checkpoint_url: str | None = None,
        checkpoint_command: Sequence[str] | None = None,
        checkpoint_timeout_seconds: float = 30.0,
        checkpoint_required: bool = False,
        gpu_annotation: str = GPU_ANNOTATION,
        gpu_resource: str = GPU_RESOURCE,
        gpu_resolver: GpuPodResolver | None = None,
        api_client: client.ApiClient | None = None,
        clock: Clock = system_clock,
    ) -> None:
        for key, value in (("drain_timeout_seconds", drain_timeout_seconds),
                           ("eviction_retry_seconds", eviction_retry_seconds),
                           ("poll_seconds", poll_seconds),
                           ("reboot_timeout_seconds", reboot_timeout_seconds),
                           ("request_timeout_seconds", request_timeout_seconds)):
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"kubernetes: {key} must be a positive number, got {value}")
        if not 1 <= workers <= 1024:
            raise ConfigError(f"kubernetes: workers must be 1-1024, got {workers}")
        if grace_period_seconds is not None and grace_period_seconds < 0:
            raise ConfigError(f"kubernetes: grace_period_seconds must be >= 0, "
                              f"got {grace_period_seconds}")
        self._api = api_client or build_api_client(
            host=host, kubeconfig=kubeconfig, context=context, in_cluster=in_cluster,
            token=token, verify_ssl=verify_ssl, pool_size=workers)
        self._api.configuration.connection_pool_maxsize = max(
            self._api.configuration.connection_pool_maxsize or 0, workers)
        self._core = client.CoreV1Api(self._api)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k8s")
        self._limiter = AsyncRateLimiter(evictions_per_second)
        self.evictions_per_second = evictions_per_second
        self._drain_timeout = drain_timeout_seconds
        self._retry_delay = eviction_retry_seconds
        self._poll = poll_seconds
        self._grace = grace_period_seconds
        self._completion_timeout = completion_timeout_seconds
        if skip_wait_for_delete_seconds is not None and not skip_wait_for_delete_seconds >= 0:
            raise ConfigError(f"kubernetes: skip_wait_for_delete_seconds must be >= 0, "
                              f"got {skip_wait_for_delete_seconds}")
        self._skip_wait = skip_wait_for_delete_seconds
        self._reboot_timeout = reboot_timeout_seconds
        self._timeout = request_timeout_seconds
        self._hook = None
        if checkpoint_url is not None or checkpoint_command is not None:
            self._hook = CheckpointHook(
                url=checkpoint_url,
                command=tuple(checkpoint_command) if checkpoint_command is not None else None,
                timeout_seconds=checkpoint_timeout_seconds, required=checkpoint_required)
        # Hooks may take their whole timeout: their own threads, so API calls never wait.
        self._hook_pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k8s-hook")
        self._gpu_resource = gpu_resource
        self._resolver: GpuPodResolver = gpu_resolver or AnnotationGpuResolver(
            key=gpu_annotation, resource=gpu_resource)
        self._clock = clock
        self._refs: dict[str, str] = {}
        self._actions: dict[str, _Action] = {}
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        # nodes read by node_state moments ago, reused once by the next read-modify-write
        self._seen: dict[str, tuple[float, client.V1Node]] = {}

    # --- lifecycle ---
    def close(self) -> None:
        """Cancel running drains, stop the worker threads and close the connections."""
        for action in self._actions.values():
            if action.task is not None and not action.task.done():
                action.task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._hook_pool.shutdown(wait=False, cancel_futures=True)
        self._api.close()  # type: ignore[no-untyped-call]

    # --- blocking helpers (run in the pool) ---
    async def _run(self, fn: Callable[..., T], *args: Any,
                   pool: ThreadPoolExecutor | None = None) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool or self._pool, functools.partial(fn, *args))

    def _read_node(self, name: str) -> client.V1Node:
        try:
            return self._core.read_node(name, _request_timeout=self._timeout)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise translate(exc, f"read node {name}", node=name) from exc

    def _list_pods(self, node: str) -> list[client.V1Pod]:
        try:
            pods = self._core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", _request_timeout=self._timeout)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise translate(exc, f"list pods on {node}") from exc
        return list(pods.items or [])

    def _patch_node(self, name: str, body: Mapping[str, Any]) -> client.V1Node:
        try:
            return self._core.patch_node(name, dict(body), _request_timeout=self._timeout)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise translate(exc, f"patch node {name}", node=name) from exc

    def _update_node(self, name: str,
                     change: Callable[[client.V1Node], dict[str, Any] | None],
                     attempts: int = 10) -> tuple[client.V1Node, bool]:
        """Read-modify-write one node.

        Patches ``change(node)`` with the node's ``resourceVersion`` as precondition; on
        409 re-reads and retries. The first attempt may start from the node that
        :meth:`node_state` read less than :data:`SEEN_SECONDS` ago (the engine reads it just
        before each step): the precondition makes a stale copy fail with 409 rather than
        overwrite anything, and a stale copy that asks for no change is read again.
        Returns (node, whether it changed).
        """
        with self._lock:
            seen = self._seen.pop(name, None)
        for _ in range(attempts):
            if seen is not None and time.monotonic() - seen[0] < SEEN_SECONDS:
                node, fresh = seen[1], False
            else:
                node, fresh = self._read_node(name), True
            seen = None
            try:
                patch = change(node)
            except ReturnedToService:
                if not fresh:
                    continue  # decided on the copy: decide again on the node as it is now
                raise
            if patch is None:
                if not fresh:
                    continue  # decided on the copy: decide again on the node as it is now
                return node, False
            patch.setdefault("metadata", {})["resourceVersion"] = meta(node).resource_version
            try:
                return self._core.patch_node(name, patch, _request_timeout=self._timeout), True
            except ApiException as exc:
                if exc.status == 409:
                    logger.info("kubernetes: node %s changed under us; re-reading", name)
                    continue
                raise translate(exc, f"patch node {name}", node=name) from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise translate(exc, f"patch node {name}", node=name) from exc
        raise SchedulerUnavailable(f"kubernetes: node {name} kept changing: {attempts} "
                                   f"conflicts (409) in a row", retry_after_seconds=1.0)

    def _evict(self, pod: client.V1Pod) -> str:
        """POST one Eviction; returns ``evicted``, ``gone`` (404) or ``blocked`` (429)."""
        namespace, name = pod_name(pod)
        body = client.V1Eviction(
            api_version="policy/v1", kind="Eviction",
            metadata=client.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=(client.V1DeleteOptions(grace_period_seconds=self._grace)
                            if self._grace is not None else None))
        try:
            self._core.create_namespaced_pod_eviction(
                name, namespace, body,
                _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 404:
                return "gone"
            if exc.status == 429:
                return "blocked"
            raise translate(exc, f"evict pod {pod_key(pod)}") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise translate(exc, f"evict pod {pod_key(pod)}") from exc
        return "evicted"

    # --- SchedulerAdapter ---
    async def submit(self, request: ActionRequest) -> str:
        """Start ``request``'s step; return a ref for :meth:`status`.

        Idempotent on ``request.idempotency_key``. ``dry_run`` requests only check
        that the node exists.

        Raises:
            NodeNotFound: The API server does not know the node.
            SchedulerUnavailable: The API server cannot be reached (nothing recorded;
                submit again).
            PermanentError: ``reset_gpu`` (not a Kubernetes operation), 401/403, or an
                unknown step.
        """
        with self._lock:
            known = self._refs.get(request.idempotency_key)
        if known is not None:
            return known
        ref = f"k8s-{next(self._counter)}-{request.step.value}-{request.node}"
        action = _Action(ref=ref, request=request)
        await self._start(action)
        with self._lock:
            existing = self._refs.get(request.idempotency_key)
            if existing is not None:
                if action.task is not None:
                    action.task.cancel()
                return existing
            self._refs[request.idempotency_key] = ref
            self._actions[ref] = action
        logger.info("kubernetes: %s %s/%s -> %s (%s)", request.step.value, request.node,
                    request.entity, ref, action.phase.value)
        return ref

    async def status(self, ref: str) -> ActionStatus:
        """Report how far the step behind ``ref`` got.

        Reboots are checked live (a changed ``bootID`` is success).

        Raises:
            PermanentError: ``ref`` was not given out by this instance.
            SchedulerUnavailable: A live check could not reach the API server.
        """
        action = self._actions.get(ref)
        if action is None:
            raise PermanentError(f"kubernetes: unknown ref {ref!r}")
        if action.request.step == RemediationStep.REBOOT and action.phase == ActionPhase.RUNNING:
            await self._run(self._check_reboot, action)
        return ActionStatus(ref=ref, phase=action.phase, message=action.message)

    async def _start(self, action: _Action) -> None:
        request = action.request
        step = request.step
        node = request.node
        if request.dry_run:
            await self._run(self._read_node, node)
            self._finish(action, ActionPhase.SUCCEEDED, f"dry run: would {step.value} {node}"
                         f"/{request.entity}; nothing changed")
            return
        if step == RemediationStep.NOTIFY:
            self._finish(action, ActionPhase.SUCCEEDED, "notify: nothing to do on Kubernetes")
        elif step == RemediationStep.CORDON:
            message = await self._run(self._cordon, request)
            self._finish(action, ActionPhase.SUCCEEDED, message)
        elif step in (RemediationStep.DRAIN, RemediationStep.MIGRATE, RemediationStep.RESTART):
            await self._start_drain(action)
        elif step == RemediationStep.REBOOT:
            await self._run(self._request_reboot, action)
        elif step == RemediationStep.HAND_OFF:
            await self._run(self._patch_node, node,
                            {"metadata": {"labels": {HARDWARE_LABEL: "requested"}}})
            self._finish(action, ActionPhase.SUCCEEDED,
                         f"labelled {HARDWARE_LABEL}=requested; node stays cordoned")
        elif step == RemediationStep.RESUME:
            phase, message = await self._run(self._resume, request)
            self._finish(action, phase, message)
        elif step == RemediationStep.RESET_GPU:
            raise PermanentError("kubernetes: a GPU reset is not a Kubernetes operation; "
                                 "the node agent carries it out (nvidia-smi -r)")
        else:  # pragma: no cover - the enum is closed
            raise PermanentError(f"kubernetes: unknown step {step!r}")

    @staticmethod
    def _finish(action: _Action, phase: ActionPhase, message: str) -> None:
        action.phase = phase
        action.message = message

    # --- cordon / resume ---
    def _cordon(self, request: ActionRequest) -> str:
        value = taint_value(request)
        at = _now_rfc3339(self._clock)
        outcome = {"message": ""}

        def change(node: client.V1Node) -> dict[str, Any] | None:
            annotations = annotations_of(node)
            ours = annotations.get(CORDONED_ANNOTATION) == "true"
            if request.attrs.get("taken_out") == "yes" and not is_unschedulable(node):
                # this incident cordoned it and someone uncordoned it since
                raise ReturnedToService(f"node {request.node} is schedulable again "
                                        "(spec.unschedulable unset)")
            if is_unschedulable(node) and not ours:
                outcome["message"] = ("already cordoned by someone else (no "
                                      f"{CORDONED_ANNOTATION} annotation): not claimed, "
                                      "resume will leave it cordoned")
                return None
            taints = taints_of(node)
            has_taint = any(t.get("key") == UNHEALTHY_TAINT and t.get("effect") == "NoSchedule"
                            for t in taints)
            if ours and has_taint and is_unschedulable(node):
                outcome["message"] = "already cordoned by gpuhealth"
                return None
            if not has_taint:
                taints.append({"key": UNHEALTHY_TAINT, "value": value, "effect": "NoSchedule"})
            outcome["message"] = (f"cordoned: unschedulable, taint {UNHEALTHY_TAINT}={value}"
                                  ":NoSchedule")
            return {"metadata": {"annotations": {
                        CORDONED_ANNOTATION: "true", REASON_ANNOTATION: request.reason,
                        CORDONED_AT_ANNOTATION: annotations.get(CORDONED_AT_ANNOTATION, at)}},
                    "spec": {"unschedulable": True, "taints": taints}}

        self._update_node(request.node, change)
        return outcome["message"]

    def _resume(self, request: ActionRequest) -> tuple[ActionPhase, str]:
        outcome: dict[str, tuple[ActionPhase, str]] = {}

        def change(node: client.V1Node) -> dict[str, Any] | None:
            annotations = annotations_of(node)
            labels = labels_of(node)
            unschedulable = is_unschedulable(node)
            if annotations.get(CORDONED_ANNOTATION) != "true":
                if unschedulable:
                    outcome["r"] = (ActionPhase.FAILED,
                                    f"not resumed: cordoned by someone else (no "
                                    f"{CORDONED_ANNOTATION} annotation); a human's cordon wins")
                else:
                    outcome["r"] = (ActionPhase.SUCCEEDED, "already schedulable; nothing to undo")
                return None
            kept = [t for t in taints_of(node) if t.get("key") != UNHEALTHY_TAINT]
            patch: dict[str, Any] = {
                "metadata": {"annotations": dict.fromkeys(
                                 k for k in OWNED_ANNOTATIONS if k in annotations),
                             "labels": dict.fromkeys(k for k in OWNED_LABELS if k in labels)},
                "spec": {"unschedulable": None, "taints": kept or None}}
            outcome["r"] = (ActionPhase.SUCCEEDED,
                            "uncordoned; removed gpuhealth's taint, labels and annotations"
                            if unschedulable else
                            "already schedulable (someone uncordoned it); removed gpuhealth's "
                            "taint, labels and annotations")
            return patch

        self._update_node(request.node, change)
        return outcome["r"]

    # --- reboot ---
    def _request_reboot(self, action: _Action) -> None:
        request = action.request
        node = self._read_node(request.node)
        if request.attrs.get("taken_out") == "yes" and not is_unschedulable(node) \
                and labels_of(node).get(REBOOT_LABEL) != "true":
            raise ReturnedToService(f"node {request.node} is schedulable again "
                                    "(spec.unschedulable unset): not rebooted")
        annotations = annotations_of(node)
        labels = labels_of(node)
        boot_id = boot_id_of(node)
        stored = annotations.get(REBOOT_BOOT_ID_ANNOTATION)
        if stored and labels.get(REBOOT_LABEL) == "true":
            action.boot_id = stored
            action.message = f"reboot already requested (bootID was {stored}); waiting"
            if stored != boot_id:
                self._check_reboot(action)
            return
        self._patch_node(request.node, {"metadata": {
            "labels": {REBOOT_LABEL: "true"},
            "annotations": {REBOOT_REQUESTED_ANNOTATION: _now_rfc3339(self._clock),
                            REBOOT_BOOT_ID_ANNOTATION: boot_id}}})
        action.boot_id = boot_id
        action.message = (f"reboot requested ({REBOOT_LABEL}=true) for the node's reboot "
                          f"daemon; waiting for bootID {boot_id} to change")

    def _check_reboot(self, action: _Action) -> None:
        name = action.request.node
        node = self._read_node(name)
        boot_id = boot_id_of(node)
        if boot_id and boot_id != action.boot_id:
            labels = labels_of(node)
            annotations = annotations_of(node)
            self._patch_node(name, {"metadata": {
                "labels": dict.fromkeys(k for k in (REBOOT_LABEL,) if k in labels),
                "annotations": dict.fromkeys(
                    k for k in (REBOOT_REQUESTED_ANNOTATION, REBOOT_BOOT_ID_ANNOTATION)
                    if k in annotations)}})
            self._finish(action, ActionPhase.SUCCEEDED,
                         f"rebooted: bootID {action.boot_id} -> {boot_id}")
        elif time.monotonic() - action.started > self._reboot_timeout:
            self._finish(action, ActionPhase.FAILED,
                         f"no reboot within {self._reboot_timeout:g} s (bootID still "
                         f"{boot_id}); is the reboot daemon running?")

    # --- drain ---
    def _drain_plan(self, request: ActionRequest) -> tuple[bool, bool, bool]:
        """(cordon first, gpu scope, evict) for a drain-like request."""
        scope = request.attrs.get("scope") or ("node" if request.entity == "node" else "gpu")
        if scope not in ("node", "gpu", "multi_node_jobs"):
            raise PermanentError(f"kubernetes: unknown scope {scope!r} "
                                 f"in {request.idempotency_key}")
        gpu = scope == "gpu"
        if gpu and request.entity == "node":
            raise PermanentError(f"kubernetes: scope=gpu needs a GPU entity, got 'node' "
                                 f"in {request.idempotency_key}")
        mode = request.attrs.get("mode")
        if mode is None:
            mode = "evict" if request.attrs.get("when", "now") == "now" else "allow_completion"
        if mode not in ("evict", "allow_completion"):
            raise PermanentError(f"kubernetes: unknown mode {mode!r} in {request.idempotency_key}")
        cordon = request.step != RemediationStep.RESTART and not gpu
        return cordon, gpu, mode == "evict"

    async def _start_drain(self, action: _Action) -> None:
        request = action.request
        cordon, gpu, evict = self._drain_plan(request)
        if cordon:
            action.message = await self._run(self._cordon, request)
        else:
            await self._run(self._read_node, request.node)
        loop = asyncio.get_running_loop()
        action.task = loop.create_task(self._drain(action, gpu=gpu, evict=evict),
                                       name=f"drain {action.ref}")

    def _stuck_terminating(self, pod: client.V1Pod) -> bool:
        """Whether ``pod`` was deleted long ago enough to count as gone.

        As ``kubectl drain --skip-wait-for-delete-timeout``: its ``deletionTimestamp`` is
        more than ``skip_wait_for_delete_seconds`` past (its kubelet is not coming back).
        """
        deleted = meta(pod).deletion_timestamp
        if self._skip_wait is None or deleted is None:
            return False
        if deleted.tzinfo is None:
            deleted = deleted.replace(tzinfo=UTC)
        return deleted.timestamp() + self._skip_wait < self._clock()

    async def _targets(self, request: ActionRequest, gpu: bool) -> tuple[list[client.V1Pod], str]:
        pods = [p for p in await self._run(self._list_pods, request.node)
                if is_workload(p) and not self._stuck_terminating(p)]
        if not gpu:
            return pods, ""
        node = await self._run(self._read_node, request.node)
        found = self._resolver(node, pods, request.entity)
        if found is None:
            fallback = [p for p in pods if gpu_request(p, self._gpu_resource) > 0]
            return fallback, (f"pods of GPU {request.entity} unknown (no pod device "
                              f"annotation); fell back to all pods requesting "
                              f"{self._gpu_resource} on the node")
        return found, f"pods of GPU {request.entity} resolved from pod annotations"

    async def work_on(self, node: NodeName, entity: EntityId | None = None) -> list[WorkRef]:
        """The pods holding ``node``'s GPUs now (:class:`~core.protocols.WorkLocator`).

        With ``entity`` (a GPU) the pods of that GPU where the pods' device annotations
        say so, else every workload pod requesting the GPU resource on the node.

        Raises:
            SchedulerUnavailable: The API server cannot be reached.
        """
        pods = [p for p in await self._run(self._list_pods, node) if is_workload(p)]
        users = [p for p in pods if gpu_request(p, self._gpu_resource) > 0]
        if entity is not None and entity != "node":
            found = self._resolver(await self._run(self._read_node, node), pods, entity)
            if found is not None:
                users = found
        return [WorkRef(kind="pod", id=f"{meta(p).namespace}/{meta(p).name}",
                        owner=str(meta(p).namespace or ""),
                        group=str(getattr(p.spec, "priority_class_name", None) or ""))
                for p in users]

    # --- PriorityScheduler (remediation.priority) ---
    def _list_phase(self, phase: str) -> list[client.V1Pod]:
        try:
            pods = self._core.list_pod_for_all_namespaces(
                field_selector=f"status.phase={phase}", _request_timeout=self._timeout)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise translate(exc, f"list {phase} pods") from exc
        return list(pods.items or [])

    async def work_detail(self, node: NodeName,
                          entity: EntityId | None = None) -> list[WorkItem]:
        """The pods holding ``node``'s GPUs (or GPU ``entity``'s) now, as work items.

        Same pods as :meth:`work_on`, with ``spec.priority``, ``priorityClassName``, GPUs,
        ``status.startTime`` and the controller's uid.

        Raises:
            SchedulerUnavailable: The API server cannot be reached.
        """
        pods = [p for p in await self._run(self._list_pods, node) if is_workload(p)]
        users = [p for p in pods if gpu_request(p, self._gpu_resource) > 0]
        if entity is not None and entity != "node":
            found = self._resolver(await self._run(self._read_node, node), pods, entity)
            if found is not None:
                users = found
        return [work_item(p, self._gpu_resource) for p in users]

    async def running_work(self) -> list[WorkItem]:
        """Every running workload pod that holds GPUs, cluster-wide.

        Raises:
            SchedulerUnavailable: The API server cannot be reached.
        """
        pods = await self._run(self._list_phase, "Running")
        return [work_item(p, self._gpu_resource) for p in pods
                if is_workload(p) and not is_terminating(p)
                and gpu_request(p, self._gpu_resource) > 0]

    async def pending_of(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        """Of ``items`` (evicted pods), those whose replacement pod is ``Pending`` now.

        The replacement has a new name; it is the pod of the same controller (uid). A
        bare pod (no controller) has no replacement and is never returned.

        Raises:
            SchedulerUnavailable: The API server cannot be reached.
        """
        owners = {i.controller: i for i in items if i.kind == "pod" and i.controller}
        if not owners:
            return []
        pods = await self._run(self._list_phase, "Pending")
        waiting = {controller_uid(p) for p in pods if not is_terminating(p)}
        return [item for uid, item in owners.items() if uid in waiting]

    async def preempt(self, item: WorkItem, *, reason: str) -> str:
        """Evict the pod ``item`` (``policy/v1`` Eviction: its PodDisruptionBudget holds).

        Raises:
            SchedulerUnavailable: A PodDisruptionBudget forbids it now (429), or the API
                server cannot be reached.
            PermanentError: Not a pod, or 401/403.
        """
        if item.kind != "pod" or "/" not in item.id:
            raise PermanentError(f"kubernetes: cannot preempt {item.kind} {item.id}")
        namespace, name = item.id.split("/", 1)
        pod = client.V1Pod(metadata=client.V1ObjectMeta(name=name, namespace=namespace))
        await self._limiter.acquire()
        result = await self._run(self._evict, pod)
        if result == "blocked":
            raise SchedulerUnavailable(f"kubernetes: evicting {item.id} is forbidden by its "
                                       "PodDisruptionBudget now", retry_after_seconds=5.0)
        if result == "gone":
            return f"pod {item.id} is gone already"
        return f"evicted pod {item.id} (priority {item.priority}) to make room: {reason}"

    async def _evict_one(self, action: _Action, pod: client.V1Pod) -> str:
        key = pod_key(pod)
        if self._hook is not None:
            if key not in action.hooks:
                namespace, name = pod_name(pod)
                result = await self._run(functools.partial(
                    self._hook.run, node=action.request.node, namespace=namespace, pod=name,
                    request=action.request), pool=self._hook_pool)
                action.hooks[key] = ("ok, " if result.ok else "FAILED, ") + result.message
                logger.info("kubernetes: checkpoint hook for %s: %s", key, action.hooks[key])
            if self._hook.required and action.hooks[key].startswith("FAILED"):
                return "hook-failed"
        await self._limiter.acquire()
        return await self._run(self._evict, pod)

    def _hook_note(self, action: _Action) -> str:
        if not action.hooks:
            return ""
        notes = ", ".join(f"{k} {v}" for k, v in sorted(action.hooks.items()))
        return f"; checkpoint hook: {notes}"

    async def _drain(self, action: _Action, *, gpu: bool, evict: bool) -> None:
        request = action.request
        timeout = self._drain_timeout if evict else self._completion_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        evicted = 0
        blocked: list[str] = []  # 429: a PodDisruptionBudget forbids it now
        erring: list[str] = []  # a temporary error (5xx, connection): tried again
        left: list[str] | None = None
        note = ""
        try:
            while True:
                try:
                    pods, found_note = await self._targets(request, gpu)
                    if "fell back" not in note:  # a fall-back, once taken, stays reported
                        note = found_note
                except SchedulerUnavailable as exc:
                    logger.warning("kubernetes: drain %s: %s; retrying", action.ref, exc)
                    pods = None
                if pods is not None:
                    if not pods:
                        what = "evicted" if evict else "finished on their own"
                        where = f" (GPU {request.entity})" if gpu else ""
                        self._finish(action, ActionPhase.SUCCEEDED,
                                     f"drained {request.node}{where}: {evicted} pods {what}"
                                     f"{'; ' + note if note else ''}{self._hook_note(action)}")
                        return
                    pending = sorted((p for p in pods if not is_terminating(p)),
                                     key=lambda p: (-pod_priority(p), pod_key(p)))
                    if evict and pending:
                        results = await asyncio.gather(
                            *(self._evict_one(action, p) for p in pending),
                            return_exceptions=True)
                        blocked, erring = [], []
                        for pod, result in zip(pending, results, strict=True):
                            if isinstance(result, PermanentError):
                                raise result
                            if isinstance(result, BaseException):
                                logger.warning("kubernetes: evict %s: %s", pod_key(pod), result)
                                erring.append(pod_key(pod))
                            elif result == "evicted":
                                evicted += 1
                            elif result == "blocked":
                                blocked.append(pod_key(pod))
                            elif result == "hook-failed":
                                self._finish(action, ActionPhase.FAILED,
                                             f"checkpoint hook failed for {pod_key(pod)}; "
                                             f"not evicted{self._hook_note(action)}")
                                return
                    left = sorted(pod_key(p) for p in pods)
                    action.message = (f"draining {request.node}: {evicted} evicted, "
                                      f"{len(left)} left{self._why(blocked, erring)}"
                                      f"{'; ' + note if note else ''}")
                if deadline is not None and time.monotonic() >= deadline:
                    left_text = ", ".join(left[:10]) if left is not None else "unknown"
                    self._finish(action, ActionPhase.FAILED,
                                 f"drain timeout after {timeout:g} s: {evicted} evicted, "
                                 f"left: {left_text}{self._why(blocked, erring)}"
                                 f"{self._hook_note(action)}")
                    return
                await asyncio.sleep(self._retry_delay if blocked or erring else self._poll)
        except GpuHealthError as exc:
            self._finish(action, ActionPhase.FAILED, f"{exc}{self._hook_note(action)}")
        except asyncio.CancelledError:
            self._finish(action, ActionPhase.CANCELLED, "drain cancelled")
            raise

    @staticmethod
    def _why(blocked: Sequence[str], erring: Sequence[str]) -> str:
        parts = []
        if blocked:
            parts.append(f"PodDisruptionBudget: {', '.join(sorted(blocked)[:10])}")
        if erring:
            parts.append(f"API errors: {', '.join(sorted(erring)[:10])}")
        return f" ({'; '.join(parts)})" if parts else ""

    # --- NodeInspector / ReliabilityPublisher ---
    async def node_state(self, node: NodeName, *, workload: bool = True) -> NodeState:
        """Read the node and, unless ``workload=False``, its pods (``running``).

        Raises:
            SchedulerUnavailable: The API server cannot be reached.
            PermanentError: 401/403.

        A node the API server does not know is returned with ``exists=False``.
        """
        try:
            obj = await self._run(self._read_node, node)
        except NodeNotFound:
            return NodeState(node=node, exists=False, schedulable=False)
        with self._lock:
            self._seen[node] = (time.monotonic(), obj)
        pods = await self._run(self._list_pods, node) if workload else []
        annotations = annotations_of(obj)
        labels = labels_of(obj)
        unschedulable = is_unschedulable(obj)
        ready = "Unknown"
        for cond in (obj.status.conditions if obj.status else None) or []:
            if cond.type == "Ready":
                ready = {"True": "Ready", "False": "NotReady"}.get(cond.status, "Unknown")
        words = ready + (",SchedulingDisabled" if unschedulable else "")
        boot_id = boot_id_of(obj)
        return NodeState(
            node=node, exists=True, schedulable=not unschedulable,
            reason=annotations.get(REASON_ANNOTATION, ""),
            owned=unschedulable and annotations.get(CORDONED_ANNOTATION) == "true",
            opted_out=labels.get(OPT_OUT_LABEL) == "true",
            running=sum(1 for p in pods if is_workload(p) and not is_terminating(p)),
            boot_id=boot_id or "", state=words)

    async def set_reliability(self, node: NodeName, score: float) -> None:
        """Label the node ``gpuhealth.io/reliability=<score, 2 decimals>`` (0-1).

        Raises:
            ValueError: ``score`` is not within 0-1.
            NodeNotFound, SchedulerUnavailable, PermanentError: As for :meth:`submit`.
        """
        if not (0.0 <= score <= 1.0):
            raise ValueError(f"reliability score must be within 0-1, got {score}")
        await self._run(self._patch_node, node,
                        {"metadata": {"labels": {RELIABILITY_LABEL: f"{score:.2f}"}}})

    async def published_reliability(self) -> dict[NodeName, float]:
        """Read every node's ``gpuhealth.io/reliability`` label (a paged LIST).

        ``GET /api/v1/nodes?labelSelector=gpuhealth.io/reliability&limit=500``, following
        ``metadata.continue`` (Kubernetes API concepts, "Retrieving large results sets in
        chunks"); the bodies are read as JSON, not into client models. A label that is not
        a score in 0-1 (a person wrote it) is left out, so it is published again.

        Raises:
            SchedulerUnavailable, PermanentError: As for :meth:`submit`.
        """
        return await self._run(self._read_reliability)

    def _read_reliability(self) -> dict[NodeName, float]:
        shown: dict[NodeName, float] = {}
        token: str | None = None
        while True:
            try:
                response = self._core.list_node(
                    label_selector=RELIABILITY_LABEL, limit=LIST_PAGE, _continue=token,
                    _preload_content=False, _request_timeout=self._timeout)
                page = json.loads(response.data)  # type: ignore[attr-defined]  # raw, not a model
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                raise translate(exc, "list nodes") from exc
            except ValueError as exc:
                raise SchedulerUnavailable(f"list nodes: the body is not JSON: {exc}") from exc
            for item in page.get("items") or ():
                meta = item.get("metadata") or {}
                with contextlib.suppress(TypeError, ValueError):
                    score = float((meta.get("labels") or {}).get(RELIABILITY_LABEL, ""))
                    if 0.0 <= score <= 1.0 and meta.get("name"):
                        shown[NodeName(meta["name"])] = score
            token = (page.get("metadata") or {}).get("continue") or None
            if token is None:
                return shown

    async def wait(self, refs: Sequence[str], *, timeout: float = 60.0,
                   interval: float = 0.05) -> list[ActionStatus]:
        """Poll :meth:`status` until every ref is no longer running (tests, CLI).

        Raises:
            TimeoutError: Some ref is still running after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            statuses = [await self.status(ref) for ref in refs]
            if all(s.phase not in (ActionPhase.RUNNING, ActionPhase.PENDING) for s in statuses):
                return statuses
            if time.monotonic() > deadline:
                raise TimeoutError(f"still running after {timeout} s: "
                                   f"{[s.ref for s in statuses if s.phase == ActionPhase.RUNNING]}")
            await asyncio.sleep(interval)

