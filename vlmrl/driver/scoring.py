"""The driver's side of rewards: start the reward-manager actors, turn a batch
into reward inputs, ask an actor for scores, and put them back on the batch.

Scoring is split into ``launch`` and ``collect`` so the trainer can run the
log-prob passes while the user's function works. Training and validation each
have their own actors, so neither waits on the other's queue. A Ray actor runs
one call at a time, so training has a pool of them (``worker.reward.num_workers``):
asynchronous training launches a job per finished generation call, and those
jobs overlap one another only on different actors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import ray
import torch

from vlmrl.config import RewardConfig
from vlmrl.records import Batch
from vlmrl.reward.function import RewardFunctionError
from vlmrl.reward.manager import RewardResult, manager_class
from vlmrl.reward.model_reward import reward_spec
from vlmrl.reward.model_service import ModelLink
from vlmrl.driver.metrics import reduce_reward_metrics
from vlmrl.driver.rollout_scores import RolloutScoring


def place_scores(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """(B, R) with each sample's scalar reward on its last trained token and 0 elsewhere.

    The last trained token, not the last token: in a multi-turn trajectory the
    loss mask has gaps (tool output) and may end before the row does. A row
    with no trained token puts its reward on column 0.
    """
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32)
    width = response_mask.shape[1]
    from_end = response_mask.bool().flip(dims=[1]).int().argmax(dim=1)  # first 1 from the right
    last = torch.where(response_mask.bool().any(dim=1), width - 1 - from_end, 0)  # (B,)
    token_level[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return token_level


def add_turn_rewards(token_level: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``token_level`` (B, R) plus each multi-turn trajectory's turn rewards on the last token of their turns.

    GAE and REINFORCE++ then see each reward where it was earned; the group estimators, which sum a row's
    token-level rewards, score the trajectory as its outcome plus its turn rewards. A turn cut off by the
    response budget drops its reward with its tokens.
    """
    out = token_level.clone()
    width = out.shape[1]
    for row, t in enumerate(batch.trajectories):
        for end, reward in zip(t.turn_ends, t.turn_rewards):
            col = end - t.prompt_length
            if reward and 0 <= col < width:
                out[row, col] += reward
    return out


def reward_inputs(batch: Batch) -> list[dict]:
    """EasyR1's reward_input per sample (response, response_length, ground_truth) plus vlmrl's additions.

    The row's extra columns come first, so a column named like one of the keys
    here (``prompt``, say) does not replace it. The images are the PIL images the
    policy saw; the n samples of a prompt share one list, which pickling sends once.
    """
    extras = batch.extra_fields or [{}] * len(batch)
    images = batch.images or [[]] * len(batch)
    inputs = [
        {
            **extras[i],
            "response": batch.response_texts[i],
            "response_length": int(batch.response_mask[i].sum()),
            "ground_truth": batch.ground_truths[i],
            "prompt": batch.prompt_texts[i],
            "data_source": batch.data_sources[i],
            "images": images[i],
            "sample_id": i,
        }
        for i in range(len(batch))
    ]
    for x, t in zip(inputs, batch.trajectories):
        if t.rollout_id:  # an external agent's rollout, scored on its last row: the last call's answer
            x.update(rollout_id=t.rollout_id)
        if t.turn_ends:  # a multi-turn trajectory: the conversation too; "response" is its last model turn
            x.update(
                messages=t.messages,
                num_turns=t.num_turns,
                tool_calls=t.tool_calls,
                turn_rewards=list(t.turn_rewards),
                stop_reason=t.stop_reason,
            )
    return inputs


@dataclass
class Rewards:
    """What scoring a batch gives; the stage that owns the batch assigns it."""

    token_level_scores: torch.Tensor
    """(B, R) each sample's reward on its last trained token."""
    per_sample: dict[str, list[float]]
    """Per-sample scores by name ("overall" and the function's sub-scores), each of length B."""
    metrics: dict[str, float]
    baselines: torch.Tensor | None = None
    """(B,) ReMax: the reward of a greedy response to each sample's prompt."""

    def assign_to(self, batch: Batch) -> None:
        """Write these rewards into ``batch``'s reward fields (the one place that does)."""
        batch.token_level_scores, batch.reward_metrics = self.token_level_scores, self.per_sample
        if self.baselines is not None:
            batch.reward_baselines = self.baselines


