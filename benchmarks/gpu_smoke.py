"""One-GPU smoke check of vlmrl's own actor passes at full model size, with no download.

    python -m benchmarks.gpu_smoke                  # Qwen2.5-VL-3B shapes, bf16, on the GPU
    python -m benchmarks.gpu_smoke --model 7b       # Qwen2.5-VL-7B shapes
    python -m benchmarks.gpu_smoke --cpu            # tiny shapes, fp32, on the CPU (CI runs this)
    python -m benchmarks.gpu_smoke KEY=VALUE ...    # any config override, e.g. worker.actor.loss_type=gspo

No vLLM engine, no Ray, no network: it builds a randomly initialised
Qwen2.5-VL from a config written here (the real model's shapes: layers,
widths, heads, vocabulary, vision tower) and then runs vlmrl's code, not a
copy of it, on synthetic image prompts and responses:

- the prompts are ``PromptSample`` rows with the dataset's rotary positions
  (``vlmrl.models.mrope.MRope``), their responses ``Trajectory`` records, and
  ``vlmrl.records.views.to_batch`` makes the padded batch from them, as the
  worker does after a rollout;
- the run's settings come from the config (``vlmrl.config.parse_config``) and
  the plan (``vlmrl.plan.resolve``): padding-free micro-batches, the update's
  ``UpdateSettings.from_config``, the AdamW of the worker;
- the model is sharded with FSDP2 as a worker shards it
  (``vlmrl.train.fsdp_options``), on a process group of one rank;
- the passes are ``vlmrl.train.actor``'s: ``compute_log_probs`` (the old
  log-prob pass, one packed row per micro-batch laid out by
  ``vlmrl.train.packing``), then ``update_policy`` (the registered policy loss
  of ``vlmrl.algos``, the KL loss, backward, clipping and one AdamW step);
- the FLOP count and the MFU are ``vlmrl.driver.perf``'s ``FlopsModel`` and
  ``PerfMeter``, the numbers the run logs as ``perf/mfu`` and
  ``perf/mfu/actor``: 2 FLOPs per parameter per token for the log-prob pass,
  6 per epoch for the update (attention's own FLOPs left out); the peak is
  ``vlmrl.driver.perf.PEAK_FLOPS`` for the GPU (no MFU for a GPU that is not
  in the table) or, with ``--cpu``, a measured matmul peak.

It prints the seconds, tokens per second and MFU of each pass, the peak
memory, and a correctness check: the packed log-probs of the last sequence in
the packed row against ``forward_response`` on that sequence alone in the
padded layout (attention mask, 3-row positions). Exit status: 0 ok, 1 a check
failed, 2 no GPU visible (without ``--cpu``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from vlmrl.config import Config, parse_config
from vlmrl.driver.perf import FlopsModel, PerfMeter, measure_cpu_peak_flops, peak_flops
from vlmrl.plan import Cluster, Plan, resolve
from vlmrl.records import Batch, PromptSample, Trajectory
from vlmrl.records.views import to_batch
from vlmrl.models import family_of
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.train.actor import MicroBatching, UpdateSettings, compute_log_probs, forward_response, update_policy
from vlmrl.train.fsdp_options import ShardOptions, shard, with_host_collectives
from vlmrl.workers.trainer import adamw, process_group_backend

# Qwen2.5-VL's special token ids (the real tokenizer's).
QWEN_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
QWEN_SPECIAL = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
QWEN_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
}

# The published configs' shapes. Weights are random; only the shapes matter here.
SHAPES: dict[str, dict] = {
    "3b": {
        "text": {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "mrope_section": [16, 24, 24],
        },
        "vision": dict(QWEN_VISION, out_hidden_size=2048),
        "ids": QWEN_IDS,
        "special": QWEN_SPECIAL,
        "tie_word_embeddings": True,
        "init_std": 0.02,
    },
    "7b": {
        "text": {
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "mrope_section": [16, 24, 24],
        },
        "vision": dict(QWEN_VISION, out_hidden_size=3584),
        "ids": QWEN_IDS,
        "special": QWEN_SPECIAL,
        "tie_word_embeddings": False,
        "init_std": 0.02,
    },
    # CI size. A wider init than Qwen's 0.02, so that wrong positions or a mask that
    # leaks across packed sequences move the log-probs far beyond fp32 noise.
    "tiny": {
        "text": {
            "vocab_size": 1024,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "mrope_section": [8, 12, 12],
        },
        "vision": {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "out_hidden_size": 128,
        },
        "ids": {
            "image_token_id": 1000,
            "video_token_id": 1001,
            "vision_start_token_id": 1002,
            "vision_end_token_id": 1003,
        },
        "special": {"bos_token_id": 1004, "eos_token_id": 1005, "pad_token_id": 1004},
        "tie_word_embeddings": False,
        "init_std": 0.05,
    },
}


def build_model(shape: str, dtype: torch.dtype, device: torch.device, attn: str | None) -> torch.nn.Module:
    """A random-init Qwen2.5-VL with the named shapes, built directly on ``device``.

    ``attn`` None leaves the attention implementation to transformers, as the
    worker's ``from_pretrained`` does (SDPA).
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec = SHAPES[shape]
    text = dict(spec["text"])
    mrope_section = text.pop("mrope_section")
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **text,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope_section},
            initializer_range=spec["init_std"],
            **spec["ids"],
            **spec["special"],
        ),
        vision_config=dict(**spec["vision"], initializer_range=spec["init_std"]),
        tie_word_embeddings=spec["tie_word_embeddings"],
        initializer_range=spec["init_std"],
        **spec["ids"],
    )
    if attn is not None:
        for part in (config, config.text_config, config.vision_config):
            part._attn_implementation = attn
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype)


