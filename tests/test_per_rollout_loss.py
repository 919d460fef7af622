"""``loss_avg_mode=per_rollout_mean``: every rollout weighs the same, however many rows and tokens it has.

An external agent's rollout may become several training rows (one per LLM
call, or one per stretch of calls). The mode weighs row ``i`` by its share of
its rollout, ``s_i = n_i / N_r`` (``rollout_credit.rollout_row_shares``), and
``aggregate_loss`` takes ``sum_i s_i (sum_t m l) / n_i / sum_i s_i``; over
whole rollouts that is ``1/R sum_r 1/N_r sum_{i in r, t} m l``.

The hand example used throughout: three rollouts in five rows, L = 3 (99 sits
on padding and must never count)::

    row  rollout  loss          mask    n_i  sum_t m l  share s_i
     0     a      1  2 99       1 1 0    2       3        2/5
     1     b      4 99 99       1 0 0    1       4        1/3
     2     a      6  6  6       1 1 1    3      18        3/5
     3     c      2  4 99       1 1 0    2       6        1
     4     b      8 10 99       1 1 0    2      18        2/3

    rollout a: N = 5, token sum 21, mean 21/5
    rollout b: N = 3, token sum 22, mean 22/3
    rollout c: N = 2, token sum  6, mean 3
    per_rollout_mean = (21/5 + 22/3 + 3) / 3 = (63 + 110 + 45) / 15 / 3 = 218/45

against seq_mean_token_mean = (3/2 + 4 + 6 + 3 + 9) / 5 = 4.7 (rows, not rollouts)
and token_mean = 49/10.

Then the training path: the update loop's gradient with micro-batches equals
the full batch's, and two gloo ranks holding a rollout's rows between them
give the one-process gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from helpers.ranks import start_ranks
from vlmrl.algos import LossAvgMode, PolicyLossParams, aggregate_loss, aggregation_weight, policy_loss_ppo_clip
from vlmrl.algos.rollout_credit import per_rollout_weights, rollout_row_shares
from vlmrl.records import Batch, Trajectory
from vlmrl.records.views import to_batch
from vlmrl.train.micro_batches import MicroBatching
from vlmrl.train.update_loop import rollout_shares, run_epochs

MODE = LossAvgMode.per_rollout_mean

IDS = ["a", "b", "a", "c", "b"]
LOSS = torch.tensor(
    [
        [1.0, 2.0, 99.0],
        [4.0, 99.0, 99.0],
        [6.0, 6.0, 6.0],
        [2.0, 4.0, 99.0],
        [8.0, 10.0, 99.0],
    ],
    dtype=torch.float64,
)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
SHARES = [2 / 5, 1 / 3, 3 / 5, 1.0, 2 / 3]


def shares_of(ids, mask) -> torch.Tensor:
    return rollout_row_shares(ids, mask.sum(dim=1).tolist())


# ------------------------------------------------------------------ the maths, by hand


def test_row_shares_are_each_rows_part_of_its_rollouts_tokens():
    # a: rows 0 and 2 hold 2 and 3 of its 5 tokens; b: rows 1 and 4 hold 1 and 2 of 3; c is one row.
    torch.testing.assert_close(shares_of(IDS, MASK), torch.tensor(SHARES, dtype=torch.float64))
    # A row with no trained token inside a rollout that has some: share 0. A rollout with none at all
    # keeps weight 1, split evenly over its 2 rows (as seq_mean_token_mean still counts an empty row).
    got = rollout_row_shares(["a", "a", "e", "e"], [4, 0, 0, 0])
    assert got.tolist() == [1.0, 0.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="one rollout id and one token count per row"):
        rollout_row_shares(["a"], [1, 2])


def test_per_rollout_mean_is_the_mean_over_rollouts_of_their_token_means():
    got = aggregate_loss(LOSS, MASK, MODE, row_weights=shares_of(IDS, MASK))
    torch.testing.assert_close(got, torch.tensor(218 / 45, dtype=torch.float64))
    # Not the row mean, nor the token mean: the mode weighs rollouts.
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, "seq_mean_token_mean"), torch.tensor(4.7, dtype=LOSS.dtype))
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, "token_mean"), torch.tensor(4.9, dtype=LOSS.dtype))
    # The same loss written as per-token weights w = m / (R N_r) (rollout_credit.per_rollout_weights).
    w = per_rollout_weights(IDS, MASK).double()
    torch.testing.assert_close(got, (w * LOSS.where(MASK.bool(), 0)).sum())
    # The aggregation weight is the shares' sum: 2/5 + 1/3 + 3/5 + 1 + 2/3 = 3 rollouts.
    torch.testing.assert_close(aggregation_weight(MASK, MODE, shares_of(IDS, MASK)), torch.tensor(3.0))


def test_one_row_per_rollout_is_seq_mean_token_mean():
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(5, 4, generator=gen)
    mask = (torch.arange(4)[None] < torch.tensor([[4], [1], [0], [3], [2]])).long()  # row 2 is empty
    want = aggregate_loss(loss, mask, "seq_mean_token_mean")
    shares = shares_of([f"r{i}" for i in range(5)], mask)  # every row its own rollout: all shares 1
    assert shares.tolist() == [1.0] * 5
    assert torch.equal(aggregate_loss(loss, mask, MODE, row_weights=None), want)
    torch.testing.assert_close(aggregate_loss(loss, mask, MODE, row_weights=shares), want, rtol=1e-6, atol=0)
    assert aggregation_weight(mask, MODE, shares) == aggregation_weight(mask, "seq_mean_token_mean") == 5
    # Through a policy loss, value and gradient.
    old = torch.randn(5, 4, generator=gen) * 0.1
    adv = torch.randn(5, 1, generator=gen).expand(5, 4)
    results = []
    for params in (
        PolicyLossParams(loss_avg_mode=LossAvgMode.seq_mean_token_mean),
        PolicyLossParams(loss_avg_mode=MODE, row_weights=shares.float()),
    ):
        logp = torch.zeros(5, 4, requires_grad=True)
        value, _ = policy_loss_ppo_clip(old, logp, adv, mask, params)
        value.backward()
        results.append((value.detach(), logp.grad))
    torch.testing.assert_close(results[1], results[0])


def test_spreading_a_rollouts_calls_over_more_rows_keeps_its_weight():
    # The same rollouts, a's 5 trained tokens and b's 3, as one row each or spread over more rows (a call per
    # row: transition aggregation). Per-token losses are the same tokens' in both layouts:
    #   merged  a: [1 2 6 6 6]   b: [4 8 10]                 -> (21/5 + 22/3) / 2
    #   spread  a: [1 2] [6 6 6]   b: [4] [8 10] (interleaved) -> the same
    merged_loss = torch.tensor([[1.0, 2.0, 6.0, 6.0, 6.0], [4.0, 8.0, 10.0, 0.0, 0.0]], dtype=torch.float64)
    merged_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    spread_ids = ["a", "b", "a", "b"]
    spread_loss = torch.tensor(
        [[1.0, 2.0, 0.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0, 0.0], [6.0, 6.0, 6.0, 0.0, 0.0], [8.0, 10.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    spread_mask = (spread_loss != 0).long()
    want = (21 / 5 + 22 / 3) / 2
    outcomes = []
    for ids, loss, mask in (
        (["a", "b"], merged_loss, merged_mask),
        (spread_ids, spread_loss, spread_mask),
    ):
        loss = loss.clone().requires_grad_(True)
        shares = shares_of(ids, mask)
        value = aggregate_loss(loss, mask, MODE, row_weights=shares)
        value.backward()
        # Each rollout's total weight: its shares sum to 1 and its tokens' gradients to 1/R = 1/2.
        by_rollout = {r: sum(s for i, s in zip(ids, shares.tolist()) if i == r) for r in ("a", "b")}
        grad_by_rollout = {r: float(sum(loss.grad[i].sum() for i, x in enumerate(ids) if x == r)) for r in "ab"}
        outcomes.append((float(value.detach()), by_rollout, grad_by_rollout, loss.grad[mask.bool()].sort().values))
        assert float(value.detach()) == pytest.approx(want)
    (merged, spread) = outcomes
    for outcome in (merged, spread):
        assert outcome[1] == pytest.approx({"a": 1.0, "b": 1.0})
        assert outcome[2] == pytest.approx({"a": 0.5, "b": 0.5})
    # Every trained token of a gets 1/(2*5), of b 1/(2*3), in either layout.
    torch.testing.assert_close(merged[3], spread[3])
    # seq_mean_token_mean, by contrast, moves: the spread rows outnumber the merged ones.
    assert aggregate_loss(spread_loss, spread_mask, "seq_mean_token_mean") != pytest.approx(want)


@pytest.mark.parametrize(
    "pieces",
    [
        [[0, 1], [2, 3, 4]],  # rollout a's rows 0 and 2 in different pieces
        [[0], [1], [2], [3], [4]],  # one row each
        [[3, 1], [4, 0, 2]],  # any order
    ],
)
def test_pieces_weighted_by_aggregation_weight_sum_to_the_whole(pieces):
    # What micro-batches and workers rely on, with the shares counted over the whole batch first:
    #   sum_k agg(piece_k) * w(piece_k) / w(all) = agg(all),   w = sum of the piece's shares.
    shares = shares_of(IDS, MASK)
    total = aggregation_weight(MASK, MODE, shares)
    got = sum(
        aggregate_loss(LOSS[p], MASK[p], MODE, row_weights=shares[p]) * aggregation_weight(MASK[p], MODE, shares[p])
        for p in pieces
    ) / total
    torch.testing.assert_close(got, torch.tensor(218 / 45, dtype=torch.float64))


def test_a_piece_of_rows_without_shares_gives_zero_not_nan():
    # Row 1 of a rollout whose tokens are all in row 0: share 0, and its piece alone aggregates to 0.
    shares = rollout_row_shares(["a", "a"], [2, 0])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate_loss(torch.ones(1, 2), mask[1:], MODE, row_weights=shares[1:]) == 0


# ------------------------------------------------------------------ the update loop: micro-batches and workers

L = 4
TABLE = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
"""Token id -> the features a tiny linear model reads."""

# 8 rows of four rollouts of 1 to 3 rows, ragged lengths and a loss-mask gap (an observation the model
# did not write); rollout a's rows sit at 0, 3 and 6, so micro-batches and ranks cut through it.
ROWS = [
    ("a", [5, 6], [1, 1]),
    ("b", [7, 8, 9, 10], [1, 1, 1, 1]),
    ("c", [11], [1]),
    ("a", [12, 13, 14], [1, 0, 1]),
    ("d", [15, 16], [1, 1]),
    ("b", [17], [1]),
    ("a", [18, 19, 20, 21], [1, 1, 1, 1]),
    ("d", [22, 23, 24], [1, 1, 0]),
]
RANKS = [[0, 1, 4, 5], [2, 3, 6, 7]]
"""Each rank's rows: a and d have rows on both."""


