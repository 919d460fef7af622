"""Tools in the prompt: the chat template's ``tools=`` where it has one, a system message where not.

Qwen2.5's and Qwen3's templates render ``tools=`` (the function schemas) into
the system turn, and tool results as ``<tool_response>`` blocks. Qwen2-VL's
and Qwen2.5-VL's templates (and the tiny test models') ignore ``tools=``; for
those the same schemas go into a system message written here, in the same
Hermes-style form, so the model sees them either way.
"""

from __future__ import annotations

import json
import re


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders the ``tools`` variable (read from its source)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def tools_system_message(tools: list[dict]) -> str:
    """The system message that shows ``tools`` to a model whose template cannot."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You are a helpful assistant. These tools are available, one JSON schema per line:\n"
        f"<tools>\n{lines}\n</tools>\n"
        'To use one, write <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>; '
        "its result comes back in <tool_response></tool_response>."
    )
