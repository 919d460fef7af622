"""Policy and value losses, and how a per-token loss is reduced to a scalar.

Every policy loss is called as ``fn(old_log_prob, log_prob, advantages,
response_mask, params)`` with ``PolicyLossParams`` holding every knob, and
returns ``(loss, metrics)``: a scalar and detached scalar tensors. They are
registered in ``POLICY_LOSSES`` under ``PolicyLossType`` (``worker.actor.loss_type``).

The ratio-based losses follow EasyR1's choices: GSPO's ratios go through the
same asymmetric and dual clip as PPO's, and CISPO's weight is the ratio clipped
to ``[1 - clip_ratio_low, 1 + clip_ratio_high]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmrl.algos.common import ConfigEnum, masked_mean, masked_sum

# Log-ratios are clamped before exp so one wild token cannot overflow to inf.
_MAX_LOG_RATIO = 20.0


class LossAvgMode(ConfigEnum):
    """How a ``(bs, L)`` per-token loss is reduced to a scalar (see ``aggregate_loss``)."""

    token_mean = "token_mean"
    """Every trained token weighs the same (DAPO)."""
    seq_mean_token_mean = "seq_mean_token_mean"
    """Every row weighs the same: the mean of the rows' token means (GRPO)."""
    seq_mean_token_sum = "seq_mean_token_sum"
    """The mean of the rows' token sums."""
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"
    """The token sum over a constant: rows x the max response length (Dr.GRPO)."""
    per_rollout_mean = "per_rollout_mean"
    """Every rollout weighs the same, whatever its number of rows and tokens (an agent's rollout may span
    several rows); with one row per rollout, seq_mean_token_mean."""

    @classmethod
    def _missing_(cls, value: object) -> LossAvgMode:
        # EasyR1 spells the first two modes "token" and "seq"; its YAMLs load unchanged.
        aliases = {"token": cls.token_mean, "seq": cls.seq_mean_token_mean}
        if value in aliases:
            return aliases[value]
        return super()._missing_(value)


class PolicyLossType(ConfigEnum):
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


