"""Multi-turn trajectories on the driver: rewards where they were earned, the reward inputs, and the metrics.

Pure logic on hand-made trajectories (no engine): the placing of outcome and turn rewards, what the
estimators make of them, and what a reward function and the loggers get.
"""

from __future__ import annotations

import torch

from vlmrl import algos
from vlmrl.driver.metrics import agent_metrics
from vlmrl.driver.scoring import add_turn_rewards, place_scores, reward_inputs
from vlmrl.driver.validation import conversation_text
from vlmrl.records import Trajectory
from vlmrl.records.views import to_batch


def _conversation(group: int, index: int, turns: list[int], obs: int, turn_rewards: list[float]) -> Trajectory:
    """A 3-token prompt, then model turns of the given lengths with ``obs`` observation tokens between them."""
    ids, mask, ends = [1, 2, 3], [0, 0, 0], []
    for k, n in enumerate(turns):
        ids += [10 + k] * n
        mask += [1] * n
        ends.append(len(ids) - 1)
        if k + 1 < len(turns):
            ids += [99] * obs
            mask += [0] * obs
    n = len(ids)
    return Trajectory(
        token_ids=ids, prompt_length=3, loss_mask=mask, position_ids=torch.arange(n).expand(3, n).clone(),
        group_id=group, sample_id=f"{group}:{index}", temperature=1.0, versions=[-1] * n,
        turn_rewards=turn_rewards, turn_ends=ends, stop_reason="done",
        messages=[{"role": "assistant", "content": "look"}, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]},
                  {"role": "assistant", "content": "red"}],
        tool_calls=[{"name": "zoom", "status": "ok", "seconds": 0.1, "turn": 0}], prompt_media=0,
    )  # fmt: skip


def _batch():
    a = _conversation(0, 0, [2, 3], obs=4, turn_rewards=[0.25, 0.25])  # response: 2 + 4 + 3 = 9 tokens
    b = _conversation(0, 1, [2], obs=4, turn_rewards=[0.25])
    return to_batch([a, b], max_prompt_length=4, max_response_length=12, pad_token_id=0)


def test_outcome_on_the_last_model_token_and_turn_rewards_at_each_turns_end():
    batch = _batch()
    scores = add_turn_rewards(place_scores([1.0, 0.0], batch.response_mask), batch)
    # Row a: turn 0 is response columns 0-1, the observation 2-5, turn 1 columns 6-8.
    # Turn rewards at columns 1 and 8; the outcome 1.0 also at column 8 (the last trained token).
    assert scores[0].tolist() == [0, 0.25, 0, 0, 0, 0, 0, 0, 1.25, 0, 0, 0]
    assert scores[1].tolist() == [0, 0.25] + [0] * 10
    # The observation tokens are not trained, and an <|im_end|>-like token inside does not end the mask.
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]


def test_group_estimators_score_a_trajectory_as_its_outcome_plus_its_turn_rewards():
    batch = _batch()
    scores = add_turn_rewards(place_scores([1.0, 0.0], batch.response_mask), batch)
    # s_a = 1 + 0.25 + 0.25 = 1.5, s_b = 0 + 0.25 = 0.25; mean 0.875; unbiased std over two values is
    # |1.5 - 0.25| / sqrt(2) = 0.8839; A_a = 0.625 / 0.8839 = 1/sqrt(2), A_b = -1/sqrt(2), on trained tokens only.
    adv, _ = algos.grpo_advantages(scores, batch.response_mask, batch.group_ids)
    expected = 2**-0.5
    assert torch.allclose(adv[0][batch.response_mask[0].bool()], torch.full((5,), expected), atol=1e-5)
    assert torch.allclose(adv[1][batch.response_mask[1].bool()], torch.full((2,), -expected), atol=1e-5)
    assert (adv[0][~batch.response_mask[0].bool()] == 0).all()


def test_reward_inputs_carry_the_conversation():
    batch = _batch()
    x = reward_inputs(batch)[0]
    assert x["num_turns"] == 2 and x["turn_rewards"] == [0.25, 0.25] and x["stop_reason"] == "done"
    assert x["tool_calls"][0]["name"] == "zoom" and x["messages"][-1] == {"role": "assistant", "content": "red"}
    assert x["response_length"] == 5  # the model's tokens only


def test_agent_metrics():
    batch = _batch()
    m = agent_metrics(batch)
    assert m["agent/turns/mean"] == 1.5 and m["agent/turns/max"] == 2
    assert m["agent/tool_calls/mean"] == 1.0 and m["agent/tool_calls/zoom"] == 1.0
    assert m["agent/stop/done"] == 1.0 and m["agent/tool/success_rate"] == 1.0
    # Model tokens over all tokens after the prompt: (5 + 2) / (9 + 2).
    assert abs(m["action/ratio"] - 7 / 11) < 1e-9
    assert m["agent/observation_tokens/mean"] == 2.0
    assert "[assistant] look\n[user] [image]x\n[assistant] red" == conversation_text(batch.trajectories[0])


