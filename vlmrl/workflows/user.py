"""A user's workflow class (``worker.rollout.workflow=path/to/file.py:Class``) as a rollout kind."""

from __future__ import annotations

from typing import Any

from vlmrl.config import BadSamplePolicy, Config
from vlmrl.rollout.turns.tools import ToolRunner, load_tools
from vlmrl.rollout.workflow import OnError, WorkflowRollouts
from vlmrl.workflows.rendering import conversation_renderer, family_positions


def build_user_workflow(config: Config, engine, processor, pad_ids: tuple[int, ...], workflow: Any) -> WorkflowRollouts:
    rollout = config.worker.rollout
    multi_turn = rollout.multi_turn
    tools = load_tools(multi_turn.tools) if multi_turn.tools else []
    return WorkflowRollouts(
        workflow,
        rollout.workflow,
        engine,
        conversation_renderer(config, processor, [t.schema() for t in tools]),
        positions=family_positions(config.worker.actor.model.model_path),
        pad_ids=pad_ids,
        max_response_length=config.data.max_response_length,
        timeout=rollout.workflow_timeout,
        on_error=OnError.skip if config.data.on_bad_sample is BadSamplePolicy.skip else OnError.error,
        tools=ToolRunner(tools, multi_turn.tool_timeout, processes=multi_turn.tool_processes) if tools else None,
    )
