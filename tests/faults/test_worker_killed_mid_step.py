"""Fault: a training worker is killed with SIGKILL in the middle of a run (an OOM kill, a lost node).

The run must fail, not hang, and the same command must resume from the last
complete checkpoint and finish, with every step logged once after the resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from helpers.processes import process_of
from helpers.runs import REPO, SMALL, experiment_dir, joined, main_command, run_main, tail

STEPS = 4
ARGS = (*SMALL, f"trainer.max_steps={STEPS}", "trainer.save_freq=1", "trainer.logger=[console,file]")


@pytest.mark.e2e
def test_a_run_whose_worker_is_killed_fails_and_the_same_command_resumes(tiny_assets, tmp_path):
    log = tmp_path / "log.txt"
    checkpoint_1 = experiment_dir(tmp_path) / "checkpoints" / "global_step_1" / "COMPLETE"
    command, env = joined(main_command(tmp_path, *ARGS))
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 400
        while not checkpoint_1.is_file():
            assert proc.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        worker = process_of(proc.pid, "ray::HybridWorker", "ray::hybrid_worker")  # the run's training worker
        assert worker is not None, "the run's worker process was not found"
        os.kill(worker, signal.SIGKILL)  # mid-run: step 2 is under way
        proc.wait(timeout=300)  # fails, does not hang
    assert proc.returncode != 0, log.read_text()[-5000:]
    resumed = run_main(tmp_path, *ARGS)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout + resumed.stderr
    checkpoints = experiment_dir(tmp_path) / "checkpoints"
    assert (checkpoints / f"global_step_{STEPS}" / "COMPLETE").is_file()
    lines = (experiment_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()
    import json

    steps = [json.loads(line)["step"] for line in lines]
    assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1)), steps
