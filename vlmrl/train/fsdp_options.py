"""What the FSDP options of a model section (memory, mesh) become in FSDP2, and the
moves between device and host memory that ``offload.*`` asks for.

- ``fsdp.enable_full_shard=false``: ``reshard_after_forward=False``; the
  gathered parameters stay whole from the forward to the backward (ZeRO-2
  like: one all-gather per pass instead of two, at the cost of holding them).
- ``fsdp.enable_cpu_offload=true``: ``CPUOffloadPolicy``; the sharded
  parameters, gradients and optimizer states live in host memory and the
  optimizer steps there. On a CPU device they live there anyway: the policy
  still runs FSDP2's offload path (tested, same numbers) but saves nothing.
  Pinned memory needs an accelerator, so it is pinned on CUDA only; on NCCL
  the process group gets gloo for the host-memory collectives
  (``with_host_collectives``).
- ``fsdp.mp_param_dtype`` / ``mp_reduce_dtype``: ``MixedPrecisionPolicy``; the
  weights keep their ``torch_dtype`` (the master copy the optimizer steps on)
  and FSDP2 casts the gathered copy for compute and the gradients for the
  reduction. Measured on CPU with gloo (2 ranks, tiny Qwen2.5-VL): bf16
  compute and bf16 reduction both run, so nothing is refused there.
- ``fsdp.mp_buffer_dtype``: FSDP2 does not manage buffers, so the floating
  buffers (Qwen-VL's rotary ``inv_freq``) are cast once before sharding.
- ``fsdp.fsdp_size``: the device mesh (``Meshes``). -1 (or the world size)
  shards every parameter over all workers (a 1-D mesh). A divisor of the
  world size gives hybrid sharding (HSDP): a 2-D mesh ``("replicate",
  "shard")`` of ``world / fsdp_size`` groups of ``fsdp_size`` ranks, each
  parameter sharded within a group and replicated across the groups;
  ``fully_shard`` reduce-scatters the gradients within a group and
  all-reduces them across groups, so the update is FSDP's over all workers.
  A group is ``fsdp_size`` consecutive ranks (``init_device_mesh`` lays the
  ranks out row by row) and the workers' ranks fill one node after another
  (``vlmrl.workers.group``), so when ``fsdp_size`` divides
  ``trainer.n_gpus_per_node`` each group's all-gathers stay within a node.
- ``offload.offload_params`` / ``offload_optimizer``: an ``Offloader`` moves
  the model's parameters / the optimizer's states to host memory after each
  pass and back before the next (the worker marks its methods with ``uses``).
  On a CPU device there is nowhere else to put them, so the moves are skipped
  (a documented no-op); ``move_model`` and ``move_optimizer_states`` take the
  target device so tests drive them on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from vlmrl.config import Config, FSDPConfig, OffloadConfig


def _dtype(name: Any) -> torch.dtype | None:
    return None if name is None else getattr(torch, str(name))


@dataclass(frozen=True)
class ShardOptions:
    """The ``fully_shard`` arguments for one model, and the buffer dtype FSDP2 leaves to us."""

    reshard_after_forward: bool = True
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    """``OffloadPolicy()`` is FSDP2's "no offload"."""
    buffer_dtype: torch.dtype | None = None

    @classmethod
    def from_config(cls, fsdp: FSDPConfig, device: str) -> ShardOptions:
        return cls(
            reshard_after_forward=fsdp.enable_full_shard,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=_dtype(fsdp.mp_param_dtype), reduce_dtype=_dtype(fsdp.mp_reduce_dtype)
            ),
            offload_policy=CPUOffloadPolicy(pin_memory=device == "cuda")
            if fsdp.enable_cpu_offload
            else OffloadPolicy(),
            buffer_dtype=_dtype(fsdp.mp_buffer_dtype),
        )

    def fully_shard_kwargs(self) -> dict[str, Any]:
        return {
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self.mp_policy,
            "offload_policy": self.offload_policy,
        }

    def cast_buffers(self, model: torch.nn.Module) -> None:
        """Cast ``model``'s floating buffers to ``buffer_dtype`` (before sharding; FSDP2 leaves buffers alone)."""
        if self.buffer_dtype is None:
            return
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(self.buffer_dtype)


def with_host_collectives(backend: str, config: Config) -> str:
    """``backend``, plus gloo for CPU tensors when a model of ``config`` uses FSDP's CPU offload on NCCL.

    Under ``CPUOffloadPolicy`` the gradients' shards live in host memory, and
    clipping all-reduces their norm there; NCCL has no CPU backend ("No backend
    type associated with device type cpu"), so gloo carries the CPU
    collectives, as torchtune does for the same case. Not yet run on a GPU.
    """
    sections = (config.worker.actor, config.worker.ref, config.worker.critic)
    if backend == "nccl" and any(section.fsdp.enable_cpu_offload for section in sections):
        return "cpu:gloo,cuda:nccl"
    return backend


