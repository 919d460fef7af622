"""The driver's advantage stage: token-level rewards (shaped by algorithm.reward_scaling, reward_bias and
reward_clip, with the KL penalty folded in when the KL is in the reward), then the configured estimator, then
algorithm.adv_norm, then, with algorithm.distillation, the teacher's per-token signal (added, or in place of it).

The estimator's ``EstimatorSpec`` says what it takes (a critic's values, a greedy
baseline, config knobs); nothing here tests an estimator's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmrl.config import AlgorithmConfig
from vlmrl.records import Batch
from vlmrl import algos


@dataclass
class Advantages:
    """What the advantage stage gives a batch; the step loop assigns it."""

    token_level_rewards: torch.Tensor
    """(B, R) the scores, less the KL penalty when the KL is in the reward."""
    advantages: torch.Tensor
    returns: torch.Tensor
    metrics: dict[str, float]

    def assign_to(self, batch: Batch) -> None:
        batch.token_level_rewards, batch.advantages, batch.returns = (
            self.token_level_rewards,
            self.advantages,
            self.returns,
        )


class AdvantageStage:
    def __init__(self, algo: AlgorithmConfig, kl_in_reward: bool, per_rollout: bool = False, distills: bool = False):
        """``per_rollout``: rows come from external agents' rollouts, several rows to a rollout; the estimator
        runs on one entry per rollout and its advantage goes to every row (``algos.rollout_advantages``).
        ``distills``: the batch carries a teacher's log-probs (``plan.use_teacher``), and its signal joins the
        advantages as ``algorithm.distillation`` says."""
        self.algo, self.per_rollout = algo, per_rollout
        self.distillation = algo.distillation if distills else None
        self.spec = algos.ADVANTAGE_ESTIMATORS[algo.adv_estimator]
        self.kl_controller = None
        if kl_in_reward:
            self.kl_controller = algos.make_kl_controller(
                algo.kl_type, algo.kl_coef, algo.kl_target, algo.kl_horizon
            )

    def __call__(self, batch: Batch) -> Advantages:
        """The token-level rewards, advantages and returns of ``batch``, and the KL-penalty metrics.

        Reads the batch, writes nothing to it; advances the adaptive KL controller.
        """
        metrics = {}
        batch.require("token_level_scores")
        shaped = self._shaped(batch.token_level_scores, batch.response_mask)
        if self.kl_controller is None:
            rewards = shaped
        else:
            batch.require("old_log_probs", "ref_log_probs")
            coef = self.kl_controller.coef
            rewards, current_kl = algos.kl_in_reward(
                shaped,
                batch.old_log_probs,
                batch.ref_log_probs,
                batch.response_mask,
                coef,
                self.algo.kl_penalty,
            )
            metrics = {"actor/reward_kl_penalty": current_kl.item(), "actor/reward_kl_penalty_coef": coef}
            self.kl_controller.update(current_kl.item(), n_steps=len(batch))
        kwargs: dict[str, Any] = {arg: getattr(self.algo, key) for arg, key in self.spec.knobs.items()}
        if self.per_rollout:
            scores = self._rollout_scores(batch, rewards)
            advantages, returns = algos.rollout_advantages(
                batch.rollout_ids, batch.group_ids.tolist(), scores, batch.response_mask, self.algo.adv_estimator,
                **kwargs,
            )  # fmt: skip
            return Advantages(rewards, self._normalised(advantages, batch), returns, metrics)
        if self.spec.needs_critic:
            batch.require("values")
            kwargs["values"] = batch.values
        if self.spec.needs_greedy_baseline:
            batch.require("reward_baselines")
            # The greedy response's reward is shaped as the samples' are, so the baseline is in the same units.
            a = self.algo
            kwargs["baseline_scores"] = algos.shape_scores(
                batch.reward_baselines, a.reward_scaling, a.reward_bias, a.reward_clip
            )
        advantages, returns = self.spec.fn(rewards, batch.response_mask, batch.group_ids, **kwargs)
        advantages = self._normalised(advantages, batch)
        if self.distillation is not None:
            advantages, distill_metrics = self._distilled(advantages, batch)
            metrics = {**metrics, **distill_metrics}
        return Advantages(rewards, advantages, returns, metrics)

    def _distilled(self, advantages: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages with the teacher's per-token signal (``algos.distillation``), and its metrics."""
        d = self.distillation
        batch.require("old_log_probs", "teacher_log_probs")
        student, teacher, mask = batch.old_log_probs, batch.teacher_log_probs, batch.response_mask
        signal = algos.distillation_signal(student, teacher, mask, d.estimator)
        combined = algos.distilled_advantages(advantages, signal, mask, d.coef, d.mode)
        return combined, algos.distillation_metrics(student, teacher, signal, mask, d.coef)

    def _rollout_scores(self, batch: Batch, rewards: torch.Tensor) -> list[float]:
        """Each row's rollout score for a per-rollout estimator.

        Without turn rewards, each row's reward sits on its last trained token and the rows of a rollout carry
        the same one. With them (an agent's ``emit_reward``, a workflow's ``turn_rewards``) a row carries its
        own turns' rewards beside the rollout's, so the rows differ: the rollout's score is then its reward
        (``overall``, shared by its rows) plus the turn rewards of all its rows, shaped as a sequence score.
        """
        turns = [sum(t.turn_rewards) for t in batch.trajectories]
        if not any(turns):
            return algos.masked_sum(rewards, batch.response_mask, dim=-1).tolist()
        reported: dict[str, float] = {}
        for rollout_id, turn in zip(batch.rollout_ids, turns, strict=True):
            reported[rollout_id] = reported.get(rollout_id, 0.0) + turn
        overall = batch.reward_metrics["overall"]
        raw = [o + reported[r] for o, r in zip(overall, batch.rollout_ids, strict=True)]
        a = self.algo
        shaped = algos.shape_scores(torch.tensor(raw, dtype=torch.float64), a.reward_scaling, a.reward_bias, a.reward_clip)
        return shaped.tolist()

    def _shaped(self, scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        a = self.algo
        if (a.reward_scaling, a.reward_bias, a.reward_clip) == (1.0, 0.0, None):
            return scores  # the default: the reward function's scores exactly
        return algos.shape_rewards(scores, response_mask, a.reward_scaling, a.reward_bias, a.reward_clip)

    def _normalised(self, advantages: torch.Tensor, batch: Batch) -> torch.Tensor:
        norm = self.algo.adv_norm
        return algos.normalise_advantages(
            advantages, batch.response_mask, batch.group_ids, norm.mean_level, norm.std_level
        )

    def state(self) -> dict[str, float]:
        """What a checkpoint must hold for an exact resume: the adaptive KL coefficient."""
        return {} if self.kl_controller is None else {"kl_coef": self.kl_controller.coef}

    def load_state(self, state: dict[str, float]) -> None:
        if self.kl_controller is not None and "kl_coef" in state:
            self.kl_controller.coef = state["kl_coef"]
