"""Fault: a start that never completes. Workers that never finish loading, and reward actors the cluster cannot
place, used to wait forever; now each wait is bounded by ``trainer.start_timeout_s`` and the error says what
did not start and what the cluster has.
"""

from __future__ import annotations

import time

import pytest

from vlmrl.config import Config, ConfigError, RewardConfig
from vlmrl.driver.scoring import start_scorers
from vlmrl.reward.function import RewardFunctionError
from vlmrl.validate import load_config
from vlmrl.workers.group import ResourcePool, WorkerGroup


def test_workers_that_never_finish_starting_fail_the_start_and_are_stopped(local_ray):
    class _Loading:  # a constructor that never returns, like a model load that hangs
        def __init__(self):
            time.sleep(600)

        def pad_token_id(self) -> int:
            return 0

    group = WorkerGroup.__new__(WorkerGroup)  # the real wait over real actors, without loading models
    group.pool = ResourcePool(nnodes=1, per_node=1, device="cpu")
    group.workers = [local_ray.remote(num_cpus=0)(_Loading).remote()]
    config = Config()
    config.trainer.start_timeout_s = 3.0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not finish starting .* within trainer.start_timeout_s=3 s; the cluster has"):
        group._wait_started(config)
    assert time.monotonic() - start < 60
    from ray.util import placement_group_table

    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())  # the bundles are free again


def test_reward_actors_the_cluster_cannot_place_fail_naming_their_cpus(local_ray):
    reward = RewardConfig(reward_function="reward_functions/synthetic_colour.py:compute_score", num_cpus=8)
    start = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"did not start within trainer.start_timeout_s=3 s: each asks for "
                                                  r"worker.reward.num_cpus=8 CPU\(s\) and the cluster has 2 free"):  # fmt: skip
        start_scorers(reward, validation=False, timeout=3.0)
    assert time.monotonic() - start < 60


def test_start_timeout_s_is_validated():
    with pytest.raises(ConfigError, match="trainer.start_timeout_s=0.0: must be a positive number of seconds"):
        load_config(["config=examples/quickstart.yaml", "trainer.start_timeout_s=0"])
