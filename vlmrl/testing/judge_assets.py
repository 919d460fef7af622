"""Tiny reward models for tests and the judge example, made locally: a judge VLM and a score model.

* The judge is the tiny Qwen2.5-VL tuned for a few supervised steps to answer
  the built-in judge question (``vlmrl.reward.judging.DEFAULT_TEMPLATE``) on the
  quickstart's task with "yes" when the graded answer names the reference colour
  and "no" otherwise (another colour, or a word that is no colour). It reads
  the same conversation the reward manager sends, so at RL time it is a judge
  that mostly agrees with the exact-match rule: the judge example learns as the
  quickstart does, with the rule replaced by the model.
* The score model is a randomly initialised ``Qwen2ForSequenceClassification``
  (one label) on the tiny text model's tokenizer: its scores mean nothing, which
  is all a test of the plumbing needs.

``ensure_judge_assets()`` builds both once into the cache, as the other assets are.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from vlmrl.testing import sft, synthetic

STEPS = 600  # measured: 300 steps judge at chance (0.56 on 64 held-out pairs), 600 steps 1.0
BATCH_SIZE = 16
LR = 3e-4  # 1e-3 for 600 steps: 0.92
OTHER_WORDS = ("square", "circle", "the", "colour", "shape", "none")
"""Answers that name no colour; the judge must say no to them too."""


@dataclass(frozen=True)
class JudgeAssets:
    judge_dir: Path
    """The tuned tiny VLM judge (yes/no)."""
    score_dir: Path
    """The random tiny sequence-classification model."""


def judge_question_input(prompt_text: str, response: str, ground_truth: str, image) -> dict:
    """A reward input as the reward manager gets it, for the tuning and the tests."""
    return {"prompt": prompt_text, "response": response, "ground_truth": ground_truth, "images": [image]}


def quickstart_prompt_text(processor) -> str:
    """The quickstart's rendered prompt (examples/format_prompt/colour.jinja over the colour question)."""
    from vlmrl.testing.format_tune import COLOUR_INSTRUCTION

    text = f"{synthetic.COLOUR_QUESTION.replace('<image>', '')} {COLOUR_INSTRUCTION}"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def judge_tune(model_dir: Path, out_dir: Path, seed: int = 0, steps: int = STEPS) -> Path:
    """Write ``model_dir`` tuned to judge the quickstart's answers yes or no (see the module docstring)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.data.media import resize_to_grid
    from vlmrl.reward.judging import DEFAULT_TEMPLATE, compile_template, judge_conversation

    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    template = compile_template(DEFAULT_TEMPLATE)
    ip = processor.image_processor
    factor = ip.patch_size * ip.merge_size
    rng = random.Random(f"judge:tune:{seed}")
    samples = [synthetic.TASKS["shape_colour"](rng) for _ in range(64)]
    prompt_text = quickstart_prompt_text(processor)
    colours = sorted(synthetic.COLOURS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokenizer.padding_side = "right"
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            texts, images, targets = [], [], []
            for _ in range(BATCH_SIZE):
                sample = rng.choice(samples)
                image = resize_to_grid(sample.image.convert("RGB"), factor, 3136, 12544)
                roll = rng.random()
                if roll < 0.5:
                    response = sample.answer
                elif roll < 0.9:
                    response = rng.choice([c for c in colours if c != sample.answer])
                else:
                    response = rng.choice(OTHER_WORDS)
                conversation = judge_conversation(
                    template, judge_question_input(prompt_text, response, sample.answer, image), "tuning"
                )
                for part in conversation[0]["content"]:
                    part.pop("image", None)  # the processor takes the images apart from the text
                text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
                target = ("yes" if response == sample.answer else "no") + tokenizer.eos_token
                texts.append(text + target)
                images.append(image)
                targets.append(len(tokenizer.encode(target)))
            inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
            sft.step_on_targets(model, optimizer, inputs, targets)
    model.eval()
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def make_score_model(text_model_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A random one-label Qwen2ForSequenceClassification with the tiny text model's config and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    config = AutoConfig.from_pretrained(text_model_dir)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def judge_layout(root: Path) -> JudgeAssets:
    return JudgeAssets(judge_dir=root / "tiny-qwen2_5_vl-judge", score_dir=root / "tiny-qwen2-score")


def judge_version() -> str:
    from vlmrl.reward import judging
    from vlmrl.testing import assets

    return assets._version(
        (synthetic, judging, sft, sys.modules[__name__]),
        f"{assets.assets_version()}:{assets.text_assets_version()}:{STEPS}:{BATCH_SIZE}:{LR}",
    )


def ensure_judge_assets(cache_dir: Path | None = None) -> JudgeAssets:
    """The tiny judge and score model, built (with the tiny assets they start from) on first use."""
    from vlmrl.testing import assets

    cache_dir = Path(cache_dir) if cache_dir is not None else assets.default_cache_dir()
    base = assets.ensure_tiny_assets(cache_dir)
    text = assets.ensure_text_assets(cache_dir)
    version = judge_version()
    final = cache_dir / f"judge-assets-{version}"

    def build(tmp: Path) -> None:
        layout = judge_layout(tmp)
        judge_tune(base.model_dir, layout.judge_dir)
        make_score_model(text.model_dir, layout.score_dir)

    assets._ensure(cache_dir, final, version, build)
    return judge_layout(final)
