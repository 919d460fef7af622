"""Unit tests of vlmrl.records.Batch: row selection, splitting and joining.

The worker group splits a step's batch over the workers and concatenates the
results; the actor splits mini-batches into micro-batches. Any field that is
reordered or dropped on the way silently pairs a response with the wrong
reward, log-prob or image, so every field is checked row by row.
"""

import dataclasses

import pytest
import torch

from vlmrl.records import Batch, Media, Trajectory

P, R = 3, 4  # prompt and response widths


def make_trajectory(i: int) -> Trajectory:
    """Row ``i``'s trajectory: every per-sample fact recognisable by ``i``."""
    n = P + 1 + i % R
    return Trajectory(
        token_ids=[i * 100 + k for k in range(n)],
        prompt_length=P,
        loss_mask=[0] * P + [1] * (n - P),
        position_ids=i * 1000 + torch.arange(3 * n).view(3, n),
        group_id=i // 2,
        sample_id=f"{i // 2}:{i % 2}",
        temperature=1.0 + i / 10,
        mm_inputs={"image_grid_thw": torch.tensor([[1, 2, 2 + i]])} if i % 2 else {},
        media=[Media("image", 1, f"image {i}")] * (i % 3),
        response_text=f"response {i}",
        prompt_text=f"prompt {i}",
        ground_truth=f"truth {i}",
        data_source=f"source {i % 3}",
        row_index=100 + i,
        extra={"difficulty": i % 3, "id": f"row {i}"},
        rollout_id=f"rollout {i // 3}" if i % 4 else "",
    )


def make_batch(b: int) -> Batch:
    """A batch of ``b`` rows where every field is filled and row ``i`` is recognisable by ``i``."""
    rows = torch.arange(b)
    return Batch(
        trajectories=[make_trajectory(i) for i in range(b)],
        input_ids=rows[:, None] * 100 + torch.arange(P + R),
        attention_mask=(rows[:, None] + torch.arange(P + R)) % 2,
        position_ids=rows[:, None, None] * 1000 + torch.arange(3 * (P + R)).view(3, P + R),
        responses=rows[:, None] * 10 + torch.arange(R),
        response_mask=(torch.arange(R) <= rows[:, None] % R).long(),
        group_ids=rows // 2,
        temperatures=1.0 + rows.float() / 10,
        policy_versions=rows[:, None] + torch.arange(R) * 0,
        rollout_log_probs=-rows[:, None].float() - torch.arange(R) / 10,
        old_log_probs=-rows[:, None].float() - torch.arange(R) / 100,
        ref_log_probs=-rows[:, None].float() - torch.arange(R) / 1000,
        teacher_log_probs=-rows[:, None].float() - torch.arange(R) / 10000,
        token_level_scores=rows[:, None].float() * torch.arange(R),
        reward_metrics={"overall": [float(i) for i in range(b)], "accuracy": [i / 10 for i in range(b)]},
        advantages=rows[:, None].float() + torch.arange(R) / 7,
        reward_baselines=rows.float() / 3,
        values=rows[:, None].float() / 5 + torch.arange(R),
        token_level_rewards=rows[:, None].float() * torch.arange(R) / 2,
        returns=rows[:, None].float() / 9 + torch.arange(R),
        rollout_shares=rows.float() / 11,
    )


# The per-sample facts a Batch reads from its trajectories; each must follow its row through select/concat.
SAMPLE_FACTS = (
    "sample_ids",
    "mm_inputs",
    "response_texts",
    "prompt_texts",
    "ground_truths",
    "data_sources",
    "row_indices",
    "images",
    "extra_fields",
    "rollout_ids",
)


def row(batch: Batch, i: int) -> dict:
    """Row ``i`` of every field of ``batch``, as plain Python values."""
    out = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = value[i].tolist()
        elif isinstance(value, list):
            out[f.name] = value[i]
        elif isinstance(value, dict):
            out[f.name] = {k: v[i] for k, v in value.items()}
        else:
            out[f.name] = value
    out.pop("trajectories")  # compared through the facts read from them, below
    for name in SAMPLE_FACTS:
        out[name] = getattr(batch, name)[i]
    out["token_ids"] = batch.trajectories[i].token_ids
    out["trajectory_positions"] = batch.trajectories[i].position_ids.tolist()
    return out


