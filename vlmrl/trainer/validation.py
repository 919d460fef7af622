"""Validation: generate on the validation set, score, report per source and sub-score, and log samples."""

from __future__ import annotations

import json
from pathlib import Path

from vlmrl.protocol import Batch
from vlmrl.trainer.metrics import reduce_reward_metrics
from vlmrl.trainer.scoring import Scorer
from vlmrl.workers.rollout import SamplingOverrides
from vlmrl.workers.worker_group import WorkerGroup


class Validator:
    def __init__(
        self,
        workers: WorkerGroup,
        scorer: Scorer,
        loader,
        sampling: SamplingOverrides,
        experiment_dir: str,
        generations_to_log: int,
    ):
        self.workers, self.scorer, self.loader, self.sampling = workers, scorer, loader, sampling
        self.experiment_dir = Path(experiment_dir)
        self.generations_to_log = generations_to_log

    def run(self, step: int) -> dict[str, float]:
        parts = []
        for prompts in self.loader:
            # Group ids only matter for advantages, which validation does not compute.
            batch = self.workers.generate(prompts, list(range(len(prompts))), self.sampling)
            self.scorer.collect(self.scorer.launch(batch), batch)
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
        """The first generations_to_log samples, with token ids and vLLM's log-probs, as JSON lines."""
        count = min(self.generations_to_log, len(batch))
        if count == 0:
            return
        path = self.experiment_dir / "generations" / f"step_{step}.jsonl"
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
