"""``file``: JSON lines, one per logged step, in <experiment dir>/metrics.jsonl.

A resumed run appends to the same file. The steps between its checkpoint and
the end of the earlier attempt are trained (and logged) again, so the earlier
attempt's lines of those steps are dropped first: the file holds each step
once, and a plot of it is right. (Validation samples go to
<experiment dir>/generations/step_<k>.jsonl, written by the Validator.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vlmrl.loggers.base import RunInfo, ValidationSample


class FileLogger:
    def __init__(self, run: RunInfo, resume: dict[str, Any] | None = None):
        self.path = Path(run.experiment_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if run.resumed_step is not None:
            drop_steps_after(self.path, run.resumed_step)
        self.file = self.path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def close(self, failed: bool = False) -> None:
        self.file.close()


def drop_steps_after(path: Path, step: int) -> int:
    """Rewrite ``path`` without the lines of steps past ``step``; return how many were dropped.

    A line that is not a JSON object with a step (a line cut short by a kill) is dropped too.
    The new file replaces the old one with one rename, so a crash here leaves one or the other.
    """
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            logged = json.loads(line)
            keep = isinstance(logged, dict) and int(logged["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        print(f"metrics: dropped {dropped} line(s) of {path} past step {step}, the step this run resumes from", flush=True)
    return dropped
