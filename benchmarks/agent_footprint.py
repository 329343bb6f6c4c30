"""Footprint of an idle ``gpuhealth agent``: 8 fake GPUs at 1 Hz, reporting to a real controller.

Two processes on loopback: a ``gpuhealth controller`` (SQLite fleet state in a temporary
folder, an ``agent_tokens_file``) and an agent. The agent cannot be given the fake NVML
through its configuration, so a small launcher (``python -c``) loads the agent's TOML,
builds its collectors as the service would (``collector_options``), hands the NVML
collector the fake NVML of ``collectors.testing`` (8 x H100 80GB HBM3 from the
``tests/fixtures/nvidia-smi`` dump, fast group at 1 Hz, slow group every 30 s) and runs
``Service(settings, role="agent", collectors=...)`` until SIGTERM. The kernel-log
collector follows an empty file; network and probe collectors are off; detectors and
predictor run with their defaults. It measures, in the same run:

* the agent's resident memory (``VmRSS`` of ``/proc/PID/status``, sampled every second
  over ``--seconds`` after ``--warmup``; goal <= 100 MiB), beside dcgm-exporter
  (135-155 MiB) and gpud (~130 MiB) as references and two anchors measured here: a bare
  ``python -c "import time; time.sleep(30)"`` and a Python that only imports numpy,
  pandas, scikit-learn and river (what those libraries alone cost: the agent used to load
  them through river's ``preprocessing`` and must not any more);
* the agent's CPU as a share of one core over the window (``utime + stime`` of
  ``/proc/PID/stat``; goal <= 1 %);
* start-up to first sample: from starting the process until its ``/metrics`` shows a
  ``gpu_`` sample (goal < 2 s), beside the wall time of the anchor's imports alone;
* the installed size of the agent's environment (``gpuhealth`` and the transitive closure
  of its base requirements) beside the full install with the ``controller`` extra,
  summed over the installed files (``importlib.metadata``) of each distribution in this
  virtual environment;
* that the agent imported none of the controller's libraries (psycopg, psycopg_pool,
  aiohttp, kubernetes, matplotlib, sksurv, apscheduler) and none of the analysis libraries
  (pandas, scikit-learn, scipy: the report, survival models and batch refit need them, the
  agent's collectors, rules, detectors and online predictor do not), read from the agent
  itself: the launcher writes ``sorted(sys.modules)`` 5 s after start and again at SIGTERM.

The detectors calibrate for ``[analytics] warmup_samples`` (500) samples per series before
they score with their fitted tails; ``--warmup 540`` measures that steady state.

It exits 0 (a measurement); ``--check`` exits 1 when a goal is missed.

Usage::

    .venv/bin/python benchmarks/agent_footprint.py [--seconds 60] [--warmup 10] [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
DUMP = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h100-80gb-hbm3-x8-q.txt"
NODE = "gpu-bench"
TOKEN = "tok-footprint-" + "0123456789abcdef" * 2
CONTROLLER_LIBS = ("psycopg", "psycopg_pool", "aiohttp", "kubernetes", "matplotlib", "sksurv",
                   "apscheduler")
ANALYSIS_LIBS = ("pandas", "sklearn", "scipy")
TICKS = os.sysconf("SC_CLK_TCK")

GOAL_RSS_MIB = 100.0
GOAL_CORE_PERCENT = 1.0
GOAL_STARTUP_SECONDS = 2.0
REFERENCES = "dcgm-exporter 135-155 MiB, gpud ~130 MiB"

LAUNCHER = textwrap.dedent("""
    import json, logging, signal, sys, threading
    config, dump, modules = sys.argv[1:4]
    sys.path.insert(0, sys.argv[4])
    from collectors.nvml import NvmlCollector
    from collectors.testing import FakeNvml, given_for_dump
    from core import logs, plugins
    from core.protocols import Collector
    from gpuhealth.config import collector_options, load_settings
    from gpuhealth.service import Service

    logs.configure(logging.INFO, "text")  # as `gpuhealth agent` does
    settings = load_settings(config)
    fake = FakeNvml.from_dump(dump, **given_for_dump(
        energy_mj=123_456_789, nvlink_states=[1] * 18, supported_events=0))
    collectors = {}
    for name, table in settings.enabled_collectors().items():
        factory = plugins.load("gpuhealth.collectors", table.type)
        options = collector_options(settings, table, factory)
        if table.type == "nvml":
            collectors[name] = NvmlCollector(**options, nvml=fake)
        else:
            collectors[name] = plugins.build("gpuhealth.collectors", table.type, options,
                                             expect=Collector)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    service = Service(settings, stop=stop, collectors=collectors, role="agent")
    service.start()

    def dump_modules(suffix):
        with open(modules + suffix, "w") as f:
            json.dump(sorted(sys.modules), f)

    if not stop.wait(5.0):
        dump_modules(".5s")
    stop.wait()
    dump_modules(".end")
    service.shutdown()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(match.group(1)) / 1024 if match else float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15)


