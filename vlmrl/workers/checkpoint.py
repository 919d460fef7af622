"""Worker side of checkpoints: the FSDP-sharded actor and optimizer through
torch.distributed.checkpoint (DCP), and each rank's RNG states.

Layout under ``<checkpoint>/actor/``: the DCP files (``.metadata``,
``*.distcp``), ``rng_rank<r>.pt``, and ``huggingface/`` with the model's
config, generation config and processor (weights only when HF weights are
asked for), which is what ``vlmrl.export`` needs to rebuild a HF directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from vlmrl.rng import rng_state, set_rng_state


def save_actor(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, model_only: bool) -> None:
    """Collective: every rank writes its shard of the model (and optimizer) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    if model_only:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
    dcp.save(state, checkpoint_id=str(path))
    torch.save(rng_state(), path / f"rng_rank{rank}.pt")


def load_actor(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> bool:
    """Collective: restore the model, and the optimizer when the checkpoint has it.

    Returns whether optimizer state was restored (a model-only checkpoint restarts it).
    """
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    has_optim = any(key.startswith("optim.") for key in metadata.state_dict_metadata)
    if has_optim:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return has_optim


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
