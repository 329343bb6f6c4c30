from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from collectors.artifact import ArtifactResult, Line, ParseContext, read_artifact
from collectors.kernel_log import (
    PARSERS,
    KernelLogCollector,
    KernelLogParser,
    KernelLogSession,
    NvidiaSmiErrorParser,
    kmsg_to_dmesg,
    parse_kernel_lines,
)
from core.errors import CollectorUnavailable
from core.protocols import StreamingCollector
from core.records import Event, NodeName
from tests.conftest import cases_dir

CTX = ParseContext(file="k.log", node=NodeName("n1"))


def events(lines: list[str], ctx: ParseContext = CTX) -> list[Event]:
    return list(parse_kernel_lines(lines, ctx))


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


XID79 = (
    "NVRM: Xid (PCI:0000:b1:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
)


@pytest.mark.parametrize(
    ("line", "observed_at"),
    [
        (f"[Fri Apr  5 21:29:39 2024] {XID79}", at("2024-04-05T21:29:39")),
        (f"[ 1843.308145] {XID79}", None),
        (f"2024-04-05T21:29:39+0000 node-a kernel: {XID79}", at("2024-04-05T21:29:39")),
        (f"2024-04-05T23:29:39+02:00 node-a kernel: {XID79}", at("2024-04-05T21:29:39")),
        (f"2024-04-05T21:29:39.250000Z {XID79}", at("2024-04-05T21:29:39.25")),
        (
            f"192.0.2.1: kern: warning: [2024-04-05T21:29:39.52643656Z]: {XID79}",
            at("2024-04-05T21:29:39.526436"),
        ),
        (f"kern  :warn  : [ 1843.308145] {XID79}", None),
        (XID79, None),
    ],
)
def test_stamp_formats(line: str, observed_at: float | None) -> None:
    (ev,) = [e for e in events([line]) if e.kind == "xid"]
    assert ev.code == "79"
    assert ev.entity == "0000:b1:00.0"
    assert ev.observed_at == (pytest.approx(observed_at) if observed_at is not None else None)
    assert ev.evidence[0].text == line
    assert ev.evidence[0].line == 1


def test_syslog_with_host_and_uptime_and_default_year() -> None:
    ctx = ParseContext(file="s.log", node=NodeName("n1"), default_year=2023)
    line = f"Dec  2 11:38:47 node-a kernel: [  219.470994] {XID79}"
    (ev,) = events([line], ctx)
    assert ev.observed_at == at("2023-12-02T11:38:47")
    assert "year_assumed" not in ev.attrs
    assert ev.attrs["uptime_seconds"] == "219.470994"


def test_yearless_takes_year_of_other_stamp_in_file() -> None:
    lines = [
        f"Mar 27 17:40:36 kernel: {XID79}",
        "[Thu Apr  4 18:03:56 2019] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.161.07",
    ]
    xid = next(e for e in events(lines) if e.kind == "xid")
    assert datetime.fromtimestamp(xid.observed_at or 0, UTC).year == 2019
    assert "year_assumed" not in xid.attrs


def test_yearless_assumes_current_year_and_says_so() -> None:
    (ev,) = events([f"Jan  1 00:00:01 host kernel: {XID79}"])
    assert ev.attrs["year_assumed"] == str(datetime.now(UTC).year)
    assert ev.observed_at is not None


def test_dmesg_T_continuation_joined() -> None:
    lines = [
        "[Fri Apr  5 21:29:39 2024] NVRM: GPU 0000:b1:00.0: GPU has fallen off the bus.",
        "[Fri Apr  5 21:29:39 2024] NVRM: A GPU crash dump has been created. "
        "If possible, please run",
        "                           NVRM: nvidia-bug-report.sh as root to collect this data before",
        "                           NVRM: the NVIDIA kernel module is unloaded.",
    ]
    evs = events(lines)
    assert [(e.kind, e.code) for e in evs] == [("gpu_lost", "fallen_off_bus")]


def test_uptime_continuation_names_gpu_on_first_line() -> None:
    lines = [
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:c4:00.0",
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "               NVRM: fallen off the bus and is not responding to commands.",
        "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).",
    ]
    evs = events(lines)
    lost = [e for e in evs if e.kind == "gpu_lost"]
    assert len(lost) == 1
    assert lost[0].entity == "0000:c4:00.0"
    assert [e.line for e in lost[0].evidence] == [1, 2, 3]
    assert any(e.kind == "gpu_init_failure" and e.code == "probe_failed" for e in evs)


