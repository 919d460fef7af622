"""Asynchronous training's rollouts (``worker.rollout.async_rl``): groups admitted ahead of the trainer under
a staleness bound, scored as they finish, consumed in data order.

The unit is the GRPO prompt group. Each step:

1. The step's prompts join the waiting queue, each with its group id (so its seed) fixed on arrival.
2. Admission (``StalenessManager``, AReaL's rule): as many waiting groups as the bound allows start, by the
   engines at the current version. Their rewards are launched as they come in, on a pool of reward actors
   (``worker.reward.num_workers``, by default eta + 1), each taking one job at a time: jobs on different actors
   overlap, and groups that come in while every actor is busy go together in the next job. A step's groups
   beyond the ones it trains are carried over. More prompts are drawn when the queue is short.
3. Consumption: the oldest admitted groups, in admission order (which is data order), never in the order
   they finish; a group waits for its rows and rewards if they are not in. At consumption each group is
   checked: its oldest generated token may be at most ``max_head_offpolicyness`` versions behind the weights
   that train it (admission alone does not guarantee it, AReaL #602). A stale group is dropped, requeued or
   accepted and counted (``stale_policy``).

Colocated, the engine and the actor share each worker and take turns: admitted groups are generated in the
calls the synchronous sampler makes (``data.mini_rollout_batch_size`` prompts), each scored in one job when it
ends, and what overlaps the trainer is that scoring (and, on a pool of reward actors, the jobs overlap one
another). With ``max_head_offpolicyness = 0`` a step admits exactly its own prompts, in the synchronous step's
calls, and trains them at the version that sampled them: the synchronous run.

Disaggregated, each admitted group is one call to the rollout servers, all in flight at once while the
trainer trains; a watcher thread collects each as it finishes and scores it, so rewards overlap the update
too. A weight push lands in the middle of responses (``partial_rollout``), so a group may straddle versions.

DAPO's online filtering: at consumption a group that would train waits for its rewards, and one whose mean
``algorithm.filter_key`` is outside the bounds gives its slot back (``StalenessManager.filter_out``), so the
loop admits another in its place and the step still trains ``rollout_batch_size`` groups under the bound.
``trainer.max_try_make_batch`` bounds the groups a step may look at (that many steps' worth).

ReMax: each group's greedy response is sampled with the group, by the same engines at the same version
(colocated, in the same call; disaggregated, queued on the servers right behind the group), and scored with it.

A checkpoint holds the manager's counters and the groups drawn but not yet trained (their rows and group
ids), never the generated work: a resumed run generates them again, so each prompt trains once (AReaL #1388).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch

from vlmrl import algos
from vlmrl.config import Config, ConsumeOrder
from vlmrl.driver.metrics import reduce_reward_metrics
from vlmrl.driver.advantage import AdvantageStage
from vlmrl.driver.sampler import (
    Rollout, Sampler, baseline_scores, filter_scores, filtering_error, greedy_sampling, rows_to_train,
)  # fmt: skip
from vlmrl.driver.scoring import Rewards, Scorer, ScoringJob
from vlmrl.driver.staleness import StaleAction, StalenessManager
from vlmrl.records import Batch, PromptSample
from vlmrl.rollout.engine import Sampling
from vlmrl.workers.rollout_pool import PendingCall


@dataclass
class _Call:
    """Groups generated, or scored, together: their rows once in (disaggregated: ``pending`` on the rollout
    servers until then), and the reward job scoring them (None until it is launched)."""

    groups: list[_Group]
    batch: Batch | None = None
    job: ScoringJob | None = None
    rewards: Rewards | None = None
    pending: PendingCall | None = None


@dataclass
class _Baseline:
    """ReMax: the greedy responses to some groups' prompts, sampled when (and where) the groups were, and their
    rewards. Disaggregated, ``pending`` on the rollout servers until collected."""

    batch: Batch | None = None
    job: ScoringJob | None = None
    pending: PendingCall | None = None
    score: dict[int, float] | None = None
    """The greedy response's reward by group id, once collected."""
    rewards: Rewards | None = None


