"""replay exits as diagnose does; an XML cut before its first element is unreadable
(issue #14 item 5b)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuhealth.cli import main
from gpuhealth.diagnose import diagnose
from gpuhealth.replay import replay

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "cases"
XID79 = CASES / "001-xid79-fallen-off-bus-dmesg-T-nvidia-smi-unknown-error.log"
CLEAN = CASES / "031-perfquery-x-extended-counters-clean-baseline.txt"
XML = CASES / "043-nvidia-smi-q-x-ecc-section-fragment-baseline.xml"

CUT_BEFORE_ANY_ELEMENT = (
    '<?xml version="1.0" ?>\n'
    '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">\n'
    "<nvidia_smi_log>\n"
    "\t<timestamp>Mon Jan  6 10:00:00 2025</timest"
)
CUT_AFTER_AN_ELEMENT = (
    '<?xml version="1.0" ?>\n'
    "<nvidia_smi_log>\n"
    "\t<timestamp>Mon Jan  6 10:00:00 2025</timestamp>\n"
    "\t<driver_version>550.54.15</driver_version>\n"
    '\t<gpu id="00000000:07:00.0">\n'
    "\t\t<product_name>NVIDIA H1"
)


@pytest.mark.parametrize(("path", "status"), [(XID79, 3), (CLEAN, 0)])
def test_replay_exits_with_the_status_diagnose_gives(path: Path, status: int) -> None:
    assert diagnose([str(path)]).exit_status == status
    assert replay([str(path)]).exit_status == status
    result = CliRunner().invoke(main, ["replay", str(path)])
    assert result.exit_code == status, result.output


def test_an_xml_cut_before_its_first_element_is_unreadable(tmp_path: Path) -> None:
    cut = tmp_path / "nvidia-smi-q-x.xml"
    cut.write_text(CUT_BEFORE_ANY_ELEMENT)
    result = diagnose([str(cut)])
    assert result.exit_status == 4
    assert not result.parsed_anything
    (issue,) = result.issues
    assert issue.file == str(cut)
    assert "unreadable" in issue.reason
    assert replay([str(cut)]).exit_status == 4
    out = CliRunner().invoke(main, ["diagnose", str(cut)])
    assert out.exit_code == 4
    assert "no findings" not in out.output


def test_an_xml_cut_later_keeps_what_was_read(tmp_path: Path) -> None:
    cut = tmp_path / "nvidia-smi-q-x.xml"
    cut.write_text(CUT_AFTER_AN_ELEMENT)
    result = diagnose([str(cut)])
    assert result.exit_status == 0
    assert result.parsed_anything
    assert ["truncated" in i.reason for i in result.issues] == [True]
    assert diagnose([str(XML)]).exit_status == 0
    assert diagnose([str(XML)]).parsed_anything


def test_a_cut_xml_beside_a_kernel_log_counts_only_the_log(tmp_path: Path) -> None:
    both = tmp_path / "ticket.txt"
    both.write_text(XID79.read_text() + "\n$ nvidia-smi -q -x\n" + CUT_BEFORE_ANY_ELEMENT)
    result = diagnose([str(both)])
    assert result.exit_status == 3
    assert any("unreadable" in i.reason for i in result.issues)


def test_evidence_names_the_path_as_given(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "kern.log").write_bytes(XID79.read_bytes())
    monkeypatch.chdir(tmp_path)
    for given in ("logs/kern.log", "./logs/kern.log", "logs"):
        files = {e.file for f in diagnose([given]).findings for e in f.evidence}
        assert files == {given if given != "logs" else "logs/kern.log"}, given
        report = replay([given])
        files = {e.file for n in report.nodes for f in n.findings for e in f.evidence}
        assert files == {given if given != "logs" else "logs/kern.log"}, given