def test_journal_split_continuation_joined_by_stamp() -> None:
    lines = [
        "Mar 27 17:40:36 h kernel: NVRM: The NVIDIA GPU 0000:c4:00.0",
        "Mar 27 17:40:36 h kernel: NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "Mar 27 17:40:36 h kernel: NVRM: fallen off the bus and is not responding to commands.",
    ]
    (ev,) = events(lines)
    assert (ev.kind, ev.entity, len(ev.evidence)) == ("gpu_lost", "0000:c4:00.0", 3)


def test_state_kept_across_feeds() -> None:
    session = KernelLogSession(ctx=CTX)
    out = list(session.feed([Line(1, "[ 1.0] NVRM: The NVIDIA GPU 0000:c4:00.0")]))
    out += session.feed([Line(2, "               NVRM: fallen off the bus and is gone.")])
    out += session.close()
    assert [(e.kind, e.entity) for e in out if isinstance(e, Event)] == [
        ("gpu_lost", "0000:c4:00.0")
    ]


def test_rpc_history_table_is_one_event() -> None:
    lines = [
        "[   84.300488] NVRM: GPU6 _kgspLogRpcTimeout: ****** GSP Timeout ******",
        "[   84.738325] NVRM:     -2    73   SET_REGISTRY   0 0x0 0x0",
        "[   84.738339] NVRM: GPU6 RPC event history (CPU <- GSP):",
        "[   84.738342] NVRM:     entry function    sequence data0",
        "[   84.738345] NVRM:      0    4124 GSP_LOCKDOWN_NOTICE  0 0x0",
        "[   85.000000] usb 1-1: new device",
    ]
    (ev,) = events(lines)
    assert (ev.kind, ev.code, ev.entity) == ("gsp_rpc_timeout", "rpc_timeout", "gpu:6")
    assert len(ev.evidence) == 5
    assert ev.attrs["at_boot"] == "yes"


def test_xid154_and_nvlink5_decode() -> None:
    lines = [
        "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to "
        "0x2 (Node Reboot Required)",
        "NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 02 (0x0004b500 "
        "0x00000008 0x00000000 0x00000000)",
        "NVRM: Xid (PCI:0000:01:00): 45, pid=1, name=x, caused by previous Xid 79",
    ]
    e154, e145, e45 = events(lines)
    assert e154.attrs["recovery_action"] == "Node Reboot Required"
    assert e154.attrs["recovery_action_code"] == "2"
    assert (e145.attrs["unit"], e145.attrs["fatal"], e145.attrs["status"]) == (
        "RLW_RXPIPE",
        "no",
        "0x00000008",
    )
    assert e145.entity == "0018:01:00.0"
    assert e45.attrs["caused_by"] == "79"
    assert e45.attrs["process"] == "x"


def test_device_plugin_xid() -> None:
    lines = [
        "2024-08-09T13:32:51.873584285Z I0809 13:32:51.873541 1 health.go:185] XidCriticalError: "
        "Xid=94 on Device=GPU-91b3d5e7-2a4c-4f18-b6e0-3c7d9a1f5e28; marking device as unhealthy.",
        "2024-08-09T13:32:51.873595882Z I0809 13:32:51.873567 1 server.go:292] 'nvidia.com/gpu' "
        "device marked unhealthy: GPU-91b3d5e7-2a4c-4f18-b6e0-3c7d9a1f5e28",
    ]
    (ev,) = events(lines)
    assert (ev.kind, ev.code, ev.entity) == (
        "xid",
        "94",
        "GPU-91b3d5e7-2a4c-4f18-b6e0-3c7d9a1f5e28",
    )
    assert ev.observed_at == pytest.approx(at("2024-08-09T13:32:51.873584"))


