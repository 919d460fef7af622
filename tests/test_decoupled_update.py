"""The decoupled PPO loss inside the actor's update (``worker.actor.use_decoupled_loss``), on the tiny VLM.

The loss itself has hand-derived tests (tests/test_decoupled_loss.py); these check the wiring: which log-probs
the update takes as behaviour and as proximal, and that the gradient is the one the derivation gives.

Derivation of the expected gradient: each policy loss is -A g(ratio, sign A) per token, positively homogeneous
in A. So, with w = bound(exp(old - behaviour)) detached, the decoupled loss is the plain loss with advantages
w * A, token by token, reduced over the same mask. The decoupled update's gradient is therefore the plain
update's gradient on a batch whose advantages are w * A.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_update_equivalence import (  # noqa: F401 (model_and_batch is a fixture)
    RecordingOptimizer,
    assert_same_gradients,
    model_and_batch,
    update_settings,
)

from vlmrl.algos import BehaviourWeightMode, DecoupledParams, LossAvgMode, PolicyLossType
from vlmrl.config import ConfigError
from vlmrl.plan import Cluster
from vlmrl.train.actor import update_policy
from vlmrl.validate import load_config


def _copy(batch):
    return batch.select(list(range(len(batch))))


def _decoupled(settings, mode, cap):
    params = DecoupledParams(behaviour_weight_cap=cap, behaviour_weight_mode=mode, loss_type=settings.loss_type)
    return dataclasses.replace(settings, decoupled=params)


def _grads(model, batch, settings, allowed):
    optimizer = RecordingOptimizer(model)
    metrics = update_policy(model, optimizer, batch, settings, allowed).metrics
    return optimizer.grads, metrics


def test_with_behaviour_equal_to_old_it_is_the_plain_update(model_and_batch):
    model, batch, allowed = model_and_batch
    settings = update_settings(batch, 2, PolicyLossType.default, LossAvgMode.token_mean)
    on_policy = _copy(batch)
    on_policy.rollout_log_probs = batch.old_log_probs.clone()  # w = 1 on every token
    want, _ = _grads(model, _copy(batch), settings, allowed)
    got, metrics = _grads(model, on_policy, _decoupled(settings, BehaviourWeightMode.mask, 5.0), allowed)
    assert_same_gradients(model, got, want)
    assert metrics["actor/behav_weight_mean"] == pytest.approx(1.0)
    assert metrics["actor/behav_weight_capped_frac"] == 0


@pytest.mark.parametrize("mode", [BehaviourWeightMode.mask, BehaviourWeightMode.truncate])
def test_the_gradient_is_the_plain_one_with_advantages_times_the_bounded_weight(model_and_batch, mode):
    model, batch, allowed = model_and_batch
    settings = update_settings(batch, 2, PolicyLossType.default, LossAvgMode.seq_mean_token_mean)
    gen = torch.Generator().manual_seed(1)
    off = _copy(batch)
    off.rollout_log_probs = batch.old_log_probs + 0.5 * torch.randn(batch.old_log_probs.shape, generator=gen)
    cap = 1.5
    raw = torch.exp(batch.old_log_probs - off.rollout_log_probs) * batch.response_mask
    weight = torch.where(raw > cap, 0.0, raw) if mode is BehaviourWeightMode.mask else raw.clamp(max=cap)
    assert (raw > cap).any() and (raw[batch.response_mask.bool()] < cap).any()  # both sides of the cap occur
    weighted = _copy(batch)
    weighted.advantages = batch.advantages * weight
    want, _ = _grads(model, weighted, settings, allowed)
    got, metrics = _grads(model, off, _decoupled(settings, mode, cap), allowed)
    assert_same_gradients(model, got, want)
    assert 0 < metrics["actor/behav_weight_capped_frac"] < 1
    assert metrics["actor/behav_prox_kl"] > 0


def test_the_update_needs_the_engines_log_probs(model_and_batch):
    model, batch, allowed = model_and_batch
    settings = update_settings(batch, 2, PolicyLossType.default, LossAvgMode.token_mean)
    missing = _copy(batch)
    missing.rollout_log_probs = None
    with pytest.raises(RuntimeError, match="rollout_log_probs"):
        update_policy(model, RecordingOptimizer(model), missing, _decoupled(settings, BehaviourWeightMode.mask, 5.0), allowed)


def test_validation_asks_for_the_engines_log_probs_and_a_cap_of_at_least_one():
    with pytest.raises(ConfigError) as e:
        load_config(["config=examples/quickstart.yaml", "worker.actor.use_decoupled_loss=true",
                     "worker.rollout.calculate_log_probs=false", "worker.actor.behaviour_weight_cap=0.5"],
                    Cluster(gpus=0, cpus=2))  # fmt: skip
    assert any("set worker.rollout.calculate_log_probs=true" in p for p in e.value.problems), e.value.problems
    assert any("behaviour_weight_cap=0.5: must be at least 1" in p for p in e.value.problems), e.value.problems
    load_config(["config=examples/quickstart.yaml", "worker.actor.use_decoupled_loss=true",
                 "worker.rollout.calculate_log_probs=true"], Cluster(gpus=0, cpus=2))  # fmt: skip
    # Unset, vLLM's log-probs follow the decoupled loss (vlmrl.plan.rollout_log_probs).
    load_config(["config=examples/quickstart.yaml", "worker.actor.use_decoupled_loss=true"], Cluster(gpus=0, cpus=2))
