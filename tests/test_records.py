"""The trajectory record and the padded view made from it (vlmrl.records), and the worker's store.

The view is the one place trajectories become tensors; every pass and the
maths read it. The expected layouts below are written out by hand.
"""

from __future__ import annotations

import pytest
import torch

from vlmrl.records import Media, PromptSample, Trajectory
from vlmrl.records.views import to_batch
from vlmrl.workers.store import PassInput, TrajectoryStore

PAD = 0


def prompt(index: int, ids: list[int]) -> PromptSample:
    n = len(ids)
    return PromptSample(
        index=index, raw_prompt_ids=ids, input_ids=ids, images=[], mm_inputs={}, ground_truth="g",
        data_source="s", prompt_text=f"p{index}", position_ids=torch.arange(n).expand(3, n).clone(),
    )  # fmt: skip


def test_a_single_turn_trajectory_is_the_prompt_then_the_response_with_a_loss_mask_on_the_response():
    t = Trajectory.single_turn(prompt(7, [11, 12, 13]), group_id=4, sample_index=1, token_ids=[21, 22],
                               text="ab", temperature=0.7, log_probs=[-0.5, -0.25], version=3)  # fmt: skip
    assert t.token_ids == [11, 12, 13, 21, 22] and t.prompt_length == 3 and t.completion_ids == [21, 22]
    assert t.loss_mask == [0, 0, 0, 1, 1]
    assert t.log_probs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert t.versions == [-1, -1, -1, 3, 3]
    # The response continues one past the prompt's largest position (2), on all three axes.
    assert t.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 3
    assert t.sample_id == "4:1" and t.temperature == 0.7 and t.row_index == 7


def test_the_padded_view_left_pads_prompts_and_right_pads_what_follows():
    a = Trajectory.single_turn(prompt(0, [11, 12]), 0, 0, [21, 22, 23], "", 1.0, [-1.0, -2.0, -3.0], version=2)
    b = Trajectory.single_turn(prompt(1, [31, 32, 33]), 1, 0, [41], "", 0.5, [-4.0], version=2)
    batch = to_batch([a, b], max_prompt_length=4, max_response_length=3, pad_token_id=PAD)
    # Prompt width P = 4 (left-padded), response width R = 3 (right-padded).
    assert batch.input_ids.tolist() == [[0, 0, 11, 12, 21, 22, 23], [0, 31, 32, 33, 41, 0, 0]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0]]
    assert batch.responses.tolist() == [[21, 22, 23], [41, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.rollout_log_probs.tolist() == [[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]]
    assert batch.policy_versions.tolist() == [[2, 2, 2], [2, -1, -1]]
    assert batch.temperatures.tolist() == [1.0, 0.5]
    # Positions: padding on the left is 0; after the last real token they count on from the largest one.
    # Row b: prompt 0 1 2, response 3, then 4 5 on the two padding columns.
    assert batch.position_ids[1, 0].tolist() == [0, 0, 1, 2, 3, 4, 5]
    assert batch.position_ids[0, 2].tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert batch.prompt_length == 4 and batch.group_ids.tolist() == [0, 1]


def test_a_multi_turn_trajectory_trains_only_the_models_tokens():
    # prompt [1, 2] | model [3, 4] | tool [5, 6] | model [7]: the tool's tokens are context (mask 0).
    t = Trajectory(
        token_ids=[1, 2, 3, 4, 5, 6, 7], prompt_length=2, loss_mask=[0, 0, 1, 1, 0, 0, 1],
        position_ids=torch.arange(7).expand(3, 7).clone(), group_id=0, sample_id="0:0", temperature=1.0,
        log_probs=[0, 0, -0.1, -0.2, 0, 0, -0.3], versions=[-1, -1, 5, 5, -1, -1, 5],
    )  # fmt: skip
    batch = to_batch([t], max_prompt_length=2, max_response_length=6, pad_token_id=PAD)
    assert batch.responses.tolist() == [[3, 4, 5, 6, 7, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0]]  # the tool's tokens are attended to
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 1, 0]]  # but not trained
    assert batch.policy_versions.tolist() == [[5, 5, -1, -1, 5, -1]]
    assert torch.allclose(batch.rollout_log_probs, torch.tensor([[-0.1, -0.2, 0, 0, -0.3, 0]]))


