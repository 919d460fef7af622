"""A finished run's directory as it stood after an earlier step, to resume from without rerunning up to it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def resume_point(run_dir: Path, copy_dir: Path, step: int) -> Path:
    """Copy ``run_dir`` to ``copy_dir`` without the checkpoints after ``step`` and the metrics logged after it.

    Started again with the same command (``trainer.output_dir`` pointing at the copy's parent), the run
    resumes from ``global_step_<step>``, as one killed after saving that step would. Returns ``copy_dir``.
    """
    later = {p.name for p in (run_dir / "checkpoints").glob("global_step_*") if int(p.name.rsplit("_", 1)[1]) > step}
    if f"global_step_{step}" not in {p.name for p in (run_dir / "checkpoints").iterdir()}:
        raise FileNotFoundError(f"{run_dir} has no checkpoint of step {step}")
    shutil.copytree(run_dir, copy_dir, ignore=lambda _, names: [n for n in names if n in later])
    metrics = copy_dir / "metrics.jsonl"
    if metrics.exists():
        kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step]
        metrics.write_text("".join(line + "\n" for line in kept))
    return copy_dir
