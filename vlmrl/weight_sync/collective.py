"""Weights to rollout servers in other processes by a broadcast (the GPU path of disaggregation; gloo on CPU).

The trainer's rank 0 (the sender, rank 0 of the group) and the rollout servers (ranks 1..n) form a
process group of their own, the weight-transfer group, apart from the trainer's FSDP group and from
the group vLLM makes inside each server. It is not made through ``torch.distributed.init_process_group``
(a process has one default group, and the trainer's is taken): the sender hosts a ``TCPStore`` on a
port the OS picks (so no other process can take it first), and every member builds the backend from
that store directly, ``ProcessGroupNCCL`` on GPU and ``ProcessGroupGloo`` on CPU, and calls its
``broadcast``. Nothing is registered in ``torch.distributed``'s world, so the default group, its
ranks and its collectives are untouched. The rendezvous address is loopback on a one-node cluster
and the trainer's node address otherwise, and the store listens on that address alone
(``vlmrl.weight_sync.bound_store``; torch's own would listen on every interface).

One sync (``broadcast_weights``): the sender calls each server's ``load_weights`` with a ``Broadcast``
ticket, and the servers start receiving on a call thread (their engines keep stepping); then, per
bucket of about ``bucket_bytes`` (a larger tensor gets a bucket of its own), two broadcasts: a
control tensor (header length, bucket length; zeros end the sync) and one byte buffer holding the
header (JSON: each tensor's name, dtype, shape and offset) and the tensors' bytes. A server slices
the buffer back into ``(name, tensor)`` views, bit for bit the sender's, and loads them as the
object-store path does. Memory on a server: one full copy while it loads (on its GPU under NCCL);
on the sender: one bucket.

A member that dies mid-sync leaves the others waiting until the group's timeout (``timeout_s``).

Written against torch 2.14: ``ProcessGroupGloo`` takes its network device through its ``_Options``
(the public constructor reads GLOO_SOCKET_IFNAME, which a rollout server does not set).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist

from vlmrl.config.options import WeightTransfer
from vlmrl.rollout.engine import InterruptMode
from vlmrl.weight_sync.bound_store import bound_store
from vlmrl.weight_sync.object_store import wait_for_loads

LOOPBACK = "127.0.0.1"
ALIGN = 64
"""Each tensor's bytes start at a multiple of this in a bucket, so that any dtype can view them."""
_STORE_PREFIX = "vlmrl/weights"


def weight_transfer(choice: WeightTransfer, device: str) -> WeightTransfer:
    """``choice`` with ``auto`` resolved: collective on cuda (NCCL), the object store on cpu."""
    if choice is WeightTransfer.auto:
        return WeightTransfer.collective if device == "cuda" else WeightTransfer.object_store
    return choice


def backend_of(device: str) -> str:
    """The group's backend for tensors on ``device`` (cuda or cpu)."""
    return "nccl" if device == "cuda" else "gloo"


def rendezvous_host() -> str:
    """Where the sender's store listens: loopback on a one-node Ray cluster, else this node's address."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return LOOPBACK if len(alive) <= 1 else ray.util.get_node_ip_address()


@dataclass(frozen=True)
class GroupAddress:
    """How the members find the weight-transfer group: the sender's store, the group's size and backend."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class Broadcast:
    """The ticket a server's ``load_weights`` gets on the collective path: the sender is about to broadcast
    the weights in ``group``."""

    group: GroupAddress


