"""Moves the actor's weights into the rollout engine after each update.

The FSDP2 shards are gathered into a full state dict whose names are the HF
checkpoint names (``model.visual.*``, ``model.language_model.*``,
``lm_head.*``), which is what vLLM's ``reload_weights`` expects. Every worker
holds its own engine, so every worker gathers the full weights.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from vlmrl.workers.rollout import VLLMRollout


class FSDPVLLMShardingManager:
    def __init__(self, model: torch.nn.Module, rollout: VLLMRollout, rollout_dtype: torch.dtype):
        self.model = model
        self.rollout = rollout
        self.rollout_dtype = rollout_dtype

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))

    def sync(self) -> float:
        """Load the actor's current weights into vLLM; returns the seconds it took."""
        start = time.perf_counter()
        state = self.full_state_dict()
        self.rollout.load_weights([(name, t.to(self.rollout_dtype)) for name, t in state.items()])
        return time.perf_counter() - start
