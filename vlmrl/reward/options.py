"""The reward section's option values, kept free of heavy imports.

``vlmrl.config`` re-exports them; they live here so that a reward process
(``vlmrl.reward.sandbox``) can load a user's function without importing torch.
"""

from __future__ import annotations

import enum


class RewardManagerType(str, enum.Enum):
    """How the reward function is called (EasyR1's ``REWARD_TYPE``)."""

    sequential = "sequential"
    """``compute_score(reward_input: dict, **kwargs) -> dict``, once per response."""
    batch = "batch"
    """``compute_score(reward_inputs: list[dict], **kwargs) -> list[dict]``, once per step."""


class TimeoutPolicy(str, enum.Enum):
    """What a call that exceeds ``worker.reward.timeout`` gives."""

    error = "error"
    """The step fails with an error naming the sample."""
    zero = "zero"
    """The sample(s) of that call score 0 (overall and every sub-score), counted in ``reward/timeouts``."""