def test_host_and_pcie_lines() -> None:
    lines = [
        "[  104.0] pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0",
        "[  104.1] nvidia 0000:01:00.0: PCIe Bus Error: severity=Uncorrected (Fatal), "
        "type=Transaction Layer, (Requester ID)",
        "[  104.2] nvidia 0000:01:00.0:   device [10de:2330] error status/mask=00004000/00000000",
        "[  106.0] EDAC MC0: 3 CE memory read error on CPU_SrcID#0_MC#0_Chan#0_DIMM#0 (page:0x1)",
        "[  107.0] {1}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 1",
        "[  107.1] {1}[Hardware Error]: event severity: recoverable",
        "[  107.2] {1}[Hardware Error]:   section_type: PCIe error",
        "[  107.3] mce: [Hardware Error]: Machine check events logged",
        "[  107.4] {1}[Hardware Error]:   device_id: 0000:5e:00.0",
        "[  107.5] {1}[Hardware Error]:   vendor_id: 0x144d, device_id: 0xa808",
        "[  108.0] pci 0000:04:00.0: 252.048 Gb/s available PCIe bandwidth, limited by 16.0 GT/s "
        "PCIe x16 link at 0000:01:00.0 (capable of 504.112 Gb/s with 32.0 GT/s PCIe x16 link)",
    ]
    evs = {(e.kind, e.code): e for e in events(lines)}
    aer = evs[("pcie_aer", "uncorrected_fatal")]
    assert (aer.entity, aer.attrs["vendor_id"], aer.attrs["driver"]) == (
        "0000:01:00.0",
        "10de",
        "nvidia",
    )
    assert len(aer.evidence) == 3
    assert evs[("host_memory", "CE")].attrs["count"] == "3"
    apei = evs[("pcie_aer", "uncorrected_nonfatal")]
    assert (apei.entity, apei.attrs["vendor_id"], apei.attrs["device_id"]) == (
        "0000:5e:00.0",
        "144d",
        "a808",
    )
    assert len(apei.evidence) == 5
    assert evs[("pcie_bandwidth_limited", "limited")].entity == "0000:04:00.0"


def test_sxid_and_init_lines() -> None:
    lines = [
        "[ 1.0] nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress error",
        "[ 2.0] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
        "[ 3.0] NVRM: GPU 0000:0a:00.0: RmInitAdapter failed! (0x24:0x72:1568)",
        "[ 4.0] NVRM: nvAssertOkFailedNoLog: Assertion failed: Reset required "
        "[NV_ERR_RESET_REQUIRED] (0x00000062) returned from status @ kernel_channel.c:2874",
        "[ 5.0] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build",
    ]
    got = [(e.kind, e.code, e.entity, e.attrs.get("fatal")) for e in events(lines)]
    assert got[:4] == [
        ("sxid", "12028", "0000:05:00.0", "no"),
        ("sxid", "20034", "0000:c3:00.0", "yes"),
        ("gpu_init_failure", "rm_init_adapter", "0000:0a:00.0", None),
        ("reset_required", "NV_ERR_RESET_REQUIRED", "node", None),
    ]
    assert got[4][:2] == ("driver_load", "570.158.01")


def test_reboot_counted_from_uptime() -> None:
    lines = [f"[ 900.0] {XID79}", "[    0.000000] Linux version 6.8.0", f"[  30.0] {XID79}"]
    xids = [e for e in events(lines) if e.kind == "xid"]
    assert [e.attrs["boot"] for e in xids] == ["0", "1"]


def test_nvidia_smi_error_lines() -> None:
    lines = [
        "Unable to determine the device handle for GPU0000:B1:00.0: Unknown Error",
        "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  Reboot",
        "No devices were found",
        "'CUDA-capable device(s) is/are busy or unavailable'",
    ]
    got = [(e.kind, e.code, e.entity) for e in events(lines)]
    assert got == [
        ("nvml_error", "unknown_error", "0000:b1:00.0"),
        ("gpu_lost", "nvml_gpu_is_lost", "0000:3b:00.0"),
        ("nvml_error", "no_devices", "node"),
        ("cuda_error", "busy_or_unavailable", "node"),
    ]


@pytest.mark.parametrize(
    "lines",
    [
        [],
        [""],
        ["\x00\x01\x02 garbage NVRM"],
        ["[ 12.3"],
        ["[Thu Apr 99 99:99:99 2024] NVRM: Xid (PCI:0000:b1:00): 79, x"],
        ["Feb 30 25:61:61 host kernel: NVRM: Xid (PCI:0000:b1:00): 79, x"],
        ["NVRM: Xid (PCI:0000:b1:00): 79"],
        ["NVRM: Xid (PCI:0000:b1:00): 13, pid=", "NVRM: Xid ("],
        ["{1}[Hardware Error]:", "pcieport AER: Corrected error received:"],
    ],
)
def test_bad_input_never_raises(lines: list[str]) -> None:
    session = KernelLogSession(ctx=CTX)
    session.feed([Line(i + 1, t) for i, t in enumerate(lines)])
    session.close()
    for issue in session.issues:
        assert issue.file == "k.log"
        assert issue.line is not None


