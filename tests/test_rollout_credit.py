"""Unit tests of vlmrl.algos.rollout_credit: advantages, loss weights and trimming when rollouts span rows.

The batch used throughout: two tasks, five rollouts, nine rows (L = 3), the
rows of each rollout scattered through the batch::

    row  rollout  task  reward  loss mask   trained tokens
     0     b       0      0     1 0 0       1
     1     c       1      2     1 1 0       2
     2     a       0      1     1 1 0       2
     3     b       0      0     1 1 0       2
     4     d       1      0     1 1 1       3
     5     c       1      2     1 0 0       1
     6     b       0      0     1 1 1       3
     7     e       1      1     1 0 0       1
     8     c       1      2     1 1 1       3

Rollouts a, d and e have one row; b and c have three.
"""

import math

import pytest
import torch

from vlmrl.algos import AdvantageEstimator, grpo_advantages
from vlmrl.algos.rollout_credit import (
    MULTI_ROW_UNSUPPORTED,
    per_rollout_weights,
    rollout_advantages,
    rollout_token_counts,
    trim_to_mini_batches,
)
from vlmrl.rollout.agents.traces import Call, aggregate

ROLLOUTS = ["b", "c", "a", "b", "d", "c", "b", "e", "c"]
TASKS = [0, 1, 0, 0, 1, 1, 0, 1, 1]
REWARDS = [0.0, 2.0, 1.0, 0.0, 0.0, 2.0, 0.0, 1.0, 2.0]
MASK = torch.tensor(
    [[1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]],
    dtype=torch.float32,
)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def per_row(values):
    """Each row's rollout value broadcast onto its mask."""
    return torch.tensor([values[r] for r in ROLLOUTS], dtype=torch.float64)[:, None] * MASK.double()


# ------------------------------------------------------------------ rollout-level advantage


def test_grpo_runs_on_one_entry_per_rollout_grouped_by_task():
    # Task 0: rewards a = 1, b = 0. mean 0.5; unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5) = 0.70711
    #   A_a = 0.5 / (0.70711 + 1e-6) = 0.70711 (to 1e-6), A_b = -0.70711.
    # Task 1: rewards c = 2, d = 0, e = 1. mean 1; std sqrt((1 + 1 + 0) / 2) = 1
    #   A_c = 1 / (1 + 1e-6), A_d = -1 / (1 + 1e-6), A_e = 0.
    # Per row (the wrong way) task 0 would be rewards 0, 1, 0, 0: mean 0.25, std 0.5, A_a = 1.5, A_b = -0.5:
    # b's three rows would pull the mean towards its own reward.
    adv, ret = rollout_advantages(ROLLOUTS, TASKS, REWARDS, MASK)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    t = 1.0 / (1.0 + 1e-6)
    expected = per_row({"a": s, "b": -s, "c": t, "d": -t, "e": 0.0})
    close(adv, expected)
    close(ret, expected)
    assert adv.dtype == torch.float32


def test_rollout_advantages_reuse_the_estimator_on_one_sequence_per_rollout():
    # The same numbers as grpo_advantages on the five rollouts a..e as single-token sequences.
    scores = torch.tensor([[1.0], [0.0], [2.0], [0.0], [1.0]])  # a b c d e
    direct, _ = grpo_advantages(scores, torch.ones_like(scores), torch.tensor([0, 0, 1, 1, 1]), norm_adv_by_std=False)
    adv, _ = rollout_advantages(ROLLOUTS, TASKS, REWARDS, MASK, norm_adv_by_std=False)
    # Dr.GRPO: A = s - mean: a 0.5, b -0.5, c 1, d -1, e 0.
    close(direct[:, 0], [0.5, -0.5, 1.0, -1.0, 0.0])
    close(adv, per_row(dict(zip("abcde", direct[:, 0].tolist()))))


def test_rows_of_one_rollout_must_share_reward_and_task():
    rewards = list(REWARDS)
    rewards[6] = 0.5  # b's third row
    with pytest.raises(ValueError, match=r"rollout b: row 6 has task 0 and reward 0.5.*reward 0.0"):
        rollout_advantages(ROLLOUTS, TASKS, rewards, MASK)
    tasks = list(TASKS)
    tasks[5] = 0  # c's second row
    with pytest.raises(ValueError, match="rollout c: row 5 has task 0"):
        rollout_advantages(ROLLOUTS, tasks, REWARDS, MASK)


