"""The distillation example's teacher: the quickstart's start tuned to name the shape's colour it sees.

examples/distillation.yaml trains the quickstart's format-tuned model (the
student, which names a colour at random, about 0.25 on validation) with no
reward in its advantage at all: the only signal is a frozen teacher's
log-probs on the student's own samples (``algorithm.distillation``). The
teacher built here is that same start after a few supervised steps on the
quickstart task with the *true* colour as the target, so it shares the
student's tokenizer and processor byte for byte, and it answers right on most
images. Its images come from their own stream of the task (none of them is a
train or val row).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from vlmrl.testing import sft, synthetic

STEPS, BATCH_SIZE, LR = 40, 16, 1e-3
N_IMAGES = 256
SEED = 0


@dataclass(frozen=True)
class DistillAssets:
    teacher_model_dir: Path
    """The quickstart's format-tuned model, then tuned on the true colours (see the module docstring)."""


def teacher_tune(model_dir: Path, out_dir: Path, seed: int = SEED, steps: int = STEPS) -> Path:
    """Write ``model_dir`` tuned to answer the quickstart's question with the colour of the shape it shows."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.testing.format_tune import COLOUR_INSTRUCTION

    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "right"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(f"distill:teacher:{seed}")
    samples = [synthetic.shape_colour_sample(rng) for _ in range(N_IMAGES)]
    text = f"{synthetic.COLOUR_QUESTION.replace('<image>', '')} {COLOUR_INSTRUCTION}"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    with torch.random.fork_rng(devices=[]):  # leave the caller's torch RNG alone
        torch.manual_seed(seed)
        for _ in range(steps):
            batch = [rng.choice(samples) for _ in range(BATCH_SIZE)]
            answers = [s.answer + tokenizer.eos_token for s in batch]
            inputs = processor(
                text=[prompt + a for a in answers], images=[s.image for s in batch], return_tensors="pt",
                padding=True,
            )  # fmt: skip
            sft.step_on_targets(model, optimizer, dict(inputs), [len(tokenizer.encode(a)) for a in answers])
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def distill_layout(root: Path) -> DistillAssets:
    return DistillAssets(teacher_model_dir=root / "tiny-qwen2_5_vl-colour-teacher")


def distill_version() -> str:
    """Hash of everything that decides the bytes of the teacher (the quickstart's start included)."""
    from vlmrl.testing import assets

    return assets._version(
        (synthetic, sft, sys.modules[__name__]),
        f"{assets.quickstart_version()}:{STEPS}:{BATCH_SIZE}:{LR}:{N_IMAGES}:{SEED}",
    )


def ensure_distill_assets(cache_dir: Path | None = None) -> DistillAssets:
    """The distillation example's teacher, built (with the quickstart's assets) on first use."""
    from vlmrl.testing import assets

    cache_dir = Path(cache_dir) if cache_dir is not None else assets.default_cache_dir()
    start = assets.ensure_quickstart_assets(cache_dir)
    version = distill_version()
    final = cache_dir / f"distill-assets-{version}"
    assets._ensure(cache_dir, final, version, lambda tmp: teacher_tune(start.model_dir, distill_layout(tmp).teacher_model_dir))
    return distill_layout(final)
