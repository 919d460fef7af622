"""Synthetic image-question datasets for tests and demos (no downloads).

Each task is one generator function, ``(rng) -> Sample``, registered in
``TASKS``; adding a task (counting, left/right, ...) is one function and one
entry. ``write_synthetic_dataset`` renders a task to ``train.parquet`` and
``val.parquet`` in the layout of EasyR1's geometry3k:

* ``problem``: the question, starting with an ``<image>`` placeholder;
* ``answer``: the short ground-truth string;
* ``images``: a list with one ``{"bytes": <png>, "path": None}`` dict, stored
  with the ``datasets.Image`` feature so ``datasets.load_dataset("parquet")``
  decodes it to PIL while plain pyarrow readers see the dicts;
* ``data_source``: the task name.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

# Closed answer set of the colour task. RGB values are saturated and far from
# every background so the answer is unambiguous after resizing.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 20),
}
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
BACKGROUNDS: tuple[tuple[int, int, int], ...] = ((255, 255, 255), (200, 200, 200), (40, 40, 40))
# Multiples of 28 (patch 14 x merge 2), so the processor does not resample.
IMAGE_SIDES: tuple[int, ...] = (56, 84, 112)

# The bare question, as in EasyR1's datasets; the answer format is asked for by
# the run's format prompt (examples/format_prompt/colour.jinja).
COLOUR_QUESTION = "<image>What colour is the shape?"


@dataclass(frozen=True)
class Sample:
    problem: str
    answer: str
    image: Image.Image


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


def colour_sample(rng: random.Random) -> Sample:
    """One coloured shape on a plain background; the answer is its colour."""
    side = rng.choice(IMAGE_SIDES)
    colour = rng.choice(sorted(COLOURS))
    image = Image.new("RGB", (side, side), rng.choice(BACKGROUNDS))
    size = rng.randint(side // 3, side * 3 // 4)
    x0 = rng.randint(0, side - size)
    y0 = rng.randint(0, side - size)
    _draw_shape(ImageDraw.Draw(image), rng.choice(SHAPES), (x0, y0, x0 + size - 1, y0 + size - 1), COLOURS[colour])
    return Sample(problem=COLOUR_QUESTION, answer=colour, image=image)


# The quickstart's canvas: one size (84 px: 3 x 3 merged image tokens) and one
# background, with the shape covering 1/2 to 3/4 of the side. Measured on the
# tiny random model, varying canvas sizes and backgrounds drown the colour in
# the image features (colour explains ~17% of the variance of the last hidden
# state across images, against ~72% here), and RL then collapses onto one
# colour before it learns to look; see docs/notes/quickstart-design.md.
QUICKSTART_SIDE = 84
QUICKSTART_BACKGROUND = (255, 255, 255)


def shape_colour_sample(rng: random.Random) -> Sample:
    """One large coloured shape on a white 84 px canvas; the answer is its colour."""
    side = QUICKSTART_SIDE
    colour = rng.choice(sorted(COLOURS))
    image = Image.new("RGB", (side, side), QUICKSTART_BACKGROUND)
    size = rng.randint(side // 2, side * 3 // 4)
    x0 = rng.randint(0, side - size)
    y0 = rng.randint(0, side - size)
    _draw_shape(ImageDraw.Draw(image), rng.choice(SHAPES), (x0, y0, x0 + size - 1, y0 + size - 1), COLOURS[colour])
    return Sample(problem=COLOUR_QUESTION, answer=colour, image=image)


TASKS: dict[str, Callable[[random.Random], Sample]] = {
    "synthetic_colour": colour_sample,
    "shape_colour": shape_colour_sample,
}


def blanked(sample: Sample) -> Sample:
    """The same question and answer over a canvas with the shape removed.

    A policy trained on blanked rows can only learn the answer distribution, so
    its accuracy is the baseline that looking at the image has to beat.
    """
    background = sample.image.getpixel((0, 0))
    return Sample(sample.problem, sample.answer, Image.new("RGB", sample.image.size, background))


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _write_split(path: Path, task: str, n: int, rng: random.Random, blank_images: bool = False) -> None:
    # Imported here: datasets is slow to import and only needed when writing.
    import pyarrow.parquet as pq
    from datasets import Dataset, Features, Image as ImageFeature, List, Value

    samples = [TASKS[task](rng) for _ in range(n)]
    if blank_images:
        samples = [blanked(s) for s in samples]
    features = Features(
        {
            "problem": Value("string"),
            "answer": Value("string"),
            "images": List(ImageFeature()),
            "data_source": Value("string"),
        }
    )
    columns = {
        "problem": [s.problem for s in samples],
        "answer": [s.answer for s in samples],
        "images": [[{"bytes": _png_bytes(s.image), "path": None}] for s in samples],
        "data_source": [task] * n,
    }
    # The arrow table carries the features in its schema metadata, which is
    # what makes `load_dataset("parquet")` decode `images` as PIL images.
    # (pq.write_table rather than Dataset.to_parquet: same file, no progress bar.)
    pq.write_table(Dataset.from_dict(columns, features=features).data.table, path)


def write_synthetic_dataset(
    out_dir: str | Path,
    n_train: int = 256,
    n_val: int = 64,
    seed: int = 0,
    task: str = "synthetic_colour",
    blank_images: bool = False,
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` for ``task`` into ``out_dir``.

    Deterministic in ``seed``; train and val draw from independent streams, so
    changing ``n_train`` leaves the validation rows unchanged. ``blank_images``
    writes the same rows with the shapes removed (see ``blanked``).
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(TASKS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("val", n_val)):
        path = out_dir / f"{split}.parquet"
        # A string seed is hashed with sha512 by `random`, so this is stable across runs.
        _write_split(path, task, n, random.Random(f"{task}:{split}:{seed}"), blank_images)
        paths.append(path)
    return paths[0], paths[1]