def test_made_up_tool_names_are_a_rate_not_metric_keys_and_the_mismatch_rate_is_over_checked_trajectories():
    batch = _batch()
    a, b = batch.trajectories
    # The model misspelt its call twice in b: both are counted under one key, not one key per spelling.
    b.tool_calls = [{"name": "zom", "status": "unknown_tool", "turn": 0}, {"name": "zooom", "status": "unknown_tool", "turn": 0}]
    a.render_mismatch, b.render_mismatch = True, None  # the loop checks the first trajectory of each group only
    m = agent_metrics(batch)
    assert m["agent/tool_calls/zoom"] == 0.5 and m["agent/tool/unknown_tool_rate"] == 2 / 3
    assert [k for k in m if k.startswith("agent/tool_calls/") and k != "agent/tool_calls/mean"] == ["agent/tool_calls/zoom"]
    assert m["agent/render_mismatch_rate"] == 1.0  # 1 of 1 checked, not 1 of 2
    a.render_mismatch = None
    assert "agent/render_mismatch_rate" not in agent_metrics(batch)


def test_external_agent_rows_log_only_the_metrics_that_mean_something_for_them():
    # Rows as the endpoint path makes them (vlmrl.workflows.openai_agent): recorded calls aggregated into rows, each row
    # a Trajectory with its rollout's id. vlmrl ran no tool for them and did not decide when they stopped (a
    # row's stop reason is its last call's finish reason), so no tool, stop-reason or render-mismatch key.
    from vlmrl.rollout.agents.traces import Call, aggregate

    calls = {
        "0:0#0": [Call("0:0#0", 0, [1, 2], [3, 4], [-0.1, -0.2], 0), Call("0:0#0", 1, [1, 2, 3, 4, 5], [6], [-0.3], 0)],
        "0:1#0": [Call("0:1#0", 0, [1, 2], [7], [-0.1], 0, finish_reason="length")],
    }
    rows = aggregate(calls, "trajectory", str).rows
    batch = to_batch([r.to_trajectory(group_id=0) for r in rows], max_prompt_length=4, max_response_length=8, pad_token_id=0)
    m = agent_metrics(batch)
    assert not [k for k in m if k.startswith(("agent/stop/", "agent/tool", "agent/render_mismatch"))], sorted(m)
    # What does mean something: calls (turns) per row, the trained share of what follows the prompt.
    assert m["agent/turns/mean"] == 1.5 and m["agent/turns/max"] == 2
    assert m["action/ratio"] == 4 / 5 and m["agent/observation_tokens/mean"] == 0.5


def test_rewards_an_agent_reported_count_once_for_their_whole_rollout_under_per_rollout_credit():
    """Two rollouts of one task; rollout r1 made two rows (its calls did not extend each other), and its agent
    reported 0.5 for a call of its first row; rollout r2 made one row and reported nothing.

    Scores: r1's reward 1.0 plus 0.5 = 1.5; r2's 0.0. GRPO over the two rollouts (not three rows): mean 0.75,
    unbiased std |1.5 - 0| / sqrt(2); A_r1 = 0.75 / 1.0607 = 1/sqrt(2), A_r2 = -1/sqrt(2), on every trained token
    of each rollout's rows. Without the turn's reward both rows of r1 would carry 1.0 and r1 would score 1.0.
    """
    import dataclasses

    from vlmrl.config.schema import AlgorithmConfig
    from vlmrl.driver.advantage import AdvantageStage
    from vlmrl.driver.scoring import Rewards

    def row(sample, rollout, rewards):
        t = _conversation(0, sample, [2], obs=0, turn_rewards=rewards)
        return dataclasses.replace(t, rollout_id=rollout)

    rows = [row(0, "r1", [0.5]), row(1, "r1", [0.0]), row(2, "r2", [0.0])]
    batch = to_batch(rows, max_prompt_length=4, max_response_length=4, pad_token_id=0)
    overall = [1.0, 1.0, 0.0]  # each row carries its rollout's reward
    scores = add_turn_rewards(place_scores(overall, batch.response_mask), batch)
    Rewards(scores, {"overall": overall}, {}).assign_to(batch)
    out = AdvantageStage(AlgorithmConfig(), kl_in_reward=False, per_rollout=True)(batch)
    expected = torch.tensor([2**-0.5, 2**-0.5, -(2**-0.5)])
    assert torch.allclose(out.advantages[:, :2], expected[:, None].expand(3, 2), atol=1e-5)
    # The reported reward sits on its turn's last token in the token-level rewards.
    assert out.token_level_rewards[0, :2].tolist() == [0.0, 1.5]
