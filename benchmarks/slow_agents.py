"""The async agent benchmark's tool and agent, with I/O-like waits (``python -m benchmarks.async_agents``).

``reveal`` is the agent quickstart's tool (examples/agent_tools.py) behind a wait, and ``solve`` is the
OpenAI-SDK demo agent (examples/openai_agent/agent.py) with a wait before each call and a long tail of calls.
The waits stand for what real tools and agents spend outside the model (a sandbox, a web request, a
database). They are ``asyncio.sleep``, so they cost no CPU.

A wait is 0.2-2 s, most short and a few long: ``0.2 + 1.8 * u**3`` for u uniform in [0, 1) (median 0.43 s,
mean 0.65 s, one in ten over 1.5 s). The agent makes 2, 3 or 4 calls, with probabilities 0.7, 0.2 and 0.1.

>>> all(0.2 <= wait_s(random.Random(i)) <= 2.0 for i in range(1000))
True
>>> sorted(set(extra_looks(random.Random(i)) for i in range(1000)))
[0, 1, 2]
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import random
from pathlib import Path

import openai
from PIL import Image

from vlmrl.api import ToolResult, tool

# The demo agent, for its picture encoding and its shared HTTP client.
_spec = importlib.util.spec_from_file_location(
    "openai_agent_demo", Path(__file__).parents[1] / "examples" / "openai_agent" / "agent.py"
)
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

FOLLOW_UP = "Answer with one word: red, green, blue or yellow."
LOOK_AGAIN = "Look again."
MAX_TOKENS = 8
_rng = random.Random(0)


def wait_s(rng: random.Random) -> float:
    """0.2-2 s, long-tailed: ``0.2 + 1.8 * u**3``."""
    return 0.2 + 1.8 * rng.random() ** 3


def extra_looks(rng: random.Random) -> int:
    """0, 1 or 2 calls before the answer's, with probabilities 0.7, 0.2 and 0.1."""
    u = rng.random()
    return 0 if u < 0.7 else 1 if u < 0.9 else 2


@tool(name="reveal", description="Show the picture.")
async def reveal(context) -> ToolResult:
    """examples/agent_tools.py:reveal after a wait (run with ``multi_turn.tool_processes=0``, so waits overlap)."""
    await asyncio.sleep(wait_s(_rng))
    image = Image.open(io.BytesIO(context.row["hidden"])).convert("RGB")
    return ToolResult(text="the picture", images=[image])


async def solve(task, llm):
    """The demo agent (look, then answer), with 0-2 more looks between and a wait before every call.

    Each call's messages are the last call's plus its reply and one user turn, so the calls make one training
    row (``algorithm.trace_aggregation=trajectory``), as the demo's two do.
    """
    question = task["prompt"].replace("<image>", "").strip()
    pictures = [{"type": "image_url", "image_url": {"url": demo.data_url(image)}} for image in task["images"]]
    messages = [{"role": "user", "content": [*pictures, {"type": "text", "text": question}]}]
    follow_ups = [LOOK_AGAIN] * extra_looks(_rng) + [FOLLOW_UP]
    # One HTTP client for every rollout (the demo's http_client), never closed.
    client = openai.AsyncOpenAI(
        base_url=llm.base_url, api_key=llm.api_key, max_retries=0, http_client=demo.http_client()
    )
    for call in range(len(follow_ups) + 1):
        await asyncio.sleep(wait_s(_rng))
        reply = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=MAX_TOKENS)
        if call < len(follow_ups):
            content = reply.choices[0].message.content  # as it came: the prompt stays append-only
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": follow_ups[call]}]
    return None  # the run's reward function scores the last reply
