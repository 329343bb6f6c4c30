"""gpuhealth storage package."""

from __future__ import annotations

