"""The registry of artifact parsers used by ``diagnose`` and ``replay``."""

from __future__ import annotations

import importlib

from collectors.artifact import ArtifactParser

PARSER_MODULES = (
    "collectors.kernel_log",
    "collectors.lspci_tree",
    "collectors.nvidia_smi",
    "collectors.dcgm",
    "collectors.dcgm_exporter",
    "collectors.nccl",
    "collectors.infiniband",
    "collectors.netdev",
    "collectors.bonding",
    "collectors.kube_node",
    "collectors.agent_log",
    "collectors.benchmark",
    "collectors.ib_exporter",
)
"""Modules whose ``PARSERS`` tuples are tried on every section."""


def artifact_parsers() -> tuple[ArtifactParser, ...]:
    """Return every registered artifact parser, in registry order."""
    found: list[ArtifactParser] = []
    for name in PARSER_MODULES:
        found.extend(importlib.import_module(name).PARSERS)
    return tuple(found)
