"""gpuhealth: observability and predictive failure analytics for GPU clusters."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("gpuhealth")
except metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0.0.0+unknown"
