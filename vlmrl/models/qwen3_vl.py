"""Qwen3-VL (dense): Qwen's vision markers and resizing (patch 16), the tower at ``model.visual``.

Its positions follow the Qwen-VL 3-D scheme with one difference: the template
writes each temporal patch of a video as its own run of pad tokens between
timestamp texts, so each run starts its own temporal block. Its deepstack
features come out of the same ``get_image_features`` (``vlmrl.train.image_features``
shares them per image).
"""

from __future__ import annotations

from vlmrl.models import qwen_vision
from vlmrl.models.base import Family
from vlmrl.models.mrope import MRope


def qwen3_vl_positions(config) -> MRope:
    return MRope.from_config(config, scale_video_time=False, video_frames_apart=True)


QWEN3_VL = Family(
    name="Qwen3-VL",
    model_type="qwen3_vl",
    banned_tokens=qwen_vision.SPECIAL_TOKENS,
    rotary=qwen3_vl_positions,
    image_token=qwen_vision.IMAGE_PAD,
    video_token=qwen_vision.VIDEO_PAD,
    vision_tower="visual",
    lora_exclude=qwen_vision.LORA_EXCLUDE,
    media_sizes=qwen_vision.QwenMediaSizes.of,
)
