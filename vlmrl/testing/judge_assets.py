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

from vlmrl.testing import synthetic

STEPS = 600
"""The most tuning steps. The tuning stops sooner, once the judge is right on every held-out pair at CHECKS checks
running (every CHECK_EVERY steps): a fixed rule on fixed pairs, so the same seed gives the same weights.

Measured on a 2-core machine shared with other jobs (load 4-7), held-out accuracy being greedy yes/no on 128
fresh pairs: the tuning before this one (600 steps of 16 random pairs, the whole model trained, the loss through
all logits, torch's default two threads) ran 100 steps in 383 s (~2300 s for its 600; 1003 s were measured at
load 5-19), judged at chance (0.5) until ~300 steps and was at 1.0 from ~550 (~300 s with one thread). This one
(each step 8 pictures, each with its right and a wrong answer; the vision tower frozen, as the verdict is read
from the text; logits only where the targets are; one thread) is at 1.0 from 300 steps and stops at 325: 96 s,
held-out accuracy 1.0, and 1.0 on the tests' flat-colour pictures. 5e-4 or 1e-3 learned no faster and less
stably; 8 random pairs a step not at all in 600 steps, 8 paired ones by 450.
"""
CHECK_EVERY = 25
CHECKS = 2
HELD_OUT = 32
"""Pictures in the held-out check, each with its right and a wrong answer: 64 pairs."""
BATCH_SIZE = 16
"""8 pictures a step, each with its right answer (yes) and a wrong one (no)."""
LR = 3e-4
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
    """Write ``model_dir`` tuned to judge the quickstart's answers yes or no (see the module docstring).

    At most ``steps`` steps; fewer once the judge is right on every held-out pair (see ``STEPS``).
    """
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.data.media import resize_to_grid
    from vlmrl.models.qwen_vision import QwenMediaSizes
    from vlmrl.reward.judging import DEFAULT_TEMPLATE, compile_template, judge_conversation

    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "right"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.model.visual.requires_grad_(False)  # the verdict is read from the text; the judge sees as the base does
    template = compile_template(DEFAULT_TEMPLATE)
    ip = processor.image_processor
    sizes = QwenMediaSizes.of(ip, 3136, 12544)
    prompt_text = quickstart_prompt_text(processor)
    colours = sorted(synthetic.COLOURS)

    def pictures(rng: random.Random, n: int) -> list:
        samples = [synthetic.TASKS["shape_colour"](rng) for _ in range(n)]
        return [(s.answer, resize_to_grid(s.image.convert("RGB"), sizes)) for s in samples]

    def wrong_answer(rng: random.Random, truth: str) -> str:
        if rng.random() < 0.8:
            return rng.choice([c for c in colours if c != truth])
        return rng.choice(OTHER_WORDS)

    def row(response: str, truth: str, image) -> tuple[str, int]:
        """The judge's conversation as the reward manager sends it, and the verdict it should give (text, length)."""
        conversation = judge_conversation(template, judge_question_input(prompt_text, response, truth, image), "tuning")
        for part in conversation[0]["content"]:
            part.pop("image", None)  # the processor takes the images apart from the text
        text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        target = ("yes" if response == truth else "no") + tokenizer.eos_token
        return text + target, len(tokenizer.encode(target))

    rows: dict = {}

    def processed(index: int, response: str, truth: str, image) -> tuple[dict, int]:
        """One row through the processor, once per (picture, response): the steps draw from a small set."""
        key = (index, response)
        if key not in rows:
            text, n = row(response, truth, image)
            rows[key] = (processor(text=[text], images=[image], return_tensors="pt"), n)
        return rows[key]

    def collate(batch: list[dict]) -> dict:
        """Rows right-padded into one batch, as the processor pads them."""
        width = max(b["input_ids"].shape[1] for b in batch)
        pads = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0, "mm_token_type_ids": 0}
        out = {k: torch.cat([torch.nn.functional.pad(b[k], (0, width - b[k].shape[1]), value=v) for b in batch])
               for k, v in pads.items() if k in batch[0]}  # fmt: skip
        out["pixel_values"] = torch.cat([b["pixel_values"] for b in batch])
        out["image_grid_thw"] = torch.cat([b["image_grid_thw"] for b in batch])
        return out

    def target_positions(inputs: dict, targets: list[int]) -> tuple:
        """(rows, positions) of the logits that predict each row's target tokens (its last ``n`` real tokens)."""
        rows_, cols = [], []
        for r, (length, n) in enumerate(zip(inputs["attention_mask"].sum(dim=1).tolist(), targets)):
            rows_ += [r] * n
            cols += range(length - n - 1, length - 1)
        return torch.tensor(rows_), torch.tensor(cols)

    def target_logits(inputs: dict, targets: list[int]) -> tuple:
        """The logits that predict the targets (only those: the rest of the sequence is context) and the targets."""
        rows_, cols = target_positions(inputs, targets)
        keep = torch.unique(cols)  # sorted
        logits = model(**inputs, logits_to_keep=keep).logits
        return logits[rows_, torch.searchsorted(keep, cols)], inputs["input_ids"][rows_, cols + 1]

    rng = random.Random(f"judge:tune:{seed}")
    train = pictures(rng, 64)
    check_rng = random.Random(f"judge:held-out:{seed}")
    check_texts, check_images, check_targets = [], [], []
    for truth, image in pictures(check_rng, HELD_OUT):
        for response in (truth, wrong_answer(check_rng, truth)):
            text, n = row(response, truth, image)
            check_texts.append(text)
            check_images.append(image)
            check_targets.append(n)
    check = processor(text=check_texts, images=check_images, padding=True, return_tensors="pt")

    def all_right() -> bool:
        """Greedy decoding gives every held-out pair's verdict and end token."""
        model.eval()
        with torch.no_grad():
            logits, labels = target_logits(check, check_targets)
        model.train()
        return bool((logits.argmax(dim=-1) == labels).all())

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    # One thread: a tiny model's ops are too small to share, and two threads on a busy 2-core machine were ~10x
    # slower per step; the weights also no longer depend on the machine's core count.
    torch.set_num_threads(1)
    model.train()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            streak = 0
            for step in range(1, steps + 1):
                batch, targets = [], []
                for _ in range(BATCH_SIZE // 2):
                    index = rng.randrange(len(train))
                    truth, image = train[index]
                    for response in (truth, wrong_answer(rng, truth)):
                        inputs, n = processed(index, response, truth, image)
                        batch.append(inputs)
                        targets.append(n)
                optimizer.zero_grad()
                logits, labels = target_logits(collate(batch), targets)
                torch.nn.functional.cross_entropy(logits, labels).backward()
                optimizer.step()
                if step % CHECK_EVERY == 0:
                    streak = streak + 1 if all_right() else 0
                    if streak == CHECKS:
                        break
    finally:
        torch.set_num_threads(threads)
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
        (synthetic, judging, sys.modules[__name__]),
        f"{assets.assets_version()}:{assets.text_assets_version()}:{STEPS}:{CHECK_EVERY}:{CHECKS}:{HELD_OUT}:{BATCH_SIZE}:{LR}",
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
