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
from vlmrl.driver.metrics import reduce_reward_metrics


def place_scores(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """(B, R) with each sample's scalar reward on its last response token and 0 elsewhere."""
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = response_mask.sum(dim=1).clamp(min=1) - 1  # (B,)
    token_level[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return token_level


def reward_inputs(batch: Batch) -> list[dict]:
    """EasyR1's reward_input per sample (response, response_length, ground_truth) plus vlmrl's additions.

    The row's extra columns come first, so a column named like one of the keys
    here (``prompt``, say) does not replace it. The images are the PIL images the
    policy saw; the n samples of a prompt share one list, which pickling sends once.
    """
    extras = batch.extra_fields or [{}] * len(batch)
    images = batch.images or [[]] * len(batch)
    return [
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


class Scorer:
    """One reward-manager actor, seen from the driver."""

    def __init__(self, reward_manager: ray.actor.ActorHandle, spec: str):
        self.reward_manager, self.spec = reward_manager, spec

    def start(self) -> ray.ObjectRef:
        return self.reward_manager.start.remote()

    def launch(self, batch: Batch) -> ray.ObjectRef:
        return self.reward_manager.compute.remote(reward_inputs(batch))

    def collect(self, job: ray.ObjectRef, batch: Batch, prefix: str = "reward") -> dict[str, float]:
        """Fill the batch's token-level scores and per-sample sub-scores; return their means and the timeouts."""
        result: RewardResult = self.get(job)
        batch.token_level_scores = place_scores(result.overall, batch.response_mask)
        batch.reward_metrics = {"overall": result.overall, **result.sub_scores}
        return {
            **reduce_reward_metrics(batch.reward_metrics, prefix=prefix),
            f"{prefix}/timeouts": len(result.timeouts),
        }

    def get(self, ref: ray.ObjectRef):
        """``ray.get`` with the manager's failures as RewardFunctionErrors that say what happened."""
        try:
            return ray.get(ref)
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


def start_scorers(reward: RewardConfig, validation: bool) -> Scorers:
    """One reward-manager actor for training and, with ``validation``, one for validation, both loaded.

    Waits until their reward processes have loaded the function, so that kwargs
    that do not fit it fail now rather than at the first step.
    """
    cls = ray.remote(manager_class(reward.reward_function, reward.reward_type))

    def scorer() -> Scorer:
        actor = cls.options(num_cpus=reward.num_cpus).remote(
            reward.reward_function,
            reward.reward_function_kwargs,
            num_cpus=reward.num_cpus,
            timeout=reward.timeout,
            on_timeout=reward.on_timeout,
        )
        return Scorer(actor, reward.reward_function)

    scorers = Scorers(train=scorer(), val=scorer() if validation else None)
    started = [(s, s.start()) for s in (scorers.train, scorers.val) if s is not None]
    for s, ref in started:
        s.get(ref)
    return scorers
