"""A step's rollouts and their rewards: plain sampling, DAPO's dynamic sampling,
and ReMax's greedy baseline.

Without online filtering the rewards are launched and collected later, so the
user's function runs while the workers compute log-probs. With it, each round's
rewards are needed at once to decide which prompt groups to keep, and rounds
continue on fresh prompts until the batch is full (DAPO, Yu et al. 2025, sec. 3.2).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vlmrl.config import Config
from vlmrl.records import Batch, PromptSample
from vlmrl import algos
from vlmrl.driver.advantage import AdvantageStage, Advantages
from vlmrl.driver.metrics import reduce_reward_metrics
from vlmrl.driver.scoring import Rewards, Scorer
from vlmrl.rollout.engine import Sampling


class OnlineFilteringError(RuntimeError):
    """Online filtering could not fill a batch within ``trainer.max_try_make_batch`` rounds."""


@dataclass
class Rollout:
    batch: Batch
    collect: Callable[[], Rewards]
    """Wait for the rewards still running; return the batch's rewards (and ReMax baselines) and their metrics."""
    advantages: Advantages | None = None
    """Agent rollouts: the advantages, computed per rollout before the passes so that rows could be trimmed to
    whole mini-batches first; None: the step computes them after the passes."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The agents' counts (rollouts by status, calls, rows) and the rows trimmed; asynchronous training's
    staleness counters."""
    on_policy: bool = True
    """Every token was sampled by the weights that train it (asynchronous training can hand over older ones,
    whose old log-probs then need their own pass)."""
    version: int | None = None
    """Asynchronous training: the policy version of the weights that train the batch (``rollout/*_current``
    metrics compare the engine's log-probs with the trainer's on the samples that version generated)."""


class NoAgentRowsError(RuntimeError):
    """No rollout of the step left a row to train on."""


class Sampler(ABC):
    """Where a step's batch comes from: the synchronous ``RolloutSampler`` or the asynchronous
    ``vlmrl.driver.async_sampler.AsyncRolloutSampler``. The loop calls these and nothing else."""

    @abstractmethod
    def sample(self, prompts: list[PromptSample], more_prompts: Callable[[], list[PromptSample]]) -> Rollout:
        """The step's batch from ``prompts`` (and, where the sampler needs more, from ``more_prompts()``)."""

    def weights_synced(self) -> None:
        """The engines hold new weights (asynchronous training counts versions)."""

    def step_metrics(self, step_s: float) -> dict[str, float]:
        """Metrics known once the step is over (asynchronous training's idle shares)."""
        return {}

    def close(self) -> None:
        """Stop what runs beside the step."""

    def state(self) -> dict:
        """What a checkpoint keeps of the sampler (synchronous: nothing, every step's prompts are its own)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore ``state``."""


