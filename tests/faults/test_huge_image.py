"""Fault: a dataset row whose image decodes to far more pixels than PIL allows (a decompression bomb).

PIL raises ``DecompressionBombError``, which is not an ``OSError``: it escaped
the dataset's bad-row handling and crashed start-up even with
``data.on_bad_sample=skip``. Now it is a bad row like any other: named by file,
row and key, and left out under skip.
"""

from __future__ import annotations

import io

import pytest
from helpers.media import png, write_jsonl
from PIL import Image
from transformers import AutoProcessor

from vlmrl.data.dataset import DataError, RLHFDataset

GOOD = {"problem": "<image>fine", "answer": "ok", "images": ["good.png"], "videos": None}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bomb")
    (tmp / "good.png").write_bytes(png(56, 56))
    # 14000 x 14000 = 1.96e8 pixels, past twice PIL's MAX_IMAGE_PIXELS (about 8.9e7): a bomb. One bit per
    # pixel and one colour, so the file itself is 50 kB.
    buffer = io.BytesIO()
    Image.new("1", (14000, 14000), 1).save(buffer, format="PNG")
    (tmp / "bomb.png").write_bytes(buffer.getvalue())
    write_jsonl(tmp / "d.jsonl", [GOOD, {**GOOD, "images": ["bomb.png"]}, GOOD])
    return tmp


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


def _dataset(data_dir, processor, **overrides):
    kwargs = dict(prompt_key="problem", answer_key="answer", image_key="images", image_dir=str(data_dir),
                  max_prompt_length=1024, min_pixels=3136, max_pixels=12544, video_fps=2.0)  # fmt: skip
    kwargs.update(overrides)
    return RLHFDataset(str(data_dir / "d.jsonl"), processor, **kwargs)


def test_a_decompression_bomb_is_a_bad_row_named_by_file_row_and_key(data_dir, processor):
    with pytest.raises(DataError, match=r"d\.jsonl row 1, key 'images'.*image too large to decode"):
        _dataset(data_dir, processor)


def test_with_skip_the_bomb_is_left_out_and_the_rest_loads(data_dir, processor):
    ds = _dataset(data_dir, processor, on_bad_sample="skip")
    assert [s.index for s in ds] == [0, 2]
    assert list(ds.skipped) == [1] and "image too large to decode" in ds.skipped[1]