def test_malformed_xid_is_an_issue() -> None:
    session = KernelLogSession(ctx=CTX)
    out = list(session.feed([Line(7, "[ 1.0] NVRM: Xid (PCI:zz): garbage")]))
    out += session.close()
    assert out == []
    assert [(i.line, i.reason) for i in session.issues] == [(7, "malformed Xid line")]


def test_detect_scores() -> None:
    kl, smi = KernelLogParser(), NvidiaSmiErrorParser()
    dmesg = [Line(1, "[    1.000000] usb 1-1: new high-speed USB device")]
    assert kl.detect(dmesg, None) >= 50
    assert kl.detect([Line(1, f"[ 1.0] {XID79}")], None) >= 90
    assert kl.detect([Line(1, "Mar 27 17:40:36 host kernel: eth0: link up")], None) >= 50
    smi_q = [
        Line(1, "    Product Name                          : NVIDIA A100-SXM4-80GB"),
        Line(2, "    Driver Version                        : 510.73.08"),
    ]
    assert kl.detect(smi_q, "nvidia-smi -q") == 0
    nccl = [Line(1, "node-a:1234:5678 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE")]
    assert kl.detect(nccl, None) == 0
    assert kl.detect([], None) == 0
    assert smi.detect([Line(1, "No devices were found")], "nvidia-smi") == 70
    assert smi.detect(smi_q, None) == 0
    assert {p.kind for p in PARSERS} == {"kernel_log", "nvidia_smi_error"}


@pytest.mark.parametrize(
    ("case", "kind", "code"),
    [
        ("001", "xid", "79"),
        ("003", "gpu_lost", "fallen_off_bus"),
        ("005", "xid", "109"),
        ("036", "xid", "154"),
        ("038", "gsp_error", "heartbeat_timeout"),
        ("042", "host_memory", "UE"),
    ],
)
def test_case_files_parse(case: str, kind: str, code: str) -> None:
    (path,) = sorted(cases_dir().glob(f"{case}-*"))
    result = ArtifactResult()
    ctx = ParseContext(file=str(path), node=NodeName("n1"))
    records = list(read_artifact(str(path), ctx, PARSERS, result))
    assert any(isinstance(r, Event) and (r.kind, r.code) == (kind, code) for r in records)


def test_kmsg_format() -> None:
    assert kmsg_to_dmesg("6,1,1500000,-;hello") == "[    1.500000] hello"
    assert kmsg_to_dmesg("garbage") is None


# ---------------------------------------------------------------- live collector


class _Script:
    """An injected sleep that changes the followed file between polls."""

    def __init__(self, steps: list[Callable[[], None]]) -> None:
        self.steps = steps
        self.calls = 0

    def __call__(self, seconds: float) -> None:
        assert seconds == pytest.approx(0.001)
        self.calls += 1
        assert self.calls < 100, "follower never delivered"
        if self.steps:
            self.steps.pop(0)()


