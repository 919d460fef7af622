"""Splitting samples by token count: micro-batches under a token budget, and equal shares for data-parallel ranks.

Pure functions on lists of sequence lengths; they return lists of sample
indices. Both use the same greedy rule (longest first, each into the part
with the fewest tokens so far), which keeps the largest part close to the
mean: it is within the longest sequence of it.
"""

from __future__ import annotations

import math


def balanced_partition(lengths: list[int], parts: int, equal_size: bool = False) -> list[list[int]]:
    """``parts`` groups of sample indices whose token sums are as even as the greedy rule makes them.

    Samples are taken longest first (ties by index) and each goes into the
    group with the fewest tokens so far (ties: the lower group); with
    ``equal_size`` a group is closed once it holds ``len(lengths) / parts``
    samples. Each group's indices are in ascending order, and groups are
    ordered by their first index, so a partition of sorted input is stable.

    >>> balanced_partition([5, 1, 4, 2, 3, 3], 2, equal_size=True)
    [[0, 1, 5], [2, 3, 4]]
    """
    if parts < 1:
        raise ValueError(f"parts={parts}: need at least one part")
    if equal_size and len(lengths) % parts:
        raise ValueError(f"{len(lengths)} samples do not split into {parts} equal parts")
    if len(lengths) < parts:
        raise ValueError(f"{len(lengths)} samples cannot fill {parts} non-empty parts")
    capacity = len(lengths) // parts if equal_size else len(lengths)
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        open_parts = [p for p in range(parts) if len(groups[p]) < capacity]
        # An empty group first, so that every group gets at least one sample.
        target = min(open_parts, key=lambda p: (len(groups[p]) > 0, sums[p], p))
        groups[target].append(i)
        sums[target] += lengths[i]
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def parts_for_budget(lengths: list[int], budget: int) -> int:
    """The fewest groups the greedy rule needs to keep every group's tokens within ``budget``.

    A sample longer than the budget can only sit alone, over it (validation
    keeps the budget at least one full sequence, so a run never has one).

    >>> parts_for_budget([5, 1, 4, 2, 3, 3], 6)  # 18 tokens: 3 groups of 6 (5+1, 4+2, 3+3)
    3
    """
    if budget < 1:
        raise ValueError(f"budget={budget}: must be at least 1 token")
    over = [n for n in lengths if n > budget]
    rest = sum(n for n in lengths if n <= budget)
    parts = max(1, len(over) + math.ceil(rest / budget))
    while parts < len(lengths):
        groups = balanced_partition(lengths, parts)
        if all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups):
            return parts
        parts += 1
    return len(lengths)


def seqlen_balance_metrics(lengths: list[int], before: list[list[int]], after: list[list[int]]) -> dict[str, float]:
    """``global_seqlen/*``: tokens per rank before balancing (min, max, mean) and after it (balanced_min/max)."""
    old = [sum(lengths[i] for i in g) for g in before]
    new = [sum(lengths[i] for i in g) for g in after]
    return {
        "global_seqlen/min": float(min(old)),
        "global_seqlen/max": float(max(old)),
        "global_seqlen/minmax_diff": float(max(old) - min(old)),
        "global_seqlen/mean": sum(old) / len(old),
        "global_seqlen/balanced_min": float(min(new)),
        "global_seqlen/balanced_max": float(max(new)),
    }
