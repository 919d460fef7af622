"""Multi-turn rollouts: the switch, the limits, and the user's tools, environment and parser, loaded now.

The tools file is imported here, in the driver, so that a broken file, a
tool whose signature cannot be read or two tools with one name are config
errors before Ray starts, not a crash in every worker.
"""

from __future__ import annotations

import inspect

from vlmrl.algos import AdvantageEstimator
from vlmrl.config import Config
from vlmrl.rollout.tool_parsers import load_parser
from vlmrl.rollout.tools import load_tools
from vlmrl.user_code import UserCodeError, load_object

P = "worker.rollout.multi_turn"


def multi_turn_problems(config: Config) -> list[str]:
    mt = config.worker.rollout.multi_turn
    problems: list[str] = []
    if not mt.enable:
        if mt.tools or mt.env:
            problems.append(f"{P}.tools or {P}.env is set but {P}.enable=false; set {P}.enable=true to use them")
        return problems
    if not mt.tools and not mt.env:
        problems.append(f"{P}.enable=true with no {P}.tools and no {P}.env; name tools (path/to/file.py:function) or an env")
    if mt.tools and mt.env:
        problems.append(f"{P}.tools and {P}.env are both set; a rollout talks to tools or to an environment, pick one")
    for key, value, low in (
        ("max_turns", mt.max_turns, 1),
        ("max_tool_response_length", mt.max_tool_response_length, 1),
        ("max_images", mt.max_images, 0),
        ("max_parallel_calls", mt.max_parallel_calls, 1),
    ):
        if not value >= low:
            problems.append(f"{P}.{key}={value}: must be at least {low}")
    if not mt.tool_timeout > 0:
        problems.append(f"{P}.tool_timeout={mt.tool_timeout}: must be a positive number of seconds")
    budget = config.data.max_response_length
    if mt.max_tokens_per_turn is not None and not 1 <= mt.max_tokens_per_turn <= budget:
        problems.append(
            f"{P}.max_tokens_per_turn={mt.max_tokens_per_turn}: must be between 1 and data.max_response_length={budget} "
            "(the whole trajectory's budget after the prompt), or null"
        )
    if config.algorithm.adv_estimator is AdvantageEstimator.remax:
        problems.append(
            f"algorithm.adv_estimator=remax with {P}.enable=true: ReMax's baseline is one greedy response, not a "
            "conversation; use grpo, rloo or reinforce_plus_plus"
        )
    if mt.tools:
        try:
            load_tools(mt.tools)
        except UserCodeError as e:
            problems.append(str(e))
    if mt.env:
        problems.extend(_env_problems(mt.env))
    try:
        load_parser(mt.format)
    except UserCodeError as e:
        problems.append(str(e))
    return problems


def _env_problems(spec: str) -> list[str]:
    try:
        env = load_object(spec, f"{P}.env")
    except UserCodeError as e:
        return [str(e)]
    if not inspect.isclass(env):
        return [f"{P}.env={spec}: not a class; name a class with reset(sample) and step(action)"]
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        return [f"{P}.env={spec}: the class has no {' or '.join(missing)} method; it needs reset(sample) and step(action)"]
    return []
