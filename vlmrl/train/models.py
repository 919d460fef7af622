"""Loading a model and its processor by kind: vision-language (``AutoModelForImageTextToText``) or text-only
(``AutoModelForCausalLM``), the kind read from the model's config.json (``vlmrl.plan.model_kind``).

A text model's processor is its tokenizer alone (``load_processor``), even
when its tokenizer config names a multimodal processor class, as a text model
cut from a vision-language checkpoint does; ``tokenizer_of`` gives the
tokenizer of either.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vlmrl.config import ModelKind
from vlmrl.models import FAMILIES
from vlmrl.plan import model_kind

__all__ = ["apply_overrides", "auto_class", "load_pretrained", "load_processor", "named_processor_class", "tokenizer_of"]


def auto_class(kind: ModelKind):
    """The transformers Auto class that builds a model of ``kind``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForCausalLM if kind is ModelKind.text else AutoModelForImageTextToText


def load_pretrained(
    model_path: str, dtype: torch.dtype, trust_remote_code: bool, override_config: dict | None = None
) -> torch.nn.Module:
    """The model at ``model_path`` with the Auto class its config.json calls for.

    ``override_config`` (``model.override_config``) replaces entries of the model's config before the model is
    built (``apply_overrides``).
    """
    from transformers import AutoConfig

    kind = model_kind(model_path, trust_remote_code)
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    apply_overrides(config, override_config or {})
    model = auto_class(kind).from_pretrained(
        model_path, config=config, dtype=dtype, trust_remote_code=trust_remote_code
    )
    family = FAMILIES.get(getattr(config, "model_type", ""))
    if family is not None and family.prepare is not None:
        family.prepare(model)  # what the family's transformers code needs for vlmrl's passes (vlmrl.models.base)
    return model


def apply_overrides(config, overrides: dict) -> None:
    """Set each ``model.override_config`` entry on the model's config, and on its language model's config.

    A VLM keeps most language-model entries (``attention_dropout``, ...) in ``text_config``, where
    ``AutoConfig.from_pretrained(**kwargs)`` does not reach: each entry goes to every level that has it.
    """
    for key, value in overrides.items():
        levels = [c for c in {id(c): c for c in (config, config.get_text_config())}.values() if hasattr(c, key)]
        if not levels:
            raise ValueError(f"model.override_config.{key}: the model's config has no entry {key!r}")
        for level in levels:
            setattr(level, key, value)


def load_processor(model_path: str, tokenizer_path: str | None = None, trust_remote_code: bool = False,
                   announce: bool = False):
    """The processor at ``tokenizer_path`` (null: ``model_path``): a VLM's processor, or a text model's tokenizer.

    The kind comes from the model's own config (``model_kind``). A text model (no vision config) loads its
    tokenizer alone, as EasyR1's ``get_processor`` ends up with, whatever processor class its tokenizer config
    names: ``AutoProcessor`` would build that class and fail looking for an image processor the directory does
    not have. With ``announce`` (the driver, once per run) one console line says so when a class was named.
    """
    from transformers import AutoProcessor, AutoTokenizer

    path = tokenizer_path or model_path
    if model_kind(model_path, trust_remote_code) is ModelKind.vision_language:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    named = named_processor_class(path)
    if named and announce:
        print(
            f"processor: {path} names processor_class {named}, but the model has no vision config (a text "
            "model): loading its tokenizer alone",
            flush=True,
        )
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def named_processor_class(path: str) -> str | None:
    """The ``processor_class`` that the tokenizer config (or processor config) at ``path`` names, if any."""
    for name in ("tokenizer_config.json", "processor_config.json"):
        file = Path(path) / name
        if file.is_file():
            try:
                named = json.loads(file.read_text()).get("processor_class")
            except (json.JSONDecodeError, AttributeError):
                continue
            if named:
                return named
    return None


def tokenizer_of(processor):
    """The tokenizer of a processor, or the processor itself when it is a tokenizer."""
    return getattr(processor, "tokenizer", processor)
