# ruff: noqa: E501  (recorded /proc lines are long)
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from collectors.network import NetworkCollector
from core.catalog import BY_NAME
from core.clock import FakeClock
from core.protocols import Collector
from core.records import Event, Sample

PROC_NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    1000      10    0    0    0     0          0         0     1000      10    0    0    0     0       0          0
  eth0: 5000000    4000    1    2    0     0          0         0  6000000    3000    3    4    0     0       0          0
broken line without colon
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    write(proc / "net" / "dev", PROC_NET_DEV)
    net = sys / "class" / "net"
    write(net / "eth0" / "operstate", "up\n")
    write(net / "eth0" / "carrier_changes", "3\n")
    write(net / "eth0" / "statistics" / "rx_bytes", "5000000\n")
    write(net / "eth0" / "statistics" / "rx_crc_errors", "0\n")
    write(net / "eth0" / "statistics" / "tx_errors", "garbage\n")
    write(net / "lo" / "operstate", "unknown\n")
    port = sys / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    write(port / "state", "4: ACTIVE\n")
    write(port / "phys_state", "5: LinkUp\n")
    write(port / "rate", "400 Gb/sec (4X NDR)\n")
    write(port / "counters" / "symbol_error", "65535\n")
    write(port / "counters" / "link_downed", "0\n")
    write(port / "counters" / "port_rcv_data", "25\n")
    write(port / "counters" / "unicast_rcv_packets", "7\n")
    write(port / "hw_counters" / "local_ack_timeout_err", "2\n")
    write(port / "hw_counters" / "lifespan", "10\n")
    port2 = sys / "class" / "infiniband" / "mlx5_1" / "ports" / "1"
    write(port2 / "state", "1: DOWN\n")
    write(port2 / "phys_state", "2: Polling\n")
    return proc, sys


def collector(proc: Path, sys: Path, clock: FakeClock | None = None) -> NetworkCollector:
    return NetworkCollector(
        node="n1", proc_root=str(proc), sys_root=str(sys), clock=clock or FakeClock(now=100.0)
    )


def by_key(records: list[Sample | Event]) -> dict[tuple[str, str, str], float]:
    out = {}
    for r in records:
        if isinstance(r, Sample):
            extra = r.labels.get("counter", "")
            out[(str(r.entity), r.metric, extra)] = r.value
    return out


def test_protocol_and_catalog(tree):
    c = collector(*tree)
    assert isinstance(c, Collector)
    assert c.name == "network"
    records = c.collect()
    assert all(r.metric in BY_NAME for r in records if isinstance(r, Sample))
    assert all(r.observed_at == 100.0 for r in records)
    assert all(r.node == "n1" for r in records)


def test_netdev_values(tree):
    c = collector(*tree)
    values = by_key(c.collect())
    assert values[("eth0", "net_rx_bytes_total", "")] == 5000000
    assert ("eth0", "net_tx_errors_total", "") not in values  # malformed file omitted, not zero
    assert values[("eth0", "net_up", "")] == 1
    assert values[("eth0", "net_carrier_changes_total", "")] == 3
    assert values[("eth0", "net_nic_counter_total", "rx_crc_errors")] == 0
    assert ("lo", "net_up", "") not in values  # "unknown" operstate is omitted
    assert values[("lo", "net_rx_bytes_total", "")] == 1000  # from /proc/net/dev
    assert c.errors_total["malformed"] == 2  # tx_errors file and the broken /proc line


def test_infiniband_values_and_saturation(tree):
    c = collector(*tree)
    records = c.collect()
    values = by_key(records)
    assert values[("mlx5_0:1", "ib_port_state", "")] == 4
    assert values[("mlx5_0:1", "ib_port_rate_bits_per_second", "")] == 400e9
    assert values[("mlx5_0:1", "ib_port_rcv_bytes_total", "")] == 100
    assert values[("mlx5_0:1", "ib_symbol_errors_total", "")] == 65535
    assert values[("mlx5_0:1", "rdma_hw_counter_total", "local_ack_timeout_err")] == 2
    assert ("mlx5_0:1", "rdma_hw_counter_total", "lifespan") not in values
    saturated = [r for r in records if isinstance(r, Event) and r.kind == "ib_counter_saturated"]
    assert [(r.entity, r.code) for r in saturated] == [("mlx5_0:1", "SymbolErrorCounter")]
    states = [r for r in records if isinstance(r, Event) and r.kind == "ib_port_state"]
    assert [(r.entity, r.code) for r in states] == [("mlx5_1:1", "down")]
    # Second collection: nothing changed, no repeated events.
    again = c.collect()
    assert not [r for r in again if isinstance(r, Event)]


def test_state_change_gives_event(tree):
    proc, sys = tree
    c = collector(proc, sys)
    c.collect()
    write(sys / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "state", "4: ACTIVE\n")
    events = [r for r in c.collect() if isinstance(r, Event)]
    assert [(e.entity, e.code, e.attrs["previous_state"]) for e in events] == [
        ("mlx5_1:1", "active", "down")
    ]


def test_vanishing_interface_and_port_logged_once(tree, caplog):
    proc, sys = tree
    c = collector(proc, sys)
    c.collect()
    shutil.rmtree(sys / "class" / "infiniband" / "mlx5_1")
    shutil.rmtree(sys / "class" / "net" / "eth0")
    write(proc / "net" / "dev", PROC_NET_DEV.replace("  eth0:", "  gone:").replace("gone:", "lo2:"))
    with caplog.at_level("INFO", logger="collectors.network"):
        for _ in range(3):
            records = c.collect()
    assert not [r for r in records if str(r.entity) == "eth0"]
    assert not [r for r in records if str(r.entity).startswith("mlx5_1")]
    assert c.errors_total["vanished"] == 2
    vanished = [m for m in caplog.messages if "vanished" in m]
    assert len(vanished) == 2


def test_missing_roots_are_not_errors(tmp_path):
    c = NetworkCollector(
        node="n1", proc_root=str(tmp_path / "nope"), sys_root=str(tmp_path / "nope")
    )
    assert c.collect() == []
    assert sum(c.errors_total.values()) == 0


def test_unreadable_file_is_counted(tree):
    proc, sys = tree
    path = (
        sys
        / "class"
        / "infiniband"
        / "mlx5_0"
        / "ports"
        / "1"
        / "hw_counters"
        / "local_ack_timeout_err"
    )
    path.unlink()
    path.mkdir()  # reading a directory fails with OSError, even as root
    c = collector(proc, sys)
    values = by_key(c.collect())
    assert ("mlx5_0:1", "rdma_hw_counter_total", "local_ack_timeout_err") not in values
    assert c.errors_total["unreadable"] == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="node"):
        NetworkCollector(node="")


def test_real_machine_does_not_raise():
    c = NetworkCollector(node="self")
    records = c.collect()
    assert all(isinstance(r, Sample | Event) for r in records)
    if os.path.exists("/proc/net/dev"):
        assert any(isinstance(r, Sample) and r.metric == "net_rx_bytes_total" for r in records)
