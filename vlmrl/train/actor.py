"""The actor's passes over a batch: log-probs (old, reference) and the policy update.

The update runs in the shared loop of ``vlmrl.train.update_loop`` (exact
gradient accumulation), with the policy loss as its per-micro-batch loss.

These functions take the model as an argument so the same forward serves the
actor and the frozen reference model. They run inside one worker on its shard
of the batch; FSDP makes the gradients of all workers agree.

Micro-batches come from ``vlmrl.train.micro_batches``. Each forward runs on
the padded micro-batch, less the columns that every row pads, or,
padding-free, on its real tokens packed into one row (``vlmrl.train.packing``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vlmrl import algos
from vlmrl.algos import (
    CorrectionMode,
    CorrectionParams,
    DecoupledParams,
    KLEstimator,
    LossAvgMode,
    PolicyLossParams,
    PolicyLossType,
    ProximalLogProbs,
)
from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.records import Batch
from vlmrl.train import packing, shared_prompts, ulysses
from vlmrl.train.lr_schedule import LRSchedule
from vlmrl.train.micro_batches import MicroBatching, TokenCount, merged_mm_inputs
from vlmrl.train.update_loop import rollout_shares, run_epochs


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def forward_response(
    model: torch.nn.Module,
    batch: Batch,
    allowed_tokens: torch.Tensor,
    entropy_grad: bool = False,
    padding_free: bool = False,
    with_entropy: bool = True,
    share_prompts: bool = False,
    tokens: TokenCount | None = None,
    sequence: ulysses.SequenceGroup | None = None,
    router_losses: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy of the response tokens under ``model``.

    Returns ``(log_probs, entropy)``, each ``(b, R)``. The logits are divided by
    each row's own sampling temperature (``batch.temperatures``, the temperature
    of the call that sampled it) and restricted to the tokens the rollout may
    sample, so they describe the distribution vLLM sampled from. The entropy
    carries a gradient only with ``entropy_grad`` (an entropy bonus in the loss).
    Padding-free, the values on response padding are 0; padded, the columns
    past every row's last response token are 0 (trimmed, see
    ``packing.trim``) and the others whatever the padding tokens give. Either
    way ``response_mask`` drops them. ``with_entropy=False`` skips the entropy
    (None), for passes that discard it (the reference's). ``share_prompts``
    (padded only): each distinct prompt through the model once
    (``vlmrl.train.shared_prompts``). ``tokens``, if given, counts the pass's
    real and computed token positions. ``sequence`` (padding-free only): the
    Ulysses sequence-parallel group this rank runs the packed row with
    (``vlmrl.train.ulysses``, the model ``ulysses.install``-ed); the values
    come back whole on every rank of the group. ``router_losses``, if given (a mixture-of-experts model): the pass
    asks the model for its router's load-balancing loss over the real tokens, and appends it, with its gradient.
    """
    if sequence is not None and not padding_free:
        raise ValueError("Ulysses sequence parallelism splits packed rows: the pass must be padding-free")
    if router_losses is not None and share_prompts:
        raise ValueError("the router's load-balancing loss is not collected by the shared-prompt forward")
    router = {} if router_losses is None else {"output_router_logits": True}
    device = _device(model)
    inputs, layout = packing.model_inputs(batch, padding_free, device, packing.is_text_only(model))
    shared = None
    if share_prompts and not padding_free:
        prompt_columns = layout.input_ids.shape[1] - layout.responses.shape[1]
        shared = shared_prompts.find(batch, prompt_columns, shared_prompts.media_token_ids(model))
    if tokens is not None:
        if shared is None:
            tokens.add(batch, padding_free)
        else:
            tokens.add_counts(*shared_prompts.computed_tokens(layout, shared))
    if shared is not None:
        logits = shared_prompts.forward(model, inputs, batch.mm_inputs, shared, prompt_columns).float()  # (b, r, V)
        temperatures = batch.temperatures[:, None, None]  # (b, 1, 1)
        targets = layout.responses.to(device)  # (b, r)
    elif padding_free and sequence is not None:
        mm = {key: value.to(device) for key, value in merged_mm_inputs(batch).items()}
        inputs, shard = ulysses.split(inputs, layout.logit_index, sequence)
        keep = shard.keep
        with ulysses.sharded(model, shard):  # lm_head runs on this rank's share of the response logits
            out = model(**inputs, use_cache=False, logits_to_keep=shard.local_logit_index.to(device), **mm, **router)
        temperatures = batch.temperatures[layout.rows[keep]][:, None]  # (K_r, 1)
        logits = out.logits[0].float()  # (K_r, V)
        targets = layout.targets[keep].to(device)  # (K_r,)
    elif padding_free:
        mm = {key: value.to(device) for key, value in merged_mm_inputs(batch).items()}
        # lm_head runs only where a logit predicts a response token.
        out = model(**inputs, use_cache=False, logits_to_keep=layout.logit_index.to(device), **mm, **router)
        temperatures = batch.temperatures[layout.rows][:, None]  # (K, 1)
        logits = out.logits[0].float()  # (K, V)
        targets = layout.targets.to(device)  # (K,)
    else:
        mm = {key: value.to(device) for key, value in merged_mm_inputs(batch).items()}
        # Logits at positions P-1 .. P+r-2 predict the r kept response tokens. (Asking for exactly those r
        # positions would spare the backward a zeroed (b, r+1, V) gradient, but the lm_head's weight gradient
        # then sums its rows in another order: last-bit differences that change a seeded run's samples.)
        out = model(**inputs, use_cache=False, logits_to_keep=layout.responses.shape[1] + 1, **mm, **router)
        temperatures = batch.temperatures[:, None, None]  # (b, 1, 1)
        logits = out.logits[:, :-1, :].float()  # (b, r, V)
        targets = layout.responses.to(device)  # (b, r)
    if router_losses is not None:
        if getattr(out, "aux_loss", None) is None:  # validation refuses a dense family; a Hub id reaches here
            raise ValueError(
                f"worker.actor.router_aux_loss_coef > 0, but {type(model).__name__} returns no router load-balancing "
                "loss: it is no mixture-of-experts model; use worker.actor.router_aux_loss_coef=0"
            )
        router_losses.append(out.aux_loss)
    # Dividing by 1 changes no logit and would cost a (tokens, vocab) copy, and its backward another.
    if bool((temperatures != 1.0).any()):
        logits = logits / temperatures.to(device)
    # finfo.min rather than -inf: masked entries then give p = 0 and p*log p = 0 in the entropy.
    logits = logits.masked_fill(~allowed_tokens.to(device), torch.finfo(logits.dtype).min)
    entropy = None
    if with_entropy and not (entropy_grad and torch.is_grad_enabled()):
        # The entropy as a metric: one log-softmax for both, each (b, R) or (K,).
        log_probs, entropy = algos.logprobs_and_entropy(logits, targets)
    else:
        log_probs = algos.logprobs_from_logits(logits, targets)  # (b, R) or (K,)
        if with_entropy:  # an entropy term in the loss: its own log-softmax, with its gradient
            entropy = algos.entropy_from_logits(logits)
    shape = tuple(batch.responses.shape)
    if padding_free and sequence is not None:  # each rank's response tokens, joined over the group
        log_probs = ulysses.gather(log_probs, shard)
        entropy = None if entropy is None else ulysses.gather(entropy, shard)
    if padding_free:
        log_probs = layout.unpack(log_probs, shape)
        entropy = None if entropy is None else layout.unpack(entropy, shape)
    elif log_probs.shape[1] < shape[1]:  # the trimmed response columns: padding in every row
        pad = (0, shape[1] - log_probs.shape[1])
        log_probs = torch.nn.functional.pad(log_probs, pad)
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, pad)
    return log_probs, entropy


