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
    files = overrides.pop("files", str(data_dir / "d.jsonl"))
    kwargs.update(overrides)
    return RLHFDataset(files, processor, **kwargs)


def test_a_decompression_bomb_is_a_bad_row_named_by_file_row_and_key(data_dir, processor):
    with pytest.raises(DataError, match=r"d\.jsonl row 1, key 'images'.*image too large to decode"):
        _dataset(data_dir, processor)


def test_with_skip_the_bomb_is_left_out_and_the_rest_loads(data_dir, processor):
    ds = _dataset(data_dir, processor, on_bad_sample="skip")
    assert [s.index for s in ds] == [0, 2]
    assert list(ds.skipped) == [1] and "image too large to decode" in ds.skipped[1]


# The bomb in a parquet file's `datasets` Image column: `datasets` decoded it as the row was read, outside the
# bad-row handling, so the run died at start-up even with skip. Each image form now goes through one checked decode.


def _bomb_bytes(data_dir) -> bytes:
    return (data_dir / "bomb.png").read_bytes()


def _image_column_parquet(path, images: list) -> str:
    import datasets
    import pyarrow.parquet as pq

    features = datasets.Features(
        {"problem": datasets.Value("string"), "answer": datasets.Value("string"), "images": [datasets.Image()]}
    )
    n = len(images)
    table = datasets.Dataset.from_dict(
        {"problem": ["<image>fine"] * n, "answer": ["ok"] * n, "images": images}, features=features
    )
    pq.write_table(table.data.table, path)  # the column as a downloaded file holds it, with its Image feature
    return str(path)


@pytest.mark.parametrize("form", ["bytes", "path"])
def test_a_bomb_in_an_hf_image_column_is_a_bad_row_that_skip_leaves_out(data_dir, processor, tmp_path, form):
    good = {"bytes": (data_dir / "good.png").read_bytes(), "path": None}
    bomb = {"bytes": _bomb_bytes(data_dir), "path": None} if form == "bytes" else {"bytes": None, "path": "bomb.png"}
    files = _image_column_parquet(tmp_path / "d.parquet", [[good], [bomb], [good]])
    with pytest.raises(DataError, match=r"d\.parquet row 1, key 'images'.*image too large to decode"):
        _dataset(data_dir, processor, files=files)
    ds = _dataset(data_dir, processor, files=files, on_bad_sample="skip")
    assert [s.index for s in ds] == [0, 2]
    assert "image too large to decode" in ds.skipped[1]


def test_every_image_form_goes_through_the_same_checked_decode(data_dir):
    from vlmrl.data.media import MediaError, open_image

    bomb = _bomb_bytes(data_dir)
    for item in (
        "bomb.png",
        bomb,
        {"bytes": bomb, "path": None},
        {"bytes": None, "path": "bomb.png"},
        Image.new("1", (14000, 14000)),  # handed over already decoded
    ):
        with pytest.raises(MediaError, match="image too large to decode"):
            open_image(item, data_dir)