# --------------------------------------------------------------------------- aggregation


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAvgMode | str,
    norm_len: int | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    With ``m`` the mask, ``n_i = sum_t m_{i,t}``, ``N = sum_i n_i`` and ``s_i`` the row weights::

        token_mean               sum_{i,t} m l / N                    (DAPO, Yu et al. 2025, eq. 8)
        seq_mean_token_mean      1/bs sum_i (sum_t m l) / n_i         (GRPO paper, eq. 3)
        seq_mean_token_sum       1/bs sum_i  sum_t m l
        seq_mean_token_sum_norm  sum_{i,t} m l / (bs * norm_len)      (Dr.GRPO, Liu et al. 2025)
        per_rollout_mean         sum_i s_i (sum_t m l) / n_i  /  sum_i s_i

    Every one of the ``bs`` rows counts as a sequence; a row with ``n_i = 0``
    contributes 0. An all-zero mask gives 0.

    ``per_rollout_mean`` is for rollouts that span several rows (an external
    agent's calls, ``vlmrl.algos.rollout_credit``). ``s_i`` is row ``i``'s
    share of its rollout ``r``: ``n_i / N_r``, with ``N_r`` the trained tokens
    of all of ``r``'s rows (``rollout_credit.rollout_row_shares``), so a
    rollout's shares sum to 1. Over rows that hold whole rollouts, ``R`` of them::

        sum_{i in r} s_i (sum_t m l) / n_i = 1/N_r sum_{i in r, t} m l     the rollout's token mean
        sum_i s_i                          = R
        loss = 1/R sum_r 1/N_r sum_{i in r, t} m l                          the mean over rollouts

    whatever the number of rows and tokens of each rollout. A rollout whose rows
    fall into several mini-batches counts in each by its share of tokens there.
    With one row per rollout every ``s_i = 1`` and this is seq_mean_token_mean
    (``row_weights=None`` means that: each row is a rollout of its own).

    Args:
        loss_mat: ``(bs, L)`` per-token loss.
        mask: ``(bs, L)`` 1 on tokens that count.
        mode: a ``LossAvgMode`` or its string value.
        norm_len: the constant length for ``seq_mean_token_sum_norm`` (the max
            response length); ``None`` uses ``L``. Ignored by other modes.
        row_weights: ``(bs,)`` the ``s_i`` of ``per_rollout_mean``; ``None``: all 1.
            Ignored by other modes.

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
    if mode is LossAvgMode.per_rollout_mean:
        seq = masked_mean(loss_mat, mask, dim=-1)  # (bs,) each row's token mean
        if row_weights is None:
            return seq.mean()
        if row_weights.shape != seq.shape:
            raise ValueError(f"row_weights must be (bs,) = {tuple(seq.shape)}; got {tuple(row_weights.shape)}")
        w = row_weights.to(seq)  # (bs,)
        # Rows that are all share-0 (no trained token) give 0, not 0/0: the clamp never moves a real sum.
        return (seq * w).sum() / w.sum().clamp_min(torch.finfo(w.dtype).tiny)
    raise AssertionError(f"unhandled LossAvgMode {mode}")  # every enum value is handled above


def aggregation_weight(
    mask: torch.Tensor, mode: LossAvgMode | str, row_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """What ``aggregate_loss`` divides by, up to a constant: tokens for token_mean, the row weights'
    sum for per_rollout_mean, rows otherwise.

    A loss aggregated over a micro-batch and scaled by ``weight(micro) /
    weight(mini-batch)`` sums, over the micro-batches, to the loss aggregated
    over the whole mini-batch, so gradient accumulation reproduces the
    full-batch gradient exactly, ragged lengths included. For per_rollout_mean
    ``aggregate_loss(micro) * sum_{i in micro} s_i = sum_{i in micro} s_i (sum_t m l) / n_i``,
    a sum over rows, so the pieces add up when the ``s_i`` were computed over
    the whole mini-batch (or more) before it was split.

    Args:
        mask: ``(bs, L)``.
        mode: a ``LossAvgMode`` or its string value.
        row_weights: ``(bs,)`` per_rollout_mean's ``s_i`` (see ``aggregate_loss``); ``None``: all 1.

    Returns:
        A float scalar tensor.
    """
    mode = LossAvgMode(mode)
    if mode is LossAvgMode.token_mean:
        return mask.float().sum()
    if mode is LossAvgMode.per_rollout_mean and row_weights is not None:
        return row_weights.detach().double().sum().float()
    return torch.tensor(float(mask.shape[0]))


# --------------------------------------------------------------------------- policy losses


@dataclass(frozen=True)
class PolicyLossParams:
    """Every knob of every policy loss; each loss reads the ones it documents."""

    clip_ratio_low: float = 0.2
    """``eps_low``: the ratio's lower bound is ``1 - eps_low``."""
    clip_ratio_high: float = 0.3
    """``eps_high``: the ratio's upper bound is ``1 + eps_high`` (DAPO clip-higher when > eps_low)."""
    clip_ratio_dual: float | None = 3.0
    """Dual-clip constant ``c > 1`` for negative advantages, or None."""
    tau_positive: float = 1.0
    """SAPO gate temperature for tokens with ``A >= 0``."""
    tau_negative: float = 1.05
    """SAPO gate temperature for tokens with ``A < 0``."""
    loss_avg_mode: LossAvgMode = LossAvgMode.token_mean
    norm_len: int | None = None
    """The constant length of ``seq_mean_token_sum_norm`` (max response length)."""
    row_weights: torch.Tensor | None = None
    """``(bs,)`` per_rollout_mean: each row's share of its rollout (``aggregate_loss``); None: each row is a
    rollout. Not a knob: the update sets it per micro-batch, from the rows' ``Batch.rollout_shares``."""

    def __post_init__(self):
        if self.clip_ratio_dual is not None and self.clip_ratio_dual <= 1.0:
            raise ValueError(f"clip_ratio_dual must be > 1 (Ye et al. 2020) or None; got {self.clip_ratio_dual}")


PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossParams],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]


