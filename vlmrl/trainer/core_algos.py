"""The maths of GRPO-family training: advantages, KL estimators, the clipped
policy loss and its aggregation, and log-prob / entropy helpers.

Every function here is pure: tensors in, tensors out, no config, no state, no
distributed calls. Shapes use ``bs`` (sequences in the batch), ``L`` (padded
response length) and ``V`` (vocabulary size). Masks are ``(bs, L)`` tensors of
0/1 (bool or numeric); masked-out positions never influence a result, even if
they hold ``nan`` or ``inf``.

Extension points are plain registries keyed by the config enums:
``ADVANTAGE_ESTIMATORS`` and ``KL_ESTIMATORS``. Adding an estimator is one
function plus one enum value plus one registry entry.

The enum members are named exactly like their values (``grpo = "grpo"``)
because OmegaConf converts a YAML string to an Enum by member *name*.

Deliberate choices that differ from verl/EasyR1:

* A sequence's score is the sum of its rewards over *valid* response tokens,
  so a reward written into padding is ignored rather than counted.
* Group statistics are computed from ``group_ids`` with scatter ops, never
  from batch position, and in float64, so reordering the batch gives the same
  per-sample advantages.
* In the ``seq_mean_*`` loss modes every row counts as a sequence; a row
  with no valid token contributes 0 instead of ``nan``.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "AdvantageEstimator",
    "KLControllerType",
    "KLEstimator",
    "LossAvgMode",
    "PolicyLossType",
    "aggregate_loss",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "policy_loss_ppo_clip",
    "rloo_advantages",
]


class _ConfigEnum(StrEnum):
    """A str Enum whose error for an unknown value lists the valid ones."""

    @classmethod
    def _missing_(cls, value: object) -> _ConfigEnum:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; choose one of: {valid}")


class AdvantageEstimator(_ConfigEnum):
    """How per-sequence rewards become advantages (see ``ADVANTAGE_ESTIMATORS``)."""

    grpo = "grpo"
    """Group-normalised reward; ``norm_adv_by_std=False`` gives Dr.GRPO."""
    rloo = "rloo"
    """REINFORCE with a leave-one-out group baseline."""
    grpo_passk = "grpo_passk"
    """GRPO for pass@k: only the best sample of a group gets a positive advantage."""
    reinforce_plus_plus = "reinforce_plus_plus"
    """REINFORCE++: discounted token returns, whitened over the batch."""
    reinforce_plus_plus_baseline = "reinforce_plus_plus_baseline"
    """REINFORCE++ with the group mean subtracted before batch whitening."""
    remax = "remax"
    """ReMax: the reward of a greedy rollout of the same prompt is the baseline."""
    gae = "gae"
    """PPO's generalised advantage estimation with a learned critic."""


class LossAvgMode(_ConfigEnum):
    """How a ``(bs, L)`` per-token loss is reduced to a scalar (see ``aggregate_loss``)."""

    token_mean = "token_mean"
    seq_mean_token_mean = "seq_mean_token_mean"
    seq_mean_token_sum = "seq_mean_token_sum"
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"

    @classmethod
    def _missing_(cls, value: object) -> LossAvgMode:
        # EasyR1 spells the first two modes "token" and "seq"; its YAMLs load unchanged.
        aliases = {"token": cls.token_mean, "seq": cls.seq_mean_token_mean}
        if value in aliases:
            return aliases[value]
        return super()._missing_(value)


