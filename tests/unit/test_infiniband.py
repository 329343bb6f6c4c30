# ruff: noqa: E501  (real tool output lines are long)
from __future__ import annotations

import pytest

from collectors.artifact import ArtifactResult, Line, ParseContext, parse_lines
from collectors.infiniband import (
    PARSERS,
    EthtoolStatsSession,
    IbqueryerrorsSession,
    IbstatSession,
    PerfquerySession,
    SysfsDumpSession,
)
from collectors.parsers import artifact_parsers
from core.catalog import BY_NAME
from core.records import Event, NodeName, Record, Sample


def lines(text: str) -> list[Line]:
    return [Line(i, t) for i, t in enumerate(text.splitlines(), start=1)]


def parse(text: str) -> tuple[list[Record], ArtifactResult]:
    result = ArtifactResult()
    ctx = ParseContext(file="f.txt", node=NodeName("n1"))
    return list(parse_lines(lines(text), ctx, artifact_parsers(), result)), result


def samples(records: list[Record], metric: str | None = None) -> list[Sample]:
    return [r for r in records if isinstance(r, Sample) and (metric is None or r.metric == metric)]


def events(records: list[Record], kind: str | None = None) -> list[Event]:
    return [r for r in records if isinstance(r, Event) and (kind is None or r.kind == kind)]


def test_every_metric_is_catalogued():
    text = IBSTAT + "\n" + PERFQUERY_LEGACY + "\n$ ethtool -S eth2\n" + ETHTOOL + "\n" + SYSFS
    records, _ = parse(text)
    assert records
    assert all(s.metric in BY_NAME for s in samples(records))


IBSTAT = """\
CA 'mlx5_0'
\tCA type: MT4129
\tNumber of ports: 1
\tFirmware version: 28.39.1002
\tPort 1:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 400
\t\tBase lid: 12
\t\tLink layer: InfiniBand
CA 'mlx5_1'
\tCA type: MT4125
\tNumber of ports: 2
\tPort 1:
\t\tState: Down
\t\tPhysical state: Disabled
\t\tRate: 40
\t\tLink layer: Ethernet
\tPort 2:
\t\tState: Initializing
\t\tPhysical state: LinkUp
\t\tRate: 200
\t\tLink layer: InfiniBand
"""


def test_ibstat_several_cas_and_ports():
    records, result = parse(IBSTAT)
    assert result.kinds == ["ibstat"]
    states = {(e.entity, e.code) for e in events(records, "ib_port_state")}
    assert states == {("mlx5_0:1", "active"), ("mlx5_1:1", "down"), ("mlx5_1:2", "init")}
    roce = next(e for e in events(records, "ib_port_state") if e.entity == "mlx5_1:1")
    assert roce.attrs["link_layer"] == "ethernet"
    assert roce.attrs["phys_state"] == "disabled"
    rates = {str(s.entity): s.value for s in samples(records, "ib_port_rate_bits_per_second")}
    assert rates["mlx5_0:1"] == 400e9
    assert result.issues == []


def test_ibstatus():
    text = (
        "Infiniband device 'mlx5_0' port 1 status:\n"
        "\tdefault gid:\t fe80:0000:0000:0000:0c42:a103:0016:054c\n"
        "\tbase lid:\t 0x0\n"
        "\tstate:\t\t 1: DOWN\n"
        "\tphys state:\t 2: Polling\n"
        "\trate:\t\t 100 Gb/sec (4X EDR)\n"
        "\tlink_layer:\t InfiniBand\n"
    )
    records, _ = parse(text)
    (event,) = events(records, "ib_port_state")
    assert (event.entity, event.code, event.attrs["phys_state"]) == ("mlx5_0:1", "down", "polling")


PERFQUERY_LEGACY = """\
# Port counters: Lid 7 port 1 (CapMask: 0x1600)
PortSelect:......................1
CounterSelect:...................0x0000
SymbolErrorCounter:..............65535
LinkErrorRecoveryCounter:........0
LinkDownedCounter:...............3
PortRcvErrors:...................0
PortXmitDiscards:................0
LocalLinkIntegrityErrors:........15
ExcessiveBufferOverrunErrors:....0
VL15Dropped:.....................0
PortXmitData:....................4294967295
PortRcvData:.....................100
PortXmitPkts:....................10
PortRcvPkts:.....................10
PortXmitWait:....................0
"""


