"""The driver's side of rewards: turn a batch into reward inputs, ask a reward
manager actor for scores, and put them back on the batch.

Scoring is split into ``launch`` and ``collect`` so the trainer can run the
log-prob passes while the user's function works.
"""

from __future__ import annotations

import ray
import torch

from vlmrl.protocol import Batch
from vlmrl.trainer.metrics import reduce_reward_metrics


def place_scores(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """(B, R) with each sample's scalar reward on its last response token and 0 elsewhere."""
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = response_mask.sum(dim=1).clamp(min=1) - 1  # (B,)
    token_level[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return token_level


def reward_inputs(batch: Batch) -> list[dict]:
    """EasyR1's reward_input per sample (response, response_length, ground_truth) plus vlmrl's additions."""
    return [
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


class Scorer:
    def __init__(self, reward_manager):
        self.reward_manager = reward_manager

    def launch(self, batch: Batch) -> ray.ObjectRef:
        return self.reward_manager.compute.remote(reward_inputs(batch))

    def collect(self, job: ray.ObjectRef, batch: Batch, prefix: str = "reward") -> dict[str, float]:
        """Fill the batch's token-level scores and per-sample sub-scores; return their means."""
        scores, sub_scores = ray.get(job)
        batch.token_level_scores = place_scores(scores, batch.response_mask)
        batch.reward_metrics = {"overall": scores, **sub_scores}
        return reduce_reward_metrics(batch.reward_metrics, prefix=prefix)
