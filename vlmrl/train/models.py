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

__all__ = ["auto_class", "load_pretrained", "load_processor", "tokenizer_of"]


def auto_class(kind: ModelKind):
    """The transformers Auto class that builds a model of ``kind``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForCausalLM if kind is ModelKind.text else AutoModelForImageTextToText


def load_pretrained(model_path: str, dtype: torch.dtype, trust_remote_code: bool) -> torch.nn.Module:
    """The model at ``model_path`` with the Auto class its config.json calls for."""
    kind = model_kind(model_path, trust_remote_code)
    return auto_class(kind).from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)


def load_processor(path: str):
    """The processor at ``path``: a VLM's processor, or a text model's tokenizer."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def tokenizer_of(processor):
    """The tokenizer of a processor, or the processor itself when it is a tokenizer."""
    return getattr(processor, "tokenizer", processor)
