"""Credit assignment when one rollout spans several training rows (agents traced through the endpoint).

An external agent's rollout becomes one row or several (``trace_aggregation``:
one per call, or one per stretch of calls that extend each other). Treating
each row as a sample would skew both the advantage and the loss: a rollout
with three rows would count three times in its group's mean and std, and
would weigh three times as much in the loss. So, as in Agent Lightning:

* ``rollout_advantages``: the group estimator runs on one entry per rollout,
  grouped by task, and each rollout's advantage is broadcast to every trained
  token of its rows.
* ``rollout_row_shares``: each row's share of its rollout, the row weights
  of ``loss_avg_mode=per_rollout_mean`` (``vlmrl.algos.losses.aggregate_loss``),
  under which every rollout weighs the same whatever its number of rows and
  tokens; ``per_rollout_weights`` writes the same loss as per-token weights.
* ``trim_to_mini_batches``: rows to drop to fill whole mini-batches, rows of
  groups that teach nothing first.
* ``MULTI_ROW_UNSUPPORTED``: the estimators that cannot work this way, and why.

Rows are described by parallel per-row sequences (rollout id, task id,
reward) so the maths stays tensors and lists, with no record type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from vlmrl.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from vlmrl.algos.common import ConfigEnum, masked_sum


class TraceAggregation(ConfigEnum):
    """How a rollout's recorded LLM calls become training rows (``algorithm.trace_aggregation``).

    Defined here, below the config, so the schema can use it; ``vlmrl.rollout.agents.traces`` does the work.
    """

    trajectory = "trajectory"
    """As few rows as possible: a call whose prompt extends the row so far continues it."""
    transition = "transition"
    """One row per call."""


MULTI_ROW_UNSUPPORTED: dict[AdvantageEstimator, str] = {
    AdvantageEstimator.remax: (
        "ReMax's baseline is the reward of a greedy rollout of the same task; an agent's or a workflow's "
        "rollout is its own program, so there is no greedy rollout to sample, only greedy single calls"
    ),
    AdvantageEstimator.gae: (
        "GAE bootstraps a critic's values along one token sequence; a rollout split into rows breaks that "
        "sequence, so the rows before the last would see no reward and get advantages from the critic alone"
    ),
    AdvantageEstimator.reinforce_plus_plus: (
        "REINFORCE++ discounts the reward back along each row's tokens and whitens over tokens; with the "
        "reward on a rollout's last row only, its earlier rows get return 0, and rollouts with more rows "
        "weigh more in the whitening"
    ),
}
"""Estimators validation refuses when a rollout may span several rows, with the reason to print.

