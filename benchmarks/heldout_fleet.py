"""A held-out labelled GPU fleet recording for judging the failure predictor (issue #15).

Written from scratch, independently of ``analytics/synthetic.py`` (whose internals were not
read): a second, differently shaped fleet on which the predictor's generalisation can be
judged. It writes what a user would get by converting their own monitoring to the catalog's
metric names (``core/catalog.py``), in the project's line protocol (encoded with
:class:`storage.lineprotocol.LineEncoder`, so ``gpuhealth replay FILE.lp`` reads it), plus
a labels JSON.

Usage::

    .venv/bin/python benchmarks/heldout_fleet.py --gpus 256 --days 10 --seed S --out DIR
        [--interval 60]

writes ``DIR/fleet.lp`` and ``DIR/labels.json``.

**Shape of the fleet** (as the project's collectors represent it):

* Nodes of 8 GPUs named ``<site>-rRR-hHH`` (4 per rack), of four platforms: DGX H100, an OEM
  HGX H100, DGX A100 and a 4-port A100 server; each with its own PCI bus layout, 4, 6 or 8
  InfiniBand ports ``mlx5_N`` port 1 (numbering with holes where storage NICs sit, as on
  DGX), driver and VBIOS versions.
* ``gpu_info`` inventory per GPU (labels ``uuid``, ``serial``, ``model``, ``pci_bus_id`` in
  NVML's own ``%08X:%02X:%02X.0`` spelling, ``index``, ``driver_version``,
  ``vbios_version``), keyed by UUID, at the start, every ``inventory_seconds`` and after
  every gap; GPU samples keyed by UUID (``collectors/nvml.py``); Xid events keyed by the
  canonical PCI bus id as the kernel-log collector keys them (``0000:18:00.0``,
  ``collectors/kernel_log.py``: kind ``xid``, attrs ``pid``, ``process``, ``message``,
  ``boot``, evidence the raw ``NVRM: Xid (PCI:0000:18:00): 48, ...`` line, source
  ``kernel_log``); port samples keyed ``mlx5_N:1`` with labels ``device``, ``port`` and
  ``ib_port_state`` events on a change (``collectors/network.py``, source ``sysfs``).
* Metrics: ``gpu_temperature_celsius`` (integer degC as NVML reports it),
  ``gpu_power_watts`` (milliwatt resolution), ``gpu_utilization_ratio`` (whole per cent),
  ``gpu_ecc_errors_total{type=corrected|uncorrected, scope=volatile, location=total}`` and,
  on half the nodes, the ``scope=aggregate`` pair too, ``gpu_pcie_replays_total``,
  ``gpu_clock_event_active{reason}`` (on a change and every ``clock_refresh_seconds``, as
  the NVML collector sends it), ``ib_port_state`` (4 active, 1 down),
  ``ib_port_physical_state`` (5 link up, 2 polling), ``ib_symbol_errors_total`` (16-bit,
  saturating), ``ib_link_error_recovery_total`` and ``ib_link_downed_total`` (8-bit,
  saturating); ``gpu_temperature_threshold_celsius{threshold=shutdown|slowdown|
  max_operating}`` on half the nodes only (some sites do not export it).
* Samples are aligned to the interval grid (what a ``query_range`` export gives); events
  keep their kernel-log second.

**Failures** (about 12 per 1,000 GPU-days, ~31 per 256 GPUs x 10 days, far above real rates;
counts per kind are the expected value rounded at random, so they vary little by seed), each
GPU or port fails at most once. Precursor lengths are log-uniform within the ranges given;
a quarter of the precursors are faint:

* ``dbe`` (40 %): double-bit ECC. 85 % with a rising corrected-error rate over 2-72 h, in
  one of four shapes, none exponential in time: ``ramp`` (linear from 0.5-4 to 15-300 /h),
  ``knee`` (flat, then linear from a random knee at 50-90 % of the lead), ``stairs`` (3-5
  random steps up) and ``faint`` (linear to only 2-6 /h). Errors arrive in clusters
  (geometric sizes, mean 1.5-4) and more under load. At the failure: an uncorrected step
  of 1-3, an Xid 48 (and an Xid 63 row-remap event 60 % of the time), sometimes a jump of
  corrected errors; the GPU is drained (idle) until its reset (driver reload) or, 40 % of
  the time, its replacement (node down 1-3 h, a new UUID and serial) 2-30 h later.
* ``thermal`` (20 %): thermal creep over 12-96 h, always with a precursor: the GPU's
  temperature under load rises relative to its own baseline and its peers (shapes
  ``linear``, ``knee``, ``steps``, ``faint``: a knee at 75-90 % with almost nothing before
  it), scaled by load (an idle GPU hides it), until it reaches its slowdown temperature;
  then hardware thermal slowdown (clock events ``sw_thermal``, ``hw_thermal``,
  ``hw_slowdown``, power cut by 30 % while above slowdown), a last 20-90 min in which the
  cooling gives out entirely and the GPU climbs to its shutdown temperature, and **the
  failure: the GPU drops out (its samples stop) with an Xid 79 logged 1-5 s later**. The
  label's failure time is the Xid 79. Repaired 4-48 h later (30 % with a new GPU).
* ``otb`` (16 %): fell off the bus: Xid 79 and a ``gpu_lost``/``fallen_off_bus`` kernel
  line, then the GPU's samples stop; **no precursor**. The node reboots 1-20 h later.
* ``link_down`` (24 %): 80 % with rising symbol errors over 2-48 h: ``ramp`` (linear to
  20-250 /min, link recoveries in proportion), ``bursty`` (an intermittent cable: bursts of
  50-3,000 errors whose frequency rises linearly from 0.3 to 2-8 per hour, a third of them
  with a link recovery, over a faint background of up to 1 /min) or
  ``faint`` (to 1.5-5 /min); then the port goes Down (``ib_port_state`` 1, physical state
  polling, ``link_downed`` +1, an ``ib_port_state`` ``down`` event). Back Active after 10
  min to 24 h, its counters cleared half the time. 20 % fail with no precursor (optics
  dying at once).

About 25 % of the failures have no precursor (all ``otb``, a sixth of ``dbe``, a fifth of
``link_down``).

**Confounders** (rates per entity-day unless said): node workload phases (jobs of 10 min to
36 h: training with checkpoint dips, partial jobs on some GPUs, noisy inference, idle),
power-capped nodes (20 %, ``power_cap`` clock events), node cooling excursions (0.06 per
node-day, +4-15 degC on the node's inlet for 30 min-8 h, the strongest ones reaching max
operating temperature with ``sw_thermal`` events), GPUs always 3-8 degC warmer than their
peers (5 %), GPUs drifting 2-6 degC warmer over 2-5 days and staying there (2 %), GPUs with
a steady high corrected-error rate (3 %, 5-150 /h), a low background on 20 %, one-off
corrected-error bursts (0.03: 30-3,000 errors in 5-60 min), a corrected-error rate that
rises over 6-48 h and falls back with no failure (1 % of GPUs), steady PCIe replays (3 %)
and replay bursts, benign application Xids 13, 31, 43, 45 (0.04), healthy links with a
steady symbol-error rate (4 %, 0.3-8 /min) or symbol-error bursts (0.04 per port-day, 40 %
with link recoveries), port counter clears (0.03 per node-day), driver reloads (0.02 per
node-day: GPU samples gap 1-4 min, volatile counters reset, a ``driver_load`` kernel
event), maintenance reboots (0.01: node gap 5-15 min, GPU and port counters reset),
collector gaps (0.15 per node-day, 2-40 min; 0.01 outages of 1-4 h) and single-GPU read
failures (0.03 per GPU-day, 1-5 samples).

The labels list every failure with its kind, node, every alias of its entity (GPU: UUID,
both PCI spellings, ``gpu:<index>``, ``serial:<serial>`` and the bare serial; port:
``mlx5_N:1``), failure time, precursor onset (``null`` without one), shape, recovery time,
plus every GPU identity with the time it was valid (a replaced GPU gets a new UUID and
serial behind the same PCI bus id) and every confounder episode.

**Size and time** (shared 2-core machine, ``nice``): 256 GPUs x 1 day wrote 2.0 million
lines (4.3 million samples, 337 MB) in 19.5 s at 262 MB peak RSS, so the default 256 x 10
days is about 20 million lines, 3.4 GB and 3-4 minutes; memory is bounded by
``chunk_ticks``. Over three seeds (11-13) the default plan had 31-33 failures, 21-29 %
without precursor.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.records import EntityId, Event, Evidence, NodeName, Sample  # noqa: E402
from storage.lineprotocol import LineEncoder  # noqa: E402

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

START = 1788739200.0
"""2026-09-07T00:00:00Z: the recording's first sample (epoch seconds)."""

HOUR = 3600.0
DAY = 86400.0
KINDS = ("dbe", "thermal", "otb", "link_down")
KIND_SHARES = {"dbe": 0.40, "thermal": 0.20, "otb": 0.16, "link_down": 0.24}
PRECURSOR_SHARES = {"dbe": 0.85, "thermal": 1.0, "otb": 0.0, "link_down": 0.80}
LEAD_HOURS = {"dbe": (2.0, 72.0), "thermal": (12.0, 96.0), "link_down": (2.0, 48.0)}
"""Precursor length range per kind, hours (log-uniform)."""

