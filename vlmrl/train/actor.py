"""The actor's passes over a batch: log-probs (old, reference) and the policy update.

Gradient accumulation is exact: each micro-batch's loss is weighted by its
share of the global mini-batch's aggregation weight (tokens for token_mean,
sequences otherwise), so (micro-batches, accumulation) gives the gradient of
(full batch, none), on one worker or many.

These functions take the model as an argument so the same forward serves the
actor and the frozen reference model. They run inside one worker on its shard
of the batch; FSDP makes the gradients of all workers agree.

Micro-batches are either a fixed number of samples of similar length or, with
dynamic batching, groups of samples under a token budget (``MicroBatching``).
Each forward runs on the padded micro-batch, less the columns that every row
pads, or, padding-free, on its real tokens packed into one row
(``vlmrl.train.packing``). FSDP gathers parameters on every forward, so
all ranks run the same number of micro-batches: with dynamic batching they
agree on the largest count any rank needs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.records import Batch
from vlmrl import algos
from vlmrl.algos import KLEstimator, LossAvgMode, PolicyLossParams, PolicyLossType
from vlmrl.train import packing
from vlmrl.train.partition import balanced_partition, parts_for_budget


def merged_mm_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """The micro-batch's image and video inputs, each key concatenated in sample order, as the model wants them.

    Samples may differ in what they have (text only, images, videos, both); a key
    is concatenated over the samples that have it.
    """
    keys = dict.fromkeys(key for mm in batch.mm_inputs for key in mm)
    return {key: torch.cat([mm[key] for mm in batch.mm_inputs if key in mm], dim=0) for key in keys}


@dataclass(frozen=True)
class MicroBatching:
    """How a worker's samples are grouped into forward passes."""

    micro_batch_size: int
    """Samples per pass (fixed micro-batches)."""
    max_token_len: int | None = None
    """Dynamic batching: the token budget of a pass (real tokens, prompt + response); None: fixed micro-batches."""
    padding_free: bool = False
    """Pack each micro-batch's real tokens into one row instead of running the padded layout."""

    def groups(self, batch: Batch) -> list[list[int]]:
        """Sample indices of each micro-batch; a collective (all ranks call it) with dynamic batching."""
        n = len(batch)
        lengths = batch.attention_mask.sum(dim=1).tolist()
        if self.max_token_len is None:
            # Rows of similar length share a micro-batch, so trimming the columns every row pads removes most
            # padding. Accumulation is exact, so grouping changes no result beyond float rounding.
            order = sorted(range(n), key=lambda i: lengths[i])
            return [order[i : i + self.micro_batch_size] for i in range(0, n, self.micro_batch_size)]
        parts = torch.tensor(parts_for_budget(lengths, self.max_token_len))
        if dist.is_available() and dist.is_initialized():
            parts = all_reduce(parts, dist.ReduceOp.MAX)
        return balanced_partition(lengths, int(parts))


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """``tensor`` reduced over all ranks, on CPU; NCCL only reduces CUDA tensors, so it travels there and back."""
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.cpu()


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def forward_response(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float,
    allowed_tokens: torch.Tensor,
    entropy_grad: bool = False,
    padding_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of the response tokens under ``model``.

    Returns ``(log_probs, entropy)``, each ``(b, R)``. The logits are divided by
    the sampling temperature and restricted to the tokens the rollout may
    sample, so they describe the distribution vLLM sampled from. The entropy
    carries a gradient only with ``entropy_grad`` (an entropy bonus in the loss).
    Padding-free, the values on response padding are 0; padded, the columns
    past every row's last response token are 0 (trimmed, see
    ``packing.trim``) and the others whatever the padding tokens give. Either
    way ``response_mask`` drops them.
    """
    device = _device(model)
    mm = {key: value.to(device) for key, value in merged_mm_inputs(batch).items()}
    inputs, layout = packing.model_inputs(batch, padding_free, device)
    if padding_free:
        # lm_head runs only where a logit predicts a response token.
        out = model(**inputs, use_cache=False, logits_to_keep=layout.logit_index.to(device), **mm)
        logits = out.logits[0].float() / temperature  # (K, V)
        targets = layout.targets.to(device)  # (K,)
    else:
        # Logits at positions P-1 .. P+r-2 predict the r kept response tokens.
        out = model(**inputs, use_cache=False, logits_to_keep=layout.responses.shape[1] + 1, **mm)
        logits = out.logits[:, :-1, :].float() / temperature  # (b, r, V)
        targets = layout.responses.to(device)  # (b, r)
    # finfo.min rather than -inf: masked entries then give p = 0 and p*log p = 0 in the entropy.
    logits = logits.masked_fill(~allowed_tokens.to(device), torch.finfo(logits.dtype).min)
    log_probs = algos.logprobs_from_logits(logits, targets)  # (b, R) or (K,)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = algos.entropy_from_logits(logits)  # (b, R) or (K,)
    shape = tuple(batch.responses.shape)
    if padding_free:
        log_probs, entropy = layout.unpack(log_probs, shape), layout.unpack(entropy, shape)
    elif log_probs.shape[1] < shape[1]:  # the trimmed response columns: padding in every row
        pad = (0, shape[1] - log_probs.shape[1])
        log_probs, entropy = torch.nn.functional.pad(log_probs, pad), torch.nn.functional.pad(entropy, pad)
    return log_probs, entropy


def computed_tokens(batch: Batch, padding_free: bool) -> int:
    """Token positions the model body runs for ``batch``: the real ones padding-free, else the trimmed layout."""
    return int(batch.attention_mask.sum()) if padding_free else packing.trim(batch).attention_mask.numel()


@dataclass
class TokenCount:
    """Real tokens against the token positions the model computed, over some passes."""

    real: int = 0
    computed: int = 0

    def add(self, batch: Batch, padding_free: bool) -> None:
        self.real += int(batch.attention_mask.sum())
        self.computed += computed_tokens(batch, padding_free)

    @property
    def padding_share(self) -> float:
        return 1.0 - self.real / self.computed if self.computed else 0.0


@torch.no_grad()
def compute_log_probs(
    model: torch.nn.Module,
    batch: Batch,
    batching: MicroBatching,
    temperature: float,
    allowed_tokens: torch.Tensor,
    tokens: TokenCount | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)``, each ``(B, R)``, micro-batch by micro-batch, in the batch's row order.

    ``tokens``, if given, counts the real and computed tokens of the passes.
    """
    log_probs = torch.zeros(batch.responses.shape)
    entropy = torch.zeros(batch.responses.shape)
    for rows in batching.groups(batch):
        mb = batch.select(rows)
        lp, ent = forward_response(model, mb, temperature, allowed_tokens, padding_free=batching.padding_free)
        log_probs[rows], entropy[rows] = lp.cpu(), ent.cpu()
        if tokens is not None:
            tokens.add(mb, batching.padding_free)
    return log_probs, entropy


