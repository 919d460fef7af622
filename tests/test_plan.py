"""The plan's derived flags and counts that several parts of a run read: where the KL term goes, which
models run, and how many threads a worker computes with."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.configs import CPU, QUICKSTART

from vlmrl.plan import Cluster, kl_in_loss, kl_in_reward, resolve, uses_critic, uses_reference
from vlmrl.validate import load_config

REPO = Path(__file__).resolve().parents[1]
GAE = ["algorithm.adv_estimator=gae", "worker.critic.global_batch_size=16"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    # The quickstart names its format prompt and reward function relative to the repo root.
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize(
    ("overrides", "in_loss", "in_reward", "reference"),
    [
        ([], True, False, True),  # the quickstart: GRPO's KL loss
        (["algorithm.use_kl_loss=false"], False, True, True),  # PPO's KL penalty in the reward
        (["algorithm.disable_kl=true"], False, False, False),  # no KL, no reference model
        (["algorithm.disable_kl=true", "algorithm.use_kl_loss=false"], False, False, False),  # disable_kl wins
    ],
)
def test_the_kl_term_is_in_the_loss_or_in_the_reward_or_nowhere(overrides, in_loss, in_reward, reference):
    config = load_config([QUICKSTART, *overrides], CPU)
    plan = resolve(config, CPU)
    assert (plan.kl_in_loss, plan.kl_in_reward, plan.use_reference) == (in_loss, in_reward, reference)
    # The predicates validation uses before a plan exists give the same answers.
    assert (kl_in_loss(config), kl_in_reward(config), uses_reference(config)) == (in_loss, in_reward, reference)


@pytest.mark.parametrize(("overrides", "critic"), [([], False), (GAE, True)])
def test_a_critic_is_used_exactly_when_the_estimator_needs_values(overrides, critic):
    config = load_config([QUICKSTART, *overrides], CPU)
    assert resolve(config, CPU).use_critic is critic is uses_critic(config)


@pytest.mark.parametrize(
    ("cpus", "workers_per_node", "nnodes", "threads"),
    [
        (2, 1, 1, 2),  # the quickstart on a 2-core machine: every core
        (16, 4, 1, 4),  # a node's cores shared by its workers
        (16, 2, 2, 8),  # per node, not per run: two nodes of two workers each get half a node's cores
        (2, 4, 1, 1),  # fewer cores than workers: at least one thread each
    ],
)
def test_threads_per_worker_is_a_share_of_one_nodes_cores(cpus, workers_per_node, nnodes, threads):
    cluster = Cluster(gpus=0, cpus=cpus)
    config = load_config(
        [QUICKSTART, f"trainer.n_gpus_per_node={workers_per_node}", f"trainer.nnodes={nnodes}"], cluster
    )
    assert resolve(config, cluster).threads_per_worker == threads