@torch.no_grad()
def compute_log_probs(
    model: torch.nn.Module,
    batch: Batch,
    batching: MicroBatching,
    allowed_tokens: torch.Tensor,
    tokens: TokenCount | None = None,
    with_entropy: bool = True,
    sequence: ulysses.SequenceGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs, entropy)``, each ``(B, R)``, micro-batch by micro-batch, in the batch's row order.

    ``tokens``, if given, counts the real and computed tokens of the passes.
    ``with_entropy=False``: no entropy (None). ``sequence``: the Ulysses group (``forward_response``).
    """
    log_probs = torch.zeros(batch.responses.shape)
    entropy = torch.zeros(batch.responses.shape) if with_entropy else None
    for rows in batching.groups(batch):
        mb = batch.select(rows)
        lp, ent = forward_response(
            model,
            mb,
            allowed_tokens,
            padding_free=batching.padding_free,
            with_entropy=with_entropy,
            share_prompts=batching.share_prompts,
            tokens=tokens,
            sequence=sequence,
        )
        log_probs[rows] = lp.cpu()
        if entropy is not None:
            entropy[rows] = ent.cpu()
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
    router_aux_loss_coef: float = 0.0
    """Weight of the router's load-balancing loss (mixture-of-experts models); 0 for none."""
    max_token_len: int | None = None
    """Dynamic batching: token budget of an update micro-batch; None: micro_batch_size samples."""
    padding_free: bool = False
    share_prompts: bool = False
    """Padded passes run each distinct prompt of a micro-batch once (``vlmrl.train.shared_prompts``)."""
    lr_schedule: LRSchedule | None = None
    """The learning rate of each update; None keeps the optimizer's (optim.lr)."""
    decoupled: DecoupledParams | None = None
    """The decoupled PPO loss (``use_decoupled_loss``): the behaviour weight's cap and mode; None for plain PPO."""
    proximal_log_probs: ProximalLogProbs = ProximalLogProbs.recompute
    """With ``decoupled``: the proximal log-probs are the batch's old ones (recompute), or each micro-batch's
    ``proximal_log_probs_loglinear`` of the behaviour log-probs and its own forward (loglinear)."""
    policy_version: int | None = None
    """loglinear: the policy version ``v`` of the weights at the start of this update (the proximal policy; the
    current one counts as ``v + 1``); the driver sets it per step (``at_version``)."""
    correction: CorrectionParams | None = None
    """The rollout correction (``algorithm.rollout_correction``, ``Plan.rollout_correction``): each token weighed
    by the anchor's (old or proximal) log-prob over the engine's, dropped tokens out of the loss; under the
    decoupled loss in place of its behaviour weight. None: no correction stage."""

    @property
    def loglinear(self) -> bool:
        """The decoupled loss's proximal log-probs are interpolated in the update (no old-log-prob pass)."""
        return self.decoupled is not None and self.proximal_log_probs == ProximalLogProbs.loglinear

    def at_version(self, version: int | None, batch: Batch) -> UpdateSettings:
        """These settings for an update of the weights at policy ``version``; loglinear needs it, others ignore it.

        ``None`` (the synchronous sampler tracks no version): the batch's newest token version, the weights that
        sampled it being the ones trained (they are synced after every update).
        """
        if not self.loglinear:
            return self
        if version is None:
            version = int(batch.policy_versions.max()) if batch.policy_versions.numel() else 0
        return dataclasses.replace(self, policy_version=version)

    @property
    def batching(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_size, self.max_token_len, self.padding_free, self.share_prompts)

    @classmethod
    def from_config(cls, config: Config, plan: Plan, training_steps: int | None = None) -> UpdateSettings:
        """``training_steps`` (the run's length, known once the data is loaded) gives the learning-rate schedule."""
        actor, algo = config.worker.actor, config.algorithm
        return cls(
            samples_per_update=plan.samples_per_update // ulysses.data_shards(plan.world_size, actor.ulysses_size),
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
            router_aux_loss_coef=actor.router_aux_loss_coef,
            use_kl_loss=plan.kl_in_loss,
            kl_estimator=algo.kl_penalty,
            kl_coef=algo.kl_coef,
            max_token_len=plan.update_token_budget,
            padding_free=actor.padding_free,
            share_prompts=actor.share_prompts,
            lr_schedule=None if training_steps is None else LRSchedule.from_optim(actor.optim, training_steps),
            decoupled=DecoupledParams(
                behaviour_weight_cap=actor.behaviour_weight_cap,
                behaviour_weight_mode=actor.behaviour_weight_mode,
                loss_type=actor.loss_type,
            )
            if plan.decoupled_loss
            else None,
            proximal_log_probs=actor.proximal_log_probs,
            correction=correction_params(config, plan),
        )


