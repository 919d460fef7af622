"""Qwen2-VL and Qwen2.5-VL: 3-D rotary positions, Qwen's vision markers, the tower at ``model.visual``.

The two share everything but one thing, which is why they share a module:
Qwen2.5-VL spaces a video's temporal positions by its time
(``tokens_per_second * second_per_grid_ts``), while Qwen2-VL counts temporal
patches. Their processors, tokens, resizing (patch 14, merge 2) and module
layout are the same.
"""

from __future__ import annotations

from vlmrl.models import qwen_vision
from vlmrl.models.base import Family
from vlmrl.models.mrope import MRope


def qwen2_vl_positions(config) -> MRope:
    return MRope.from_config(config, scale_video_time=False, video_frames_apart=False)


def qwen2_5_vl_positions(config) -> MRope:
    return MRope.from_config(config, scale_video_time=True, video_frames_apart=False)


QWEN2_VL = Family(
    name="Qwen2-VL",
    model_type="qwen2_vl",
    banned_tokens=qwen_vision.SPECIAL_TOKENS,
    rotary=qwen2_vl_positions,
    image_token=qwen_vision.IMAGE_PAD,
    video_token=qwen_vision.VIDEO_PAD,
    vision_tower="visual",
    lora_exclude=qwen_vision.LORA_EXCLUDE,
    media_sizes=qwen_vision.QwenMediaSizes.of,
)

QWEN2_5_VL = Family(
    name="Qwen2.5-VL",
    model_type="qwen2_5_vl",
    banned_tokens=qwen_vision.SPECIAL_TOKENS,
    rotary=qwen2_5_vl_positions,
    image_token=qwen_vision.IMAGE_PAD,
    video_token=qwen_vision.VIDEO_PAD,
    vision_tower="visual",
    lora_exclude=qwen_vision.LORA_EXCLUDE,
    media_sizes=qwen_vision.QwenMediaSizes.of,
)
