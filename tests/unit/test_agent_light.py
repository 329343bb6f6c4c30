"""The node agent never imports the controller's libraries (``pip install .`` lacks them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONTROLLER_LIBS = ("psycopg", "psycopg_pool", "aiohttp", "kubernetes", "matplotlib", "sksurv",
                   "apscheduler")

_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import gpuhealth.service, gpuhealth.agent, storage.agent_outbox
print(json.dumps(sorted(sys.modules)))
"""


def test_agent_imports_no_controller_library() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT)], capture_output=True,
                         text=True, timeout=60, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "gpuhealth.service" in modules
    imported = sorted(m for m in modules
                      if m.split(".", 1)[0] in CONTROLLER_LIBS)
    assert not imported, f"the agent's import chain pulls in controller libraries: {imported}"