def agent_batch() -> Batch:
    trajectories = []
    for k, (rollout, tokens, mask) in enumerate(ROWS):
        ids = [1, 2, *tokens]  # a two-token prompt, never trained
        n = len(ids)
        trajectories.append(
            Trajectory(
                token_ids=ids,
                prompt_length=2,
                loss_mask=[0, 0, *mask],
                position_ids=torch.arange(n).expand(3, n),
                group_id=0,
                sample_id=f"{rollout}:{k}",
                temperature=1.0,
                rollout_id=rollout,
            )
        )
    return to_batch(trajectories, max_prompt_length=2, max_response_length=L, pad_token_id=0)


def token_losses(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``(b, L)``: a per-token squared error of a linear model on the tokens' features."""
    return (model(TABLE[batch.responses]).squeeze(-1) - (batch.responses % 3).float()).square()


def micro_loss(model):
    def fn(mb: Batch, rows: list[int], sums: dict) -> tuple[torch.Tensor, torch.Tensor]:
        loss = aggregate_loss(token_losses(model, mb), mb.response_mask, MODE, row_weights=mb.rollout_shares)
        sums["loss"].append(loss.item())
        return loss, mb.response_mask

    return fn


def linear() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(3, 1, bias=False)


class RecordingOptimizer:
    """Records each step's gradients; with a process group, averages them over the ranks first, as FSDP does."""

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.parameters())
        self.steps: list[torch.Tensor] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        grad = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in self.params])
        if dist.is_initialized():
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        self.steps.append(grad)


