"""An image- and video-aware RLHF prompt dataset.

Each row becomes a ``PromptSample`` that both the vLLM rollout and the FSDP
actor use: the chat-templated prompt twice (one placeholder per image or video
for vLLM, and expanded to the media's patch tokens for the actor), the media
resized once to the processor's grid so that both see the same pixels, the
processor outputs, and the prompt's 3-D rotary positions.

A row that cannot become a sample (an unreadable image or video, a placeholder
count that does not match the media, an empty prompt, no answer) raises a
``BadRowError`` naming its file, row and key. With
``data.filter_overlong_prompts`` every row is checked when the dataset is
built (in ``filter_overlong_prompts_workers`` processes): prompts longer than
``max_prompt_length`` after the media tokens are expanded are dropped and
counted, and bad rows stop the run or, with ``on_bad_sample=skip``, are left
out, counted and logged. Without it rows are checked when read.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import torch
from transformers import AutoConfig
from transformers.video_utils import VideoMetadata

from vlmrl.config.options import BadSamplePolicy
from vlmrl.data.chat import template_has_tools, tools_system_message
from vlmrl.data.errors import BadRowError, DataError
from vlmrl.data.media import (
    MediaError,
    Video,
    load_video,
    open_image,
    resize_to_grid,
)
from vlmrl.data.sources import load_rows
from vlmrl.models import family_of
from vlmrl.records import PromptSample

__all__ = ["BadRowError", "DataError", "RLHFDataset"]

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDER = re.compile(f"({IMAGE_PLACEHOLDER}|{VIDEO_PLACEHOLDER})")
# What the actor's model reads from the processor's output; the rest (token type
# ids, second_per_grid_ts) only serves the positions computed here.
MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
)


class OverlongPromptError(DataError):
    """A prompt longer than ``max_prompt_length`` once its media tokens are expanded."""


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def answer_text(answer: Any) -> str:
    """The ground truth as the reward function gets it: text.

    A list answer (a parquet or JSON list column) of one item is that item; of several, a JSON list, which
    a reward function can parse (``str`` gave Python's repr, ``['a', 'b']``, which nothing parses reliably).
    """
    if hasattr(answer, "tolist") and not isinstance(answer, (str, bytes)):
        answer = answer.tolist()  # numpy arrays and scalars from parquet
    if isinstance(answer, (list, tuple)):
        items = [a.tolist() if hasattr(a, "tolist") else a for a in answer]
        return answer_text(items[0]) if len(items) == 1 else json.dumps(items, ensure_ascii=False)
    if isinstance(answer, dict):
        return json.dumps(answer, ensure_ascii=False)
    return str(answer)


@dataclass(frozen=True)
class _Prepared:
    """A row checked and rendered, its media loaded: what the processor is called on."""

    row_id: int
    row: dict
    where: str
    prompt: str
    answer: Any
    images: list
    videos: list
    text: str
    raw_prompt_ids: list[int]


CHECK_BATCH = 64
"""Rows the start-up check gives the processor in one call: a call's own overhead (its keyword handling) costs more
than a small row's images, so one call per row made the check several times slower."""


# The dataset being checked, for the forked processes of the start-up check.
_CHECKING: RLHFDataset | None = None


def _check_rows(row_ids: list[int]) -> list[tuple[int, str, str]]:
    assert _CHECKING is not None
    return _CHECKING.check_rows(row_ids)


class RLHFDataset(torch.utils.data.Dataset):
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
        filter_overlong_prompts_workers: int = 1,
        video_key: str = "videos",
        video_fps: float = 2.0,
        on_bad_sample: BadSamplePolicy | str = BadSamplePolicy.error,
        model_config: Any = None,
        tools: list[dict] | None = None,
        limit_images: int = 0,
        allow_paths_outside_image_dir: bool = False,
    ):
        self.files = files
        self.limit_images = limit_images
        """worker.rollout.limit_images: a row with more images is bad (the engine plans memory for this many); 0: none."""
        self.tools = tools or []
        """Function schemas the model may call (multi-turn rollouts): they go into every prompt."""
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)  # a text LM's processor may be its tokenizer
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.image_key, self.video_key = image_key, video_key
        self.image_dir = Path(image_dir) if image_dir else None
        self.allow_outside = allow_paths_outside_image_dir
        """data.allow_paths_outside_image_dir: media paths may be absolute or climb out of image_dir."""
        self.max_prompt_length = max_prompt_length
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.video_fps = video_fps
        self.on_bad_sample = BadSamplePolicy(on_bad_sample)
        self.format_template = jinja2.Template(Path(format_prompt).read_text()) if format_prompt else None
        self.chat_template = override_chat_template
        # The positions and the resizing are the model family's; the processor directory holds its config too.
        config = model_config or AutoConfig.from_pretrained(self.tokenizer.name_or_path)
        self.model_config = config
        self.family = family_of(config)
        self.text_only = not self.family.vision
        """A text causal LM: rows with images or videos are refused, positions are 0 .. L-1."""
        self.rotary = self.family.positions(config)
        self.sizes = None if self.text_only else self.family.sizes(processor, min_pixels, max_pixels)

        self.rows = load_rows(files)
        for key, setting in (
            (prompt_key, "data.prompt_key"),
            (answer_key, "data.answer_key"),
        ):
            if key not in self.rows.table.column_names:
                raise DataError(
                    f"{files}: no column {key!r} (columns: {self.rows.table.column_names}); "
                    f"set {setting} to the right column (data.prompt_key / data.answer_key)"
                )
        self.skipped: dict[int, str] = {}
        """Rows left out as bad, by row id, with the reason (on_bad_sample=skip)."""
        self.overlong: list[int] = []
        """Rows dropped by filter_overlong_prompts."""
        if filter_overlong_prompts or self.on_bad_sample is BadSamplePolicy.skip:
            # With on_bad_sample=skip every row is read once now, so that a bad row is left out of the index
            # instead of found at read time, where the next row would take its place and appear twice.
            self.index = self._check_all(max(1, filter_overlong_prompts_workers), drop_long=filter_overlong_prompts)
        else:
            self.index = list(range(len(self.rows)))
        if not self.index:
            raise DataError(
                f"{files}: no usable rows left: {len(self.rows)} rows, {len(self.overlong)} longer than "
                f"data.max_prompt_length={max_prompt_length} tokens once image and video tokens are counted, "
                f"{len(self.skipped)} bad; raise data.max_prompt_length, lower data.max_pixels or fix the rows"
            )

    # ------------------------------------------------------------ indexing

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> PromptSample:
        """The i-th usable row; with on_bad_sample=skip a bad row found only now gives way to the next one."""
        if not -len(self.index) <= i < len(self.index):
            raise IndexError(f"row {i} of a dataset of {len(self.index)}")
        i %= len(self.index)
        for step in range(len(self.index)):
            row_id = self.index[(i + step) % len(self.index)]
            try:
                return self.sample(row_id)
            except BadRowError as e:
                if self.on_bad_sample is BadSamplePolicy.error:
                    raise
                if row_id not in self.skipped:
                    self.skipped[row_id] = str(e)
                    # The start-up check passed this row, so its source changed since (a file edited or removed).
                    logger.warning(
                        "data: skipped bad row (%d so far): %s; it passed the start-up check, so its source changed "
                        "since; the next usable row takes its place and appears twice this epoch",
                        len(self.skipped), e,
                    )  # fmt: skip
        raise DataError(f"{self.files}: every row is bad ({len(self.skipped)} skipped); see the warnings above")

    def where(self, row_id: int) -> str:
        """'FILE row N' of table row ``row_id``."""
        name, row = self.rows.locate(row_id)
        return f"{name} row {row}"

    # ------------------------------------------------------- start-up check

    def check(self, row_id: int) -> tuple[int, str, str]:
        """(row_id, "ok" | "long" | "bad", message)."""
        try:
            sample = self.sample(row_id, check_length=False)
        except BadRowError as e:
            return row_id, "bad", str(e)
        return self._length_status(row_id, len(sample.input_ids))

    def _length_status(self, row_id: int, tokens: int) -> tuple[int, str, str]:
        if tokens > self.max_prompt_length:
            return row_id, "long", f"{self.where(row_id)}: {tokens} tokens"
        return row_id, "ok", ""

    def check_rows(self, row_ids: list[int]) -> list[tuple[int, str, str]]:
        """``check`` of each row, the same results, with the rows' images processed ``CHECK_BATCH`` rows to a call.

        A row the batch cannot settle (a video, a text model's row, media tokens that do not match its media, a
        batch the processor rejects) is checked alone, so its result and message are ``check``'s own.
        """
        results: dict[int, tuple[int, str, str]] = {}
        for start in range(0, len(row_ids), CHECK_BATCH):
            batch: list[_Prepared] = []
            for row_id in row_ids[start : start + CHECK_BATCH]:
                try:
                    prepared = self._prepare(row_id, check_length=False)
                except BadRowError as e:
                    results[row_id] = (row_id, "bad", str(e))
                    continue
                if isinstance(prepared, PromptSample):  # a text model's row, whole already
                    results[row_id] = self._length_status(row_id, len(prepared.input_ids))
                elif prepared.videos:
                    results[row_id] = self.check(row_id)
                else:
                    batch.append(prepared)
            for prepared, status in zip(batch, self._check_batch(batch), strict=True):
                results[prepared.row_id] = status or self.check(prepared.row_id)
        return [results[r] for r in row_ids]

    def _check_batch(self, batch: list[_Prepared]) -> list[tuple[int, str, str] | None]:
        """Each row's ``check`` result from one processor call on them all; None where it cannot tell."""
        if not batch:
            return []
        images = [image for prepared in batch for image in prepared.images]
        try:
            out = self.processor(
                text=[prepared.text for prepared in batch], return_tensors="pt", do_resize=False, padding=True,
                **({"images": images} if images else {}),
            )  # fmt: skip
        except (ValueError, TypeError, RuntimeError):
            return [None] * len(batch)  # a row's media the processor rejects: found row by row
        grids = out.get("image_grid_thw")
        if "attention_mask" not in out or (images and grids is None):  # a processor that says less: row by row
            return [None] * len(batch)
        results: list[tuple[int, str, str] | None] = []
        first_image = 0
        for i, prepared in enumerate(batch):
            input_ids = out["input_ids"][i][out["attention_mask"][i].bool()].tolist()
            count = len(prepared.images)
            mm_inputs = {"image_grid_thw": grids[first_image : first_image + count]} if count else {}
            first_image += count
            try:
                self.rotary.positions(input_ids, mm_inputs)
            except ValueError:
                results.append(None)  # a bad row: check says so in its own words
                continue
            results.append(self._length_status(prepared.row_id, len(input_ids)))
        return results

    def _check_all(self, workers: int, drop_long: bool = True) -> list[int]:
        """Check every row; return the usable ones. Fills ``overlong`` (with ``drop_long``) and ``skipped``."""
        global _CHECKING
        row_ids = list(range(len(self.rows)))
        if workers > 1 and len(row_ids) > 1:
            size = max(1, len(row_ids) // (workers * 4))
            chunks = [row_ids[i : i + size] for i in range(0, len(row_ids), size)]
            _CHECKING = self
            try:
                # fork: the children inherit the dataset instead of unpickling a processor each. An executor, not
                # multiprocessing.Pool: a child killed mid-check (the OOM killer) breaks the executor, which says
                # so, where a Pool waits forever for the lost chunk.
                context = multiprocessing.get_context("fork")
                with ProcessPoolExecutor(workers, mp_context=context) as pool:
                    results = [r for part in pool.map(_check_rows, chunks) for r in part]
            except BrokenProcessPool as e:
                raise DataError(
                    f"{self.files}: a row-check process died while checking the rows (killed, for example by the "
                    "out-of-memory killer on a large image or video); lower data.filter_overlong_prompts_workers "
                    "(1 checks in this process) or data.max_pixels"
                ) from e
            finally:
                _CHECKING = None
        else:
            results = self.check_rows(row_ids)
        keep = []
        for row_id, status, message in results:
            if status == "ok" or (status == "long" and not drop_long):  # not filtering: found when it is read
                keep.append(row_id)
            elif status == "long":
                self.overlong.append(row_id)
            elif self.on_bad_sample is BadSamplePolicy.error:
                raise DataError(f"{message}\n(data.on_bad_sample=skip leaves such rows out and counts them)")
            else:
                self.skipped[row_id] = message
        if self.overlong:
            logger.warning(
                "data: %s: dropped %d of %d rows longer than data.max_prompt_length=%d (first: %s)",
                self.files, len(self.overlong), len(row_ids), self.max_prompt_length, self.where(self.overlong[0]),
            )  # fmt: skip
        if self.skipped:
            shown = "; ".join(list(self.skipped.values())[:5])
            logger.warning(
                "data: %s: skipped %d bad rows of %d (data.on_bad_sample=skip): %s%s",
                self.files, len(self.skipped), len(row_ids), shown, " ..." if len(self.skipped) > 5 else "",
            )  # fmt: skip
        return keep

    # ------------------------------------------------------------- a sample

    def sample(self, row_id: int, *, check_length: bool = True) -> PromptSample:
        """Row ``row_id`` of the sources (before filtering) as a PromptSample."""
        prepared = self._prepare(row_id, check_length)
        if isinstance(prepared, PromptSample):  # a text model's row
            return prepared
        out = self._process(prepared.text, prepared.images, prepared.videos, prepared.where)
        return self._finish(prepared, out, check_length)

    def _prepare(self, row_id: int, check_length: bool) -> _Prepared | PromptSample:
        """Everything of ``sample`` before the processor: the row's checks, its media and its rendered prompt (a
        text model's row is whole already)."""
        row = self.rows.table[row_id]
        where = self.where(row_id)
        prompt = row.get(self.prompt_key)
        if not isinstance(prompt, str):
            raise BadRowError(
                where,
                self.prompt_key,
                f"the prompt is {type(prompt).__name__} {prompt!r:.60}, not a string",
            )
        if not prompt.strip():
            raise BadRowError(where, self.prompt_key, "the prompt is empty")
        answer = row.get(self.answer_key)
        if answer is None:
            raise BadRowError(
                where,
                self.answer_key,
                "no answer (the value is missing or null); the reward needs one",
            )

        if self.text_only:
            return self._text_sample(row_id, row, where, prompt, answer, check_length)
        n_images = len(_as_list(row.get(self.image_key)))
        if self.limit_images and n_images > self.limit_images:
            raise BadRowError(
                where, self.image_key,
                f"the row has {n_images} images, over worker.rollout.limit_images={self.limit_images} (the most the "
                "vLLM engine takes per prompt); raise limit_images, or 0 for the model's own limit",
            )  # fmt: skip
        images = self._images(row, where)
        videos = self._videos(row, where)
        text = self._render_prompt(prompt, len(images), len(videos), where)
        raw_prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        for kind, token_id, count in (
            ("image", self.model_config.image_token_id, len(images)),
            ("video", self.model_config.video_token_id, len(videos)),
        ):
            if raw_prompt_ids.count(token_id) != count:
                raise BadRowError(
                    where, self.prompt_key,
                    f"the rendered prompt holds {raw_prompt_ids.count(token_id)} {kind} pad tokens for {count} {kind}s; "
                    f"the prompt text (or data.format_prompt) must not contain the model's own vision tokens, "
                    f"use {IMAGE_PLACEHOLDER} / {VIDEO_PLACEHOLDER}",
                )  # fmt: skip

        return _Prepared(row_id, row, where, prompt, answer, images, videos, text, raw_prompt_ids)

    def _finish(self, prepared: _Prepared, out: dict, check_length: bool) -> PromptSample:
        """The PromptSample of a prepared row from the processor's output for it."""
        row_id, row, where, prompt, answer = (
            prepared.row_id, prepared.row, prepared.where, prepared.prompt, prepared.answer
        )  # fmt: skip
        images, videos, text, raw_prompt_ids = prepared.images, prepared.videos, prepared.text, prepared.raw_prompt_ids
        input_ids = out["input_ids"][0].tolist()
        if check_length and len(input_ids) > self.max_prompt_length:
            raise OverlongPromptError(
                f"{where}: the prompt is {len(input_ids)} tokens with its image and video tokens, over "
                f"data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length, lower "
                "data.max_pixels, or set data.filter_overlong_prompts=true to drop such rows"
            )
        mm_inputs = {k: out[k] for k in MODEL_INPUT_KEYS if k in out}
        try:
            # Also the guard against "Image features and image tokens do not match" in the model.
            position_ids = self.rotary.positions(
                input_ids,
                {
                    **mm_inputs,
                    **{k: out[k] for k in ("second_per_grid_ts",) if k in out},
                },
            )
        except ValueError as e:
            raise BadRowError(
                where,
                self.image_key if images else self.video_key,
                f"media tokens do not match the media: {e}",
            ) from e
        name, row_in_file = self.rows.locate(row_id)
        media_keys = (self.prompt_key, self.answer_key, self.image_key, self.video_key)
        return PromptSample(
            index=row_id,
            raw_prompt_ids=raw_prompt_ids,
            input_ids=input_ids,
            images=images,
            mm_inputs=mm_inputs,
            ground_truth=answer_text(answer),
            data_source=str(row.get("data_source") or "unknown"),
            prompt_text=text,
            question=prompt,
            extra={k: v for k, v in row.items() if k not in media_keys},
            videos=videos,
            position_ids=position_ids,
            uid=f"{name}:{row_in_file}",
        )

    def _text_sample(
        self, row_id: int, row: dict, where: str, prompt: str, answer: Any, check_length: bool
    ) -> PromptSample:
        """A row for a text-only model: the prompt as the user turn's text, no media, positions 0 .. L-1."""
        for key in (self.image_key, self.video_key):
            media = row.get(key)
            count = 1 if isinstance(media, str) else len(_as_list(media))
            if count:
                raise BadRowError(
                    where, key,
                    f"the row has {count} {'image' if key == self.image_key else 'video'}(s) but the model is "
                    "text-only (its config.json has no vision_config); use a vision-language model, or data "
                    "without media",
                )  # fmt: skip
        question = prompt
        if self.format_template is not None:
            prompt = self.format_template.render(content=prompt)
        messages = [{"role": "user", "content": prompt}]  # text chat templates take a string content
        kwargs: dict[str, Any] = {}
        if self.tools:
            if template_has_tools(self.chat_template or self.tokenizer.chat_template):
                kwargs["tools"] = self.tools
            else:
                messages.insert(0, {"role": "system", "content": tools_system_message(self.tools)})
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=self.chat_template, **kwargs
        )
        input_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if check_length and len(input_ids) > self.max_prompt_length:
            raise OverlongPromptError(
                f"{where}: the prompt is {len(input_ids)} tokens, over data.max_prompt_length="
                f"{self.max_prompt_length}; raise data.max_prompt_length, or set data.filter_overlong_prompts=true "
                "to drop such rows"
            )
        name, row_in_file = self.rows.locate(row_id)
        media_keys = (self.prompt_key, self.answer_key, self.image_key, self.video_key)
        return PromptSample(
            index=row_id,
            raw_prompt_ids=input_ids,
            input_ids=input_ids,
            images=[],
            mm_inputs={},
            ground_truth=answer_text(answer),
            data_source=str(row.get("data_source") or "unknown"),
            prompt_text=text,
            question=question,
            extra={k: v for k, v in row.items() if k not in media_keys},
            videos=[],
            # The records keep Qwen-VL's three rows; for text they are equal, and a text model reads one.
            position_ids=torch.arange(len(input_ids)).expand(3, -1).clone(),
            uid=f"{name}:{row_in_file}",
        )

    def _images(self, row: dict, where: str) -> list:
        images = []
        for n, item in enumerate(_as_list(row.get(self.image_key))):
            try:
                image = open_image(item, self.image_dir, self.allow_outside)
                images.append(resize_to_grid(image, self.sizes))
            except MediaError as e:
                raise BadRowError(where, self.image_key, f"image {n}: {e}") from e
        return images

    def _videos(self, row: dict, where: str) -> list[Video]:
        videos = []
        value = row.get(self.video_key)
        # One file, or a list of videos each a file or a list of frames.
        for n, item in enumerate([value] if isinstance(value, str) else _as_list(value)):
            try:
                videos.append(
                    load_video(item, self.image_dir, self.video_fps, self.sizes, allow_outside=self.allow_outside)
                )
            except MediaError as e:
                raise BadRowError(where, self.video_key, f"video {n}: {e}") from e
        return videos

    def _process(self, text: str, images: list, videos: list[Video], where: str) -> dict:
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["images"] = images
        if videos:
            kwargs["videos"] = [v.frames for v in videos]
            # The frames are already sampled: the processor must not sample again, and
            # needs their rate for the temporal positions (Qwen2.5-VL) and timestamps (Qwen3-VL).
            kwargs["video_metadata"] = [
                VideoMetadata(
                    total_num_frames=v.frames.shape[0],
                    fps=v.fps,
                    frames_indices=list(range(v.frames.shape[0])),
                )
                for v in videos
            ]
            kwargs["do_sample_frames"] = False
            kwargs["fps"] = self.video_fps
        try:
            # do_resize=False: the media are on the grid already, as vLLM gets them.
            return self.processor(text=[text], return_tensors="pt", do_resize=False, **kwargs)
        except (ValueError, TypeError, RuntimeError) as e:
            key = self.video_key if videos else self.image_key
            raise BadRowError(
                where,
                key,
                f"the processor rejected the row's media ({type(e).__name__}: {e})",
            ) from e

    def _render_prompt(self, prompt: str, n_images: int, n_videos: int, where: str) -> str:
        if self.format_template is not None:
            prompt = self.format_template.render(content=prompt)
        counts = {
            IMAGE_PLACEHOLDER: prompt.count(IMAGE_PLACEHOLDER),
            VIDEO_PLACEHOLDER: prompt.count(VIDEO_PLACEHOLDER),
        }
        for placeholder, n_items, key, kind in (
            (IMAGE_PLACEHOLDER, n_images, self.image_key, "images"),
            (VIDEO_PLACEHOLDER, n_videos, self.video_key, "videos"),
        ):
            if counts[placeholder] not in (0, n_items):
                raise BadRowError(
                    where, key,
                    f"the prompt has {counts[placeholder]} {placeholder} placeholders but the row has {n_items} {kind}; "
                    f"they must match, or the prompt must have none ({kind} then go first)",
                )  # fmt: skip
        # Media without placeholders go first, images before videos.
        content: list[dict] = []
        if counts[IMAGE_PLACEHOLDER] == 0:
            content += [{"type": "image"}] * n_images
        if counts[VIDEO_PLACEHOLDER] == 0:
            content += [{"type": "video"}] * n_videos
        for piece in _PLACEHOLDER.split(prompt):
            if piece == IMAGE_PLACEHOLDER and n_images:
                content.append({"type": "image"})
            elif piece == VIDEO_PLACEHOLDER and n_videos:
                content.append({"type": "video"})
            elif piece:
                content.append({"type": "text", "text": piece})
        messages = [{"role": "user", "content": content}]
        kwargs: dict[str, Any] = {}
        if self.tools:
            template = self.chat_template or getattr(self.processor, "chat_template", None)
            if template_has_tools(template or self.tokenizer.chat_template):
                kwargs["tools"] = self.tools
            else:
                messages.insert(0, {"role": "system", "content": tools_system_message(self.tools)})
        return self.processor.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=False,
            chat_template=self.chat_template,
            **kwargs,
        )
