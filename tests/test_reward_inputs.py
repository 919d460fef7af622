"""What a reward function is given: EasyR1's keys, vlmrl's additions, and the row's extra columns.

The extra columns travel from the dataset row (``PromptSample.extra``) through the
batch (``Batch.extra_fields``, kept in order by select/concat as every per-sample
field is, see tests/test_protocol.py) into ``reward_input``.
"""

from __future__ import annotations

import dataclasses
import io

import pandas as pd
import pytest
from helpers.reward_batch import make_batch
from PIL import Image
from transformers import AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.driver.scoring import reward_inputs


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_rows_extra_columns_reach_the_prompt_sample(tiny_assets, tmp_path):
    path = tmp_path / "rows.parquet"
    rows = [
        {"problem": "What colour?", "answer": "red", "images": [{"bytes": png(56, 56)}], "data_source": "colours",
         "difficulty": 3, "choices": ["red", "blue"], "id": "row-0"},
        {"problem": "What colour?", "answer": "blue", "images": [{"bytes": png(56, 56)}], "data_source": "colours",
         "difficulty": 1, "choices": ["blue"], "id": "row-1"},
    ]  # fmt: skip
    pd.DataFrame(rows).to_parquet(path)
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    data = RLHFDataset(
        str(path), processor, prompt_key="problem", answer_key="answer", image_key="images", image_dir=None,
        max_prompt_length=1024, min_pixels=3136, max_pixels=12544,
    )  # fmt: skip
    first, second = data[0], data[1]
    # Everything but the prompt, answer and image columns; data_source stays (reward_input sets it anyway).
    assert first.extra == {"data_source": "colours", "difficulty": 3, "choices": ["red", "blue"], "id": "row-0"}
    assert second.extra["id"] == "row-1" and second.extra["choices"] == ["blue"]


def test_reward_inputs_hold_easyr1_keys_vlmrl_additions_and_extra_fields():
    batch = make_batch(["red", "blue"], [1, 4])
    first, second = reward_inputs(batch)
    assert first["response"] == "red" and first["response_length"] == 1 and first["ground_truth"] == "red"
    assert second["response_length"] == 4  # valid tokens, not the padded width
    assert first["prompt"] == "prompt 0"  # vlmrl's key wins over a column of the same name
    assert first["data_source"] == "colours" and first["sample_id"] == 0 and second["sample_id"] == 1
    assert first["images"][0].size == (28, 14) and second["images"] == []
    assert second["difficulty"] == 1
    assert set(first) == {"response", "response_length", "ground_truth", "prompt", "data_source", "images",
                          "sample_id", "difficulty"}  # fmt: skip


def test_a_batch_without_images_or_extra_fields_still_gives_every_key():
    batch = make_batch(["red"], [1])
    batch.trajectories = [dataclasses.replace(t, media=[], extra={}) for t in batch.trajectories]
    (x,) = reward_inputs(batch)
    assert x["images"] == [] and x["response"] == "red"


@pytest.mark.parametrize("n", [2, 3])
def test_the_samples_of_a_prompt_share_their_image_list(n):
    # Pickling sends an image once per prompt, not once per sample, when the n samples share the object.
    batch = make_batch(["red"] * n, [1] * n)
    shared = batch.trajectories[0].media
    batch.trajectories = [dataclasses.replace(t, media=shared) for t in batch.trajectories]
    xs = reward_inputs(batch)
    assert all(len(x["images"]) == 1 and x["images"][0] is shared[0].item for x in xs)
