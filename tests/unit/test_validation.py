"""Validation before a node returns to service, and the NVML state check of a GPU reset.

NVML is :class:`collectors.testing.FakeNvml` built from a recorded 8 x H100 ``nvidia-smi
-q``; the kernel log is a fake ``journalctl`` (an injected runner).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from collectors.testing import FakeNvml, given_for_dump
from remediation.validation import CommandResult, NvmlStateCheck, xids_by_gpu

DUMP = Path(__file__).parent.parent / "fixtures" / "nvidia-smi" / "h100-80gb-hbm3-x8-q.txt"


def h100(**given: Any) -> FakeNvml:
    facts = given_for_dump(energy_mj=1_000, nvlink_states=[1] * 18, supported_events=0)
    facts.update(given)
    return FakeNvml.from_dump(DUMP, **facts)


def kernel_log(*lines: str):
    seen: list[list[str]] = []

    def runner(argv, timeout_seconds):
        seen.append(list(argv))
        return CommandResult(returncode=0, stdout="\n".join(lines) + "\n")

    runner.seen = seen  # type: ignore[attr-defined]
    return runner


def test_nvml_state_of_clean_gpus():
    fake = h100()
    check = NvmlStateCheck(nvml=fake, runner=kernel_log())
    states = check([], since_at=None)
    assert len(states) == 8
    assert all(not s.problems for s in states), states
    first = states[0].gpu
    assert first.startswith("0000:")
    (one,) = check([first], since_at=None)
    assert one.gpu == first


def test_nvml_state_names_recovery_action_remap_and_xids():
    fake = h100()
    fake.gpus[0].set(recovery_action=2)  # NODE_REBOOT
    fake.gpus[1].set(remap_pending=1)
    log = kernel_log("2027-01-15T08:00:01+00:00 node kernel: NVRM: Xid (PCI:0000:75:00): 79, "
                     "pid=0, GPU has fallen off the bus.")
    check = NvmlStateCheck(nvml=fake, runner=log)
    states = {s.gpu: s.problems for s in check([], since_at=1_800_000_000.0)}
    problems = sorted(states.items())
    assert "recovery action node_reboot" in problems[0][1]
    assert "row remap pending" in problems[1][1]
    assert any("Xid 79 logged since the fix" in p for p in states["0000:75:00.0"])
    assert log.seen[0][-1] == "@1800000000"  # type: ignore[attr-defined]
    missing = check(["0000:ff:00.0"], since_at=None)
    assert missing[0].problems == ("not found by NVML",)


def test_xids_by_gpu():
    assert xids_by_gpu(["NVRM: Xid (PCI:0000:B1:00): 48, pid=1, DBE", "unrelated"]) == {
        "0000:b1:00.0": ["48"]}
