"""On-policy distillation: a frozen teacher scores the student's own samples, token by token.

The student samples ``y`` from its policy; the teacher computes ``log pi_T(y_t)``
on the same prompt and tokens. Per trained token the signal is the negative
of a per-token estimate of the reverse KL ``KL(pi_S || pi_T)`` (Agarwal et
al. 2024, "On-Policy Distillation of Language Models" (GKD); Thinking
Machines' "On-Policy Distillation", 2025)::

    reverse_kl   s_t = -(log pi_S(y_t) - log pi_T(y_t)) = log pi_T(y_t) - log pi_S(y_t)

with ``pi_S`` the student's old log-probs (the policy that sampled, up to the
engine/trainer mismatch). On samples from the student, the mean of
``log pi_S - log pi_T`` is an unbiased estimate of the reverse KL, so pushing
up the probability of tokens with a positive ``s_t`` (the teacher likes them
more than the student does) and down those with a negative one is a policy
gradient step on ``-KL(pi_S || pi_T)`` with ``s_t`` as a per-token reward
that is not summed into a return (each token's own term, as the write-ups do).

The signal becomes the advantage in one of two ways (``DistillMode``)::

    add       A_t = A_t(reward) + coef * s_t
    replace   A_t = coef * s_t                          the reward's advantage is not used

Tokens outside the loss mask (padding, and in multi-turn rows the tool's and
the user's tokens) get ``s_t = 0``: only the model's own tokens are distilled.
Both log-probs are detached: the signal is a reward, never a path for gradient
into the teacher or the student's old pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlmrl.algos.common import ConfigEnum, masked_mean


class DistillEstimator(ConfigEnum):
    """The per-token signal from the teacher's and the student's log-probs (``algorithm.distillation.estimator``)."""

    reverse_kl = "reverse_kl"
    """``log pi_teacher(y_t) - log pi_student(y_t)``: minus the per-token reverse KL estimate on the sampled token."""


class DistillMode(ConfigEnum):
    """How the signal meets the reward's advantage (``algorithm.distillation.mode``)."""

    add = "add"
    """``A + coef * s``: the reward's advantage plus the teacher's per-token signal."""
    replace = "replace"
    """``coef * s``: the teacher's signal is the whole advantage; the reward only shows in the logs."""


def reverse_kl_signal(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """``(bs, L)`` ``log pi_T - log pi_S`` per token, unmasked."""
    return teacher_log_probs - student_log_probs


DISTILL_ESTIMATORS: dict[DistillEstimator, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    DistillEstimator.reverse_kl: reverse_kl_signal,
}
"""The per-token signal of each estimator, from ``(student_log_probs, teacher_log_probs)``."""


def distillation_signal(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: DistillEstimator = DistillEstimator.reverse_kl,
) -> torch.Tensor:
    """The teacher's per-token signal on the trained tokens, 0 elsewhere.

    Args:
        student_log_probs: ``(bs, L)`` the student's log-probs of the sampled tokens (its old log-probs).
        teacher_log_probs: ``(bs, L)`` the teacher's log-probs of the same tokens.
        response_mask: ``(bs, L)`` the loss mask: 1 on the model's own tokens.
        estimator: which signal (``DISTILL_ESTIMATORS``).

    Returns:
        ``(bs, L)`` detached; 0 where the mask is 0 (whatever the log-probs hold there, ``inf`` included).
    """
    signal = DISTILL_ESTIMATORS[estimator](student_log_probs.detach(), teacher_log_probs.detach())
    return torch.where(response_mask.bool(), signal, torch.zeros((), dtype=signal.dtype, device=signal.device))


def distilled_advantages(
    advantages: torch.Tensor, signal: torch.Tensor, response_mask: torch.Tensor, coef: float, mode: DistillMode
) -> torch.Tensor:
    """The advantages with the teacher's signal: ``A + coef * s`` (add) or ``coef * s`` (replace), 0 off the mask."""
    scaled = coef * signal
    combined = advantages + scaled if mode is DistillMode.add else scaled
    return torch.where(response_mask.bool(), combined, torch.zeros((), dtype=combined.dtype, device=combined.device))


def distillation_metrics(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    signal: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
) -> dict[str, float]:
    """``distill/reverse_kl``: the mean of ``log pi_S - log pi_T`` over the trained tokens (the reverse KL
    estimate, whatever the estimator); ``distill/signal_mean``: the mean of what the advantages got,
    ``coef * s``, over the same tokens."""
    gap = (student_log_probs - teacher_log_probs).detach()
    return {
        "distill/reverse_kl": masked_mean(gap, response_mask).item(),
        "distill/signal_mean": masked_mean(coef * signal.detach(), response_mask).item(),
    }