@dataclass(frozen=True)
class ScoringJob:
    """A batch's rewards in the making: the reward manager's job, and for agent rollouts what it scores."""

    ref: ray.ObjectRef | None
    """None when no row needs the reward function (every agent returned its rollout's reward)."""
    rollouts: RolloutScoring | None = None
    """Set when rows come from agent rollouts: one score per rollout, spread over its rows."""


class Scorer:
    """A pool of reward-manager actors loaded with one function, seen from the driver as one.

    ``launch`` sends each job to an actor with no job in flight, else to the one
    with the fewest (the first of those). One actor scores jobs in the order
    they are launched; several score them at once. Every actor loads the same
    function with the same kwargs, so for a function deterministic per input a
    row's scores do not depend on the actor that gave them.
    """

    def __init__(self, reward_managers: list[ray.actor.ActorHandle], spec: str):
        # No actors and no spec: an external agent gives every reward (worker.reward.reward_function unset).
        assert bool(reward_managers) == bool(spec), "a Scorer has reward-manager actors exactly when it has a function"
        self.reward_managers, self.spec = list(reward_managers), spec
        self._in_flight: list[list[ray.ObjectRef]] = [[] for _ in self.reward_managers]
        """Per actor, the jobs launched on it not yet seen finished; pruned when an actor is chosen or asked for."""
        self._lock = threading.Lock()
        """Guards ``_in_flight``: the asynchronous sampler's watcher thread launches beside the step."""

    @property
    def reward_manager(self) -> ray.actor.ActorHandle:
        """The first actor (the only one unless worker.reward.num_workers asks for more)."""
        return self.reward_managers[0]

    def start(self) -> list[ray.ObjectRef]:
        """Each actor's start: its reward processes load the function."""
        return [m.start.remote() for m in self.reward_managers]

    def idle(self) -> bool:
        """Whether some actor has no job in flight, so that a job launched now starts at once."""
        with self._lock:
            return not self.reward_managers or min(self._loads()) == 0

    def launch(self, batch: Batch) -> ScoringJob:
        inputs = reward_inputs(batch)
        if not any(t.rollout_id for t in batch.trajectories):
            return ScoringJob(self._compute(inputs))
        # Agent rollouts: the function scores each rollout's last row, unless its agent returned the reward.
        rollouts = RolloutScoring.of(batch.trajectories)
        rows = rollouts.rows_to_score
        if rows and not self.spec:
            unscored = [batch.trajectories[i].rollout for i in rows]
            raise RewardFunctionError(
                f"rollout {unscored[0]}: its agent returned no reward (None), and worker.reward.reward_function is "
                f"not set to score it ({len(unscored)} such rollout(s) in this batch); return a number from the "
                "agent for every rollout, or set worker.reward.reward_function to score the rollouts it leaves"
            )
        return ScoringJob(self._compute([inputs[i] for i in rows]) if rows else None, rollouts)

    def _compute(self, inputs: list[dict]) -> ray.ObjectRef:
        """One job on the least loaded actor."""
        with self._lock:
            loads = self._loads()
            i = loads.index(min(loads))
            ref = self.reward_managers[i].compute.remote(inputs)
            self._in_flight[i].append(ref)
        return ref

    def _loads(self) -> list[int]:
        """Jobs in flight per actor, after dropping those that have finished (the lock held)."""
        refs = [r for jobs in self._in_flight for r in jobs]
        if refs:
            # fetch_local=False: only whether they finished; the results are fetched by ``collect``.
            finished, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            if finished:
                gone = set(finished)
                self._in_flight = [[r for r in jobs if r not in gone] for jobs in self._in_flight]
        return [len(jobs) for jobs in self._in_flight]

    def collect(self, job: ScoringJob, batch: Batch, prefix: str = "reward") -> Rewards:
        """The batch's token-level scores and per-sample sub-scores, with their means and the timeouts.

        Nothing is written to ``batch``: the caller assigns the result (``Rewards.assign_to``).
        """
        result: RewardResult = self.get(job.ref) if job.ref is not None else RewardResult([], {}, [], {})
        per_sample = {"overall": result.overall, **result.sub_scores}
        means = per_sample
        if job.rollouts is not None:  # means over rollouts; every row gets its rollout's scores
            means = job.rollouts.per_rollout(per_sample)
            per_sample = job.rollouts.per_row(means)
        metrics = {**reduce_reward_metrics(means, prefix=prefix), f"{prefix}/timeouts": len(result.timeouts)}
        # The reward model's counters: reward_model/* for training, val/reward_model/* for validation.
        model_prefix = "reward_model" if prefix == "reward" else f"{prefix}/reward_model"
        metrics.update({model_prefix + k[len("reward_model") :]: v for k, v in result.metrics.items()})
        token_level = place_scores(per_sample["overall"], batch.response_mask)
        if any(t.turn_rewards for t in batch.trajectories):
            token_level = add_turn_rewards(token_level, batch)
        return Rewards(token_level, per_sample, metrics)

    def get(self, ref: ray.ObjectRef, timeout: float | None = None):
        """``ray.get`` with the manager's failures as RewardFunctionErrors that say what happened."""
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayActorError as e:
            raise RewardFunctionError(
                f"the reward manager actor running {self.spec} died (a crash or os._exit in the actor, "
                f"its process killed, or out of memory); Ray says: {e}"
            ) from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, RewardFunctionError):
                raise e.cause from None
            raise


