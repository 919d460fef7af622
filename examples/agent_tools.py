"""The agent quickstart's tool (examples/agent_quickstart.yaml): the picture behind the cover.

Each row of the quickstart's data shows a covered picture; the real one is in
the row's ``hidden`` column (PNG bytes). ``reveal`` hands it to the model as
an image. ``reveal_blank`` is the baseline's tool: same name and schema, but
it shows a blank canvas, so calling it cannot help.
"""

from __future__ import annotations

import io

from PIL import Image

from vlmrl.rollout.tools import ToolResult, tool


def reveal(context) -> ToolResult:
    """Show the picture."""
    image = Image.open(io.BytesIO(context.row["hidden"])).convert("RGB")
    return ToolResult(text="the picture", images=[image])


@tool(name="reveal", description="Show the picture.")
def reveal_blank(context) -> ToolResult:
    image = Image.open(io.BytesIO(context.row["hidden"])).convert("RGB")
    return ToolResult(text="the picture", images=[Image.new("RGB", image.size, image.getpixel((0, 0)))])