The others (grpo, grpo_passk, rloo, reinforce_plus_plus_baseline) compare
outcome rewards within a group, which ``rollout_advantages`` runs on one entry
per rollout.
"""


def _check_mask(rollout_ids: Sequence[str], response_mask: torch.Tensor) -> None:
    bs = len(rollout_ids)
    if response_mask.dim() != 2 or response_mask.shape[0] != bs:
        raise ValueError(f"response_mask must be (bs, L) with bs = {bs}; got {tuple(response_mask.shape)}")


def _rollout_index(
    rollout_ids: Sequence[str], group_ids: Sequence[int], rewards: Sequence[float]
) -> tuple[list[str], list[int], list[int], list[float]]:
    """``(rollouts, rollout_of_row, group_of_rollout, reward_of_rollout)``, rollouts in first-seen order.

    Raises ValueError naming the rollout when its rows disagree on task or reward.
    """
    if not len(rollout_ids) == len(group_ids) == len(rewards):
        raise ValueError(
            f"one rollout id, task id and reward per row; got {len(rollout_ids)}, {len(group_ids)} and {len(rewards)}"
        )
    position: dict[str, int] = {}
    rollout_of_row: list[int] = []
    groups: list[int] = []
    scores: list[float] = []
    for row, (rid, gid, reward) in enumerate(zip(rollout_ids, group_ids, rewards)):
        if rid not in position:
            position[rid] = len(groups)
            groups.append(int(gid))
            scores.append(float(reward))
        r = position[rid]
        if int(gid) != groups[r] or float(reward) != scores[r]:
            raise ValueError(
                f"rollout {rid}: row {row} has task {gid} and reward {reward}, but an earlier row of the same "
                f"rollout has task {groups[r]} and reward {scores[r]}; every row of a rollout must share both"
            )
        rollout_of_row.append(r)
    return list(position), rollout_of_row, groups, scores


def rollout_advantages(
    rollout_ids: Sequence[str],
    group_ids: Sequence[int],
    rewards: Sequence[float],
    response_mask: torch.Tensor,
    estimator: AdvantageEstimator = AdvantageEstimator.grpo,
    **knobs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout-level advantages, broadcast to every row of each rollout.

    With ``s_r`` the reward of rollout ``r`` and ``G(r)`` the rollouts of its task,
    the estimator sees one sequence per rollout, a single token holding ``s_r``::

        A_r = estimator({s_r' : r' in G(r)})   e.g. GRPO: (s_r - mean_G s) / (std_G s + eps)
        A_{i,t} = A_{r(i)}                     on every valid token t of every row i of r

    so a rollout with three rows counts once in its group's statistics.

    Args:
        rollout_ids: ``(bs,)`` each row's rollout.
        group_ids: ``(bs,)`` each row's task (the prompt the rollouts answer); one rollout's rows share it.
        rewards: ``(bs,)`` each row's rollout reward; one rollout's rows share it.
        response_mask: ``(bs, L)`` 1 on the trained tokens of each row.
        estimator: an outcome group estimator; those in ``MULTI_ROW_UNSUPPORTED`` are refused.
        knobs: the estimator's keyword arguments (``norm_adv_by_std``, ``eps``).

    Returns:
        ``(advantages, returns)``, both ``(bs, L)`` float32, 0 off the mask.
    """
    estimator = AdvantageEstimator(estimator)
    if estimator in MULTI_ROW_UNSUPPORTED:
        raise ValueError(
            f"{estimator.value} cannot be used when a rollout spans rows: {MULTI_ROW_UNSUPPORTED[estimator]}"
        )
    _check_mask(rollout_ids, response_mask)
    _, rollout_of_row, groups, scores = _rollout_index(rollout_ids, group_ids, rewards)
    # One single-token sequence per rollout: its score is its reward.
    per_rollout_rewards = torch.tensor(scores, dtype=torch.float64)[:, None]  # (R, 1), rewards as given
    ones = torch.ones_like(per_rollout_rewards)  # (R, 1)
    adv, ret = ADVANTAGE_ESTIMATORS[estimator].fn(
        per_rollout_rewards, ones, torch.tensor(groups, dtype=torch.long), **knobs
    )  # (R, 1) each
    index = torch.tensor(rollout_of_row, dtype=torch.long)  # (bs,)
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=adv.dtype)
    advantages = torch.where(valid, adv[index, 0][:, None], zero)  # (bs, L)
    returns = torch.where(valid, ret[index, 0][:, None], zero)  # (bs, L)
    return advantages.float(), returns.float()


def rollout_token_counts(rollout_ids: Sequence[str], response_mask: torch.Tensor) -> dict[str, int]:
    """Trained tokens of each rollout, summed over its rows: the ``n_r`` of ``per_rollout_weights``."""
    per_row = masked_sum(torch.ones_like(response_mask, dtype=torch.long), response_mask, dim=-1)  # (bs,)
    counts: dict[str, int] = {}
    for rid, n in zip(rollout_ids, per_row.tolist()):
        counts[rid] = counts.get(rid, 0) + int(n)
    return counts


def rollout_row_shares(rollout_ids: Sequence[str], row_tokens: Sequence[int]) -> torch.Tensor:
    """Each row's share of its rollout: the row weights ``s_i`` of ``loss_avg_mode=per_rollout_mean``.

    With ``n_i`` the trained tokens of row ``i``, ``N_r`` the sum of ``n_i``
    over the rows of rollout ``r`` and ``k_r`` their number::

        s_i = n_i / N_{r(i)}      when N_r > 0
        s_i = 1 / k_{r(i)}        when rollout r has no trained token

    Every rollout's shares sum to 1, so in ``aggregate_loss`` each rollout
    weighs 1 whatever its number of rows and tokens, and a row that is a
    rollout of its own gets 1 (seq_mean_token_mean). In per-token form
    ``s_i / n_i = 1 / N_r`` on every trained token of ``r``: ``per_rollout_weights``
    up to the constant ``1 / R``. A rollout without trained tokens keeps its
    weight in the denominator, as seq_mean_token_mean counts an empty row.

    The shares must be computed over every row the loss will see, before the
    rows are split into micro-batches and workers: the training update gathers
    the rows of all workers (``vlmrl.train.update_loop.rollout_shares``).

    Args:
        rollout_ids: ``(bs,)`` each row's rollout.
        row_tokens: ``(bs,)`` each row's trained tokens ``n_i`` (its response mask's sum).

    Returns:
        ``(bs,)`` float64.
    """
    if len(rollout_ids) != len(row_tokens):
        raise ValueError(f"one rollout id and one token count per row; got {len(rollout_ids)} and {len(row_tokens)}")
    tokens: dict[str, int] = {}
    rows: dict[str, int] = {}
    for rid, n in zip(rollout_ids, row_tokens):
        if n < 0:
            raise ValueError(f"rollout {rid}: a row with {n} trained tokens")
        tokens[rid] = tokens.get(rid, 0) + int(n)
        rows[rid] = rows.get(rid, 0) + 1
    shares = [int(n) / tokens[rid] if tokens[rid] else 1.0 / rows[rid] for rid, n in zip(rollout_ids, row_tokens)]
    return torch.tensor(shares, dtype=torch.float64)