class RolloutSampler(Sampler):
    def __init__(
        self,
        config: Config,
        workers,
        scorer: Scorer,
        sampling: Sampling,
        new_group_ids: Callable[[int], list[int]],
        advantages: AdvantageStage | None = None,
        rows_per_update: int = 1,
        variable_rows: bool = False,
    ):
        """``variable_rows``: the rollout kind's (``RolloutKind.variable_rows``): a prompt may give other than n
        rows. ``advantages`` and ``rows_per_update`` (the rows of one global mini-batch) serve such kinds, whose
        advantages come before the passes and whose rows are trimmed to whole mini-batches."""
        self.algo, self.workers, self.scorer, self.sampling = config.algorithm, workers, scorer, sampling
        self.variable_rows = variable_rows
        self.advantage_stage, self.rows_per_update = advantages, rows_per_update
        self.new_group_ids = new_group_ids
        self.batch_prompts = config.data.rollout_batch_size
        self.prompts_per_call = config.data.mini_rollout_batch_size or config.data.rollout_batch_size
        """data.mini_rollout_batch_size (EasyR1's / verl's generation batch): prompts per generation call."""
        self.max_tries = config.trainer.max_try_make_batch
        self.needs_baseline = algos.ADVANTAGE_ESTIMATORS[self.algo.adv_estimator].needs_greedy_baseline
        self.greedy = greedy_sampling(sampling)

    def sample(self, prompts: list[PromptSample], more_prompts: Callable[[], list[PromptSample]]) -> Rollout:
        """The step's batch from ``prompts`` (and, with online filtering, from ``more_prompts()`` as needed)."""
        prompt_of: dict[int, PromptSample] = {}
        if self.variable_rows:
            return self._varying_rows(prompts, prompt_of)
        if self.algo.online_filtering:
            batch, filtered = self._filtered(prompts, more_prompts, prompt_of)
            reward_job = None
        else:
            batch = self._generate(prompts, prompt_of)
            reward_job = self.scorer.launch(batch)
        baseline = self._launch_baseline(batch, prompt_of) if self.needs_baseline else None

        def collect() -> Rewards:
            rewards = filtered if reward_job is None else self.scorer.collect(reward_job, batch)
            if baseline is not None:
                baselines, metrics = self._collect_baseline(batch, *baseline)
                rewards = dataclasses.replace(rewards, baselines=baselines, metrics={**rewards.metrics, **metrics})
            return rewards

        return Rollout(batch, collect)

    def _generate(self, prompts: list[PromptSample], prompt_of: dict[int, PromptSample]) -> Batch:
        group_ids = self.new_group_ids(len(prompts))
        prompt_of.update(zip(group_ids, prompts))
        # keep: the workers hold these rows for the step's passes (dropped groups are released with the rest).
        # In calls of data.mini_rollout_batch_size prompts: the engines hold one call's requests at a time.
        size = self.prompts_per_call
        parts = [
            self.workers.generate(prompts[i : i + size], group_ids[i : i + size], self.sampling, keep=True)
            for i in range(0, len(prompts), size)
        ]
        return parts[0] if len(parts) == 1 else Batch.concat(parts)

    def _varying_rows(self, prompts: list[PromptSample], prompt_of: dict[int, PromptSample]) -> Rollout:
        """Rollouts whose rows vary (an agent's calls, a workflow's dropped samples): scored and given advantages
        per rollout, then trimmed to whole mini-batches.

        A rollout makes any number of rows, so the step's row count is not a multiple of the mini-batch. Rows
        are dropped until it is (or, with fewer rows than one mini-batch, until the workers get equal shares),
        rows of groups whose advantage is 0 first (``algos.trim_to_mini_batches``). The advantages are computed
        before the trim, over every rollout that finished, and kept: a trimmed row does not move its group's
        baseline.
        """
        batch = self._generate(prompts, prompt_of)
        metrics = self.workers.take_rollout_counts()
        rewards = self.scorer.collect(self.scorer.launch(batch), batch)
        return rows_to_train(batch, rewards, self.advantage_stage, self.rows_per_update, self.workers.world_size, metrics)

    def _filtered(self, prompts, more_prompts, prompt_of) -> tuple[Batch, Rewards]:
        algo = self.algo
        kept: list[Batch] = []
        kept_groups = seen_groups = timeouts = 0
        scores: dict[str, list[float]] = defaultdict(list)
        tries = 0
        while True:
            tries += 1
            batch = self._generate(prompts, prompt_of)
            rewards = self.scorer.collect(self.scorer.launch(batch), batch)
            rewards.assign_to(batch)  # this round's batch is the sampler's own until it is returned
            timeouts += rewards.metrics["reward/timeouts"]
            for name, values in batch.reward_metrics.items():
                scores[name].extend(values)
            values = torch.tensor(filter_scores(algo, batch.reward_metrics), dtype=torch.float64)
            keep = algos.online_filter_keep(values, batch.group_ids, algo.filter_low, algo.filter_high)
            seen_groups += len(prompts)
            if keep.any():
                kept.append(batch.select(keep.nonzero().flatten()))
                kept_groups += int(batch.group_ids[keep].unique().numel())
            if kept_groups >= self.batch_prompts:
                break
            if 0 < self.max_tries <= tries:
                raise filtering_error(algo, tries, kept_groups, self.batch_prompts)
            prompts = more_prompts()
        batch = Batch.concat(kept)
        # Kept groups are whole (n samples each, contiguous), so the first batch_prompts x n rows are whole groups.
        batch = batch.select(list(range(self.batch_prompts * self.sampling.n)))
        metrics = {
            **reduce_reward_metrics(scores, prefix="reward"),
            "reward/timeouts": timeouts,
            "filter/tries": tries,
            "filter/kept_group_ratio": kept_groups / seen_groups,
        }
        return batch, Rewards(batch.token_level_scores, batch.reward_metrics, metrics)

    def _launch_baseline(self, batch: Batch, prompt_of: dict[int, PromptSample]):
        """ReMax: one greedy response per prompt of the batch, its reward launched."""
        group_ids = list(dict.fromkeys(batch.group_ids.tolist()))  # unique, in batch order
        greedy = self.workers.generate([prompt_of[g] for g in group_ids], group_ids, self.greedy)
        return greedy, self.scorer.launch(greedy)

    def _collect_baseline(self, batch: Batch, greedy: Batch, job) -> tuple[torch.Tensor, dict[str, float]]:
        """ReMax: each sample's greedy-baseline reward (B,), and the baseline's reward metrics."""
        greedy_score, rewards = baseline_scores(self.scorer, job, greedy)
        return torch.tensor([greedy_score[g] for g in batch.group_ids.tolist()]), rewards.metrics


