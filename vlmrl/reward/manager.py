"""Reward managers: run a user's reward function over a step's responses.

A manager gets plain dicts (EasyR1's ``reward_input``: response,
response_length, ground_truth; plus vlmrl's prompt, data_source, images,
sample_id and the row's extra fields) and returns one ``overall`` score per
sample and the sub-scores by name. The trainer runs each manager as a Ray actor
(one for training, one for validation), and the manager runs the user's code
in its own processes (``vlmrl.reward.sandbox``), so that a call can be timed
out and a crash in user code fails the step with the sample named rather than
taking the run down with it or hanging it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from vlmrl.config.options import RewardManagerType, TimeoutPolicy
from vlmrl.reward.function import RewardFunctionError, RewardTimeout, load_reward_function
from vlmrl.reward.model_service import ModelLink, ModelService
from vlmrl.reward.sandbox import Outcome, Sandbox, Status

log = logging.getLogger(__name__)

CHUNKS_PER_PROCESS = 4
"""A sequential step is cut into about this many contiguous chunks per process: enough to
balance uneven calls, few enough that a prompt's n samples (and their shared images) mostly
travel together."""


@dataclass
class RewardResult:
    overall: list[float]
    """The scalar reward per sample."""
    sub_scores: dict[str, list[float]] = field(default_factory=dict)
    """Every other key the function returned, per sample (0 where a sample lacks it)."""
    timeouts: list[int] = field(default_factory=list)
    """Positions of the samples scored 0 because their call ran past the timeout."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The reward model's counters for this batch (``reward_model/*``), when one is configured."""


def _where(inputs: list[dict], i: int) -> str:
    x = inputs[i]
    return f"sample {x.get('sample_id', i)} (data source {x.get('data_source', 'unknown')!r})"


def check_score(score: Any, spec: str, where: str) -> dict[str, float]:
    """``score`` as a dict of finite floats with an ``overall`` key, or a RewardFunctionError saying what is wrong."""
    where = f"reward function {spec} on {where}"
    if not isinstance(score, dict) or "overall" not in score:
        raise RewardFunctionError(f"{where} returned {score!r}; it must return a dict with an 'overall' key")
    out = {}
    for key, value in score.items():
        if not isinstance(key, str):
            raise RewardFunctionError(f"{where}: score key {key!r} is not a string")
        try:
            out[key] = float(value)
        except (TypeError, ValueError) as e:
            raise RewardFunctionError(f"{where}: score {key!r}={value!r} is not a number") from e
        if not math.isfinite(out[key]):
            raise RewardFunctionError(f"{where}: score {key!r}={value!r} is not finite")
    return out


def _collect(scores: list[dict[str, float] | None], timeouts: list[int]) -> RewardResult:
    keys = sorted({k for s in scores if s for k in s if k != "overall"})
    scores = [s or {} for s in scores]  # a timed-out sample scores 0 everywhere
    # A sub-score a function leaves out for some samples is recorded as 0 there, so every list has length B.
    return RewardResult(
        overall=[s.get("overall", 0.0) for s in scores],
        sub_scores={k: [s.get(k, 0.0) for s in scores] for k in keys},
        timeouts=timeouts,
    )