MESH_DIMS = ("replicate", "shard")
"""The names of a hybrid-sharding mesh's dimensions: across the groups, within a group."""


def mesh_shape(world_size: int, fsdp_size: int) -> tuple[int, ...]:
    """``(world,)`` to shard over all workers, or ``(world / fsdp_size, fsdp_size)`` for hybrid sharding.

    >>> mesh_shape(4, -1), mesh_shape(4, 4), mesh_shape(4, 2)
    ((4,), (4,), (2, 2))
    """
    if fsdp_size == -1 or fsdp_size == world_size:
        return (world_size,)
    if fsdp_size < 1 or world_size % fsdp_size:
        # Validation refuses these (vlmrl.validate.features); a caller that skipped it gets the same reason.
        raise ValueError(f"fsdp.fsdp_size={fsdp_size} must be -1 or divide the {world_size} worker(s)")
    return (world_size // fsdp_size, fsdp_size)


class Meshes:
    """The device meshes of one worker's models, one per shape: models with the same ``fsdp_size`` share one.

    Building a mesh creates its process groups, a collective every rank must
    join in the same order, so the worker asks for its models' meshes in one
    order on every rank.
    """

    def __init__(self, device: str, world_size: int):
        self.device, self.world_size = device, world_size
        self._built: dict[tuple[int, ...], DeviceMesh] = {}

    def of(self, fsdp: FSDPConfig) -> DeviceMesh:
        shape = mesh_shape(self.world_size, fsdp.fsdp_size)
        if shape not in self._built:
            names = MESH_DIMS[-len(shape):]
            self._built[shape] = init_device_mesh(self.device, shape, mesh_dim_names=names)
        return self._built[shape]


def shard(model: torch.nn.Module, layer_classes: list[str], mesh, options: ShardOptions) -> torch.nn.Module:
    """Shard ``model`` with FSDP2, one unit per module of ``layer_classes`` (decoder layers, vision blocks), then
    the rest. A 2-D ``mesh`` (``Meshes``) shards within its last dimension and replicates across its first."""
    options.cast_buffers(model)
    for module in model.modules():
        if type(module).__name__ in set(layer_classes):
            fully_shard(module, mesh=mesh, **options.fully_shard_kwargs())
    fully_shard(model, mesh=mesh, **options.fully_shard_kwargs())
    return model


def move_model(model: torch.nn.Module, device: str | torch.device) -> None:
    """Move an FSDP2 model's (sharded) parameters, gradients and buffers to ``device``.

    ``FSDPModule`` reshards first and re-registers its sharded parameters after
    the move, so the public ``Module.to`` is all it takes.
    """
    model.to(device)


def move_optimizer_states(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Replace every state tensor of ``optimizer`` (Adam's moments) by a copy on ``device``.

    A copy even when the tensor is already there, so the old storage is freed
    and the move is the same operation on every device. Adam's 0-dim ``step``
    counters stay where they are: non-capturable Adam keeps them on the host.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device, copy=True)


class Offloader:
    """Keeps one set of tensors (a model's parameters, or an optimizer's states) in host memory between the
    passes that use them.

    ``move(device)`` moves them; ``offload()`` sends them to the host and
    ``on_device()`` brings them back for a pass and offloads them afterwards.
    Nested ``on_device()`` blocks (a checkpoint load that resyncs the rollout)
    move only at the outermost one. Disabled, every call is a no-op.
    """

    def __init__(self, move: Callable[[str], None], device: str, enabled: bool):
        self.move, self.device, self.enabled = move, device, enabled
        self._depth = 0

    def offload(self) -> None:
        if self.enabled:
            self.move("cpu")
            torch.cuda.empty_cache()

    @contextmanager
    def on_device(self) -> Iterator[None]:
        if self.enabled and self._depth == 0:
            self.move(self.device)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.offload()


def offloaders(
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    offload: OffloadConfig,
    fsdp: FSDPConfig,
    device: str,
) -> dict[str, Offloader]:
    """``{name: the parameters' Offloader, name_optimizer: the optimizer states' (when there is an optimizer)}``.

    Enabled only on an accelerator without FSDP's own CPU offload: otherwise the
    shards, and so Adam's states, already live in host memory.
    """
    host = device == "cpu" or fsdp.enable_cpu_offload

    def move_params(target: str) -> None:
        if target == "cpu":
            # Each update starts with zero_grad, so gradients are dropped rather than carried to the host.
            model.zero_grad(set_to_none=True)
        move_model(model, target)

    parts = {name: Offloader(move_params, device, offload.offload_params and not host)}
    if optimizer is not None:
        parts[f"{name}_optimizer"] = Offloader(
            functools.partial(move_optimizer_states, optimizer), device, offload.offload_optimizer and not host
        )
    return parts
