"""Which work each fault hit: the jobs or pods on the node when a finding first appeared.

dcgm-exporter's users asked for it (its issue #625): an alert that says "GPU 3 on gpu-017
has a double-bit ECC error" is half the story; the other half is which job it killed. The
first time a finding is seen, :class:`WorkAttribution` asks the scheduler adapter
(:class:`~core.protocols.WorkLocator`: Slurm ``squeue``, the Kubernetes pods of the GPU)
what ran on the node (or on that GPU), within a timeout, and keeps the answer with the
finding for as long as it lasts: the work *at the time of the fault*, not whatever runs
there later. It is added to the finding's evidence (``work on gpu-017 when it happened:
slurm job 4123 (alice, partition train)``), so every alert, page and audit record shows it.

A scheduler that does not answer in time costs nothing: the finding goes on without the
line and the next evaluation asks again.

Only findings that can take work down are asked about (``min_severity``, major by
default): a fleet's warnings (corrected ECC, PCIe replays, thermal slowdown) come at
production rates of several per second, and one scheduler query each would load the
scheduler and hold up every evaluation for nothing a job lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace

from core.errors import GpuHealthError
from core.protocols import WorkLocator
from core.records import Evidence, Finding, Severity, WorkRef

logger = logging.getLogger(__name__)

SKIPPED_KINDS = frozenset({"gpuhealth", "fleet", "agent", "prediction", "anomaly"})
"""Kinds that are about no work on the node (gpuhealth itself, the fleet, statistics)."""

WORK_FILE = "scheduler"
"""``Evidence.file`` of the attribution line."""

Key = tuple[str, str, str, str]


class WorkAttribution:
    """Attach the work each new finding hit (module docstring).

    Bounded, so a burst of thousands of new findings costs the scheduler little and holds
    up no decision: at most ``max_targets`` (node, GPU) pairs are asked per evaluation (the
    rest at the next ones), each answer serves every finding of that pair, and within
    ``timeout_seconds``.

    Args:
        locator: The scheduler adapter.
        timeout_seconds: Longest wait for the scheduler per evaluation, seconds.
        max_refs: Work items named per finding (the rest are counted).
        max_targets: (node, entity) pairs asked per evaluation.
        min_severity: The least severe finding asked about (default major).
    """

    def __init__(self, locator: WorkLocator, *, timeout_seconds: float = 0.5,
                 max_refs: int = 8, max_targets: int = 16,
                 min_severity: Severity = Severity.MAJOR) -> None:
        self.locator = locator
        self.min_severity = min_severity
        self.timeout_seconds = timeout_seconds
        self.max_refs = max_refs
        self.max_targets = max_targets
        self._work: dict[Key, tuple[WorkRef, ...]] = {}
        self._said = False

    def work_of(self, key: Key) -> tuple[WorkRef, ...]:
        """The work recorded for the finding ``key`` (empty when none or not asked yet)."""
        return self._work.get(key, ())

    async def apply(self, findings: Sequence[Finding]) -> list[Finding]:
        """Ask about the findings seen for the first time; return all with their work line."""
        wanted = [f for f in findings if f.key not in self._work
                  and f.kind not in SKIPPED_KINDS and f.severity.rank >= self.min_severity.rank]
        targets = sorted({(f.node, f.entity) for f in wanted})[: self.max_targets]
        wanted = [f for f in wanted if (f.node, f.entity) in set(targets)]
        if targets:
            try:
                answers = await asyncio.wait_for(
                    asyncio.gather(*(self.locator.work_on(node, entity)
                                     for node, entity in targets)),
                    self.timeout_seconds)
            except (TimeoutError, GpuHealthError, OSError) as exc:
                if not self._said:
                    logger.warning("cannot tell which work the new findings hit: %s", exc)
                    self._said = True
            else:
                self._said = False
                by_target = dict(zip(targets, answers, strict=True))
                for f in wanted:
                    self._work[f.key] = tuple(by_target[(f.node, f.entity)])
        current = {f.key for f in findings}
        self._work = {k: v for k, v in self._work.items() if k in current}
        return [self._with_line(f) for f in findings]

    def _with_line(self, f: Finding) -> Finding:
        work = self._work.get(f.key)
        if not work:
            return f
        shown = ", ".join(w.describe() for w in work[: self.max_refs])
        more = f" and {len(work) - self.max_refs} more" if len(work) > self.max_refs else ""
        line = Evidence(file=WORK_FILE, line=None,
                        text=f"work on {f.node} when it happened: {shown}{more}")
        if line in f.evidence:
            return f
        return replace(f, evidence=(line, *f.evidence))
