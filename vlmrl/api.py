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

- ``AgentLLM``: the ``llm`` an agent gets: base_url, api_key and model of the rollout's OpenAI-compatible endpoint,
  and ``emit_reward`` to report a reward for one of its calls before the rollout ends.
- ``AgentTask``: a rollout's task as a hook sees it (``RolloutRecord.task``): its id, the row's fields, its images.
- ``RolloutRecord``: what a hook gets: the rollout's task, status, reward, recorded calls, answer and error.
- ``AgentStatus``: how a rollout ended: ok, raised, timeout, died or no_call.
- ``Call``: one LLM call the endpoint recorded: prompt and response token ids, log-probs, policy version.

Training from Python (guides/python-api):

- ``train``: one training run in this process from a config (a YAML path or a mapping), overrides, and optionally
  the data as a ``datasets.Dataset`` or a list of rows and the reward function or workflow class as objects.
- ``TrainResult``: what ``train`` returns: the experiment and checkpoint directories, the last step and its metrics.

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
    "tool": "vlmrl.rollout.turns.tools",
    "ToolContext": "vlmrl.rollout.turns.tools",
    "ToolResult": "vlmrl.rollout.turns.tools",
    "ParsedTurn": "vlmrl.rollout.turns.tool_parsers",
    "ToolCall": "vlmrl.rollout.turns.tool_parsers",
    "parse_qwen": "vlmrl.rollout.turns.tool_parsers",
    "ToolStatus": "vlmrl.rollout.turns.tools",
    "AgentLLM": "vlmrl.rollout.agents.child",
    "AgentTask": "vlmrl.rollout.agents.runner",
    "RolloutRecord": "vlmrl.rollout.agents.runner",
    "AgentStatus": "vlmrl.rollout.agents.runner",
    "Call": "vlmrl.rollout.agents.traces",
    "train": "vlmrl.launch",
    "TrainResult": "vlmrl.launch",
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
