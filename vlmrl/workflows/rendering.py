"""What the conversation kinds share: the family's rotary positions and the chat renderer of the config."""

from __future__ import annotations

from transformers import AutoConfig

from vlmrl.config import Config
from vlmrl.data.chat import template_has_tools
from vlmrl.data.dataset import MODEL_INPUT_KEYS
from vlmrl.data.media import resize_to_grid
from vlmrl.models import Family, family_at, family_of
from vlmrl.rollout.turns.observations import ConversationRenderer


def family_positions(model_path: str):
    """``(token ids, mm inputs) -> (3, n)`` rotary positions of the model's family (Qwen2/2.5/3-VL's 3-D scheme;
    for a text model, one position per token on every axis)."""
    model_config = AutoConfig.from_pretrained(model_path)
    return family_of(model_config).positions(model_config).positions


def image_resize(family: Family, processor, min_pixels: int, max_pixels: int):
    """An image -> RGB on the family's grid within the pixel budget (a text family: the image as RGB, which its
    processor then refuses)."""
    rgb = lambda image: image if image.mode == "RGB" else image.convert("RGB")
    if not family.vision:
        return rgb
    sizes = family.sizes(processor, min_pixels, max_pixels)
    return lambda image: resize_to_grid(rgb(image), sizes)


def conversation_renderer(config: Config, processor, tool_schemas: list[dict]) -> ConversationRenderer:
    """The renderer of what follows a model turn, with the config's chat template, tools and image sizes."""
    data = config.data
    family = family_at(config.worker.actor.model.model_path)
    tokenizer = getattr(processor, "tokenizer", processor)
    template = data.override_chat_template or getattr(processor, "chat_template", None) or tokenizer.chat_template
    return ConversationRenderer(
        processor,
        chat_template=data.override_chat_template,
        tools=tool_schemas,
        template_has_tools=template_has_tools(template),
        resize=image_resize(family, processor, data.min_pixels, data.max_pixels),
        model_input_keys=MODEL_INPUT_KEYS,
        stop_opens_turn=family.stop_opens_turn,
    )