def per_rollout_weights(
    rollout_ids: Sequence[str],
    response_mask: torch.Tensor,
    num_rollouts: int | None = None,
    rollout_tokens: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """Per-token loss weights under which every rollout weighs the same (``per_rollout_mean``).

    With ``R`` the rollouts of the global mini-batch and ``n_r`` the trained
    tokens of rollout ``r`` over all its rows::

        w_{i,t} = m_{i,t} / (R * n_{r(i)})        loss = sum_{i,t} w_{i,t} l_{i,t}

    so each rollout's weights sum to ``1 / R`` whether it is one row of 12
    tokens or three rows of 4, and the loss is the mean over rollouts of each
    rollout's token mean. Computed once over the global mini-batch (pass its
    ``num_rollouts`` and ``rollout_tokens`` when these are only some of its
    rows, e.g. one worker's or one micro-batch's), the weights make any split
    into micro-batches and workers sum to the same loss.

    Args:
        rollout_ids: ``(bs,)`` each row's rollout.
        response_mask: ``(bs, L)`` 1 on trained tokens.
        num_rollouts: ``R``; default: the distinct rollouts among ``rollout_ids``.
        rollout_tokens: ``n_r`` by rollout id; default: counted from these rows (``rollout_token_counts``).

    Returns:
        ``(bs, L)`` float32, 0 off the mask.
    """
    _check_mask(rollout_ids, response_mask)
    counts = rollout_token_counts(rollout_ids, response_mask) if rollout_tokens is None else rollout_tokens
    R = len(set(rollout_ids)) if num_rollouts is None else num_rollouts
    if R <= 0:
        raise ValueError(f"num_rollouts must be positive; got {R}")
    per_row = []
    for rid in rollout_ids:
        if rid not in counts:
            raise ValueError(f"rollout {rid} has no entry in rollout_tokens")
        # A rollout without trained tokens has an all-zero mask: its weight 1 / (R * 1) is never used.
        per_row.append(1.0 / (R * max(int(counts[rid]), 1)))
    w = torch.tensor(per_row, dtype=torch.float64)[:, None].expand(response_mask.shape)  # (bs, L)
    return torch.where(response_mask.bool(), w, torch.zeros((), dtype=w.dtype)).float()


def trim_to_mini_batches(
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[int],
    mini_batch_size: int,
) -> tuple[list[int], int]:
    """The rows to keep so that their number is a multiple of ``mini_batch_size``, and how many were dropped.

    Rows are dropped in this order, each class from the end of the batch:

    1. rows of groups whose advantage is 0 on every trained token of every row
       (as ``zero_advantage_groups`` counts them): they carry no policy gradient;
    2. other rows whose own advantage is 0 everywhere;
    3. the rest.

    Advantages are exact zeros here, as GRPO gives a group whose rewards are
    equal. The caller computes ``per_rollout_weights`` after trimming, on the
    rows kept.

    Args:
        advantages: ``(bs, L)``.
        response_mask: ``(bs, L)``.
        group_ids: ``(bs,)`` each row's task.
        mini_batch_size: rows per mini-batch (positive).

    Returns:
        ``(kept, dropped)``: the kept row indices in ascending order, and ``bs - len(kept)``.
    """
    if mini_batch_size <= 0:
        raise ValueError(f"mini_batch_size must be positive; got {mini_batch_size}")
    bs = len(group_ids)
    if advantages.shape != response_mask.shape or advantages.shape[0] != bs:
        raise ValueError(
            f"advantages and response_mask must both be (bs, L) with bs = {bs}; got "
            f"{tuple(advantages.shape)} and {tuple(response_mask.shape)}"
        )
    n_drop = bs % mini_batch_size
    if n_drop == 0:
        return list(range(bs)), 0
    row_zero = (masked_sum((advantages != 0).float(), response_mask, dim=-1) == 0).tolist()  # (bs,)
    group_zero: dict[int, bool] = {}
    for gid, zero in zip(group_ids, row_zero):
        group_zero[int(gid)] = group_zero.get(int(gid), True) and zero
    # Sort key: lower class first, then later rows first.
    rank = [(0 if group_zero[int(g)] else 1 if z else 2, -i) for i, (g, z) in enumerate(zip(group_ids, row_zero))]
    order = sorted(range(bs), key=lambda i: rank[i])
    dropped = set(order[:n_drop])
    return [i for i in range(bs) if i not in dropped], n_drop
