"""One configuration, the same guards for every entry point (issue 13, composition root).

``run`` (the service), ``replay --live`` and ``controller`` each build their pipeline
from the same settings file; the guards read back from the built policy and engine
(breaker, budget, opt-out, reserve, rate limit, approvals, probation, step timeout)
must be identical. Before the composition root, ``replay --live`` built the breaker
switched off and ignored ``cluster_size``, ``opt_out_nodes`` and
``max_disrupted_fraction``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from core.records import RemediationStep, Severity
from gpuhealth import cli
from gpuhealth import compose as compose_mod
from gpuhealth.compose import Guards, guards, guards_of
from gpuhealth.config import load_settings
from gpuhealth.replay import replay
from gpuhealth.service import Service

CONFIG = """
[node]
name = "ctl-a"
data_dir = "{data}"

[metrics]
enabled = false

[alerting]
api_enabled = false

[report]
enabled = false

[remediation]
dry_run = false
scheduler = "webhook"
scheduler_options = {{ url = "http://127.0.0.1:9/remediate", secret_env = "GH_TEST_HOOK" }}
cluster_size = 40
max_disrupted_fraction = 0.2
critical_reserve_fraction = 0.5
opt_out_nodes = ["gpu-07", "gpu-08"]
max_actions_per_minute = 12
approval_min_severity = "critical"
approval_steps = ["reboot"]
probation_seconds = "20m"
step_timeout_seconds = "15m"
breaker_window_seconds = "5m"
"""


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GH_TEST_HOOK", "whsec_" + "c2VjcmV0LXNlY3JldC1zZWNyZXQ=")
    path = tmp_path / "gpuhealth.toml"
    path.write_text(CONFIG.format(data=tmp_path / "data"))
    return path


def _run_guards(config: Path) -> Guards:
    service = Service(load_settings(config, env={}), stop=threading.Event())
    service.settings.node.data_dir.mkdir(parents=True, exist_ok=True)
    pipeline = service._build_pipeline()
    try:
        return guards_of(pipeline)
    finally:
        pipeline.close()


def _replay_live_guards(config: Path, monkeypatch: pytest.MonkeyPatch) -> Guards:
    built: list[Guards] = []
    real = compose_mod.replay_pipeline

    def spy(**kwargs):  # type: ignore[no-untyped-def]
        pipeline = real(**kwargs)
        built.append(guards_of(pipeline))
        return pipeline

    monkeypatch.setattr("gpuhealth.replay.replay_pipeline", spy)
    options = cli._live_remediation(str(config), cluster_size=None,
                                    max_disrupted_fraction=None)
    options.pop("audit_log")
    replay([], **options)
    assert len(built) == 1
    return built[0]


def test_the_guards_are_read_from_the_settings(config: Path) -> None:
    g = guards(load_settings(config, env={}))
    assert g.cluster_size == 40
    assert g.disruption_limit == 8
    assert g.breaker_max_nodes == 8  # max(3, ceil(0.2 x 40)): never switched off
    assert g.opt_out_nodes == frozenset({"gpu-07", "gpu-08"})
    assert g.critical_reserve_fraction == 0.5
    assert g.max_actions_per_minute == 12
    assert g.approval_min_severity is Severity.CRITICAL
    assert g.approval_steps == frozenset({RemediationStep.REBOOT})
    assert g.probation_seconds == 1200.0
    assert g.step_timeout_seconds == 900.0
    assert g.breaker_window_seconds == 300.0


def test_run_and_replay_live_build_identical_guards(
        config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = guards(load_settings(config, env={}))
    assert _run_guards(config) == expected
    assert _replay_live_guards(config, monkeypatch) == expected


def test_the_controller_builds_the_same_guards(config: Path, tmp_path: Path) -> None:
    from gpuhealth.controller import Controller

    tokens = tmp_path / "tokens"
    tokens.write_text("gpu-01 tok-0123456789abcdef\n")
    text = config.read_text() + f'\n[controller]\nagent_tokens_file = "{tokens}"\n'
    config.write_text(text)
    settings = load_settings(config, env={})
    settings.node.data_dir.mkdir(parents=True, exist_ok=True)
    controller = Controller(settings)
    try:
        assert guards_of(controller.pipeline) == guards(settings) == _run_guards(config)
    finally:
        controller.pipeline.close()
        controller.store.close()


def test_a_command_line_budget_wins_over_the_file_in_replay_live(config: Path) -> None:
    options = cli._live_remediation(str(config), cluster_size=100,
                                    max_disrupted_fraction=0.05)
    g = options["guard"]
    assert (g.cluster_size, g.disruption_limit, g.breaker_max_nodes) == (100, 5, 20)
    assert g.opt_out_nodes == frozenset({"gpu-07", "gpu-08"})  # the rest from the file