def _clipped_surrogate(
    log_ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO clipped surrogate on a (token or broadcast sequence) log-ratio; see ``policy_loss_ppo_clip``."""
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()  # (bs, L)
    low, high = 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high
    loss_unclipped = -advantages * ratio  # (bs, L)
    loss_clipped = -advantages * ratio.clamp(low, high)  # (bs, L)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # (bs, L) pessimistic bound
    negative = advantages < 0  # (bs, L)
    if params.clip_ratio_dual is not None:
        dual_cap = -advantages * params.clip_ratio_dual  # (bs, L)
        dual_active = negative & (loss > dual_cap)  # (bs, L)
        loss = torch.where(dual_active, dual_cap, loss)
    else:
        dual_active = torch.zeros_like(negative)
    pg_loss = aggregate_loss(loss, response_mask, params.loss_avg_mode, params.norm_len, params.row_weights)
    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac_higher": masked_mean(((advantages > 0) & (ratio > high)).float(), response_mask),
            "pg_clipfrac_lower": masked_mean((negative & (ratio < low)).float(), response_mask),
            "pg_clipfrac_dual": masked_mean(dual_active.float(), response_mask),
            "ppo_kl": masked_mean(-token_log_ratio, response_mask),
        }
    return pg_loss, metrics


def policy_loss_ppo_clip(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss with asymmetric and dual clipping (``loss_type=default``).

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
        params: clip_ratio_low/high/dual, loss_avg_mode, norm_len, row_weights.

    Returns:
        ``(loss, metrics)``: scalar loss, and detached scalar tensors (means over valid tokens):

        * ``pg_loss``: the loss value.
        * ``pg_clipfrac_higher``: share of tokens with ``A > 0`` and ``rho > 1 + eps_high`` (no gradient).
        * ``pg_clipfrac_lower``: share of tokens with ``A < 0`` and ``rho < 1 - eps_low`` (no gradient).
        * ``pg_clipfrac_dual``: share of tokens with ``A < 0`` held at the dual-clip cap (no gradient).
        * ``ppo_kl``: mean of ``old_log_prob - log_prob``, a k1 estimate of KL(old || new).
    """
    log_ratio = log_prob - old_log_prob  # (bs, L)
    return _clipped_surrogate(log_ratio, log_ratio, advantages, response_mask, params)


def _sequence_log_ratio(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``(bs,)``: ``1/|y_i| sum_t (log_prob - old_log_prob)``, GSPO's length-normalised log-ratio."""
    return masked_mean(log_prob - old_log_prob, response_mask, dim=-1)


def policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO at sequence level (Zheng et al. 2025, arXiv 2507.18071, eq. 5-7).

    One importance ratio per sequence, the geometric mean of its token ratios::

        s_i = exp( 1/|y_i| sum_t log(pi(y_t) / pi_old(y_t)) )

    ``s_i`` is placed on each valid token of ``i`` (gradients flow through the
    mean) and then clipped like PPO (``policy_loss_ppo_clip``) and reduced with
    ``loss_avg_mode``; ``seq_mean_token_mean`` gives the paper's
    ``1/G sum_i min(s_i A_i, clip(s_i) A_i)``. The paper's clip ranges are tiny
    (about 3e-4 / 4e-4) because ``s_i`` is length-normalised.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, L)``.
        params: clip_ratio_low/high/dual, loss_avg_mode, norm_len, row_weights.

    Returns:
        ``(loss, metrics)`` as ``policy_loss_ppo_clip`` (clip fractions count tokens).
    """
    seq = _sequence_log_ratio(old_log_prob, log_prob, response_mask)  # (bs,)
    log_ratio = seq[:, None].expand_as(log_prob)  # (bs, L)
    return _clipped_surrogate(log_ratio, log_prob - old_log_prob, advantages, response_mask, params)


def policy_loss_gspo_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025, eq. 13-14): the sequence ratio's value with per-token gradients.

    ::

        s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]

    equals ``s_i`` in value, and its gradient is ``s_i grad log pi(y_t)``, so a
    per-token advantage ``A_{i,t}`` weights each token's gradient. When every
    token of a sequence has the same advantage, this is GSPO exactly (value and
    gradient). Clipped and reduced like ``policy_loss_gspo``.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, L)``.
        params: clip_ratio_low/high/dual, loss_avg_mode, norm_len, row_weights.

    Returns:
        ``(loss, metrics)`` as ``policy_loss_ppo_clip``.
    """
    seq = _sequence_log_ratio(old_log_prob, log_prob, response_mask).detach()  # (bs,)
    log_ratio = seq[:, None] + log_prob - log_prob.detach()  # (bs, L)
    return _clipped_surrogate(log_ratio, log_prob - old_log_prob, advantages, response_mask, params)


def policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): REINFORCE with a clipped, detached IS weight.

    ::

        w = sg[ clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high) ]
        l = -w A log pi(y_t)

    Unlike PPO, no token loses its gradient: a clipped ratio only caps the
    weight. (The paper leaves the lower bound effectively open; set
    ``clip_ratio_low`` close to 1 for that.)

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, L)``.
        params: clip_ratio_low/high, loss_avg_mode, norm_len, row_weights.

    Returns:
        ``(loss, metrics)``: ``pg_loss``, ``ppo_kl``, and ``pg_clipfrac_higher`` /
        ``pg_clipfrac_lower``, the shares of tokens whose weight was capped above / below.
    """
    log_ratio = log_prob - old_log_prob  # (bs, L)
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    low, high = 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high
    weight = ratio.clamp(low, high).detach()  # (bs, L)
    loss = -advantages * weight * log_prob  # (bs, L)
    pg_loss = aggregate_loss(loss, response_mask, params.loss_avg_mode, params.norm_len, params.row_weights)
    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac_higher": masked_mean((ratio > high).float(), response_mask),
            "pg_clipfrac_lower": masked_mean((ratio < low).float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return pg_loss, metrics


def policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a sigmoid gate in place of the hard clip.

    ::

        f(rho) = 4 / tau * sigmoid(tau (rho - 1))       tau = tau_positive if A >= 0 else tau_negative
        l      = -A f(rho)

    ``d f / d log pi = 4 sigmoid(x) (1 - sigmoid(x)) rho`` with ``x = tau (rho - 1)``,
    which is ``rho`` (the unclipped PPO gradient) at ``rho = 1`` and fades
    smoothly as ``rho`` leaves 1, faster for larger ``tau``.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(bs, L)``.
        params: tau_positive, tau_negative, loss_avg_mode, norm_len, row_weights.

    Returns:
        ``(loss, metrics)``: ``pg_loss`` and ``ppo_kl``.
    """
    log_ratio = log_prob - old_log_prob  # (bs, L)
    ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    tau = torch.where(advantages >= 0, params.tau_positive, params.tau_negative).to(ratio.dtype)  # (bs, L)
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))  # (bs, L)
    loss = -advantages * gate  # (bs, L)
    pg_loss = aggregate_loss(loss, response_mask, params.loss_avg_mode, params.norm_len, params.row_weights)
    with torch.no_grad():
        metrics = {"pg_loss": pg_loss.detach(), "ppo_kl": masked_mean(-log_ratio, response_mask)}
    return pg_loss, metrics


