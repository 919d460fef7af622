"""Single-turn batches made by hand, as the rollout worker makes them from an engine's samples."""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.records import Batch, PromptSample, Trajectory
from vlmrl.records.views import to_batch


@dataclass
class Response:
    """One sampled response to ``prompt``, before it becomes a trajectory."""

    prompt: PromptSample
    group_id: int
    token_ids: list[int]
    text: str = ""
    log_probs: list[float] | None = None


def batch_of(
    responses: list[Response],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
    temperature: float = 1.0,
) -> Batch:
    """The padded view of ``responses``; each gets a sample id unique in the batch (the workers key rows by it)."""
    seen: dict[int, int] = {}
    trajectories = []
    for r in responses:
        index = seen.get(r.group_id, 0)
        seen[r.group_id] = index + 1
        trajectories.append(
            Trajectory.single_turn(r.prompt, r.group_id, index, r.token_ids, r.text, temperature, r.log_probs)
        )
    return to_batch(
        trajectories,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
        pad_token_id=pad_token_id,
    )
