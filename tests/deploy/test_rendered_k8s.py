"""The chart's rendered configuration against the Kubernetes API stand-in, under its RBAC.

The controller's and the agent's ``[remediation]`` adapters are built from the TOML the
chart renders (the only change: ``in_cluster = true`` becomes the stand-in's URL), and the
stand-in answers 403 to every request the rendered RBAC does not allow that
ServiceAccount, as the API server's RBAC authorizer does. Each remediation step, the
node reads and writes and the Lease election then run through it: none may be refused.
"""

from __future__ import annotations

import asyncio
import re
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from core import plugins
from core.protocols import LeaderElector, SchedulerAdapter
from core.records import ActionPhase, ActionRequest, EntityId, NodeName, RemediationStep
from tests.deploy.conftest import CHART, objects, rendered
from tests.k8s_api import K8sApi, running_k8s_api, status_body

Attributes = tuple[str, str, str, str | None, str | None]
"""(apiGroup, resource, verb, namespace, name) of one request."""


def attributes(method: str, raw_path: str) -> Attributes:
    """The RBAC request attributes of one API request (kube-apiserver's RequestInfo)."""
    split = urlsplit(raw_path)
    query = parse_qs(split.query)
    parts = split.path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    namespace = None
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    if name is None:
        verb = {"GET": "watch" if query.get("watch") == ["true"] else "list",
                "POST": "create", "DELETE": "deletecollection"}[method]
    else:
        verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete",
                "POST": "create"}[method]
    return group, resource, verb, namespace, name


def authorizer(values: Path | None, account: str) -> Callable[[Attributes], bool]:
    """What the rendered (Cluster)Roles bound to ``account`` allow."""
    docs = [d for _, d in rendered(values)]
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("ClusterRole", "Role")}
    grants: list[tuple[str | None, dict[str, Any]]] = []  # (namespace or None: cluster, rule)
    for binding in (d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account
                   for s in binding["subjects"]):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" \
            else None
        grants += [(scope, rule) for rule in role["rules"]]

    def allowed(request: Attributes) -> bool:
        group, resource, verb, namespace, name = request
        for scope, rule in grants:
            if scope is not None and namespace != scope:
                continue
            names = rule.get("resourceNames")
            if (group in rule["apiGroups"] and resource in rule["resources"]
                    and verb in rule["verbs"] and (not names or name in names)):
                return True
        return False

    return allowed


@pytest.fixture
def api() -> Iterator[K8sApi]:
    with running_k8s_api() as server:
        yield server


def enforce(api: K8sApi, allowed: Callable[[Attributes], bool]) -> list[Attributes]:
    """Make the stand-in refuse what ``allowed`` refuses; return the list of refusals."""
    refused: list[Attributes] = []
    serve = api.handle

    def handle(method: str, raw_path: str, headers: dict[str, str],
               body: bytes) -> tuple[int, Any, dict[str, str]]:
        request = attributes(method, raw_path)
        if not allowed(request):
            refused.append(request)
            group, resource, verb, _, _ = request
            return 403, status_body(403, "Forbidden", f'"{verb}" on "{resource}" in group '
                                    f'"{group}" is forbidden (rendered RBAC)'), {}
        return serve(method, raw_path, headers, body)

    api.handle = handle  # type: ignore[method-assign]
    return refused


def settings_of(values: Path | None, role: str) -> dict[str, Any]:
    (cm,) = (c for n, c in objects(values, "ConfigMap").items() if n == f"gpuhealth-{role}")
    return tomllib.loads(cm["data"]["gpuhealth.toml"])


def in_stand_in(options: dict[str, Any], api: K8sApi) -> dict[str, Any]:
    assert options.pop("in_cluster") is True
    return {**options, "host": api.url}


def request(step: RemediationStep, key: str, **attrs: str) -> ActionRequest:
    return ActionRequest(step=step, node=NodeName("gpu-001"), entity=EntityId("node"),
                         reason=f"gpuhealth: deploy test {step.value}", idempotency_key=key,
                         dry_run=False, attrs=attrs)


async def carry_out(adapter: Any, req: ActionRequest) -> Any:
    ref = await adapter.submit(req)
    (status,) = await adapter.wait([ref], timeout=20.0)
    return status


def test_authorizer_refuses_what_rbac_does_not_grant(api: K8sApi) -> None:
    allowed = authorizer(None, "gpuhealth-controller")
    assert allowed(attributes("GET", "/api/v1/nodes/gpu-001"))
    assert allowed(attributes("GET", "/api/v1/nodes"))  # list nodes: scores read back
    assert not allowed(attributes("DELETE", "/api/v1/nodes/gpu-001"))
    assert not allowed(attributes("DELETE", "/api/v1/namespaces/a/pods/p"))
    lease = "/apis/coordination.k8s.io/v1/namespaces/gpuhealth/leases"
    assert allowed(attributes("POST", lease))
    assert allowed(attributes("PUT", f"{lease}/gpuhealth-controller"))
    assert not allowed(attributes("PUT", f"{lease}/someone-else"))
    assert not allowed(attributes("GET", lease.replace("gpuhealth", "kube-system", 1)
                                  + "/gpuhealth-controller"))
    assert not authorizer(None, "gpuhealth-agent")(attributes("GET", "/api/v1/nodes/gpu-001"))


