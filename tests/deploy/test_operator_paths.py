"""What a fresh operator meets: the chart's values schema, render.py with their own values,
Secrets outside the applied set, and the TOML examples of the fleet docs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

from tests.deploy.conftest import CHART, ROOT, VALUE_FILES, need, render_module

SCHEMA = CHART / "values.schema.json"
MANIFESTS = ROOT / "deploy" / "manifests"
TYPOS = [
    pytest.param({"remediation": {"dryrun": False}}, "dryrun", id="remediation.dryrun"),
    pytest.param({"secrets": {"controler": {"stateDsn": "host=db"}}}, "controler",
                 id="secrets.controler"),
    pytest.param({"agent": {"image": {"tags": "x"}}}, "tags", id="agent.image.tags"),
]


def test_values_yaml_and_every_option_set_meet_the_schema() -> None:
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    for path in [CHART / "values.yaml", *VALUE_FILES]:
        jsonschema.validate(yaml.safe_load(path.read_text()) or {}, schema)


@pytest.mark.parametrize(("values", "key"), TYPOS)
def test_a_misspelt_value_is_refused_by_render_and_lint(values: dict[str, Any],
                                                         key: str) -> None:
    helm = need("helm_python", "helm-python-sdk>=0.2.2")
    render = render_module()
    with pytest.raises(Exception, match=re.escape(key)):
        render.render(values)
    report = helm.lint(str(CHART), values, strict=True, namespace="gpuhealth")
    assert any(key in e for e in report["errors"]), report


def test_render_py_renders_an_operators_values(tmp_path: Path) -> None:
    render_module()
    mine = tmp_path / "mine.yaml"
    mine.write_text("remediation: {dryRun: false, clusterSize: 64}\n")
    more = tmp_path / "more.yaml"
    more.write_text("remediation: {clusterSize: 128}\n")
    script = str(ROOT / "deploy" / "render.py")
    done = subprocess.run([sys.executable, script, "-f", str(mine), "--values", str(more)],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"
             and d["metadata"]["name"] == "gpuhealth-controller"]
    settings = tomllib.loads(cm["data"]["gpuhealth.toml"])
    assert settings["remediation"]["dry_run"] is False
    assert settings["remediation"]["cluster_size"] == 128  # the later file wins
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, script, "-f", str(mine), "--out", str(out)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert (out / "controller-deployment.yaml").is_file()
    assert (out / "secrets.yaml").is_file()  # the operator's own render carries its Secrets


def test_render_py_refuses_a_typo_and_a_missing_file(tmp_path: Path) -> None:
    render_module()
    bad = tmp_path / "bad.yaml"
    bad.write_text("remediation: {dryrun: false}\n")
    script = str(ROOT / "deploy" / "render.py")
    done = subprocess.run([sys.executable, script, "-f", str(bad)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert "dryrun" in done.stderr
    assert not done.stdout
    done = subprocess.run([sys.executable, script, "-f", str(tmp_path / "nope.yaml")],
                          capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "nope.yaml" in done.stderr


def test_kubectl_apply_of_the_manifests_writes_no_secret() -> None:
    """kubectl apply -f DIR reads .yaml, .yml and .json: none of them holds a Secret."""
    applied = [p for p in MANIFESTS.iterdir() if p.suffix in (".yaml", ".yml", ".json")]
    assert applied
    for path in applied:
        kinds = {d["kind"] for d in yaml.safe_load_all(path.read_text()) if d}
        assert "Secret" not in kinds, path
    example = MANIFESTS / "secrets.yaml.example"
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(example.read_text()) if d
             and d["kind"] == "Secret"}
    assert {"gpuhealth-controller-tls", "gpuhealth-controller",
            "gpuhealth-agent-tokens"} <= names


def test_the_secrets_example_validates() -> None:
    kv = need("kubernetes_validate", "kubernetes-validate>=1.37")
    example = MANIFESTS / "secrets.yaml.example"
    for doc in yaml.safe_load_all(example.read_text()):
        if doc:
            kv.validate(doc, "1.30.0", True)


# --- the TOML examples of docs/fleet.md and deploy/slurm/README.md -------------------

def toml_examples(path: Path) -> list[str]:
    text = path.read_text()
    return [textwrap.dedent(m.group(2))
            for m in re.finditer(r"^( *)```toml\n(.*?)^\1```", text, re.S | re.M)]


def settings_of(example: str, tmp_path: Path) -> Any:
    """The example's settings, validated as load_settings does but without its checks of
    files and environment variables (the example's paths do not exist here)."""
    from gpuhealth.config import Settings

    return Settings.model_validate({**tomllib.loads(example),
                                    "source": str(tmp_path / "example.toml")})


def example_with(path: Path, section: str) -> str:
    (found,) = [e for e in toml_examples(path) if section in tomllib.loads(e)]
    return found


DOCS = [ROOT / "docs" / "fleet.md", ROOT / "deploy" / "slurm" / "README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_controller_examples_pass_the_checks_the_controller_makes(doc: Path,
                                                                  tmp_path: Path) -> None:
    from gpuhealth.compose import scheduler_problems
    from gpuhealth.controller import listener_token_problem

    example = example_with(doc, "controller")
    table = tomllib.loads(example)
    assert "password" not in table["controller"]["state"]
    assert table["controller"]["state_password_file"]
    settings = settings_of(example, tmp_path)
    assert scheduler_problems(settings) == []
    name = table["alerting"]["api_token_env"]
    assert listener_token_problem(settings, {name: "t0ken"}) is None
    problem = listener_token_problem(settings, {})
    assert problem
    assert name in problem
    assert "principle" not in problem


def test_a_misspelt_scheduler_option_is_named_with_the_valid_ones(tmp_path: Path) -> None:
    from gpuhealth.compose import scheduler_problems

    example = example_with(ROOT / "deploy" / "slurm" / "README.md", "controller")
    example = re.sub(r"^scheduler_options = .*$",
                     'scheduler_options = { scontrol = "/usr/bin/scontrol" }', example,
                     flags=re.M)
    (problem,) = scheduler_problems(settings_of(example, tmp_path))
    assert "'scontrol'" in problem
    assert "scontrol_path" in problem
    assert "command_timeout_seconds" in problem


def test_agent_example_is_scrapable_and_names_its_token(tmp_path: Path) -> None:
    example = example_with(ROOT / "docs" / "fleet.md", "agent")
    settings = settings_of(example, tmp_path)
    assert settings.metrics.listen_address not in ("127.0.0.1", "::1", "localhost")
    assert settings.agent.token_env == "GPUHEALTH_AGENT_TOKEN"  # the unit's agent.env
    assert ":9835" in (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()


def test_slurm_install_steps_agree() -> None:
    slurm = (ROOT / "deploy" / "slurm" / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for text in (slurm, readme):
        assert "install -d -m 0750 -g gpuhealth /etc/gpuhealth" in text
        assert "pip install gpuhealth" not in text
        assert "'gpuhealth[controller]'" not in text
    useradd = {line.strip() for text in (slurm, readme) for line in text.splitlines()
               if line.strip().startswith("useradd")}
    assert useradd == {"useradd --system --home-dir /var/lib/gpuhealth --shell "
                       "/usr/sbin/nologin gpuhealth"}


def test_a_dry_run_start_refuses_a_misspelt_scheduler_option(tmp_path: Path) -> None:
    from core.errors import ConfigError
    from gpuhealth.compose import build_schedulers

    example = example_with(ROOT / "deploy" / "slurm" / "README.md", "controller")
    assert "dry_run = true" in example
    assert build_schedulers(settings_of(example, tmp_path)) == (None, None)
    example = example.replace("command_timeout_seconds", "timeout_seconds")
    with pytest.raises(ConfigError, match=r"'timeout_seconds'.*command_timeout_seconds"):
        build_schedulers(settings_of(example, tmp_path))


def test_config_check_words_for_a_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    from click.testing import CliRunner

    from gpuhealth.cli import main

    monkeypatch.delenv("GPUHEALTH_API_TOKEN", raising=False)
    agent = tmp_path / "agent.toml"
    agent.write_text('[agent]\ncontrollers = ["http://10.0.0.1:9837"]\ntoken_env = "T"\n')
    result = CliRunner().invoke(main, ["config", "check", "--role", "agent", str(agent)],
                                env={"T": "x"})
    assert result.exit_code == 1
    assert "[agent] controllers: 'http://10.0.0.1:9837'" in result.output
    tokens = tmp_path / "agent-tokens"
    tokens.write_text("gpu-001 abc\n")
    controller = tmp_path / "controller.toml"
    controller.write_text(f'[controller]\nagent_tokens_file = "{tokens}"\n')
    result = CliRunner().invoke(main, ["config", "check", "--role", "controller",
                                       str(controller)])
    assert result.exit_code == 0, result.output
    assert "collector" not in result.output
