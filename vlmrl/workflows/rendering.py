"""What the conversation kinds share: the family's rotary positions and the chat renderer of the config."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from vlmrl.config import Config
from vlmrl.data.chat import template_has_tools
from vlmrl.data.dataset import MODEL_INPUT_KEYS
from vlmrl.data.media import resize_to_grid
from vlmrl.data.positions import MRope
from vlmrl.rollout.turns.observations import ConversationRenderer


def family_positions(model_path: str):
    """``(token ids, mm inputs) -> (3, n)`` rotary positions of the model's family (Qwen2/2.5/3-VL's 3-D scheme;
    for a text model, one position per token on every axis)."""
    model_config = AutoConfig.from_pretrained(model_path)
    if getattr(model_config, "vision_config", None) is not None:
        return MRope.from_config(model_config).positions

    def positions(ids, _mm):
        return torch.arange(len(ids), dtype=torch.long).expand(3, len(ids)).clone()

    return positions


def conversation_renderer(config: Config, processor, tool_schemas: list[dict]) -> ConversationRenderer:
    """The renderer of what follows a model turn, with the config's chat template, tools and image sizes."""
    data = config.data
    image_processor = getattr(processor, "image_processor", None)
    factor = image_processor.patch_size * image_processor.merge_size if image_processor is not None else 28
    tokenizer = getattr(processor, "tokenizer", processor)
    template = data.override_chat_template or getattr(processor, "chat_template", None) or tokenizer.chat_template
    return ConversationRenderer(
        processor,
        chat_template=data.override_chat_template,
        tools=tool_schemas,
        template_has_tools=template_has_tools(template),
        resize=lambda image: resize_to_grid(image.convert("RGB"), factor, data.min_pixels, data.max_pixels),
        model_input_keys=MODEL_INPUT_KEYS,
    )