@pytest.mark.parametrize("estimator", sorted(MULTI_ROW_UNSUPPORTED))
def test_estimators_that_need_one_row_per_rollout_are_refused(estimator):
    with pytest.raises(ValueError, match=f"{estimator.value} cannot be used when a rollout spans rows"):
        rollout_advantages(ROLLOUTS, TASKS, REWARDS, MASK, estimator)


def test_refused_set_is_remax_gae_and_reinforce_plus_plus_and_the_rest_run():
    assert set(MULTI_ROW_UNSUPPORTED) == {
        AdvantageEstimator.remax,
        AdvantageEstimator.gae,
        AdvantageEstimator.reinforce_plus_plus,
    }
    for estimator in set(AdvantageEstimator) - set(MULTI_ROW_UNSUPPORTED):
        adv, _ = rollout_advantages(ROLLOUTS, TASKS, REWARDS, MASK, estimator)
        assert adv.shape == MASK.shape and torch.isfinite(adv).all()
        # One value per rollout on all its rows.
        for rid in "abcde":
            rows = [i for i, r in enumerate(ROLLOUTS) if r == rid]
            values = {round(float(v), 6) for i in rows for v in adv[i][MASK[i].bool()]}
            assert len(values) == 1, (estimator, rid, values)


# ------------------------------------------------------------------ per_rollout_mean


def test_per_rollout_weights_give_each_rollout_one_share():
    # Trained tokens: a 2; b 1 + 2 + 3 = 6; c 2 + 1 + 3 = 6; d 3; e 1. R = 5 rollouts.
    # w = 1 / (R n_r): a 1/10, b 1/30, c 1/30, d 1/15, e 1/5. Each rollout's weights sum to 1/5; all to 1.
    assert rollout_token_counts(ROLLOUTS, MASK) == {"b": 6, "c": 6, "a": 2, "d": 3, "e": 1}
    w = per_rollout_weights(ROLLOUTS, MASK)
    close(w, per_row({"a": 1 / 10, "b": 1 / 30, "c": 1 / 30, "d": 1 / 15, "e": 1 / 5}))
    for rid in "abcde":
        close(w[[i for i, r in enumerate(ROLLOUTS) if r == rid]].sum(), 0.2)
    close(w.sum(), 1.0)


