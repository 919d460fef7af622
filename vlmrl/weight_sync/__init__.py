"""Moves the actor's weights into the rollout engine after each update, a bucket at a time.

Two parts: ``gather`` streams the full weights out of the FSDP2 shards, one
all-gather per bucket (see its docstring for the memory and the collectives),
and a ``sink`` delivers the stream to the engine (``EngineSink``: in process,
into vLLM's one-pass ``reload_weights``, which repacks each layer as soon as its
tensors have arrived). ``WeightSync`` joins them for one model and one sink.

An optional ``transform`` sits between the gather and the sink: a function
from the stream of ``(name, full tensor)`` to another such stream (for LoRA,
merging adapters into their base weights under the HF names). With a
transform the tensors reach it in the actor's dtype and are cast to the
rollout dtype after it; without one they are cast before the gather, which
halves the traffic for a float32 actor and a bfloat16 engine.

Imports torch and the rollout's interface only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from vlmrl.weight_sync.gather import BucketedGather, drain, plan_buckets
from vlmrl.weight_sync.sink import EngineSink, Sink

NamedTensors = Iterable[tuple[str, torch.Tensor]]
StreamTransform = Callable[[Iterator[tuple[str, torch.Tensor]]], NamedTensors]

__all__ = ["BucketedGather", "EngineSink", "Sink", "StreamTransform", "WeightSync", "plan_buckets"]


class WeightSync:
    def __init__(
        self,
        model: torch.nn.Module,
        sink: Sink,
        rollout_dtype: torch.dtype,
        bucket_bytes: int = 512 << 20,
        transform: StreamTransform | None = None,
    ):
        self.gather = BucketedGather(model, bucket_bytes)
        self.sink = sink
        self.rollout_dtype = rollout_dtype
        self.transform = transform

    def weight_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the sink gets: the gathered weights, through the transform if any, in the rollout dtype."""
        if self.transform is None:
            yield from self.gather.stream(self.rollout_dtype)
            return
        for name, tensor in self.transform(self.gather.stream()):
            yield name, tensor.to(self.rollout_dtype)

    def sync(self, version: int) -> dict[str, float]:
        """Collective: the model's current weights into the sink as policy ``version``; the resync's metrics."""
        start = time.perf_counter()
        stream = self.weight_stream()
        try:
            self.sink.load(stream, version)
        finally:
            # The sink stopped early (an error, or a busy engine that refused): finish the gathers so the
            # other ranks are not left waiting in one.
            drain(stream)
        return {
            "timing_s/resync_worker": time.perf_counter() - start,
            "perf/resync_bucket_peak_mb": self.gather.largest_bucket_bytes / 2**20,
        }
