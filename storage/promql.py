"""Read-only store over the Prometheus HTTP API (Prometheus or VictoriaMetrics).

For sites whose metrics already live in Prometheus: gpuhealth's own series (written by the
``influxdb`` backend into VictoriaMetrics, or scraped from ``gpuhealth run``'s ``/metrics``)
carry the catalog name and ``node``/``entity`` labels; dcgm-exporter series
(``DCGM_FI_DEV_GPU_TEMP``...) are found through ``core.catalog.BY_DCGM``, scaled by
``dcgm_scale`` into base units (``DCGM_FI_DEV_POWER_USAGE`` is W, FB memory MiB, energy mJ),
with ``node`` from the ``Hostname``/``hostname`` label (released tags vs main,
``ecosystem-reference.md`` §0 item 3) or the ``instance`` host, and ``entity`` from
``UUID``/``uuid``.

Raw reads use an instant query of a range selector (``metric[<window>]`` at ``until_at``),
which both servers answer with the stored samples; reads with ``step_seconds`` use
``/api/v1/query_range`` over ``avg_over_time(metric[<step>])``, shifted so that each point
is the mean of ``(t, t + step]`` stamped ``t``, as :class:`~storage.sqlite.SqliteStore`
buckets. Synchronous HTTP (``httpx.Client``) because the Store protocol is synchronous and
reads come from reports and the analytics' batch jobs, not the collection path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from core.catalog import BY_DCGM, BY_NAME, MetricSpec
from core.errors import PermanentError, TemporaryError
from core.records import EntityId, EntityRef, Event, NodeName, Sample

if TYPE_CHECKING:
    import pandas as pd  # reads only: importing the store (every agent does) never loads it

logger = logging.getLogger(__name__)

_BASE_COLUMNS = ["observed_at", "node", "entity", "value"]
_DROP = {"__name__", "node", "entity", "job", "instance", "db"}


@contextlib.contextmanager
def _mapped_errors(url: str) -> Iterator[None]:
    try:
        yield
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        if status == 429 or status >= 500:
            raise TemporaryError(f"{url}: HTTP {status}") from exc
        raise PermanentError(f"{url}: HTTP {status}: {exc.response.text[:300]}") from exc
    except httpx.HTTPError as exc:
        raise TemporaryError(f"{url}: {exc}") from exc


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _regex(values: Sequence[str]) -> str:
    return _quote("|".join(re.escape(v) for v in sorted(set(values))))


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


class PromqlStore:
    """A read-only :class:`core.protocols.Store` over ``/api/v1/query[_range]``.

    Args:
        url: Base URL, e.g. ``http://127.0.0.1:9090`` or ``http://127.0.0.1:8428``.
        dcgm: Also read dcgm-exporter's ``DCGM_FI_*`` series for catalogued metrics.
        timeout_seconds: HTTP timeout of one query.
        token_env: Environment variable holding a bearer token, if any.
        entities_lookback_seconds: How far back :meth:`entities` looks.
        max_points: Largest number of steps one range query may ask for (Prometheus
            refuses more than 11,000); longer windows use a larger step.
    """

    def __init__(
        self,
        *,
        url: str,
        dcgm: bool = True,
        timeout_seconds: float = 10.0,
        token_env: str | None = None,
        entities_lookback_seconds: float = 86400.0,
        max_points: int = 11_000,
    ) -> None:
        self.url = url.rstrip("/")
        self.dcgm = dcgm
        self.timeout_seconds = timeout_seconds
        self.token_env = token_env
        self.entities_lookback_seconds = entities_lookback_seconds
        self.max_points = max_points
        headers = {}
        if token_env and os.environ.get(token_env):
            headers["Authorization"] = f"Bearer {os.environ[token_env]}"
        self._http = httpx.Client(base_url=self.url, timeout=timeout_seconds, headers=headers)

    def write(self, samples: Sequence[Sample], events: Sequence[Event]) -> None:
        """Refuse: this store only reads (write with the ``influxdb`` store instead).

        Raises:
            PermanentError: Always, unless the batch is empty.
        """
        if samples or events:
            raise PermanentError("the promql store is read-only; write with type = \"influxdb\"")

    def _get(self, path: str, params: dict[str, Any] | list[tuple[str, Any]]) -> Any:
        with _mapped_errors(self.url):
            response = self._http.get(path, params=params)
            response.raise_for_status()
            body = response.json()
        if body.get("status") != "success":
            raise PermanentError(f"{self.url}{path}: {body.get('error', body)}")
        return body["data"]

    def _selectors(self, metric: str, entities: Sequence[EntityRef] | None
                   ) -> list[tuple[str, MetricSpec | None]]:
        spec = BY_NAME.get(metric)
        native = f'{metric}{{node!="",entity!=""}}'
        if entities is not None:
            native = (f"{metric}{{node=~{_regex([e.node for e in entities])},"
                      f"entity=~{_regex([e.entity for e in entities])}}}")
        out: list[tuple[str, MetricSpec | None]] = [(native, None)]
        if self.dcgm and spec is not None and spec.dcgm:
            if entities is None:
                out.append((spec.dcgm, spec))
            else:
                ids = _regex([e.entity for e in entities])
                out += [(f"{spec.dcgm}{{UUID=~{ids}}}", spec),
                        (f"{spec.dcgm}{{uuid=~{ids}}}", spec)]
        return out

    @staticmethod
    def _identity(labels: dict[str, str], spec: MetricSpec | None
                  ) -> tuple[str, str, dict[str, str]]:
        if spec is None:
            extra = {k: v for k, v in labels.items() if k not in _DROP}
            return labels.get("node", ""), labels.get("entity", ""), extra
        node = (labels.get("Hostname") or labels.get("hostname")
                or labels.get("instance", "").rsplit(":", 1)[0])
        entity = labels.get("UUID") or labels.get("uuid") or labels.get("pci_bus_id", "")
        extra = {k: v for k, v in labels.items() if k in spec.labels}
        return node, entity, extra

    def read(
        self,
        metric: str,
        entities: Sequence[EntityRef] | None,
        since_at: float,
        until_at: float,
        step_seconds: float | None = None,
    ) -> pd.DataFrame:
        """Read one metric over ``[since_at, until_at]`` (epoch seconds, inclusive).

        Returns:
            Columns ``observed_at``, ``node``, ``entity``, ``value`` (base units) and one per
            extra label, sorted by node, entity, labels and time.

        Raises:
            TemporaryError: The server is unreachable or answered 429/5xx.
            PermanentError: The query was refused.
        """
        import pandas as pd

        if step_seconds is not None and step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds!r}")
        if entities is not None and not entities:
            return pd.DataFrame(columns=_BASE_COLUMNS)
        wanted = None if entities is None else {(str(e.node), str(e.entity)) for e in entities}
        rows: list[dict[str, Any]] = []
        label_keys: set[str] = set()
        for selector, spec in self._selectors(metric, entities):
            scale = spec.dcgm_scale if spec is not None else 1.0
            shift = 0.0
            if step_seconds is None:
                window = _duration(until_at - since_at + 0.001)
                data = self._get("/api/v1/query", {"query": f"{selector}[{window}]",
                                                   "time": f"{until_at:.3f}"})
            else:
                step = max(step_seconds, (until_at - since_at) / self.max_points)
                start = since_at - since_at % step
                # the value at t averages (t - step, t]: ask one step later, stamp t - step
                shift = step
                data = self._get("/api/v1/query_range", {
                    "query": f"avg_over_time({selector}[{_duration(step)}])",
                    "start": f"{start + step:.3f}", "end": f"{until_at + step:.3f}",
                    "step": _duration(step)})
            for series in data.get("result", []):
                node, entity, extra = self._identity(series.get("metric", {}), spec)
                if wanted is not None and (node, entity) not in wanted:
                    continue
                label_keys.update(extra)
                for at, value in series.get("values", []):
                    t = float(at) - shift
                    if t > until_at + 1e-9 or (shift == 0.0 and t < since_at - 1e-9):
                        continue
                    rows.append({"observed_at": t, "node": node, "entity": entity,
                                 "value": float(value) * scale, **extra})
        frame = pd.DataFrame.from_records(rows, columns=_BASE_COLUMNS + sorted(label_keys))
        if frame.empty:
            return frame
        order = ["node", "entity", *sorted(label_keys), "observed_at"]
        return frame.sort_values(order, kind="stable").reset_index(drop=True)

    def entities(self) -> Sequence[EntityRef]:
        """List (node, entity) pairs of gpuhealth series and, with ``dcgm``, of dcgm-exporter."""
        import time

        since = time.time() - self.entities_lookback_seconds
        params: list[tuple[str, Any]] = [("match[]", '{node!="",entity!=""}'),
                                         ("start", f"{since:.0f}")]
        if self.dcgm:
            params.append(("match[]", '{__name__=~"DCGM_FI_.*"}'))
        pairs: set[tuple[str, str]] = set()
        for labels in self._get("/api/v1/series", params):
            name = labels.get("__name__", "")
            spec = BY_DCGM.get(name) if name.startswith("DCGM_FI_") else None
            if name.startswith("DCGM_FI_") and spec is None:
                spec = MetricSpec(name=name, type=BY_NAME["gpu_info"].type, unit="1", help="")
            node, entity, _ = self._identity(labels, spec)
            if node and entity:
                pairs.add((node, entity))
        return [EntityRef(node=NodeName(n), entity=EntityId(e)) for n, e in sorted(pairs)]

    def close(self) -> None:
        """Close the HTTP client."""
        self._http.close()

    def __repr__(self) -> str:
        return f"PromqlStore(url={self.url!r}, dcgm={self.dcgm!r})"