@dataclass(frozen=True)
class UpdateSettings:
    """What one policy update does; built by the driver from the config and sent with each batch."""

    samples_per_update: int
    """Samples in one optimizer step on this worker."""
    micro_batch_size: int
    ppo_epochs: int
    loss_type: PolicyLossType
    loss_params: PolicyLossParams
    max_grad_norm: float
    entropy_coeff: float
    """Weight of the entropy bonus (subtracted from the loss); 0 for none."""
    use_kl_loss: bool
    kl_estimator: KLEstimator
    kl_coef: float
    temperature: float
    max_token_len: int | None = None
    """Dynamic batching: token budget of an update micro-batch; None: micro_batch_size samples."""
    padding_free: bool = False

    @property
    def batching(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_size, self.max_token_len, self.padding_free)

    @classmethod
    def from_config(cls, config: Config, plan: Plan) -> UpdateSettings:
        actor, algo = config.worker.actor, config.algorithm
        return cls(
            samples_per_update=plan.samples_per_update // plan.world_size,
            micro_batch_size=actor.micro_batch_size_per_device_for_update,
            ppo_epochs=actor.ppo_epochs,
            loss_type=actor.loss_type,
            loss_params=PolicyLossParams(
                clip_ratio_low=actor.clip_ratio_low,
                clip_ratio_high=actor.clip_ratio_high,
                clip_ratio_dual=actor.clip_ratio_dual,
                tau_positive=actor.tau_positive,
                tau_negative=actor.tau_negative,
                loss_avg_mode=actor.loss_avg_mode,
                norm_len=config.data.max_response_length,
            ),
            max_grad_norm=actor.max_grad_norm,
            entropy_coeff=actor.entropy_coeff,
            use_kl_loss=algo.use_kl_loss and not algo.disable_kl,
            kl_estimator=algo.kl_penalty,
            kl_coef=algo.kl_coef,
            temperature=config.worker.rollout.temperature,
            max_token_len=plan.update_token_budget,
            padding_free=actor.padding_free,
        )


def global_weight(mask: torch.Tensor, mode: LossAvgMode) -> tuple[torch.Tensor, int]:
    """``(sum of aggregation weights over every worker's mini-batch, world size)``.

    A micro-batch's loss scaled by ``world * weight(micro) / global`` makes the
    accumulated, FSDP-averaged gradient equal the gradient of the loss
    aggregated over the whole global mini-batch, ragged lengths included.
    """
    weight = algos.aggregation_weight(mask, mode)
    if dist.is_available() and dist.is_initialized():
        return all_reduce(weight, dist.ReduceOp.SUM), dist.get_world_size()
    return weight, 1


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


