"""Reward managers: run a user's reward function over a step's responses.

A manager gets plain dicts (EasyR1's ``reward_input``: response,
response_length, ground_truth, plus prompt, data_source and sample_id) and
returns one ``overall`` score per sample and the sub-scores by name. The
trainer runs a manager as a Ray actor so user code cannot stall the driver's
process or share its memory.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from vlmrl.config import RewardManagerType
from vlmrl.reward.function import RewardFunctionError, load_reward_function

RewardResult = tuple[list[float], dict[str, list[float]]]


def _check_score(score: Any, spec: str, sample: dict) -> dict[str, float]:
    where = f"reward function {spec} on sample {sample.get('sample_id')}"
    if not isinstance(score, dict) or "overall" not in score:
        raise RewardFunctionError(f"{where} returned {score!r}; it must return a dict with an 'overall' key")
    out = {}
    for key, value in score.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError) as e:
            raise RewardFunctionError(f"{where}: score {key!r}={value!r} is not a number") from e
        if not math.isfinite(out[key]):
            raise RewardFunctionError(f"{where}: score {key!r}={value!r} is not finite")
    return out


def _collect(scores: list[dict[str, float]]) -> RewardResult:
    keys = sorted({k for s in scores for k in s if k != "overall"})
    # A sub-score a function leaves out for some samples is recorded as 0 there, so every list has length B.
    return [s["overall"] for s in scores], {k: [s.get(k, 0.0) for s in scores] for k in keys}


def check_kwargs(fn, spec: str, kwargs: dict[str, Any]) -> None:
    """Fail at start-up, not at the first step, when the kwargs do not fit the function."""
    try:
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as e:
        raise RewardFunctionError(
            f"worker.reward.reward_function_kwargs={kwargs} do not fit {spec}{inspect.signature(fn)}: {e}"
        ) from e


class FunctionRewardManager:
    reward_type: RewardManagerType

    def __init__(self, spec: str, kwargs: dict[str, Any]):
        self.spec = spec
        self.kwargs = dict(kwargs)
        self.fn, _ = load_reward_function(spec)
        check_kwargs(self.fn, spec, self.kwargs)

    def compute(self, inputs: list[dict]) -> RewardResult:
        raise NotImplementedError


class SequentialFunctionRewardManager(FunctionRewardManager):
    """Calls ``fn(reward_input, **kwargs) -> dict`` once per sample."""

    reward_type = RewardManagerType.sequential

    def compute(self, inputs: list[dict]) -> RewardResult:
        return _collect([_check_score(self.fn(x, **self.kwargs), self.spec, x) for x in inputs])


class BatchFunctionRewardManager(FunctionRewardManager):
    """Calls ``fn(reward_inputs, **kwargs) -> list[dict]`` once per step."""

    reward_type = RewardManagerType.batch

    def compute(self, inputs: list[dict]) -> RewardResult:
        scores = self.fn(inputs, **self.kwargs)
        if not isinstance(scores, list) or len(scores) != len(inputs):
            raise RewardFunctionError(
                f"batch reward function {self.spec} returned {type(scores).__name__} of length "
                f"{len(scores) if hasattr(scores, '__len__') else '?'} for {len(inputs)} inputs; "
                "it must return one dict per input"
            )
        return _collect([_check_score(s, self.spec, x) for s, x in zip(scores, inputs)])


REWARD_MANAGERS: dict[RewardManagerType, type[FunctionRewardManager]] = {
    RewardManagerType.sequential: SequentialFunctionRewardManager,
    RewardManagerType.batch: BatchFunctionRewardManager,
}


def manager_class(spec: str, configured: RewardManagerType | None) -> type[FunctionRewardManager]:
    """The manager for ``spec``: the config's choice, else the function's REWARD_TYPE, else sequential."""
    _, declared = load_reward_function(spec)
    return REWARD_MANAGERS[configured or declared or RewardManagerType.sequential]
