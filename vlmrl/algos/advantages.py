"""Advantage estimators: how rewards (and, for GAE, values) become per-token advantages.

Every estimator is called as ``fn(token_level_rewards, response_mask,
group_ids, **kwargs)`` and returns ``(advantages, returns)``, both ``(bs, L)``
in the dtype of the rewards and 0 on padding. ``ADVANTAGE_ESTIMATORS`` maps
each ``AdvantageEstimator`` to an ``EstimatorSpec`` that also says what the
estimator needs from the trainer (groups, a critic, a greedy baseline) and
which config knobs it takes, so the trainer never tests an estimator's name.

Deliberate choices that differ from verl/EasyR1:

* A sequence's score is the sum of its rewards over *valid* response tokens,
  so a reward written into padding is ignored rather than counted.
* Group statistics come from ``group_ids`` with scatter ops, never from batch
  position, and in float64, so reordering the batch gives the same per-sample
  advantages.
* GAE follows each row's own mask (EasyR1 tests ``response_mask[:, t]`` for
  the whole batch at once, which only works for a batch of one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from vlmrl.algos.common import ConfigEnum, masked_sum, masked_whiten


class AdvantageEstimator(ConfigEnum):
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


# --------------------------------------------------------------------------- helpers


def _check_inputs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor) -> None:
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            "token_level_rewards and response_mask must both be (bs, L); got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    if group_ids.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"group_ids must be (bs,) = ({token_level_rewards.shape[0]},); got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor; got {group_ids.dtype}")


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group_of, counts)``: each sample's group as 0..G-1 ``(bs,)``, and each group's size ``(G,)``."""
    _, group_of, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return group_of, counts


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Size, mean and unbiased std of each sample's group, gathered back per sample.

    Args:
        scores: ``(bs,)`` float.
        group_ids: ``(bs,)`` int; equal ids form a group, wherever they sit.

    Returns:
        ``(count, mean, std)``, each ``(bs,)``. ``std`` is 0 for groups of size 1.
    """
    group_of, counts = _group_index(group_ids)  # (bs,), (G,)
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
    return _zero_padding(adv, response_mask)


def _zero_padding(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma G_{t+1}`` over each row's valid tokens (padding skipped), ``(bs, L)``, 0 on padding."""
    valid = response_mask.bool()
    running = rewards.new_zeros(rewards.shape[0])  # (bs,)
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):  # a recursion over time, vectorised over the batch
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return _zero_padding(returns, response_mask)


# --------------------------------------------------------------------------- estimators


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
        ``(advantages, returns)``, both ``(bs, L)``: ``A_i`` on every valid token
        of ``i``, 0 on padding. ``returns`` equals ``advantages`` (no value function).
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = _scores(token_level_rewards, response_mask)  # (bs,) float64
    count, mean, std = _group_stats(scores, group_ids)  # (bs,) each
    single = count == 1
    adv = scores - mean.masked_fill(single, 0.0)  # (bs,)
    if norm_adv_by_std:
        adv = adv / (std.masked_fill(single, 1.0) + eps)
    adv = _broadcast(adv, response_mask, token_level_rewards.dtype)  # (bs, L)
    return adv, adv


