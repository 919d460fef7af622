"""The rollout role: an engine, and the trajectories it samples from prompts.

The engine (``vlmrl.rollout.VLLMEngine``, in process) serves one request per
prompt, seeded by the prompt's group id; each of its n samples becomes a
``Trajectory`` stamped with the engine's policy version and the sampling
temperature, so the trainer computes log-probs at the temperature that sampled.
"""

from __future__ import annotations

import time

import torch

from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.sampling import seeded_requests
from vlmrl.rollout.vllm_engine import VLLMEngine


def media_offsets(token_ids: list[int], pad_ids: tuple[int, ...]) -> list[int]:
    """Where each run of media pad tokens starts, in order (one run per image; Qwen3-VL splits a video).

    >>> media_offsets([5, 9, 9, 6, 7, 9, 8], (9,))
    [1, 5]
    """
    return [i for i, t in enumerate(token_ids) if t in pad_ids and (i == 0 or token_ids[i - 1] != t)]


class RolloutWorker:
    def __init__(self, config: Config, plan: Plan, rank: int, tokenizer, allowed_tokens: torch.Tensor):
        rollout_cfg = config.worker.rollout
        self.engine = VLLMEngine(
            config.worker.actor.model.model_path,
            dtype=rollout_cfg.dtype.value,
            seed=rollout_cfg.seed + rank,
            max_model_len=plan.rollout_max_model_len,
            max_num_batched_tokens=rollout_cfg.max_num_batched_tokens,
            enforce_eager=rollout_cfg.enforce_eager,
            gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
            cpu_kvcache_space_gb=rollout_cfg.cpu_kvcache_space_gb,
            min_pixels=config.data.min_pixels,
            max_pixels=config.data.max_pixels,
            allowed_tokens=allowed_tokens,
            free_cache_engine=rollout_cfg.free_cache_engine,
        )
        vocab = tokenizer.get_vocab()
        self.pad_ids = tuple(vocab[t] for t in ("<|image_pad|>", "<|video_pad|>") if t in vocab)

    def generate(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """n trajectories per prompt, in prompt order, and the seconds of the call's pieces."""
        t0 = time.perf_counter()
        requests = seeded_requests(prompts, group_ids, sampling, self.engine.seed)
        t1 = time.perf_counter()
        outputs = self.engine.generate(requests)
        t2 = time.perf_counter()
        trajectories = []
        for prompt, group_id, output in zip(prompts, group_ids, outputs, strict=True):
            offsets = media_offsets(prompt.input_ids, self.pad_ids)
            for i, sample in enumerate(output.samples):
                trajectories.append(
                    Trajectory.single_turn(
                        prompt, group_id, i, sample.token_ids, sample.text, sampling.temperature,
                        sample.log_probs, output.version, offsets,
                    )
                )  # fmt: skip
        timings = dict(self.engine.last_timings)
        timings["requests"] = timings.get("requests", 0.0) + t1 - t0
        timings["trajectories"] = time.perf_counter() - t2
        return trajectories, timings