def test_follow_file_survives_rotation_and_truncation(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(f"[ 1.0] {XID79}\n")  # before start: skipped (tail -F starts at the end)

    def append(text: str) -> Callable[[], None]:
        def do() -> None:
            with log.open("a") as fh:
                fh.write(text)

        return do

    def rotate() -> None:
        os.rename(log, tmp_path / "kern.log.1")

    def create() -> None:
        log.write_text("[ 3.0] NVRM: Xid (PCI:0000:02:00): 13, pid=1, name=a, boom\n")

    def truncate() -> None:
        log.write_text("")

    steps = [
        append("[ 2.0] NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=a, gone.\n"),
        rotate,
        lambda: None,  # file missing for a poll
        create,
        truncate,
        append("[ 4.0] NVRM: Xid (PCI:0000:03:00): 48, pid=1, name=a, DBE\n"),
    ]
    sleep = _Script(steps)
    collector = KernelLogCollector(
        node="n1",
        path=str(log),
        source="file",
        clock=lambda: 42.0,
        poll_interval_seconds=0.001,
        sleep=sleep,
    )
    got: list[tuple[str, str, float | None]] = []
    for ev in collector.stream():
        got.append((ev.code, ev.entity, ev.observed_at))
        if len(got) == 3:
            collector.close()
    assert got == [
        ("79", "0000:01:00.0", 42.0),
        ("13", "0000:02:00.0", 42.0),
        ("48", "0000:03:00.0", 42.0),
    ]
    assert collector.collect() == []
    assert isinstance(collector, StreamingCollector)


def test_collector_arguments() -> None:
    with pytest.raises(ValueError, match="unknown kernel log source"):
        KernelLogCollector(node="n", source="bogus")
    with pytest.raises(ValueError, match="positive"):
        KernelLogCollector(node="n", poll_interval_seconds=0)
    collector = KernelLogCollector(node="n", source="file")
    with pytest.raises(CollectorUnavailable):
        next(collector.stream())


def _fake_journalctl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe: str, follow: str
) -> Path:
    """A journalctl that answers the probe with ``probe`` and ``-f`` with ``follow``."""
    args = tmp_path / "journalctl.args"
    script = tmp_path / "journalctl"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {args}\n'
        'case "$*" in *-f*) ;; *) printf "%s" "$PROBE"; exit 0;; esac\n'
        'printf "%s" "$FOLLOW"\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("PROBE", probe)
    monkeypatch.setenv("FOLLOW", follow)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    return args


def _journal_entry(cursor: str, usec: int, message: str) -> str:
    import json

    return json.dumps(
        {
            "__CURSOR": cursor,
            "__REALTIME_TIMESTAMP": str(usec),
            "_HOSTNAME": "node-a",
            "MESSAGE": message,
        }
    )


def test_journal_source_with_fake_journalctl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    follow = (
        _journal_entry("c1", 1712352579_000000, XID79.replace("'<unknown>'", "1"))
        + "\n"
        + _journal_entry("c2", 1712352580_000000, "usb 1-1: new device")
        + "\n"
    )
    args = _fake_journalctl(
        tmp_path, monkeypatch, "Apr 05 21:29:38 node-a kernel: Linux version\n", follow
    )
    state = tmp_path / "state"
    collector = KernelLogCollector(
        node="n1", clock=lambda: 1.0, poll_interval_seconds=0.5, state_dir=str(state)
    )
    with caplog.at_level("INFO", logger="collectors.kernel_log"):
        got = list(collector.stream())
    assert collector.chosen_source == "journal"
    assert "reading journal (journalctl -k -b returned" in caplog.text
    assert [(e.code, e.entity, e.node, e.observed_at) for e in got] == [
        ("79", "0000:b1:00.0", "n1", at("2024-04-05T21:29:39"))
    ]
    assert got[0].evidence[0].line is None
    assert got[0].evidence[0].file == "journal"
    follow_args = [a for a in args.read_text().splitlines() if "-f" in a]
    assert "-b" in follow_args[0].split()
    assert "all" in follow_args[0].split()  # the whole boot
    assert '"cursor": "c2"' in (state / "kernel_log.state.json").read_text()
    list(KernelLogCollector(node="n1", state_dir=str(state)).stream())  # restart
    follow_args = [a for a in args.read_text().splitlines() if "-f" in a]
    assert "--after-cursor=c2" in follow_args[1].split()


def test_auto_skips_a_journal_without_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_journalctl(tmp_path, monkeypatch, "", "")  # "No journal files were found", status 0
    empty = tmp_path / "journal"
    (empty / "machine-id").mkdir(parents=True)
    monkeypatch.setattr("collectors.kernel_log.JOURNAL_DIRS", (str(empty),))
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    monkeypatch.setattr("collectors.kernel_log.KMSG_PATH", str(kmsg))
    collector = KernelLogCollector(node="n1")
    with caplog.at_level("INFO", logger="collectors.kernel_log"):
        assert collector._choose() == "kmsg"
    assert collector.chosen_source == "kmsg"
    assert "hold no journal files" in collector.chosen_reason
    assert f"reading {kmsg}" in caplog.text
    # journal files present: the journal is chosen although the probe printed nothing
    (empty / "machine-id" / "system.journal").write_text("x")
    assert KernelLogCollector(node="n1")._choose() == "journal"


