"""``worker.rollout.workflow``: a built-in name or a workflow class that loads, and the settings it cannot run
with, refused before anything starts."""

from __future__ import annotations

import inspect

from vlmrl.algos import MULTI_ROW_UNSUPPORTED
from vlmrl.config import Config
from vlmrl.plan import kl_in_reward
from vlmrl.user_code import UserCodeError
from vlmrl.workflows import BUILTINS, KEY, is_builtin, load_workflow_class

ALIASES = {"multi_turn": "worker.rollout.multi_turn.enable=true", "openai_agent": "worker.rollout.agent=..."}


def workflow_problems(config: Config) -> list[str]:
    rollout = config.worker.rollout
    chosen = rollout.workflow
    names = ", ".join(BUILTINS)
    problems: list[str] = []
    if not is_builtin(chosen) and ":" not in chosen:
        return [f"{KEY}={chosen!r}: not a built-in ({names}) nor a class, path/to/file.py:Class"]
    # The older switches choose their kind; a workflow that says otherwise is a contradiction, not a preference.
    switched = "openai_agent" if rollout.agent else "multi_turn" if rollout.multi_turn.enable else None
    if switched and chosen not in ("single_turn", switched):
        problems.append(
            f"{KEY}={chosen} with {ALIASES[switched]}, which chooses {switched}: drop one of them"
        )
    if chosen == "openai_agent" and not rollout.agent:
        problems.append(f"{KEY}=openai_agent needs the agent: set worker.rollout.agent=path/to/file.py:solve")
    if is_builtin(chosen):
        if rollout.workflow_kwargs:
            problems.append(
                f"worker.rollout.workflow_kwargs is set but {KEY}={chosen} is a built-in, which takes none; "
                "drop workflow_kwargs"
            )
        return problems
    try:
        cls = load_workflow_class(chosen)
    except (UserCodeError, ValueError) as e:
        return [*problems, str(e)]
    try:
        inspect.signature(cls).bind(**rollout.workflow_kwargs)
    except TypeError as e:
        problems.append(f"worker.rollout.workflow_kwargs do not fit {chosen}'s constructor: {e}")
    timeout = rollout.workflow_timeout
    if timeout is not None and not timeout > 0:
        problems.append(f"worker.rollout.workflow_timeout={timeout}: must be a positive number of seconds, or null")
    # A workflow's samples may be dropped or make several rows: what the agent's rollouts cannot run with.
    algo, est = config.algorithm, config.algorithm.adv_estimator
    if est in MULTI_ROW_UNSUPPORTED:
        problems.append(
            f"algorithm.adv_estimator={est.value} with {KEY}={chosen}: {MULTI_ROW_UNSUPPORTED[est]}; use grpo, rloo, "
            "grpo_passk or reinforce_plus_plus_baseline"
        )
    if algo.online_filtering:
        problems.append(
            f"algorithm.online_filtering=true with {KEY}={chosen}: a workflow's samples may be dropped, which online "
            "filtering's batch filling does not handle yet; set algorithm.online_filtering=false"
        )
    if kl_in_reward(config):
        problems.append(
            f"the KL is in the reward (algorithm.use_kl_loss=false) with {KEY}={chosen}: a workflow's rows get their "
            "advantage before the log-prob passes, so that rows can be trimmed to whole mini-batches first; set "
            "algorithm.use_kl_loss=true, or algorithm.disable_kl=true"
        )
    a = rollout.async_rl
    if rollout.tensor_parallel_size > 1 and not (a.enable and a.placement == "disaggregated"):
        problems.append(
            f"worker.rollout.tensor_parallel_size={rollout.tensor_parallel_size} with {KEY}={chosen}: the trainer "
            "workers of a tensor-parallel engine must send it the same requests, which a workflow's code does not "
            "promise; set worker.rollout.tensor_parallel_size=1, or run it on rollout servers "
            "(worker.rollout.async_rl.enable=true, placement=disaggregated), whose engines may be tensor-parallel"
        )
    return problems
