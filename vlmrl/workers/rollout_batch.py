"""The driver's ``Batch`` from the slim trajectories a rollout call returns, whoever generated them.

Workers and rollout servers send trajectories without pixels or media (``Trajectory.slim``); the driver
holds the prompts', puts them back here, and pads the rows into one ``Batch``. ``WorkerGroup.generate``
(colocated engines) and ``RolloutPool.collect`` (rollout servers) both build their batches with these.
"""

from __future__ import annotations

import dataclasses

from vlmrl.config import Config
from vlmrl.records import Batch, PromptSample, Trajectory
from vlmrl.records.views import to_batch


def with_prompt_media(trajectory: Trajectory, prompt: PromptSample) -> Trajectory:
    """The trajectory with its prompt's media, when it was sent slim (its media are only its prompt's)."""
    if not trajectory.media_are_the_prompts:
        return trajectory
    full = dataclasses.replace(trajectory, mm_inputs=prompt.mm_inputs)
    return full.with_media(list(prompt.images) + list(prompt.videos))


def rollout_batch(trajectories: list[Trajectory], config: Config, pad_token_id: int) -> Batch:
    """The rows, padded to the run's prompt and response budgets."""
    data = config.data
    return to_batch(
        trajectories,
        max_prompt_length=data.max_prompt_length,
        max_response_length=data.max_response_length,
        pad_token_id=pad_token_id,
    )