def test_a_response_longer_than_the_view_is_cut_and_a_prompt_longer_than_it_is_refused():
    long = Trajectory.single_turn(prompt(0, [1]), 0, 0, [5, 6, 7, 8], "", 1.0)
    assert to_batch([long], max_prompt_length=1, max_response_length=2, pad_token_id=PAD).responses.tolist() == [
        [5, 6]
    ]
    with pytest.raises(ValueError, match="row 3: prompt of 3 tokens exceeds data.max_prompt_length=2"):
        to_batch([Trajectory.single_turn(prompt(3, [1, 2, 3]), 0, 0, [5], "", 1.0)], max_prompt_length=2,
                 max_response_length=2, pad_token_id=PAD)  # fmt: skip


def test_a_record_whose_per_token_fields_disagree_in_length_is_refused():
    with pytest.raises(ValueError, match="trajectory 0:0: 3 tokens but a loss mask of 2"):
        Trajectory(token_ids=[1, 2, 3], prompt_length=1, loss_mask=[0, 1], position_ids=torch.zeros(3, 3),
                   group_id=0, sample_id="0:0", temperature=1.0)  # fmt: skip


def test_slim_drops_pixels_and_media_payloads_and_with_media_puts_them_back():
    t = Trajectory.single_turn(prompt(0, [1, 2]), 0, 0, [3], "", 1.0)
    t.mm_inputs, t.media = {"pixel_values": torch.ones(4, 3)}, [Media("image", 1, "the image")]
    slim = t.slim()
    assert slim.mm_inputs == {} and slim.media == [Media("image", 1, None)] and slim.token_ids == t.token_ids
    assert slim.with_media(["the image"]).images == ["the image"]
    with pytest.raises(ValueError, match="1 media but 2 items"):
        slim.with_media(["a", "b"])


def test_the_store_builds_the_view_of_the_rows_asked_for_with_only_that_passs_fields():
    rows = [Trajectory.single_turn(prompt(i, [1, 2]), i, 0, [3 + i] * (i + 1), "", 1.0) for i in range(3)]
    store = TrajectoryStore(max_prompt_length=2, max_response_length=3, pad_token_id=PAD)
    store.hold(rows[:2])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    # Row 2 is not held: it comes with the request, in full.
    batch = store.batch(PassInput(["2:0", "0:0"], new_rows=[rows[2]], fields={"advantages": advantages}))
    assert batch.responses.tolist() == [[5, 5, 5], [3, 0, 0]] and torch.equal(batch.advantages, advantages)
    # The next pass over the same rows reuses the view, and does not see the last pass's fields.
    again = store.batch(PassInput(["2:0", "0:0"]))
    assert again.input_ids is batch.input_ids and again.advantages is None
    with pytest.raises(KeyError, match="neither held nor sent"):
        store.batch(PassInput(["9:0"]))
    with pytest.raises(ValueError, match="unknown per-token fields"):
        PassInput(["0:0"], fields={"advantage": advantages})
    store.release()
    with pytest.raises(KeyError):
        store.batch(PassInput(["0:0"]))


def test_a_row_sent_again_under_a_held_id_replaces_the_held_one_and_its_view():
    store = TrajectoryStore(max_prompt_length=2, max_response_length=2, pad_token_id=PAD)
    first = Trajectory.single_turn(prompt(0, [1, 2]), 0, 0, [3], "", 1.0)
    store.hold([first])
    assert store.batch(PassInput(["0:0"])).responses.tolist() == [[3, 0]]
    other = Trajectory.single_turn(prompt(0, [1, 2]), 0, 0, [4, 5], "", 1.0)
    assert store.batch(PassInput(["0:0"], new_rows=[other])).responses.tolist() == [[4, 5]]


