"""gpuhealth dashboards package."""

from __future__ import annotations