def test_perfquery_legacy_saturation_and_units():
    records, result = parse(PERFQUERY_LEGACY)
    assert result.kinds == ["perfquery"]
    rcv = samples(records, "ib_port_rcv_bytes_total")[0]
    assert rcv.value == 400
    assert rcv.entity == "lid-7:1"
    saturated = {e.code for e in events(records, "ib_counter_saturated")}
    assert saturated == {"SymbolErrorCounter", "LocalLinkIntegrityErrors", "PortXmitData"}


def test_perfquery_extended_wrapped_header_and_command():
    text = (
        "$ perfquery -x -C mlx5_4 -P 1\n"
        "# Port extended counters: Lid 21 port 1 (CapMask: 0x1600 CapMask2:\n"
        "0x0000000)\n"
        "PortSelect:......................1\n"
        "PortXmitData:....................4294967295\n"
        "SymbolErrorCounter:..............0\n"
    )
    records, result = parse(text)
    assert result.issues == []
    xmit = samples(records, "ib_port_xmit_bytes_total")[0]
    assert xmit.entity == "mlx5_4:1"
    assert xmit.value == 4294967295 * 4
    assert not events(records, "ib_counter_saturated")


def test_perfquery_garbage_line_is_issue():
    session = PerfquerySession(ParseContext(file="p", node=NodeName("n")))
    out = session.feed(
        lines(
            "# Port counters: Lid 1 port 1 (CapMask: 0x0)\nthis is not a counter\nPortRcvErrors:....x"
        )
    )
    assert out == []
    assert [i.line for i in session.issues] == [2, 3]


def test_ibqueryerrors_variants():
    text = (
        'Errors for 0x0002c90300a1b2c3 "node-b mlx5_0"\n'
        "   GUID 0x0002c90300a1b2c3 port 1: [LinkDownedCounter == 255] [SymbolErrorCounter == 12]\n"
        "   GUID 0x0002c90300a1b2c3 port 2: [PortRcvErrors == 4 (4.000)] [XmtDiscards == 9]\n"
        "## Summary: 4 nodes checked, 1 bad nodes found\n"
    )
    records, result = parse(text)
    assert result.kinds == ["ibqueryerrors"]
    assert result.issues == []
    by = {(str(s.entity), s.metric): s.value for s in samples(records)}
    assert by[("0x0002c90300a1b2c3:1", "ib_link_downed_total")] == 255
    assert by[("0x0002c90300a1b2c3:2", "ib_port_xmit_discards_total")] == 9
    (sat,) = events(records, "ib_counter_saturated")
    assert sat.code == "LinkDownedCounter"
    assert sat.entity == "0x0002c90300a1b2c3:1"


ETHTOOL = """\
NIC statistics:
     rx_packets: 10
     rx_crc_errors_phy: 0
     rx_prio3_bytes: 1000
     tx_prio3_bytes: 2000
     rx_prio3_pause: 7
     rx0_packets: 5
     tx_pause_ctrl_phy: 0
"""


def test_ethtool_counters():
    records, _ = parse("$ ethtool -S eth2\n" + ETHTOOL)
    prio = samples(records, "net_prio_bytes_total")
    assert {(s.labels["direction"], s.labels["priority"], s.value) for s in prio} == {
        ("rx", "3", 1000.0),
        ("tx", "3", 2000.0),
    }
    assert all(s.entity == "eth2" for s in samples(records))
    assert samples(records, "net_prio_pause_frames_total")[0].value == 7
    counters = {s.labels["counter"] for s in samples(records, "net_nic_counter_total")}
    assert counters == {"rx_packets", "rx_crc_errors_phy", "tx_pause_ctrl_phy"}


SYSFS = """\
/sys/class/infiniband/mlx5_0/ports/1/hw_counters/lifespan:12
/sys/class/infiniband/mlx5_0/ports/1/hw_counters/local_ack_timeout_err:5
/sys/class/infiniband/mlx5_0/ports/1/counters/port_rcv_data:10
/sys/class/infiniband/mlx5_0/ports/1/counters/symbol_error:65535
/sys/class/infiniband/mlx5_0/ports/1/state:4: ACTIVE
/sys/class/infiniband/mlx5_0/ports/1/rate:400 Gb/sec (4X NDR)
/sys/class/infiniband/mlx5_0/hw_counters/num_page_faults:1
"""


