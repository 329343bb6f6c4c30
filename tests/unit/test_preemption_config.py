"""``[remediation.preemption]`` (#16 item 10): off by default, validated by ``config check``."""

from __future__ import annotations

from pathlib import Path

from gpuhealth.config import check, load_settings
from remediation.priority import PreemptionPolicy


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpuhealth.toml"
    path.write_text(text)
    return path


def test_off_by_default() -> None:
    settings = load_settings(None, env={})
    assert settings.remediation.preemption.enabled is False
    assert settings.remediation.preemption.policy() == PreemptionPolicy()


def test_a_valid_table_becomes_the_engine_policy(tmp_path: Path) -> None:
    path = _write(tmp_path, """
[remediation.preemption]
enabled = true
critical_classes = ["critical", "prod-training"]
max_victim_priority = 100
wait_seconds = "2m"
max_preemptions = 3
window_seconds = "1h"
""")
    assert check(path, env={}) == []
    policy = load_settings(path, env={}).remediation.preemption.policy()
    assert policy == PreemptionPolicy(enabled=True, critical_classes=("critical", "prod-training"),
                                      max_victim_priority=100, wait_seconds=120.0,
                                      max_preemptions=3, window_seconds=3600.0)


def test_config_check_refuses_a_malformed_table_naming_the_key(tmp_path: Path) -> None:
    cases = {
        "[remediation.preemption]\nenabled = true\n": "critical_priority or critical_classes",
        "[remediation.preemption]\nvictims = 3\n": "victims",
        "[remediation.preemption]\nmax_preemptions = 0\n": "max_preemptions",
        "[remediation.preemption]\nwait_seconds = \"-5s\"\n": "wait_seconds",
        "[remediation.preemption]\nenabled = \"yes\"\n": "enabled",
    }
    for text, words in cases.items():
        problems = check(_write(tmp_path, text), env={})
        assert problems, text
        assert any("preemption" in p and words in p for p in problems), (text, problems)
