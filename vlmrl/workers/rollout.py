"""The rollout role: an engine, and the rollout kind that turns prompts into trajectories on it.

The engine (``vlmrl.rollout.VLLMEngine``, in process) is built here; the kind
(``vlmrl.workflows``: single_turn, multi_turn, openai_agent, or a user's
workflow class) is chosen once from the config by ``vlmrl.workflows.build``,
and every call goes to it. Each trajectory carries the engine's policy version
and the sampling temperature, so the trainer computes log-probs at the
temperature that sampled.
"""

from __future__ import annotations

import os

import torch

from vlmrl import workflows
from vlmrl.config import Config
from vlmrl.models import family_at
from vlmrl.plan import Plan
from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.vllm import VLLMEngine
from vlmrl.rollout.kind import RolloutKind, RolloutStats


class RolloutWorker:
    def __init__(
        self, config: Config, plan: Plan, rank: int, tokenizer, allowed_tokens: torch.Tensor, processor=None,
        engine_for_kind=None, server: bool = False,
    ):  # fmt: skip
        """``engine_for_kind``: wraps the engine for the rollout kind (a rollout server's loop); default: the
        engine itself. ``server``: this is rollout server ``rank``, whose engine is its own (its tensor-parallel
        shards in processes vLLM starts), not a trainer worker's shard of a group's engine."""
        rollout_cfg = config.worker.rollout
        tp = plan.tensor_parallel_size
        if tp > 1 and not server:
            # vLLM's external launcher reads the rank from the environment (the process group already exists).
            # On GPU each worker sees only its own device, so its local rank is 0.
            os.environ["RANK"] = str(rank)
            os.environ["LOCAL_RANK"] = "0" if plan.device == "cuda" else str(rank % plan.workers_per_node)
        family = family_at(config.worker.actor.model.model_path, config.worker.actor.model.trust_remote_code)
        self.engine = VLLMEngine(
            config.worker.actor.model.model_path,
            dtype=rollout_cfg.dtype.value,
            # The workers of a tensor-parallel group sample as one engine: the same seed and the same requests.
            seed=rollout_cfg.seed + (rank if server else rank // tp),
            max_model_len=plan.rollout_max_model_len,
            max_num_batched_tokens=rollout_cfg.max_num_batched_tokens,
            enforce_eager=rollout_cfg.enforce_eager,
            gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
            cpu_kvcache_space_gb=rollout_cfg.cpu_kvcache_space_gb,
            min_pixels=config.data.min_pixels,
            max_pixels=config.data.max_pixels,
            allowed_tokens=allowed_tokens,
            free_cache_engine=rollout_cfg.free_cache_engine,
            tensor_parallel_size=tp,
            tokenizer_path=config.worker.actor.model.tokenizer_path,
            limit_images=rollout_cfg.limit_images,
            hf_overrides=family.engine_overrides(config.worker.actor.model.override_config),
            engine_weight=family.engine_weight,
            recurrent_layers=family.recurrent_layers,
            own_processes=server,
        )
        self.pad_ids = family.media_pad_ids(tokenizer)
        """The image and the video pad token (-1 for one the tokenizer lacks)."""
        engine = self.engine if engine_for_kind is None else engine_for_kind(self.engine)
        self.kind: RolloutKind = workflows.build(config, plan, engine, processor, self.pad_ids)

    def generate(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], RolloutStats]:
        """n trajectories per prompt (fewer or more where the kind's rows vary), and the call's stats."""
        return self.kind.rollout(prompts, group_ids, sampling)

    def close(self) -> None:
        self.kind.close()
