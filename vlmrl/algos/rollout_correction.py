"""Rollout-training mismatch correction: importance weights of the trained policy over the sampler's.

The engine that samples (vLLM) and the actor that trains (FSDP) compute the
same policy with other kernels and precision and, under asynchronous training,
with older weights; the tokens are drawn from the behaviour policy ``mu`` (the
engine's log-probs) while the loss assumes the anchor policy ``pi`` (the old
log-probs of PPO, or the proximal policy of the decoupled loss). Per token::

    log r_t = log pi(y_t) - log mu(y_t)                     clamped to [-20, 20] before exp

and per level (``CorrectionLevel``), the ratio the mode acts on::

    token                 R_t = r_t
    sequence_product      R_i = exp( sum_t log r_t )           the sequence's own importance ratio
    sequence_geometric    R_i = exp( 1/|y_i| sum_t log r_t )   its per-token geometric mean (GSPO's length norm)

(a sequence ratio applies to each of the sequence's tokens). The modes
(``CorrectionMode``), with ``C = threshold`` and ``a = icepop_alpha``::

    none       w = 1                                         no correction (the ratio is still measured)
    truncate   w = min(R, C)                                 TIS (Yao et al. 2025; TRL's default, C = 2)
    mask       w = R if R <= C, else the token is dropped    MIS
    icepop     w = R if 1/a <= R <= a, else dropped          IcePop (Ling team, Ring-1T 2025)

and, whatever the mode, the veto (verl's ``rollout_token_veto_threshold``):
a sequence with any ``r_t < veto_threshold`` is dropped whole.

The weight is detached: it scales a token's gradient and never receives one.
It is folded into the advantages, as the decoupled loss does
(``algos.decoupled``): every registered policy loss is positively homogeneous
in ``A`` per token, so ``loss(w A) = w loss(A)``, and every loss type works
unchanged. A *dropped* token leaves the loss mask, so every aggregation mode
treats it exactly as padding: out of the token sums and out of the token
counts (``aggregate_loss`` on ``mask & keep``; the update's gradient
accumulation counts the kept tokens, ``run_epochs(mask_may_shrink=True)``).
A row left with no token counts as a row with no trained token always does.

Under the decoupled loss the anchor is the proximal policy: the correction is
then its behaviour weight (``pi_prox / pi_behav``), in place of
``behaviour_weight_cap`` / ``behaviour_weight_mode``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.algos.common import ConfigEnum, masked_mean, masked_sum
from vlmrl.algos.kl import KLEstimator, kl_penalty

# As in losses.py: log-ratios are clamped before exp so a wild token (or a long sequence's sum) cannot overflow.
_MAX_LOG_RATIO = 20.0


class CorrectionLevel(ConfigEnum):
    """Which ratio the correction acts on (``algorithm.rollout_correction.level``)."""

    token = "token"
    """Each token's own ratio ``pi / mu``."""
    sequence_product = "sequence_product"
    """The sequence's ratio: the product of its token ratios, on each of its tokens."""
    sequence_geometric = "sequence_geometric"
    """The geometric mean of the sequence's token ratios, on each of its tokens."""


class CorrectionMode(ConfigEnum):
    """What the correction does with the ratio (``algorithm.rollout_correction.mode``)."""

    none = "none"
    """Weight 1: no correction; the ratio is still measured and logged."""
    truncate = "truncate"
    """Truncated IS (TIS): weight ``min(ratio, threshold)``."""
    mask = "mask"
    """Masked IS (MIS): weight ``ratio``; a token (or sequence) with ratio above ``threshold`` is dropped."""
    icepop = "icepop"
    """IcePop: weight ``ratio``; a token (or sequence) with ratio outside ``[1/icepop_alpha, icepop_alpha]`` is
    dropped."""


@dataclass(frozen=True)
class CorrectionParams:
    """The knobs of the correction (``algorithm.rollout_correction``)."""

    mode: CorrectionMode = CorrectionMode.truncate
    level: CorrectionLevel = CorrectionLevel.token
    threshold: float = 2.0
    """``C`` of truncate and mask (> 1)."""
    icepop_alpha: float = 2.0
    """``a`` of icepop: the band ``[1/a, a]`` (> 1)."""
    veto_threshold: float | None = None
    """A sequence with any token ratio below this (in (0, 1)) is dropped whole; None: no veto."""

    @property
    def drops_tokens(self) -> bool:
        """Whether the correction can drop tokens (mask, icepop, the veto), so the loss's token count can shrink."""
        return CorrectionMode(self.mode) in (CorrectionMode.mask, CorrectionMode.icepop) or (
            self.veto_threshold is not None
        )

    def __post_init__(self):
        # The same bounds as validate/rollout_correction.py, for callers that build params by hand.
        if not self.threshold > 1.0:
            raise ValueError(f"threshold must be > 1 (a ratio of 1 is an on-policy token); got {self.threshold}")
        if not self.icepop_alpha > 1.0:
            raise ValueError(f"icepop_alpha must be > 1 (the band is [1/alpha, alpha]); got {self.icepop_alpha}")
        if self.veto_threshold is not None and not 0.0 < self.veto_threshold < 1.0:
            raise ValueError(f"veto_threshold must be in (0, 1) or None; got {self.veto_threshold}")


@dataclass(frozen=True)
class Correction:
    """What ``rollout_correction`` gives, each ``(bs, L)`` and detached."""

    weight: torch.Tensor
    """The weight to fold into the advantages; 0 on padding and on dropped tokens."""
    keep: torch.Tensor
    """bool: the response mask less the dropped tokens; the loss is aggregated over it."""
    ratio: torch.Tensor
    """The level's ratio on each valid token (a sequence's on each of its tokens); 0 on padding."""
    truncated: torch.Tensor
    """bool: valid tokens whose weight the truncation lowered."""
    masked: torch.Tensor
    """bool: valid tokens dropped by mask or icepop."""
    vetoed: torch.Tensor
    """bool: valid tokens of sequences the veto dropped."""