def reference_gradient(rows: list[int]) -> tuple[torch.Tensor, float]:
    """One process, no accumulation: the gradient and value of the loss over ``rows`` of the batch, with the
    shares counted over every row of the batch."""
    batch = agent_batch()
    shares = shares_of(batch.rollout_ids, batch.response_mask)[rows]
    model = linear()
    sub = batch.select(rows)
    loss = aggregate_loss(token_losses(model, sub), sub.response_mask, MODE, row_weights=shares)
    loss.backward()
    return model.weight.grad.flatten(), float(loss.detach())


def run(batch: Batch, samples_per_update: int, micro_batch_size: int) -> tuple[list[torch.Tensor], dict]:
    model = linear()
    optimizer = RecordingOptimizer(model)
    batch = dataclasses.replace(batch, rollout_shares=rollout_shares(batch))
    sums, skipped = run_epochs(
        model, optimizer, batch, epochs=1, samples_per_update=samples_per_update,
        batching=MicroBatching(micro_batch_size), mode=MODE, max_grad_norm=1e9, micro_loss=micro_loss(model),
        prefix="test",
    )  # fmt: skip
    assert skipped == 0
    return optimizer.steps, sums


def test_the_full_batch_loss_is_the_mean_over_rollouts():
    # Written out without the mode: each rollout's token mean over all its rows, then their mean.
    batch = agent_batch()
    model = linear()
    with torch.no_grad():
        losses = token_losses(model, batch)
    means = {}
    for r in "abcd":
        rows = [i for i, x in enumerate(batch.rollout_ids) if x == r]
        means[r] = float(losses[rows][batch.response_mask[rows].bool()].mean())
    _, value = reference_gradient(list(range(len(ROWS))))
    assert value == pytest.approx(sum(means.values()) / 4, rel=1e-6)


