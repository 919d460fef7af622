"""``single_turn``: one response per sample, n samples of a prompt in one engine request.

The request of a prompt is seeded by its group id (``group_seed``), so a
step's samples depend neither on what the engine sampled before nor on how the
prompts were split over workers.
"""

from __future__ import annotations

import time

from vlmrl.config import Config
from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.engine import Engine, Sampling
from vlmrl.rollout.engine.sampling import media_offsets, seeded_requests
from vlmrl.rollout.kind import RolloutKind, RolloutStats


class SingleTurn(RolloutKind):
    name = "single_turn"

    def __init__(self, engine: Engine, pad_ids: tuple[int, ...]):
        self.engine, self.pad_ids = engine, pad_ids

    @classmethod
    def build(cls, config: Config, plan, engine: Engine, processor, pad_ids: tuple[int, ...]) -> SingleTurn:
        return cls(engine, pad_ids)

    def rollout(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], RolloutStats]:
        t0 = time.perf_counter()
        requests = seeded_requests(prompts, group_ids, sampling, self.engine.seed)
        t1 = time.perf_counter()
        outputs = self.engine.generate(requests)
        t2 = time.perf_counter()
        trajectories = []
        for prompt, group_id, output in zip(prompts, group_ids, outputs, strict=True):
            offsets = media_offsets(prompt.input_ids, self.pad_ids)
            for i, sample in enumerate(output.samples):
                trajectories.append(
                    Trajectory.single_turn(
                        prompt, group_id, i, sample.token_ids, sample.text, sampling.temperature,
                        sample.log_probs, output.version, offsets,
                    )
                )  # fmt: skip
        seconds = dict(self.engine.last_timings)
        seconds["requests"] = seconds.get("requests", 0.0) + t1 - t0
        seconds["trajectories"] = time.perf_counter() - t2
        return trajectories, RolloutStats(seconds=seconds)
