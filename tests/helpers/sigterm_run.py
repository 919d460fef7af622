"""One quickstart run stopped by SIGTERM once its first step is logged, started through a launch script.

tests/test_resume.py (SIGTERM finishes the step, saves and exits zero) and
tests/faults/test_sigterm_through_launch_script.py (SIGTERM to a launch script's shell reaches the driver)
check the same kind of run; this one, shared through the ``sigterm_run`` session fixture
(tests/conftest.py), serves both. It is examples/qwen2_5_vl_3b_geo3k_grpo.sh, whose ``exec`` makes the
driver (``python -m vlmrl.main``) the shell's process, pointed at the tiny quickstart on the CPU with
tests/helpers/runs.py's SMALL step and the quickstart's own loggers (MLflow among them), and SIGTERM goes
to the shell's pid, as a scheduler sends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from helpers.runs import REPO, SMALL, experiment_dir

SCRIPT = REPO / "examples" / "qwen2_5_vl_3b_geo3k_grpo.sh"
MAX_STEPS = 200


@dataclass(frozen=True)
class SigtermRun:
    out: Path
    """trainer.output_dir; the experiment is ``run`` (helpers.runs.experiment_dir(out))."""
    returncode: int
    output: str
    """The run's stdout and stderr together."""


def wait_for_first_step(proc: subprocess.Popen, out: Path, log: Path, timeout: float = 300) -> None:
    """Until the run under ``out`` has logged its first step: a signal before then would stop a run that has
    nothing to save. Fails with the run's output if it ends first, or after ``timeout`` seconds."""
    metrics = experiment_dir(out) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, log.read_text()[-5000:]
        assert time.monotonic() < deadline, "no step finished in time"
        time.sleep(0.5)


def sigterm_run(quickstart_assets, tmp: Path) -> SigtermRun:
    out = tmp / "outputs"
    overrides = [
        "config=examples/quickstart.yaml",  # the last config= wins: the script's GPU settings are replaced
        f"data.train_files={quickstart_assets.train_file}", "data.val_files=",
        "worker.actor.micro_batch_size_per_device_for_update=4", "worker.actor.micro_batch_size_per_device_for_experience=16",
        "trainer.n_gpus_per_node=1", f"trainer.output_dir={out}", "trainer.experiment_name=run",
        f"trainer.max_steps={MAX_STEPS}", "trainer.logger=[console,file,mlflow]", *SMALL,
    ]  # fmt: skip
    env = {**os.environ, "PYTHON": str(REPO / ".venv" / "bin" / "python"), "MODEL_PATH": str(quickstart_assets.model_dir)}
    env.pop("MLFLOW_TRACKING_URI", None)  # the run's embedded store
    log = tmp / "log.txt"
    with log.open("w") as sink:  # a file, not a pipe: Ray's output would fill a pipe nobody reads yet
        proc = subprocess.Popen(["bash", str(SCRIPT), *overrides], env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_for_first_step(proc, out, log)
            os.kill(proc.pid, signal.SIGTERM)  # the shell's pid, as a scheduler sends it
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return SigtermRun(out, proc.returncode, log.read_text())