@dataclass
class ActorUpdate:
    """What a policy update returns."""

    metrics: dict[str, float]
    """Averaged over micro-batches (losses, clip fractions, KL, entropy) and optimizer steps (grad norm)."""
    log_probs: torch.Tensor | None = None
    """(B, R) on-policy update only: the log-probs of the update's forward, before the step (the old log-probs)."""
    entropy: torch.Tensor | None = None
    """(B, R) on-policy update only: their entropy."""


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    settings: UpdateSettings,
    allowed_tokens: torch.Tensor,
) -> ActorUpdate:
    """Policy-loss epochs over ``batch`` in mini-batches with gradient accumulation.

    The loss is the registered ``settings.loss_type`` policy loss, plus
    ``kl_coef`` x the KL to the reference (``use_kl_loss``), minus
    ``entropy_coeff`` x the entropy, each aggregated with ``loss_avg_mode``.

    A batch without ``old_log_probs`` gets exactly one update (one epoch, one
    mini-batch): the policy that sampled it is the one being updated, so each
    micro-batch's own log-probs, detached, are the old ones (ratio 1, the
    on-policy GRPO gradient) and no separate pass is needed. They are returned
    with their entropy for the step's metrics.
    """
    batch.require("advantages")
    on_policy = batch.old_log_probs is None
    if on_policy and (settings.ppo_epochs != 1 or len(batch) > settings.samples_per_update):
        raise RuntimeError(
            f"a batch of {len(batch)} samples without old log-probs needs exactly one update, but the settings make "
            f"{settings.ppo_epochs} epoch(s) of {settings.samples_per_update}-sample mini-batches; compute the old "
            "log-probs first (worker.actor.old_log_prob_pass=always)"
        )
    if settings.use_kl_loss:
        batch.require("ref_log_probs")
    own_log_probs = torch.zeros(batch.responses.shape) if on_policy else None
    own_entropy = torch.zeros(batch.responses.shape) if on_policy else None
    policy_loss = algos.POLICY_LOSSES[settings.loss_type]
    params = settings.loss_params
    mode, norm_len = params.loss_avg_mode, params.norm_len
    sums: dict[str, list[float]] = defaultdict(list)
    skipped = 0
    tokens = TokenCount()
    model.train()
    for _ in range(settings.ppo_epochs):
        for mini in batch.split(settings.samples_per_update):
            total, world = global_weight(mini.response_mask, mode)
            optimizer.zero_grad(set_to_none=True)
            for rows in settings.batching.groups(mini):
                mb = mini.select(rows)
                log_probs, entropy = forward_response(
                    model,
                    mb,
                    settings.temperature,
                    allowed_tokens,
                    entropy_grad=settings.entropy_coeff != 0,
                    padding_free=settings.padding_free,
                )
                tokens.add(mb, settings.padding_free)
                device = log_probs.device
                mask = mb.response_mask.to(device)
                if on_policy:  # one mini-batch: ``rows`` index ``batch`` itself
                    old_log_probs = log_probs.detach()
                    own_log_probs[rows], own_entropy[rows] = old_log_probs.cpu(), entropy.detach().cpu()
                else:
                    old_log_probs = mb.old_log_probs.to(device)
                advantages = mb.advantages.to(device)
                pg_loss, pg_metrics = policy_loss(old_log_probs, log_probs, advantages, mask, params)
                loss = pg_loss
                entropy_mean = algos.aggregate_loss(entropy, mask, mode, norm_len)
                if settings.entropy_coeff != 0:
                    loss = loss - settings.entropy_coeff * entropy_mean
                if settings.use_kl_loss:
                    kl = algos.kl_penalty(log_probs, mb.ref_log_probs.to(device), settings.kl_estimator)
                    kl_loss = algos.aggregate_loss(kl, mask, mode, norm_len)
                    loss = loss + settings.kl_coef * kl_loss
                    sums["actor/kl_loss"].append(kl_loss.item())
                (loss * (world * algos.aggregation_weight(mask, mode) / total.to(device))).backward()
                for key, value in pg_metrics.items():
                    sums[f"actor/{key}"].append(float(value))
                sums["actor/entropy"].append(algos.masked_mean(entropy.detach(), mask).item())
            grad_norm, stepped = clip_and_step(model, optimizer, settings.max_grad_norm)
            skipped += not stepped
            sums["actor/grad_norm"].append(grad_norm)
    metrics = {key: sum(values) / len(values) for key, values in sums.items()}
    metrics["actor/skipped_steps"] = float(skipped)
    metrics["actor/padding_share"] = tokens.padding_share
    metrics["actor/micro_batches"] = float(len(sums["actor/entropy"]))
    return ActorUpdate(metrics, own_log_probs, own_entropy)
