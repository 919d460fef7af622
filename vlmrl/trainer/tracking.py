"""Where per-step metrics go: one registry of loggers keyed by ``trainer.logger``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from vlmrl.config import LoggerName


class MetricLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class ConsoleLogger:
    """A compact line per step with the metrics people watch."""

    KEYS = ("reward/overall", "val/reward/overall", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
            "response_length/mean", "rollout/log_prob_diff_mean", "timing_s/step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in self.KEYS if k in metrics)
        print(f"step {step}: {shown}", flush=True)

    def close(self) -> None:
        pass


class FileLogger:
    """JSON lines, one per step, in <experiment dir>/metrics.jsonl."""

    def __init__(self, experiment_dir: str):
        self.path = Path(experiment_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


LOGGERS = {
    LoggerName.console: lambda experiment_dir: ConsoleLogger(),
    LoggerName.file: FileLogger,
}


class Tracker:
    def __init__(self, names: list[LoggerName], experiment_dir: str):
        self.loggers = [LOGGERS[name](experiment_dir) for name in names]

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
