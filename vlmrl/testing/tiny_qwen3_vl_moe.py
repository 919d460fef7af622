"""A tiny randomly initialised Qwen3-VL-MoE (``qwen3_vl_moe``), built locally like the dense tiny Qwen3-VL.

The dense tiny Qwen3-VL (``tiny_vlm.build_tiny_qwen3_vl``) with every decoder
layer a sparse block: 4 experts, 2 per token, each expert 32 wide (hidden 128,
so no expert tensor is square and a missing transpose cannot pass unnoticed).

The checkpoint holds the fused expert tensors in the layout of Qwen's released
checkpoints, which is what vLLM 0.32 loads: ``mlp.experts.gate_up_proj``
(experts, hidden, 2 * inter) and ``mlp.experts.down_proj`` (experts, inter,
hidden). transformers 5.19 holds them transposed in the last two dims and
transposes them on load (its conversion mapping for ``qwen3_vl_moe``), but
``save_pretrained`` writes its own layout; so this builder transposes them
once more before writing (``vlmrl.models.qwen3_vl_moe.engine_weight``, the
same map the weight sync applies).
"""

from __future__ import annotations

from pathlib import Path

from vlmrl.testing import tiny_vlm


def build_tiny_qwen3_vl_moe(out_dir: Path, seed: int) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from vlmrl.models.qwen3_vl_moe import engine_weight

    tokenizer = tiny_vlm.build_qwen_tokenizer()
    ids, vision_ids = tiny_vlm._qwen_token_ids(tokenizer)
    text_config = tiny_vlm._tiny_text_config(tokenizer, ids, vision_ids, mrope_section=[8, 12, 12])
    text_config["head_dim"] = 64
    text_config["rope_parameters"]["mrope_interleaved"] = True
    # norm_topk_prob: vLLM reads it from the text config; transformers 5.19's config has no such field (it always
    # normalises the top-k weights), so it is written explicitly to make both do the same.
    text_config.update(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True
    )
    config = Qwen3VLMoeConfig(
        text_config=text_config,
        vision_config=tiny_vlm.qwen3_vision_config(),
        tie_word_embeddings=False,
        dtype="float32",
        **vision_ids,
    )
    tiny_vlm._save_tiny(
        out_dir, Qwen3VLMoeForConditionalGeneration, config, seed, ids, tiny_vlm.qwen3_processor(tokenizer)
    )
    [weights_file] = out_dir.glob("*.safetensors")
    weights = load_file(weights_file)
    save_file({n: engine_weight(n, t).contiguous() for n, t in weights.items()}, weights_file, {"format": "pt"})
