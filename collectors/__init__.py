"""gpuhealth collectors package."""

from __future__ import annotations