@dataclass
class Scorers:
    train: Scorer
    val: Scorer | None


def start_scorers(
    reward: RewardConfig,
    validation: bool,
    reward_model: ModelLink | None = None,
    timeout: float | None = None,
    train_workers: int | None = None,
) -> Scorers:
    """``train_workers`` reward-manager actors for training and, with ``validation``, one for validation, all
    loaded.

    ``train_workers`` is ``Plan.reward_workers``; None takes ``reward.num_workers``, else 1 (the
    RewardConfig alone does not say whether training is asynchronous). Waits until their reward processes
    have loaded the function, so that kwargs that do not fit it fail now rather than at the first step.
    ``reward_model`` is how they all reach a judge or score model, when one is configured. ``timeout``
    (trainer.start_timeout_s) bounds the wait: an actor the cluster cannot place would otherwise wait forever.
    """
    if train_workers is None:
        train_workers = reward.num_workers or 1
    spec = reward_spec(reward.reward_function, reward.reward_model.model_path)
    if not spec:  # every reward comes from the agent (validation allows this only with worker.rollout.agent)
        return Scorers(train=Scorer([], spec), val=Scorer([], spec) if validation else None)
    cls = ray.remote(manager_class(spec, reward.reward_type))

    def actor() -> ray.actor.ActorHandle:
        return cls.options(num_cpus=reward.num_cpus).remote(
            spec,
            reward.reward_function_kwargs,
            num_cpus=reward.num_cpus,
            timeout=reward.timeout,
            on_timeout=reward.on_timeout,
            memory_limit_mb=reward.memory_limit_mb,
            reward_model=reward_model,
            env=dict(reward.env),
        )

    train = Scorer([actor() for _ in range(train_workers)], spec)
    scorers = Scorers(train=train, val=Scorer([actor()], spec) if validation else None)
    started = [(s, ref) for s in (scorers.train, scorers.val) if s is not None for ref in s.start()]
    for s, ref in started:
        try:
            s.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources().get("CPU", 0)
            actors = f"{train_workers} for training (worker.reward.num_workers)"
            actors += " and 1 for validation" if validation else ""
            raise RewardFunctionError(
                f"the reward actors for {spec} did not start within trainer.start_timeout_s={timeout:g} s: each asks "
                f"for worker.reward.num_cpus={reward.num_cpus} CPU(s) and the cluster has {free:g} free; there are "
                f"{actors}; lower worker.reward.num_cpus or worker.reward.num_workers, or give the cluster more CPUs"
            ) from None
    return scorers
