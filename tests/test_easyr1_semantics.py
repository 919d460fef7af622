"""Where vlmrl follows EasyR1's and verl's defaults and step counts: the step the actor starts at under
``trainer.critic_warmup`` and validation before training on by default."""

from __future__ import annotations

import pytest
from helpers.configs import CPU, QUICKSTART
from helpers.runs import REPO

from vlmrl.config import Config
from vlmrl.plan import resolve
from vlmrl.validate import load_config


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    monkeypatch.chdir(REPO)


def plan_of(*overrides: str):
    config = load_config([QUICKSTART, *overrides], CPU)
    return resolve(config, CPU), config


@pytest.mark.parametrize(
    ("critic_warmup", "actor_steps", "updates_by_4"),
    [
        # EasyR1 and verl count steps from 1 and train the actor when critic_warmup <= global_step:
        (0, [1, 2, 3, 4], 4),  # 0 <= 1: from the first step
        (1, [1, 2, 3, 4], 4),  # 1 <= 1: the same as 0
        (2, [2, 3, 4], 3),  # step 1 trains the critic alone
        (3, [3, 4], 2),  # steps 1 and 2 train the critic alone
    ],
)
def test_critic_warmup_starts_the_actor_at_the_step_easyr1_and_verl_start_it(critic_warmup, actor_steps, updates_by_4):
    plan, _ = plan_of("algorithm.adv_estimator=gae", "worker.critic.global_batch_size=16",
                      f"trainer.critic_warmup={critic_warmup}")  # fmt: skip
    assert [s for s in range(1, 5) if plan.trains_actor(s)] == actor_steps
    # Each step that trains the actor syncs the engine once: a resume at step 4 continues at that version.
    assert plan.actor_updates_by(4) == updates_by_4
    # A step that trains no actor has no update to give the old log-probs: the pass runs.
    assert [s for s in range(1, 5) if plan.old_log_probs_from_forward(s, plan.samples_per_step)] == actor_steps


def test_validation_before_training_is_on_by_default_as_in_easyr1_and_verl():
    # EasyR1's TrainerConfig (verl/trainer/config.py) and verl's ppo_trainer.yaml: val_before_train = True.
    assert Config().trainer.val_before_train is True
