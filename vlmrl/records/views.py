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
    for t in trajectories:
        if t.prompt_length > max_prompt_length:
            raise ValueError(
                f"row {t.row_index}: prompt of {t.prompt_length} tokens exceeds "
                f"data.max_prompt_length={max_prompt_length}"
            )
    # One scatter per field over every row's kept tokens, rather than a few small copies per row: a step's
    # view is built on the driver and on every worker, and per-row tensor ops add up to tens of ms there.
    prompts = [t.prompt_length for t in trajectories]
    completions = [min(len(t.token_ids) - p, max_response_length) for t, p in zip(trajectories, prompts)]
    kept = torch.tensor([p + r for p, r in zip(prompts, completions)], dtype=torch.long)
    row, within = _rows_and_offsets(kept)
    col = torch.repeat_interleave(max_prompt_length - torch.tensor(prompts, dtype=torch.long), kept) + within
    tokens = [x for t, k in zip(trajectories, kept.tolist()) for x in t.token_ids[:k]]
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    input_ids[row, col] = torch.tensor(tokens, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    attention_mask[row, col] = 1
    position_ids = torch.zeros((n, 3, width), dtype=torch.long)
    if n:
        flat = torch.cat([t.position_ids[:, :k].long() for t, k in zip(trajectories, kept.tolist())], dim=1)
        position_ids[row, :, col] = flat.T
        # Past the last real token the positions count on from the largest one so far, as text would.
        last = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, row, flat.amax(dim=0), "amax")
        end = max_prompt_length + torch.tensor(completions, dtype=torch.long)  # (n,) first padding column
        columns = torch.arange(width)
        after = columns[None, :] >= end[:, None]  # (n, width)
        counted = last[:, None] + 1 + (columns[None, :] - end[:, None])
        position_ids = torch.where(after[:, None, :], counted[:, None, :], position_ids)
    # The per-token fields of the tokens after the prompt, in (B, R) response coordinates.
    r_row, r_col = _rows_and_offsets(torch.tensor(completions, dtype=torch.long))
    spans = [(p, p + r) for p, r in zip(prompts, completions)]
    response_mask = torch.zeros((n, max_response_length), dtype=torch.long)
    response_mask[r_row, r_col] = torch.tensor(
        [m for t, (lo, hi) in zip(trajectories, spans) for m in t.loss_mask[lo:hi]], dtype=torch.long
    )
    versions = torch.full((n, max_response_length), -1, dtype=torch.long)
    versions[r_row, r_col] = torch.tensor(
        [v for t, (lo, hi) in zip(trajectories, spans) for v in (t.versions[lo:hi] or [-1] * (hi - lo))],
        dtype=torch.long,
    )
    rollout_log_probs = None
    if n and all(t.log_probs is not None for t in trajectories):
        rollout_log_probs = torch.zeros((n, max_response_length))
        rollout_log_probs[r_row, r_col] = torch.tensor(
            [x for t, (lo, hi) in zip(trajectories, spans) for x in t.log_probs[lo:hi]], dtype=torch.float32
        )
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



def _rows_and_offsets(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of ``counts[i]`` items each: every item's row, and its index within the row.

    >>> _rows_and_offsets(torch.tensor([2, 0, 3]))
    (tensor([0, 0, 2, 2, 2]), tensor([0, 1, 0, 1, 2]))
    """
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return rows, torch.arange(int(counts.sum())) - starts