def correction_params(config: Config, plan: Plan) -> CorrectionParams | None:
    """``algorithm.rollout_correction`` with the plan's mode, or None when the plan runs no correction stage."""
    if plan.rollout_correction is None:
        return None
    rc = config.algorithm.rollout_correction
    return CorrectionParams(
        mode=CorrectionMode(plan.rollout_correction),
        level=rc.level,
        threshold=rc.threshold,
        icepop_alpha=rc.icepop_alpha,
        veto_threshold=rc.veto_threshold,
    )


@dataclass
class ActorUpdate:
    """What a policy update returns."""

    metrics: dict[str, float]
    """Averaged over micro-batches (losses, clip fractions, KL, entropy) and optimizer steps (grad norm)."""
    log_probs: torch.Tensor | None = None
    """(B, R) ``old_from_forward`` only: the log-probs of the update's forward, before the step (the old
    log-probs); loglinear over several mini-batches: each row's from its first epoch, so its mini-batch's
    weights, and the proximal log-probs are not these but the interpolation."""
    entropy: torch.Tensor | None = None
    """(B, R) ``old_from_forward`` only: their entropy."""


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    settings: UpdateSettings,
    allowed_tokens: torch.Tensor,
    old_from_forward: bool = False,
    sequence: ulysses.SequenceGroup | None = None,
) -> ActorUpdate:
    """Policy-loss epochs over ``batch`` in mini-batches with gradient accumulation.

    The loss is the registered ``settings.loss_type`` policy loss, plus
    ``kl_coef`` x the KL to the reference (``use_kl_loss``), minus
    ``entropy_coeff`` x the entropy, each aggregated with ``loss_avg_mode``,
    plus ``router_aux_loss_coef`` x the router's load-balancing loss of the
    micro-batch's forward (a mixture-of-experts model).

    ``old_from_forward`` (the driver's decision for this step): the batch gets
    exactly one update (one epoch, one mini-batch) by the policy that sampled
    it, so each micro-batch's own log-probs, detached, are the old ones (ratio
    1, the on-policy GRPO gradient) and no separate pass is needed. They are
    returned with their entropy for the step's metrics. Otherwise the batch
    must carry ``old_log_probs``.

    ``settings.loglinear`` (the decoupled loss with
    ``proximal_log_probs=loglinear``): the proximal log-probs are each
    micro-batch's ``proximal_log_probs_loglinear(rollout_log_probs, its own
    log-probs detached, policy_versions, v, v + 1)`` with ``v =
    settings.policy_version``, so a token sampled by version ``v`` gets its
    behaviour log-prob; any number of epochs and mini-batches. The batch's
    ``old_log_probs`` are not read, and ``old_from_forward`` (no pass ran) only
    asks for the forward's log-probs back, each row's from its first epoch.

    ``settings.correction`` (``algorithm.rollout_correction``): each micro-batch's
    ``rollout_correction(rollout_log_probs, old log-probs)``, with the old
    log-probs whichever of the above gave them (the proximal ones under the
    decoupled loss), weighs its advantages, and the tokens it drops leave the
    mask that every loss term is aggregated over (the behaviour weight of
    ``settings.decoupled`` is then not applied: the correction is it).

    ``loss_avg_mode=per_rollout_mean``: each row's share of its rollout is
    counted first over the rows of every worker (``update_loop.rollout_shares``,
    a collective) and travels with the rows into every micro-batch, whose
    losses weigh their rows by it.

    ``sequence`` (padding-free): the Ulysses group; its ranks hold the same
    ``batch`` and run each micro-batch's packed row together
    (``vlmrl.train.ulysses``).
    """
    batch.require("advantages")
    loglinear = settings.loglinear
    if loglinear and settings.policy_version is None:
        raise ValueError(
            "proximal_log_probs=loglinear needs UpdateSettings.policy_version, the version of the weights being "
            "trained (UpdateSettings.at_version)"
        )
    if old_from_forward and not loglinear and (settings.ppo_epochs != 1 or len(batch) > settings.samples_per_update):
        raise RuntimeError(
            f"a batch of {len(batch)} samples without old log-probs needs exactly one update, but the settings make "
            f"{settings.ppo_epochs} epoch(s) of {settings.samples_per_update}-sample mini-batches; compute the old "
            "log-probs first (worker.actor.old_log_prob_pass=always)"
        )
    if not old_from_forward and not loglinear:
        batch.require("old_log_probs")
    if settings.use_kl_loss:
        batch.require("ref_log_probs")
    if settings.decoupled is not None or settings.correction is not None:
        batch.require("rollout_log_probs")  # the behaviour policy's (vLLM's) log-probs
    own_log_probs = torch.zeros(batch.responses.shape) if old_from_forward else None
    own_entropy = torch.zeros(batch.responses.shape) if old_from_forward else None
    policy_loss = algos.POLICY_LOSSES[settings.loss_type]
    params = settings.loss_params
    mode, norm_len = params.loss_avg_mode, params.norm_len
    if mode is LossAvgMode.per_rollout_mean:  # a new Batch: the caller's is left as it was
        batch = dataclasses.replace(batch, rollout_shares=rollout_shares(batch))
    tokens = TokenCount()
    # Rows the micro-batches covered so far: run_epochs' first epoch visits the mini-batches in row order, each
    # one's micro-batches partitioning it, so a micro-batch's mini-batch starts at a multiple of samples_per_update.
    seen = 0

    def micro_loss(mb: Batch, rows: list[int], sums: dict[str, list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
        router_losses = [] if settings.router_aux_loss_coef else None
        log_probs, entropy = forward_response(
            model,
            mb,
            allowed_tokens,
            entropy_grad=settings.entropy_coeff != 0,
            padding_free=settings.padding_free,
            share_prompts=settings.share_prompts,
            tokens=tokens,
            sequence=sequence,
            router_losses=router_losses,
        )
        nonlocal seen
        device = log_probs.device
        mask = mb.response_mask.to(device)
        if old_from_forward and seen < len(batch):  # the first epoch: ``rows`` index the mini-batch
            start = seen // settings.samples_per_update * settings.samples_per_update
            index = [start + r for r in rows]
            own_log_probs[index], own_entropy[index] = log_probs.detach().cpu(), entropy.detach().cpu()
        seen += len(rows)
        if loglinear:  # the weights before this update are version v; this forward stands for v + 1
            v = settings.policy_version
            old_log_probs = algos.proximal_log_probs_loglinear(
                mb.rollout_log_probs.to(device), log_probs.detach(), mb.policy_versions.to(device), v, v + 1
            )
        elif old_from_forward:  # one mini-batch, one epoch
            old_log_probs = log_probs.detach()
        else:
            old_log_probs = mb.old_log_probs.to(device)
        row_weights = None if mb.rollout_shares is None else mb.rollout_shares.to(device)  # per_rollout_mean
        mb_params = params if row_weights is None else dataclasses.replace(params, row_weights=row_weights)
        loss_mask = mask
        if settings.correction is not None:  # old / behaviour folded into A; dropped tokens leave the loss like padding
            corr = algos.rollout_correction(mb.rollout_log_probs.to(device), old_log_probs, mask, settings.correction)
            loss_mask = corr.keep.to(mask.dtype)
            advantages = corr.weight * mb.advantages.to(device)
            pg_loss, pg_metrics = policy_loss(old_log_probs, log_probs, advantages, loss_mask, mb_params)
        elif settings.decoupled is None:
            pg_loss, pg_metrics = policy_loss(old_log_probs, log_probs, mb.advantages.to(device), mask, mb_params)
        else:  # the old log-probs are the proximal policy; the weight old / behaviour corrects for the sampler
            pg_loss, pg_metrics = algos.policy_loss_decoupled(
                mb.rollout_log_probs.to(device), old_log_probs, log_probs, mb.advantages.to(device), mask, mb_params,
                settings.decoupled,
            )  # fmt: skip
        loss = pg_loss
        entropy_mean = algos.aggregate_loss(entropy, loss_mask, mode, norm_len, row_weights)
        if settings.entropy_coeff != 0:
            loss = loss - settings.entropy_coeff * entropy_mean
        if settings.use_kl_loss:
            kl = algos.kl_penalty(log_probs, mb.ref_log_probs.to(device), settings.kl_estimator)
            kl_loss = algos.aggregate_loss(kl, loss_mask, mode, norm_len, row_weights)
            loss = loss + settings.kl_coef * kl_loss
            sums["actor/kl_loss"].append(kl_loss.item())
        if router_losses:
            # Scaled with the micro-batch's share like the other terms (run_epochs), so the step's gradient is
            # that of the micro-batches' loss averaged by their share of the mini-batch.
            loss = loss + settings.router_aux_loss_coef * router_losses[0]
            sums["actor/router_aux_loss"].append(router_losses[0].item())
        for key, value in pg_metrics.items():
            sums[f"actor/{key}"].append(float(value))
        sums["actor/entropy"].append(algos.masked_mean(entropy.detach(), mask).item())
        return loss, loss_mask

    sums, skipped = run_epochs(
        model,
        optimizer,
        batch,
        epochs=settings.ppo_epochs,
        samples_per_update=settings.samples_per_update,
        batching=settings.batching,
        mode=mode,
        max_grad_norm=settings.max_grad_norm,
        micro_loss=micro_loss,
        prefix="actor",
        mask_may_shrink=settings.correction is not None and settings.correction.drops_tokens,
    )
    metrics = {key: sum(values) / len(values) for key, values in sums.items()}
    metrics["actor/skipped_steps"] = float(skipped)
    metrics["actor/padding_share"] = tokens.padding_share
    metrics["actor/micro_batches"] = float(len(sums["actor/entropy"]))
    return ActorUpdate(metrics, own_log_probs, own_entropy)
