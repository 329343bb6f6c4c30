"""Artifact parsers: kernel_log (filled in by its owner)."""

from __future__ import annotations

from collectors.artifact import ArtifactParser

PARSERS: tuple[ArtifactParser, ...] = ()
