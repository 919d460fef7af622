"""Tiny randomly initialised text-only causal LMs (Qwen2 and Qwen3 dense), built locally, and a text math task.

The text counterparts of ``tiny_vlm``: the same tokenizer (so the same
special tokens and ids), the same language-model size, saved with
``save_pretrained`` as a model directory with a tokenizer and no processor,
which is what a text checkpoint on the Hub looks like (Qwen2.5-7B-Instruct,
Qwen3-4B). Both load with ``AutoModelForCausalLM`` and with ``vllm.LLM``.

``write_math_dataset`` writes EasyR1's math12k columns (``problem``,
``answer``) with small arithmetic problems, for EasyR1's math format prompt
(examples/format_prompt/math.jinja) and reward (reward_functions/math.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from vlmrl.testing.tiny_vlm import INIT_STD, QWEN_SPECIAL_TOKENS, build_qwen_tokenizer

__all__ = ["TEXT_FAMILIES", "build_tiny_text_lm", "write_math_dataset"]

# Qwen2.5's text chat template, cut to what the tests use: a default system turn and string contents.
QWEN_TEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _language_model_config(tokenizer) -> dict:
    """The tiny VLMs' language model: 2 layers, hidden 128, 2 heads of 64, one KV head (GQA)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "dtype": "float32",
    }


def _save(out_dir: Path, model_cls, config, tokenizer, seed: int) -> None:
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    eos, pad = config.eos_token_id, config.pad_token_id
    # Only the stopping ids; sampling defaults here would silently change vLLM's.
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out_dir)
    tokenizer.chat_template = QWEN_TEXT_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)  # a tokenizer alone: no image or video processor


def build_tiny_qwen2(out_dir: Path, seed: int) -> None:
    """Qwen2 / Qwen2.5 dense (``Qwen2ForCausalLM``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_qwen_tokenizer()
    settings = _language_model_config(tokenizer)
    settings.pop("head_dim")  # Qwen2 derives it: hidden / heads = 64
    _save(out_dir, Qwen2ForCausalLM, Qwen2Config(**settings), tokenizer, seed)


def build_tiny_qwen3(out_dir: Path, seed: int) -> None:
    """Qwen3 dense (``Qwen3ForCausalLM``): Qwen2 plus RMS norms on the queries and keys."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_qwen_tokenizer()
    _save(out_dir, Qwen3ForCausalLM, Qwen3Config(**_language_model_config(tokenizer)), tokenizer, seed)


TEXT_FAMILIES: dict[str, Callable[[Path, int], None]] = {
    "qwen2": build_tiny_qwen2,
    "qwen3": build_tiny_qwen3,
}


def build_tiny_text_lm(out_dir: str | Path, family: str = "qwen2", seed: int = 0) -> Path:
    """Write a random-init tiny text LM of ``family`` to ``out_dir``; deterministic in ``seed``."""
    if family not in TEXT_FAMILIES:
        raise ValueError(f"unknown tiny text family {family!r}; known: {sorted(TEXT_FAMILIES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    TEXT_FAMILIES[family](out_dir, seed)
    return out_dir


def _problem(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"problem": f"What is {a} {op} {b}?", "answer": str(value), "data_source": "tiny_math"}


def write_math_dataset(out_dir: str | Path, n_train: int, n_val: int, seed: int = 0) -> tuple[Path, Path]:
    """``train.parquet`` and ``val.parquet`` of arithmetic problems in math12k's columns (problem, answer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for name, n in (("train", n_train), ("val", n_val)):
        path = out_dir / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist([_problem(rng) for _ in range(n)]), path)
        paths.append(path)
    return paths[0], paths[1]
