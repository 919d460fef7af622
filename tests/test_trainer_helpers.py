"""Unit tests of the small pure helpers around the driver loop.

``place_scores`` (where a sequence reward lands), ``_chunks`` (how a batch is
split over workers), ``reduce_reward_metrics`` (what is logged) and
``sampling_mask`` (which tokens a response may contain).
"""

import pytest
import torch
from transformers import AutoTokenizer

from vlmrl.algos import grpo_advantages, masked_sum
from vlmrl.driver.metrics import reduce_reward_metrics
from vlmrl.driver.scoring import place_scores
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.workers.group import _chunks

# --------------------------------------------------------------------------- place_scores


def test_place_scores_puts_a_multi_turn_reward_on_the_last_trained_token_not_the_last_token():
    # A trajectory's loss mask has gaps where a tool answered, and may end before the row does
    # (a final tool turn, then nothing the model said): the reward goes to the last 1.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [0, 1, 0, 1, 1, 1, 0]])
    assert place_scores([1.0, 2.0], mask).tolist() == [
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0],
    ]


def test_place_scores_puts_each_reward_on_the_last_valid_token():
    mask = torch.tensor(
        [
            [1, 1, 1, 0],  # 3 tokens: last valid index 2
            [1, 0, 0, 0],  # 1 token: index 0
            [1, 1, 1, 1],  # full width: index 3
        ]
    )
    placed = place_scores([0.5, -1.0, 2.0], mask)
    assert placed.dtype == torch.float32 and placed.shape == (3, 4)
    assert placed.tolist() == [
        [0.0, 0.0, 0.5, 0.0],
        [-1.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 2.0],
    ]


def test_placed_scores_are_recovered_by_the_estimators_masked_sum():
    # The estimators read a sequence's score as the sum of its rewards on valid tokens.
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    scores = [0.25, 1.0, -0.5]
    assert masked_sum(place_scores(scores, mask), mask, dim=-1).tolist() == scores


def test_place_scores_on_an_all_padding_row():
    # An empty response (mask all 0) has no token to carry its reward. build_batch never makes one
    # (vLLM returns at least one token, EOS included), so this only has to be safe: no IndexError,
    # no reward on another row, and the value written where it cannot reach the loss. It sits at
    # column 0 under padding, so the estimators' masked sum counts the row's score as 0, and its
    # advantage is 0 on every (non-existent) token. We judge that acceptable for an unreachable
    # row; if empty responses ever become possible the estimators should read a (B,) score instead.
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    placed = place_scores([1.0, 7.0], mask)
    assert placed.tolist() == [[0.0, 1.0, 0.0], [7.0, 0.0, 0.0]]
    assert masked_sum(placed, mask, dim=-1).tolist() == [1.0, 0.0]
    advantages, _ = grpo_advantages(placed, mask, torch.tensor([0, 1]))
    assert advantages[1].tolist() == [0.0, 0.0, 0.0]


def test_place_scores_of_an_empty_batch():
    assert place_scores([], torch.zeros((0, 5), dtype=torch.long)).shape == (0, 5)


# --------------------------------------------------------------------------- _chunks


@pytest.mark.parametrize(("n", "parts"), [(6, 3), (8, 2), (4, 4), (5, 1), (0, 2)])
def test_chunks_split_evenly_into_contiguous_ordered_parts(n, parts):
    items = list(range(n))
    chunks = _chunks(items, parts)
    assert len(chunks) == parts
    assert all(len(c) == n // parts for c in chunks)
    assert [x for c in chunks for x in c] == items  # worker i gets the i-th contiguous chunk


@pytest.mark.parametrize(("n", "parts"), [(7, 2), (5, 3), (1, 2)])
def test_chunks_refuse_an_uneven_split(n, parts):
    with pytest.raises(ValueError, match=rf"{n} items do not split evenly over {parts} workers"):
        _chunks(list(range(n)), parts)


# --------------------------------------------------------------------------- reduce_reward_metrics


def test_reduce_reward_metrics_means_each_score_under_the_prefix():
    metrics = reduce_reward_metrics(
        {"overall": [1.0, 0.0, 0.5, 0.5], "accuracy": [1.0, 0.0, 1.0, 0.0], "format": [0.25]},
        prefix="val/reward",
    )
    assert metrics == {
        "val/reward/overall": 0.5,  # (1 + 0 + 0.5 + 0.5) / 4
        "val/reward/accuracy": 0.5,  # 2 / 4
        "val/reward/format": 0.25,
    }


def test_reduce_reward_metrics_skips_empty_lists():
    assert reduce_reward_metrics({"overall": [2.0], "unused": []}, prefix="reward") == {"reward/overall": 2.0}
    assert reduce_reward_metrics({}, prefix="reward") == {}


# --------------------------------------------------------------------------- sampling_mask


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets.model_dir)


def test_sampling_mask_bans_vision_tokens_and_rows_past_the_tokenizer(tokenizer):
    vocab_size = len(tokenizer) + 113  # an embedding padded past the tokenizer, as real checkpoints are
    allowed = sampling_mask(tokenizer, vocab_size, QWEN_MARKERS)
    assert allowed.shape == (vocab_size,) and allowed.dtype == torch.bool
    vision_ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN_MARKERS]
    assert len(set(vision_ids)) == 5 and all(i < len(tokenizer) for i in vision_ids)
    for token_id in vision_ids:
        assert not allowed[token_id]
    assert not allowed[len(tokenizer) :].any()
    # Everything else the tokenizer knows stays allowed: text, <|im_end|> (the stop token), <|endoftext|>.
    assert allowed.sum() == len(tokenizer) - len(vision_ids)
    for token in ("<|im_end|>", "<|endoftext|>"):
        assert allowed[tokenizer.convert_tokens_to_ids(token)]
    for token_id in tokenizer.encode("The shape is red.", add_special_tokens=False):
        assert allowed[token_id]


def test_sampling_mask_with_an_embedding_the_size_of_the_tokenizer(tokenizer):
    allowed = sampling_mask(tokenizer, len(tokenizer), QWEN_MARKERS)
    assert allowed.sum() == len(tokenizer) - len(QWEN_MARKERS)
    assert not allowed[tokenizer.convert_tokens_to_ids("<|image_pad|>")]