POLICY_LOSSES: dict[PolicyLossType, PolicyLossFn] = {
    PolicyLossType.default: policy_loss_ppo_clip,
    PolicyLossType.gspo: policy_loss_gspo,
    PolicyLossType.gspo_token: policy_loss_gspo_token,
    PolicyLossType.cispo: policy_loss_cispo,
    PolicyLossType.sapo: policy_loss_sapo,
}
"""Every policy loss: ``fn(old_log_prob, log_prob, advantages, response_mask, params) -> (loss, metrics)``."""


# --------------------------------------------------------------------------- value loss


def value_loss_clipped(
    values_pred: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_avg_mode: LossAvgMode | str,
    norm_len: int | None = None,
    row_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (Schulman et al. 2017 as implemented in OpenAI baselines' ppo2).

    ::

        v_clip = old_values + clip(values_pred - old_values, -cliprange_value, cliprange_value)
        l      = 0.5 * max((values_pred - R)^2, (v_clip - R)^2)

    reduced with ``loss_avg_mode``. The max keeps the pessimistic term, so a
    prediction that moved further than ``cliprange_value`` gets no gradient
    pushing it further.

    Args:
        values_pred: ``(bs, L)`` current critic predictions.
        returns: ``(bs, L)`` regression targets (e.g. GAE returns).
        old_values: ``(bs, L)`` the critic's predictions when the batch was made.
        response_mask: ``(bs, L)``.
        cliprange_value: the clip range.
        loss_avg_mode, norm_len, row_weights: as ``aggregate_loss``.

    Returns:
        ``(loss, metrics)``: ``vf_loss``, ``vf_clipfrac`` (share of tokens where the
        clipped term is the larger) and ``vpred_mean``.
    """
    v_clip = old_values + (values_pred - old_values).clamp(-cliprange_value, cliprange_value)
    err = (values_pred - returns).square()  # (bs, L)
    err_clipped = (v_clip - returns).square()  # (bs, L)
    worst = torch.maximum(err, err_clipped)  # (bs, L)
    loss = 0.5 * aggregate_loss(worst, response_mask, loss_avg_mode, norm_len, row_weights)
    with torch.no_grad():
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": masked_mean((err_clipped > err).float(), response_mask),
            "vpred_mean": masked_mean(values_pred, response_mask),
        }
    return loss, metrics
