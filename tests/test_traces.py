"""Unit tests of vlmrl.rollout.agents.traces: an agent's recorded LLM calls turned into training rows.

Token ids are small made-up integers; ``decode`` writes them out joined by
spaces, so a mismatch's decoded views can be checked exactly.
"""

import dataclasses

import pytest
import torch

from vlmrl.records import Media
from vlmrl.rollout.agents.traces import Call, TraceAggregation, aggregate


def decode(ids):
    return " ".join(str(i) for i in ids)


def call(index, prompt, response, log_probs=None, version=0, rollout="a", **kw):
    log_probs = [-0.1 * (k + 1) for k in range(len(response))] if log_probs is None else log_probs
    return Call(rollout, index, prompt, response, log_probs, version, **kw)


def append_only_calls(rollout="a"):
    """Three calls of an append-only chat: each prompt is the previous prompt + response + new turn."""
    return [
        call(0, [1, 2, 3], [4, 5], [-0.1, -0.2], version=3, rollout=rollout),
        call(1, [1, 2, 3, 4, 5, 6, 7], [8], [-0.3], version=4, rollout=rollout),
        call(2, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [-0.4, -0.5], version=4, rollout=rollout),
    ]


# ------------------------------------------------------------------ trajectory aggregation


def test_append_only_calls_make_one_row_per_rollout():
    # Rollout a's calls extend each other: one row. Its tokens are the last context, [1..11]:
    #   prompt 1 2 3 | response 4 5 | observation 6 7 | response 8 | observation 9 | response 10 11
    # so mask 0 0 0 1 1 0 0 1 0 1 1, the response log-probs in place (0 elsewhere), versions 3 on the first
    # response, 4 on the later ones, -1 on context; turns end at 4, 7 and 10.
    # Rollout b made one call: its own row.
    out = aggregate(
        {"a": append_only_calls(), "b": [call(0, [1, 2], [3], [-0.7], version=4, rollout="b")]},
        TraceAggregation.trajectory,
        decode,
    )
    assert [r.rollout_id for r in out.rows] == ["a", "b"]
    a, b = out.rows
    assert a.token_ids == list(range(1, 12))
    assert a.prompt_length == 3
    assert a.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert a.log_probs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3, 0, -0.4, -0.5])
    assert a.versions == [-1, -1, -1, 3, 3, -1, -1, 4, -1, 4, 4]
    assert a.turn_ends == [4, 7, 10]
    assert a.calls == [0, 1, 2] and a.call_span == (0, 2)
    assert b.token_ids == [1, 2, 3] and b.loss_mask == [0, 0, 1] and b.log_probs == pytest.approx([0, 0, -0.7])
    assert out.mismatches == [] and out.metrics()["trace/mismatches"] == 0


def test_template_that_drops_reasoning_splits_the_row_and_counts_the_mismatch():
    # Call 0 answers "50 51 3" (50 51: reasoning). The template of call 1 strips the reasoning from the
    # history, so its prompt 1 2 3 6 does not start with the row 1 2 50 51 3: they part at index 2.
    # Call 1 starts a new row; call 2 extends call 1 (prompt = 1 2 3 6 + response 7 + new 8) and joins it.
    calls = [
        call(0, [1, 2], [50, 51, 3]),
        call(1, [1, 2, 3, 6], [7]),
        call(2, [1, 2, 3, 6, 7, 8], [9]),
    ]
    out = aggregate({"a": calls}, "trajectory", decode)
    assert [r.calls for r in out.rows] == [[0], [1, 2]]
    assert out.rows[1].token_ids == [1, 2, 3, 6, 7, 8, 9]
    assert out.rows[1].loss_mask == [0, 0, 0, 0, 1, 0, 1]
    assert len(out.mismatches) == 1 and out.metrics()["trace/mismatches"] == 1
    m = out.mismatches[0]
    assert (m.rollout_id, m.call_index, m.reason, m.diverges_at) == ("a", 1, "tokens", 2)
    assert m.previous == "1 2 50 51 3"
    assert m.current == "1 2 3 6"


