"""``worker.actor.share_prompts``: each distinct prompt of a padded micro-batch goes through the model once.

The passes then run every row's response tokens on its prompt's cached keys
and values. They must give the log-probs, entropies and gradients of the full
padded passes (up to float rounding), on each Qwen-VL family's tiny model
(Qwen3-VL's deepstack features included) with ragged responses and rows of two
sampling temperatures, while the prompts really run once. (The text models are
checked in test_text_models.py, and under FSDP2 in test_fsdp_options.py.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.tiny_families import FAMILIES, count_prompt_passes, family_prompts
from transformers import AutoModelForImageTextToText

from vlmrl.records import Trajectory
from vlmrl.records.views import to_batch
from vlmrl.train import shared_prompts
from vlmrl.train.actor import forward_response
from vlmrl.train.micro_batches import TokenCount

SAMPLES = 3
LENGTHS = [6, 2, 4, 5, 1, 3]  # ragged responses: the response pass pads on the right under a cached prompt


@pytest.fixture(scope="module", params=FAMILIES)
def family_batch(request, tiny_assets, tmp_path_factory):
    """A family's tiny model and 2 image prompts x SAMPLES ragged responses, the second prompt's at temperature 0.7."""
    path, prompts, allowed = family_prompts(request.param, tmp_path_factory.mktemp(request.param), tiny_assets.train_file)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    allowed_ids = allowed.nonzero().flatten()
    rows = [
        Trajectory.single_turn(
            p, g, k, allowed_ids[torch.randint(len(allowed_ids), (LENGTHS[g * SAMPLES + k],))].tolist(), "",
            1.0 if g == 0 else 0.7,
        )
        for g, p in enumerate(prompts)
        for k in range(SAMPLES)
    ]  # fmt: skip
    batch = to_batch(rows, max_prompt_length=2048, max_response_length=max(LENGTHS), pad_token_id=0)
    return model, batch, allowed


def _pass(model, batch, allowed, share: bool):
    """Log-probs, entropy, the gradient of a loss on both, and the token positions counted."""
    model.zero_grad(set_to_none=True)
    tokens = TokenCount()
    log_probs, entropy = forward_response(
        model, batch, allowed, entropy_grad=True, share_prompts=share, tokens=tokens
    )
    mask = batch.response_mask
    ((log_probs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach(), entropy.detach(), grads, tokens


def test_shared_prompts_give_the_full_passes_log_probs_entropy_and_gradients(family_batch, monkeypatch):
    model, batch, allowed = family_batch
    prompt_passes = count_prompt_passes(monkeypatch)
    lp0, ent0, g0, full = _pass(model, batch, allowed, share=False)
    lp1, ent1, g1, shared = _pass(model, batch, allowed, share=True)
    assert prompt_passes == [2]  # two distinct prompts, one pass over them, for six rows
    mask = batch.response_mask.bool()
    torch.testing.assert_close(lp1[mask], lp0[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent1[mask], ent0[mask], rtol=0, atol=1e-5)
    assert g1.keys() == g0.keys()
    assert [name for name in g0 if ".visual." in f".{name}"], "no gradient reached the tower through the prompt"
    for name, g in g0.items():
        # Against each tensor's largest entry: the same sums in another order (see test_fsdp_options.py).
        error = float((g1[name] - g).abs().max())
        assert error <= 1e-5 * float(g.abs().max()), (name, error)
    # The prompts' positions were computed once instead of SAMPLES times; the responses' as before.
    p = shared_prompts_columns(batch)
    assert full.computed - shared.computed == 2 * (SAMPLES - 1) * p
    assert full.real - shared.real == (SAMPLES - 1) * int(batch.attention_mask[[0, SAMPLES], : batch.prompt_length].sum())


def shared_prompts_columns(batch) -> int:
    """The trimmed prompt width: the prompt columns some row uses."""
    return int(batch.attention_mask[:, : batch.prompt_length].any(dim=0).sum())


def test_rows_share_a_prompt_only_when_its_tokens_and_media_are_equal(family_batch):
    model, batch, _ = family_batch
    p = shared_prompts_columns(batch)
    media = shared_prompts.media_token_ids(model)
    found = shared_prompts.find(batch, p, media)
    assert found.firsts == [0, SAMPLES] and found.where.tolist() == [0] * SAMPLES + [1] * SAMPLES
    # One row's picture differs by one pixel value: it is a prompt of its own, whatever its group id says.
    rows = [dataclasses.replace(t) for t in batch.trajectories]
    pixels = rows[1].mm_inputs["pixel_values"].clone()
    pixels[0, 0] += 1e-3
    rows[1].mm_inputs = {**rows[1].mm_inputs, "pixel_values": pixels}
    changed = dataclasses.replace(batch, trajectories=rows)
    found = shared_prompts.find(changed, p, media)
    assert found.firsts == [0, 1, SAMPLES] and found.where.tolist() == [0, 1, 0, 2, 2, 2]
    # One row per prompt: nothing to share, the full pass runs.
    assert shared_prompts.find(batch.select([0, SAMPLES]), p, media) is None


def test_rows_with_media_after_the_prompt_keep_the_full_pass(family_batch):
    """An agent's observation image sits after the prompt; the response pass would need its pixels."""
    model, batch, allowed = family_batch
    media = shared_prompts.media_token_ids(model)
    assert media  # the family's image and video placeholders
    observed = dataclasses.replace(batch, input_ids=batch.input_ids.clone())
    observed.input_ids[2, batch.prompt_length + 1] = media[0]
    assert shared_prompts.find(observed, shared_prompts_columns(batch), media) is None



def test_micro_batches_keep_a_prompts_rows_together():
    """Rows of two prompts whose lengths interleave (prompt 0: 10, 13, 16 tokens; prompt 1: 11, 14, 17): sorted by
    length alone, no micro-batch of two holds two rows of one prompt; with shared prompts, pairs of a prompt's rows
    do, the groups in the order of their longest row."""
    from vlmrl.train.micro_batches import MicroBatching

    class Rows:  # what grouping reads of a Batch: the real lengths and the group ids
        def __init__(self, lengths, group_ids):
            self.attention_mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
            for row, length in enumerate(lengths):
                self.attention_mask[row, :length] = 1
            self.group_ids = torch.tensor(group_ids)

        def __len__(self):
            return len(self.group_ids)

    rows = Rows([10, 13, 16, 11, 14, 17], [0, 0, 0, 1, 1, 1])
    assert MicroBatching(2).groups(rows) == [[0, 3], [1, 4], [2, 5]]
    assert MicroBatching(2, share_prompts=True).groups(rows) == [[0, 1], [2, 3], [4, 5]]
    later = Rows([10, 13, 18, 11, 14, 17], [0, 0, 0, 1, 1, 1])  # prompt 0 now has the longest row: it goes last
    assert MicroBatching(2, share_prompts=True).groups(later) == [[3, 4], [5, 0], [1, 2]]
