"""Worker side of checkpoints: the FSDP-sharded actor and optimizer through
torch.distributed.checkpoint (DCP), and each rank's RNG states.

Layout under ``<checkpoint>/actor/``: the DCP files (``.metadata``,
``*.distcp``), ``rng_rank<r>.pt``, and ``huggingface/`` with the model's
config, generation config and processor (weights only when HF weights are
asked for, in the family's checkpoint layout: ``write_checkpoint_layout``), which is what ``vlmrl.export`` needs
to rebuild a HF directory.
A LoRA actor's (or critic's, under ``critic/``) DCP files hold its base
weights and adapters under the injected names (``<m>.base_layer.weight``,
``<m>.lora_A.default.weight``), and ``lora.json`` holds the LoRA settings
that merging them, and resuming into the same adapters, need.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
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

from vlmrl.config import LoraConfig
from vlmrl.rng import rng_state, set_rng_state
from vlmrl.train.safe_checkpoint import check_private, read_metadata_safely
from vlmrl.train.safe_checkpoint import load as safe_load

LORA_FILE = "lora.json"


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
    # Restricted loaders: a checkpoint directory must not be able to run code (see safe_checkpoint).
    check_private(path)
    metadata = read_metadata_safely(path)
    has_optim = any(key.startswith("optim.") for key in metadata.state_dict_metadata)
    if has_optim:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        safe_load(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = {"model": get_model_state_dict(model)}
        safe_load(state, path)
        set_model_state_dict(model, state["model"])
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return has_optim


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def write_checkpoint_layout(hf_dir: Path, to_checkpoint: Callable[[str, torch.Tensor], torch.Tensor] | None) -> int:
    """Rewrite the weights ``save_pretrained`` wrote to ``hf_dir`` in the family's checkpoint layout; the number of
    tensors changed.

    ``to_checkpoint`` is the family's ``engine_weight``: vLLM's layout, which is the family's own checkpoints' too
    (Qwen3-VL-MoE's fused experts, transposed from transformers'). transformers 5.19 writes its own layout, which
    vLLM 0.32 refuses, and reads both (it transposes a tensor whose shape is not its parameter's). None: nothing
    to do. The names are unchanged, so a sharded directory's index still holds.
    """
    if to_checkpoint is None:
        return 0
    from safetensors.torch import load_file, save_file

    changed = 0
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors = load_file(file)
        mapped = {name: to_checkpoint(name, tensor) for name, tensor in tensors.items()}
        moved = [name for name in tensors if mapped[name] is not tensors[name]]
        if moved:
            save_file({name: t.contiguous() for name, t in mapped.items()}, file, metadata={"format": "pt"})
            changed += len(moved)
    return changed


def save_lora_config(path: Path, lora: LoraConfig) -> None:
    (path / LORA_FILE).write_text(json.dumps(dataclasses.asdict(lora), indent=2) + "\n")


def load_lora_config(path: Path) -> LoraConfig | None:
    """The LoRA settings a checkpoint's actor was trained with; None for a full-model checkpoint."""
    file = path / LORA_FILE
    return LoraConfig(**json.loads(file.read_text())) if file.is_file() else None


def _describe_lora(lora: LoraConfig | None) -> str:
    if lora is None:
        return "no LoRA"
    return (
        f"LoRA rank={lora.rank} alpha={lora.alpha} target_modules={lora.target_modules!r} "
        f"exclude_modules={lora.exclude_modules!r}"
    )


def check_lora_matches(path: Path, lora: LoraConfig | None, key: str = "worker.actor.model.lora") -> None:
    """A checkpoint's adapters load only into a model with the same adapters; say which settings differ.

    ``key`` is the config section of the model saved at ``path`` (the actor's, or the critic's).
    """
    saved = load_lora_config(path)
    if saved != lora:
        model = key.split(".")[1]
        raise ValueError(
            f"{path}: the checkpoint's {model} has {_describe_lora(saved)} but {key} has "
            f"{_describe_lora(lora)}; resume with the checkpoint's LoRA settings"
        )
