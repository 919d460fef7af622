"""Activation memory per rank of one forward and backward over a long multi-image row, Ulysses SP = 1 against 2.

    .venv/bin/python -m benchmarks.ulysses_memory [--images 8] [--side 224]

One packed row on the tiny Qwen2.5-VL (float32, no gradient checkpointing): a prompt showing ``--images``
pictures of ``--side`` x ``--side`` pixels, and a 64-token response, trained by one ``update_policy`` micro-batch.
SP = 1 runs it in this process; SP = 2 on two gloo ranks of one group (``vlmrl.train.ulysses``), each holding
the same row. What is measured is what autograd keeps for the backward: the bytes of every tensor saved during
the forward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once), split into the vision
tower's and the rest. On CPU no allocator reports a peak; the saved tensors are the activations that a GPU's
peak during the backward holds on top of the weights, gradients and optimizer state, which SP does not change.
Written to benchmarks/results/ulysses_memory.json.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results" / "ulysses_memory.json"
RESPONSE = 64


def _tensors(obj, depth: int = 0):
    """Every tensor held by ``obj`` (a batch: its fields, and the dicts and lists in them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth + 1)
    elif depth < 4 and hasattr(obj, "__dict__"):
        yield from _tensors(vars(obj), depth + 1)


class SavedBytes:
    """Bytes of the tensors autograd saves, each storage once, attributed to the vision tower while it runs.

    The weights, the batch and the model's inputs are held whatever SP does (a linear layer saves its weight, the
    vision tower's first layer a view of the pixels), so they are left out: what is counted is the activations."""

    def __init__(self, model: torch.nn.Module, batch=None):
        held = [*model.parameters(), *model.buffers(), *_tensors(batch)]
        self.seen: set[int] = {t.untyped_storage().data_ptr() for t in held}
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)
        self.bytes = {"vision": 0, "rest": 0}
        self.in_vision = False
        visual = model.model.visual if hasattr(model, "model") else model.visual
        visual.register_forward_pre_hook(lambda *_: setattr(self, "in_vision", True))
        visual.register_forward_hook(lambda *_: setattr(self, "in_vision", False))

    def _inputs(self, _module, args, kwargs) -> None:
        self.seen.update(t.untyped_storage().data_ptr() for t in _tensors([args, kwargs]))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen and storage.nbytes():
            self.seen.add(storage.data_ptr())
            self.bytes["vision" if self.in_vision else "rest"] += storage.nbytes()
        return tensor

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def long_row(model_dir: str, images: int, side: int):
    """One trajectory whose prompt shows ``images`` pictures, and the tokens a response may hold."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.data.dataset import RLHFDataset
    from vlmrl.models.qwen_vision import SPECIAL_TOKENS
    from vlmrl.records import Trajectory
    from vlmrl.records.views import to_batch
    from vlmrl.rollout.engine.sampling import sampling_mask
    import pandas as pd
    from PIL import Image

    def png(colour) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (side, side), colour).save(buffer, format="PNG")
        return buffer.getvalue()

    tmp = Path(tempfile.mkdtemp(prefix="ulysses-memory-"))
    colours = [((37 * i) % 256, (91 * i) % 256, (151 * i) % 256) for i in range(images)]
    rows = [{"problem": "Compare " + " and ".join(["<image>"] * images) + ".", "answer": "a",
             "images": [png(c) for c in colours]}]  # fmt: skip
    pd.DataFrame(rows).to_parquet(tmp / "rows.parquet")
    processor = AutoProcessor.from_pretrained(model_dir)
    pixels = side * side
    dataset = RLHFDataset(
        str(tmp / "rows.parquet"), processor, prompt_key="problem", answer_key="answer",
        image_key="images", image_dir=None, max_prompt_length=16384, min_pixels=pixels, max_pixels=pixels,
    )  # fmt: skip
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, SPECIAL_TOKENS)
    ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(0)
    response = ids[torch.randint(len(ids), (RESPONSE,), generator=gen)].tolist()
    batch = to_batch([Trajectory.single_turn(dataset[0], 0, 0, response, "", 1.0)], max_prompt_length=16384,
                     max_response_length=RESPONSE, pad_token_id=0)  # fmt: skip
    batch.old_log_probs = torch.full(batch.responses.shape, -5.0) * batch.response_mask
    batch.advantages = torch.ones(batch.responses.shape) * batch.response_mask
    return batch, allowed


def settings():
    from vlmrl.algos import KLEstimator, LossAvgMode, PolicyLossParams, PolicyLossType
    from vlmrl.train.actor import UpdateSettings

    return UpdateSettings(
        samples_per_update=1, micro_batch_size=1, ppo_epochs=1, loss_type=PolicyLossType.default,
        loss_params=PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0,
                                     loss_avg_mode=LossAvgMode.token_mean),
        max_grad_norm=1e6, entropy_coeff=0.0, use_kl_loss=False, kl_estimator=KLEstimator.low_var_kl, kl_coef=0.0,
        padding_free=True,
    )  # fmt: skip


def measure(model_dir: str, batch, allowed, sequence=None) -> dict[str, int]:
    from transformers import AutoModelForImageTextToText

    from vlmrl.train import ulysses
    from vlmrl.train.actor import update_policy

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    if sequence is not None:
        ulysses.install(model)
    saved = SavedBytes(model, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with saved.context():
        update_policy(model, optimizer, batch, settings(), allowed, sequence=sequence)
    return dict(saved.bytes)


def _rank(rank: int, init: str, model_dir: str, batch, allowed, results) -> None:
    from vlmrl.train import ulysses

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        results[rank] = measure(model_dir, batch, allowed, ulysses.SequenceGroup.of_world(2))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--side", type=int, default=224)
    args = parser.parse_args()
    from vlmrl.testing.assets import ensure_tiny_assets

    model_dir = str(ensure_tiny_assets().model_dir)
    batch, allowed = long_row(model_dir, args.images, args.side)
    tokens = int(batch.attention_mask.sum())
    alone = measure(model_dir, batch, allowed)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(tempfile.mktemp(), model_dir, batch, allowed, results), nprocs=2,
                           start_method="spawn")  # fmt: skip
        ranks = [dict(results[r]) for r in range(2)]
    mib = 2**20
    out = {
        "command": f"python -m benchmarks.ulysses_memory --images {args.images} --side {args.side}",
        "row_tokens": tokens,
        "images": args.images,
        "sp1_mib": {k: round(v / mib, 2) for k, v in alone.items()},
        "sp2_mib_per_rank": [{k: round(v / mib, 2) for k, v in r.items()} for r in ranks],
    }
    total = sum(alone.values())
    out["sp2_over_sp1"] = [round(sum(r.values()) / total, 3) for r in ranks]
    out["sp2_over_sp1_vision"] = [round(r["vision"] / alone["vision"], 3) for r in ranks]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
