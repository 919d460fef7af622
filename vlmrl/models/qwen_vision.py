"""What the Qwen-VL families share: their special tokens and their resizing of images and video frames.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL use the same markers around a medium and
resize with the same rule (``smart_resize``: each side a multiple of
``patch_size * merge_size``, the area within the pixel budget); only the
patch size differs (14, or 16 for Qwen3-VL), and it is read from the image
processor. Videos go through qwen-vl-utils' ``fetch_video``, which resizes the
frames and pads their count to the temporal patch (2 frames).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", IMAGE_PAD, VIDEO_PAD)
"""The vision markers of the Qwen vocabulary (the text models' tokenizers hold them too): never sampled."""
LORA_EXCLUDE = r".*visual.*"
"""No adapter anywhere in the vision tower (the HF models name it ``model.visual``)."""


def grid_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) on the processor's grid, within [min_pixels, max_pixels].

    The processor's own smart_resize keeps each side at least one grid cell,
    which for a very wide or tall image can exceed max_pixels; the long side is
    then cut back. The result is a fixed point of smart_resize, so vLLM's
    processor and the actor's see the same grid.
    """
    # Imported here: the module pulls in torchvision, seconds that validating a config (which reads this
    # family's tokens) should not pay.
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    if h * w > max_pixels:
        if h <= w:
            w = max(factor, max_pixels // h // factor * factor)
        else:
            h = max(factor, max_pixels // w // factor * factor)
    return h, w


@dataclass(frozen=True)
class QwenMediaSizes:
    """The Qwen-VL resizing for one image processor and pixel budget."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def of(cls, image_processor: Any, min_pixels: int, max_pixels: int) -> QwenMediaSizes:
        return cls(image_processor.patch_size, image_processor.merge_size, min_pixels, max_pixels)

    @property
    def factor(self) -> int:
        """The grid cell's side in pixels: one merged patch."""
        return self.patch_size * self.merge_size

    def image(self, image: Image.Image) -> Image.Image:
        height, width = grid_size(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
        return image.resize((width, height), Image.Resampling.BICUBIC)

    def frame(self, frame: Image.Image) -> Image.Image:
        from qwen_vl_utils import fetch_image

        # fetch_video's own resize of each listed frame; done at read time, fetch_video then finds the frame
        # already at its size and leaves the pixels as they are.
        return fetch_image(
            {"image": frame, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels}, self.patch_size * 2
        )

    def video(self, frames: list[Image.Image], fps: float) -> torch.Tensor:
        from qwen_vl_utils import fetch_video

        return fetch_video(
            {"video": frames, "sample_fps": fps, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels},
            image_patch_size=self.patch_size,
        )
