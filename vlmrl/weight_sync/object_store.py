"""Weights to rollout servers in other processes, through Ray's object store (the CPU path of disaggregation).

The trainer's rank 0 holds the full HF-named state dict (``TrainerWorker.full_weights``).
``push_weights`` cuts it into buckets of about ``bucket_bytes``, puts each bucket into the
object store once (every server reads the same objects), and calls each server's
``load_weights`` with the bucket references (``WeightBuckets``), all servers at once. Ray
resolves only top-level arguments, so the references arrive unresolved: the server fetches
them itself, on its call thread, while its engine keeps stepping, and only then interrupts the
engine for the load. The transfer is a pickle of the tensors, so it is bit-exact.

Memory: the pusher's dict, one copy in the object store, and on each server one full copy
during the load (vLLM's ``reload_weights`` must get the whole model in one call, so the
buckets cannot be streamed into it from the store without stalling the engine on the
transfer). On GPU the same buckets would go through host memory; the broadcast in
``vlmrl.weight_sync.collective`` (NCCL there) is the default path on GPU.

Imports the rollout's interface only (and Ray); the servers are duck-typed actor handles.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from vlmrl.rollout.engine import InterruptMode


@dataclass(frozen=True)
class WeightBuckets:
    """One weight sync in the object store: references to lists of ``(HF name, CPU tensor)``, in state-dict
    order (the order vLLM wants: a layer's tensors together)."""

    refs: tuple[ray.ObjectRef, ...]
    tensors: int
    nbytes: int

    def fetch(self) -> list[tuple[str, torch.Tensor]]:
        """Every ``(name, tensor)``, bucket after bucket, in order (blocks on the transfer)."""
        named: list[tuple[str, torch.Tensor]] = []
        for bucket in ray.get(list(self.refs)):
            named.extend(bucket)
        return named


def put_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20) -> WeightBuckets:
    """Put ``named_tensors`` (a dict's items, or a lazy stream) into the object store in buckets of at most
    ``bucket_bytes`` (a larger tensor gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    refs: list[ray.ObjectRef] = []
    bucket: list[tuple[str, torch.Tensor]] = []
    size = tensors = total = 0
    for name, tensor in named_tensors:
        # A view would pickle its whole storage; a CPU copy of exactly the tensor goes instead.
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            refs.append(ray.put(bucket))
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        tensors += 1
        total += nbytes
    if bucket:
        refs.append(ray.put(bucket))
    return WeightBuckets(tuple(refs), tensors, total)


def push_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    servers: Sequence[Any],
    version: int,
    interrupt: InterruptMode = InterruptMode.continue_,
    bucket_bytes: int = 512 << 20,
    timeout: float | None = None,
) -> dict[str, float]:
    """Load ``named_tensors`` (HF names, full tensors) into every rollout server as policy ``version``.

    ``servers``: actor handles with ``load_weights(weights, version, interrupt)``
    (``vlmrl.workers.rollout_server.RolloutServer``); ``interrupt`` says what each
    does with the requests it has in flight (``InterruptMode``). Returns when every
    server has loaded; the sync's seconds and bytes.
    """
    start = time.perf_counter()
    buckets = put_buckets(named_tensors, bucket_bytes)
    put = time.perf_counter()
    wait_for_loads([s.load_weights.remote(buckets, version, interrupt.value) for s in servers], version, timeout)
    return {
        "timing_s/resync_put": put - start,
        "timing_s/resync_load": time.perf_counter() - put,
        "perf/resync_mb": buckets.nbytes / 2**20,
        "perf/resync_buckets": float(len(buckets.refs)),
    }


def wait_for_loads(loads: list[ray.ObjectRef], version: int, timeout: float | None = None) -> None:
    """Wait for the servers' ``load_weights`` calls of weights ``version``; a server that died is reported as
    such, with what to do, rather than as Ray's actor error."""
    try:
        ray.get(loads, timeout=timeout)
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(
            f"a rollout server died during the push of weights version {version} (killed, out of memory, or its "
            "node lost); the run stops here. Run the same command again to resume from the last checkpoint. "
            f"Ray says: {str(e).splitlines()[0]}"
        ) from None
