"""The reward when only a reward model is configured: its score of each response, as it is.

``worker.reward.reward_function`` left empty with ``worker.reward.reward_model.model_path``
set runs ``model_score``: a batch function, so the whole step goes to the model
in one request.
"""

from __future__ import annotations

REWARD_TYPE = "batch"
SPEC = "vlmrl.reward.model_reward:model_score"


def model_score(reward_inputs: list[dict], reward_model) -> list[dict]:
    """``overall`` is the reward model's score (a judge's parsed verdict, or a score model's scalar)."""
    return [{"overall": score} for score in reward_model.score(reward_inputs)]


def reward_spec(reward_function: str, model_path: str) -> str:
    """The reward function a run calls: the configured one, else ``model_score`` when a reward model is set."""
    return reward_function or (SPEC if model_path else "")