class PolicyLossType(_ConfigEnum):
    """The per-token policy objective (``worker.actor.loss_type``)."""

    default = "default"
    """PPO-clip with asymmetric (clip-higher) and dual clipping."""
    gspo = "gspo"
    """GSPO: a clipped sequence-level (length-normalised) importance ratio."""
    gspo_token = "gspo_token"
    """GSPO-token: the sequence ratio with per-token gradients."""
    cispo = "cispo"
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio."""
    sapo = "sapo"
    """SAPO: a smooth, temperature-controlled gate instead of a hard clip."""


class KLControllerType(_ConfigEnum):
    """How the coefficient of a KL penalty folded into the reward evolves (``algorithm.kl_type``)."""

    fixed = "fixed"
    adaptive = "adaptive"


class KLEstimator(_ConfigEnum):
    """Per-token estimator of KL(policy || reference) (see ``KL_ESTIMATORS``)."""

    kl = "kl"
    """k1: ``logp - ref``. Unbiased, high variance, can be negative."""
    abs = "abs"
    """``|logp - ref|``."""
    mse = "mse"
    """k2: ``0.5 * (logp - ref) ** 2``."""
    low_var_kl = "low_var_kl"
    """k3: ``exp(ref - logp) - (ref - logp) - 1``. Unbiased, non-negative."""
    full = "full"
    """Exact KL over the vocabulary; needs ``(bs, L, V)`` log-prob distributions."""


# --------------------------------------------------------------------------- masks


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set.

    Args:
        x: ``(bs, L)`` (any shape broadcastable with ``mask``).
        mask: ``(bs, L)`` 0/1 or bool.
        dim: reduce over this dim; ``None`` reduces over everything.

    Returns:
        A scalar if ``dim`` is None, else ``x`` reduced over ``dim`` (e.g. ``(bs,)``).
    """
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 where nothing is set.

    Args:
        x: ``(bs, L)``.
        mask: ``(bs, L)`` 0/1 or bool.
        dim: reduce over this dim; ``None`` reduces over everything.

    Returns:
        A scalar if ``dim`` is None, else ``x`` reduced over ``dim`` (e.g. ``(bs,)``).
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    # count is 0 or >= 1 for 0/1 masks; clamping keeps an empty selection at 0, not nan.
    return masked_sum(x, mask, dim) / count.clamp_min(1)


# --------------------------------------------------------------------------- advantages