def grpo_passk_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k (Chen et al. 2025, "Pass@k Training", arXiv 2503.19595 as cited by verl).

    Only the best response of each group is credited, by its margin over the
    runner-up; every other response gets 0::

        A_best = (s_max - s_second) / (std_G s + eps)   if norm_adv_by_std
        A_best =  s_max - s_second                      otherwise
        A_i    = 0                                      for the rest

    With tied best scores the margin is 0, so which tied sample counts as "best"
    does not matter. A group of one has no runner-up and gets 0.

    Args:
        token_level_rewards: ``(bs, L)``.
        response_mask: ``(bs, L)``.
        group_ids: ``(bs,)`` int64; batch order is irrelevant.
        norm_adv_by_std: divide the margin by the group's unbiased std.
        eps: added to the std.

    Returns:
        ``(advantages, returns)``, both ``(bs, L)``, equal.
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = _scores(token_level_rewards, response_mask)  # (bs,)
    group_of, counts = _group_index(group_ids)  # (bs,), (G,)
    n_groups, bs = counts.numel(), scores.numel()
    neg_inf = scores.new_full((n_groups,), float("-inf"))
    best_score = neg_inf.scatter_reduce(0, group_of, scores, "amax")  # (G,)
    position = torch.arange(bs, device=scores.device)  # (bs,)
    # One best sample per group: the first in batch order among those at the max.
    at_max = torch.where(scores == best_score[group_of], position, bs)  # (bs,)
    first_best = torch.full((n_groups,), bs, device=scores.device).scatter_reduce(0, group_of, at_max, "amin")
    is_best = position == first_best[group_of]  # (bs,)
    runner_up = neg_inf.scatter_reduce(0, group_of, scores.masked_fill(is_best, float("-inf")), "amax")  # (G,)
    margin = (best_score - runner_up).masked_fill(counts == 1, 0.0)  # (G,)
    adv = torch.where(is_best, margin[group_of], torch.zeros_like(scores))  # (bs,)
    if norm_adv_by_std:
        _, _, std = _group_stats(scores, group_ids)
        adv = adv / (std + eps)
    adv = _broadcast(adv, response_mask, token_level_rewards.dtype)
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
        ``(advantages, returns)``, both ``(bs, L)``, equal.
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = _scores(token_level_rewards, response_mask)  # (bs,) float64
    count, mean, _ = _group_stats(scores, group_ids)  # (bs,) each
    baseline = (count * mean - scores) / (count - 1).clamp_min(1)  # (bs,) mean of the others
    baseline = baseline.masked_fill(count == 1, 0.0)
    adv = _broadcast(scores - baseline, response_mask, token_level_rewards.dtype)  # (bs, L)
    return adv, adv


def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262, sec. 3): discounted returns, whitened over the batch.

    ::

        G_{i,t} = r_{i,t} + gamma G_{i,t+1}        over the valid tokens of i
        A_{i,t} = (G_{i,t} - mu) / sqrt(var + 1e-8) with mu, var over every valid token of the batch

    No group or critic is used; ``group_ids`` is accepted (and ignored) so every
    estimator is called alike.

    Args:
        token_level_rewards: ``(bs, L)``.
        response_mask: ``(bs, L)``.
        group_ids: ``(bs,)``, unused.
        gamma: discount per token.

    Returns:
        ``(advantages, returns)``: the whitened returns and the raw ``G``, both ``(bs, L)``.
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    returns = _discounted_returns(token_level_rewards.double(), response_mask, gamma)  # (bs, L)
    adv = masked_whiten(returns, response_mask)  # (bs, L)
    dtype = token_level_rewards.dtype
    return adv.to(dtype), returns.to(dtype)


def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv 2501.03262, "REINFORCE++-baseline"; verl).

    ::

        a_i     = s_i - mean_{G(i)} s              (a group of one keeps s_i)
        A_{i,t} = whiten(a_i over every valid token of the batch)

    Args:
        token_level_rewards: ``(bs, L)``.
        response_mask: ``(bs, L)``.
        group_ids: ``(bs,)`` int64; batch order is irrelevant.

    Returns:
        ``(advantages, returns)``, both ``(bs, L)``, equal.
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = _scores(token_level_rewards, response_mask)  # (bs,)
    count, mean, _ = _group_stats(scores, group_ids)
    centred = _broadcast(scores - mean.masked_fill(count == 1, 0.0), response_mask, torch.float64)  # (bs, L)
    adv = masked_whiten(centred, response_mask).to(token_level_rewards.dtype)
    return adv, adv


