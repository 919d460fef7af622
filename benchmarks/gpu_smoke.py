"""One-GPU smoke check of the actor's passes at full model size, with no download.

    python -m benchmarks.gpu_smoke                  # Qwen2.5-VL-3B shapes, bf16, on the GPU
    python -m benchmarks.gpu_smoke --model 7b       # Qwen2.5-VL-7B shapes
    python -m benchmarks.gpu_smoke --cpu            # tiny shapes, fp32, on the CPU (CI runs this)

It needs torch and transformers only: no vLLM, no Ray, no network. It builds a
randomly initialised Qwen2.5-VL from a config written here (the real model's
shapes: layers, widths, heads, vocabulary, vision tower), makes synthetic
image prompts and responses, and runs what the actor does each step:

1. **Padding-free log-probs.** The sequences are packed end to end into one
   row of T tokens, no padding. Each sequence's 3-D rotary positions come from
   the model's own ``get_rope_index`` on that sequence alone; a fourth row of
   plain text positions (0..L-1 per sequence) goes in front, which is how
   transformers' Qwen2.5-VL tells packed sequences apart: with no attention
   mask, its causal mask (SDPA) or its varlen flash-attention call restarts
   wherever that row does not step by one. Only the response positions go
   through ``lm_head``, in chunks, so the (T, vocabulary) logits are never
   held at once.
2. **An update micro-step**: the same forward with gradients, a PPO-style
   clipped loss on the response tokens, backward, and one AdamW step.

It prints the seconds, tokens per second and MFU of each, the peak memory, and
a correctness check: the log-probs of the last packed sequence against the
same sequence run alone, padded-batch style (attention mask, 3-row positions).

MFU counts model FLOPs (recomputation under gradient checkpointing is not
counted): 2 FLOPs per parameter per token for the language model's body, the
vision tower per patch and ``lm_head`` per response token, plus causal
attention, 2 x L^2 x hidden per layer and sequence; a training pass is 3x a
forward. The peak is ``vlmrl.driver.perf.PEAK_FLOPS`` for the GPU (no MFU for
a GPU that is not in the table) or, with ``--cpu``, a measured matmul peak.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import torch

from vlmrl.driver.perf import measure_cpu_peak_flops, peak_flops

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


def build_model(
    shape: str, dtype: torch.dtype, device: torch.device, attn: str
) -> torch.nn.Module:
    """A random-init Qwen2.5-VL with the named shapes, built directly on ``device``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec = SHAPES[shape]
    text = dict(spec["text"])
    mrope_section = text.pop("mrope_section")
    config = Qwen2_5_VLConfig(
        text_config=dict(
            **text,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": mrope_section,
            },
            initializer_range=spec["init_std"],
            **spec["ids"],
            **spec["special"],
        ),
        vision_config=dict(**spec["vision"], initializer_range=spec["init_std"]),
        tie_word_embeddings=spec["tie_word_embeddings"],
        initializer_range=spec["init_std"],
        **spec["ids"],
    )
    config._attn_implementation = attn
    config.text_config._attn_implementation = attn
    config.vision_config._attn_implementation = attn
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype)


@dataclass
class Sample:
    input_ids: torch.Tensor  # (L,)
    response_start: int  # index of the first response token
    pixel_values: torch.Tensor  # (patches, 3 x temporal_patch x patch x patch)
    image_grid_thw: torch.Tensor  # (1, 3)


