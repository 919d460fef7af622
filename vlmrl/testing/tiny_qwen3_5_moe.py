"""A tiny randomly initialised Qwen3.5-MoE (``qwen3_5_moe``): the tiny Qwen3.5 (``tiny_qwen3_5``) with every decoder
layer's MLP a sparse block, as ``${tiny:qwen3_5_moe_model_dir}``.

Each sparse block has 4 routed experts, 2 per token, each 32 wide (hidden 128, so no expert tensor is square and a
transposed layout cannot pass unnoticed), and Qwen3.5-MoE's shared expert (64 wide) with its sigmoid gate.
"""

from __future__ import annotations

from pathlib import Path

from vlmrl.testing import tiny_vlm


def build_tiny_qwen3_5_moe(out_dir: Path, seed: int) -> None:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from vlmrl.testing.tiny_qwen3_5 import text_config, vision_config

    tokenizer = tiny_vlm.build_qwen_tokenizer()
    text, ids, vision_ids = text_config(tokenizer)
    text.pop("intermediate_size")  # no dense MLP: every layer is sparse
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    config = Qwen3_5MoeConfig(
        text_config=text, vision_config=vision_config(), tie_word_embeddings=False, dtype="float32", **vision_ids
    )
    tiny_vlm._save_tiny(
        out_dir, Qwen3_5MoeForConditionalGeneration, config, seed, ids, tiny_vlm.qwen3_processor(tokenizer)
    )
