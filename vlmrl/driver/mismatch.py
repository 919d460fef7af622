"""The rollout-training mismatch as the step's metrics: the correction's ratio and what it changed, and the
behaviour-vs-training KL by turn, by images per sequence and by response length.

Computed on the driver from the finished batch (the engine's log-probs, and the old log-probs the update read or
gave back), so maxima and minima are over the whole batch rather than averaged over micro-batches. The maths is
``vlmrl.algos.rollout_correction``'s.
"""

from __future__ import annotations

import torch

from vlmrl import algos
from vlmrl.algos import CorrectionParams
from vlmrl.records import Batch
from vlmrl.train.actor import UpdateSettings

LENGTH_BUCKETS = 4
"""Response-length buckets: quarters of the response width (data.max_response_length)."""


def anchor_log_probs(batch: Batch, settings: UpdateSettings) -> torch.Tensor:
    """The log-probs the update's correction divides by the engine's: the old ones, or under
    ``proximal_log_probs=loglinear`` their interpolation (``settings`` at the step's version)."""
    if settings.loglinear and settings.policy_version is not None:
        v = settings.policy_version
        return algos.proximal_log_probs_loglinear(
            batch.rollout_log_probs, batch.old_log_probs, batch.policy_versions, v, v + 1
        )
    return batch.old_log_probs


def mismatch_metrics(batch: Batch, settings: UpdateSettings) -> dict[str, float]:
    """``mismatch/*`` (ratio, KL k1 and k3 overall and by split) and, with a correction stage,
    ``rollout_corr/*`` (weight, truncated / masked / vetoed shares); {} without the engine's log-probs."""
    if batch.rollout_log_probs is None or batch.old_log_probs is None:
        return {}
    mask = batch.response_mask.bool()
    if not bool(mask.any()):
        return {}
    behaviour, anchor = batch.rollout_log_probs, anchor_log_probs(batch, settings)
    params = settings.correction
    applied = params is not None
    if params is None:  # measured only: no correction stage (the decoupled loss's behaviour weight, or none)
        params = CorrectionParams(mode=algos.CorrectionMode.none)
    correction = algos.rollout_correction(behaviour, anchor, mask, params)
    metrics = algos.correction_metrics(correction, mask, params.level)
    if not applied:
        metrics = {k: v for k, v in metrics.items() if k.startswith("mismatch/")}
    k1, k3 = algos.mismatch_kl(behaviour, anchor)
    metrics["mismatch/kl_k1"] = algos.masked_mean(k1, mask).item()
    metrics["mismatch/kl_k3"] = algos.masked_mean(k3, mask).item()
    for split, where in _splits(batch).items():
        where = where & mask
        if bool(where.any()):
            metrics[f"mismatch/kl_k1/{split}"] = algos.masked_mean(k1, where).item()
            metrics[f"mismatch/kl_k3/{split}"] = algos.masked_mean(k3, where).item()
    return metrics


def _splits(batch: Batch) -> dict[str, torch.Tensor]:
    """``(B, R)`` bool selections by name: ``turn_{i}`` (multi-turn rows' model turns, from 0), ``images_0`` /
    ``images_1`` / ``images_2plus`` (images in the sequence), ``length_q{k}`` (trained tokens in the k-th quarter
    of the response width)."""
    shape = tuple(batch.response_mask.shape)
    out: dict[str, torch.Tensor] = {}
    width = shape[1]
    for row, t in enumerate(batch.trajectories):
        start = t.prompt_length
        for turn, end in enumerate(t.turn_ends):  # token indices of the sequence; response columns from the prompt
            lo, hi = max(start - t.prompt_length, 0), min(end + 1 - t.prompt_length, width)
            if hi > lo:
                out.setdefault(f"turn_{turn}", torch.zeros(shape, dtype=torch.bool))[row, lo:hi] = True
            start = end + 1
        images = sum(m.kind == "image" for m in t.media)
        name = "images_0" if images == 0 else "images_1" if images == 1 else "images_2plus"
        out.setdefault(name, torch.zeros(shape, dtype=torch.bool))[row] = True
    lengths = batch.response_mask.sum(dim=1)  # (B,)
    # Quarter k holds lengths in ((k-1) R/4, k R/4]: ceil(4 len / R), 1 to 4.
    quarter = (lengths * LENGTH_BUCKETS + width - 1).div(width, rounding_mode="floor").clamp(1, LENGTH_BUCKETS)
    for k in range(1, LENGTH_BUCKETS + 1):
        rows = quarter == k
        if bool(rows.any()):
            out[f"length_q{k}"] = rows[:, None].expand(shape).clone()
    return out
