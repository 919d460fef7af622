"""The reward managers as the trainer runs them: Ray actors behind ``Scorer``.

Covers what only shows through Ray: the inputs the driver builds from a Batch
(images and the row's extra fields included) reach the function; scores land on
the last valid token and sub-scores and timeouts come back as metrics; an
error raised in the actor arrives as itself; an actor that dies (here killed
from user code) is a clear error rather than a hang; training and validation
get separate actors.
"""

from __future__ import annotations

import textwrap
import time

import pytest
import ray
import torch
from helpers.reward_batch import make_batch
from helpers.shared_cluster import forked_runtime_env

from vlmrl.config import RewardConfig
from vlmrl.reward.function import RewardFunctionError
from vlmrl.config import TimeoutPolicy
from vlmrl.driver.scoring import start_scorers

REWARDS = """
    import os, signal, time

    REWARD_TYPE = "sequential"

    def score(reward_input, weight=1.0):
        r = reward_input["response"]
        if r == "kill the manager":
            os.kill(os.getppid(), signal.SIGKILL)  # the reward process's parent is the actor
            time.sleep(60)
        if r == "raise":
            raise ValueError("bad response")
        if r == "sleep":
            time.sleep(60)
        if r == "slow red":
            time.sleep(3)
            r = "red"
        images = reward_input["images"]
        return {
            "overall": weight * float(r == reward_input["ground_truth"]),
            "image_width": float(images[0].width) if images else -1.0,
            "difficulty": float(reward_input["difficulty"]),
        }
"""


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=forked_runtime_env())
    yield
    ray.shutdown()


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return f"{path}:score"


def test_scores_land_on_the_last_valid_token_and_sub_scores_become_metrics(cluster, spec):
    reward = RewardConfig(reward_function=spec, reward_function_kwargs={"weight": 2.0})
    scorers = start_scorers(reward, validation=True)
    assert scorers.val is not None and scorers.val.reward_manager != scorers.train.reward_manager
    batch = make_batch(["red", "blue", "red", "red"], [1, 4, 6, 2])
    rewards = scorers.train.collect(scorers.train.launch(batch), batch)
    assert rewards.metrics == {
        "reward/overall": pytest.approx((2 + 0 + 2 + 2) / 4),
        "reward/image_width": pytest.approx((28 - 1 + 28 - 1) / 4),  # images reached the function as PIL
        "reward/difficulty": pytest.approx((0 + 1 + 2 + 3) / 4),  # so did the row's extra column
        "reward/timeouts": 0,
    }
    expected = torch.zeros(4, 6)
    expected[0, 0], expected[2, 5], expected[3, 1] = 2.0, 2.0, 2.0
    assert torch.equal(rewards.token_level_scores, expected)
    assert rewards.per_sample["difficulty"] == [0.0, 1.0, 2.0, 3.0]
    # Scoring leaves the batch alone; assigning the result is the caller's one visible step.
    assert batch.token_level_scores is None and batch.reward_metrics == {}
    rewards.assign_to(batch)
    assert torch.equal(batch.token_level_scores, expected) and batch.reward_metrics["difficulty"][3] == 3.0
    # The validation actor scores the same way, on its own.
    val_batch = make_batch(["red", "red"], [2, 2])
    assert (
        scorers.val.collect(scorers.val.launch(val_batch), val_batch, prefix="val/reward").metrics["val/reward/overall"]
        == 2.0
    )


def test_launch_returns_at_once_so_the_trainer_can_work_while_the_function_runs(cluster, spec):
    scorer = start_scorers(RewardConfig(reward_function=spec), validation=False).train
    batch = make_batch(["slow red"], [1])
    start = time.monotonic()
    job = scorer.launch(batch)
    launched = time.monotonic() - start
    assert launched < 1.5  # the 3 s call runs in the actor meanwhile
    assert scorer.collect(job, batch).metrics["reward/overall"] == 1.0
    assert time.monotonic() - start >= 3.0


def test_an_error_in_the_function_arrives_as_a_reward_function_error(cluster, spec):
    scorer = start_scorers(RewardConfig(reward_function=spec), validation=False).train
    batch = make_batch(["red", "raise"], [1, 1])
    with pytest.raises(RewardFunctionError) as info:
        scorer.collect(scorer.launch(batch), batch)
    assert "raised on sample 1 (data source 'colours'): ValueError: bad response" in str(info.value)
    assert "RayTaskError" not in str(info.value)


def test_timeouts_are_counted_in_the_metrics(cluster, spec):
    reward = RewardConfig(reward_function=spec, timeout=1.0, on_timeout=TimeoutPolicy.zero)
    scorer = start_scorers(reward, validation=False).train
    batch = make_batch(["red", "sleep", "red"], [1, 1, 1])
    rewards = scorer.collect(scorer.launch(batch), batch)
    assert rewards.metrics["reward/timeouts"] == 1
    assert rewards.per_sample["overall"] == [1.0, 0.0, 1.0]


def test_kwargs_that_do_not_fit_fail_when_the_actors_start(cluster, spec):
    with pytest.raises(RewardFunctionError, match="reward_function_kwargs=.*do not fit"):
        start_scorers(RewardConfig(reward_function=spec, reward_function_kwargs={"wieght": 2.0}), validation=False)


def test_a_dead_reward_actor_is_a_clear_error_not_a_hang(cluster, spec):
    scorer = start_scorers(RewardConfig(reward_function=spec), validation=False).train
    batch = make_batch(["red", "kill the manager"], [1, 1])
    job = scorer.launch(batch)
    with pytest.raises(RewardFunctionError) as info:
        scorer.collect(job, batch)
    message = str(info.value)
    assert f"the reward manager actor running {spec} died" in message
    # Later calls on the dead actor fail the same way rather than wait.
    with pytest.raises(RewardFunctionError, match="died"):
        scorer.collect(scorer.launch(batch), batch)
