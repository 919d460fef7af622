"""Qwen3.5-MoE: Qwen3.5 with sparse decoder MLPs (routed experts and a gated shared expert); everything else is the
dense family's (``vlmrl.models.qwen3_5``), the packed linear attention included.

transformers 5.19 holds each layer's routed experts fused (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``)
and writes them back per expert on save, Qwen's checkpoint layout. The router (``mlp.gate``) and the fused experts
are no ``nn.Linear`` in transformers, so LoRA leaves them alone without a further exclusion; the shared expert's
projections are linear layers and get adapters like any MLP.
"""

from __future__ import annotations

import dataclasses

import torch

from vlmrl.models.qwen3_5 import QWEN3_5, keep_packed_sequences_apart


def prepare_qwen3_5_moe(model: torch.nn.Module) -> None:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeGatedDeltaNet,
        Qwen3_5MoeTextModel,
    )

    keep_packed_sequences_apart(model, Qwen3_5MoeTextModel, Qwen3_5MoeGatedDeltaNet)


QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5, name="Qwen3.5-MoE", model_type="qwen3_5_moe", prepare=prepare_qwen3_5_moe, routed_experts=True
)
