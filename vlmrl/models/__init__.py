"""Model families: one adapter module per family, and the registry that picks one from a config's ``model_type``.

A family (``vlmrl.models.base.Family``) holds what differs between model
architectures: special tokens, rotary positions, media resizing, the vision
tower's place and the LoRA exclusions. The dataset, the rollout, the trainer
and validation choose the family once, from the model's ``config.json``, and
ask it; none of them branches on a model type.

Adding a family: write its adapter module here (a ``Family``), add one line to
``FAMILIES``, and a tiny builder in ``vlmrl.testing`` (``tiny_vlm.FAMILIES``,
``tiny_text.TEXT_FAMILIES`` or ``tiny_qwen3_5.BUILDERS``) so that the tests run it on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmrl.models import glm4v, qwen2_vl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe, qwen_text
from vlmrl.models.base import Family, MediaSizes, RotaryPositions

__all__ = [
    "FAMILIES", "Family", "MediaSizes", "RotaryPositions", "UnsupportedFamily", "family", "family_at", "family_of",
]

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        qwen2_vl.QWEN2_VL,
        qwen2_vl.QWEN2_5_VL,
        qwen3_vl.QWEN3_VL,
        qwen3_vl_moe.QWEN3_VL_MOE,
        qwen3_5.QWEN3_5,
        qwen3_5_moe.QWEN3_5_MOE,
        glm4v.GLM4V,
        qwen_text.QWEN2,
        qwen_text.QWEN3,
    )
}
"""Every supported family, by ``model_type``."""


class UnsupportedFamily(ValueError):
    """A model whose ``model_type`` has no adapter."""


def supported() -> str:
    """The supported families, for messages: ``qwen2_vl (Qwen2-VL), ...``."""
    return ", ".join(f"{t} ({f.name})" for t, f in FAMILIES.items())


def family(model_type: str | None) -> Family:
    """The adapter of ``model_type``; UnsupportedFamily, naming it and the supported families, for any other."""
    found = FAMILIES.get(model_type or "")
    if found is None:
        raise UnsupportedFamily(
            f"model_type {model_type!r} is not a supported model family; vlmrl supports {supported()}"
        )
    return found


def family_of(config: Any) -> Family:
    """The family of a transformers config, or of a ``config.json`` read as a dict."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return family(model_type)


def family_at(model_path: str, trust_remote_code: bool = False) -> Family:
    """The family of the model at ``model_path``: its ``config.json``, or transformers' config of a Hub id."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        return family_of(json.loads(config_file.read_text()))
    from transformers import AutoConfig

    return family_of(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
