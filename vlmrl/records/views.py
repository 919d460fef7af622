"""The padded view of a list of trajectories: the one place that lays trajectories out as tensors.

Each row is the trajectory's prompt, left-padded to ``max_prompt_length``,
then the tokens after it, right-padded to ``max_response_length``, so views
made on different workers have the same width and concatenate. The loss mask
of the tokens after the prompt becomes ``response_mask``; per-token log-probs
and policy versions land in the same ``(B, R)`` coordinates. Positions are the
trajectory's own; the padding after a row's last token continues from its
largest position on all three axes (padding is masked, so these only keep the
numbering the model has always seen). The packed view for padding-free passes
is made from this one (``vlmrl.train.packing``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlmrl.records.batch import Batch
from vlmrl.records.trajectory import Trajectory


def to_batch(
    trajectories: Sequence[Trajectory],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
) -> Batch:
    n = len(trajectories)
    width = max_prompt_length + max_response_length
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    position_ids = torch.zeros((n, 3, width), dtype=torch.long)
    response_mask = torch.zeros((n, max_response_length), dtype=torch.long)
    versions = torch.full((n, max_response_length), -1, dtype=torch.long)
    want_log_probs = n > 0 and all(t.log_probs is not None for t in trajectories)
    rollout_log_probs = torch.zeros((n, max_response_length)) if want_log_probs else None
    for i, t in enumerate(trajectories):
        p = t.prompt_length
        if p > max_prompt_length:
            raise ValueError(
                f"row {t.row_index}: prompt of {p} tokens exceeds data.max_prompt_length={max_prompt_length}"
            )
        tokens = torch.tensor(t.token_ids, dtype=torch.long)
        r = min(len(t.token_ids) - p, max_response_length)
        lo, hi = max_prompt_length - p, max_prompt_length + r
        input_ids[i, lo:hi] = tokens[: p + r]
        attention_mask[i, lo:hi] = 1
        position_ids[i, :, lo:hi] = t.position_ids[:, : p + r]
        # Past the last real token the positions count on from the largest one so far, as text would.
        last = int(t.position_ids[:, : p + r].max()) if p + r else -1
        position_ids[i, :, hi:] = last + 1 + torch.arange(width - hi)
        response_mask[i, :r] = torch.tensor(t.loss_mask[p : p + r], dtype=torch.long)
        if t.versions:
            versions[i, :r] = torch.tensor(t.versions[p : p + r], dtype=torch.long)
        if rollout_log_probs is not None:
            rollout_log_probs[i, :r] = torch.tensor(t.log_probs[p : p + r])
    return Batch(
        trajectories=list(trajectories),
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        responses=input_ids[:, max_prompt_length:].clone(),
        response_mask=response_mask,
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        # A greedy sample (temperature 0) is scored at temperature 1, the model's own distribution: the point
        # mass greedy decoding samples from has no log-probs to compare.
        temperatures=torch.tensor([t.temperature or 1.0 for t in trajectories], dtype=torch.float32),
        policy_versions=versions,
        rollout_log_probs=rollout_log_probs,
    )