def test_kmsg_reads_the_boot_backlog_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("boot-1\n")
    monkeypatch.setattr("collectors.kernel_log.KMSG_PATH", str(kmsg))
    monkeypatch.setattr("collectors.kernel_log.BOOT_ID_PATH", str(boot_id))
    records = [
        "6,1,1000000,-;Linux version 6.8.0",
        "4,2,5000000,-;" + XID79,
        "4,3,9000000,-;NVRM: Xid (PCI:0000:02:00): 13, pid=1, name=a, boom",
    ]

    def run(count: int) -> list[tuple[str, float | None]]:
        collector = KernelLogCollector(
            node="n1", source="kmsg", clock=lambda: 1000.0, state_dir=str(tmp_path)
        )
        collector._monotonic = lambda: 10.0  # booted 10 s ago
        fake: list[str | None] = [*records[:count], None]
        monkeypatch.setattr(collector, "_fd_lines", lambda fd, records: iter(fake))
        return [(e.code, e.observed_at) for e in collector.stream()]

    assert run(2) == [("79", 995.0)]  # boot backlog, dated from its uptime
    assert run(3) == [("13", 999.0)]  # restart: only what is new
    boot_id.write_text("boot-2\n")
    assert [c for c, _ in run(3)] == ["79", "13"]  # another boot: all of it


def test_file_with_state_starts_at_the_beginning_then_resumes(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(f"[ 1.0] {XID79}\n")
    state = tmp_path / "state"

    def run() -> list[str]:
        collector = KernelLogCollector(
            node="n1",
            path=str(log),
            source="file",
            clock=lambda: 42.0,
            poll_interval_seconds=0.001,
            sleep=lambda _s: collector.close(),
            state_dir=str(state),
        )
        return [e.code for e in collector.stream()]

    assert run() == ["79"]  # first run: from the start
    assert run() == []  # restart: nothing new
    with log.open("a") as fh:
        fh.write("[ 2.0] NVRM: Xid (PCI:0000:02:00): 13, pid=1, name=a, boom\n")
    assert run() == ["13"]


def test_auto_without_any_source_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda _name: None)
    monkeypatch.setattr("os.access", lambda *_a: False)
    collector = KernelLogCollector(node="n1")
    with pytest.raises(CollectorUnavailable, match="no readable kernel log"):
        next(collector.stream())


def test_fabric_manager_log_lines() -> None:
    lines = [
        "[Mar 27 2024 17:40:36] [ERROR] [tid 1234] detected NVSwitch fatal error 20034 on fid 0 "
        "on NVSwitch pci bus id 00000000:05:00.0 physical id 0 port 30",
        "Mar 27 17:40:36 host systemd[1]: nvidia-fabricmanager.service: "
        "Failed with result 'exit-code'.",
    ]
    sxid, fm = events(lines)
    assert (sxid.kind, sxid.code, sxid.entity, sxid.attrs["fatal"]) == (
        "sxid",
        "20034",
        "0000:05:00.0",
        "yes",
    )
    assert sxid.observed_at == at("2024-03-27T17:40:36")
    assert (fm.kind, fm.code) == ("fabric_manager", "start_failed")
    assert KernelLogParser().detect([Line(1, lines[0])], None) >= 50


@pytest.mark.parametrize(
    "prefix",
    [
        "Mar 27 17:40:36.123456 host kernel:",
        "Wed 2024-03-27 17:40:36 CET host kernel:",
        "[Mar27 17:40]",
        "[  +0.000012]",
        "<4>1 2024-03-27T17:40:36.123Z host kernel - - -",
        "2024-03-27T17:40:36,123456+0100",
    ],
)
def test_more_stamp_formats(prefix: str) -> None:
    ctx = ParseContext(file="k.log", node=NodeName("n1"), default_year=2024)
    (ev,) = events([f"{prefix} {XID79}"], ctx)
    assert (ev.kind, ev.code, ev.entity) == ("xid", "79", "0000:b1:00.0")


def test_indented_paste_is_not_one_long_message() -> None:
    found = events(
        [
            "    [  912.1] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=python, Graphics Exception",
            "    [  960.5] NVRM: Xid (PCI:0000:5e:00): 79, pid=2, name=python, GPU has fallen off",
            "  NVRM: Xid (PCI:0000:9b:00): 43, pid=3, name=python3, Ch 00000008",
            "  NVRM: Xid (PCI:0000:9b:00): 95, pid=3, name=python3, Uncontained: FBHUB.",
        ]
    )
    assert [(e.code, e.entity) for e in found if e.kind == "xid"] == [
        ("13", "0000:3b:00.0"),
        ("79", "0000:5e:00.0"),
        ("43", "0000:9b:00.0"),
        ("95", "0000:9b:00.0"),
    ]


