"""Bad input: a dataset whose answer column holds lists (a parquet or JSON list column).

``str(answer)`` gave the reward function Python's repr (``"['4', 'four']"``),
which no reward function parses reliably. A one-item list is its item; a longer
one a JSON list; other answers are unchanged.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.media import write_parquet
from transformers import AutoProcessor

from vlmrl.data.dataset import RLHFDataset, answer_text


def test_answer_text():
    assert answer_text("4") == "4" and answer_text(4) == "4"
    assert answer_text(["4"]) == "4"
    assert answer_text(np.array(["4", "four"])) == '["4", "four"]'
    assert json.loads(answer_text(["x", 2])) == ["x", 2]
    assert answer_text({"a": 1}) == '{"a": 1}'


@pytest.mark.parametrize(("answer", "expected"), [(["7"], "7"), (["7", "seven"], '["7", "seven"]')])
def test_a_list_answer_column_reaches_the_reward_as_text(tmp_path, tiny_assets, answer, expected):
    files = write_parquet(tmp_path / "d.parquet", [{"problem": "what is 3 + 4?", "answer": answer}])
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    ds = RLHFDataset(files, processor, prompt_key="problem", answer_key="answer", image_key="images",
                     image_dir=None, max_prompt_length=256, min_pixels=3136, max_pixels=12544, video_fps=2.0)  # fmt: skip
    assert ds[0].ground_truth == expected
