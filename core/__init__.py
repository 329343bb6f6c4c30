"""gpuhealth core package."""

from __future__ import annotations

