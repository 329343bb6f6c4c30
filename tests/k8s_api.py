"""A local stand-in for the Kubernetes API server, for tests of the Kubernetes adapter.

No real API server can run on the test machines (it needs etcd, certificates and a
kubelet), so the tests talk to this threaded HTTP server instead. It follows the
documented Kubernetes API (https://kubernetes.io/docs/reference/kubernetes-api/ and
``api-concepts``) for the subset gpuhealth uses, with the same paths, verbs, content
types, status codes and ``kind: Status`` error bodies:

* ``GET /api/v1/nodes`` (``labelSelector`` with ``key``, ``!key``, ``key=value`` and
  ``key!=value`` terms; ``limit`` and ``continue`` page it, with ``metadata.continue`` and
  ``remainingItemCount`` as the API server sends them), ``GET|PUT|PATCH
  /api/v1/nodes/{name}``: PATCH accepts
  ``application/strategic-merge-patch+json`` (maps merge, ``null`` deletes a key,
  lists are replaced whole, as for ``spec.taints`` which has no patch-merge key),
  ``application/merge-patch+json`` (RFC 7386) and ``application/json-patch+json``
  (RFC 6902: add, remove, replace, test, move, copy; a failed ``test`` is 422).
  A patch or PUT whose ``metadata.resourceVersion`` is not the current one is a
  409 ``Conflict``. ``resourceVersion`` grows on every write, cluster-wide, as etcd's
  revision does.
* ``GET /api/v1/pods?fieldSelector=spec.nodeName=N`` (also ``metadata.namespace``,
  ``status.phase`` and ``!=``), ``GET /api/v1/namespaces/{ns}/pods[/{name}]``.
* ``POST /api/v1/namespaces/{ns}/pods/{name}/eviction`` (``policy/v1`` Eviction): 201
  with a ``Success`` Status; 429 ``TooManyRequests`` with a ``DisruptionBudget`` cause
  while the pod's PodDisruptionBudget forbids it (set per pod with
  :meth:`K8sApi.block_evictions`); 404 for a missing pod. An evicted pod gets a
  ``deletionTimestamp`` and disappears once its grace period (the eviction's
  ``deleteOptions.gracePeriodSeconds``, else the pod's
  ``terminationGracePeriodSeconds``) has passed; a pod owned by a ReplicaSet is then
  recreated under a new name on :attr:`K8sApi.reschedule_to` (its "controller").
  Evicting a pod that is already terminating is accepted and changes nothing, as the
  real server does.
* ``coordination.k8s.io/v1`` Leases:
  ``GET|POST /apis/coordination.k8s.io/v1/namespaces/{ns}/leases`` and
  ``GET|PUT|DELETE .../leases/{name}`` (POST of an existing name is 409
  ``AlreadyExists``; PUT with a stale ``resourceVersion`` is 409 ``Conflict``;
  ``renewTime``/``acquireTime`` must be ``MicroTime``, six fraction digits, else 400).

Every request is counted per ``"<VERB> <kind>"`` (``"POST eviction"``, ``"PATCH node"``)
in :attr:`K8sApi.requests`, accepted evictions per ``"ns/name"`` in
:attr:`K8sApi.evictions`, so tests can assert "exactly once". :meth:`K8sApi.fail`
injects status codes (500, 429, 403...) for the next matching requests, and
:meth:`K8sApi.on_request` lets a test change the state between a read and a write
(to provoke a 409).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

JsonObj = dict[str, Any]

NODE_INFO_KEYS = (
    "architecture", "bootID", "containerRuntimeVersion", "kernelVersion", "kubeProxyVersion",
    "kubeletVersion", "machineID", "operatingSystem", "osImage", "systemUUID",
)


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str, *, name: str = "", kind: str = "",
                causes: list[JsonObj] | None = None) -> JsonObj:
    """A ``metav1.Status`` failure object as the API server writes it."""
    details: JsonObj = {}
    if name:
        details["name"] = name
    if kind:
        details["kind"] = kind
    if causes:
        details["causes"] = causes
    body: JsonObj = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                     "status": "Failure", "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, **kw: Any) -> None:
        super().__init__(message)
        self.code = code
        self.body = status_body(code, reason, message, **kw)


def make_node(name: str, *, boot_id: str = "boot-1", unschedulable: bool = False,
              labels: dict[str, str] | None = None,
              annotations: dict[str, str] | None = None,
              taints: list[JsonObj] | None = None) -> JsonObj:
    """A ``v1.Node`` with the fields a kubelet fills in (all of ``nodeInfo``)."""
    info = dict.fromkeys(NODE_INFO_KEYS, "")
    info.update({"architecture": "amd64", "bootID": boot_id, "operatingSystem": "linux",
                 "kubeletVersion": "v1.33.0", "kubeProxyVersion": "v1.33.0",
                 "containerRuntimeVersion": "containerd://1.7.0", "kernelVersion": "6.1.0",
                 "osImage": "Debian GNU/Linux 12 (bookworm)", "machineID": name,
                 "systemUUID": name})
    node: JsonObj = {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "uid": str(uuid.uuid4()),
                     "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                     "annotations": dict(annotations or {})},
        "spec": {},
        "status": {"nodeInfo": info,
                   "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                   "message": "kubelet is posting ready status"}]},
    }
    if unschedulable:
        node["spec"]["unschedulable"] = True
    if taints:
        node["spec"]["taints"] = list(taints)
    return node


def make_pod(name: str, node: str, *, namespace: str = "default", owner_kind: str | None = None,
             gpus: int = 0, annotations: dict[str, str] | None = None, phase: str = "Running",
             grace_seconds: int = 0, mirror: bool = False, priority: int | None = None,
             priority_class: str | None = None, started_at: float | None = None,
             owner_uid: str | None = None) -> JsonObj:
    """A ``v1.Pod`` bound to ``node``; ``owner_kind`` ``DaemonSet``/``ReplicaSet``/``None``.

    ``priority`` and ``priority_class`` set ``spec.priority`` and ``spec.priorityClassName``
    (what the PriorityClass admission plugin fills in from the class); ``started_at``
    (epoch s) sets ``status.startTime``; ``owner_uid`` the controller's uid (pods of one
    ReplicaSet share it). An empty ``node`` is a pod not yet scheduled.
    """
    meta: JsonObj = {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                     "annotations": dict(annotations or {})}
    if mirror:
        meta["annotations"]["kubernetes.io/config.mirror"] = "abc123"
    if owner_kind:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner_kind,
                                    "name": f"{name}-owner",
                                    "uid": owner_uid or str(uuid.uuid4()),
                                    "controller": True}]
    container: JsonObj = {"name": "main", "image": "busybox"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)},
                                  "requests": {"nvidia.com/gpu": str(gpus)}}
    spec: JsonObj = {"nodeName": node, "containers": [container],
                     "terminationGracePeriodSeconds": grace_seconds}
    if not node:
        del spec["nodeName"]
    if priority is not None:
        spec["priority"] = priority
    if priority_class is not None:
        spec["priorityClassName"] = priority_class
    status: JsonObj = {"phase": phase}
    if started_at is not None:
        status["startTime"] = rfc3339(started_at)
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": spec,
            "status": status}


# --- patch semantics --------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; also the strategic merge of maps and of lists without
    a patch-merge key (lists are replaced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            raise ApiError(400, "BadRequest", f"unsupported strategic-merge directive {key}")
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")
"""metav1.MicroTime as the API server parses it (Go layout RFC3339Micro)."""


def check_lease_times(lease: JsonObj) -> None:
    for key in ("acquireTime", "renewTime"):
        value = (lease.get("spec") or {}).get(key)
        if value is not None and not MICRO_TIME.fullmatch(str(value)):
            raise ApiError(400, "BadRequest",
                           f'Lease in version "v1" cannot be handled as a Lease: '
                           f'parsing time "{value}" as "2006-01-02T15:04:05.000000Z07:00": '
                           f"cannot parse as RFC3339Micro")


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"json patch path {path!r} does not start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(doc, list):
            doc = doc[int(part)]
        elif isinstance(doc, dict):
            doc = doc[part]
        else:
            raise KeyError(part)
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch; a failed ``test`` or a missing path is 422 as in Kubernetes."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json patch body must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            name = op["op"]
            parts = _pointer(op["path"])
            parent: Any = _walk(doc, parts[:-1]) if parts else None
            last = parts[-1] if parts else ""
            if name == "test":
                if _walk(doc, parts) != op["value"]:
                    raise ApiError(422, "Invalid",
                                   f"the server rejected our request due to an error in our "
                                   f"request: testing value {op['path']} failed")
                continue
            if name in ("move", "copy"):
                value = copy.deepcopy(_walk(doc, _pointer(op["from"])))
                if name == "move":
                    src = _pointer(op["from"])
                    holder = _walk(doc, src[:-1])
                    if isinstance(holder, list):
                        holder.pop(int(src[-1]))
                    else:
                        del holder[src[-1]]
                name, op = "add", {**op, "value": value}
            if name == "remove":
                if isinstance(parent, list):
                    parent.pop(int(last))
                else:
                    del parent[last]
            elif name in ("add", "replace"):
                if not parts:
                    doc = copy.deepcopy(op["value"])
                elif isinstance(parent, list):
                    if name == "add":
                        index = len(parent) if last == "-" else int(last)
                        parent.insert(index, copy.deepcopy(op["value"]))
                    else:
                        parent[int(last)] = copy.deepcopy(op["value"])
                else:
                    if name == "replace":
                        _walk(parent, [last])  # KeyError if absent (RFC 6902 4.3)
                    parent[last] = copy.deepcopy(op["value"])
            else:
                raise ApiError(422, "Invalid", f"unknown json patch op {name!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, "Invalid",
                           f"the server rejected our request due to an error in our request: "
                           f"{op!r}: {exc!r}") from exc
    return doc


# --- the server --------------------------------------------------------------------------

@dataclass
class _Failure:
    method: str
    pattern: re.Pattern[str]
    code: int
    remaining: int
    retry_after: int | None


class K8sApi:
    """The API state and its HTTP server; start with :func:`running_k8s_api`.

    Attributes:
        url: ``http://127.0.0.1:<port>`` once started.
        requests: ``Counter`` of ``"<VERB> <kind>"`` for every request served.
        evictions: ``Counter`` of accepted (201) evictions per ``"ns/name"`` that were
            not already terminating.
        eviction_times: Monotonic times of the accepted evictions, for rate checks.
        eviction_order: ``"ns/name"`` of the accepted evictions, in the order served.
        reschedule_to: Node on which a ReplicaSet's evicted pod is recreated, or ``None``.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self.revision = 1
        self.nodes: dict[str, JsonObj] = {}
        self.pods: dict[tuple[str, str], JsonObj] = {}
        # pods by spec.nodeName, as kube-apiserver's watch cache indexes them for the
        # kubelets' and drains' field selectors (pkg/registry/core/pod: NodeNameIndexFunc);
        # a candidate list only: _select still checks every selector term on each pod
        self._pods_by_node: dict[str, set[tuple[str, str]]] = {}
        self.leases: dict[tuple[str, str], JsonObj] = {}
        self.pdb_blocks: dict[tuple[str, str], int | None] = {}
        self.requests: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.eviction_times: list[float] = []
        self.eviction_order: list[str] = []
        self.reschedule_to: str | None = None
        self._deadlines: dict[tuple[str, str], float] = {}
        self._failures: list[_Failure] = []
        self._hooks: list[Callable[[str, str], None]] = []
        self._recreated = 0
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    # --- state set-up (tests) ---
    def _bump(self, obj: JsonObj) -> None:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)

    def add_node(self, name: str, **kw: Any) -> JsonObj:
        with self.lock:
            node = make_node(name, **kw)
            node["metadata"]["creationTimestamp"] = rfc3339(self.clock())
            self._bump(node)
            self.nodes[name] = node
            return node

    def add_pod(self, name: str, node: str, **kw: Any) -> JsonObj:
        with self.lock:
            pod = make_pod(name, node, **kw)
            pod["metadata"]["creationTimestamp"] = rfc3339(self.clock())
            self._bump(pod)
            self._put_pod(pod)
            return pod

    def _put_pod(self, pod: JsonObj) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self.pods[key] = pod
        self._pods_by_node.setdefault(pod["spec"].get("nodeName", ""), set()).add(key)

    def node(self, name: str) -> JsonObj:
        with self.lock:
            return copy.deepcopy(self.nodes[name])

    def edit_node(self, name: str, change: Callable[[JsonObj], None]) -> None:
        """Change a node as another client would (bumps ``resourceVersion``)."""
        with self.lock:
            change(self.nodes[name])
            self._bump(self.nodes[name])

    def pods_on(self, node: str) -> list[str]:
        with self.lock:
            self._sweep()
            return sorted(f"{ns}/{name}" for (ns, name), p in self.pods.items()
                          if p["spec"].get("nodeName") == node)

    def block_evictions(self, namespace: str, name: str, times: int | None = None) -> None:
        """Answer the next ``times`` evictions of the pod with 429 (``None``: until unblocked)."""
        with self.lock:
            self.pdb_blocks[(namespace, name)] = times

    def unblock_evictions(self, namespace: str, name: str) -> None:
        with self.lock:
            self.pdb_blocks.pop((namespace, name), None)

    def fail(self, method: str, path_regex: str, code: int, *, times: int = 1,
             retry_after: int | None = None) -> None:
        """Answer the next ``times`` requests matching with ``code`` and a Status body."""
        with self.lock:
            self._failures.append(_Failure(method, re.compile(path_regex), code, times,
                                           retry_after))

    def on_request(self, hook: Callable[[str, str], None]) -> None:
        """Call ``hook(method, path)`` (under the lock) before each request is served."""
        self._hooks.append(hook)

    # --- time ---
    def _sweep(self) -> None:
        now = self.clock()
        for key, deadline in list(self._deadlines.items()):
            if now >= deadline:
                del self._deadlines[key]
                pod = self.pods.pop(key, None)
                if pod is not None:
                    self._recreate(pod)

    def _recreate(self, pod: JsonObj) -> None:
        owners = pod["metadata"].get("ownerReferences") or []
        if self.reschedule_to is None or not any(o.get("kind") == "ReplicaSet" for o in owners):
            return
        self._recreated += 1
        new = copy.deepcopy(pod)
        meta = new["metadata"]
        base = re.sub(r"-r\d+$", "", meta["name"])
        meta["name"] = f"{base}-r{self._recreated}"
        meta["uid"] = str(uuid.uuid4())
        meta.pop("deletionTimestamp", None)
        meta.pop("deletionGracePeriodSeconds", None)
        new["spec"]["nodeName"] = self.reschedule_to
        new["status"] = {"phase": "Running"}
        self._bump(new)
        self._put_pod(new)

    # --- request handling ---
    def handle(self, method: str, raw_path: str, headers: dict[str, str],
               body: bytes) -> tuple[int, JsonObj, dict[str, str]]:
        split = urlsplit(raw_path)
        path = unquote(split.path)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        with self.lock:
            for hook in self._hooks:
                hook(method, path)
            self._sweep()
            kind = self._kind(path)
            self.requests[f"{method} {kind}"] += 1
            for failure in self._failures:
                if failure.remaining > 0 and failure.method == method \
                        and failure.pattern.search(path):
                    failure.remaining -= 1
                    reasons = {403: "Forbidden", 404: "NotFound", 409: "Conflict",
                               429: "TooManyRequests", 500: "InternalError",
                               503: "ServiceUnavailable"}
                    extra = {"Retry-After": str(failure.retry_after)} \
                        if failure.retry_after is not None else {}
                    return (failure.code,
                            status_body(failure.code, reasons.get(failure.code, "Unknown"),
                                        "injected failure"), extra)
            try:
                payload = json.loads(body) if body else None
                code, obj = self._route(method, path, query,
                                        headers.get("content-type", ""), payload)
            except ApiError as exc:
                return exc.code, exc.body, {}
            except json.JSONDecodeError as exc:
                return 400, status_body(400, "BadRequest", f"invalid JSON body: {exc}"), {}
            return code, obj, {}

    @staticmethod
    def _kind(path: str) -> str:
        if path.endswith("/eviction"):
            return "eviction"
        for marker, kind in (("/leases", "lease"), ("/pods", "pod"), ("/nodes", "node")):
            if marker in path:
                return kind
        return "other"

    def _route(self, method: str, path: str, query: dict[str, str], ctype: str,
               payload: Any) -> tuple[int, JsonObj]:
        if m := re.fullmatch(r"/api/v1/nodes/?", path):
            if method == "GET":
                return 200, self._page("NodeList", self._labelled(query), query)
        elif m := re.fullmatch(r"/api/v1/nodes/([^/]+)", path):
            return self._node(method, m.group(1), ctype, payload)
        elif re.fullmatch(r"/api/v1/pods/?", path) and method == "GET":
            return 200, self._list("PodList", self._select(query, None))
        elif (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/?", path)) and method == "GET":
            return 200, self._list("PodList", self._select(query, m.group(1)))
        elif (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", path)) \
                and method == "GET":
            pod = self.pods.get((m.group(1), m.group(2)))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{m.group(2)}" not found',
                               name=m.group(2), kind="pods")
            return 200, pod
        elif (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction", path)) \
                and method == "POST":
            return self._evict(m.group(1), m.group(2), payload)
        elif m := re.fullmatch(
                r"/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?", path):
            return self._lease(method, m.group(1), m.group(2), payload)
        raise ApiError(404, "NotFound", f"the server could not find the requested resource "
                                        f"({method} {path})")

    def _labelled(self, query: dict[str, str]) -> list[JsonObj]:
        """The nodes matching ``labelSelector`` (``key``, ``!key``, ``key=value``, ``key!=v``)."""
        nodes = list(self.nodes.values())
        for term in filter(None, query.get("labelSelector", "").split(",")):
            m = re.fullmatch(r"(!?)([\w./-]+)(?:(!=|==|=)(.*))?", term)
            if m is None:
                raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
            absent, key, op, value = m.groups()

            def keep(node: JsonObj, absent: str = absent, key: str = key, op: str | None = op,
                     value: str | None = value) -> bool:
                labels = node["metadata"].get("labels") or {}
                if op is None:
                    return (key in labels) != bool(absent)
                return (labels.get(key) == value) == (op != "!=")
            nodes = [n for n in nodes if keep(n)]
        return nodes

    def _page(self, kind: str, items: list[JsonObj], query: dict[str, str]) -> JsonObj:
        """``limit`` and ``continue`` as the API server pages a LIST (the token is opaque)."""
        start = 0
        if token := query.get("continue"):
            try:
                start = int(token.removeprefix("page:"))
            except ValueError:
                raise ApiError(400, "BadRequest", "invalid continue token") from None
        limit = int(query.get("limit") or 0)
        end = start + limit if limit > 0 else len(items)
        page = self._list(kind, items[start:end])
        if end < len(items):
            page["metadata"]["continue"] = f"page:{end}"
            page["metadata"]["remainingItemCount"] = len(items) - end
        return page

    def _list(self, kind: str, items: list[JsonObj]) -> JsonObj:
        return {"kind": kind, "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.revision)}, "items": items}

    def _select(self, query: dict[str, str], namespace: str | None) -> list[JsonObj]:
        terms: list[tuple[str, bool, str]] = []
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            m = re.fullmatch(r"([\w.]+)(!=|==|=)(.*)", term)
            if m is None:
                raise ApiError(400, "BadRequest", f"invalid field selector {term!r}")
            terms.append((m.group(1), m.group(2) != "!=", m.group(3)))
        getters: dict[str, Callable[[JsonObj], str]] = {
            "spec.nodeName": lambda p: p["spec"].get("nodeName", ""),
            "metadata.namespace": lambda p: p["metadata"]["namespace"],
            "metadata.name": lambda p: p["metadata"]["name"],
            "status.phase": lambda p: p["status"].get("phase", ""),
        }
        for field, _, _ in terms:
            if field not in getters:
                raise ApiError(400, "BadRequest",
                               f'"{field}" is not a known field selector: only '
                               f'"{", ".join(getters)}"')
        keys: Iterable[tuple[str, str]] = self.pods.keys()
        on_node = [v for f, eq, v in terms if f == "spec.nodeName" and eq]
        if on_node:
            index = self._pods_by_node.get(on_node[0], set())
            index.intersection_update(self.pods.keys())  # forget deleted pods
            keys = index
        out = []
        for ns, name in sorted(keys):
            pod = self.pods[(ns, name)]
            if namespace is not None and ns != namespace:
                continue
            if all((getters[f](pod) == v) == eq for f, eq, v in terms):
                out.append(pod)
        return out

    def _check_rv(self, current: JsonObj, new: Any, name: str, kind: str) -> None:
        rv = (new.get("metadata") or {}).get("resourceVersion") if isinstance(new, dict) else None
        if rv is not None and rv != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict",
                           f'Operation cannot be fulfilled on {kind} "{name}": the object has '
                           f"been modified; please apply your changes to the latest version "
                           f"and try again", name=name, kind=kind)

    def _node(self, method: str, name: str, ctype: str, payload: Any) -> tuple[int, JsonObj]:
        current = self.nodes.get(name)
        if current is None:
            raise ApiError(404, "NotFound", f'nodes "{name}" not found', name=name, kind="nodes")
        if method == "GET":
            return 200, current
        if method == "PUT":
            if not isinstance(payload, dict) or (payload.get("metadata") or {}).get("name") != name:
                raise ApiError(400, "BadRequest", "the name of the object does not match the URL")
            if not (payload.get("metadata") or {}).get("resourceVersion"):
                raise ApiError(422, "Invalid", "metadata.resourceVersion: Invalid value: 0x0: "
                                               "must be specified for an update")
            self._check_rv(current, payload, name, "nodes")
            new = copy.deepcopy(payload)
        elif method == "PATCH":
            media = ctype.split(";")[0].strip()
            if media in ("application/strategic-merge-patch+json",
                         "application/merge-patch+json"):
                self._check_rv(current, payload, name, "nodes")
                new = merge_patch(current, payload)
            elif media == "application/json-patch+json":
                new = json_patch(current, payload)
            else:
                raise ApiError(415, "UnsupportedMediaType",
                               f"the body of the request was in an unknown format - accepted "
                               f"media types include: application/json-patch+json, "
                               f"application/merge-patch+json, "
                               f"application/strategic-merge-patch+json; got {ctype!r}")
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on nodes")
        if not isinstance(new, dict) or (new.get("metadata") or {}).get("name") != name:
            raise ApiError(422, "Invalid", "metadata.name may not be changed")
        for taint in (new.get("spec") or {}).get("taints") or []:
            if taint.get("effect") not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
                raise ApiError(422, "Invalid", f"spec.taints: Unsupported value: {taint!r}")
        new["metadata"]["uid"] = current["metadata"]["uid"]
        new["status"] = new.get("status") or current["status"]
        self._bump(new)
        self.nodes[name] = new
        return 200, new

    def _evict(self, namespace: str, name: str, payload: Any) -> tuple[int, JsonObj]:
        key = (namespace, name)
        pod = self.pods.get(key)
        if pod is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods")
        if not isinstance(payload, dict) or payload.get("kind", "Eviction") != "Eviction":
            raise ApiError(400, "BadRequest", "body must be a policy/v1 Eviction")
        success = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                   "code": 201}
        if pod["metadata"].get("deletionTimestamp"):
            return 201, success
        if pod["status"].get("phase") not in ("Succeeded", "Failed") and key in self.pdb_blocks:
            remaining = self.pdb_blocks[key]
            if remaining is None or remaining > 0:
                if remaining is not None:
                    self.pdb_blocks[key] = remaining - 1
                raise ApiError(429, "TooManyRequests",
                               "Cannot evict pod as it would violate the pod's disruption "
                               "budget.", causes=[{"reason": "DisruptionBudget",
                                                   "message": "The disruption budget pdb needs "
                                                              "1 healthy pods and has 1 "
                                                              "currently"}])
            del self.pdb_blocks[key]
        grace = ((payload.get("deleteOptions") or {}).get("gracePeriodSeconds"))
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        now = self.clock()
        pod["metadata"]["deletionTimestamp"] = rfc3339(now + grace)
        pod["metadata"]["deletionGracePeriodSeconds"] = grace
        self._bump(pod)
        self._deadlines[key] = now + grace
        self.evictions[f"{namespace}/{name}"] += 1
        self.eviction_times.append(time.monotonic())
        self.eviction_order.append(f"{namespace}/{name}")
        self._sweep()
        return 201, success

    def _lease(self, method: str, namespace: str, name: str | None,
               payload: Any) -> tuple[int, JsonObj]:
        if name is None:
            if method == "GET":
                items = [v for (ns, _), v in sorted(self.leases.items()) if ns == namespace]
                return 200, {"kind": "LeaseList", "apiVersion": "coordination.k8s.io/v1",
                             "metadata": {"resourceVersion": str(self.revision)},
                             "items": items}
            if method == "POST":
                if not isinstance(payload, dict):
                    raise ApiError(400, "BadRequest", "body must be a Lease")
                lname = (payload.get("metadata") or {}).get("name")
                if not lname:
                    raise ApiError(422, "Invalid", "metadata.name: Required value")
                if (namespace, lname) in self.leases:
                    raise ApiError(409, "AlreadyExists", f'leases.coordination.k8s.io "{lname}" '
                                                         f"already exists", name=lname,
                                   kind="leases")
                check_lease_times(payload)
                lease = copy.deepcopy(payload)
                lease.update(kind="Lease", apiVersion="coordination.k8s.io/v1")
                lease["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()))
                lease["metadata"].pop("resourceVersion", None)
                self._bump(lease)
                self.leases[(namespace, lname)] = lease
                return 201, lease
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on leases")
        current = self.leases.get((namespace, name))
        if current is None:
            raise ApiError(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found',
                           name=name, kind="leases")
        if method == "GET":
            return 200, current
        if method == "DELETE":
            del self.leases[(namespace, name)]
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                         "status": "Success", "code": 200}
        if method == "PUT":
            if not isinstance(payload, dict) or \
                    not (payload.get("metadata") or {}).get("resourceVersion"):
                raise ApiError(422, "Invalid", "metadata.resourceVersion: must be specified "
                                               "for an update")
            self._check_rv(current, payload, name, "leases.coordination.k8s.io")
            check_lease_times(payload)
            lease = copy.deepcopy(payload)
            lease.update(kind="Lease", apiVersion="coordination.k8s.io/v1")
            lease["metadata"]["uid"] = current["metadata"]["uid"]
            self._bump(lease)
            self.leases[(namespace, name)] = lease
            return 200, lease
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on leases")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The real API server (Go) sends headers and body in one write; without this the
    # headers-then-body writes meet the client's delayed ACK and each answer waits 40 ms.
    disable_nagle_algorithm = True
    api: K8sApi

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        code, obj, extra = self.api.handle(self.command, self.path, headers, body)
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in extra.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_PATCH = do_POST = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


@contextmanager
def running_k8s_api(*, clock: Callable[[], float] = time.time) -> Iterator[K8sApi]:
    """Start a :class:`K8sApi` on a free loopback port; stop it on exit."""
    api = K8sApi(clock=clock)
    handler = type("Handler", (_Handler,), {"api": api})
    server = _Server(("127.0.0.1", 0), handler)
    api.server = server
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                              name="k8s-api", daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
