"""Single-turn batches made by hand, as the rollout worker makes them from an engine's samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.records import Batch, Media, PromptSample, Trajectory
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


def multi_turn(prompt: PromptSample, group_id: int, index: int, pieces: list[tuple[list[int], int]]) -> Trajectory:
    """A conversation made by hand: after ``prompt``, each piece is (tokens, loss mask) — model turns with mask
    1, text observations with mask 0 — positions counting on from the prompt's largest one, as text does."""
    p = len(prompt.input_ids)
    ids, mask, ends = list(prompt.input_ids), [0] * p, []
    for tokens, m in pieces:
        ids += tokens
        mask += [m] * len(tokens)
        if m:
            ends.append(len(ids) - 1)
    r = len(ids) - p
    start = int(prompt.position_ids.max()) + 1
    positions = torch.cat([prompt.position_ids.long(), (start + torch.arange(r)).expand(3, r)], dim=1)
    items = list(prompt.images)
    return Trajectory(
        token_ids=ids, prompt_length=p, loss_mask=mask, position_ids=positions, group_id=group_id,
        sample_id=f"{group_id}:{index}", temperature=1.0, versions=[-1] * p + [0 if m else -1 for m in mask[p:]],
        mm_inputs=prompt.mm_inputs, media=[Media("image", -1, x) for x in items], prompt_text=prompt.prompt_text,
        ground_truth=prompt.ground_truth, row_index=prompt.index, turn_ends=ends, turn_rewards=[0.0] * len(ends),
    )  # fmt: skip
