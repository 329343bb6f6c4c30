"""A running agent never loads pandas, scikit-learn or scipy (issue #13: RSS <= 100 MiB).

The agent runs the collectors, the parsers and node-local fault rules, the online detectors
and the failure predictor; none of them needs the analysis libraries of the report, the
survival models or the batch refit. The child process starts a real ``Service`` in the
``agent`` role over the fake NVML of 8 GPUs, lets it collect and analyse, forces one
prediction step and one evaluation, and prints ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DUMP = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h100-80gb-hbm3-x8-q.txt"
HEAVY = ("pandas", "sklearn", "scipy")

_CHILD = """
import json, sys, threading, time
root, config, dump = sys.argv[1:4]
sys.path.insert(0, root)
from collectors.nvml import NvmlCollector
from collectors.testing import FakeNvml, given_for_dump
from gpuhealth.config import load_settings
from gpuhealth.service import Service

settings = load_settings(config)
fake = FakeNvml.from_dump(dump, **given_for_dump(
    energy_mj=123_456_789, nvlink_states=[1] * 18, supported_events=0))
nvml = NvmlCollector(node=settings.node.name, nvml=fake)
stop = threading.Event()
service = Service(settings, stop=stop, collectors={"nvml": nvml}, role="agent")
service.start()
try:
    deadline = time.monotonic() + 20
    while len(service._gpus) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # a second collection: counter rates, detectors, peers
    assert service.prediction is not None and service.online is not None
    service.prediction.step(time.time())  # the predictor's first step
    service._evaluate()                   # the node-local fault rules
    print(json.dumps({"gpus": len(service._gpus), "refit": service.prediction.refit,
                      "modules": sorted(sys.modules)}))
finally:
    service.shutdown()
"""


def test_running_agent_loads_no_analysis_library(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(f"""
[node]
name = "gpu-test"
data_dir = "{tmp_path / 'data'}"
[metrics]
port = 0
[alerting]
api_port = 0
[agent]
controllers = ["http://127.0.0.1:9"]
token_env = "GPUHEALTH_TEST_AGENT_TOKEN"
""")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), str(config), str(DUMP)],
                         capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
                         env={"GPUHEALTH_TEST_AGENT_TOKEN": "t" * 32, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["gpus"] == 8
    assert got["refit"] is False  # [analytics] predictor_refit unset: off on agents
    heavy = sorted(m for m in got["modules"] if m.split(".", 1)[0] in HEAVY)
    assert not heavy, f"the running agent imported {heavy[:10]}"


def test_batch_refit_is_on_for_run_off_for_agents_unless_set(tmp_path: Path) -> None:
    from gpuhealth.compose import build_analytics
    from gpuhealth.config import load_settings

    def stage(extra: str, role: str) -> bool:
        config = tmp_path / "g.toml"
        config.write_text(f'[node]\ndata_dir = "{tmp_path}"\n[analytics]\n{extra}\n')
        built = build_analytics(load_settings(config, env={}), role=role).prediction
        assert built is not None
        return built.refit

    assert stage("", "run") is True
    assert stage("", "agent") is False
    assert stage("predictor_refit = true", "agent") is True
    assert stage("predictor_refit = false", "run") is False