CLOCK_REASONS = (("gpu_idle", 0x001), ("power_cap", 0x004), ("hw_slowdown", 0x008),
                 ("sw_thermal", 0x020), ("hw_thermal", 0x040))
"""The clock-event reasons written (``gpu_clock_event_active{reason}``, NVML bit values)."""

SYM_MAX = 65535.0
"""SymbolErrorCounter is 16 bits and saturates (ecosystem-reference §10.2)."""
RECOVERY_MAX = 255.0
"""LinkErrorRecoveryCounter and LinkDownedCounter are 8 bits and saturate."""


@dataclass(frozen=True, slots=True)
class Model:
    """A GPU model: name as NVML gives it, power (W), thermal resistance (degC/W), thresholds."""

    name: str
    tdp: float
    idle: tuple[float, float]
    rth: tuple[float, float]
    shutdown: float
    slowdown: float
    max_operating: float
    vbios: str


MODELS = {
    "h100": Model("NVIDIA H100 80GB HBM3", 700.0, (68.0, 92.0), (0.050, 0.060), 92.0, 89.0,
                  87.0, "96.00.99.00.01"),
    "a100": Model("NVIDIA A100-SXM4-80GB", 400.0, (52.0, 64.0), (0.085, 0.100), 92.0, 89.0,
                  85.0, "92.00.45.00.06"),
}

PLATFORMS: dict[str, tuple[str, float, tuple[str, ...], tuple[int, ...], tuple[str, ...]]] = {
    # name: (model, share, PCI buses of GPUs 0-7, mlx5 device numbers, driver versions)
    "dgx_h100": ("h100", 0.35, ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db"),
                 (0, 1, 2, 3, 6, 7, 8, 9), ("550.90.07", "535.183.01")),
    "hgx_h100": ("h100", 0.30, ("19", "3b", "4c", "5d", "9b", "bb", "cb", "db"),
                 (0, 1, 2, 3, 4, 5), ("550.90.07", "550.127.05")),
    "dgx_a100": ("a100", 0.20, ("07", "0f", "47", "4e", "87", "90", "b7", "bd"),
                 (0, 1, 2, 3, 6, 7, 8, 9), ("535.183.01", "525.147.05")),
    "a100_4p": ("a100", 0.15, ("17", "31", "65", "67", "b1", "b3", "ca", "e3"),
                (0, 1, 2, 3), ("535.183.01",)),
}


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    """What to generate.

    Attributes:
        gpus: GPUs (rounded up to whole nodes of ``gpus_per_node``).
        days: Length of the recording, days.
        interval_seconds: Sample interval, seconds.
        start: First sample, epoch seconds.
        gpus_per_node: GPUs per node.
        quiet_hours: No failure before this long after the start.
        failures_per_1000_gpu_days: Expected failures (all kinds).
        faint_share: Share of precursors drawn faint.
        threshold_node_share: Share of nodes that export the temperature thresholds.
        aggregate_node_share: Share of nodes that export the aggregate ECC counters too.
        inventory_seconds: ``gpu_info`` (and thresholds) every this long.
        clock_refresh_seconds: Clock-event series re-sent unchanged every this long.
        chunk_ticks: Samples per GPU rendered at once (memory, not results).
    """

    gpus: int = 256
    days: float = 10.0
    interval_seconds: float = 60.0
    start: float = START
    gpus_per_node: int = 8
    quiet_hours: float = 12.0
    failures_per_1000_gpu_days: float = 12.1
    faint_share: float = 0.25
    threshold_node_share: float = 0.5
    aggregate_node_share: float = 0.5
    inventory_seconds: float = 900.0
    clock_refresh_seconds: float = 600.0
    chunk_ticks: int = 720


@dataclass(frozen=True, slots=True)
class Identity:
    """One physical GPU in a slot, valid from ``valid_from`` until ``valid_to`` (or the end)."""

    uuid: str
    serial: str
    valid_from: float
    valid_to: float | None


@dataclass(kw_only=True)
class Node:
    """One server: its platform, GPU slots (rows) and ports (rows)."""

    name: str
    platform: str
    model: str
    driver: str
    thresholds: bool
    aggregate: bool
    power_capped: bool
    slots: list[int] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class Slot:
    """A GPU position: node, index, PCI bus id (NVML and canonical spelling), identities."""

    node: int
    index: int
    pci_nvml: str
    pci: str
    identities: list[Identity]

    def identity_at(self, at: float) -> Identity:
        """The GPU in the slot at ``at`` (the last one whose validity started by then)."""
        current = self.identities[0]
        for ident in self.identities:
            if ident.valid_from <= at:
                current = ident
        return current


@dataclass(frozen=True, slots=True)
class Port:
    """An HCA port: node, device (``mlx5_3``), port number, entity (``mlx5_3:1``)."""

    node: int
    device: str
    port: str
    entity: str


@dataclass(kw_only=True)
class Failure:
    """One labelled failure (times in epoch seconds)."""

    kind: str
    row: int  # slot for GPU kinds, port for link_down
    node: int
    at: float
    onset: float | None
    shape: str | None
    faint: bool
    recovered_at: float
    replaced: bool = False


@dataclass(frozen=True, slots=True)
class Episode:
    """A time-bounded contribution to one row's series: ``shape`` with ``params``."""

    row: int
    t0: float
    t1: float
    shape: str
    params: Mapping[str, Any]


@dataclass(kw_only=True)
class FleetPlan:
    """Everything drawn for one recording; rendered by :func:`write_recording`."""

    config: FleetConfig
    seed: int
    end: float
    ticks: int
    nodes: list[Node]
    slots: list[Slot]
    ports: list[Port]
    failures: list[Failure]
    # per-slot parameters
    tdp: FloatArray
    limit: FloatArray
    idle: FloatArray
    rth: FloatArray
    alpha: FloatArray
    eff: FloatArray
    pos_off: FloatArray
    hot_off: FloatArray
    ecc_base: FloatArray
    ecc_cluster: FloatArray
    pcie_base: FloatArray
    shutdown: FloatArray
    slowdown: FloatArray
    max_operating: FloatArray
    # per-node parameters
    inlet_base: FloatArray
    diurnal_amp: FloatArray
    diurnal_phase: FloatArray
    jobs: list[dict[str, Any]]
    # per-port parameters
    sym_base: FloatArray
    rec_ratio: FloatArray
    # episodes by series
    ecc_eps: list[Episode] = field(default_factory=list)
    temp_eps: list[Episode] = field(default_factory=list)
    force_eps: list[Episode] = field(default_factory=list)
    inlet_eps: list[Episode] = field(default_factory=list)
    pcie_eps: list[Episode] = field(default_factory=list)
    sym_eps: list[Episode] = field(default_factory=list)
    port_bumps: list[tuple[int, float, float, float]] = field(default_factory=list)
    downed_steps: list[tuple[int, float]] = field(default_factory=list)
    gpu_bumps: list[tuple[int, float, str, float]] = field(default_factory=list)
    node_gaps: list[tuple[int, float, float, str]] = field(default_factory=list)
    gpu_gaps: list[tuple[int, float, float]] = field(default_factory=list)
    lost: list[tuple[int, float, float]] = field(default_factory=list)
    drained: list[tuple[int, float, float]] = field(default_factory=list)
    port_down: list[tuple[int, float, float]] = field(default_factory=list)
    port_clears: list[tuple[int, float]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    confounders: list[dict[str, Any]] = field(default_factory=list)


# --- planning ------------------------------------------------------------------------------


def _loguniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _round_random(rng: np.random.Generator, mean: float) -> int:
    """``mean`` rounded down or up at random, so that the expectation is ``mean``."""
    whole = math.floor(mean)
    return whole + int(rng.random() < mean - whole)


def _count(rng: np.random.Generator, rate_per_day: float, days: float) -> int:
    return int(rng.poisson(rate_per_day * days))


def _uuid(rng: np.random.Generator) -> str:
    hexes = "".join(f"{int(b):02x}" for b in rng.integers(0, 256, 16))
    return f"GPU-{hexes[:8]}-{hexes[8:12]}-{hexes[12:16]}-{hexes[16:20]}-{hexes[20:]}"


def _serial(rng: np.random.Generator) -> str:
    return f"165{int(rng.integers(0, 10**10)):010d}"


def _grid(config: FleetConfig, at: float) -> float:
    """The first sample time at or after ``at``."""
    step = config.interval_seconds
    return config.start + math.ceil((at - config.start) / step - 1e-9) * step


class _Kmsg:
    """Builds kernel-log events as ``collectors/kernel_log.py`` emits them."""

    def __init__(self) -> None:
        self.line = 0

    def event(self, kind: str, code: str, node: str, entity: str, at: float, message: str,
              raw: str, attrs: Mapping[str, str]) -> Event:
        self.line += 1
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(at))
        text = f"{stamp} {node} kernel: NVRM: {raw}"
        return Event(kind=kind, code=code, node=NodeName(node), entity=EntityId(entity),
                     observed_at=float(at), message=message,
                     attrs={**attrs, "boot": "0"},
                     evidence=(Evidence(file="kern.log", line=self.line, text=text),),
                     source="kernel_log")

    def xid(self, code: int, node: str, pci: str, at: float, message: str,
            process: tuple[str, str] = ("<unknown>", "<unknown>")) -> Event:
        short = pci[:-2]  # 0000:18:00.0 -> 0000:18:00, as the Xid line spells it
        pid, name = process
        shown = "'<unknown>'" if pid == "<unknown>" else pid
        raw = f"Xid (PCI:{short}): {code}, pid={shown}, name={name}, {message}"
        return self.event("xid", str(code), node, pci, at, message, raw,
                          {"pid": pid, "process": name, "message": message})


