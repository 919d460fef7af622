"""Group-level decisions: DAPO's online filtering and the count of groups that teach nothing.

Groups are found by ``group_ids`` (the prompt each sample answers), never by
batch position.
"""

from __future__ import annotations

import torch

from vlmrl.algos.common import masked_sum


def _group_means(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``(bs,)``: the mean of ``values`` over each sample's group, in float64."""
    _, group_of, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.shape, dtype=torch.float64).index_add_(0, group_of, values.double())
    return (sums / counts)[group_of]


def online_filter_keep(values: torch.Tensor, group_ids: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476, eq. 11): keep a group only if
    its mean ``filter_key`` lies strictly inside ``(low, high)``.

    With an accuracy in [0, 1] and ``(0.01, 0.99)``, groups where every sample
    is right or every sample is wrong are dropped: their GRPO advantages are
    all 0, so they would only dilute the batch.

    Args:
        values: ``(bs,)`` each sample's ``filter_key`` reward (e.g. ``overall`` or ``accuracy``).
        group_ids: ``(bs,)`` int64.
        low, high: the open interval the group mean must fall in.

    Returns:
        ``(bs,)`` bool: whether each sample's group is kept.
    """
    if values.shape != group_ids.shape:
        raise ValueError(
            f"values and group_ids must both be (bs,); got {tuple(values.shape)} and {tuple(group_ids.shape)}"
        )
    mean = _group_means(values, group_ids)
    return (mean > low) & (mean < high)


def zero_advantage_groups(advantages: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor) -> int:
    """How many groups have advantage exactly 0 on every valid token of every sample.

    Such groups (all samples scored alike, under GRPO) contribute no policy
    gradient; DAPO's dynamic sampling exists to remove them.

    Args:
        advantages: ``(bs, L)``.
        response_mask: ``(bs, L)``.
        group_ids: ``(bs,)`` int64.

    Returns:
        The number of such groups.
    """
    nonzero = masked_sum((advantages != 0).float(), response_mask, dim=-1)  # (bs,) non-zero tokens per sample
    _, group_of, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    per_group = torch.zeros(counts.shape).index_add_(0, group_of, nonzero.float())  # (G,)
    return int((per_group == 0).sum())