def test_deeper_indented_unstamped_line_continues_the_message() -> None:
    (ev,) = events(
        [
            "Apr 19 12:34:42 host kernel: NVRM: API mismatch: the client 'x' (pid 849)",
            "                               NVRM: has the version 570.133.07, but this kernel",
        ]
    )
    assert (ev.kind, ev.code) == ("driver_mismatch", "api_mismatch")
    assert len(ev.evidence) == 2


def test_rsyslog_escaped_newlines() -> None:
    (ev,) = events(
        [
            "Jun 30 11:07:05 gpu-0 kernel: NVRM: API mismatch: the client has the version "
            "535.54.03, but#012NVRM: this kernel module has the version 530.30.02."
        ]
    )
    assert ev.kind == "driver_mismatch"


@pytest.mark.parametrize(
    ("line", "kind", "code", "entity"),
    [
        (
            "[ 4.8] nvidia 0000:3b:00.0: probe with driver nvidia failed with error -1",
            "gpu_init_failure",
            "probe_failed",
            "0000:3b:00.0",
        ),
        (
            "[ 23.9] nvidia 0000:07:00.0: Direct firmware load for nvidia/570.144/gsp_ga10x.bin "
            "failed with error -2",
            "gpu_init_failure",
            "firmware_missing",
            "0000:07:00.0",
        ),
        (
            "[ 23.9] NVRM: RmFetchGspRmImages: No firmware image found",
            "gpu_init_failure",
            "firmware_missing",
            "node",
        ),
        (
            "[ 9.1] NVRM: nvGpuOpsReportFatalError: uvm encountered global fatal error 0x60, "
            "requiring os reboot to recover.",
            "reboot_required",
            "uvm_fatal",
            "node",
        ),
        (
            "[ 9.2] NVRM: Rate limiting GSP RPC error prints for GPU at PCI:0000:3b:00 (printing "
            "1 of every 30).  The GPU likely needs to be reset.",
            "gsp_rpc_timeout",
            "rpc_timeout",
            "0000:3b:00.0",
        ),
        (
            "XID 79(GPU has fallen off the bus) detected on PCI:0000:ae:00",
            "xid",
            "79",
            "0000:ae:00.0",
        ),
        (
            "[Mar 27 2024 17:40:36.123456] [ERROR] [tid 12] detected NVSwitch non-fatal error "
            "12028 on fid 0 on NVSwitch pci bus id 00000000:86:00.0 physical id 1 port 32",
            "sxid",
            "12028",
            "0000:86:00.0",
        ),
        (
            "Sep 18 03:19:01 h nv-fabricmanager[1]: NVIDIA Fabric Manager doesn't support this "
            "system",
            "fabric_manager",
            "not_supported",
            "node",
        ),
        (
            "[1.0] EDAC MC0: CE page 0x1a3c22, offset 0x480, grain 0, syndrome 0x21, row 2, "
            'channel 1, label "DIMM_B1": i5000 CE',
            "host_memory",
            "CE",
            "node",
        ),
    ],
)
def test_more_driver_wordings(line: str, kind: str, code: str, entity: str) -> None:
    found = [e for e in events([line]) if e.kind == kind]
    assert [(e.code, e.entity) for e in found] == [(code, entity)]


def test_xid154_without_from_part() -> None:
    (ev,) = events(
        ["NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed to 0x1 (GPU Reset Required)"]
    )
    assert ev.attrs["recovery_action"] == "GPU Reset Required"
    assert ev.attrs["recovery_action_code"] == "1"


