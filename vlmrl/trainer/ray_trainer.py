"""The driver loop: one ``fit`` that reads as the dataflow of a step."""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import contextmanager
from pathlib import Path

import ray
import torch

from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.protocol import Batch
from vlmrl.trainer import core_algos
from vlmrl.trainer.metrics import batch_metrics, reduce_reward_metrics
from vlmrl.trainer.tracking import Tracker
from vlmrl.workers.rollout import SamplingOverrides
from vlmrl.workers.worker_group import WorkerGroup


@contextmanager
def timer(name: str, timings: dict[str, float]):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


def place_scores(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """(B, R) with each sample's scalar reward on its last response token and 0 elsewhere."""
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = response_mask.sum(dim=1).clamp(min=1) - 1  # (B,)
    token_level[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return token_level


class RayPPOTrainer:
    def __init__(self, config: Config, plan: Plan, train_loader, val_loader, reward_manager, workers: WorkerGroup, tracker: Tracker):
        self.config, self.plan = config, plan
        self.train_loader, self.val_loader = train_loader, val_loader
        self.reward_manager = reward_manager
        self.workers = workers
        self.tracker = tracker
        self.next_group_id = 0
        rollout = config.worker.rollout
        self.train_sampling = SamplingOverrides(
            n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k
        )
        self.val_sampling = dataclasses.replace(
            self.train_sampling, **{"n": 1, "temperature": 0.0, **rollout.val_override_config}
        )
        steps_per_epoch = len(train_loader)
        total = steps_per_epoch * config.trainer.total_epochs
        self.total_steps = min(total, config.trainer.max_steps) if config.trainer.max_steps else total

    def fit(self) -> None:
        trainer_cfg = self.config.trainer
        step = 0
        if trainer_cfg.val_before_train:
            self.tracker.log(self.validate(step), step)
        for _epoch in range(trainer_cfg.total_epochs):
            for prompts in self.train_loader:
                step += 1
                timings: dict[str, float] = {}
                with timer("step", timings):
                    # 1. Rollout: n samples per prompt, images included.
                    with timer("gen", timings):
                        batch = self.workers.generate(prompts, self._group_ids(len(prompts)), self.train_sampling)
                    # 2. Rewards from the user's function.
                    with timer("reward", timings):
                        reward_metrics = self._score(batch)
                    # 3. Log-probs of the responses under the current and the reference policy.
                    with timer("old", timings):
                        batch.old_log_probs, entropy = self.workers.compute_old_log_probs(batch)
                    if self.workers_have_ref:
                        with timer("ref", timings):
                            batch.ref_log_probs = self.workers.compute_ref_log_probs(batch)
                    # 4. Advantages, grouped by prompt.
                    with timer("adv", timings):
                        batch.advantages = self._advantages(batch)
                    # 5. Policy update with the KL loss.
                    with timer("update_actor", timings):
                        actor_metrics = self.workers.update_actor(batch)
                    # 6. The rollout engine gets the new weights.
                    with timer("update_weights", timings):
                        self.workers.sync_weights()
                    last = step == self.total_steps
                    val_metrics = {}
                    if self._validation_due(step, last):
                        with timer("testing", timings):
                            val_metrics = self.validate(step)
                metrics = {
                    **batch_metrics(batch, entropy),
                    **reward_metrics,
                    **actor_metrics,
                    **val_metrics,
                    **{f"timing_s/{k}": v for k, v in timings.items()},
                }
                self.tracker.log(metrics, step)
                if last:
                    break
            if step >= self.total_steps:
                break
        if trainer_cfg.save_hf_weights:
            self.workers.save_hf(str(Path(self.plan.checkpoint_dir) / f"global_step_{step}" / "actor" / "huggingface"))
        self.tracker.close()

    @property
    def workers_have_ref(self) -> bool:
        return self.config.algorithm.use_kl_loss and not self.config.algorithm.disable_kl

    def _group_ids(self, n_prompts: int) -> list[int]:
        ids = list(range(self.next_group_id, self.next_group_id + n_prompts))
        self.next_group_id += n_prompts
        return ids

    def _validation_due(self, step: int, last: bool) -> bool:
        if self.val_loader is None:
            return False
        freq = self.config.trainer.val_freq
        return last or (freq > 0 and step % freq == 0)

    def _score(self, batch: Batch) -> dict[str, float]:
        """Fill the batch's token-level scores; return the reward metrics."""
        inputs = [
            {
                "response": batch.response_texts[i],
                "response_length": int(batch.response_mask[i].sum()),
                "ground_truth": batch.ground_truths[i],
                "prompt": batch.prompt_texts[i],
                "data_source": batch.data_sources[i],
                "sample_id": i,
            }
            for i in range(len(batch))
        ]
        scores, sub_scores = ray.get(self.reward_manager.compute.remote(inputs))
        batch.token_level_scores = place_scores(scores, batch.response_mask)
        batch.reward_metrics = {"overall": scores, **sub_scores}
        return reduce_reward_metrics(batch.reward_metrics, prefix="reward")

    def _advantages(self, batch: Batch) -> torch.Tensor:
        algo = self.config.algorithm
        estimator = core_algos.ADVANTAGE_ESTIMATORS[algo.adv_estimator]
        kwargs = {"norm_adv_by_std": algo.norm_adv_by_std_in_grpo} if algo.adv_estimator is core_algos.AdvantageEstimator.grpo else {}
        advantages, _returns = estimator(batch.token_level_scores, batch.response_mask, batch.group_ids, **kwargs)
        return advantages

    def validate(self, step: int) -> dict[str, float]:
        parts = []
        for prompts in self.val_loader:
            batch = self.workers.generate(prompts, self._group_ids(len(prompts)), self.val_sampling)
            self._score(batch)
            parts.append(batch)
        batch = Batch.concat(parts)
        metrics = reduce_reward_metrics(batch.reward_metrics, prefix="val/reward")
        for source in sorted(set(batch.data_sources)):
            rows = [i for i, s in enumerate(batch.data_sources) if s == source]
            per_source = {k: [v[i] for i in rows] for k, v in batch.reward_metrics.items()}
            metrics.update(reduce_reward_metrics(per_source, prefix=f"val/{source}"))
        self._write_generations(batch, step)
        return metrics

    def _write_generations(self, batch: Batch, step: int) -> None:
        """The first val_generations_to_log samples, with token ids and vLLM's log-probs, as JSON lines."""
        count = min(self.config.trainer.val_generations_to_log, len(batch))
        if count == 0:
            return
        path = Path(self.plan.experiment_dir) / "generations" / f"step_{step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for i in range(count):
                length = int(batch.response_mask[i].sum())
                row = {
                    "step": step,
                    "row": batch.row_indices[i],
                    "prompt": batch.prompt_texts[i],
                    "response": batch.response_texts[i],
                    "ground_truth": batch.ground_truths[i],
                    "data_source": batch.data_sources[i],
                    "scores": {k: v[i] for k, v in batch.reward_metrics.items()},
                    "response_ids": batch.responses[i, :length].tolist(),
                    "rollout_log_probs": batch.rollout_log_probs[i, :length].tolist()
                    if batch.rollout_log_probs is not None
                    else None,
                }
                f.write(json.dumps(row) + "\n")
