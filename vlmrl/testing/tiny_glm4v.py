"""A tiny randomly initialised GLM-4.1V (``glm4v``), built locally like the tiny Qwen-VL models.

The architecture is transformers' own ``Glm4vForConditionalGeneration`` at toy
size: a 2-block vision tower (patch 14, merge 2, a learned 8x8 position table
interpolated to each image's grid), a 2-layer GLM-4 language model with
partial rotary (half the head) and 3-D mrope. The tokenizer is a byte-level
BPE trained on the same in-code corpus as the Qwen ones, with GLM-4.1V's
special tokens and a chat template in GLM's layout (``[gMASK]<sop>``, role
tokens, no end-of-turn token: a reply ends where the model writes
``<|user|>``). The image and video processors are GLM-4.1V's.
"""

from __future__ import annotations

from pathlib import Path

from vlmrl.testing.tiny_vlm import INIT_STD, build_bpe_tokenizer

GLM_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)
"""GLM-4.1V's special tokens, in its id order (151329.. there; here after the trained vocabulary)."""

# GLM's layout: a prefix, then each turn as its role token and a newline, with no closing token; media items
# as the markers around the placeholder the processor expands.
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif 'text' in item %}"
    "{{ item['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The same token budgets as the tiny Qwen2.5-VL (4 to 64 image tokens, 28-px cells). GLM's processor counts an
# image as two frames (its temporal patch), so its own budget is twice the area.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64


def build_glm_tokenizer():
    """A byte-level BPE tokenizer with GLM-4.1V's special tokens and chat template. GLM-4's tokenizer is the same
    kind (byte-level BPE), so Qwen2Tokenizer's class only decides how the saved files are read back."""
    return build_bpe_tokenizer(GLM_SPECIAL_TOKENS, "<|user|>", GLM4V_CHAT_TEMPLATE)


def build_tiny_glm4v(out_dir: Path, seed: int) -> None:
    """GLM-4.1V at toy size, saved with its processor to ``out_dir``; deterministic in ``seed``."""
    import torch
    from transformers import (
        GenerationConfig,
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vImageProcessor,
        Glm4vProcessor,
        Glm4vVideoProcessor,
    )

    tokenizer = build_glm_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM_SPECIAL_TOKENS}
    vision_ids = {
        "image_token_id": ids["<|image|>"],
        "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"],
        "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"],
        "video_end_token_id": ids["<|end_of_video|>"],
    }
    pad = ids["<|endoftext|>"]
    stops = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    config = Glm4vConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,  # head_dim 64; GQA exercised
            "max_position_embeddings": 4096,
            # GLM rotates half of each head (32 dims); the mrope sections cover its 16 frequencies.
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5, "mrope_section": [4, 6, 6],
            },  # fmt: skip
            "pad_token_id": pad,
            "eos_token_id": stops,
            "dtype": "float32",
            "initializer_range": INIT_STD,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_heads": 2,
            "patch_size": 14,
            "image_size": 112,  # an 8x8 learned position table, interpolated to each image's grid
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 128,
            "initializer_range": INIT_STD,
        },
        tie_word_embeddings=False,
        dtype="float32",
        **vision_ids,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Glm4vForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=pad)
    model.save_pretrained(out_dir)

    budget = {"shortest_edge": 2 * MIN_PIXELS, "longest_edge": 2 * MAX_PIXELS}
    processor = Glm4vProcessor(
        image_processor=Glm4vImageProcessor(size=budget),
        tokenizer=tokenizer,
        video_processor=Glm4vVideoProcessor(size=budget, max_image_size={"longest_edge": 2 * MAX_PIXELS}),
        chat_template=GLM4V_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
