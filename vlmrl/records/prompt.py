"""One dataset row, ready for the rollout and the model's forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.records.shipping import ShipsTensors


@dataclass
class PromptSample(ShipsTensors):
    """One dataset row, ready for both the rollout and the actor."""

    index: int
    """Row index in its dataset."""
    raw_prompt_ids: list[int]
    """Chat-templated prompt with one placeholder token per image or video: vLLM expands these itself."""
    input_ids: list[int]
    """The same prompt with each placeholder expanded to its patch tokens: what the actor sees."""
    images: list[Any]
    """The row's images as PIL images, already resized to the processor's grid."""
    mm_inputs: dict[str, torch.Tensor]
    """Processor outputs for the actor (pixel_values, image_grid_thw, pixel_values_videos,
    video_grid_thw), only the keys of the media the row has; empty for a text-only row."""
    ground_truth: str
    data_source: str
    prompt_text: str
    question: str = ""
    """The row's prompt column as written (before data.format_prompt and the chat template): the ``prompt`` an external
    agent (``worker.rollout.agent``) gets, which renders its own messages."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other columns (not prompt, answer, images or videos), passed to the reward function."""
    videos: list[Any] = field(default_factory=list)
    """The row's videos (``vlmrl.data.media.Video``: sampled frames on the processor's grid)."""
    position_ids: torch.Tensor | None = None
    """(3, len(input_ids)) rotary positions (temporal, height, width) of the expanded prompt."""
    uid: str = ""
    """Stable id of the row: "FILE:ROW", its source and its index there."""

    @property
    def attention_mask(self) -> list[int]:
        """All ones: a sample is unpadded; the rollout pads batches."""
        return [1] * len(self.input_ids)

    @property
    def multi_modal_data(self) -> dict[str, list]:
        """The media as vLLM's ``multi_modal_data`` wants them; empty for a text-only row."""
        data: dict[str, list] = {}
        if self.images:
            data["image"] = list(self.images)
        if self.videos:
            data["video"] = [video.for_vllm() for video in self.videos]
        return data