def http_get(url: str) -> tuple[int, bytes] | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""
    except (OSError, ValueError):
        return None


def wait_for(check: Any, timeout: float, step: float = 0.02) -> float | None:
    """Seconds until ``check()`` is true, or ``None`` after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(step)
    return None


def anchor(code: str) -> tuple[float, float]:
    """(RSS MiB, seconds to run ``code``) of a fresh ``python -c`` that then sleeps."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{code}\nprint('ready', flush=True)\nimport time; time.sleep(30)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        took = time.monotonic() - started
        time.sleep(0.3)
        return rss_mib(proc.pid), took
    finally:
        proc.kill()
        proc.wait()


# --- installed size ---------------------------------------------------------------------


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(extras: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """Distributions ``gpuhealth[extras]`` needs, transitively; and those not installed here."""
    from packaging.requirements import Requirement

    seen: set[str] = {"gpuhealth"}
    missing: set[str] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [("gpuhealth", extras)]
    while todo:
        name, active = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not any(
                    req.marker.evaluate({"extra": e}) for e in (*active, "")):
                continue
            key = _key(req.name)
            if key == "gpuhealth":  # gpuhealth[controller] inside an extra: follow its extras
                todo.append((key, tuple(req.extras)))
                continue
            if key not in seen:
                seen.add(key)
                todo.append((key, tuple(req.extras)))
    return seen - missing, missing


def installed_mib(names: set[str]) -> float:
    files: set[Path] = set()
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            for file in metadata.distribution(name).files or []:
                path = Path(str(file.locate())).resolve()
                if path.is_file():
                    files.add(path)
    return sum(p.stat().st_size for p in files) / 2**20


# --- the two processes ------------------------------------------------------------------


def write_configs(folder: Path, ctl_port: int, metrics_port: int, api_port: int) -> None:
    (folder / "tokens").write_text(f"{NODE} {TOKEN}\n")
    (folder / "kern.log").touch()
    (folder / "ctl.toml").write_text(f"""
[node]
name = "ctl"
data_dir = "{folder / 'ctl'}"
[metrics]
enabled = false
[alerting]
api_enabled = false
[report]
enabled = false
[controller]
port = {ctl_port}
state = "{folder / 'ctl' / 'fleet.sqlite'}"
agent_tokens_file = "{folder / 'tokens'}"
""")
    (folder / "agent.toml").write_text(f"""
[node]
name = "{NODE}"
data_dir = "{folder / 'agent'}"
[metrics]
port = {metrics_port}
[alerting]
api_port = {api_port}
[collectors.nvml]
fast_interval_seconds = 1.0
slow_interval_seconds = 30.0
[collectors.network]
enabled = false
[collectors.probe]
enabled = false
[collectors.kernel_log]
source = "file"
path = "{folder / 'kern.log'}"
[agent]
controllers = ["http://127.0.0.1:{ctl_port}"]
token_env = "AGENT_TOKEN"
""")


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def measure_agent(seconds: float, warmup: float) -> dict[str, Any]:
    got: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gh-footprint-") as tmp:
        folder = Path(tmp)
        ctl_port, metrics_port, api_port = free_port(), free_port(), free_port()
        write_configs(folder, ctl_port, metrics_port, api_port)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        procs: list[subprocess.Popen[bytes]] = []
        try:
            with (folder / "ctl.log").open("wb") as log:
                procs.append(subprocess.Popen(
                    [GPUHEALTH, "controller", "--config", str(folder / "ctl.toml")],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
            ready = wait_for(lambda: http_get(f"http://127.0.0.1:{ctl_port}/-/ready") is not None,
                             60, 0.1)
            if ready is None:
                raise RuntimeError("the controller did not answer in 60 s:\n"
                                   + (folder / "ctl.log").read_text()[-3000:])
            got["controller_ready_s"] = ready
            modules = folder / "modules.json"
            started = time.monotonic()
            with (folder / "agent.log").open("wb") as log:
                agent = subprocess.Popen(
                    [sys.executable, "-c", LAUNCHER, str(folder / "agent.toml"), str(DUMP),
                     str(modules), str(ROOT)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**env, "AGENT_TOKEN": TOKEN}, cwd=ROOT)
            procs.insert(0, agent)
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

            def has_gpu_sample() -> bool:
                if agent.poll() is not None:
                    raise RuntimeError("the agent exited:\n"
                                       + (folder / "agent.log").read_text()[-3000:])
                answer = http_get(metrics_url)
                if answer is not None and "metrics_up_s" not in got:
                    got["metrics_up_s"] = time.monotonic() - started
                return answer is not None and re.search(rb"(?m)^gpu_\w+\{", answer[1]) is not None

            first = wait_for(has_gpu_sample, 60, 0.01)
            got["first_sample_s"] = float("nan") if first is None else first
            time.sleep(max(0.0, warmup - (time.monotonic() - started)))
            rss: list[float] = []
            cpu0, wall0 = cpu_seconds(agent.pid), time.monotonic()
            while time.monotonic() - wall0 < seconds:
                time.sleep(1.0)
                rss.append(rss_mib(agent.pid))
            got["core_percent"] = 100.0 * (cpu_seconds(agent.pid) - cpu0) / (
                time.monotonic() - wall0)
            got["rss_median"], got["rss_max"] = statistics.median(rss), max(rss)
            hwm = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{agent.pid}/status").read_text())
            got["rss_hwm"] = int(hwm.group(1)) / 1024 if hwm else float("nan")
            answer = http_get(f"http://127.0.0.1:{ctl_port}/api/v1/agents")
            rows = json.loads(answer[1]) if answer and answer[0] == 200 else []
            got["registered"] = [r for r in rows if r.get("node") == NODE]
            text = (http_get(metrics_url) or (0, b""))[1].decode()
            up = re.search(r"(?m)^gpuhealth_agent_controller_up(?:\{[^}]*\})? (\S+)", text)
            got["controller_up"] = up.group(1) if up else "absent"
            got["gpus"] = len(set(re.findall(r'gpu_power_watts\{[^}]*entity="([^"]+)"', text)))
        finally:
            stop_all(procs)
        imported: set[str] = set()
        got["module_dumps"] = 0
        for suffix in (".5s", ".end"):
            path = folder / f"modules.json{suffix}"
            if path.exists():
                imported.update(json.loads(path.read_text()))
                got["module_dumps"] += 1
        got["imported"] = imported
        got["agent_exit"] = procs[0].returncode
        got["agent_log_tail"] = (folder / "agent.log").read_text()[-1500:]
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="measurement window after the warm-up (default 60)")
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="seconds from the agent's start before the window (default 10)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)

    print(f"idle agent: 8 fake GPUs ({DUMP.name}) at 1 Hz, kernel log on an empty file, "
          f"reporting to a controller on loopback; warm-up {args.warmup:g} s, "
          f"window {args.seconds:g} s")
    a = measure_agent(args.seconds, args.warmup)
    bare_rss, _ = anchor("import time")
    libs_rss, libs_s = anchor("import numpy, pandas, sklearn, river")
    base, base_missing = closure(())
    full, full_missing = closure(("controller",))
    base_mib, full_mib = installed_mib(base), installed_mib(full)
    heavy = sorted(m for m in CONTROLLER_LIBS
                   if any(x == m or x.startswith(m + ".") for x in a["imported"]))
    analysis = sorted(m for m in ANALYSIS_LIBS
                      if any(x == m or x.startswith(m + ".") for x in a["imported"]))
    in_base = sorted(n for n in ("psycopg", "psycopg-pool", "aiohttp", "kubernetes",
                                 "matplotlib", "scikit-survival", "apscheduler") if n in base)

    rows: list[tuple[str, str, str, bool | None]] = [
        ("RSS after warm-up, max (MiB)",
         f"{a['rss_max']:.1f} (median {a['rss_median']:.1f})", f"<= {GOAL_RSS_MIB:.0f}",
         a["rss_max"] <= GOAL_RSS_MIB),
        ("CPU, % of one core", f"{a['core_percent']:.2f}", f"<= {GOAL_CORE_PERCENT:g}",
         a["core_percent"] <= GOAL_CORE_PERCENT),
        ("start-up to first gpu_ sample (s)", f"{a['first_sample_s']:.2f}",
         f"< {GOAL_STARTUP_SECONDS:g}", a["first_sample_s"] < GOAL_STARTUP_SECONDS),
        ("controller libraries imported", ", ".join(heavy) or "none", "none",
         not heavy and a["module_dumps"] > 0),
        ("analysis libraries imported", ", ".join(analysis) or "none", "none",
         not analysis and a["module_dumps"] > 0),
        ("controller libraries in base deps", ", ".join(in_base) or "none", "none", not in_base),
        ("installed, agent (MiB)", f"{base_mib:.0f} ({len(base)} dists)", "-", None),
        ("installed, with [controller] (MiB)", f"{full_mib:.0f} ({len(full)} dists)", "-", None),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'figure':<{width}}  {'value':>24}  {'goal':>8}  met")
    for name, value, goal, met in rows:
        print(f"{name:<{width}}  {value:>24}  {goal:>8}  "
              f"{'-' if met is None else ('yes' if met else 'no')}")

    print(f"\nreferences: {REFERENCES}")
    print(f"anchors (same run): bare python {bare_rss:.1f} MiB; python importing numpy, "
          f"pandas, sklearn, river {libs_rss:.1f} MiB ({libs_s:.2f} s to import); the agent "
          f"is {a['rss_max'] - libs_rss:+.1f} MiB over the libraries alone; peak RSS (VmHWM) "
          f"{a['rss_hwm']:.1f} MiB")
    print(f"start-up: /metrics answered after {a.get('metrics_up_s') or float('nan'):.2f} s, "
          f"first gpu_ sample after {a['first_sample_s']:.2f} s (the library imports alone "
          f"take {libs_s:.2f} s)")
    print(f"agent: {a['gpus']} GPUs on /metrics; gpuhealth_agent_controller_up "
          f"{a['controller_up']}; registered at the controller: "
          f"{'yes' if a['registered'] else 'NO'}"
          + (f" ({len(a['registered'][0].get('gpus', []))} GPUs in its heartbeat)"
             if a["registered"] else "")
          + f"; exit status {a['agent_exit']}")
    print(f"modules: {len(a['imported'])} imported by the agent (from {a['module_dumps']} "
          f"dumps: 5 s after start and at SIGTERM); controller libraries: "
          f"{', '.join(heavy) or 'none'}")
    extra = sorted(full - base)
    print(f"the [controller] extra adds {len(extra)} distributions, "
          f"{full_mib - base_mib:.0f} MiB: {', '.join(extra)}")
    if base_missing or full_missing:
        print(f"not installed here (not counted): {', '.join(sorted(base_missing | full_missing))}")
    if a["agent_exit"] not in (0, None) or not a["registered"]:
        print(f"agent log tail:\n{a['agent_log_tail']}")

    missed = [name for name, _, _, met in rows if met is False]
    print("\nall goals met" if not missed else f"\ngoals missed: {', '.join(missed)}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
