"""``worker.actor.proximal_log_probs=loglinear`` (AReaL's ``prox_logp_method``): the decoupled loss's proximal
log-probs interpolated in the update, with no old-log-prob pass; the config, the plan and the update on the tiny VLM.

The interpolation (``vlmrl.algos.proximal_log_probs_loglinear``, hand-checked in tests/test_decoupled_loss.py)
with the update's versions: the weights at the start of the update are version ``v`` (the proximal policy) and
the update's own forward stands for ``v + 1``, so a token sampled by version ``v_b`` gets::

    alpha      = (v - v_b) / ((v + 1) - v_b)                 0 for v_b = v, 1/2 for v - 1, 2/3 for v - 2, 3/4 for v - 3
    log p_prox = (1 - alpha) log p_behav + alpha log p_forward
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.configs import CPU, QUICKSTART, problems_of
from test_update_equivalence import (  # noqa: F401 (model_and_batch is a fixture)
    RecordingOptimizer,
    model_and_batch,
    update_settings,
)

from vlmrl import algos
from vlmrl.algos import BehaviourWeightMode, DecoupledParams, LossAvgMode, PolicyLossType, ProximalLogProbs
from vlmrl.plan import describe, resolve
from vlmrl.train.actor import UpdateSettings, compute_log_probs, update_policy
from vlmrl.train.micro_batches import MicroBatching
from vlmrl.validate import load_config

DECOUPLED = ("worker.actor.use_decoupled_loss=true", "worker.rollout.calculate_log_probs=true")
LOGLINEAR = "worker.actor.proximal_log_probs=loglinear"
V = 5
"""The policy version of the weights the updates below start from."""


def _copy(batch):
    return batch.select(list(range(len(batch))))


def _settings(batch, proximal, version=None, micro=2, samples_per_update=None, epochs=1):
    base = update_settings(batch, micro, PolicyLossType.default, LossAvgMode.token_mean)
    params = DecoupledParams(behaviour_weight_cap=5.0, behaviour_weight_mode=BehaviourWeightMode.mask)
    return dataclasses.replace(
        base, decoupled=params, proximal_log_probs=proximal, policy_version=version, ppo_epochs=epochs,
        samples_per_update=samples_per_update or len(batch),
    )  # fmt: skip


def _at_versions(batch, versions):
    """A copy of ``batch`` whose response tokens were sampled by ``versions`` ((B, R), or a number for all)."""
    out = _copy(batch)
    valid = batch.response_mask.bool()
    out.policy_versions = torch.where(valid, torch.as_tensor(versions).expand(valid.shape), -1).long()
    out.rollout_log_probs = batch.old_log_probs.clone()  # the fixture's: 0.3-noise off the model's own
    return out


# ------------------------------------------------------------------------------------------------ config


def test_validation_refuses_loglinear_without_the_decoupled_loss_naming_the_key_and_fix():
    problems = problems_of(QUICKSTART, LOGLINEAR)
    (mine,) = [p for p in problems if p.startswith(LOGLINEAR)]
    assert "without worker.actor.use_decoupled_loss=true" in mine
    assert "set worker.actor.use_decoupled_loss=true and worker.rollout.calculate_log_probs=true" in mine
    assert "worker.actor.proximal_log_probs=recompute" in mine


def test_validation_refuses_what_reads_or_asks_for_the_pass_loglinear_drops():
    problems = problems_of(
        QUICKSTART, LOGLINEAR, *DECOUPLED, "algorithm.use_kl_loss=false", "worker.actor.old_log_prob_pass=always"
    )
    assert any(p.startswith(f"{LOGLINEAR} with the KL in the reward") and "algorithm.use_kl_loss=true" in p
               for p in problems), problems  # fmt: skip
    assert any(p.startswith("worker.actor.old_log_prob_pass=always with " + LOGLINEAR) for p in problems), problems
    # The decoupled loss's own rule still asks for the engine's log-probs when they are turned off by hand.
    problems = problems_of(
        QUICKSTART, LOGLINEAR, "worker.actor.use_decoupled_loss=true", "worker.rollout.calculate_log_probs=false"
    )
    assert any("set worker.rollout.calculate_log_probs=true" in p for p in problems), problems


def test_the_option_is_an_enum_defaulting_to_recompute():
    problems = problems_of(QUICKSTART, "worker.actor.proximal_log_probs=linear")
    assert any("worker.actor.proximal_log_probs" in p and "loglinear" in p for p in problems), problems
    config = load_config([QUICKSTART], CPU)
    assert config.worker.actor.proximal_log_probs is ProximalLogProbs.recompute
    config = load_config([QUICKSTART, LOGLINEAR, *DECOUPLED], CPU)
    assert config.worker.actor.proximal_log_probs is ProximalLogProbs.loglinear
    load_config([QUICKSTART, LOGLINEAR, *DECOUPLED, "worker.rollout.async_rl.enable=true",
                 "worker.rollout.async_rl.max_head_offpolicyness=2"], CPU)  # fmt: skip


# -------------------------------------------------------------------------------------------------- plan


def test_no_old_log_prob_pass_is_scheduled_with_loglinear():
    # Two mini-batches per step: with recompute the pass runs on every step, on-policy or not.
    two_minis = "worker.actor.global_batch_size=8"
    config = load_config([QUICKSTART, *DECOUPLED, two_minis], CPU)
    plan = resolve(config, CPU)
    assert not plan.proximal_loglinear
    assert not plan.old_log_probs_from_forward(1, plan.samples_per_step, on_policy=True)
    config = load_config([QUICKSTART, *DECOUPLED, two_minis, LOGLINEAR], CPU)
    plan = resolve(config, CPU)
    assert plan.proximal_loglinear
    for on_policy in (True, False):
        assert plan.old_log_probs_from_forward(1, plan.samples_per_step, on_policy)
    assert "no old-log-prob pass" in describe(plan, config)
    # The one update the quickstart makes: recompute's auto skip holds only on-policy; loglinear's always.
    plan = resolve(load_config([QUICKSTART, *DECOUPLED, LOGLINEAR], CPU), CPU)
    assert plan.old_log_probs_from_forward(1, plan.samples_per_step, on_policy=False)
    recompute = resolve(load_config([QUICKSTART, *DECOUPLED], CPU), CPU)
    assert not recompute.old_log_probs_from_forward(1, recompute.samples_per_step, on_policy=False)
    # The steps before trainer.critic_warmup train no actor: their metrics' old log-probs still come from the pass.
    warm = dataclasses.replace(plan, critic_warmup=3)
    assert not warm.old_log_probs_from_forward(2, plan.samples_per_step) and warm.old_log_probs_from_forward(3, 1)


def test_the_update_settings_carry_the_mode_and_the_driver_gives_the_version(model_and_batch):
    _, batch, _ = model_and_batch
    config = load_config([QUICKSTART, *DECOUPLED, LOGLINEAR], CPU)
    settings = UpdateSettings.from_config(config, resolve(config, CPU))
    assert settings.loglinear and settings.policy_version is None
    assert settings.at_version(7, batch).policy_version == 7
    # The synchronous sampler names no version: the batch's newest token's, the weights that sampled it.
    assert settings.at_version(None, _at_versions(batch, 4)).policy_version == 4
    plain = load_config([QUICKSTART, *DECOUPLED], CPU)
    recompute = UpdateSettings.from_config(plain, resolve(plain, CPU))
    assert not recompute.loglinear and recompute.at_version(7, batch) is recompute


# ------------------------------------------------------------------------------------------------ update


def _run(model, batch, settings, allowed, old_from_forward=False):
    optimizer = RecordingOptimizer(model)
    update = update_policy(model, optimizer, batch, settings, allowed, old_from_forward)
    return optimizer.grads, update


@pytest.mark.parametrize(("samples_per_update", "epochs"), [(None, 1), (4, 2)])
def test_on_policy_loglinear_is_recompute_with_the_behaviour_as_proximal(model_and_batch, samples_per_update, epochs):
    # Every token sampled by version v: alpha = (v - v) / ((v + 1) - v) = 0, so p_prox = p_behav exactly (the
    # interpolation returns the behaviour tensor itself where alpha = 0), the weight is exp(0) = 1, and the loss
    # is the registered loss anchored at the behaviour log-probs: recompute with old_log_probs = rollout's.
    model, batch, allowed = model_and_batch
    on_policy = _at_versions(batch, V)
    recompute = _copy(on_policy)
    recompute.old_log_probs = on_policy.rollout_log_probs.clone()
    loglinear = _copy(on_policy)
    loglinear.old_log_probs = torch.full_like(batch.old_log_probs, 100.0)  # never read
    want, want_update = _run(
        model, recompute, _settings(batch, ProximalLogProbs.recompute, None, 2, samples_per_update, epochs), allowed
    )
    got, got_update = _run(
        model, loglinear, _settings(batch, ProximalLogProbs.loglinear, V, 2, samples_per_update, epochs), allowed
    )
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert any(g.abs().sum() > 0 for g in got)
    assert got_update.metrics == want_update.metrics
    assert got_update.metrics["actor/behav_weight_mean"] == 1.0 and got_update.metrics["actor/behav_prox_kl"] == 0


def test_older_tokens_get_the_interpolated_proximal_log_probs(model_and_batch, monkeypatch):
    model, batch, allowed = model_and_batch
    # Rows sampled by v, v - 1, v - 3 whole; the others token by token by v, v - 1, v - 2, v - 3 in turn.
    lag = torch.zeros(batch.response_mask.shape, dtype=torch.long)
    lag[1], lag[2] = 1, 3
    lag[3:] = torch.arange(lag.shape[1]) % 4
    old = _at_versions(batch, V - lag)
    # alpha = (v - v_b) / (v + 1 - v_b) = lag / (lag + 1) (see the module docstring), written out by hand:
    alpha = torch.tensor([0.0, 1 / 2, 2 / 3, 3 / 4])[lag] * batch.response_mask
    assert {round(float(a), 4) for a in alpha[batch.response_mask.bool()]} == {0.0, 0.5, 0.6667, 0.75}
    current, _ = compute_log_probs(model, batch, MicroBatching(len(batch)), allowed)  # the update's forward
    behav = old.rollout_log_probs
    want = (1 - alpha) * behav + alpha * current
    seen = []
    real = algos.policy_loss_decoupled

    def spy(behaviour, proximal, *args):
        seen.append(proximal.detach().clone())
        return real(behaviour, proximal, *args)

    monkeypatch.setattr(algos, "policy_loss_decoupled", spy)
    settings = _settings(batch, ProximalLogProbs.loglinear, V, micro=len(batch))  # one micro-batch, rows in order
    got, _ = _run(model, old, settings, allowed)
    (order,) = settings.batching.groups(old)  # the micro-batch's rows, sorted by length
    proximal = torch.empty_like(want)
    (proximal[order],) = seen
    mask = batch.response_mask.bool()
    torch.testing.assert_close(proximal[mask], want[mask], rtol=0, atol=1e-5)
    assert torch.equal(proximal[0][mask[0]], behav[0][mask[0]])  # version v: the behaviour log-prob, exactly
    assert not torch.allclose(proximal[2][mask[2]], behav[2][mask[2]])  # older: moved toward the forward's
    # And the gradient is recompute's with those proximal log-probs as the old ones.
    monkeypatch.setattr(algos, "policy_loss_decoupled", real)
    anchored = _copy(old)
    anchored.old_log_probs = want
    expected, _ = _run(model, anchored, _settings(batch, ProximalLogProbs.recompute, micro=len(batch)), allowed)
    for name_and_param, a, b in zip(model.named_parameters(), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7, msg=lambda m, n=name_and_param[0]: f"{n}: {m}")


def test_without_a_pass_the_update_returns_its_forwards_log_probs_over_every_mini_batch(model_and_batch):
    # No pass ran (old_from_forward): the step's metrics get each row's log-probs from the update's first epoch;
    # mini-batches of 4 over 6 rows, two epochs, and the recording optimizer never moves the weights.
    model, batch, allowed = model_and_batch
    old = _at_versions(batch, V - 1)
    old.old_log_probs = None
    settings = _settings(batch, ProximalLogProbs.loglinear, V, micro=2, samples_per_update=4, epochs=2)
    _, update = _run(model, old, settings, allowed, old_from_forward=True)
    current, entropy = compute_log_probs(model, batch, MicroBatching(2), allowed)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(update.log_probs[mask], current[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(update.entropy[mask], entropy[mask], rtol=0, atol=1e-5)


def test_loglinear_needs_the_version_and_the_engines_log_probs(model_and_batch):
    model, batch, allowed = model_and_batch
    old = _at_versions(batch, V)
    with pytest.raises(ValueError, match="policy_version"):
        _run(model, old, _settings(batch, ProximalLogProbs.loglinear, None), allowed)
    old.rollout_log_probs = None
    with pytest.raises(RuntimeError, match="rollout_log_probs"):
        _run(model, old, _settings(batch, ProximalLogProbs.loglinear, V), allowed)
