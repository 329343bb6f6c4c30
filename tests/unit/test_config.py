from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.errors import ConfigError
from core.records import Severity
from gpuhealth.config import (
    DEFAULT_METRICS_PORT,
    check,
    load_settings,
    parse_duration,
    webhook_secret,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "gpuhealth.example.toml"


def _write(tmp_path: Path, text: str, name: str = "gpuhealth.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    s = load_settings(None, env={})
    assert s.node.name == socket.gethostname()
    assert s.node.data_dir == Path("gpuhealth-data")
    assert s.metrics.listen_address == "127.0.0.1"
    assert s.metrics.port == DEFAULT_METRICS_PORT == 9835
    assert s.storage.type == "sqlite"
    assert s.storage.path == Path("gpuhealth-data/gpuhealth.sqlite")
    assert s.remediation.audit_log == Path("gpuhealth-data/audit.jsonl")
    assert s.remediation.dry_run is True
    assert s.remediation.max_disrupted_fraction == 0.10
    assert s.remediation.cluster_size == 1
    assert s.remediation.opt_out_nodes == ()
    assert s.alerting.min_severity is Severity.WARNING
    assert s.alerting.webhook_url is None
    assert s.time.timezone == "UTC"
    assert s.inventory == {}
    assert set(s.enabled_collectors()) == {"nvml", "kernel_log", "network", "probe"}
    nvml = s.collectors["nvml"]
    assert nvml.options == {"fast_interval_seconds": 1.0, "slow_interval_seconds": 30.0}
    assert nvml.poll_interval_seconds == 1.0
    assert s.collectors["network"].poll_interval_seconds == 10.0
    assert s.collectors["probe"].options == {"peers": []}


def test_file_values_durations_and_derived_paths(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[node]
name = "gpu-001"
data_dir = "/var/lib/gpuhealth"

[collectors.nvml]
slow_interval_seconds = "1m"

[collectors.kernel_log]
enabled = false

[collectors.dcgm]
type = "dcgm_exporter"
url = "http://127.0.0.1:9400/metrics"
interval_seconds = "15s"

[storage]
retention_seconds = "3d"

[remediation]
opt_out_nodes = ["gpu-007"]
probation_seconds = "1h"
breaker_window_seconds = "15m"

[inventory]
nvlink = "absent"
ib_unused = "mlx5_1:1"
""")
    s = load_settings(path, env={})
    assert s.source == str(path)
    assert s.node.name == "gpu-001"
    assert s.storage.path == Path("/var/lib/gpuhealth/gpuhealth.sqlite")
    assert s.remediation.audit_log == Path("/var/lib/gpuhealth/audit.jsonl")
    assert s.collectors["nvml"].options["slow_interval_seconds"] == 60.0
    assert s.collectors["nvml"].options["fast_interval_seconds"] == 1.0  # merged over default
    assert "kernel_log" not in s.enabled_collectors()
    dcgm = s.collectors["dcgm"]
    assert dcgm.type == "dcgm_exporter"
    assert dcgm.poll_interval_seconds == 15.0
    assert dcgm.options == {"url": "http://127.0.0.1:9400/metrics"}
    assert s.storage.retention_seconds == 3 * 86400.0
    assert s.remediation.opt_out_nodes == ("gpu-007",)
    assert (s.remediation.probation_seconds, s.remediation.breaker_window_seconds) == (
        3600.0, 900.0)
    assert s.inventory == {"nvlink": "absent", "ib_unused": "mlx5_1:1"}


def test_settings_are_frozen() -> None:
    s = load_settings(None, env={})
    with pytest.raises(ValidationError):
        s.metrics.port = 1


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "[storage]\nretension_days = 3\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert str(info.value) == f"{path}: [storage] unknown key 'retension_days'"


def test_unknown_section_and_wrong_type(tmp_path: Path) -> None:
    path = _write(tmp_path, '[metrcs]\nport = 1\n[metrics]\nport = "many"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    message = str(info.value)
    assert f"{path}: unknown key 'metrcs'" in message
    assert f"{path}: [metrics] port: " in message
    assert "'many'" in message


def test_bad_duration_and_range(tmp_path: Path) -> None:
    path = _write(tmp_path, '[storage]\nflush_interval_seconds = "soon"\n'
                            "[remediation]\nmax_disrupted_fraction = 1.5\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    message = str(info.value)
    assert "[storage] flush_interval_seconds: not a duration: 'soon'" in message
    assert "[remediation] max_disrupted_fraction:" in message


def test_secret_in_file_is_refused_with_a_hint(tmp_path: Path) -> None:
    path = _write(tmp_path, '[alerting]\nwebhook_secret = "hunter2"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert "unknown key 'webhook_secret'" in str(info.value)
    assert "webhook_secret_env" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_secret_from_environment_or_file(tmp_path: Path) -> None:
    path = _write(tmp_path, '[alerting]\nwebhook_url = "https://hooks.example/x"\n'
                            'webhook_secret_env = "HOOK_SECRET"\n')
    with pytest.raises(ConfigError, match="'HOOK_SECRET' is not set"):
        load_settings(path, env={})
    s = load_settings(path, env={"HOOK_SECRET": "s3cret"})
    assert webhook_secret(s, {"HOOK_SECRET": "s3cret"}) == "s3cret"
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file\n")
    path2 = _write(tmp_path, f'[alerting]\nwebhook_secret_file = "{secret_file}"\n', "b.toml")
    assert webhook_secret(load_settings(path2, env={}), {}) == "from-file"


def test_environment_overrides_are_validated(tmp_path: Path) -> None:
    path = _write(tmp_path, "[metrics]\nport = 9000\n")
    s = load_settings(path, env={"GPUHEALTH_METRICS__PORT": "9500",
                                 "GPUHEALTH_COLLECTORS__NVML__SLOW_INTERVAL_SECONDS": "2m",
                                 "GPUHEALTH_NODE__NAME": "from-env",
                                 "GPUHEALTH_REMEDIATION__OPT_OUT_NODES": '["a", "b"]',
                                 "UNRELATED": "x"})
    assert s.metrics.port == 9500
    assert s.collectors["nvml"].options["slow_interval_seconds"] == 120.0
    assert s.node.name == "from-env"
    assert s.remediation.opt_out_nodes == ("a", "b")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={"GPUHEALTH_METRICS__PORT": "high"})
    assert str(info.value).startswith(
        f"{path}: environment GPUHEALTH_METRICS__PORT: [metrics] port: ")
    with pytest.raises(ConfigError, match="unknown key 'prot'"):
        load_settings(path, env={"GPUHEALTH_METRICS__PROT": "1"})


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_settings(tmp_path / "nope.toml", env={})
    path = _write(tmp_path, "[metrics\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(path, env={})


def test_unknown_time_zone(tmp_path: Path) -> None:
    path = _write(tmp_path, '[time]\ntimezone = "Mars/Olympus"\n')
    with pytest.raises(ConfigError, match=r"\[time\] timezone: unknown time zone"):
        load_settings(path, env={})


def test_inventory_values_must_be_strings(tmp_path: Path) -> None:
    path = _write(tmp_path, "[inventory]\nnvlink = false\n")
    with pytest.raises(ConfigError, match=r"\[inventory\] nvlink"):
        load_settings(path, env={})


def test_check_reports_unknown_plugin_and_bad_plugin_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '[collectors.gpus]\ntype = "nvmll"\n'
                            "[collectors.nvml]\nfast_interval = 1\n")
    problems = check(path, env={})
    assert any("[collectors.gpus] type: no plugin 'nvmll'" in p for p in problems)
    # as `run` says it: the unknown key named and the valid ones listed (not Python's
    # "got an unexpected keyword argument")
    assert any("[collectors.nvml]" in p and "unknown option 'fast_interval'; valid options: "
               in p and "fast_interval_seconds" in p for p in problems)
    assert all(p.startswith(f"{path}: ") for p in problems)


def test_a_collector_duration_that_is_not_one_names_its_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '[collectors.nvml]\nfast_interval_seconds = "fast"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert "nvml: fast_interval_seconds: not a duration: 'fast'" in str(info.value)


def test_check_returns_load_errors_as_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, "[storage]\nretension_days = 3\n[metrics]\nport = -1\n")
    problems = check(path, env={})
    assert len(problems) == 2
    assert f"{path}: [storage] unknown key 'retension_days'" in problems


def test_example_config_is_accepted() -> None:
    settings = load_settings(EXAMPLE, env={})
    assert settings.metrics.port == DEFAULT_METRICS_PORT
    # A collector whose module has not landed yet is the only tolerated problem.
    problems = [p for p in check(EXAMPLE, env={}) if "No module named 'collectors." not in p]
    assert problems == []


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
                                                ("7d", 604800.0), ("1.5s", 1.5), (10, 10.0),
                                                ("12", 12.0)])
def test_parse_duration(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5 minutes", "-1s", "nan", True, False])
def test_parse_duration_rejects(text: str | bool) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_unknown_scheduler_or_elector_is_refused_at_check(tmp_path):
    from core.errors import ConfigError
    from gpuhealth.config import load_settings

    for key, value in (("scheduler", "nosuch"), ("election", "zookeeper")):
        path = tmp_path / f"{key}.toml"
        path.write_text(f'[remediation]\n{key} = "{value}"\n')
        with pytest.raises(ConfigError, match=f"no plugin '{value}'"):
            load_settings(path, env={})


def test_storage_messages_name_the_key_once(tmp_path: Path) -> None:
    path = _write(tmp_path, "[storage]\nretention_seconds = -5\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(str(path), env={})
    assert "[storage] retention_seconds" in str(caught.value)
    assert str(caught.value).endswith(", got -5")  # once, not "got -5 (got -5)"
    path = _write(tmp_path, '[storage]\ntype = "influxdb"\n')
    with pytest.raises(ConfigError, match=r"\[storage\] url: required when type = 'influxdb'$"):
        load_settings(str(path), env={})


@pytest.mark.parametrize(("section", "key"), [
    ("analytics", "predictor"), ("analytics", "detectors"), ("metrics", "enabled"),
    ("analytics", "predictor_refit")])
def test_a_switch_must_be_a_toml_boolean(tmp_path: Path, section: str, key: str) -> None:
    """Fresh-user finding: `predictor = "yes"` was taken as true (pydantic's lax bool); a
    string is refused naming the key, as `dry_run = "no"` already was."""
    path = _write(tmp_path, f'[{section}]\n{key} = "yes"\n')
    with pytest.raises(ConfigError, match=rf"\[{section}\] {key}.*valid boolean"):
        load_settings(path, env={})
    assert getattr(getattr(load_settings(_write(tmp_path, f"[{section}]\n{key} = false\n"),
                                         env={}), section), key) is False
