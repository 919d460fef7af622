"""Format tuning for the quickstart's tiny model: teach the answer format, not the answer.

A randomly initialised model spreads its first token over the whole
vocabulary, so it names a colour about once in 300 samples. Measured with
GRPO on the tiny VLM, that start fails in the same way every time: the first
colour that happens to be rewarded is pushed up on every image, groups become
all-same (no advantage, no gradient), and the policy collapses onto one colour
before it learns to look at the image. An instruction-tuned model, the usual
starting point of RL, does not have this problem: it already answers in the
asked-for format and has to learn only what to say.

``format_tune`` gives the tiny model that starting point with a few supervised
steps on the quickstart's prompt, where each target is a colour word drawn at
random *independently of the image*, followed by ``<|im_end|>``. The tuned
model answers with one colour word and stops, and picks the colour by chance:
its validation accuracy starts at the level of a policy that ignores the
image (about 0.25), which is what the RL run has to beat.
"""

from __future__ import annotations

import random
from pathlib import Path

from vlmrl.testing.synthetic import COLOUR_QUESTION, COLOURS, TASKS

# Must match examples/format_prompt/colour.jinja rendered on COLOUR_QUESTION, so
# that the tuned format is the one the quickstart asks for.
COLOUR_INSTRUCTION = "Answer with one word: red, green, blue or yellow."

STEPS = 40
BATCH_SIZE = 16
LR = 1e-3
N_IMAGES = 64


def format_tune(
    model_dir: str | Path,
    out_dir: str | Path,
    task: str = "shape_colour",
    steps: int = STEPS,
    batch_size: int = BATCH_SIZE,
    lr: float = LR,
    seed: int = 0,
) -> Path:
    """Write ``model_dir`` tuned to answer ``task``'s question with a random colour word.

    Images come from their own stream of ``task`` (none of them is a train or
    val row). Deterministic in ``seed``.
    """
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)

    rng = random.Random(f"{task}:format:{seed}")
    images = [TASKS[task](rng).image for _ in range(N_IMAGES)]
    colours = sorted(COLOURS)
    text = f"{COLOUR_QUESTION.replace('<image>', '')} {COLOUR_INSTRUCTION}"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    with torch.random.fork_rng(devices=[]):  # leave the caller's torch RNG alone
        torch.manual_seed(seed)
        for _ in range(steps):
            optimizer.zero_grad()
            for _ in range(batch_size):
                answer = rng.choice(colours) + tokenizer.eos_token  # independent of the image
                inputs = processor(text=[prompt + answer], images=[rng.choice(images)], return_tensors="pt")
                n_answer = len(tokenizer.encode(answer))
                labels = inputs["input_ids"].clone()
                labels[:, :-n_answer] = -100  # loss on the answer and its end token only
                (model(**inputs, labels=labels).loss / batch_size).backward()
            optimizer.step()
    model.eval()

    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir
