"""Throughput of ``diagnose`` on a large dmesg: lines parsed and classified per second.

Generates a ``dmesg`` (uptime stamps, realistic non-NVIDIA kernel noise) in which
1% of the lines are NVRM/Xid lines taken from the case collection
(``GPUHEALTH_CASES``, else ``tests/fixtures/cases``), runs the real diagnose path
(``gpuhealth.diagnose.diagnose`` on a temporary file) on one core and prints the
rate beside the goal (>= 200,000 lines/s).

With ``--rss-gb N`` it also writes an N GB file of the same kind and runs
``gpuhealth diagnose`` on it in a subprocess, printing the child's peak RSS
(goal < 200 MB; ``resource.getrusage(RUSAGE_CHILDREN)``).

Usage::

    .venv/bin/python benchmarks/diagnose_throughput.py [--lines 400000] [--rss-gb 1]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_LINES_PER_SECOND = 200_000
GOAL_RSS_BYTES = 200 * 1024 * 1024
NVRM_FRACTION = 0.01

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_STAMP = re.compile(r"^\s*(?:\[[^\]]*\]\s*|\S+ +\d+ [\d:]+ (?:\S+ )?kernel: (?:\[[^\]]*\] )?)")

NOISE = (
    "usb 1-1.{n}: new high-speed USB device number {n} using xhci_hcd",
    "IPv6: ADDRCONF(NETDEV_CHANGE): eth{n}: link becomes ready",
    'audit: type=1400 audit(1712253836.{n}:{n}): apparmor="STATUS" operation="profile_load" '
    'profile="unconfined" name="snap-update-ns.lxd" pid={n} comm="apparmor_parser"',
    "EXT4-fs (nvme0n1p{n}): mounted filesystem with ordered data mode. Quota mode: none.",
    "mlx5_core 0000:{b:02x}:00.0: mlx5_pcie_event:301:(pid {n}): PCIe slot advertised sufficient "
    "power (75W).",
    "systemd[1]: Started Session {n} of User root.",
    "bond0: (slave eth{n}): link status definitely up, 100000 Mbps full duplex",
    "nvme nvme{n}: 32/0/0 default/read/poll queues",
    "perf: interrupt took too long (2503 > 2500), lowering "
    "kernel.perf_event_max_sample_rate to {n}",
    "TCP: request_sock_TCP: Possible SYN flooding on port {n}. Sending cookies.",
    "device veth{n:x}a entered promiscuous mode",
    "cni0: port {n}(veth{n:x}) entered forwarding state",
)


def case_nvrm_lines(cases: Path) -> list[str]:
    """Return the message part (stamp removed) of every NVRM line in the case files."""
    found: list[str] = []
    for path in sorted(cases.iterdir()):
        if not path.is_file() or path.suffix == ".json" or path.name == "README.md":
            continue
        for line in path.read_text(errors="replace").splitlines():
            if "NVRM:" in line and not line[:1].isspace():
                body = _STAMP.sub("", line, count=1)
                idx = body.find("NVRM:")
                found.append(body[idx:])
    if not found:
        found.append(
            "NVRM: Xid (PCI:0000:b1:00): 79, pid='<unknown>', name=<unknown>, "
            "GPU has fallen off the bus."
        )
    return found


def write_dmesg(path: Path, lines: int, nvrm: list[str], seed: int = 7) -> int:
    """Write ``lines`` dmesg lines (1% NVRM) to ``path``; return the bytes written."""
    rng = random.Random(seed)
    every = int(1 / NVRM_FRACTION)
    size = 0
    with path.open("w") as out:
        buf: list[str] = []
        for i in range(lines):
            up = f"[{i * 0.000731 + 5:12.6f}] "
            if i % every == every - 1:
                msg = nvrm[rng.randrange(len(nvrm))]
            else:
                msg = NOISE[rng.randrange(len(NOISE))].format(n=rng.randrange(1, 999), b=i % 256)
            buf.append(up + msg + "\n")
            if len(buf) >= 10_000:
                chunk = "".join(buf)
                size += len(chunk)
                out.write(chunk)
                buf.clear()
        chunk = "".join(buf)
        size += len(chunk)
        out.write(chunk)
    return size


def measure(lines: int, cases: Path) -> float:
    """Run diagnose on a generated dmesg of ``lines`` lines; return lines per second."""
    from gpuhealth.diagnose import diagnose

    nvrm = case_nvrm_lines(cases)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dmesg.log"
        write_dmesg(path, 1000, nvrm)
        diagnose([str(path)])  # warm-up: plugin imports are start-up cost, not throughput
        write_dmesg(path, lines, nvrm)
        start = time.perf_counter()
        result = diagnose([str(path)])
        elapsed = time.perf_counter() - start
    rate = lines / elapsed
    print(
        f"diagnose: {lines:,} lines in {elapsed:.2f} s -> {rate:,.0f} lines/s "
        f"(goal {GOAL_LINES_PER_SECOND:,}; ratio {rate / GOAL_LINES_PER_SECOND:.2f}); "
        f"{len(result.findings)} findings, worst {result.worst_severity.value}"
    )
    return rate


def measure_rss(gigabytes: float, cases: Path) -> int:
    """Write a ``gigabytes`` GB dmesg, run ``gpuhealth diagnose`` on it; return peak RSS bytes."""
    nvrm = case_nvrm_lines(cases)
    avg_line = 90
    lines = int(gigabytes * 1e9 / avg_line)
    exe = shutil.which("gpuhealth") or str(Path(sys.executable).parent / "gpuhealth")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dmesg-big.log"
        size = write_dmesg(path, lines, nvrm)
        print(f"wrote {size / 1e9:.2f} GB ({lines:,} lines)")
        start = time.perf_counter()
        proc = subprocess.run(
            [exe, "diagnose", "--json", str(path)], capture_output=True, check=False
        )
        elapsed = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = int(usage.ru_maxrss) * 1024  # kilobytes on Linux
    print(
        f"gpuhealth diagnose: exit {proc.returncode}, {elapsed:.1f} s "
        f"({lines / elapsed:,.0f} lines/s), peak RSS {peak / 2**20:.0f} MiB "
        f"(goal < {GOAL_RSS_BYTES / 2**20:.0f} MiB; ratio {peak / GOAL_RSS_BYTES:.2f})"
    )
    return peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=400_000, help="lines in the timed dmesg")
    parser.add_argument(
        "--rss-gb",
        type=float,
        default=0.0,
        help="also run gpuhealth diagnose on a file of this many GB",
    )
    args = parser.parse_args(argv)
    cases = Path(os.environ.get("GPUHEALTH_CASES") or ROOT / "tests" / "fixtures" / "cases")
    rate = measure(args.lines, cases)
    ok = rate >= GOAL_LINES_PER_SECOND
    if args.rss_gb > 0:
        ok = measure_rss(args.rss_gb, cases) < GOAL_RSS_BYTES and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