def remax_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    baseline_scores: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024, arXiv 2310.10505, Algorithm 1): the greedy response's reward is the baseline.

    ::

        A_{i,t} = s_i - b_i                         b_i: reward of the greedy response to i's prompt
        G_{i,t} = sum_{t' >= t} r_{i,t'}            (the undiscounted return-to-go)

    Args:
        token_level_rewards: ``(bs, L)``.
        response_mask: ``(bs, L)``.
        group_ids: ``(bs,)``, unused (the baseline already belongs to each sample's prompt).
        baseline_scores: ``(bs,)`` the greedy reward of each sample's prompt.

    Returns:
        ``(advantages, returns)``, both ``(bs, L)``.
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    if baseline_scores.shape != group_ids.shape:
        raise ValueError(
            f"baseline_scores must be (bs,) = {tuple(group_ids.shape)}; got {tuple(baseline_scores.shape)}"
        )
    scores = _scores(token_level_rewards, response_mask)  # (bs,)
    dtype = token_level_rewards.dtype
    adv = _broadcast(scores - baseline_scores.double(), response_mask, dtype)
    returns = _discounted_returns(token_level_rewards.double(), response_mask, 1.0).to(dtype)
    return adv, returns


def gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16), as in PPO.

    Over the valid tokens of each row, with ``V_{T} = 0`` past the last one::

        delta_t = r_t + gamma V_{t+1} - V_t
        Ahat_t  = delta_t + gamma lam Ahat_{t+1}
        returns = Ahat + V                          (the critic's regression target)
        A       = whiten(Ahat over every valid token of the batch)

    Args:
        token_level_rewards: ``(bs, L)``.
        response_mask: ``(bs, L)``.
        group_ids: ``(bs,)``, unused.
        values: ``(bs, L)`` the critic's value of the state before each response token.
        gamma: discount per token.
        lam: GAE's lambda (1 gives Monte-Carlo returns minus V, 0 gives one-step TD errors).

    Returns:
        ``(advantages, returns)``, both ``(bs, L)``, 0 on padding.
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    if values.shape != token_level_rewards.shape:
        raise ValueError(f"values must be (bs, L) = {tuple(token_level_rewards.shape)}; got {tuple(values.shape)}")
    rewards, v = token_level_rewards.double(), values.double()
    valid = response_mask.bool()
    next_value = v.new_zeros(v.shape[0])  # (bs,)
    next_gae = v.new_zeros(v.shape[0])  # (bs,)
    gae = torch.zeros_like(v)  # (bs, L)
    for t in reversed(range(v.shape[1])):  # a recursion over time, vectorised over the batch
        delta = rewards[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * next_gae
        next_value = torch.where(valid[:, t], v[:, t], next_value)
        next_gae = torch.where(valid[:, t], step, next_gae)
        gae[:, t] = next_gae
    dtype = token_level_rewards.dtype
    returns = _zero_padding(gae + v, response_mask).to(dtype)
    adv = masked_whiten(_zero_padding(gae, response_mask), response_mask).to(dtype)
    return adv, returns


# --------------------------------------------------------------------------- registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EstimatorSpec:
    """An estimator and what it needs, so the trainer can ask rather than test names."""

    fn: AdvantageFn
    needs_groups: bool = False
    """It compares the samples of a prompt, so ``worker.rollout.n`` must be at least 2."""
    needs_critic: bool = False
    """It takes ``values=`` from a critic, which the run then builds and trains."""
    needs_greedy_baseline: bool = False
    """It takes ``baseline_scores=``: the reward of one greedy rollout per prompt."""
    knobs: Mapping[str, str] = field(default_factory=dict)
    """Keyword argument of ``fn`` -> the ``algorithm.*`` config field that sets it."""


ADVANTAGE_ESTIMATORS: dict[AdvantageEstimator, EstimatorSpec] = {
    AdvantageEstimator.grpo: EstimatorSpec(
        grpo_advantages, needs_groups=True, knobs={"norm_adv_by_std": "norm_adv_by_std_in_grpo"}
    ),
    AdvantageEstimator.grpo_passk: EstimatorSpec(
        grpo_passk_advantages, needs_groups=True, knobs={"norm_adv_by_std": "norm_adv_by_std_in_grpo"}
    ),
    AdvantageEstimator.rloo: EstimatorSpec(rloo_advantages, needs_groups=True),
    AdvantageEstimator.reinforce_plus_plus: EstimatorSpec(reinforce_plus_plus_advantages, knobs={"gamma": "gamma"}),
    AdvantageEstimator.reinforce_plus_plus_baseline: EstimatorSpec(
        reinforce_plus_plus_baseline_advantages, needs_groups=True
    ),
    AdvantageEstimator.remax: EstimatorSpec(remax_advantages, needs_greedy_baseline=True),
    AdvantageEstimator.gae: EstimatorSpec(gae_advantages, needs_critic=True, knobs={"gamma": "gamma", "lam": "lam"}),
}
"""Every estimator: ``fn(token_level_rewards, response_mask, group_ids, **inputs, **knobs)``."""