class WeightGroup:
    """This process's member of a weight-transfer group: rank 0 sends, the others receive."""

    def __init__(
        self, address: GroupAddress, rank: int, store: dist.Store | None = None, local_host: str | None = None
    ):
        """Join the group as ``rank`` (blocks until every member has joined). ``store``: the sender's own
        (``host_store``); the receivers connect to it. ``local_host``: the address this member's gloo device
        binds (default: loopback when the store is on loopback, else this node's address)."""
        self.address, self.rank = address, rank
        timeout = datetime.timedelta(seconds=address.timeout_s)
        if store is None:
            store = dist.TCPStore(address.host, address.port, address.world_size, is_master=False, timeout=timeout)
        self.store = store  # the sender's keeps listening as long as the group lives
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        if address.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, address.world_size, timeout)
        elif address.backend == "gloo":
            self.device = torch.device("cpu")
            if local_host is None:
                local_host = LOOPBACK if address.host == LOOPBACK else ray.util.get_node_ip_address()
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, address.world_size, options)
        else:
            raise ValueError(f"backend={address.backend!r}: the weight-transfer group runs on nccl or gloo")
        self._lock = threading.Lock()
        """One sync at a time through this member (each is a sequence of broadcasts that must not interleave)."""
        # A first collective: NCCL makes its communicator lazily, and a member that cannot join fails here.
        hello = torch.tensor([address.world_size if rank == 0 else -1], dtype=torch.int64, device=self.device)
        self._broadcast(hello)
        if int(hello.item()) != address.world_size:
            raise RuntimeError(
                f"weight-transfer group: the sender says {int(hello.item())} members, not {address.world_size}"
            )

    @staticmethod
    def host_store(
        receivers: int, backend: str, host: str = LOOPBACK, timeout_s: float = 600.0
    ) -> tuple[dist.TCPStore, GroupAddress]:
        """The sender's side of the rendezvous: a store on a port the OS picks, and the address the receivers
        join (``WeightGroup(address, rank)``, ranks 1..``receivers``) while the sender joins as rank 0."""
        store = bound_store(host, 0, receivers + 1, datetime.timedelta(seconds=timeout_s))  # on ``host`` alone
        return store, GroupAddress(host, store.port, receivers + 1, backend, timeout_s)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()
        if tensor.is_cuda:  # the caller's stream waits on NCCL's; the host waits here before using the bytes
            torch.cuda.current_stream(tensor.device).synchronize()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20) -> tuple[int, int]:
        """Rank 0: broadcast ``named_tensors`` bucket by bucket, then the end of the sync; (tensor bytes, buckets)."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} of the weight-transfer group receives; rank 0 sends")
        nbytes = buckets = 0
        with self._lock:
            for bucket in _buckets(named_tensors, bucket_bytes):
                header, payload = _pack(bucket, self.device)
                self._broadcast(torch.tensor([header, payload.numel()], dtype=torch.int64, device=self.device))
                self._broadcast(payload)
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                buckets += 1
            self._broadcast(torch.zeros(2, dtype=torch.int64, device=self.device))
        return nbytes, buckets

    def receive(self) -> list[tuple[str, torch.Tensor]]:
        """Ranks 1..n: every ``(name, tensor)`` of one sync, in the sender's order, on this member's device."""
        if self.rank == 0:
            raise RuntimeError("rank 0 of the weight-transfer group sends")
        named: list[tuple[str, torch.Tensor]] = []
        with self._lock:
            while True:
                control = torch.empty(2, dtype=torch.int64, device=self.device)
                self._broadcast(control)
                header, size = (int(x) for x in control.tolist())
                if size == 0:
                    return named
                payload = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._broadcast(payload)
                named.extend(_unpack(payload, header))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of at most ``bucket_bytes`` (a larger tensor alone), in order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


def _pack(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[int, torch.Tensor]:
    """One buffer on ``device``: the JSON header (name, dtype, shape, offset, bytes of each tensor), padded, then
    each tensor's bytes at its offset; and the header's length."""
    entries, offset = [], 0
    for name, t in bucket:
        n = t.numel() * t.element_size()
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, n])
        offset = _align(offset + n)
    header = json.dumps(entries).encode()
    start = _align(len(header))
    payload = torch.empty(start + offset, dtype=torch.uint8, device=device)
    payload[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for (_, t), (*_, off, n) in zip(bucket, entries):
        if n:
            payload[start + off : start + off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return len(header), payload


def _unpack(payload: torch.Tensor, header: int) -> list[tuple[str, torch.Tensor]]:
    """``_pack`` undone: views into ``payload``."""
    entries = json.loads(payload[:header].cpu().numpy().tobytes())
    start = _align(header)
    named = []
    for name, dtype_name, shape, off, n in entries:
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight-transfer header: {dtype_name!r} is not a torch dtype")
        named.append((name, payload[start + off : start + off + n].view(dtype).view(shape)))
    return named


def open_group(servers: Sequence[Any], backend: str, host: str = LOOPBACK, timeout_s: float = 600.0) -> WeightGroup:
    """The sender's member of a new weight-transfer group with ``servers`` (actor handles with
    ``join_weight_group(address, rank)``: ``vlmrl.workers.rollout_server.RolloutServer``), made once."""
    store, address = WeightGroup.host_store(len(servers), backend, host, timeout_s)
    joined = [s.join_weight_group.remote(address, rank) for rank, s in enumerate(servers, start=1)]
    group = WeightGroup(address, 0, store)
    ray.get(joined, timeout=timeout_s)
    return group


def broadcast_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    group: WeightGroup,
    servers: Sequence[Any],
    version: int,
    interrupt: InterruptMode = InterruptMode.continue_,
    bucket_bytes: int = 512 << 20,
    timeout: float | None = None,
) -> dict[str, float]:
    """Load ``named_tensors`` (HF names, full tensors) into every server of ``group`` as policy ``version``
    (``push_weights``' counterpart): each server's ``load_weights`` gets a ``Broadcast`` and receives while
    the sender sends. Returns when every server has loaded; the sync's seconds and bytes."""
    start = time.perf_counter()
    loads = [s.load_weights.remote(Broadcast(group.address), version, interrupt.value) for s in servers]
    nbytes, buckets = group.send(named_tensors, bucket_bytes)
    sent = time.perf_counter()
    wait_for_loads(loads, version, timeout)
    return {
        "timing_s/resync_broadcast": sent - start,
        "timing_s/resync_load": time.perf_counter() - sent,
        "perf/resync_mb": nbytes / 2**20,
        "perf/resync_buckets": float(buckets),
    }
