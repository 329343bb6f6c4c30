"""The Helm chart: lint, render, validate, generated copies, RBAC, the rendered settings.

Renders run offline through Helm's own SDK (``helm-python-sdk``); every object is checked
by ``kubernetes-validate --strict`` against Kubernetes 1.30 and the newest schema it
bundles; the RBAC rules are compared with the Kubernetes client calls of the adapters.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import (
    CHART,
    ROOT,
    VALUE_FILES,
    need,
    objects,
    option_sets,
    render_module,
    rendered,
    values_of,
)

KUBE_VERSIONS = ("1.30.0", "latest")
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
"""prometheus-operator kinds: kubernetes-validate has no schema for them (checked below)."""


def test_option_sets_exist() -> None:
    assert {p.name for p in VALUE_FILES} >= {
        "monitoring-values.yaml", "protective-cordon-values.yaml",
        "existing-secrets-values.yaml", "fleet-values.yaml", "full-dsn-values.yaml"}


@pytest.mark.parametrize("values", option_sets())
def test_chart_lints_strict(values: Path | None) -> None:
    helm = need("helm_python", "helm-python-sdk>=0.2.2")
    for kube in ("v1.30.0", None):
        report = helm.lint(str(CHART), values_of(values), strict=True, namespace="gpuhealth",
                           kube_version=kube)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"]
        assert not problems


@pytest.mark.parametrize("values", option_sets())
def test_every_rendered_object_validates_strict(values: Path | None) -> None:
    kv = need("kubernetes_validate", "kubernetes-validate>=1.37")
    docs = rendered(values)
    assert docs
    checked = 0
    for template, doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in KUBE_VERSIONS:
            version = kv.latest_version() if version == "latest" else version
            try:
                kv.validate(doc, version, True)
            except kv.ValidationError as exc:
                pytest.fail(f"{template} {doc['kind']}/{doc['metadata']['name']} on "
                            f"Kubernetes {version}: {exc}")
            checked += 1
    assert checked >= 2 * 10


def test_the_validator_rejects_an_unknown_field() -> None:
    """The check above can fail: --strict catches a misspelt key."""
    kv = need("kubernetes_validate", "kubernetes-validate>=1.37")
    (ds,) = objects(None, "DaemonSet").values()
    bad = json.loads(json.dumps(ds))
    bad["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.30.0", True)


def test_the_cli_validates_the_committed_manifests() -> None:
    """What an operator runs: kubernetes-validate --strict on deploy/manifests/*.yaml."""
    need("kubernetes_validate", "kubernetes-validate>=1.37")
    files = sorted(str(p) for p in (ROOT / "deploy" / "manifests").glob("*.yaml"))
    assert files
    cli = Path(sys.executable).with_name("kubernetes-validate")
    for version in ("1.30.0", None):
        args = [str(cli), "--strict", "--quiet", *(["-k", version] if version else []), *files]
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def test_committed_manifests_and_chart_files_equal_a_fresh_render() -> None:
    render = render_module()
    assert render.main(["--check"]) == 0, "run: python deploy/render.py"


def test_chart_rules_are_gpuhealth_rules_export(tmp_path: Path) -> None:
    """files/rules.yml is what `gpuhealth rules export` writes now (not only a stale copy)."""
    from click.testing import CliRunner

    from gpuhealth.cli import main

    out = tmp_path / "rules.yml"
    result = CliRunner().invoke(main, ["rules", "export", str(out)])
    assert result.exit_code == 0, result.output
    assert (CHART / "files" / "rules.yml").read_text() == out.read_text()


def test_prometheus_rule_and_dashboards_carry_the_generated_content() -> None:
    values = CHART / "ci" / "monitoring-values.yaml"
    (rule,) = objects(values, "PrometheusRule").values()
    exported = yaml.safe_load((CHART / "files" / "rules.yml").read_text())
    assert rule["spec"] == exported
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    monitors = objects(values, "ServiceMonitor")
    assert set(monitors) == {"gpuhealth-agent", "gpuhealth-controller"}
    for monitor in monitors.values():
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        (endpoint,) = monitor["spec"]["endpoints"]
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "tlsConfig",
                                 "relabelings"}
    dashboards = {name: cm for name, cm in objects(values, "ConfigMap").items()
                  if "dashboard" in name}
    sources = sorted((ROOT / "deploy/grafana/dashboards/prometheus").glob("*.json"))
    assert len(dashboards) == len(sources) == 6
    for source in sources:
        cm = dashboards[f"gpuhealth-dashboard-{source.stem}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (body,) = cm["data"].values()
        assert json.loads(body) == json.loads(source.read_text())


def test_defaults_render_no_crd_and_no_dashboard() -> None:
    kinds = {d["kind"] for _, d in rendered(None)}
    assert not kinds & CRD_KINDS
    assert kinds >= {"DaemonSet", "Deployment", "PodDisruptionBudget", "ServiceAccount",
                     "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Secret",
                     "Service", "ConfigMap", "NetworkPolicy"}


# --- RBAC: exactly the verbs the adapters call -----------------------------------------

API_GROUPS = {"CoreV1Api": "", "CoordinationV1Api": "coordination.k8s.io"}
VERBS = {"read": "get", "list": "list", "patch": "patch", "create": "create",
         "replace": "update", "delete": "delete"}
ADAPTERS = ("remediation/kubernetes.py", "remediation/kubernetes_lease.py")

Rule = tuple[str, str, str]
"""(apiGroup, resource, verb)."""


def api_call(api_class: str, method: str) -> Rule:
    """The RBAC (group, resource, verb) of one generated client method.

    >>> api_call("CoreV1Api", "create_namespaced_pod_eviction")
    ('', 'pods/eviction', 'create')
    >>> api_call("CoreV1Api", "list_pod_for_all_namespaces")
    ('', 'pods', 'list')
    """
    prefix, _, rest = method.partition("_")
    rest = rest.removeprefix("namespaced_").removesuffix("_for_all_namespaces")
    resource, _, sub = rest.partition("_")
    plural = resource + "s"
    return API_GROUPS[api_class], f"{plural}/{sub}" if sub else plural, VERBS[prefix]


def call_sites(path: str) -> dict[str, dict[str, set[tuple[str, str]] | set[str]]]:
    """Per method of each class in ``path``: its API calls and the ``self`` methods it calls.

    API calls are ``self.<attr>.<method>(...)`` where ``self.<attr>`` was assigned a
    ``client.<...>Api`` instance.
    """
    tree = ast.parse((ROOT / path).read_text())
    out: dict[str, dict[str, Any]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        apis: dict[str, str] = {}
        for node in ast.walk(cls):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Attribute)
                    and node.value.func.attr in API_GROUPS):
                for target in node.targets:
                    if isinstance(target, ast.Attribute):
                        apis[target.attr] = node.value.func.attr
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            calls: set[tuple[str, str]] = set()
            local: set[str] = set()
            for node in ast.walk(fn):
                if not isinstance(node, ast.Attribute):
                    continue
                base = node.value
                if (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                        and base.value.id == "self" and base.attr in apis):
                    calls.add((apis[base.attr], node.attr))
                elif isinstance(base, ast.Name) and base.id == "self":
                    local.add(node.attr)
            out[f"{cls.name}.{fn.name}"] = {"api": calls, "self": local}
    return out


def used_rules(roots: list[str] | None = None) -> set[Rule]:
    """The rules the adapters' client calls need: all of them, or those reachable from ``roots``."""
    graph: dict[str, dict[str, Any]] = {}
    for path in ADAPTERS:
        graph.update(call_sites(path))
    todo = list(graph) if roots is None else list(roots)
    seen: set[str] = set()
    rules: set[Rule] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        cls = name.split(".")[0]
        rules |= {api_call(*c) for c in graph[name]["api"]}
        todo += [f"{cls}.{m}" for m in graph[name]["self"]]
    return rules


CONTROLLER_RULES = {
    ("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "patch"), ("", "pods", "list"),
    ("", "pods/eviction", "create"),
    ("coordination.k8s.io", "leases", "get"), ("coordination.k8s.io", "leases", "create"),
    ("coordination.k8s.io", "leases", "update"),
}
"""What the call sites below come to today; a new call site must change this and the chart."""


def test_the_call_sites_are_the_known_ones() -> None:
    assert used_rules() == CONTROLLER_RULES
    # a protective cordon (and its dry run) is a read and a patch of the node
    assert used_rules(["KubernetesScheduler._cordon", "KubernetesScheduler._read_node"]) == {
        ("", "nodes", "get"), ("", "nodes", "patch")}


def granted(values: Path | None, account: str) -> dict[Rule, list[str] | None]:
    """Rules bound to ServiceAccount ``account``: rule -> resourceNames (None: any)."""
    roles = {(d["kind"], d["metadata"]["name"]): d for _, d in rendered(values)
             if d["kind"] in ("ClusterRole", "Role")}
    out: dict[Rule, list[str] | None] = {}
    for _, binding in rendered(values):
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account
                   for s in binding["subjects"]):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb)
                        key = (group, resource, verb)
                        assert key not in out, f"{key} granted twice"
                        out[key] = rule.get("resourceNames")
    return out


@pytest.mark.parametrize("values", option_sets())
def test_rbac_is_exactly_the_adapters_calls(values: Path | None) -> None:
    controller = granted(values, "gpuhealth-controller")
    assert set(controller) == used_rules() == CONTROLLER_RULES
    (settings,) = (tomllib.loads(cm["data"]["gpuhealth.toml"])
                   for name, cm in objects(values, "ConfigMap").items()
                   if name == "gpuhealth-controller")
    lease = settings["remediation"]["election_options"]["name"]
    assert controller[("coordination.k8s.io", "leases", "get")] == [lease]
    assert controller[("coordination.k8s.io", "leases", "update")] == [lease]
    (role,) = objects(values, "Role").values()
    assert role["metadata"]["namespace"] == settings["remediation"]["election_options"][
        "namespace"]

    agent = granted(values, "gpuhealth-agent")
    (sa,) = (d for d in objects(values, "ServiceAccount").values()
             if d["metadata"]["name"] == "gpuhealth-agent")
    (ds,) = objects(values, "DaemonSet").values()
    cordon = values_of(values).get("agent", {}).get("protectiveCordon", {}).get("enabled")
    if cordon:
        assert set(agent) == used_rules(["KubernetesScheduler._cordon",
                                         "KubernetesScheduler._read_node"])
        assert sa["automountServiceAccountToken"] is True
    else:
        assert agent == {}
        assert sa["automountServiceAccountToken"] is False
        assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# --- the rendered gpuhealth settings ----------------------------------------------------


def _settings_env(container: dict[str, Any], **known: str) -> dict[str, str]:
    """The container's literal and fieldRef environment, with $(VAR) expanded."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]),
                                       item["value"])
        elif item["name"] in known:
            env[item["name"]] = known[item["name"]]
    return env


@pytest.mark.parametrize("values", option_sets())
def test_rendered_settings_load_for_their_role(values: Path | None, tmp_path: Path) -> None:
    """Each ConfigMap's TOML loads with the pod's environment and passes `config check`."""
    from gpuhealth.config import fleet_problems, load_settings

    maps = objects(values, "ConfigMap")
    workloads = {"agent": objects(values, "DaemonSet"), "controller": objects(values,
                                                                                "Deployment")}
    for role in ("agent", "controller"):
        text = maps[f"gpuhealth-{role}"]["data"]["gpuhealth.toml"]
        path = tmp_path / f"{role}.toml"
        path.write_text(text)
        (workload,) = workloads[role].values()
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        assert container["args"] == [role, "--config", "/etc/gpuhealth/gpuhealth.toml"]
        env = _settings_env(container, GPUHEALTH_NODE__NAME="gpu-001", POD_NAME="ctl-abc",
                            GPUHEALTH_CONTROLLER__STATE="host=db dbname=gpuhealth",
                            GPUHEALTH_API_TOKEN="t")
        env = {k: v for k, v in env.items() if k.startswith("GPUHEALTH_")}
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        wired = tomllib.loads(text)
        # the Secrets' files are not on this machine: stand-ins, after checking each
        # configured path lies in a mounted folder
        if role == "agent":
            files = {"AGENT__CA_FILE": wired["agent"]["ca_file"],
                     "AGENT__TOKEN_FILE": env.get("GPUHEALTH_AGENT__TOKEN_FILE", "")}
        else:
            files = {f"CONTROLLER__{k.upper()}": wired["controller"][k]
                     for k in ("tls_cert_file", "tls_key_file", "agent_tokens_file")}
            if "GPUHEALTH_CONTROLLER__STATE_PASSWORD_FILE" in env:
                files["CONTROLLER__STATE_PASSWORD_FILE"] = env[
                    "GPUHEALTH_CONTROLLER__STATE_PASSWORD_FILE"]
        for key, configured in files.items():
            assert str(Path(configured).parent) in mounts, (key, configured)
            stand_in = tmp_path / f"{role}-{key}"
            stand_in.write_text("gpu-001 token\n" if "TOKENS" in key else "token\n")
            env[f"GPUHEALTH_{key}"] = str(stand_in)
        settings = load_settings(path, env=env)
        if role == "agent":
            assert settings.node.name == "gpu-001"
            assert files["AGENT__TOKEN_FILE"] == "/etc/gpuhealth/agent-tokens/gpu-001"
            assert settings.agent.controllers == ("https://gpuhealth-controller.gpuhealth.svc:9837",)
            assert settings.alerting.api_enabled is False
            assert str(settings.node.data_dir) in mounts
        else:
            assert settings.remediation.election == "kubernetes"
            assert settings.remediation.identity == "ctl-abc"
            assert settings.controller.state == "host=db dbname=gpuhealth"
            assert settings.controller.listen_address == "0.0.0.0"
            assert settings.controller.tls_cert_file is not None
            from_file = _state_password(values).get("fromFile", True)
            assert (settings.controller.state_password_file is not None) is from_file
            assert not fleet_problems(settings, env)
        expected_dry = values_of(values).get("remediation", {}).get("dryRun", True)
        if role == "controller" or settings.agent.protective_cordon:
            assert settings.remediation.dry_run is expected_dry


def test_agent_has_no_privilege_unless_kmsg() -> None:
    for values in (None, *VALUE_FILES):
        (ds,) = objects(values, "DaemonSet").values()
        pod = ds["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        kmsg = values_of(values).get("agent", {}).get("kernelLog", {}).get("source") == "kmsg"
        assert c["securityContext"]["privileged"] is kmsg
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        if not kmsg:
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["runtimeClassName"] == "nvidia"
        host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        writable = {m["name"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert {n for n in host if n in writable} == {"data"}, "host paths other than the " \
            "data folder are read-only"


def test_controller_pair_spreads_and_survives_drains() -> None:
    (deploy,) = objects(None, "Deployment").values()
    assert deploy["spec"]["replicas"] == 2
    anti = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" in anti
    (pdb,) = objects(None, "PodDisruptionBudget").values()
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == deploy["spec"]["selector"]
    hard = CHART / "ci" / "existing-secrets-values.yaml"
    (deploy,) = objects(hard, "Deployment").values()
    anti = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert list(anti) == ["requiredDuringSchedulingIgnoredDuringExecution"]
    sc = deploy["spec"]["template"]["spec"]["securityContext"]
    assert sc["runAsNonRoot"] is True


@pytest.mark.parametrize("values", option_sets())
def test_the_workloads_can_read_their_secrets(values: Path | None) -> None:
    """A Secret volume's files are root's, group fsGroup: a non-root reader needs g+r."""
    for kind in ("DaemonSet", "Deployment"):
        (workload,) = objects(values, kind).values()
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        uid = container.get("securityContext", {}).get("runAsUser",
                                                       pod["securityContext"].get("runAsUser"))
        for volume in pod["volumes"]:
            if "secret" not in volume:
                continue
            mode = volume["secret"].get("defaultMode", 0o644)
            if uid == 0:
                assert mode & 0o400, (kind, volume["name"])
            else:
                assert pod["securityContext"]["fsGroup"] is not None
                assert mode & 0o040, (kind, volume["name"], oct(mode))
                assert not mode & 0o007, (kind, volume["name"], oct(mode))


def test_values_yaml_documents_every_key() -> None:
    """Every key of values.yaml has a `# --` comment above it, or a parent that has one."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w.-]*):(.*)$", line)
        if not m:
            continue
        indent = len(m[1])
        while documented and documented[-1][0] >= indent:
            documented.pop()
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith(
                "# --"):
            j -= 1
        here = j >= 0 and lines[j].strip().startswith("# --")
        inherited = any(d for _, d in documented)
        if m[3].strip() and not (here or inherited):
            undocumented.append(line.strip())
        documented.append((indent, here or inherited))
    assert not undocumented


# --- secrets that rotate: mounted folders ----------------------------------------------

PASSWORD_FILE = "/etc/gpuhealth/state-password/state-password"


def _state_password(values: Path | None) -> dict[str, Any]:
    return values_of(values).get("secrets", {}).get("controller", {}).get("statePassword", {})


@pytest.mark.parametrize("values", option_sets())
def test_the_state_password_is_a_mounted_secret_file(values: Path | None) -> None:
    """The DSN carries no password; the password is a Secret key mounted as a folder and
    named by GPUHEALTH_CONTROLLER__STATE_PASSWORD_FILE (statePassword.fromFile, the
    default), or nothing is mounted and the DSN is the site's full one (fromFile=false)."""
    chosen = _state_password(values)
    own = values_of(values).get("secrets", {}).get("controller", {})
    (deploy,) = objects(values, "Deployment").values()
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert "secretKeyRef" in env["GPUHEALTH_CONTROLLER__STATE"]["valueFrom"]
    assert "PGPASSWORD" not in env
    controller_secret = own.get("existingSecret") or "gpuhealth-controller"
    chart_secret = objects(values, "Secret").get("gpuhealth-controller")
    assert (chart_secret is None) is bool(own.get("existingSecret"))
    if chart_secret is not None:
        dsn = chart_secret["stringData"]["state-dsn"]
        assert ("password=" in dsn or ":test-password@" in dsn) is (
            chosen.get("fromFile", True) is False)
    if chosen.get("fromFile", True) is False:
        assert "GPUHEALTH_CONTROLLER__STATE_PASSWORD_FILE" not in env
        assert "state-password" not in volumes
        assert "state-password" not in mounts
        if chart_secret is not None:
            assert set(chart_secret["stringData"]) == {"agent-tokens", "state-dsn",
                                                       "api-token"}
        return
    assert env["GPUHEALTH_CONTROLLER__STATE_PASSWORD_FILE"] == {
        "name": "GPUHEALTH_CONTROLLER__STATE_PASSWORD_FILE", "value": PASSWORD_FILE}
    key = chosen.get("key", "state-password")
    assert volumes["state-password"]["secret"] == {
        "secretName": chosen.get("existingSecret") or controller_secret,
        "defaultMode": 0o440, "items": [{"key": key, "path": "state-password"}]}
    assert mounts["state-password"] == {"name": "state-password", "readOnly": True,
                                        "mountPath": str(Path(PASSWORD_FILE).parent)}
    if chart_secret is not None and not chosen.get("existingSecret"):
        assert chart_secret["stringData"][key] == chosen.get("value", "")


@pytest.mark.parametrize("values", option_sets())
def test_rotating_secrets_are_mounted_as_folders(values: Path | None) -> None:
    """kubelet updates a Secret volume in place but never a subPath mount: the agent
    tokens, the TLS pair and the password, which the processes re-read, are folders."""
    for kind, wanted in (("DaemonSet", {"agent-token", "tls"}),
                         ("Deployment", {"agent-tokens", "tls"})):
        (workload,) = objects(values, kind).values()
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        secrets = {v["name"] for v in pod["volumes"] if "secret" in v}
        assert secrets >= wanted
        for mount in container["volumeMounts"]:
            if mount["name"] in secrets:
                assert "subPath" not in mount, (kind, mount)
                assert mount["readOnly"] is True, (kind, mount)


@pytest.mark.parametrize("controller", [
    {"stateDsn": "host=db dbname=gpuhealth user=gpuhealth password=secret"},
    {"stateDsn": "postgresql://gpuhealth:secret@db:5432/gpuhealth"},
    {"stateDsn": "host=db user=gpuhealth", "statePassword": {"fromFile": False,
                                                             "value": "secret"}},
], ids=["keywords", "uri", "value-ignored"])
def test_the_chart_refuses_a_password_in_two_places(controller: dict[str, Any]) -> None:
    """With the password file on, a DSN that carries a password would stop the controller
    (it refuses both): the render fails, naming the values to change."""
    render = render_module()
    with pytest.raises(Exception, match="statePassword"):
        render.render({"secrets": {"controller": controller}})
    fine = {**controller, "statePassword": {"fromFile": False}}
    if "value" not in controller.get("statePassword", {}):
        assert render.render({"secrets": {"controller": fine}})
