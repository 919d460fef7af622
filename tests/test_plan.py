"""The plan's derived flags and counts that several parts of a run read: where the KL term goes, which
models run, how many threads a worker computes with, the loss asynchronous training turns on, and the
start-up text that says what will run."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.configs import CPU, QUICKSTART, problems_of

from vlmrl.config import help_text, parse_config
from vlmrl.plan import (
    Cluster,
    decoupled_loss,
    describe,
    kl_in_loss,
    kl_in_reward,
    resolve,
    rollout_log_probs,
    uses_critic,
    uses_reference,
)
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


# ------------------------------------------------------------------ asynchronous training's defaults

ASYNC = "worker.rollout.async_rl.enable=true"


def test_the_async_switch_alone_validates_and_turns_the_decoupled_loss_on():
    # The default max_head_offpolicyness is 1: tokens one version old need the decoupled loss and vLLM's log-probs.
    config = load_config([QUICKSTART, ASYNC], CPU)
    plan = resolve(config, CPU)
    assert (plan.decoupled_loss, plan.rollout_log_probs) == (True, True)
    assert (decoupled_loss(config), rollout_log_probs(config)) == (True, True)
    # Derived into the plan, never written back into the user's config.
    assert config.worker.actor.use_decoupled_loss is None and config.worker.rollout.calculate_log_probs is None
    assert "decoupled PPO loss" in describe(plan, config)


@pytest.mark.parametrize(
    ("overrides", "decoupled", "log_probs"),
    [
        ([], False, False),  # synchronous: plain PPO, no log-probs from vLLM
        ([ASYNC, "worker.rollout.async_rl.max_head_offpolicyness=0"], False, False),  # eta = 0 is synchronous
        (["worker.rollout.calculate_log_probs=true"], False, True),  # the mismatch metrics alone
        (["worker.actor.use_decoupled_loss=true"], True, True),  # the log-probs follow the loss
        ([ASYNC, "worker.rollout.calculate_log_probs=true"], True, True),
    ],
)
def test_the_decoupled_loss_and_the_rollout_log_probs_follow_eta_unless_set(overrides, decoupled, log_probs):
    config = load_config([QUICKSTART, *overrides], CPU)
    plan = resolve(config, CPU)
    assert (plan.decoupled_loss, plan.rollout_log_probs) == (decoupled, log_probs)


def test_an_explicit_false_under_async_is_still_refused_with_the_reason():
    problems = problems_of(QUICKSTART, ASYNC, "worker.actor.use_decoupled_loss=false")
    (mine,) = [p for p in problems if "use_decoupled_loss=false" in p]
    assert "max_head_offpolicyness=1 with worker.actor.use_decoupled_loss=false" in mine
    assert "corrected for the policy that sampled them" in mine and "max_head_offpolicyness=0" in mine
    # The loss on by default, but vLLM's log-probs turned off by hand: the behaviour log-probs are missing.
    problems = problems_of(QUICKSTART, ASYNC, "worker.rollout.calculate_log_probs=false")
    assert any(
        p.startswith("worker.rollout.calculate_log_probs=false with worker.rollout.async_rl.max_head_offpolicyness=1")
        for p in problems
    ), problems


def test_help_shows_the_decoupled_loss_and_log_probs_default_as_following_eta():
    text = help_text("worker.")
    assert "worker.actor.use_decoupled_loss  bool or null = null" in text
    assert "worker.rollout.calculate_log_probs  bool or null = null" in text
    assert "null: on when worker.rollout.async_rl.enable=true with max_head_offpolicyness > 0" in text


# ------------------------------------------------------------------ the plan says what will run


def plan_text(*overrides: str) -> str:
    """The start-up plan of the quickstart with ``overrides``; only the schema is checked (the text is pure)."""
    config = parse_config([QUICKSTART, *overrides])
    return describe(resolve(config, CPU), config)


def test_the_plan_says_synchronous_one_response_the_reward_function_and_a_constant_rate():
    text = plan_text()
    assert "training: synchronous" in text
    assert "old log-probs from the update's forward (one on-policy update)" in text
    assert "rollouts: one response per sample" in text
    assert "rewards: reward_functions/synthetic_colour.py:compute_score" in text
    assert "learning rate: 0.001, constant, no warm-up" in text


def test_the_plan_under_async_says_eta_the_placement_and_the_loss_not_one_on_policy_update():
    text = plan_text(ASYNC)
    assert "training: asynchronous, eta=1" in text and "colocated" in text
    assert "decoupled PPO loss" in text and "vLLM returns the sampled tokens' log-probs" in text
    assert "(one on-policy update)" not in text
    text = plan_text(ASYNC, "worker.rollout.async_rl.placement=disaggregated", "worker.rollout.async_rl.rollout_workers=2",
                     "worker.rollout.async_rl.max_head_offpolicyness=2", "worker.rollout.async_rl.weight_sync_interval=2")  # fmt: skip
    assert "training: asynchronous, eta=2" in text
    assert "disaggregated (2 rollout server(s) apart from the trainers, weights pushed every 2 update(s)" in text
    assert "rollout servers: 2" in text


def test_the_plan_names_the_multi_turn_settings_and_tools():
    text = plan_text("worker.rollout.multi_turn.enable=true", "worker.rollout.multi_turn.tools=[examples/agent_tools.py:reveal]",
                     "worker.rollout.multi_turn.max_turns=3")  # fmt: skip
    assert "rollouts: multi-turn, up to 3 turns, calls parsed as qwen, tools examples/agent_tools.py:reveal" in text


def test_the_plan_names_the_agent_its_endpoint_and_who_rewards():
    config = parse_config(["config=examples/openai_agent/config.yaml"])
    text = describe(resolve(config, CPU), config)
    assert "rollouts: external agent examples/openai_agent/agent.py:solve" in text
    assert "OpenAI-compatible endpoint on 127.0.0.1:a free port of each worker" in text
    assert "rewards: from the agent, else reward_functions/synthetic_colour.py:compute_score" in text
    config = parse_config(["config=examples/openai_agent/config.yaml", "worker.reward.reward_function="])
    assert "rewards: from the agent (no reward function" in describe(resolve(config, CPU), config)


def test_the_plan_gives_the_cosine_schedules_warm_up_and_floor():
    text = plan_text("worker.actor.optim.lr_scheduler_type=cosine", "worker.actor.optim.lr_warmup_steps=2",
                     "worker.actor.optim.min_lr_ratio=0.1")  # fmt: skip
    assert "learning rate: 0.001, cosine, 2 warm-up step(s), floor 0.1 x lr = 0.0001" in text
    assert "warm-up 0.1 of the steps" in plan_text("worker.actor.optim.lr_warmup_ratio=0.1")


def test_the_plan_names_the_reward_model():
    text = plan_text("worker.reward.reward_model.model_path=/models/judge", "worker.reward.reward_function=")
    assert "reward model: judge /models/judge" in text
    assert "rewards: model_score (the reward model's score)" in text
