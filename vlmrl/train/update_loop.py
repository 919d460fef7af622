"""The update loop the actor and the critic share: epochs over mini-batches, exact gradient accumulation.

Each micro-batch's loss is weighted by its share of the global mini-batch's
aggregation weight (tokens for token_mean, the rows' rollout shares for
per_rollout_mean, sequences otherwise), so (micro-batches, accumulation) gives
the gradient of (full batch, none), on one worker or many. A non-finite
gradient norm skips that optimizer step.

per_rollout_mean needs each row's share of its rollout counted over every row
of the update, whichever worker holds it: ``rollout_shares`` gathers the rows'
rollout ids and token counts from all workers once per update, before the
rows are cut into mini- and micro-batches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from vlmrl import algos
from vlmrl.algos import LossAvgMode
from vlmrl.algos.rollout_credit import rollout_row_shares
from vlmrl.records import Batch
from vlmrl.train.micro_batches import MicroBatching, all_reduce

MicroLoss = Callable[[Batch, list[int], dict[str, list[float]]], tuple[torch.Tensor, torch.Tensor]]
"""``(micro-batch, its rows in the mini-batch, metric lists) -> (loss, loss mask)``; appends its metrics."""


def global_weight(
    mask: torch.Tensor, mode: LossAvgMode, row_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """``(sum of aggregation weights over every worker's mini-batch, world size)``.

    A micro-batch's loss scaled by ``world * weight(micro) / global`` makes the
    accumulated, FSDP-averaged gradient equal the gradient of the loss
    aggregated over the whole global mini-batch, ragged lengths included.
    ``row_weights``: per_rollout_mean's rollout shares of this worker's rows.
    """
    weight = algos.aggregation_weight(mask, mode, row_weights)
    if dist.is_available() and dist.is_initialized():
        return all_reduce(weight, dist.ReduceOp.SUM), dist.get_world_size()
    return weight, 1


def rollout_shares(batch: Batch) -> torch.Tensor:
    """``(b,)`` float32: each row's share of its rollout over the rows of every worker; a collective.

    Every worker gathers all workers' ``(rollout id, trained tokens)`` per row,
    so a rollout whose rows were dealt to several workers is counted whole, and
    all workers compute the same shares (``rollout_credit.rollout_row_shares``).
    """
    mine = (batch.rollout_ids, batch.response_mask.sum(dim=1).tolist())
    if dist.is_available() and dist.is_initialized():
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        rank = dist.get_rank()
    else:
        parts, rank = [mine], 0
    shares = rollout_row_shares([i for ids, _ in parts for i in ids], [n for _, ns in parts for n in ns])
    start = sum(len(ids) for ids, _ in parts[:rank])
    return shares[start : start + len(batch)].float()


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> tuple[float, bool]:
    """Clip the gradients to ``max_grad_norm`` and step; a non-finite norm skips the step. Returns (norm, stepped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):
        optimizer.step()
        return float(grad_norm), True
    # A non-finite gradient would poison the weights; skip the step and say so.
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm), False


def _rescale_grads(model: torch.nn.Module, counted_before: torch.Tensor, kept: torch.Tensor) -> None:
    """Turn the gradient of ``sum_kept l / N_before`` into ``sum_kept l / N_kept``: every worker's kept tokens
    summed (a collective), and the gradients scaled by ``N_before / N_kept`` (none when nothing was kept)."""
    if dist.is_available() and dist.is_initialized():
        kept = all_reduce(kept.float(), dist.ReduceOp.SUM).double()
    if float(kept) <= 0 or float(kept) == float(counted_before):
        return
    scale = float(counted_before) / float(kept)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)


def run_epochs(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    *,
    epochs: int,
    samples_per_update: int,
    batching: MicroBatching,
    mode: LossAvgMode,
    max_grad_norm: float,
    micro_loss: MicroLoss,
    prefix: str,
    mask_may_shrink: bool = False,
) -> tuple[dict[str, list[float]], int]:
    """``epochs`` passes over ``batch`` in mini-batches of ``samples_per_update``, one optimizer step each.

    Returns the per-micro-batch metric lists (``<prefix>/grad_norm`` per
    optimizer step among them) and the number of skipped steps. With
    per_rollout_mean the batch carries ``rollout_shares`` (``rollout_shares``),
    and ``micro_loss`` must aggregate with the micro-batch's.

    ``mask_may_shrink``: ``micro_loss`` may return a loss mask with fewer tokens than the rows' response mask (the
    rollout correction drops tokens, known only once the micro-batch's forward ran). Under token_mean the
    mini-batch's token count is then counted as the micro-batches run, and the accumulated gradient rescaled by
    ``counted before / counted after`` before the step: the gradient of the loss over the kept tokens only.
    """
    if mode is LossAvgMode.per_rollout_mean:
        batch.require("rollout_shares")
    sums: dict[str, list[float]] = defaultdict(list)
    skipped = 0
    model.train()
    for _ in range(epochs):
        for mini in batch.split(samples_per_update):
            total, world = global_weight(mini.response_mask, mode, mini.rollout_shares)
            optimizer.zero_grad(set_to_none=True)
            # Only when the correction can drop tokens: counting them reads each micro-batch's weight back from
            # the device, a sync that the plain update does not pay.
            count_kept = mask_may_shrink and mode is LossAvgMode.token_mean
            kept = torch.zeros((), dtype=torch.float64)
            for rows in batching.groups(mini):
                micro = mini.select(rows)
                loss, mask = micro_loss(micro, rows, sums)
                device = loss.device
                weight = algos.aggregation_weight(mask, mode, micro.rollout_shares)
                if count_kept:
                    kept += weight.detach().double().cpu()
                (loss * (world * weight / total.to(device))).backward()
            if count_kept:
                _rescale_grads(model, total, kept)
            grad_norm, stepped = clip_and_step(model, optimizer, max_grad_norm)
            skipped += not stepped
            sums[f"{prefix}/grad_norm"].append(grad_norm)
    return sums, skipped
