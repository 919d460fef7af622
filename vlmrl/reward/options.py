"""Transitional: the reward section's option values now live in ``vlmrl.config.options``; import them from there."""

from __future__ import annotations

from vlmrl.config.options import RewardManagerType, TimeoutPolicy

__all__ = ["RewardManagerType", "TimeoutPolicy"]
