"""gpuhealth remediation package."""

from __future__ import annotations

