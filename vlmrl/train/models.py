"""Loading a model and its processor by kind: vision-language (``AutoModelForImageTextToText``) or text-only
(``AutoModelForCausalLM``), the kind read from the model's config.json (``vlmrl.plan.model_kind``).

A text model's processor may be a tokenizer alone (``AutoProcessor`` returns
the tokenizer for such a directory); ``tokenizer_of`` gives the tokenizer of
either.
"""

from __future__ import annotations

import torch

from vlmrl.config import ModelKind
from vlmrl.plan import model_kind

__all__ = ["apply_overrides", "auto_class", "load_pretrained", "load_processor", "tokenizer_of"]


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
    return auto_class(kind).from_pretrained(
        model_path, config=config, dtype=dtype, trust_remote_code=trust_remote_code
    )


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


def load_processor(path: str):
    """The processor at ``path``: a VLM's processor, or a text model's tokenizer."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def tokenizer_of(processor):
    """The tokenizer of a processor, or the processor itself when it is a tokenizer."""
    return getattr(processor, "tokenizer", processor)
