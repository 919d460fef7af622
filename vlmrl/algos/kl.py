"""KL to the reference policy: per-token estimators, the KL penalty folded into
the reward, and the controllers that set its coefficient.

KL enters training in one of two ways (``algorithm.use_kl_loss``): as a loss
term beside the policy loss (GRPO; ``kl_penalty`` + ``aggregate_loss`` in the
actor) or subtracted from the token-level reward before the advantages are
computed (PPO/RLHF; ``kl_in_reward`` with a ``KLController``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmrl.algos.common import ConfigEnum, masked_mean


class KLEstimator(ConfigEnum):
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


class KLControllerType(ConfigEnum):
    """How the coefficient of a KL penalty folded into the reward evolves (``algorithm.kl_type``)."""

    fixed = "fixed"
    """``kl_coef`` throughout."""
    adaptive = "adaptive"
    """Ziegler et al. 2019: steered towards ``kl_target`` over ``kl_horizon`` samples."""


# --------------------------------------------------------------------------- estimators


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


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: KLEstimator | str) -> torch.Tensor:
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


# --------------------------------------------------------------------------- KL in the reward


def kl_in_reward(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: KLEstimator | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a KL penalty into the token-level reward (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022, eq. 2).

    ::

        r_{i,t} = score_{i,t} - kl_coef * KL_{i,t}     on valid tokens (score elsewhere)
        current_kl = 1/bs sum_i mean_t KL_{i,t}         (what the adaptive controller steers)

    Args:
        token_level_scores: ``(bs, L)`` the reward function's scores.
        old_log_prob: ``(bs, L)`` the sampling policy's log-probs.
        ref_log_prob: ``(bs, L)`` the reference model's log-probs.
        response_mask: ``(bs, L)``.
        kl_coef: the controller's current coefficient.
        estimator: which per-token KL estimate (``algorithm.kl_penalty``).

    Returns:
        ``(token_level_rewards, current_kl)``: ``(bs, L)`` and a scalar tensor.
    """
    kl = kl_penalty(old_log_prob, ref_log_prob, estimator)  # (bs, L)
    kl = torch.where(response_mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    rewards = token_level_scores - kl_coef * kl.to(token_level_scores.dtype)
    current_kl = masked_mean(kl, response_mask, dim=-1).mean()  # (bs,) -> ()
    return rewards, current_kl


# --------------------------------------------------------------------------- controllers


def adaptive_kl_coef(coef: float, current_kl: float, n_steps: int, target: float, horizon: float) -> float:
    """One update of the adaptive KL controller (Ziegler et al. 2019, arXiv 1909.08593, sec. 2.2).

    ::

        e     = clip(current_kl / target - 1, -0.2, 0.2)
        coef' = coef * (1 + e * n_steps / horizon)

    ``n_steps`` is the number of samples the KL was measured on, so the
    coefficient moves about ``e`` relative per ``horizon`` samples.
    """
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


def fixed_kl_coef(coef: float, current_kl: float, n_steps: int, target: float, horizon: float) -> float:
    """The fixed controller: ``coef`` never moves."""
    return coef


KL_CONTROLLERS: dict[KLControllerType, Callable[[float, float, int, float, float], float]] = {
    KLControllerType.fixed: fixed_kl_coef,
    KLControllerType.adaptive: adaptive_kl_coef,
}
"""Every controller: ``update(coef, current_kl, n_steps, target, horizon) -> next coef``."""


@dataclass
class KLController:
    """The KL-in-reward coefficient and how it moves; ``update`` after each step's rewards."""

    kind: KLControllerType
    coef: float
    target: float = 0.1
    horizon: float = 10000.0

    def update(self, current_kl: float, n_steps: int) -> None:
        self.coef = KL_CONTROLLERS[self.kind](self.coef, current_kl, n_steps, self.target, self.horizon)


def make_kl_controller(
    kind: KLControllerType | str, kl_coef: float, kl_target: float, kl_horizon: float
) -> KLController:
    """A controller of kind ``algorithm.kl_type`` starting at ``kl_coef``."""
    kind = KLControllerType(kind)
    if kind is KLControllerType.adaptive and not (kl_horizon > 0 and kl_target > 0):
        raise ValueError(
            f"the adaptive KL controller needs kl_horizon > 0 and kl_target > 0; got {kl_horizon}, {kl_target}"
        )
    return KLController(kind, kl_coef, kl_target, kl_horizon)
