"""``python -m vlmrl.export <checkpoint>/actor --output DIR``: a checkpoint's actor as a HF model directory.

The sharded (DCP) weights are read in one process, without a process group,
into a model built from the config saved next to them, and written with
``save_pretrained`` together with the generation config and the processor, so
that transformers and vLLM load the result. A LoRA actor's checkpoint (with
``lora.json``) is written with its adapters merged into the base weights, under
the plain HF names, so the directory needs no peft.

Nothing in the checkpoint runs: transformers is called with
``trust_remote_code=False``, and a ``huggingface/`` directory whose files ask
for code of their own (an ``auto_map``) is refused with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, GenerationConfig

from vlmrl.config import LoraConfig
from vlmrl.plan import kind_of
from vlmrl.models import family_of
from vlmrl.train.checkpoint import load_lora_config, write_checkpoint_layout
from vlmrl.train.lora import merged_weights, scaling
from vlmrl.train.models import auto_class, load_processor
from vlmrl.train.safe_checkpoint import UnsafeCheckpoint, check_private, read_metadata_safely
from vlmrl.train.safe_checkpoint import load as safe_load


class ExportError(RuntimeError):
    pass


def export(actor_dir: str | Path, output: str | Path) -> Path:
    actor_dir, output = Path(actor_dir), Path(output)
    hf_dir = actor_dir / "huggingface"
    if not (actor_dir / ".metadata").is_file():
        raise ExportError(f"{actor_dir}: no DCP checkpoint here (expected <checkpoint>/global_step_<k>/actor)")
    if not (hf_dir / "config.json").is_file():
        raise ExportError(f"{hf_dir}: the model config saved with the checkpoint is missing")
    remote = remote_code_requests(hf_dir)
    if remote:
        raise ExportError(
            f"{hf_dir} asks for code shipped in the checkpoint ({'; '.join(remote)}); vlmrl.export runs none: "
            "remove the auto_map entries to export with transformers' own classes"
        )
    try:
        # The export loads what the directory holds; refuse one that others can change or that would run code.
        check_private(actor_dir)
        read_metadata_safely(actor_dir)
    except UnsafeCheckpoint as e:
        raise ExportError(str(e)) from e
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    with torch.device("meta"):
        # a VLM or a text causal LM
        model = auto_class(kind_of(config.to_dict())).from_config(config, trust_remote_code=False)
    model = model.to_empty(device="cpu")
    lora = load_lora_config(actor_dir)
    if lora is None:
        state = {"model": model.state_dict()}
        safe_load(state, actor_dir, no_dist=True)
        weights = state["model"]
    else:
        weights = _merged_lora_weights(actor_dir, lora)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ExportError(f"{actor_dir}: weights do not fit the saved config (missing {missing}, unexpected {unexpected})")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    write_checkpoint_layout(output, family_of(model.config).engine_weight)  # so that vLLM loads it too
    if (hf_dir / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(hf_dir).save_pretrained(output)
    load_processor(str(hf_dir)).save_pretrained(output)  # a text model's tokenizer alone
    return output


def remote_code_requests(hf_dir: Path) -> list[str]:
    """``<file>: auto_map <entries>`` for each JSON file of ``hf_dir`` that names classes of its own code."""
    found = []
    for file in sorted(hf_dir.glob("*.json")):
        try:
            content = json.loads(file.read_text())
        except (OSError, ValueError):
            continue  # transformers reports a file it cannot read; this looks only for code to run
        auto_map = content.get("auto_map") if isinstance(content, dict) else None
        if auto_map:
            entries = sorted(auto_map) if isinstance(auto_map, dict) else [str(auto_map)]
            found.append(f"{file.name}: auto_map {', '.join(entries)}")
    return found


def _merged_lora_weights(actor_dir: Path, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's model tensors (base weights and adapters, as saved), merged under the HF names."""
    metadata = read_metadata_safely(actor_dir).state_dict_metadata
    saved = {
        key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    state = {"model": saved}
    safe_load(state, actor_dir, no_dist=True)
    return dict(merged_weights(state["model"].items(), scaling(lora)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("actor_dir", help="a checkpoint's actor directory: <checkpoint dir>/global_step_<k>/actor")
    parser.add_argument("--output", required=True, help="directory to write the HF model to")
    args = parser.parse_args(argv)
    try:
        path = export(args.actor_dir, args.output)
    except (ExportError, UnsafeCheckpoint) as e:
        print(f"vlmrl.export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.actor_dir} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
