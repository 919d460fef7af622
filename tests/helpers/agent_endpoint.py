"""The tiny engine and the agent endpoint over it, as the endpoint and runner tests build them."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from vlmrl.data.chat import template_has_tools, tools_system_message
from vlmrl.data.media import resize_to_grid
from vlmrl.rollout.endpoint.render import ChatRenderer
from vlmrl.rollout.endpoint.server import AgentEndpoint, EndpointLimits
from vlmrl.rollout.engine import Engine, EngineOutput, EngineRequest, SampleOutput
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models import family_at
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.models.qwen_vision import QwenMediaSizes
from vlmrl.rollout.engine.vllm import VLLMEngine

MIN_PIXELS, MAX_PIXELS = 3136, 12544


def resize(processor):
    """The dataset's resize to the processor's grid, with the tests' pixel bounds."""
    ip = processor.image_processor
    sizes = QwenMediaSizes.of(ip, MIN_PIXELS, MAX_PIXELS)
    return lambda image: resize_to_grid(image, sizes)


@contextmanager
def tiny_engine(model_dir, processor, max_model_len: int, seed: int = 5):
    """A float32 VLLMEngine on the tiny model, torn down (and torch's threads restored) on exit."""
    threads = torch.get_num_threads()
    engine = VLLMEngine(
        str(model_dir), dtype="float32", seed=seed, max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len, enforce_eager=True, gpu_memory_utilization=0.5, cpu_kvcache_space_gb=1,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
        allowed_tokens=sampling_mask(processor.tokenizer, len(processor.tokenizer), QWEN_MARKERS),
    )  # fmt: skip
    try:
        yield engine
    finally:
        from vllm.distributed import cleanup_dist_env_and_memory

        del engine
        gc.collect()
        cleanup_dist_env_and_memory()
        torch.set_num_threads(threads)


def new_endpoint(engine, processor, max_model_len: int, max_tokens: int) -> AgentEndpoint:
    """An endpoint (not started) over ``engine``, rendering with the processor's own template."""
    renderer = ChatRenderer(
        processor, resize=resize(processor), template_has_tools=template_has_tools(processor.chat_template),
        tools_message=tools_system_message, family=family_at(processor.tokenizer.name_or_path),
    )  # fmt: skip
    return AgentEndpoint(engine, renderer, EndpointLimits(max_model_len=max_model_len, max_tokens=max_tokens))


class EchoEngine(Engine):
    """A stub engine that answers every request at once with the same few tokens (for the endpoint's own bounds,
    where what is sampled does not matter)."""

    def __init__(self, token_ids: list[int], seed: int = 5):
        self.token_ids, self.seed = list(token_ids), seed
        self.queue: list[EngineRequest] = []
        self.requests: list[EngineRequest] = []

    def add(self, request: EngineRequest) -> None:
        self.queue.append(request)
        self.requests.append(request)

    def step(self) -> list[EngineOutput]:
        ids, log_probs = self.token_ids, [-0.5] * len(self.token_ids)
        out = [
            EngineOutput(r.request_id, [SampleOutput(ids, "", log_probs, "stop")] * r.sampling.n, self.version)
            for r in self.queue
        ]
        self.queue = []
        return out

    def abort(self, request_ids) -> None:
        self.queue = [r for r in self.queue if r.request_id not in set(request_ids)]

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def _load(self, named_tensors) -> None:
        pass
