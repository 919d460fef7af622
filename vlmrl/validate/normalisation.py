"""``algorithm.reward_scaling``, ``reward_bias``, ``reward_clip`` and ``adv_norm``: their values, and the one
setting of adv_norm that contradicts ``norm_adv_by_std_in_grpo``."""

from __future__ import annotations

import math

from vlmrl.algos import AdvantageEstimator, NormLevel
from vlmrl.config import Config

__all__ = ["normalisation_problems"]

_DIVIDES_BY_GROUP_STD = (AdvantageEstimator.grpo, AdvantageEstimator.grpo_passk)


def normalisation_problems(config: Config) -> list[str]:
    algo = config.algorithm
    problems = []
    if not (math.isfinite(algo.reward_scaling) and algo.reward_scaling > 0):
        problems.append(
            f"algorithm.reward_scaling={algo.reward_scaling}: must be a finite number above 0 (0 or a negative "
            "scale would erase or invert the reward); 1.0 leaves the reward as it is"
        )
    if not math.isfinite(algo.reward_bias):
        problems.append(f"algorithm.reward_bias={algo.reward_bias}: must be finite; 0.0 adds nothing")
    if algo.reward_clip is not None and not algo.reward_clip > 0:
        problems.append(
            f"algorithm.reward_clip={algo.reward_clip}: must be above 0 (the shaped reward is clipped to "
            "[-reward_clip, reward_clip]); e.g. 20.0 as AReaL, or null for no clipping"
        )
    std_level = algo.adv_norm.std_level
    if algo.adv_estimator in _DIVIDES_BY_GROUP_STD and algo.norm_adv_by_std_in_grpo and std_level != NormLevel.none:
        problems.append(
            f"algorithm.adv_norm.std_level={std_level.value} with algorithm.norm_adv_by_std_in_grpo=true: "
            f"{algo.adv_estimator.value} already divides its advantages by the group std, and adv_norm would "
            "divide them again; set algorithm.norm_adv_by_std_in_grpo=false to divide by the "
            f"{std_level.value} std alone, or algorithm.adv_norm.std_level=none to keep GRPO's"
        )
    return problems