@pytest.mark.parametrize("micro_batch_size", [1, 3, 8])
def test_micro_batches_accumulate_to_the_full_batch_gradient(micro_batch_size):
    (grad,), sums = run(agent_batch(), samples_per_update=8, micro_batch_size=micro_batch_size)
    want, _ = reference_gradient(list(range(8)))
    torch.testing.assert_close(grad, want)
    assert len(sums["loss"]) == -(-8 // micro_batch_size)


def test_mini_batches_weigh_rows_by_their_share_of_the_whole_update():
    # Two mini-batches of 4 rows: rollout a (rows 0 | 3, 6) and d (row 4 | 7) straddle them; each mini-batch's
    # loss weighs its rows by the shares counted over all 8, so a counts 2/9 of itself in the first.
    steps, _ = run(agent_batch(), samples_per_update=4, micro_batch_size=2)
    assert len(steps) == 2
    for got, rows in zip(steps, ([0, 1, 2, 3], [4, 5, 6, 7])):
        want, _ = reference_gradient(rows)
        torch.testing.assert_close(got, want)


def test_the_loop_refuses_a_batch_without_shares():
    with pytest.raises(RuntimeError, match="rollout_shares"):
        run_epochs(
            linear(), RecordingOptimizer(linear()), agent_batch(), epochs=1, samples_per_update=8,
            batching=MicroBatching(8), mode=MODE, max_grad_norm=1.0, micro_loss=micro_loss(linear()), prefix="t",
        )  # fmt: skip


def _two_rank_worker(rank: int, init_file: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    shard = agent_batch().select(RANKS[rank])
    shares = rollout_shares(shard)  # a collective: rows of a and d on the other rank count too
    (grad,), _ = run(shard, samples_per_update=4, micro_batch_size=3)
    results[rank] = (shares.tolist(), grad.tolist())
    dist.destroy_process_group()


def test_two_ranks_with_a_rollout_between_them_give_the_one_process_gradient(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        start_ranks(_two_rank_worker, (str(tmp_path / "init"), results), 2)
        results = dict(results)
    batch = agent_batch()
    all_shares = shares_of(batch.rollout_ids, batch.response_mask)
    want, _ = reference_gradient(list(range(8)))
    for rank in (0, 1):
        shares, grad = results[rank]
        assert shares == pytest.approx(all_shares[RANKS[rank]].tolist())
        torch.testing.assert_close(torch.tensor(grad), want)


# ------------------------------------------------------------------ config


def test_the_rows_carry_their_rollout_and_a_row_without_one_is_its_own():
    batch = agent_batch()
    assert batch.rollout_ids == [r for r, _, _ in ROWS]
    single = dataclasses.replace(batch.trajectories[0], rollout_id="")
    assert single.rollout == single.sample_id == "a:0"
    picked = dataclasses.replace(batch, rollout_shares=torch.arange(8.0)).select([6, 1])
    assert picked.rollout_shares.tolist() == [6.0, 1.0]


def test_per_rollout_mean_is_valid_for_the_actor_and_refused_for_the_critic():
    from helpers.configs import CPU, QUICKSTART, problems_of

    from vlmrl.validate import load_config

    config = load_config([QUICKSTART, "worker.actor.loss_avg_mode=per_rollout_mean"], CPU)
    assert config.worker.actor.loss_avg_mode is MODE
    problems = problems_of(QUICKSTART, "algorithm.adv_estimator=gae", "worker.critic.loss_avg_mode=per_rollout_mean")
    (problem,) = [p for p in problems if p.startswith("worker.critic.loss_avg_mode")]
    assert problem.startswith("worker.critic.loss_avg_mode=per_rollout_mean: the critic's value loss does not weigh")
    assert "set worker.critic.loss_avg_mode=seq_mean_token_mean" in problem


# ------------------------------------------------------------------ the actor's update on the tiny VLM


@pytest.fixture(scope="module")
def actor_and_batch(tiny_assets):
    """The tiny Qwen2.5-VL and the 8 rows of ``ROWS`` as text rows of its vocabulary, with old and reference
    log-probs a little off the model's and one advantage per rollout."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.rollout.engine.sampling import sampling_mask
    from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
    from vlmrl.train.actor import compute_log_probs

    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32)
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    vocab = allowed.nonzero().flatten()
    batch = agent_batch()
    trajectories = [
        dataclasses.replace(t, token_ids=vocab[torch.tensor(t.token_ids) * 7].tolist()) for t in batch.trajectories
    ]
    batch = to_batch(trajectories, max_prompt_length=2, max_response_length=L, pad_token_id=0)
    gen = torch.Generator().manual_seed(2)
    log_probs, _ = compute_log_probs(model, batch, MicroBatching(8), allowed)
    batch.old_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)
    batch.ref_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)
    per_rollout = dict(zip("abcd", torch.randn(4, generator=gen).tolist()))
    batch.advantages = torch.tensor([per_rollout[r] for r in batch.rollout_ids])[:, None] * batch.response_mask
    return model, batch, allowed


def actor_gradients(model, batch, allowed, micro_batch_size, mode):
    from vlmrl.algos import KLEstimator, PolicyLossType
    from vlmrl.train.actor import UpdateSettings, update_policy

    settings = UpdateSettings(
        samples_per_update=len(batch), micro_batch_size=micro_batch_size, ppo_epochs=1,
        loss_type=PolicyLossType.default, loss_params=PolicyLossParams(loss_avg_mode=mode), max_grad_norm=1e9,
        entropy_coeff=0.01, use_kl_loss=True, kl_estimator=KLEstimator.low_var_kl, kl_coef=0.1,
    )  # fmt: skip
    optimizer = RecordingOptimizer(model)
    metrics = update_policy(model, optimizer, batch, settings, allowed).metrics
    (grad,) = optimizer.steps
    return grad, metrics


def test_the_actors_update_accumulates_exactly_with_policy_kl_and_entropy_terms(actor_and_batch):
    # The policy loss, the KL loss and the entropy bonus each weigh rows by their shares; one of them left
    # unweighted would part the micro-batched gradient from the full batch's.
    model, batch, allowed = actor_and_batch
    full, full_metrics = actor_gradients(model, batch, allowed, 8, MODE)
    micro, _ = actor_gradients(model, batch, allowed, 3, MODE)
    torch.testing.assert_close(micro, full, rtol=1e-5, atol=1e-7)
    # The rollouts are weighed, not the rows: seq_mean_token_mean gives another gradient here ...
    rows, _ = actor_gradients(model, batch, allowed, 8, LossAvgMode.seq_mean_token_mean)
    assert not torch.allclose(rows, full, rtol=1e-3)
    # ... and the same one when every row is a rollout of its own.
    own = dataclasses.replace(
        batch, trajectories=[dataclasses.replace(t, rollout_id="") for t in batch.trajectories]
    )
    alone, _ = actor_gradients(model, own, allowed, 3, MODE)
    torch.testing.assert_close(alone, rows, rtol=1e-5, atol=1e-7)
    assert batch.rollout_shares is None  # the update set the shares on its own copy
