"""Scrape configurations and Grafana datasources of deploy/: accepted by the real tools.

`promtool check config` (Prometheus 2.42, Debian) and `vmagent -promscrape.config.dryRun`
(VictoriaMetrics 1.79, Debian) read the shipped files; the Grafana datasources cover the
datasource type each dashboard flavour selects.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import ROOT

DEPLOY = ROOT / "deploy"


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        why = f"{name} is not installed"
        if os.environ.get("GPUHEALTH_TEST_SERVERS") == "required":
            pytest.fail(why)
        pytest.skip(why)
    return found


def beside(tmp_path: Path, config: Path) -> Path:
    """The config in a folder with the files it names (rules, a CA, file_sd targets)."""
    shutil.copy(config, tmp_path / config.name)
    shutil.copy(DEPLOY / "prometheus" / "gpuhealth-rules.yml", tmp_path)
    ca = tmp_path / "gpuhealth-ca.crt"
    done = subprocess.run([tool("openssl"), "req", "-x509", "-newkey", "ec",
                           "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                           "-subj", "/CN=gpuhealth-test-ca", "-keyout", str(tmp_path / "ca.key"),
                           "-out", str(ca)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    (tmp_path / "gpuhealth-agents.d").mkdir()
    (tmp_path / "gpuhealth-agents.d" / "rack1.json").write_text(
        json.dumps([{"targets": ["gpu-003:9835"]}]))
    return tmp_path / config.name


def test_prometheus_config_checks(tmp_path: Path) -> None:
    config = beside(tmp_path, DEPLOY / "prometheus" / "prometheus.yml")
    done = subprocess.run([tool("promtool"), "check", "config", str(config)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_vmagent_config_checks(tmp_path: Path) -> None:
    config = beside(tmp_path, DEPLOY / "vmagent" / "scrape.yml")
    done = subprocess.run([tool("vmagent"), f"-promscrape.config={config}",
                           "-promscrape.config.dryRun", "-loggerLevel=ERROR"],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(config.read_text().replace("static_configs", "statik_configs", 1))
    done = subprocess.run([tool("vmagent"), f"-promscrape.config={bad}",
                           "-promscrape.config.dryRun", "-loggerLevel=ERROR"],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode != 0


def test_scrape_targets_are_the_ports_gpuhealth_serves() -> None:
    from gpuhealth.config import ControllerSettings, MetricsSettings

    for path in (DEPLOY / "prometheus" / "prometheus.yml", DEPLOY / "vmagent" / "scrape.yml"):
        jobs = {j["job_name"]: j for j in yaml.safe_load(path.read_text())["scrape_configs"]}
        agent = jobs["gpuhealth-agent"]["static_configs"][0]["targets"]
        assert all(t.endswith(f":{MetricsSettings().port}") for t in agent)
        controller = jobs["gpuhealth-controller"]
        assert controller["scheme"] == "https"
        assert all(t.endswith(f":{ControllerSettings().port}")
                   for t in controller["static_configs"][0]["targets"])


def test_grafana_datasources_match_the_dashboards() -> None:
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/gpuhealth.yaml").read_text())["datasources"]
    by_type = {d["type"]: d for d in provisioned}
    for flavour in ("prometheus", "influxdb"):
        dashboards = sorted((DEPLOY / "grafana/dashboards" / flavour).glob("*.json"))
        assert dashboards
        for path in dashboards:
            board = json.loads(path.read_text())
            (variable,) = (v for v in board["templating"]["list"] if v["type"] == "datasource")
            assert variable["query"] in by_type, (path.name, variable["query"])
            # panels name the variable, never a fixed uid a site would not have
            uids = {p["datasource"]["uid"] for p in board["panels"] if "datasource" in p}
            assert uids <= {"${datasource}", "-- Grafana --"}, (path.name, uids)
    assert by_type["prometheus"]["uid"] == "prometheus"  # kube-prometheus-stack's uid too
    assert by_type["prometheus"]["isDefault"] is True