XID_TEXT = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    31: ("Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ "
         "0x7f2a_3c000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"),
    43: "Ch 00000010",
    45: "Ch 00000010",
    48: ("An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
         "at partition 6, subpartition 0."),
    63: ("Row Remapper: New row (0x00000000000a1f3c) was marked for remapping, reset gpu to "
         "activate."),
    79: "GPU has fallen off the bus.",
}


def _jobs(rng: np.random.Generator, start: float, end: float, gpus: int) -> dict[str, Any]:
    """A node's workload: consecutive jobs (start, kind, level, intensity, busy GPUs, dips)."""
    starts: list[float] = []
    kinds: list[int] = []
    levels: list[float] = []
    intensity: list[float] = []
    busy: list[BoolArray] = []
    period: list[float] = []
    dip: list[float] = []
    dip_level: list[float] = []
    at = start - rng.uniform(0, 6 * HOUR)
    while at < end:
        kind = rng.choice(4, p=[0.15, 0.55, 0.18, 0.12])  # idle, train, partial, inference
        mask = np.ones(gpus, dtype=bool)
        if kind == 0:
            mask[:] = False
        elif kind == 2:
            mask[:] = False
            mask[rng.choice(gpus, int(rng.integers(1, gpus)), replace=False)] = True
        starts.append(at)
        kinds.append(int(kind))
        levels.append(float(rng.uniform(0.85, 1.0) if kind == 1 else rng.uniform(0.3, 0.95)))
        intensity.append(float(rng.uniform(0.75, 1.1)))
        busy.append(mask)
        period.append(float(rng.uniform(20, 90) * 60))
        dip.append(float(rng.uniform(2, 6) * 60))
        dip_level.append(float(rng.uniform(0.02, 0.2)))
        at += float(np.clip(rng.lognormal(math.log(2.5 * HOUR), 1.0), 600, 36 * HOUR))
    return {"starts": np.array(starts), "kinds": np.array(kinds), "levels": np.array(levels),
            "intensity": np.array(intensity), "busy": np.array(busy), "period": np.array(period),
            "dip": np.array(dip), "dip_level": np.array(dip_level)}


