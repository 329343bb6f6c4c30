"""Prometheus families from the metric catalog, for the stages' own ``Collector`` classes.

Each stage exports its metrics through a prometheus-client custom collector (``collect()``
yields families; ecosystem-reference §3.3) registered on the service's registry
(:meth:`gpuhealth.metrics.MetricsExporter.register`). :func:`family` builds one family
with the catalog's type, help and label names (``core/catalog.py``), so a name, unit or
label set is defined once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from core.catalog import BY_NAME, MetricType


def family(name: str, samples: Iterable[tuple[Mapping[str, str], float]]) -> Any:
    """One family of catalogued metric ``name`` with ``(labels, value)`` samples.

    Raises:
        KeyError: ``name`` is not in the catalog.
    """
    spec = BY_NAME[name]
    labels = list(spec.labels)
    made: Any = (CounterMetricFamily(name, spec.help, labels=labels)
                 if spec.type is MetricType.COUNTER
                 else GaugeMetricFamily(name, spec.help, labels=labels))
    for values, value in samples:
        made.add_metric([str(values.get(label, "")) for label in labels], float(value))
    return made
