"""Learning-rate schedules with EasyR1's keys: linear warm-up, then constant or cosine decay.

``optim.lr_warmup_steps`` (or ``lr_warmup_ratio`` x the run's training steps)
steps climb linearly from 0 to ``optim.lr``; after them the rate stays at
``lr`` (``constant``) or follows a half cosine from ``lr`` towards
``min_lr_ratio`` x ``lr`` (``cosine``). These are the formulas of EasyR1's
and verl's ``get_constant_schedule_with_warmup`` and
``get_cosine_schedule_with_warmup`` (verl/utils/torch_functional.py), so the
same config gives the same rates.

Update k of a run of T training steps (k = 0 .. T-1) runs at the schedule's
value at k, as EasyR1's and verl's ``LambdaLR``, which is stepped after each
update. The cosine reaches its floor at k = T, one past the last update: the
last update runs a step above it, at
``m + (1 - m) x (1 + cos(pi (T-1-w) / (T-w))) / 2`` of ``lr`` (w warm-up steps,
m = ``min_lr_ratio``). With T = 2, no warm-up and m = 0.1, the two updates run
at ``lr`` and 0.55 x ``lr``; the longer the run, the closer the last update
comes to the floor.

The schedule advances once per training step that updates the model (as
EasyR1 steps its scheduler once per ``update_actor``/``update_critic`` call),
whatever the number of optimizer steps inside it. A schedule is a pure
function of that count, so its whole state is one integer, which the
checkpoint keeps (``ScheduleState``); a resumed run continues at the rate the
uninterrupted run would have used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmrl.config.options import LRSchedulerType

__all__ = ["STATE_FILE", "LRSchedule", "ScheduleState", "set_lr"]

STATE_FILE = "lr_scheduler.json"


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of each scheduler step of a run."""

    peak_lr: float
    """``optim.lr``."""
    kind: LRSchedulerType
    warmup_steps: int
    training_steps: int
    """The run's training steps (trainer.total_epochs x steps per epoch, at most trainer.max_steps)."""
    min_lr_ratio: float = 0.0
    """Cosine: the floor as a share of ``peak_lr``, reached one step past the last update (null reads as 0)."""

    @classmethod
    def from_optim(cls, optim, training_steps: int) -> LRSchedule:
        """EasyR1's rule: ``lr_warmup_steps`` when set, else ``int(lr_warmup_ratio x training_steps)``."""
        if optim.lr_warmup_steps is not None:
            warmup = optim.lr_warmup_steps
        else:
            warmup = int(optim.lr_warmup_ratio * training_steps)
        return cls(
            peak_lr=optim.lr,
            kind=optim.lr_scheduler_type,
            warmup_steps=warmup,
            training_steps=training_steps,
            min_lr_ratio=optim.min_lr_ratio or 0.0,
        )

    def factor(self, step: int) -> float:
        """The share of ``peak_lr`` at scheduler step ``step`` (0 for the first update).

        Warm-up (step < w): step / max(1, w), so the first update runs at 0 as in EasyR1.
        Cosine after it: progress p = (step - w) / max(1, T - w), and
        factor = max(m, m + (1 - m) x (1 + cos(pi p)) / 2), which is 1 at p = 0 and m at p = 1, that is at
        step T, one past the last update (step T - 1).
        """
        w = self.warmup_steps
        if step < w:
            return step / max(1, w)
        if self.kind is LRSchedulerType.constant:
            return 1.0
        m = self.min_lr_ratio
        progress = (step - w) / max(1, self.training_steps - w)
        # EasyR1 writes it as cos(pi x p) x (1 - m) / 2 + (1 + m) / 2; the same number.
        return max(m, math.cos(math.pi * progress) * (1 - m) * 0.5 + (1 + m) * 0.5)

    def lr(self, step: int) -> float:
        return self.peak_lr * self.factor(step)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` steps at ``lr`` (vlmrl builds one group per model)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass
class ScheduleState:
    """How many scheduler steps a model has taken: the whole state of its schedule."""

    steps: int = 0

    def save(self, directory: Path) -> None:
        (directory / STATE_FILE).write_text(json.dumps({"steps": self.steps}) + "\n")

    @classmethod
    def load(cls, directory: Path) -> ScheduleState | None:
        """The saved state, or None for a checkpoint written before schedules were saved."""
        file = directory / STATE_FILE
        if not file.is_file():
            return None
        return cls(steps=int(json.loads(file.read_text())["steps"]))
