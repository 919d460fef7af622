"""Turns sampled responses into a padded ``Batch`` the actor can run.

Prompts are left-padded to ``max_prompt_length`` and responses right-padded to
``max_response_length``, so batches from different workers have the same
width and concatenate. Positions are Qwen-VL's 3-D rotary ids: the prompt's come
from the dataset (``PromptSample.position_ids``, the positions vLLM uses too),
and the response continues one past the prompt's largest position, on all
three axes, as text does. A sample without positions (built by hand) gets them
from the model's own ``get_rope_index``, which agrees for images.
"""

from __future__ import annotations

import torch

from vlmrl.records import Batch
from vlmrl.rollout.vllm_engine import Generation


def _modality_types(input_ids: torch.Tensor, config) -> torch.Tensor:
    """(B, S) int: 0 text, 1 image token, 2 video token, as get_rope_index wants."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def rope_positions(model: torch.nn.Module, input_ids, attention_mask, mm_inputs: list[dict]) -> torch.Tensor:
    """(B, 3, S) rotary positions for a left/right padded batch."""
    grids = [mm["image_grid_thw"] for mm in mm_inputs if mm]
    image_grid_thw = torch.cat(grids) if grids else None
    position_ids, _ = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=_modality_types(input_ids, model.config),
        image_grid_thw=image_grid_thw,
        attention_mask=attention_mask,
    )
    return position_ids.transpose(0, 1).contiguous()  # (3, B, S) -> (B, 3, S)


def padded_positions(prompt_positions: torch.Tensor, max_prompt_length: int, max_response_length: int) -> torch.Tensor:
    """(3, P + R) positions of a left-padded prompt of positions ``prompt_positions`` (3, p) and its response.

    Padding gets 0, as ``get_rope_index`` gives it; the response's tokens are text,
    numbered on from the prompt's largest position.
    """
    out = torch.zeros((3, max_prompt_length + max_response_length), dtype=torch.long)
    p = prompt_positions.shape[1]
    out[:, max_prompt_length - p : max_prompt_length] = prompt_positions
    out[:, max_prompt_length:] = int(prompt_positions.max()) + 1 + torch.arange(max_response_length)
    return out


def build_batch(
    generations: list[Generation],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
    model: torch.nn.Module,
) -> Batch:
    n = len(generations)
    prompts = torch.full((n, max_prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, max_prompt_length), dtype=torch.long)
    responses = torch.full((n, max_response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((n, max_response_length), dtype=torch.long)
    want_log_probs = all(g.log_probs is not None for g in generations)
    rollout_log_probs = torch.zeros((n, max_response_length)) if want_log_probs else None
    for i, g in enumerate(generations):
        p = g.prompt.input_ids
        if len(p) > max_prompt_length:
            raise ValueError(
                f"row {g.prompt.index}: prompt of {len(p)} tokens exceeds data.max_prompt_length={max_prompt_length}"
            )
        prompts[i, max_prompt_length - len(p) :] = torch.tensor(p)
        prompt_mask[i, max_prompt_length - len(p) :] = 1
        r = g.token_ids[:max_response_length]
        responses[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_mask[i, : len(r)] = 1
        if rollout_log_probs is not None:
            rollout_log_probs[i, : len(r)] = torch.tensor(g.log_probs[: len(r)])
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    mm_inputs = [g.prompt.mm_inputs for g in generations]
    if all(g.prompt.position_ids is not None for g in generations):
        position_ids = torch.stack(
            [padded_positions(g.prompt.position_ids, max_prompt_length, max_response_length) for g in generations]
        )
    else:
        position_ids = rope_positions(model, input_ids, attention_mask, mm_inputs)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        responses=responses,
        response_mask=response_mask,
        group_ids=torch.tensor([g.group_id for g in generations], dtype=torch.long),
        mm_inputs=mm_inputs,
        response_texts=[g.text for g in generations],
        prompt_texts=[g.prompt.prompt_text for g in generations],
        ground_truths=[g.prompt.ground_truth for g in generations],
        data_sources=[g.prompt.data_source for g in generations],
        row_indices=[g.prompt.index for g in generations],
        images=[g.prompt.images for g in generations],
        extra_fields=[g.prompt.extra for g in generations],
        rollout_log_probs=rollout_log_probs,
    )
