"""Token-budget micro-batches and data-parallel balancing, with the greedy steps written out by hand."""

from __future__ import annotations

import pytest

from vlmrl.train.partition import balanced_partition, parts_for_budget, seqlen_balance_metrics


def test_equal_size_balancing_by_hand():
    # lengths 10 9 8 7 2 1 (indices 0..5), 2 ranks of 3 samples each; longest first, to the lighter rank:
    # 10 -> A(10); 9 -> B(9); 8 -> B(17); 7 -> A(17); 2 -> A(19), A full; 1 -> B(18).
    lengths = [10, 9, 8, 7, 2, 1]
    assert balanced_partition(lengths, 2, equal_size=True) == [[0, 3, 4], [1, 2, 5]]
    # Contiguous halves hold 27 and 10 tokens; balanced, 19 and 18.
    metrics = seqlen_balance_metrics(lengths, [[0, 1, 2], [3, 4, 5]], [[0, 3, 4], [1, 2, 5]])
    assert metrics == {
        "global_seqlen/min": 10.0,
        "global_seqlen/max": 27.0,
        "global_seqlen/minmax_diff": 17.0,
        "global_seqlen/mean": 18.5,
        "global_seqlen/balanced_min": 18.0,
        "global_seqlen/balanced_max": 19.0,
    }


def test_free_size_balancing_lets_one_long_sequence_sit_alone():
    # 12 -> A(12); 3 -> B(3); 3 -> C(3); 3 -> B(6); 3 -> C(6): sizes 1, 2, 2.
    assert balanced_partition([3, 12, 3, 3, 3], 3) == [[0, 3], [1], [2, 4]]


def test_one_part_is_the_identity_and_every_part_is_filled():
    assert balanced_partition([4, 1, 7], 1) == [[0, 1, 2]]
    # Three parts for three samples: one each, even with a zero-length one.
    assert balanced_partition([0, 5, 0], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_partition([1, 2], 3)
    with pytest.raises(ValueError, match="equal parts"):
        balanced_partition([1, 2, 3], 2, equal_size=True)


@pytest.mark.parametrize(
    ("lengths", "budget", "parts"),
    [
        # 18 tokens / 6 = 3 parts; greedy: 5 -> A, 4 -> B, 3 -> C, 3 -> C(6), 2 -> B(6), 1 -> A(6).
        ([5, 1, 4, 2, 3, 3], 6, 3),
        ([5, 1, 4, 2, 3, 3], 100, 1),  # everything fits in one
        # 12 tokens / 7 = 2 parts, but no two of these fit together: 3.
        ([4, 4, 4], 7, 3),
        # 12 / 6 = 2 parts; greedy: 6 -> A, 3 -> B, 3 -> B(6): within budget.
        ([6, 3, 3], 6, 2),
        # 10 is over the budget and sits alone; the two 1s share a part.
        ([10, 1, 1], 4, 2),
    ],
)
def test_parts_for_budget(lengths, budget, parts):
    assert parts_for_budget(lengths, budget) == parts