def test_the_worker_group_sends_a_row_once_and_again_when_another_trajectory_takes_its_id():
    from vlmrl.workers.group import WorkerGroup

    from vlmrl.config import Config

    group = WorkerGroup.__new__(WorkerGroup)  # the driver-side bookkeeping only: no Ray, no workers
    group.world_size, group.holders, group.config = 1, {}, Config()  # the default: no Ulysses groups
    rows = [Trajectory.single_turn(prompt(i, [1, 2]), i, 0, [3], "", 1.0) for i in range(2)]
    batch = to_batch(rows, max_prompt_length=2, max_response_length=1, pad_token_id=PAD)
    (first,), _ = group.scatter(batch)
    assert first.sample_ids == ["0:0", "1:0"] and first.new_rows == rows
    (second,), _ = group.scatter(batch)
    assert second.new_rows == []  # the worker holds both now
    replaced = to_batch([Trajectory.single_turn(prompt(0, [1, 2]), 0, 0, [4], "", 1.0), rows[1]],
                        max_prompt_length=2, max_response_length=1, pad_token_id=PAD)  # fmt: skip
    (third,), _ = group.scatter(replaced)
    assert [t.completion_ids for t in third.new_rows] == [[4]]


def test_records_pickle_their_tensors_as_byte_arrays_and_come_back_equal_and_writable():
    import pickle

    import numpy as np

    p = prompt(3, [11, 12, 13])
    pixels = torch.randn(8, 6)[:, ::2]  # not contiguous
    p.mm_inputs = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2, 2]]),
                   "half": torch.randn(4, 3).to(torch.bfloat16), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 5)}  # fmt: skip
    t = Trajectory.single_turn(p, 1, 0, [21, 22], "ab", 1.0, [-0.5, -0.25], version=1)
    for record in (p, t):
        before = {k: v.clone() for k, v in record.mm_inputs.items()}
        buffers = []
        blob = pickle.dumps(record, protocol=5, buffer_callback=buffers.append)
        # Through Ray the pixels travel out of band (no copy), and may come back as read-only memory.
        assert buffers, "the tensors were pickled in band: the byte-array path is not taken"
        assert b"torch._utils" not in blob and b"_rebuild_tensor" not in blob
        back = pickle.loads(blob, buffers=[memoryview(b).toreadonly() for b in buffers])
        for key, value in record.mm_inputs.items():
            got = back.mm_inputs[key]
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
            got.add_(1)  # its own, writable memory: the sender's tensor (whose bytes were the buffer) is untouched
            assert torch.equal(value, before[key]), key
        assert torch.equal(back.position_ids, record.position_ids) and back.position_ids.dtype == torch.long
        back.position_ids.add_(1)
        assert back.input_ids == record.input_ids if isinstance(record, PromptSample) else back.token_ids == record.token_ids
    # Older protocols (pipes, deepcopy) still round-trip.
    again = pickle.loads(pickle.dumps(t, protocol=2))
    assert torch.equal(again.mm_inputs["pixel_values"], pixels) and isinstance(again.mm_inputs["pixel_values"], torch.Tensor)
    assert not isinstance(again.mm_inputs["pixel_values"], np.ndarray)


def test_an_unpacked_tensor_owns_its_memory_when_the_bytes_came_read_only():
    import numpy as np

    from vlmrl.records.shipping import PackedTensor, unpack

    # What Ray may hand back: a read-only view of its object store. Writing into it must not be possible or
    # visible there; the tensor gets a copy.
    data = np.arange(12, dtype=np.uint8)
    data.flags.writeable = False
    out = unpack(PackedTensor(torch.int32, (3,), data))
    assert out.dtype == torch.int32 and out.shape == (3,)
    out.add_(1)
    assert data.tolist() == list(range(12))