def test_prompt_shorter_than_the_row_is_a_mismatch():
    # The agent restarted its conversation: call 1's prompt is a strict prefix of the row, not an extension.
    calls = [call(0, [1, 2], [3, 4]), call(1, [1, 2], [5])]
    out = aggregate({"a": calls}, "trajectory", decode)
    assert [r.calls for r in out.rows] == [[0], [1]]
    assert out.mismatches[0].diverges_at == 2  # the prompt ends where the row goes on


def test_same_tokens_other_images_do_not_continue_the_row():
    # Equal placeholder tokens can hide different pixels: the images already in the row must lead the new
    # call's images. Call 1 keeps image "x" and adds "y": it continues. Call 2 shows "z" where "x" was.
    calls = [
        call(0, [1, 9, 2], [3], images=("x",)),
        call(1, [1, 9, 2, 3, 9, 4], [5], images=("x", "y")),
        call(2, [1, 9, 2, 3, 9, 4, 5, 6], [7], images=("z", "y")),
    ]
    out = aggregate({"a": calls}, "trajectory", decode)
    assert [r.calls for r in out.rows] == [[0, 1], [2]]
    assert out.rows[0].images == ("x", "y")
    assert [m.reason for m in out.mismatches] == ["images"]


def test_another_temperature_starts_a_new_row():
    # A row's log-probs are recomputed at one temperature, so a call sampled at another cannot join it.
    calls = [call(0, [1], [2], temperature=1.0), call(1, [1, 2, 3], [4], temperature=0.7)]
    out = aggregate({"a": calls}, "trajectory", decode)
    assert [r.calls for r in out.rows] == [[0], [1]]
    assert [m.reason for m in out.mismatches] == ["temperature"]
    assert out.rows[1].temperature == 0.7


def test_calls_are_ordered_by_index_not_by_arrival():
    c0, c1, c2 = append_only_calls()
    in_order = aggregate({"a": [c0, c1, c2]}, "trajectory", decode)
    shuffled = aggregate({"a": [c2, c0, c1]}, "trajectory", decode)
    assert len(shuffled.rows) == 1 and shuffled.mismatches == []
    assert shuffled.rows[0] == in_order.rows[0]
    transition = aggregate({"a": [c2, c0, c1]}, "transition", decode)
    assert [r.calls for r in transition.rows] == [[0], [1], [2]]


# ------------------------------------------------------------------ transition aggregation


def test_transition_makes_one_row_per_call():
    # Each call is its own row: its whole prompt is context (mask 0), its response is trained.
    out = aggregate({"a": append_only_calls()}, TraceAggregation.transition, decode)
    assert [r.calls for r in out.rows] == [[0], [1], [2]]
    second = out.rows[1]
    assert second.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert second.prompt_length == 7
    assert second.loss_mask == [0] * 7 + [1]
    assert second.log_probs == pytest.approx([0] * 7 + [-0.3])
    assert second.versions == [-1] * 7 + [4]
    assert second.turn_ends == [7]
    assert out.mismatches == []


# ------------------------------------------------------------------ counts and checks


def test_rollout_without_calls_gives_no_row_and_is_counted():
    out = aggregate({"a": [], "b": [call(0, [1], [2], rollout="b")]}, "trajectory", decode)
    assert [r.rollout_id for r in out.rows] == ["b"]
    assert out.empty_rollouts == ["a"]
    assert out.metrics()["trace/empty_rollouts"] == 1


def test_row_without_response_tokens_is_dropped_and_counted():
    # Call 0 returned nothing (stopped at once); after the split by call 1, its row has no trained token.
    calls = [call(0, [1, 2], [], finish_reason="length"), call(1, [7], [8])]
    out = aggregate({"a": calls}, "trajectory", decode)
    assert [r.calls for r in out.rows] == [[1]]
    assert out.untrained_rows == 1


