"""Running ``python -m vlmrl.main`` on the tiny quickstart from a test, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A step of the quickstart cut down to seconds: 2 prompts x 2 samples x 8 tokens, no validation.
SMALL = [
    "data.rollout_batch_size=2",
    "data.max_response_length=8",
    "worker.actor.global_batch_size=2",
    "worker.actor.micro_batch_size_per_device_for_update=4",
    "worker.rollout.n=2",
    "data.val_files=",
    "trainer.val_before_train=false",
]


def main_command(output_dir: Path, *overrides: str, experiment: str = "run") -> list[str]:
    return [
        sys.executable, "-m", "vlmrl.main", "config=examples/quickstart.yaml",
        f"trainer.output_dir={output_dir}", f"trainer.experiment_name={experiment}", *overrides,
    ]  # fmt: skip


def run_main(output_dir: Path, *overrides: str, experiment: str = "run", env: dict | None = None, timeout: int = 600):
    """Run to completion; return the CompletedProcess (the caller checks returncode)."""
    return subprocess.run(
        main_command(output_dir, *overrides, experiment=experiment),
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def experiment_dir(output_dir: Path, experiment: str = "run") -> Path:
    return output_dir / "vlmrl" / experiment


def read_metrics(output_dir: Path, experiment: str = "run") -> list[dict]:
    path = experiment_dir(output_dir, experiment) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
