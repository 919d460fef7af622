"""The driver loop: one ``fit`` that reads as the dataflow of a step."""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.protocol import Batch
from vlmrl.trainer import core_algos
from vlmrl.trainer.metrics import batch_metrics
from vlmrl.trainer.scoring import Scorer
from vlmrl.trainer.validation import Validator
from vlmrl.trainer.tracking import Tracker
from vlmrl.workers.rollout import SamplingOverrides
from vlmrl.workers.worker_group import WorkerGroup


@contextmanager
def timer(name: str, timings: dict[str, float]):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


class RayPPOTrainer:
    def __init__(self, config: Config, plan: Plan, train_loader, val_loader, reward_manager, workers: WorkerGroup, tracker: Tracker):
        self.config, self.plan = config, plan
        self.train_loader = train_loader
        self.scorer = Scorer(reward_manager)
        self.workers = workers
        self.tracker = tracker
        self.next_group_id = 0
        rollout = config.worker.rollout
        self.train_sampling = SamplingOverrides(
            n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k
        )
        self.validator = None
        if val_loader is not None:
            val_sampling = dataclasses.replace(
                self.train_sampling, **{"n": 1, "temperature": 0.0, **rollout.val_override_config}
            )
            self.validator = Validator(
                workers, self.scorer, val_loader, val_sampling, plan.experiment_dir, config.trainer.val_generations_to_log
            )
        steps_per_epoch = len(train_loader)
        total = steps_per_epoch * config.trainer.total_epochs
        self.total_steps = min(total, config.trainer.max_steps) if config.trainer.max_steps else total

    def _steps(self):
        """(step, prompts) over the epochs, stopping at total_steps."""
        step = 0
        for _epoch in range(self.config.trainer.total_epochs):
            for prompts in self.train_loader:
                step += 1
                yield step, prompts
                if step == self.total_steps:
                    return

    def fit(self) -> None:
        step = 0
        if self.config.trainer.val_before_train and self.validator is not None:
            self.tracker.log(self.validator.run(step), step)
        for step, prompts in self._steps():
            timings: dict[str, float] = {}
            with timer("step", timings):
                # 1. Rollout: n samples per prompt, images included.
                with timer("gen", timings):
                    batch = self.workers.generate(prompts, self._group_ids(len(prompts)), self.train_sampling)
                # 2. Rewards from the user's function, computed while the log-prob passes run.
                reward_job = self.scorer.launch(batch)
                # 3. Log-probs of the responses under the current and the reference policy.
                with timer("old", timings):
                    batch.old_log_probs, entropy = self.workers.compute_old_log_probs(batch)
                if self.plan.use_reference:
                    with timer("ref", timings):
                        batch.ref_log_probs = self.workers.compute_ref_log_probs(batch)
                with timer("reward", timings):  # only the wait that the passes did not hide
                    reward_metrics = self.scorer.collect(reward_job, batch)
                # 4. Advantages, grouped by prompt.
                with timer("adv", timings):
                    batch.advantages = self._advantages(batch)
                # 5. Policy update with the KL loss.
                with timer("update_actor", timings):
                    actor_metrics = self.workers.update_actor(batch)
                # 6. The rollout engine gets the new weights.
                with timer("update_weights", timings):
                    self.workers.sync_weights()
                val_metrics = {}
                if self._validation_due(step):
                    with timer("testing", timings):
                        val_metrics = self.validator.run(step)
            metrics = {
                **batch_metrics(batch, entropy),
                **reward_metrics,
                **actor_metrics,
                **val_metrics,
                **{f"timing_s/{k}": v for k, v in timings.items()},
            }
            self.tracker.log(metrics, step)
        if self.config.trainer.save_hf_weights:
            self.workers.save_hf(str(Path(self.plan.checkpoint_dir) / f"global_step_{step}" / "actor" / "huggingface"))
        self.tracker.close()

    def _group_ids(self, n_prompts: int) -> list[int]:
        ids = list(range(self.next_group_id, self.next_group_id + n_prompts))
        self.next_group_id += n_prompts
        return ids

    def _validation_due(self, step: int) -> bool:
        if self.validator is None:
            return False
        freq = self.config.trainer.val_freq
        return step == self.total_steps or (freq > 0 and step % freq == 0)

    def _advantages(self, batch: Batch) -> torch.Tensor:
        algo = self.config.algorithm
        estimator = core_algos.ADVANTAGE_ESTIMATORS[algo.adv_estimator]
        kwargs = {"norm_adv_by_std": algo.norm_adv_by_std_in_grpo} if algo.adv_estimator is core_algos.AdvantageEstimator.grpo else {}
        advantages, _returns = estimator(batch.token_level_scores, batch.response_mask, batch.group_ids, **kwargs)
        return advantages
