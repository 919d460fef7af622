"""The synthetic colour dataset: layout, determinism, and that labels match pixels."""

from __future__ import annotations

import io

import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlmrl.testing.synthetic import COLOURS, write_synthetic_dataset

COLUMNS = ["problem", "answer", "images", "data_source"]


def _rows(path):
    return pq.read_table(path).to_pylist()


def _shape_colour(image: Image.Image) -> str:
    """The answer as read from the pixels: the palette colour that is present."""
    rgb_image = image.convert("RGB")
    pixels = {rgb for _, rgb in rgb_image.getcolors(rgb_image.width * rgb_image.height)}
    present = [name for name, rgb in COLOURS.items() if rgb in pixels]
    assert len(present) == 1, present
    return present[0]


def test_layout_matches_geometry3k_style(tmp_path):
    train, val = write_synthetic_dataset(tmp_path, n_train=12, n_val=5, seed=0)
    assert (train.name, val.name) == ("train.parquet", "val.parquet")
    for path, n in ((train, 12), (val, 5)):
        table = pq.read_table(path)
        assert table.column_names == COLUMNS
        assert table.num_rows == n
        for row in table.to_pylist():
            assert row["problem"].startswith("<image>") and row["problem"].count("<image>") == 1
            assert row["answer"] in COLOURS
            assert row["data_source"] == "synthetic_colour"
            (image,) = row["images"]
            assert image["path"] is None
            decoded = Image.open(io.BytesIO(image["bytes"]))
            assert decoded.format == "PNG"
            assert 56 <= decoded.width <= 112 and decoded.height == decoded.width
            assert _shape_colour(decoded) == row["answer"]


def test_same_seed_same_bytes_other_seed_other_rows(tmp_path):
    a = write_synthetic_dataset(tmp_path / "a", n_train=16, n_val=4, seed=3)
    b = write_synthetic_dataset(tmp_path / "b", n_train=16, n_val=4, seed=3)
    c = write_synthetic_dataset(tmp_path / "c", n_train=16, n_val=4, seed=4)
    assert [_rows(p) for p in a] == [_rows(p) for p in b]
    assert _rows(a[0]) != _rows(c[0])
    # Train and val are independent streams: different rows, and val does not
    # depend on how many training rows were drawn.
    assert _rows(a[0])[:4] != _rows(a[1])
    d = write_synthetic_dataset(tmp_path / "d", n_train=3, n_val=4, seed=3)
    assert _rows(d[1]) == _rows(a[1])


def test_answers_cover_the_closed_set(tmp_path):
    train, _ = write_synthetic_dataset(tmp_path, n_train=64, n_val=1, seed=0)
    assert {row["answer"] for row in _rows(train)} == set(COLOURS)


def test_hf_datasets_decodes_images(tiny_assets):
    from datasets import load_dataset

    dataset = load_dataset("parquet", data_files={"train": str(tiny_assets.train_file)}, split="train")
    assert dataset.num_rows == 256
    row = dataset[0]
    assert isinstance(row["images"][0], Image.Image)
    assert _shape_colour(row["images"][0]) == row["answer"]


def test_unknown_task_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="synthetic_colour"):
        write_synthetic_dataset(tmp_path, task="counting")


def test_quickstart_task_is_one_large_shape_on_a_white_84px_canvas(tmp_path):
    train, _ = write_synthetic_dataset(tmp_path, n_train=32, n_val=1, seed=0, task="shape_colour")
    rows = _rows(train)
    assert {row["answer"] for row in rows} == set(COLOURS)
    for row in rows:
        assert row["data_source"] == "shape_colour" and row["problem"] == "<image>What colour is the shape?"
        image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        assert image.size == (84, 84) and image.getpixel((0, 0)) in {(255, 255, 255), COLOURS[row["answer"]]}
        assert _shape_colour(image) == row["answer"]
        # The shape's box is at least half the side, so even a triangle covers over 1/10 of the canvas.
        covered = sum(1 for rgb in image.getdata() if rgb == COLOURS[row["answer"]])
        assert covered > 84 * 84 / 10, covered


def test_blank_images_keep_the_rows_and_remove_the_shapes(tmp_path):
    shapes = write_synthetic_dataset(tmp_path / "shapes", n_train=16, n_val=8, seed=0, task="shape_colour")
    blank = write_synthetic_dataset(
        tmp_path / "blank", n_train=16, n_val=8, seed=0, task="shape_colour", blank_images=True
    )
    for with_shape, without in zip(shapes, blank):
        a, b = _rows(with_shape), _rows(without)
        assert [(r["problem"], r["answer"]) for r in a] == [(r["problem"], r["answer"]) for r in b]
        for row in b:
            image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
            assert image.size == (84, 84) and image.getcolors() == [(84 * 84, (255, 255, 255))]
