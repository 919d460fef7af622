"""Agent rollouts: the built-in multi-turn loop (tools, environment, parser) and an external agent
(``worker.rollout.agent``, its options and hooks), the user's code loaded now.

The user's files are imported here, in the driver, so that a broken file, a
tool or agent whose signature cannot be read or two tools with one name are
config errors before Ray starts, not a crash in every worker.
"""

from __future__ import annotations

import inspect

from vlmrl.algos import MULTI_ROW_UNSUPPORTED, AdvantageEstimator
from vlmrl.config import Config
from vlmrl.plan import kl_in_reward
from vlmrl.rollout.agents.runner import HOOK_KEY, load_agent, load_hooks
from vlmrl.rollout.turns.tool_parsers import load_parser
from vlmrl.rollout.turns.tools import load_tools
from vlmrl.user_code import UserCodeError, load_object
from vlmrl.workflows import is_builtin, workflow_name

P = "worker.rollout.multi_turn"


def multi_turn_problems(config: Config) -> list[str]:
    mt = config.worker.rollout.multi_turn
    problems: list[str] = []
    kind = workflow_name(config.worker.rollout)
    if kind != "multi_turn":
        if mt.env or (mt.tools and is_builtin(kind)):  # a workflow class may call tools; only the loop an env
            problems.append(
                f"{P}.tools or {P}.env is set but {P}.enable=false (the rollout is {kind}); set {P}.enable=true "
                "(or worker.rollout.workflow=multi_turn) to use them"
            )
        return problems
    if not mt.tools and not mt.env:
        problems.append(
            f"worker.rollout.workflow=multi_turn ({P}.enable=true) with no {P}.tools and no {P}.env; name tools "
            "(path/to/file.py:function) or an env"
        )
    if mt.tools and mt.env:
        problems.append(f"{P}.tools and {P}.env are both set; a rollout talks to tools or to an environment, pick one")
    for key, value, low in (
        ("max_turns", mt.max_turns, 1),
        ("max_tool_response_length", mt.max_tool_response_length, 1),
        ("max_images", mt.max_images, 0),
        ("max_parallel_calls", mt.max_parallel_calls, 1),
        ("tool_processes", mt.tool_processes, 0),
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
            f"algorithm.adv_estimator=remax with multi-turn rollouts: ReMax's baseline is one greedy response, not a "
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


A = "worker.rollout.agent"


def external_agent_problems(config: Config) -> list[str]:
    """``worker.rollout.agent``: the agent and its hooks load, and the settings it cannot work with are refused."""
    rollout, algo = config.worker.rollout, config.algorithm
    hooks = {k: v for k, v in vars(rollout.agent_hooks).items() if v}
    if not rollout.agent:
        if hooks:
            return [f"{HOOK_KEY} is set ({', '.join(hooks)}) but {A} is not; name the agent, path/to/file.py:solve"]
        return []
    problems: list[str] = []
    if rollout.multi_turn.enable:
        problems.append(
            f"{A} and {P}.enable=true are both set: a rollout is either the built-in tool loop or an external "
            f"agent's calls; set {P}.enable=false or drop {A}"
        )
    est = algo.adv_estimator
    if est in MULTI_ROW_UNSUPPORTED:
        problems.append(
            f"algorithm.adv_estimator={est.value} with {A}: {MULTI_ROW_UNSUPPORTED[est]}; use grpo, rloo, "
            "grpo_passk or reinforce_plus_plus_baseline"
        )
    if algo.online_filtering:
        problems.append(
            f"algorithm.online_filtering=true with {A}: an agent's rollouts make a varying number of rows, which "
            "online filtering's batch filling does not handle yet; set algorithm.online_filtering=false"
        )
    if kl_in_reward(config):
        problems.append(
            f"the KL is in the reward (algorithm.use_kl_loss=false) with {A}: agent rows get their advantage before "
            "the log-prob passes, so that rows can be trimmed to whole mini-batches first; set "
            "algorithm.use_kl_loss=true, or algorithm.disable_kl=true"
        )
    a = rollout.async_rl
    if rollout.tensor_parallel_size > 1 and not (a.enable and a.placement == "disaggregated"):
        problems.append(
            f"worker.rollout.tensor_parallel_size={rollout.tensor_parallel_size} with {A}: each trainer worker "
            "serves its own agents from its own engine, and a tensor-parallel engine's workers must be given the "
            "same requests; set worker.rollout.tensor_parallel_size=1, or serve the agents from rollout servers "
            "(worker.rollout.async_rl.enable=true, placement=disaggregated), whose engines may be tensor-parallel"
        )
    opts, key = rollout.agent_options, "worker.rollout.agent_options"
    if opts.max_concurrency < 1:
        problems.append(f"{key}.max_concurrency={opts.max_concurrency}: must be at least 1")
    if not opts.timeout > 0:
        problems.append(f"{key}.timeout={opts.timeout}: must be a positive number of seconds")
    if not 0 <= opts.port <= 65535:
        problems.append(f"{key}.port={opts.port}: must be 0 (a free port) or a port number up to 65535")
    budget = config.data.max_response_length
    if opts.max_tokens_per_call is not None and not 1 <= opts.max_tokens_per_call <= budget:
        problems.append(
            f"{key}.max_tokens_per_call={opts.max_tokens_per_call}: must be between 1 and "
            f"data.max_response_length={budget}, or null"
        )
    for name in ("max_images_per_call", "max_image_pixels", "max_call_pixels"):
        if getattr(opts, name) < 1:
            problems.append(f"{key}.{name}={getattr(opts, name)}: must be at least 1 (a call needs a finite budget)")
    if 1 <= opts.max_call_pixels < opts.max_image_pixels:
        problems.append(
            f"{key}.max_call_pixels={opts.max_call_pixels} is below {key}.max_image_pixels={opts.max_image_pixels}: "
            "one image could be larger than a whole call may be; raise max_call_pixels or lower max_image_pixels"
        )
    if opts.max_connections < opts.max_concurrency:
        problems.append(
            f"{key}.max_connections={opts.max_connections} is below {key}.max_concurrency={opts.max_concurrency}: "
            "each agent running needs a connection; raise max_connections"
        )
    for name in ("header_timeout", "body_timeout"):
        if not getattr(opts, name) > 0:
            problems.append(f"{key}.{name}={getattr(opts, name)}: must be a positive number of seconds")
    try:
        load_agent(rollout.agent)
    except UserCodeError as e:
        problems.append(str(e))
    try:
        load_hooks(hooks)
    except UserCodeError as e:
        problems.append(str(e))
    return problems
