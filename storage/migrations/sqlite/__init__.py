"""Versioned schema migrations (NNNN_name.sql), applied in order once per database."""

from __future__ import annotations
