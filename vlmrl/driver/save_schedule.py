"""When a step saves a checkpoint: every ``trainer.save_freq`` steps, every ``trainer.save_every_minutes`` of
training, and at the last step.

The time-based save is the default's safety net: a run whose YAML sets no ``save_freq`` still loses at most that
many minutes to a SIGKILL, an out-of-memory kill or a lost node, instead of the whole run. The clock starts when
training starts (a resumed run's clock starts at its resume) and restarts at every save, whatever caused it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SaveSchedule:
    def __init__(
        self,
        total_steps: int,
        save_freq: int,
        save_every_minutes: float | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total_steps = total_steps
        self.save_freq = save_freq
        self.interval_s = None if save_every_minutes is None else save_every_minutes * 60.0
        self.clock = clock
        self.last_save = clock()

    def due(self, step: int) -> bool:
        """Whether ``step``, just trained, should be saved (a stop request saves regardless)."""
        if step == self.total_steps or (self.save_freq > 0 and step % self.save_freq == 0):
            return True
        return self.interval_s is not None and self.clock() - self.last_save >= self.interval_s

    def saved(self) -> None:
        """A checkpoint was just written: the time-based interval counts from now."""
        self.last_save = self.clock()