def test_unstamped_block_with_driver_lines_deep_inside_is_a_kernel_log() -> None:
    noise = [Line(i, f"systemd: Started Session {i} of User root.") for i in range(1, 80)]
    block = [*noise, Line(80, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, fallen off")]
    assert KernelLogParser().detect(block, None) >= 20
    assert KernelLogParser().detect(noise, None) == 0


def test_rasdaemon_memory_errors() -> None:
    found = events(
        [
            "24 2022-10-16 06:55:24 +0000 3 Corrected error(s): memory read error at "
            "CPU_SrcID#1_MC#1_Chan#1_DIMM#0 location: 3:1:0:-1",
            "26 2022-10-16 07:12:03 +0000 1 Uncorrected error(s): memory read error at "
            "CPU_SrcID#1_MC#1_Chan#1_DIMM#0 location: 3:1:0:-1",
        ]
    )
    assert [(e.kind, e.code, e.attrs["count"]) for e in found] == [
        ("host_memory", "CE", "3"),
        ("host_memory", "UE", "1"),
    ]


def test_printk_caller_id_after_the_stamp() -> None:
    found = events(
        [
            "[ 8812.114420] [  T812] nvidia 0000:3b:00.0: AER: PCIe Bus Error: "
            "severity=Uncorrected (Fatal), type=Transaction Layer, (Requester ID)",
            "[ 8813.000001] [ C12] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, fallen off",
        ]
    )
    assert sorted((e.kind, e.code, e.attrs.get("driver", "")) for e in found) == [
        ("pcie_aer", "uncorrected_fatal", "nvidia"),
        ("xid", "79", ""),
    ]
    (xid79,) = [e for e in found if e.kind == "xid"]
    assert xid79.attrs["uptime_seconds"] == "8813.000001"


XID79_B1 = "NVRM: Xid (PCI:0000:b1:00): 79, pid=1, name=a, GPU has fallen off the bus."


@pytest.mark.parametrize(
    "shape",
    [
        "Mar 14 02:11:07 {h} kernel: [ 5.0] {m}",
        "<4>1 2025-03-14T02:11:09.123456+00:00 {h} kernel - - - {m}",
        "{h}: [ 5.0] {m}",
        '{{"MESSAGE":"{m}","_HOSTNAME":"{h}","__REALTIME_TIMESTAMP":"1718091662000000"}}',
        "2025-03-14T02:11:09+0000 {h} kernel: {m}",
    ],
)
def test_two_hosts_in_one_input_name_the_events_node(shape: str) -> None:
    lines = [shape.format(h="gpu-017", m=XID79_B1), shape.format(h="gpu-042", m=XID79_B1)]
    got = events(lines, ParseContext(file="k.log", node=NodeName("localhost"), default_year=2025))
    assert sorted(e.node for e in got) == ["gpu-017", "gpu-042"]
    # one host only: the context's node (symptoms of one pasted file fold together)
    got = events(lines[:1] * 2, ParseContext(file="k.log", node=NodeName("n1"), default_year=2025))
    assert {e.node for e in got} == {"n1"}


def test_remote_syslog_hosts() -> None:
    lines = [
        f"192.0.2.119: kern: warning: [2026-04-22T21:30:51.5Z]: {XID79_B1}",
        f"192.0.2.120: kern: warning: [2026-04-22T21:30:52.5Z]: {XID79_B1}",
    ]
    assert [e.node for e in events(lines)] == ["192.0.2.119", "192.0.2.120"]


def test_rfc5424_is_stamped() -> None:
    line = f"<4>1 2025-03-14T02:11:09.5+00:00 node-a kernel - - - {XID79_B1}"
    (event,) = events([line])
    assert event.observed_at == at("2025-03-14T02:11:09.5")
    assert event.node == "n1"


def test_live_syslog_lines_without_a_year_are_released_when_idle(tmp_path: Path) -> None:
    """kern.log's classic stamps carry no year: a live event must not wait for one."""
    log = tmp_path / "kern.log"
    log.write_text(
        f"Nov 30 07:11:32 gpu-017 kernel: {XID79}\n"
        "Nov 30 07:11:34 gpu-017 kernel: NVRM: Xid (PCI:0000:02:00): 94, pid=1, name=a, "
        "Contained: SM (0x1).\n"
    )
    seen: list[tuple[str, float | None]] = []
    idle = {"polls": 0}

    def on_idle(_s: float) -> None:
        idle["polls"] += 1
        if idle["polls"] > 1:
            collector.close()

    collector = KernelLogCollector(
        node="n1",
        path=str(log),
        source="file",
        clock=lambda: 1_796_000_000.0,
        poll_interval_seconds=0.001,
        sleep=on_idle,
        from_start=True,
    )
    for event in collector.stream():
        seen.append((event.code, event.observed_at))
        if len(seen) == 2:
            assert idle["polls"] <= 1, "released only at close, not when idle"
    assert [code for code, _ in seen] == ["79", "94"]
    assert all(at is not None and time.gmtime(at).tm_year == 2026 for _, at in seen)
