from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors.probe import ProbeCollector, icmp_allowed
from core.clock import FakeClock
from core.errors import CollectorUnavailable
from core.protocols import Collector
from core.records import Sample


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


@pytest.fixture
def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _values(records: list[Sample], metric: str) -> dict[str, float]:
    return {r.labels["peer"]: r.value for r in records if r.metric == metric}


def test_tcp_rtt_and_no_loss_to_listening_port(listening_port: int) -> None:
    peer = f"127.0.0.1:{listening_port}"
    c = ProbeCollector(node="n1", peers=[peer], method="tcp", count=3,
                       clock=FakeClock(now=7.0))
    assert isinstance(c, Collector)
    records = [r for r in c.collect() if isinstance(r, Sample)]
    assert _values(records, "probe_loss_ratio") == {peer: 0.0}
    rtt = _values(records, "probe_rtt_seconds")[peer]
    assert 0.0 < rtt < 1.0
    assert all(r.labels["method"] == "tcp" and r.observed_at == 7.0 and r.node == "n1"
               and r.entity == "node" for r in records)


def test_refused_port_still_answers(closed_port: int) -> None:
    # A RST proves the path works: the host answered, only the port is closed.
    peer = f"127.0.0.1:{closed_port}"
    c = ProbeCollector(node="n1", peers=[peer], method="tcp", count=2)
    records = [r for r in c.collect() if isinstance(r, Sample)]
    assert _values(records, "probe_loss_ratio") == {peer: 0.0}
    assert peer in _values(records, "probe_rtt_seconds")


def test_unresolvable_peer_is_full_loss_without_rtt() -> None:
    peer = "no-such-host.invalid:22"
    c = ProbeCollector(node="n1", peers=[peer], method="tcp", count=2, timeout_seconds=0.2)
    records = [r for r in c.collect() if isinstance(r, Sample)]
    assert _values(records, "probe_loss_ratio") == {peer: 1.0}
    assert _values(records, "probe_rtt_seconds") == {}
    assert c.errors_total["resolve"] == 2


def test_default_port_used_without_one(listening_port: int) -> None:
    c = ProbeCollector(node="n1", peers=["127.0.0.1"], method="tcp", count=1,
                       tcp_port=listening_port)
    records = [r for r in c.collect() if isinstance(r, Sample)]
    assert _values(records, "probe_loss_ratio") == {"127.0.0.1": 0.0}


def test_no_peers_collects_nothing() -> None:
    assert list(ProbeCollector(node="n1").collect()) == []


def test_icmp_allowed_reads_ping_group_range(tmp_path: Path) -> None:
    sysctl = tmp_path / "ping_group_range"
    sysctl.write_text("1\t0\n")
    assert not icmp_allowed(sysctl, gid=0)
    sysctl.write_text("0\t2147483647\n")
    assert icmp_allowed(sysctl, gid=1000)
    assert not icmp_allowed(tmp_path / "missing", gid=0)


def test_auto_picks_tcp_when_icmp_is_not_allowed(monkeypatch: pytest.MonkeyPatch,
                                                 listening_port: int) -> None:
    monkeypatch.setattr("collectors.probe.icmp_allowed", lambda: False)
    c = ProbeCollector(node="n1", peers=[f"127.0.0.1:{listening_port}"], count=1)
    records = [r for r in c.collect() if isinstance(r, Sample)]
    assert {r.labels["method"] for r in records} == {"tcp"}


@pytest.mark.parametrize("kwargs", [{"method": "udp"}, {"count": 0}, {"timeout_seconds": 0},
                                    {"peers": [""]}])
def test_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        ProbeCollector(node="n1", **kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(icmp_allowed(), reason="ICMP datagram sockets are permitted here")
def test_icmp_not_permitted_is_unavailable_not_loss() -> None:
    c = ProbeCollector(node="n1", peers=["127.0.0.1"], method="icmp", count=1)
    with pytest.raises(CollectorUnavailable, match="ping_group_range"):
        list(c.collect())


@pytest.mark.skipif(not icmp_allowed(), reason="ICMP datagram sockets are not permitted here")
def test_icmp_echo_to_loopback() -> None:
    c = ProbeCollector(node="n1", peers=["127.0.0.1"], method="icmp", count=2)
    records = [r for r in c.collect() if isinstance(r, Sample)]
    assert _values(records, "probe_loss_ratio") == {"127.0.0.1": 0.0}