def _check_advantage_inputs(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor
) -> None:
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            "token_level_rewards and response_mask must both be (bs, L); got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    if group_ids.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"group_ids must be (bs,) = ({token_level_rewards.shape[0]},); got {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor; got {group_ids.dtype}")


def _group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Size, mean and unbiased std of each sample's group, gathered back per sample.

    Args:
        scores: ``(bs,)`` float.
        group_ids: ``(bs,)`` int; equal ids form a group, wherever they sit.

    Returns:
        ``(count, mean, std)``, each ``(bs,)``. ``std`` is 0 for groups of size 1.
    """
    _, group_of, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # (bs,), (G,)
    counts = counts.to(scores.dtype)  # (G,)
    sums = scores.new_zeros(counts.shape).index_add_(0, group_of, scores)  # (G,)
    means = sums / counts  # (G,)
    sq_dev = scores.new_zeros(counts.shape).index_add_(0, group_of, (scores - means[group_of]).square())  # (G,)
    stds = (sq_dev / (counts - 1).clamp_min(1)).sqrt()  # (G,) Bessel-corrected like torch.std
    return counts[group_of], means[group_of], stds[group_of]


def _scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(bs, L) -> (bs,)`` float64 sequence scores (sum of rewards on valid tokens)."""
    return masked_sum(token_level_rewards.double(), response_mask, dim=-1)


def _broadcast(adv: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(bs,) -> (bs, L)``: the sequence value on valid tokens, 0 on padding."""
    adv = adv.to(dtype)[:, None].expand(response_mask.shape)
    return torch.where(response_mask.bool(), adv, torch.zeros((), dtype=dtype, device=adv.device))


def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath, eq. 3 / sec. 4.1.2).

    With ``s_i = sum_t r_{i,t}`` over the valid tokens of response ``i`` and
    ``G(i)`` the responses sharing ``i``'s group id::

        A_i = (s_i - mean_{G(i)} s) / (std_{G(i)} s + eps)   if norm_adv_by_std
        A_i =  s_i - mean_{G(i)} s                           otherwise (Dr.GRPO,
                                                              Liu et al. 2025, sec. 3.1)

    ``std`` is the unbiased (Bessel-corrected) std, as ``torch.std``. A group of
    one response follows verl's convention, mean 0 and std 1, so its advantage
    is its raw score (divided by ``1 + eps`` when normalising). A group whose
    scores are all equal gets advantage 0.

    Args:
        token_level_rewards: ``(bs, L)`` rewards; usually one non-zero at the last valid token.
        response_mask: ``(bs, L)`` 1 on valid response tokens.
        group_ids: ``(bs,)`` int64; responses to the same prompt share an id. Batch order is irrelevant.
        norm_adv_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std.

    Returns:
        ``(advantages, returns)``, both ``(bs, L)`` in the dtype of
        ``token_level_rewards``: ``A_i`` on every valid token of ``i``, 0 on
        padding. ``returns`` equals ``advantages`` (no value function).
    """
    _check_advantage_inputs(token_level_rewards, response_mask, group_ids)
    scores = _scores(token_level_rewards, response_mask)  # (bs,) float64
    count, mean, std = _group_stats(scores, group_ids)  # (bs,) each
    single = count == 1
    mean = mean.masked_fill(single, 0.0)
    adv = scores - mean  # (bs,)
    if norm_adv_by_std:
        adv = adv / (std.masked_fill(single, 1.0) + eps)
    adv = _broadcast(adv, response_mask, token_level_rewards.dtype)  # (bs, L)
    return adv, adv


def rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO advantages: REINFORCE with a leave-one-out baseline
    (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!";
    Ahmadian et al. 2024, eq. 6).

    With ``s_i`` the sum of valid-token rewards of response ``i`` and ``n`` the
    size of its group ``G(i)``::

        A_i = s_i - (sum_{j in G(i), j != i} s_j) / (n - 1)  =  n / (n - 1) * (s_i - mean_{G(i)} s)

    A group of one has no other sample to form a baseline; following verl its
    baseline is 0, so its advantage is its raw score.

    Args:
        token_level_rewards: ``(bs, L)``.
        response_mask: ``(bs, L)`` 1 on valid response tokens.
        group_ids: ``(bs,)`` int64; batch order is irrelevant.

    Returns:
        ``(advantages, returns)``, both ``(bs, L)``: ``A_i`` on valid tokens, 0 on
        padding; ``returns`` equals ``advantages``.
    """
    _check_advantage_inputs(token_level_rewards, response_mask, group_ids)
    scores = _scores(token_level_rewards, response_mask)  # (bs,) float64
    count, mean, _ = _group_stats(scores, group_ids)  # (bs,) each
    baseline = (count * mean - scores) / (count - 1).clamp_min(1)  # (bs,) mean of the others
    baseline = baseline.masked_fill(count == 1, 0.0)
    adv = _broadcast(scores - baseline, response_mask, token_level_rewards.dtype)  # (bs, L)
    return adv, adv


AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADVANTAGE_ESTIMATORS: dict[AdvantageEstimator, AdvantageFn] = {
    AdvantageEstimator.grpo: grpo_advantages,
    AdvantageEstimator.rloo: rloo_advantages,
}
"""Every estimator takes ``(token_level_rewards, response_mask, group_ids, **its_own_knobs)``."""


# --------------------------------------------------------------------------- KL


def _kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


def _kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


def _kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def _kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    # Clamp as verl does: exp of a large log-ratio overflows, and one wild token
    # (e.g. a token the reference model finds near-impossible) must not dominate.
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


def _kl_full(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    if logprob.dim() < 3 or logprob.shape != ref_logprob.shape:
        raise ValueError(
            "KLEstimator.full needs full-vocabulary log-probs of equal shape (bs, L, V); got "
            f"{tuple(logprob.shape)} and {tuple(ref_logprob.shape)}"
        )
    # sum_v p(v) (log p(v) - log q(v)); torch.xlogy-style guard: p(v) = 0 adds 0, not nan.
    p = logprob.exp()
    terms = torch.where(p > 0, p * (logprob - ref_logprob), torch.zeros((), dtype=p.dtype, device=p.device))
    return terms.sum(-1)


KL_ESTIMATORS: dict[KLEstimator, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    KLEstimator.kl: _kl_k1,
    KLEstimator.abs: _kl_abs,
    KLEstimator.mse: _kl_k2,
    KLEstimator.low_var_kl: _kl_k3,
    KLEstimator.full: _kl_full,
}


def kl_penalty(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: KLEstimator | str
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) at the sampled tokens.

    The k1/k2/k3 names follow John Schulman, "Approximating KL Divergence" (2020),
    with ``r = pi_ref(x) / pi(x)`` and ``x ~ pi``::

        kl          k1 = -log r             = logp - ref
        abs            = |log r|
        mse         k2 = 0.5 (log r)^2
        low_var_kl  k3 = r - 1 - log r      (log r clamped to [-20, 20], result to [-10, 10], as verl)
        full           = sum_v pi(v) (log pi(v) - log pi_ref(v))

    Args:
        logprob: ``(bs, L)`` policy log-probs of the sampled tokens; ``(bs, L, V)``
            log-prob distributions for ``full``.
        ref_logprob: same shape as ``logprob``, from the reference model.
        estimator: a ``KLEstimator`` or its string value.

    Returns:
        ``(bs, L)`` per-token KL estimate (unmasked; reduce with ``masked_mean``).
    """
    return KL_ESTIMATORS[KLEstimator(estimator)](logprob, ref_logprob)


# --------------------------------------------------------------------------- policy loss


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAvgMode | str,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    With ``m`` the mask, ``n_i = sum_t m_{i,t}`` and ``N = sum_i n_i``::

        token_mean               sum_{i,t} m l / N                    (DAPO, Yu et al. 2025, eq. 8)
        seq_mean_token_mean      1/bs sum_i (sum_t m l) / n_i         (GRPO paper, eq. 3)
        seq_mean_token_sum       1/bs sum_i  sum_t m l
        seq_mean_token_sum_norm  sum_{i,t} m l / (bs * norm_len)      (Dr.GRPO, Liu et al. 2025)

    Every one of the ``bs`` rows counts as a sequence; a row with ``n_i = 0``
    contributes 0. An all-zero mask gives 0.

    Args:
        loss_mat: ``(bs, L)`` per-token loss.
        mask: ``(bs, L)`` 1 on tokens that count.
        mode: a ``LossAvgMode`` or its string value.
        norm_len: the constant length for ``seq_mean_token_sum_norm`` (the max
            response length); ``None`` uses ``L``. Ignored by other modes.

    Returns:
        Scalar loss.
    """
    mode = LossAvgMode(mode)
    if mode is LossAvgMode.token_mean:
        return masked_mean(loss_mat, mask)
    if mode is LossAvgMode.seq_mean_token_mean:
        return masked_mean(loss_mat, mask, dim=-1).mean()  # (bs,) -> ()
    if mode is LossAvgMode.seq_mean_token_sum:
        return masked_sum(loss_mat, mask, dim=-1).mean()  # (bs,) -> ()
    if mode is LossAvgMode.seq_mean_token_sum_norm:
        norm_len = loss_mat.shape[-1] if norm_len is None else norm_len
        if norm_len <= 0:
            raise ValueError(f"norm_len must be positive; got {norm_len}")
        return masked_sum(loss_mat, mask) / (loss_mat.shape[0] * norm_len)
    raise AssertionError(f"unhandled LossAvgMode {mode}")  # every enum value is handled above


def policy_loss_ppo_clip(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float | None,
    loss_avg_mode: LossAvgMode | str,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss with asymmetric and dual clipping.

    With ``rho = exp(log_prob - old_log_prob)`` per token (the log-ratio is
    clamped to [-20, 20] so ``exp`` cannot overflow)::

        l_clip = max(-A rho, -A clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high))   PPO, Schulman et al. 2017, eq. 7
        l      = min(l_clip, -A clip_ratio_dual)  where A < 0                          Dual-clip PPO, Ye et al. 2020, eq. 5
        l      = l_clip                           elsewhere

    Separate low/high bounds give DAPO's clip-higher (Yu et al. 2025, sec. 3.1).
    The dual clip caps the loss of a negative-advantage token whose ratio has
    grown past ``clip_ratio_dual``, so one such token cannot blow up the update.

    Args:
        old_log_prob: ``(bs, L)`` log-probs under the rollout-time policy (no grad).
        log_prob: ``(bs, L)`` log-probs under the current policy.
        advantages: ``(bs, L)``.
        response_mask: ``(bs, L)`` 1 on valid response tokens.
        clip_ratio_low: ``eps_low``; the ratio's lower bound is ``1 - eps_low``.
        clip_ratio_high: ``eps_high``; the ratio's upper bound is ``1 + eps_high``.
        clip_ratio_dual: the dual-clip constant ``c > 1``, or ``None`` to disable.
        loss_avg_mode: how to reduce the per-token loss (see ``aggregate_loss``).
        norm_len: passed to ``aggregate_loss`` for ``seq_mean_token_sum_norm``.

    Returns:
        ``(loss, metrics)``: scalar loss, and detached scalar tensors (means over valid tokens):

        * ``pg_loss``: the loss value.
        * ``pg_clipfrac_higher``: share of tokens with ``A > 0`` and ``rho > 1 + eps_high`` (no gradient).
        * ``pg_clipfrac_lower``: share of tokens with ``A < 0`` and ``rho < 1 - eps_low`` (no gradient).
        * ``pg_clipfrac_dual``: share of tokens with ``A < 0`` held at the dual-clip cap (no gradient).
        * ``ppo_kl``: mean of ``old_log_prob - log_prob``, a k1 estimate of KL(old || new).
    """
    if clip_ratio_dual is not None and clip_ratio_dual <= 1.0:
        raise ValueError(f"clip_ratio_dual must be > 1 (Ye et al. 2020) or None; got {clip_ratio_dual}")

    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)  # (bs, L)
    ratio = log_ratio.exp()  # (bs, L)
    low, high = 1.0 - clip_ratio_low, 1.0 + clip_ratio_high

    loss_unclipped = -advantages * ratio  # (bs, L)
    loss_clipped = -advantages * ratio.clamp(low, high)  # (bs, L)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # (bs, L) pessimistic bound
    negative = advantages < 0  # (bs, L)
    if clip_ratio_dual is not None:
        dual_cap = -advantages * clip_ratio_dual  # (bs, L)
        dual_active = negative & (loss > dual_cap)  # (bs, L)
        loss = torch.where(dual_active, dual_cap, loss)
    else:
        dual_active = torch.zeros_like(negative)

    pg_loss = aggregate_loss(loss, response_mask, loss_avg_mode, norm_len)
    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac_higher": masked_mean(((advantages > 0) & (ratio > high)).float(), response_mask),
            "pg_clipfrac_lower": masked_mean((negative & (ratio < low)).float(), response_mask),
            "pg_clipfrac_dual": masked_mean(dual_active.float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return pg_loss, metrics


# --------------------------------------------------------------------------- logits

# Low-precision logits are upcast to float32 this many token rows at a time, so
# a (bs, L, V) float32 copy of a ~150k vocabulary never exists at once when no
# gradient is kept (reference and old-policy log-probs). With autograd on,
# backward stores each chunk anyway.
_FP32_CHUNK_TOKENS = 1024


def _rowwise_fp32(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *rows: torch.Tensor) -> torch.Tensor:
    """Apply ``fn(logits_2d_fp32, *rows_1d) -> (n,)`` to ``(..., V)`` logits, chunked
    when they must be upcast; returns float32 of shape ``logits.shape[:-1]``."""
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_rows = [r.reshape(-1) for r in rows]  # (N,) each
    if logits.dtype in (torch.float32, torch.float64):
        out = fn(flat, *flat_rows)
    else:
        out = torch.cat([
            fn(flat[i : i + _FP32_CHUNK_TOKENS].float(), *(r[i : i + _FP32_CHUNK_TOKENS] for r in flat_rows))
            for i in range(0, flat.shape[0], _FP32_CHUNK_TOKENS)
        ])
    return out.reshape(logits.shape[:-1])


# Both go through log_softmax, which subtracts the row max before exponentiating.
# The shorter z_y - logsumexp(z) and logsumexp(z) - sum_v p_v z_v subtract two
# numbers of the logits' magnitude and lose about |z| * 6e-8 in float32.


def _logprobs_2d(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def _entropy_2d(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    # p log p is taken as 0 where p = 0 (a -inf logit), not 0 * -inf = nan.
    plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=p.dtype, device=p.device))
    return -plogp.sum(-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the softmax of its logits.

    ``log p(y) = log_softmax(z)_y = (z_y - max z) - log sum_v exp(z_v - max z)``.
    bf16/fp16 logits are upcast to float32 in chunks of tokens.

    Args:
        logits: ``(bs, L, V)``.
        labels: ``(bs, L)`` int64 token ids.

    Returns:
        ``(bs, L)`` log-probs; float32 for low-precision logits, else the logits' dtype.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must be logits.shape[:-1] = {tuple(logits.shape[:-1])}; got {tuple(labels.shape)}")
    return _rowwise_fp32(_logprobs_2d, logits, labels)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution of each row of logits, in nats.

    ``H = -sum_v p_v log p_v`` with ``log p = log_softmax(z)`` (max-shifted, so
    stable for large logits) and ``p log p = 0`` where a logit is ``-inf``.
    bf16/fp16 logits are upcast to float32 in chunks of tokens.

    Args:
        logits: ``(..., V)``, e.g. ``(bs, L, V)``.

    Returns:
        ``(...)``, e.g. ``(bs, L)``; float32 for low-precision logits.
    """
    return _rowwise_fp32(_entropy_2d, logits)

