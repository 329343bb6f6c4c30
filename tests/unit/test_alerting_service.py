"""`gpuhealth run` builds its notifiers, pagers, silences and outbox from [alerting]."""

from __future__ import annotations

import pytest

from core.plugins import available
from gpuhealth.config import load_settings
from gpuhealth.service import Service


def test_run_builds_alerting_from_settings(tmp_path, monkeypatch):
    installed = available("gpuhealth.notifiers")
    if not {"alertmanager", "pagerduty"} <= set(installed):
        pytest.skip("alertmanager/pagerduty entry points not installed yet (pyproject)")
    monkeypatch.setenv("PD_KEY", "R" * 32)
    path = tmp_path / "g.toml"
    path.write_text(
        f'[node]\nname = "n1"\ndata_dir = "{tmp_path}"\n'
        '[alerting]\ncluster = "c1"\nalertmanager_url = "http://127.0.0.1:9093"\n'
        'pagerduty_routing_key_env = "PD_KEY"\n'
        '[alerting.policies."xid:13"]\ndebounce_count = 3\ndebounce_window = "10m"\n'
    )
    settings = load_settings(str(path))
    pipeline = Service(settings)._build_pipeline()
    assert [n.name for n in pipeline.notifiers] == ["log", "alertmanager"]
    assert [n.name for n in pipeline.page_notifiers] == ["pagerduty"]
    assert pipeline.extra_labels == {"cluster": "c1"}
    assert pipeline.alert_policies["xid:13"].debounce_count == 3
    assert pipeline.outbox_path == str(tmp_path / "outbox.sqlite")
    assert pipeline.silences is not None
    assert "R" * 32 not in repr(pipeline.page_notifiers[0])
