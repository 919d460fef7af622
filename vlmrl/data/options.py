"""Transitional: the data section's option values now live in ``vlmrl.config.options``; import them from there."""

from __future__ import annotations

from vlmrl.config.options import BadSamplePolicy

__all__ = ["BadSamplePolicy"]
