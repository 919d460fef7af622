"""The maths of GRPO-family and PPO training, as pure tensor functions.

Everything here is tensors in, tensors out: no config, no state beyond the KL
controller's coefficient, no distributed calls. Shapes use ``bs`` (sequences
in the batch), ``L`` (padded response length) and ``V`` (vocabulary size).

The code lives in ``vlmrl.algos``, one module per kind; this module
re-exports the public names so callers have one import:

* ``algos.advantages``: the estimators and ``ADVANTAGE_ESTIMATORS`` (each entry an
  ``EstimatorSpec`` saying what the estimator needs from the trainer).
* ``algos.losses``: ``aggregate_loss``, the policy losses and ``POLICY_LOSSES``,
  the clipped value loss.
* ``algos.kl``: ``KL_ESTIMATORS``, KL folded into the reward, ``KL_CONTROLLERS``.
* ``algos.groups``: DAPO online filtering, zero-advantage group count.
* ``algos.normalisation``: reward scaling, bias and clipping; advantage normalisation by group or batch (AReaL).
* ``algos.logits``: log-probs and entropy from logits.
* ``algos.rollout_correction``: importance weights of the trained policy over the engine's (TIS, MIS, IcePop,
  the veto) and the mismatch KL.
* ``algos.distillation``: on-policy distillation's per-token signal from a teacher's log-probs.

One registry per extension point, keyed by the config enum: adding an
estimator or a loss is one function, one enum value and one registry entry.
"""

from __future__ import annotations

from vlmrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    EstimatorSpec,
    gae_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)
from vlmrl.algos.common import masked_mean, masked_sum, masked_whiten
from vlmrl.algos.decoupled import (
    BehaviourWeightMode,
    DecoupledParams,
    ProximalLogProbs,
    behaviour_weight,
    policy_loss_decoupled,
    proximal_log_probs_loglinear,
)
from vlmrl.algos.distillation import (
    DISTILL_ESTIMATORS,
    DistillEstimator,
    DistillMode,
    distillation_metrics,
    distillation_signal,
    distilled_advantages,
)
from vlmrl.algos.groups import online_filter_keep, zero_advantage_groups
from vlmrl.algos.normalisation import NormLevel, normalise_advantages, shape_rewards, shape_scores
from vlmrl.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KLController,
    KLControllerType,
    KLEstimator,
    adaptive_kl_coef,
    kl_in_reward,
    kl_penalty,
    make_kl_controller,
)
from vlmrl.algos.logits import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from vlmrl.algos.losses import (
    POLICY_LOSSES,
    LossAvgMode,
    PolicyLossParams,
    PolicyLossType,
    aggregate_loss,
    aggregation_weight,
    policy_loss_cispo,
    policy_loss_gspo,
    policy_loss_gspo_token,
    policy_loss_ppo_clip,
    policy_loss_sapo,
    value_loss_clipped,
)
from vlmrl.algos.rollout_correction import (
    Correction,
    CorrectionLevel,
    CorrectionMode,
    CorrectionParams,
    correction_metrics,
    mismatch_kl,
    rollout_correction,
)
from vlmrl.algos.rollout_credit import (
    MULTI_ROW_UNSUPPORTED,
    TraceAggregation,
    rollout_advantages,
    trim_to_mini_batches,
)

__all__ = [
    "NormLevel",
    "normalise_advantages",
    "shape_rewards",
    "shape_scores",
    "ADVANTAGE_ESTIMATORS",
    "DISTILL_ESTIMATORS",
    "DistillEstimator",
    "DistillMode",
    "distillation_metrics",
    "distillation_signal",
    "distilled_advantages",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "MULTI_ROW_UNSUPPORTED",
    "POLICY_LOSSES",
    "AdvantageEstimator",
    "BehaviourWeightMode",
    "Correction",
    "CorrectionLevel",
    "CorrectionMode",
    "CorrectionParams",
    "DecoupledParams",
    "EstimatorSpec",
    "KLController",
    "KLControllerType",
    "KLEstimator",
    "LossAvgMode",
    "PolicyLossParams",
    "PolicyLossType",
    "ProximalLogProbs",
    "TraceAggregation",
    "adaptive_kl_coef",
    "aggregate_loss",
    "aggregation_weight",
    "behaviour_weight",
    "correction_metrics",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "grpo_passk_advantages",
    "kl_in_reward",
    "kl_penalty",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "mismatch_kl",
    "online_filter_keep",
    "policy_loss_cispo",
    "policy_loss_decoupled",
    "policy_loss_gspo",
    "policy_loss_gspo_token",
    "policy_loss_ppo_clip",
    "policy_loss_sapo",
    "proximal_log_probs_loglinear",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "rollout_advantages",
    "rollout_correction",
    "trim_to_mini_batches",
    "value_loss_clipped",
    "zero_advantage_groups",
]
