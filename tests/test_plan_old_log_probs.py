"""When a step's old log-probs come from the update's own forward instead of a pass of their own."""

from __future__ import annotations

import pytest
from helpers.configs import CPU, QUICKSTART, problems_of

from vlmrl.plan import describe, resolve
from vlmrl.validate import load_config


def plan_of(*overrides: str):
    config = load_config([QUICKSTART, *overrides], CPU)
    return resolve(config, CPU), config


def test_one_on_policy_update_per_step_skips_the_pass():
    # The quickstart: rollout_batch_size = global_batch_size = 16, one epoch, KL as a loss.
    plan, config = plan_of()
    assert plan.updates_per_step == 1
    assert plan.old_log_probs_from_update
    assert "old log-probs from the update's forward" in describe(plan, config)


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["worker.actor.ppo_epochs=2"], "the second epoch's old policy is the first epoch's"),
        (["worker.actor.global_batch_size=8"], "the second mini-batch's old policy is the first's"),
        (["algorithm.use_kl_loss=false"], "KL in the reward reads old log-probs before the update"),
        (["worker.actor.old_log_prob_pass=always"], "asked for"),
    ],
)
def test_the_pass_runs_when_the_update_is_not_the_single_on_policy_one(overrides, why):
    plan, config = plan_of(*overrides)
    assert not plan.old_log_probs_from_update, why
    assert "old log-probs from the update's forward" not in describe(plan, config)


def test_without_kl_the_pass_is_still_skipped():
    plan, _ = plan_of("algorithm.disable_kl=true", "algorithm.use_kl_loss=false")
    assert plan.old_log_probs_from_update


def test_the_option_is_an_enum():
    problems = problems_of(QUICKSTART, "worker.actor.old_log_prob_pass=never")
    assert any("worker.actor.old_log_prob_pass" in p and "always" in p for p in problems), problems
