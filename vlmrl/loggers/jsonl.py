"""``file``: JSON lines, one per logged step, in <experiment dir>/metrics.jsonl.

A resumed run appends to the same file. (Validation samples go to
<experiment dir>/generations/step_<k>.jsonl, written by the Validator.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmrl.loggers.base import RunInfo, ValidationSample


class FileLogger:
    def __init__(self, run: RunInfo, resume: dict[str, Any] | None = None):
        self.path = Path(run.experiment_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
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