def test_empty_response_still_continues_the_context():
    # An empty response leaves the context as it was; the next call extends it and no turn end is added.
    calls = [call(0, [1, 2], []), call(1, [1, 2, 3], [4])]
    out = aggregate({"a": calls}, "trajectory", decode)
    assert [r.calls for r in out.rows] == [[0, 1]]
    assert out.rows[0].loss_mask == [0, 0, 0, 1] and out.rows[0].turn_ends == [3]


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="rollout b was filed under rollout a"):
        aggregate({"a": [call(0, [1], [2], rollout="b")]}, "trajectory", decode)
    with pytest.raises(ValueError, match="repeated call indices"):
        aggregate({"a": [call(0, [1], [2]), call(0, [1, 2], [3])]}, "trajectory", decode)
    with pytest.raises(ValueError, match="2 response tokens but 1 log-probs"):
        call(0, [1], [2, 3], [-0.1])
    with pytest.raises(ValueError, match="not a valid TraceAggregation"):
        aggregate({}, "per_call", decode)


# ------------------------------------------------------------------ the Trajectory record


def test_row_converts_to_a_trajectory():
    row = aggregate({"a": append_only_calls()}, "trajectory", decode).rows[0]
    t = row.to_trajectory(group_id=7, ground_truth="42")
    assert t.token_ids == row.token_ids and t.loss_mask == row.loss_mask
    assert t.log_probs == row.log_probs and t.versions == row.versions
    assert t.prompt_length == 3 and t.group_id == 7 and t.sample_id == "a:0"
    assert t.turn_ends == [4, 7, 10] and t.num_turns == 3 and t.turn_rewards == [0.0, 0.0, 0.0]
    assert t.ground_truth == "42" and t.stop_reason == "stop"
    assert t.rollout_id == "a" and t.rollout == "a"  # per_rollout_mean weighs the rollout's rows as one
    # Text positions: 0..n-1 on all three axes.
    assert torch.equal(t.position_ids, torch.arange(11).expand(3, 11))


def test_row_with_images_needs_the_family_positions_and_its_media():
    row = aggregate({"a": [call(0, [1, 9, 2], [3], images=("x",))]}, "trajectory", decode).rows[0]
    with pytest.raises(ValueError, match="1 images but 0 media"):
        row.to_trajectory(group_id=0)
    with pytest.raises(ValueError, match="needs the model family's position ids"):
        row.to_trajectory(group_id=0, media=[Media("image", 1, None)])
    t = row.to_trajectory(group_id=0, media=[Media("image", 1, None)], position_ids=torch.zeros(3, 4, dtype=torch.long))
    assert t.media[0].offset == 1


def test_rewards_the_agent_reported_for_its_calls_become_the_rows_turn_rewards():
    # Rollout a's calls make one row with turns ending at 4, 7 and 10 (above); the agent reported 0.5 for call 0
    # and -1 for call 2, so the row's turn rewards are [0.5, 0, -1] and its trajectory carries them, one per turn
    # end (the scorer adds each on its turn's last token). Under transition aggregation each call's row has its own.
    calls = [dataclasses.replace(c, reward=r) for c, r in zip(append_only_calls(), [0.5, 0.0, -1.0])]
    (row,) = aggregate({"a": calls}, TraceAggregation.trajectory, decode).rows
    assert row.turn_ends == [4, 7, 10] and row.turn_rewards == [0.5, 0.0, -1.0]
    assert row.to_trajectory(group_id=0).turn_rewards == [0.5, 0.0, -1.0]
    rows = aggregate({"a": calls}, TraceAggregation.transition, decode).rows
    assert [r.turn_rewards for r in rows] == [[0.5], [0.0], [-1.0]]
    # A call with an empty response has no turn of its own: its reward goes to the row's previous turn.
    empty = [calls[0], call(1, [1, 2, 3, 4, 5, 6], [], [], reward=2.0)]
    (row,) = aggregate({"a": empty}, TraceAggregation.trajectory, decode).rows
    assert row.turn_rewards == [2.5]
