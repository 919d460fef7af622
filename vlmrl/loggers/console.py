"""``console``: one compact line per step with the numbers people watch, and a
summary of the run when it ends (validation scores at the first and last
validation, the steps and the wall time)."""

from __future__ import annotations

import time
from typing import Any

from vlmrl.loggers.base import RunInfo, ValidationSample

# (label, metric key, format); a metric the step lacks is left out of the line.
FIELDS = (
    ("reward", "reward/overall", ".3f"),
    ("val", "val/reward/overall", ".3f"),
    ("kl", "actor/reference_kl", ".2e"),
    ("pg_loss", "actor/pg_loss", ".3g"),
    ("entropy", "actor/entropy", ".3g"),
    ("len", "response_length/mean", ".1f"),
    ("calls/traj", "agent/tool_calls/mean", ".2f"),  # multi-turn: tool calls per trajectory
    ("parse_err", "agent/tool/parse_error_rate", ".0%"),  # of those calls, the share the parser could not read
    ("lp_diff", "rollout/log_prob_diff_mean", ".1e"),
    ("s/step", "perf/time_per_step", ".1f"),
    ("tok/s/dev", "perf/throughput", ".4g"),
    ("mfu", "perf/mfu", ".2%"),
)


def format_line(metrics: dict[str, float], step: int) -> str:
    """``step 3 | reward 0.412 | kl 1.20e-03 | ...``

    >>> format_line({"reward/overall": 0.5, "perf/mfu": 0.0123, "other": 1.0}, 3)
    'step 3 | reward 0.500 | mfu 1.23%'

    Multi-turn runs show their tool calls per trajectory and the share that did not parse:

    >>> format_line({"reward/overall": 0.0, "agent/tool_calls/mean": 1.0, "agent/tool/parse_error_rate": 1.0}, 4)
    'step 4 | reward 0.000 | calls/traj 1.00 | parse_err 100%'
    """
    parts = [f"step {step}"]
    parts += [f"{label} {metrics[key]:{fmt}}" for label, key, fmt in FIELDS if key in metrics]
    return " | ".join(parts)


VAL_PREFIX = "val/reward/"


def format_summary(first: dict[str, Any] | None, last: dict[str, Any] | None, steps: int, seconds: float) -> str:
    """The end-of-run summary: every validation score, first -> last.

    >>> print(format_summary({"step": 0, "scores": {"overall": 0.1, "accuracy": 0.0}},
    ...                      {"step": 8, "scores": {"overall": 0.9, "accuracy": 0.875}}, 8, 125.0))
    run summary: 8 steps in 2m05s
      val accuracy: 0.000 (step 0) -> 0.875 (step 8)
      val overall: 0.100 (step 0) -> 0.900 (step 8)
    """
    lines = [f"run summary: {steps} steps in {int(seconds // 60)}m{int(seconds % 60):02d}s"]
    if first is None or last is None:
        lines.append("  no validation ran (set data.val_files and trainer.val_freq or trainer.val_before_train)")
        return "\n".join(lines)
    for name in sorted(last["scores"]):
        start = first["scores"].get(name)
        start_text = f"{start:.3f} (step {first['step']})" if start is not None else "n/a"
        lines.append(f"  val {name}: {start_text} -> {last['scores'][name]:.3f} (step {last['step']})")
    return "\n".join(lines)


class ConsoleLogger:
    def __init__(self, run: RunInfo, resume: dict[str, Any] | None = None):
        resume = resume or {}
        # A resumed run reports from the start of the whole run, not of this process.
        self.first_val: dict[str, Any] | None = resume.get("first_val")
        self.last_val: dict[str, Any] | None = resume.get("last_val")
        self.last_step: int = resume.get("last_step", 0)
        self.earlier_seconds: float = resume.get("seconds", 0.0)
        self.started = time.monotonic()

    def start_clock(self) -> None:
        """Count this process's time from now: the loggers are built while the workers start, before training."""
        self.started = time.monotonic()

    def log(self, metrics: dict[str, float], step: int) -> None:
        print(format_line(metrics, step), flush=True)
        self.last_step = max(self.last_step, step)
        scores = {k.removeprefix(VAL_PREFIX): v for k, v in metrics.items() if k.startswith(VAL_PREFIX)}
        if scores:
            record = {"step": step, "scores": scores}
            if self.first_val is None:
                self.first_val = record
            self.last_val = record

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {
            "first_val": self.first_val,
            "last_val": self.last_val,
            "last_step": self.last_step,
            "seconds": self.earlier_seconds + time.monotonic() - self.started,
        }

    def close(self, failed: bool = False) -> None:
        if not failed:
            seconds = self.earlier_seconds + time.monotonic() - self.started
            print(format_summary(self.first_val, self.last_val, self.last_step, seconds), flush=True)