def make_samples(
    model,
    n: int,
    prompt_text: int,
    image_side: int,
    response: int,
    generator: torch.Generator,
) -> list[Sample]:
    """``n`` synthetic prompts of one image each and their responses, lengths varying by sample.

    Layout: text, <vision_start>, image tokens, <vision_end>, text, response.
    """
    config = model.config
    vision = config.vision_config
    ordinary = (
        min(config.image_token_id, config.video_token_id, config.vision_start_token_id)
        - 8
    )
    patch_dim = 3 * vision.temporal_patch_size * vision.patch_size**2
    samples = []
    for i in range(n):
        # Lengths vary across samples (as real rollouts do), so packed boundaries are irregular.
        side = max(
            2 * vision.spatial_merge_size,
            image_side - 2 * vision.spatial_merge_size * (i % 2),
        )
        grid = torch.tensor([[1, side, side]])
        image_tokens = side * side // vision.spatial_merge_size**2
        before = max(1, prompt_text // 4 + i % 3)
        after = max(1, prompt_text - before - i % 5)
        response_len = max(2, response - 3 * (i % 4))
        rand = lambda k: torch.randint(0, ordinary, (k,), generator=generator)
        ids = torch.cat(
            [
                rand(before),
                torch.tensor([config.vision_start_token_id]),
                torch.full((image_tokens,), config.image_token_id),
                torch.tensor([config.vision_end_token_id]),
                rand(after),
                rand(response_len),
            ]
        )
        pixels = torch.randn(side * side, patch_dim, generator=generator)
        samples.append(Sample(ids, len(ids) - response_len, pixels, grid))
    return samples


def rope_index(
    model, input_ids: torch.Tensor, image_grid_thw: torch.Tensor
) -> torch.Tensor:
    """(3, 1, L) Qwen-VL rotary positions of one unpadded sequence, from the model's own code."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == model.config.image_token_id] = 1
    positions, _ = model.model.get_rope_index(
        input_ids[None],
        mm_token_type_ids=types[None],
        image_grid_thw=image_grid_thw,
        attention_mask=torch.ones_like(input_ids)[None],
    )
    return positions


@dataclass
class Packed:
    input_ids: torch.Tensor  # (1, T)
    position_ids: (
        torch.Tensor
    )  # (4, 1, T): text positions, then temporal / height / width
    pixel_values: torch.Tensor  # (P, patch_dim)
    image_grid_thw: torch.Tensor  # (images, 3)
    logit_index: torch.Tensor  # (R,) positions whose logits predict the response tokens
    targets: torch.Tensor  # (R,) the response tokens
    seq_lengths: list[int]

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def pack(
    model, samples: list[Sample], device: torch.device, dtype: torch.dtype
) -> Packed:
    """Concatenate the samples into one row with per-sequence positions; no padding anywhere."""
    ids, positions, logit_index, targets = [], [], [], []
    offset = 0
    for s in samples:
        length = len(s.input_ids)
        mrope = rope_index(
            model, s.input_ids.to(device), s.image_grid_thw.to(device)
        )  # (3, 1, L)
        text = torch.arange(length, device=device).view(1, 1, length)
        positions.append(torch.cat([text, mrope], dim=0))  # (4, 1, L)
        ids.append(s.input_ids)
        # Logits at s-1 .. L-2 predict the response tokens s .. L-1.
        logit_index.append(
            torch.arange(offset + s.response_start - 1, offset + length - 1)
        )
        targets.append(s.input_ids[s.response_start :])
        offset += length
    return Packed(
        input_ids=torch.cat(ids)[None].to(device),
        position_ids=torch.cat(positions, dim=2),
        pixel_values=torch.cat([s.pixel_values for s in samples]).to(device, dtype),
        image_grid_thw=torch.cat([s.image_grid_thw for s in samples]).to(device),
        logit_index=torch.cat(logit_index).to(device),
        targets=torch.cat(targets).to(device),
        seq_lengths=[len(s.input_ids) for s in samples],
    )


def _chunk_log_probs(
    lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = lm_head(hidden).float()  # (c, V)
    return (
        torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    )  # (c,)


def response_log_probs(model, packed: Packed, chunk: int = 2048) -> torch.Tensor:
    """(R,) log-probs of the packed response tokens; ``lm_head`` runs on response positions only.

    With gradients, each chunk is checkpointed, so only its hidden states are kept
    for the backward pass, never its (chunk, vocabulary) logits.
    """
    hidden = model.model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,  # packing: the text-position row marks the sequence boundaries
        pixel_values=packed.pixel_values,
        image_grid_thw=packed.image_grid_thw,
        use_cache=False,
    ).last_hidden_state[0]  # (T, H)
    selected = hidden[packed.logit_index]  # (R, H)
    parts = []
    for start in range(0, len(selected), chunk):
        h, t = selected[start : start + chunk], packed.targets[start : start + chunk]
        if torch.is_grad_enabled():
            parts.append(
                torch.utils.checkpoint.checkpoint(
                    _chunk_log_probs, model.lm_head, h, t, use_reentrant=False
                )
            )
        else:
            parts.append(_chunk_log_probs(model.lm_head, h, t))
    return torch.cat(parts)


@torch.no_grad()
def unpacked_log_probs(
    model, sample: Sample, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The same sequence alone, as a padded batch of one runs it: attention mask, 3-row positions."""
    ids = sample.input_ids.to(device)[None]
    out = model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=rope_index(model, ids[0], sample.image_grid_thw.to(device)),
        pixel_values=sample.pixel_values.to(device, dtype),
        image_grid_thw=sample.image_grid_thw.to(device),
        use_cache=False,
    )
    logits = out.logits[0, sample.response_start - 1 : -1].float()
    return (
        torch.log_softmax(logits, dim=-1)
        .gather(-1, ids[0, sample.response_start :, None])
        .squeeze(-1)
    )


