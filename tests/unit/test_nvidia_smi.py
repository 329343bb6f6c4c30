"""nvidia-smi and lspci artifact parsers: table, -q, -q -x, CSV, nvlink, lspci."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from collectors import dcgm, dcgm_exporter, nvidia_smi
from collectors.artifact import ArtifactResult, Line, ParseContext, parse_lines
from core.catalog import BY_NAME
from core.records import Event, NodeName, Record, Sample
from tests.conftest import FIXTURES, cases_dir

PARSERS = nvidia_smi.PARSERS + dcgm.PARSERS + dcgm_exporter.PARSERS


def parse(text: str) -> tuple[list[Record], ArtifactResult]:
    lines = [Line(i, t) for i, t in enumerate(text.splitlines(), start=1)]
    result = ArtifactResult()
    ctx = ParseContext(file="input.txt", node=NodeName("node-a"))
    records = list(parse_lines(lines, ctx, PARSERS, result))
    result.summarise(ctx.file)  # as read_artifact closes a file
    return records, result


def parse_file(path: str) -> tuple[list[Record], ArtifactResult]:
    with open(path, encoding="utf-8") as handle:
        return parse(handle.read())


def samples(records: Sequence[Record], metric: str, entity: str | None = None) -> list[Sample]:
    return [
        r
        for r in records
        if isinstance(r, Sample) and r.metric == metric and (entity is None or r.entity == entity)
    ]


def events(records: Sequence[Record], kind: str) -> list[Event]:
    return [r for r in records if isinstance(r, Event) and r.kind == kind]


def case(prefix: str) -> str:
    return str(next(cases_dir().glob(f"{prefix}-*")))


def check_records(records: Sequence[Record]) -> None:
    for r in records:
        if isinstance(r, Sample):
            assert r.metric in BY_NAME
            assert r.value == r.value
            assert r.evidence is not None
            assert r.evidence.line is not None
        else:
            assert r.evidence


# ---------------------------------------------------------------------------- table


def test_table_h100_volatile_uncorrected_ecc() -> None:
    records, result = parse_file(case("013"))
    check_records(records)
    ecc = samples(records, "gpu_ecc_errors_total", "0000:1a:00.0")
    assert [(s.value, dict(s.labels)) for s in ecc] == [
        (2.0, {"type": "uncorrected", "scope": "volatile", "location": "total"})
    ]
    assert samples(records, "gpu_power_limit_watts")[0].value == 700.0
    assert samples(records, "gpu_memory_total_bytes")[0].value == 81559 * 1024 * 1024
    # the second GPU's row is cut off after its first line: an issue, no records
    assert any("cut off" in i.reason for i in result.issues)


def test_table_err_power_is_an_event_not_a_value() -> None:
    records, _ = parse_file(case("014"))
    check_records(records)
    assert samples(records, "gpu_power_watts") == []
    errs = events(records, "nvidia_smi_err")
    assert [(e.entity, e.code) for e in errs] == [("a1b2:00:00.0", "power")]
    assert samples(records, "gpu_power_limit_watts")[0].value == 250.0


def test_table_err_fan_without_space_and_truncated_name() -> None:
    records, _ = parse_file(case("028"))
    errs = events(records, "nvidia_smi_err")
    assert [(e.entity, e.code) for e in errs] == [("0000:cc:00.0", "fan")]
    assert samples(records, "gpu_utilization_ratio", "0000:cc:00.0")[0].value == pytest.approx(0.93)
    assert samples(records, "gpu_fan_speed_ratio", "0000:c9:00.0")[0].value == pytest.approx(0.3)


def test_table_whole_row_err_is_gpu_lost_event() -> None:
    text = (
        "+-------------------------------+----------------------+----------------------+\n"
        "|   0  Tesla V100-SXM2...  On   | 00000000:18:00.0 Off |                 ERR! |\n"
        "|ERR!  ERR! ERR!    ERR! / ERR! |   ERR! /  ERR!       |    ERR!      Default |\n"
        "+-------------------------------+----------------------+----------------------+\n"
    )
    records, _ = parse(text)
    errs = events(records, "nvidia_smi_err")
    assert [(e.entity, e.code) for e in errs] == [("0000:18:00.0", "row")]
    assert samples(records, "gpu_temperature_celsius") == []


# ------------------------------------------------------------------------------- -q


def test_q_full_h100_x8() -> None:
    records, result = parse_file(str(FIXTURES / "nvidia-smi" / "h100-80gb-hbm3-x8-q.txt"))
    check_records(records)
    assert result.issues == []
    assert len(samples(records, "gpu_info")) == 8
    active = {
        s.labels["reason"]
        for s in samples(records, "gpu_clock_event_active", "0000:75:00.0")
        if s.value == 1
    }
    assert active == {"power_cap", "hw_power_brake", "sw_thermal"}
    assert samples(records, "gpu_pcie_replays_total", "0000:53:00.0")[0].value == 120
    assert [e.code for e in events(records, "fabric")] == ["completed"] * 8
    # Reset Required: No -> no recovery action sample invented
    assert samples(records, "gpu_recovery_action") == []


def test_q_a10_pending_remap() -> None:
    records, _ = parse_file(str(FIXTURES / "nvidia-smi" / "a10-q.txt"))
    pending = samples(records, "gpu_row_remap_pending", "0000:07:00.0")
    assert [s.value for s in pending] == [1.0]
    assert pending[0].evidence is not None
    assert "Pending" in pending[0].evidence.text
    unc = [s for s in samples(records, "gpu_remapped_rows") if s.labels["type"] == "uncorrectable"]
    assert unc[0].value == 4


def test_q_legacy_ecc_all_na_emits_nothing() -> None:
    records, _result = parse_file(str(FIXTURES / "nvidia-smi" / "titan-v-q.txt"))
    check_records(records)
    assert samples(records, "gpu_ecc_errors_total") == []
    assert samples(records, "gpu_remapped_rows") == []
    gens = {s.labels["bound"]: s.value for s in samples(records, "gpu_pcie_link_generation")}
    assert gens["max"] == 3
    assert gens["current"] == 1


def test_q_mig_device_ecc_is_not_gpu_level() -> None:
    records, _ = parse_file(str(FIXTURES / "nvidia-smi" / "h100-80gb-hbm3-mig-q.txt"))
    ecc = samples(records, "gpu_ecc_errors_total")
    locations = {(s.labels["scope"], s.labels["location"]) for s in ecc}
    assert ("volatile", "sram_parity") in locations
    assert ("volatile", "sram") in locations
    assert samples(records, "gpu_recovery_action")[0].value == 0
    assert samples(records, "gpu_power_watts")[0].value == pytest.approx(432.21)


def test_q_fragment_belongs_to_unknown_gpu() -> None:
    records, _ = parse_file(case("016"))
    assert {r.entity for r in records} == {nvidia_smi.UNKNOWN_GPU}
    assert samples(records, "gpu_row_remap_pending")[0].value == 1


def test_q_throttle_reasons_old_name_and_recovery_and_err() -> None:
    text = (
        "GPU 00000000:3B:00.0\n"
        "    Product Name                    : Tesla V100-SXM2-16GB\n"
        "    GPU Recovery Action             : Drain P2P\n"
        "    Fan Speed                       : ERR!\n"
        "    Clocks Throttle Reasons\n"
        "        Idle                        : Not Active\n"
        "        HW Slowdown                 : Active\n"
        "    ECC Errors\n"
        "        Volatile\n"
        "            SRAM Uncorrectable Parity  : 1\n"
        "            SRAM Uncorrectable SEC-DED : 0\n"
        "        Aggregate\n"
        "            SRAM Threshold Exceeded    : Yes\n"
        "    Retired Pages\n"
        "        Pending Page Blacklist      : Yes\n"
        "    Fabric\n"
        "        State                       : Completed\n"
        "        Status                      : Failure\n"
    )
    records, _ = parse(text)
    entity = "0000:3b:00.0"
    assert samples(records, "gpu_recovery_action", entity)[0].value == 3
    hw = samples(records, "gpu_clock_event_active", entity)
    assert {s.labels["reason"]: s.value for s in hw} == {"gpu_idle": 0, "hw_slowdown": 1}
    assert [e.code for e in events(records, "nvidia_smi_err")] == ["fan_speed"]
    parity = [s for s in samples(records, "gpu_ecc_errors_total") if s.value == 1]
    assert parity[0].labels["location"] == "sram_parity"
    assert samples(records, "gpu_sram_threshold_exceeded")[0].value == 1
    assert samples(records, "gpu_retired_pages_pending")[0].value == 1
    fabric = events(records, "fabric")[0]
    assert fabric.attrs["status"] == "Failure"
    assert len(fabric.evidence) == 2


def test_q_reset_required_flag_becomes_recovery_action() -> None:
    text = (
        "GPU 00000000:53:00.0\n"
        "    GPU Reset Status\n"
        "        Reset Required                    : Yes\n"
        "        Drain and Reset Recommended       : No\n"
    )
    records, _ = parse(text)
    assert samples(records, "gpu_recovery_action")[0].value == 1


# ------------------------------------------------------------------------------ XML


def test_xml_full_document() -> None:
    records, result = parse_file(str(FIXTURES / "nvidia-smi" / "a100-sxm4-80gb-mig-qx.xml"))
    check_records(records)
    assert result.issues == []
    entity = "0000:01:00.0"
    info = samples(records, "gpu_info", entity)[0]
    assert info.labels["model"] == "NVIDIA A100-SXM4-80GB"
    assert samples(records, "gpu_power_limit_watts", entity)[0].value == 500
    assert samples(records, "gpu_temperature_celsius", entity)[0].value == 27
    assert len(samples(records, "gpu_clock_event_active", entity)) == 9
    ecc = samples(records, "gpu_ecc_errors_total", entity)
    assert len(ecc) == 8
    assert all(s.value == 0 for s in ecc)


def test_xml_truncated_fragment_is_an_issue_never_an_alarm() -> None:
    records, result = parse_file(case("043"))
    assert any("XML" in i.reason and i.line is not None for i in result.issues)
    assert all(s.value == 0 for s in samples(records, "gpu_ecc_errors_total"))


@pytest.mark.parametrize(
    "text",
    [
        '<nvidia_smi_log>\n<gpu id="00000000:01:00.0">\n<ecc_errors><volatile><dram_unc',
        "<ecc_errors>\n<volatile>\n<<<>>>\n",
        "<product_name>A100</product_name>\n</gpu>\n</nvidia_smi_log>\n",
    ],
)
def test_xml_garbage_never_raises(text: str) -> None:
    records, result = parse(text)
    assert result.issues
    assert samples(records, "gpu_ecc_errors_total") == []


def test_xml_fragment_without_root_is_wrapped() -> None:
    text = (
        "<remapped_rows>\n"
        "    <remapped_row_corr>0</remapped_row_corr>\n"
        "    <remapped_row_unc>2</remapped_row_unc>\n"
        "    <remapped_row_pending>Yes</remapped_row_pending>\n"
        "    <remapped_row_failure>No</remapped_row_failure>\n"
        "    <row_remapper_histogram>\n"
        "        <row_remapper_histogram_none>1 bank(s)</row_remapper_histogram_none>\n"
        "    </row_remapper_histogram>\n"
        "</remapped_rows>\n"
        "<gpu_recovery_action>Reset</gpu_recovery_action>\n"
    )
    records, result = parse(text)
    assert result.issues == []
    assert samples(records, "gpu_row_remap_pending")[0].value == 1
    assert samples(records, "gpu_recovery_action")[0].value == 1
    hist = samples(records, "gpu_row_remap_bank_availability")[0]
    assert (hist.labels["availability"], hist.value) == ("none", 1)
    assert samples(records, "gpu_row_remap_pending")[0].evidence.line == 4  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ CSV


def test_csv_noheader_fields_from_command() -> None:
    records, _ = parse_file(case("008"))
    actions: dict[str, float] = {s.entity: s.value for s in samples(records, "gpu_recovery_action")}
    assert actions["gpu:1"] == 1
    assert actions["gpu:0"] == 0
    assert len(actions) == 8


def test_csv_header_units_and_na() -> None:
    text = (
        "$ nvidia-smi --query-gpu=index,pci.bus_id,temperature.gpu,power.draw,memory.used,"
        "utilization.gpu,remapped_rows.pending,clocks_event_reasons.hw_slowdown --format=csv\n"
        "index, pci.bus_id, temperature.gpu, power.draw [W], memory.used [MiB], "
        "utilization.gpu [%], remapped_rows.pending, clocks_event_reasons.hw_slowdown\n"
        "0, 00000000:1A:00.0, 35, 71.20 W, 4 MiB, 50 %, [N/A], Not Active\n"
        "1, 00000000:40:00.0, 36, ERR!, 4 MiB, 0 %, Yes, Active\n"
    )
    records, _result = parse(text)
    check_records(records)
    assert samples(records, "gpu_power_watts", "0000:1a:00.0")[0].value == pytest.approx(71.2)
    assert samples(records, "gpu_memory_used_bytes", "0000:1a:00.0")[0].value == 4 * 1024 * 1024
    assert samples(records, "gpu_utilization_ratio", "0000:1a:00.0")[0].value == 0.5
    assert samples(records, "gpu_row_remap_pending", "0000:1a:00.0") == []
    assert samples(records, "gpu_row_remap_pending", "0000:40:00.0")[0].value == 1
    assert [e.code for e in events(records, "nvidia_smi_err")] == ["power.draw"]
    reason = samples(records, "gpu_clock_event_active", "0000:40:00.0")[0]
    assert reason.labels["reason"] == "hw_slowdown"
    assert reason.value == 1


def test_csv_noheader_without_command_is_an_issue() -> None:
    text = "$ nvidia-smi --format=csv,noheader\n0, Reset\n"
    records, result = parse(text)
    assert samples(records, "gpu_recovery_action") == []
    assert result.issues


# --------------------------------------------------------------------------- nvlink


def test_nvlink_status_inactive_links() -> None:
    records, _ = parse_file(case("040"))
    states = {s.labels["link"]: s.value for s in samples(records, "gpu_nvlink_state", "gpu:3")}
    assert states == {"0": 1, "1": 1, "2": 1, "3": 0, "4": 1, "5": 0}
    assert samples(records, "gpu_info", "gpu:3")[0].labels["model"] == "Tesla V100-SXM2-32GB"


def test_nvlink_errors_and_all_inactive() -> None:
    text = (
        "$ nvidia-smi nvlink -e\n"
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-11111111-2222-3333-4444-555555555555)\n"
        "\t Link 0: Replay Errors: 3\n"
        "\t Link 0: CRC Data Errors: 1\n"
        "GPU 1: NVIDIA H100 PCIe (UUID: GPU-21111111-2222-3333-4444-555555555555)\n"
        "\t NVML: Unable to retrieve NVLink information as all links are inActive\n"
    )
    records, _ = parse(text)
    errors = samples(records, "gpu_nvlink_errors_total")
    assert {(s.labels["type"], s.value) for s in errors} == {("replay", 3), ("crc_data", 1)}
    assert errors[0].entity == "GPU-11111111-2222-3333-4444-555555555555"
    down = samples(records, "gpu_nvlink_state")
    assert [(s.entity, s.labels["link"], s.value) for s in down] == [
        ("GPU-21111111-2222-3333-4444-555555555555", "all", 0.0)
    ]


# ---------------------------------------------------------------------------- lspci


def test_lspci_link_of_nvidia_gpus_only() -> None:
    text = (
        "$ sudo lspci -vv\n"
        "1a:00.0 3D controller: NVIDIA Corporation GH100 [H100 SXM5 80GB] (rev a1)\n"
        "\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM not supported\n"
        "\t\tLnkSta:\tSpeed 16GT/s (downgraded), Width x8 (downgraded)\n"
        "\n"
        "5e:00.0 Non-Volatile memory controller: Samsung Electronics Co Ltd NVMe SSD\n"
        "\t\tLnkCap:\tPort #0, Speed 16GT/s, Width x4\n"
        "\t\tLnkSta:\tSpeed 8GT/s (downgraded), Width x2\n"
    )
    records, _ = parse(text)
    assert {r.entity for r in records} == {"0000:1a:00.0"}
    width = {s.labels["bound"]: s.value for s in samples(records, "gpu_pcie_link_width")}
    gen = {s.labels["bound"]: s.value for s in samples(records, "gpu_pcie_link_generation")}
    assert width == {"max": 16, "current": 8}
    assert gen == {"max": 5, "current": 4}


# --------------------------------------------------------------------------- robust


@pytest.mark.parametrize("text", ["", "\n\n", "garbage line\n\x00\x01 more", "| | |\n|x|"])
def test_garbage_and_empty_never_raise(text: str) -> None:
    records, _ = parse(text)
    assert [r for r in records if isinstance(r, Sample) and r.metric.startswith("gpu_ecc")] == []


def test_helpers() -> None:
    assert nvidia_smi.number("ERR!") is None
    assert nvidia_smi.number("16x") == (16.0, "x")
    assert nvidia_smi.is_missing("[Not Supported]")
    assert nvidia_smi.gpu_entity(uuid="...", index=None) is None


def test_nvlink_capabilities_are_not_issues() -> None:
    text = (
        "$ nvidia-smi nvlink -c\n"
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-11111111-2222-3333-4444-555555555555)\n"
        "\t Link 0, P2P is supported: true\n"
        "\t Link 0, Access to system memory supported: true\n"
    )
    records, result = parse(text)
    assert result.issues == []
    assert samples(records, "gpu_nvlink_state") == []


def test_cut_and_mangled_inputs_never_raise() -> None:
    rng = random.Random(7)
    files = sorted(cases_dir().glob("0*")) + sorted((FIXTURES / "nvidia-smi").glob("*-q*"))
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for _ in range(8):
            lines = text[: rng.randrange(0, len(text) + 1)]
            for _ in range(3):
                if lines:
                    i = rng.randrange(len(lines))
                    lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
            parse("\n".join(lines))


# ------------------------------------------------------- variants of real artifacts


def test_recovery_action_texts_of_several_drivers() -> None:
    code = nvidia_smi.recovery_code
    assert [code(v) for v in ("None", "Reset", "GPU Reset Required", "Node Reboot Required")] == [
        0,
        1,
        1,
        2,
    ]
    assert [
        code(v) for v in ("Drain P2P", "Drain and Reset", "NVML_GPU_RECOVERY_ACTION_NODE_REBOOT")
    ] == [
        3,
        4,
        2,
    ]
    assert code("Recover IMEX Domain") == 5
    assert code("something new") is None


def test_csv_bitmask_nvml_error_values_and_reset_status() -> None:
    text = (
        "index, pci.bus_id, clocks_event_reasons.active, reset_status.reset_required, "
        "temperature.gpu\n"
        "0, 00000000:18:00.0, 0x0000000000000088, No, 33\n"
        "1, 00000000:2A:00.0, [GPU is lost], [GPU is lost], [GPU is lost]\n"
        "2, 00000000:3B:00.0, 0x0000000000000001, Yes, 30\n"
    )
    records, result = parse(text)
    active = {
        r.labels["reason"]
        for r in samples(records, "gpu_clock_event_active", "0000:18:00.0")
        if r.value
    }
    assert active == {"hw_slowdown", "hw_power_brake"}
    (lost,) = events(records, "gpu_lost")
    assert lost.entity == "0000:2a:00.0"
    (action,) = samples(records, "gpu_recovery_action", "0000:3b:00.0")
    assert action.value == 1
    assert result.issues == []


def test_q_fabric_health_derived_and_indented_gpu_headers() -> None:
    text = (
        "    GPU 00000008:01:00.0\n"
        "        Fabric\n"
        "            State                         : Completed\n"
        "            Status                        : Success\n"
        "            Health\n"
        "                Bandwidth                 : Degraded\n"
        "                Route Unhealthy           : False\n"
        "    GPU 00000009:01:00.0\n"
        "        Remapped Rows\n"
        "            Pending                       : Yes\n"
    )
    records, _ = parse(text)
    (fabric,) = events(records, "fabric")
    assert fabric.entity == "0008:01:00.0"
    assert fabric.attrs["health_summary"].startswith("Unhealthy")
    (pending,) = samples(records, "gpu_row_remap_pending")
    assert pending.entity == "0009:01:00.0"


def test_table_followed_by_q_text_in_one_block() -> None:
    text = (
        "|   0  NVIDIA A100-SXM4-80GB          On  | 00000000:27:00.0 Off |                0 |\n"
        "| N/A   29C    P0              61W / 400W |      4MiB / 81920MiB |  0%      Default |\n"
        "+-----------------------------------------+----------------------+------------------+\n"
        "GPU 00000000:27:00.0\n"
        "    Remapped Rows\n"
        "        Pending                           : Yes\n"
    )
    records, result = parse(text)
    assert samples(records, "gpu_row_remap_pending", "0000:27:00.0")[0].value == 1
    assert samples(records, "gpu_temperature_celsius", "0000:27:00.0")
    assert result.kinds == ["nvidia_smi_table"]


def test_nvidia_smi_L_and_nvlink_without_links() -> None:
    text = (
        "GPU 0: Tesla T4 (UUID: GPU-7474aaaa-0000-0000-0000-000000000000)\n"
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-7474aaaa-0000-0000-0000-000000000001)\n"
        "  MIG 3g.20gb     Device  0: (UUID: MIG-7474aaaa-0000-0000-0000-000000000002)\n"
    )
    records, result = parse(text)
    assert result.kinds == ["nvidia_smi_nvlink"]
    assert not samples(records, "gpu_nvlink_state")
    assert result.issues == []
