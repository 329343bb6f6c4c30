"""The live network collector: netdev and InfiniBand/RDMA counters of the local node.

Sources (ecosystem-reference §10):

* ``/proc/net/dev`` (receive ``bytes packets errs drop ...``, transmit ``bytes
  packets errs drop ...``), used for interfaces whose
  ``/sys/class/net/<if>/statistics/`` cannot be read;
* ``/sys/class/net/<if>/statistics/*``, ``operstate`` and ``carrier_changes``
  (``Documentation/ABI/testing/sysfs-class-net``);
* ``/proc/net/bonding/<bond>`` (kernel ``Documentation/networking/bonding.rst``), read by
  :mod:`collectors.bonding` into the ``net_bond_*`` samples that ``diagnose`` gives for a
  pasted copy; a member's ``Link Failure Count`` rising between collections is a
  ``bond_member_flap`` event;
* ``/sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,counters/*,hw_counters/*}``
  (``Documentation/ABI/stable/sysfs-class-infiniband``). ``port_xmit_data`` and
  ``port_rcv_data`` count 4-octet words and are multiplied by 4; legacy
  PortCounters error counters saturate at all-ones and are reported once as an
  ``ib_counter_saturated`` event when they reach it.

Missing or unreadable files are skipped, never filled with zeros, and counted in
:attr:`NetworkCollector.errors_total` by reason; an interface or port that vanishes
between collections is logged once.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable

from collectors.bonding import read_bond
from collectors.infiniband import (
    NETDEV_STATS,
    SYSFS_COUNTERS,
    counter_samples,
    parse_phys_state,
    parse_port_state,
    parse_rate_bits,
    port_entity,
)
from collectors.netdev import RISE_COUNTERS
from core.clock import system_clock
from core.records import EntityId, Event, Evidence, NodeName, Record, Sample

logger = logging.getLogger(__name__)

PROC_NET_DEV_FIELDS: dict[int, str] = {
    0: "net_rx_bytes_total",
    1: "net_rx_packets_total",
    2: "net_rx_errors_total",
    3: "net_rx_dropped_total",
    8: "net_tx_bytes_total",
    9: "net_tx_packets_total",
    10: "net_tx_errors_total",
    11: "net_tx_dropped_total",
}
"""Column (0-based, after the interface name) of ``/proc/net/dev`` to catalog metric."""

_NETDEV_COUNTER: dict[str, str] = {metric: name for name, metric in NETDEV_STATS.items()}
"""Catalog metric to its ``statistics/`` file name (``net_rx_errors_total`` -> ``rx_errors``)."""

OPERSTATE_UP: dict[str, float] = {
    "up": 1.0,
    "down": 0.0,
    "lowerlayerdown": 0.0,
    "dormant": 0.0,
    "notpresent": 0.0,
}
"""RFC 2863 ``operstate`` values that say whether the link is up; ``unknown`` is omitted."""

_ACTIVE = {"active", "active_defer"}


class NetworkCollector:
    """Collect netdev and InfiniBand/RDMA port metrics from ``/proc`` and ``/sys``.

    Attributes:
        name: ``"network"``.
        node: Node name put on every record.
        proc_root: Root of the proc file system (a fake tree in tests).
        sys_root: Root of the sys file system.
        clock: Returns epoch seconds; stamps ``observed_at``.
        errors_total: Files skipped, by reason (``unreadable``, ``malformed``,
            ``vanished``); the service exports it as
            ``gpuhealth_collector_errors_total{collector="network"}``.
    """

    name = "network"

    def __init__(
        self,
        *,
        node: str,
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        clock: Callable[[], float] = system_clock,
    ) -> None:
        if not node:
            raise ValueError("node must not be empty")
        self.node = node
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.clock = clock
        self.errors_total: Counter[str] = Counter()
        self._seen_ifaces: set[str] = set()
        self._seen_ports: set[str] = set()
        self._port_states: dict[str, str] = {}
        self._saturated: set[tuple[str, str]] = set()
        self._logged: set[str] = set()
        self._netdev_last: dict[tuple[str, str], tuple[float, float]] = {}
        self._bond_failures: dict[tuple[str, str], float] = {}

    # --- helpers -----------------------------------------------------------

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.info(message, *args)

    def _read(self, path: str) -> str | None:
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                return handle.read().strip()
        except OSError as exc:
            self.errors_total["unreadable"] += 1
            self._log_once(f"read:{path}", "cannot read %s: %s", path, exc.strerror)
            return None

    def _read_int(self, path: str) -> int | None:
        text = self._read(path)
        if text is None:
            return None
        try:
            return int(text, 0) if text.lower().startswith("0x") else int(text)
        except ValueError:
            self.errors_total["malformed"] += 1
            self._log_once(f"malformed:{path}", "not a number in %s: %r", path, text[:40])
            return None

    @staticmethod
    def _listdir(path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    def _sample(
        self, metric: str, value: float, entity: str, labels: dict[str, str], at: float
    ) -> Sample:
        return Sample(
            metric=metric,
            value=value,
            observed_at=at,
            node=NodeName(self.node),
            entity=EntityId(entity),
            labels=labels,
        )

    # --- collection ----------------------------------------------------------

    def collect(self) -> list[Sample | Event]:
        """Return the current netdev and IB samples, and port-state events on change."""
        at = self.clock()
        out: list[Record] = []
        out.extend(self._collect_netdev(at))
        out.extend(self._collect_infiniband(at))
        out.extend(self._collect_bonding(at))
        return out

    def _collect_bonding(self, at: float) -> list[Record]:
        """Read ``/proc/net/bonding/*`` when present (:mod:`collectors.bonding`).

        A member whose ``Link Failure Count`` rose since the last collection gives a
        ``bond_member_flap`` event: it went down and came back in between.
        """
        root = os.path.join(self.proc_root, "net", "bonding")
        out: list[Record] = []
        for bond in self._listdir(root):
            text = self._read(os.path.join(root, bond))
            if text is None:
                continue
            samples = read_bond(text, bond, node=NodeName(self.node), observed_at=at)
            if not samples:
                self.errors_total["malformed"] += 1
                self._log_once(f"bond:{bond}", "no bond status in /proc/net/bonding/%s", bond)
                continue
            out.extend(samples)
            for sample in samples:
                if sample.metric != "net_bond_member_link_failures_total":
                    continue
                key = (bond, sample.labels["interface"])
                previous = self._bond_failures.get(key)
                self._bond_failures[key] = sample.value
                if previous is None or sample.value <= previous:
                    continue
                out.append(
                    Event(
                        kind="bond_member_flap",
                        code=sample.labels["interface"],
                        node=NodeName(self.node),
                        entity=EntityId(bond),
                        observed_at=at,
                        message=(
                            f"{bond} member {sample.labels['interface']} link failures "
                            f"{previous:.0f} -> {sample.value:.0f}"
                        ),
                        attrs={
                            "bond": bond,
                            "interface": sample.labels["interface"],
                            "delta": f"{sample.value - previous:.0f}",
                        },
                        source=self.name,
                    )
                )
        return out

    def _collect_netdev(self, at: float) -> list[Record]:
        out: list[Record] = []
        proc = self._proc_net_dev()
        class_net = os.path.join(self.sys_root, "class", "net")
        sys_ifaces = self._listdir(class_net)
        ifaces = sorted(set(proc) | set(sys_ifaces))
        for iface in sorted(self._seen_ifaces - set(ifaces)):
            self.errors_total["vanished"] += 1
            self._log_once(f"vanished:{iface}", "interface %s vanished", iface)
        self._seen_ifaces = set(ifaces)
        for iface in ifaces:
            labels = {"interface": iface}
            base = os.path.join(class_net, iface)
            from_sys = self._netdev_sysfs(iface, base, at) if iface in sys_ifaces else []
            counters: list[Record] = list(from_sys)
            if not from_sys and iface in proc:
                for metric, value in proc[iface].items():
                    counters.append(self._sample(metric, float(value), iface, labels, at))
            out.extend(counters)
            out.extend(self._netdev_rises(iface, counters, at))
            if iface not in sys_ifaces:
                continue
            oper = self._read_optional(os.path.join(base, "operstate"))
            if oper is not None and oper.lower() in OPERSTATE_UP:
                out.append(self._sample("net_up", OPERSTATE_UP[oper.lower()], iface, labels, at))
            changes = self._read_optional(os.path.join(base, "carrier_changes"))
            if changes is not None and changes.isdigit():
                out.append(
                    self._sample("net_carrier_changes_total", float(changes), iface, labels, at)
                )
        return out

    def _netdev_rises(self, iface: str, records: list[Record], at: float) -> list[Record]:
        """Return a ``netdev_counter_rise`` event per error or drop counter that went up.

        Compared with the last collection, as :mod:`collectors.netdev` compares two readings
        of a pasted file, so that one rule judges both.
        """
        out: list[Record] = []
        for record in records:
            if not isinstance(record, Sample) or record.entity != iface:
                continue
            counter = _NETDEV_COUNTER.get(record.metric) or record.labels.get("counter", "")
            if counter not in RISE_COUNTERS:
                continue
            key = (iface, counter)
            previous = self._netdev_last.get(key)
            self._netdev_last[key] = (record.value, at)
            if previous is None or record.value <= previous[0]:
                continue  # first reading, unchanged, or a reset (driver reload)
            out.append(
                Event(
                    kind="netdev_counter_rise",
                    code=counter,
                    node=NodeName(self.node),
                    entity=EntityId(iface),
                    observed_at=at,
                    message=f"{iface} {counter} rose from {previous[0]:.0f} to {record.value:.0f}",
                    attrs={
                        "interface": iface,
                        "before": f"{previous[0]:.0f}",
                        "after": f"{record.value:.0f}",
                        "delta": f"{record.value - previous[0]:.0f}",
                        "interval_seconds": f"{at - previous[1]:g}",
                    },
                    source=self.name,
                )
            )
        return out

    def _read_optional(self, path: str) -> str | None:
        """Read a file that may legitimately be absent (no error counted when it is)."""
        if not os.path.exists(path):
            return None
        return self._read(path)

    def _netdev_sysfs(self, iface: str, base: str, at: float) -> list[Record]:
        out: list[Record] = []
        stats = os.path.join(base, "statistics")
        for name in self._listdir(stats):
            metric = NETDEV_STATS.get(name)
            value = self._read_int(os.path.join(stats, name))
            if value is None:
                if not os.path.isdir(base):
                    return out  # the interface went away while it was being read
                continue
            if metric is not None:
                out.append(self._sample(metric, float(value), iface, {"interface": iface}, at))
            else:
                out.append(
                    self._sample(
                        "net_nic_counter_total",
                        float(value),
                        iface,
                        {"interface": iface, "counter": name},
                        at,
                    )
                )
        return out

    def _proc_net_dev(self) -> dict[str, dict[str, int]]:
        path = os.path.join(self.proc_root, "net", "dev")
        text = self._read(path) if os.path.exists(path) else None
        if text is None:
            return {}
        out: dict[str, dict[str, int]] = {}
        for raw in text.splitlines()[2:]:
            name, sep, rest = raw.partition(":")
            fields = rest.split()
            if not sep or len(fields) < 12 or not all(f.isdigit() for f in fields[:12]):
                self.errors_total["malformed"] += 1
                self._log_once(f"procnetdev:{raw[:20]}", "malformed /proc/net/dev line %r", raw)
                continue
            out[name.strip()] = {
                metric: int(fields[col]) for col, metric in PROC_NET_DEV_FIELDS.items()
            }
        return out

    def _collect_infiniband(self, at: float) -> list[Record]:
        out: list[Record] = []
        root = os.path.join(self.sys_root, "class", "infiniband")
        ports: list[tuple[str, str]] = [
            (dev, port)
            for dev in self._listdir(root)
            for port in self._listdir(os.path.join(root, dev, "ports"))
        ]
        current = {f"{dev}:{port}" for dev, port in ports}
        for gone in sorted(self._seen_ports - current):
            self.errors_total["vanished"] += 1
            self._log_once(f"vanished-port:{gone}", "InfiniBand port %s vanished", gone)
            self._port_states.pop(gone, None)
        self._seen_ports = current
        for dev, port in ports:
            base = os.path.join(root, dev, "ports", port)
            out.extend(self._collect_port(dev, port, base, at))
        return out

    def _collect_port(self, dev: str, port: str, base: str, at: float) -> list[Record]:
        out: list[Record] = []
        entity = port_entity(dev, port)
        labels = {"device": dev, "port": port}
        state_text = self._read_optional(os.path.join(base, "state"))
        if state_text is None and not os.path.isdir(base):
            return out
        state = parse_port_state(state_text) if state_text else None
        if state is not None:
            out.append(self._sample("ib_port_state", float(state[1]), entity, labels, at))
        phys_text = self._read_optional(os.path.join(base, "phys_state"))
        phys = parse_phys_state(phys_text) if phys_text else None
        if phys is not None:
            out.append(self._sample("ib_port_physical_state", float(phys[1]), entity, labels, at))
        rate_text = self._read_optional(os.path.join(base, "rate"))
        rate = parse_rate_bits(rate_text) if rate_text else None
        if rate is not None:
            out.append(self._sample("ib_port_rate_bits_per_second", rate, entity, labels, at))
        if state is not None:
            out.extend(self._state_event(dev, port, state[0], state_text or "", phys, at))
        counters = os.path.join(base, "counters")
        for name in self._listdir(counters):
            pma = SYSFS_COUNTERS.get(name)
            if pma is None:
                continue
            value = self._read_int(os.path.join(counters, name))
            if value is None:
                continue
            for record in counter_samples(
                name=pma,
                value=value,
                node=NodeName(self.node),
                device=dev,
                port=port,
                evidence=None,
                observed_at=at,
                legacy=False,
                source="sysfs",
            ):
                if isinstance(record, Event):
                    key = (entity, record.code)
                    if key in self._saturated:
                        continue
                    self._saturated.add(key)
                    record = Event(
                        kind=record.kind,
                        code=record.code,
                        node=record.node,
                        entity=record.entity,
                        observed_at=at,
                        message=record.message,
                        attrs=record.attrs,
                        evidence=(
                            Evidence(file=os.path.join(counters, name), line=None, text=str(value)),
                        ),
                        source="sysfs",
                    )
                out.append(record)
        hw = os.path.join(base, "hw_counters")
        for name in self._listdir(hw):
            if name == "lifespan":
                continue
            value = self._read_int(os.path.join(hw, name))
            if value is not None:
                out.append(
                    self._sample(
                        "rdma_hw_counter_total",
                        float(value),
                        entity,
                        {"device": dev, "port": port, "counter": name},
                        at,
                    )
                )
        return out

    def _state_event(
        self,
        dev: str,
        port: str,
        code: str,
        raw: str,
        phys: tuple[str, int] | None,
        at: float,
    ) -> list[Record]:
        entity = f"{dev}:{port}"
        previous = self._port_states.get(entity)
        self._port_states[entity] = code
        if previous == code or (previous is None and code in _ACTIVE):
            return []
        attrs = {"device": dev, "port": port, "state": code}
        if phys is not None:
            attrs["phys_state"] = phys[0]
        if previous is not None:
            attrs["previous_state"] = previous
        return [
            Event(
                kind="ib_port_state",
                code=code,
                node=NodeName(self.node),
                entity=EntityId(entity),
                observed_at=at,
                message=f"{entity} state {raw}",
                attrs=attrs,
                evidence=(
                    Evidence(
                        file=os.path.join(
                            self.sys_root, "class", "infiniband", dev, "ports", port, "state"
                        ),
                        line=None,
                        text=raw,
                    ),
                ),
                source="sysfs",
            )
        ]
