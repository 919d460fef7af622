"""Fault: a worker call that never returns (a hung collective, a wedged engine), and a cluster that cannot
place the workers.

Every step call used to wait forever, and the placement-group wait ended after
10 minutes in Ray's generic timeout with the groups left pending. With
``trainer.step_timeout_s`` a late call fails the run naming the call and the
ranks still running; a placement that cannot be met says what was asked for and
what the cluster has, and frees the groups.
"""

from __future__ import annotations

import time

import pytest

import vlmrl.workers.group as group_module
from vlmrl.config import ConfigError
from vlmrl.validate import load_config
from vlmrl.workers.group import ResourcePool, WorkerGroup, WorkerTimeout


def test_a_call_past_step_timeout_s_fails_naming_the_call_and_the_late_ranks(local_ray):
    class _Worker:  # defined here so that Ray pickles it by value (the test module is not on the workers' path)
        def step(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    workers = [local_ray.remote(num_cpus=0)(_Worker).remote() for _ in range(2)]
    group = WorkerGroup.__new__(WorkerGroup)  # the real call path over real actors, without loading models
    group.workers, group.world_size, group.call_timeout = workers, 2, None
    assert group.call(_Worker.step, [(0.0,), (0.0,)]) == [0.0, 0.0]  # the actors are up (slow on a loaded machine)
    group.call_timeout = 2.0
    assert group.call(_Worker.step, [(0.0,), (0.1,)]) == [0.0, 0.1]
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"step call ran past trainer.step_timeout_s=2 s \(ranks still running: \[1\]\)"):
        group.call(_Worker.step, [(0.0,), (600.0,)])
    assert time.monotonic() - start < 30
    for w in workers:
        local_ray.kill(w)


def test_an_impossible_placement_says_what_was_asked_and_frees_the_groups(local_ray, monkeypatch):
    monkeypatch.setattr(group_module, "PLACEMENT_TIMEOUT_S", 3.0)
    with pytest.raises(RuntimeError, match=r"asked for 1 node\(s\) with 4 x \{'CPU': 1\}.*the cluster has 1 node\(s\) \(.*2 CPU, 0 GPU\)"):
        ResourcePool(nnodes=1, per_node=4, device="cpu")
    from ray.util import placement_group_table

    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())


def test_step_timeout_s_is_validated():
    assert load_config(["config=examples/quickstart.yaml"]).trainer.step_timeout_s == 3600.0
    with pytest.raises(ConfigError, match="trainer.step_timeout_s=0.0: must be a positive number of seconds"):
        load_config(["config=examples/quickstart.yaml", "trainer.step_timeout_s=0"])
