"""Active reachability probes: round-trip time and loss to peers, without root.

``method="auto"`` uses an ICMP datagram socket (``SOCK_DGRAM``/``IPPROTO_ICMP``) when the
kernel's ``net.ipv4.ping_group_range`` includes this process's group, and a TCP connect
otherwise (ecosystem-reference §10.3). For TCP, a completed handshake *or a refusal*
(RST) both prove the path works and time the round trip; a timeout or an unreachable
network counts as loss.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Literal

from core.clock import Clock, system_clock
from core.errors import CollectorUnavailable
from core.records import NODE_ENTITY, Event, NodeName, Sample

logger = logging.getLogger(__name__)

Method = Literal["auto", "icmp", "tcp"]

_PING_GROUP_RANGE = Path("/proc/sys/net/ipv4/ping_group_range")
_REFUSED = {errno.ECONNREFUSED, errno.ECONNRESET}


def icmp_allowed(range_path: Path = _PING_GROUP_RANGE, gid: int | None = None) -> bool:
    """Tell whether this process may open an ICMP datagram socket.

    Args:
        range_path: The ``ping_group_range`` sysctl file.
        gid: Group to test; default this process's effective group.

    Returns:
        True when ``gid`` lies in the range (the kernel default ``1 0`` allows nobody).
    """
    try:
        low, high = (int(x) for x in range_path.read_text().split()[:2])
    except (OSError, ValueError):
        return False
    group = os.getegid() if gid is None else gid
    return low <= group <= high


def _split(peer: str, default_port: int) -> tuple[str, int]:
    host, sep, port = peer.rpartition(":")
    if sep and port.isdigit() and host and not host.endswith(":"):
        return host.strip("[]"), int(port)
    return peer.strip("[]"), default_port


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return int(~total & 0xFFFF)


class ProbeCollector:
    """Measures RTT and loss to each peer on every :meth:`collect`.

    Args:
        node: Node name put on every sample.
        peers: ``host`` or ``host:port`` (port used by TCP; ICMP ignores it).
        method: ``"auto"``, ``"icmp"`` or ``"tcp"``.
        timeout_seconds: Per-probe timeout; a probe that takes longer is lost.
        count: Probes per peer per collection (loss resolution is ``1/count``).
        tcp_port: Port for peers given without one (22: sshd answers on most nodes).
        clock: Epoch seconds stamped on samples.
    """

    name = "probe"

    def __init__(
        self,
        *,
        node: str,
        peers: Sequence[str] = (),
        method: Method = "auto",
        timeout_seconds: float = 1.0,
        count: int = 3,
        tcp_port: int = 22,
        clock: Clock = system_clock,
    ) -> None:
        if method not in ("auto", "icmp", "tcp"):
            raise ValueError(f"method must be auto, icmp or tcp, got {method!r}")
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count!r}")
        for peer in peers:
            if not isinstance(peer, str) or not peer.strip():
                raise ValueError(f"peers must be host or host:port strings, got {peer!r}")
        self.node = node
        self.peers = tuple(peers)
        self.method = method
        self.timeout_seconds = timeout_seconds
        self.count = count
        self.tcp_port = tcp_port
        self.clock = clock
        self.errors_total: Counter[str] = Counter()
        """Failed probes by reason (``timeout``, ``unreachable``, ``resolve``...)."""
        self._resolved: Literal["icmp", "tcp"] | None = None
        self._seq = 0

    def _method(self) -> Literal["icmp", "tcp"]:
        if self.method != "auto":
            return self.method
        if self._resolved is None:
            self._resolved = "icmp" if icmp_allowed() else "tcp"
            logger.info(
                "probe method: %s (net.ipv4.ping_group_range %s this group)",
                self._resolved,
                "includes" if self._resolved == "icmp" else "excludes",
            )
        return self._resolved

    def collect(self) -> Iterable[Sample | Event]:
        """Probe every peer ``count`` times.

        Returns:
            ``probe_rtt_seconds{peer,method}`` (mean of the probes that answered; omitted
            when none did) and ``probe_loss_ratio{peer,method}`` for each peer.

        Raises:
            CollectorUnavailable: ``method="icmp"`` but ICMP datagram sockets are not
                permitted for this process.
        """
        if not self.peers:
            return []
        method = self._method()
        probe: Callable[[str], float | None] = self._icmp if method == "icmp" else self._tcp
        out: list[Sample | Event] = []
        for peer in self.peers:
            rtts = [rtt for rtt in (probe(peer) for _ in range(self.count)) if rtt is not None]
            now = self.clock()
            labels = {"peer": peer, "method": method}
            if rtts:
                out.append(
                    Sample(
                        metric="probe_rtt_seconds",
                        value=sum(rtts) / len(rtts),
                        observed_at=now,
                        node=NodeName(self.node),
                        entity=NODE_ENTITY,
                        labels=labels,
                    )
                )
            out.append(
                Sample(
                    metric="probe_loss_ratio",
                    value=1.0 - len(rtts) / self.count,
                    observed_at=now,
                    node=NodeName(self.node),
                    entity=NODE_ENTITY,
                    labels=labels,
                )
            )
        return out

    def _tcp(self, peer: str) -> float | None:
        """Time one TCP handshake (or refusal) to ``peer``, seconds; ``None`` when lost."""
        host, port = _split(peer, self.tcp_port)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            self.errors_total["resolve"] += 1
            return None
        family, socktype, proto, _, addr = infos[0]
        with socket.socket(family, socktype, proto) as sock:
            sock.settimeout(self.timeout_seconds)
            start = time.perf_counter()
            try:
                sock.connect(addr)
            except TimeoutError:
                self.errors_total["timeout"] += 1
                return None
            except OSError as exc:
                if exc.errno in _REFUSED:
                    return time.perf_counter() - start
                self.errors_total["unreachable"] += 1
                return None
            return time.perf_counter() - start

    def _icmp(self, peer: str) -> float | None:
        """Time one ICMP echo to ``peer`` over a datagram socket, seconds; ``None`` when lost."""
        host, _ = _split(peer, 0)
        try:
            addr = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        except (socket.gaierror, IndexError):
            self.errors_total["resolve"] += 1
            return None
        self._seq = (self._seq + 1) & 0xFFFF
        payload = b"gpuhealth"
        header = struct.pack("!BBHHH", 8, 0, 0, 0, self._seq)
        packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), 0, self._seq) + payload
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
        except OSError as exc:
            self.errors_total["icmp_socket"] += 1
            raise CollectorUnavailable(
                f"ICMP probes not permitted ({exc.strerror}): net.ipv4.ping_group_range must "
                'include this process\'s group, or use method = "tcp"'
            ) from exc
        with sock:
            deadline = time.perf_counter() + self.timeout_seconds
            start = time.perf_counter()
            try:
                sock.sendto(packet, (addr, 0))
                while (left := deadline - time.perf_counter()) > 0:
                    sock.settimeout(left)
                    reply, _ = sock.recvfrom(2048)
                    if (
                        len(reply) >= 8
                        and reply[0] == 0
                        and struct.unpack("!H", reply[6:8])[0] == self._seq
                    ):
                        return time.perf_counter() - start
            except TimeoutError:
                pass
            except OSError:
                self.errors_total["unreachable"] += 1
                return None
        self.errors_total["timeout"] += 1
        return None

    def __repr__(self) -> str:
        return (
            f"ProbeCollector(node={self.node!r}, peers={self.peers!r}, "
            f"method={self.method!r}, timeout_seconds={self.timeout_seconds!r}, "
            f"count={self.count!r})"
        )
