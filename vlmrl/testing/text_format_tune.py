"""Format tuning for the tiny text model, so that EasyR1's math reward has something to reward.

A randomly initialised model never writes ``<think>...</think>`` and a
``\\boxed{}``: every response of the text e2e scored 0 (format and accuracy),
each GRPO group was all-same, and the policy update had no signal. Here the
tiny Qwen3 gets a few supervised steps on the math prompt
(examples/format_prompt/math.jinja), where half the targets are the asked-for
format with a random number boxed, and the rest the bare number. The tuned
model writes either at temperature 1, so EasyR1's math reward (format weight
0.1) differs within a group and the update has an advantage to follow: the
run can learn the format, as the quickstart learns the colour.
"""

from __future__ import annotations

import random
from pathlib import Path

from vlmrl.testing import sft

STEPS = 200  # 80 steps: samples at temperature 1 were mostly garbled, no format at all in 8
BATCH_SIZE = 16
LR = 1e-3
FORMATTED_SHARE = 0.5
MATH_PROMPT = Path(__file__).resolve().parents[2] / "examples" / "format_prompt" / "math.jinja"


def math_prompt_text(tokenizer, problem: str) -> str:
    """The chat prompt the dataset renders for ``problem`` with EasyR1's math format prompt."""
    import jinja2

    content = jinja2.Template(MATH_PROMPT.read_text()).render(content=problem)
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)


def format_tune_math(model_dir: Path, out_dir: Path, train_file: Path, seed: int = 0, steps: int = STEPS) -> Path:
    """Write ``model_dir`` tuned to answer the math prompt either in EasyR1's format or bare (see above)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    problems = pq.read_table(train_file).column("problem").to_pylist()
    prompts = [math_prompt_text(tokenizer, p) for p in problems]
    rng = random.Random(f"text:format:{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokenizer.padding_side = "right"
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            texts, targets = [], []
            for _ in range(BATCH_SIZE):
                number = str(rng.randint(0, 20))  # independent of the problem: the format, not the sum
                answer = f"<think></think>\\boxed{{{number}}}" if rng.random() < FORMATTED_SHARE else number
                target = answer + tokenizer.eos_token
                texts.append(rng.choice(prompts) + target)
                targets.append(len(tokenizer.encode(target, add_special_tokens=False)))
            inputs = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
            sft.step_on_targets(model, optimizer, inputs, targets)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