@dataclass
class _Group:
    group_id: int
    prompt: PromptSample
    call: _Call | None = None
    admitted_at: int = 0
    """The policy version when it was admitted (and generated)."""
    baseline: _Baseline | None = None
    seq: int = 0
    """Its place in the admission order (a step's rows are in this order, whichever group finished first)."""


class AsyncRolloutSampler(Sampler):
    """The step's groups under a staleness bound; ``sample`` has the synchronous sampler's signature."""

    def __init__(
        self,
        config: Config,
        workers,
        scorer: Scorer,
        sampling: Sampling,
        new_group_ids: Callable[[int], list[int]],
        prompt_by_row: Callable[[int], PromptSample],
        advantages: AdvantageStage | None = None,
        rows_per_update: int = 1,
        variable_rows: bool = False,
    ):
        """``variable_rows``, ``advantages`` and ``rows_per_update``: as ``RolloutSampler``'s. A kind whose rows
        vary (an external agent, a workflow class) has the step's groups scored, given advantages and trimmed to
        whole mini-batches when the step takes them, before the log-prob passes."""
        a = config.worker.rollout.async_rl
        self.groups_per_step = config.data.rollout_batch_size
        self.manager = StalenessManager(
            self.groups_per_step,
            a.max_concurrent_rollouts or (a.max_head_offpolicyness + 1) * self.groups_per_step,
            a.max_head_offpolicyness,
            a.stale_policy,
        )
        self.workers, self.scorer, self.sampling = workers, scorer, sampling
        self.variable_rows, self.advantage_stage, self.rows_per_update = variable_rows, advantages, rows_per_update
        self.pool = getattr(workers, "rollout_pool", None)
        """Disaggregated: the rollout servers, generating while the trainer trains; None: the workers' engines."""
        self.generating: list[_Call] = []
        """Disaggregated: calls submitted to the servers and not yet collected, in submission order."""
        self.new_group_ids, self.prompt_by_row = new_group_ids, prompt_by_row
        self.prompts_per_call = config.data.mini_rollout_batch_size or config.data.rollout_batch_size
        self.waiting: deque[_Group] = deque()
        """Drawn, not admitted: in data order (requeued groups go first)."""
        self.admitted: deque[_Group] = deque()
        """Admitted and not yet consumed, in admission order."""
        self.counts = {"generate_s": 0.0, "batch_wait_s": 0.0}
        self.reward_wait_s = 0.0
        self.algo, self.max_tries = config.algorithm, config.trainer.max_try_make_batch
        self.filtering = bool(config.algorithm.online_filtering)
        """DAPO's dynamic sampling: a group whose mean filter_key score is outside the bounds is not trained, and
        another is admitted in its place (``_sample``)."""
        self.greedy = None
        """ReMax: the baseline's sampling; each group's greedy response is sampled with the group."""
        if algos.ADVANTAGE_ESTIMATORS[config.algorithm.adv_estimator].needs_greedy_baseline:
            self.greedy = greedy_sampling(sampling)
        self._timeouts = 0
        self.finished_first = a.consume_order is ConsumeOrder.finished and self.pool is not None
        """consume_order=finished on rollout servers: a step takes the admitted groups that finished first."""
        self._admissions = itertools.count()
        self._lock = threading.RLock()
        """Guards the calls and the manager: the watcher (disaggregated) collects finished calls beside the step."""
        self._watch_error: BaseException | None = None
        self.unscored: list[_Call] = []
        """Generated, their rewards not launched yet: every reward actor (one call at a time) was busy."""
        self._closed = threading.Event()
        if self.pool is not None:
            # A call the servers finish while the trainer trains is collected and its rewards launched at once,
            # not at the next ``sample``: the scoring overlaps the update too.
            threading.Thread(target=self._watch, name="vlmrl-async-watch", daemon=True).start()

    # ------------------------------------------------------------------ the step

    def sample(self, prompts: list[PromptSample], more_prompts: Callable[[], list[PromptSample]]) -> Rollout:
        """The step's ``groups_per_step`` groups, in admission order, scored; drawing more prompts as needed."""
        with self._lock:
            return self._sample(prompts, more_prompts)

    def _sample(self, prompts: list[PromptSample], more_prompts: Callable[[], list[PromptSample]]) -> Rollout:
        self._raise_watch_error()
        self._enqueue(prompts)
        self.counts = {"generate_s": 0.0, "batch_wait_s": 0.0}
        version = self.manager.version
        taken: list[_Group] = []
        lags: list[int] = []
        stale = {action: 0 for action in StaleAction}
        filtered = 0
        self._timeouts = 0
        self._poll()
        while len(taken) < self.groups_per_step:
            self._admit(more_prompts)
            if not self.admitted:
                raise RuntimeError(f"async sampler: nothing admitted and nothing to train ({self.manager.stats()})")
            group = self._next_group()
            rows = self._rows(group)
            versions = rows.policy_versions.flatten().tolist()
            # Online filtering, on the groups that would train: one outside the bounds gives its slot back, and
            # the next round of the loop admits another, so the step still gets its groups under the bound.
            if self.filtering and self.manager.would_train(versions, version) and not self._passes_filter(group):
                self.manager.filter_out()
                filtered += 1
                seen = len(taken) + filtered
                if 0 < self.max_tries and seen >= self.max_tries * self.groups_per_step:
                    tries = math.ceil(seen / self.groups_per_step)
                    raise filtering_error(self.algo, tries, len(taken), self.groups_per_step)
                continue
            decision = self.manager.check(versions, version)
            if decision.stale:
                stale[decision.action] += 1
            if decision.action is StaleAction.train:
                taken.append(group)
                lags.append(decision.lag)
            elif decision.action is StaleAction.requeue:
                # First in the queue; a new group id gives its rows new sample ids and a new seed, for the
                # newer weights.
                self.waiting.appendleft(_Group(self.new_group_ids(1)[0], group.prompt))
        order = sorted(range(len(taken)), key=lambda i: taken[i].seq)  # admission order, however they finished
        taken, lags = [taken[i] for i in order], [lags[i] for i in order]
        batch = Batch.concat([self._rows(g) for g in taken])
        self._poll()
        self._score(force=True)  # groups in and not yet scored are scored while the trainer trains
        generated = batch.policy_versions[batch.policy_versions >= 0]
        stats = self.manager.stats()
        metrics = {
            **{f"async/{k}": float(v) for k, v in stats.items()},
            "async/lag/mean": float(sum(lags) / len(lags)),
            "async/lag/max": float(max(lags)),
            "async/token_lag/mean": float((version - generated).float().mean()) if generated.numel() else 0.0,
            "async/stale_dropped": float(stale[StaleAction.drop]),
            "async/stale_requeued": float(stale[StaleAction.requeue]),
            "async/stale_accepted": float(stale[StaleAction.train]),
            "async/partial_rollout_share": _straddling_share(batch),
            "async/carried_over": float(len(self.admitted)),
            "async/carried_over_age": float(max((version - g.admitted_at for g in self.admitted), default=0)),
            # Groups admitted and not trained: still generating (in flight) or generated and waiting (in queue).
            "async/lag/in_flight_max": float(max((version - g.admitted_at for g in self.admitted
                                                  if g.call.batch is None), default=0)),
            "async/lag/in_queue_max": float(max((version - g.admitted_at for g in self.admitted
                                                 if g.call.batch is not None), default=0)),
            "timing_s/async/generate": self.counts["generate_s"],
            "timing_s/async/batch_wait": self.counts["batch_wait_s"],
        }  # fmt: skip
        if self.filtering:
            seen = len(taken) + filtered
            metrics["filter/tries"] = float(math.ceil(seen / self.groups_per_step))
            metrics["filter/kept_group_ratio"] = len(taken) / seen
        on_policy = bool(generated.numel()) and bool((generated == version).all())
        if self.variable_rows:
            # As the synchronous sampler does for such kinds: the rewards now, the advantages over the groups
            # taken, and the rows trimmed to whole mini-batches before the passes. The counts are those of the
            # rollouts this step generated (its own groups or later ones).
            counts = self.workers.take_rollout_counts()
            rollout = rows_to_train(
                batch, self._rewards(taken), self.advantage_stage, self.rows_per_update, self.workers.world_size,
                {**counts, **metrics},
            )  # fmt: skip
            return dataclasses.replace(rollout, on_policy=on_policy, version=version)
        # The rewards are collected when the step asks for them, after its log-prob passes, as the synchronous
        # sampler's are: with eta = 0 the schedule is the synchronous one, overlap included.
        return Rollout(batch, lambda: self._rewards(taken), metrics=metrics, on_policy=on_policy, version=version)

    def weights_synced(self) -> None:
        """The engines hold the weights of one more update."""
        with self._lock:
            self.manager.set_version(self.manager.version + 1)

    def step_metrics(self, step_s: float) -> dict[str, float]:
        """The step's idle shares, once it is over (``step_s``: its seconds).

        * ``async/trainer_idle_share``: the trainer waited for a batch (on the rollout servers) or for
          rewards, doing nothing.
        * ``async/rollout_idle_share``: the engines did not step. Colocated, they idle whenever the workers
          are not generating; disaggregated, the servers' own count of their engine steps.
        """
        if step_s <= 0:
            return {}
        waited = self.counts["batch_wait_s"] + self.reward_wait_s
        if self.pool is None:
            rollout_idle = 1.0 - self.counts["generate_s"] / step_s
        else:
            rollout_idle = self.pool.idle_share()
        return {
            "async/trainer_idle_share": min(1.0, waited / step_s),
            "async/rollout_idle_share": max(0.0, rollout_idle),
        }

    def close(self) -> None:
        """Stop the watcher (disaggregated); the servers are the worker group's to shut down."""
        self._closed.set()

    # ------------------------------------------------------------------ admission and scoring

    def _enqueue(self, prompts: list[PromptSample]) -> None:
        ids = self.new_group_ids(len(prompts))
        self.waiting.extend(_Group(g, p) for g, p in zip(ids, prompts, strict=True))
        self.manager.enqueue(len(prompts))

    def _admit(self, more_prompts: Callable[[], list[PromptSample]]) -> None:
        """Start as many waiting groups as the bound allows, generate them, and launch their rewards."""
        want = self.manager.capacity()
        while len(self.waiting) < want:  # the queue is short: draw the next prompts
            self._enqueue(more_prompts())
        starting = [self.waiting.popleft() for _ in range(want)]
        for g in starting:
            self.manager.start()
            g.admitted_at, g.seq = self.manager.version, next(self._admissions)
            self.admitted.append(g)
        if self.pool is None:
            # In calls of data.mini_rollout_batch_size prompts, as the synchronous sampler makes them, so eta = 0
            # gives the engines the synchronous run's batches.
            for i in range(0, len(starting), self.prompts_per_call):
                self._generate_here(starting[i : i + self.prompts_per_call])
        else:  # a call per group, all in flight on the servers at once; each is scored as it comes in (``_poll``)
            for g in starting:
                g.call = _Call([g], pending=self.pool.submit([g.prompt], [g.group_id], self.sampling))
                self.generating.append(g.call)
                if self.greedy is not None:  # ReMax: the greedy response queued right behind the group's
                    g.baseline = _Baseline(pending=self.pool.submit([g.prompt], [g.group_id], self.greedy))
        self._poll()

    def _next_group(self) -> _Group:
        """The next admitted group the step takes: the oldest, or (``finished_first``) the oldest of those the
        servers have finished, waiting for whichever finishes first when none has."""
        if not self.finished_first:
            return self.admitted.popleft()
        while True:
            self._poll()
            for group in self.admitted:
                if group.call.batch is not None:
                    self.admitted.remove(group)
                    return group
            refs = [r for g in self.admitted if g.call.pending is not None for r in g.call.pending.refs]
            t0 = time.perf_counter()
            ray.wait(refs, num_returns=1, timeout=1.0)  # the trainer idles until one finishes
            self.counts["batch_wait_s"] += time.perf_counter() - t0

    def _generate_here(self, part: list[_Group]) -> None:
        """Colocated: generate ``part`` on the workers' engines in one call and score its groups in one job.

        The trainer waits for the call either way (it shares the workers), and a reward actor takes one job
        at a time: a job per group as each finished would make a reward that waits on I/O (a judge, a sandbox)
        wait group after group on an actor, where one job waits for its slowest group once. The job goes to a
        free actor of the pool, so it overlaps the jobs of earlier calls still scoring. With
        ``max_head_offpolicyness = 0`` this is the synchronous step's schedule.
        """
        t0 = time.perf_counter()
        batch = self.workers.generate([g.prompt for g in part], [g.group_id for g in part], self.sampling)
        self.counts["generate_s"] += time.perf_counter() - t0
        call = _Call(part, batch)
        for g in part:
            g.call = call
        if self.greedy is not None:  # ReMax: the baseline now, with the weights that sampled the groups
            greedy = self.workers.generate([g.prompt for g in part], [g.group_id for g in part], self.greedy)
            baseline = _Baseline(greedy, self.scorer.launch(greedy))
            for g in part:
                g.baseline = baseline
        self._finished(call)
        self._score(force=True)

    def _finished(self, call: _Call) -> None:
        """A call's groups are generated and kept: they wait for the trainer, and for their rewards."""
        for _ in call.groups:
            self.manager.finish()
        self.unscored.append(call)

    def _score(self, force: bool = False) -> None:
        """Launch the rewards of the groups in and not yet scored, in one job, if some reward actor is free (or
        ``force``: then on the least loaded one); their groups then point at the merged call."""
        with self._lock:
            if not self.unscored:
                return
            if not (force or self.scorer.idle()):
                return
            calls, self.unscored = self.unscored, []
            batch = calls[0].batch if len(calls) == 1 else Batch.concat([c.batch for c in calls])
            merged = _Call([g for c in calls for g in c.groups], batch, self.scorer.launch(batch))
            for g in merged.groups:
                g.call = merged

    def _poll(self, until: _Call | None = None) -> None:
        """Disaggregated: collect the calls the servers have finished and launch their rewards; with ``until``,
        wait for that call first."""
        with self._lock:
            for call in list(self.generating):
                if call is until or self.pool.done(call.pending):
                    t0 = time.perf_counter()
                    call.batch = self.pool.collect(call.pending)
                    if until is not None and call is until:  # the step waits on the servers: the trainer idles
                        self.counts["batch_wait_s"] += time.perf_counter() - t0
                    call.pending = None
                    self.generating.remove(call)
                    self._finished(call)
            self._score()

    def _watch(self) -> None:
        """Disaggregated, on a thread: collect each call as the servers finish it and score it when a reward
        actor is free, so rewards run while the trainer trains. An error (a server died) is kept for the step."""
        while not self._closed.is_set():
            with self._lock:
                refs = [r for call in self.generating for r in call.pending.refs]
            try:
                if refs:
                    ray.wait(refs, num_returns=1, timeout=0.2)
                else:
                    self._closed.wait(0.05)
                self._poll()
            except BaseException as e:  # noqa: BLE001 - handed to the step, which raises it
                self._watch_error = e
                return

    def _raise_watch_error(self) -> None:
        if self._watch_error is not None:
            raise self._watch_error

    def _rows(self, group: _Group) -> Batch:
        """The group's rows (waiting for its generation if it is not in yet), without rewards."""
        if group.call.batch is None:
            self._poll(until=group.call)
        call = group.call  # it may have been merged with others for scoring meanwhile
        return call.batch.select(_rows_of(call, group))

    def _group_rewards(self, group: _Group) -> tuple[Rewards, torch.Tensor]:
        """The rewards of the group's call (launching its scoring if it is not yet, waiting for it) and the
        group's rows in them. A call's rewards are collected once, for all of its groups."""
        if group.call.job is None:  # in, but not scored yet: score it now
            self._score(force=True)
        call = group.call  # it may have been merged with others for scoring meanwhile
        if call.rewards is None:
            call.rewards = self.scorer.collect(call.job, call.batch)
            self._timeouts += call.rewards.metrics.get("reward/timeouts", 0)
        return call.rewards, _rows_of(call, group)

    def _passes_filter(self, group: _Group) -> bool:
        """Online filtering: whether the group's mean ``filter_key`` score is inside the bounds (waits for its
        rewards)."""
        rewards, rows = self._group_rewards(group)
        scores = filter_scores(self.algo, rewards.per_sample)
        values = torch.tensor([scores[i] for i in rows.tolist()], dtype=torch.float64)
        same_group = torch.zeros(len(values), dtype=torch.long)
        return bool(algos.online_filter_keep(values, same_group, self.algo.filter_low, self.algo.filter_high).all())

    def _baseline(self, group: _Group) -> tuple[float, dict[str, float]]:
        """ReMax: the reward of the group's greedy response, and its sub-scores (waits for them)."""
        b = group.baseline
        if b.score is None:
            if b.batch is None:  # disaggregated: the greedy response is still on the servers
                with self._lock:
                    b.batch, b.pending = self.pool.collect(b.pending), None
                b.job = self.scorer.launch(b.batch)
            b.score, b.rewards = baseline_scores(self.scorer, b.job, b.batch)
            self._timeouts += b.rewards.metrics.get("reward_baseline/timeouts", 0)
        row = b.batch.group_ids.tolist().index(group.group_id)
        return b.score[group.group_id], {k: v[row] for k, v in b.rewards.per_sample.items()}

    def _rewards(self, taken: list[_Group]) -> Rewards:
        """The step's rewards, in its rows' order, waiting for the calls still being scored; their means (as a
        synchronous step reports), the timeouts of the calls collected in this step, and the seconds waited.
        ReMax: each row's greedy baseline."""
        start = time.perf_counter()
        scores, per_sample, baselines, baseline_scores_ = [], {}, [], {}
        for group in taken:
            rewards, rows = self._group_rewards(group)
            scores.append(rewards.token_level_scores.index_select(0, rows))
            for name, values in rewards.per_sample.items():
                per_sample.setdefault(name, []).extend(values[i] for i in rows.tolist())
            if self.greedy is not None:
                score, sub_scores = self._baseline(group)
                baselines.append(torch.full((len(rows),), score))
                for name, value in sub_scores.items():
                    baseline_scores_.setdefault(name, []).append(value)
        self.reward_wait_s = time.perf_counter() - start
        metrics = {
            **reduce_reward_metrics(per_sample, prefix="reward"),
            **reduce_reward_metrics(baseline_scores_, prefix="reward_baseline"),
            "reward/timeouts": self._timeouts,
            "timing_s/async/reward_wait": self.reward_wait_s,
        }
        return Rewards(torch.cat(scores), per_sample, metrics, torch.cat(baselines) if baselines else None)

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        """The counters and the groups drawn but not trained (row, group id), waiting ones after admitted ones."""
        with self._lock:
            return self._state()

    def _state(self) -> dict:
        pending = [*self.admitted, *self.waiting]
        return {
            "staleness": self.manager.state_dict(),
            "pending": [(g.prompt.index, g.group_id) for g in pending],
        }

    def load_state(self, state: dict) -> None:
        """Restore a checkpoint: the groups it had drawn and not trained wait again, to be generated anew."""
        if not state:
            return
        self.manager.load_state_dict(state["staleness"])
        self.waiting = deque(_Group(int(g), self.prompt_by_row(int(row))) for row, g in state["pending"])
        self.admitted = deque()
        self.manager.enqueue(len(self.waiting))


def _rows_of(call: _Call, group: _Group) -> torch.Tensor:
    """The rows of ``group`` in its call's batch."""
    return (call.batch.group_ids == group.group_id).nonzero().flatten()


def _straddling_share(batch: Batch) -> float:
    """The share of samples whose generated tokens come from more than one policy version (a weight load
    landed while they were generated)."""
    versions = batch.policy_versions
    generated = versions >= 0
    newest = versions.max(dim=1).values
    oldest = versions.masked_fill(~generated, torch.iinfo(versions.dtype).max).min(dim=1).values
    return float((generated.any(dim=1) & (newest > oldest)).float().mean())
