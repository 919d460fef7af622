"""The bucketed all-gather of a FSDP2-sharded model's full weights, as a lazy stream.

Every worker holds its own engine, so every worker needs the full weights. They
are gathered from the FSDP2 shards in buckets of about ``bucket_bytes`` (one
all-gather per bucket) and yielded one tensor at a time; a bucket is gathered
only when the consumer asks for its first tensor. A consumer that loads each
tensor as it arrives (vLLM repacks each layer as soon as its tensors are in)
never makes a worker hold a second full copy of the model; the extra memory is
about two buckets (the gathered buffer and the tensors cut from it) plus what
the consumer keeps.

The names are the module's ``state_dict`` names, which for a FSDP2-sharded HF
VLM are the HF checkpoint names (``model.visual.*``, ``model.language_model.*``,
``lm_head.*``) that vLLM's ``reload_weights`` expects.

Under hybrid sharding (``fsdp.fsdp_size``) each rank gathers from its own
shard group: the other groups hold the same shards.

The all-gathers are collectives: every rank walks the same state dict in the
same order with the same bucket plan (both depend only on names, shapes and
dtypes, which all ranks share), and every rank must consume the whole stream.
A consumer that stops early (an error on one rank) leaves the other ranks in a
collective unless the rest is still gathered: ``drain`` does that.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _shard_dim(tensor: torch.Tensor) -> int | None:
    """The mesh dimension a tensor this module gathers itself is sharded over, else None.

    Such a tensor is a DTensor sharded on its dim 0 over one mesh dimension and
    replicated over any others: FSDP2's layout on a 1-D mesh ``(Shard(0),)``,
    and hybrid sharding's on a 2-D one ``(Replicate(), Shard(0))``, where the
    all-gather runs within a shard group only.
    """
    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        return None
    placements = tuple(tensor.placements)
    sharded = [i for i, p in enumerate(placements) if p == Shard(0)]
    if len(sharded) != 1 or not all(p.is_replicate() for i, p in enumerate(placements) if i != sharded[0]):
        return None
    return sharded[0]


def _bucketable(tensor: torch.Tensor) -> bool:
    """A tensor gathered in buckets (``_shard_dim``); any other is gathered on its own."""
    return _shard_dim(tensor) is not None


def _shard_numel(tensor: torch.Tensor, world: int) -> int:
    """Elements of one rank's padded shard: ``ceil(rows / world)`` rows (torch.chunk's split, as DTensor's Shard(0))."""
    return math.ceil(tensor.shape[0] / world) * math.prod(tensor.shape[1:])


def plan_buckets(sizes: list[tuple[str, int, object]], bucket_bytes: int) -> list[list[str]]:
    """Group names into buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own).

    ``sizes`` holds ``(name, full bytes, key)`` in state-dict order. Only
    neighbours with the same key share a bucket (one all-gather moves one
    dtype over one mesh); key None means "gathered on its own". Buckets keep
    the state dict's order, which is also the order vLLM wants: a layer's
    tensors together.

    >>> plan_buckets([("a", 40, 1), ("b", 40, 1), ("c", 40, 1), ("d", 200, 1), ("e", 8, None), ("f", 8, 2)], 100)
    [['a', 'b'], ['c'], ['d'], ['e'], ['f']]
    """
    buckets: list[list[str]] = []
    current: list[str] = []
    current_key, current_bytes = None, 0
    for name, nbytes, key in sizes:
        if current and (key is None or key != current_key or current_bytes + nbytes > bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        if key is None:
            buckets.append([name])
            continue
        current.append(name)
        current_key, current_bytes = key, current_bytes + nbytes
    if current:
        buckets.append(current)
    return buckets


class BucketedGather:
    """Streams a FSDP2-sharded model's full weights, a bucket of about ``bucket_bytes`` per all-gather."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = 512 << 20):
        self.model = model
        self.bucket_bytes = bucket_bytes
        self.largest_bucket_bytes = 0
        """Bytes of the largest gathered buffer (all ranks' shards of one bucket) of the last stream."""

    # torch.no_grad on a generator function holds for each step of it, not for the consumer between steps;
    # without it the copies out of the parameters would be recorded for autograd.
    @torch.no_grad()
    def stream(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective, lazy: ``(name, full tensor)`` in state-dict order, gathered a bucket at a time.

        ``dtype``: cast before the gather (None keeps each tensor's own dtype).
        """
        state = self.model.state_dict()  # sharded DTensors; nothing is gathered here
        sizes = []
        for name, t in state.items():
            wire_dtype = dtype or t.dtype
            key = (wire_dtype, t.device_mesh, _shard_dim(t)) if _bucketable(t) else None
            sizes.append((name, t.numel() * wire_dtype.itemsize, key))
        self.largest_bucket_bytes = 0
        for names in plan_buckets(sizes, self.bucket_bytes):
            yield from self._gather_bucket([(n, state[n]) for n in names], dtype)

    @torch.no_grad()
    def _gather_bucket(
        self, items: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        first = items[0][1]
        if not _bucketable(first):
            # A replicated buffer, or a layout other than FSDP2's: DTensor gathers it (or it is already whole).
            full = first.full_tensor() if isinstance(first, DTensor) else first
            yield items[0][0], full if dtype is None else full.to(dtype)
            return
        mesh, dim = first.device_mesh, _shard_dim(first)
        group, world, rank = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
        if world == 1:  # the shards are the whole tensors: nothing to gather or copy
            for name, t in items:
                yield name, t.to_local().detach() if dtype is None else t.to_local().detach().to(dtype)
            return
        wire_dtype = dtype or first.dtype  # the whole bucket shares it (plan_buckets' key)
        numels = [_shard_numel(t, world) for _, t in items]
        send = torch.zeros(sum(numels), dtype=wire_dtype, device=first.to_local().device)
        offset = 0
        for (name, t), numel in zip(items, numels):
            local = t.to_local()
            rows = math.ceil(t.shape[0] / world)
            expected = max(0, min(rows, t.shape[0] - rank * rows))
            if local.shape[0] != expected:
                raise RuntimeError(
                    f"{name}: local shard has {local.shape[0]} rows, expected {expected} of {t.shape[0]} "
                    f"(rank {rank} of {world}); the resync assumes torch.chunk-style Shard(0) sharding"
                )
            send[offset : offset + local.numel()].copy_(local.reshape(-1))
            offset += numel
        gathered = torch.empty(world * send.numel(), dtype=wire_dtype, device=send.device)
        dist.all_gather_single(gathered, send, group=group)
        del send
        self.largest_bucket_bytes = max(self.largest_bucket_bytes, gathered.numel() * gathered.element_size())
        by_rank = gathered.view(world, -1)
        offset = 0
        for (name, t), numel in zip(items, numels):
            rows = math.ceil(t.shape[0] / world)
            # Rank r's rows sit at [r, offset:offset + numel]; stacked in rank order they are the full tensor
            # plus the padding rows of the last ranks, which [: t.shape[0]] drops.
            part = by_rank[:, offset : offset + numel].reshape(world * rows, *t.shape[1:])[: t.shape[0]]
            offset += numel
            yield name, part


def drain(stream: Iterator) -> None:
    """Consume the rest of ``stream``: its remaining all-gathers, which the other ranks are waiting in."""
    for _ in stream:
        pass
