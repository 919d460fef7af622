"""Tiny randomly initialised vision-language models, built locally.

There is no model hub at test time, so tests and demos use a model written
here with ``save_pretrained``: a real architecture at toy size, its own
byte-level BPE tokenizer trained on a small in-code corpus, a chat template
and the real image/video processors. The directory loads with transformers'
Auto classes and with ``vllm.LLM`` (a few MB, built in seconds).

``FAMILIES`` maps a family name to its builder; adding Qwen2-VL or Qwen3-VL is
one builder function and one entry.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from vlmrl.testing.synthetic import COLOURS, SHAPES

# Qwen2.5's special tokens, in Qwen's id order (151643..151656 there; here they
# follow the trained vocabulary, so id = first_special_id + index).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Same pre-tokenisation as transformers' Qwen2Tokenizer, which rebuilds its
# pipeline from vocab + merges on load; training with the same pipeline keeps
# the saved tokenizer.json and the loaded tokenizer identical.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2-VL style: a default system turn, media items as vision placeholders the
# processor expands, and an optional open assistant turn.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in item %}"
    "{{ item['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

# Image sizes in pixels: 56x56 gives 4 image tokens, the cap 224x224 gives 64.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64
# Larger than Qwen's 0.02: at hidden size 128 a 0.02 init leaves positions and
# attention nearly without effect on the logits (a wrong mrope changed
# log-probs by ~1e-2), so tests could not tell correct positions from wrong
# ones. At 0.05 they move by ~0.3 while sampling stays near uniform.
INIT_STD = 0.05
TOKENIZER_VOCAB_SIZE = 960  # BPE upper bound incl. the 256 byte symbols, before specials

_CORPUS_WORDS = """
the a an of and or to in on at is are was were be been it this that these those with for from by as
what which who where when why how many much one two three four five six seven eight nine ten zero
answer question image picture video shape colour color object left right top bottom middle centre
center above below next there here count number total first second third last find solve compute
value equal equals plus minus times divided sum difference product area length width height angle
line point triangle circle square rectangle background foreground small large big bright dark light
grey gray white black orange purple pink brown please think step reason reasoning final so therefore
because then if not no yes true false you are helpful assistant system user i we can see shows has have
""".split()

_CORPUS_SENTENCES = (
    "You are a helpful assistant.",
    "What colour is the shape? Answer with one word inside <answer></answer> tags.",
    "How many shapes are in the image? Is the circle left or right of the square?",
    "Let me think step by step. The shape is red, so the answer is <answer>red</answer>.",
    "The final answer is 42. Therefore x = 3.5, y = -7 and z = 1/2 (approximately 0.5%).",
    "Find x. Solve for y: 2x + 3 = 11; x = 4! Is it true? Yes: 'it's' and \"quotes\" [a] {b} <c> #1 @2 $3 & * ~ ^ | \\",
)


def _training_corpus() -> list[str]:
    task_words = [*COLOURS, *SHAPES]
    lines = list(_CORPUS_SENTENCES)
    lines += [" ".join(_CORPUS_WORDS), " ".join(w.capitalize() for w in _CORPUS_WORDS)]
    lines += [f"<answer>{w}</answer> The {w} shape. answer: {w}" for w in task_words]
    lines += [" ".join(str(i) for i in range(200)), "0123456789 .,;:!?()[]{}<>+-*/=%'\"\n\t"]
    lines += task_words  # bare, as in an answer, so each also has a no-space form
    # Repetition raises the pair counts of the task words above the rest, so
    # their merges are learned first.
    return lines * 4 + [f"The shape is {w}. <answer>{w}</answer>" for w in task_words] * 20


def build_bpe_tokenizer(special_tokens: tuple[str, ...], eos_token: str, chat_template: str):
    """A byte-level BPE tokenizer with Qwen's pipeline, trained on the toy corpus, with ``special_tokens`` after
    the learned vocabulary (fixed ids) and ``chat_template``; a family's tiny builder chooses the three."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_corpus(), trainer=trainer)

    vocab = bpe.get_vocab()
    # Specials go after the learned vocabulary, as in Qwen, with fixed ids.
    for token in special_tokens:
        vocab[token] = len(vocab)
    merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=eos_token,
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in special_tokens if t not in (eos_token, "<|endoftext|>")],
        model_max_length=4096,
        errors="replace",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_qwen_tokenizer():
    """A byte-level BPE tokenizer with Qwen's pipeline, specials and chat template."""
    return build_bpe_tokenizer(QWEN_SPECIAL_TOKENS, "<|im_end|>", QWEN_VL_CHAT_TEMPLATE)


