"""Fault: every update of a run is NaN (a non-finite gradient), so every optimizer step is skipped.

The run used to go on to its end changing nothing and exit 0; the critic's
skips were not even looked at. ``trainer.max_consecutive_skipped_steps`` steps
in a row with every actor (or critic) optimizer step skipped must fail the run,
naming the steps and the cause. Bad numbers that would make the updates NaN are
refused at validation (NaN clip bounds slipped through ``<=`` checks; the
critic's optimizer settings were not checked at all).
"""

from __future__ import annotations

import pytest

from vlmrl.config import ConfigError
from vlmrl.driver.stall import RunStalled, SkippedStepWatch, optimizer_steps
from vlmrl.validate import load_config

QUICKSTART = "config=examples/quickstart.yaml"


def test_optimizer_steps_per_update():
    # 64 rows over 2 workers = 32 each; mini-batches of 8 per worker -> 4 per epoch; 2 epochs -> 8.
    assert optimizer_steps(64, 8, 2, 2) == 8
    # 10 rows on one worker in mini-batches of 4: 4 + 4 + 2 -> 3 steps.
    assert optimizer_steps(10, 4, 1, 1) == 3


def test_three_steps_in_a_row_with_every_update_skipped_fail_the_run():
    watch = SkippedStepWatch(limit=3)
    nan = {"actor/skipped_steps": 2.0, "actor/grad_norm": float("nan")}
    watch.observe(1, nan, {"actor": 2})
    watch.observe(2, nan, {"actor": 2})
    with pytest.raises(RunStalled, match=r"steps 1-3: every actor optimizer step was skipped.*actor/grad_norm=nan"):
        watch.observe(3, nan, {"actor": 2})


def test_a_step_that_trained_resets_the_count():
    watch = SkippedStepWatch(limit=2)
    watch.observe(1, {"actor/skipped_steps": 2.0}, {"actor": 2})
    watch.observe(2, {"actor/skipped_steps": 1.0}, {"actor": 2})  # one of two optimizer steps ran: it trained
    watch.observe(3, {"actor/skipped_steps": 2.0}, {"actor": 2})
    with pytest.raises(RunStalled):
        watch.observe(4, {"actor/skipped_steps": 2.0}, {"actor": 2})


def test_the_critics_skips_count_too():
    # Critic warm-up: the actor made no optimizer step, the critic's were all skipped.
    watch = SkippedStepWatch(limit=2)
    metrics = {"critic/skipped_steps": 1.0, "critic/grad_norm": float("inf")}
    watch.observe(1, metrics, {"critic": 1})
    with pytest.raises(RunStalled, match="every critic optimizer step was skipped.*critic/grad_norm=inf"):
        watch.observe(2, metrics, {"critic": 1})


def test_minus_one_never_stops():
    watch = SkippedStepWatch(limit=-1)
    for step in range(1, 20):
        watch.observe(step, {"actor/skipped_steps": 1.0}, {"actor": 1})


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("worker.actor.clip_ratio_high=.nan", "worker.actor.clip_ratio_high=nan: must be positive"),
        ("worker.actor.clip_ratio_dual=.nan", "worker.actor.clip_ratio_dual=nan: must be greater than 1"),
        ("worker.actor.optim.weight_decay=.nan", "worker.actor.optim.weight_decay=nan: must be 0 or more"),
        ("worker.critic.optim.lr=0", "worker.critic.optim.lr=0.0: must be positive"),
        ("worker.critic.optim.lr=.nan", "worker.critic.optim.lr=nan: must be positive"),
        ("worker.critic.optim.betas=[0.9,1.5]", "worker.critic.optim.betas=[0.9, 1.5]: give two numbers in [0, 1)"),
        ("worker.critic.optim.weight_decay=-1", "worker.critic.optim.weight_decay=-1.0: must be 0 or more"),
        ("worker.critic.max_grad_norm=0", "worker.critic.max_grad_norm=0.0: must be positive"),
        ("worker.critic.cliprange_value=.nan", "worker.critic.cliprange_value=nan: must be positive"),
        ("trainer.max_consecutive_skipped_steps=0", "trainer.max_consecutive_skipped_steps=0: must be at least 1, or -1"),
    ],
)
def test_numbers_that_would_make_updates_nan_are_refused(override, expected):
    with pytest.raises(ConfigError) as refused:
        load_config([QUICKSTART, "algorithm.adv_estimator=gae", "worker.critic.global_batch_size=16", override])
    assert expected in str(refused.value)
