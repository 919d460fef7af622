"""The Qwen text models: Qwen2 and Qwen2.5 (``qwen2``) and Qwen3 dense (``qwen3``).

One position per token, no media. Their tokenizers carry the Qwen vocabulary's
vision markers, which a response may not hold any more than a VLM's may: the
ban is the same as the VLM families'.
"""

from __future__ import annotations

from vlmrl.models import qwen_vision
from vlmrl.models.base import Family, text_positions


QWEN2 = Family(
    name="Qwen2 / Qwen2.5", model_type="qwen2", banned_tokens=qwen_vision.SPECIAL_TOKENS, rotary=text_positions
)

QWEN3 = Family(name="Qwen3", model_type="qwen3", banned_tokens=qwen_vision.SPECIAL_TOKENS, rotary=text_positions)