def build_tiny_qwen2_5_vl(out_dir: Path, seed: int) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = build_qwen_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    bos, eos, pad = ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|endoftext|>"]
    token_ids = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_config = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # head_dim 64; GQA exercised
        max_position_embeddings=4096,
        # mrope: (temporal, height, width) sections sum to head_dim / 2.
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]},
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
        initializer_range=INIT_STD,
        **token_ids,
    )
    vision_config = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1],  # block 0 windowed, block 1 full, as in the real model
        out_hidden_size=128,
        tokens_per_second=2,
        initializer_range=INIT_STD,
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        dtype="float32",
        **token_ids,
    )

    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    # Only the stopping ids; sampling defaults here would silently change vLLM's.
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[eos, ids["<|endoftext|>"]], pad_token_id=pad)
    model.save_pretrained(out_dir)

    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    # cap_pixels_per_frame: qwen-vl-utils' per-frame budget (the future default).
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, min_frames=2, max_frames=8, cap_pixels_per_frame=True
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)


def _qwen_token_ids(tokenizer) -> tuple[dict[str, int], dict[str, int]]:
    """(the tokenizer's special ids by token, the vision token ids a Qwen-VL config names)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    vision = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    return ids, vision


def _save_tiny(out_dir: Path, model_cls, config, seed: int, ids: dict[str, int], processor) -> None:
    """Initialise ``model_cls(config)`` from ``seed`` and save it with its processor."""
    import torch
    from transformers import GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


def _tiny_text_config(tokenizer, ids: dict[str, int], vision_ids: dict[str, int], mrope_section: list[int]) -> dict:
    """The language model of every tiny family: 2 layers, hidden 128, head_dim 64, one KV head."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope_section},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "dtype": "float32",
        "initializer_range": INIT_STD,
        **vision_ids,
    }


def build_tiny_qwen2_vl(out_dir: Path, seed: int) -> None:
    """Qwen2-VL: the 2.5 layout without windowed attention, with a LayerNorm/GELU vision tower."""
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = build_qwen_tokenizer()
    ids, vision_ids = _qwen_token_ids(tokenizer)
    config = Qwen2VLConfig(
        text_config=_tiny_text_config(tokenizer, ids, vision_ids, mrope_section=[8, 12, 12]),
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": 128,  # Qwen2-VL's vision hidden_size is the merger's output: the LM's width
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": INIT_STD,
        },
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        dtype="float32",
        **vision_ids,
    )
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(
            min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, min_frames=2, max_frames=8, cap_pixels_per_frame=True
        ),
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    _save_tiny(out_dir, Qwen2VLForConditionalGeneration, config, seed, ids, processor)


# Qwen3-VL's vision tower works on 16-px patches: the same token budgets as above in its 32-px grid.
QWEN3_MIN_PIXELS = 32 * 32 * 4
QWEN3_MAX_PIXELS = 32 * 32 * 64


def qwen3_vision_config() -> dict:
    """Qwen3-VL's vision tower at toy size (shared by the dense and the MoE tiny model)."""
    return {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 128,
        "num_position_embeddings": 64,  # an 8x8 table, interpolated to each image's grid
        "deepstack_visual_indexes": [0],
        "initializer_range": INIT_STD,
    }


def qwen3_processor(tokenizer):
    """Qwen3-VL's processor on the 32-px grid of the token budgets above."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            patch_size=16, min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS, image_mean=[0.5] * 3, image_std=[0.5] * 3
        ),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(
            size={"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS * 8}, min_frames=2, max_frames=8
        ),
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )


def build_tiny_qwen3_vl(out_dir: Path, seed: int) -> None:
    """Qwen3-VL: 16-px patches, learned vision positions, deepstack features, interleaved mrope."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = build_qwen_tokenizer()
    ids, vision_ids = _qwen_token_ids(tokenizer)
    text_config = _tiny_text_config(tokenizer, ids, vision_ids, mrope_section=[8, 12, 12])
    text_config["head_dim"] = 64
    text_config["rope_parameters"]["mrope_interleaved"] = True
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=qwen3_vision_config(),
        tie_word_embeddings=False,
        dtype="float32",
        **vision_ids,
    )
    _save_tiny(out_dir, Qwen3VLForConditionalGeneration, config, seed, ids, qwen3_processor(tokenizer))


def build_tiny_qwen3_vl_moe(out_dir: Path, seed: int) -> None:
    """Qwen3-VL-MoE (``vlmrl.testing.tiny_qwen3_vl_moe``): the dense tiny Qwen3-VL with sparse layers."""
    from vlmrl.testing.tiny_qwen3_vl_moe import build_tiny_qwen3_vl_moe as build

    build(out_dir, seed)


def build_tiny_glm4v(out_dir: Path, seed: int) -> None:
    """GLM-4.1V (``vlmrl.testing.tiny_glm4v``, which builds on this module's corpus)."""
    from vlmrl.testing.tiny_glm4v import build_tiny_glm4v as build

    build(out_dir, seed)


FAMILIES: dict[str, Callable[[Path, int], None]] = {
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen3_vl": build_tiny_qwen3_vl,
    "qwen3_vl_moe": build_tiny_qwen3_vl_moe,
    "glm4v": build_tiny_glm4v,
}


def build_tiny_vlm(out_dir: str | Path, family: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """Write a random-init tiny VLM of ``family`` to ``out_dir``; deterministic in ``seed``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny VLM family {family!r}; known: {sorted(FAMILIES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    FAMILIES[family](out_dir, seed)
    return out_dir