def make_generations(
    model, n: int, prompt_text: int, image_side: int, response: int, generator: torch.Generator
) -> list[Trajectory]:
    """``n`` synthetic one-image prompts and their responses, as the rollout hands them over; lengths vary.

    Layout of a prompt: text, <vision_start>, image tokens, <vision_end>, text.
    The pixels are random patches given directly as the processor's output, so
    the rows have no PIL image. Each prompt's positions come from the
    model family's rotary scheme (``vlmrl.models``), which also checks that its image tokens match its grid.
    """
    config = model.config
    vision = config.vision_config
    mrope = family_of(config).positions(config)
    ordinary = min(config.image_token_id, config.video_token_id, config.vision_start_token_id) - 8
    patch_dim = 3 * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size
    rand = lambda k: torch.randint(0, ordinary, (k,), generator=generator).tolist()
    generations = []
    for i in range(n):
        # Lengths vary across samples (as real rollouts do), so packed boundaries are irregular.
        side = max(2 * merge, image_side - 2 * merge * (i % 2))
        grid = torch.tensor([[1, side, side]])
        before = max(1, prompt_text // 4 + i % 3)
        after = max(1, prompt_text - before - i % 5)
        head, tail = rand(before), rand(after)
        image_tokens = [config.image_token_id] * (side * side // merge**2)
        input_ids = head + [config.vision_start_token_id, *image_tokens, config.vision_end_token_id] + tail
        # What vLLM sees: one placeholder per image, which it expands itself.
        raw_prompt_ids = head + [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id] + tail
        mm_inputs = {"pixel_values": torch.randn(side * side, patch_dim, generator=generator), "image_grid_thw": grid}
        prompt = PromptSample(
            index=i,
            raw_prompt_ids=raw_prompt_ids,
            input_ids=input_ids,
            images=[],
            mm_inputs=mm_inputs,
            ground_truth="",
            data_source="gpu_smoke",
            prompt_text="",
            position_ids=mrope.positions(input_ids, mm_inputs),
            uid=f"gpu_smoke:{i}",
        )
        tokens = rand(max(2, response - 3 * (i % 4)))
        generations.append(Trajectory.single_turn(prompt, i, 0, tokens, "", temperature=1.0))
    return generations


def run_config(args: argparse.Namespace, device: torch.device, max_prompt_length: int) -> Config:
    """The run's config for this micro-batch: one worker, one packed micro-batch per pass, then ``KEY=VALUE``s."""
    n = args.sequences
    return parse_config([
        f"trainer.device={device.type}",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"data.rollout_batch_size={n}",
        "worker.rollout.n=1",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={args.response}",
        f"worker.actor.global_batch_size={n}",
        f"worker.actor.micro_batch_size_per_device_for_update={n}",
        f"worker.actor.micro_batch_size_per_device_for_experience={n}",
        "worker.actor.padding_free=true",
        f"worker.actor.model.enable_gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        f"worker.actor.fsdp.torch_dtype={args.dtype}",
        *args.overrides,
    ])  # fmt: skip


def make_batch(model, trajectories: list[Trajectory], config: Config) -> Batch:
    """The padded view of ``trajectories``, made as the worker makes it for its passes."""
    return to_batch(
        trajectories,
        max_prompt_length=config.data.max_prompt_length,
        max_response_length=config.data.max_response_length,
        pad_token_id=model.config.text_config.pad_token_id,
    )


def allowed_tokens(model) -> torch.Tensor:
    """What the rollout may sample: ``sampling_mask`` of a tokenizer that holds the vocabulary and these ids.

    There is no tokenizer here; the stand-in names the vision special tokens by
    the ids of the shapes, so the mask is the one the worker would make.
    """
    config = model.config
    ids = {
        "<|vision_start|>": config.vision_start_token_id,
        "<|vision_end|>": config.vision_end_token_id,
        "<|image_pad|>": config.image_token_id,
        "<|video_pad|>": config.video_token_id,
    }
    # A name sampling_mask does not know would leave its token allowed without a word.
    unknown = set(ids) - set(QWEN_MARKERS)
    if unknown:
        raise RuntimeError(f"gpu_smoke: {sorted(unknown)} are not in QWEN_MARKERS")
    vocab_size = config.text_config.vocab_size

    class Vocabulary:
        def __len__(self) -> int:
            return vocab_size

        def get_vocab(self) -> dict[str, int]:
            return ids

    return sampling_mask(Vocabulary(), vocab_size, QWEN_MARKERS)


def shard_like_a_worker(model: torch.nn.Module, config: Config, device: torch.device) -> torch.nn.Module:
    """FSDP2 over a process group of one rank, with the worker's backend, mesh and ``ShardOptions``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = with_host_collectives(process_group_backend(device.type), config)
        # One rank has no one to meet: an in-process store, no port or file to pick.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    options = ShardOptions.from_config(config.worker.actor.fsdp, device.type)
    return shard(model, list(getattr(model, "_no_split_modules", None) or []), mesh, options)


def last_packed_vs_alone(
    model, batch: Batch, batching: MicroBatching, allowed: torch.Tensor, log_probs: torch.Tensor
) -> tuple[float, int]:
    """Max |difference| between the packed log-probs of the last sequence of the last packed row and
    ``forward_response`` on that sequence alone, padded layout; and its response tokens.

    The last sequence of a packed row is the one that any leak across packed
    sequences (a missing boundary, wrong positions) would reach.
    """
    row = batching.groups(batch)[-1][-1]
    alone, _ = forward_response(model, batch.select([row]), allowed, padding_free=False)
    mask = batch.response_mask[row].bool()
    diff = (log_probs[row][mask] - alone[0].cpu()[mask]).abs()
    return float(diff.max()), int(mask.sum())


def parameter_counts(model) -> dict[str, int]:
    """For the report: where the parameters are (the FLOP count uses the total)."""
    count = lambda module: sum(p.numel() for p in module.parameters())
    language = model.model.language_model
    return {
        "total": count(model),
        "lm_body": count(language) - language.embed_tokens.weight.numel(),
        "lm_head": model.lm_head.weight.numel(),
        "vision": count(model.model.visual),
    }


# ------------------------------------------------------------------ main


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, iters: int) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        result = fn()
    _sync(device)
    return (time.perf_counter() - start) / iters, result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, applied after the "
                   "smoke check's own (e.g. worker.actor.padding_free=false)")  # fmt: skip
    p.add_argument("--cpu", action="store_true", help="tiny shapes in fp32 on the CPU (the CI check of this script)")
    p.add_argument("--model", choices=sorted(SHAPES), help="shapes to build (default: 3b on GPU, tiny with --cpu)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on GPU, float32 with --cpu")
    p.add_argument("--attn", help="sdpa, flash_attention_2, ... (default: transformers' choice, as vlmrl's "
                   "from_pretrained makes it: sdpa)")  # fmt: skip
    p.add_argument("--sequences", type=int, help="sequences in the micro-batch (default 16 on GPU, 4 with --cpu)")
    p.add_argument("--prompt-text", type=int,
                   help="text tokens of a prompt besides the image (default 128; 12 with --cpu)")  # fmt: skip
    p.add_argument("--image-side", type=int,
                   help="image side in patches of 14 px (default 32 = 448 px; 4 with --cpu)")  # fmt: skip
    p.add_argument("--response", type=int, help="response tokens (default 512; 16 with --cpu)")
    p.add_argument("--iters", type=int, help="timed repetitions (default 3; 1 with --cpu)")
    p.add_argument("--warmup", type=int, help="untimed repetitions first (default 1; 0 with --cpu, where the run only "
                   "has to show that the code works)")  # fmt: skip
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute the layers in the backward pass (default: on for GPU sizes, off with --cpu)")
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True,
                   help="shard the model with FSDP2 on one rank, as a worker does (default: on)")  # fmt: skip
    p.add_argument("--tolerance", type=float, help="largest allowed |packed - alone| log-prob difference "
                   "(default 1e-4 in fp32, 0.1 in bf16)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="with --cpu: torch threads (default 1; on a shared, "
                   "oversubscribed machine more threads spin against each other and run far slower)")  # fmt: skip
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cpu = args.cpu
    defaults = {
        "model": "tiny" if cpu else "3b",
        "dtype": "float32" if cpu else "bfloat16",
        "sequences": 4 if cpu else 16,
        "prompt_text": 12 if cpu else 128,
        "image_side": 4 if cpu else 32,
        "response": 16 if cpu else 512,
        "iters": 1 if cpu else 3,
        "warmup": 0 if cpu else 1,
        "gradient_checkpointing": not cpu,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tolerance is None:
        args.tolerance = 1e-4 if args.dtype == "float32" else 0.1
    if args.image_side % 2:
        p.error(f"--image-side={args.image_side}: must be even (the vision tower merges 2 x 2 patches)")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"expected KEY=VALUE config overrides, got {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        print("gpu_smoke: no CUDA device is visible; run on a GPU machine, or pass --cpu for the tiny CPU check",
              file=sys.stderr)  # fmt: skip
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        peak = peak_flops(device_name)
        peak_source = "from vlmrl.driver.perf.PEAK_FLOPS" if peak else "not in PEAK_FLOPS, so no MFU"
    else:
        threads = torch.get_num_threads()
        device_name = f"cpu ({threads} thread{'s' if threads > 1 else ''})"
        peak, peak_source = measure_cpu_peak_flops(threads, dtype), f"measured, {args.dtype} matmul"

    # Imported first (several seconds), so that the build time below is the build's alone.
    from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: F401

    start = time.perf_counter()
    model = build_model(args.model, dtype, device, args.attn)
    params = parameter_counts(model)
    generations = make_generations(model, args.sequences, args.prompt_text, args.image_side, args.response, generator)
    config = run_config(args, device, max(t.prompt_length for t in generations))
    plan: Plan = resolve(config, Cluster(gpus=int(device.type == "cuda"), cpus=os.cpu_count() or 1))
    actor = config.worker.actor
    if args.fsdp:
        model = shard_like_a_worker(model, config, device)
    if actor.model.enable_gradient_checkpointing:  # after sharding, as the worker does
        model.gradient_checkpointing_enable()
    attn = model.config._attn_implementation
    print(
        f"gpu_smoke: Qwen2.5-VL-{args.model} shapes, random init in {time.perf_counter() - start:.1f} s: "
        f"{_count(params['total'])} parameters (language body {_count(params['lm_body'])}, "
        f"lm_head {_count(params['lm_head'])}, vision {_count(params['vision'])}), {args.dtype}, "
        f"attention {attn}, gradient checkpointing {'on' if actor.model.enable_gradient_checkpointing else 'off'}, "
        f"{'FSDP2 (one rank)' if args.fsdp else 'not sharded'}",
        flush=True,
    )
    shown_peak = f"{peak / 1e12:.1f} TFLOP/s" if peak else "unknown"
    print(f"gpu_smoke: device {device_name}, peak {shown_peak} ({peak_source})", flush=True)

    batch = make_batch(model, generations, config)
    allowed = allowed_tokens(model)
    experience = MicroBatching(actor.micro_batch_size_per_device_for_experience, plan.experience_token_budget,
                               actor.padding_free)  # fmt: skip  (the worker's experience batching)
    settings = UpdateSettings.from_config(config, plan)
    tokens = int(batch.attention_mask.sum())
    response_tokens = int(batch.response_mask.sum())
    lengths = batch.attention_mask.sum(dim=1)
    image_tokens = int((batch.input_ids == model.config.image_token_id).sum())
    patches = sum(int(mm["pixel_values"].shape[0]) for mm in batch.mm_inputs)
    layout = "packed into one row per micro-batch" if actor.padding_free else "padded, trimmed"
    print(
        f"gpu_smoke: {len(batch)} sequences, {tokens} tokens ({image_tokens} image tokens from {patches} patches, "
        f"{response_tokens} response tokens, lengths {int(lengths.min())}-{int(lengths.max())}) in a "
        f"{tuple(batch.input_ids.shape)} batch from records.views.to_batch; {len(experience.groups(batch))} log-prob and "
        f"{len(settings.batching.groups(batch))} update micro-batch(es), {layout}",
        flush=True,
    )
    # The same count as the run's perf/mfu: the pass that ran is timed under the loop's name for it.
    meter = PerfMeter(plan.world_size, peak, FlopsModel(params["total"], ppo_epochs=settings.ppo_epochs))

    # 1. The old-log-prob pass.
    model.eval()
    for _ in range(args.warmup):
        compute_log_probs(model, batch, experience, allowed)
    logprob_s, (old_log_probs, _) = _timed(lambda: compute_log_probs(model, batch, experience, allowed), device,
                                           args.iters)  # fmt: skip
    with torch.no_grad():
        diff, checked = last_packed_vs_alone(model, batch, experience, allowed, old_log_probs)

    # 2. The update: vlmrl's policy loss (and KL loss) on random advantages, backward, clipping, one AdamW step.
    batch.old_log_probs = old_log_probs
    # Before the first update the reference model is the actor, so its log-probs are the old ones.
    batch.ref_log_probs = old_log_probs.clone()
    # The engine's log-probs that the rollout correction (on by default in bf16) and the decoupled loss weigh by:
    # the old ones with a bf16-sized mismatch.
    batch.rollout_log_probs = old_log_probs + 1e-2 * torch.randn(old_log_probs.shape, generator=generator)
    batch.advantages = torch.randn(batch.responses.shape, generator=generator) * batch.response_mask
    optimizer = adamw(model, actor.optim)
    for _ in range(args.warmup):
        update_policy(model, optimizer, batch, settings, allowed)  # (the first also allocates the optimizer state)
    update_s, update = _timed(lambda: update_policy(model, optimizer, batch, settings, allowed), device, args.iters)

    logprob_mfu = meter.metrics(batch, {"step": logprob_s, "old": logprob_s}).get("perf/mfu")
    update_mfu = meter.metrics(batch, {"step": update_s, "update_actor": update_s}).get("perf/mfu/actor")
    loss = update.metrics.get("actor/pg_loss", math.nan)
    results = {
        "model": args.model,
        "dtype": args.dtype,
        "attention": attn,
        "fsdp": args.fsdp,
        "device": device_name,
        "parameters": params["total"],
        "peak_flops": peak,
        "tokens": tokens,
        "response_tokens": response_tokens,
        "logprob_seconds": logprob_s,
        "logprob_tokens_per_s": tokens / logprob_s,
        "update_seconds": update_s,
        "update_tokens_per_s": tokens / update_s,
        "logprob_mfu": logprob_mfu,
        "update_mfu": update_mfu,
        "packed_vs_alone_max_abs_diff": diff,
        "loss": loss,
        "update_metrics": update.metrics,
    }
    if device.type == "cuda":
        results["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30

    def mfu(value) -> str:
        return f"{value:.4f}" if value is not None else "n/a"

    print(
        f"gpu_smoke: logprob seconds={logprob_s:.4f} tokens_per_s={results['logprob_tokens_per_s']:.1f} "
        f"mfu={mfu(logprob_mfu)} (compute_log_probs)",
        flush=True,
    )
    print(
        f"gpu_smoke: update seconds={update_s:.4f} tokens_per_s={results['update_tokens_per_s']:.1f} "
        f"mfu={mfu(update_mfu)} (update_policy: forward + backward + AdamW step)",
        flush=True,
    )
    if "peak_memory_gib" in results:
        print(f"gpu_smoke: peak memory {results['peak_memory_gib']:.1f} GiB", flush=True)
    print(
        f"gpu_smoke: check: last packed sequence vs the same sequence alone, max |log-prob difference| "
        f"{diff:.2e} over {checked} tokens (tolerance {args.tolerance:g})",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    problems = []
    if not diff <= args.tolerance:
        problems.append(f"packed log-probs differ from the unpacked ones by {diff:.3g} > {args.tolerance:g}")
    if not math.isfinite(loss):
        problems.append(f"the update's loss is {loss}")
    if update.metrics.get("actor/skipped_steps"):
        problems.append("the update skipped its optimizer step (a non-finite gradient norm)")
    for problem in problems:
        print(f"gpu_smoke: FAILED: {problem}", file=sys.stderr, flush=True)
    if not problems:
        print("gpu_smoke: ok", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