def test_per_rollout_loss_is_the_mean_over_rollouts_of_their_token_means():
    # With the per-token loss equal to v_r on every token of rollout r (a 1, b 2, c 3, d 4, e 5),
    # sum w l = (1 + 2 + 3 + 4 + 5) / 5 = 3, whatever the rows and token counts.
    w = per_rollout_weights(ROLLOUTS, MASK)
    loss = per_row({"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 5.0})
    close((w * loss).sum(), 3.0)
    # And for any loss: the mean over rollouts of each rollout's token mean over all its rows.
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    token_means = []
    for rid in "abcde":
        rows = [i for i, r in enumerate(ROLLOUTS) if r == rid]
        token_means.append(loss[rows][MASK[rows].bool()].mean())
    close((w * loss).sum(), torch.stack(token_means).mean())


def test_per_rollout_weights_split_exactly_over_micro_batches_with_the_global_counts():
    # Rows 0-3 on one micro-batch (or worker), rows 4-8 on another: with the global R and n_r passed,
    # the two pieces are exactly the full batch's weights, so the summed losses equal the full loss.
    counts = rollout_token_counts(ROLLOUTS, MASK)
    full = per_rollout_weights(ROLLOUTS, MASK)
    first = per_rollout_weights(ROLLOUTS[:4], MASK[:4], num_rollouts=5, rollout_tokens=counts)
    second = per_rollout_weights(ROLLOUTS[4:], MASK[4:], num_rollouts=5, rollout_tokens=counts)
    assert torch.equal(torch.cat([first, second]), full)
    # Counted from a micro-batch alone, b's rows 0 and 3 would weigh 1/(3 * 3) each token: not the share.
    alone = per_rollout_weights(ROLLOUTS[:4], MASK[:4])
    assert not torch.equal(alone, full[:4])


def test_spreading_a_rollout_over_more_rows_keeps_its_total_weight():
    # Rollout x makes three append-only calls: one row under "trajectory", three under "transition"
    # (which repeats the earlier responses as context, mask 0). Its trained tokens are the same 2 + 1 + 2 = 5
    # either way, so each trained token weighs 1 / (2 * 5) and x's total is 1/2; rollout y's is 1/2 too.
    calls = {
        "x": [
            Call("x", 0, [1, 2], [3, 4], [-0.1, -0.2], 0),
            Call("x", 1, [1, 2, 3, 4, 5], [6], [-0.3], 0),
            Call("x", 2, [1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.4, -0.5], 0),
        ],
        "y": [Call("y", 0, [1], [2, 3, 4], [-0.1, -0.1, -0.1], 0)],
    }
    totals = {}
    for mode in ("trajectory", "transition"):
        rows = aggregate(calls, mode, str).rows
        L = max(len(r.loss_mask) for r in rows)
        mask = torch.tensor([r.loss_mask + [0] * (L - len(r.loss_mask)) for r in rows], dtype=torch.float32)
        ids = [r.rollout_id for r in rows]
        w = per_rollout_weights(ids, mask)
        totals[mode] = {rid: float(w[[i for i, r in enumerate(ids) if r == rid]].sum()) for rid in "xy"}
        close(w[mask.bool() & torch.tensor([r == "x" for r in ids])[:, None]], torch.full((5,), 0.1))
    assert len(aggregate(calls, "transition", str).rows) == 4
    assert totals["trajectory"] == pytest.approx({"x": 0.5, "y": 0.5})
    assert totals["transition"] == pytest.approx(totals["trajectory"])


def test_per_rollout_weights_check_their_inputs():
    with pytest.raises(ValueError, match="rollout z has no entry"):
        per_rollout_weights(["z"], MASK[:1], num_rollouts=1, rollout_tokens={"a": 2})
    with pytest.raises(ValueError, match="bs = 2"):
        per_rollout_weights(["a", "b"], MASK)


# ------------------------------------------------------------------ trimming to mini-batches


def test_trimming_drops_rows_of_zero_advantage_groups_first():
    # Seven rows, mini-batches of 4: 7 % 4 = 3 rows go.
    #   group 0 (rows 1, 5): advantage 0 everywhere, a group that teaches nothing -> dropped first, row 5 then 1;
    #   group 1 (rows 0, 2, 4): row 4 alone has advantage 0 -> dropped next;
    #   group 2 (rows 3, 6): kept.
    adv = torch.tensor([[0.5, 0.5], [0.0, 0.0], [-0.5, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [1, 1]])
    groups = [1, 0, 1, 2, 1, 0, 2]
    kept, dropped = trim_to_mini_batches(adv, mask, groups, 4)
    assert (kept, dropped) == ([0, 2, 3, 6], 3)
    # Two rows to drop (7 % 5): both of group 0, although row 4 (advantage 0, in group 1) comes after row 1.
    assert trim_to_mini_batches(adv, mask, groups, 5) == ([0, 2, 3, 4, 6], 2)
    # One row to drop: the latest row of the zero-advantage group.
    assert trim_to_mini_batches(adv[:6], mask[:6], groups[:6], 5) == ([0, 1, 2, 3, 4], 1)
    # A whole number of mini-batches already: nothing goes.
    assert trim_to_mini_batches(adv[:4], mask[:4], groups[:4], 2) == ([0, 1, 2, 3], 0)


def test_trimming_ignores_advantages_off_the_mask_and_falls_back_to_the_latest_rows():
    # Row 1's only non-zero advantage (9) sits on padding, so its group 0 teaches nothing: 4 % 3 = 1, row 1 goes.
    adv = torch.tensor([[1.0, 0.0], [0.0, 9.0], [2.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 0], [1, 0], [1, 0]])
    assert trim_to_mini_batches(adv, mask, [1, 0, 2, 3], 3) == ([0, 2, 3], 1)
    # Without row 1 nothing has advantage 0: the latest row goes (3 % 2 = 1).
    assert trim_to_mini_batches(adv[[0, 2, 3]], mask[:3], [1, 2, 3], 2) == ([0, 1], 1)


def test_trimming_the_fixture_drops_the_rollout_at_its_group_mean():
    # No group of the fixture teaches nothing, but e's advantage is 0 (its reward is task 1's mean):
    # 9 % 4 = 1 row goes, row 7.
    adv, _ = rollout_advantages(ROLLOUTS, TASKS, REWARDS, MASK)
    assert trim_to_mini_batches(adv, MASK, TASKS, 4) == ([0, 1, 2, 3, 4, 5, 6, 8], 1)
    with pytest.raises(ValueError, match="mini_batch_size must be positive"):
        trim_to_mini_batches(adv, MASK, TASKS, 0)
