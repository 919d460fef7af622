"""The async benchmark's multi-turn workload with 2-4 tool turns (``python -m benchmarks.async_agents``).

The agent quickstart's task (call ``reveal``, then name the colour its picture shows) as a workflow class, so that
the number of tool turns is the workload's, not the tiny model's (which calls once and answers):

1. the model's first turn calls ``reveal`` (``<tool_call>reveal</tool_call>``, or Qwen's JSON); a first turn that
   answers instead ends the trajectory unseen;
2. the configured ``reveal`` tool runs (``benchmarks/slow_agents.py:reveal``: a 0.2-2 s wait, long-tailed, then the
   picture) and its answer follows as the multi-turn loop renders it; the model answers;
3. the tool runs again and the model answers again, 0, 1 or 2 more times (probabilities 0.7, 0.2 and 0.1): 2, 3
   or 4 tool turns, 3-5 model turns. The prompt shows the tool's schema, as the quickstart's does.

``compute_score`` scores the last answer as ``examples/reward_function/agent_colour.py`` does, 0 without the call.

>>> compute_score({"response": "red", "ground_truth": "red", "messages": [{"role": "assistant", "content": "<tool_call>reveal</tool_call>"}]})
{'overall': 1.0, 'accuracy': 1.0, 'revealed': 1.0}
>>> compute_score({"response": "red", "ground_truth": "red", "messages": [{"role": "assistant", "content": "red"}]})
{'overall': 0.0, 'accuracy': 1.0, 'revealed': 0.0}
"""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path

from vlmrl.api import Workflow

# Loaded by path, as the run loads this file: the long tail is the agent benchmark's.
_spec = importlib.util.spec_from_file_location("slow_agents", Path(__file__).with_name("slow_agents.py"))
slow_agents = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slow_agents)

REWARD_TYPE = "sequential"
_rng = random.Random(0)
_REVEAL = re.compile(r"<tool_call>\s*(reveal|\{\s*\"name\"\s*:\s*\"reveal\".*\})\s*</tool_call>", re.DOTALL)


def calls_reveal(text: str) -> bool:
    return bool(_REVEAL.search(text or ""))


def tool_turns(rng: random.Random) -> int:
    """2, 3 or 4, with probabilities 0.7, 0.2 and 0.1."""
    return 2 + slow_agents.extra_looks(rng)


class LookAgain(Workflow):
    """Reveal, answer; then reveal and answer again, 2-4 tool turns in all."""

    async def run(self, ctx, row):
        episode = ctx.episode()
        turn = await ctx.generate(episode)
        ctx.add_generation(episode, turn)
        if not calls_reveal(turn.text):
            return episode  # an answer without looking
        for _ in range(tool_turns(_rng)):
            outcome = await ctx.call_tool(episode, "reveal", {})
            # The tool's answer as the multi-turn loop renders it for a template without tools.
            content = [{"type": "text", "text": "<tool_response>\n"},
                       *({"type": "image", "image": image} for image in outcome.result.images),
                       {"type": "text", "text": f"{outcome.result.text}\n</tool_response>"}]  # fmt: skip
            if not ctx.add_user(episode, content):
                break  # no room left in data.max_response_length
            turn = await ctx.generate(episode)
            ctx.add_generation(episode, turn)
        return episode


def _normalise(text: str) -> str:
    return text.strip().rstrip(".!").strip().lower()


def compute_score(reward_input: dict) -> dict[str, float]:
    first = next((m["content"] for m in reward_input.get("messages") or [] if m.get("role") == "assistant"), "")
    revealed = calls_reveal(first if isinstance(first, str) else "")
    accuracy = float(_normalise(reward_input["response"]) == _normalise(reward_input["ground_truth"]))
    return {"overall": accuracy if revealed else 0.0, "accuracy": accuracy, "revealed": float(revealed)}
