"""Training's reward actors as a pool (``worker.reward.num_workers``): jobs launched on different actors run
at once, each row's scores do not depend on the actor that gave them, and the default size follows the
asynchronous bound.
"""

from __future__ import annotations

import textwrap
import time

import pytest
import ray
from helpers.reward_batch import make_batch
from helpers.shared_cluster import forked_runtime_env

from vlmrl.config import Config, RewardConfig
from vlmrl.driver.scoring import start_scorers
from vlmrl.plan import reward_workers

SLOW = """
    import time

    REWARD_TYPE = "sequential"

    def score(reward_input):
        time.sleep(1.0)
        response = reward_input["response"]
        return {"overall": float(response == reward_input["ground_truth"]), "length": float(len(response))}
"""


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=forked_runtime_env())
    yield
    ray.shutdown()


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "slow_reward.py"
    path.write_text(textwrap.dedent(SLOW))
    return f"{path}:score"


@pytest.mark.parametrize("workers", [1, 2])
def test_two_jobs_overlap_on_two_actors_and_queue_on_one(cluster, spec, workers):
    scorer = start_scorers(RewardConfig(reward_function=spec, num_workers=workers), validation=False).train
    assert len(scorer.reward_managers) == workers and scorer.idle()
    batches = [make_batch(["red"], [3]), make_batch(["blue"], [2])]
    # Each job is one response of a function that sleeps 1 s: 1 s apart from Ray's and the sandbox's overhead.
    # The bounds are a behaviour check, not a timing: two jobs that overlap take about 1 s, two in a queue at
    # least 2 s; 1.8 s leaves 0.8 s of overhead on a busy machine and is still far from the queued 2 s.
    start = time.perf_counter()
    jobs = [scorer.launch(b) for b in batches]
    assert not scorer.idle()  # both actors (or the one) have a job in flight
    rewards = [scorer.collect(job, b) for job, b in zip(jobs, batches)]
    elapsed = time.perf_counter() - start
    if workers == 2:
        assert elapsed < 1.8, f"two jobs on two actors took {elapsed:.2f} s: they did not overlap"
    else:
        assert elapsed >= 2.0, f"two jobs on one actor took {elapsed:.2f} s: they should have queued"
    assert [r.per_sample for r in rewards] == [{"overall": [1.0], "length": [3.0]}, {"overall": [0.0], "length": [4.0]}]
    assert scorer.idle()


def test_rows_score_the_same_on_any_actor(cluster, spec):
    scorer = start_scorers(RewardConfig(reward_function=spec, num_workers=2), validation=False).train
    batch = make_batch(["red", "blue"], [3, 1])
    first, second = scorer.launch(batch), scorer.launch(batch)  # the second goes to the other, idle, actor
    a, b = scorer.collect(first, batch), scorer.collect(second, batch)
    assert a.per_sample == b.per_sample and a.token_level_scores.equal(b.token_level_scores)


@pytest.mark.parametrize(
    ("enable", "eta", "num_workers", "expected"),
    [
        (False, 1, None, 1),  # synchronous: one job per step
        (True, 0, None, 1),  # eta = 0 is the synchronous schedule
        (True, 1, None, 2),
        (True, 3, None, 4),
        (True, 1, 3, 3),  # an explicit count is used as is
        (False, 1, 2, 2),
    ],
)
def test_the_default_pool_is_one_actor_per_step_outstanding(enable, eta, num_workers, expected):
    config = Config()
    config.worker.rollout.async_rl.enable = enable
    config.worker.rollout.async_rl.max_head_offpolicyness = eta
    config.worker.reward.num_workers = num_workers
    assert reward_workers(config) == expected