def assert_rows(batch: Batch, source: Batch, order: list[int]) -> None:
    """``batch`` holds rows ``order`` of ``source``, in that order, in every field."""
    assert len(batch) == len(order)
    for j, i in enumerate(order):
        got, want = row(batch, j), row(source, i)
        assert got.keys() == want.keys()
        for name in want:
            if name == "mm_inputs":
                assert got[name].keys() == want[name].keys(), (name, j, i)
                for k in want[name]:
                    assert torch.equal(got[name][k], want[name][k]), (name, j, i)
            else:
                assert got[name] == want[name], (name, j, i)


def test_make_batch_fills_every_field():
    # Guards the tests below: a new Batch field must be filled here, or the
    # round-trip tests would not notice that select/concat drop or reorder it.
    batch = make_batch(4)
    for f in dataclasses.fields(Batch):
        value = getattr(batch, f.name)
        assert value is not None and (not isinstance(value, (list, dict)) or len(value) > 0), f.name


def test_select_returns_rows_in_the_requested_order_for_every_field():
    batch = make_batch(5)
    order = [3, 0, 4, 1]
    assert_rows(batch.select(order), batch, order)
    assert_rows(batch.select(torch.tensor(order)), batch, order)


def test_select_keeps_dict_of_lists_aligned_with_tensors():
    batch = make_batch(5)
    picked = batch.select([4, 2])
    assert picked.reward_metrics == {"overall": [4.0, 2.0], "accuracy": [0.4, 0.2]}
    assert picked.group_ids.tolist() == [2, 1]


@pytest.mark.parametrize(("b", "size"), [(6, 2), (5, 2), (4, 4), (3, 5)])
def test_split_then_concat_is_the_identity(b, size):
    batch = make_batch(b)
    parts = batch.split(size)
    # ceil(b / size) parts, all of `size` rows but possibly the last.
    assert [len(p) for p in parts] == [min(size, b - i) for i in range(0, b, size)]
    assert_rows(Batch.concat(parts), batch, list(range(b)))


def test_concat_after_select_of_a_permutation_keeps_that_permutation():
    # The worker group's contract: worker i gets chunk i; results joined in worker order.
    batch = make_batch(6)
    perm = [5, 1, 3, 0, 4, 2]
    parts = [batch.select(perm[:2]), batch.select(perm[2:4]), batch.select(perm[4:])]
    assert_rows(Batch.concat(parts), batch, perm)


def test_concat_keeps_an_optional_field_none_when_no_part_filled_it():
    parts = [make_batch(2), make_batch(3)]
    for p in parts:
        p.advantages = None
        p.ref_log_probs = None
    joined = Batch.concat(parts)
    assert joined.advantages is None
    assert joined.ref_log_probs is None
    assert joined.old_log_probs is not None and len(joined) == 5


def test_select_and_concat_keep_rows_without_media_empty():
    # Rows 0 and 3 have no media (i % 3 == 0): their image lists stay [] rather than borrowing a neighbour's.
    batch = make_batch(4)
    assert batch.select([3, 1, 0]).images == [[], ["image 1"], []]
    assert Batch.concat(batch.split(2)).images == [[], ["image 1"], ["image 2"] * 2, []]


def test_concat_of_a_field_filled_in_some_parts_only_fails_naming_it_when_first_part_is_empty():
    filled, empty = make_batch(2), make_batch(2)
    empty.advantages = None
    with pytest.raises(RuntimeError, match="advantages"):
        Batch.concat([empty, filled])


def test_concat_of_a_field_filled_in_some_parts_only_fails_naming_it_when_first_part_is_filled():
    filled, empty = make_batch(2), make_batch(2)
    empty.advantages = None
    with pytest.raises(RuntimeError, match="advantages"):
        Batch.concat([filled, empty])


def test_require_names_every_missing_field():
    batch = make_batch(2)
    batch.require("old_log_probs", "advantages")  # filled: no error
    batch.old_log_probs = None
    batch.ref_log_probs = None
    with pytest.raises(RuntimeError) as info:
        batch.require("old_log_probs", "advantages", "ref_log_probs")
    message = str(info.value)
    assert "old_log_probs" in message and "ref_log_probs" in message
    assert "'advantages'" not in message


def test_prompt_length_is_the_width_before_the_responses():
    assert make_batch(2).prompt_length == P
