"""The actor's passes over a batch: log-probs (old, reference) and the policy update.

These functions take the model as an argument so the same forward serves the
actor and the frozen reference model. They run inside one worker on its shard
of the batch; FSDP makes the gradients of all workers agree.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from vlmrl.protocol import Batch
from vlmrl.trainer import core_algos
from vlmrl.trainer.core_algos import KLEstimator, LossAvgMode


def merged_mm_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """The micro-batch's image inputs concatenated in sample order, as the model wants them."""
    parts = [mm for mm in batch.mm_inputs if mm]
    if not parts:
        return {}
    return {key: torch.cat([mm[key] for mm in parts], dim=0) for key in parts[0]}


def forward_response(
    model: torch.nn.Module, batch: Batch, temperature: float, allowed_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of the response tokens under ``model``.

    Returns ``(log_probs, entropy)``, each ``(b, R)``. The logits are divided by
    the sampling temperature and restricted to the tokens the rollout may
    sample, so they describe the distribution vLLM sampled from.
    """
    response_length = batch.responses.shape[1]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids.transpose(0, 1),  # (3, b, S) as Qwen-VL expects
        use_cache=False,
        # Logits at positions P-1 .. P+R-2 predict the R response tokens.
        logits_to_keep=response_length + 1,
        **merged_mm_inputs(batch),
    )
    logits = out.logits[:, :-1, :].float() / temperature  # (b, R, V)
    # finfo.min rather than -inf: masked entries then give p = 0 and p*log p = 0 in the entropy.
    logits = logits.masked_fill(~allowed_tokens, torch.finfo(logits.dtype).min)
    log_probs = core_algos.logprobs_from_logits(logits, batch.responses)  # (b, R)
    with torch.no_grad():
        entropy = core_algos.entropy_from_logits(logits)  # (b, R)
    return log_probs, entropy


@torch.no_grad()
def compute_log_probs(
    model: torch.nn.Module, batch: Batch, micro_batch_size: int, temperature: float, allowed_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)``, each ``(B, R)``, micro-batch by micro-batch."""
    parts = [forward_response(model, mb, temperature, allowed_tokens) for mb in batch.split(micro_batch_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@dataclass(frozen=True)
class UpdateSettings:
    samples_per_update: int
    """Samples in one optimizer step on this worker."""
    micro_batch_size: int
    ppo_epochs: int
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_dual: float
    loss_avg_mode: LossAvgMode
    max_grad_norm: float
    use_kl_loss: bool
    kl_estimator: KLEstimator
    kl_coef: float
    temperature: float
    max_response_length: int


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    settings: UpdateSettings,
    allowed_tokens: torch.Tensor,
) -> dict[str, float]:
    """PPO-clip epochs over ``batch`` in mini-batches with gradient accumulation.

    Returns metrics averaged over micro-batches (losses, clip fractions, KL,
    entropy) and over optimizer steps (grad norm).
    """
    batch.require("old_log_probs", "advantages")
    if settings.use_kl_loss:
        batch.require("ref_log_probs")
    sums: dict[str, list[float]] = defaultdict(list)
    skipped = 0
    model.train()
    for _ in range(settings.ppo_epochs):
        for mini in batch.split(settings.samples_per_update):
            micro_batches = mini.split(settings.micro_batch_size)
            optimizer.zero_grad(set_to_none=True)
            for mb in micro_batches:
                log_probs, entropy = forward_response(model, mb, settings.temperature, allowed_tokens)
                mask = mb.response_mask
                pg_loss, pg_metrics = core_algos.policy_loss_ppo_clip(
                    mb.old_log_probs,
                    log_probs,
                    mb.advantages,
                    mask,
                    settings.clip_ratio_low,
                    settings.clip_ratio_high,
                    settings.clip_ratio_dual,
                    settings.loss_avg_mode,
                    norm_len=settings.max_response_length,
                )
                loss = pg_loss
                if settings.use_kl_loss:
                    kl = core_algos.kl_penalty(log_probs, mb.ref_log_probs, settings.kl_estimator)
                    kl_loss = core_algos.aggregate_loss(kl, mask, settings.loss_avg_mode, settings.max_response_length)
                    loss = loss + settings.kl_coef * kl_loss
                    sums["actor/kl_loss"].append(kl_loss.item())
                # Each micro-batch's loss is a mean over its own samples; dividing by
                # the count makes the accumulated gradient the mini-batch mean.
                (loss / len(micro_batches)).backward()
                for key, value in pg_metrics.items():
                    sums[f"actor/{key}"].append(float(value))
                sums["actor/entropy"].append(core_algos.masked_mean(entropy, mask).item())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                # A non-finite gradient would poison the weights; skip the step and say so.
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
            sums["actor/grad_norm"].append(float(grad_norm))
    metrics = {key: sum(values) / len(values) for key, values in sums.items()}
    metrics["actor/skipped_steps"] = float(skipped)
    return metrics
