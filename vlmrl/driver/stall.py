"""Failing a run that has stopped training: steps in a row whose every optimizer step was skipped.

An optimizer step is skipped when its gradient norm is not finite
(``train.update_loop``; counted as ``actor/skipped_steps`` and
``critic/skipped_steps``). One skipped step is a hiccup; a run of them means
every update is NaN (a broken loss input, a bf16 overflow) and the run would
go on to its end changing nothing, then exit 0. After
``trainer.max_consecutive_skipped_steps`` such steps it fails, naming them.
"""

from __future__ import annotations

import math


class RunStalled(RuntimeError):
    """Every update of several steps in a row was skipped for a non-finite gradient."""


def optimizer_steps(batch_rows: int, samples_per_update: int, world_size: int, epochs: int) -> int:
    """Optimizer steps one update of ``batch_rows`` rows makes: epochs x mini-batches of a worker's share."""
    per_worker = batch_rows // world_size
    return epochs * math.ceil(per_worker / samples_per_update) if per_worker and samples_per_update else 0


class SkippedStepWatch:
    def __init__(self, limit: int):
        self.limit = limit
        self.stalled: list[tuple[int, list[str]]] = []  # (step, roles whose every optimizer step was skipped)

    def observe(self, step: int, metrics: dict[str, float], steps_made: dict[str, int]) -> None:
        """Record one training step; raise RunStalled once ``limit`` steps in a row trained nothing."""
        roles = [
            role
            for role, made in steps_made.items()
            if made > 0 and metrics.get(f"{role}/skipped_steps", 0.0) >= made
        ]
        if not roles:
            self.stalled = []
            return
        self.stalled.append((step, roles))
        if self.limit < 1 or len(self.stalled) < self.limit:
            return
        first, last = self.stalled[0][0], self.stalled[-1][0]
        which = sorted({role for _, rs in self.stalled for role in rs})
        norms = ", ".join(f"{role}/grad_norm={metrics.get(f'{role}/grad_norm', float('nan')):g}" for role in which)
        raise RunStalled(
            f"steps {first}-{last}: every {' and '.join(which)} optimizer step was skipped for a non-finite gradient "
            f"({norms} at step {last}), {len(self.stalled)} steps in a row (trainer.max_consecutive_skipped_steps="
            f"{self.limit}); the run is not training. Look for NaN or inf in what the loss reads: rewards, "
            "log-probs (a sampling temperature of 0), a learning rate or clip bound; or lower the learning rate. "
            "trainer.max_consecutive_skipped_steps=-1 goes on regardless."
        )
