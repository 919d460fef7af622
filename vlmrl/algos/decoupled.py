"""The decoupled PPO objective for off-policy (asynchronous) samples, and the log-linear proximal policy.

In asynchronous RL the policy that sampled a token (the *behaviour* policy,
vLLM's log-probs at version ``v_b``) may be several versions older than the
weights being trained. Decoupled PPO (Hilton et al. 2022, "Batch size-invariance
for policy optimization"; used by AReaL, Fu et al. 2025, arXiv 2505.24298,
eq. 5) separates the two jobs the old policy does in PPO::

    w   = sg[ pi_prox(y_t) / pi_behav(y_t) ]        importance weight, corrects for off-policy sampling
    rho = pi(y_t) / pi_prox(y_t)                     the trust-region ratio, clipped as usual
    l   = w * l_clip(rho, A)

The proximal policy is the weights before this update: its log-probs are
recomputed by a forward pass, or approximated log-linearly from the per-token
versions (``proximal_log_probs_loglinear``, AReaL's ``prox_logp_method=loglinear``).
With ``pi_prox = pi_behav`` the weight is 1 and this is plain PPO.

The weight can explode on a token the sampler found unlikely, so it is bounded
by ``behaviour_weight_cap`` (``BehaviourWeightMode``): truncated to the cap, or
the token is masked out of the numerator while the denominator of the loss
aggregation stays as it was (AReaL counts the loss mask before masking, so
masked tokens do not inflate the others' gradients).

How the weight composes with the policy losses: every loss in
``POLICY_LOSSES`` has the per-token form ``-A g(rho, sign A)``, positively
homogeneous in ``A``, so ``loss(w A) = w loss(A)`` token by token for ``w >= 0``
(the dual-clip cap ``-A c`` scales with ``A`` too). The weight is therefore
folded into the advantages and the registered loss is called unchanged, with
the original response mask, so every loss type and every ``LossAvgMode`` of
``aggregate_loss`` works on top of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.algos.common import ConfigEnum, masked_mean
from vlmrl.algos.kl import KLEstimator, kl_penalty
from vlmrl.algos.losses import POLICY_LOSSES, PolicyLossParams, PolicyLossType

# As in losses.py: log-ratios are clamped before exp so a wild token cannot overflow to inf.
_MAX_LOG_WEIGHT = 20.0


class BehaviourWeightMode(ConfigEnum):
    """How the importance weight ``pi_prox / pi_behav`` is bounded by ``behaviour_weight_cap``."""

    truncate = "truncate"
    """``w = min(w, cap)``: the token keeps its gradient, at most ``cap`` times (AReaL's ``token_truncate``)."""
    mask = "mask"
    """Tokens with ``w > cap`` get weight 0; the loss denominator is unchanged (AReaL's ``token_mask``)."""
    none = "none"
    """The raw weight, unbounded (log-weight clamped to [-20, 20] only so ``exp`` stays finite)."""


class ProximalLogProbs(ConfigEnum):
    """Where the decoupled loss's proximal log-probs come from (AReaL's ``prox_logp_method``)."""

    recompute = "recompute"
    """A no-grad forward over the batch with the weights before the update (the old-log-prob pass)."""
    loglinear = "loglinear"
    """No pass: ``proximal_log_probs_loglinear`` of the behaviour log-probs and the update's own forward, by each
    token's policy version."""


@dataclass(frozen=True)
class DecoupledParams:
    """The knobs of the behaviour correction; the clip knobs stay in ``PolicyLossParams``."""

    behaviour_weight_cap: float = 5.0
    """``c``: the bound on ``pi_prox / pi_behav`` (AReaL's former ``behave_imp_weight_cap`` default)."""
    behaviour_weight_mode: BehaviourWeightMode = BehaviourWeightMode.mask
    loss_type: PolicyLossType = PolicyLossType.default
    """The policy loss the weight is applied to (``POLICY_LOSSES``)."""

    def __post_init__(self):
        # A cap below 1 would down-weight (or, in mask mode, drop) tokens that are exactly on-policy.
        if self.behaviour_weight_cap < 1.0:
            raise ValueError(
                f"behaviour_weight_cap must be >= 1 (a weight of 1 is an on-policy token); "
                f"got {self.behaviour_weight_cap}"
            )


def behaviour_weight(
    behaviour_log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    params: DecoupledParams,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The detached importance weight ``pi_prox / pi_behav`` per token, bounded as ``params`` says.

    Args:
        behaviour_log_prob: ``(bs, L)`` the sampler's log-probs.
        proximal_log_prob: ``(bs, L)`` log-probs under the weights before this update.
        response_mask: ``(bs, L)``.
        params: behaviour_weight_cap, behaviour_weight_mode.

    Returns:
        ``(weight, raw, capped)``, each ``(bs, L)``: the weight to apply (0 on
        padding and on masked tokens), the unbounded weight (0 on padding), and
        whether the token's raw weight exceeded the cap (False in mode ``none``).
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=behaviour_log_prob.dtype, device=behaviour_log_prob.device)
    # Padding may hold -inf on both sides (nan difference); it is zeroed before exp so
    # no nan reaches the advantages and, from there, the backward pass.
    log_w = torch.where(valid, proximal_log_prob.detach() - behaviour_log_prob.detach(), zero)
    raw = torch.where(valid, log_w.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT).exp(), zero)
    cap = params.behaviour_weight_cap
    mode = BehaviourWeightMode(params.behaviour_weight_mode)
    if mode is BehaviourWeightMode.none:
        return raw, raw, torch.zeros_like(valid)
    capped = valid & (raw > cap)
    if mode is BehaviourWeightMode.truncate:
        return raw.clamp(max=cap), raw, capped
    if mode is BehaviourWeightMode.mask:
        return torch.where(capped, zero, raw), raw, capped
    raise AssertionError(f"unhandled BehaviourWeightMode {mode}")  # every enum value is handled above


