"""gpuhealth alerting package."""

from __future__ import annotations

