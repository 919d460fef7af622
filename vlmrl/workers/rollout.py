"""The rollout role: an engine, and the trajectories it samples from prompts.

The engine (``vlmrl.rollout.VLLMEngine``, in process) serves one request per
prompt, seeded by the prompt's group id; each of its n samples becomes a
``Trajectory`` stamped with the engine's policy version and the sampling
temperature, so the trainer computes log-probs at the temperature that sampled.

With ``worker.rollout.multi_turn.enable`` the same engine plays conversations
instead (``vlmrl.rollout.agent_loop``): the tools or the environment run in
this process, next to the engine. With ``worker.rollout.agent`` it serves the
user's agent over an OpenAI-compatible endpoint (``vlmrl.workers.agents``).
"""

from __future__ import annotations

import os
import time

import torch

from transformers import AutoConfig

from vlmrl.config import Config
from vlmrl.data.chat import template_has_tools
from vlmrl.data.dataset import MODEL_INPUT_KEYS
from vlmrl.data.media import resize_to_grid
from vlmrl.data.positions import MRope
from vlmrl.plan import Plan
from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.agent_loop import AgentLoop, Limits
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.observations import ConversationRenderer
from vlmrl.rollout.tool_parsers import load_parser
from vlmrl.rollout.tools import ToolRunner, load_tools
from vlmrl.rollout.sampling import media_offsets, seeded_requests
from vlmrl.rollout.vllm_engine import VLLMEngine
from vlmrl.user_code import load_object
from vlmrl.workers.agents import ExternalAgents


class RolloutWorker:
    def __init__(
        self, config: Config, plan: Plan, rank: int, tokenizer, allowed_tokens: torch.Tensor, processor=None
    ):
        rollout_cfg = config.worker.rollout
        tp = plan.tensor_parallel_size
        if tp > 1:
            # vLLM's external launcher reads the rank from the environment (the process group already exists).
            # On GPU each worker sees only its own device, so its local rank is 0.
            os.environ["RANK"] = str(rank)
            os.environ["LOCAL_RANK"] = "0" if plan.device == "cuda" else str(rank % plan.workers_per_node)
        self.engine = VLLMEngine(
            config.worker.actor.model.model_path,
            dtype=rollout_cfg.dtype.value,
            # The workers of a tensor-parallel group sample as one engine: the same seed and the same requests.
            seed=rollout_cfg.seed + rank // tp,
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
            hf_overrides=config.worker.actor.model.override_config,
        )
        vocab = tokenizer.get_vocab()
        self.pad_ids = tuple(vocab[t] for t in ("<|image_pad|>", "<|video_pad|>") if t in vocab)
        self.agent = None
        if rollout_cfg.multi_turn.enable:
            self.agent = build_agent_loop(config, self.engine, processor, (vocab.get("<|image_pad|>", -1), vocab.get("<|video_pad|>", -1)))
        self.external = None
        """``worker.rollout.agent``: the endpoint on this engine and the runner of the user's agent."""
        if rollout_cfg.agent:
            self.external = ExternalAgents(
                config, plan, self.engine, processor, family_positions(config.worker.actor.model.model_path)
            )

    def generate(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """n trajectories per prompt, in prompt order, and the seconds of the call's pieces."""
        if self.agent is not None:
            return self.agent.run(prompts, group_ids, sampling)
        if self.external is not None:
            return self.external.run(prompts, group_ids, sampling)
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


def family_positions(model_path: str):
    """``(token ids, mm inputs) -> (3, n)`` rotary positions of the model's family (Qwen2/2.5/3-VL's 3-D scheme;
    for a text model, one position per token on every axis)."""
    model_config = AutoConfig.from_pretrained(model_path)
    if getattr(model_config, "vision_config", None) is not None:
        return MRope.from_config(model_config).positions

    def positions(ids, _mm):
        return torch.arange(len(ids), dtype=torch.long).expand(3, len(ids)).clone()

    return positions


def build_agent_loop(config: Config, engine, processor, pad_ids: tuple[int, int]) -> AgentLoop:
    """The multi-turn loop over ``engine`` with the config's tools or environment, loaded in this process."""
    multi_turn, data = config.worker.rollout.multi_turn, config.data
    positions = family_positions(config.worker.actor.model.model_path)

    image_processor = getattr(processor, "image_processor", None)
    factor = image_processor.patch_size * image_processor.merge_size if image_processor is not None else 28
    tokenizer = getattr(processor, "tokenizer", processor)
    template = data.override_chat_template or getattr(processor, "chat_template", None) or tokenizer.chat_template
    tools = load_tools(multi_turn.tools) if multi_turn.tools else []
    renderer = ConversationRenderer(
        processor,
        chat_template=data.override_chat_template,
        tools=[t.schema() for t in tools],
        template_has_tools=template_has_tools(template),
        resize=lambda image: resize_to_grid(image.convert("RGB"), factor, data.min_pixels, data.max_pixels),
        model_input_keys=MODEL_INPUT_KEYS,
    )
    limits = Limits(
        max_turns=multi_turn.max_turns,
        max_response_length=data.max_response_length,
        max_tokens_per_turn=multi_turn.max_tokens_per_turn,
        max_tool_response_length=multi_turn.max_tool_response_length,
        max_images=multi_turn.max_images,
        tool_timeout=multi_turn.tool_timeout,
        max_parallel_calls=multi_turn.max_parallel_calls,
    )
    return AgentLoop(
        engine,
        renderer,
        limits,
        positions=positions,
        pad_ids=pad_ids,
        runner=ToolRunner(tools, multi_turn.tool_timeout, processes=multi_turn.tool_processes) if tools else None,
        parser=load_parser(multi_turn.format),
        env_class=load_object(multi_turn.env, "worker.rollout.multi_turn.env") if multi_turn.env else None,
    )
