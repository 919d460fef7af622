"""Where a run's numbers and samples go: one registry of loggers keyed by ``trainer.logger``.

The Tracker fans every call out to the loggers the config names: per-step
scalars (``log``), validation samples with their images (``log_samples``),
and, for a resumed run, what each logger needs to continue its run
(``state()`` now, ``Tracker(..., resume_state=...)`` later).

Adding a logger is one class with the ``Logger`` methods (loggers/base.py),
one ``vlmrl.config.LoggerName`` member (the config's option enum) and one
``LOGGERS`` entry, plus its package in ``PACKAGES`` if it needs one that may
be missing; ``vlmrl.validate`` checks those packages before a run starts.
"""

from __future__ import annotations

from typing import Any

from vlmrl.config import LoggerName
from vlmrl.loggers.base import Logger, RunInfo, ValidationSample
from vlmrl.loggers.console import ConsoleLogger
from vlmrl.loggers.jsonl import FileLogger
from vlmrl.loggers.mlflow_logger import MlflowLogger
from vlmrl.loggers.swanlab_logger import SwanlabLogger
from vlmrl.loggers.tensorboard_logger import TensorBoardLogger
from vlmrl.loggers.wandb_logger import WandbLogger

__all__ = ["LOGGERS", "PACKAGES", "RunInfo", "Tracker", "ValidationSample"]


LOGGERS: dict[LoggerName, type] = {
    LoggerName.console: ConsoleLogger,
    LoggerName.file: FileLogger,
    LoggerName.mlflow: MlflowLogger,
    LoggerName.tensorboard: TensorBoardLogger,
    LoggerName.wandb: WandbLogger,
    LoggerName.swanlab: SwanlabLogger,
}

PACKAGES: dict[LoggerName, str] = {
    LoggerName.mlflow: "mlflow",
    LoggerName.tensorboard: "tensorboard",
    LoggerName.wandb: "wandb",
    LoggerName.swanlab: "swanlab",
}
"""The package each logger imports, checked when the config is validated."""


class Tracker:
    """The loggers of one run.

    ``resume_state`` is an earlier tracker's ``state()``: loggers that keep a
    run elsewhere (MLflow, W&B, SwanLab) continue that run instead of starting one.
    """

    def __init__(self, names: list[LoggerName], run: RunInfo, resume_state: dict[str, Any] | None = None):
        resume_state = resume_state or {}
        self.loggers: dict[LoggerName, Logger] = {}
        try:
            for name in names:
                self.loggers[name] = LOGGERS[name](run, resume_state.get(name.value))
        except BaseException:
            self.close(failed=True)
            raise

    def start_clock(self) -> None:
        """Training starts now: the console's run summary counts its time from here."""
        console = self.loggers.get(LoggerName.console)
        if console is not None:
            console.start_clock()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers.values():
            logger.log(metrics, step)

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        for logger in self.loggers.values():
            logger.log_samples(samples, step)

    def state(self) -> dict[str, Any]:
        """``{logger name: its state}`` for the loggers that have one; JSON-serialisable."""
        return {name.value: s for name, logger in self.loggers.items() if (s := logger.state())}

    def close(self, failed: bool = False) -> None:
        for logger in self.loggers.values():
            logger.close(failed=failed)
        self.loggers = {}