def plan_fleet(config: FleetConfig, *, seed: int) -> FleetPlan:
    """Draw a fleet, its failures and its confounders (deterministic in ``seed``).

    Args:
        config: Sizes, rates and cadences.
        seed: Seed of every draw (the rendering noise too, via :func:`write_recording`).

    Returns:
        The plan; :func:`labels` and :func:`write_recording` turn it into files.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, 1_500_015]))
    per = config.gpus_per_node
    n_nodes = max(1, math.ceil(config.gpus / per))
    start = config.start
    ticks = max(1, math.ceil(config.days * DAY / config.interval_seconds))
    end = start + ticks * config.interval_seconds
    site = str(rng.choice(["sjc2", "ams4", "iad7", "fra3"]))
    platforms = list(PLATFORMS)
    shares = np.array([PLATFORMS[p][1] for p in platforms])
    thr_nodes = set(rng.choice(n_nodes, round(n_nodes * config.threshold_node_share),
                               replace=False).tolist())
    agg_nodes = set(rng.choice(n_nodes, round(n_nodes * config.aggregate_node_share),
                               replace=False).tolist())
    nodes: list[Node] = []
    slots: list[Slot] = []
    ports: list[Port] = []
    models: list[Model] = []
    for n in range(n_nodes):
        platform = platforms[int(rng.choice(len(platforms), p=shares / shares.sum()))]
        model_key, _, buses, devices, drivers = PLATFORMS[platform]
        node = Node(name=f"{site}-r{n // 4 + 1:02d}-h{n % 4 + 1:02d}", platform=platform,
                    model=model_key, driver=str(rng.choice(list(drivers))),
                    thresholds=n in thr_nodes, aggregate=n in agg_nodes,
                    power_capped=bool(rng.random() < 0.2))
        for i in range(per):
            bus = buses[i % len(buses)]
            node.slots.append(len(slots))
            slots.append(Slot(node=n, index=i, pci_nvml=f"00000000:{bus.upper()}:00.0",
                              pci=f"0000:{bus}:00.0",
                              identities=[Identity(_uuid(rng), _serial(rng), start, None)]))
            models.append(MODELS[model_key])
        for d in devices:
            node.ports.append(len(ports))
            ports.append(Port(node=n, device=f"mlx5_{d}", port="1", entity=f"mlx5_{d}:1"))
        nodes.append(node)
    g_count, p_count = len(slots), len(ports)

    def arr(values: Iterable[float]) -> FloatArray:
        return np.array(list(values), dtype=np.float64)

    tdp = arr(m.tdp for m in models)
    capped = np.array([nodes[s.node].power_capped for s in slots])
    limit = np.where(capped, tdp * 0.85, tdp)
    idle = arr(rng.uniform(*m.idle) for m in models)
    rth = arr(rng.uniform(*m.rth) for m in models)
    tau = rng.uniform(120, 300, g_count)
    alpha = 1.0 - np.exp(-config.interval_seconds / tau)
    eff = rng.uniform(0.95, 1.05, g_count)
    pos_off = arr(0.8 * (s.index >= per // 2) + rng.uniform(-1.0, 2.0) for s in slots)
    hot_off = np.where(rng.random(g_count) < 0.05, rng.uniform(3.0, 8.0, g_count), 0.0)
    draw = rng.random(g_count)
    ecc_base = np.where(draw < 0.03, rng.uniform(5, 150, g_count),
                        np.where(draw < 0.23, rng.uniform(0.02, 0.5, g_count), 0.0))
    ecc_cluster = rng.uniform(1.5, 4.0, g_count)
    draw = rng.random(g_count)
    pcie_base = np.where(draw < 0.03, rng.uniform(0.1, 5, g_count),
                         np.where(draw < 0.15, rng.uniform(0.001, 0.05, g_count), 0.0))
    draw = rng.random(p_count)
    sym_base = np.where(draw < 0.04, rng.uniform(0.3, 8, p_count),
                        np.where(draw < 0.30, rng.uniform(0.0005, 0.02, p_count), 0.0))
    rec_ratio = rng.uniform(400, 4000, p_count)

    plan = FleetPlan(
        config=config, seed=seed, end=end, ticks=ticks, nodes=nodes, slots=slots, ports=ports,
        failures=[], tdp=tdp, limit=limit, idle=idle, rth=rth, alpha=alpha, eff=eff,
        pos_off=pos_off, hot_off=hot_off, ecc_base=ecc_base, ecc_cluster=ecc_cluster,
        pcie_base=pcie_base, shutdown=arr(m.shutdown for m in models),
        slowdown=arr(m.slowdown for m in models),
        max_operating=arr(m.max_operating for m in models),
        inlet_base=rng.uniform(19, 27, n_nodes), diurnal_amp=rng.uniform(0.3, 1.8, n_nodes),
        diurnal_phase=rng.uniform(0, 2 * math.pi, n_nodes),
        jobs=[_jobs(rng, start, end, per) for _ in range(n_nodes)],
        sym_base=sym_base, rec_ratio=rec_ratio,
    )
    for g in np.flatnonzero(ecc_base >= 5):
        plan.confounders.append(_conf("steady_high_corrected_ecc", plan, int(g), start, end,
                                      rate_per_hour=round(float(ecc_base[g]), 2)))
    for g in np.flatnonzero(hot_off > 0):
        plan.confounders.append(_conf("always_warmer", plan, int(g), start, end,
                                      degc=round(float(hot_off[g]), 2)))
    for g in np.flatnonzero(pcie_base >= 0.1):
        plan.confounders.append(_conf("steady_pcie_replays", plan, int(g), start, end,
                                      rate_per_minute=round(float(pcie_base[g]), 3)))
    for p in np.flatnonzero(sym_base >= 0.3):
        plan.confounders.append(_port_conf("steady_symbol_errors", plan, int(p), start, end,
                                           rate_per_minute=round(float(sym_base[p]), 3)))
    kmsg = _Kmsg()
    _plan_failures(plan, rng, kmsg)
    _plan_confounders(plan, rng, kmsg)
    plan.events.sort(key=lambda e: (e.observed_at or 0.0, e.node, e.entity, e.code))
    return plan


def _conf(kind: str, plan: FleetPlan, g: int, t0: float, t1: float, **extra: Any) -> dict[str, Any]:
    slot = plan.slots[g]
    return {"kind": kind, "node": plan.nodes[slot.node].name,
            "entity": slot.identity_at(t0).uuid, "pci_bus_id": slot.pci, "start": t0,
            "end": t1, **extra}


def _port_conf(kind: str, plan: FleetPlan, p: int, t0: float, t1: float,
               **extra: Any) -> dict[str, Any]:
    port = plan.ports[p]
    return {"kind": kind, "node": plan.nodes[port.node].name, "entity": port.entity,
            "start": t0, "end": t1, **extra}


def _plan_failures(plan: FleetPlan, rng: np.random.Generator, kmsg: _Kmsg) -> None:
    config = plan.config
    start, end = config.start, plan.end
    gpu_days = len(plan.slots) * config.days
    total = config.failures_per_1000_gpu_days * gpu_days / 1000.0
    used_gpus: set[int] = set()
    used_ports: set[int] = set()
    earliest = start + config.quiet_hours * HOUR
    latest = end - 45 * 60
    if latest <= earliest:
        return
    for kind in KINDS:
        for _ in range(_round_random(rng, total * KIND_SHARES[kind])):
            if kind == "link_down":
                free = [p for p in range(len(plan.ports)) if p not in used_ports]
                if not free:
                    continue
                row = int(rng.choice(free))
                used_ports.add(row)
                node = plan.ports[row].node
            else:
                free = [g for g in range(len(plan.slots)) if g not in used_gpus]
                if not free:
                    continue
                row = int(rng.choice(free))
                used_gpus.add(row)
                node = plan.slots[row].node
            at = float(rng.uniform(earliest, latest))
            # a port is seen Down at a sample; a kernel-log line has whole seconds
            at = _grid(config, at) if kind == "link_down" else float(math.floor(at))
            has_precursor = rng.random() < PRECURSOR_SHARES[kind]
            onset: float | None = None
            shape: str | None = None
            faint = False
            if has_precursor:
                lo, hi = LEAD_HOURS[kind]
                onset = at - _loguniform(rng, lo, hi) * HOUR
                faint = bool(rng.random() < config.faint_share)
                shape = "faint" if faint else str(rng.choice(
                    {"dbe": ["ramp", "knee", "stairs"], "thermal": ["linear", "knee", "steps"],
                     "link_down": ["ramp", "bursty"]}[kind]))
            failure = Failure(kind=kind, row=row, node=node, at=at, onset=onset, shape=shape,
                              faint=faint, recovered_at=at)
            {"dbe": _plan_dbe, "thermal": _plan_thermal, "otb": _plan_otb,
             "link_down": _plan_link}[kind](plan, rng, kmsg, failure)
            plan.failures.append(failure)
    plan.failures.sort(key=lambda f: f.at)


def _replace_gpu(plan: FleetPlan, rng: np.random.Generator, g: int, at: float) -> None:
    """A new GPU (UUID, serial) in slot ``g`` from ``at``."""
    slot = plan.slots[g]
    old = slot.identities[-1]
    slot.identities[-1] = Identity(old.uuid, old.serial, old.valid_from, at)
    slot.identities.append(Identity(_uuid(rng), _serial(rng), at, None))


def _node_restart(plan: FleetPlan, rng: np.random.Generator, kmsg: _Kmsg, node: int,
                  t0: float, t1: float, kind: str) -> None:
    """The node is out from ``t0`` to ``t1`` (reboot, repair); counters reset after it."""
    plan.node_gaps.append((node, t0, t1, kind))
    n = plan.nodes[node]
    back = t1 + float(rng.uniform(5, 40))
    if back < plan.end:
        version = n.driver
        plan.events.append(kmsg.event(
            "driver_load", version, n.name, "node", math.floor(back),
            f"loading NVIDIA UNIX x86_64 Kernel Module  {version}  Fri May 31 09:35:42 UTC 2024",
            f"loading NVIDIA UNIX x86_64 Kernel Module  {version}  Fri May 31 09:35:42 UTC 2024",
            {"driver_version": version}))
    if kind != "driver":
        for p in n.ports:
            plan.port_clears.append((p, t1))


def _plan_dbe(plan: FleetPlan, rng: np.random.Generator, kmsg: _Kmsg, f: Failure) -> None:
    g, slot = f.row, plan.slots[f.row]
    name = plan.nodes[slot.node].name
    if f.onset is not None and f.shape is not None:
        r0 = float(rng.uniform(0.5, 4.0))
        params: dict[str, Any] = {"r0": r0, "r1": float(rng.uniform(15, 300))}
        if f.shape == "knee":
            params["k"] = float(rng.uniform(0.5, 0.9))
        elif f.shape == "stairs":
            params["steps"] = sorted(rng.uniform(0, 1, int(rng.integers(3, 6))).tolist())
        elif f.shape == "faint":
            params = {"r0": float(rng.uniform(0.1, 0.5)), "r1": float(rng.uniform(2, 6))}
        plan.ecc_eps.append(Episode(g, f.onset, f.at, f.shape, params))
    plan.gpu_bumps.append((g, f.at, "uncorrected", float(rng.integers(1, 4))))
    if rng.random() < 0.5:
        plan.gpu_bumps.append((g, f.at, "corrected", float(rng.integers(10, 120))))
    pid = (str(int(rng.integers(2000, 90000))), "python3")
    plan.events.append(kmsg.xid(48, name, slot.pci, f.at, XID_TEXT[48], pid))
    if rng.random() < 0.6:
        plan.events.append(kmsg.xid(63, name, slot.pci, f.at + float(rng.integers(1, 4)),
                                    XID_TEXT[63]))
    f.recovered_at = f.at + float(rng.uniform(2, 30)) * HOUR
    plan.drained.append((g, f.at, f.recovered_at))
    if rng.random() < 0.4:
        f.replaced = True
        _node_restart(plan, rng, kmsg, slot.node, f.recovered_at - rng.uniform(1, 3) * HOUR,
                      f.recovered_at, "replace")
        _replace_gpu(plan, rng, g, f.recovered_at)
    else:
        _node_restart(plan, rng, kmsg, slot.node, f.recovered_at - rng.uniform(60, 240),
                      f.recovered_at, "driver")


def _plan_thermal(plan: FleetPlan, rng: np.random.Generator, kmsg: _Kmsg, f: Failure) -> None:
    g, slot = f.row, plan.slots[f.row]
    node = plan.nodes[slot.node]
    assert f.onset is not None
    assert f.shape is not None
    loaded = plan.idle[g] + (0.93 * plan.tdp[g] - plan.idle[g]) * 0.9 * plan.eff[g]
    typical = (plan.inlet_base[slot.node] + plan.rth[g] * min(loaded, plan.limit[g])
               + plan.pos_off[g] + plan.hot_off[g])
    # at the end of the creep a GPU under typical load is just below its slowdown point
    creep = max(8.0, float(plan.slowdown[g] - 1.0 - typical))
    final = float(rng.uniform(20, 90)) * 60
    params: dict[str, Any] = {"amp": creep}
    if f.shape == "knee":
        params.update(k=float(rng.uniform(0.4, 0.8)), level=float(rng.uniform(0.15, 0.35)))
    elif f.shape == "faint":
        params.update(k=float(rng.uniform(0.75, 0.9)), level=float(rng.uniform(0.04, 0.1)))
    elif f.shape == "steps":
        params["steps"] = sorted(rng.uniform(0, 1, int(rng.integers(2, 5))).tolist())
    plan.temp_eps.append(Episode(g, f.onset, f.at, "creep_" + f.shape, params))
    plan.force_eps.append(Episode(g, f.at - final, f.at, "ramp",
                                  {"r0": float(plan.slowdown[g]) - 4.0,
                                   "r1": float(plan.shutdown[g]) + 0.5}))
    xid_at = float(math.floor(f.at + rng.uniform(1, 5)))
    plan.events.append(kmsg.xid(79, node.name, slot.pci, xid_at, XID_TEXT[79]))
    f.at = xid_at
    f.recovered_at = f.at + float(rng.uniform(4, 48)) * HOUR
    plan.lost.append((g, f.at - 1.0, f.recovered_at))
    _node_restart(plan, rng, kmsg, slot.node, f.recovered_at - rng.uniform(0.5, 2) * HOUR,
                  f.recovered_at, "replace")
    if rng.random() < 0.3:
        f.replaced = True
        _replace_gpu(plan, rng, g, f.recovered_at)


def _plan_otb(plan: FleetPlan, rng: np.random.Generator, kmsg: _Kmsg, f: Failure) -> None:
    g, slot = f.row, plan.slots[f.row]
    name = plan.nodes[slot.node].name
    plan.events.append(kmsg.xid(79, name, slot.pci, f.at, XID_TEXT[79]))
    text = f"GPU {slot.pci}: GPU has fallen off the bus."
    plan.events.append(kmsg.event("gpu_lost", "fallen_off_bus", name, slot.pci,
                                  f.at + float(rng.integers(0, 2)), text, text,
                                  {"message": text}))
    f.recovered_at = f.at + float(rng.uniform(1, 20)) * HOUR
    plan.lost.append((g, f.at, f.recovered_at))
    _node_restart(plan, rng, kmsg, slot.node, f.recovered_at - rng.uniform(300, 900),
                  f.recovered_at, "reboot")


def _plan_link(plan: FleetPlan, rng: np.random.Generator, kmsg: _Kmsg, f: Failure) -> None:
    p, port = f.row, plan.ports[f.row]
    name = plan.nodes[port.node].name
    if f.onset is not None and f.shape is not None:
        if f.shape == "bursty":
            lead = f.at - f.onset
            b1 = float(rng.uniform(2, 8))  # bursts per hour at the end, 0.3 at the onset
            times = [t for t in np.arange(f.onset, f.at - 300, 300.0)
                     if rng.random() < (0.3 + (b1 - 0.3) * (t - f.onset) / lead) / 12]
            while len(times) < 2:  # a precursor has at least two bursts, late in the lead
                times.append(f.at - float(rng.uniform(0.05, 0.3)) * lead)
            for t in sorted(times):
                size = float(np.clip(rng.lognormal(math.log(300), 1.0), 50, 3000))
                rec = float(rng.integers(1, 3)) if rng.random() < 0.33 else 0.0
                plan.port_bumps.append((p, float(t) + float(rng.uniform(0, 300)), size, rec))
            plan.sym_eps.append(Episode(p, f.onset, f.at, "ramp",
                                        {"r0": 0.0, "r1": float(rng.uniform(0.2, 1.0))}))
        elif f.shape == "faint":
            plan.sym_eps.append(Episode(p, f.onset, f.at, "ramp",
                                        {"r0": 0.0, "r1": float(rng.uniform(1.5, 5))}))
        else:
            plan.sym_eps.append(Episode(p, f.onset, f.at, "ramp",
                                        {"r0": float(rng.uniform(0, 2)),
                                         "r1": float(rng.uniform(20, 250))}))
    down_for = float(np.clip(rng.lognormal(math.log(1.5 * HOUR), 1.2), 600, 24 * HOUR))
    f.recovered_at = _grid(plan.config, f.at + down_for)
    plan.port_down.append((p, f.at, f.recovered_at))
    plan.downed_steps.append((p, f.at))
    attrs = {"device": port.device, "port": port.port, "state": "down", "phys_state": "polling",
             "previous_state": "active"}
    path = f"/sys/class/infiniband/{port.device}/ports/{port.port}/state"
    plan.events.append(Event(kind="ib_port_state", code="down", node=NodeName(name),
                             entity=EntityId(port.entity), observed_at=f.at,
                             message=f"{port.entity} state 1: DOWN", attrs=attrs,
                             evidence=(Evidence(file=path, line=None, text="1: DOWN"),),
                             source="sysfs"))
    if f.recovered_at < plan.end:
        attrs = {"device": port.device, "port": port.port, "state": "active",
                 "phys_state": "linkup", "previous_state": "down"}
        plan.events.append(Event(kind="ib_port_state", code="active", node=NodeName(name),
                                 entity=EntityId(port.entity), observed_at=f.recovered_at,
                                 message=f"{port.entity} state 4: ACTIVE", attrs=attrs,
                                 evidence=(Evidence(file=path, line=None, text="4: ACTIVE"),),
                                 source="sysfs"))
        if rng.random() < 0.5:
            plan.port_clears.append((p, f.recovered_at))


def _plan_confounders(plan: FleetPlan, rng: np.random.Generator, kmsg: _Kmsg) -> None:
    config = plan.config
    start, end, days = config.start, plan.end, config.days
    g_count, p_count, n_count = len(plan.slots), len(plan.ports), len(plan.nodes)

    def when(span: float = 0.0) -> float:
        return float(rng.uniform(start, max(start + 1, end - span)))

    # one-off corrected-error bursts
    for _ in range(_count(rng, 0.03 * g_count, days)):
        g, t0 = int(rng.integers(g_count)), when()
        length = float(rng.uniform(5, 60)) * 60
        total = float(np.clip(rng.lognormal(math.log(200), 1.2), 30, 3000))
        plan.ecc_eps.append(Episode(g, t0, t0 + length, "flat",
                                    {"rate": total / (length / HOUR), "load": False}))
        plan.confounders.append(_conf("corrected_ecc_burst", plan, g, t0, t0 + length,
                                      errors=round(total)))
    # a corrected-error rate that rises and falls back, no failure
    for g in map(int, np.flatnonzero(rng.random(g_count) < 0.01)):
        up, down = float(rng.uniform(6, 48)) * HOUR, float(rng.uniform(6, 24)) * HOUR
        t0 = when(up + down)
        peak = float(rng.uniform(20, 100))
        plan.ecc_eps.append(Episode(int(g), t0, t0 + up, "ramp", {"r0": 0.5, "r1": peak}))
        plan.ecc_eps.append(Episode(int(g), t0 + up, t0 + up + down, "ramp",
                                    {"r0": peak, "r1": 0.0}))
        plan.confounders.append(_conf("corrected_ecc_rise_and_fall", plan, int(g), t0,
                                      t0 + up + down, peak_per_hour=round(peak, 1)))
    # GPUs drifting warmer and staying there
    for g in map(int, np.flatnonzero(rng.random(g_count) < 0.02)):
        span = float(rng.uniform(2, 5)) * DAY
        t0 = when()
        amp = float(rng.uniform(2, 6))
        plan.temp_eps.append(Episode(int(g), t0, t0 + span, "drift", {"amp": amp}))
        plan.confounders.append(_conf("warming_drift", plan, int(g), t0, end, degc=round(amp, 1)))
    # node cooling excursions
    for _ in range(_count(rng, 0.06 * n_count, days)):
        n = int(rng.integers(n_count))
        length = float(rng.uniform(0.5, 8)) * HOUR
        t0 = when()
        amp = float(rng.uniform(4, 15))
        plan.inlet_eps.append(Episode(n, t0, t0 + length, "trapezoid",
                                      {"amp": amp, "ramp": float(rng.uniform(5, 20)) * 60}))
        plan.confounders.append({"kind": "cooling_excursion", "node": plan.nodes[n].name,
                                 "entity": "node", "start": t0, "end": t0 + length,
                                 "degc": round(amp, 1)})
    # PCIe replay bursts
    for _ in range(_count(rng, 0.02 * g_count, days)):
        g, t0 = int(rng.integers(g_count)), when()
        length = float(rng.uniform(2, 30)) * 60
        plan.pcie_eps.append(Episode(g, t0, t0 + length, "flat",
                                     {"rate": float(rng.uniform(5, 200))}))
        plan.confounders.append(_conf("pcie_replay_burst", plan, g, t0, t0 + length))
    # benign application Xids
    for _ in range(_count(rng, 0.04 * g_count, days)):
        g, t0 = int(rng.integers(g_count)), math.floor(when())
        slot = plan.slots[g]
        code = int(rng.choice([13, 31, 43, 45]))
        pid = (str(int(rng.integers(2000, 90000))), str(rng.choice(["python3", "pt_main_thread",
                                                                    "tritonserver"])))
        plan.events.append(kmsg.xid(code, plan.nodes[slot.node].name, slot.pci, float(t0),
                                    XID_TEXT[code], pid))
        plan.confounders.append(_conf(f"app_xid_{code}", plan, g, float(t0), float(t0)))
    # symbol-error bursts on healthy links
    for _ in range(_count(rng, 0.04 * p_count, days)):
        p, t0 = int(rng.integers(p_count)), when()
        length = float(rng.uniform(1, 20)) * 60
        total = float(np.clip(rng.lognormal(math.log(400), 1.3), 50, 5000))
        pieces = max(1, int(length // config.interval_seconds))
        rec_total = float(rng.integers(1, 4)) if rng.random() < 0.4 else 0.0
        for i in range(pieces):
            plan.port_bumps.append((p, t0 + i * config.interval_seconds, total / pieces,
                                    rec_total if i == pieces // 2 else 0.0))
        plan.confounders.append(_port_conf("symbol_error_burst", plan, p, t0, t0 + length,
                                           errors=round(total), recoveries=rec_total))
    # port counter clears
    for _ in range(_count(rng, 0.03 * n_count, days)):
        n, t0 = int(rng.integers(n_count)), _grid(config, when())
        for p in plan.nodes[n].ports:
            plan.port_clears.append((p, t0))
        plan.confounders.append({"kind": "port_counter_clear", "node": plan.nodes[n].name,
                                 "entity": "node", "start": t0, "end": t0})
    # driver reloads, maintenance reboots, collector gaps and outages
    for rate, kind, lo, hi in ((0.02, "driver", 60.0, 240.0), (0.01, "reboot", 300.0, 900.0)):
        for _ in range(_count(rng, rate * n_count, days)):
            n, t0 = int(rng.integers(n_count)), when()
            t1 = t0 + float(rng.uniform(lo, hi))
            _node_restart(plan, rng, kmsg, n, t0, t1, kind)
            plan.confounders.append({"kind": f"{kind}_reload" if kind == "driver" else kind,
                                     "node": plan.nodes[n].name, "entity": "node",
                                     "start": t0, "end": t1})
    for rate, kind, lo, hi in ((0.15, "collector_gap", 120.0, 2400.0),
                               (0.01, "collector_outage", HOUR, 4 * HOUR)):
        for _ in range(_count(rng, rate * n_count, days)):
            n, t0 = int(rng.integers(n_count)), when()
            t1 = t0 + float(rng.uniform(lo, hi))
            plan.node_gaps.append((n, t0, t1, "collector"))
            plan.confounders.append({"kind": kind, "node": plan.nodes[n].name,
                                     "entity": "node", "start": t0, "end": t1})
    for _ in range(_count(rng, 0.03 * g_count, days)):
        g, t0 = int(rng.integers(g_count)), when()
        t1 = t0 + float(rng.integers(1, 6)) * config.interval_seconds
        plan.gpu_gaps.append((g, t0, t1))
        plan.confounders.append(_conf("gpu_read_failure", plan, g, t0, t1))


# --- rendering -----------------------------------------------------------------------------


def _shape(shape: str, u: FloatArray, params: Mapping[str, Any]) -> FloatArray:
    """The value of an episode's shape at fractions ``u`` (0 at its start, 1 at its end)."""
    if shape == "flat":
        return np.full_like(u, float(params["rate"]))
    if shape in ("ramp", "faint"):
        return params["r0"] + (params["r1"] - params["r0"]) * u  # type: ignore[no-any-return]
    if shape == "knee":
        k = float(params["k"])
        return np.asarray(np.where(u < k, params["r0"], params["r0"] + (
            params["r1"] - params["r0"]) * (u - k) / (1 - k)), dtype=np.float64)
    if shape == "stairs":
        steps = np.asarray(params["steps"])
        level = (u[:, None] >= steps[None, :]).sum(axis=1) / len(steps)
        return params["r0"] * (params["r1"] / params["r0"]) ** level  # type: ignore[no-any-return]
    if shape == "creep_linear":
        return params["amp"] * u  # type: ignore[no-any-return]
    if shape in ("creep_knee", "creep_faint"):
        k, level = float(params["k"]), float(params["level"])
        s = np.where(u < k, level * u / k, level + (1 - level) * (u - k) / (1 - k))
        return params["amp"] * s  # type: ignore[no-any-return]
    if shape == "creep_steps":
        steps = np.asarray(params["steps"])
        # each step ramps up over 5 % of the episode
        s = np.clip((u[:, None] - steps[None, :]) / 0.05, 0, 1).sum(axis=1) / len(steps)
        return params["amp"] * s  # type: ignore[no-any-return]
    if shape == "drift":
        return params["amp"] * np.clip(u, 0, 1)  # type: ignore[no-any-return]
    if shape == "trapezoid":
        return np.asarray(params["amp"] * u)  # the caller passes the ramp factor as u
    raise ValueError(shape)


