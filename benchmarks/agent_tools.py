"""The agent benchmarks' tool and tool-call parser, loadable by path (``benchmarks/agent_tools.py:look``).

Every model turn is read as one call of ``look`` (``always_call``), whatever
the random tiny model wrote, so every trajectory calls the tool at every turn
up to ``max_turns``; ``look`` answers at once with a line of text and a
56 px picture (4 image tokens at the benchmark's pixel bounds), a different
colour each turn. ``python -m benchmarks.agent`` uses both in process and,
for the step overhead, through ``python -m vlmrl.main`` (``agent_step.yaml``).

>>> always_call("anything").calls
[ToolCall(name='look', arguments={})]
>>> card(1).getpixel((0, 0))
(30, 200, 30)
"""

from __future__ import annotations

from PIL import Image

from vlmrl.rollout.turns.tool_parsers import ParsedTurn, ToolCall
from vlmrl.rollout.turns.tools import ToolResult


def card(index: int) -> Image.Image:
    """A plain 56 x 56 picture, red, green or blue by ``index``."""
    return Image.new("RGB", (56, 56), [(200, 30, 30), (30, 200, 30), (30, 30, 200)][index % 3])


def look(context) -> ToolResult:
    """Look again."""
    return ToolResult(text=f"turn {context.turn}", images=[card(context.turn)])


def always_call(text: str) -> ParsedTurn:
    """A tool-call parser (``multi_turn.format``) that reads every turn as a call of ``look``."""
    return ParsedTurn(calls=[ToolCall("look", {})])
