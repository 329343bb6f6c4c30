"""Boot windows: what a reboot is known to raise is not a fault until it outlives the boot.

While a node boots, NVLinks train, InfiniBand and Ethernet ports go through polling and
init, bonds gather their members, and Fabric Manager starts: each of
these reads as "down" for a while. NVSentinel's issue #1701 saw 214 of 288 GB200 nodes
report NVLink down on planned reboots, none of them faulty; with remediation on that
would have been 63 reboots in one day. So a finding of a :data:`BOOT_KINDS` kind last
seen within ``window_seconds`` after the node's latest boot (its kernel log's
``Linux version`` line, the ``kernel_boot`` event) is held back; a state still seen
after the window is a finding like any other (its first time kept), and every other
kind (an Xid, an ECC error) is never held back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from analytics.fault_model.engine import Observations
from core.records import Finding

BOOT_KINDS = frozenset({"nvlink", "ib_port", "nic_port", "bond", "fabric", "fabric_manager",
                        "nvls"})
"""Finding kinds a booting node raises for a while (links training, services starting).
Not ``pcie``: an uncorrectable AER error at boot is as real as at any other time."""

DEFAULT_BOOT_WINDOW_SECONDS = 600.0
"""Ten minutes: NVLink training and Fabric Manager start within a few; a port still down
after ten minutes of uptime is down."""


def boot_times(nodes: Mapping[str, Observations]) -> dict[str, float]:
    """Return each node's latest boot time (epoch seconds) from its ``kernel_boot`` events.

    A boot line without a time stamp gives no time (nothing is held back for it).
    """
    out: dict[str, float] = {}
    for obs in nodes.values():
        for group in obs.events("kernel_boot"):
            if group.last_seen_at is not None:
                out[group.node] = max(out.get(group.node, group.last_seen_at),
                                      group.last_seen_at)
    return out


def hold_boot_transients(findings: Sequence[Finding], booted: Mapping[str, float], *,
                         now: float, window_seconds: float = DEFAULT_BOOT_WINDOW_SECONDS,
                         kinds: frozenset[str] = BOOT_KINDS) -> tuple[list[Finding],
                                                                       list[Finding]]:
    """Split ``findings`` into those that stand and those a boot window holds back.

    Args:
        findings: The current findings.
        booted: Each node's latest boot time (:func:`boot_times`).
        now: Epoch seconds; the time of a finding seen without one.
        window_seconds: The boot window, > 0 (0 or less: nothing is held back).
        kinds: The kinds a boot raises (:data:`BOOT_KINDS`).

    Returns:
        ``(standing, held)``, each in input order.
    """
    if window_seconds <= 0 or not booted:
        return list(findings), []
    standing: list[Finding] = []
    held: list[Finding] = []
    for f in findings:
        boot = booted.get(f.node)
        seen = f.last_seen_at if f.last_seen_at is not None else now
        if boot is not None and f.kind in kinds and boot <= seen <= boot + window_seconds:
            held.append(f)
        else:
            standing.append(f)
    return standing, held
