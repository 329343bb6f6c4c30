"""The diagnostic bundle before a destructive step: bounded, on time, attached to the step.

Tools (``nvidia-bug-report.sh``, ``nvidia-smi``, ``journalctl``) are an injected runner;
the engine runs through the pipeline on the in-memory scheduler.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest

from alerting.silences import SilenceStore
from core.clock import FakeClock
from core.errors import ConfigError
from core.records import Action
from gpuhealth.api import AlertingApi, ApiServer
from gpuhealth.pipeline import Pipeline
from remediation.audit import read_audit_log
from remediation.bundle import (
    BundleCollector,
    BundleRequest,
    LocalBundler,
    NodeAgentBundler,
)
from remediation.gpu_reset import GpuResetEndpoint, GpuResetter
from remediation.validation import CommandResult, GpuState
from tests.fake_scheduler import FakeCluster, FakeNode
from tests.unit.test_fix_validation import finding, make, run_until

SECRET = "whsec_" + base64.b64encode(b"node-agent-shared-secret-32bytes").decode()
INSTALLED = {"nvidia-bug-report.sh", "nvidia-smi", "journalctl"}


class Tools:
    def __init__(self, *, sleep: float = 0.0, report_bytes: int = 1000) -> None:
        self.sleep = sleep
        self.report_bytes = report_bytes
        self.calls: list[tuple[str, float]] = []

    def __call__(self, argv, timeout_seconds):
        self.calls.append((" ".join(argv), timeout_seconds))
        if argv[0] == "nvidia-bug-report.sh":
            if self.sleep:
                time.sleep(min(self.sleep, timeout_seconds))
                if self.sleep > timeout_seconds:
                    return CommandResult(returncode=None, stderr="timed out")
            out = argv[argv.index("--output-file") + 1] + ".gz"
            with open(out, "wb") as fh:  # random bytes: a gzip file that does not shrink
                fh.write(gzip.compress(os.urandom(self.report_bytes)))
            return CommandResult(returncode=0, stdout="nvidia-bug-report.sh will now collect")
        if argv[0] == "nvidia-smi":
            return CommandResult(returncode=0, stdout="==============NVSMI LOG==============\n"
                                 "GPU 00000000:B1:00.0\n    Recovery Action : Node Reboot\n")
        if argv[0] == "journalctl":
            return CommandResult(returncode=0, stdout="NVRM: Xid (PCI:0000:b1:00): 79, pid=0, "
                                 "GPU has fallen off the bus.\n")
        return CommandResult(returncode=127, stderr="not found")


def collector(tmp_path: Path, tools: Tools, **kw) -> BundleCollector:
    return BundleCollector(directory=str(tmp_path / "bundles"), node="n1", runner=tools,
                           which=lambda name: name if name in INSTALLED else None, **kw)


def members(path: str) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def test_a_bundle_holds_what_a_vendor_asks_for(tmp_path):
    tools = Tools()
    result = collector(tmp_path, tools).collect(reason="Xid 79 on 0000:b1:00.0",
                                                gpus=["0000:b1:00.0"], key="fp/reboot",
                                                evidence=["NVRM: Xid (PCI:0000:b1:00): 79"])
    assert result.path.endswith(".tar.gz")
    files = members(result.path)
    assert set(files) == {"manifest.json", "evidence.txt", "nvidia-smi-q.txt", "kernel.log",
                          "nvidia-bug-report.log.gz"}
    assert b"Recovery Action : Node Reboot" in files["nvidia-smi-q.txt"]
    assert b"fallen off the bus" in files["kernel.log"]
    assert b"NVRM: Xid (PCI:0000:b1:00): 79" in files["evidence.txt"]
    manifest = json.loads(files["manifest.json"])
    assert manifest["key"] == "fp/reboot"
    assert [i["name"] for i in manifest["items"]] == [
        "evidence.txt", "nvidia-smi-q.txt", "kernel.log", "nvidia-bug-report.log.gz"]
    journal = next(c for c, _ in tools.calls if c.startswith("journalctl"))
    assert "--since @" in journal
    assert "4 of 4 items" in result.message


def test_missing_tools_are_noted_not_fatal(tmp_path):
    result = BundleCollector(directory=str(tmp_path), runner=Tools(),
                             which=lambda name: None).collect(reason="r", key="k")
    files = members(result.path)
    assert set(files) == {"manifest.json", "evidence.txt"}
    notes = {i["name"]: i["note"] for i in json.loads(files["manifest.json"])["items"]}
    assert notes["nvidia-bug-report.log.gz"] == "nvidia-bug-report.sh is not installed"


def test_a_bundle_is_bounded_in_size_and_count(tmp_path):
    tools = Tools()
    tools.report_bytes = 200_000
    big = collector(tmp_path, tools, max_bytes=10_000, keep=2)
    result = big.collect(reason="r", key="k1")
    manifest = json.loads(members(result.path)["manifest.json"])
    assert sum(i["size_bytes"] for i in manifest["items"]) <= 10_000
    report = next(i for i in manifest["items"] if i["name"] == "nvidia-bug-report.log.gz")
    assert report["truncated"]
    for key in ("k2", "k3"):
        time.sleep(0.01)
        big.collect(reason="r", key=key)
    assert len(os.listdir(tmp_path / "bundles")) == 2  # the oldest was removed


def test_the_deadline_bounds_the_whole_collection(tmp_path):
    tools = Tools(sleep=5.0)
    started = time.monotonic()
    result = collector(tmp_path, tools, timeout_seconds=1.0).collect(reason="r", key="k")
    assert time.monotonic() - started < 3
    assert all(timeout <= 1.0 for _, timeout in tools.calls)
    manifest = json.loads(members(result.path)["manifest.json"])
    report = next(i for i in manifest["items"] if i["name"] == "nvidia-bug-report.log.gz")
    assert report["returncode"] is None


def test_bad_bounds():
    with pytest.raises(ConfigError):
        BundleCollector(directory="/tmp", max_bytes=0)


def test_the_gpu_reset_collects_a_bundle_before_the_reset(tmp_path):
    tools = Tools()
    seen: list[str] = []

    def runner(argv, timeout_seconds):
        seen.append(argv[1] if len(argv) > 1 else argv[0])
        if argv[1].startswith("--query-gpu"):
            return CommandResult(returncode=0, stdout="00000000:B1:00.0, Disabled\n")
        return CommandResult(returncode=0, stdout="")

    bundles = collector(tmp_path, tools)
    resetter = GpuResetter(nvidia_smi="smi", runner=runner, proc_root=str(tmp_path),
                           dev_root=str(tmp_path), bundle=bundles,
                           state_check=lambda gpus, since: [GpuState(gpu=g) for g in gpus])
    result = resetter.reset("0000:b1:00.0", idempotency_key="fp/reset_gpu", reason="Xid 48")
    names = [s.name for s in result.steps]
    assert names.index("diagnostic bundle") < names.index("reset")
    assert result.bundle.endswith(".tar.gz")
    assert "Xid 48" in members(result.bundle)["evidence.txt"].decode()


def test_the_engine_collects_a_bundle_before_the_reboot_and_the_hand_off(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    bundler = LocalBundler(collector=collector(tmp_path, Tools()))
    p = make(tmp_path, cluster, clock, engine_options={"bundler": bundler})
    p.observe_findings([finding("n1", code="79", action=Action.REBOOT_NODE)], hold_seconds=1e6)
    p.evaluate()
    run_until(p, clock, lambda: "reboot" in [h[0] for h in cluster.history])
    records = read_audit_log(str(tmp_path / "audit.jsonl"))
    order = [(r.decision, r.step.value if r.step else "") for r in records]
    assert order.index(("bundling", "reboot")) < order.index(("bundle", "reboot")) \
        < order.index(("submitted", "reboot"))
    done = next(r for r in records if r.decision == "bundle")
    assert done.details["bundle"].endswith(".tar.gz")
    assert "fallen off the bus" in members(done.details["bundle"])["kernel.log"].decode()


def test_a_slow_bundle_delays_the_step_no_longer_than_its_timeout(tmp_path):
    clock = FakeClock(now=1000.0)
    cluster = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    gate = threading.Event()

    class Stuck(LocalBundler):
        def start(self, request: BundleRequest) -> None:
            self._spawn(request.key, lambda: (gate.wait(20), self.collector.collect(
                reason=request.reason, key=request.key))[1])

    bundler = Stuck(collector=collector(tmp_path, Tools(), timeout_seconds=5.0))
    p = make(tmp_path, cluster, clock, engine_options={"bundler": bundler})
    p.observe_findings([finding("n1", code="79", action=Action.REBOOT_NODE)], hold_seconds=1e6)
    p.evaluate()
    run_until(p, clock, lambda: "reboot" in [h[0] for h in cluster.history], ticks=20)
    records = read_audit_log(str(tmp_path / "audit.jsonl"))
    started = next(r.at for r in records if r.decision == "bundling")
    submitted = next(r.at for r in records if r.decision == "submitted" and r.step
                     and r.step.value == "reboot")
    assert 5.0 <= submitted - started <= 7.0
    late = next(r for r in records if r.decision == "bundle")
    assert "not collected within 5 s" in late.reason
    gate.set()


def test_the_node_agent_collects_the_bundle_on_the_signed_endpoint(tmp_path):
    clock = FakeClock(now=1_800_000_000.0)
    store = SilenceStore(clock=clock)
    pipeline = Pipeline(facts={}, notifiers=[], page_notifiers=[], audit_log_path=None,
                        clock=clock, silences=store, cluster_size=10)
    endpoint = GpuResetEndpoint(resetter=GpuResetter(), secrets=(SECRET,), node="127.0.0.1",
                                clock=clock, bundle=collector(tmp_path, Tools()))
    server = ApiServer(api=AlertingApi(pipeline=pipeline, silences=store, token="t",
                                       gpu_reset=endpoint), port=0)
    server.start()
    try:
        bundler = NodeAgentBundler(secret=SECRET, clock=clock, url_template=(
            f"http://{{node}}:{server.port}/api/v1/gpu-reset"))
        bundler.start(BundleRequest(node="127.0.0.1", key="fp/hand_off", reason="hand-off",
                                    evidence=("validation failed: dcgm_diag failed",)))
        bundler.wait("fp/hand_off")
        result = bundler.result("fp/hand_off")
        assert result is not None
        assert result.path.startswith("127.0.0.1:")
        local = result.path.split(":", 1)[1]
        assert "dcgm_diag failed" in members(local)["evidence.txt"].decode()
        asyncio.run(asyncio.sleep(0))
    finally:
        server.stop()


def test_the_hand_off_after_a_failed_validation_carries_the_bundle(tmp_path):
    """The drill's first run with a bundler: reboot and hand-off each get a bundle."""
    from remediation.validation import LocalValidator, ValidationRunner
    from tests.fake_scheduler import FakeScheduler

    clock = FakeClock(now=1000.0)
    cluster = FakeCluster(nodes={"n1": FakeNode(), "n2": FakeNode()})
    sent: list = []
    scheduler = FakeScheduler(cluster, after_submit=sent.append)
    bundler = LocalBundler(collector=collector(tmp_path, Tools()))

    def dirty(gpus, since_at):
        return [GpuState(gpu="0000:b1:00.0", problems=("recovery action node_reboot",))]

    validator = LocalValidator(runner=ValidationRunner(state_check=dirty, runner=Tools(),
                                                       which=lambda name: None))
    p = make(tmp_path, cluster, clock, scheduler=scheduler,
             engine_options={"bundler": bundler, "validator": validator})
    p.observe_findings([finding("n1", code="79", action=Action.REBOOT_NODE)], hold_seconds=1e6)
    p.evaluate()
    run_until(p, clock, lambda: "hand_off" in [h[0] for h in cluster.history], ticks=60)
    by_step = {r.step.value: r for r in sent}
    assert by_step["reboot"].attrs["bundle"].endswith(".tar.gz")
    hand_off = by_step["hand_off"]
    assert hand_off.attrs["bundle"].endswith(".tar.gz")
    assert hand_off.attrs["bundle"] != by_step["reboot"].attrs["bundle"]
    assert "recovery action node_reboot" in hand_off.attrs["evidence"]
    evidence = members(hand_off.attrs["bundle"])["evidence.txt"].decode()
    assert "recovery action node_reboot" in evidence  # the validation's evidence goes along


def test_settings_build_the_bundlers(tmp_path, monkeypatch):
    from gpuhealth.compose import build_bundler
    from gpuhealth.config import load_settings

    local = tmp_path / "local.toml"
    local.write_text(f'[node]\nname = "n1"\ndata_dir = "{tmp_path}"\n'
                     '[remediation.bundle]\nwhere = "local"\ntimeout_seconds = 60\n')
    built = build_bundler(load_settings(local, env={}))
    assert isinstance(built, LocalBundler)
    assert built.timeout_seconds == 60
    assert built.collector.directory == str(tmp_path / "bundles")
    agent = tmp_path / "agent.toml"
    agent.write_text('[remediation.bundle]\nwhere = "node_agent"\nsecret_env = "GH_TEST_S"\n')
    monkeypatch.setenv("GH_TEST_S", SECRET)
    assert isinstance(build_bundler(load_settings(agent, env={})), NodeAgentBundler)
    assert build_bundler(load_settings(None, env={})) is None
    bad = tmp_path / "bad.toml"
    bad.write_text('[remediation.bundle]\nwhere = "local"\nmax_bytes = 0\n')
    with pytest.raises(ConfigError):
        build_bundler(load_settings(bad, env={}))
