"""Qwen3-VL-MoE: Qwen3-VL with sparse decoder layers; everything but the expert weights' layout is the dense family's.

transformers holds each layer's fused experts as ``mlp.experts.gate_up_proj``
(experts, 2 * inter, hidden) and ``mlp.experts.down_proj`` (experts, hidden,
inter); Qwen's checkpoints and vLLM's loader (vLLM 0.32) have them transposed
in the last two dims. ``engine_weight`` maps the actor's tensors to vLLM's at
each weight sync. The router (``mlp.gate``) is no ``nn.Linear`` in
transformers, so LoRA leaves it and the experts alone without a further
exclusion.
"""

from __future__ import annotations

import dataclasses

import torch

from vlmrl.models.qwen3_vl import QWEN3_VL

_TRANSPOSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def engine_weight(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The fused expert tensors transposed in their last two dims (transformers' layout <-> Qwen's and vLLM's);
    every other tensor as it is."""
    return tensor.transpose(-2, -1) if name.endswith(_TRANSPOSED) else tensor


QWEN3_VL_MOE = dataclasses.replace(
    QWEN3_VL, name="Qwen3-VL-MoE", model_type="qwen3_vl_moe", engine_weight=engine_weight, routed_experts=True
)
