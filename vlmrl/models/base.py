"""What a model family decides, as one record: ``Family``.

A family is one ``model_type`` of transformers' configs. Its adapter module
(``qwen2_vl``, ``qwen3_vl``, ``qwen_text``) fills a ``Family`` with what the
rest of vlmrl would otherwise have to know about it: the special tokens a
response may not hold and the media placeholders, the rotary positions of a
prompt, how images and videos are resized to the processor's grid, where the
vision tower sits and what LoRA leaves alone. Callers choose the family once
from the model's config (``vlmrl.models.family_of``) and then ask it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from PIL import Image


class RotaryPositions(Protocol):
    """A family's rotary scheme for one model config."""

    def positions(self, input_ids: list[int], mm_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(3, len(input_ids)) positions of an unpadded sequence; ValueError if its tokens and media disagree."""
        ...


class MediaSizes(Protocol):
    """A family's resizing of images and video frames to its processor's grid, within a pixel budget."""

    def image(self, image: Image.Image) -> Image.Image:
        """``image`` on the grid; ValueError if it cannot be (an extreme aspect ratio)."""
        ...

    def frame(self, frame: Image.Image) -> Image.Image:
        """One video frame, resized as it is read."""
        ...

    def video(self, frames: list[Image.Image], fps: float) -> torch.Tensor:
        """(T, C, H, W) float frames on the grid, ready for the processor (T as the family's temporal patch needs)."""
        ...


class TextPositions:
    """One position per token, the same on all three rows (a text model reads one of them)."""

    def positions(self, input_ids: list[int], mm_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        n = len(input_ids)
        return torch.arange(n, dtype=torch.long).expand(3, n).clone()


def text_positions(config: Any) -> TextPositions:
    """The rotary scheme of any text family."""
    return TextPositions()


@dataclass(frozen=True)
class Family:
    """One model family: what its adapter module decides, and the questions callers ask of it."""

    name: str
    """For people: "Qwen2.5-VL"."""
    model_type: str
    """transformers' ``config.model_type`` of the family's checkpoints."""
    banned_tokens: tuple[str, ...]
    """Special tokens a response may not hold (the vision markers: a sampled one breaks the actor's forward). A
    tokenizer that lacks one simply has nothing to ban for it."""
    rotary: Callable[[Any], RotaryPositions]
    """config -> the family's rotary scheme for that config."""
    image_token: str | None = None
    """The placeholder the chat template writes per image, which the processor expands; None: a text family."""
    video_token: str | None = None
    """The placeholder per video."""
    vision_tower: str | None = None
    """The attribute that holds the vision tower on the module that owns it (``model.visual`` on the HF model:
    ``"visual"``); None for a text family."""
    lora_exclude: str | None = None
    """peft's ``exclude_modules`` when the user gives none: the vision tower gets no adapters."""
    media_sizes: Callable[[Any, int, int], MediaSizes] | None = None
    """(image processor, min_pixels, max_pixels) -> the family's resizing; None for a text family."""
    stop_opens_turn: bool = False
    """A reply stops at the token that opens the next turn (GLM-4.1V: ``<|user|>``; the template closes no turn),
    so the multi-turn renderer leaves that token out of what follows a reply that ended with it: the template
    writes it once (``ConversationRenderer``, ``Episode.add_observation``). False: a reply's stop token closes
    its own turn (Qwen's ``<|im_end|>``)."""
    no_agent_endpoint: str | None = None
    """Why the family's models are not trained on an OpenAI-compatible agent's calls yet (validation then refuses
    ``worker.rollout.workflow=openai_agent`` with this reason); None: they are."""
    engine_weight: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    """(HF name, the actor's tensor) -> the tensor in the layout vLLM loads, applied to every weight the sync hands
    the engine, where the two layouts differ (Qwen3-VL-MoE's fused experts); None: they are the same."""
    engine_config: Mapping[str, Any] | None = None
    """Config values vLLM's model of the family needs and a checkpoint may leave to transformers' code, given to
    vLLM as ``hf_overrides`` (``worker.actor.model.override_config`` goes on top): without them vLLM builds a
    model that differs from the actor's (GLM-4.1V: no q/k/v biases). None: nothing."""
    prepare: Callable[[torch.nn.Module], None] | None = None
    """Applied to every model of the family the trainer loads (``vlmrl.train.models.load_pretrained``), before it is
    wrapped: what transformers' code of the family needs for vlmrl's passes (Qwen3.5: packed sequences kept apart
    in its linear-attention layers); None: nothing."""
    cpu_engine_bfloat16: str | None = None
    """Why vLLM on CPU runs the family in bfloat16 only (validation then refuses any other worker.rollout.dtype on
    a CPU run, with this reason); None: any dtype."""
    routed_experts: bool = False
    """The decoder's MLPs are sparse: a router sends each token to some of its experts, and transformers' model
    computes the router's load-balancing loss when asked (``output_router_logits``), which
    ``worker.actor.router_aux_loss_coef`` adds to the actor's loss."""
    recurrent_layers: bool = False
    """Some decoder layers carry a recurrent state along the sequence instead of keys and values (Qwen3.5's linear
    attention): vLLM caches the prefixes of such a model only with chunked prefill, which CPU engines run without
    (the engine then runs without a prefix cache), and the shared-prompt forward, which hands each row its prompt's
    keys and values, cannot run it (validation refuses worker.actor.share_prompts)."""

    @property
    def vision(self) -> bool:
        """A vision-language family (images and videos in prompts)."""
        return self.image_token is not None

    def positions(self, config: Any) -> RotaryPositions:
        """The rotary scheme of a model of this family with transformers config ``config``."""
        return self.rotary(config)

    def media_pad_ids(self, tokenizer: Any) -> tuple[int, int]:
        """The image and the video placeholder ids in ``tokenizer`` (-1 for one it lacks, and for a text family)."""
        vocab = tokenizer.get_vocab()
        return tuple(vocab.get(t, -1) if t is not None else -1 for t in (self.image_token, self.video_token))

    def tower(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The vision tower of ``model`` (wrapped or not: the first module that holds it), None for a text family."""
        if self.vision_tower is None:
            return None
        for module in model.modules():
            if self.vision_tower in module._modules:
                return module._modules[self.vision_tower]
        return None

    def sizes(self, processor: Any, min_pixels: int, max_pixels: int) -> MediaSizes:
        """The resizing of the images and videos of a model with ``processor``, within the pixel budget."""
        if self.media_sizes is None:
            raise ValueError(f"{self.name} ({self.model_type}) is a text family: its models take no images")
        return self.media_sizes(processor.image_processor, min_pixels, max_pixels)

    def engine_overrides(self, user: Mapping[str, Any] | None) -> dict[str, Any]:
        """vLLM's ``hf_overrides``: the family's ``engine_config`` with ``user`` (the run's ``override_config``)
        merged on top, a nested config's keys one by one.

        >>> GLM = Family("GLM", "glm", (), text_positions, engine_config={"text_config": {"attention_bias": True}})
        >>> GLM.engine_overrides({"text_config": {"rope_theta": 5.0}, "max_position_embeddings": 64})
        {'text_config': {'attention_bias': True, 'rope_theta': 5.0}, 'max_position_embeddings': 64}
        """
        family = self.engine_config or {}
        merged: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in family.items()}
        for key, value in (user or {}).items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
                merged[key].update(value)
            else:
                merged[key] = value
        return merged