def _apply(out: FloatArray, eps: Iterable[Episode], ts: FloatArray, *,
           open_end: bool = False) -> None:
    """Add each episode's shape to its row over the samples of ``ts`` inside it."""
    t_first, t_last = float(ts[0]), float(ts[-1])
    for ep in eps:
        t1 = math.inf if open_end else ep.t1
        if ep.t0 > t_last or t1 < t_first:
            continue
        mask = (ts >= ep.t0) & (ts < t1)
        if not mask.any():
            continue
        u = (ts[mask] - ep.t0) / max(ep.t1 - ep.t0, 1e-9)
        if ep.shape == "trapezoid":
            ramp = float(ep.params["ramp"])
            u = np.minimum(np.minimum((ts[mask] - ep.t0) / ramp, (ep.t1 - ts[mask]) / ramp), 1.0)
        out[ep.row, mask] += _shape(ep.shape, np.clip(u, 0, None), ep.params)


def _window(mask: BoolArray, windows: Iterable[tuple[int, float, float]], ts: FloatArray,
            value: bool) -> None:
    t_first, t_last = float(ts[0]), float(ts[-1])
    for row, t0, t1 in windows:
        if t0 > t_last or t1 < t_first:
            continue
        mask[row, (ts >= t0) & (ts < t1)] = value