def rows_to_train(
    batch: Batch, rewards: Rewards, stage: AdvantageStage, rows_per_update: int, world: int, metrics: dict[str, float]
) -> Rollout:
    """Rows that vary (an agent's calls, a workflow's dropped samples), scored: their advantages over every
    rollout that finished, then the rows trimmed to whole mini-batches (``RolloutSampler._varying_rows``; the
    asynchronous sampler does the same with the groups it takes). ``metrics``: the rollouts' counts, to which the
    trim's are added."""
    rewards.assign_to(batch)
    advantages = stage(batch)
    advantages.assign_to(batch)
    unit = rows_per_update if len(batch) >= rows_per_update else world
    kept, dropped = algos.trim_to_mini_batches(batch.advantages, batch.response_mask, batch.group_ids.tolist(), unit)
    if not kept:
        raise NoAgentRowsError(
            f"the rollouts made {len(batch)} row(s), fewer than the {world} workers that train; their counts: "
            f"{ {k: int(v) for k, v in metrics.items()} }"
        )
    metrics["trace/trimmed_rows"] = float(dropped)
    metrics["trace/rows_trained"] = float(len(kept))
    batch = batch.select(kept)
    advantages = Advantages(batch.token_level_rewards, batch.advantages, batch.returns, advantages.metrics)
    rewards = dataclasses.replace(rewards, token_level_scores=batch.token_level_scores, per_sample=batch.reward_metrics)
    return Rollout(batch, lambda: rewards, advantages, metrics)


def greedy_sampling(sampling: Sampling) -> Sampling:
    """ReMax's baseline: one greedy response per prompt, with the step's limits."""
    return dataclasses.replace(sampling, n=1, temperature=0.0, want_log_probs=False, ignore_eos=False)


def baseline_scores(scorer: Scorer, job, greedy: Batch) -> tuple[dict[int, float], Rewards]:
    """ReMax: the greedy response's reward by group id, and the baseline's rewards (``reward_baseline/*``)."""
    rewards = scorer.collect(job, greedy, prefix="reward_baseline")
    return dict(zip(greedy.group_ids.tolist(), rewards.per_sample["overall"])), rewards


def filter_scores(algo, per_sample: dict[str, list[float]]) -> list[float]:
    """Online filtering: each sample's ``algorithm.filter_key`` score, or a KeyError naming what there is."""
    if algo.filter_key not in per_sample:
        raise KeyError(
            f"algorithm.filter_key={algo.filter_key!r} is not a score the reward function returns; "
            f"it returns: {', '.join(sorted(per_sample))}"
        )
    return per_sample[algo.filter_key]


def filtering_error(algo, tries: int, kept_groups: int, needed: int) -> OnlineFilteringError:
    return OnlineFilteringError(
        f"online filtering: after {tries} generation rounds only {kept_groups} of the "
        f"{needed} prompt groups a step needs had a mean {algo.filter_key} inside "
        f"({algo.filter_low}, {algo.filter_high}); the prompts are too easy or too hard for the policy. "
        "Raise trainer.max_try_make_batch (-1 for no limit), widen algorithm.filter_low/filter_high, "
        "or set algorithm.online_filtering=false"
    )
