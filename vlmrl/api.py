"""What user code imports from vlmrl: the one documented path for tools, tool-call parsers, agent hooks and
reward functions that read tool calls.

``from vlmrl.api import tool, ToolResult`` and so on. Each name is the object
of the module it lives in (not a copy), loaded when first asked for, so a
tools file that imports ``tool`` does not pay for torch. Nothing else of vlmrl
is meant for user code; where a name lives inside vlmrl may change, this path
does not.

Tools (``worker.rollout.multi_turn.tools``):

- ``tool``: decorator that overrides a tool's name, description or JSON-schema parameters read from the function.
- ``ToolContext``: what a tool with a ``context`` parameter gets: the row, the images so far, the turn, a state dict.
- ``ToolResult``: what a tool may return: text, images, an optional turn reward, and ``done`` to end the trajectory.

Tool-call parsers (``worker.rollout.multi_turn.format=my_parser.py:parse``):

- ``ParsedTurn``: what a parser returns for a turn's text: the calls read and one error message per broken call.
- ``ToolCall``: one call read from the text: the tool's name and its arguments.
- ``parse_qwen``: the built-in parser of Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` form.

Reward functions:

- ``ToolStatus``: the values of ``status`` in a multi-turn reward input's ``tool_calls`` (ok, parse_error, ...).

Agents (``worker.rollout.agent``) and their hooks (``worker.rollout.agent_hooks``):

- ``AgentLLM``: the ``llm`` an agent gets: base_url, api_key and model of the rollout's OpenAI-compatible endpoint.
- ``AgentTask``: a rollout's task as a hook sees it (``RolloutRecord.task``): its id, the row's fields, its images.
- ``RolloutRecord``: what a hook gets: the rollout's task, status, reward, recorded calls, answer and error.
- ``AgentStatus``: how a rollout ended: ok, raised, timeout, died or no_call.
- ``Call``: one LLM call the endpoint recorded: prompt and response token ids, log-probs, policy version.

Workflows (``worker.rollout.workflow=path/to/file.py:Class``, guides/workflows):

- ``Workflow``: the base class of a workflow; its ``async def run(self, ctx, row)`` plays one sample of a row.
- ``Context``: what ``run`` gets: ``generate`` (token-in/token-out), ``episode``, ``add_generation``, ``add_user``,
  ``render``, the processor, the sampling settings, the sample's seed, the tools.
- ``Generation``: one sample ``ctx.generate`` returns: token ids, text, log-probs, versions, finish reason.
- ``Episode``: the trajectory ``run`` returns (``reward`` and ``turn_rewards`` to give rewards).
- ``Credit``: a workflow's ``credit``: per_row, or per_rollout when ``run`` returns several rows of one rollout.

Environments (``worker.rollout.multi_turn.env``) are plain classes with ``reset`` and ``step`` and need nothing
from here.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "tool": "vlmrl.rollout.tools",
    "ToolContext": "vlmrl.rollout.tools",
    "ToolResult": "vlmrl.rollout.tools",
    "ParsedTurn": "vlmrl.rollout.tool_parsers",
    "ToolCall": "vlmrl.rollout.tool_parsers",
    "parse_qwen": "vlmrl.rollout.tool_parsers",
    "ToolStatus": "vlmrl.rollout.tools",
    "AgentLLM": "vlmrl.rollout.agent_runner_child",
    "AgentTask": "vlmrl.rollout.agent_runner",
    "RolloutRecord": "vlmrl.rollout.agent_runner",
    "AgentStatus": "vlmrl.rollout.agent_runner",
    "Call": "vlmrl.rollout.traces",
    "Workflow": "vlmrl.rollout.workflow",
    "Context": "vlmrl.rollout.workflow",
    "Generation": "vlmrl.rollout.workflow",
    "Episode": "vlmrl.rollout.episode",
    "Credit": "vlmrl.rollout.kind",
}
"""Each public name and the module that defines it."""

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'vlmrl.api' has no attribute {name!r}; it holds {', '.join(__all__)}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