def clipped_policy_loss(
    log_probs, old_log_probs, advantages, clip: float = 0.2
) -> torch.Tensor:
    """PPO's clipped surrogate, token mean; all (R,)."""
    ratio = torch.exp(log_probs - old_log_probs)
    return -torch.minimum(
        ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages
    ).mean()


# ------------------------------------------------------------------ FLOPs


def parameter_counts(model) -> dict[str, int]:
    count = lambda module: sum(p.numel() for p in module.parameters())
    language = model.model.language_model
    embed = language.embed_tokens.weight.numel()
    return {
        "total": count(model),
        "lm_body": count(language) - embed,
        "lm_head": model.lm_head.weight.numel(),
        "vision": count(model.model.visual),
    }


def forward_flops(model, packed: Packed) -> float:
    """Model FLOPs of one forward over the packed batch (see the module docstring)."""
    params = parameter_counts(model)
    text = model.config.text_config
    attention = sum(
        2 * length**2 * text.hidden_size * text.num_hidden_layers
        for length in packed.seq_lengths
    )
    return (
        2.0
        * (
            params["lm_body"] * packed.tokens
            + params["lm_head"] * len(packed.targets)
            + params["vision"] * packed.pixel_values.shape[0]
        )
        + attention
    )


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
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="tiny shapes in fp32 on the CPU (the CI check of this script)",
    )
    p.add_argument(
        "--model",
        choices=sorted(SHAPES),
        help="shapes to build (default: 3b on GPU, tiny with --cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="default: bfloat16 on GPU, float32 with --cpu",
    )
    p.add_argument(
        "--attn",
        default="auto",
        help="sdpa, flash_attention_2, ... (auto: flash_attention_2 if installed, else sdpa)",
    )
    p.add_argument(
        "--sequences",
        type=int,
        help="sequences in the micro-batch (default 16 on GPU, 4 with --cpu)",
    )
    p.add_argument(
        "--prompt-text",
        type=int,
        help="text tokens of a prompt besides the image (default 128; 12 with --cpu)",
    )
    p.add_argument(
        "--image-side",
        type=int,
        help="image side in patches of 14 px (default 32 = 448 px; 4 with --cpu)",
    )
    p.add_argument(
        "--response", type=int, help="response tokens (default 512; 16 with --cpu)"
    )
    p.add_argument(
        "--iters", type=int, help="timed repetitions (default 3; 1 with --cpu)"
    )
    p.add_argument("--warmup", type=int, help="untimed repetitions first (default 1; 0 with --cpu, where the run only "
                   "has to show that the code works)")  # fmt: skip
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute the layers in the backward pass (default: on for GPU sizes, off with --cpu)")  # fmt: skip
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
        p.error(
            f"--image-side={args.image_side}: must be even (the vision tower merges 2 x 2 patches)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("gpu_smoke: no CUDA device is visible; run on a GPU machine, or pass --cpu for the tiny CPU check",
              file=sys.stderr)  # fmt: skip
        return 2
    dtype = getattr(torch, args.dtype)
    attn = args.attn
    if attn == "auto":
        import importlib.util

        attn = (
            "flash_attention_2"
            if device.type == "cuda" and importlib.util.find_spec("flash_attn")
            else "sdpa"
        )
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        peak = peak_flops(device_name)
        peak_source = (
            "from vlmrl.driver.perf.PEAK_FLOPS"
            if peak
            else "not in PEAK_FLOPS, so no MFU"
        )
    else:
        threads = torch.get_num_threads()
        device_name = f"cpu ({threads} thread{'s' if threads > 1 else ''})"
        peak, peak_source = (
            measure_cpu_peak_flops(threads, dtype),
            f"measured, {args.dtype} matmul",
        )

    # Imported first (several seconds), so that the build time below is the build's alone.
    from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: F401

    start = time.perf_counter()
    model = build_model(args.model, dtype, device, attn)
    params = parameter_counts(model)
    print(
        f"gpu_smoke: Qwen2.5-VL-{args.model} shapes, random init in {time.perf_counter() - start:.1f} s: "
        f"{_count(params['total'])} parameters (language body {_count(params['lm_body'])}, "
        f"lm_head {_count(params['lm_head'])}, vision {_count(params['vision'])}), {args.dtype}, "
        f"attention {attn}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}",
        flush=True,
    )
    shown_peak = f"{peak / 1e12:.1f} TFLOP/s" if peak else "unknown"
    print(
        f"gpu_smoke: device {device_name}, peak {shown_peak} ({peak_source})",
        flush=True,
    )

    samples = make_samples(
        model,
        args.sequences,
        args.prompt_text,
        args.image_side,
        args.response,
        generator,
    )
    packed = pack(model, samples, device, dtype)
    image_tokens = int((packed.input_ids == model.config.image_token_id).sum())
    print(
        f"gpu_smoke: {len(samples)} sequences packed into one row of {packed.tokens} tokens "
        f"({image_tokens} image tokens from {packed.pixel_values.shape[0]} patches, {len(packed.targets)} response "
        f"tokens, lengths {min(packed.seq_lengths)}-{max(packed.seq_lengths)}), no padding",
        flush=True,
    )
    flops = forward_flops(model, packed)

    # 1. Log-prob pass (old / reference log-probs).
    model.eval()
    with torch.no_grad():
        for _ in range(args.warmup):
            response_log_probs(model, packed)
        logprob_s, old_log_probs = _timed(
            lambda: response_log_probs(model, packed), device, args.iters
        )
    alone = unpacked_log_probs(model, samples[-1], device, dtype)
    packed_last = old_log_probs[-len(alone) :]
    diff = float((packed_last - alone).abs().max())

    # 2. Update micro-step: forward + backward + AdamW.
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    advantages = torch.randn(len(packed.targets), generator=generator).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

    def update_step() -> float:
        optimizer.zero_grad(set_to_none=True)
        log_probs = response_log_probs(model, packed)
        loss = clipped_policy_loss(log_probs, old_log_probs, advantages)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    for _ in range(args.warmup):
        update_step()  # (the first also allocates the optimizer state)
    update_s, loss = _timed(update_step, device, args.iters)

    results = {
        "model": args.model,
        "dtype": args.dtype,
        "attention": attn,
        "device": device_name,
        "tokens": packed.tokens,
        "response_tokens": len(packed.targets),
        "logprob_seconds": logprob_s,
        "logprob_tokens_per_s": packed.tokens / logprob_s,
        "update_seconds": update_s,
        "update_tokens_per_s": packed.tokens / update_s,
        "logprob_mfu": flops / (logprob_s * peak) if peak else None,
        "update_mfu": 3 * flops / (update_s * peak) if peak else None,
        "packed_vs_alone_max_abs_diff": diff,
        "loss": float(loss),
    }
    if device.type == "cuda":
        results["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30

    def mfu(value) -> str:
        return f"{value:.4f}" if value is not None else "n/a"

    print(
        f"gpu_smoke: logprob seconds={logprob_s:.4f} tokens_per_s={results['logprob_tokens_per_s']:.1f} "
        f"mfu={mfu(results['logprob_mfu'])}",
        flush=True,
    )
    print(
        f"gpu_smoke: update seconds={update_s:.4f} tokens_per_s={results['update_tokens_per_s']:.1f} "
        f"mfu={mfu(results['update_mfu'])} (forward + backward + AdamW step)",
        flush=True,
    )
    if "peak_memory_gib" in results:
        print(
            f"gpu_smoke: peak memory {results['peak_memory_gib']:.1f} GiB", flush=True
        )
    print(
        f"gpu_smoke: check: last packed sequence vs the same sequence alone, max |log-prob difference| "
        f"{diff:.2e} over {len(alone)} tokens (tolerance {args.tolerance:g})",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    problems = []
    if not diff <= args.tolerance:
        problems.append(
            f"packed log-probs differ from the unpacked ones by {diff:.3g} > {args.tolerance:g}"
        )
    if not math.isfinite(results["loss"]):
        problems.append(f"the update's loss is {results['loss']}")
    for problem in problems:
        print(f"gpu_smoke: FAILED: {problem}", file=sys.stderr, flush=True)
    if not problems:
        print("gpu_smoke: ok", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
