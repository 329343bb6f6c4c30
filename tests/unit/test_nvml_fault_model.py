"""NVML-sourced states reach the diagnosis the fault model gives their nvidia-smi equivalents.

Each state is a real ``nvidia-smi -q`` / ``-q -x`` dump from tests/fixtures/nvidia-smi,
as is or with the one reading the state is about changed (the change is spelled out in
each case). The same text feeds both paths: the ``nvidia-smi`` parser, and the fake NVML
built from it and read by :class:`collectors.nvml.NvmlCollector`. Both record streams go
through :func:`analytics.fault_model.evaluate`; the findings about the state must agree
(kind, code, severity, action), and must be the fault-model.md row for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from analytics.fault_model import Context, Observations, evaluate
from collectors import nvidia_smi
from collectors.artifact import ArtifactResult, Line, ParseContext, parse_lines
from collectors.kernel_log import parse_kernel_lines
from collectors.nvml import NvmlCollector
from collectors.testing import FakeNvml, FakeNvmlGap, given_for_dump, parse_nvidia_smi_dump
from core.clock import FakeClock
from core.records import Action, Finding, NodeName, Record, Severity
from tests.conftest import cases_dir

DUMPS = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
STATE_KINDS = {
    "recovery_action",
    "row_remap",
    "ecc",
    "retired_pages",
    "throttle",
    "xid",
    "gpu_lost",
}

Verdict = tuple[str, str, Severity, Action]


def _write(tmp_path: Path, name: str, edits: tuple[tuple[str, str, int], ...]) -> Path:
    text = (DUMPS / name).read_text(encoding="utf-8")
    for old, new, count in edits:
        assert text.count(old) >= count, old
        text = text.replace(old, new, count)
    out = tmp_path / name
    out.write_text(text, encoding="utf-8")
    return out


def _verdicts(findings: list[Finding]) -> set[Verdict]:
    return {(f.kind, f.code, f.severity, f.action) for f in findings if f.kind in STATE_KINDS}


def _via_nvml(path: Path, fake: FakeNvml | None = None) -> tuple[set[Verdict], list[Record]]:
    fake = fake or FakeNvml.from_dump(path, **given_for_dump())
    collector = NvmlCollector(
        node="n1", nvml=fake, clock=FakeClock(now=1000.0), deadline_seconds=0, events=False
    )
    records = list(collector.collect())
    records += list(collector.collect())  # a second fast tick: fallbacks settled
    collector.close()
    assert not fake.gaps
    obs = Observations()
    obs.extend(records)
    return _verdicts(evaluate(obs, Context())), records


def _via_smi(path: Path) -> set[Verdict]:
    text = path.read_text(encoding="utf-8")
    lines = [Line(i, t) for i, t in enumerate(text.splitlines(), start=1)]
    records = list(
        parse_lines(
            lines,
            ParseContext(file=str(path), node=NodeName("n1")),
            nvidia_smi.PARSERS,
            ArtifactResult(),
        )
    )
    obs = Observations()
    obs.extend(records)
    return _verdicts(evaluate(obs, Context()))


CASES = [
    pytest.param(
        "h100-80gb-hbm3-mig-q.txt",
        (
            (
                "GPU Recovery Action                                : None",
                "GPU Recovery Action                                : Reset",
                1,
            ),
        ),
        ("recovery_action", "gpu_reset", Severity.CRITICAL, Action.RESET_GPU),
        id="recovery-action-reset",
    ),
    pytest.param(
        "a100-sxm4-80gb-mig-qx.xml",
        (
            (
                "<drain_and_reset_recommended>No</drain_and_reset_recommended>",
                "<drain_and_reset_recommended>Yes</drain_and_reset_recommended>",
                1,
            ),
        ),
        ("recovery_action", "drain_and_reset", Severity.CRITICAL, Action.RESET_GPU),
        id="drain-and-reset-driver-535",
    ),
    pytest.param(
        "a10-q.txt",
        (),  # as captured: Remapped Rows Pending: Yes
        ("row_remap", "pending", Severity.WARNING, Action.RESET_GPU),
        id="row-remap-pending",
    ),
    pytest.param(
        "a10-q.txt",
        (
            (
                "            SRAM Uncorrectable            : 0",
                "            SRAM Uncorrectable            : 2",
                2,
            ),
        ),
        ("ecc", "sram_uncorrectable", Severity.CRITICAL, Action.RESET_GPU),
        id="sram-uncorrectable",
    ),
    pytest.param(
        "h100-80gb-hbm3-x8-q.txt",
        (
            (
                "            SRAM Uncorrectable Parity     : 0",
                "            SRAM Uncorrectable Parity     : 1",
                2,
            ),
        ),
        ("ecc", "sram_uncorrectable", Severity.CRITICAL, Action.RESET_GPU),
        id="sram-uncorrectable-parity-hopper",
    ),
    pytest.param(
        "titan-v-q.txt",
        (
            (
                "        Single Bit ECC                    : N/A",
                "        Single Bit ECC                    : 0",
                1,
            ),
            (
                "        Double Bit ECC                    : N/A",
                "        Double Bit ECC                    : 2",
                1,
            ),
            (
                "        Pending Page Blacklist            : N/A",
                "        Pending Page Blacklist            : Yes",
                1,
            ),
        ),
        ("retired_pages", "pending", Severity.WARNING, Action.RESET_GPU),
        id="retired-pages-pending",
    ),
    pytest.param(
        "h100-80gb-hbm3-x8-q.txt",
        (),  # as captured: GPU 75 HW Power Brake Slowdown: Active
        ("throttle", "hw_power_brake", Severity.MAJOR, Action.FIX_CONFIG),
        id="power-brake",
    ),
    pytest.param(
        "h100-80gb-hbm3-x8-q.txt",
        (),  # as captured: GPU 75 SW Thermal Slowdown: Active
        ("throttle", "thermal", Severity.WARNING, Action.SERVICE_HARDWARE),
        id="thermal-slowdown-sw",
    ),
    pytest.param(
        "a10-q.txt",
        (
            (
                "            HW Thermal Slowdown           : Not Active",
                "            HW Thermal Slowdown           : Active",
                1,
            ),
        ),
        ("throttle", "thermal", Severity.WARNING, Action.SERVICE_HARDWARE),
        id="thermal-slowdown-hw",
    ),
]


@pytest.mark.parametrize(("dump", "edits", "expected"), CASES)
def test_nvml_state_gets_the_nvidia_smi_diagnosis(
    tmp_path: Path, dump: str, edits: tuple[tuple[str, str, int], ...], expected: Verdict
) -> None:
    path = _write(tmp_path, dump, edits)
    nvml, _records = _via_nvml(path)
    smi = _via_smi(path)
    assert expected in nvml, sorted(nvml)
    assert nvml == smi


@pytest.mark.parametrize(
    "dump", sorted(p.name for p in DUMPS.iterdir() if p.suffix in {".txt", ".xml"})
)
def test_fixture_dumps_as_captured_agree(dump: str) -> None:
    nvml, _records = _via_nvml(DUMPS / dump)
    assert nvml == _via_smi(DUMPS / dump)


def test_gpu_is_lost_is_the_xid79_class_finding() -> None:
    fake = FakeNvml.from_dump(DUMPS / "h100-80gb-hbm3-x8-q.txt", **given_for_dump())
    clock = FakeClock(now=1000.0)
    collector = NvmlCollector(node="n1", nvml=fake, clock=clock, deadline_seconds=0, events=False)
    records = list(collector.collect())
    fake.lose(2)  # GPU_IS_LOST from every call on GPU 2 from now on
    clock.advance(1.0)
    records += collector.collect()
    obs = Observations()
    obs.extend(records)
    verdicts = _verdicts(evaluate(obs, Context()))
    assert ("gpu_lost", "nvml_gpu_is_lost", Severity.CRITICAL, Action.REBOOT_NODE) in verdicts
    lost = [r for r in records if getattr(r, "kind", "") == "gpu_lost"]
    assert [r.entity for r in lost] == ["0000:75:00.0"]
    # the kernel log's Xid 79 for the same GPU is the same finding, not a second one
    obs.extend(
        parse_kernel_lines(
            [
                "[ 99.0] NVRM: Xid (PCI:0000:75:00): 79, pid='<unknown>', name=<unknown>, "
                "GPU has fallen off the bus."
            ],
            ParseContext(file="k", node=NodeName("n1")),
        )
    )
    lost_findings = [f for f in evaluate(obs, Context()) if f.entity == "0000:75:00.0"]
    assert len(lost_findings) == 1
    assert (lost_findings[0].severity, lost_findings[0].action) == (
        Severity.CRITICAL,
        Action.REBOOT_NODE,
    )


def test_injected_remap_failure_and_recovery_reboot() -> None:
    fake = FakeNvml.from_dump(DUMPS / "a10-q.txt", **given_for_dump())
    fake.gpus[0].set(remap_failure=1, recovery_action=2)
    verdicts, _records = _via_nvml(DUMPS / "a10-q.txt", fake)
    assert ("row_remap", "failure", Severity.CRITICAL, Action.SERVICE_HARDWARE) in verdicts
    assert ("recovery_action", "node_reboot", Severity.CRITICAL, Action.REBOOT_NODE) in verdicts


def test_a_case_fragment_answers_what_it_prints_and_nothing_else() -> None:
    case = next(cases_dir().glob("021-*"))  # A100, Row Remapper pending, pasted with [...]
    (gpu,) = parse_nvidia_smi_dump(case)
    assert (gpu.facts["remap_pending"], gpu.facts["remap_correctable"]) == (1, 1)
    assert gpu.facts[("ecc", 0, 0, 2)] == 177  # DRAM correctable, volatile
    assert "power_mw" in gpu.absent
    assert "power_mw" not in gpu.facts  # not printed: unknown, not "not supported"
    fake = FakeNvml([gpu])
    with pytest.raises(FakeNvmlGap):
        fake.nvmlDeviceGetPowerUsage(fake.handles[0])
    # with the rest declared not supported, NVML reaches the nvidia-smi diagnosis
    declared = FakeNvml.from_dump(case, **given_for_dump())
    for each in declared.gpus:
        each.declare_absent()
    nvml, _records = _via_nvml(case, declared)
    assert ("row_remap", "pending", Severity.WARNING, Action.RESET_GPU) in nvml
    assert nvml == _via_smi(case)