@dataclass
class _Carry:
    """State carried from one chunk to the next."""

    temp: FloatArray
    throttled: BoolArray
    ecc: dict[str, FloatArray]
    pcie: FloatArray
    sym: FloatArray
    rec: FloatArray
    downed: FloatArray
    last_mask: list[int]
    last_clock: list[int]
    last_inventory: list[int]
    alive_before: list[bool]
    identity: list[str]


def _counts(rng: np.random.Generator, lam: FloatArray, cluster: FloatArray | None) -> FloatArray:
    """Clustered counts: Poisson clusters of mean size ``cluster`` (per row), mean ``lam``."""
    lam = np.maximum(lam, 0.0)
    if cluster is None:
        return rng.poisson(lam).astype(np.float64)
    m = cluster[:, None]
    clusters = rng.poisson(lam / m)
    extra = np.where(clusters > 0, rng.negative_binomial(np.maximum(clusters, 1), 1.0 / m), 0)
    return (clusters + extra).astype(np.float64)


def _cumulate(inc: FloatArray, carry: FloatArray, resets: list[tuple[int, int]]) -> FloatArray:
    """Cumulative counter values from increments, starting at ``carry``, reset at (row, col)."""
    total = carry[:, None] + np.cumsum(inc, axis=1)
    for row, col in sorted(resets, key=lambda rc: rc[1]):
        before = total[row, col] - inc[row, col]
        total[row, col:] -= before
    return total


def _resets(times: Iterable[tuple[int, float]], ts: FloatArray,
            dt: float) -> list[tuple[int, int]]:
    """(row, column) of each reset: the first sample at or after its time, in this chunk."""
    return [(row, int(np.searchsorted(ts, at))) for row, at in times
            if ts[0] - dt < at <= ts[-1]]


_ECC_LABELS = {
    ("corrected", "volatile"): {"type": "corrected", "scope": "volatile", "location": "total"},
    ("uncorrected", "volatile"): {"type": "uncorrected", "scope": "volatile", "location": "total"},
    ("corrected", "aggregate"): {"type": "corrected", "scope": "aggregate", "location": "total"},
    ("uncorrected", "aggregate"): {"type": "uncorrected", "scope": "aggregate",
                                   "location": "total"},
}
_CLOCK_LABELS = tuple(({"reason": name}, bit) for name, bit in CLOCK_REASONS)
_THRESHOLD_LABELS = ({"threshold": "shutdown"}, {"threshold": "slowdown"},
                     {"threshold": "max_operating"})


def write_recording(plan: FleetPlan, path: Path) -> dict[str, int]:
    """Render the plan as line protocol at ``path``; return the lines, samples and events.

    Time order throughout: each sample time's lines, then the events up to the next one.
    Memory is bounded by ``chunk_ticks`` x GPUs (the plan itself is small).
    """
    config = plan.config
    dt = config.interval_seconds
    rng = np.random.default_rng(np.random.SeedSequence([plan.seed, 2_600_907]))
    g_count, p_count = len(plan.slots), len(plan.ports)
    enc = LineEncoder()
    carry = _Carry(
        temp=np.array([plan.inlet_base[s.node] + plan.rth[g] * plan.idle[g]
                       for g, s in enumerate(plan.slots)]),
        throttled=np.zeros(g_count, dtype=bool),
        ecc={k: np.zeros(g_count) for k in ("corrected", "uncorrected", "corrected_agg",
                                            "uncorrected_agg")},
        pcie=np.zeros(g_count), sym=np.zeros(p_count), rec=np.zeros(p_count),
        downed=np.zeros(p_count), last_mask=[-1] * g_count, last_clock=[-10**9] * g_count,
        last_inventory=[-10**9] * g_count, alive_before=[False] * g_count,
        identity=[""] * g_count)
    # aggregate counters start from a lifetime of errors
    carry.ecc["corrected_agg"] = np.floor(plan.ecc_base * rng.uniform(200, 4000, g_count))
    counts = {"lines": 0, "samples": 0, "events": 0}
    events = plan.events
    next_event = 0
    inv_ticks = max(1, round(config.inventory_seconds / dt))
    clock_ticks = max(1, round(config.clock_refresh_seconds / dt))
    with open(path, "w", encoding="utf-8") as out:
        out.write(f"# gpuhealth held-out fleet recording seed={plan.seed} gpus={g_count} "
                  f"days={config.days:g} interval={dt:g}s (benchmarks/heldout_fleet.py)\n")
        for k0 in range(0, plan.ticks, config.chunk_ticks):
            c_len = min(config.chunk_ticks, plan.ticks - k0)
            ts = config.start + dt * np.arange(k0, k0 + c_len, dtype=np.float64)
            chunk = _render_chunk(plan, rng, ts, carry)
            for c in range(c_len):
                at = float(ts[c])
                samples = _tick_samples(plan, chunk, c, k0 + c, at, carry, inv_ticks,
                                        clock_ticks)
                lines = enc.samples(samples)
                counts["samples"] += len(samples)
                upto = at + dt
                due = []
                while next_event < len(events) and (events[next_event].observed_at or 0) < upto:
                    due.append(events[next_event])
                    next_event += 1
                if due:
                    lines.extend(enc.events(due))
                    counts["events"] += len(due)
                if lines:
                    out.write("\n".join(lines))
                    out.write("\n")
                    counts["lines"] += len(lines)
    return counts