def test_sysfs_dump():
    records, result = parse(SYSFS)
    assert result.kinds == ["sysfs_dump"]
    hw = samples(records, "rdma_hw_counter_total")
    assert {(s.entity, s.labels["counter"]) for s in hw} == {
        ("mlx5_0:1", "local_ack_timeout_err"),
        ("mlx5_0", "num_page_faults"),
    }
    assert samples(records, "ib_port_rcv_bytes_total")[0].value == 40
    assert events(records, "ib_counter_saturated")[0].code == "SymbolErrorCounter"
    assert events(records, "ib_port_state")[0].code == "active"


def test_parsers_exported():
    assert {p.kind for p in PARSERS} == {
        "ibstat",
        "perfquery",
        "ibqueryerrors",
        "ethtool_stats",
        "sysfs_dump",
        "rdma_statistic",
        "ip_link_stats",
        "mlxlink",
        "ibdiagnet",
    }


@pytest.mark.parametrize(
    "session_type",
    [IbstatSession, PerfquerySession, IbqueryerrorsSession, EthtoolStatsSession, SysfsDumpSession],
)
@pytest.mark.parametrize(
    "text",
    [
        "",
        "garbage \x00 line",
        "\tPort 1:\n\t\tState: Bogus",
        "   GUID 0xzz port 1: [X == ]",
        "rx_prio0_bytes: -5",
    ],
)
def test_bad_input_never_raises(session_type, text):
    session = session_type(ParseContext(file="bad", node=NodeName("n")))
    out = list(session.feed(lines(text))) + list(session.close())
    assert not events(out, "ib_port_state")
    assert all(s.value >= 0 for s in samples(out))


def test_truncated_ibstat_port_is_issue_not_event():
    records, result = parse(
        "CA 'mlx5_0'\n\tCA type: MT4129\n\tPort 1:\n\t\tPhysical state: LinkUp\n"
    )
    assert not events(records, "ib_port_state")
    assert any("State" in i.reason for i in result.issues)


def test_detect_does_not_claim_other_text():
    plain = lines("[  12.3] NVRM: Xid (PCI:0000:b1:00): 79, GPU has fallen off the bus.")
    assert all(p.detect(plain, None) == 0 for p in PARSERS)


def test_other_nic_priority_counters():
    text = "NIC statistics:\n     rx_bytes_pri3: 500\n     tx_pfc_ena_frames_pri3: 4\n     rx_priority_5_xoff: 2\n"
    records, _ = parse(text)
    got = {
        (s.metric, s.labels.get("direction"), s.labels.get("priority"), s.value)
        for s in samples(records)
    }
    assert got == {
        ("net_prio_bytes_total", "rx", "3", 500.0),
        ("net_prio_pause_frames_total", "tx", "3", 4.0),
        ("net_prio_pause_frames_total", "rx", "5", 2.0),
    }


# --- more tools and layouts ------------------------------------------------------------


def test_ibstat_with_indentation_lost() -> None:
    text = (
        "CA 'mlx5_3'\nCA type: MT4119\nPort 1:\nState: Armed\nPhysical state: LinkUp\nRate: 100\n"
    )
    records, result = parse(text)
    (event,) = [r for r in records if isinstance(r, Event) and r.kind == "ib_port_state"]
    assert (event.entity, event.code) == ("mlx5_3:1", "armed")
    assert not result.issues


def test_rdma_statistic_show_link() -> None:
    text = "link mlx5_0/1 rx_write_requests 1182 out_of_sequence 1290 local_ack_timeout_err 2705 np_cnp_sent 0\n"
    records, result = parse(text)
    got = {s.labels["counter"]: s.value for s in samples(records, "rdma_hw_counter_total")}
    assert got == {
        "rx_write_requests": 1182,
        "out_of_sequence": 1290,
        "local_ack_timeout_err": 2705,
        "np_cnp_sent": 0,
    }
    assert result.kinds == ["rdma_statistic"]


