"""``worker.rollout.agent`` is checked before Ray starts, and its rollouts are scored once per rollout.

The config: the agent and its hooks are loaded (a broken file, a bad signature, an unknown hook are one
problem each, naming the key), and the settings an external agent's rows cannot work with (estimators that
need one row per rollout, online filtering, the KL in the reward, the tool loop at the same time) are refused
with the reason, all in one report.

The scores: a rollout is scored once, by its agent's reward or by the reward function on its last row, and
the score goes to every row of the rollout; the means count rollouts, not rows.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.configs import CPU, problems_of

from vlmrl.driver.metrics import reduce_reward_metrics
from vlmrl.driver.rollout_scores import RolloutScoring
from vlmrl.records import Trajectory
from vlmrl.validate import load_config

DEMO = "config=examples/openai_agent/config.yaml"
AGENTS = "tests/fixtures/agents"


def test_the_demo_config_validates():
    config = load_config([DEMO], CPU)
    assert config.worker.rollout.agent == "examples/openai_agent/agent.py:solve"
    assert config.algorithm.trace_aggregation.value == "trajectory"


def test_every_agent_problem_is_reported_at_once(tmp_path):
    broken = tmp_path / "broken_agent.py"
    broken.write_text("raise RuntimeError('import-time failure')\n")
    problems = problems_of(
        DEMO,
        f"worker.rollout.agent={broken}:solve",
        "worker.rollout.agent_hooks.on_failed=tests/fixtures/agents/hooks.py:missing",
        "algorithm.adv_estimator=remax",
        "algorithm.online_filtering=true",
        "worker.rollout.agent_options.max_concurrency=0",
        "worker.rollout.agent_options.timeout=0",
        "worker.rollout.agent_options.port=70000",
        "worker.rollout.agent_options.max_tokens_per_call=1000",
    )
    text = "\n".join(problems)
    assert "broken_agent.py failed to load: RuntimeError: import-time failure" in text
    assert "worker.rollout.agent_hooks.on_failed" in text and "'missing'" in text
    assert "algorithm.adv_estimator=remax with worker.rollout.agent" in text and "greedy rollout" in text
    assert "algorithm.online_filtering=true with worker.rollout.agent" in text
    assert "agent_options.max_concurrency=0: must be at least 1" in text
    assert "agent_options.timeout=0" in text
    assert "agent_options.port=70000" in text
    assert "agent_options.max_tokens_per_call=1000" in text and "data.max_response_length=48" in text


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algorithm.adv_estimator=gae", "GAE bootstraps"),
        ("algorithm.adv_estimator=reinforce_plus_plus", "REINFORCE++ discounts"),
        ("algorithm.use_kl_loss=false", "the KL is in the reward"),
        ("worker.rollout.multi_turn.enable=true", "are both set"),
        ("worker.rollout.agent=tests/fixtures/agents/bad_signatures.py:no_arguments", "worker.rollout.agent"),
    ],
)
def test_settings_an_agents_rows_cannot_work_with_are_refused(override, expected):
    assert any(expected in p for p in problems_of(DEMO, override)), problems_of(DEMO, override)


def test_hooks_without_an_agent_are_refused():
    problems = problems_of(
        "config=examples/quickstart.yaml", "worker.rollout.agent_hooks.on_failed=tests/fixtures/agents/hooks.py:on_failed"
    )
    assert any("worker.rollout.agent_hooks is set (on_failed) but worker.rollout.agent is not" in p for p in problems)


# ------------------------------------------------------------------ scores per rollout


def _row(rollout: str, agent_reward: float | None = None) -> Trajectory:
    return Trajectory(
        token_ids=[1, 2, 3], prompt_length=1, loss_mask=[0, 1, 1], position_ids=torch.zeros(3, 3, dtype=torch.long),
        group_id=0, sample_id=f"{rollout}:{id(object())}", temperature=1.0, rollout_id=rollout,
        agent_reward=agent_reward,
    )  # fmt: skip


def test_a_rollout_is_scored_once_on_its_last_row_and_its_score_reaches_every_row():
    # Rows: a, a, b, c, c, c. Rollout b's agent returned 0.5; a and c are left to the reward function.
    rows = [_row("a"), _row("a"), _row("b", 0.5), _row("c"), _row("c"), _row("c")]
    scoring = RolloutScoring.of(rows)
    assert scoring.last_rows == [1, 2, 5]
    assert scoring.rows_to_score == [1, 5]  # a's last row and c's; b is scored by its agent
    # The function scored a: overall 1 (accuracy 1), c: overall 0 (accuracy 0).
    per_rollout = scoring.per_rollout({"overall": [1.0, 0.0], "accuracy": [1.0, 0.0]})
    assert per_rollout["overall"] == [1.0, 0.5, 0.0]
    assert per_rollout["accuracy"][0] == 1.0 and math.isnan(per_rollout["accuracy"][1])
    per_row = scoring.per_row(per_rollout)
    assert per_row["overall"] == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
    # Means over rollouts: overall (1 + 0.5 + 0) / 3 = 0.5, accuracy over the two function-scored ones = 0.5.
    # Over rows the overall mean would have been (1 + 1 + 0.5) / 6 = 0.417: rollout a counted twice.
    means = reduce_reward_metrics(per_rollout, prefix="reward")
    assert means == {"reward/overall": 0.5, "reward/accuracy": 0.5}


def test_rows_of_a_rollout_with_different_agent_rewards_are_refused():
    with pytest.raises(ValueError, match="rollout a: row 1 carries agent reward 1.0 but an earlier row carries 0.0"):
        RolloutScoring.of([_row("a", 0.0), _row("a", 1.0)])


def test_when_every_agent_returned_its_reward_the_function_scores_nothing():
    scoring = RolloutScoring.of([_row("a", 1.0), _row("b", 0.0)])
    assert scoring.rows_to_score == []
    assert scoring.per_row(scoring.per_rollout({"overall": []}))["overall"] == [1.0, 0.0]


def test_a_failed_rollout_leaves_its_group_and_the_baseline_is_the_others():
    # Task 7 had three rollouts; the third agent raised and made no row (on_failure=drop). The group's GRPO
    # statistics are over the two that finished, rewards 1 and 0: mean 0.5, std (unbiased) sqrt(0.5) = 0.7071,
    # so A = +-0.5 / 0.7071 = +-0.7071. Had the failure been scored 0 instead, the group would be 1, 0, 0:
    # mean 1/3, std 0.5774, A = 1.1547 for the first: the failure would have moved the others' advantages.
    from vlmrl.algos import rollout_advantages

    mask = torch.ones(2, 3)
    advantages, _ = rollout_advantages(["7:0", "7:1"], [7, 7], [1.0, 0.0], mask)
    assert advantages[:, 0].tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)


# ------------------------------------------------------------------ an agent that gives every reward


def test_an_agent_that_gives_every_reward_needs_no_reward_function():
    config = load_config([DEMO, "worker.reward.reward_function="], CPU)
    assert config.worker.reward.reward_function == ""
    # Without an agent an empty reward function is still refused.
    problems = problems_of("config=examples/quickstart.yaml", "worker.reward.reward_function=")
    assert any(p.startswith("worker.reward.reward_function is empty") for p in problems), problems


def _agent_batch(*rows: Trajectory):
    from vlmrl.records.views import to_batch

    return to_batch(list(rows), max_prompt_length=2, max_response_length=4, pad_token_id=0)


def test_without_a_reward_function_the_agents_rewards_are_the_scores():
    from vlmrl.config import RewardConfig
    from vlmrl.driver.scoring import start_scorers

    scorer = start_scorers(RewardConfig(reward_function=""), validation=False).train  # no reward actor starts
    batch = _agent_batch(_row("a", 1.0), _row("a", 1.0), _row("b", 0.0))
    job = scorer.launch(batch)
    assert job.ref is None
    rewards = scorer.collect(job, batch)
    assert rewards.per_sample["overall"] == [1.0, 1.0, 0.0]


def test_without_a_reward_function_a_rollout_its_agent_left_unscored_fails_naming_it():
    from vlmrl.config import RewardConfig
    from vlmrl.driver.scoring import start_scorers
    from vlmrl.reward.function import RewardFunctionError

    scorer = start_scorers(RewardConfig(reward_function=""), validation=False).train
    with pytest.raises(RewardFunctionError, match=r"rollout b: its agent returned no reward \(None\), and "
                       r"worker.reward.reward_function is not set"):  # fmt: skip
        scorer.launch(_agent_batch(_row("a", 1.0), _row("b"), _row("b")))


def test_the_endpoints_bounds_are_checked_at_once_naming_their_keys():
    key = "worker.rollout.agent_options"
    problems = problems_of(
        DEMO,
        f"{key}.max_images_per_call=0",
        f"{key}.max_image_pixels=1000",
        f"{key}.max_call_pixels=999",
        f"{key}.max_concurrency=8",
        f"{key}.max_connections=4",
        f"{key}.header_timeout=0",
        f"{key}.body_timeout=-1",
    )
    text = "\n".join(problems)
    assert f"{key}.max_images_per_call=0: must be at least 1" in text  # 0 no longer means "no limit"
    assert f"{key}.max_call_pixels=999 is below {key}.max_image_pixels=1000" in text
    assert f"{key}.max_connections=4 is below {key}.max_concurrency=8" in text
    assert f"{key}.header_timeout=0.0: must be a positive" in text and f"{key}.body_timeout=-1.0: must be" in text
    load_config([DEMO], CPU)  # the defaults pass
