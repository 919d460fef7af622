"""How records' tensors travel between processes: as byte arrays, copied once on arrival.

Rows cross process boundaries on every step (the prompts to the engines, the trajectories back to the driver,
rows to a worker that does not hold them), and their pixel values are most of their bytes. Ray's put and get
of 256 agent-like trajectories (92 MB of pixel values) took 0.54 s with the tensors pickled by torch and 0.16 s
as numpy byte arrays, which pickle protocol 5 hands over without copying (medians of 5, one process, 2 cores).
On arrival each array is copied into a tensor of its own: an array Ray hands back may be read-only memory of the
object store, and the records' tensors are written to in place by their users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class PackedTensor:
    """A CPU tensor's bytes with its dtype and shape (any dtype: the bytes are reinterpreted, not converted)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: np.ndarray


def pack(value: Any) -> Any:
    """``value`` as a ``PackedTensor`` when it is a plain CPU tensor, else as it is (pickled as usual)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.device.type != "cpu"
        or value.layout is not torch.strided
        or value.requires_grad
        or type(value) is not torch.Tensor  # a subclass (a parameter, a DTensor) keeps its own pickling
    ):
        return value
    flat = value.contiguous().reshape(-1)
    return PackedTensor(value.dtype, tuple(value.shape), flat.view(torch.uint8).numpy())


def unpack(value: Any) -> Any:
    """The tensor a ``PackedTensor`` holds, in memory of its own; anything else as it is."""
    if not isinstance(value, PackedTensor):
        return value
    if value.data.size == 0:  # no bytes to reinterpret (and an empty array's stride will not view)
        return torch.empty(value.shape, dtype=value.dtype)
    return torch.from_numpy(value.data.copy()).view(value.dtype).reshape(value.shape)


class ShipsTensors:
    """Mixed into a record: pickled with ``position_ids`` and the tensors of ``mm_inputs`` packed."""

    def __getstate__(self) -> dict[str, Any]:
        return _packed_fields(self.__dict__, pack)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(_packed_fields(state, unpack))


def _packed_fields(state: dict[str, Any], convert) -> dict[str, Any]:
    """``state`` with ``convert`` applied to ``position_ids`` and to each value of ``mm_inputs``."""
    state = dict(state)
    state["position_ids"] = convert(state["position_ids"])
    state["mm_inputs"] = {k: convert(v) for k, v in state["mm_inputs"].items()}
    return state
