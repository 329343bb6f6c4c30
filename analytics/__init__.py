"""gpuhealth analytics package."""

from __future__ import annotations