def test_ip_s_link_new_and_old_layouts() -> None:
    text = (
        "4: ens1f0np0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 9000 qdisc mq state UP mode DEFAULT group default qlen 1000\n"
        "    link/ether 02:00:5e:10:00:02 brd ff:ff:ff:ff:ff:ff\n"
        "    RX:  bytes packets errors dropped  missed   mcast\n"
        "    2195783498134 845320277      3    1832       0   51223\n"
        "    RX errors: length   crc     frame   fifo    missed\n"
        "               0        3       0       0       0\n"
        "    TX:  bytes packets errors dropped carrier collsns\n"
        "    2655285206479 896117891      0       0       0       0\n"
    )
    records, result = parse(text)
    got = {s.labels["counter"]: s.value for s in samples(records, "net_nic_counter_total")}
    assert got["rx_errors"] == 3
    assert got["rx_crc_errors"] == 3
    assert got["rx_dropped"] == 1832
    assert got["tx_carrier_errors"] == 0
    assert "rx_bytes" not in got
    assert result.kinds == ["ip_link_stats"]


def test_mlxlink_state_opcode_and_counters() -> None:
    text = (
        "$ mlxlink -d mlx5_4 -c\n"
        "Operational Info\n----------------\n"
        "State                           : Polling\n"
        "Physical state                  : N/A\n\n"
        "Troubleshooting Info\n--------------------\n"
        "Status Opcode                   : 1024\n"
        "Recommendation                  : Cable is unplugged\n\n"
        "Physical Counters and BER Info\n------------------------------\n"
        "Effective Physical Errors       : 7\n"
        "Link Down Counter               : 2\n"
    )
    records, result = parse(text)
    (event,) = [r for r in records if isinstance(r, Event) and r.kind == "ib_port_state"]
    assert (event.entity, event.code) == ("mlx5_4:1", "down")
    assert event.attrs["recommendation"] == "Cable is unplugged"
    assert {s.metric: s.value for s in samples(records) if s.metric.startswith("ib_")} == {
        "ib_symbol_errors_total": 7,
        "ib_link_downed_total": 2,
    }
    assert result.kinds == ["mlxlink"]


def test_ibdiagnet_summary_rows() -> None:
    text = (
        "Summary\n"
        "-I- Stage                     Warnings   Errors     Comment\n"
        "-I- Discovery                 3          0\n"
        "-I- Speed / Width checks      1          2          See log\n"
    )
    records, _ = parse(text)
    got = [(r.code, r.attrs["errors"]) for r in records if isinstance(r, Event)]
    assert got == [("discovery", "0"), ("speed_width_checks", "2")]


def test_new_tools_emit_catalog_metrics_only() -> None:
    text = "link mlx5_0/1 out_of_sequence 1\n\n3: eth2: <UP> mtu 1500 state UP\n    RX: bytes  packets  errors  dropped overrun mcast\n    1 1 1 0 0 0\n"
    records, _ = parse(text)
    for sample in samples(records):
        assert sample.metric in BY_NAME


def test_rdma_link_states_and_layouts() -> None:
    text = (
        "link mlx5_0/1 state DOWN physical_state DISABLED netdev ens7f0np0\n"
        "8/1: mlx5_bond_0/1: state ACTIVE physical_state LINK_UP netdev reth0\n"
        "link mlx5_4/1: state INIT physical_state LINK_UP netdev ib0\n"
        "mlx5_1 port 1 ==> ib0 (Down)\n"
    )
    records, result = parse(text)
    got = [
        (r.entity, r.code, r.attrs.get("phys_state"), r.attrs.get("link_layer"))
        for r in records
        if isinstance(r, Event)
    ]
    assert got == [
        ("mlx5_0:1", "down", "disabled", "ethernet"),
        ("mlx5_bond_0:1", "active", "linkup", "ethernet"),
        ("mlx5_4:1", "init", "linkup", "infiniband"),
    ]
    assert not result.issues


def test_ibv_devinfo_port_states() -> None:
    text = "hca_id:\tmlx5_0\n\ttransport:\t\t\tInfiniBand (0)\n\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_DOWN (1)\n\t\t\tlink_layer:\t\tInfiniBand\n"
    records, _ = parse(text)
    (event,) = [r for r in records if isinstance(r, Event)]
    assert (event.entity, event.code) == ("mlx5_0:1", "down")


def test_markdown_quoted_ibstat() -> None:
    text = (
        "> CA 'mlx5_0'\n>     Port 1:\n>         State: Down\n>         Physical state: Polling\n"
    )
    records, _ = parse(text)
    (event,) = [r for r in records if isinstance(r, Event)]
    assert (event.entity, event.code) == ("mlx5_0:1", "down")