class FunctionRewardManager:
    """Runs ``spec`` in reward processes; ``start`` loads it there, ``compute`` scores a step.

    ``timeout`` (seconds, None for no limit) bounds one call: one response for a
    sequential function, the whole batch for a batch function. ``on_timeout``
    says whether such a call fails the step or scores 0. ``env``: worker.reward.env, the variables the
    reward processes get on top of the allowlisted ones (``vlmrl.user_process.ENV_ALLOWLIST``).
    """

    reward_type: RewardManagerType
    parallel: bool
    """Whether calls are spread over num_cpus processes (else one process serves them)."""

    def __init__(
        self,
        spec: str,
        kwargs: dict[str, Any] | None = None,
        *,
        num_cpus: int = 1,
        timeout: float | None = None,
        on_timeout: TimeoutPolicy = TimeoutPolicy.error,
        memory_limit_mb: int | None = None,
        reward_model: ModelLink | None = None,
        env: dict[str, str] | None = None,
    ):
        self.spec = spec
        self.timeout = timeout
        self.on_timeout = TimeoutPolicy(on_timeout)
        processes = max(1, num_cpus) if self.parallel else 1
        self.model_service = ModelService(reward_model) if reward_model is not None else None
        self.sandbox = Sandbox(
            spec, kwargs or {}, processes=processes, timeout=timeout, memory_limit_mb=memory_limit_mb,
            reward_model_kind=reward_model.kind if reward_model is not None else None,
            service=self.model_service, env=env,
        )  # fmt: skip

    def start(self) -> None:
        """Load the function in every reward process; a load error or kwargs that do not fit raise here."""
        self.sandbox.start()

    def close(self) -> None:
        """Stop the reward processes (a later call starts them again)."""
        self.sandbox.close()

    def compute(self, inputs: list[dict]) -> RewardResult:
        """Score ``inputs``; the reward model's counters of this batch come with the result."""
        result = self._compute(inputs)
        if self.model_service is not None:
            result.metrics = self.model_service.take_metrics()
        return result

    def _compute(self, inputs: list[dict]) -> RewardResult:
        raise NotImplementedError

    def _failure(self, outcome: Outcome, where: str) -> RewardFunctionError:
        if outcome.status is Status.timed_out:
            return RewardTimeout(
                f"reward function {self.spec} ran past worker.reward.timeout={self.timeout}s on {where}; "
                "raise worker.reward.timeout, or set worker.reward.on_timeout=zero to score such calls 0"
            )
        if outcome.status is Status.died:
            return RewardFunctionError(
                f"reward function {self.spec} crashed on {where}: {outcome.value} "
                "(for example os._exit or a fault in a C extension)"
            )
        return RewardFunctionError(f"reward function {self.spec} raised on {where}: {outcome.value}")

    def _fatal(self, outcome: Outcome) -> bool:
        if outcome.status is Status.timed_out:
            return self.on_timeout is TimeoutPolicy.error
        return outcome.status is not Status.ok

    def _report_timeouts(self, inputs: list[dict], timeouts: list[int]) -> None:
        if timeouts:
            # A warning: it reaches the console from the reward actor's process (vlmrl.driver.console).
            log.warning(
                "reward: %d sample(s) of %d scored 0: %s ran past worker.reward.timeout=%ss (first: %s)",
                len(timeouts), len(inputs), self.spec, self.timeout, _where(inputs, timeouts[0]),
            )  # fmt: skip


class SequentialFunctionRewardManager(FunctionRewardManager):
    """Calls ``fn(reward_input, **kwargs) -> dict`` once per sample, in num_cpus processes in parallel."""

    reward_type = RewardManagerType.sequential
    parallel = True

    def _compute(self, inputs: list[dict]) -> RewardResult:
        chunk = max(1, math.ceil(len(inputs) / (self.sandbox.processes * CHUNKS_PER_PROCESS)))
        outcomes = self.sandbox.run(inputs, chunk, stop=self._fatal)
        # The first failure in sample order (a stopped run may have left later samples unscored).
        for i, outcome in enumerate(outcomes):
            if outcome is not None and self._fatal(outcome):
                raise self._failure(outcome, _where(inputs, i))
        timeouts = [i for i, o in enumerate(outcomes) if o.status is Status.timed_out]
        self._report_timeouts(inputs, timeouts)
        scores = [None if o.status is Status.timed_out else check_score(o.value, self.spec, _where(inputs, i))
                  for i, o in enumerate(outcomes)]  # fmt: skip
        return _collect(scores, timeouts)


class BatchFunctionRewardManager(FunctionRewardManager):
    """Calls ``fn(reward_inputs, **kwargs) -> list[dict]`` once per step, in one process."""

    reward_type = RewardManagerType.batch
    parallel = False  # one call per step; the function may use its num_cpus itself

    def _compute(self, inputs: list[dict]) -> RewardResult:
        (outcome,) = self.sandbox.run([inputs], 1, stop=self._fatal)
        sources = sorted({str(x.get("data_source", "unknown")) for x in inputs})
        where = f"a batch of {len(inputs)} samples (data sources: {', '.join(sources)})"
        if self._fatal(outcome):
            raise self._failure(outcome, where)
        if outcome.status is Status.timed_out:
            timeouts = list(range(len(inputs)))
            self._report_timeouts(inputs, timeouts)
            return _collect([None] * len(inputs), timeouts)
        scores = outcome.value
        if not isinstance(scores, list) or len(scores) != len(inputs):
            raise RewardFunctionError(
                f"batch reward function {self.spec} returned {type(scores).__name__} of length "
                f"{len(scores) if hasattr(scores, '__len__') else '?'} for {len(inputs)} inputs; "
                "it must return a list with one dict per input"
            )
        return _collect([check_score(s, self.spec, _where(inputs, i)) for i, s in enumerate(scores)], [])


REWARD_MANAGERS: dict[RewardManagerType, type[FunctionRewardManager]] = {
    RewardManagerType.sequential: SequentialFunctionRewardManager,
    RewardManagerType.batch: BatchFunctionRewardManager,
}


def manager_class(spec: str, configured: RewardManagerType | None) -> type[FunctionRewardManager]:
    """The manager for ``spec``: the config's choice, else the function's REWARD_TYPE, else sequential."""
    _, declared = load_reward_function(spec)
    return REWARD_MANAGERS[configured or declared or RewardManagerType.sequential]
