"""``multi_turn``: conversations with tools or an environment (``worker.rollout.multi_turn.*``).

The turns of a call's trajectories run in lock-step on the engine
(``vlmrl.rollout.turns.loop``); the tools or the environment run in this
process, next to it.
"""

from __future__ import annotations

from vlmrl.config import Config
from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.engine import Engine, Sampling
from vlmrl.rollout.kind import RolloutKind, RolloutStats
from vlmrl.rollout.turns.loop import AgentLoop, Limits
from vlmrl.rollout.turns.tool_parsers import load_parser
from vlmrl.rollout.turns.tools import ToolRunner, load_tools
from vlmrl.user_code import load_object
from vlmrl.workflows.rendering import conversation_renderer, family_positions


class MultiTurn(RolloutKind):
    name = "multi_turn"

    def __init__(self, loop: AgentLoop):
        self.loop = loop

    @classmethod
    def build(cls, config: Config, plan, engine: Engine, processor, pad_ids: tuple[int, ...]) -> MultiTurn:
        return cls(build_agent_loop(config, engine, processor, pad_ids))

    def rollout(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], RolloutStats]:
        trajectories, seconds = self.loop.run(prompts, group_ids, sampling)
        return trajectories, RolloutStats(seconds=seconds)

    def close(self) -> None:
        if self.loop.runner is not None:
            self.loop.runner.close()


def build_agent_loop(config: Config, engine, processor, pad_ids: tuple[int, ...]) -> AgentLoop:
    """The multi-turn loop over ``engine`` with the config's tools or environment, loaded in this process.
    ``pad_ids``: the image and the video pad token (-1 for one the tokenizer lacks)."""
    multi_turn, data = config.worker.rollout.multi_turn, config.data
    tools = load_tools(multi_turn.tools) if multi_turn.tools else []
    limits = Limits(
        max_turns=multi_turn.max_turns,
        max_response_length=data.max_response_length,
        max_tokens_per_turn=multi_turn.max_tokens_per_turn,
        max_tool_response_length=multi_turn.max_tool_response_length,
        max_images=multi_turn.max_images,
        tool_timeout=multi_turn.tool_timeout,
        max_parallel_calls=multi_turn.max_parallel_calls,
    )
    return AgentLoop(
        engine,
        conversation_renderer(config, processor, [t.schema() for t in tools]),
        limits,
        positions=family_positions(config.worker.actor.model.model_path),
        pad_ids=pad_ids,
        runner=ToolRunner(tools, multi_turn.tool_timeout, processes=multi_turn.tool_processes) if tools else None,
        parser=load_parser(multi_turn.format),
        env_class=load_object(multi_turn.env, "worker.rollout.multi_turn.env") if multi_turn.env else None,
    )
