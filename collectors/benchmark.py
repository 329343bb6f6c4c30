"""Per-GPU benchmark output: one throughput a GPU, for the peer comparison of the fault model.

A diagnostic that passes can still hide a GPU far slower than its peers (NVIDIA/DCGM #122:
``dcgmi diag -r xlong`` passed on an A100 doing a third of its peers' GEMM throughput, which
``ubergemm`` showed at once). Each per-GPU value becomes a ``dcgm_diag_perf`` event (code:
the benchmark, entity: the GPU, attrs ``value``/``unit``/``metric``), the record the DCGM
diagnostic parser gives for its own per-GPU throughput, so that one rule compares every GPU
with its peers (``analytics.fault_model.gpu``, a GPU under half the peers' median: major).

Forms read:

* ``ubergemm`` (nvidia-validation-suite plugin): ``GEMM [I] (ADAPTER#0)  Ending with
  6698.44 GFlops``;
* ``gpu-burn``: progress lines ``100.0%  proc'd: 2334 (17583 Gflop/s) - 2330 (17590
  Gflop/s) ...`` (one ``count (rate)`` pair per GPU, in GPU order; the last line counts);
* generic per-GPU lines ``GPU 3: 125.4 TFLOPS`` / ``GPU 3 | 512.0 GB/s`` in a block whose
  lines are mostly of that form.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from collectors.artifact import ArtifactParser, Line, ParseContext, ParserSession
from collectors.textparse import Session, line_evidence
from core.ids import gpu_index_entity
from core.records import EntityId, Event, Evidence, Record

_UBERGEMM = re.compile(
    r"GEMM \[I\] \(ADAPTER#(?P<gpu>\d+)\)\s+Ending with (?P<value>[\d.]+) (?P<unit>[GT]Flops)",
    re.IGNORECASE,
)
_BURN = re.compile(r"^\s*[\d.]+%\s+proc'd:\s*(?P<rest>.*)$")
_BURN_GPU = re.compile(r"\d+ \((?P<value>[\d.]+) (?P<unit>Gflop/s)\)")
_GENERIC = re.compile(
    r"^\s*(?:GPU|gpu|Device|device|rank)\s*#?(?P<gpu>\d+)\s*[:|,]\s*(?P<value>\d+(?:\.\d+)?)\s*"
    r"(?P<unit>[TG]FLOPS|[TG]Flop/s|GB/s|TB/s)\b",
)


class BenchmarkSession(Session):
    """Collect per-GPU values; emit them when the section closes (the last value counts)."""

    def __init__(self, ctx: ParseContext, *, test: str) -> None:
        super().__init__(ctx)
        self._test = test
        self._values: dict[tuple[str, int], tuple[str, str, Evidence, str]] = {}

    def feed(self, lines: Sequence[Line]) -> list[Record]:
        """Parse more lines (values are held back until :meth:`close`)."""
        for line in lines:
            text = line.text
            ev = line_evidence(self.ctx, line)
            m = _UBERGEMM.search(text)
            if m:
                self._values[("ubergemm", int(m["gpu"]))] = (m["value"], m["unit"], ev, text)
                continue
            burn = _BURN.match(text)
            if burn:
                for index, pair in enumerate(_BURN_GPU.finditer(burn["rest"])):
                    self._values[("gpu_burn", index)] = (pair["value"], pair["unit"], ev, text)
                continue
            generic = _GENERIC.match(text)
            if generic:
                key = (self._test, int(generic["gpu"]))
                self._values[key] = (generic["value"], generic["unit"], ev, text)
        return []

    def close(self) -> list[Record]:
        """Emit one ``dcgm_diag_perf`` event per GPU and benchmark."""
        out: list[Record] = []
        for (test, gpu), (value, unit, ev, text) in sorted(self._values.items()):
            out.append(
                Event(
                    kind="dcgm_diag_perf",
                    code=test,
                    node=self.ctx.node,
                    entity=EntityId(gpu_index_entity(gpu)),
                    observed_at=None,
                    message=text.strip()[:200],
                    attrs={"value": value, "unit": unit.lower(), "metric": "throughput"},
                    evidence=(ev,),
                    source="benchmark",
                )
            )
        return out


class BenchmarkParser:
    """Per-GPU benchmark throughput (``ubergemm``, ``gpu-burn``, ``GPU N: X TFLOPS`` lines)."""

    kind = "gpu_benchmark"

    def detect(self, lines: Sequence[Line], command: str | None) -> int:
        """Return 85 when most lines are per-GPU benchmark values."""
        sample = lines[:200]
        hits = sum(
            1
            for ln in sample
            if _UBERGEMM.search(ln.text) or _BURN.match(ln.text) or _GENERIC.match(ln.text)
        )
        if hits >= 2 and hits * 2 >= len(sample):
            return 85
        if hits and command is not None and re.search(r"ubergemm|gpu.?burn", command):
            return 85
        return 0

    def open(self, ctx: ParseContext) -> ParserSession:
        """Start parsing a section."""
        test = "benchmark"
        if ctx.command:
            found = re.search(r"([\w-]+)(?:\s|$)", ctx.command.split("/")[-1])
            test = found[1].replace("-", "_") if found else test
        return BenchmarkSession(ctx, test=test)


PARSERS: tuple[ArtifactParser, ...] = (BenchmarkParser(),)
"""The artifact parsers of this module (read by ``collectors.parsers``)."""

__all__ = ["PARSERS", "BenchmarkParser"]
