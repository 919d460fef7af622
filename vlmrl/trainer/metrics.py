"""Per-step metrics computed on the driver from a finished batch."""

from __future__ import annotations

import torch

from vlmrl.protocol import Batch
from vlmrl.trainer import core_algos


def reduce_reward_metrics(per_sample: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """The mean of each reward score over the samples, as ``<prefix>/<name>``."""
    return {f"{prefix}/{name}": sum(values) / len(values) for name, values in per_sample.items() if values}


def batch_metrics(batch: Batch, entropy: torch.Tensor) -> dict[str, float]:
    mask = batch.response_mask
    lengths = mask.sum(dim=1).float()
    metrics = {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": (lengths == mask.shape[1]).float().mean().item(),
        "actor/entropy_old": core_algos.masked_mean(entropy, mask).item(),
        "critic/advantages/mean": core_algos.masked_mean(batch.advantages, mask).item(),
        "critic/advantages/max": batch.advantages[mask.bool()].max().item(),
        "critic/advantages/min": batch.advantages[mask.bool()].min().item(),
    }
    if batch.ref_log_probs is not None:
        kl = core_algos.kl_penalty(batch.old_log_probs, batch.ref_log_probs, core_algos.KLEstimator.low_var_kl)
        metrics["actor/reference_kl"] = core_algos.masked_mean(kl, mask).item()
    if batch.rollout_log_probs is not None:
        # How far vLLM's view of the policy is from the actor's: a stale resync or a
        # numerics mismatch between the engines shows up here first.
        diff = (batch.rollout_log_probs - batch.old_log_probs).abs()
        metrics["rollout/log_prob_diff_mean"] = core_algos.masked_mean(diff, mask).item()
        metrics["rollout/log_prob_diff_max"] = diff[mask.bool()].max().item()
    return metrics