def token_log_ratio(
    anchor_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``(bs, L)``: ``log pi - log mu`` on valid tokens, 0 on padding (where either side may be -inf), detached."""
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=anchor_log_prob.dtype, device=anchor_log_prob.device)
    return torch.where(valid, anchor_log_prob.detach() - behaviour_log_prob.detach(), zero)


def rollout_correction(
    behaviour_log_prob: torch.Tensor,
    anchor_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    params: CorrectionParams,
) -> Correction:
    """The detached correction weights and the kept tokens (see the module docstring for the formulas).

    Args:
        behaviour_log_prob: ``(bs, L)`` the engine's log-probs of the sampled tokens.
        anchor_log_prob: ``(bs, L)`` the anchor policy's: the old log-probs, or the decoupled loss's proximal ones.
        response_mask: ``(bs, L)`` 1 on valid response tokens.
        params: mode, level and bounds.

    Returns:
        A ``Correction``. With every ratio 1 (and no veto) the weight is the mask and nothing is dropped.
    """
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=anchor_log_prob.dtype, device=anchor_log_prob.device)
    log_r = token_log_ratio(anchor_log_prob, behaviour_log_prob, response_mask)  # (bs, L)
    level = CorrectionLevel(params.level)
    if level is CorrectionLevel.token:
        log_level = log_r
    elif level is CorrectionLevel.sequence_product:
        log_level = log_r.sum(dim=-1, keepdim=True).expand_as(log_r)  # (bs, L)
    elif level is CorrectionLevel.sequence_geometric:
        log_level = masked_mean(log_r, valid, dim=-1)[:, None].expand_as(log_r)  # (bs, L)
    else:
        raise AssertionError(f"unhandled CorrectionLevel {level}")  # every enum value is handled above
    ratio = torch.where(valid, log_level.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp(), zero)  # (bs, L)
    nothing = torch.zeros_like(valid)
    mode = CorrectionMode(params.mode)
    truncated, masked = nothing, nothing
    if mode is CorrectionMode.none:
        weight = valid.to(ratio.dtype)
    elif mode is CorrectionMode.truncate:
        truncated = valid & (ratio > params.threshold)
        weight = ratio.clamp(max=params.threshold)
    elif mode is CorrectionMode.mask:
        masked = valid & (ratio > params.threshold)
        weight = ratio
    elif mode is CorrectionMode.icepop:
        a = params.icepop_alpha
        masked = valid & ((ratio < 1.0 / a) | (ratio > a))
        weight = ratio
    else:
        raise AssertionError(f"unhandled CorrectionMode {mode}")  # every enum value is handled above
    vetoed = nothing
    if params.veto_threshold is not None:
        # On the token ratios whatever the level: one token the sampler found far likelier than the trainer does.
        below = valid & (log_r < torch.log(torch.tensor(params.veto_threshold, dtype=log_r.dtype)))
        vetoed = valid & below.any(dim=-1, keepdim=True)
    keep = valid & ~masked & ~vetoed
    weight = torch.where(keep, weight, zero)
    return Correction(weight.detach(), keep, ratio.detach(), truncated, masked & ~vetoed, vetoed)


def correction_metrics(correction: Correction, response_mask: torch.Tensor, level: CorrectionLevel) -> dict[str, float]:
    """The ratio's mean, max and min and the shares of tokens and sequences that the correction changed.

    The ratio's statistics are over valid tokens at token level and over sequences (those with a valid token) at
    the sequence levels. A sequence counts as truncated or masked when any of its tokens is; a vetoed sequence
    counts as vetoed only (not also as masked).
    """
    valid = response_mask.bool()
    rows = valid.any(dim=-1)  # (bs,)
    if not bool(rows.any()):
        return {}
    if CorrectionLevel(level) is CorrectionLevel.token:
        values = correction.ratio[valid]
    else:
        values = masked_mean(correction.ratio, valid, dim=-1)[rows]  # the sequence's ratio, on each of its tokens
    values = values.double()
    metrics = {
        "mismatch/ratio_mean": values.mean().item(),
        "mismatch/ratio_max": values.max().item(),
        "mismatch/ratio_min": values.min().item(),
        "rollout_corr/weight_mean": masked_mean(correction.weight, correction.keep).item(),
    }
    n_tokens, n_rows = masked_sum(torch.ones_like(correction.ratio), valid).item(), float(rows.sum())
    changed = {"truncated": correction.truncated, "masked": correction.masked, "vetoed": correction.vetoed}
    for name, hit in changed.items():
        hit = hit & valid
        metrics[f"rollout_corr/{name}_token_frac"] = float(hit.sum()) / n_tokens
        metrics[f"rollout_corr/{name}_seq_frac"] = float(hit.any(dim=-1).sum()) / n_rows
    return metrics


def mismatch_kl(
    behaviour_log_prob: torch.Tensor, anchor_log_prob: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k1, k3)``, each ``(bs, L)`` and unmasked: per-token estimates of KL(mu || pi) on tokens sampled from mu.

    With ``r = pi / mu`` (Schulman, "Approximating KL Divergence", 2020)::

        k1 = -log r = log mu - log pi         unbiased, can be negative
        k3 = r - 1 - log r                    unbiased, never negative (log r clamped to [-20, 20])

    Reduce with ``masked_mean`` over the tokens of interest.
    """
    behav, anchor = behaviour_log_prob.detach(), anchor_log_prob.detach()
    return kl_penalty(behav, anchor, KLEstimator.kl), kl_penalty(behav, anchor, KLEstimator.low_var_kl)
