"""``console``: one compact line per step with the numbers people watch."""

from __future__ import annotations

from typing import Any

from vlmrl.trainer.loggers.base import RunInfo, ValidationSample

# (label, metric key, format); a metric the step lacks is left out of the line.
FIELDS = (
    ("reward", "reward/overall", ".3f"),
    ("val", "val/reward/overall", ".3f"),
    ("kl", "actor/reference_kl", ".2e"),
    ("pg_loss", "actor/pg_loss", ".3g"),
    ("entropy", "actor/entropy", ".3g"),
    ("len", "response_length/mean", ".1f"),
    ("lp_diff", "rollout/log_prob_diff_mean", ".1e"),
    ("s/step", "perf/time_per_step", ".1f"),
    ("tok/s/dev", "perf/throughput", ".4g"),
    ("mfu", "perf/mfu", ".2%"),
)


def format_line(metrics: dict[str, float], step: int) -> str:
    """``step 3 | reward 0.412 | kl 1.20e-03 | ...``

    >>> format_line({"reward/overall": 0.5, "perf/mfu": 0.0123, "other": 1.0}, 3)
    'step 3 | reward 0.500 | mfu 1.23%'
    """
    parts = [f"step {step}"]
    parts += [f"{label} {metrics[key]:{fmt}}" for label, key, fmt in FIELDS if key in metrics]
    return " | ".join(parts)


class ConsoleLogger:
    def __init__(self, run: RunInfo, resume: dict[str, Any] | None = None):
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        print(format_line(metrics, step), flush=True)

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def close(self, failed: bool = False) -> None:
        pass
