"""Reward shaping and advantage normalisation as AReaL has them (``reward_scaling``, ``reward_bias``,
``reward_clip``; ``adv_norm`` with a mean level and a std level).

Both are off by default and then leave every number as it was. The reward is shaped before the KL penalty
and the estimator, the advantages are normalised after the estimator, so every estimator takes them:

* ``shape_rewards``: a sequence's score ``s`` becomes ``clip((s + bias) * scaling, -clip, clip)``; the
  difference is written at the row's last valid token, so the row's rewards still sum to its score.
* ``normalise_advantages``: ``A <- (A - mu) / (sigma + eps)``, where ``mu`` is taken over the row's group or
  the batch (or is 0) and ``sigma`` likewise (or is 1). As AReaL's, the statistics are over valid *tokens*,
  so a long response weighs more than a short one. With equal lengths the mean is the per-sequence mean, and
  the std differs from the per-sequence one only in Bessel's correction (``n L - 1`` tokens, not ``n - 1``).
"""

from __future__ import annotations

import torch

from vlmrl.algos.common import ConfigEnum, masked_sum


class NormLevel(ConfigEnum):
    """Over what a statistic of ``algorithm.adv_norm`` is taken."""

    none = "none"
    """No statistic: the mean is 0, the std 1."""
    group = "group"
    """Over the valid tokens of the rows that share the row's group id (the responses to one prompt)."""
    batch = "batch"
    """Over every valid token of the batch."""


def shape_scores(
    scores: torch.Tensor, scaling: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """``clip((s + bias) * scaling, -clip, clip)`` elementwise (AReaL's order: bias, then scale, then clip).

    Args:
        scores: ``(bs,)`` sequence scores.
        scaling, bias: as above.
        clip: the bound on ``|s'|``; None: no clipping.

    Returns:
        ``(bs,)`` in the dtype of ``scores``.
    """
    shaped = (scores + bias) * scaling
    return shaped if clip is None else shaped.clamp(-clip, clip)


def shape_rewards(
    token_level_scores: torch.Tensor,
    response_mask: torch.Tensor,
    scaling: float = 1.0,
    bias: float = 0.0,
    clip: float | None = None,
) -> torch.Tensor:
    """Token rewards whose per-row sum is ``shape_scores`` of the row's score.

    With ``s_i = sum_t r_{i,t}`` over valid tokens, the shaped row is ``r_i`` plus ``shape_scores(s_i) - s_i``
    at its last valid token: an outcome reward (the only non-zero at the last token) is simply shaped, and
    per-token rewards elsewhere in the row stay where they are. A row with no valid token is returned as is.

    Args:
        token_level_scores: ``(bs, L)``.
        response_mask: ``(bs, L)`` 1 on valid tokens.
        scaling, bias, clip: as ``shape_scores``.

    Returns:
        ``(bs, L)``, in the dtype of ``token_level_scores``.
    """
    valid = response_mask.bool()
    scores = masked_sum(token_level_scores.double(), valid, dim=-1)  # (bs,)
    delta = shape_scores(scores, scaling, bias, clip) - scores  # (bs,)
    positions = torch.arange(1, valid.shape[1] + 1, device=valid.device)  # (L,) 1-based so position 0 counts
    last = (valid * positions).argmax(dim=-1)  # (bs,) the last valid position
    delta = delta.masked_fill(~valid.any(dim=-1), 0.0)
    out = token_level_scores.double().clone()
    out[torch.arange(out.shape[0], device=out.device), last] += delta
    return out.to(token_level_scores.dtype)


def _level_stats(
    x: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor, level: NormLevel
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(mean, unbiased std)`` over the valid tokens of the row's group or of the batch, ``(bs, 1)`` each.

    A set of one valid token has std 0. ``level`` must be group or batch.
    """
    if level is NormLevel.batch:
        keys = torch.zeros_like(group_ids)
    else:
        keys = group_ids
    _, key_of = torch.unique(keys, return_inverse=True)  # (bs,) 0..K-1
    n_keys = int(key_of.max()) + 1 if key_of.numel() else 0
    w = valid.double()
    counts = x.new_zeros(n_keys).index_add_(0, key_of, w.sum(-1))  # (K,) valid tokens per set
    sums = x.new_zeros(n_keys).index_add_(0, key_of, (x * w).sum(-1))
    means = sums / counts.clamp_min(1)  # (K,)
    dev = ((x - means[key_of][:, None]) * w).square().sum(-1)  # (bs,)
    sq = x.new_zeros(n_keys).index_add_(0, key_of, dev)
    stds = (sq / (counts - 1).clamp_min(1)).sqrt()  # (K,) Bessel-corrected; 0 for one token
    return means[key_of][:, None], stds[key_of][:, None]


def normalise_advantages(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    mean_level: NormLevel = NormLevel.none,
    std_level: NormLevel = NormLevel.none,
    eps: float = 1e-6,
) -> torch.Tensor:
    """AReaL's advantage normalisation, applied to an estimator's advantages::

        A'_{i,t} = (A_{i,t} - mu_{m(i)}) / (sigma_{s(i)} + eps)

    ``mu`` is the mean of ``A`` over the valid tokens of row ``i``'s group (``mean_level=group``), of the batch
    (``batch``), or 0 (``none``); ``sigma`` is the unbiased std over the set ``std_level`` names, taken around
    that set's own mean, or 1 with no ``eps`` (``none``). Both none returns ``advantages`` itself.

    Args:
        advantages: ``(bs, L)``.
        response_mask: ``(bs, L)``.
        group_ids: ``(bs,)`` int; equal ids form a group, wherever they sit.
        mean_level, std_level: as above.
        eps: added to the std.

    Returns:
        ``(bs, L)`` in the dtype of ``advantages``, 0 on padding.
    """
    if mean_level is NormLevel.none and std_level is NormLevel.none:
        return advantages
    valid = response_mask.bool()
    x = advantages.double()
    out = x
    if mean_level is not NormLevel.none:
        mean, _ = _level_stats(x, valid, group_ids, mean_level)
        out = out - mean
    if std_level is not NormLevel.none:
        _, std = _level_stats(x, valid, group_ids, std_level)
        out = out / (std + eps)
    out = torch.where(valid, out, torch.zeros((), dtype=out.dtype))
    return out.to(advantages.dtype)
