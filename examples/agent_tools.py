"""The agent quickstart's tool and tool-call format (examples/agent_quickstart.yaml): the hidden picture.

Each row of the quickstart's data asks about a picture the prompt does not
show; it is in the row's ``hidden`` column (PNG bytes). ``reveal`` hands it to the model as
an image. ``reveal_blank`` is the baseline's tool: same name and schema, but
it shows a blank canvas, so calling it cannot help.

``parse_named`` is the quickstart's tool-call format (``worker.rollout.multi_turn.format``):
``<tool_call>reveal</tool_call>`` calls a tool by name alone, and Qwen's JSON form
still parses. The tiny model's tokenizer spells JSON a letter at a time, so
Qwen's ``<tool_call>{"name": "reveal"}</tool_call>`` is 16 tokens for it (about 8
for Qwen's own tokenizer) and the bare name 5: fewer tokens of format for RL to
keep intact while the picture cannot pay yet.
"""

from __future__ import annotations

import io
import re

from PIL import Image

from vlmrl.api import ParsedTurn, ToolCall, ToolResult, parse_qwen, tool


def reveal(context) -> ToolResult:
    """Show the picture."""
    image = Image.open(io.BytesIO(context.row["hidden"])).convert("RGB")
    return ToolResult(text="the picture", images=[image])


@tool(name="reveal", description="Show the picture.")
def reveal_blank(context) -> ToolResult:
    image = Image.open(io.BytesIO(context.row["hidden"])).convert("RGB")
    return ToolResult(text="the picture", images=[Image.new("RGB", image.size, image.getpixel((0, 0)))])


_NAMED = re.compile(r"<tool_call>\s*([A-Za-z_][A-Za-z0-9_]*)\s*</tool_call>")


def parse_named(text: str) -> ParsedTurn:
    """``<tool_call>NAME</tool_call>`` calls NAME with no arguments; anything else in the tags is read as Qwen's JSON.

    >>> parse_named("<tool_call>reveal</tool_call>").calls
    [ToolCall(name='reveal', arguments={})]
    >>> parse_named('<tool_call>{"name": "reveal"}</tool_call>').calls
    [ToolCall(name='reveal', arguments={})]
    >>> parse_named("<tool_call>{reveal</tool_call>").errors[0][:26]
    'tool call 1 is not JSON: E'
    """
    named = [ToolCall(m.group(1), {}) for m in _NAMED.finditer(text)]
    rest = parse_qwen(_NAMED.sub("", text))
    return ParsedTurn(calls=named + rest.calls, errors=rest.errors)
