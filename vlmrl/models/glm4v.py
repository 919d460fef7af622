"""GLM-4.1V (``glm4v``): Qwen-VL's 3-D positions and grid, GLM's markers, the tower at ``model.visual``.

GLM-4.1V's vision tower works like Qwen2-VL's (patch 14, merge 2, a temporal
patch of two frames, ``image_grid_thw``), and its rotary positions for images
are Qwen-VL's 3-D scheme: a text token's three rows are equal, an image's run
takes (0, row, column) offset by where it starts, and the text after it
resumes one past the largest position. transformers' ``get_rope_index`` and
vLLM compute the same.

Where it differs from the Qwen families:

- the markers: ``<|begin_of_image|><|image|><|end_of_image|>`` (and
  ``..._video|>``), which a response may not hold;
- the pixel budget: GLM's processor counts an image as two frames (its
  temporal patch), so an image is kept within half the processor's own budget
  as well as the user's, and the processor (the dataset's, and vLLM's, which
  is the same) leaves it as it is;
- no end-of-turn token: a reply stops at ``<|user|>`` (or
  ``<|observation|>``), the token that opens the next turn, so the
  multi-turn renderer leaves that token out of the next turn when the reply
  already holds it (``stop_opens_turn``); the agent endpoint's calls are not
  checked for this layout yet and are refused (``no_agent_endpoint``);
- videos are refused. GLM writes a video as one ``<|image|>`` run per frame
  between timestamp texts, and transformers' GLM-4.1V scatters image and video
  features by the same token, so a row with both cannot be run; vlmrl takes
  images only for this family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vlmrl.models.base import Family
from vlmrl.models.mrope import MRope
from vlmrl.models.qwen_vision import LORA_EXCLUDE, grid_size

IMAGE_TOKEN = "<|image|>"
VIDEO_TOKEN = "<|video|>"
SPECIAL_TOKENS = (
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>", IMAGE_TOKEN, VIDEO_TOKEN,
)  # fmt: skip
"""GLM-4.1V's vision markers: never sampled (a sampled ``<|image|>`` breaks the actor's forward)."""


def glm4v_positions(config) -> MRope:
    """Qwen-VL's 3-D positions; videos never reach them (``GlmMediaSizes`` refuses them)."""
    return MRope.from_config(config, scale_video_time=False, video_frames_apart=True)


@dataclass(frozen=True)
class GlmMediaSizes:
    """GLM-4.1V's resizing for one image processor and pixel budget: Qwen's grid rule within both budgets."""

    factor: int
    """The grid cell's side in pixels: one merged patch (patch 14 x merge 2)."""
    min_pixels: int
    max_pixels: int

    @classmethod
    def of(cls, image_processor: Any, min_pixels: int, max_pixels: int) -> GlmMediaSizes:
        size = image_processor.size
        # The processor reads its budget as frames * height * width, an image being two frames.
        frames = image_processor.temporal_patch_size
        shortest, longest = -(-size["shortest_edge"] // frames), size["longest_edge"] // frames
        low, high = max(min_pixels, shortest), min(max_pixels, longest)
        if low > high:
            raise ValueError(
                f"the pixel budget [{min_pixels}, {max_pixels}] and GLM-4.1V's processor budget (an image's area "
                f"within [{shortest}, {longest}]) do not overlap; set data.min_pixels / data.max_pixels within it"
            )
        return cls(image_processor.patch_size * image_processor.merge_size, low, high)

    def image(self, image: Image.Image) -> Image.Image:
        height, width = grid_size(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
        return image.resize((width, height), Image.Resampling.BICUBIC)

    def frame(self, frame: Image.Image) -> Image.Image:
        raise ValueError("vlmrl takes no videos for GLM-4.1V (images only); drop the row's videos")

    def video(self, frames: list[Image.Image], fps: float) -> torch.Tensor:
        raise ValueError("vlmrl takes no videos for GLM-4.1V (images only); drop the row's videos")


GLM4V = Family(
    name="GLM-4.1V",
    model_type="glm4v",
    banned_tokens=SPECIAL_TOKENS,
    rotary=glm4v_positions,
    image_token=IMAGE_TOKEN,
    video_token=VIDEO_TOKEN,
    vision_tower="visual",
    lora_exclude=LORA_EXCLUDE,
    media_sizes=GlmMediaSizes.of,
    stop_opens_turn=True,
    # transformers' GLM-4.1V text attention always has q, k and v biases; vLLM's builds them only when the config
    # says attention_bias, which a checkpoint may leave out. Without them vLLM drops the biases as it loads and
    # the engine drifts from the actor as soon as training moves them.
    engine_config={"text_config": {"attention_bias": True}},
    no_agent_endpoint=(
        "the agent endpoint's merging of an agent's calls into training rows is not checked yet for GLM-4.1V's "
        "turns, which have no end-of-turn token (a reply stops at the next turn's <|user|>)"
    ),
)
