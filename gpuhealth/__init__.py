"""gpuhealth gpuhealth package."""

from __future__ import annotations