def _render_chunk(plan: FleetPlan, rng: np.random.Generator, ts: FloatArray,
                  carry: _Carry) -> dict[str, Any]:
    """The chunk's values as arrays [rows, samples] (lists of lists for the writer)."""
    config = plan.config
    dt = config.interval_seconds
    g_count, p_count, c_len = len(plan.slots), len(plan.ports), len(ts)
    per = config.gpus_per_node
    # workload
    util = np.zeros((g_count, c_len))
    intensity = np.ones((g_count, c_len))
    for n, node in enumerate(plan.nodes):
        jobs = plan.jobs[n]
        seg = np.clip(np.searchsorted(jobs["starts"], ts, side="right") - 1, 0, None)
        kind, level = jobs["kinds"][seg], jobs["levels"][seg]
        busy = jobs["busy"][seg]  # [C, per]
        since = ts - jobs["starts"][seg]
        dip = (kind == 1) & ((since % jobs["period"][seg]) < jobs["dip"][seg])
        base = np.where(dip, jobs["dip_level"][seg], level)
        for i, g in enumerate(node.slots):
            u = base * busy[:, i % per]
            u = np.where(kind == 3, np.clip(u + rng.normal(0, 0.12, c_len), 0.05, 1.0) * busy[
                :, i % per], u)
            u = np.where(u > 0, np.clip(u + rng.normal(0, 0.015, c_len), 0.0, 1.0), u)
            util[g] = u
            intensity[g] = jobs["intensity"][seg]
    drained = np.zeros((g_count, c_len), dtype=bool)
    _window(drained, plan.drained, ts, True)
    util[drained] = 0.0
    util = np.round(util * 100.0) / 100.0
    # power
    full = 0.93 * plan.tdp[:, None]
    raw = (plan.idle[:, None] + (full - plan.idle[:, None]) * intensity * util ** 0.85
           * plan.eff[:, None] + rng.normal(0, 1, (g_count, c_len)) * 0.012 * plan.tdp[:, None])
    raw = np.maximum(raw, plan.idle[:, None] * 0.85)
    power_cap = raw >= plan.limit[:, None]
    power = np.minimum(raw, plan.limit[:, None])
    # temperature: node inlet (diurnal, excursions) + own heat + offsets + episodes, lagged
    node_of = np.array([s.node for s in plan.slots])
    inlet = np.zeros((len(plan.nodes), c_len))
    inlet += plan.inlet_base[:, None] + plan.diurnal_amp[:, None] * np.sin(
        2 * math.pi * ts[None, :] / DAY + plan.diurnal_phase[:, None])
    _apply(inlet, plan.inlet_eps, ts)
    extra = np.zeros((g_count, c_len))
    creep = np.zeros((g_count, c_len))
    _apply(extra, [e for e in plan.temp_eps if e.shape == "drift"], ts, open_end=True)
    # a drift stays at its amplitude after its end: open_end applies the shape clipped at 1
    _apply(creep, [e for e in plan.temp_eps if e.shape != "drift"], ts)
    extra += creep * (0.4 + 0.6 * util)
    # the cooling gives out: the temperature is driven from below slowdown to shutdown
    force = np.zeros((g_count, c_len))
    _apply(force, plan.force_eps, ts)
    force[force == 0.0] = np.nan
    temps = np.zeros((g_count, c_len))
    temp = carry.temp
    throttled = carry.throttled
    offsets = plan.pos_off + plan.hot_off
    for c in range(c_len):
        throttled = np.where(throttled, temp >= plan.slowdown - 2.0, temp >= plan.slowdown)
        power[:, c] = np.where(throttled, power[:, c] * 0.7, power[:, c])
        target = inlet[node_of, c] + plan.rth * power[:, c] + offsets + extra[:, c]
        forced = ~np.isnan(force[:, c])
        target = np.where(forced, np.maximum(target, force[:, c]), target)
        temp = temp + plan.alpha * (target - temp)
        temps[:, c] = temp
    carry.temp, carry.throttled = temp, throttled
    # a GPU shuts itself down at its shutdown temperature: it never reports above it
    temp_read = np.minimum(np.round(temps + rng.normal(0, 0.35, temps.shape)),
                           plan.shutdown[:, None])
    power = np.round(power * 1000.0) / 1000.0
    mask = ((util < 0.01) * 0x001 + power_cap * 0x004 + (temp_read >= plan.slowdown[:, None] + 1)
            * 0x008 + (temp_read >= plan.max_operating[:, None]) * 0x020
            + (temp_read >= plan.slowdown[:, None]) * 0x040).astype(np.int64)
    # GPU counters
    load = 0.25 + 0.75 * util
    lam = np.repeat(plan.ecc_base[:, None], c_len, axis=1)
    _apply(lam, [e for e in plan.ecc_eps if e.params.get("load", True)], ts)
    lam *= load
    _apply(lam, [e for e in plan.ecc_eps if not e.params.get("load", True)], ts)
    corrected = _counts(rng, lam * dt / HOUR, plan.ecc_cluster)
    uncorrected = np.zeros((g_count, c_len))
    for g, at, which, n_err in plan.gpu_bumps:
        if ts[0] - dt < at <= ts[-1]:
            col = int(np.searchsorted(ts, at))
            (corrected if which == "corrected" else uncorrected)[g, col] += n_err
    pcie_lam = np.repeat(plan.pcie_base[:, None], c_len, axis=1)
    _apply(pcie_lam, plan.pcie_eps, ts)
    pcie = _counts(rng, pcie_lam * dt / 60.0, None)
    gpu_resets = _resets(((s, t1) for n, _t0, t1, why in plan.node_gaps
                          if why != "collector" for s in plan.nodes[n].slots), ts, dt)
    ecc = {
        "corrected": _cumulate(corrected, carry.ecc["corrected"], gpu_resets),
        "uncorrected": _cumulate(uncorrected, carry.ecc["uncorrected"], gpu_resets),
        "corrected_agg": _cumulate(corrected, carry.ecc["corrected_agg"], []),
        "uncorrected_agg": _cumulate(uncorrected, carry.ecc["uncorrected_agg"], []),
    }
    pcie_total = _cumulate(pcie, carry.pcie, gpu_resets)
    for key, values in ecc.items():
        carry.ecc[key] = values[:, -1].copy()
    carry.pcie = pcie_total[:, -1].copy()
    # GPU presence
    gpu_alive = np.ones((g_count, c_len), dtype=bool)
    node_gap = np.zeros((len(plan.nodes), c_len), dtype=bool)
    node_driver = np.zeros((len(plan.nodes), c_len), dtype=bool)
    for n, t0, t1, kind in plan.node_gaps:
        target_mask = node_driver if kind == "driver" else node_gap
        target_mask[n, (ts >= t0) & (ts < t1)] = True
    gpu_alive &= ~node_gap[node_of] & ~node_driver[node_of]
    _window(gpu_alive, plan.gpu_gaps, ts, False)
    _window(gpu_alive, plan.lost, ts, False)
    # ports
    sym_lam = np.repeat(plan.sym_base[:, None], c_len, axis=1)
    _apply(sym_lam, plan.sym_eps, ts)
    rec_lam = sym_lam / plan.rec_ratio[:, None]
    shape = 0.5  # gamma-Poisson: symbol errors are overdispersed
    sym = rng.poisson(rng.gamma(shape, np.maximum(sym_lam, 1e-12) * dt / 60.0 / shape)).astype(
        np.float64)
    rec = rng.poisson(rec_lam * dt / 60.0).astype(np.float64)
    downed = np.zeros((p_count, c_len))
    down = np.zeros((p_count, c_len), dtype=bool)
    _window(down, plan.port_down, ts, True)
    for p, at, n_sym, n_rec in plan.port_bumps:
        if ts[0] - dt < at <= ts[-1]:
            col = int(np.searchsorted(ts, at))
            sym[p, col] += round(n_sym)
            rec[p, col] += n_rec
    for p, at in plan.downed_steps:
        if ts[0] - dt < at <= ts[-1]:
            downed[p, int(np.searchsorted(ts, at))] += 1.0
    sym[down] = 0.0
    rec[down] = 0.0
    port_resets = _resets(plan.port_clears, ts, dt)
    sym_total = _cumulate(sym, carry.sym, port_resets)
    rec_total = _cumulate(rec, carry.rec, port_resets)
    downed_total = _cumulate(downed, carry.downed, port_resets)
    carry.sym, carry.rec, carry.downed = (sym_total[:, -1].copy(), rec_total[:, -1].copy(),
                                          downed_total[:, -1].copy())
    port_node = np.array([p.node for p in plan.ports], dtype=np.int64)
    port_alive = ~node_gap[port_node] if p_count else np.zeros((0, c_len), dtype=bool)
    return {
        "temp": temp_read.tolist(), "power": power.tolist(), "util": util.tolist(),
        "mask": mask.tolist(), "alive": gpu_alive.tolist(),
        "ecc": {k: v.tolist() for k, v in ecc.items()}, "pcie": pcie_total.tolist(),
        "port_alive": port_alive.tolist(), "down": down.tolist(),
        "sym": np.minimum(sym_total, SYM_MAX).tolist(),
        "rec": np.minimum(rec_total, RECOVERY_MAX).tolist(),
        "downed": np.minimum(downed_total, RECOVERY_MAX).tolist(),
    }


