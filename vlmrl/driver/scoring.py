"""The driver's side of rewards: start the reward-manager actors, turn a batch
into reward inputs, ask an actor for scores, and put them back on the batch.

Scoring is split into ``launch`` and ``collect`` so the trainer can run the
log-prob passes while the user's function works. Training and validation each
have their own actor, so neither waits on the other's queue.
"""

from __future__ import annotations

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
    """One reward-manager actor, seen from the driver."""

    def __init__(self, reward_manager: ray.actor.ActorHandle, spec: str):
        self.reward_manager, self.spec = reward_manager, spec

    def start(self) -> ray.ObjectRef:
        return self.reward_manager.start.remote()

    def launch(self, batch: Batch) -> ScoringJob:
        inputs = reward_inputs(batch)
        if not any(t.rollout_id for t in batch.trajectories):
            return ScoringJob(self.reward_manager.compute.remote(inputs))
        # Agent rollouts: the function scores each rollout's last row, unless its agent returned the reward.
        rollouts = RolloutScoring.of(batch.trajectories)
        rows = rollouts.rows_to_score
        return ScoringJob(self.reward_manager.compute.remote([inputs[i] for i in rows]) if rows else None, rollouts)

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
    reward: RewardConfig, validation: bool, reward_model: ModelLink | None = None, timeout: float | None = None
) -> Scorers:
    """One reward-manager actor for training and, with ``validation``, one for validation, both loaded.

    Waits until their reward processes have loaded the function, so that kwargs
    that do not fit it fail now rather than at the first step. ``reward_model``
    is how both reach a judge or score model, when one is configured. ``timeout``
    (trainer.start_timeout_s) bounds the wait: an actor the cluster cannot place
    would otherwise wait forever.
    """
    spec = reward_spec(reward.reward_function, reward.reward_model.model_path)
    cls = ray.remote(manager_class(spec, reward.reward_type))

    def scorer() -> Scorer:
        actor = cls.options(num_cpus=reward.num_cpus).remote(
            spec,
            reward.reward_function_kwargs,
            num_cpus=reward.num_cpus,
            timeout=reward.timeout,
            on_timeout=reward.on_timeout,
            memory_limit_mb=reward.memory_limit_mb,
            reward_model=reward_model,
        )
        return Scorer(actor, spec)

    scorers = Scorers(train=scorer(), val=scorer() if validation else None)
    started = [(s, s.start()) for s in (scorers.train, scorers.val) if s is not None]
    for s, ref in started:
        try:
            s.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources().get("CPU", 0)
            raise RewardFunctionError(
                f"the reward actors for {spec} did not start within trainer.start_timeout_s={timeout:g} s: each asks "
                f"for worker.reward.num_cpus={reward.num_cpus} CPU(s) and the cluster has {free:g} free; lower "
                "worker.reward.num_cpus, or give the cluster more CPUs"
            ) from None
    return scorers