def test_rendered_controller_remediates_and_elects_within_its_rbac(api: K8sApi) -> None:
    settings = settings_of(None, "controller")["remediation"]
    assert settings["scheduler"] == settings["election"] == "kubernetes"
    refused = enforce(api, authorizer(None, "gpuhealth-controller"))
    api.add_node("gpu-001")
    api.add_pod("train", "gpu-001", owner_kind="ReplicaSet", gpus=8)
    api.add_pod("dcgm", "gpu-001", owner_kind="DaemonSet", namespace="kube-system")

    elector = plugins.build("gpuhealth.electors", "kubernetes",
                            {**in_stand_in(dict(settings["election_options"]), api),
                             "identity": "gpuhealth-controller-a"}, expect=LeaderElector)
    other = plugins.build("gpuhealth.electors", "kubernetes",
                          {**in_stand_in(dict(settings["election_options"]), api),
                           "identity": "gpuhealth-controller-b"}, expect=LeaderElector)
    assert elector.try_acquire()
    assert not other.try_acquire()
    assert elector.renew()
    assert other.leader() == "gpuhealth-controller-a"
    elector.release()
    assert other.try_acquire()

    scheduler = plugins.build("gpuhealth.schedulers", "kubernetes",
                              in_stand_in(dict(settings["scheduler_options"]), api),
                              expect=SchedulerAdapter)

    async def steps() -> list[Any]:
        out = [await scheduler.node_state(NodeName("gpu-001"))]  # type: ignore[attr-defined]
        for step, attrs in ((RemediationStep.CORDON, {}),
                            (RemediationStep.DRAIN, {"scope": "node", "mode": "evict"}),
                            (RemediationStep.HAND_OFF, {}),
                            (RemediationStep.RESUME, {})):
            out.append(await carry_out(scheduler, request(step, f"k/{step.value}", **attrs)))
        ref = await scheduler.submit(request(RemediationStep.REBOOT, "k/reboot"))
        out.append(await scheduler.status(ref))
        await scheduler.set_reliability(NodeName("gpu-001"), 0.5)  # type: ignore[attr-defined]
        return out

    results = asyncio.run(steps())
    scheduler.close()  # type: ignore[attr-defined]
    assert refused == []
    for status in results[1:5]:
        assert status.phase == ActionPhase.SUCCEEDED, status.message
    assert results[5].phase == ActionPhase.RUNNING, results[5].message  # waits for a new bootID
    assert api.evictions == {"default/train": 1}
    assert {re.sub(r"\s.*", "", k) for k in api.requests} <= {"GET", "PATCH", "POST", "PUT"}


def test_rendered_agent_cordons_its_node_only_with_protective_cordon(api: K8sApi) -> None:
    values = CHART / "ci" / "protective-cordon-values.yaml"
    settings = settings_of(values, "agent")
    assert settings["agent"]["protective_cordon"] is True
    remediation = settings["remediation"]
    refused = enforce(api, authorizer(values, "gpuhealth-agent"))
    api.add_node("gpu-001")
    scheduler = plugins.build("gpuhealth.schedulers", remediation["scheduler"],
                              in_stand_in(dict(remediation["scheduler_options"]), api),
                              expect=SchedulerAdapter)
    cordon = request(RemediationStep.CORDON, "protective/gpu-001/1", when="now", scope="node")
    dry = ActionRequest(step=RemediationStep.CORDON, node=NodeName("gpu-001"),
                        entity=EntityId("node"), reason="gpuhealth: dry", dry_run=True,
                        idempotency_key="protective/gpu-001/0")
    results = asyncio.run(asyncio.wait_for(_both(scheduler, dry, cordon), 30))
    scheduler.close()  # type: ignore[attr-defined]
    assert refused == []
    assert [s.phase for s in results] == [ActionPhase.SUCCEEDED] * 2
    assert api.node("gpu-001")["spec"]["unschedulable"] is True
    # and nothing else: a drain needs pods, which the agent may not list
    refused_before = len(refused)
    drain = plugins.build("gpuhealth.schedulers", "kubernetes",
                          in_stand_in(dict(remediation["scheduler_options"]), api),
                          expect=SchedulerAdapter)

    async def try_drain() -> Any:
        try:
            return await carry_out(drain, request(RemediationStep.DRAIN, "d", scope="node",
                                                  mode="evict"))
        except Exception as exc:
            return exc

    outcome = asyncio.run(try_drain())
    drain.close()  # type: ignore[attr-defined]
    assert len(refused) > refused_before
    assert ("", "pods", "list", None, None) in refused
    assert not (hasattr(outcome, "phase") and outcome.phase == ActionPhase.SUCCEEDED)


async def _both(scheduler: Any, *reqs: ActionRequest) -> list[Any]:
    return [await carry_out(scheduler, r) for r in reqs]