def _tick_samples(plan: FleetPlan, chunk: dict[str, Any], c: int, k: int, at: float,
                  carry: _Carry, inv_ticks: int, clock_ticks: int) -> list[Sample]:
    """The samples of sample time ``at`` (chunk column ``c``, global tick ``k``)."""
    out: list[Sample] = []
    add = out.append
    alive, temp, power, util = chunk["alive"], chunk["temp"], chunk["power"], chunk["util"]
    mask, ecc, pcie = chunk["mask"], chunk["ecc"], chunk["pcie"]
    for node in plan.nodes:
        name = NodeName(node.name)
        for g in node.slots:
            if not alive[g][c]:
                carry.alive_before[g] = False
                continue
            slot = plan.slots[g]
            ident = slot.identity_at(at)
            entity = EntityId(ident.uuid)
            fresh = not carry.alive_before[g] or carry.identity[g] != ident.uuid
            carry.alive_before[g] = True
            carry.identity[g] = ident.uuid
            if fresh or k - carry.last_inventory[g] >= inv_ticks:
                carry.last_inventory[g] = k
                model = MODELS[node.model]
                add(Sample(metric="gpu_info", value=1.0, observed_at=at, node=name,
                           entity=entity, labels={
                               "uuid": ident.uuid, "serial": ident.serial, "model": model.name,
                               "pci_bus_id": slot.pci_nvml, "index": str(slot.index),
                               "driver_version": node.driver, "vbios_version": model.vbios}))
                if node.thresholds:
                    for labels, value in zip(_THRESHOLD_LABELS, (plan.shutdown[g],
                                             plan.slowdown[g], plan.max_operating[g]),
                                             strict=True):
                        add(Sample(metric="gpu_temperature_threshold_celsius",
                                   value=float(value), observed_at=at, node=name,
                                   entity=entity, labels=labels))
            add(Sample(metric="gpu_temperature_celsius", value=temp[g][c], observed_at=at,
                       node=name, entity=entity))
            add(Sample(metric="gpu_power_watts", value=power[g][c], observed_at=at, node=name,
                       entity=entity))
            add(Sample(metric="gpu_utilization_ratio", value=util[g][c], observed_at=at,
                       node=name, entity=entity))
            add(Sample(metric="gpu_pcie_replays_total", value=pcie[g][c], observed_at=at,
                       node=name, entity=entity))
            add(Sample(metric="gpu_ecc_errors_total", value=ecc["corrected"][g][c],
                       observed_at=at, node=name, entity=entity,
                       labels=_ECC_LABELS["corrected", "volatile"]))
            add(Sample(metric="gpu_ecc_errors_total", value=ecc["uncorrected"][g][c],
                       observed_at=at, node=name, entity=entity,
                       labels=_ECC_LABELS["uncorrected", "volatile"]))
            if node.aggregate:
                add(Sample(metric="gpu_ecc_errors_total", value=ecc["corrected_agg"][g][c],
                           observed_at=at, node=name, entity=entity,
                           labels=_ECC_LABELS["corrected", "aggregate"]))
                add(Sample(metric="gpu_ecc_errors_total", value=ecc["uncorrected_agg"][g][c],
                           observed_at=at, node=name, entity=entity,
                           labels=_ECC_LABELS["uncorrected", "aggregate"]))
            bits = mask[g][c]
            if fresh or bits != carry.last_mask[g] or k - carry.last_clock[g] >= clock_ticks:
                carry.last_mask[g] = bits
                carry.last_clock[g] = k
                for labels, bit in _CLOCK_LABELS:
                    add(Sample(metric="gpu_clock_event_active",
                               value=1.0 if bits & bit else 0.0, observed_at=at, node=name,
                               entity=entity, labels=labels))
        port_alive, down = chunk["port_alive"], chunk["down"]
        sym, rec, downed = chunk["sym"], chunk["rec"], chunk["downed"]
        for p in node.ports:
            if not port_alive[p][c]:
                continue
            port = plan.ports[p]
            entity = EntityId(port.entity)
            labels = {"device": port.device, "port": port.port}
            is_down = down[p][c]
            add(Sample(metric="ib_port_state", value=1.0 if is_down else 4.0, observed_at=at,
                       node=name, entity=entity, labels=labels))
            add(Sample(metric="ib_port_physical_state", value=2.0 if is_down else 5.0,
                       observed_at=at, node=name, entity=entity, labels=labels))
            add(Sample(metric="ib_symbol_errors_total", value=sym[p][c], observed_at=at,
                       node=name, entity=entity, labels=labels))
            add(Sample(metric="ib_link_error_recovery_total", value=rec[p][c], observed_at=at,
                       node=name, entity=entity, labels=labels))
            add(Sample(metric="ib_link_downed_total", value=downed[p][c], observed_at=at,
                       node=name, entity=entity, labels=labels))
    return out


# --- labels --------------------------------------------------------------------------------


def gpu_aliases(plan: FleetPlan, g: int, ident: Identity) -> list[str]:
    """Every name of one GPU: UUID, both PCI spellings, ``gpu:<index>``, serial (two forms)."""
    slot = plan.slots[g]
    return [ident.uuid, slot.pci, slot.pci_nvml, f"gpu:{slot.index}", f"serial:{ident.serial}",
            ident.serial]


def labels(plan: FleetPlan, written: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The labels JSON of a plan (failures, identities, confounders; times epoch seconds)."""
    config = plan.config
    failures = []
    for i, f in enumerate(plan.failures):
        if f.kind == "link_down":
            port = plan.ports[f.row]
            entity, aliases = port.entity, [port.entity]
            pci = None
        else:
            slot = plan.slots[f.row]
            ident = slot.identity_at(f.at)
            entity, aliases, pci = ident.uuid, gpu_aliases(plan, f.row, ident), slot.pci
        onset = None if f.onset is None else max(f.onset, config.start)
        failures.append({
            "id": f"F{i + 1:03d}", "kind": f.kind, "node": plan.nodes[f.node].name,
            "entity": entity, "aliases": aliases, "pci_bus_id": pci,
            "failure_at": f.at, "precursor_onset_at": onset,
            "precursor_onset_true_at": f.onset, "precursor_shape": f.shape, "faint": f.faint,
            "recovered_at": f.recovered_at if f.recovered_at < plan.end else None,
            "replaced": f.replaced,
        })
    by_kind = {k: sum(1 for f in failures if f["kind"] == k) for k in KINDS}
    without = sum(1 for f in failures if f["precursor_onset_at"] is None)
    gpus = []
    for g, slot in enumerate(plan.slots):
        node = plan.nodes[slot.node]
        for ident in slot.identities:
            gpus.append({"node": node.name, "uuid": ident.uuid, "serial": ident.serial,
                         "pci_bus_id": slot.pci, "pci_bus_id_nvml": slot.pci_nvml,
                         "index": slot.index, "model": MODELS[node.model].name,
                         "platform": node.platform, "aliases": gpu_aliases(plan, g, ident),
                         "valid_from": ident.valid_from, "valid_to": ident.valid_to,
                         "thresholds_exported": node.thresholds,
                         "aggregate_ecc_exported": node.aggregate})
    ports = [{"node": plan.nodes[p.node].name, "entity": p.entity, "device": p.device,
              "port": p.port} for p in plan.ports]
    return {
        "format": "gpuhealth-heldout-labels/1",
        "generator": "benchmarks/heldout_fleet.py",
        "seed": plan.seed,
        "config": asdict(config),
        "start": config.start,
        "end": plan.end,
        "interval_seconds": config.interval_seconds,
        "gpus": len(plan.slots),
        "nodes": len(plan.nodes),
        "ports": len(plan.ports),
        "gpu_days": len(plan.slots) * config.days,
        "port_days": len(plan.ports) * config.days,
        "written": dict(written or {}),
        "failure_time": {
            "dbe": "the Xid 48 (uncorrected ECC step at the next sample)",
            "thermal": "the Xid 79 after the GPU reached its shutdown temperature and dropped out",
            "otb": "the Xid 79 (samples stop)",
            "link_down": "the sample at which the port reads Down (ib_port_state event)",
        },
        "summary": {"failures": len(failures), "by_kind": by_kind,
                    "without_precursor": without,
                    "share_without_precursor": round(without / len(failures), 3)
                    if failures else None},
        "failures": failures,
        "entities": {"gpus": gpus, "ports": ports},
        "confounders": plan.confounders,
    }


def generate(config: FleetConfig, *, seed: int, out_dir: Path) -> dict[str, Any]:
    """Write ``out_dir/fleet.lp`` and ``out_dir/labels.json``; return the labels."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_fleet(config, seed=seed)
    written = write_recording(plan, out_dir / "fleet.lp")
    result = labels(plan, written)
    (out_dir / "labels.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> int:
    """Generate a held-out recording from the command line and print its summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--days", type=float, default=10.0)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for fleet.lp, labels.json")
    parser.add_argument("--interval", type=float, default=60.0, help="sample interval, seconds")
    parser.add_argument("--start", type=float, default=START, help="first sample, epoch seconds")
    parser.add_argument("--rate", type=float, default=12.1,
                        help="failures per 1,000 GPU-days (default 12.1: ~31 per 256 x 10 d)")
    args = parser.parse_args(argv)
    config = FleetConfig(gpus=args.gpus, days=args.days, interval_seconds=args.interval,
                         start=args.start, failures_per_1000_gpu_days=args.rate)
    started = time.perf_counter()
    result = generate(config, seed=args.seed, out_dir=args.out)
    took = time.perf_counter() - started
    s = result["summary"]
    w = result["written"]
    print(f"{args.out}/fleet.lp: {result['gpus']} GPUs on {result['nodes']} nodes, "
          f"{result['ports']} ports, {config.days:g} days at {config.interval_seconds:g} s: "
          f"{w['lines']:,} lines, {w['samples']:,} samples, {w['events']:,} events "
          f"in {took:.1f} s")
    print(f"failures: {s['failures']} {s['by_kind']}, without precursor: "
          f"{s['without_precursor']} ({s['share_without_precursor']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
