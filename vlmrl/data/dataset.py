"""An image-aware RLHF prompt dataset.

Each row becomes a ``PromptSample``: the chat-templated prompt twice (with one
placeholder per image for vLLM, and expanded to the image's patch tokens for
the actor), the images resized once to the processor's grid so that vLLM and
the actor see the same pixels, and the processor outputs for the actor.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import datasets
import jinja2
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from vlmrl.protocol import PromptSample

IMAGE_PLACEHOLDER = "<image>"


def grid_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) on the processor's grid, within [min_pixels, max_pixels].

    The processor's own smart_resize keeps each side at least one grid cell,
    which for a very wide or tall image can exceed max_pixels; the long side is
    then cut back. The result is a fixed point of smart_resize, so vLLM's
    processor and the actor's see the same grid.
    """
    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    if h * w > max_pixels:
        if h <= w:
            w = max(factor, max_pixels // h // factor * factor)
        else:
            h = max(factor, max_pixels // w // factor * factor)
    return h, w


class DataError(ValueError):
    """A row or file that cannot be used, named with where it came from."""


def load_rows(files: str) -> datasets.Dataset:
    """Read one or more comma-separated local parquet/json/jsonl files into one dataset."""
    paths = [p.strip() for p in files.split(",") if p.strip()]
    parts = []
    for path in paths:
        suffix = Path(path).suffix.lstrip(".")
        builder = {"parquet": "parquet", "json": "json", "jsonl": "json"}.get(suffix)
        if builder is None:
            raise DataError(f"{path}: unsupported data file type {suffix!r}; use .parquet, .json or .jsonl")
        parts.append(datasets.load_dataset(builder, data_files=path, split="train"))
    first = parts[0]
    for path, part in zip(paths[1:], parts[1:]):
        if set(part.column_names) != set(first.column_names):
            raise DataError(
                f"{path}: columns {sorted(part.column_names)} differ from {paths[0]}'s {sorted(first.column_names)}; "
                "files listed together must have the same columns"
            )
    # Same columns can still differ in type (a jsonl "string" next to a pandas
    # parquet "large_string"); align each file to the first one's schema.
    aligned = [first] + [part.cast(first.features) for part in parts[1:]]
    return first if len(parts) == 1 else datasets.concatenate_datasets(aligned)


class RLHFDataset:
    def __init__(
        self,
        files: str,
        processor: Any,
        *,
        prompt_key: str,
        answer_key: str,
        image_key: str,
        image_dir: str | None,
        max_prompt_length: int,
        min_pixels: int,
        max_pixels: int,
        format_prompt: str | None = None,
        override_chat_template: str | None = None,
        filter_overlong_prompts: bool = True,
    ):
        self.files = files
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.prompt_key, self.answer_key, self.image_key = prompt_key, answer_key, image_key
        self.image_dir = Path(image_dir) if image_dir else None
        self.max_prompt_length = max_prompt_length
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        image_processor = processor.image_processor
        self.resize_factor = image_processor.patch_size * image_processor.merge_size
        self.format_template = (
            jinja2.Template(Path(format_prompt).read_text()) if format_prompt else None
        )
        self.chat_template = override_chat_template
        self.rows = load_rows(files)
        for key in (prompt_key, answer_key):
            if key not in self.rows.column_names:
                raise DataError(
                    f"{files}: no column {key!r} (columns: {self.rows.column_names}); "
                    "set data.prompt_key / data.answer_key to the right column"
                )
        if filter_overlong_prompts:
            keep = [i for i in range(len(self.rows)) if len(self.sample(i).input_ids) <= max_prompt_length]
            if not keep:
                raise DataError(
                    f"{files}: every prompt is longer than data.max_prompt_length={max_prompt_length} tokens; "
                    "raise it or lower data.max_pixels"
                )
            self.index = keep
        else:
            self.index = list(range(len(self.rows)))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> PromptSample:
        return self.sample(self.index[i])

    def sample(self, row_id: int) -> PromptSample:
        """Row ``row_id`` of the underlying files (before filtering) as a PromptSample."""
        row = self.rows[row_id]
        where = f"{self.files} row {row_id}"
        images = [self._load_image(x, where) for x in self._images_of(row)]
        text = self._render_prompt(str(row[self.prompt_key]), len(images), where)
        mm_inputs: dict = {}
        if images:
            out = self.processor(text=[text], images=images, return_tensors="pt", do_resize=False)
            mm_inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        else:
            out = self.processor(text=[text], return_tensors="pt")
        input_ids = out["input_ids"][0].tolist()
        raw_prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return PromptSample(
            index=row_id,
            raw_prompt_ids=raw_prompt_ids,
            input_ids=input_ids,
            images=images,
            mm_inputs=mm_inputs,
            ground_truth=str(row[self.answer_key]),
            data_source=str(row.get("data_source", "unknown")),
            prompt_text=text,
            extra={k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key, self.image_key)},
        )

    def _images_of(self, row: dict) -> list:
        value = row.get(self.image_key)
        if value is None:
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def _load_image(self, item: Any, where: str) -> Image.Image:
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        try:
            if isinstance(item, Image.Image):
                image = item
            elif isinstance(item, (bytes, bytearray)):
                image = Image.open(io.BytesIO(item))
            elif isinstance(item, str):
                path = Path(item)
                if not path.is_absolute() and self.image_dir is not None:
                    path = self.image_dir / path
                image = Image.open(path)
            else:
                raise DataError(f"{where}: cannot read an image from {type(item).__name__}")
            image = image.convert("RGB")
        except (OSError, ValueError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{where}: unreadable image ({e})") from e
        try:
            height, width = grid_size(image.height, image.width, self.resize_factor, self.min_pixels, self.max_pixels)
        except ValueError as e:
            raise DataError(f"{where}: image of {image.width}x{image.height} px cannot be used ({e})") from e
        return image.resize((width, height), Image.Resampling.BICUBIC)

    def _render_prompt(self, prompt: str, n_images: int, where: str) -> str:
        if self.format_template is not None:
            prompt = self.format_template.render(content=prompt)
        n_placeholders = prompt.count(IMAGE_PLACEHOLDER)
        if n_placeholders not in (0, n_images):
            raise DataError(
                f"{where}: the prompt has {n_placeholders} {IMAGE_PLACEHOLDER} placeholders but the row has "
                f"{n_images} images; they must match, or the prompt must have none (images then go first)"
            )
        if n_placeholders == 0:
            content = [{"type": "image"} for _ in range(n_images)]
            if prompt:
                content.append({"type": "text", "text": prompt})
        else:
            content = []
            for i, piece in enumerate(prompt.split(IMAGE_PLACEHOLDER)):
                if i > 0:
                    content.append({"type": "image"})
                if piece:
                    content.append({"type": "text", "text": piece})
        messages = [{"role": "user", "content": content}]
        return self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=self.chat_template
        )