def policy_loss_decoupled(
    behaviour_log_prob: torch.Tensor,
    proximal_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    params: PolicyLossParams,
    decoupled: DecoupledParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO: the policy loss anchored at the proximal policy, weighted by ``pi_prox / pi_behav``.

    ::

        w = bound( exp(proximal_log_prob - behaviour_log_prob) )     detached; bound per BehaviourWeightMode
        l = loss_type(old = proximal_log_prob, new = log_prob, advantages = w * A)
          = w * loss_type(proximal_log_prob, log_prob, A)               per token (see the module docstring)

    reduced by the loss type with ``params.loss_avg_mode`` over the full
    ``response_mask``: a masked token adds 0 to the numerator and still counts
    in the denominator. Neither ``behaviour_log_prob`` nor ``proximal_log_prob``
    receives a gradient; ``d l / d log_prob = w * d l_ppo / d log_prob``.

    Args:
        behaviour_log_prob: ``(bs, L)`` the sampler's (vLLM's) log-probs.
        proximal_log_prob: ``(bs, L)`` log-probs under the weights before this
            update, recomputed or from ``proximal_log_probs_loglinear``.
        log_prob: ``(bs, L)`` log-probs under the current policy (with grad).
        advantages: ``(bs, L)``.
        response_mask: ``(bs, L)`` 1 on valid response tokens.
        params: the clip knobs, loss_avg_mode and norm_len of the loss type.
        decoupled: the weight cap and mode, and which loss type.

    Returns:
        ``(loss, metrics)``: the loss type's metrics (``pg_loss``, clip shares,
        ``ppo_kl`` of current vs proximal; a masked token counts as unclipped
        there), and, over valid tokens:

        * ``behav_weight_mean``: mean of the applied weight (after the cap or mask).
        * ``behav_weight_max``: max of the raw weight (before the cap), the tail the cap guards against.
        * ``behav_weight_capped_frac``: share of tokens whose raw weight exceeded the cap
          (truncated or masked; 0 in mode ``none``).
        * ``behav_prox_kl``: the k3 estimate ``w - 1 - log w`` of KL(behaviour || proximal), on the
          raw weight. Unbiased because the tokens were sampled from the behaviour policy, and never negative.
    """
    weight, raw, capped = behaviour_weight(behaviour_log_prob, proximal_log_prob, response_mask, decoupled)
    loss_fn = POLICY_LOSSES[PolicyLossType(decoupled.loss_type)]
    loss, metrics = loss_fn(proximal_log_prob.detach(), log_prob, weight * advantages, response_mask, params)
    with torch.no_grad():
        valid = response_mask.bool()
        metrics = {
            **metrics,
            "behav_weight_mean": masked_mean(weight, valid),
            "behav_weight_max": raw.max() if raw.numel() else raw.new_zeros(()),  # raw is 0 on padding, w > 0
            "behav_weight_capped_frac": masked_mean(capped.float(), valid),
            # kl_penalty(logprob, ref) estimates KL(logprob's policy || ref's) with r = exp(ref - logprob) = w.
            "behav_prox_kl": masked_mean(
                kl_penalty(behaviour_log_prob.detach(), proximal_log_prob.detach(), KLEstimator.low_var_kl), valid
            ),
        }
    return loss, metrics


def proximal_log_probs_loglinear(
    behaviour_log_prob: torch.Tensor,
    current_log_prob: torch.Tensor,
    versions: torch.Tensor,
    proximal_version: int,
    current_version: int,
) -> torch.Tensor:
    """Approximate the proximal policy's log-probs without a forward pass (AReaL's ``prox_logp_method=loglinear``).

    Assume a token's log-prob moves linearly in log space with the policy
    version, from the behaviour policy (version ``v_b``, the token's own
    version) to the current policy (version ``v``). The proximal policy sits at
    version ``v_p`` in between::

        alpha     = clip( (v_p - v_b) / (v - v_b), 0, 1 )     0 where v <= v_b or v_b < 0 (context, padding)
        log p_prox = (1 - alpha) log p_behav + alpha log p_current

    A token sampled by the proximal weights (``v_b = v_p``) gets exactly its
    behaviour log-prob (weight 1). The result is detached: the proximal policy
    is a fixed anchor, and with ``current_log_prob`` carrying a gradient it
    would otherwise leak one into the clip's denominator. AReaL fixes
    ``v_p = v - 1``; here both versions are named by the caller.

    Args:
        behaviour_log_prob: ``(bs, L)``.
        current_log_prob: ``(bs, L)`` log-probs under the current policy.
        versions: ``(bs, L)`` the policy version that sampled each token, -1 on context and padding.
        proximal_version: ``v_p``, the version of the weights before this update.
        current_version: ``v``, the version of the current policy; must exceed ``v_p``.

    Returns:
        ``(bs, L)`` proximal log-probs, detached, in ``behaviour_log_prob``'s dtype.
    """
    if current_version <= proximal_version:
        raise ValueError(
            f"current_version ({current_version}) must be greater than proximal_version ({proximal_version}): "
            "the proximal policy is the weights before the update that produces the current one"
        )
    v_b = versions.to(torch.float64)
    span = current_version - v_b  # (bs, L)
    interpolate = (versions >= 0) & (span > 0)
    # span is replaced by 1 where it is not used, so no division by zero happens even in the dead branch.
    alpha = torch.where(interpolate, (proximal_version - v_b) / torch.where(interpolate, span, 1.0), 0.0)
    alpha = alpha.clamp(0.0, 1.0).to(behaviour_log_prob.dtype)
    behav = behaviour_log_prob.detach()
    # Where alpha is 0 the behaviour log-prob is returned as it is, so -inf padding stays -inf, not nan.
    return torch.where(alpha > 0, behav + alpha * (current_log_prob.detach() - behav), behav)
