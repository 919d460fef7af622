"""The quickstart's format-tuned tiny model: it answers in the asked-for format, by chance.

``vlmrl.testing.format_tune`` must teach the answer format (one colour word,
then the end of the turn) and nothing about the images, so that the RL run
starts at the accuracy of a policy that cannot see. Read off the HF model's
next-token distribution on the quickstart's own validation prompts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.trajectories import Response, batch_of
from vlmrl.validate import load_config
from vlmrl.data.dataset import RLHFDataset
from vlmrl.testing.synthetic import COLOURS
from vlmrl.train.micro_batches import merged_mm_inputs

N_PROMPTS = 24


@pytest.fixture(scope="module")
def first_tokens(quickstart_assets):
    """(P(each colour word), P(end of turn after the greedy word), ground truth) per validation prompt."""
    data = load_config(["config=examples/quickstart.yaml"]).data
    model_dir = quickstart_assets.model_dir
    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    dataset = RLHFDataset(
        str(quickstart_assets.val_file), processor, prompt_key=data.prompt_key, answer_key=data.answer_key,
        image_key=data.image_key, image_dir=None, max_prompt_length=data.max_prompt_length,
        min_pixels=data.min_pixels, max_pixels=data.max_pixels, format_prompt=data.format_prompt,
    )  # fmt: skip
    colour_ids = {c: tokenizer.encode(c) for c in sorted(COLOURS)}
    assert all(len(ids) == 1 for ids in colour_ids.values()), colour_ids  # one token each in the tiny BPE
    def next_token_probs(sample, response_ids: list[int]) -> torch.Tensor:
        """(len(response_ids), V): the model's next-token distribution before each response token."""
        batch = batch_of(
            [Response(sample, 0, response_ids, "", None)],
            max_prompt_length=data.max_prompt_length, max_response_length=len(response_ids),
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        with torch.no_grad():
            logits = model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids.transpose(0, 1), logits_to_keep=len(response_ids) + 1,
                **merged_mm_inputs(batch),
            ).logits[0, :-1]  # fmt: skip
        return logits.softmax(-1)

    results = []
    for row in range(N_PROMPTS):
        sample = dataset.sample(row)
        first = next_token_probs(sample, [tokenizer.eos_token_id])[0]  # the response does not change it
        colour_probs = {c: first[ids[0]].item() for c, ids in colour_ids.items()}
        # The token after the most likely word, teacher-forced.
        word = max(colour_probs, key=colour_probs.get)
        after = next_token_probs(sample, [colour_ids[word][0], tokenizer.eos_token_id])[1]
        results.append((colour_probs, after[tokenizer.eos_token_id].item(), sample.ground_truth))
    return results


def test_the_tuned_model_answers_with_a_colour_word(first_tokens):
    for colour_probs, _, _ in first_tokens:
        assert sum(colour_probs.values()) > 0.9, colour_probs
        # ... and any of the four: no colour is near-certain before RL.
        assert min(colour_probs.values()) > 0.05, colour_probs


def test_the_tuned_model_ends_its_turn_after_the_word(first_tokens):
    assert all(p_end > 0.9 for _, p_end, _ in first_tokens), [p for _, p, _ in first_tokens]


def test_the_tuned_model_does_not_know_the_answer(first_tokens):
    # Trained on colours drawn independently of the image: the probability it
    # gives the right colour is about 1/4, far from what the RL run reaches.
    p_correct = sum(colour_probs[truth] for colour_probs, _, truth in first_tokens) / len(first_tokens)
    assert 0.15 < p_correct < 0.4, p_correct
